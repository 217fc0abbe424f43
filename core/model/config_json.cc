#include "core/model/config_json.h"

#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/base/absl_string_view.h"
#include "core/base/field_error.h"
#include "core/base/status_macros.h"
#include "core/checkpoint/atomic_file.h"
#include "nlohmann/json.hpp"

namespace dta {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// The value of `field`, or nullptr when it is absent or null.
const Json* Lookup(const Json& object, const char* field) {
  auto it = object.find(field);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

// Typed reads of one JSON object's fields; errors name the field as prefix + key (the prefix names
// a nested object, e.g. "rope_scaling.").
class Fields {
 public:
  explicit Fields(const Json& object, std::string prefix = "")
      : object_(object), prefix_(std::move(prefix)) {}

  const Json* Find(const char* key) const { return Lookup(object_, key); }
  std::string Name(const char* key) const { return prefix_ + key; }
  absl::Status Error(const char* key, std::string_view what) const {
    return FieldError(Name(key), what);
  }

  absl::Status Int(const char* key, bool required, int64_t* out) const {
    const Json* value = Find(key);
    if (value == nullptr) return required ? Error(key, "missing") : absl::OkStatus();
    if (value->is_number_unsigned()) {
      if (value->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Error(key, absl::StrCat(value->dump(), " is too large"));
      }
      *out = static_cast<int64_t>(value->get<uint64_t>());
    } else if (value->is_number_integer()) {
      *out = value->get<int64_t>();
    } else {
      return Error(key, absl::StrCat("must be an integer, not ", value->dump()));
    }
    return absl::OkStatus();
  }

  absl::Status Double(const char* key, bool required, double* out) const {
    const Json* value = Find(key);
    if (value == nullptr) return required ? Error(key, "missing") : absl::OkStatus();
    if (!value->is_number())
      return Error(key, absl::StrCat("must be a number, not ", value->dump()));
    *out = value->get<double>();
    return absl::OkStatus();
  }

  absl::Status OptionalDouble(const char* key, std::optional<double>* out) const {
    if (Find(key) == nullptr) return absl::OkStatus();
    double value = 0;
    RETURN_IF_ERROR(Double(key, false, &value));
    *out = value;
    return absl::OkStatus();
  }

  absl::Status Bool(const char* key, bool* out) const {
    const Json* value = Find(key);
    if (value == nullptr) return absl::OkStatus();
    if (!value->is_boolean())
      return Error(key, absl::StrCat("must be true or false, not ", value->dump()));
    *out = value->get<bool>();
    return absl::OkStatus();
  }

  absl::Status String(const char* key, std::string* out) const {
    const Json* value = Find(key);
    if (value == nullptr) return absl::OkStatus();
    if (!value->is_string())
      return Error(key, absl::StrCat("must be a string, not ", value->dump()));
    *out = value->get<std::string>();
    return absl::OkStatus();
  }

 private:
  const Json& object_;
  std::string prefix_;
};

// The rope object of config.json (rope_scaling; rope_parameters adds rope_theta), or null for the
// default rope.
Json RopeJson(const RopeScaling& rope) { return Json::parse(RopeScalingToJson(rope)); }

// The rope as transformers 5 reads it (PreTrainedConfig.convert_rope_params_to_dict and
// standardize_rope_params): rope_scaling when it is a non-empty object, else rope_parameters.
// `config` already holds the top-level fields (rope_theta, max_position_embeddings) and the
// family's default partial_rotary_factor.
absl::Status ParseRope(const Json& json, const ModelFamily& family, ModelConfig& config) {
  const Fields top(json);
  const char* field = nullptr;
  const Json* rope = nullptr;
  for (const char* name : {"rope_scaling", "rope_parameters"}) {
    const Json* value = Lookup(json, name);
    if (value == nullptr) continue;
    if (!value->is_object())
      return FieldError(name, absl::StrCat("must be an object or null, not ", value->dump()));
    if (value->empty()) continue;
    field = name;
    rope = value;
    break;
  }
  // partial_rotary_factor: top-level (moved into the rope object by transformers) or in it. The
  // rope object's wins: transformers setdefault()s the top-level value (else the family's
  // default) into it.
  for (const Json* object : {&json, rope}) {
    if (object == nullptr) continue;
    const Fields fields(*object, object == &json ? "" : absl::StrCat(field, "."));
    double partial = family.partial_rotary ? config.partial_rotary_factor : 1.0;
    RETURN_IF_ERROR(fields.Double("partial_rotary_factor", false, &partial));
    if (family.partial_rotary) {
      config.partial_rotary_factor = partial;
    } else if (partial != 1.0) {
      return UnsupportedFieldError(
          fields.Name("partial_rotary_factor"),
          absl::StrCat(partial, " is not supported (only 1: RoPE on whole heads)"));
    }
  }
  config.rope_scaling = RopeScaling();
  if (rope == nullptr) return absl::OkStatus();

  const Fields fields(*rope, absl::StrCat(field, "."));
  std::string type = "default";
  for (const char* key : {"type", "rope_type"}) RETURN_IF_ERROR(fields.String(key, &type));
  RETURN_IF_ERROR(fields.Double("rope_theta", false, &config.rope_theta));
  RopeScaling& scaling = config.rope_scaling;
  const std::optional<RopeType> known = RopeTypeFromName(type);
  if (known) scaling.type = *known;
  if (!known) {
    return UnsupportedFieldError(field,
                                 absl::StrCat("rope type '", type,
                                              "' is not supported (only default, linear, llama3, "
                                              "yarn)"));
  }
  if (RopeUsesOriginalContext(scaling.type)) {
    // transformers gives a top-level original_max_position_embeddings priority (Phi-3's), then
    // the rope object's, then max_position_embeddings.
    scaling.original_max_position_embeddings = config.max_position_embeddings;
    RETURN_IF_ERROR(fields.Int("original_max_position_embeddings", false,
                               &scaling.original_max_position_embeddings));
    RETURN_IF_ERROR(top.Int("original_max_position_embeddings", false,
                            &scaling.original_max_position_embeddings));
  }
  switch (scaling.type) {
    case RopeType::kDefault:
      break;
    case RopeType::kLinear:
      RETURN_IF_ERROR(fields.Double("factor", true, &scaling.factor));
      break;
    case RopeType::kLlama3:
      RETURN_IF_ERROR(fields.Double("factor", true, &scaling.factor));
      RETURN_IF_ERROR(fields.Double("low_freq_factor", true, &scaling.low_freq_factor));
      RETURN_IF_ERROR(fields.Double("high_freq_factor", true, &scaling.high_freq_factor));
      break;
    case RopeType::kYarn: {
      // An explicit null factor is the ratio of the context lengths; an absent one is missing.
      if (!rope->contains("factor")) return fields.Error("factor", "missing");
      if (fields.Find("factor") == nullptr) {
        if (scaling.original_max_position_embeddings <= 0) {
          return fields.Error("original_max_position_embeddings", "must be positive");
        }
        scaling.factor = static_cast<double>(config.max_position_embeddings) /
                         static_cast<double>(scaling.original_max_position_embeddings);
      } else {
        RETURN_IF_ERROR(fields.Double("factor", true, &scaling.factor));
      }
      RETURN_IF_ERROR(fields.OptionalDouble("attention_factor", &scaling.attention_factor));
      RETURN_IF_ERROR(fields.OptionalDouble("mscale", &scaling.mscale));
      RETURN_IF_ERROR(fields.OptionalDouble("mscale_all_dim", &scaling.mscale_all_dim));
      // transformers: `rope_parameters.get("beta_fast") or 32`, so 0 means the default too.
      RETURN_IF_ERROR(fields.Double("beta_fast", false, &scaling.beta_fast));
      RETURN_IF_ERROR(fields.Double("beta_slow", false, &scaling.beta_slow));
      if (scaling.beta_fast == 0) scaling.beta_fast = 32.0;
      if (scaling.beta_slow == 0) scaling.beta_slow = 1.0;
      RETURN_IF_ERROR(fields.Bool("truncate", &scaling.truncate));
      // transformers: `rope_parameters.get("truncate", True)`, so an explicit null is false.
      if (rope->contains("truncate") && (*rope)["truncate"].is_null()) scaling.truncate = false;
      break;
    }
  }
  return absl::OkStatus();
}

// Sliding-window attention: refused unless every layer is full attention.
absl::Status CheckNoSlidingWindow(const Json& json, int64_t layers) {
  const Fields top(json);
  bool sliding = false;
  RETURN_IF_ERROR(top.Bool("use_sliding_window", &sliding));
  if (sliding)
    return UnsupportedFieldError("use_sliding_window", "sliding-window attention is not supported");
  if (const Json* layer_types = Lookup(json, "layer_types"); layer_types != nullptr) {
    if (!layer_types->is_array()) return FieldError("layer_types", "must be an array");
    if (static_cast<int64_t>(layer_types->size()) != layers) {
      return FieldError("layer_types",
                        absl::StrCat(layer_types->size(), " entries for ", layers, " layers"));
    }
    for (size_t i = 0; i < layer_types->size(); ++i) {
      if ((*layer_types)[i] != "full_attention") {
        return UnsupportedFieldError("layer_types",
                                     absl::StrCat("layer ", i, " is ", (*layer_types)[i].dump(),
                                                  ": only 'full_attention' is supported"));
      }
    }
  }
  return absl::OkStatus();
}

constexpr std::pair<LayerType, const char*> kLayerTypes[] = {
    {LayerType::kFullAttention, "full_attention"},
    {LayerType::kLinearAttention, "linear_attention"},
};

// The layer types of a family with linear-attention layers (qwen3_next), as transformers'
// Qwen3NextConfig: config.json's layer_types, else every full_attention_interval-th layer full
// attention and the others linear.
absl::Status ParseLayerTypes(const Json& json, ModelConfig& config) {
  const int64_t layers = config.num_hidden_layers;
  config.layer_types.clear();
  const Json* layer_types = Lookup(json, "layer_types");
  if (layer_types == nullptr) {
    int64_t interval = 4;
    RETURN_IF_ERROR(Fields(json).Int("full_attention_interval", false, &interval));
    if (interval <= 0) {
      return FieldError("full_attention_interval", absl::StrCat(interval, " is not positive"));
    }
    for (int64_t i = 0; i < layers; ++i) {
      config.layer_types.push_back((i + 1) % interval != 0 ? LayerType::kLinearAttention
                                                           : LayerType::kFullAttention);
    }
    return absl::OkStatus();
  }
  if (!layer_types->is_array()) {
    return FieldError("layer_types", absl::StrCat("must be an array, not ", layer_types->dump()));
  }
  if (static_cast<int64_t>(layer_types->size()) != layers) {
    return FieldError("layer_types",
                      absl::StrCat(layer_types->size(), " entries for ", layers, " layers"));
  }
  for (size_t i = 0; i < layer_types->size(); ++i) {
    const Json& entry = (*layer_types)[i];
    if (!entry.is_string()) {
      return FieldError("layer_types",
                        absl::StrCat("layer ", i, " is ", entry.dump(), ", not a string"));
    }
    bool known = false;
    for (const auto& [type, name] : kLayerTypes) {
      if (entry == name) {
        config.layer_types.push_back(type);
        known = true;
      }
    }
    if (!known) {
      return UnsupportedFieldError(
          "layer_types", absl::StrCat("layer ", i, " is ", entry.dump(),
                                      ": only 'linear_attention' and 'full_attention' are "
                                      "supported"));
    }
  }
  return absl::OkStatus();
}

// The mixture-of-experts fields (config holds the family's transformers defaults).
absl::Status ParseMoe(const Json& json, const ModelFamily& family, ModelConfig& config) {
  const Fields top(json);
  // transformers 5 writes num_local_experts for qwen3_moe (Qwen3MoeConfig's attribute_map name for
  // num_experts: ModelFamily::num_local_experts_alias); the Hub's config.json files say
  // num_experts. Qwen3NextConfig has no such map and ignores num_local_experts, and so does dta.
  RETURN_IF_ERROR(top.Int("num_experts", false, &config.num_experts));
  if (family.num_local_experts_alias && top.Find("num_local_experts") != nullptr) {
    int64_t local_experts = 0;
    RETURN_IF_ERROR(top.Int("num_local_experts", true, &local_experts));
    if (top.Find("num_experts") != nullptr && local_experts != config.num_experts) {
      return FieldError(
          "num_local_experts",
          absl::StrCat(local_experts, " differs from num_experts = ", config.num_experts));
    }
    config.num_experts = local_experts;
  }
  RETURN_IF_ERROR(top.Int("num_experts_per_tok", false, &config.num_experts_per_tok));
  RETURN_IF_ERROR(top.Int("moe_intermediate_size", false, &config.moe_intermediate_size));
  RETURN_IF_ERROR(top.Double("router_aux_loss_coef", false, &config.router_aux_loss_coef));
  RETURN_IF_ERROR(top.Bool("output_router_logits", &config.output_router_logits));
  if (family.shared_expert) {
    RETURN_IF_ERROR(
        top.Int("shared_expert_intermediate_size", false, &config.shared_expert_intermediate_size));
  }
  // Which layers are sparse, and how they weigh their experts: fixed where every layer is sparse
  // (transformers' config has none of these fields and ignores them).
  config.mlp_only_layers.clear();
  if (family.every_layer_sparse) return absl::OkStatus();
  RETURN_IF_ERROR(top.Bool("norm_topk_prob", &config.norm_topk_prob));
  RETURN_IF_ERROR(top.Int("decoder_sparse_step", false, &config.decoder_sparse_step));
  if (const Json* layers = Lookup(json, "mlp_only_layers"); layers != nullptr) {
    if (!layers->is_array()) {
      return FieldError("mlp_only_layers",
                        absl::StrCat("must be an array of layer indices, not ", layers->dump()));
    }
    for (const Json& layer : *layers) {
      if (!layer.is_number_integer()) {
        return FieldError("mlp_only_layers",
                          absl::StrCat("must hold layer indices, not ", layer.dump()));
      }
      config.mlp_only_layers.push_back(layer.get<int64_t>());
    }
  }
  return absl::OkStatus();
}

// The family's transformers defaults for fields absent from config.json (which differ from the
// struct's defaults).
ModelConfig FamilyDefaults(const ModelFamily& family) {
  ModelConfig config;
  config.model_type = std::string(family.model_type);
  config.vocab_size = family.default_vocab_size;
  config.head_dim = family.default_head_dim;
  config.rope_theta = 10000.0;
  config.max_position_embeddings = family.default_max_position_embeddings;
  config.tie_word_embeddings = false;
  config.torch_dtype = "float32";
  config.partial_rotary_factor = family.default_partial_rotary_factor;
  if (family.moe) {
    const MoeDefaults& moe = family.moe_defaults;
    config.intermediate_size = moe.intermediate_size;
    config.num_experts = moe.num_experts;
    config.num_experts_per_tok = moe.num_experts_per_tok;
    config.moe_intermediate_size = moe.moe_intermediate_size;
    config.shared_expert_intermediate_size = moe.shared_expert_intermediate_size;
    config.norm_topk_prob = moe.norm_topk_prob;
    config.router_aux_loss_coef = moe.router_aux_loss_coef;
  }
  if (family.linear_attention) {
    const LinearAttentionDefaults& linear = family.linear_defaults;
    config.linear_num_key_heads = linear.num_key_heads;
    config.linear_num_value_heads = linear.num_value_heads;
    config.linear_key_head_dim = linear.key_head_dim;
    config.linear_value_head_dim = linear.value_head_dim;
    config.linear_conv_kernel_dim = linear.conv_kernel_dim;
  }
  return config;
}

// A vision-language model's config.json (model_type a family's multimodal_model_type) as its
// decoder's: its text_config, whose model_type must be the family's (or absent), with the
// wrapper's tie_word_embeddings where it has one: the wrapper's model (whose checkpoint it is)
// ties by that one.
absl::StatusOr<Json> DecoderConfigOf(const Json& json, const ModelFamily& family) {
  const Json* text = Lookup(json, "text_config");
  if (text == nullptr || !text->is_object()) {
    return FieldError("text_config",
                      absl::StrCat(text == nullptr ? "missing" : "must be an object", ": a '",
                                   AsAbsl(family.multimodal_model_type),
                                   "' config.json holds its language model's config there"));
  }
  Json decoder = *text;
  std::string model_type(family.model_type);
  RETURN_IF_ERROR(Fields(decoder, "text_config.").String("model_type", &model_type));
  if (model_type != family.model_type) {
    return UnsupportedFieldError("text_config.model_type",
                                 absl::StrCat("'", model_type, "' is not the language model of '",
                                              AsAbsl(family.multimodal_model_type), "' ('",
                                              AsAbsl(family.model_type), "')"));
  }
  decoder["model_type"] = model_type;
  if (const Json* tie = Lookup(json, "tie_word_embeddings"); tie != nullptr) {
    decoder["tie_word_embeddings"] = *tie;
  }
  return decoder;
}

absl::Status ParseObject(const Json& json, ModelConfig& config) {
  if (!json.is_object()) return absl::InvalidArgumentError("a config must be a JSON object");
  const Fields top(json);

  std::string model_type = "qwen3";
  RETURN_IF_ERROR(top.String("model_type", &model_type));
  if (const ModelFamily* wrapped = FindModelFamilyByMultimodalType(model_type); wrapped) {
    ASSIGN_OR_RETURN(const Json decoder, DecoderConfigOf(json, *wrapped));
    const absl::Status parsed = ParseObject(decoder, config);
    if (parsed.ok()) return parsed;
    return absl::Status(parsed.code(), absl::StrCat("text_config: ", parsed.message()));
  }
  const ModelFamily* family = FindModelFamily(model_type);
  if (family == nullptr) {
    return UnsupportedFieldError("model_type",
                                 absl::StrCat("'", model_type, "' is not supported (supported: ",
                                              absl::StrJoin(ModelFamilyTypes(), ", "), ")"));
  }

  // The family's transformers defaults for what is absent.
  config = FamilyDefaults(*family);
  int64_t ignored = 0;
  struct IntField {
    const char* name;
    int64_t* value;
    bool required;
  };
  const IntField ints[] = {
      {"vocab_size", &config.vocab_size, false},
      {"hidden_size", &config.hidden_size, true},
      // Not a field where every layer is sparse (transformers ignores it, and so does dta).
      {"intermediate_size", family->every_layer_sparse ? &ignored : &config.intermediate_size,
       !family->moe},
      {"num_hidden_layers", &config.num_hidden_layers, true},
      {"num_attention_heads", &config.num_attention_heads, true},
      {"num_key_value_heads", &config.num_key_value_heads, false},
      {"head_dim", &config.head_dim, false},
      {"max_position_embeddings", &config.max_position_embeddings, false},
  };
  for (const IntField& field : ints) {
    RETURN_IF_ERROR(top.Int(field.name, field.required, field.value));
  }
  if (top.Find("num_key_value_heads") == nullptr) {
    // The family's default, else num_attention_heads (see the header).
    config.num_key_value_heads = family->default_num_key_value_heads > 0
                                     ? family->default_num_key_value_heads
                                     : config.num_attention_heads;
  }
  if (top.Find("head_dim") == nullptr && family->default_head_dim == 0 &&
      config.num_attention_heads > 0) {
    config.head_dim = config.hidden_size / config.num_attention_heads;
  }
  RETURN_IF_ERROR(top.Double("rms_norm_eps", false, &config.rms_norm_eps));
  RETURN_IF_ERROR(top.Double("rope_theta", false, &config.rope_theta));
  RETURN_IF_ERROR(top.Bool("tie_word_embeddings", &config.tie_word_embeddings));
  switch (family->attention_bias) {
    case AttentionBiasRule::kNone:
    case AttentionBiasRule::kFromConfig:
      RETURN_IF_ERROR(top.Bool("attention_bias", &config.attention_bias));
      break;
    case AttentionBiasRule::kQkvAlways:  // transformers does not read the field
      config.attention_bias = true;
      break;
  }
  if (family->mlp_bias_field) {
    bool mlp_bias = false;
    RETURN_IF_ERROR(top.Bool("mlp_bias", &mlp_bias));
    if (mlp_bias) return UnsupportedFieldError("mlp_bias", "biases in the MLP are not supported");
  }
  // Newer transformers write "dtype"; older ones "torch_dtype".
  RETURN_IF_ERROR(top.String("torch_dtype", &config.torch_dtype));
  RETURN_IF_ERROR(top.String("dtype", &config.torch_dtype));
  RETURN_IF_ERROR(ParseRope(json, *family, config));
  if (family->sliding_window_fields) {
    RETURN_IF_ERROR(CheckNoSlidingWindow(json, config.num_hidden_layers));
  }
  if (family->linear_attention) {
    RETURN_IF_ERROR(ParseLayerTypes(json, config));
    const IntField linear[] = {
        {"linear_num_key_heads", &config.linear_num_key_heads, false},
        {"linear_num_value_heads", &config.linear_num_value_heads, false},
        {"linear_key_head_dim", &config.linear_key_head_dim, false},
        {"linear_value_head_dim", &config.linear_value_head_dim, false},
        {"linear_conv_kernel_dim", &config.linear_conv_kernel_dim, false},
    };
    for (const IntField& field : linear) {
      RETURN_IF_ERROR(top.Int(field.name, field.required, field.value));
    }
  }

  if (family->moe) RETURN_IF_ERROR(ParseMoe(json, *family, config));

  std::string hidden_act = "silu";
  RETURN_IF_ERROR(top.String("hidden_act", &hidden_act));
  if (hidden_act != "silu") {
    return UnsupportedFieldError("hidden_act",
                                 absl::StrCat("'", hidden_act, "' is not supported (only 'silu')"));
  }
  double dropout = 0.0;
  RETURN_IF_ERROR(top.Double("attention_dropout", false, &dropout));
  if (dropout != 0.0) {
    return UnsupportedFieldError("attention_dropout",
                                 absl::StrCat(dropout, " is not supported (only 0)"));
  }
  return ValidateModelConfig(config);
}

// The full_attention_interval whose pattern (transformers' rule: layer i is linear iff (i + 1) %
// interval != 0) gives `types`, the smallest one, or 0 when none does.
int64_t FullAttentionInterval(const std::vector<LayerType>& types) {
  const int64_t layers = static_cast<int64_t>(types.size());
  int64_t interval = layers + 1;  // no full-attention layer
  for (int64_t i = 0; i < layers; ++i) {
    if (types[i] == LayerType::kFullAttention) {
      interval = i + 1;
      break;
    }
  }
  for (int64_t i = 0; i < layers; ++i) {
    const LayerType expected =
        (i + 1) % interval != 0 ? LayerType::kLinearAttention : LayerType::kFullAttention;
    if (types[i] != expected) return 0;
  }
  return interval;
}

// config.json's rope_parameters (transformers 5's spelling): the rope object with rope_theta,
// and partial_rotary_factor for the families that have it.
Json RopeParametersJson(const ModelConfig& config, const ModelFamily& family) {
  Json rope = RopeJson(config.rope_scaling);
  if (rope.is_null()) rope = {{"rope_type", "default"}};
  rope["rope_theta"] = config.rope_theta;
  if (family.partial_rotary) rope["partial_rotary_factor"] = config.partial_rotary_factor;
  return rope;
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json) {
  Json parsed;
  try {
    parsed = Json::parse(json.begin(), json.end());
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("malformed JSON: ", e.what()));
  }
  ModelConfig config;
  RETURN_IF_ERROR(ParseObject(parsed, config));
  return config;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  std::error_code error;
  const std::string file =
      fs::is_directory(path, error) ? (fs::path(path) / "config.json").string() : path;
  std::ifstream in(file, std::ios::binary);
  if (!in) {
    if (!fs::exists(file, error)) {
      // A training checkpoint (dta-train --save, dta.Trainer.save, dta-trainer's step-<N>) keeps
      // its model one level down.
      const fs::path nested = fs::path(file).parent_path() / "model" / "config.json";
      return absl::NotFoundError(absl::StrCat(
          file, ": no such file",
          fs::exists(nested, error) ? absl::StrCat(" (a dta checkpoint: its model is in ",
                                                   nested.parent_path().string(), ")")
                                    : ""));
    }
    return absl::UnavailableError(absl::StrCat(file, ": cannot open"));
  }
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<ModelConfig> config = ParseModelConfig(text.str());
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(file, ": ", config.status().message()));
  }
  return config;
}

std::string ModelConfigToJson(const ModelConfig& config) {
  const ModelFamily* family = FindModelFamily(config.model_type);
  // An unknown model_type (which validation refuses) is written with Qwen3's fields.
  const ModelFamily& f = family != nullptr ? *family : *FindModelFamily("qwen3");
  Json json = {
      {"architectures", {std::string(f.architecture)}},
      {"attention_dropout", 0.0},
      {"head_dim", config.head_dim},
      {"hidden_act", "silu"},
      {"hidden_size", config.hidden_size},
      {"initializer_range", 0.02},
      {"max_position_embeddings", config.max_position_embeddings},
      {"model_type", config.model_type},
      {"num_attention_heads", config.num_attention_heads},
      {"num_hidden_layers", config.num_hidden_layers},
      {"num_key_value_heads", config.num_key_value_heads},
      {"rms_norm_eps", config.rms_norm_eps},
      {"rope_scaling", RopeJson(config.rope_scaling)},
      {"rope_theta", config.rope_theta},
      {"tie_word_embeddings", config.tie_word_embeddings},
      {"torch_dtype", config.torch_dtype},
      {"use_cache", true},
      {"vocab_size", config.vocab_size},
  };
  if (!f.every_layer_sparse) json["intermediate_size"] = config.intermediate_size;
  if (f.attention_bias != AttentionBiasRule::kQkvAlways) {
    json["attention_bias"] = config.attention_bias;
  }
  if (f.sliding_window_fields) {
    json["max_window_layers"] = config.num_hidden_layers;
    json["sliding_window"] = nullptr;
    json["use_sliding_window"] = false;
  }
  if (f.mlp_bias_field) {
    json["mlp_bias"] = false;
    json["pretraining_tp"] = 1;
  }
  if (f.moe) {
    json["num_experts"] = config.num_experts;
    json["num_experts_per_tok"] = config.num_experts_per_tok;
    json["moe_intermediate_size"] = config.moe_intermediate_size;
    if (!f.every_layer_sparse) {
      json["norm_topk_prob"] = config.norm_topk_prob;
      json["decoder_sparse_step"] = config.decoder_sparse_step;
      json["mlp_only_layers"] = config.mlp_only_layers;
    }
    json["router_aux_loss_coef"] = config.router_aux_loss_coef;
    json["output_router_logits"] = config.output_router_logits;
  }
  if (f.shared_expert) {
    json["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size;
  }
  if (f.linear_attention) {
    Json layer_types = Json::array();
    for (const LayerType type : config.layer_types) {
      for (const auto& [value, name] : kLayerTypes) {
        if (value == type) layer_types.push_back(name);
      }
    }
    json["layer_types"] = std::move(layer_types);
    // transformers reads layer_types first; inference engines that derive the layers from the
    // interval alone (as the Hub's config.json gives it) find the same ones.
    if (const int64_t interval = FullAttentionInterval(config.layer_types); interval > 0) {
      json["full_attention_interval"] = interval;
    }
    json["linear_num_key_heads"] = config.linear_num_key_heads;
    json["linear_num_value_heads"] = config.linear_num_value_heads;
    json["linear_key_head_dim"] = config.linear_key_head_dim;
    json["linear_value_head_dim"] = config.linear_value_head_dim;
    json["linear_conv_kernel_dim"] = config.linear_conv_kernel_dim;
  }
  if (f.partial_rotary) {
    // Both spellings: transformers 5 reads (and writes) rope_parameters, older readers the
    // top-level field beside rope_scaling and rope_theta. They agree, so either wins.
    json["partial_rotary_factor"] = config.partial_rotary_factor;
    json["rope_parameters"] = RopeParametersJson(config, f);
  }
  return json.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

absl::Status SaveModelConfig(const ModelConfig& config, const std::string& directory,
                             const std::string& base_config) {
  RETURN_IF_ERROR(ValidateModelConfig(config));
  std::error_code error;
  fs::create_directories(directory, error);
  if (error) {
    return absl::UnavailableError(
        absl::StrCat(directory, ": cannot create (", error.message(), ")"));
  }
  std::string text = ModelConfigToJson(config);
  if (!base_config.empty()) {
    ASSIGN_OR_RETURN(const std::string base, ReadWholeFile(base_config));
    Json merged = Json::parse(base, nullptr, /*allow_exceptions=*/false);
    if (!merged.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(base_config, ": not a JSON object"));
    }
    const ModelFamily& family = *FindModelFamily(config.model_type);  // validated
    // A vision-language model's config.json: its language model's part is the base of the
    // decoder's (the model saved is the decoder alone).
    if (Lookup(merged, "model_type") != nullptr && !family.multimodal_model_type.empty() &&
        merged["model_type"] == family.multimodal_model_type) {
      absl::StatusOr<Json> decoder = DecoderConfigOf(merged, family);
      if (decoder.ok()) merged = *std::move(decoder);
    }
    // Qwen3.5's multimodal RoPE sections, which text positions do not depend on, stay.
    Json mrope = Json::object();
    if (const Json* rope = Lookup(merged, "rope_parameters");
        rope != nullptr && rope->is_object()) {
      for (const char* key : {"mrope_section", "mrope_interleaved"}) {
        if (rope->contains(key)) mrope[key] = (*rope)[key];
      }
    }
    const Json ours = Json::parse(text);
    for (const auto& [key, value] : ours.items()) merged[key] = value;
    // The newer spellings of fields this struct models, if the base uses them.
    if (merged.contains("dtype")) merged["dtype"] = config.torch_dtype;
    if (merged.contains("rope_parameters") && merged["rope_parameters"].is_object()) {
      merged["rope_parameters"] = RopeParametersJson(config, family);
      merged["rope_parameters"].update(mrope);
    }
    // An interval left from the base where the layers follow none would contradict layer_types
    // for a reader that prefers it.
    if (family.linear_attention && !ours.contains("full_attention_interval")) {
      merged.erase("full_attention_interval");
    }
    if (merged.contains("num_local_experts")) merged["num_local_experts"] = config.num_experts;
    if (merged.contains("original_max_position_embeddings")) {  // read before the rope's own
      if (RopeUsesOriginalContext(config.rope_scaling.type)) {
        merged["original_max_position_embeddings"] =
            config.rope_scaling.original_max_position_embeddings;
      } else {
        merged.erase("original_max_position_embeddings");
      }
    }
    std::string merged_text = merged.dump(2) + "\n";
    // Kept only if it still says exactly this config (else the base disagrees in a way the struct
    // cannot express, and the model's own config is the truth).
    if (absl::StatusOr<ModelConfig> parsed = ParseModelConfig(merged_text);
        parsed.ok() && *parsed == config) {
      text = std::move(merged_text);
    }
  }
  return WriteTextAtomically((fs::path(directory) / "config.json").string(), text);
}

absl::StatusOr<ModelConfig> ModelConfigFromName(std::string_view name) {
  absl::StatusOr<ModelConfig> config = ModelPreset(name);
  if (!config.ok()) config = LoadModelConfig(std::string(name));
  return config;
}

}  // namespace dta

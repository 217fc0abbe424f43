#include "core/checkpoint/qwen3_config.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "core/base/absl_string_view.h"
#include "core/base/field_error.h"
#include "core/base/status_macros.h"
#include "core/checkpoint/atomic_file.h"
#include "nlohmann/json.hpp"

namespace dta {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

absl::Status Unsupported(std::string_view field, std::string_view what) {
  return absl::UnimplementedError(absl::StrCat("field '", AsAbsl(field), "': ", AsAbsl(what)));
}

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

constexpr std::pair<RopeType, const char*> kRopeTypes[] = {
    {RopeType::kDefault, "default"},
    {RopeType::kLinear, "linear"},
    {RopeType::kLlama3, "llama3"},
    {RopeType::kYarn, "yarn"},
};

bool UsesOriginalContext(RopeType type) {
  return type == RopeType::kLlama3 || type == RopeType::kYarn;
}

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
      return Unsupported(fields.Name("partial_rotary_factor"),
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
  bool known = false;
  for (const auto& [value, name] : kRopeTypes) {
    if (type == name) {
      scaling.type = value;
      known = true;
    }
  }
  if (!known) {
    return Unsupported(field, absl::StrCat("rope type '", type,
                                           "' is not supported (only default, linear, llama3, "
                                           "yarn)"));
  }
  if (UsesOriginalContext(scaling.type)) {
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
    return Unsupported("use_sliding_window", "sliding-window attention is not supported");
  if (const Json* layer_types = Lookup(json, "layer_types"); layer_types != nullptr) {
    if (!layer_types->is_array()) return FieldError("layer_types", "must be an array");
    if (static_cast<int64_t>(layer_types->size()) != layers) {
      return FieldError("layer_types",
                        absl::StrCat(layer_types->size(), " entries for ", layers, " layers"));
    }
    for (size_t i = 0; i < layer_types->size(); ++i) {
      if ((*layer_types)[i] != "full_attention") {
        return Unsupported("layer_types",
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
      return Unsupported("layer_types",
                         absl::StrCat("layer ", i, " is ", entry.dump(),
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
  // num_experts); the Hub's config.json files say num_experts. Qwen3NextConfig has no such map and
  // ignores num_local_experts, and so does dta.
  RETURN_IF_ERROR(top.Int("num_experts", false, &config.num_experts));
  if (family.model_type == "qwen3_moe" && top.Find("num_local_experts") != nullptr) {
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
  RETURN_IF_ERROR(top.Bool("norm_topk_prob", &config.norm_topk_prob));
  RETURN_IF_ERROR(top.Int("decoder_sparse_step", false, &config.decoder_sparse_step));
  RETURN_IF_ERROR(top.Double("router_aux_loss_coef", false, &config.router_aux_loss_coef));
  RETURN_IF_ERROR(top.Bool("output_router_logits", &config.output_router_logits));
  if (family.shared_expert) {
    RETURN_IF_ERROR(
        top.Int("shared_expert_intermediate_size", false, &config.shared_expert_intermediate_size));
  }
  config.mlp_only_layers.clear();
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

// The mixture-of-experts fields: in range for the MoE families, at the struct's defaults
// elsewhere. qwen3_next may have no experts at all (every MLP dense, as transformers allows); the
// other sizes then only need to be non-negative.
absl::Status ValidateMoe(const ModelConfig& config, const ModelFamily& family) {
  const ModelConfig dense;
  if (!family.shared_expert &&
      config.shared_expert_intermediate_size != dense.shared_expert_intermediate_size) {
    return FieldError(
        "shared_expert_intermediate_size",
        absl::StrCat("is a shared-expert field; ", AsAbsl(family.name), " has no shared expert"));
  }
  if (!family.moe) {
    const std::pair<const char*, bool> fields[] = {
        {"num_experts", config.num_experts != dense.num_experts},
        {"num_experts_per_tok", config.num_experts_per_tok != dense.num_experts_per_tok},
        {"moe_intermediate_size", config.moe_intermediate_size != dense.moe_intermediate_size},
        {"norm_topk_prob", config.norm_topk_prob != dense.norm_topk_prob},
        {"decoder_sparse_step", config.decoder_sparse_step != dense.decoder_sparse_step},
        {"mlp_only_layers", config.mlp_only_layers != dense.mlp_only_layers},
        {"router_aux_loss_coef", config.router_aux_loss_coef != dense.router_aux_loss_coef},
        {"output_router_logits", config.output_router_logits != dense.output_router_logits},
    };
    for (const auto& [field, set] : fields) {
      if (set) {
        return FieldError(field, absl::StrCat("is a mixture-of-experts field; ",
                                              AsAbsl(family.name), " has no experts"));
      }
    }
    return absl::OkStatus();
  }
  // Without experts (allowed where there is a shared expert: qwen3_next) the expert sizes are
  // unused.
  const bool experts = config.num_experts > 0 || !family.shared_expert;
  const std::pair<const char*, int64_t> sizes[] = {
      {"num_experts", config.num_experts},
      {"num_experts_per_tok", config.num_experts_per_tok},
      {"moe_intermediate_size", config.moe_intermediate_size},
      {"shared_expert_intermediate_size",
       family.shared_expert ? config.shared_expert_intermediate_size : 1},
  };
  for (const auto& [field, value] : sizes) {
    if (value < 0 || (experts && value <= 0)) {
      return FieldError(field, absl::StrCat(value, " is not positive"));
    }
  }
  if (config.decoder_sparse_step <= 0) {
    return FieldError("decoder_sparse_step",
                      absl::StrCat(config.decoder_sparse_step, " is not positive"));
  }
  if (experts && config.num_experts_per_tok > config.num_experts) {
    return FieldError("num_experts_per_tok",
                      absl::StrCat(config.num_experts_per_tok,
                                   " is more than num_experts = ", config.num_experts));
  }
  for (size_t i = 0; i < config.mlp_only_layers.size(); ++i) {
    const int64_t layer = config.mlp_only_layers[i];
    if (layer < 0 || layer >= config.num_hidden_layers) {
      return FieldError("mlp_only_layers",
                        absl::StrCat("layer ", layer, " is not in [0, num_hidden_layers = ",
                                     config.num_hidden_layers, ")"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (config.mlp_only_layers[j] == layer) {
        return FieldError("mlp_only_layers", absl::StrCat("layer ", layer, " is listed twice"));
      }
    }
  }
  if (!(config.router_aux_loss_coef >= 0) || !std::isfinite(config.router_aux_loss_coef)) {
    return FieldError("router_aux_loss_coef",
                      absl::StrCat(config.router_aux_loss_coef, " is not finite and >= 0"));
  }
  return absl::OkStatus();
}

// Qwen3-Next's hybrid layers and partial rotary: in range for the families with the traits, at
// the struct's defaults elsewhere.
absl::Status ValidateHybrid(const ModelConfig& config, const ModelFamily& family) {
  const ModelConfig plain;
  const std::pair<const char*, int64_t> linear_sizes[] = {
      {"linear_num_key_heads", config.linear_num_key_heads},
      {"linear_num_value_heads", config.linear_num_value_heads},
      {"linear_key_head_dim", config.linear_key_head_dim},
      {"linear_value_head_dim", config.linear_value_head_dim},
      {"linear_conv_kernel_dim", config.linear_conv_kernel_dim},
  };
  if (!family.linear_attention) {
    if (!config.layer_types.empty()) {
      return FieldError("layer_types", absl::StrCat("must be empty: ", AsAbsl(family.name),
                                                    " has only full-attention layers"));
    }
    for (const auto& [field, value] : linear_sizes) {
      if (value != 0) {
        return FieldError(field, absl::StrCat("is a linear-attention field; ", AsAbsl(family.name),
                                              " has no linear attention"));
      }
    }
  } else {
    if (static_cast<int64_t>(config.layer_types.size()) != config.num_hidden_layers) {
      return FieldError("layer_types", absl::StrCat(config.layer_types.size(), " entries for ",
                                                    config.num_hidden_layers, " layers"));
    }
    bool any_linear = false;
    for (const LayerType type : config.layer_types) {
      any_linear = any_linear || type == LayerType::kLinearAttention;
    }
    for (const auto& [field, value] : linear_sizes) {
      if (value < 0 || (any_linear && value <= 0)) {
        return FieldError(field, absl::StrCat(value, " is not positive"));
      }
    }
    if (any_linear && config.linear_num_value_heads % config.linear_num_key_heads != 0) {
      return FieldError("linear_num_value_heads",
                        absl::StrCat(config.linear_num_value_heads,
                                     " is not a multiple of linear_num_key_heads = ",
                                     config.linear_num_key_heads));
    }
  }
  if (!family.partial_rotary) {
    if (config.partial_rotary_factor != plain.partial_rotary_factor) {
      return Unsupported("partial_rotary_factor",
                         absl::StrCat(config.partial_rotary_factor,
                                      " is not supported (only 1: RoPE on whole heads)"));
    }
    return absl::OkStatus();
  }
  if (!(config.partial_rotary_factor > 0 && config.partial_rotary_factor <= 1)) {
    return FieldError("partial_rotary_factor",
                      absl::StrCat(config.partial_rotary_factor, " is not in (0, 1]"));
  }
  const int64_t rotary = RotaryDim(config);
  if (rotary < 2 || rotary % 2 != 0) {
    return FieldError(
        "partial_rotary_factor",
        absl::StrCat(config.partial_rotary_factor, " of head_dim = ", config.head_dim, " rotates ",
                     rotary, " dimensions; RoPE needs an even number, at least 2"));
  }
  return absl::OkStatus();
}

// The mixture-of-experts defaults of the family's transformers config (Qwen3MoeConfig,
// Qwen3NextConfig: they differ, so by model_type) for fields absent from config.json.
void SetMoeDefaults(const ModelFamily& family, ModelConfig& config) {
  if (!family.moe) return;
  config.router_aux_loss_coef = 0.001;
  if (family.model_type == "qwen3_next") {  // Qwen3NextConfig
    config.intermediate_size = 5632;
    config.num_experts = 512;
    config.num_experts_per_tok = 10;
    config.moe_intermediate_size = 512;
    config.shared_expert_intermediate_size = 512;
    config.norm_topk_prob = true;
  } else {  // Qwen3MoeConfig
    config.intermediate_size = 6144;
    config.num_experts = 128;
    config.num_experts_per_tok = 8;
    config.moe_intermediate_size = 768;
  }
}

absl::Status ParseObject(const Json& json, ModelConfig& config) {
  if (!json.is_object()) return absl::InvalidArgumentError("a config must be a JSON object");
  const Fields top(json);

  std::string model_type = "qwen3";
  RETURN_IF_ERROR(top.String("model_type", &model_type));
  const ModelFamily* family = FindModelFamily(model_type);
  if (family == nullptr) {
    return Unsupported("model_type",
                       absl::StrCat("'", model_type, "' is not supported (supported: ",
                                    absl::StrJoin(ModelFamilyTypes(), ", "), ")"));
  }

  // The family's transformers defaults for what is absent.
  config = ModelConfig();
  config.model_type = std::string(family->model_type);
  config.vocab_size = family->default_vocab_size;
  config.head_dim = family->default_head_dim;
  config.rope_theta = 10000.0;
  config.max_position_embeddings = family->default_max_position_embeddings;
  config.tie_word_embeddings = false;
  config.torch_dtype = "float32";
  config.partial_rotary_factor = family->default_partial_rotary_factor;
  SetMoeDefaults(*family, config);
  if (family->linear_attention) {  // transformers' Qwen3NextConfig
    config.linear_num_key_heads = 16;
    config.linear_num_value_heads = 32;
    config.linear_key_head_dim = 128;
    config.linear_value_head_dim = 128;
    config.linear_conv_kernel_dim = 4;
  }
  struct IntField {
    const char* name;
    int64_t* value;
    bool required;
  };
  const IntField ints[] = {
      {"vocab_size", &config.vocab_size, false},
      {"hidden_size", &config.hidden_size, true},
      {"intermediate_size", &config.intermediate_size, !family->moe},
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
    // transformers' Qwen3NextConfig default (2); the other families: see the header.
    config.num_key_value_heads =
        family->model_type == "qwen3_next" ? 2 : config.num_attention_heads;
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
    if (mlp_bias) return Unsupported("mlp_bias", "biases in the MLP are not supported");
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
    return Unsupported("hidden_act",
                       absl::StrCat("'", hidden_act, "' is not supported (only 'silu')"));
  }
  double dropout = 0.0;
  RETURN_IF_ERROR(top.Double("attention_dropout", false, &dropout));
  if (dropout != 0.0) {
    return Unsupported("attention_dropout", absl::StrCat(dropout, " is not supported (only 0)"));
  }
  return ValidateModelConfig(config);
}

// The rope object of config.json (rope_scaling; rope_parameters adds rope_theta), or null for the
// default rope.
Json RopeJson(const RopeScaling& rope) {
  if (rope.type == RopeType::kDefault) return nullptr;
  Json json = {{"rope_type", std::string(RopeTypeName(rope.type))}, {"factor", rope.factor}};
  if (UsesOriginalContext(rope.type)) {
    json["original_max_position_embeddings"] = rope.original_max_position_embeddings;
  }
  if (rope.type == RopeType::kLlama3) {
    json["low_freq_factor"] = rope.low_freq_factor;
    json["high_freq_factor"] = rope.high_freq_factor;
  }
  if (rope.type == RopeType::kYarn) {
    // Only where they differ from transformers' defaults, which an absent field means.
    if (rope.beta_fast != 32.0) json["beta_fast"] = rope.beta_fast;
    if (rope.beta_slow != 1.0) json["beta_slow"] = rope.beta_slow;
    if (rope.attention_factor) json["attention_factor"] = *rope.attention_factor;
    if (rope.mscale) json["mscale"] = *rope.mscale;
    if (rope.mscale_all_dim) json["mscale_all_dim"] = *rope.mscale_all_dim;
    if (!rope.truncate) json["truncate"] = false;
  }
  return json;
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

absl::Status CheckPositiveFinite(const char* field, double value) {
  if (!(value > 0) || !std::isfinite(value)) {
    return FieldError(field, absl::StrCat(value, " is not positive and finite"));
  }
  return absl::OkStatus();
}

absl::Status ValidateRope(const RopeScaling& rope) {
  if (rope.type == RopeType::kDefault) return absl::OkStatus();
  RETURN_IF_ERROR(CheckPositiveFinite("rope_scaling.factor", rope.factor));
  if (UsesOriginalContext(rope.type) && rope.original_max_position_embeddings <= 0) {
    return FieldError("rope_scaling.original_max_position_embeddings",
                      absl::StrCat(rope.original_max_position_embeddings, " is not positive"));
  }
  if (rope.type == RopeType::kLlama3) {
    RETURN_IF_ERROR(CheckPositiveFinite("rope_scaling.low_freq_factor", rope.low_freq_factor));
    if (!(rope.high_freq_factor > rope.low_freq_factor) || !std::isfinite(rope.high_freq_factor)) {
      return FieldError(
          "rope_scaling.high_freq_factor",
          absl::StrCat(rope.high_freq_factor, " must be finite and greater than low_freq_factor = ",
                       rope.low_freq_factor));
    }
  }
  if (rope.type == RopeType::kYarn) {
    RETURN_IF_ERROR(CheckPositiveFinite("rope_scaling.beta_fast", rope.beta_fast));
    RETURN_IF_ERROR(CheckPositiveFinite("rope_scaling.beta_slow", rope.beta_slow));
    if (rope.attention_factor) {
      RETURN_IF_ERROR(CheckPositiveFinite("rope_scaling.attention_factor", *rope.attention_factor));
    }
    for (const auto& [name, value] :
         {std::pair{"rope_scaling.mscale", rope.mscale},
          std::pair{"rope_scaling.mscale_all_dim", rope.mscale_all_dim}}) {
      if (value && !std::isfinite(*value)) {
        return FieldError(name, absl::StrCat(*value, " is not finite"));
      }
    }
    RETURN_IF_ERROR(CheckPositiveFinite("rope attention factor", RopeAttentionFactor(rope)));
  }
  return absl::OkStatus();
}

struct Preset {
  const char* name;
  const char* model_type;
  int64_t vocab, hidden, intermediate, layers, heads, kv_heads, head_dim;
  bool tie;
  double rope_theta, rms_norm_eps;
  int64_t max_position_embeddings;
  RopeScaling rope;
  // qwen3_moe, qwen3_next: experts, top-k, each expert's width (every layer sparse, top-k
  // renormalised).
  int64_t experts = 0, experts_per_token = 0, moe_intermediate = 0;
  // qwen3_next: the shared expert's width; the Gated DeltaNet layers' sizes (linear_* fields, one
  // head dim for keys and values); every full_attention_interval-th layer full attention, the
  // others linear; RoPE's share of each head.
  int64_t shared_expert = 0;
  int64_t linear_key_heads = 0, linear_value_heads = 0, linear_head_dim = 0, linear_conv_kernel = 0;
  int64_t full_attention_interval = 0;
  double partial_rotary_factor = 1.0;
};

// Llama 3.1's rope scaling with the given factor (Llama 3.2 uses 32).
constexpr RopeScaling Llama3Rope(double factor) {
  return {.type = RopeType::kLlama3,
          .factor = factor,
          .original_max_position_embeddings = 8192,
          .low_freq_factor = 1.0,
          .high_freq_factor = 4.0};
}

// As in the models' config.json on the Hugging Face Hub.
const Preset kPresets[] = {
    {"qwen3-0.6b", "qwen3", 151936, 1024, 3072, 28, 16, 8, 128, true, 1e6, 1e-6, 40960, {}},
    {"qwen3-1.7b", "qwen3", 151936, 2048, 6144, 28, 16, 8, 128, true, 1e6, 1e-6, 40960, {}},
    {"qwen3-4b", "qwen3", 151936, 2560, 9728, 36, 32, 8, 128, true, 1e6, 1e-6, 40960, {}},
    {"qwen3-8b", "qwen3", 151936, 4096, 12288, 36, 32, 8, 128, false, 1e6, 1e-6, 40960, {}},
    {"qwen3-14b", "qwen3", 151936, 5120, 17408, 40, 40, 8, 128, false, 1e6, 1e-6, 40960, {}},
    {"qwen3-32b", "qwen3", 151936, 5120, 25600, 64, 64, 8, 128, false, 1e6, 1e-6, 40960, {}},
    // Qwen/Qwen2.5-1.5B-Instruct.
    {"qwen2.5-1.5b", "qwen2", 151936, 1536, 8960, 28, 12, 2, 128, true, 1e6, 1e-6, 32768, {}},
    {"llama-3.2-1b", "llama", 128256, 2048, 8192, 16, 32, 8, 64, true, 500000.0, 1e-5, 131072,
     Llama3Rope(32.0)},
    {"llama-3.1-8b", "llama", 128256, 4096, 14336, 32, 32, 8, 128, false, 500000.0, 1e-5, 131072,
     Llama3Rope(8.0)},
    // Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.3B active per token.
    {"qwen3-30b-a3b",
     "qwen3_moe",
     151936,
     2048,
     6144,
     48,
     32,
     4,
     128,
     false,
     1e6,
     1e-6,
     40960,
     {},
     128,
     8,
     768},
    // Not a released model: Qwen3-30B-A3B's first 4 layers (3.1B parameters, 0.9B active), for
    // benchmarks on one 80 GB GPU with its real expert shapes and routing.
    {"qwen3-moe-small",
     "qwen3_moe",
     151936,
     2048,
     6144,
     4,
     32,
     4,
     128,
     false,
     1e6,
     1e-6,
     40960,
     {},
     128,
     8,
     768},
    // Qwen/Qwen3-Next-80B-A3B-Instruct (and -Thinking): 79.7B parameters, 3.9B active per token.
    {.name = "qwen3-next-80b-a3b",
     .model_type = "qwen3_next",
     .vocab = 151936,
     .hidden = 2048,
     .intermediate = 5120,
     .layers = 48,
     .heads = 16,
     .kv_heads = 2,
     .head_dim = 256,
     .tie = false,
     .rope_theta = 1e7,
     .rms_norm_eps = 1e-6,
     .max_position_embeddings = 262144,
     .rope = {},
     .experts = 512,
     .experts_per_token = 10,
     .moe_intermediate = 512,
     .shared_expert = 512,
     .linear_key_heads = 16,
     .linear_value_heads = 32,
     .linear_head_dim = 128,
     .linear_conv_kernel = 4,
     .full_attention_interval = 4,
     .partial_rotary_factor = 0.25},
    // Not a released model: Qwen3-Next-80B-A3B's layers, 4 of its 48 (three linear, one full
    // attention) with 128 of its 512 experts each (2.4B parameters, 0.9B active), for benchmarks
    // on one 80 GB GPU with its real layer shapes and routing.
    {.name = "qwen3-next-small",
     .model_type = "qwen3_next",
     .vocab = 151936,
     .hidden = 2048,
     .intermediate = 5120,
     .layers = 4,
     .heads = 16,
     .kv_heads = 2,
     .head_dim = 256,
     .tie = false,
     .rope_theta = 1e7,
     .rms_norm_eps = 1e-6,
     .max_position_embeddings = 262144,
     .rope = {},
     .experts = 128,
     .experts_per_token = 10,
     .moe_intermediate = 512,
     .shared_expert = 512,
     .linear_key_heads = 16,
     .linear_value_heads = 32,
     .linear_head_dim = 128,
     .linear_conv_kernel = 4,
     .full_attention_interval = 4,
     .partial_rotary_factor = 0.25},
};

}  // namespace

std::string_view RopeTypeName(RopeType type) {
  for (const auto& [value, name] : kRopeTypes) {
    if (value == type) return name;
  }
  return "unknown";
}

double RopeAttentionFactor(const RopeScaling& rope) {
  if (rope.type != RopeType::kYarn) return 1.0;
  if (rope.attention_factor) return *rope.attention_factor;
  // transformers' get_mscale, and its truthiness test of mscale and mscale_all_dim.
  auto mscale = [&](double m) {
    return rope.factor <= 1 ? 1.0 : 0.1 * m * std::log(rope.factor) + 1.0;
  };
  if (rope.mscale.value_or(0) != 0 && rope.mscale_all_dim.value_or(0) != 0) {
    return mscale(*rope.mscale) / mscale(*rope.mscale_all_dim);
  }
  return mscale(1.0);
}

std::string RopeScalingToJson(const RopeScaling& rope) { return RopeJson(rope).dump(); }

namespace {
// The family's boolean trait; false for a model_type without a family.
bool FamilyTrait(const ModelConfig& config, bool ModelFamily::*trait) {
  const ModelFamily* family = FindModelFamily(config.model_type);
  return family != nullptr && family->*trait;
}
}  // namespace

bool HasQkNorm(const ModelConfig& config) {
  const ModelFamily* family = FindModelFamily(config.model_type);
  return family == nullptr || family->qk_norm;
}

bool HasOProjBias(const ModelConfig& config) {
  const ModelFamily* family = FindModelFamily(config.model_type);
  return family != nullptr && family->attention_bias == AttentionBiasRule::kFromConfig &&
         config.attention_bias;
}

bool IsMoe(const ModelConfig& config) { return FamilyTrait(config, &ModelFamily::moe); }

bool IsSparseLayer(const ModelConfig& config, int64_t layer) {
  if (!IsMoe(config) || config.num_experts <= 0 || config.decoder_sparse_step <= 0) return false;
  for (const int64_t dense : config.mlp_only_layers) {
    if (dense == layer) return false;
  }
  return (layer + 1) % config.decoder_sparse_step == 0;
}

bool IsLinearAttentionLayer(const ModelConfig& config, int64_t layer) {
  return layer >= 0 && layer < static_cast<int64_t>(config.layer_types.size()) &&
         config.layer_types[layer] == LayerType::kLinearAttention;
}

int64_t RotaryDim(const ModelConfig& config) {
  // transformers: int(head_dim * partial_rotary_factor), a truncation.
  return static_cast<int64_t>(static_cast<double>(config.head_dim) * config.partial_rotary_factor);
}

bool HasZeroCentredNorms(const ModelConfig& config) {
  return FamilyTrait(config, &ModelFamily::zero_centred_norms);
}
bool HasGatedAttention(const ModelConfig& config) {
  return FamilyTrait(config, &ModelFamily::gated_attention);
}
bool HasSharedExpert(const ModelConfig& config) {
  return FamilyTrait(config, &ModelFamily::shared_expert);
}

absl::Status ValidateModelConfig(const ModelConfig& config) {
  const ModelFamily* family = FindModelFamily(config.model_type);
  if (family == nullptr) {
    return Unsupported("model_type",
                       absl::StrCat("'", config.model_type, "' is not supported (supported: ",
                                    absl::StrJoin(ModelFamilyTypes(), ", "), ")"));
  }
  const std::pair<const char*, int64_t> sizes[] = {
      {"vocab_size", config.vocab_size},
      {"hidden_size", config.hidden_size},
      {"intermediate_size", config.intermediate_size},
      {"num_hidden_layers", config.num_hidden_layers},
      {"num_attention_heads", config.num_attention_heads},
      {"num_key_value_heads", config.num_key_value_heads},
      {"head_dim", config.head_dim},
      {"max_position_embeddings", config.max_position_embeddings},
  };
  for (const auto& [field, value] : sizes) {
    if (value <= 0) return FieldError(field, absl::StrCat(value, " is not positive"));
  }
  if (config.num_attention_heads % config.num_key_value_heads != 0) {
    return FieldError("num_key_value_heads", absl::StrCat(config.num_key_value_heads,
                                                          " does not divide num_attention_heads = ",
                                                          config.num_attention_heads));
  }
  if (family->hidden_divisible_by_heads && config.hidden_size % config.num_attention_heads != 0) {
    return FieldError("hidden_size", absl::StrCat(config.hidden_size,
                                                  " is not a multiple of num_attention_heads = ",
                                                  config.num_attention_heads, " (transformers' ",
                                                  AsAbsl(family->name), " refuses it)"));
  }
  if (!(config.rms_norm_eps > 0) || !std::isfinite(config.rms_norm_eps)) {
    return FieldError("rms_norm_eps",
                      absl::StrCat(config.rms_norm_eps, " is not positive and finite"));
  }
  RETURN_IF_ERROR(CheckPositiveFinite("rope_theta", config.rope_theta));
  RETURN_IF_ERROR(ValidateRope(config.rope_scaling));
  const std::string& dtype = config.torch_dtype;
  if (dtype != "bfloat16" && dtype != "float16" && dtype != "float32" && dtype != "float64") {
    return FieldError(
        "torch_dtype",
        absl::StrCat("'", dtype, "' is not one of bfloat16, float16, float32, float64"));
  }
  switch (family->attention_bias) {
    case AttentionBiasRule::kNone:
      if (config.attention_bias) {
        return Unsupported("attention_bias",
                           absl::StrCat("attention biases are not supported for ",
                                        AsAbsl(family->name), " (its models have none)"));
      }
      break;
    case AttentionBiasRule::kQkvAlways:
      if (!config.attention_bias) {
        return FieldError("attention_bias", absl::StrCat("must be true: ", AsAbsl(family->name),
                                                         " always has q/k/v biases"));
      }
      break;
    case AttentionBiasRule::kFromConfig:
      break;
  }
  RETURN_IF_ERROR(ValidateMoe(config, *family));
  return ValidateHybrid(config, *family);
}

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
      {"intermediate_size", config.intermediate_size},
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
    json["norm_topk_prob"] = config.norm_topk_prob;
    json["decoder_sparse_step"] = config.decoder_sparse_step;
    json["mlp_only_layers"] = config.mlp_only_layers;
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
    const Json ours = Json::parse(text);
    for (const auto& [key, value] : ours.items()) merged[key] = value;
    // The newer spellings of fields this struct models, if the base uses them.
    if (merged.contains("dtype")) merged["dtype"] = config.torch_dtype;
    const ModelFamily& family = *FindModelFamily(config.model_type);  // validated
    if (merged.contains("rope_parameters") && merged["rope_parameters"].is_object()) {
      merged["rope_parameters"] = RopeParametersJson(config, family);
    }
    // An interval left from the base where the layers follow none would contradict layer_types
    // for a reader that prefers it.
    if (family.linear_attention && !ours.contains("full_attention_interval")) {
      merged.erase("full_attention_interval");
    }
    if (merged.contains("num_local_experts")) merged["num_local_experts"] = config.num_experts;
    if (merged.contains("original_max_position_embeddings")) {  // read before the rope's own
      if (UsesOriginalContext(config.rope_scaling.type)) {
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

absl::StatusOr<ModelConfig> ModelPreset(std::string_view name) {
  const std::string lower = absl::AsciiStrToLower(AsAbsl(name));
  absl::string_view key = lower;
  if (!absl::ConsumePrefix(&key, "qwen/")) absl::ConsumePrefix(&key, "meta-llama/");
  for (const Preset& preset : kPresets) {
    if (key != preset.name) continue;
    ModelConfig config;
    config.model_type = preset.model_type;
    config.vocab_size = preset.vocab;
    config.hidden_size = preset.hidden;
    config.intermediate_size = preset.intermediate;
    config.num_hidden_layers = preset.layers;
    config.num_attention_heads = preset.heads;
    config.num_key_value_heads = preset.kv_heads;
    config.head_dim = preset.head_dim;
    config.rms_norm_eps = preset.rms_norm_eps;
    config.rope_theta = preset.rope_theta;
    config.rope_scaling = preset.rope;
    config.tie_word_embeddings = preset.tie;
    config.max_position_embeddings = preset.max_position_embeddings;
    config.torch_dtype = "bfloat16";
    config.attention_bias =
        FindModelFamily(preset.model_type)->attention_bias == AttentionBiasRule::kQkvAlways;
    if (preset.experts > 0) {
      config.num_experts = preset.experts;
      config.num_experts_per_tok = preset.experts_per_token;
      config.moe_intermediate_size = preset.moe_intermediate;
      config.norm_topk_prob = true;
      config.router_aux_loss_coef = 0.001;
      config.shared_expert_intermediate_size = preset.shared_expert;
    }
    if (preset.full_attention_interval > 0) {
      for (int64_t i = 0; i < preset.layers; ++i) {
        config.layer_types.push_back((i + 1) % preset.full_attention_interval != 0
                                         ? LayerType::kLinearAttention
                                         : LayerType::kFullAttention);
      }
      config.linear_num_key_heads = preset.linear_key_heads;
      config.linear_num_value_heads = preset.linear_value_heads;
      config.linear_key_head_dim = preset.linear_head_dim;
      config.linear_value_head_dim = preset.linear_head_dim;
      config.linear_conv_kernel_dim = preset.linear_conv_kernel;
    }
    config.partial_rotary_factor = preset.partial_rotary_factor;
    return config;
  }
  return absl::NotFoundError(absl::StrCat("unknown preset '", AsAbsl(name), "' (known: ",
                                          absl::StrJoin(ModelPresetNames(), ", "), ")"));
}

absl::StatusOr<ModelConfig> ModelConfigFromName(std::string_view name) {
  absl::StatusOr<ModelConfig> config = ModelPreset(name);
  if (!config.ok()) config = LoadModelConfig(std::string(name));
  return config;
}

std::vector<std::string> ModelPresetNames() {
  std::vector<std::string> names;
  for (const Preset& preset : kPresets) names.push_back(preset.name);
  return names;
}

}  // namespace dta

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
#include "core/base/field_error.h"
#include "core/base/status_macros.h"
#include "core/checkpoint/atomic_file.h"
#include "nlohmann/json.hpp"

namespace dta {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// Debian's Abseil is built with its own string_view type, so std::string_view needs converting.
absl::string_view AsAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

absl::Status Unsupported(std::string_view field, std::string_view what) {
  return absl::UnimplementedError(absl::StrCat("field '", AsAbsl(field), "': ", AsAbsl(what)));
}

// The value of `field`, or nullptr when it is absent or null.
const Json* Lookup(const Json& object, const char* field) {
  auto it = object.find(field);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

absl::Status ReadInt(const Json& object, const char* field, bool required, int64_t* out) {
  const Json* value = Lookup(object, field);
  if (value == nullptr) return required ? FieldError(field, "missing") : absl::OkStatus();
  if (value->is_number_unsigned()) {
    if (value->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return FieldError(field, absl::StrCat(value->dump(), " is too large"));
    }
    *out = static_cast<int64_t>(value->get<uint64_t>());
  } else if (value->is_number_integer()) {
    *out = value->get<int64_t>();
  } else {
    return FieldError(field, absl::StrCat("must be an integer, not ", value->dump()));
  }
  return absl::OkStatus();
}

absl::Status ReadDouble(const Json& object, const char* field, double* out) {
  const Json* value = Lookup(object, field);
  if (value == nullptr) return absl::OkStatus();
  if (!value->is_number())
    return FieldError(field, absl::StrCat("must be a number, not ", value->dump()));
  *out = value->get<double>();
  return absl::OkStatus();
}

absl::Status ReadBool(const Json& object, const char* field, bool* out) {
  const Json* value = Lookup(object, field);
  if (value == nullptr) return absl::OkStatus();
  if (!value->is_boolean())
    return FieldError(field, absl::StrCat("must be true or false, not ", value->dump()));
  *out = value->get<bool>();
  return absl::OkStatus();
}

absl::Status ReadString(const Json& object, const char* field, std::string* out) {
  const Json* value = Lookup(object, field);
  if (value == nullptr) return absl::OkStatus();
  if (!value->is_string())
    return FieldError(field, absl::StrCat("must be a string, not ", value->dump()));
  *out = value->get<std::string>();
  return absl::OkStatus();
}

// rope_type (or the older key "type") of a rope_scaling / rope_parameters object; "default" when
// neither is present.
absl::StatusOr<std::string> RopeType(const char* field, const Json& rope) {
  if (!rope.is_object())
    return FieldError(field, absl::StrCat("must be an object or null, not ", rope.dump()));
  for (const char* key : {"rope_type", "type"}) {
    if (const Json* type = Lookup(rope, key); type != nullptr) {
      if (!type->is_string())
        return FieldError(field, absl::StrCat("'", key, "' must be a string"));
      return type->get<std::string>();
    }
  }
  return std::string("default");
}

absl::Status ParseObject(const Json& json, Qwen3Config& config) {
  if (!json.is_object()) return absl::InvalidArgumentError("a config must be a JSON object");

  std::string model_type = "qwen3";
  RETURN_IF_ERROR(ReadString(json, "model_type", &model_type));
  if (model_type != "qwen3") {
    return Unsupported(
        "model_type", absl::StrCat("'", model_type, "' is not supported: only Qwen3 ('qwen3') is"));
  }

  // transformers' Qwen3Config defaults for what is absent.
  config = Qwen3Config();
  config.head_dim = 128;
  config.rope_theta = 10000.0;
  config.max_position_embeddings = 32768;
  config.tie_word_embeddings = false;
  config.torch_dtype = "float32";
  struct IntField {
    const char* name;
    int64_t* value;
    bool required;
  };
  const IntField ints[] = {
      {"vocab_size", &config.vocab_size, false},
      {"hidden_size", &config.hidden_size, true},
      {"intermediate_size", &config.intermediate_size, true},
      {"num_hidden_layers", &config.num_hidden_layers, true},
      {"num_attention_heads", &config.num_attention_heads, true},
      {"num_key_value_heads", &config.num_key_value_heads, false},
      {"head_dim", &config.head_dim, false},
      {"max_position_embeddings", &config.max_position_embeddings, false},
  };
  for (const IntField& field : ints) {
    RETURN_IF_ERROR(ReadInt(json, field.name, field.required, field.value));
  }
  if (Lookup(json, "num_key_value_heads") == nullptr) {
    config.num_key_value_heads = config.num_attention_heads;
  }
  RETURN_IF_ERROR(ReadDouble(json, "rms_norm_eps", &config.rms_norm_eps));
  RETURN_IF_ERROR(ReadDouble(json, "rope_theta", &config.rope_theta));
  if (absl::Status s = ReadBool(json, "tie_word_embeddings", &config.tie_word_embeddings);
      !s.ok()) {
    return s;
  }
  RETURN_IF_ERROR(ReadBool(json, "attention_bias", &config.attention_bias));
  // Newer transformers write "dtype"; older ones "torch_dtype".
  RETURN_IF_ERROR(ReadString(json, "torch_dtype", &config.torch_dtype));
  RETURN_IF_ERROR(ReadString(json, "dtype", &config.torch_dtype));

  // Rope: rope_scaling (older transformers) must be absent, null or the plain default rope;
  // rope_parameters (newer ones) carries rope_theta.
  if (const Json* scaling = Lookup(json, "rope_scaling"); scaling != nullptr) {
    absl::StatusOr<std::string> type = RopeType("rope_scaling", *scaling);
    if (!type.ok()) return type.status();
    if (*type != "default") {
      return Unsupported("rope_scaling",
                         absl::StrCat("rope scaling is not supported (got ", scaling->dump(), ")"));
    }
  }
  if (const Json* parameters = Lookup(json, "rope_parameters"); parameters != nullptr) {
    absl::StatusOr<std::string> type = RopeType("rope_parameters", *parameters);
    if (!type.ok()) return type.status();
    if (*type != "default") {
      return Unsupported("rope_parameters",
                         absl::StrCat("rope type '", *type, "' is not supported (only 'default')"));
    }
    if (const Json* theta = Lookup(*parameters, "rope_theta"); theta != nullptr) {
      if (!theta->is_number())
        return FieldError("rope_parameters", "'rope_theta' must be a number");
      config.rope_theta = theta->get<double>();
    }
  }

  bool sliding = false;
  RETURN_IF_ERROR(ReadBool(json, "use_sliding_window", &sliding));
  if (sliding)
    return Unsupported("use_sliding_window", "sliding-window attention is not supported");
  if (const Json* layer_types = Lookup(json, "layer_types"); layer_types != nullptr) {
    if (!layer_types->is_array()) return FieldError("layer_types", "must be an array");
    if (static_cast<int64_t>(layer_types->size()) != config.num_hidden_layers) {
      return FieldError("layer_types", absl::StrCat(layer_types->size(), " entries for ",
                                                    config.num_hidden_layers, " layers"));
    }
    for (size_t i = 0; i < layer_types->size(); ++i) {
      if ((*layer_types)[i] != "full_attention") {
        return Unsupported("layer_types",
                           absl::StrCat("layer ", i, " is ", (*layer_types)[i].dump(),
                                        ": only 'full_attention' is supported"));
      }
    }
  }

  std::string hidden_act = "silu";
  RETURN_IF_ERROR(ReadString(json, "hidden_act", &hidden_act));
  if (hidden_act != "silu") {
    return Unsupported("hidden_act",
                       absl::StrCat("'", hidden_act, "' is not supported (only 'silu')"));
  }
  double dropout = 0.0;
  RETURN_IF_ERROR(ReadDouble(json, "attention_dropout", &dropout));
  if (dropout != 0.0) {
    return Unsupported("attention_dropout", absl::StrCat(dropout, " is not supported (only 0)"));
  }
  return ValidateQwen3Config(config);
}

struct Preset {
  const char* name;
  int64_t hidden, intermediate, layers, heads, kv_heads;
  bool tie;
};

constexpr Preset kPresets[] = {
    {"qwen3-0.6b", 1024, 3072, 28, 16, 8, true},  {"qwen3-1.7b", 2048, 6144, 28, 16, 8, true},
    {"qwen3-4b", 2560, 9728, 36, 32, 8, true},    {"qwen3-8b", 4096, 12288, 36, 32, 8, false},
    {"qwen3-14b", 5120, 17408, 40, 40, 8, false}, {"qwen3-32b", 5120, 25600, 64, 64, 8, false},
};

}  // namespace

absl::Status ValidateQwen3Config(const Qwen3Config& config) {
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
  if (!(config.rms_norm_eps > 0) || !std::isfinite(config.rms_norm_eps)) {
    return FieldError("rms_norm_eps",
                      absl::StrCat(config.rms_norm_eps, " is not positive and finite"));
  }
  if (!(config.rope_theta > 0) || !std::isfinite(config.rope_theta)) {
    return FieldError("rope_theta", absl::StrCat(config.rope_theta, " is not positive and finite"));
  }
  const std::string& dtype = config.torch_dtype;
  if (dtype != "bfloat16" && dtype != "float16" && dtype != "float32" && dtype != "float64") {
    return FieldError(
        "torch_dtype",
        absl::StrCat("'", dtype, "' is not one of bfloat16, float16, float32, float64"));
  }
  if (config.attention_bias) {
    return Unsupported("attention_bias", "attention biases are not supported (Qwen3 has none)");
  }
  return absl::OkStatus();
}

absl::StatusOr<Qwen3Config> ParseQwen3Config(std::string_view json) {
  Json parsed;
  try {
    parsed = Json::parse(json.begin(), json.end());
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("malformed JSON: ", e.what()));
  }
  Qwen3Config config;
  RETURN_IF_ERROR(ParseObject(parsed, config));
  return config;
}

absl::StatusOr<Qwen3Config> LoadQwen3Config(const std::string& path) {
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
  absl::StatusOr<Qwen3Config> config = ParseQwen3Config(text.str());
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(file, ": ", config.status().message()));
  }
  return config;
}

std::string Qwen3ConfigToJson(const Qwen3Config& config) {
  const Json json = {
      {"architectures", {"Qwen3ForCausalLM"}},
      {"attention_bias", config.attention_bias},
      {"attention_dropout", 0.0},
      {"head_dim", config.head_dim},
      {"hidden_act", "silu"},
      {"hidden_size", config.hidden_size},
      {"initializer_range", 0.02},
      {"intermediate_size", config.intermediate_size},
      {"max_position_embeddings", config.max_position_embeddings},
      {"max_window_layers", config.num_hidden_layers},
      {"model_type", "qwen3"},
      {"num_attention_heads", config.num_attention_heads},
      {"num_hidden_layers", config.num_hidden_layers},
      {"num_key_value_heads", config.num_key_value_heads},
      {"rms_norm_eps", config.rms_norm_eps},
      {"rope_scaling", nullptr},
      {"rope_theta", config.rope_theta},
      {"sliding_window", nullptr},
      {"tie_word_embeddings", config.tie_word_embeddings},
      {"torch_dtype", config.torch_dtype},
      {"use_cache", true},
      {"use_sliding_window", false},
      {"vocab_size", config.vocab_size},
  };
  return json.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

absl::Status SaveQwen3Config(const Qwen3Config& config, const std::string& directory,
                             const std::string& base_config) {
  RETURN_IF_ERROR(ValidateQwen3Config(config));
  std::error_code error;
  fs::create_directories(directory, error);
  if (error) {
    return absl::UnavailableError(
        absl::StrCat(directory, ": cannot create (", error.message(), ")"));
  }
  std::string text = Qwen3ConfigToJson(config);
  if (!base_config.empty()) {
    ASSIGN_OR_RETURN(const std::string base, ReadWholeFile(base_config));
    Json merged = Json::parse(base, nullptr, /*allow_exceptions=*/false);
    if (!merged.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(base_config, ": not a JSON object"));
    }
    const Json ours = Json::parse(text);
    for (const auto& [key, value] : ours.items()) merged[key] = value;
    // The newer spellings of two fields this struct models, if the base uses them.
    if (merged.contains("dtype")) merged["dtype"] = config.torch_dtype;
    if (Json* rope = merged.contains("rope_parameters") ? &merged["rope_parameters"] : nullptr;
        rope != nullptr && rope->is_object()) {
      (*rope)["rope_theta"] = config.rope_theta;
    }
    std::string merged_text = merged.dump(2) + "\n";
    // Kept only if it still says exactly this config (else the base disagrees in a way the struct
    // cannot express, and the model's own config is the truth).
    if (absl::StatusOr<Qwen3Config> parsed = ParseQwen3Config(merged_text);
        parsed.ok() && *parsed == config) {
      text = std::move(merged_text);
    }
  }
  return WriteTextAtomically((fs::path(directory) / "config.json").string(), text);
}

absl::StatusOr<Qwen3Config> Qwen3ConfigPreset(std::string_view name) {
  const std::string lower = absl::AsciiStrToLower(AsAbsl(name));
  absl::string_view key = lower;
  absl::ConsumePrefix(&key, "qwen/");
  for (const Preset& preset : kPresets) {
    if (key != preset.name) continue;
    Qwen3Config config;
    config.vocab_size = 151936;
    config.hidden_size = preset.hidden;
    config.intermediate_size = preset.intermediate;
    config.num_hidden_layers = preset.layers;
    config.num_attention_heads = preset.heads;
    config.num_key_value_heads = preset.kv_heads;
    config.head_dim = 128;
    config.rms_norm_eps = 1e-6;
    config.rope_theta = 1000000.0;
    config.tie_word_embeddings = preset.tie;
    config.max_position_embeddings = 40960;
    config.torch_dtype = "bfloat16";
    config.attention_bias = false;
    return config;
  }
  return absl::NotFoundError(absl::StrCat("unknown Qwen3 preset '", AsAbsl(name), "' (known: ",
                                          absl::StrJoin(Qwen3ConfigPresetNames(), ", "), ")"));
}

absl::StatusOr<Qwen3Config> Qwen3ConfigFromName(std::string_view name) {
  absl::StatusOr<Qwen3Config> config = Qwen3ConfigPreset(name);
  if (!config.ok()) config = LoadQwen3Config(std::string(name));
  return config;
}

std::vector<std::string> Qwen3ConfigPresetNames() {
  std::vector<std::string> names;
  for (const Preset& preset : kPresets) names.push_back(preset.name);
  return names;
}

}  // namespace dta

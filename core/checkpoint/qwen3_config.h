// The Qwen3 model configuration, read from and written to Hugging Face's config.json.
//
// Only the dense Qwen3 architecture is supported: no rope scaling, no sliding-window attention,
// no attention biases, SiLU activations, no attention dropout. A config.json asking for any of
// these is refused with UNIMPLEMENTED rather than silently loaded into a model that would compute
// something else. Fields this struct does not model (bos_token_id, transformers_version,
// initializer_range, use_cache, ...) are accepted and ignored.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dta {

struct Qwen3Config {
  int64_t vocab_size = 151936;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1000000.0;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 40960;
  std::string torch_dtype = "bfloat16";  // "bfloat16", "float16", "float32" or "float64"
  bool attention_bias = false;           // must stay false: biases are not supported

  bool operator==(const Qwen3Config&) const = default;
};

// OK if the config describes a model this project can build: every size positive,
// num_attention_heads a multiple of num_key_value_heads, rms_norm_eps and rope_theta positive and
// finite, torch_dtype one of the four above (INVALID_ARGUMENT naming the field otherwise);
// UNIMPLEMENTED if attention_bias is set.
absl::Status ValidateQwen3Config(const Qwen3Config& config);

// Parses a config.json. Required: hidden_size, intermediate_size, num_hidden_layers,
// num_attention_heads. Absent optional fields take the defaults of transformers' Qwen3Config
// (which is what Hugging Face would compute from the same file, and differs from this struct's
// defaults): vocab_size 151936, num_key_value_heads = num_attention_heads, head_dim 128,
// rms_norm_eps 1e-6, rope_theta 10000, tie_word_embeddings false, max_position_embeddings 32768,
// torch_dtype "float32". "dtype" is read as torch_dtype and "rope_parameters" (rope_type
// "default") as rope_theta, as newer transformers write them. INVALID_ARGUMENT naming the field
// for a missing required field or a value of the wrong type or range; UNIMPLEMENTED naming the
// field for model_type other than "qwen3", a non-null rope_scaling (other than rope_type
// "default"), use_sliding_window true, layer_types other than all "full_attention",
// attention_bias true, hidden_act other than "silu", or a non-zero attention_dropout.
absl::StatusOr<Qwen3Config> ParseQwen3Config(std::string_view json);

// Reads `path`, a config.json or a directory holding one. Errors as ParseQwen3Config, prefixed by
// the file's path; NOT_FOUND if it does not exist.
absl::StatusOr<Qwen3Config> LoadQwen3Config(const std::string& path);

// A Hugging Face compatible config.json (2-space indent, sorted keys, trailing newline):
// model_type "qwen3", architectures ["Qwen3ForCausalLM"], every field of the struct, and
// hidden_act "silu", rope_scaling null, use_sliding_window false, sliding_window null,
// max_window_layers = num_hidden_layers, attention_dropout 0, initializer_range 0.02,
// use_cache true. Parsing it gives the same config back, bit for bit.
std::string Qwen3ConfigToJson(const Qwen3Config& config);

// Validates the config and writes <directory>/config.json (creating the directory, replacing the
// file atomically). With `base_config` (the config.json the model was loaded from), the fields this
// struct does not model (bos_token_id, eos_token_id, ...) are kept from it, as inference engines
// read them; the fields it models are this config's (also under "dtype" and "rope_parameters" when
// the base spells them so), and the base is ignored if the result would not parse back to this
// config. UNAVAILABLE naming the file if it cannot be read or written, INVALID_ARGUMENT if the
// base is not a JSON object.
absl::Status SaveQwen3Config(const Qwen3Config& config, const std::string& directory,
                             const std::string& base_config = "");

// The released model shapes, as in their Hugging Face config.json: "qwen3-0.6b", "qwen3-1.7b",
// "qwen3-4b", "qwen3-8b" (case-insensitive, an optional "Qwen/" prefix allowed). NOT_FOUND listing
// the known names otherwise.
absl::StatusOr<Qwen3Config> Qwen3ConfigPreset(std::string_view name);

// A preset if `name` is one (Qwen3ConfigPreset), else the config.json at path `name`
// (LoadQwen3Config, whose error is returned when neither works).
absl::StatusOr<Qwen3Config> Qwen3ConfigFromName(std::string_view name);

// The preset names, smallest model first.
std::vector<std::string> Qwen3ConfigPresetNames();

}  // namespace dta

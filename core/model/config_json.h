// ModelConfig as Hugging Face's config.json: parsed with the family's transformers defaults for
// absent fields, refused with an error naming the field where dta would compute something else,
// and written so that transformers, SGLang and vLLM load it and parsing gives the config back.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/model/model_config.h"

namespace dta {

// Parses a config.json. Required: hidden_size, intermediate_size, num_hidden_layers,
// num_attention_heads. model_type defaults to "qwen3". Absent optional fields take the defaults of
// the family's transformers config (which is what Hugging Face would compute from the same file,
// and differs from this struct's defaults): rms_norm_eps 1e-6, rope_theta 10000,
// tie_word_embeddings false, torch_dtype "float32"; qwen3: vocab_size 151936, head_dim 128,
// max_position_embeddings 32768; qwen2: vocab_size 151936, head_dim hidden_size /
// num_attention_heads, max_position_embeddings 32768; llama: vocab_size 32000, head_dim
// hidden_size / num_attention_heads, max_position_embeddings 2048, attention_bias false. One
// exception: an absent num_key_value_heads is num_attention_heads for every family, where
// transformers' Qwen2 and Qwen3 configs would take 32 (no published config omits it). "dtype" is
// read as torch_dtype. Rope as transformers 5 reads it: the rope_scaling object when present and
// not empty, else rope_parameters; its rope_theta, else the top-level rope_theta; its rope_type (or
// "type"); for llama3 and yarn the top-level original_max_position_embeddings, else the object's,
// else max_position_embeddings; for yarn a null factor is max_position_embeddings /
// original_max_position_embeddings, a null truncate false, a null or 0 beta_fast 32 and beta_slow
// 1. INVALID_ARGUMENT naming the field for a missing required field (factor for linear, llama3 and
// yarn, low_freq_factor and high_freq_factor for llama3) or a value of the wrong type or range;
// UNIMPLEMENTED naming the field for a model_type other than "qwen3", "qwen2", "llama", a rope
// type other than "default", "linear", "llama3", "yarn", partial_rotary_factor other than 1,
// hidden_act other than "silu", a non-zero attention_dropout, attention_bias true on qwen3,
// mlp_bias true on llama, and on qwen2/qwen3/qwen3_moe use_sliding_window true or layer_types other
// than all "full_attention". qwen3_moe (transformers' Qwen3MoeConfig defaults): head_dim
// hidden_size / num_attention_heads, intermediate_size 6144 (not required), num_experts 128 (or
// num_local_experts; INVALID_ARGUMENT if both are given and differ), num_experts_per_tok 8,
// moe_intermediate_size 768, norm_topk_prob false, decoder_sparse_step 1, mlp_only_layers [] (null
// too), router_aux_loss_coef 0.001, output_router_logits false; the MoE fields of other families'
// config.json are ignored, as transformers ignores them. qwen3_5_text and qwen3_5_moe_text
// (Qwen3_5TextConfig's and Qwen3_5MoeTextConfig's defaults; the latter reads neither
// intermediate_size nor decoder_sparse_step, mlp_only_layers and norm_topk_prob, which its
// transformers config does not have): a config.json of the vision-language model around them
// (model_type "qwen3_5" or "qwen3_5_moe", as the Hub's Qwen3.5 models are) is read as its
// text_config, whose model_type must be the family's or absent, with the outer
// tie_word_embeddings when given (the vision-language model ties by it); its vision_config is
// ignored, and errors inside are prefixed "text_config: ".
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json);

// Reads `path`, a config.json or a directory holding one. Errors as ParseModelConfig, prefixed by
// the file's path; NOT_FOUND if it does not exist.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

// A Hugging Face compatible config.json (2-space indent, sorted keys, trailing newline): the
// family's model_type and architectures (["Qwen3ForCausalLM"], ["Qwen2ForCausalLM"],
// ["LlamaForCausalLM"], ["Qwen3MoeForCausalLM"], ["Qwen3NextForCausalLM"], ["Qwen3_5ForCausalLM"],
// ["Qwen3_5MoeForCausalLM"]: the decoder alone, never the vision-language model), every field of
// the struct that the family's transformers config has (attention_bias for qwen3 and llama;
// head_dim always, which transformers' Qwen2 also reads), rope_scaling (null for the default rope,
// else the type's fields with "rope_type"), hidden_act "silu", attention_dropout 0,
// initializer_range 0.02, use_cache true; qwen2 and qwen3 also use_sliding_window false,
// sliding_window null, max_window_layers = num_hidden_layers; llama mlp_bias false and
// pretraining_tp 1; qwen3_moe every MoE field of the struct (num_experts under that name, as the
// Hub's config.json has it); qwen3_next its MoE and linear_* fields, layer_types as strings (and
// full_attention_interval when one reproduces them, which several inference engines read instead),
// partial_rotary_factor at the top level and in a rope_parameters object beside rope_theta;
// qwen3_5_text and qwen3_5_moe_text as qwen3_next, without the fields their transformers configs
// lack (qwen3_5_text: the MoE fields; qwen3_5_moe_text: intermediate_size, decoder_sparse_step,
// mlp_only_layers, norm_topk_prob). Parsing it gives the same config back, bit for bit.
std::string ModelConfigToJson(const ModelConfig& config);

// Validates the config and writes <directory>/config.json (creating the directory, replacing the
// file atomically). With `base_config` (the config.json the model was loaded from), the fields this
// struct does not model (bos_token_id, eos_token_id, ...) are kept from it, as inference engines
// read them; the fields it models are this config's (also under "dtype" and "rope_parameters" when
// the base spells them so, and num_local_experts; the base's mrope_section and mrope_interleaved
// stay in rope_parameters), and the base is ignored if the result would not parse back to this
// config. A vision-language model's config.json as the base (ParseModelConfig) contributes its
// text_config. UNAVAILABLE naming the file if it cannot be read or written,
// INVALID_ARGUMENT if the base is not a JSON object.
absl::Status SaveModelConfig(const ModelConfig& config, const std::string& directory,
                             const std::string& base_config = "");

// A preset if `name` is one (ModelPreset), else the config.json at path `name`
// (LoadModelConfig, whose error is returned when neither works).
absl::StatusOr<ModelConfig> ModelConfigFromName(std::string_view name);

}  // namespace dta

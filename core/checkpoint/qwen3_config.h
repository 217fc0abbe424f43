// The decoder's configuration, read from and written to Hugging Face's config.json: one struct for
// every family of core/checkpoint/model_family.h (DescribeModelFamilies() lists them), told apart
// by model_type.
//
// Supported beyond the families' dense architecture: rope scaling of types "linear", "llama3" and
// "yarn" (transformers' rope_init_fn of each, modeling_rope_utils.py), attention biases where the
// family has them. A config.json asking for anything else (another model_type, rope types
// "dynamic", "longrope" and others, partial_rotary_factor other than 1 outside the families that
// have it (qwen3_next), sliding-window attention, mlp_bias true, a hidden_act other than silu,
// attention dropout, Qwen3 with attention biases) is refused with UNIMPLEMENTED naming the field
// rather than silently loaded into a model that would compute something else. Fields this struct
// does not model (bos_token_id, transformers_version, initializer_range, use_cache, ...) are
// accepted and ignored.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/checkpoint/model_family.h"

namespace dta {

// transformers' rope_type: how RoPE's inverse frequencies are scaled.
enum class RopeType {
  kDefault,  // inv_freq = 1 / rope_theta^(2i / head_dim)
  kLinear,   // inv_freq / factor
  kLlama3,   // Llama 3.1: low frequencies / factor, high ones kept, a smooth band between
  kYarn,     // YaRN: a ramp between interpolated and extrapolated frequencies; cos and sin scaled
};

// "default", "linear", "llama3", "yarn".
std::string_view RopeTypeName(RopeType type);

// config.json's rope_scaling (older transformers) or rope_parameters (transformers 5), less
// rope_theta (ModelConfig::rope_theta). Each type reads only its own fields; the others keep these
// defaults, so that two configs of one model compare equal.
struct RopeScaling {
  RopeType type = RopeType::kDefault;
  double factor = 1.0;                           // linear, llama3, yarn
  int64_t original_max_position_embeddings = 0;  // llama3, yarn (the pretraining context)
  double low_freq_factor = 1.0;                  // llama3
  double high_freq_factor = 4.0;                 // llama3
  double beta_fast = 32.0;                       // yarn (transformers: 32 when absent or 0)
  double beta_slow = 1.0;                        // yarn (transformers: 1 when absent or 0)
  // yarn, as config.json gives them (absent: nullopt); RopeAttentionFactor combines them.
  std::optional<double> attention_factor = std::nullopt;
  std::optional<double> mscale = std::nullopt;
  std::optional<double> mscale_all_dim = std::nullopt;
  bool truncate = true;  // yarn: floor/ceil the correction range

  bool operator==(const RopeScaling&) const = default;
};

// What cos and sin are multiplied by: YaRN's attention factor (the explicit attention_factor, else
// (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1) when both are non-zero, else
// 0.1 ln(factor) + 1, each term 1 for factor <= 1), as transformers' _compute_yarn_parameters;
// 1 for every other type.
double RopeAttentionFactor(const RopeScaling& rope);

// config.json's rope_scaling value, on one line: "null" for the default rope, else an object with
// rope_type and the type's fields.
std::string RopeScalingToJson(const RopeScaling& rope);

// A decoder layer's token mixer (config.json's layer_types).
enum class LayerType {
  kFullAttention,    // "full_attention": softmax attention over K/V
  kLinearAttention,  // "linear_attention": Gated DeltaNet (qwen3_next)
};

struct ModelConfig {
  // The family (core/checkpoint/model_family.h): "qwen3", "qwen2" or "llama".
  std::string model_type = "qwen3";
  int64_t vocab_size = 151936;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1000000.0;
  RopeScaling rope_scaling = {};
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 40960;
  std::string torch_dtype = "bfloat16";  // "bfloat16", "float16", "float32" or "float64"
  // Whether q_proj, k_proj and v_proj have biases: false for qwen3 (true is refused), true for
  // qwen2 (always), config.json's attention_bias for llama (where o_proj then has one too:
  // HasOProjBias).
  bool attention_bias = false;

  // Sparse mixture of experts (qwen3_moe only; every other family keeps these defaults, which
  // ValidateModelConfig checks). A layer is sparse iff IsSparseLayer; the others are dense SwiGLU
  // MLPs of intermediate_size.
  int64_t num_experts = 0;                    // experts per sparse layer (config.json: also
                                              // num_local_experts, as transformers 5 writes it)
  int64_t num_experts_per_tok = 0;            // top-k: the experts each token is routed to
  int64_t moe_intermediate_size = 0;          // each expert's SwiGLU width
  bool norm_topk_prob = false;                // renormalise the top-k routing weights to sum to 1
  int64_t decoder_sparse_step = 1;            // every decoder_sparse_step-th layer is sparse
  std::vector<int64_t> mlp_only_layers = {};  // layers that stay dense whatever the step
  // Accepted and written back for transformers, not used: dta's RL losses do not include the
  // router's load-balancing auxiliary loss (yet).
  double router_aux_loss_coef = 0.0;
  bool output_router_logits = false;

  // RoPE rotates the first int(head_dim * partial_rotary_factor) dimensions of each head and passes
  // the rest (transformers' partial rotary; qwen3_next only, 1 elsewhere). The rotary dimension
  // must be even and positive.
  double partial_rotary_factor = 1.0;

  // Qwen3-Next's hybrid layers (qwen3_next only; every other family keeps these defaults).
  // Per decoder layer, its token mixer; empty means every layer is full attention.
  std::vector<LayerType> layer_types = {};
  // The Gated DeltaNet layers' sizes (executor/model/gated_delta_net.h's GatedDeltaNetShape).
  int64_t linear_num_key_heads = 0;
  int64_t linear_num_value_heads = 0;  // a multiple of linear_num_key_heads
  int64_t linear_key_head_dim = 0;
  int64_t linear_value_head_dim = 0;
  int64_t linear_conv_kernel_dim = 0;  // the short causal convolution's taps
  // The sparse blocks' shared expert (a SwiGLU MLP of this width with a sigmoid gate).
  int64_t shared_expert_intermediate_size = 0;

  bool operator==(const ModelConfig&) const = default;
};

// Whether decoder layer `layer` is a Gated DeltaNet (linear-attention) layer: layer_types says
// "linear_attention" there. False for every layer of the other families.
bool IsLinearAttentionLayer(const ModelConfig& config, int64_t layer);

// The number of dimensions of each head that RoPE rotates: int(head_dim * partial_rotary_factor)
// (head_dim without partial rotary).
int64_t RotaryDim(const ModelConfig& config);

// The family's trait (core/checkpoint/model_family.h) for a config; false for a model_type
// without a family.
bool HasZeroCentredNorms(const ModelConfig& config);
bool HasGatedAttention(const ModelConfig& config);
bool HasSharedExpert(const ModelConfig& config);

// Whether the config's family has mixture-of-experts layers (qwen3_moe).
bool IsMoe(const ModelConfig& config);

// Whether decoder layer `layer` (0-based) is a sparse mixture-of-experts block, by transformers'
// rule (Qwen3MoeDecoderLayer): the family is MoE, `layer` is not in mlp_only_layers, num_experts >
// 0 and (layer + 1) % decoder_sparse_step == 0. False for every layer of the dense families.
bool IsSparseLayer(const ModelConfig& config, int64_t layer);

// The family's traits for a config (a config whose model_type has no family has q/k norms and no
// o_proj bias here; ValidateModelConfig refuses it).
bool HasQkNorm(const ModelConfig& config);
bool HasOProjBias(const ModelConfig& config);

// OK if the config describes a model this project can build: model_type one of the families
// (UNIMPLEMENTED otherwise), every size positive, num_attention_heads a multiple of
// num_key_value_heads (and, for llama, hidden_size a multiple of num_attention_heads, as
// transformers requires), rms_norm_eps and rope_theta positive and finite, torch_dtype one of the
// four above, the rope scaling's numbers in range (factor, attention_factor and the betas positive
// and finite, high_freq_factor > low_freq_factor > 0, original_max_position_embeddings positive for
// llama3 and yarn), attention_bias as the family allows (INVALID_ARGUMENT naming the field
// otherwise); UNIMPLEMENTED for attention_bias on qwen3 and qwen3_moe. qwen3_moe: num_experts,
// num_experts_per_tok and moe_intermediate_size positive, num_experts_per_tok <= num_experts,
// decoder_sparse_step positive, mlp_only_layers distinct layers in [0, num_hidden_layers),
// router_aux_loss_coef finite and >= 0; other families: those fields at their defaults
// (INVALID_ARGUMENT naming the field). qwen3_next: the same MoE rules except that num_experts may
// be 0, shared_expert_intermediate_size positive with experts, layer_types one entry per layer,
// the linear_* sizes positive when a layer is linear with value heads a multiple of key heads,
// partial_rotary_factor in (0, 1] with an even RotaryDim of at least 2; other families: empty
// layer_types, the linear and shared-expert fields 0 and partial_rotary_factor 1.
absl::Status ValidateModelConfig(const ModelConfig& config);

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
// config.json are ignored, as transformers ignores them.
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json);

// Reads `path`, a config.json or a directory holding one. Errors as ParseModelConfig, prefixed by
// the file's path; NOT_FOUND if it does not exist.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

// A Hugging Face compatible config.json (2-space indent, sorted keys, trailing newline): the
// family's model_type and architectures (["Qwen3ForCausalLM"], ["Qwen2ForCausalLM"],
// ["LlamaForCausalLM"], ["Qwen3MoeForCausalLM"], ["Qwen3NextForCausalLM"]), every field of the
// struct that the family's transformers config has (attention_bias for qwen3 and llama; head_dim
// always, which transformers' Qwen2 also reads), rope_scaling (null for the default rope, else the
// type's fields with "rope_type"), hidden_act "silu", attention_dropout 0, initializer_range 0.02,
// use_cache true; qwen2 and qwen3 also use_sliding_window false, sliding_window null,
// max_window_layers = num_hidden_layers; llama mlp_bias false and pretraining_tp 1; qwen3_moe every
// MoE field of the struct (num_experts under that name, as the Hub's config.json has it);
// qwen3_next its MoE and linear_* fields, layer_types as strings (and full_attention_interval when
// one reproduces them, which several inference engines read instead), partial_rotary_factor at the
// top level and in a rope_parameters object beside rope_theta. Parsing it gives the same config
// back, bit for bit.
std::string ModelConfigToJson(const ModelConfig& config);

// Validates the config and writes <directory>/config.json (creating the directory, replacing the
// file atomically). With `base_config` (the config.json the model was loaded from), the fields this
// struct does not model (bos_token_id, eos_token_id, ...) are kept from it, as inference engines
// read them; the fields it models are this config's (also under "dtype" and "rope_parameters" when
// the base spells them so, and num_local_experts), and the base is ignored if the result would not
// parse back to this config. UNAVAILABLE naming the file if it cannot be read or written,
// INVALID_ARGUMENT if the base is not a JSON object.
absl::Status SaveModelConfig(const ModelConfig& config, const std::string& directory,
                             const std::string& base_config = "");

// The released model shapes, as in their Hugging Face config.json: "qwen3-0.6b", "qwen3-1.7b",
// "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen2.5-1.5b" (Qwen2.5-1.5B-Instruct),
// "llama-3.2-1b", "llama-3.1-8b", "qwen3-30b-a3b" (Qwen3-30B-A3B), and "qwen3-moe-small" (not a
// released model: Qwen3-30B-A3B's layers, 4 of its 48, 3.1B parameters, for benchmarks on one 80 GB
// GPU), "qwen3-next-80b-a3b" (Qwen3-Next-80B-A3B-Instruct) and "qwen3-next-small" (not a
// released model: 4 of its layers, three linear and one full, with 128 experts instead of 512,
// 2.4B parameters, 0.89B active) (case-insensitive, an optional "Qwen/" or "meta-llama/" prefix
// allowed). NOT_FOUND listing the known names otherwise.
absl::StatusOr<ModelConfig> ModelPreset(std::string_view name);

// A preset if `name` is one (ModelPreset), else the config.json at path `name`
// (LoadModelConfig, whose error is returned when neither works).
absl::StatusOr<ModelConfig> ModelConfigFromName(std::string_view name);

// The preset names: Qwen3 smallest first, then Qwen2.5, then Llama smallest first, then Qwen3-MoE,
// then Qwen3-Next.
std::vector<std::string> ModelPresetNames();

// The struct's name before it served every family; gone in the next release.
using Qwen3Config [[deprecated("use dta::ModelConfig")]] = ModelConfig;

}  // namespace dta

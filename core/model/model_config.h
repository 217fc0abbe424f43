// The decoder's configuration: one struct for every family of core/model/family.h
// (DescribeModelFamilies() lists them), told apart by model_type, with the rules that say which
// configs dta can build (ValidateModelConfig) and the named presets of the released models.
// config_json.h reads and writes it as Hugging Face's config.json; layer_spec.h derives each
// layer's blocks and parameters from it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/model/family.h"
#include "core/model/rope_config.h"

namespace dta {

// A decoder layer's token mixer (config.json's layer_types).
enum class LayerType {
  kFullAttention,    // "full_attention": softmax attention over K/V
  kLinearAttention,  // "linear_attention": Gated DeltaNet (qwen3_next, qwen3_5_*)
};

struct ModelConfig {
  // The family (core/model/family.h), e.g. "qwen3".
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

  // Sparse mixture of experts (the MoE families: qwen3_moe, qwen3_next, qwen3_5_moe_text; every
  // other family keeps these defaults, which ValidateModelConfig checks). A layer is sparse iff
  // IsSparseLayer; the others are dense SwiGLU MLPs of intermediate_size (0 for qwen3_5_moe_text,
  // which has none).
  int64_t num_experts = 0;                    // experts per sparse layer (config.json: also
                                              // num_local_experts, as transformers 5 writes it)
  int64_t num_experts_per_tok = 0;            // top-k: the experts each token is routed to
  int64_t moe_intermediate_size = 0;          // each expert's SwiGLU width
  bool norm_topk_prob = false;                // renormalise the top-k routing weights to sum to 1
  int64_t decoder_sparse_step = 1;            // every decoder_sparse_step-th layer is sparse
  std::vector<int64_t> mlp_only_layers = {};  // layers that stay dense whatever the step
  // Read and written back for transformers. Training takes the load-balancing loss's weight from
  // LossOptions::router_aux_loss_coef (--router_aux_loss_coef), not from here.
  double router_aux_loss_coef = 0.0;
  bool output_router_logits = false;

  // RoPE rotates the first int(head_dim * partial_rotary_factor) dimensions of each head and passes
  // the rest (transformers' partial rotary; the hybrid families only, 1 elsewhere). The rotary
  // dimension must be even and positive.
  double partial_rotary_factor = 1.0;

  // The hybrid layers (qwen3_next, qwen3_5_text, qwen3_5_moe_text; every other family keeps
  // these defaults).
  // Per decoder layer, its token mixer; empty means every layer is full attention.
  std::vector<LayerType> layer_types = {};
  // The Gated DeltaNet layers' sizes (executor/model/ops/gated_delta_net.h's GatedDeltaNetShape).
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

// The family's trait (core/model/family.h) for a config; false for a model_type
// without a family. HasSeparateLinearProjections: separate_linear_projections.
bool HasZeroCentredNorms(const ModelConfig& config);
bool HasGatedAttention(const ModelConfig& config);
bool HasSharedExpert(const ModelConfig& config);
bool HasSeparateLinearProjections(const ModelConfig& config);

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
// layer_types, the linear and shared-expert fields 0 and partial_rotary_factor 1. qwen3_5_text:
// qwen3_next's hybrid rules without experts. qwen3_5_moe_text: qwen3_next's with experts in every
// layer (num_experts positive, intermediate_size 0, decoder_sparse_step 1, no mlp_only_layers,
// norm_topk_prob true).
absl::Status ValidateModelConfig(const ModelConfig& config);

// The released model shapes, as in their Hugging Face config.json: "qwen3-0.6b", "qwen3-1.7b",
// "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen2.5-1.5b" (Qwen2.5-1.5B-Instruct),
// "llama-3.2-1b", "llama-3.1-8b", "qwen3-30b-a3b" (Qwen3-30B-A3B), "qwen3-235b-a22b"
// (Qwen3-235B-A22B), and "qwen3-moe-small" (not a
// released model: Qwen3-30B-A3B's layers, 4 of its 48, 3.1B parameters, for benchmarks on one 80 GB
// GPU), "qwen3-next-80b-a3b" (Qwen3-Next-80B-A3B-Instruct) and "qwen3-next-small" (not a
// released model: 4 of its layers, three linear and one full, with 128 experts instead of 512,
// 2.4B parameters, 0.89B active) (case-insensitive, an optional "Qwen/" or "meta-llama/" prefix
// allowed). NOT_FOUND listing the known names otherwise.
absl::StatusOr<ModelConfig> ModelPreset(std::string_view name);

// The preset names: Qwen3 smallest first, then Qwen2.5, then Llama smallest first, then Qwen3-MoE,
// then Qwen3-Next.
std::vector<std::string> ModelPresetNames();

// The struct's name before it served every family; gone in the next release.
using Qwen3Config [[deprecated("use dta::ModelConfig")]] = ModelConfig;

}  // namespace dta

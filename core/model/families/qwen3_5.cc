// qwen3_5_text and qwen3_5_moe_text: transformers' Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM,
// the language models of Qwen3.5 (e.g. Qwen3.5-27B and Qwen3.5-35B-A3B), one file for the two.
// Qwen3-Next's hybrid layers (Gated DeltaNet interleaved with gated attention, zero-centred
// RMSNorms, partial RoPE, q/k norms, attention biases from config.json) with the Gated DeltaNet's
// input projections separate (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), and dense SwiGLU
// MLPs or, in the mixture-of-experts model, Qwen3-Next's sparse block with a shared expert in
// every layer. Their RoPE is mRoPE, whose three position components are equal for text: then it
// is exactly the plain partial RoPE (mrope_section only picks which component each frequency
// reads). The Hub's Qwen3.5 models are vision-language checkpoints ("qwen3_5" and "qwen3_5_moe",
// Qwen3_5(Moe)ForConditionalGeneration): dta reads their text_config and their language model's
// tensors, as transformers' causal LM classes do, and skips the vision tower and the multi-token
// prediction head.
#include <string_view>

#include "core/model/families/families.h"

namespace dta {
namespace {

constexpr std::string_view kIgnored[] = {"mtp.", "model.visual."};

// transformers 5's Qwen3_5TextConfig defaults; with `moe`, Qwen3_5MoeTextConfig's.
constexpr ModelFamily Qwen35(bool moe) {
  ModelFamily family = {.model_type = moe ? "qwen3_5_moe_text" : "qwen3_5_text",
                        .architecture = moe ? "Qwen3_5MoeForCausalLM" : "Qwen3_5ForCausalLM",
                        .name = moe ? "Qwen3.5-MoE" : "Qwen3.5",
                        .qk_norm = true,
                        .attention_bias = AttentionBiasRule::kFromConfig,
                        .default_vocab_size = 248320,
                        .default_head_dim = 256,
                        .default_max_position_embeddings = 32768,
                        .sliding_window_fields = false,
                        .mlp_bias_field = false,
                        .hidden_divisible_by_heads = false,
                        .moe = moe,
                        .zero_centred_norms = true,
                        .gated_attention = true,
                        .shared_expert = moe,
                        .linear_attention = true,
                        .partial_rotary = true,
                        .default_partial_rotary_factor = 0.25,
                        .default_num_key_value_heads = moe ? 2 : 4,
                        .separate_linear_projections = true,
                        .every_layer_sparse = moe,
                        .multimodal_model_type = moe ? "qwen3_5_moe" : "qwen3_5",
                        .ignored_checkpoint_prefixes = kIgnored,
                        .linear_defaults = {.num_key_heads = 16,
                                            .num_value_heads = 32,
                                            .key_head_dim = 128,
                                            .value_head_dim = 128,
                                            .conv_kernel_dim = 4}};
  if (moe) {
    family.moe_defaults = {.num_experts = 256,
                           .num_experts_per_tok = 8,
                           .moe_intermediate_size = 512,
                           .shared_expert_intermediate_size = 512,
                           .norm_topk_prob = true};
  }
  return family;
}

}  // namespace

constexpr ModelFamily kQwen3_5TextFamily = Qwen35(/*moe=*/false);
constexpr ModelFamily kQwen3_5MoeTextFamily = Qwen35(/*moe=*/true);

}  // namespace dta

// qwen3_next: transformers' Qwen3NextForCausalLM (Qwen3-Next-80B-A3B). Gated DeltaNet
// linear-attention layers interleaved with gated full attention (layer_types), zero-centred
// RMSNorms (1 + w), partial RoPE, q/k norms, attention biases from config.json (q/k/v and o_proj),
// and Qwen3-MoE's sparse blocks (where IsSparseLayer says, none when num_experts is 0) plus a
// shared expert with a sigmoid gate.
#include <string_view>

#include "core/model/families/families.h"

namespace dta {
namespace {

// Qwen3-Next-80B-A3B's shapes with `layers` layers of `experts` experts each.
constexpr ModelPresetShape Qwen3Next(const char* name, int64_t layers, int64_t experts) {
  return {.name = name,
          .vocab = 151936,
          .hidden = 2048,
          .intermediate = 5120,
          .layers = layers,
          .heads = 16,
          .kv_heads = 2,
          .head_dim = 256,
          .tie = false,
          .rope_theta = 1e7,
          .rms_norm_eps = 1e-6,
          .max_position_embeddings = 262144,
          .rope = {},
          .experts = experts,
          .experts_per_token = 10,
          .moe_intermediate = 512,
          .shared_expert = 512,
          .linear_key_heads = 16,
          .linear_value_heads = 32,
          .linear_head_dim = 128,
          .linear_conv_kernel = 4,
          .full_attention_interval = 4,
          .partial_rotary_factor = 0.25};
}

constexpr ModelPresetShape kPresets[] = {
    // Qwen/Qwen3-Next-80B-A3B-Instruct (and -Thinking): 79.7B parameters, 3.9B active per token.
    Qwen3Next("qwen3-next-80b-a3b", /*layers=*/48, /*experts=*/512),
    // Not a released model: Qwen3-Next-80B-A3B's layers, 4 of its 48 (three linear, one full
    // attention) with 128 of its 512 experts each (2.4B parameters, 0.9B active), for benchmarks
    // on one 80 GB GPU with its real layer shapes and routing.
    Qwen3Next("qwen3-next-small", /*layers=*/4, /*experts=*/128),
};

// Qwen3NextForCausalLM skips the Hub checkpoints' multi-token prediction head.
constexpr std::string_view kIgnored[] = {"mtp."};

}  // namespace

// transformers 5's Qwen3NextConfig defaults.
constexpr ModelFamily kQwen3NextFamily = {.model_type = "qwen3_next",
                                          .architecture = "Qwen3NextForCausalLM",
                                          .name = "Qwen3-Next",
                                          .qk_norm = true,
                                          .attention_bias = AttentionBiasRule::kFromConfig,
                                          .default_vocab_size = 151936,
                                          .default_head_dim = 256,
                                          .default_max_position_embeddings = 32768,
                                          .sliding_window_fields = false,
                                          .mlp_bias_field = false,
                                          .hidden_divisible_by_heads = false,
                                          .moe = true,
                                          .zero_centred_norms = true,
                                          .gated_attention = true,
                                          .shared_expert = true,
                                          .linear_attention = true,
                                          .partial_rotary = true,
                                          .default_partial_rotary_factor = 0.25,
                                          .default_num_key_value_heads = 2,
                                          .ignored_checkpoint_prefixes = kIgnored,
                                          .moe_defaults = {.intermediate_size = 5632,
                                                           .num_experts = 512,
                                                           .num_experts_per_tok = 10,
                                                           .moe_intermediate_size = 512,
                                                           .shared_expert_intermediate_size = 512,
                                                           .norm_topk_prob = true},
                                          .linear_defaults = {.num_key_heads = 16,
                                                              .num_value_heads = 32,
                                                              .key_head_dim = 128,
                                                              .value_head_dim = 128,
                                                              .conv_kernel_dim = 4},
                                          .presets = kPresets};

}  // namespace dta

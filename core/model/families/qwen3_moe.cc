// qwen3_moe: transformers' Qwen3MoeForCausalLM (Qwen3-30B-A3B, Qwen3-235B-A22B). Qwen3's attention
// (q/k norms, no biases) with sparse mixture-of-experts MLPs (a router and num_experts SwiGLU
// experts, top-k routing) in the layers ModelConfig's IsSparseLayer picks, dense SwiGLU MLPs of
// intermediate_size in the others; head_dim defaults to hidden_size / heads.
#include "core/model/families/families.h"

namespace dta {
namespace {

// Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.3B active per token.
constexpr ModelPresetShape kQwen3_30B_A3B = {"qwen3-30b-a3b", 151936, 2048, 6144,  48, 32,  4, 128,
                                             false,           1e6,    1e-6, 40960, {}, 128, 8, 768};

// The same shape under another name with fewer layers.
constexpr ModelPresetShape WithLayers(ModelPresetShape shape, const char* name, int64_t layers) {
  shape.name = name;
  shape.layers = layers;
  return shape;
}

constexpr ModelPresetShape kPresets[] = {
    kQwen3_30B_A3B,
    // Qwen/Qwen3-235B-A22B: 235B parameters, 22B active per token.
    {"qwen3-235b-a22b",
     151936,
     4096,
     12288,
     94,
     64,
     4,
     128,
     false,
     1e6,
     1e-6,
     40960,
     {},
     128,
     8,
     1536},
    // Not a released model: Qwen3-30B-A3B's first 4 layers (3.1B parameters, 0.9B active), for
    // benchmarks on one 80 GB GPU with its real expert shapes and routing.
    WithLayers(kQwen3_30B_A3B, "qwen3-moe-small", 4),
};

}  // namespace

// transformers 5's Qwen3MoeConfig defaults.
constexpr ModelFamily kQwen3MoeFamily = {.model_type = "qwen3_moe",
                                         .architecture = "Qwen3MoeForCausalLM",
                                         .name = "Qwen3-MoE",
                                         .qk_norm = true,
                                         .attention_bias = AttentionBiasRule::kNone,
                                         .default_vocab_size = 151936,
                                         .default_head_dim = 0,
                                         .default_max_position_embeddings = 32768,
                                         .sliding_window_fields = true,
                                         .mlp_bias_field = false,
                                         .hidden_divisible_by_heads = false,
                                         .moe = true,
                                         .num_local_experts_alias = true,
                                         .moe_defaults = {.intermediate_size = 6144,
                                                          .num_experts = 128,
                                                          .num_experts_per_tok = 8,
                                                          .moe_intermediate_size = 768},
                                         .presets = kPresets};

}  // namespace dta

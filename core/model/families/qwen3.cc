// qwen3: transformers' Qwen3ForCausalLM (Qwen3 0.6B to 32B). Per-head q/k RMSNorm before RoPE, no
// attention biases, head_dim 128 by default.
#include "core/model/families/families.h"

namespace dta {
namespace {

// As in the models' config.json on the Hugging Face Hub.
constexpr ModelPresetShape kPresets[] = {
    {"qwen3-0.6b", 151936, 1024, 3072, 28, 16, 8, 128, true, 1e6, 1e-6, 40960, {}},
    {"qwen3-1.7b", 151936, 2048, 6144, 28, 16, 8, 128, true, 1e6, 1e-6, 40960, {}},
    {"qwen3-4b", 151936, 2560, 9728, 36, 32, 8, 128, true, 1e6, 1e-6, 40960, {}},
    {"qwen3-8b", 151936, 4096, 12288, 36, 32, 8, 128, false, 1e6, 1e-6, 40960, {}},
    {"qwen3-14b", 151936, 5120, 17408, 40, 40, 8, 128, false, 1e6, 1e-6, 40960, {}},
    {"qwen3-32b", 151936, 5120, 25600, 64, 64, 8, 128, false, 1e6, 1e-6, 40960, {}},
};

}  // namespace

// transformers 5's Qwen3Config defaults.
constexpr ModelFamily kQwen3Family = {.model_type = "qwen3",
                                      .architecture = "Qwen3ForCausalLM",
                                      .name = "Qwen3",
                                      .qk_norm = true,
                                      .attention_bias = AttentionBiasRule::kNone,
                                      .default_vocab_size = 151936,
                                      .default_head_dim = 128,
                                      .default_max_position_embeddings = 32768,
                                      .sliding_window_fields = true,
                                      .mlp_bias_field = false,
                                      .hidden_divisible_by_heads = false,
                                      .moe = false,
                                      .presets = kPresets};

}  // namespace dta

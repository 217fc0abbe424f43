// qwen2: transformers' Qwen2ForCausalLM (Qwen2, Qwen2.5). Biases on q_proj, k_proj and v_proj (not
// o_proj), always (its config.json has no attention_bias); no q/k norm.
#include "core/model/families/families.h"

namespace dta {
namespace {

constexpr ModelPresetShape kPresets[] = {
    // Qwen/Qwen2.5-1.5B-Instruct.
    {"qwen2.5-1.5b", 151936, 1536, 8960, 28, 12, 2, 128, true, 1e6, 1e-6, 32768, {}},
};

}  // namespace

// transformers 5's Qwen2Config defaults.
constexpr ModelFamily kQwen2Family = {.model_type = "qwen2",
                                      .architecture = "Qwen2ForCausalLM",
                                      .name = "Qwen2/Qwen2.5",
                                      .qk_norm = false,
                                      .attention_bias = AttentionBiasRule::kQkvAlways,
                                      .default_vocab_size = 151936,
                                      .default_head_dim = 0,
                                      .default_max_position_embeddings = 32768,
                                      .sliding_window_fields = true,
                                      .mlp_bias_field = false,
                                      .hidden_divisible_by_heads = false,
                                      .moe = false,
                                      .presets = kPresets};

}  // namespace dta

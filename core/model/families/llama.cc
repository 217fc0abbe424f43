// llama: transformers' LlamaForCausalLM (Llama 3, 3.1, 3.2). attention_bias (default false) puts
// biases on q_proj, k_proj, v_proj and o_proj, as transformers' LlamaAttention; mlp_bias must be
// false; no q/k norm; head_dim defaults to hidden_size / num_attention_heads.
#include "core/model/families/families.h"

namespace dta {
namespace {

// Llama 3.1's rope scaling with the given factor (Llama 3.2 uses 32).
constexpr RopeScaling Llama3Rope(double factor) {
  return {.type = RopeType::kLlama3,
          .factor = factor,
          .original_max_position_embeddings = 8192,
          .low_freq_factor = 1.0,
          .high_freq_factor = 4.0};
}

constexpr ModelPresetShape kPresets[] = {
    {"llama-3.2-1b", 128256, 2048, 8192, 16, 32, 8, 64, true, 500000.0, 1e-5, 131072,
     Llama3Rope(32.0)},
    {"llama-3.1-8b", 128256, 4096, 14336, 32, 32, 8, 128, false, 500000.0, 1e-5, 131072,
     Llama3Rope(8.0)},
};

}  // namespace

// transformers 5's LlamaConfig defaults.
constexpr ModelFamily kLlamaFamily = {.model_type = "llama",
                                      .architecture = "LlamaForCausalLM",
                                      .name = "Llama",
                                      .qk_norm = false,
                                      .attention_bias = AttentionBiasRule::kFromConfig,
                                      .default_vocab_size = 32000,
                                      .default_head_dim = 0,
                                      .default_max_position_embeddings = 2048,
                                      .sliding_window_fields = false,
                                      .mlp_bias_field = true,
                                      .hidden_divisible_by_heads = true,
                                      .moe = false,
                                      .presets = kPresets};

}  // namespace dta

// A family that exists only in the tests, to show that a family built from existing blocks is one
// file plus one registry line: Qwen2's always-on q/k/v biases, Qwen3's q/k norms, Qwen3-Next's
// zero-centred norms and sparse blocks with a shared expert, and no linear attention or gated
// attention (a combination no shipped family has). RegisterTestFamily() is its registry line; the
// float64 equivalence suites and the layer-spec tests run it like the shipped families.
#pragma once

#include "core/model/family.h"
#include "core/model/model_config.h"

namespace dta {

inline constexpr ModelFamily kTestHybridFamily = {
    .model_type = "dta_test_hybrid",
    .architecture = "DtaTestHybridForCausalLM",
    .name = "dta test hybrid",
    .qk_norm = true,
    .attention_bias = AttentionBiasRule::kQkvAlways,
    .default_vocab_size = 151936,
    .default_head_dim = 128,
    .default_max_position_embeddings = 32768,
    .sliding_window_fields = false,
    .mlp_bias_field = false,
    .hidden_divisible_by_heads = false,
    .moe = true,
    .zero_centred_norms = true,
    .shared_expert = true,
    .moe_defaults = {.intermediate_size = 5632,
                     .num_experts = 8,
                     .num_experts_per_tok = 2,
                     .moe_intermediate_size = 512,
                     .shared_expert_intermediate_size = 512,
                     .norm_topk_prob = true},
};

// Registers the family once per process (later calls do nothing).
inline void RegisterTestFamily() {
  static const bool registered = RegisterModelFamily(&kTestHybridFamily).ok();
  (void)registered;
}

// A tiny model of the family on top of `c` (a small Qwen3 config): 5 experts (top 2) and a shared
// expert of 5 in every layer but the first.
inline ModelConfig TestHybridModel(ModelConfig c) {
  c.model_type = std::string(kTestHybridFamily.model_type);
  c.attention_bias = true;
  c.num_experts = 5;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 6;
  c.norm_topk_prob = true;
  c.mlp_only_layers = {0};
  c.shared_expert_intermediate_size = 5;
  c.router_aux_loss_coef = 0.001;
  return c;
}

}  // namespace dta

// Rollouts, losses and comparisons shared by the executor's exactness tests (the methods against
// each other, tensor parallelism against one process).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/io/rollout.h"
#include "executor/engine/executor.h"
#include "executor/loss/loss.h"
#include "tests/testing/test_family.h"

namespace dta::testing {

// The executor tests' tiny model: 2 layers of hidden size 16 (4 heads of 8, 2 KV heads), MLP width
// 24, untied embeddings, a vocabulary of `vocab`.
inline ModelConfig TinyConfig(int64_t vocab = 19) {
  ModelConfig c;
  c.vocab_size = vocab;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = false;
  return c;
}

// `c` as a model of `family` ("qwen3": c itself) with what sets the family apart switched on:
// attention biases (q/k/v, and o_proj for "llama"), no q/k norms, and scaled RoPE whose every band
// matters within a few hundred positions at head_dim 8. "llama": llama3 scaling with theta 100
// (wavelengths 6.3 kept, 20 and 63 smoothed, 199 divided by the factor); "qwen2": YaRN (frequency 0
// extrapolated, 1 half-way, 2 and 3 interpolated; cos and sin scaled by 0.1 ln 4 + 1).
//
// "qwen3_moe": Qwen3's attention with every layer a sparse mixture of 5 experts of width 6, top-2
// renormalised (a width that no tensor-parallel size of 2 or 4 divides evenly).
//
// "qwen3_next" (2 layers or more): layer 0 a Gated DeltaNet layer (2 key heads serving 4 value
// heads, a 3-tap convolution) with a dense MLP, the others gated full attention with q/k/v/o
// biases, partial RoPE (half of each head) and a sparse block of 5 experts (top-2) plus a shared
// expert; every norm zero-centred.
//
// "qwen3_5_text": qwen3_next's layers with Qwen3.5's separate Gated DeltaNet projections and dense
// MLPs. "qwen3_5_moe_text": the same with qwen3_next's sparse block in every layer (the Gated
// DeltaNet layer's too).
//
// "dta_test_hybrid" (tests/testing/test_family.h, registered by RegisterTestFamily):
// TestHybridModel.
inline ModelConfig WithFamily(ModelConfig c, const std::string& family) {
  if (family == "qwen3") return c;
  if (family == "qwen3_next" || family == "qwen3_5_text" || family == "qwen3_5_moe_text") {
    c.model_type = family;
    c.attention_bias = true;
    c.partial_rotary_factor = 0.5;
    c.layer_types.assign(c.num_hidden_layers, LayerType::kFullAttention);
    c.layer_types[0] = LayerType::kLinearAttention;
    c.linear_num_key_heads = 2;
    c.linear_num_value_heads = 4;
    c.linear_key_head_dim = 4;
    c.linear_value_head_dim = 3;
    c.linear_conv_kernel_dim = 3;
    if (family == "qwen3_5_text") return c;
    c.num_experts = 5;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 6;
    c.norm_topk_prob = true;
    c.shared_expert_intermediate_size = 5;
    c.router_aux_loss_coef = 0.001;
    if (family == "qwen3_5_moe_text") {
      c.intermediate_size = 0;  // no dense MLP
    } else {
      c.mlp_only_layers = {0};
    }
    return c;
  }
  if (family == "qwen3_moe") {
    c.model_type = family;
    c.num_experts = 5;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 6;
    c.norm_topk_prob = true;
    c.router_aux_loss_coef = 0.001;
    return c;
  }
  if (family == kTestHybridFamily.model_type) return TestHybridModel(c);
  if (family != "llama" && family != "qwen2") {
    // A family the registry gained: the parametrized family tests fail until it has a model here.
    throw std::invalid_argument("WithFamily: no test model for family '" + family +
                                "' (tests/testing/executor_cases.h)");
  }
  c.model_type = family;
  c.attention_bias = true;
  if (family == "llama") {
    c.rope_theta = 100.0;
    c.rope_scaling = {.type = RopeType::kLlama3,
                      .factor = 8.0,
                      .original_max_position_embeddings = 64,
                      .low_freq_factor = 1.0,
                      .high_freq_factor = 4.0};
  } else {
    c.rope_theta = 10000.0;
    c.rope_scaling = {.type = RopeType::kYarn,
                      .factor = 4.0,
                      .original_max_position_embeddings = 32,
                      .beta_fast = 8.0,
                      .beta_slow = 0.5};
  }
  return c;
}

// Rollouts over the given token sequences with random masks, behaviour and reference
// log-probabilities, rewards, two GRPO groups, and per-token advantages on some.
inline std::vector<Rollout> MakeRollouts(const std::vector<std::vector<TokenId>>& sequences,
                                         uint64_t seed, int64_t vocab = 19) {
  const double center = -std::log(static_cast<double>(vocab));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<Rollout> rollouts;
  for (size_t i = 0; i < sequences.size(); ++i) {
    Rollout r;
    r.id = "r" + std::to_string(i);
    r.group = "g" + std::to_string(rng() % 2);
    r.tokens = sequences[i];
    const size_t n = r.tokens.size();
    for (size_t t = 0; t < n; ++t) {
      r.loss_mask.push_back(t > 0 && unit(rng) < 0.8);
      // Around the tiny model's own log-probabilities (about -log vocab), so PPO ratios land on
      // both sides of the clip range.
      r.logprobs.push_back(static_cast<float>(center + 0.6 * (unit(rng) - 0.5)));
      r.ref_logprobs.push_back(static_cast<float>(center + 0.6 * (unit(rng) - 0.5)));
    }
    r.reward = unit(rng);
    if (i % 3 == 2) {
      for (size_t t = 0; t < n; ++t) r.advantages.push_back(static_cast<float>(unit(rng) - 0.5));
    }
    rollouts.push_back(std::move(r));
  }
  return rollouts;
}

// |value - reference| / |reference| (Frobenius norms), or |value| when the reference is zero.
inline double RelativeError(const at::Tensor& value, const at::Tensor& reference) {
  const double scale = reference.norm().item<double>();
  const double diff = (value - reference).norm().item<double>();
  return scale > 0 ? diff / scale : diff;
}

// One of each loss kind and normalisation, entropy and KL terms included.
inline std::vector<std::pair<std::string, LossOptions>> Losses() {
  LossOptions sft{.kind = LossKind::kSft};
  LossOptions ppo{.kind = LossKind::kPpo};
  LossOptions dual{.kind = LossKind::kPpo,
                   .normalization = Normalization::kSequenceMean,
                   .eps_clip_low = 0.1,
                   .eps_clip_high = 0.28,
                   .dual_clip = 3.0};
  LossOptions decoupled{.kind = LossKind::kDecoupledPpo, .behave_imp_weight_cap = 5.0};
  LossOptions gspo{.kind = LossKind::kGspo};
  LossOptions regularized{.kind = LossKind::kPpo,
                          .normalization = Normalization::kSum,
                          .entropy_coef = 0.01,
                          .kl_coef = 0.05};
  return {{"sft", sft},
          {"ppo", ppo},
          {"ppo_dual_clip_seq_mean", dual},
          {"decoupled_ppo", decoupled},
          {"gspo", gspo},
          {"ppo_entropy_kl_sum", regularized}};
}

// One method's loss, log-probabilities and gradients (every parameter's .grad zeroed first, then
// cloned; zeros where a parameter got none).
// Every method once, with the options that exercise different model calls: dense with and without
// checkpointing, packed whole and partitioned into subtrees of `longest` tokens, dta at block sizes
// 1, 3 and unbounded, each also in lexicographic order with a graph budget and packing.
inline std::vector<std::pair<std::string, ExecutorOptions>> ExactnessMethods(int64_t longest) {
  std::vector<std::pair<std::string, ExecutorOptions>> methods = {
      {"dense", {.method = Method::kDense}},
      {"dense+ckpt", {.method = Method::kDense, .checkpointing = true}},
      {"packed", {.method = Method::kPacked}},
      {"packed capacity+ckpt",
       {.method = Method::kPacked, .token_capacity = longest, .checkpointing = true}},
  };
  for (int64_t block : {int64_t{1}, int64_t{3}, kUnboundedBlock}) {
    const std::string b = block == kUnboundedBlock ? "inf" : std::to_string(block);
    methods.push_back({"dta B=" + b, {.method = Method::kDta, .block_size = block, .pack = false}});
    methods.push_back({"dta B=" + b + " lex budget=6 packed",
                       {.method = Method::kDta,
                        .block_size = block,
                        .order = LeafOrderKind::kLexicographic,
                        .graph_budget = 6,
                        .pack = true}});
  }
  return methods;
}

struct MethodRun {
  GradientResult result;
  std::vector<at::Tensor> grads;
};

inline MethodRun RunMethod(const Decoder& model, const std::vector<Rollout>& rollouts,
                           const LossOptions& loss, const ExecutorOptions& options) {
  for (const auto& [name, p] : model.named_parameters()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  MethodRun run;
  run.result = ComputeGradients(model, rollouts, loss, options);
  for (const auto& [name, p] : model.named_parameters()) {
    run.grads.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
  }
  return run;
}

}  // namespace dta::testing

// Decoder's parameters: the layout planner's count (core/layout) is exactly what it allocates,
// for every family (q/k norms, attention biases), and InitRandom draws the same weights however
// many threads draw them.
#include <ATen/Parallel.h>

#include <string>

#include "core/layout/memory_plan.h"
#include "core/model/config_json.h"
#include "executor/model/decoder.h"

#include "gtest/gtest.h"

namespace dta {
namespace {

// CountParameters(c) is what a model of c allocates, in all and whole on every tensor-parallel rank
// (the norms, o_proj's bias). Returns how many of the model's elements are biases.
int64_t ExpectCountIsTheModels(const ModelConfig& c, const std::string& what) {
  const Decoder model(c, at::TensorOptions().dtype(at::kFloat));
  int64_t total = 0;
  int64_t replicated = 0;
  int64_t biases = 0;
  for (size_t i = 0; i < model.named_parameters().size(); ++i) {
    const auto& [name, p] = model.named_parameters()[i];
    total += p.numel();
    if (model.parameter_splits()[i].replicated()) replicated += p.numel();
    if (name.ends_with(".bias")) biases += p.numel();
  }
  const ParameterCount count = CountParameters(c);
  EXPECT_EQ(count.total(), total) << what;
  EXPECT_EQ(count.replicated, replicated) << what;
  return biases;
}

TEST(ParameterCount, EqualsTheModelsParameters) {
  for (const bool tie : {false, true}) {
    ModelConfig c;
    c.vocab_size = 37;
    c.hidden_size = 24;
    c.intermediate_size = 40;
    c.num_hidden_layers = 3;
    c.num_attention_heads = 6;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    c.tie_word_embeddings = tie;
    EXPECT_EQ(ExpectCountIsTheModels(c, tie ? "tied" : "untied"), 0);
  }
}

// The other families, from their config.json: biases, no q/k norms.
TEST(ParameterCount, CountsEachFamilysBiasesAndNorms) {
  auto config = [](const std::string& family, bool bias) {
    const absl::StatusOr<ModelConfig> c = ParseModelConfig(
        R"({"vocab_size": 37, "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 3,
            "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8, "model_type": ")" +
        family + R"(", "attention_bias": )" + (bias ? "true" : "false") + "}");
    EXPECT_TRUE(c.ok()) << c.status();
    return *c;
  };
  // q, k and v (6 + 2 + 2 heads of 8) in each of 3 layers; Llama's o_proj 24 more.
  const ModelConfig qwen2 = config("qwen2", false);  // Qwen2's q/k/v biases are not optional
  EXPECT_EQ(ExpectCountIsTheModels(qwen2, "qwen2"), 3 * 80);
  EXPECT_EQ(ExpectCountIsTheModels(config("llama", false), "llama"), 0);
  EXPECT_EQ(ExpectCountIsTheModels(config("llama", true), "llama with biases"), 3 * (80 + 24));
  // Without q/k norms: 2 x 8 fewer replicated elements per layer than Qwen3.
  EXPECT_EQ(CountParameters(config("qwen3", false)).replicated - CountParameters(qwen2).replicated,
            3 * 2 * 8);
}

// The embedding (2.56M elements) is drawn in three pieces of 2^20 from their own generators.
TEST(InitRandom, DrawsTheSameWeightsOnAnyNumberOfThreads) {
  ModelConfig c;
  c.vocab_size = 40000;
  c.hidden_size = 64;
  c.intermediate_size = 32;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 32;
  const int threads = at::get_num_threads();
  auto draw = [&](int with_threads, uint64_t seed) {
    at::set_num_threads(with_threads);
    Decoder model(c, at::TensorOptions().dtype(at::kDouble));
    model.InitRandom(seed);
    return model.named_parameters();
  };
  const auto one = draw(1, 7);
  const auto four = draw(4, 7);
  const auto other_seed = draw(4, 8);
  at::set_num_threads(threads);
  ASSERT_EQ(one.size(), four.size());
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_TRUE(at::equal(one[i].second, four[i].second)) << one[i].first;
    EXPECT_FALSE(at::equal(one[i].second, other_seed[i].second)) << one[i].first;
  }
  // N(0, 0.02), piece by piece: no two pieces drew the same numbers.
  const at::Tensor embedding = one.front().second.view(-1);
  ASSERT_EQ(one.front().first, "model.embed_tokens.weight");
  EXPECT_NEAR(embedding.std().item<double>(), 0.02, 2e-4);
  EXPECT_NEAR(embedding.mean().item<double>(), 0.0, 1e-4);
  const int64_t piece = int64_t{1} << 20;
  EXPECT_FALSE(at::equal(embedding.narrow(0, 0, 1000), embedding.narrow(0, piece, 1000)));
  EXPECT_FALSE(at::equal(embedding.narrow(0, 0, 1000), embedding.narrow(0, 2 * piece, 1000)));
}

// Qwen3-MoE: the stacked experts (sharded) and the routers (replicated) of the sparse layers, the
// dense MLPs of the others; the parameters a token uses are those of its top-k experts.
TEST(ParameterCount, CountsExpertsAndRouters) {
  const absl::StatusOr<ModelConfig> c = ParseModelConfig(
      R"({"vocab_size": 37, "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 5,
          "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8,
          "model_type": "qwen3_moe", "num_experts": 7, "num_experts_per_tok": 3,
          "moe_intermediate_size": 11, "decoder_sparse_step": 2, "mlp_only_layers": [3]})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(ExpectCountIsTheModels(*c, "qwen3_moe"), 0);
  // Layer 1 alone is sparse: 4 of its 7 experts of 3 x 24 x 11 are unused by each token.
  const ParameterCount count = CountParameters(*c);
  EXPECT_EQ(count.unused_per_token, 4 * 3 * 24 * 11);
  EXPECT_EQ(count.active(), count.total() - 4 * 3 * 24 * 11);
  ModelConfig dense = *c;
  dense.mlp_only_layers = {0, 1, 2, 3, 4};
  EXPECT_EQ(count.total() - CountParameters(dense).total(), 7 * 3 * 24 * 11 + 7 * 24 - 3 * 24 * 40);
  EXPECT_EQ(CountParameters(dense).unused_per_token, 0);
}

// Qwen3-Next: Gated DeltaNet layers instead of attention where layer_types says so (no q/k/v/o or
// q/k norms there), gated attention (q_proj twice as tall), and a shared expert with its gate in
// every sparse block; counted by hand from transformers' Qwen3NextForCausalLM shapes, then against
// the model's own parameters.
TEST(ParameterCount, CountsQwen3NextsLayers) {
  const absl::StatusOr<ModelConfig> c = ParseModelConfig(
      R"({"model_type": "qwen3_next", "vocab_size": 37, "hidden_size": 24,
          "intermediate_size": 40, "num_hidden_layers": 4, "num_attention_heads": 6,
          "num_key_value_heads": 2, "head_dim": 8, "attention_bias": true,
          "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 4,
          "linear_value_head_dim": 5, "linear_conv_kernel_dim": 3, "num_experts": 7,
          "num_experts_per_tok": 3, "moe_intermediate_size": 11,
          "shared_expert_intermediate_size": 13, "decoder_sparse_step": 2})");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(IsLinearAttentionLayer(*c, 0) && IsLinearAttentionLayer(*c, 2));
  ASSERT_TRUE(!IsLinearAttentionLayer(*c, 3) && IsSparseLayer(*c, 1) && IsSparseLayer(*c, 3));
  // Linear layer (key_dim 8, value_dim 30, conv_dim 46): in_proj_qkvz 76 x 24, in_proj_ba 12 x 24,
  // conv1d 46 x 1 x 3, dt_bias and A_log 6 each, norm 5, out_proj 24 x 30.
  const int64_t linear = 76 * 24 + 12 * 24 + 46 * 3 + 2 * 6 + 5 + 24 * 30;
  // Full attention: q_proj 96 x 24 (queries and gates) and its bias, k_proj and v_proj 16 x 24
  // with theirs, o_proj 24 x 48 and its bias, q_norm and k_norm 8 each.
  const int64_t attention = 96 * 24 + 96 + 2 * (16 * 24 + 16) + 24 * 48 + 24 + 2 * 8;
  // Sparse block: 7 experts of 3 x 24 x 11, the router 7 x 24, the shared expert 3 x 24 x 13 and
  // its gate 24; dense MLP 3 x 24 x 40.
  const int64_t sparse = 7 * 3 * 24 * 11 + 7 * 24 + 3 * 24 * 13 + 24;
  const int64_t dense = 3 * 24 * 40;
  // Layers: linear/dense, linear/sparse, linear/dense, attention/sparse; two norms of 24 each; the
  // final norm; embedding and lm_head 37 x 24.
  const int64_t total =
      3 * linear + attention + 2 * sparse + 2 * dense + 4 * 2 * 24 + 24 + 2 * 37 * 24;
  const ParameterCount count = CountParameters(*c);
  EXPECT_EQ(count.total(), total);
  EXPECT_EQ(count.unused_per_token, 2 * 4 * 3 * 24 * 11);  // 4 of 7 experts, in 2 sparse layers

  // Replicated: the norms (4 x 2 x 24 + 24), the linear layers' gated norms (3 x 5), the
  // attention layer's q/k norms (2 x 8) and o_proj's bias (24), the routers (2 x 7 x 24) and the
  // shared experts' gates (2 x 24).
  EXPECT_EQ(count.replicated, 4 * 2 * 24 + 24 + 3 * 5 + 2 * 8 + 24 + 2 * 7 * 24 + 2 * 24);
  // The model's own parameters (the q/k/v and o_proj biases).
  EXPECT_EQ(ExpectCountIsTheModels(*c, "qwen3_next"), 96 + 2 * 16 + 24);
}

// Qwen3-30B-A3B: 30.5B parameters, 3.3B active (Qwen's model card: "30.5B in total and 3.3B
// activated").
TEST(ParameterCount, Qwen3MoePresets) {
  const ParameterCount a3b = CountParameters(*ModelPreset("qwen3-30b-a3b"));
  EXPECT_EQ(a3b.total(), 30532122624);
  EXPECT_EQ(a3b.active(), 3353032704);
  const ParameterCount small = CountParameters(*ModelPreset("qwen3-moe-small"));
  EXPECT_LT(small.total(), 3300000000);
}

}  // namespace
}  // namespace dta

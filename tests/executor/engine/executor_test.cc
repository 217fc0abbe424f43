// ExecutorOptions' defaults (executor/engine/executor.h) and what they do: dta packs by default,
// and the layout planner's view of the defaults (ExecutorMemoryOf) is core/layout's own default
// ExecutorMemoryOptions, so that a plan made without the executor's options plans for them; the
// gradients a model's first step creates, which the automatic chunk plan leaves room for.
#include "executor/engine/executor.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "core/layout/executor_memory.h"
#include "gtest/gtest.h"
#include "tests/testing/executor_cases.h"

namespace dta {
namespace {

TEST(ExecutorOptions, DtaPacksByDefault) {
  const ExecutorOptions defaults;
  EXPECT_EQ(defaults.method, Method::kDta);
  EXPECT_TRUE(defaults.pack);
  EXPECT_EQ(defaults.block_size, kAutoBlockSize);
  EXPECT_EQ(defaults.graph_budget, kAutoGraphBudget);
}

// What the default runs, not only what it says: on a 64-way branch of two-token leaves, the
// default options take the packed schedule's steps (progress is reported once per step), fewer
// than the paper's schedule takes, with the same loss.
ModelConfig SmallConfig() {
  ModelConfig config;
  config.vocab_size = 19;
  config.hidden_size = 16;
  config.intermediate_size = 24;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 4;
  config.num_key_value_heads = 2;
  config.head_dim = 8;
  config.rope_theta = 10000.0;
  config.tie_word_embeddings = false;
  return config;
}

// What the automatic chunk plan leaves free for a model's first step: every gradient backward will
// create, in its accumulator dtype (float32 for bfloat16 weights), and none once they exist.
TEST(ExecutorOptions, TheFirstStepsGradientsAreCountedBeforeTheyExist) {
  for (const auto& [dtype, accumulator_bytes] :
       {std::pair{at::kDouble, 8}, std::pair{at::kBFloat16, 4}}) {
    Decoder model(SmallConfig(), at::TensorOptions().dtype(dtype));
    int64_t elements = 0;
    for (const auto& [name, p] : model.named_parameters()) elements += p.numel();
    EXPECT_EQ(model.UncreatedGradientBytes(), elements * accumulator_bytes);
    if (dtype != at::kDouble) continue;
    model.InitRandom(7, 0.3);
    testing::RunMethod(model, testing::MakeRollouts({{1, 2, 3}, {1, 2, 4}}, 3),
                       {.kind = LossKind::kSft}, {});
    EXPECT_EQ(model.UncreatedGradientBytes(), 0);
    const at::Tensor embed = model.parameter("model.embed_tokens.weight");
    embed.mutable_grad() = at::Tensor();
    EXPECT_EQ(model.UncreatedGradientBytes(), embed.numel() * 8);
  }
}

TEST(ExecutorOptions, TheDefaultRunsThePackedSchedule) {
  Decoder model(SmallConfig(), at::TensorOptions().dtype(at::kDouble));
  model.InitRandom(7, 0.3);
  std::vector<std::vector<TokenId>> sequences;
  for (TokenId i = 0; i < 64; ++i) sequences.push_back({1, 2, 3, 4, 5 + i % 8, 5 + i / 8, 7});
  const std::vector<Rollout> rollouts = testing::MakeRollouts(sequences, 9);

  struct Run {
    double loss = 0;
    int64_t steps = 0;
  };
  auto run = [&](ExecutorOptions options) {
    Run out;
    options.progress = [&out](int64_t, int64_t) { ++out.steps; };
    out.loss = testing::RunMethod(model, rollouts, {.kind = LossKind::kPpo}, options).result.loss;
    return out;
  };
  const Run defaults = run({});
  const Run packed = run({.pack = true});
  const Run unpacked = run({.pack = false});
  EXPECT_EQ(defaults.steps, packed.steps);
  EXPECT_LT(packed.steps, unpacked.steps);
  EXPECT_GE(unpacked.steps, static_cast<int64_t>(rollouts.size())) << "a step per leaf at least";
  EXPECT_EQ(defaults.loss, packed.loss);
  EXPECT_NEAR(unpacked.loss, packed.loss, 1e-12 * std::abs(packed.loss));
}

TEST(ExecutorOptions, ThePlannersDefaultsAreTheExecutors) {
  const ExecutorMemoryOptions planned = ExecutorMemoryOf(ExecutorOptions{}, /*longest_rollout=*/0);
  const ExecutorMemoryOptions defaults;
  EXPECT_EQ(planned.method, defaults.method);
  EXPECT_EQ(planned.longest_rollout, defaults.longest_rollout);
  EXPECT_EQ(planned.block_size, defaults.block_size);
  EXPECT_EQ(planned.graph_budget, defaults.graph_budget);
  EXPECT_EQ(planned.pack, defaults.pack);
  EXPECT_EQ(planned.token_capacity, defaults.token_capacity);
  EXPECT_EQ(planned.tree_tokens, defaults.tree_tokens);
  EXPECT_EQ(planned.checkpointing, defaults.checkpointing);
  EXPECT_EQ(planned.logprob_slice_rows, defaults.logprob_slice_rows);
}

}  // namespace
}  // namespace dta

// dta's path stack at linear-attention layers keeps no convolution inputs per position, only the
// last conv_kernel - 1 rows at each chunk end (dta.cc): the memory it holds on a long chain is the
// planner's estimate (core/layout/executor_memory.h), far below what a row per position takes.
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "core/layout/executor_memory.h"
#include "executor/engine/executor.h"
#include "gtest/gtest.h"
#include "tests/testing/executor_cases.h"
#include "tests/testing/live_cpu_bytes.h"

namespace dta {
namespace {

// Three Gated DeltaNet layers whose convolution rows (conv_dim 192) are 6x the attention layer's
// K/V, and small recurrent states (512 elements).
ModelConfig WideConvolutionModel() {
  ModelConfig c = testing::TinyConfig();
  c.num_hidden_layers = 4;
  c = testing::WithFamily(c, "qwen3_5_text");
  c.layer_types = {LayerType::kLinearAttention, LayerType::kLinearAttention,
                   LayerType::kLinearAttention, LayerType::kFullAttention};
  c.linear_num_key_heads = 8;
  c.linear_num_value_heads = 8;
  c.linear_key_head_dim = 8;
  c.linear_value_head_dim = 8;
  c.linear_conv_kernel_dim = 4;
  return c;
}

TEST(LinearPathStack, HoldsTheEstimateNotARowPerPosition) {
  const ModelConfig config = WideConvolutionModel();
  Decoder model(config, at::TensorOptions().dtype(at::kDouble));
  model.InitRandom(3, 0.3);
  constexpr int64_t kLength = 3000, kBlock = 64;
  std::vector<TokenId> chain(kLength);
  for (int64_t i = 0; i < kLength; ++i) chain[i] = static_cast<TokenId>((i * 7) % 19);
  const std::vector<Rollout> rollouts = testing::MakeRollouts({chain}, 5);

  // Between steps (progress callbacks) what is alive is the stack, the graph kept (the top
  // chunk's, about 8 MB) and the parameters' gradients: 12.8 MB at most, 39 MB with a row per
  // position.
  const auto live = std::make_shared<testing::LiveCpuBytes>();
  int64_t most = 0;
  {
    c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, live);
    testing::RunMethod(
        model, rollouts, {.kind = LossKind::kPpo},
        {.method = Method::kDta,
         .block_size = kBlock,
         .graph_budget = 0,
         .pack = false,
         .progress = [&](int64_t, int64_t) { most = std::max(most, live->live()); }});
  }
  const int64_t stack =
      EstimateExecutorMemory(
          config,
          {.longest_rollout = kLength, .block_size = kBlock, .graph_budget = 0, .pack = false},
          {.stack = kLength, .graphs = 0, .chunk = kBlock},
          /*tensor_parallel=*/1, /*weight_bytes=*/8)
          .stack;
  int64_t gradients = 0;
  for (const auto& [name, p] : model.named_parameters()) gradients += p.numel() * 8;
  // A row per position and its accumulator at the three linear layers: 27.6 MB.
  const int64_t conv_dim = 2 * 8 * 8 + 8 * 8;
  const int64_t every_row = 3 * kLength * conv_dim * (8 + 8);
  std::printf("live %lld B, stack estimate %lld B, a row per position %lld B\n",
              static_cast<long long>(most), static_cast<long long>(stack),
              static_cast<long long>(every_row));
  EXPECT_GT(most, stack / 2) << "the measurement misses the stack";
  EXPECT_LT(most, stack + gradients + every_row / 2);
}

}  // namespace
}  // namespace dta

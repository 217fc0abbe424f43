// GraphBytesPerToken (executor/engine/executor.h), the unit the automatic block size and graph
// budget are sized in, for Qwen3-Next's layers: Gated DeltaNet layers, gated attention and the
// shared expert, by hand; it agrees with the layout planner's estimate (core/layout).
#include <ATen/ATen.h>

#include "core/layout/executor_memory.h"
#include "core/model/model_config.h"
#include "executor/engine/executor.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

// 4 layers (linear x3, then full attention) of hidden 64: 4 heads of 16 (2 KV), Gated DeltaNet of
// 2 key heads and 4 value heads of 8 (key_dim 16, value_dim 32, conv_dim 64, kernel 4); every
// layer sparse: 4 experts of 8, top 2, a shared expert of 12.
ModelConfig SmallNext() {
  ModelConfig c = *ModelPreset("qwen3-next-small");
  c.vocab_size = 1000;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.linear_num_key_heads = 2;
  c.linear_num_value_heads = 4;
  c.linear_key_head_dim = 8;
  c.linear_value_head_dim = 8;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 8;
  c.shared_expert_intermediate_size = 12;
  EXPECT_TRUE(ValidateModelConfig(c).ok()) << ValidateModelConfig(c);
  return c;
}

TEST(GraphBytesPerToken, CountsQwen3NextsLayers) {
  const ModelConfig c = SmallNext();
  // Attention: the residual inputs 2 x 64 x 4, (2 x 64 + 2 x 32 + 96 before the q/k norms + 128
  // gate and gated output) x 2: 1,344. Linear: 512, out_proj's input 32 x 2, the convolution's
  // input and output 2 x 64 x 2 (its taps are recomputed in backward) and z 32 x 2, and in float32
  // 6 x 32 + 3 x 32 + 5 x 4 x 64 + 10 x 4 = 1,608 elements (no recurrent state or corrected
  // values: recomputed in backward): 7,328.
  // Sparse: experts 2 x 2 x 8 x 2, routing (4 + 2) x 4 + 4 x 2 x 8, shared expert 2 x 12 x 2 and
  // its scaled output and gate 65 x 4: 460.
  EXPECT_EQ(GraphBytesPerToken(c, at::kBFloat16), 3 * (7328 + 460) + 1344 + 460);
  // float32 weights: every term in 4-byte elements.
  EXPECT_EQ(GraphBytesPerToken(c, at::kFloat),
            3 * (512 + 192 * 4 + 6432) + (512 + 416 * 4) +
                4 * (2 * 2 * 8 * 4 + 24 + 64 + 2 * 12 * 4 + 260));
}

// The planner's graph term per token differs only by the norms' 1/rms and attention's
// log-sum-exp, which it alone counts (4 x (2 + 4 + 4 + 2) at the attention layer), and the
// per-chunk terms.
TEST(GraphBytesPerToken, AgreesWithThePlannersEstimate) {
  const ModelConfig c = SmallNext();
  const ExecutorTokens one{.stack = 0, .graphs = 1, .chunk = 1};
  const ExecutorMemoryEstimate planned =
      EstimateExecutorMemory(c, {.method = ExecutorKind::kDense}, one);
  const int64_t per_chunk = 2 * 64 * 4 + 64 * 2 + 2 * RotaryDim(c) * 4 + 24;
  EXPECT_EQ(planned.graphs - per_chunk - 48, GraphBytesPerToken(c, at::kBFloat16));
  const ModelConfig hub = *ModelPreset("qwen3-next-80b-a3b");
  const ExecutorMemoryEstimate big =
      EstimateExecutorMemory(hub, {.method = ExecutorKind::kDense}, one);
  const int64_t big_chunk = 2 * 2048 * 4 + 2048 * 2 + 2 * 64 * 4 + 24;
  EXPECT_EQ(big.graphs - big_chunk - 12 * 4 * (2 + 16 + 16 + 2),
            GraphBytesPerToken(hub, at::kBFloat16));
}

}  // namespace
}  // namespace dta

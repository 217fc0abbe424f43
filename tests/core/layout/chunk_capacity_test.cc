#include "core/layout/chunk_capacity.h"
#include "core/model/config_json.h"

#include <cstdint>

#include "absl/status/statusor.h"
#include "core/layout/executor_memory.h"
#include "core/model/model_config.h"
#include "core/tree/schedule.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

ModelConfig Preset(const char* name) {
  absl::StatusOr<ModelConfig> config = ModelConfigFromName(name);
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *config : ModelConfig{};
}

// The estimate above the path stack for an attention-only model, from EstimateExecutorMemory
// directly: what a chunk plan of B and G may add to the memory already allocated.
int64_t AboveStack(const ModelConfig& config, ExecutorMemoryOptions options, int64_t block,
                   int64_t graphs) {
  options.method = ExecutorKind::kDta;
  options.block_size = block;
  options.graph_budget = graphs;
  const ExecutorMemoryEstimate e = EstimateExecutorMemory(config, options);
  return e.graphs + e.workspace + e.logprob_head;
}

ChunkCapacity Fit(const ModelConfig& config, const ExecutorMemoryOptions& options,
                  int64_t available) {
  absl::StatusOr<ChunkCapacity> fit = FitChunksInMemory(config, options, available);
  EXPECT_TRUE(fit.ok()) << fit.status();
  return fit.ok() ? *fit : ChunkCapacity{};
}

TEST(FitChunksInMemory, TakesTheLargestBlockThenTheLargestGraphBudgetThatFit) {
  const ModelConfig config = Preset("qwen3-1.7b");
  // With packing, kept graphs lie below a packed step of up to B: both grow the peak.
  const ExecutorMemoryOptions options{.longest_rollout = 8192, .pack = true};
  int short_blocks = 0, short_budgets = 0;
  for (const int64_t available : {kGiB, 2 * kGiB, 6 * kGiB, 20 * kGiB, 30 * kGiB, 60 * kGiB}) {
    SCOPED_TRACE(available);
    const ChunkCapacity fit = Fit(config, options, available);
    EXPECT_LE(AboveStack(config, options, fit.block_size, fit.graph_budget), available);
    EXPECT_GE(fit.block_size, 256);
    if (fit.block_size < 8192) {
      // Not at the longest rollout: one more token would not fit, and no graphs either.
      EXPECT_GT(AboveStack(config, options, fit.block_size + 1, 0), available);
      EXPECT_EQ(fit.graph_budget, 0);
      ++short_blocks;
    } else if (fit.graph_budget < 8192) {
      EXPECT_GT(AboveStack(config, options, fit.block_size, fit.graph_budget + 1), available);
      ++short_budgets;
    }
  }
  EXPECT_GT(short_blocks, 0);  // both cases were seen
  EXPECT_GT(short_budgets, 0);
}

TEST(FitChunksInMemory, GrowsWithTheMemoryAndStopsAtTheLongestRollout) {
  const ModelConfig config = Preset("qwen3-1.7b");
  // Without packing (which lets B reach kPackedAutomaticBlock).
  const ExecutorMemoryOptions options{.longest_rollout = 3000, .pack = false};
  ChunkCapacity previous{};
  for (int64_t available = kGiB; available <= 64 * kGiB; available *= 2) {
    const ChunkCapacity fit = Fit(config, options, available);
    EXPECT_GE(fit.block_size, previous.block_size);
    EXPECT_TRUE(fit.block_size > previous.block_size || fit.graph_budget >= previous.graph_budget);
    previous = fit;
  }
  EXPECT_EQ(previous.block_size, 3000);
  EXPECT_EQ(previous.graph_budget, 3000);  // every graph of a path can be kept
}

TEST(FitChunksInMemory, PackingReachesPackedSizedStepsAndCapsAnUnboundedBlock) {
  const ModelConfig config = Preset("qwen3-0.6b");
  ExecutorMemoryOptions options{.longest_rollout = 1000, .pack = true};
  EXPECT_EQ(Fit(config, options, 64 * kGiB).block_size, kPackedAutomaticBlock);
  options.block_size = kUnboundedBlock;
  EXPECT_EQ(Fit(config, options, 64 * kGiB).block_size, kPackedAutomaticBlock);
  options.block_size = 20000;  // an explicit B that fits is kept, above the automatic cap
  EXPECT_EQ(Fit(config, options, 64 * kGiB).block_size, 20000);
}

// Mixture-of-experts models amortize the experts' weight-gradient accumulation over larger packed
// steps: with packing their automatic B takes as many tokens as fit; without packing (B beyond the
// longest rollout changes no chunk) and for dense models the caps stay.
TEST(MostAutomaticBlock, UncappedOnlyForPackedMixtureOfExperts) {
  for (const char* dense : {"qwen3-0.6b", "llama-3.2-1b"}) {
    SCOPED_TRACE(dense);
    EXPECT_EQ(MostAutomaticBlock(Preset(dense), 1000, true), kPackedAutomaticBlock);
    EXPECT_EQ(MostAutomaticBlock(Preset(dense), 20000, true), 20000);
    EXPECT_EQ(MostAutomaticBlock(Preset(dense), 1000, false), 1000);
  }
  for (const char* moe : {"qwen3-moe-small", "qwen3-next-small", "qwen3-30b-a3b"}) {
    SCOPED_TRACE(moe);
    EXPECT_EQ(MostAutomaticBlock(Preset(moe), 1000, true), kUncappedAutomaticBlock);
    EXPECT_EQ(MostAutomaticBlock(Preset(moe), 1000, false), 1000);
  }
  // A MoE family whose every layer stays dense (mlp_only_layers) is a dense model here.
  ModelConfig all_dense = Preset("qwen3-moe-small");
  all_dense.mlp_only_layers.clear();
  for (int64_t layer = 0; layer < all_dense.num_hidden_layers; ++layer)
    all_dense.mlp_only_layers.push_back(layer);
  EXPECT_EQ(MostAutomaticBlock(all_dense, 1000, true), kPackedAutomaticBlock);
}

TEST(FitChunksInMemory, MixtureOfExpertsBlocksTakeWhatFits) {
  const ModelConfig config = Preset("qwen3-moe-small");
  ExecutorMemoryOptions options{.longest_rollout = 4096, .pack = true};
  for (const int64_t available : {4 * kGiB, 16 * kGiB, 48 * kGiB}) {
    SCOPED_TRACE(available);
    const ChunkCapacity fit = Fit(config, options, available);
    EXPECT_LE(AboveStack(config, options, fit.block_size, fit.graph_budget), available);
    // The largest B that fits, past the packed cap once the memory allows; graphs take only what
    // is left of a token.
    EXPECT_GT(AboveStack(config, options, fit.block_size + 1, 0), available);
    if (available >= 48 * kGiB) {
      EXPECT_GT(fit.block_size, kPackedAutomaticBlock);
    }
  }
  // Without packing B stops at the longest rollout, and graphs take the rest.
  options.pack = false;
  const ChunkCapacity unpacked = Fit(config, options, 48 * kGiB);
  EXPECT_EQ(unpacked.block_size, 4096);
  EXPECT_GT(unpacked.graph_budget, 0);
}

TEST(FitChunksInMemory, ExplicitSizesAreCapsKeptWhenTheyFit) {
  const ModelConfig config = Preset("qwen3-1.7b");
  const ExecutorMemoryOptions options{
      .longest_rollout = 8192, .block_size = 1024, .graph_budget = 2048};
  const ChunkCapacity roomy = Fit(config, options, 40 * kGiB);
  EXPECT_EQ(roomy.block_size, 1024);
  EXPECT_EQ(roomy.graph_budget, 2048);

  // Room for B = 1024 and part of the graphs: the budget shrinks to what fits.
  const int64_t available = AboveStack(config, options, 1024, 1000);
  const ChunkCapacity tight = Fit(config, options, available);
  EXPECT_EQ(tight.block_size, 1024);
  EXPECT_EQ(tight.graph_budget, 1000);

  // Room for less than B: B shrinks, and no graph is kept beyond the chunk.
  const ChunkCapacity tighter = Fit(config, options, AboveStack(config, options, 600, 0));
  EXPECT_EQ(tighter.block_size, 600);
  EXPECT_EQ(tighter.graph_budget, 0);
}

TEST(FitChunksInMemory, RefusesMemoryBelowTheSmallestChunkSayingWhatItNeeds) {
  const ModelConfig config = Preset("qwen3-1.7b");
  const ExecutorMemoryOptions options{.longest_rollout = 8192};
  const int64_t smallest = AboveStack(config, options, 256, 0);
  EXPECT_TRUE(FitChunksInMemory(config, options, smallest).ok());
  absl::StatusOr<ChunkCapacity> fit = FitChunksInMemory(config, options, smallest - 1);
  ASSERT_FALSE(fit.ok());
  EXPECT_EQ(fit.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      fit.status().message(),
      testing::AllOf(testing::HasSubstr("a chunk of 256 tokens needs"),
                     testing::HasSubstr("log-prob head"), testing::HasSubstr("GiB available")));
  // A rollout shorter than the smallest automatic block needs only its own length.
  const ExecutorMemoryOptions short_rollouts{.longest_rollout = 100};
  EXPECT_EQ(Fit(config, short_rollouts, AboveStack(config, short_rollouts, 100, 0)).block_size,
            100);
  EXPECT_FALSE(FitChunksInMemory(config, options, -kGiB).ok());
}

TEST(FitChunksInMemory, CountsTheRecurrentStatesOfLinearLayers) {
  // Qwen3-Next keeps a recurrent state per chunk end on the path: smaller chunks cost states.
  const ModelConfig config = Preset("qwen3-next-small");
  const ExecutorMemoryOptions options{.longest_rollout = 4096};
  for (const int64_t available : {2 * kGiB, 4 * kGiB, 8 * kGiB}) {
    const ChunkCapacity fit = Fit(config, options, available);
    ExecutorMemoryOptions planned = options;
    planned.block_size = fit.block_size;
    planned.graph_budget = fit.graph_budget;
    const ExecutorMemoryEstimate e = EstimateExecutorMemory(config, planned);
    planned.block_size = 4096;
    planned.graph_budget = 0;
    const int64_t stack_alone = EstimateExecutorMemory(config, planned).stack;
    EXPECT_LE(e.total() - stack_alone, available) << available;
  }
}

TEST(FitChunksInMemory, RefusesBadSizes) {
  const ModelConfig config = Preset("qwen3-0.6b");
  EXPECT_FALSE(FitChunksInMemory(config, {.block_size = 0}, kGiB).ok());
  EXPECT_FALSE(FitChunksInMemory(config, {.graph_budget = -5}, kGiB).ok());
}

}  // namespace
}  // namespace dta

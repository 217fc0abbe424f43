// The chunk sizes dta's executor runs with under a memory budget (ExecutorOptions::memory_budget):
// the inverse of EstimateExecutorMemory (executor_memory.h) for dta. Given the bytes the budget
// leaves once the weights, gradients, optimizer state and path stack are allocated, it takes the
// largest block size B, then the largest graph budget G, whose estimated peak above the stack
// (graphs of the tokens alive at once, the backward workspace of a chunk of B, the log-probability
// head, and Qwen3-Next's recurrent states at the chunk ends B adds) fits. The estimate is
// calibrated to lie 1-7% above measured peaks, never below, so the executor's peak stays within
// the budget without a further margin.
//
//   absl::StatusOr<ChunkCapacity> fit = FitChunksInMemory(
//       config, {.longest_rollout = 8192, .pack = true}, /*available_bytes=*/int64_t{3} << 30);
//   // fit->block_size, fit->graph_budget: what ExecutorOptions' block_size and graph_budget get.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "core/layout/executor_memory.h"
#include "core/model/model_config.h"

namespace dta {

// An automatic block is never below this many tokens (or the longest rollout, if shorter): below
// it chunks are too small to run efficiently.
inline constexpr int64_t kLeastAutomaticBlock = 256;
// With packing, an automatic block reaches this many tokens even when every rollout is shorter:
// B also bounds packed steps, which run best at several thousand tokens.
inline constexpr int64_t kPackedAutomaticBlock = 8192;

// MostAutomaticBlock's answer where only memory bounds an automatic block.
inline constexpr int64_t kUncappedAutomaticBlock = int64_t{1} << 40;

// The most tokens an automatic block takes, here and in the executor's automatic B: the longest
// rollout (it then runs in one chunk, as dense runs it), at least kPackedAutomaticBlock with
// packing; with packing and sparse mixture-of-experts layers, kUncappedAutomaticBlock: as many as
// fit. Every backward chunk accumulates each sparse layer's expert weight gradients in full
// (experts x 3 x hidden x expert width float32, read and written, however few of the chunk's
// tokens reach each expert), a cost per chunk that only fewer, larger packed steps amortize; kept
// graphs, which the memory would go to instead, save a forward of prefixes that larger packed
// steps mostly no longer split (Qwen3-Next's shapes on an H200: 1.18x on the step with B = 20K
// tokens over 8K, kept graphs or not).
int64_t MostAutomaticBlock(const ModelConfig& config, int64_t longest_rollout, bool pack);

struct ChunkCapacity {
  int64_t block_size = 0;
  int64_t graph_budget = 0;
};

// options: the batch's longest rollout, pack, logprob_slice_rows; block_size and graph_budget are
// kAutomaticCapacity (the largest that fits: B up to MostAutomaticBlock; G up to the longest
// rollout, beyond which no more graphs can be alive) or
// explicit upper bounds, kept when they fit (an unbounded B, as kUnboundedBlock, is capped as an
// automatic one). `options.method` is taken as kDta. B is at least
// min(kLeastAutomaticBlock, the longest rollout, an explicit B); InvalidArgument (saying what the
// smallest chunk needs) when even that does not fit in `available_bytes`.
absl::StatusOr<ChunkCapacity> FitChunksInMemory(const ModelConfig& config,
                                                ExecutorMemoryOptions options,
                                                int64_t available_bytes,
                                                int32_t tensor_parallel = 1,
                                                int32_t weight_bytes = 2);

}  // namespace dta

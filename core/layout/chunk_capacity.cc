#include "core/layout/chunk_capacity.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/layout/gib.h"

namespace dta {
namespace {

// The estimated bytes above the path stack for B = block and G = graphs: EstimateExecutorMemory's
// graphs, workspace and head, and the stack's growth beyond its one-chunk size (recurrent states
// at the chunk ends of linear layers; none for attention-only models).
ExecutorMemoryEstimate AboveStack(const ModelConfig& config, ExecutorMemoryOptions options,
                                  int64_t block, int64_t graphs, int32_t tensor_parallel,
                                  int32_t weight_bytes) {
  options.block_size = block;
  options.graph_budget = graphs;
  ExecutorMemoryEstimate e = EstimateExecutorMemory(config, options, tensor_parallel, weight_bytes);
  ExecutorMemoryOptions whole = options;
  whole.block_size = std::max<int64_t>(options.longest_rollout, 1);
  whole.graph_budget = 0;
  const ExecutorTokens stack_only{
      .stack = PlannedExecutorTokens(whole).stack, .graphs = 0, .chunk = whole.block_size};
  e.stack -= EstimateExecutorMemory(config, whole, stack_only, tensor_parallel, weight_bytes).stack;
  return e;
}

// The largest value in [low, high] for which fits(value) holds, given fits(low) and that fits is
// monotone (true up to some value, false after).
template <typename Fits>
int64_t LargestFitting(int64_t low, int64_t high, const Fits& fits) {
  while (low < high) {
    const int64_t mid = low + (high - low + 1) / 2;
    if (fits(mid)) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  return low;
}

}  // namespace

int64_t MostAutomaticBlock(const ModelConfig& config, int64_t longest_rollout, bool pack) {
  if (!pack) return std::max<int64_t>(longest_rollout, 1);
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    if (IsSparseLayer(config, layer)) return kUncappedAutomaticBlock;
  }
  return std::max(longest_rollout, kPackedAutomaticBlock);
}

absl::StatusOr<ChunkCapacity> FitChunksInMemory(const ModelConfig& config,
                                                ExecutorMemoryOptions options,
                                                int64_t available_bytes, int32_t tensor_parallel,
                                                int32_t weight_bytes) {
  options.method = ExecutorKind::kDta;
  const int64_t longest = std::max<int64_t>(options.longest_rollout, 1);
  const bool auto_block = options.block_size == kAutomaticCapacity;
  const bool auto_graphs = options.graph_budget == kAutomaticCapacity;
  if (!auto_block && options.block_size < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("block_size must be >= 1 or automatic, got ", options.block_size));
  if (!auto_graphs && options.graph_budget < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("graph_budget must be >= 0 or automatic, got ", options.graph_budget));
  auto cost = [&](int64_t block, int64_t graphs) {
    return AboveStack(config, options, block, graphs, tensor_parallel, weight_bytes);
  };
  auto fits = [&](int64_t block, int64_t graphs) {
    return cost(block, graphs).total() <= available_bytes;
  };

  // An unbounded B (kUnboundedBlock) lets packed steps grow to whole subtrees, which no estimate
  // from the longest rollout bounds: under a budget it is capped as an automatic one is.
  const int64_t most_block = auto_block || options.block_size >= kUncappedAutomaticBlock
                                 ? MostAutomaticBlock(config, longest, options.pack)
                                 : options.block_size;
  const int64_t least_block = std::min({kLeastAutomaticBlock, longest, most_block});
  if (!fits(least_block, 0)) {
    const ExecutorMemoryEstimate need = cost(least_block, 0);
    return absl::InvalidArgumentError(absl::StrCat(
        "a chunk of ", least_block, " tokens needs ", GiB(need.total()), " (graphs ",
        GiBNumber(need.graphs), ", backward workspace ", GiBNumber(need.workspace),
        ", log-prob head ", GiBNumber(need.logprob_head),
        need.stack > 0 ? absl::StrCat(", recurrent states ", GiBNumber(need.stack)) : "",
        " GiB), more than the ", GiB(std::max<int64_t>(available_bytes, 0)), " available"));
  }
  ChunkCapacity capacity;
  capacity.block_size =
      LargestFitting(least_block, most_block, [&](int64_t b) { return fits(b, 0); });
  const int64_t most_graphs = auto_graphs ? longest : options.graph_budget;
  capacity.graph_budget =
      LargestFitting(0, most_graphs, [&](int64_t g) { return fits(capacity.block_size, g); });
  return capacity;
}

}  // namespace dta

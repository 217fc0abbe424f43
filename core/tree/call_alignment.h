// Lockstep for collectives across ranks that run different schedules (expert parallelism,
// docs/expert_parallelism.md): every rank lists its model calls (its "word"), and AlignCalls merges
// the words into one sequence of slots that every rank then runs in order, a rank with no call of a
// slot's kind running an empty (zero-token) call of that kind instead. Each sparse layer's
// all-to-all then pairs the same slot on every rank.
//
// A word is a sequence of calls: kForward (no graph kept), kForwardBackward (forward and backward
// in one call), kLayerReplay (the same with layer-by-layer recomputation, whose collectives come in
// another order) and nested kKeep ... kBackwardKept pairs (a forward whose graph is kept, and later
// the backward of the newest kept graph, last in first out, with other calls between them).
//
// Slots pair calls of the same kind, and a kKeep/kBackwardKept pair only with a pair (their inner
// calls aligned in turn), so every rank's kept graphs stay last in first out with pads paired with
// pads. Among such alignments AlignCalls picks a cheap one: a slot costs
//   alpha * max over ranks of its tokens + (1 - alpha) * sum of its tokens / ranks + overhead
// (the dense part of a call waits for the slowest rank at every layer's all-to-all, the experts'
// work is spread over the ranks; every call pays launches and small collectives). Two ranks are
// aligned optimally by dynamic programming, more ranks progressively (the alignment of ranks
// 0..r-1 against rank r), and words too long for the tables greedily. The result depends only on
// the words and the costs, so every rank computes the same one.
//
// Example:
//   // rank 0: forward+backward of 100 tokens, then of 20; rank 1: one of 90.
//   AlignCalls({{{kForwardBackward, 100}, {kForwardBackward, 20}}, {{kForwardBackward, 90}}});
//   // -> {kForwardBackward, {0, 0}}, {kForwardBackward, {1, -1}}: rank 1 pads the second slot.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace dta {

enum class CallKind : int8_t {
  kForward,          // forward, no graph kept
  kKeep,             // forward keeping its graph for a later kBackwardKept
  kBackwardKept,     // backward of the newest kept graph
  kForwardBackward,  // forward and backward in one call
  kLayerReplay,      // forward, then layer by layer recomputation and backward
};

struct ModelCall {
  CallKind kind = CallKind::kForwardBackward;
  int64_t tokens = 0;  // the call's tokens on its rank (its share of the work)
  bool operator==(const ModelCall&) const = default;
};

struct AlignedSlot {
  CallKind kind = CallKind::kForwardBackward;
  // Per rank, the index of its call in its word, or -1: the rank runs an empty call of `kind`.
  std::vector<int64_t> calls;
  bool operator==(const AlignedSlot&) const = default;
};

struct AlignmentCosts {
  double alpha = 0.6;            // the share of a call's work that waits for the slowest rank
  double call_overhead = 200.0;  // in tokens: a call's launches and small collectives
  int64_t max_table_cells = int64_t{1} << 22;  // beyond, two sequences are merged greedily
};

// The slots of `words` (one per rank, each well nested). INVALID_ARGUMENT naming the rank and the
// call for a kBackwardKept without an open kKeep, a kKeep never closed, or negative tokens.
absl::StatusOr<std::vector<AlignedSlot>> AlignCalls(
    const std::vector<std::vector<ModelCall>>& words, const AlignmentCosts& costs = {});

// The cost of running `slots` (the sum of their costs, as above).
double AlignmentCost(const std::vector<AlignedSlot>& slots,
                     const std::vector<std::vector<ModelCall>>& words,
                     const AlignmentCosts& costs = {});

}  // namespace dta

// The push/pop schedule (AReaL-DTA Algorithm 3) as plain data, independent of any model.
//
// The executor keeps a stack holding the current root-to-leaf path: per position, the K/V of every
// layer, the log-probability of the token, and gradient accumulators. A schedule is the exact list
// of operations on that stack for one batch, planned once on the CPU before the first kernel runs.
// Positions are offsets along the current path: a step with range [begin, end) on rollout r means
// tokens begin..end-1 of rollout r, whose ancestors are positions 0..begin-1 of the same rollout.
//
// For each rollout r in the leaf order, with lcp = LCP(previous rollout, r):
//   1. backward and pop the previous path down to lcp, right to left, chunk by chunk (a chunk whose
//      graph is still alive is backpropagated directly, any other chunk is first recomputed with a
//      graph on top of the stack's cached K/V);
//   2. forward positions [lcp, |r|) in chunks: the chunk the next pop backpropagates first keeps
//      its graph until then, the others are forwarded without a graph (cache anchors) unless the
//      graph budget lets them keep theirs;
//   3. attach r's loss: its gradient with respect to each of its log-probabilities is added to the
//      stack's per-token accumulators.
// After the last rollout the stack is popped down to 0 the same way.
//
// Chunks are fixed when their tokens are forwarded: a forward range is cut at every later pop
// target that falls inside it (so each pop removes whole chunks) and each piece is split evenly
// into ceil(size / B) chunks of at most B tokens (Algorithm 3's evenly spaced boundaries).
//
// Packing (beyond the paper): consecutive rollouts whose unique tokens beyond their common prefix
// d fit in B tokens, and which form complete subtrees below d, become one kPacked step that
// forwards those tokens with a tree mask on top of the stack [0, d), attaches all their losses and
// backpropagates at once, so thousands of short leaves do not become thousands of tiny steps.
//
// Invariants (checked by the property tests): every tree token is forwarded once (with or without
// a graph) and backpropagated exactly once, after every loss through it and after all its
// descendants; every step's ancestors are on the stack; the stack never exceeds the longest
// rollout; no chunk or packed step exceeds B tokens; live graphs never exceed B + the graph budget
// in tokens; every rollout's loss is attached exactly once.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/tree/prefix_tree.h"

namespace dta {

inline constexpr int64_t kUnboundedBlock = std::numeric_limits<int64_t>::max();

struct ScheduleOptions {
  // B: the most tokens one backward chunk may hold (and so the most tokens whose graph is alive).
  // Must be at least 1. Default: unbounded, one chunk per pop.
  int64_t block_size = kUnboundedBlock;
  // Tokens whose graphs may stay alive beyond the one chunk the next pop needs: a chunk forwarded
  // while the live kept graphs plus its size fit in this budget keeps its graph instead of being
  // recomputed for its backward. 0 (the default) recomputes everything else, as the paper does.
  int64_t graph_budget = 0;
  // Pack runs of small complete subtrees into kPacked steps of at most B tokens (training only).
  bool pack = false;
  // false: a forward-only schedule (log-probabilities of every rollout, each unique token computed
  // once): forwards without graphs, pops without backward; kAttachLoss steps only mark where each
  // rollout's log-probabilities are complete. Default: training.
  bool training = true;
};

enum class StepKind : uint8_t {
  // Push positions [begin, end) of `rollout`'s path: compute their K/V and log-probabilities on
  // top of the stack (whose height is `begin`). with_graph: keep the autograd graph for the
  // matching Backward step.
  kForward,
  // Every position of `rollout` is on the stack: read its log-probabilities; when training,
  // compute its loss from them and add d loss / d log-probability into the per-token
  // accumulators.
  kAttachLoss,
  // Backpropagate positions [begin, end), the top of the stack: their accumulated loss gradients
  // and dK/dV flow into the parameters and into the dK/dV accumulators of positions < begin.
  // reuses_graph: the graph from a kForward step is still alive; otherwise recompute first.
  kBackward,
  // Drop positions [begin, end) from the top of the stack, freeing their K/V and accumulators.
  kPop,
  // The rollouts order[first .. last) share the stack's positions [0, begin) (begin = end = the
  // stack height) and their tokens beyond it, `packed_tokens` unique ones forming complete
  // subtrees, are needed by no other rollout: forward those tokens in DFS order with a tree mask
  // and a graph, attach the rollouts' losses (their log-probabilities below `begin` come from the
  // stack, whose accumulators receive those gradients), backpropagate, and drop them. The stack
  // height does not change.
  kPacked,
};

struct Step {
  StepKind kind;
  bool with_graph = false;    // kForward only
  bool reuses_graph = false;  // kBackward only
  RolloutIndex rollout = 0;   // the path the range lies on; for kAttachLoss the rollout itself
  int64_t begin = 0;          // path positions [begin, end); for kAttachLoss [0, length)
  int64_t end = 0;
  int32_t first = 0;  // kPacked: positions in the leaf order, [first, last)
  int32_t last = 0;
  int64_t packed_tokens = 0;  // kPacked: unique tokens above `begin`

  // Tokens the step forwards or backpropagates.
  int64_t size() const { return kind == StepKind::kPacked ? packed_tokens : end - begin; }
  friend bool operator==(const Step&, const Step&) = default;
};

struct Schedule {
  std::vector<Step> steps;
  std::vector<RolloutIndex> order;  // the leaf order it follows
  int64_t block_size = kUnboundedBlock;
  int64_t graph_budget = 0;
  bool training = true;

  // Summary, filled by BuildSchedule.
  int64_t tree_tokens = 0;
  int64_t forwarded_with_graph = 0;     // tokens in kForward steps with a graph
  int64_t forwarded_without_graph = 0;  // tokens in kForward steps without a graph
  int64_t recomputed = 0;               // tokens in kBackward steps that recompute
  int64_t backpropagated = 0;           // tokens in kBackward steps
  int64_t peak_stack = 0;               // the highest stack, in tokens
  int64_t num_forward_steps = 0;
  int64_t num_backward_steps = 0;
  int64_t num_packed_steps = 0;
  int64_t packed = 0;            // tokens in kPacked steps (forwarded with a graph, backpropagated)
  int64_t largest_backward = 0;  // the largest kBackward or kPacked step, in tokens
  int64_t peak_live_graphs = 0;  // the most tokens whose graphs were alive at once

  // Tokens forwarded again for their backward / tree tokens (0 = nothing recomputed).
  double recompute_overhead() const {
    return tree_tokens == 0 ? 0.0 : static_cast<double>(recomputed) / tree_tokens;
  }
};

// Plans the schedule for `tree` visiting rollouts in `order`, which must be a DFS leaf order (see
// CheckDfsLeafOrder). INVALID_ARGUMENT if it is not, or if options.block_size < 1.
// Time O(steps + nodes + rollouts).
absl::StatusOr<Schedule> BuildSchedule(const PrefixTree& tree, absl::Span<const RolloutIndex> order,
                                       const ScheduleOptions& options = {});

// With packing, B bounds packed steps as well as chunks: fewer, larger steps launch fewer kernels
// and run larger GEMMs (Qwen3-1.7B on tau2 on an H200: 1.31 -> 1.22 s a step with B = 32K tokens
// over 8K), but where B and the graph budget share one memory (graphs of B + G tokens), a larger B
// keeps fewer graphs and may recompute more (Qwen3-8B there: 1.21x the tokens forwarded and a
// slower step at B = 16K). Returns `options` with the largest B = options.block_size * 2^k
// (k >= 0) such that B + G stays options.block_size + options.graph_budget with G >= 0, B does
// not pass the first power that reaches `tokens` (the batch's tree tokens: a larger B changes
// nothing more), and `recomputed` (the tokens the schedules at those options recompute) is no more
// than at `options`. `options` as given unless packing, training, a bounded B >= 1 and a positive
// graph budget.
ScheduleOptions LargestBlockRecomputingNoMore(
    const ScheduleOptions& options, int64_t tokens,
    absl::FunctionRef<int64_t(const ScheduleOptions&)> recomputed);

// "forward r3 [0,128) graph", for logs and test failure messages.
std::string StepToString(const Step& step);

}  // namespace dta

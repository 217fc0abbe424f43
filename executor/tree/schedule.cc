#include "executor/tree/schedule.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "executor/tree/leaf_order.h"

namespace dta {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return a / b + (a % b != 0); }

// Size of the first (rightmost) chunk when `tokens` are popped in ceil(tokens / B) evenly sized
// chunks: Algorithm 3's Delta.
int64_t FirstChunk(int64_t tokens, int64_t block) {
  if (tokens <= block) return tokens;
  return CeilDiv(tokens, CeilDiv(tokens, block));
}

class Planner {
 public:
  Planner(const ScheduleOptions& options, Schedule& schedule)
      : block_(options.block_size), training_(options.training), schedule_(schedule) {}

  void Forward(RolloutIndex rollout, int64_t begin, int64_t end, bool with_graph) {
    if (begin == end) return;
    schedule_.steps.push_back(
        Step{.kind = StepKind::kForward, .with_graph = with_graph, .rollout = rollout, .begin = begin, .end = end});
    if (with_graph) {
      kept_begin_ = begin;
      kept_end_ = end;
    }
    top_ = end;
    schedule_.peak_stack = std::max(schedule_.peak_stack, top_);
  }

  void AttachLoss(RolloutIndex rollout, int64_t length) {
    schedule_.steps.push_back(Step{.kind = StepKind::kAttachLoss, .rollout = rollout, .begin = 0, .end = length});
  }

  // Backpropagates and pops rollout's path from the top of the stack down to `target`.
  void PopTo(RolloutIndex rollout, int64_t target) {
    if (top_ == target) return;
    if (!training_) {
      Pop(rollout, target, top_);
      return;
    }
    if (kept_end_ > kept_begin_) {
      // The kept graph is always the first chunk of the pop that follows its forward.
      BackwardAndPop(rollout, kept_begin_, top_, /*reuses_graph=*/true);
      kept_begin_ = kept_end_ = 0;
    }
    const int64_t tokens = top_ - target;
    if (tokens == 0) return;
    const int64_t chunks = CeilDiv(tokens, block_);
    const int64_t base = tokens / chunks;
    const int64_t extra = tokens % chunks;  // the first `extra` chunks from the left get one more
    for (int64_t k = chunks - 1; k >= 0; --k) {
      const int64_t begin = target + k * base + std::min(k, extra);
      BackwardAndPop(rollout, begin, top_, /*reuses_graph=*/false);
    }
  }

 private:
  void BackwardAndPop(RolloutIndex rollout, int64_t begin, int64_t end, bool reuses_graph) {
    schedule_.steps.push_back(
        Step{.kind = StepKind::kBackward, .reuses_graph = reuses_graph, .rollout = rollout, .begin = begin, .end = end});
    Pop(rollout, begin, end);
  }

  void Pop(RolloutIndex rollout, int64_t begin, int64_t end) {
    schedule_.steps.push_back(Step{.kind = StepKind::kPop, .rollout = rollout, .begin = begin, .end = end});
    top_ = begin;
  }

  const int64_t block_;
  const bool training_;
  Schedule& schedule_;
  int64_t top_ = 0;
  int64_t kept_begin_ = 0;  // [kept_begin_, kept_end_): positions whose graph is alive
  int64_t kept_end_ = 0;
};

void Summarize(Schedule& schedule) {
  for (const Step& step : schedule.steps) {
    switch (step.kind) {
      case StepKind::kForward:
        schedule.num_forward_steps++;
        (step.with_graph ? schedule.forwarded_with_graph : schedule.forwarded_without_graph) += step.size();
        break;
      case StepKind::kBackward:
        schedule.num_backward_steps++;
        schedule.backpropagated += step.size();
        if (!step.reuses_graph) schedule.recomputed += step.size();
        schedule.largest_backward = std::max(schedule.largest_backward, step.size());
        break;
      case StepKind::kAttachLoss:
      case StepKind::kPop:
        break;
    }
  }
}

}  // namespace

absl::StatusOr<Schedule> BuildSchedule(const PrefixTree& tree, absl::Span<const RolloutIndex> order,
                                       const ScheduleOptions& options) {
  if (options.block_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("block_size must be >= 1, got ", options.block_size));
  }
  if (absl::Status status = CheckDfsLeafOrder(tree, order); !status.ok()) return status;

  Schedule schedule;
  schedule.order.assign(order.begin(), order.end());
  schedule.block_size = options.block_size;
  schedule.training = options.training;
  schedule.tree_tokens = tree.num_tree_tokens();
  const std::vector<int64_t> lcp = ConsecutiveLcps(tree, order);
  const int64_t num = static_cast<int64_t>(order.size());

  Planner planner(options, schedule);
  for (int64_t i = 0; i < num; ++i) {
    const RolloutIndex rollout = order[i];
    const int64_t length = tree.rollout_length(rollout);
    if (i > 0) planner.PopTo(order[i - 1], lcp[i]);
    if (options.training) {
      // The next pop runs from `length` down to the next rollout's LCP; forward its first chunk
      // with a graph so that chunk needs no recomputation, the rest as a no-graph cache anchor.
      const int64_t next_lcp = i + 1 < num ? lcp[i + 1] : 0;
      const int64_t graph_begin = std::max(length - FirstChunk(length - next_lcp, options.block_size), lcp[i]);
      planner.Forward(rollout, lcp[i], graph_begin, /*with_graph=*/false);
      planner.Forward(rollout, graph_begin, length, /*with_graph=*/true);
      planner.AttachLoss(rollout, length);
    } else {
      planner.Forward(rollout, lcp[i], length, /*with_graph=*/false);
      planner.AttachLoss(rollout, length);
    }
  }
  if (num > 0) planner.PopTo(order[num - 1], 0);
  Summarize(schedule);
  return schedule;
}

std::string StepToString(const Step& step) {
  switch (step.kind) {
    case StepKind::kForward:
      return absl::StrCat("forward r", step.rollout, " [", step.begin, ",", step.end, ")",
                          step.with_graph ? " graph" : "");
    case StepKind::kAttachLoss:
      return absl::StrCat("loss r", step.rollout);
    case StepKind::kBackward:
      return absl::StrCat("backward r", step.rollout, " [", step.begin, ",", step.end, ")",
                          step.reuses_graph ? " kept" : " recompute");
    case StepKind::kPop:
      return absl::StrCat("pop r", step.rollout, " [", step.begin, ",", step.end, ")");
  }
  return "?";
}

}  // namespace dta

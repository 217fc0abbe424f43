#include "core/tree/schedule.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/tree/leaf_order.h"

namespace dta {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return a / b + (a % b != 0); }

// What the traversal visits in turn: one rollout, or a packed run of rollouts.
struct Unit {
  int32_t first = 0;  // positions [first, last) of the leaf order
  int32_t last = 0;
  int64_t lcp = 0;            // shared with the previous unit: where this unit's forward starts
  int64_t top = 0;            // stack height after the unit: its length, or the packed depth
  int64_t packed_tokens = 0;  // > 0 for a packed run: unique tokens above `top`
};

// Groups the order into units. A run order[i..j] is packed when its common prefix d is at least
// what the stack holds when it starts (lcp[i]) and at least what the next rollout shares with it
// (so its tokens above d are complete subtrees), and its unique tokens above d fit in B.
std::vector<Unit> MakeUnits(absl::Span<const int64_t> length, absl::Span<const int64_t> lcp,
                            int64_t block, bool pack) {
  const int32_t n = static_cast<int32_t>(length.size());
  std::vector<Unit> units;
  for (int32_t i = 0; i < n;) {
    int32_t best = i;
    int64_t best_depth = 0, best_tokens = 0;
    if (pack) {
      int64_t depth = length[i];
      int64_t beyond = 0;  // sum over k in (i, j] of length[k] - lcp[k]
      for (int32_t j = i + 1; j < n; ++j) {
        depth = std::min(depth, lcp[j]);
        if (depth < lcp[i]) break;
        beyond += length[j] - lcp[j];
        const int64_t tokens = length[i] - depth + beyond;
        if (tokens > block) break;
        const int64_t next = j + 1 < n ? lcp[j + 1] : 0;
        if (next <= depth) best = j, best_depth = depth, best_tokens = tokens;
      }
    }
    if (best > i && best_tokens > 0) {
      units.push_back({.first = i,
                       .last = best + 1,
                       .lcp = lcp[i],
                       .top = best_depth,
                       .packed_tokens = best_tokens});
      i = best + 1;
    } else {
      units.push_back({.first = i, .last = i + 1, .lcp = lcp[i], .top = length[i]});
      ++i;
    }
  }
  return units;
}

class Planner {
 public:
  Planner(const ScheduleOptions& options, Schedule& schedule)
      : block_(options.block_size),
        budget_(options.graph_budget),
        training_(options.training),
        schedule_(schedule) {}

  // Pushes positions [begin, end) of `rollout`'s path. `cuts` are the later pop targets inside
  // (begin, end), decreasing; `auto_keep` keeps the topmost chunk's graph for the next pop.
  void Forward(RolloutIndex rollout, int64_t begin, int64_t end, const std::vector<int64_t>& cuts,
               bool auto_keep) {
    if (begin == end) return;
    if (!training_) {
      Emit({.kind = StepKind::kForward, .rollout = rollout, .begin = begin, .end = end});
      top_ = end;
      Peak();
      return;
    }
    // Chunks, top first: each segment between cuts split evenly into ceil(size / B) chunks.
    std::vector<Piece> chunks;
    int64_t hi = end;
    for (size_t c = 0; c <= cuts.size(); ++c) {
      const int64_t lo = c < cuts.size() ? cuts[c] : begin;
      const int64_t tokens = hi - lo;
      const int64_t count = CeilDiv(tokens, block_);
      const int64_t base = tokens / count, extra = tokens % count;
      // The larger chunks on top, as Algorithm 3's Delta = ceil(size / count).
      for (int64_t k = 0, upper = hi; k < count; ++k) {
        const int64_t size = base + (k < extra ? 1 : 0);
        chunks.push_back({.begin = upper - size, .end = upper});
        upper -= size;
      }
      hi = lo;
    }
    // Graphs: the first chunk the next pop needs, then whatever fits the budget, nearest pops
    // first.
    for (size_t k = 0; k < chunks.size(); ++k) {
      Piece& chunk = chunks[k];
      if (k == 0 && auto_keep) {
        chunk.kept = true;
      } else if (budgeted_ + chunk.size() <= budget_) {
        chunk.kept = chunk.budgeted = true;
        budgeted_ += chunk.size();
      }
    }
    // Emit bottom to top: runs of chunks without graphs as one step, each kept chunk on its own.
    for (size_t k = chunks.size(); k-- > 0;) {
      const Piece& chunk = chunks[k];
      const bool merge = !chunk.kept && !schedule_.steps.empty() && pieces_open_ &&
                         schedule_.steps.back().kind == StepKind::kForward &&
                         !schedule_.steps.back().with_graph;
      if (merge) {
        schedule_.steps.back().end = chunk.end;
      } else {
        Emit({.kind = StepKind::kForward,
              .with_graph = chunk.kept,
              .rollout = rollout,
              .begin = chunk.begin,
              .end = chunk.end});
      }
      pieces_open_ = true;
      pieces_.push_back(chunk);
      if (chunk.kept) live_ += chunk.size();
      top_ = chunk.end;
      Peak();
    }
    pieces_open_ = false;
  }

  void AttachLoss(RolloutIndex rollout, int64_t length) {
    Emit({.kind = StepKind::kAttachLoss, .rollout = rollout, .begin = 0, .end = length});
  }

  void Packed(RolloutIndex rollout, int32_t first, int32_t last, int64_t tokens) {
    Emit({.kind = StepKind::kPacked,
          .rollout = rollout,
          .begin = top_,
          .end = top_,
          .first = first,
          .last = last,
          .packed_tokens = tokens});
    Peak(tokens);
  }

  // Backpropagates and pops `rollout`'s path from the top of the stack down to `target`.
  void PopTo(RolloutIndex rollout, int64_t target) {
    if (top_ == target) return;
    if (!training_) {
      Emit({.kind = StepKind::kPop, .rollout = rollout, .begin = target, .end = top_});
      top_ = target;
      return;
    }
    while (top_ > target) {
      const Piece chunk = pieces_.back();
      pieces_.pop_back();
      if (!chunk.kept) Peak(chunk.size());  // the recomputed graph lives during its backward
      Emit({.kind = StepKind::kBackward,
            .reuses_graph = chunk.kept,
            .rollout = rollout,
            .begin = chunk.begin,
            .end = chunk.end});
      Emit({.kind = StepKind::kPop, .rollout = rollout, .begin = chunk.begin, .end = chunk.end});
      if (chunk.kept) live_ -= chunk.size();
      if (chunk.budgeted) budgeted_ -= chunk.size();
      top_ = chunk.begin;
    }
  }

 private:
  struct Piece {
    int64_t begin = 0, end = 0;
    bool kept = false;      // forwarded with a graph that its backward reuses
    bool budgeted = false;  // kept under the graph budget
    int64_t size() const { return end - begin; }
  };

  void Emit(Step step) { schedule_.steps.push_back(step); }
  void Peak(int64_t transient = 0) {
    schedule_.peak_stack = std::max(schedule_.peak_stack, top_);
    schedule_.peak_live_graphs = std::max(schedule_.peak_live_graphs, live_ + transient);
  }

  const int64_t block_;
  const int64_t budget_;
  const bool training_;
  Schedule& schedule_;
  int64_t top_ = 0;
  std::vector<Piece> pieces_;  // the stack's chunks, bottom to top (training)
  bool pieces_open_ = false;   // the last step is a forward of the chunks being pushed
  int64_t live_ = 0;           // tokens of kept graphs alive
  int64_t budgeted_ = 0;       // of which kept under the budget
};

void Summarize(Schedule& schedule) {
  for (const Step& step : schedule.steps) {
    switch (step.kind) {
      case StepKind::kForward:
        schedule.num_forward_steps++;
        (step.with_graph ? schedule.forwarded_with_graph : schedule.forwarded_without_graph) +=
            step.size();
        break;
      case StepKind::kBackward:
        schedule.num_backward_steps++;
        schedule.backpropagated += step.size();
        if (!step.reuses_graph) schedule.recomputed += step.size();
        schedule.largest_backward = std::max(schedule.largest_backward, step.size());
        break;
      case StepKind::kPacked:
        schedule.num_packed_steps++;
        schedule.packed += step.size();
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
    return absl::InvalidArgumentError(
        absl::StrCat("block_size must be >= 1, got ", options.block_size));
  }
  if (options.graph_budget < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("graph_budget must be >= 0, got ", options.graph_budget));
  }
  RETURN_IF_ERROR(CheckDfsLeafOrder(tree, order));

  Schedule schedule;
  schedule.order.assign(order.begin(), order.end());
  schedule.block_size = options.block_size;
  schedule.graph_budget = options.graph_budget;
  schedule.training = options.training;
  schedule.tree_tokens = tree.num_tree_tokens();
  const std::vector<int64_t> lcp = ConsecutiveLcps(tree, order);
  std::vector<int64_t> length(order.size());
  for (size_t i = 0; i < order.size(); ++i) length[i] = tree.rollout_length(order[i]);
  const std::vector<Unit> units =
      MakeUnits(length, lcp, options.block_size, options.pack && options.training);

  Planner planner(options, schedule);
  std::vector<int64_t> cuts;
  for (size_t u = 0; u < units.size(); ++u) {
    const Unit& unit = units[u];
    const RolloutIndex head = order[unit.first];
    if (u > 0) planner.PopTo(order[units[u - 1].last - 1], unit.lcp);
    // Later pops that stop inside this unit's forward range: the running minimum of the later
    // units' LCPs, until it falls to where the range starts.
    cuts.clear();
    int64_t low = unit.top;
    for (size_t v = u + 1; v < units.size() && low > unit.lcp; ++v) {
      if (units[v].lcp < low) {
        low = units[v].lcp;
        if (low > unit.lcp) cuts.push_back(low);
      }
    }
    const int64_t next_target = u + 1 < units.size() ? units[u + 1].lcp : 0;
    const bool auto_keep = next_target < unit.top && unit.packed_tokens == 0;
    planner.Forward(head, unit.lcp, unit.top, cuts, auto_keep);
    if (unit.packed_tokens > 0) {
      planner.Packed(head, unit.first, unit.last, unit.packed_tokens);
    } else {
      planner.AttachLoss(head, unit.top);
    }
  }
  if (!units.empty()) planner.PopTo(order[units.back().last - 1], 0);
  Summarize(schedule);
  return schedule;
}

ScheduleOptions LargestBlockRecomputingNoMore(
    const ScheduleOptions& options, int64_t tokens,
    absl::FunctionRef<int64_t(const ScheduleOptions&)> recomputed) {
  if (!options.pack || !options.training || options.block_size < 1 ||
      options.block_size >= kUnboundedBlock / 4 || options.graph_budget <= 0 ||
      options.graph_budget >= kUnboundedBlock / 4) {
    return options;
  }
  const int64_t capacity = options.block_size + options.graph_budget;
  const int64_t base = recomputed(options);
  ScheduleOptions best = options;
  while (best.block_size < tokens && 2 * best.block_size <= capacity) {
    ScheduleOptions next = best;
    next.block_size = 2 * best.block_size;
    next.graph_budget = capacity - next.block_size;
    if (recomputed(next) > base) break;
    best = next;
  }
  return best;
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
    case StepKind::kPacked:
      return absl::StrCat("packed [", step.first, ",", step.last, ") above ", step.begin, ": ",
                          step.packed_tokens, " tokens");
  }
  return "?";
}

}  // namespace dta

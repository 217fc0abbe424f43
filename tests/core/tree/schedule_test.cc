#include "core/tree/schedule.h"

#include <algorithm>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/tree/leaf_order.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/tree/random_trees.h"

namespace dta {
namespace {

using ::testing::ElementsAre;

// Index of position `p` of rollout `r` among the tree's unique tokens (serialized order).
int64_t TreeToken(const PrefixTree& tree, RolloutIndex r, int64_t p) {
  const NodeId v = tree.NodeAt(r, p);
  return tree.token_offset(v) + p - tree.depth(v);
}

// Replays a schedule on a simulated stack of tree tokens and checks every invariant the executor
// relies on. Returns an empty string when all hold, else the first violation.
std::string Violation(const PrefixTree& tree, const Schedule& s) {
  const int64_t n = tree.num_tree_tokens();
  const int64_t block = s.block_size;
  // Live graphs may reach the budget plus one chunk; saturate to avoid overflow with B unbounded.
  const int64_t graph_limit =
      block > kUnboundedBlock - s.graph_budget ? kUnboundedBlock : block + s.graph_budget;
  std::vector<int64_t> stack;
  std::vector<int> forwarded(n, 0), backpropagated(n, 0), attached(tree.num_rollouts(), 0);
  std::vector<std::pair<int64_t, int64_t>> graphs;  // kept graphs, bottom to top
  int64_t live = 0, peak_live = 0;
  int64_t longest = 0;
  for (RolloutIndex r = 0; r < tree.num_rollouts(); ++r)
    longest = std::max(longest, tree.rollout_length(r));

  // Backpropagates tree token t, checking that every gradient it needs has arrived.
  auto backprop = [&](int64_t t, NodeId v) -> std::string {
    // All descendants backpropagated, all losses through it attached.
    for (int64_t d = t + 1; d < tree.token_offset(tree.subtree_end(v)); ++d) {
      if (backpropagated[d] != 1)
        return absl::StrCat("descendant ", d, " of ", t, " not backpropagated");
    }
    for (RolloutIndex r = 0; r < tree.num_rollouts(); ++r) {
      if (tree.IsAncestorOrSelf(v, tree.end_node(r)) && attached[r] != 1) {
        return absl::StrCat("loss of rollout ", r, " through token ", t, " not attached");
      }
    }
    if (backpropagated[t]++) return absl::StrCat("tree token ", t, " backpropagated twice");
    return "";
  };
  auto check_live = [&](int64_t transient) -> bool {
    peak_live = std::max(peak_live, live + transient);
    return live + transient <= graph_limit;
  };

  for (size_t i = 0; i < s.steps.size(); ++i) {
    const Step& step = s.steps[i];
    const std::string where = absl::StrCat("step ", i, " (", StepToString(step), "): ");
    if (step.kind == StepKind::kPacked) {
      if (!s.training) return where + "packed step in a forward-only schedule";
      if (step.begin != static_cast<int64_t>(stack.size()) || step.end != step.begin)
        return where + "not at the top";
      if (step.last - step.first < 2 || step.last > static_cast<int32_t>(s.order.size()))
        return where + "bad run";
      if (step.size() > block) return where + "packed step larger than B";
      if (!check_live(step.size())) return where + "live graphs exceed B + budget";
      std::set<std::pair<int64_t, NodeId>> tokens;
      for (int32_t k = step.first; k < step.last; ++k) {
        const RolloutIndex r = s.order[k];
        if (tree.rollout_length(r) < step.begin)
          return where + "rollout shorter than the packed depth";
        for (int64_t p = 0; p < tree.rollout_length(r); ++p) {
          const int64_t t = TreeToken(tree, r, p);
          if (p < step.begin) {
            if (stack[p] != t)
              return where +
                     absl::StrCat("position ", p, " of rollout ", r, " is not on the stack");
          } else {
            tokens.emplace(t, tree.NodeAt(r, p));
          }
        }
      }
      if (static_cast<int64_t>(tokens.size()) != step.packed_tokens)
        return where + "packed token count";
      for (const auto& [t, v] : tokens) {
        if (forwarded[t]++) return where + absl::StrCat("tree token ", t, " forwarded twice");
      }
      for (int32_t k = step.first; k < step.last; ++k) {
        if (attached[s.order[k]]++) return where + "loss attached twice";
      }
      for (auto it = tokens.rbegin(); it != tokens.rend(); ++it) {  // descendants first
        if (std::string v = backprop(it->first, it->second); !v.empty()) return where + v;
      }
      continue;
    }
    if (step.begin < 0 || step.begin >= step.end || step.end > tree.rollout_length(step.rollout)) {
      return where + "bad range";
    }
    // Ancestors on the stack: whatever is below the range is exactly this rollout's path.
    const int64_t below =
        step.kind == StepKind::kForward ? static_cast<int64_t>(stack.size()) : step.begin;
    if (step.kind == StepKind::kForward && step.begin != below)
      return where + "does not start at the top";
    if (step.kind != StepKind::kForward && step.end != static_cast<int64_t>(stack.size())) {
      return where + "range does not end at the top of the stack";
    }
    for (int64_t p = 0; p < below; ++p) {
      if (stack[p] != TreeToken(tree, step.rollout, p))
        return where + absl::StrCat("position ", p, " is not an ancestor");
    }
    switch (step.kind) {
      case StepKind::kForward:
        if (step.with_graph) {
          if (!s.training) return where + "graph in a forward-only schedule";
          if (step.size() > block) return where + "graph larger than B";
          graphs.emplace_back(step.begin, step.end);
          live += step.size();
          if (!check_live(0)) return where + "live graphs exceed B + budget";
        }
        for (int64_t p = step.begin; p < step.end; ++p) {
          const int64_t t = TreeToken(tree, step.rollout, p);
          if (forwarded[t]++) return where + absl::StrCat("tree token ", t, " forwarded twice");
          stack.push_back(t);
        }
        break;
      case StepKind::kAttachLoss:
        if (attached[step.rollout]++) return where + "loss attached twice";
        if (step.begin != 0 || step.end != tree.rollout_length(step.rollout))
          return where + "loss range is not the rollout";
        break;
      case StepKind::kBackward: {
        if (!s.training) return where + "backward in a forward-only schedule";
        if (step.size() > block) return where + "chunk larger than B";
        if (step.reuses_graph) {
          if (graphs.empty() || graphs.back() != std::make_pair(step.begin, step.end)) {
            return where + "reuses a graph that is not the top live graph";
          }
          graphs.pop_back();
          live -= step.size();
        } else {
          if (!graphs.empty() && graphs.back().second > step.begin)
            return where + "recomputes below a live graph";
          if (!check_live(step.size())) return where + "live graphs exceed B + budget";
        }
        for (int64_t p = step.end - 1; p >= step.begin; --p) {
          if (std::string v = backprop(stack[p], tree.NodeAt(step.rollout, p)); !v.empty())
            return where + v;
        }
        break;
      }
      case StepKind::kPop:
        for (int64_t p = step.begin; p < step.end; ++p) {
          if (s.training && backpropagated[stack[p]] != 1)
            return where + "pops a token never backpropagated";
        }
        if (!graphs.empty() && graphs.back().second > step.begin)
          return where + "pops a live graph";
        stack.resize(step.begin);
        break;
      case StepKind::kPacked:
        break;
    }
    if (static_cast<int64_t>(stack.size()) > longest)
      return where + "stack exceeds the longest rollout";
  }
  if (!stack.empty()) return "stack not empty at the end";
  if (!graphs.empty()) return "graphs alive at the end";
  for (int64_t t = 0; t < n; ++t) {
    if (forwarded[t] != 1)
      return absl::StrCat("tree token ", t, " forwarded ", forwarded[t], " times");
    if (s.training && backpropagated[t] != 1)
      return absl::StrCat("tree token ", t, " backpropagated ", backpropagated[t], " times");
  }
  for (RolloutIndex r = 0; r < tree.num_rollouts(); ++r) {
    if (attached[r] != 1)
      return absl::StrCat("rollout ", r, " loss attached ", attached[r], " times");
  }
  // The summary agrees with the steps.
  if (s.forwarded_with_graph + s.forwarded_without_graph + s.packed != n)
    return "summary: forwarded tokens";
  if (s.training && s.backpropagated + s.packed != n) return "summary: backpropagated tokens";
  if (s.training && s.recomputed != s.forwarded_without_graph)
    return "summary: every no-graph token is recomputed once";
  if (s.peak_stack > longest) return "summary: peak stack";
  if (s.largest_backward > block) return "summary: largest chunk";
  if (s.training && s.peak_live_graphs != peak_live)
    return absl::StrCat("summary: peak live graphs ", s.peak_live_graphs, " != ", peak_live);
  return "";
}

TEST(Schedule, InvariantsHoldOnThousandsOfRandomTrees) {
  const int64_t blocks[] = {1, 2, 3, 5, 64, kUnboundedBlock};
  struct Variant {
    bool training;
    int64_t budget;
    bool pack;
  };
  const Variant variants[] = {{true, 0, false}, {true, 7, false}, {true, 1000, false},
                              {true, 0, true},  {true, 9, true},  {false, 0, false}};
  int checked = 0, packed = 0, kept_by_budget = 0;
  for (uint64_t seed = 0; seed < 600; ++seed) {
    const PrefixTree tree = *PrefixTree::FromRollouts(testing::RandomRollouts(seed));
    for (const auto& order : {LexicographicOrder(tree), BackwardDfsOrder(tree)}) {
      for (int64_t block : blocks) {
        for (const Variant& v : variants) {
          absl::StatusOr<Schedule> s = BuildSchedule(tree, order,
                                                     {.block_size = block,
                                                      .graph_budget = v.budget,
                                                      .pack = v.pack,
                                                      .training = v.training});
          ASSERT_TRUE(s.ok()) << s.status();
          ASSERT_EQ(Violation(tree, *s), "")
              << "seed " << seed << " B " << block << " training " << v.training << " budget "
              << v.budget << " pack " << v.pack;
          ++checked;
          packed += s->num_packed_steps > 0;
          kept_by_budget += v.budget > 0 && s->recomputed < tree.num_tree_tokens() / 2;
        }
      }
    }
  }
  EXPECT_EQ(checked, 600 * 2 * 6 * 6);
  // The variants really exercise packing and the budget.
  EXPECT_GT(packed, 1000);
  EXPECT_GT(kept_by_budget, 1000);
}

TEST(Schedule, BudgetRemovesRecomputation) {
  const PrefixTree tree = *PrefixTree::FromRollouts({{1, 2, 3, 4, 5, 6}, {1, 2, 3, 7}, {1, 9}});
  const auto order = LexicographicOrder(tree);
  const Schedule paper = *BuildSchedule(tree, order, {.block_size = 2});
  const Schedule roomy = *BuildSchedule(tree, order, {.block_size = 2, .graph_budget = 100});
  EXPECT_GT(paper.recomputed, 0);
  EXPECT_EQ(roomy.recomputed, 0);
  EXPECT_EQ(Violation(tree, roomy), "");
}

TEST(Schedule, PacksSiblingLeavesIntoOneStep) {
  // A 4-token prompt and eight 2-token answers: one forward of the prompt, one packed step.
  std::vector<std::vector<TokenId>> rollouts;
  for (int i = 0; i < 8; ++i) rollouts.push_back({1, 2, 3, 4, 10 + i, 20 + i});
  const PrefixTree tree = *PrefixTree::FromRollouts(rollouts);
  const Schedule s =
      *BuildSchedule(tree, LexicographicOrder(tree), {.block_size = 16, .pack = true});
  std::vector<std::string> steps;
  for (const Step& step : s.steps) steps.push_back(StepToString(step));
  EXPECT_THAT(steps, ElementsAre("forward r0 [0,4)", "packed [0,8) above 4: 16 tokens",
                                 "backward r7 [0,4) recompute", "pop r7 [0,4)"));
  EXPECT_EQ(Violation(tree, s), "");
}

// A 4-token prompt and eight 2-token answers (20 tree tokens), B and the graph budget sharing the
// memory of B + G tokens of graphs.
class LargestBlock : public ::testing::Test {
 protected:
  LargestBlock() {
    std::vector<std::vector<TokenId>> rollouts;
    for (int i = 0; i < 8; ++i) rollouts.push_back({1, 2, 3, 4, 10 + i, 20 + i});
    tree_ = *PrefixTree::FromRollouts(rollouts);
    order_ = LexicographicOrder(tree_);
  }
  Schedule At(const ScheduleOptions& options) { return *BuildSchedule(tree_, order_, options); }
  ScheduleOptions Largest(const ScheduleOptions& options) {
    return LargestBlockRecomputingNoMore(options, tree_.num_tree_tokens(),
                                         [&](const ScheduleOptions& o) {
                                           ++calls_;
                                           return At(o).recomputed;
                                         });
  }
  PrefixTree tree_ = *PrefixTree::FromRollouts({{1}});
  std::vector<RolloutIndex> order_;
  int calls_ = 0;
};

TEST_F(LargestBlock, PacksMoreWhileNothingMoreIsRecomputed) {
  const ScheduleOptions base{.block_size = 4, .graph_budget = 28, .pack = true};
  const ScheduleOptions grown = Largest(base);
  // B = 32 would leave no budget for the prompt's graph: recomputed, so B stops at 16.
  EXPECT_EQ(grown.block_size, 16);
  EXPECT_EQ(grown.graph_budget, 16);
  EXPECT_EQ(At(base).recomputed, 0);
  EXPECT_EQ(At(grown).recomputed, 0);
  EXPECT_EQ(At(base).num_packed_steps, 4);
  EXPECT_EQ(At(grown).num_packed_steps, 1);
  EXPECT_EQ(Violation(tree_, At(grown)), "");
  ScheduleOptions doubled = base;
  doubled.block_size = 32;
  doubled.graph_budget = 0;
  EXPECT_GT(At(doubled).recomputed, 0);
}

TEST_F(LargestBlock, KeepsTheBlockWhenALargerOneWouldRecompute) {
  const ScheduleOptions tight{.block_size = 4, .graph_budget = 4, .pack = true};
  EXPECT_EQ(Largest(tight).block_size, 4);
  EXPECT_EQ(Largest(tight).graph_budget, 4);
}

TEST_F(LargestBlock, StopsOnceTheBlockHoldsTheWholeTree) {
  // 20 tree tokens: 4 -> 8 -> 16 -> 32, the first at least 20; the budget takes what B leaves.
  const ScheduleOptions roomy{.block_size = 4, .graph_budget = 1000, .pack = true};
  const ScheduleOptions grown = Largest(roomy);
  EXPECT_EQ(grown.block_size, 32);
  EXPECT_EQ(grown.graph_budget, 972);
  EXPECT_EQ(calls_, 4);  // the base and three doublings
}

TEST_F(LargestBlock, LeavesOptionsWithoutPackingOrBudgetAsGiven) {
  for (const ScheduleOptions& options :
       {ScheduleOptions{.block_size = 4, .graph_budget = 28},
        ScheduleOptions{.block_size = 4, .graph_budget = 0, .pack = true},
        ScheduleOptions{.block_size = 4, .graph_budget = 28, .pack = true, .training = false},
        ScheduleOptions{.graph_budget = 28, .pack = true}}) {
    const ScheduleOptions same = Largest(options);
    EXPECT_EQ(same.block_size, options.block_size);
    EXPECT_EQ(same.graph_budget, options.graph_budget);
  }
  EXPECT_EQ(calls_, 0);
}

TEST(Schedule, WorkedExample) {
  // Rollouts {1,2,3,4} and {1,2,5}: they share positions [0,2). B = 2, lexicographic order.
  const PrefixTree tree = *PrefixTree::FromRollouts({{1, 2, 3, 4}, {1, 2, 5}});
  const Schedule s = *BuildSchedule(tree, LexicographicOrder(tree), {.block_size = 2});
  std::vector<std::string> steps;
  for (const Step& step : s.steps) steps.push_back(StepToString(step));
  EXPECT_THAT(steps, ElementsAre("forward r0 [0,2)",        // anchor: the shared prefix
                                 "forward r0 [2,4) graph",  // the next pop's first chunk
                                 "loss r0", "backward r0 [2,4) kept", "pop r0 [2,4)",
                                 "forward r1 [2,3) graph",  // only the new suffix
                                 "loss r1", "backward r1 [2,3) kept", "pop r1 [2,3)",
                                 "backward r1 [0,2) recompute", "pop r1 [0,2)"));
  EXPECT_EQ(s.recomputed, 2);
  EXPECT_DOUBLE_EQ(s.recompute_overhead(), 2.0 / 5);
  EXPECT_EQ(s.peak_stack, 4);
}

TEST(Schedule, LongSuffixIsPoppedInEvenChunks) {
  // One rollout of 10 tokens, B = 4: ceil(10/4) = 3 chunks of 4, 3, 3 from the right.
  const PrefixTree tree = *PrefixTree::FromRollouts({std::vector<TokenId>(10, 1)});
  const Schedule s = *BuildSchedule(tree, LexicographicOrder(tree), {.block_size = 4});
  std::vector<std::string> backward;
  for (const Step& step : s.steps) {
    if (step.kind == StepKind::kBackward) backward.push_back(StepToString(step));
  }
  EXPECT_THAT(backward, ElementsAre("backward r0 [6,10) kept", "backward r0 [3,6) recompute",
                                    "backward r0 [0,3) recompute"));
}

TEST(Schedule, ForwardOnlyComputesEachTokenOnce) {
  const PrefixTree tree = *PrefixTree::FromRollouts({{1, 2, 3}, {1, 2, 4}, {1, 2}});
  const Schedule s = *BuildSchedule(tree, LexicographicOrder(tree), {.training = false});
  EXPECT_EQ(s.forwarded_without_graph, 4);
  EXPECT_EQ(s.num_backward_steps, 0);
  EXPECT_EQ(Violation(tree, s), "");
}

TEST(Schedule, RejectsBadOptionsAndOrders) {
  const PrefixTree tree = *PrefixTree::FromRollouts({{1, 2}, {1, 3}, {4}});
  EXPECT_EQ(BuildSchedule(tree, LexicographicOrder(tree), {.block_size = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildSchedule(tree, std::vector<RolloutIndex>{0, 2, 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Schedule, DeepAndWideTreesStayBounded) {
  // A 10,000-token chain, a 512-way branch, and a 100,000-token-deep tree: the schedule is
  // iterative, and the stack never exceeds the longest rollout.
  std::vector<std::vector<TokenId>> rollouts = {std::vector<TokenId>(10'000, 3)};
  for (int i = 0; i < 512; ++i) rollouts.push_back({7, 7, 1000 + i});
  std::vector<TokenId> deep(100'000);
  for (size_t i = 0; i < deep.size(); ++i) deep[i] = 10 + static_cast<TokenId>(i % 97);
  for (int64_t cut : {100'000, 99'999, 50'000, 1}) {
    std::vector<TokenId> r(deep.begin(), deep.begin() + cut);
    r.push_back(5);
    rollouts.push_back(std::move(r));
  }
  const PrefixTree tree = *PrefixTree::FromRollouts(rollouts);
  for (const auto& order : {LexicographicOrder(tree), BackwardDfsOrder(tree)}) {
    for (int64_t block : {int64_t{2048}, kUnboundedBlock}) {
      const Schedule s = *BuildSchedule(tree, order, {.block_size = block});
      EXPECT_EQ(s.backpropagated, tree.num_tree_tokens());
      EXPECT_EQ(s.peak_stack, 100'001);
      EXPECT_LE(s.largest_backward, block);
    }
  }
}

}  // namespace
}  // namespace dta

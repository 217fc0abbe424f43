// Google Benchmark for the dispatcher's per-step planning at the scale: 4,096 rollouts of
// 16,384 tokens (67M rollout tokens) through PlanPartitions (tree, GRPO advantages, normalisers,
// the DFS-contiguous split over 8 trainers). Two shapes bound the cost from both sides:
//   grpo   256 prompts of 2,048 tokens, 16 samples each sharing nothing else (C = 1.14: almost
//          every token is unique);
//   agent  256 tasks whose 16 rollouts form a binary tree of turns: a 2,048-token prompt, then four
//          levels of 3,584-token turns (C = 2.4: long shared paths).
// Run: build/bin/dta-plan-bench [--benchmark_filter=...]
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "dispatcher/batch/batch_plan.h"

namespace dta {
namespace {

constexpr int kTasks = 256;
constexpr int kRolloutsPerTask = 16;
constexpr int kPromptTokens = 2048;
constexpr int kRolloutTokens = 16384;
constexpr int kVocab = 151936;

std::vector<TokenId> RandomTokens(std::mt19937& rng, int n) {
  std::vector<TokenId> tokens(n);
  for (TokenId& t : tokens) t = static_cast<TokenId>(rng() % kVocab);
  return tokens;
}

// Rollout `s` of a task: the prompt, then `levels` turns where turn l is shared by the rollouts
// that agree on the top l + 1 bits of s (levels = 0: the rest is the sample's own).
Rollout MakeRollout(const std::vector<std::vector<TokenId>>& turns, int task, int sample,
                    std::mt19937& rng) {
  Rollout r;
  r.id = absl::StrCat("t", task, "-s", sample);
  r.group = absl::StrCat("t", task);
  for (const auto& turn : turns) r.tokens.insert(r.tokens.end(), turn.begin(), turn.end());
  if (static_cast<int>(r.tokens.size()) < kRolloutTokens) {
    const std::vector<TokenId> rest =
        RandomTokens(rng, kRolloutTokens - static_cast<int>(r.tokens.size()));
    r.tokens.insert(r.tokens.end(), rest.begin(), rest.end());
  }
  r.loss_mask.assign(r.tokens.size(), 1);
  r.loss_mask[0] = 0;
  r.logprobs.assign(r.tokens.size(), -1.0f);
  r.reward = static_cast<double>(rng() % 1000) / 1000.0;
  return r;
}

// levels <= 4: 2^levels branches must not outnumber a task's 16 rollouts.
std::vector<Rollout> MakeBatch(int levels) {
  std::mt19937 rng(2026);
  std::vector<Rollout> batch;
  batch.reserve(kTasks * kRolloutsPerTask);
  const int turn_tokens = levels == 0 ? 0 : (kRolloutTokens - kPromptTokens) / levels;
  for (int task = 0; task < kTasks; ++task) {
    const std::vector<TokenId> prompt = RandomTokens(rng, kPromptTokens);
    // turn[l][b]: the turn at level l on the branch whose top l + 1 bits are b.
    std::vector<std::vector<std::vector<TokenId>>> turn(levels);
    for (int l = 0; l < levels; ++l) {
      for (int b = 0; b < (2 << l); ++b) turn[l].push_back(RandomTokens(rng, turn_tokens));
    }
    for (int s = 0; s < kRolloutsPerTask; ++s) {
      std::vector<std::vector<TokenId>> path = {prompt};
      for (int l = 0; l < levels; ++l) path.push_back(turn[l][s >> (3 - l)]);
      batch.push_back(MakeRollout(path, task, s, rng));
    }
  }
  return batch;
}

void BM_PlanPartitions(benchmark::State& state) {
  const std::vector<Rollout> batch = MakeBatch(static_cast<int>(state.range(0)));
  std::vector<const Rollout*> pointers;
  for (const Rollout& r : batch) pointers.push_back(&r);
  double compression = 0;
  for (auto _ : state) {
    absl::StatusOr<PartitionPlan> plan = PlanPartitions(pointers, 8, /*with_advantages=*/true, {});
    if (!plan.ok()) {
      state.SkipWithError(std::string(plan.status().message()).c_str());
      break;
    }
    compression = static_cast<double>(int64_t{kTasks} * kRolloutsPerTask * kRolloutTokens) /
                  static_cast<double>(plan->partition.combined_tree_tokens);
    benchmark::DoNotOptimize(plan->ranks.data());
  }
  state.SetItemsProcessed(state.iterations() * int64_t{kTasks} * kRolloutsPerTask * kRolloutTokens);
  state.counters["C"] = compression;
}
// Arg: levels of shared turns below the prompt (0: the grpo shape, 4: the agent shape).
BENCHMARK(BM_PlanPartitions)->Arg(0)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace dta

BENCHMARK_MAIN();

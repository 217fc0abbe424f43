// Google Benchmark for the torch-free core at the scale: 1,024 rollouts of 16K tokens
// (16M rollout tokens), shaped like GRPO groups: 64 prompts of 2,048 tokens, 16 samples each
// whose responses share nothing. Run: build/bin/dta-tree-bench [--benchmark_filter=...]
#include <cstdint>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/partition/partition.h"
#include "core/tree/leaf_order.h"
#include "core/tree/schedule.h"
#include "core/tree/tree_stats.h"

namespace dta {
namespace {

constexpr int kPrompts = 64;
constexpr int kSamples = 16;
constexpr int kPromptTokens = 2048;
constexpr int kRolloutTokens = 16384;

const std::vector<std::vector<TokenId>>& Rollouts() {
  static const auto* rollouts = [] {
    auto* out = new std::vector<std::vector<TokenId>>();
    std::mt19937 rng(2026);
    for (int p = 0; p < kPrompts; ++p) {
      std::vector<TokenId> prompt(kPromptTokens);
      for (auto& t : prompt) t = static_cast<TokenId>(rng() % 151936);
      for (int s = 0; s < kSamples; ++s) {
        std::vector<TokenId> r = prompt;
        r.resize(kRolloutTokens);
        for (int i = kPromptTokens; i < kRolloutTokens; ++i)
          r[i] = static_cast<TokenId>(rng() % 151936);
        out->push_back(std::move(r));
      }
    }
    return out;
  }();
  return *rollouts;
}

const PrefixTree& Tree() {
  static const PrefixTree* tree = new PrefixTree(*PrefixTree::FromRollouts(Rollouts()));
  return *tree;
}

void SetTokens(benchmark::State& state) {
  state.SetItemsProcessed(state.iterations() * int64_t{kPrompts} * kSamples * kRolloutTokens);
  state.counters["rollouts"] = kPrompts * kSamples;
}

void BM_BuildTree(benchmark::State& state) {
  const auto& rollouts = Rollouts();
  for (auto _ : state) {
    PrefixTreeBuilder builder;
    for (const auto& r : rollouts) benchmark::DoNotOptimize(builder.AddRollout(r));
    PrefixTree tree = std::move(builder).Build();
    benchmark::DoNotOptimize(tree.num_nodes());
  }
  SetTokens(state);
}
BENCHMARK(BM_BuildTree)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_TreeStats(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(ComputeTreeStats(Tree()));
  SetTokens(state);
}
BENCHMARK(BM_TreeStats)->Unit(benchmark::kMicrosecond);

void BM_LexicographicOrder(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(LexicographicOrder(Tree()));
  SetTokens(state);
}
BENCHMARK(BM_LexicographicOrder)->Unit(benchmark::kMicrosecond);

void BM_BackwardDfsOrder(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(BackwardDfsOrder(Tree()));
  SetTokens(state);
}
BENCHMARK(BM_BackwardDfsOrder)->Unit(benchmark::kMicrosecond);

void BM_Schedule(benchmark::State& state) {
  const std::vector<RolloutIndex> order = BackwardDfsOrder(Tree());
  for (auto _ : state)
    benchmark::DoNotOptimize(BuildSchedule(Tree(), order, {.block_size = state.range(0)}));
  SetTokens(state);
}
BENCHMARK(BM_Schedule)->Arg(2048)->Arg(4096)->Unit(benchmark::kMicrosecond);

void BM_PartitionDfsContiguous(benchmark::State& state) {
  for (auto _ : state)
    benchmark::DoNotOptimize(PartitionDfsContiguous(Tree(), static_cast<int>(state.range(0))));
  SetTokens(state);
}
BENCHMARK(BM_PartitionDfsContiguous)->Arg(8)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace dta

BENCHMARK_MAIN();

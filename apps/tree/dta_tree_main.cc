// dta-tree: what a rollout file shares, how the push/pop executor would run it, and how it splits
// across trainer GPUs.
//
//   dta-tree [--block_size=2048] [--partitions=8] [--order=backward-dfs] [--json] FILE.jsonl...
//
// Exit status: 0 on success, 2 on bad input (unreadable file, malformed rollout, bad flag value).
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/exit_codes.h"
#include "core/cli/usage.h"
#include "core/io/rollout_jsonl.h"
#include "core/partition/partition.h"
#include "core/tree/leaf_order.h"
#include "core/tree/schedule.h"
#include "core/tree/tree_partition.h"
#include "core/tree/tree_stats.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int64_t, block_size, 2048, "B: the most tokens per backward chunk (0 = unbounded)");
ABSL_FLAG(int32_t, partitions, 8, "K: number of trainer GPUs to split the batch across");
ABSL_FLAG(std::string, order, "backward-dfs",
          "leaf order: backward-dfs (Algorithm 1) or lexicographic");
ABSL_FLAG(int64_t, vocab_size, 0, "reject token ids >= this (0: no upper bound)");
ABSL_FLAG(int64_t, token_capacity, 24576,
          "packed tree (Tree Training): the most unique tokens per packed forward (0: skip this "
          "section)");
ABSL_FLAG(bool, json, false, "print JSON instead of tables");

namespace dta {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

std::string Thousands(int64_t value) {
  std::string digits = absl::StrCat(value < 0 ? -value : value);
  for (int i = static_cast<int>(digits.size()) - 3; i > 0; i -= 3)
    digits.insert(static_cast<size_t>(i), 1, ',');
  if (value < 0) digits.insert(digits.begin(), '-');
  return digits;
}

nlohmann::json PartitionJson(const Partition& p) {
  return {{"max_cost", p.max_cost},
          {"cost", p.cost},
          {"imbalance", p.imbalance},
          {"extra_tokens", p.extra_tokens},
          {"combined_tree_tokens", p.combined_tree_tokens}};
}

int Run(const std::string& path) {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::vector<Rollout>> rollouts =
      ReadRolloutsJsonl(path, {.vocab_size = absl::GetFlag(FLAGS_vocab_size)});
  if (!rollouts.ok()) {
    std::cerr << "dta-tree: " << rollouts.status().message() << "\n";
    return kExitBadInput;
  }
  const double read_seconds = Seconds(start);
  const auto build_start = std::chrono::steady_clock::now();
  PrefixTreeBuilder builder;
  for (const Rollout& rollout : *rollouts) {
    // ReadRolloutsJsonl validated every rollout, so adding cannot fail.
    if (auto added = builder.AddRollout(rollout.tokens); !added.ok()) {
      std::cerr << "dta-tree: " << path << ": rollout '" << rollout.id
                << "': " << added.status().message() << "\n";
      return kExitBadInput;
    }
  }
  const PrefixTree tree = std::move(builder).Build();
  const double build_seconds = Seconds(build_start);
  const TreeStats stats = ComputeTreeStats(tree);

  const std::string order_name = absl::GetFlag(FLAGS_order);
  const std::vector<RolloutIndex> order =
      order_name == "lexicographic" ? LexicographicOrder(tree) : BackwardDfsOrder(tree);
  const int64_t block =
      absl::GetFlag(FLAGS_block_size) == 0 ? kUnboundedBlock : absl::GetFlag(FLAGS_block_size);
  const Schedule schedule = *BuildSchedule(tree, order, {.block_size = block});
  const int k = absl::GetFlag(FLAGS_partitions);
  const Partition ours = *PartitionDfsContiguous(tree, k);
  const Partition by_tokens = *PartitionGreedyByRolloutTokens(tree, k);
  const Partition by_tree = *PartitionGreedyByTreeTokens(tree, k);

  // Tree Training's partitioning under a token capacity (capacities below the longest rollout
  // cannot hold it: reported, not fatal).
  const int64_t capacity = absl::GetFlag(FLAGS_token_capacity);
  absl::StatusOr<TreePartition> packed = absl::FailedPreconditionError("skipped");
  if (capacity > 0) packed = PartitionTreeGreedy(tree, capacity);

  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json out = {
        {"file", path},
        {"tree",
         {{"rollouts", stats.num_rollouts},
          {"nodes", stats.num_nodes},
          {"leaves", stats.num_leaves},
          {"prefix_rollouts", stats.num_prefix_rollouts},
          {"duplicate_rollouts", stats.num_duplicate_rollouts},
          {"rollout_tokens", stats.rollout_tokens},
          {"tree_tokens", stats.tree_tokens},
          {"leaf_tokens", stats.leaf_tokens},
          {"longest_rollout", stats.longest_rollout},
          {"max_children", stats.max_children},
          {"max_level", stats.max_level},
          {"compression", stats.compression},
          {"prefix_sharing", stats.prefix_sharing},
          {"leaf_compression", stats.leaf_compression},
          {"potential_overlap_ratio", stats.potential_overlap_ratio},
          {"attention_compression", stats.attention_compression}}},
        {"schedule",
         {{"order", order_name},
          {"block_size", block == kUnboundedBlock ? 0 : block},
          {"steps", schedule.steps.size()},
          {"forward_steps", schedule.num_forward_steps},
          {"backward_steps", schedule.num_backward_steps},
          {"recomputed_tokens", schedule.recomputed},
          {"recompute_overhead", schedule.recompute_overhead()},
          {"peak_stack", schedule.peak_stack},
          {"largest_backward", schedule.largest_backward}}},
        {"partition",
         {{"ranks", k},
          {"dfs_contiguous", PartitionJson(ours)},
          {"greedy_rollout_tokens", PartitionJson(by_tokens)},
          {"greedy_tree_tokens", PartitionJson(by_tree)}}},
        {"seconds", {{"read", read_seconds}, {"build_tree", build_seconds}}},
    };
    if (packed.ok()) {
      out["packed_tree"] = {{"token_capacity", capacity},
                            {"batches", packed->batches.size()},
                            {"total_tokens", packed->total_tokens},
                            {"flattened_tokens", packed->flattened_tokens},
                            {"effective_reuse_ratio", packed->effective_reuse_ratio}};
    }
    std::cout << out.dump(2) << "\n";
    return 0;
  }

  std::cout << absl::StrFormat(
      "%s: %s rollouts, %s rollout tokens (read %.2f s, tree built in %.3f s)\n", path,
      Thousands(stats.num_rollouts), Thousands(stats.rollout_tokens), read_seconds, build_seconds);
  std::cout << "\nPrefix tree\n";
  std::cout << absl::StrFormat("  %-28s %s\n", "tree tokens", Thousands(stats.tree_tokens));
  std::cout << absl::StrFormat("  %-28s %.2fx (prefix sharing S = %.1f%%)\n", "compression C",
                               stats.compression, 100 * stats.prefix_sharing);
  std::cout << absl::StrFormat("  %-28s %.2fx\n", "leaf-only C", stats.leaf_compression);
  std::cout << absl::StrFormat("  %-28s %.1f%%\n", "POR (leaf paths)",
                               100 * stats.potential_overlap_ratio);
  std::cout << absl::StrFormat("  %-28s %.2fx\n", "attention C_attn", stats.attention_compression);
  std::cout << absl::StrFormat("  %-28s %s / %s\n", "nodes / leaves", Thousands(stats.num_nodes),
                               Thousands(stats.num_leaves));
  std::cout << absl::StrFormat("  %-28s %s / %s\n", "prefix / duplicate rollouts",
                               Thousands(stats.num_prefix_rollouts),
                               Thousands(stats.num_duplicate_rollouts));
  std::cout << absl::StrFormat("  %-28s %s tokens, %d levels\n", "longest rollout",
                               Thousands(stats.longest_rollout), stats.max_level);
  std::cout << absl::StrFormat("  %-28s %d children\n", "widest branch", stats.max_children);

  std::cout << absl::StrFormat("\nPush/pop schedule (B = %s, %s order)\n",
                               block == kUnboundedBlock ? "unbounded" : Thousands(block),
                               order_name);
  std::cout << absl::StrFormat(
      "  %-28s %s (%s forward, %s backward)\n", "steps", Thousands(schedule.steps.size()),
      Thousands(schedule.num_forward_steps), Thousands(schedule.num_backward_steps));
  std::cout << absl::StrFormat("  %-28s %s tokens (%.1f%% of tree tokens)\n",
                               "recomputed for backward", Thousands(schedule.recomputed),
                               100 * schedule.recompute_overhead());
  std::cout << absl::StrFormat("  %-28s %s tokens\n", "peak stack", Thousands(schedule.peak_stack));
  std::cout << absl::StrFormat("  %-28s %s tokens\n", "largest backward chunk",
                               Thousands(schedule.largest_backward));

  if (capacity > 0) {
    std::cout << absl::StrFormat(
        "\nPacked tree under a %s-token capacity (Tree Training's partitioning)\n",
        Thousands(capacity));
    if (packed.ok()) {
      std::cout << absl::StrFormat("  %-28s %s\n", "packed forwards",
                                   Thousands(packed->batches.size()));
      std::cout << absl::StrFormat("  %-28s %s (tree %s, leaf paths %s)\n", "tokens computed",
                                   Thousands(packed->total_tokens), Thousands(packed->tree_tokens),
                                   Thousands(packed->flattened_tokens));
      std::cout << absl::StrFormat("  %-28s %.1f%%\n", "ERR (redundancy removed)",
                                   100 * packed->effective_reuse_ratio);
    } else {
      std::cout << "  " << packed.status().message() << "\n";
    }
  }

  std::cout << absl::StrFormat("\nPartition across %d ranks (cost = tree tokens per rank)\n", k);
  std::cout << absl::StrFormat("  %-30s %12s %10s %14s\n", "method", "max cost", "imbalance",
                               "extra tokens");
  for (const auto& [name, p] :
       {std::pair<const char*, const Partition&>{"dfs-contiguous (Algorithm 4)", ours},
        {"greedy by rollout tokens", by_tokens},
        {"greedy by tree tokens", by_tree}}) {
    std::cout << absl::StrFormat("  %-30s %12s %9.3fx %14s\n", name, Thousands(p.max_cost),
                                 p.imbalance, Thousands(p.extra_tokens));
  }
  return 0;
}

}  // namespace
}  // namespace dta

int main(int argc, char** argv) {
  dta::SetProgramUsage(
      "dta-tree [--block_size=B] [--partitions=K] [--order=O] [--json] FILE.jsonl...");
  std::vector<char*> files = dta::ParseCommandLine(argc, argv);
  files.erase(files.begin());
  if (files.empty()) {
    std::cerr << "dta-tree: no rollout file given\n" << absl::ProgramUsageMessage() << "\n";
    return dta::kExitBadInput;
  }
  if (absl::GetFlag(FLAGS_block_size) < 0 || absl::GetFlag(FLAGS_partitions) < 1) {
    std::cerr << "dta-tree: --block_size must be >= 0 and --partitions >= 1\n";
    return dta::kExitBadInput;
  }
  const std::string order = absl::GetFlag(FLAGS_order);
  if (order != "backward-dfs" && order != "lexicographic") {
    std::cerr << "dta-tree: --order must be backward-dfs or lexicographic, got '" << order << "'\n";
    return dta::kExitBadInput;
  }
  for (char* file : files) {
    if (int status = dta::Run(file); status != 0) return status;
  }
  return 0;
}

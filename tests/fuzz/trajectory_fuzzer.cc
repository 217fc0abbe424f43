// libFuzzer target over the dispatcher's admission gate and everything a batch goes through after
// it: CheckTrajectory (wire) and ParseRolloutJson (files) on arbitrary bytes, then, for every
// accepted rollout, the conversions, a prefix tree and PlanPartitions of a small batch built from
// it, checked against invariants computed independently here.
//
// Input: bytes starting with '{' are one JSON line (ParseRolloutJson); anything else is a
// serialized dta.v1.Trajectory (a serialized Trajectory never starts with '{': that byte is the
// tag of an unknown field 15 as a group).
//
// Seed corpus: `trajectory_fuzzer --write-seeds=DIR` writes a few valid and invalid inputs of both
// kinds into DIR and exits (scripts/fuzz.sh does this before every run).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/types/span.h"
#include "core/io/rollout.h"
#include "core/io/rollout_jsonl.h"
#include "core/partition/partition.h"
#include "core/tree/prefix_tree.h"
#include "dispatcher/batch/batch_plan.h"
#include "dispatcher/wire/trajectory.h"
#include "google/protobuf/stubs/logging.h"
#include "proto/dta/v1/dispatcher.pb.h"

// An invariant of the code under test: on violation, print it and abort, which libFuzzer records
// as a crash (with the input and the stack).
#define FUZZ_CHECK(condition)                                                                  \
  do {                                                                                         \
    if (!(condition)) {                                                                        \
      std::fprintf(stderr, "%s:%d: invariant violated: %s\n", __FILE__, __LINE__, #condition); \
      std::abort();                                                                            \
    }                                                                                          \
  } while (0)

// Like FUZZ_CHECK(status.ok()) for an absl::Status or StatusOr, printing the error.
#define FUZZ_CHECK_OK(expression)                                                       \
  do {                                                                                  \
    const auto& fuzz_result = (expression);                                             \
    if (!fuzz_result.ok()) {                                                            \
      const std::string fuzz_error = ::dta::StatusOf(fuzz_result).ToString();           \
      std::fprintf(stderr, "%s:%d: invariant violated: %s is %s\n", __FILE__, __LINE__, \
                   #expression, fuzz_error.c_str());                                    \
      std::abort();                                                                     \
    }                                                                                   \
  } while (0)

namespace dta {
namespace {

const absl::Status& StatusOf(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

// Small limits keep every execution fast; both are still well inside what the fuzzer can reach.
constexpr int64_t kVocab = 1000;
constexpr int64_t kMaxTokens = 4096;
constexpr int kMaxWorldSize = 3;
// Extra rollouts cut from the accepted one at its "turn boundaries" (see MakeBatch).
constexpr int kMaxTurns = 6;
// Rewards up to this give finite advantages for sure; beyond it GroupAdvantages may refuse them
// (an advantage outside float's range), which is then the expected answer.
constexpr double kMaxCheckedReward = 1e18;

TrajectoryLimits Limits(bool require_reward) {
  TrajectoryLimits limits;
  limits.vocab_size = kVocab;
  limits.max_tokens = kMaxTokens;
  limits.require_reward_or_advantages = require_reward;
  return limits;
}

// The first `n` tokens of `r`, with every per-token field cut to match.
Rollout Truncate(const Rollout& r, size_t n) {
  Rollout out = r;
  out.tokens.resize(n);
  out.loss_mask.resize(n);
  out.logprobs.resize(n);
  if (!out.versions.empty()) out.versions.resize(n);
  if (!out.advantages.empty()) out.advantages.resize(n);
  if (!out.ref_logprobs.empty()) out.ref_logprobs.resize(n);
  return out;
}

// The rollout and deterministic variants of it, so that the tree has shared prefixes, a rollout
// ending at an internal node, a duplicate and branches: a prefix, a copy (reward -r - 1, so its
// group has two distinct rewards), the last token changed (in another group), and for each of the
// first kMaxTurns later positions holding the first token ("turn boundaries", chosen by the fuzzer
// through the token values) the prefix before it and a branch one token past it.
std::vector<Rollout> MakeBatch(const Rollout& r) {
  const size_t n = r.tokens.size();
  std::vector<Rollout> batch = {r};
  Rollout prefix = Truncate(r, (n + 1) / 2);
  prefix.id += "/prefix";
  batch.push_back(std::move(prefix));
  Rollout copy = r;
  copy.id += "/copy";
  if (copy.reward.has_value()) copy.reward = -*copy.reward - 1;
  batch.push_back(std::move(copy));
  Rollout branch = r;
  branch.id += "/branch";
  branch.group += "/other";
  branch.tokens.back() = static_cast<TokenId>((branch.tokens.back() + 1) % kVocab);
  batch.push_back(std::move(branch));
  int turns = 0;
  for (size_t i = 1; i < n && turns < kMaxTurns; ++i) {
    if (r.tokens[i] != r.tokens[0]) continue;
    ++turns;
    Rollout before = Truncate(r, i);
    before.id += "/turn" + std::to_string(turns);
    batch.push_back(std::move(before));
    Rollout fork = Truncate(r, i + 1);
    fork.id += "/fork" + std::to_string(turns);
    fork.tokens.back() = static_cast<TokenId>((fork.tokens.back() + 7) % kVocab);
    batch.push_back(std::move(fork));
  }
  return batch;
}

int64_t Lcp(const std::vector<TokenId>& a, const std::vector<TokenId>& b) {
  const size_t limit = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < limit && a[i] == b[i]) ++i;
  return static_cast<int64_t>(i);
}

// Tree tokens of `sequences` taken in lexicographic order, computed without a tree.
int64_t TreeTokens(std::vector<std::vector<TokenId>> sequences) {
  std::sort(sequences.begin(), sequences.end());
  int64_t tokens = 0;
  for (size_t i = 0; i < sequences.size(); ++i) {
    tokens += static_cast<int64_t>(sequences[i].size()) -
              (i > 0 ? Lcp(sequences[i - 1], sequences[i]) : 0);
  }
  return tokens;
}

// The smallest largest-group cost over every cut of a sequence into at most `k` (<= 3) contiguous
// groups, by exhaustion. lengths[i] and lcp[i] = LCP(sequence i - 1, sequence i) describe it.
int64_t BestContiguousCost(const std::vector<int64_t>& lengths, const std::vector<int64_t>& lcp,
                           int k) {
  const int64_t n = static_cast<int64_t>(lengths.size());
  std::vector<int64_t> added_before(n + 1, 0);  // tokens the sequences before i add to one tree
  for (int64_t i = 0; i < n; ++i) {
    added_before[i + 1] = added_before[i] + lengths[i] - (i > 0 ? lcp[i] : 0);
  }
  auto cost = [&](int64_t begin, int64_t end) {
    return begin == end ? 0 : lengths[begin] + added_before[end] - added_before[begin + 1];
  };
  int64_t best = cost(0, n);
  for (int64_t a = 0; k >= 2 && a <= n; ++a) {
    best = std::min(best, std::max(cost(0, a), cost(a, n)));
    for (int64_t b = a; k >= 3 && b <= n; ++b) {
      best = std::min(best, std::max({cost(0, a), cost(a, b), cost(b, n)}));
    }
  }
  return best;
}

void CheckPartitionOfBatch(const std::vector<Rollout>& batch, const Partition& partition, int k,
                           int64_t combined_tree_tokens) {
  FUZZ_CHECK(static_cast<int>(partition.groups.size()) == k);
  FUZZ_CHECK(static_cast<int>(partition.cost.size()) == k);
  std::vector<int> seen(batch.size(), 0);
  int64_t total = 0;
  int64_t max_cost = 0;
  for (int g = 0; g < k; ++g) {
    std::vector<std::vector<TokenId>> sequences;
    for (RolloutIndex r : partition.groups[g]) {
      FUZZ_CHECK(r >= 0 && r < static_cast<RolloutIndex>(batch.size()));
      seen[r]++;
      sequences.push_back(batch[r].tokens);
    }
    FUZZ_CHECK(partition.cost[g] == TreeTokens(std::move(sequences)));
    total += partition.cost[g];
    max_cost = std::max(max_cost, partition.cost[g]);
  }
  for (int count : seen) FUZZ_CHECK(count == 1);  // every rollout on exactly one rank
  FUZZ_CHECK(partition.max_cost == max_cost);
  FUZZ_CHECK(partition.combined_tree_tokens == combined_tree_tokens);
  FUZZ_CHECK(partition.extra_tokens == total - combined_tree_tokens);
  FUZZ_CHECK(partition.extra_tokens >= 0);
}

// SelectBatch over the batch as the pending queue, at the newest policy version it holds.
void CheckSelection(const std::vector<Rollout>& batch) {
  const int64_t n = static_cast<int64_t>(batch.size());
  std::vector<const Rollout*> pending;
  std::vector<int64_t> oldest(n, -1);  // oldest generated token's version, -1 if none
  int64_t newest = 0;
  for (int64_t i = 0; i < n; ++i) {
    pending.push_back(&batch[i]);
    for (int32_t v : batch[i].versions) {
      if (v >= 0 && (oldest[i] < 0 || v < oldest[i])) oldest[i] = v;
      newest = std::max<int64_t>(newest, v);
    }
  }
  std::vector<int64_t> everything(n);
  std::iota(everything.begin(), everything.end(), 0);
  BatchOptions options;
  options.rollouts = n;
  FUZZ_CHECK_OK(ValidateBatchOptions(options));
  BatchSelection selection = SelectBatch(pending, newest, options);
  FUZZ_CHECK(selection.ready && selection.batch == everything && selection.stale.empty());

  // Only the freshest: every rollout with an older generated token is stale.
  options.max_staleness = 0;
  std::vector<int64_t> fresh, stale;
  for (int64_t i = 0; i < n; ++i) {
    const bool is_stale = oldest[i] >= 0 && oldest[i] < newest;
    FUZZ_CHECK(Staleness(batch[i], newest) == (oldest[i] < 0 ? 0 : newest - oldest[i]));
    (is_stale ? stale : fresh).push_back(i);
  }
  options.rollouts = std::max<int64_t>(1, static_cast<int64_t>(fresh.size()));
  selection = SelectBatch(pending, newest, options);
  FUZZ_CHECK(selection.ready == !fresh.empty());
  if (!selection.ready) {
    FUZZ_CHECK(selection.batch.empty());
    return;
  }
  FUZZ_CHECK(selection.batch == fresh);
  while (!stale.empty() && stale.back() > fresh.back()) stale.pop_back();  // met after the batch
  FUZZ_CHECK(selection.stale == stale);
}

void CheckPlan(const std::vector<Rollout>& batch, const PrefixTree& tree) {
  const int64_t n = static_cast<int64_t>(batch.size());
  std::vector<const Rollout*> pointers;
  for (const Rollout& r : batch) pointers.push_back(&r);
  // Lexicographic order, equal rollouts by index: what the DFS-contiguous split must follow.
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return batch[a].tokens < batch[b].tokens; });
  std::vector<int64_t> ordered_lengths(n), ordered_lcp(n, 0);
  for (int64_t i = 0; i < n; ++i) {
    ordered_lengths[i] = static_cast<int64_t>(batch[order[i]].tokens.size());
    if (i > 0) ordered_lcp[i] = Lcp(batch[order[i - 1]].tokens, batch[order[i]].tokens);
  }
  int64_t longest = 0;
  double loss_tokens = 0;
  bool every_one_has_reward_or_advantages = true;
  bool rewards_bounded = true;
  for (const Rollout& r : batch) {
    longest = std::max(longest, static_cast<int64_t>(r.tokens.size()));
    for (uint8_t m : r.loss_mask) loss_tokens += m;
    every_one_has_reward_or_advantages &= r.reward.has_value() || !r.advantages.empty();
    if (r.reward.has_value()) rewards_bounded &= std::fabs(*r.reward) <= kMaxCheckedReward;
  }

  for (int k = 1; k <= kMaxWorldSize; ++k) {
    const int64_t best_cost = BestContiguousCost(ordered_lengths, ordered_lcp, k);
    for (int mode = 0; mode < 3; ++mode) {
      const bool with_advantages = mode > 0;
      const bool normalize_std = mode == 1;
      absl::StatusOr<PartitionPlan> plan = PlanPartitions(
          pointers, k, with_advantages,
          {.std_level = normalize_std ? AdvantageLevel::kGroup : AdvantageLevel::kNone});
      if (with_advantages && !every_one_has_reward_or_advantages) {
        FUZZ_CHECK(!plan.ok() && plan.status().code() == absl::StatusCode::kInvalidArgument);
        continue;
      }
      if (with_advantages && !rewards_bounded && !plan.ok()) {
        FUZZ_CHECK(plan.status().code() == absl::StatusCode::kInvalidArgument);
        continue;
      }
      FUZZ_CHECK_OK(plan);
      FUZZ_CHECK(static_cast<int>(plan->ranks.size()) == k);
      std::vector<int64_t> concatenated;
      for (int g = 0; g < k; ++g) {
        // A rank is empty only when there are fewer rollouts than ranks.
        FUZZ_CHECK(!plan->ranks[g].empty() || n < k);
        FUZZ_CHECK(plan->ranks[g].size() == plan->partition.groups[g].size());
        for (size_t i = 0; i < plan->ranks[g].size(); ++i) {
          FUZZ_CHECK(plan->ranks[g][i] == plan->partition.groups[g][i]);
        }
        concatenated.insert(concatenated.end(), plan->ranks[g].begin(), plan->ranks[g].end());
      }
      // DFS-contiguous: the ranks in order are the lexicographic order cut into pieces.
      FUZZ_CHECK(concatenated == order);
      CheckPartitionOfBatch(batch, plan->partition, k, tree.num_tree_tokens());
      FUZZ_CHECK(plan->partition.extra_tokens <= (k - 1) * longest);
      FUZZ_CHECK(plan->partition.max_cost == best_cost);  // Algorithm 4 is optimal
      FUZZ_CHECK(plan->context.num_rollouts == n);
      FUZZ_CHECK(plan->context.total_loss_tokens == loss_tokens);
      if (!with_advantages) {
        FUZZ_CHECK(plan->advantages.empty());
        continue;
      }
      FUZZ_CHECK(static_cast<int64_t>(plan->advantages.size()) == n);
      for (int64_t i = 0; i < n; ++i) {
        const std::vector<float> a = PlannedAdvantages(*plan, i, batch[i]);
        FUZZ_CHECK(a.size() == batch[i].tokens.size());
        if (!batch[i].advantages.empty()) {
          FUZZ_CHECK(a == batch[i].advantages);
          continue;
        }
        for (float v : a) FUZZ_CHECK(v == a[0]);
        FUZZ_CHECK(std::isfinite(a[0]));
      }
    }
    // The greedy baselines must also partition the batch, with costs that describe their groups.
    const absl::StatusOr<Partition> by_rollout = PartitionGreedyByRolloutTokens(tree, k);
    const absl::StatusOr<Partition> by_tree = PartitionGreedyByTreeTokens(tree, k);
    FUZZ_CHECK_OK(by_rollout);
    FUZZ_CHECK_OK(by_tree);
    CheckPartitionOfBatch(batch, *by_rollout, k, tree.num_tree_tokens());
    CheckPartitionOfBatch(batch, *by_tree, k, tree.num_tree_tokens());
  }
}

// Everything downstream of admission, for a rollout the gate accepted.
void CheckAccepted(const Rollout& rollout) {
  FUZZ_CHECK_OK(ValidateRollout(rollout, kVocab));

  // Conversions: in memory, through the wire bytes and through a JSON line.
  const v1::Trajectory trajectory = TrajectoryFromRollout(rollout);
  FUZZ_CHECK(RolloutFromTrajectory(trajectory) == rollout);
  v1::Trajectory reparsed;
  FUZZ_CHECK(reparsed.ParseFromString(trajectory.SerializeAsString()));
  FUZZ_CHECK(RolloutFromTrajectory(reparsed) == rollout);
  const absl::StatusOr<Rollout> from_json =
      ParseRolloutJson(RolloutToJson(rollout), {.vocab_size = kVocab});
  FUZZ_CHECK_OK(from_json);
  FUZZ_CHECK(*from_json == rollout);

  // The tree of a small batch built from it.
  const std::vector<Rollout> batch = MakeBatch(rollout);
  PrefixTreeBuilder builder;
  std::vector<int64_t> added;
  int64_t rollout_tokens = 0;
  for (const Rollout& r : batch) {
    FUZZ_CHECK_OK(ValidateRollout(r, kVocab));
    const absl::StatusOr<int64_t> a = builder.AddRollout(r.tokens);
    FUZZ_CHECK_OK(a);
    added.push_back(*a);
    rollout_tokens += static_cast<int64_t>(r.tokens.size());
  }
  const int64_t n = static_cast<int64_t>(rollout.tokens.size());
  FUZZ_CHECK(added[0] == n);
  FUZZ_CHECK(added[1] == 0);  // a prefix of rollout 0
  FUZZ_CHECK(added[2] == 0);  // a copy of rollout 0
  FUZZ_CHECK(added[3] == 1);  // differs from rollout 0 in its last token only
  const int64_t added_total = std::accumulate(added.begin(), added.end(), int64_t{0});
  FUZZ_CHECK(builder.num_tree_tokens() == added_total);
  FUZZ_CHECK(builder.num_rollout_tokens() == rollout_tokens);
  const PrefixTree tree = std::move(builder).Build();
  FUZZ_CHECK(tree.num_rollouts() == static_cast<int32_t>(batch.size()));
  FUZZ_CHECK(tree.num_tree_tokens() == added_total);
  FUZZ_CHECK(tree.num_tree_tokens() <= tree.num_rollout_tokens());
  FUZZ_CHECK(tree.num_rollout_tokens() == rollout_tokens);
  FUZZ_CHECK(static_cast<int64_t>(tree.serialized_tokens().size()) == tree.num_tree_tokens());
  std::vector<std::vector<TokenId>> sequences;
  for (const Rollout& r : batch) sequences.push_back(r.tokens);
  FUZZ_CHECK(tree.num_tree_tokens() == TreeTokens(sequences));
  for (RolloutIndex r = 0; r < tree.num_rollouts(); ++r) {
    FUZZ_CHECK(tree.RolloutTokens(r) == batch[r].tokens);
    FUZZ_CHECK(tree.rollout_length(r) == static_cast<int64_t>(batch[r].tokens.size()));
    FUZZ_CHECK(tree.Lcp(0, r) == Lcp(batch[0].tokens, batch[r].tokens));
  }
  for (NodeId v = 1; v < tree.num_nodes(); ++v) {
    FUZZ_CHECK(tree.parent(v) < v);
    FUZZ_CHECK(tree.length(v) > 0);
    FUZZ_CHECK(tree.depth(v) == tree.end_depth(tree.parent(v)));
  }

  CheckSelection(batch);
  CheckPlan(batch, tree);
}

// The error of a refused input names its field.
void CheckRefused(const absl::Status& status) {
  FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  FUZZ_CHECK(!FieldOfError(status).empty());
}

void FuzzTrajectory(const uint8_t* data, size_t size) {
  v1::Trajectory trajectory;
  if (!trajectory.ParseFromArray(data, static_cast<int>(size))) return;
  // The dispatcher's RL gate, and the same without the reward rule (SFT).
  const absl::StatusOr<Rollout> rl = CheckTrajectory(trajectory, Limits(true));
  const absl::StatusOr<Rollout> sft = CheckTrajectory(trajectory, Limits(false));
  if (!rl.ok()) CheckRefused(rl.status());
  if (!sft.ok()) {
    CheckRefused(sft.status());
    FUZZ_CHECK(rl.status() == sft.status());  // the reward rule comes last
    return;
  }
  if (rl.ok()) {
    FUZZ_CHECK(*rl == *sft);
  } else {
    FUZZ_CHECK(FieldOfError(rl.status()) == "reward");
    FUZZ_CHECK(!sft->reward.has_value() && sft->advantages.empty());
  }
  FUZZ_CHECK(*sft == RolloutFromTrajectory(trajectory));
  CheckAccepted(*sft);
}

void FuzzJsonLine(const uint8_t* data, size_t size) {
  const std::string_view line(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<Rollout> parsed = ParseRolloutJson(line, {.vocab_size = kVocab});
  if (!parsed.ok()) {
    FUZZ_CHECK(parsed.status().code() == absl::StatusCode::kInvalidArgument);
    const absl::string_view message = parsed.status().message();
    FUZZ_CHECK(absl::StartsWith(message, "malformed JSON: ") ||
               message == "a rollout must be a JSON object" ||
               absl::StrContains(message, "field '"));
    return;
  }
  // What a rollout file holds, the dispatcher accepts as a trajectory within its size limits.
  const Rollout& rollout = *parsed;
  const bool within_limits =
      static_cast<int64_t>(rollout.id.size()) <= TrajectoryLimits().max_id_bytes &&
      static_cast<int64_t>(rollout.group.size()) <= TrajectoryLimits().max_id_bytes &&
      static_cast<int64_t>(rollout.tokens.size()) <= kMaxTokens;
  const absl::StatusOr<Rollout> checked =
      CheckTrajectory(TrajectoryFromRollout(rollout), Limits(false));
  FUZZ_CHECK(checked.ok() == within_limits);
  if (!checked.ok()) {
    CheckRefused(checked.status());
    return;
  }
  FUZZ_CHECK(*checked == rollout);
  CheckAccepted(rollout);
}

// A few inputs of both kinds, valid and not, for a fresh corpus.
int WriteSeeds(const std::string& dir) {
  Rollout plain;
  plain.id = "task1-s0";
  plain.group = "task1";
  plain.tokens = {5, 6, 7, 5, 8, 9};
  plain.loss_mask = {0, 0, 1, 0, 1, 1};
  plain.logprobs = {0.0f, -1.5f, -0.25f, -0.5f, -0.125f, -2.0f};
  plain.reward = 1.0;
  Rollout full = plain;
  full.id = "task2-s3-turn1";
  full.group = "task2";
  full.versions = {-1, -1, 3, -1, 4, 4};
  full.ref_logprobs = {0.0f, -1.0f, -0.5f, -0.75f, -0.25f, -1.0f};
  full.advantages = {0.0f, 0.0f, 0.5f, 0.0f, -0.5f, 1.5f};
  full.reward = -0.5;
  Rollout single;
  single.id = "s";
  single.group = "g";
  single.tokens = {999};
  single.loss_mask = {0};
  single.logprobs = {0.0f};
  single.reward = 0.0;
  Rollout sft = plain;
  sft.id = "sft-0";
  sft.reward.reset();

  std::vector<std::pair<std::string, std::string>> seeds;
  auto add_proto = [&](const std::string& name, const v1::Trajectory& t) {
    seeds.emplace_back(name + ".pb", t.SerializeAsString());
  };
  add_proto("plain", TrajectoryFromRollout(plain));
  add_proto("single", TrajectoryFromRollout(single));
  add_proto("sft", TrajectoryFromRollout(sft));
  v1::Trajectory with_metadata = TrajectoryFromRollout(full);
  (*with_metadata.mutable_metadata())["task"] = "tau2-airline";
  add_proto("full", with_metadata);
  v1::Trajectory bad_mask = TrajectoryFromRollout(plain);
  bad_mask.set_loss_mask(0, true);
  add_proto("bad-mask", bad_mask);
  for (const auto& [name, r] :
       {std::pair<std::string, const Rollout*>{"plain", &plain}, {"full", &full}, {"sft", &sft}}) {
    seeds.emplace_back(name + ".json", RolloutToJson(*r));
  }
  seeds.emplace_back("lenient.json",
                     R"({"metadata": {"turn": 2}, "id": 17, "group": 3, "tokens": [1, 2, 1, 3],)"
                     R"( "loss_mask": [false, true, 0, 1], "logprobs": [0, -1e-3, -2.5e-1, -7],)"
                     R"( "versions": [-1, 0, -1, 1], "reward": 2})");
  // Finite, but beyond kMaxAbsReward: a rollout file refuses it as the dispatcher does.
  seeds.emplace_back("huge-reward.json",
                     R"({"id": "x", "group": "g", "tokens": [1, 2], "loss_mask": [0, 1],)"
                     R"( "logprobs": [0, -1], "reward": -1e308})");
  seeds.emplace_back("bad-field.json",
                     R"({"id": "x", "group": "g", "tokens": [1], "loss_mask": [0],)"
                     R"( "logprobs": [0], "rewards": 1})");
  for (const auto& [name, bytes] : seeds) {
    std::ofstream file(dir + "/seed-" + name, std::ios::binary | std::ios::trunc);
    file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!file) {
      std::fprintf(stderr, "cannot write %s/seed-%s\n", dir.c_str(), name.c_str());
      return 1;
    }
  }
  std::printf("wrote %zu seeds to %s\n", seeds.size(), dir.c_str());
  return 0;
}

}  // namespace
}  // namespace dta

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // Protobuf logs every string with invalid UTF-8 it refuses; the refusal is all that matters here.
  google::protobuf::SetLogHandler(nullptr);
  constexpr std::string_view kWriteSeeds = "--write-seeds=";
  for (int i = 1; i < *argc; ++i) {
    const std::string_view arg = (*argv)[i];
    if (arg.substr(0, kWriteSeeds.size()) == kWriteSeeds) {
      std::exit(dta::WriteSeeds(std::string(arg.substr(kWriteSeeds.size()))));
    }
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 0 && data[0] == '{') {
    dta::FuzzJsonLine(data, size);
  } else {
    dta::FuzzTrajectory(data, size);
  }
  return 0;
}

#include "core/workload/workload.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/base/absl_string_view.h"

namespace dta {
namespace {

// ---------------------------------------------------------------------------------------------
// Deterministic sampling. std::uniform_int_distribution and friends are implementation-defined,
// so everything below draws raw 64-bit words from std::mt19937_64 (fixed by the standard) and
// maps them with integer arithmetic.

// SplitMix64's finalizer: turns (seed, family, stream) into well-spread, independent mt19937_64
// seeds, so nearby seeds or group indices do not give correlated streams.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Streams are keyed by a family (which presets share draws) and an index within it: group g's
// stream is g, batch-wide draws use the indices below, far from any group index.
constexpr uint64_t kFirstTokenStream = ~uint64_t{0};
constexpr uint64_t kSystemPromptStream = ~uint64_t{0} - 1;

uint64_t StreamSeed(uint64_t seed, uint64_t family, uint64_t stream) {
  return Mix(Mix(Mix(seed) ^ family) ^ stream);
}

class Sampler {
 public:
  explicit Sampler(uint64_t seed) : rng_(seed) {}

  // Uniform in [0, n) for n >= 1 by Lemire's multiply-shift (bias below n / 2^64).
  uint64_t Below(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(rng_()) * n) >> 64);
  }
  // Uniform in [lo, hi], lo <= hi.
  int64_t Uniform(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(Below(static_cast<uint64_t>(hi - lo) + 1));
  }
  bool Percent(int64_t percent) { return static_cast<int64_t>(Below(100)) < percent; }

 private:
  std::mt19937_64 rng_;
};

// An inclusive range of lengths.
struct Range {
  int64_t lo;
  int64_t hi;
};

int64_t Draw(Sampler& s, Range r) { return s.Uniform(r.lo, r.hi); }

// ---------------------------------------------------------------------------------------------
// Token tracks: the per-token arrays of one root-to-node path, grown segment by segment and cut
// into rollouts. Rollouts through the same tokens copy them from the same track, which is what
// keeps the mask, logprobs and versions of shared tokens identical across rollouts.

constexpr TokenId kAnyToken = -1;
// Generated tokens come from policy versions up to this one (asynchronous RL: a batch mixes a few
// recent versions).
constexpr int32_t kLatestVersion = 8;

struct Track {
  std::vector<TokenId> tokens;
  std::vector<uint8_t> loss_mask;
  std::vector<float> logprobs;
  std::vector<int32_t> versions;

  int64_t size() const { return static_cast<int64_t>(tokens.size()); }

  void Append(const Track& other) {
    tokens.insert(tokens.end(), other.tokens.begin(), other.tokens.end());
    loss_mask.insert(loss_mask.end(), other.loss_mask.begin(), other.loss_mask.end());
    logprobs.insert(logprobs.end(), other.logprobs.begin(), other.logprobs.end());
    versions.insert(versions.end(), other.versions.begin(), other.versions.end());
  }
};

// `n` >= 1 random tokens; the first is `first` unless it is kAnyToken.
void AppendTokens(Sampler& s, int32_t vocab, int64_t n, TokenId first, Track& track) {
  for (int64_t i = 0; i < n; ++i) {
    track.tokens.push_back(i == 0 && first != kAnyToken ? first
                                                        : static_cast<TokenId>(s.Below(vocab)));
  }
}

// Prompt, system or observation tokens: not trained, no behaviour logprob, no policy version.
void AppendPrompt(Sampler& s, int32_t vocab, int64_t n, TokenId first, Track& track) {
  AppendTokens(s, vocab, n, first, track);
  track.loss_mask.resize(track.tokens.size(), 0);
  track.logprobs.resize(track.tokens.size(), 0.0f);
  track.versions.resize(track.tokens.size(), -1);
}

// Model-generated tokens: trained, with a sampled token's logprob in [-3, -1/1024], skewed towards
// 0 as in real decoding where most tokens are confident (-a^2/3 for a uniform in [0, 3)). The
// logprob is a multiple of 1/1024 computed in integers, so it is exact on every platform
// (floating-point arithmetic may round differently where the compiler fuses multiply-adds).
void AppendGenerated(Sampler& s, int32_t vocab, int64_t n, int32_t version, TokenId first,
                     Track& track) {
  AppendTokens(s, vocab, n, first, track);
  track.loss_mask.resize(track.tokens.size(), 1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = static_cast<int64_t>(s.Below(3072));
    const int64_t q = 1 + a * a / 3072;  // in [1, 3072]
    track.logprobs.push_back(-static_cast<float>(q) / 1024.0f);
  }
  track.versions.resize(track.tokens.size(), version);
}

// `count` distinct tokens, none equal to `exclude` (kAnyToken: no exclusion): the first tokens of
// sibling branches, so that they diverge exactly there. Requires count (plus one with an
// exclusion) <= vocab; GenerateWorkload checks it. Rejection sampling one token at a time keeps the
// i-th token a function of the stream and i alone (so more groups only append tokens).
std::vector<TokenId> DistinctTokens(Sampler& s, int32_t vocab, int64_t count,
                                    TokenId exclude = kAnyToken) {
  absl::flat_hash_set<TokenId> used;
  if (exclude != kAnyToken) used.insert(exclude);
  std::vector<TokenId> tokens;
  tokens.reserve(count);
  while (static_cast<int64_t>(tokens.size()) < count) {
    const TokenId t = static_cast<TokenId>(s.Below(vocab));
    if (used.insert(t).second) tokens.push_back(t);
  }
  return tokens;
}

// A policy version for a new sample: up to two versions stale.
int32_t StartVersion(Sampler& s) { return kLatestVersion - static_cast<int32_t>(s.Below(3)); }
// The version of a sample's next LLM call: the policy may have been updated in between.
int32_t NextVersion(Sampler& s, int32_t version) {
  return std::min<int32_t>(kLatestVersion, version + static_cast<int32_t>(s.Below(2)));
}

Rollout MakeRollout(const Track& track, int64_t length, std::string id, std::string group,
                    double reward) {
  Rollout r;
  r.id = std::move(id);
  r.group = std::move(group);
  r.tokens.assign(track.tokens.begin(), track.tokens.begin() + length);
  r.loss_mask.assign(track.loss_mask.begin(), track.loss_mask.begin() + length);
  r.logprobs.assign(track.logprobs.begin(), track.logprobs.begin() + length);
  r.versions.assign(track.versions.begin(), track.versions.begin() + length);
  r.reward = reward;
  return r;
}

std::string GroupName(std::string_view preset, uint64_t seed, char kind, int64_t index) {
  return absl::StrCat(AsAbsl(preset), "-s", seed, "-", absl::string_view(&kind, 1), index);
}

// ---------------------------------------------------------------------------------------------
// Calibration. Every constant below was tuned by generating seeds 1..50 at scale 1 and reading
// ComputeTreeStats (see workload_test, which prints the stats of seeds 1..5); the derivations in
// the comments give the closed-form model the constants were first solved from.

// tau2 and modified-prefix share one structure and one family of streams.
//
// Model (AReaL-DTA Fig. 1 and Table 3): per task a prompt of length P and G samples, each a chain
// of K LLM calls whose context grows by X tokens in all (responses plus the user/tool turns in
// between); a global system prompt of length S in front of everything.
//   * modified-prefix (no S, leaves only): mean length P + X = 1.6K and
//     C = G (P + X) / (P + G X) = 1.42 with G = 8 give P ~ 540, X ~ 1060.
//   * tau2 leaf-only C = G T (S + P + X) / (S + T (P + G X)) = 5.56 with T = 16 tasks gives
//     S ~ 4.9K (tau2-bench's system prompt is a long tool and policy manual).
//   * tau2 C / leaf-only C = 9.43 / 5.56 = 1.70 = (rollout tokens of a sample) / (its leaf), and
//     every earlier call of a sample is a rollout of length >= S + P, so a sample makes only
//     ~1.75 LLM calls on average: 1, 2 or 3 calls in the proportions 40/45/15.
// Solving the three for the response and observation means (with P = 540, S = 4.9K) gives ~410
// and ~460 tokens; the ranges below are centred there. Seeds 1..50 then land within 4% of the
// tau2 targets and 6% of the modified-prefix ones.
struct AgentParams {
  int32_t tasks;    // at scale 1
  int32_t samples;  // G
  Range system_prompt;
  Range task_prompt;
  std::array<int64_t, 3> call_percent;  // P(K = 1), P(K = 2), P(K = 3), in percent
  Range response;                       // per LLM call
  Range observation;                    // user / tool turn between two calls
};

constexpr AgentParams kAgent = {
    .tasks = 16,
    .samples = 8,
    .system_prompt = {4800, 5000},
    .task_prompt = {340, 740},
    .call_percent = {40, 45, 15},
    .response = {260, 560},
    .observation = {220, 700},
};

// GRPO single-turn: per prompt of length P, G samples with responses of mean length R, so
// C = (P + R) / (P / G + R).
//   * gsm8k: C = 1.09 and P + R = 1.8K with G = 16 give P ~ 158, R ~ 1642.
//   * aime: responses of ~16K, capped at 16384 - P (about half hit the cap, as long reasoning
//     does), mean R ~ 15.9K; C = 1.008 with G = 16 gives R ~ 117 P, so P ~ 136.
// Seeds 1..50 land within 1% (gsm8k) and 0.2% (aime) of C, and within 12% and 20% of C - 1.
struct GrpoParams {
  int32_t prompts;  // at scale 1
  int32_t samples;  // G
  Range prompt;
  Range response;  // capped so that prompt + response <= 16384
};

constexpr GrpoParams kGsm8k = {
    .prompts = 16, .samples = 16, .prompt = {110, 206}, .response = {1300, 1984}};
constexpr GrpoParams kAime = {
    .prompts = 4, .samples = 16, .prompt = {92, 180}, .response = {14500, 18500}};

// Tree Training's agentic trees (Section 4.4, Fig. 6): sparse, unbalanced trees grown around one
// main trajectory, the trunk. A trajectory is a chain of LLM calls (thinking, then the answer and
// tool calls), each but the last followed by an observation (tool results).
//   * Concurrent tool calls fork it: at a fork the trunk and `fork_width - 1` side branches go on
//     with different observations (they differ from the first observation token on). A side
//     branch makes a share of the trunk's remaining calls and does not fork again.
//   * Think mode drops earlier thinking from the history, so the context of call k+1 diverges from
//     the full text of call k where its thinking began: every call but the last leaves a leaf
//     (prefix + thinking + answer) behind, and the trajectory goes on as prefix + answer +
//     observation.
// POR = 1 - tree tokens / leaf tokens grows with how much of a leaf's length lies before its
// branch point: late forks, long prompts and think mode on long histories push it up, early forks
// into long side branches keep it down. Fork counts and windows are fixed ranges rather than a
// per-call coin so that POR varies little between trees and seeds (a per-call coin left a third of
// the branch-low trees unforked and the batch POR off by up to 50% between seeds).
struct BranchParams {
  int32_t trees;  // at scale 1
  Range prompt;
  Range calls;  // LLM calls on the trunk
  Range think;  // thinking tokens per call (kept in the history unless drop_thinking)
  Range answer;
  Range observation;
  bool drop_thinking;
  Range forks;         // fork points on the trunk (at most calls - 1)
  Range fork_window;   // where on the trunk they fall, in percent of its calls
  Range fork_width;    // continuations at a fork, the trunk's included
  Range side_percent;  // a side branch's calls, in percent of the trunk's remaining calls
};

// The longest path a preset can produce: its prompt and every trunk call at its longest, with an
// observation between two calls and, in think mode, the thinking of the last call only.
constexpr int64_t LongestPath(const BranchParams& p) {
  return p.prompt.hi + p.calls.hi * p.answer.hi + (p.calls.hi - 1) * p.observation.hi +
         (p.drop_thinking ? 1 : p.calls.hi) * p.think.hi;
}

// Calibrated POR: low 0.28 (one fork early in the trunk into a long side branch), mid 0.70 (three
// or four forks over the trunk into short side branches), high 0.89 (think mode on long
// histories). Seeds 1..50 land within 6%, 3% and 1% of POR and 3%, 7% and 7% of C.
constexpr BranchParams kBranchLow = {
    .trees = 48,
    .prompt = {1500, 2500},
    .calls = {8, 12},
    .think = {100, 250},
    .answer = {100, 250},
    .observation = {200, 600},
    .drop_thinking = false,
    .forks = {1, 1},
    .fork_window = {20, 55},
    .fork_width = {2, 2},
    .side_percent = {70, 100},
};

constexpr BranchParams kBranchMid = {
    .trees = 32,
    .prompt = {1500, 2500},
    .calls = {8, 12},
    .think = {100, 250},
    .answer = {100, 250},
    .observation = {200, 600},
    .drop_thinking = false,
    .forks = {3, 4},
    .fork_window = {20, 90},
    .fork_width = {2, 3},
    .side_percent = {10, 40},
};

constexpr BranchParams kBranchHigh = {
    .trees = 16,
    .prompt = {3000, 4000},
    .calls = {16, 20},
    .think = {50, 150},
    .answer = {50, 150},
    .observation = {200, 450},
    .drop_thinking = true,
    .forks = {0, 0},
    .fork_window = {0, 100},
    .fork_width = {2, 2},
    .side_percent = {0, 0},
};

// Long-horizon agent trajectories: 34-44 calls with long tool observations (file reads, logs),
// paths of ~27K-51K tokens (at most 64K); two forks late on the trunk (past half its calls) into
// side branches of a fifth to three fifths of the remaining calls. Seeds 1..5 land within 4% of POR
// 0.55 and mean leaf length 39K, their longest paths 47K-51K (workload_test).
constexpr BranchParams kLongAgentic = {
    .trees = 8,
    .prompt = {2000, 4000},
    .calls = {34, 44},
    .think = {100, 250},
    .answer = {100, 250},
    .observation = {500, 900},
    .drop_thinking = false,
    .forks = {2, 2},
    .fork_window = {50, 90},
    .fork_width = {2, 2},
    .side_percent = {20, 60},
};

static_assert(kAgent.system_prompt.hi + kAgent.task_prompt.hi + 3 * kAgent.response.hi +
                  2 * kAgent.observation.hi <=
              kMaxWorkloadRolloutLength);
static_assert(kAgent.call_percent[0] + kAgent.call_percent[1] + kAgent.call_percent[2] == 100);
static_assert(kGsm8k.prompt.hi + kGsm8k.response.hi <= kMaxWorkloadRolloutLength);
static_assert(LongestPath(kBranchLow) <= kMaxWorkloadRolloutLength);
static_assert(LongestPath(kBranchMid) <= kMaxWorkloadRolloutLength);
static_assert(LongestPath(kBranchHigh) <= kMaxWorkloadRolloutLength);
static_assert(LongestPath(kLongAgentic) <= kMaxLongWorkloadRolloutLength);

// Families of streams: presets that share one never share draws with another.
constexpr uint64_t kAgentFamily = 0x7461753200000001ULL;
constexpr uint64_t kGsm8kFamily = 0x67736d3800000002ULL;
constexpr uint64_t kAimeFamily = 0x61696d6500000003ULL;
constexpr uint64_t kBranchLowFamily = 0x62726c6f00000004ULL;
constexpr uint64_t kBranchMidFamily = 0x62726d6900000005ULL;
constexpr uint64_t kBranchHighFamily = 0x6272686900000006ULL;
constexpr uint64_t kLongAgenticFamily = 0x6c6f6e6700000007ULL;

// ---------------------------------------------------------------------------------------------
// Generators. Each draws group g from the stream (seed, family, g), and the first tokens of the
// groups from one batch stream, so that they differ and a larger scale only appends groups.

// The number of LLM calls of each of a task's samples. Systematic sampling (one random offset, G
// evenly spaced quantiles, then shuffled) keeps every task's mix of 1-, 2- and 3-call samples
// close to call_percent: with independent draws the mix alone moved the batch's mean length and
// leaf-only C by up to 12% between seeds.
std::vector<int64_t> StratifiedCalls(Sampler& s, const AgentParams& p) {
  const int64_t quantum = 1 << 20;  // quantiles in units of 2^-20, exact in integers
  const int64_t offset = static_cast<int64_t>(s.Below(quantum));
  std::vector<int64_t> calls(p.samples);
  for (int32_t g = 0; g < p.samples; ++g) {
    const int64_t q = (offset + g * quantum / p.samples) % quantum;
    int64_t k = 0;
    for (int64_t below = 0; k + 1 < static_cast<int64_t>(p.call_percent.size()); ++k) {
      below += p.call_percent[k] * quantum / 100;
      if (q < below) break;
    }
    calls[g] = k + 1;
  }
  for (int32_t g = p.samples - 1; g > 0; --g) std::swap(calls[g], calls[s.Below(g + 1)]);
  return calls;
}

void GenerateAgent(const AgentParams& p, bool with_system_prompt, bool leaves_only,
                   std::string_view name, const WorkloadOptions& o, int64_t tasks,
                   std::vector<Rollout>& out) {
  const int32_t vocab = o.vocab_size;
  Sampler first_sampler(StreamSeed(o.seed, kAgentFamily, kFirstTokenStream));
  const std::vector<TokenId> task_first = DistinctTokens(first_sampler, vocab, tasks);
  Track system;
  if (with_system_prompt) {
    Sampler s(StreamSeed(o.seed, kAgentFamily, kSystemPromptStream));
    AppendPrompt(s, vocab, Draw(s, p.system_prompt), kAnyToken, system);
  }
  for (int64_t t = 0; t < tasks; ++t) {
    Sampler s(StreamSeed(o.seed, kAgentFamily, static_cast<uint64_t>(t)));
    const std::string group = GroupName(name, o.seed, 't', t);
    Track task = system;
    AppendPrompt(s, vocab, Draw(s, p.task_prompt), task_first[t], task);
    const int64_t success_percent = s.Uniform(10, 90);
    const std::vector<TokenId> sample_first = DistinctTokens(s, vocab, p.samples);
    const std::vector<int64_t> sample_calls = StratifiedCalls(s, p);
    for (int32_t g = 0; g < p.samples; ++g) {
      const double reward = s.Percent(success_percent) ? 1.0 : 0.0;
      const int64_t calls = sample_calls[g];
      Track track = task;
      std::vector<int64_t> call_end;  // where each call's response ends
      int32_t version = StartVersion(s);
      for (int64_t k = 0; k < calls; ++k) {
        if (k > 0) {
          AppendPrompt(s, vocab, Draw(s, p.observation), kAnyToken, track);
          version = NextVersion(s, version);
        }
        AppendGenerated(s, vocab, Draw(s, p.response), version,
                        k == 0 ? sample_first[g] : kAnyToken, track);
        call_end.push_back(track.size());
      }
      for (int64_t k = leaves_only ? calls - 1 : 0; k < calls; ++k) {
        std::string id = absl::StrCat(group, "-g", g);
        if (!leaves_only) absl::StrAppend(&id, "-turn", k);
        out.push_back(MakeRollout(track, call_end[k], std::move(id), group, reward));
      }
    }
  }
}

void GenerateGrpo(const GrpoParams& p, uint64_t family, std::string_view name,
                  const WorkloadOptions& o, int64_t prompts, std::vector<Rollout>& out) {
  const int32_t vocab = o.vocab_size;
  Sampler first_sampler(StreamSeed(o.seed, family, kFirstTokenStream));
  const std::vector<TokenId> prompt_first = DistinctTokens(first_sampler, vocab, prompts);
  for (int64_t q = 0; q < prompts; ++q) {
    Sampler s(StreamSeed(o.seed, family, static_cast<uint64_t>(q)));
    const std::string group = GroupName(name, o.seed, 'p', q);
    Track prompt;
    AppendPrompt(s, vocab, Draw(s, p.prompt), prompt_first[q], prompt);
    const int64_t solve_percent = s.Uniform(0, 100);
    const std::vector<TokenId> sample_first = DistinctTokens(s, vocab, p.samples);
    for (int32_t g = 0; g < p.samples; ++g) {
      Track track = prompt;
      const int64_t length =
          std::min(Draw(s, p.response), kMaxWorkloadRolloutLength - prompt.size());
      AppendGenerated(s, vocab, length, StartVersion(s), sample_first[g], track);
      const double reward = s.Percent(solve_percent) ? 1.0 : 0.0;
      out.push_back(MakeRollout(track, track.size(), absl::StrCat(group, "-g", g), group, reward));
    }
  }
}

void GenerateBranch(const BranchParams& p, uint64_t family, std::string_view name,
                    const WorkloadOptions& o, int64_t trees, std::vector<Rollout>& out) {
  const int32_t vocab = o.vocab_size;
  Sampler first_sampler(StreamSeed(o.seed, family, kFirstTokenStream));
  const std::vector<TokenId> prompt_first = DistinctTokens(first_sampler, vocab, trees);
  for (int64_t t = 0; t < trees; ++t) {
    Sampler s(StreamSeed(o.seed, family, static_cast<uint64_t>(t)));
    const std::string group = GroupName(name, o.seed, 't', t);
    const int64_t success_percent = s.Uniform(10, 90);
    int64_t leaves = 0;
    auto emit = [&](const Track& track) {
      const double reward = s.Percent(success_percent) ? 1.0 : 0.0;
      out.push_back(
          MakeRollout(track, track.size(), absl::StrCat(group, "-leaf", leaves), group, reward));
      ++leaves;
    };
    // One call on `track` at `version`; the last call of a path emits its leaf.
    auto call = [&](Track& track, int32_t version, bool last) {
      Track answer;
      AppendGenerated(s, vocab, Draw(s, p.answer), version, kAnyToken, answer);
      Track think;
      if (p.think.hi > 0) {
        const TokenId first = DistinctTokens(s, vocab, 1, answer.tokens[0])[0];
        AppendGenerated(s, vocab, Draw(s, p.think), version, first, think);
      }
      if (last || !p.drop_thinking || think.size() == 0) {
        track.Append(think);
        track.Append(answer);
        if (last) emit(track);
        return;
      }
      Track leaf = track;
      leaf.Append(think);
      leaf.Append(answer);
      emit(leaf);
      track.Append(answer);
    };

    Track trunk;
    AppendPrompt(s, vocab, Draw(s, p.prompt), prompt_first[t], trunk);
    const int64_t calls = Draw(s, p.calls);
    // Fork points: distinct call indices in the window (a fork needs a call after it).
    std::vector<int64_t> window;
    for (int64_t k = 0; k + 1 < calls; ++k) {
      const int64_t percent = k * 100 / (calls - 1);
      if (percent >= p.fork_window.lo && percent <= p.fork_window.hi) window.push_back(k);
    }
    const int64_t forks = std::min<int64_t>(Draw(s, p.forks), window.size());
    for (int64_t i = 0; i < forks; ++i) {  // partial Fisher-Yates
      std::swap(window[i], window[i + s.Below(window.size() - i)]);
    }
    window.resize(forks);
    std::sort(window.begin(), window.end());

    int32_t version = StartVersion(s);
    for (int64_t k = 0, next_fork = 0; k < calls; ++k) {
      const bool last = k + 1 == calls;
      call(trunk, version, last);
      if (last) break;
      version = NextVersion(s, version);
      const bool fork = next_fork < forks && window[next_fork] == k;
      const int64_t width = fork ? Draw(s, p.fork_width) : 1;
      next_fork += fork;
      const std::vector<TokenId> firsts = DistinctTokens(s, vocab, width);
      const int64_t remaining = calls - k - 1;
      for (int64_t b = 1; b < width; ++b) {
        Track side = trunk;
        AppendPrompt(s, vocab, Draw(s, p.observation), firsts[b], side);
        const int64_t side_calls =
            std::clamp<int64_t>((remaining * Draw(s, p.side_percent) + 50) / 100, 1, remaining);
        int32_t side_version = version;
        for (int64_t j = 0; j < side_calls; ++j) {
          call(side, side_version, j + 1 == side_calls);
          if (j + 1 < side_calls) {
            AppendPrompt(s, vocab, Draw(s, p.observation), kAnyToken, side);
            side_version = NextVersion(s, side_version);
          }
        }
      }
      AppendPrompt(s, vocab, Draw(s, p.observation), firsts[0], trunk);
    }
  }
}

// Groups at scale 1, siblings of one node at most, and rollouts per group at most (for the
// validation of options).
struct Shape {
  int32_t groups;
  int64_t max_siblings;
  int64_t max_rollouts_per_group;
};

// Every path of a tree can leave a leaf per call in think mode.
Shape BranchShape(const BranchParams& p) {
  const int64_t paths = 1 + p.forks.hi * (p.fork_width.hi - 1);
  return {p.trees, std::max<int64_t>(2, p.fork_width.hi), paths * p.calls.hi};
}

Shape ShapeOf(WorkloadPreset preset) {
  switch (preset) {
    case WorkloadPreset::kTau2:
      return {kAgent.tasks, kAgent.samples,
              kAgent.samples * static_cast<int64_t>(kAgent.call_percent.size())};
    case WorkloadPreset::kModifiedPrefix:
      return {kAgent.tasks, kAgent.samples, kAgent.samples};
    case WorkloadPreset::kGsm8k:
      return {kGsm8k.prompts, kGsm8k.samples, kGsm8k.samples};
    case WorkloadPreset::kAime:
      return {kAime.prompts, kAime.samples, kAime.samples};
    case WorkloadPreset::kBranchLow:
      return BranchShape(kBranchLow);
    case WorkloadPreset::kBranchMid:
      return BranchShape(kBranchMid);
    case WorkloadPreset::kBranchHigh:
      return BranchShape(kBranchHigh);
    case WorkloadPreset::kLongAgentic:
      return BranchShape(kLongAgentic);
  }
  return {1, 1, 1};
}

constexpr std::array<std::pair<WorkloadPreset, std::string_view>, 8> kNames = {{
    {WorkloadPreset::kTau2, "tau2"},
    {WorkloadPreset::kGsm8k, "gsm8k"},
    {WorkloadPreset::kAime, "aime"},
    {WorkloadPreset::kModifiedPrefix, "modified-prefix"},
    {WorkloadPreset::kBranchLow, "branch-low"},
    {WorkloadPreset::kBranchMid, "branch-mid"},
    {WorkloadPreset::kBranchHigh, "branch-high"},
    {WorkloadPreset::kLongAgentic, "long-agentic"},
}};

// The bound on a batch: by the worst case of the preset's shape, so that it is checked before
// anything is allocated.
constexpr int64_t kMaxBatchTokens = int64_t{1} << 34;

}  // namespace

absl::StatusOr<WorkloadPreset> ParseWorkloadPreset(std::string_view name) {
  for (const auto& [preset, preset_name] : kNames) {
    if (name == preset_name) return preset;
  }
  std::string valid;
  for (const auto& [preset, preset_name] : kNames) {
    absl::StrAppend(&valid, valid.empty() ? "" : ", ", AsAbsl(preset_name));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown workload preset '", AsAbsl(name), "'; valid presets: ", valid));
}

std::string_view WorkloadPresetName(WorkloadPreset preset) {
  for (const auto& [p, name] : kNames) {
    if (p == preset) return name;
  }
  return "unknown";
}

std::vector<WorkloadPreset> AllWorkloadPresets() {
  std::vector<WorkloadPreset> presets;
  for (const auto& [preset, name] : kNames) presets.push_back(preset);
  return presets;
}

WorkloadTargets TargetsFor(WorkloadPreset preset) {
  switch (preset) {
    case WorkloadPreset::kTau2:  // AReaL-DTA Fig. 1
      return {.compression = 9.43, .leaf_compression = 5.56, .por = 0, .mean_length = 0};
    case WorkloadPreset::kGsm8k:  // AReaL-DTA Table 3
      return {.compression = 1.09, .leaf_compression = 0, .por = 0, .mean_length = 1800};
    case WorkloadPreset::kAime:  // AReaL-DTA Table 3
      return {.compression = 1.008, .leaf_compression = 0, .por = 0, .mean_length = 16000};
    case WorkloadPreset::kModifiedPrefix:  // AReaL-DTA Table 3
      return {.compression = 1.42, .leaf_compression = 0, .por = 0, .mean_length = 1600};
    // Tree Training Section 4.4. Only leaves are rollouts, so C = 1 / (1 - POR).
    case WorkloadPreset::kBranchLow:
      return {.compression = 1 / (1 - 0.28), .leaf_compression = 0, .por = 0.28, .mean_length = 0};
    case WorkloadPreset::kBranchMid:
      return {.compression = 1 / (1 - 0.70), .leaf_compression = 0, .por = 0.70, .mean_length = 0};
    case WorkloadPreset::kBranchHigh:
      return {.compression = 1 / (1 - 0.89), .leaf_compression = 0, .por = 0.89, .mean_length = 0};
    // Designed (kLongAgentic): only leaves are rollouts.
    case WorkloadPreset::kLongAgentic:
      return {
          .compression = 1 / (1 - 0.55), .leaf_compression = 0, .por = 0.55, .mean_length = 39000};
  }
  return {};
}

int64_t MaxWorkloadRolloutLength(WorkloadPreset preset) {
  return preset == WorkloadPreset::kLongAgentic ? kMaxLongWorkloadRolloutLength
                                                : kMaxWorkloadRolloutLength;
}

absl::StatusOr<std::vector<Rollout>> GenerateWorkload(const WorkloadOptions& options) {
  const std::string_view name = WorkloadPresetName(options.preset);
  if (!std::isfinite(options.scale) || options.scale <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("workload scale must be finite and > 0, got ", options.scale));
  }
  const Shape shape = ShapeOf(options.preset);
  const double groups_real = std::max(1.0, std::round(shape.groups * options.scale));
  if (groups_real * shape.max_rollouts_per_group * MaxWorkloadRolloutLength(options.preset) >
      kMaxBatchTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "workload scale ", options.scale, " too large: ", AsAbsl(name), " could pass 2^34 tokens"));
  }
  const int64_t groups = static_cast<int64_t>(groups_real);
  const int64_t needed = std::max({int64_t{2}, groups, shape.max_siblings});
  if (options.vocab_size < needed) {
    return absl::InvalidArgumentError(absl::StrCat(
        "vocab_size ", options.vocab_size, " too small for ", AsAbsl(name), " at scale ",
        options.scale, ": sibling branches need distinct first tokens, so at least ", needed,
        " ids"));
  }
  std::vector<Rollout> rollouts;
  switch (options.preset) {
    case WorkloadPreset::kTau2:
      GenerateAgent(kAgent, /*with_system_prompt=*/true, /*leaves_only=*/false, name, options,
                    groups, rollouts);
      break;
    case WorkloadPreset::kModifiedPrefix:
      GenerateAgent(kAgent, /*with_system_prompt=*/false, /*leaves_only=*/true, name, options,
                    groups, rollouts);
      break;
    case WorkloadPreset::kGsm8k:
      GenerateGrpo(kGsm8k, kGsm8kFamily, name, options, groups, rollouts);
      break;
    case WorkloadPreset::kAime:
      GenerateGrpo(kAime, kAimeFamily, name, options, groups, rollouts);
      break;
    case WorkloadPreset::kBranchLow:
      GenerateBranch(kBranchLow, kBranchLowFamily, name, options, groups, rollouts);
      break;
    case WorkloadPreset::kBranchMid:
      GenerateBranch(kBranchMid, kBranchMidFamily, name, options, groups, rollouts);
      break;
    case WorkloadPreset::kBranchHigh:
      GenerateBranch(kBranchHigh, kBranchHighFamily, name, options, groups, rollouts);
      break;
    case WorkloadPreset::kLongAgentic:
      GenerateBranch(kLongAgentic, kLongAgenticFamily, name, options, groups, rollouts);
      break;
  }
  return rollouts;
}

}  // namespace dta

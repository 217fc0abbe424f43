// Synthetic rollout batches shaped like the workloads the papers measure, for benchmarks, tests
// and end-to-end runs without an inference engine.
//
// Each preset reproduces the sharing structure of one published workload, calibrated so that
// ComputeTreeStats over PrefixTree::FromRollouts of the generated tokens lands within 10% of
// TargetsFor(preset) at scale 1 (workload_test checks seeds 1..5):
//
//   tau2             tau2-bench-like multi-turn agent (AReaL-DTA Fig. 1): one global system
//                    prompt, tasks of G = 8 samples, every LLM call its own rollout, so the earlier
//                    calls of a sample are prefixes of its later ones. C = 9.43, leaf-only
//                    C = 5.56.
//   gsm8k            GRPO single-turn maths, G = 16, mean length ~1.8K. C = 1.09.
//   aime             Long reasoning, G = 16, mean length ~16K (capped at 16384). C = 1.008.
//   modified-prefix  tau2 without the global system prompt, leaf sequences only, mean length
//                    ~1.6K (AReaL-DTA Table 3). C = 1.42. With the same seed it is exactly the tau2
//                    batch's leaves with the system prompt cut off.
//   branch-low/-mid/-high
//                    Tree Training's agentic trees (Section 4.4): single trajectories that fork on
//                    concurrent tool calls (low, mid) or leave a branch behind at every call
//                    because think mode drops earlier thinking from the history (high). Only
//                    leaves are rollouts. POR = 0.28, 0.70, 0.89.
//   long-agentic     branch-mid's kind of tree at long-horizon agent lengths: 34-44 calls with
//                    long tool observations, paths of ~27K-51K tokens (at most 64K; past the
//                    papers' 16K context), forking twice late on the trajectory. Only leaves are
//                    rollouts. Designed, not from a paper: POR 0.55, mean leaf ~39K tokens.
//
// Guarantees for every generated rollout: non-empty tokens with ids in [0, vocab_size); loss_mask,
// logprobs and versions of the same length as tokens; loss_mask 0 on prompt, system and
// tool/user-observation tokens and 1 on model-generated tokens, loss_mask[0] = 0; logprobs
// finite, 0 on prompt tokens and negative on generated ones; versions -1 on prompt tokens and a
// small non-negative policy version on generated ones; a reward in [0, 1]; no advantages; a unique
// id and a group naming the prompt (task, tree) it was sampled from; at most
// MaxWorkloadRolloutLength(preset) tokens (16384, 65536 for long-agentic).
// Tokens shared by several rollouts carry the same mask, logprob and version in all of them.
// Sibling branches always differ in their first token, so the prefix tree has exactly the shape
// the preset describes (no accidental sharing beyond it).
//
// Determinism: the output is a pure function of the options, identical on every platform (only
// std::mt19937_64, whose output the standard fixes, and integer arithmetic on its output). Each
// group is drawn from its own stream derived from (seed, group index), so a larger scale keeps
// the groups of a smaller one and appends new ones.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/io/rollout.h"

namespace dta {

enum class WorkloadPreset {
  kTau2,
  kGsm8k,
  kAime,
  kModifiedPrefix,
  kBranchLow,
  kBranchMid,
  kBranchHigh,
  kLongAgentic,
};

// "tau2", "gsm8k", "aime", "modified-prefix", "branch-low", "branch-mid", "branch-high",
// "long-agentic".
// INVALID_ARGUMENT listing the valid names for anything else.
absl::StatusOr<WorkloadPreset> ParseWorkloadPreset(std::string_view name);
std::string_view WorkloadPresetName(WorkloadPreset preset);

// Every preset, in declaration order (for loops in tests and tools).
std::vector<WorkloadPreset> AllWorkloadPresets();

struct WorkloadOptions {
  WorkloadPreset preset = WorkloadPreset::kTau2;
  uint64_t seed = 1;
  // Multiplies the number of groups (tasks, prompts, trees), never the sequence lengths. Every
  // batch has at least one group. Must be finite and > 0.
  double scale = 1.0;
  // Token ids are drawn from [0, vocab_size). Must be >= 2, at least the number of groups and at
  // least G (sibling branches need distinct first tokens). The default is Qwen3's.
  int32_t vocab_size = 151936;
};

// The batch described by `options`, groups in order, each group's rollouts together.
// INVALID_ARGUMENT on a bad scale or vocab_size, or on a scale so large that the preset's worst
// case (every rollout 16384 tokens) would pass 2^34 tokens, checked before anything is allocated.
absl::StatusOr<std::vector<Rollout>> GenerateWorkload(const WorkloadOptions& options);

// The statistics each preset is calibrated to (from the papers), at scale 1.
struct WorkloadTargets {
  double compression;       // C = rollout tokens / tree tokens
  double leaf_compression;  // leaf-only C; 0 = no target
  double por;               // potential overlap ratio; 0 = no target
  double mean_length;       // mean rollout length in tokens; 0 = no target
};
WorkloadTargets TargetsFor(WorkloadPreset preset);

// The longest rollout the papers' presets generate (their 16K training context), and the longest
// of long-agentic.
inline constexpr int64_t kMaxWorkloadRolloutLength = 16384;
inline constexpr int64_t kMaxLongWorkloadRolloutLength = 65536;

// The longest rollout `preset` generates.
int64_t MaxWorkloadRolloutLength(WorkloadPreset preset);

}  // namespace dta

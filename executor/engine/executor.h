// The three exact execution methods over one Decoder and one loss:
//
//   kDense   every rollout on its own: the reference and the baseline.
//   kPacked  Tree Training: the tree's unique tokens DFS-serialized into one forward with a tree
//            attention mask and original position ids; each rollout's log-probabilities are
//            gathered from the shared tokens, so autograd sums its gradient over the rollouts.
//   kDta     AReaL-DTA: the push/pop schedule (core/tree/schedule.h) over a stack holding the
//            current root-to-leaf path (per-layer K/V, hidden states, log-probabilities and their
//            gradient accumulators); backward right to left in chunks of at most B tokens.
//
// All three compute the same batch loss (a sum over rollouts, normalised as the loss options say)
// and accumulate the same d loss / d parameter into every parameter's .grad (float64 runs agree to
// rounding; tests/executor/engine checks 1e-9).
//
// Example:
//   GradientResult r = ComputeGradients(model, rollouts, {.kind = LossKind::kPpo},
//                                       {.method = Method::kDta, .block_size = 2048,
//                                        .replace_gradients = true});  // or zero each .grad first
//
// Thread safety: one call at a time per model (gradients accumulate into shared tensors).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "absl/types/span.h"
#include "core/io/rollout.h"
#include "core/layout/executor_memory.h"
#include "core/tree/schedule.h"
#include "executor/loss/loss.h"
#include "executor/model/decoder.h"

namespace dta {

enum class Method { kDense, kPacked, kDta };

// ExecutorOptions::graph_budget: size the budget from the memory the GPU has free.
inline constexpr int64_t kAutoGraphBudget = -1;
// ExecutorOptions::block_size: the longest rollout if its graph fits in the memory the GPU has
// free, else what fits (with packing: at least 8192 tokens, and for mixture-of-experts models all
// that fits).
inline constexpr int64_t kAutoBlockSize = -1;
enum class LeafOrderKind { kBackwardDfs, kLexicographic };

struct ExecutorOptions {
  Method method = Method::kDta;
  // kDta: the most tokens per backward chunk (B), or kUnboundedBlock. The default,
  // kAutoBlockSize, sizes it from memory: with the graphs of B + graph_budget tokens in 80% of the
  // device memory free when the step starts (after the path stack, and less the gradients a
  // model's first step creates: Decoder::UncreatedGradientBytes), B is the longest rollout if
  // that fits (a rollout then runs in one chunk, as dense runs it: nothing shared costs nothing
  // extra; with `pack`, at least 8192 tokens, so that packed steps are large, then doubled while
  // the schedule recomputes no more tokens and the automatic graph budget takes what B leaves
  // (LargestBlockRecomputingNoMore: fewer, larger packed steps), and for models with
  // sparse mixture-of-experts layers every token that fits: each backward chunk accumulates all
  // their experts' weight gradients, core/layout/chunk_capacity.h's MostAutomaticBlock), else what
  // fits beside an explicit graph budget; an automatic graph budget then takes what B leaves. On
  // the CPU it means the longest rollout. Under tensor parallelism every rank sizes from the least
  // free memory any rank has (LeastOverRanks), so that all plan the same schedule.
  int64_t block_size = kAutoBlockSize;
  // kDta: the order in which rollouts are visited. Default: AReaL-DTA Algorithm 1.
  LeafOrderKind order = LeafOrderKind::kBackwardDfs;
  // kDta: tokens whose graphs may be kept alive instead of recomputed for their backward (see
  // ScheduleOptions::graph_budget); 0 recomputes every graph, as the paper does. The default,
  // kAutoGraphBudget, keeps as many tokens' graphs as fit beside one chunk of B in 80% of the
  // device memory free when the step starts (after the path stack is allocated, less the
  // gradients the step creates), at the model's
  // per-token graph size (GraphBytesPerToken); on the CPU it means 0.
  int64_t graph_budget = kAutoGraphBudget;
  // kDta on a GPU: the most device memory the step may hold, in bytes, what PyTorch's allocator
  // has allocated included (weights, gradients, optimizer state, the path stack) and the gradients
  // the step will create (a model's first step); 0: no budget.
  // The automatic block size and graph budget are then the largest whose estimated graphs, backward
  // workspace and log-probability head (core/layout/chunk_capacity.h) fit in what the budget leaves
  // once the step's path stack is allocated (and in the memory free), and explicit ones are upper
  // bounds, lowered to fit; a budget that leaves no room for the smallest chunk is refused, naming
  // what it needs. The planner's estimate lies 1-7% above measured peaks, so the step's peak
  // (torch.cuda.max_memory_allocated) stays within the budget. Dense, packed, ComputeLogprobs and
  // the CPU ignore it. The estimate models the GPU's kernels (bfloat16 models); float32 and float64
  // attention on a GPU runs a reference that holds [T, P + T] scores, which it does not count.
  int64_t memory_budget = 0;
  // kDta: pack runs of small complete subtrees into one forward of at most B tokens with a tree
  // mask on top of the stack (see StepKind::kPacked). Default: on, the fastest on a GPU
  // (docs/benchmarks.md); false runs AReaL-DTA's schedule as the paper gives it, one rollout's
  // chunks at a time. The gradient is the same either way.
  bool pack = true;
  // kDta: a prefix that lexicographically consecutive rollouts share is recomputed for each of them
  // instead of shared when it is at most this fraction of the shorter rollout and that one
  // continues past it for at least kernels::kMinSplitChain tokens: the batch then runs as separate
  // trees (core/tree/sharing_groups.h). A short prompt before long answers costs less recomputed
  // than shared: the answers then run as causal chains without a prefix, as dense runs them, where
  // on the prompt each would take the split attention path (kernels/chunk_attention.h). 0 shares
  // every prefix. The gradient is the same either way.
  double unshared_prefix_fraction = 1.0 / 64;
  // kPacked: the most unique tokens in one packed forward; larger trees are split by Tree
  // Training's greedy partitioning. 0 (the default): the whole tree at once.
  int64_t token_capacity = 0;
  // kDense and kPacked: activation checkpointing: keep only each layer's input, recompute the
  // layer in backward (the "Dense+CKPT" and "Tree+CKPT" baselines of the papers).
  bool checkpointing = false;
  // Rows of the [rows x vocabulary] logits slice computed at once for log-probabilities; the
  // log-probability pass holds at most two float32 slices (2 x 512 x 151,936 x 4 B = 0.6 GB for
  // Qwen3), and 512-row matmuls against the vocabulary still run near peak.
  int64_t logprob_slice_rows = 512;
  // Log-probabilities (and entropy) of softmax(logits / temperature): the temperature the rollouts
  // were sampled at, as AReaL applies it to the training log-probabilities.
  double temperature = 1.0;
  // ComputeGradients: the batch's gradient replaces what each .grad holds instead of adding to it,
  // as a zero_grad before the call would, but cheaper: the experts' stacked weight gradients of
  // mixture-of-experts layers (most of the gradient memory) are not zero-filled but written whole
  // by their first backward chunk (Decoder::StartFreshGradients); the other gradients are zeroed in
  // one fused pass. False (the default) accumulates, for gradient accumulation over several calls.
  bool replace_gradients = false;
  // Progress within one call (ComputeGradients, ComputeLogprobs), for progress lines on long
  // steps: called on the calling thread after each unit of work with the tokens pushed through the
  // model so far and in all (forward and recomputation, as GradientResult::forwarded_tokens counts
  // them; `done` never decreases and reaches `total` at the end). It never synchronises the
  // device: on a GPU `done` counts work queued, which runs at most a launch queue ahead.
  std::function<void(int64_t done, int64_t total)> progress;
};

// The names the command line and Python give these: "dta", "dense", "packed"; "backward-dfs",
// "lexicographic" (dta-train's flags take their defaults from ExecutorOptions through them).
std::string_view MethodName(Method method);
std::string_view LeafOrderName(LeafOrderKind order);

struct GradientResult {
  double loss = 0;  // the batch loss: the sum of every rollout's (normalised) loss, and the
                    // router-balance term (LossOptions::router_aux_loss_coef) when on
  // With LossOptions::router_aux_loss_coef: the mean over the batch's rollouts of their
  // load-balancing losses aux_r (without the coefficient; over R = BatchLossContext::num_rollouts,
  // so data-parallel ranks' values add up). 0 when off.
  double router_aux_loss = 0;
  // Per rollout [L], the current policy's, detached; position 0 holds 0, and so does every position
  // no loss reads: with a built-in loss the LM head runs only where some rollout through the token
  // has loss_mask 1 (a custom loss, ComputeLogprobs and DTA_LOSS_ROWS_ONLY=0 compute them all).
  std::vector<at::Tensor> logprobs;
  // kDta: the block size and graph budget the step ran with, automatic ones resolved (0 for dense
  // and packed).
  int64_t block_size = 0;
  int64_t graph_budget = 0;
  int64_t rollout_tokens = 0;    // all rollout tokens
  int64_t forwarded_tokens = 0;  // tokens pushed through the model, recomputation included
  // Routing replay (Rollout::routed_experts): the unique tokens the batch's tree gains because
  // rollouts that share tokens were routed differently on them (such prefixes are not shared).
  int64_t replay_split_tokens = 0;
  LossDiagnostics diagnostics;  // of the losses (ComputeGradients only)
};

// Bytes of autograd state one token's forward graph keeps alive (saved activations of every
// layer), the unit in which the automatic graph budget is sized. An estimate from the shapes; on
// one of `tensor_parallel` ranks (heads and the MLP's intermediate split across them) and of
// `expert_parallel` ranks (whose sparse layers also keep the rows they served).
int64_t GraphBytesPerToken(const ModelConfig& config, at::ScalarType dtype, int tensor_parallel = 1,
                           int expert_parallel = 1);

// The executor's options and workload as core/layout's estimate of its memory sees them; a
// longest_rollout of 0 plans for kDefaultPlannedRollout tokens.
ExecutorMemoryOptions ExecutorMemoryOf(const ExecutorOptions& executor, int64_t longest_rollout,
                                       int64_t tree_tokens = 0);

// Computes the batch loss and adds d loss / d parameter into each parameter's .grad (callers zero
// the gradients between steps). Rollouts must be valid (ValidateRollout) with token ids below the
// model's vocabulary; TORCH_CHECK names the rollout otherwise.
GradientResult ComputeGradients(const Decoder& model, absl::Span<const Rollout> rollouts,
                                const LossOptions& loss, const ExecutorOptions& options = {});

// The same with the batch's normalisers given instead of computed from `rollouts`. With data
// parallelism each rank passes the global context (MakeBatchContext over every rank's rollouts), so
// that the ranks' gradients sum to the single-process gradient; a rank's rollouts then carry
// per-token advantages computed over the whole batch (GroupAdvantages), as the dispatcher sends
// them, because group advantages computed here would see only this rank's part of each group.
GradientResult ComputeGradients(const Decoder& model, absl::Span<const Rollout> rollouts,
                                const LossOptions& loss, const ExecutorOptions& options,
                                const BatchLossContext& batch);

// Every rollout's per-token log-probabilities under the model, without gradients, each unique
// token computed once for kPacked and kDta. Position 0 holds 0.
std::vector<at::Tensor> ComputeLogprobs(const Decoder& model, absl::Span<const Rollout> rollouts,
                                        const ExecutorOptions& options = {});

}  // namespace dta

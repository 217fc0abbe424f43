// Internal to executor/engine: what the three methods share, and their entry points.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/types/span.h"
#include "core/tree/prefix_tree.h"
#include "executor/engine/executor.h"
#include "executor/engine/routing_replay.h"

namespace dta::engine {

// The positions whose log-probability (and entropy) an execution computes: per rollout, those that
// its loss reads or the loss of another rollout through the same token does (a shared token is
// computed once for all of them). The built-in losses read a position only where its loss_mask
// is 1, so the LM head (a tenth of a small model's step, for a vocabulary of 151,936) skips
// prompts, observations and tool output; the other positions hold 0 and get no gradient, as the
// losses give them anyway. Every position for a custom loss (it may read any), for ComputeLogprobs
// and with DTA_LOSS_ROWS_ONLY=0 (read when the plan is made; for before/after measurements).
class LogprobPositions {
 public:
  LogprobPositions() = default;  // every position
  // Where the loss masks of `rollouts` are 1, merged over the tokens they share.
  static LogprobPositions OfLossMasks(absl::Span<const Rollout> rollouts);

  bool all() const { return read_.empty(); }
  // Rollout r's flags for its positions [begin, end); empty when every position is read.
  absl::Span<const uint8_t> Of(RolloutIndex r, int64_t begin, int64_t end) const {
    if (all()) return {};
    return absl::MakeConstSpan(read_[r]).subspan(begin, end - begin);
  }

 private:
  std::vector<std::vector<uint8_t>> read_;
};

// Log-probabilities (and entropies) of `targets` [N] predicted by `rows` [N, hidden] through
// model.Logprobs, computed at the rows whose flag in `read` is set (every row when `read` is
// empty) and 0 at the others, which get no gradient. `entropy` is set when asked for.
at::Tensor LogprobsOfReadRows(const Decoder& model, const at::Tensor& rows,
                              const at::Tensor& targets, absl::Span<const uint8_t> read,
                              at::Tensor* entropy, const LogprobOptions& options);

// Everything about the loss that is fixed for the batch before execution: the normaliser, GRPO
// advantages, whether entropy is needed, proximal log-probabilities for decoupled PPO, the
// positions whose log-probabilities the losses read.
class LossPlan {
 public:
  LossPlan(const Decoder& model, absl::Span<const Rollout> rollouts, const LossOptions& options,
           const ExecutorOptions& executor, const BatchLossContext& batch);

  bool needs_entropy() const {
    return options_.with_entropy || (options_.entropy_coef != 0.0 && !options_.custom);
  }
  // Rollout r's normalised loss as a differentiable function of its log-probabilities (and
  // entropy, when needed; otherwise pass an undefined tensor).
  at::Tensor Loss(int32_t r, const at::Tensor& logprobs, const at::Tensor& entropy) const;
  // The same, with d loss / d logprobs (and d loss / d entropy) by autograd on the small vectors.
  RolloutLossGrad LossAndGrad(int32_t r, const at::Tensor& logprobs,
                              const at::Tensor& entropy) const;
  // The same with the diagnostics gathered into `diagnostics`, for a caller that computes several
  // rollouts' losses on several threads (built-in losses only: a custom one may hold Python's
  // lock) and then adds their diagnostics in rollout order (AddDiagnostics).
  RolloutLossGrad LossAndGrad(int32_t r, const at::Tensor& logprobs, const at::Tensor& entropy,
                              DiagnosticsAccumulator& diagnostics) const;
  void AddDiagnostics(const DiagnosticsAccumulator& part) const { diagnostics_.Merge(part); }
  // Whether the losses of many rollouts can be computed at once (LossAndGradOfRollouts): a
  // built-in loss that is a sum of per-token terms (SumsTokenTerms).
  bool sums_token_terms() const { return SumsTokenTerms(options_); }
  // RolloutsLossAndGrad of rollouts `rs`, whose log-probabilities (and entropies, when needed)
  // are concatenated in that order: their summed loss and the gradients laid out alike.
  RolloutLossGrad LossAndGradOfRollouts(absl::Span<const RolloutIndex> rs,
                                        const at::Tensor& logprobs,
                                        const at::Tensor& entropy) const;
  // Whether LossAndGrad may run for different rollouts on different threads at once.
  bool computes_on_any_thread() const { return !options_.custom; }
  // The positions whose log-probabilities the losses read.
  const LogprobPositions& read_positions() const { return read_; }
  // The diagnostics of the losses computed so far (each rollout's loss is computed once).
  LossDiagnostics ReadDiagnostics() const { return diagnostics_.Read(); }

  // The router's load-balancing loss (LossOptions::router_aux_loss_coef), per rollout r with c_r
  // and p_r [E] the sums over its tokens and the sparse layers of the top-k indicators and the
  // router probabilities (ChunkOutput::router_counts, router_probs): coef aux_r / R = w_r <c_r,
  // p_r>, w_r = coef E / (R (sparse layers x length_r)^2). c_r is a constant, so the term is linear
  // in the probabilities: it adds w_r c_r to d loss / d router_probs of each of r's tokens (a
  // token shared by rollouts sums theirs), and its value is <those rows, the probabilities>.
  bool balances_routers() const { return options_.router_aux_loss_coef != 0; }
  double router_aux_loss_coef() const { return options_.router_aux_loss_coef; }
  // w_r c_r given c_r = `counts` [E].
  at::Tensor RouterBalanceRow(int32_t r, const at::Tensor& counts) const;

 private:
  RolloutLossInputs Inputs(int32_t r, const at::Tensor& logprobs, const at::Tensor& entropy) const;

  absl::Span<const Rollout> rollouts_;
  LossOptions options_;
  BatchLossContext batch_;
  std::vector<std::vector<float>> advantages_;
  LogprobPositions read_;
  std::vector<at::Tensor> proximal_;
  int64_t sparse_layers_ = 0, experts_ = 0;
  // Gathered as Loss and LossAndGrad run: statistics, not state the losses depend on.
  mutable DiagnosticsAccumulator diagnostics_;
};

// The log-probability head's options of an execution.
inline LogprobOptions LogprobOptionsOf(const ExecutorOptions& options) {
  return {.slice_rows = options.logprob_slice_rows, .temperature = options.temperature};
}

// Every rollout's tokens as an [L] int64 tensor on the model's device: views of one buffer,
// uploaded in one asynchronous copy.
std::vector<at::Tensor> TokenTensors(absl::Span<const Rollout> rollouts,
                                     const at::TensorOptions& model_options);

// The prefix tree over the keys (RoutingReplay::keys: the token ids, or with routing replay the
// tokens and their routings) of rollouts subset[0], subset[1], ... (local indices follow
// `subset`), or of all the batch's rollouts.
PrefixTree BuildTree(const RoutingReplay& keys, absl::Span<const RolloutIndex> subset);
PrefixTree BuildTree(const RoutingReplay& keys);

// Checks token ids against the vocabulary, naming the rollout.
void CheckRollouts(const Decoder& model, absl::Span<const Rollout> rollouts);

// The router-balance term of rollouts whose tokens sit at rows `paths[i]` of a forward's
// router_counts / router_probs ([T, E]): rows [T, E] with w_r c_r added at each rollout's rows
// (LossPlan::RouterBalanceRow), the gradient the forward's router_probs is seeded with (or, times
// router_probs, the term's differentiable value). `rollouts[i]` is the plan's index of paths[i].
at::Tensor RouterBalanceRows(const LossPlan& plan, const at::Tensor& router_counts,
                             absl::Span<const RolloutIndex> rollouts,
                             absl::Span<const at::Tensor> paths);

// When `plan` is null, only log-probabilities are computed (no graph, no gradients). `replay` is
// the batch's routing replay (RoutingReplay over `rollouts`); log-probabilities are computed at
// `read` (GradientResult::logprobs holds 0 elsewhere).
GradientResult RunDense(const Decoder& model, absl::Span<const Rollout> rollouts,
                        const RoutingReplay& replay, const LossPlan* plan,
                        const LogprobPositions& read, const ExecutorOptions& options);
GradientResult RunPacked(const Decoder& model, absl::Span<const Rollout> rollouts,
                         const RoutingReplay& replay, const LossPlan* plan,
                         const LogprobPositions& read, const ExecutorOptions& options);
GradientResult RunDta(const Decoder& model, absl::Span<const Rollout> rollouts,
                      const RoutingReplay& replay, const LossPlan* plan,
                      const LogprobPositions& read, const ExecutorOptions& options);
// The method options.method names over `rollouts`: gradients with a plan, log-probabilities at
// `read` without.
GradientResult Run(const Decoder& model, absl::Span<const Rollout> rollouts, const LossPlan* plan,
                   const LogprobPositions& read, const ExecutorOptions& options);

}  // namespace dta::engine

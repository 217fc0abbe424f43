// The training losses: pure functions of one rollout's per-token log-probabilities.
//
// An execution method (dense, packed tree, push/pop dta) computes, for each rollout r, a tensor
// `logprobs` [L] of the current policy's log p(tokens[t] | tokens[<t]) (position 0 holds a dummy
// value; loss_mask[0] = 0 so it never contributes), optionally the per-token `entropy` [L], and
// calls RolloutLoss (or RolloutLossAndGrad) on it. It then adds d loss / d logprobs into the
// accumulators of the rollout's tokens; it never needs to know which loss ran.
//
// The batch loss is the SUM over rollouts of RolloutLoss. Every normalisation is therefore fixed
// before execution by a BatchLossContext (MakeBatchContext), so that a rollout's contribution
// depends only on that rollout and the context.
//
// Notation for one rollout (all per-token quantities aligned with tokens, t = 0 .. L-1):
//   m_t        loss_mask[t] (0/1); M = sum_t m_t, the rollout's loss tokens
//   lp_t       current log-probability (the `logprobs` input, gradients flow into it)
//   old_t      behaviour log-probability (Rollout::logprobs, constant)
//   prox_t     proximal log-probability (`proximal_logprobs`, decoupled PPO only, constant)
//   ref_t      reference log-probability (Rollout::ref_logprobs, constant)
//   H_t        entropy (the `entropy` input, gradients flow into it)
//   A_t        advantage (`advantages`, constant)
//   N          batch.total_loss_tokens;  R = batch.num_rollouts
//   clip(x)    min(max(x, 1 - eps_clip_low), 1 + eps_clip_high)
//
// Per-token policy losses l_t (only tokens with m_t = 1 are ever evaluated into the loss; masked
// positions get exactly zero gradient even if their values are extreme):
//   kSft:          l_t = -lp_t
//   kPpo:          r_t = exp(lp_t - old_t)
//                  l_t = max(-A_t r_t, -A_t clip(r_t))
//                  dual clip (dual_clip = c > 1): if A_t < 0, l_t = min(l_t, -c A_t)
//   kDecoupledPpo: (AReaL) r_t = exp(lp_t - prox_t), l_t as kPpo (same clip and dual clip), then
//                  multiplied by the behaviour importance weight w_t = exp(prox_t - old_t) (a
//                  constant, no gradient; behave_imp_weight = false leaves it out, as AReaL 1.0
//                  does without rejection sampling). With behave_imp_weight_cap = cap > 0, tokens
//                  with w_t > cap contribute 0 (loss and gradient) but, as in AReaL, still count in
//                  the normalisers (N, M), which are fixed from loss_mask. rejection_sampling
//                  generalises the cap as AReaL 1.0's RejectionSamplingConfig does (see
//                  RejectionSampling below); the tokens it rejects also keep counting in N and M.
//   kGspo:         sequence level (see below).
//
// Regulariser per token (every kind, masked by m_t):
//   g_t = -entropy_coef * H_t + kl_coef * k3_t,   k3_t = exp(ref_t - lp_t) - (ref_t - lp_t) - 1
// (terms whose coefficient is 0 are skipped, so entropy / ref_logprobs are then not needed).
//
// Normalisation of token sums S = sum_t m_t (l_t + g_t):
//   kTokenMean:    S / N
//   kSequenceMean: (S / M) / R        (0 if M = 0)
//   kSum:          S
//
// GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), standard sequence-level form:
//   s   = exp((1/M) sum_t m_t (lp_t - old_t))           (length-normalised sequence ratio)
//   A   = A_t of the first token with m_t = 1           (GSPO advantages are per sequence)
//   L_s = max(-A s, -A min(max(s, 1 - gspo_eps_low), 1 + gspo_eps_high))
// whose gradient is -A s (1/M) sum_t m_t d lp_t when unclipped, 0 when clipped (the paper's
// GSPO gradient; the GSPO-token variant with stop-gradients is not implemented, it has the same
// gradient when A is constant over the sequence). L_s is already a per-sequence mean, so the
// rollout's policy term is L_s / R for kTokenMean and kSequenceMean, and L_s for kSum. The
// regulariser g_t is added with the token normalisation above. eps_clip_*, dual_clip and
// behave_imp_weight_cap do not apply to GSPO. A rollout with M = 0 contributes 0.
//
// Errors: c10::Error (TORCH_CHECK) whose message names the rollout id and the field, e.g.
//   "rollout 'r7': field 'advantages': 5 values for 6 tokens".
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/io/rollout.h"
#include "core/loss/batch_context.h"
#include "executor/loss/diagnostics.h"

namespace dta {

enum class LossKind {
  kSft,           // supervised fine-tuning: negative log-likelihood
  kPpo,           // PPO / GRPO token-level clipped surrogate against the behaviour policy
  kDecoupledPpo,  // AReaL's decoupled PPO: clip against pi_prox, behaviour importance weight
  kGspo,          // GSPO: clipped sequence-level (length-normalised) ratio
};

enum class Normalization {
  kTokenMean,     // divide by the batch's total loss tokens
  kSequenceMean,  // each rollout's masked token mean, divided by the number of rollouts
  kSum,           // no normalisation
};

struct RolloutLossInputs;

// AReaL 1.0's rejection sampling of stale tokens in decoupled PPO (its RejectionSamplingConfig),
// on the divergence between the proximal and the behaviour policy, lr_t = prox_t - old_t (0 where
// it is not finite). Per token the metric is
//   kRatio: exp(lr_t)   kKlK1: lr_t   kKlK2: lr_t^2 / 2   kKlK3: exp(-lr_t) - 1 + lr_t
// and a value is in bounds when lower <= value <= upper (no lower bound when lower is unset).
//   kToken:    each loss token on its own.
//   kSequence: the rollout's loss tokens together, through `aggregation` of their metric values
//              (for kRatio in log space: exp(sum lr), exp(mean lr) or exp(max lr)); for kRatio the
//              behaviour weight of every token is then the geometric mean exp(mean lr) too.
//   kMask:     tokens (or whole rollouts) out of bounds contribute nothing.
//   kClamp:    their behaviour weight is clamped to [lower (0 if unset), upper].
struct RejectionSampling {
  enum class Level { kToken, kSequence };
  enum class Action { kMask, kClamp };
  enum class Metric { kRatio, kKlK1, kKlK2, kKlK3 };
  enum class Aggregation { kSum, kMean, kMax };
  Level level = Level::kToken;
  Action action = Action::kMask;
  Metric metric = Metric::kRatio;
  Aggregation aggregation = Aggregation::kMean;  // kSequence only
  double upper = 5.0;
  std::optional<double> lower;  // > 0 for kRatio
};

// A loss defined outside the executor, e.g. a Python callable wrapped by bindings/python: rollout
// r's contribution to the batch loss as a differentiable function of in.logprobs (a 0-d float
// tensor on in.logprobs' device; the batch loss is the sum over rollouts, so it normalises itself,
// e.g. by batch.total_loss_tokens). in.advantages is set when every rollout of the batch has a
// reward or advantages (GRPO group advantages, as for kPpo), else null; in.entropy is set with
// LossOptions::with_entropy (differentiable, like logprobs), in.proximal_logprobs with
// with_proximal. It may throw; the exception propagates out of
// ComputeGradients. Called on the thread that called ComputeGradients, one rollout at a time.
using CustomLoss =
    std::function<at::Tensor(const RolloutLossInputs& in, const BatchLossContext& batch)>;

struct LossOptions {
  LossKind kind = LossKind::kPpo;
  Normalization normalization = Normalization::kTokenMean;
  // PPO ratio clipped to [1 - eps_clip_low, 1 + eps_clip_high]; both >= 0.
  double eps_clip_low = 0.2;
  double eps_clip_high = 0.2;
  // c > 1 enables dual clip (for negative advantages, the loss is capped at -c*A); 0 = off.
  double dual_clip = 0.0;
  // Decoupled PPO: tokens whose pi_prox / pi_behave exceeds this are masked out; 0 = no cap.
  double behave_imp_weight_cap = 0.0;
  // Decoupled PPO: multiply by the behaviour importance weight pi_prox / pi_behave (the AReaL paper
  // and AReaL <= 0.5); false: no weight (AReaL 1.0 without rejection sampling).
  bool behave_imp_weight = true;
  // Decoupled PPO: AReaL 1.0's filtering of stale tokens (needs behave_imp_weight and no cap).
  std::optional<RejectionSampling> rejection_sampling;
  // loss -= entropy_coef * entropy (needs the entropy input when nonzero).
  double entropy_coef = 0.0;
  // loss += kl_coef * k3 KL(pi || ref) per token (needs Rollout::ref_logprobs when nonzero).
  double kl_coef = 0.0;
  // GSPO sequence-ratio clip range [1 - gspo_eps_low, 1 + gspo_eps_high] (paper defaults).
  double gspo_eps_low = 3e-4;
  double gspo_eps_high = 4e-4;
  // How rewards become advantages, when the rollouts carry none (GRPO group normalisation).
  AdvantageOptions advantages;
  // Compute the entropy even when entropy_coef is 0: for a custom loss (RolloutLossInputs::entropy,
  // differentiable) and the entropy diagnostic.
  bool with_entropy = false;
  // Compute the proximal log-probabilities (the policy before this step, forward only) for a
  // custom loss too (RolloutLossInputs::proximal_logprobs); kDecoupledPpo always computes them.
  bool with_proximal = false;
  // When set, replaces the built-in losses: kind, the clips and the regularisers are ignored.
  CustomLoss custom = nullptr;
  // Mixture-of-experts models: loss += router_aux_loss_coef * (1/R) sum_r aux_r (>= 0; 0 = off),
  // the router's load-balancing loss of each rollout r as transformers computes it for that rollout
  // alone (load_balancing_loss_func over its tokens and every sparse layer, Qwen3MoeForCausalLM's
  // aux_loss with output_router_logits): aux_r = E sum_i f_i P_i, f_i the fraction of its (token,
  // layer) pairs that put expert i in their top-k and P_i the mean router probability of expert i
  // over them (E experts). Added to the batch loss beside whatever `kind` or `custom` computes,
  // whatever the normalisation. Per rollout, not over the whole batch: a batch-wide f would need
  // every token's routing before the first backward, which push/pop execution never has.
  double router_aux_loss_coef = 0.0;
};

// A RejectionSampling from "key=value" pairs joined by commas (the command line's spelling):
// level=token|sequence, action=mask|clamp, metric=ratio|kl_k1|kl_k2|kl_k3,
// aggregation=sum|mean|max, upper=U, lower=L; unnamed keys keep their defaults. INVALID_ARGUMENT
// naming the key for an unknown key or value.
absl::StatusOr<RejectionSampling> ParseRejectionSampling(std::string_view spec);

// Whether `loss` trains `rollouts` with advantages (their own, else GRPO group advantages over the
// batch): every kind but kSft; a custom loss when every rollout has a reward or advantages.
bool UsesAdvantages(const LossOptions& loss, absl::Span<const Rollout> rollouts);

// GroupAdvantages (core/loss/batch_context.h), with TORCH_CHECK naming the rollout on error.
std::vector<std::vector<float>> ComputeAdvantages(absl::Span<const Rollout> rollouts,
                                                  const AdvantageOptions& options = {});

struct RolloutLossInputs {
  const Rollout* rollout = nullptr;
  at::Tensor logprobs{};  // [L] current policy, float32 or float64 (usually requires_grad)
  at::Tensor entropy{};   // [L] or undefined; needed when entropy_coef != 0
  // [L] or undefined; needed by kDecoupledPpo (pi_prox, treated as a constant).
  at::Tensor proximal_logprobs{};
  const std::vector<float>* advantages = nullptr;  // [L]; needed by all kinds but kSft
};

// The rollout's contribution to the batch loss: a 0-d tensor of logprobs' dtype and device,
// already divided by the batch normaliser, with autograd history to `logprobs` (and `entropy` when
// entropy_coef != 0) if they require grad. Always connected to `logprobs`, even when it is 0.
// Checks (TORCH_CHECK, message names rollout id and field): logprobs/entropy/proximal_logprobs
// 1-D float32/float64 of length L = tokens.size(); loss_mask, behaviour logprobs (kinds but
// kSft), advantages and ref_logprobs (kl_coef != 0) of length L; the required inputs present;
// option ranges; a positive normaliser when the rollout has loss tokens.
// With `diagnostics`, the rollout's contribution to the batch's diagnostics (clip fractions,
// approximate KL, importance ratios, entropy, rejection) is added to it from the same tensors,
// without gradients or a host synchronisation; a custom loss adds its tokens and entropy only.
at::Tensor RolloutLoss(const RolloutLossInputs& in, const LossOptions& options,
                       const BatchLossContext& batch,
                       DiagnosticsAccumulator* diagnostics = nullptr);

// The loss value and its gradients, computed with torch::autograd::grad on detached copies of the
// inputs (the caller's tensors and graph are untouched; works under NoGradGuard).
struct RolloutLossGrad {
  at::Tensor loss{};       // 0-d, detached: reading it (.item()) is the caller's choice of sync
  at::Tensor dlogprobs{};  // [L], d loss / d logprobs, detached
  // [L] d loss / d entropy when entropy was given (zeros if entropy_coef = 0), else undefined.
  at::Tensor dentropy{};
};
RolloutLossGrad RolloutLossAndGrad(const RolloutLossInputs& in, const LossOptions& options,
                                   const BatchLossContext& batch,
                                   DiagnosticsAccumulator* diagnostics = nullptr);

// Whether the loss is a sum of per-token terms, each of one token's inputs and of constants fixed
// for the batch: every built-in kind but kGspo, without sequence-level rejection sampling. Such a
// loss can be computed for many rollouts at once (RolloutsLossAndGrad).
bool SumsTokenTerms(const LossOptions& options);

// Several rollouts' inputs, their log-probabilities (and entropies) concatenated: rollout i's L_i
// values follow rollout i - 1's.
struct RolloutsLossInputs {
  std::vector<const Rollout*> rollouts;
  at::Tensor logprobs{};  // [sum L_i], float32 or float64
  at::Tensor entropy{};   // [sum L_i] or undefined, as RolloutLossInputs::entropy
  std::vector<at::Tensor> proximal_logprobs;          // per rollout, as RolloutLossInputs'
  std::vector<const std::vector<float>*> advantages;  // per rollout, as RolloutLossInputs'
};

// RolloutLossAndGrad of every rollout at once, for a loss that SumsTokenTerms: one graph of a few
// operations over the concatenation instead of one per rollout (a packed step holds dozens of
// rollouts, whose losses one by one took the host longer than the GPU's packed forward). The loss
// is the sum of the rollouts' losses and the gradients are laid out as the inputs; each token's
// gradient comes from the same operations as RolloutLossAndGrad's (the sums are taken in another
// order, so the loss's last bits may differ). The same checks, naming the rollout; diagnostics
// are added once, as the sums of the rollouts'.
RolloutLossGrad RolloutsLossAndGrad(const RolloutsLossInputs& in, const LossOptions& options,
                                    const BatchLossContext& batch,
                                    DiagnosticsAccumulator* diagnostics = nullptr);

}  // namespace dta

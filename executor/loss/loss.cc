#include "executor/loss/loss.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "executor/device/host_to_device.h"

namespace dta {
namespace {

const char* KindName(LossKind kind) {
  switch (kind) {
    case LossKind::kSft:
      return "kSft";
    case LossKind::kPpo:
      return "kPpo";
    case LossKind::kDecoupledPpo:
      return "kDecoupledPpo";
    case LossKind::kGspo:
      return "kGspo";
  }
  return "unknown";
}

// A copy (never an alias: autograd may save it past the vector's lifetime) of a float vector,
// uploaded without a host synchronisation.
at::Tensor ToTensor(const std::vector<float>& values, const at::TensorOptions& options) {
  return CopyToDevice(absl::MakeConstSpan(values), options);
}

void CheckVectorLength(const Rollout& r, const char* field, size_t size) {
  TORCH_CHECK(size == r.tokens.size(), "rollout '", r.id, "': field '", field, "': ", size,
              " values for ", r.tokens.size(), " tokens");
}

void CheckTensor(const Rollout& r, const char* field, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, "rollout '", r.id,
              "': field '", field, "': dtype ", t.scalar_type(), ", expected float32 or float64");
  TORCH_CHECK(t.dim() == 1, "rollout '", r.id, "': field '", field, "': ", t.dim(),
              "-D tensor, expected 1-D [", r.tokens.size(), "]");
  TORCH_CHECK(t.size(0) == static_cast<int64_t>(r.tokens.size()), "rollout '", r.id, "': field '",
              field, "': ", t.size(0), " values for ", r.tokens.size(), " tokens");
}

void CheckRejectionSampling(const Rollout& r, const LossOptions& o) {
  const RejectionSampling& rs = *o.rejection_sampling;
  TORCH_CHECK(o.kind == LossKind::kDecoupledPpo, "rollout '", r.id, "': LossOptions.",
              "rejection_sampling applies to kDecoupledPpo only, the loss is ", KindName(o.kind));
  TORCH_CHECK(o.behave_imp_weight_cap == 0, "rollout '", r.id,
              "': LossOptions.behave_imp_weight_cap and rejection_sampling are two ways of saying "
              "the same: give one (the cap is rejection_sampling {token, mask, ratio, upper=cap})");
  TORCH_CHECK(o.behave_imp_weight, "rollout '", r.id,
              "': LossOptions.rejection_sampling filters the behaviour importance weight, which "
              "behave_imp_weight = false leaves out");
  const bool ratio = rs.metric == RejectionSampling::Metric::kRatio;
  TORCH_CHECK(std::isfinite(rs.upper) && (!ratio || rs.upper > 1), "rollout '", r.id,
              "': LossOptions.rejection_sampling.upper must be finite",
              ratio ? " and > 1 for the ratio metric" : "", ", got ", rs.upper);
  if (rs.lower) {
    TORCH_CHECK(std::isfinite(*rs.lower) && *rs.lower <= rs.upper && (!ratio || *rs.lower > 0),
                "rollout '", r.id, "': LossOptions.rejection_sampling.lower must be finite, ",
                ratio ? "> 0 and " : "", "<= upper (", rs.upper, "), got ", *rs.lower);
  }
}

// Every check on the inputs and options, before any tensor work.
void CheckInputs(const RolloutLossInputs& in, const LossOptions& o) {
  TORCH_CHECK(in.rollout != nullptr, "RolloutLossInputs.rollout is null");
  const Rollout& r = *in.rollout;
  TORCH_CHECK(in.logprobs.defined(), "rollout '", r.id,
              "': field 'logprobs' (current policy) is "
              "undefined");
  CheckTensor(r, "logprobs", in.logprobs);
  CheckVectorLength(r, "loss_mask", r.loss_mask.size());
  if (in.entropy.defined()) {
    CheckTensor(r, "entropy", in.entropy);
    TORCH_CHECK(in.entropy.device() == in.logprobs.device(), "rollout '", r.id,
                "': field 'entropy': on ", in.entropy.device(), ", logprobs on ",
                in.logprobs.device());
  }
  TORCH_CHECK(o.entropy_coef == 0 || in.entropy.defined(), "rollout '", r.id,
              "': field 'entropy' is missing but entropy_coef = ", o.entropy_coef);
  if (o.kind != LossKind::kSft) {
    CheckVectorLength(r, "logprobs (behaviour)", r.logprobs.size());
    TORCH_CHECK(in.advantages != nullptr, "rollout '", r.id, "': field 'advantages' is missing (",
                KindName(o.kind), " needs them)");
    CheckVectorLength(r, "advantages", in.advantages->size());
  }
  if (o.kind == LossKind::kDecoupledPpo) {
    TORCH_CHECK(in.proximal_logprobs.defined(), "rollout '", r.id,
                "': field 'proximal_logprobs' is missing (kDecoupledPpo needs them)");
    CheckTensor(r, "proximal_logprobs", in.proximal_logprobs);
  }
  if (o.kl_coef != 0) {
    TORCH_CHECK(!r.ref_logprobs.empty(), "rollout '", r.id,
                "': field 'ref_logprobs' is missing but kl_coef = ", o.kl_coef);
    CheckVectorLength(r, "ref_logprobs", r.ref_logprobs.size());
  }
  TORCH_CHECK(o.eps_clip_low >= 0 && o.eps_clip_high >= 0, "rollout '", r.id,
              "': LossOptions.eps_clip_low/high must be >= 0, got ", o.eps_clip_low, ", ",
              o.eps_clip_high);
  TORCH_CHECK(o.dual_clip == 0 || o.dual_clip > 1, "rollout '", r.id,
              "': LossOptions.dual_clip must be 0 (off) or > 1, got ", o.dual_clip);
  TORCH_CHECK(o.behave_imp_weight_cap >= 0, "rollout '", r.id,
              "': LossOptions.behave_imp_weight_cap must be >= 0, got ", o.behave_imp_weight_cap);
  TORCH_CHECK(o.gspo_eps_low >= 0 && o.gspo_eps_high >= 0, "rollout '", r.id,
              "': LossOptions.gspo_eps_low/high must be >= 0, got ", o.gspo_eps_low, ", ",
              o.gspo_eps_high);
  if (o.rejection_sampling) CheckRejectionSampling(r, o);
}

// max(-A r, -A clip(r)), then the dual clip for A < 0.
at::Tensor ClippedSurrogate(const at::Tensor& ratio, const at::Tensor& adv, const LossOptions& o) {
  at::Tensor clipped = at::clamp(ratio, 1.0 - o.eps_clip_low, 1.0 + o.eps_clip_high);
  at::Tensor loss = at::maximum(-adv * ratio, -adv * clipped);
  if (o.dual_clip > 1) {
    loss = at::where(adv < 0, at::minimum(loss, -o.dual_clip * adv), loss);
  }
  return loss;
}

// The rollout's loss tokens: how many, the first, and loss_mask as a bool tensor on the device.
struct LossTokens {
  int64_t count = 0;
  int64_t first = -1;
  at::Tensor mask;
};

LossTokens LossTokensOf(const Rollout& r, const at::TensorOptions& opts) {
  LossTokens out;
  for (size_t t = 0; t < r.loss_mask.size(); ++t) {
    if (r.loss_mask[t] == 0) continue;
    if (out.first < 0) out.first = static_cast<int64_t>(t);
    ++out.count;
  }
  out.mask = CopyToDevice(at::from_blob(const_cast<uint8_t*>(r.loss_mask.data()),
                                        {static_cast<int64_t>(r.loss_mask.size())}, at::kByte),
                          opts.dtype(at::kBool));
  return out;
}

// Decoupled PPO's behaviour importance weights pi_prox / pi_behave, after rejection sampling.
struct BehaviourWeights {
  at::Tensor weight;     // [L], 0 on rejected and masked tokens
  at::Tensor kept;       // [L] bool: loss tokens not rejected
  at::Tensor changed;    // [L] bool: loss tokens rejected (kMask) or clamped (kClamp)
  at::Tensor log_ratio;  // [L] lr = prox - old (0 where not finite or masked)
};

BehaviourWeights BehaviourWeightsOf(const at::Tensor& prox, const at::Tensor& old,
                                    const at::Tensor& mask, int64_t loss_tokens,
                                    const LossOptions& o) {
  using RS = RejectionSampling;
  BehaviourWeights out;
  const at::Tensor diff = prox - old;
  out.log_ratio = at::where(mask & at::isfinite(diff), diff, 0);
  at::Tensor weight = at::exp(out.log_ratio);
  at::Tensor unclamped = weight;  // what kClamp compares with to count the clamped tokens
  at::Tensor in_bounds = at::ones_like(mask);
  if (o.behave_imp_weight_cap > 0) in_bounds = weight <= o.behave_imp_weight_cap;
  if (o.rejection_sampling) {
    const RS& rs = *o.rejection_sampling;
    const at::Tensor& lr = out.log_ratio;
    at::Tensor metric;
    switch (rs.metric) {
      case RS::Metric::kRatio:
        metric = weight;
        break;
      case RS::Metric::kKlK1:
        metric = lr;
        break;
      case RS::Metric::kKlK2:
        metric = lr * lr / 2;
        break;
      case RS::Metric::kKlK3:
        metric = at::exp(-lr) - 1 + lr;
        break;
    }
    const auto bounded = [&rs](const at::Tensor& x) {
      at::Tensor ok = x <= rs.upper;
      return rs.lower ? ok & (x >= *rs.lower) : ok;
    };
    const double lower = rs.lower.value_or(0.0);
    if (rs.level == RS::Level::kToken) {
      if (rs.action == RS::Action::kMask) {
        in_bounds = bounded(metric);
      } else {
        weight = at::clamp(weight, lower, rs.upper);
      }
    } else if (loss_tokens > 0) {
      // The ratio aggregates in log space (a geometric mean for kMean), the KL metrics as they are.
      const bool log_space = rs.metric == RS::Metric::kRatio;
      const at::Tensor values = log_space ? lr : metric;
      at::Tensor aggregate;
      switch (rs.aggregation) {
        case RS::Aggregation::kSum:
          aggregate = at::where(mask, values, 0).sum();
          break;
        case RS::Aggregation::kMean:
          aggregate = at::where(mask, values, 0).sum() / static_cast<double>(loss_tokens);
          break;
        case RS::Aggregation::kMax:
          aggregate = at::where(mask, values, -std::numeric_limits<double>::infinity()).max();
          break;
      }
      if (log_space) {
        aggregate = at::exp(aggregate);
        // Every token weighs the sequence's geometric mean ratio.
        weight = at::exp(lr.sum() / static_cast<double>(loss_tokens)).expand_as(weight);
        unclamped = weight;
      }
      const at::Tensor sequence_ok = bounded(aggregate);
      if (rs.action == RS::Action::kMask) {
        in_bounds = sequence_ok.expand_as(mask);
      } else {
        weight = at::where(sequence_ok, weight, at::clamp(weight, lower, rs.upper));
      }
    }
  }
  out.kept = mask & in_bounds;
  out.changed = mask & (~in_bounds | (weight != unclamped));
  if (!o.behave_imp_weight) weight = at::ones_like(weight);
  out.weight = at::where(out.kept, weight, 0);
  return out;
}

// A token sum S of the rollout, normalised as Normalization says.
// The batch normaliser a rollout with `loss_tokens` loss tokens divides its token sum by must be
// positive (nothing to check without loss tokens).
void CheckNormaliser(int64_t loss_tokens, const Rollout& r, const LossOptions& o,
                     const BatchLossContext& batch) {
  if (loss_tokens == 0) return;
  if (o.normalization == Normalization::kTokenMean) {
    TORCH_CHECK(batch.total_loss_tokens > 0, "rollout '", r.id,
                "': BatchLossContext.total_loss_tokens = ", batch.total_loss_tokens,
                " but the rollout has ", loss_tokens, " loss tokens");
  }
  if (o.normalization == Normalization::kSequenceMean) {
    TORCH_CHECK(batch.num_rollouts > 0, "rollout '", r.id,
                "': BatchLossContext.num_rollouts = ", batch.num_rollouts);
  }
}

at::Tensor NormalizeTokenSum(const at::Tensor& sum, int64_t loss_tokens, const Rollout& r,
                             const LossOptions& o, const BatchLossContext& batch) {
  if (loss_tokens == 0) return sum;  // exactly 0, still connected to the inputs
  CheckNormaliser(loss_tokens, r, o, batch);
  switch (o.normalization) {
    case Normalization::kTokenMean:
      return sum / batch.total_loss_tokens;
    case Normalization::kSequenceMean:
      return sum / (static_cast<double>(loss_tokens) * static_cast<double>(batch.num_rollouts));
    case Normalization::kSum:
      return sum;
  }
  TORCH_CHECK(false, "rollout '", r.id, "': unknown Normalization");
  return sum;
}

// GSPO's per-sequence loss, normalised by R for the mean normalisations.
at::Tensor NormalizeSequenceLoss(const at::Tensor& seq, int64_t loss_tokens, const Rollout& r,
                                 const LossOptions& o, const BatchLossContext& batch) {
  if (loss_tokens == 0 || o.normalization == Normalization::kSum) return seq;
  TORCH_CHECK(batch.num_rollouts > 0, "rollout '", r.id,
              "': BatchLossContext.num_rollouts = ", batch.num_rollouts);
  return seq / static_cast<double>(batch.num_rollouts);
}

// The custom loss's value, checked, and connected to logprobs even when it does not depend on them
// (autograd needs every rollout's loss to reach its inputs).
at::Tensor CustomRolloutLoss(const RolloutLossInputs& in, const LossOptions& o,
                             const BatchLossContext& batch) {
  TORCH_CHECK(in.rollout != nullptr, "RolloutLossInputs.rollout is null");
  const Rollout& r = *in.rollout;
  TORCH_CHECK(in.logprobs.defined(), "rollout '", r.id,
              "': field 'logprobs' (current policy) is undefined");
  CheckTensor(r, "logprobs", in.logprobs);
  at::Tensor loss = o.custom(in, batch);
  if (!loss.defined() || loss.numel() != 1 || loss.dim() > 1 || !loss.is_floating_point()) {
    // (Streaming a number into a c10 message once crashed the Python extension built on the GPU
    // machines: their toolchain linked libstdc++ statically into it; see
    // bindings/python/CMakeLists.txt. Formatting here does not depend on it either way.)
    TORCH_CHECK(false, "rollout '", r.id,
                "': the custom loss must return one floating-point value (a 0-d tensor), got ",
                loss.defined() ? absl::StrCat(loss.toString(), " of shape [",
                                              absl::StrJoin(loss.sizes(), ", "), "]")
                               : std::string("an undefined tensor"));
  }
  TORCH_CHECK(loss.device() == in.logprobs.device(), "rollout '", r.id, "': the custom loss is on ",
              loss.device(), ", logprobs on ", in.logprobs.device());
  loss = loss.reshape({});
  // An empty slice's sum: exactly 0 whatever logprobs hold, with a zero gradient.
  if (in.logprobs.requires_grad() && !loss.requires_grad())
    loss = loss + in.logprobs.narrow(0, 0, 0).sum();
  return loss;
}

}  // namespace

absl::StatusOr<RejectionSampling> ParseRejectionSampling(std::string_view spec) {
  using RS = RejectionSampling;
  RS out;
  // The enum-valued keys: their names and values.
  const auto choose =
      [](std::string_view key, std::string_view value, auto& field,
         std::initializer_list<std::pair<std::string_view, std::decay_t<decltype(field)>>> choices)
      -> absl::Status {
    std::vector<std::string> names;
    for (const auto& [name, v] : choices) {
      if (name == value) {
        field = v;
        return absl::OkStatus();
      }
      names.emplace_back(name);
    }
    return absl::InvalidArgumentError(absl::StrCat(std::string(key), " must be ",
                                                   absl::StrJoin(names, ", "), ", got '",
                                                   std::string(value), "'"));
  };
  for (absl::string_view piece :
       absl::StrSplit(absl::string_view(spec.data(), spec.size()), ',', absl::SkipWhitespace())) {
    const std::string_view pair(piece.data(), piece.size());
    const size_t eq = pair.find('=');
    if (eq == std::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("expected key=value, got '", std::string(pair), "'"));
    }
    const std::string_view key = pair.substr(0, eq);
    const std::string_view value = pair.substr(eq + 1);
    absl::Status status;
    if (key == "level") {
      status = choose(key, value, out.level,
                      {{"token", RS::Level::kToken}, {"sequence", RS::Level::kSequence}});
    } else if (key == "action") {
      status = choose(key, value, out.action,
                      {{"mask", RS::Action::kMask}, {"clamp", RS::Action::kClamp}});
    } else if (key == "metric") {
      status = choose(key, value, out.metric,
                      {{"ratio", RS::Metric::kRatio},
                       {"kl_k1", RS::Metric::kKlK1},
                       {"kl_k2", RS::Metric::kKlK2},
                       {"kl_k3", RS::Metric::kKlK3}});
    } else if (key == "aggregation") {
      status = choose(key, value, out.aggregation,
                      {{"sum", RS::Aggregation::kSum},
                       {"mean", RS::Aggregation::kMean},
                       {"max", RS::Aggregation::kMax}});
    } else if (key == "upper" || key == "lower") {
      double number = 0;
      if (!absl::SimpleAtod(absl::string_view(value.data(), value.size()), &number)) {
        return absl::InvalidArgumentError(
            absl::StrCat(std::string(key), " must be a number, got '", std::string(value), "'"));
      }
      if (key == "upper") {
        out.upper = number;
      } else {
        out.lower = number;
      }
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown key '", std::string(key),
                       "' (the keys: level, action, metric, aggregation, upper, lower)"));
    }
    if (!status.ok()) return status;
  }
  return out;
}

bool UsesAdvantages(const LossOptions& loss, absl::Span<const Rollout> rollouts) {
  if (!loss.custom) return loss.kind != LossKind::kSft;
  return std::all_of(rollouts.begin(), rollouts.end(), [](const Rollout& r) {
    return r.reward.has_value() || !r.advantages.empty();
  });
}

std::vector<std::vector<float>> ComputeAdvantages(absl::Span<const Rollout> rollouts,
                                                  const AdvantageOptions& options) {
  absl::StatusOr<std::vector<std::vector<float>>> advantages = GroupAdvantages(rollouts, options);
  TORCH_CHECK(advantages.ok(), std::string(advantages.status().message()));
  return *std::move(advantages);
}

namespace {

// What the diagnostics of one rollout are computed from: the loss's own tensors, so that nothing is
// uploaded or derived twice.
struct Diagnosis {
  at::Tensor lp;  // detached
  const LossTokens* tokens = nullptr;
  at::Tensor entropy;  // or undefined
  // Token ratios (PPO, decoupled PPO): pi / pi_base over the `valid` tokens, advantages `adv`.
  at::Tensor base, adv, valid;
  const BehaviourWeights* behave = nullptr;  // decoupled PPO
  // GSPO: the sum of the log-ratios (undefined without loss tokens) and the advantage.
  at::Tensor sequence_log_ratio;
  double sequence_advantage = 0;
};

void Diagnose(const Diagnosis& d, const LossOptions& o, DiagnosticsAccumulator& diagnostics) {
  at::NoGradGuard no_grad;
  const at::TensorOptions opts = d.lp.options();
  const int64_t loss_tokens = d.tokens->count;
  const auto masked_sum = [](const at::Tensor& where, const at::Tensor& x) {
    return at::where(where, x, 0).sum();
  };
  const at::Tensor zero = at::zeros({}, opts);
  const auto count = [&](double n) { return at::full({}, n, opts); };
  std::array<at::Tensor, LossDiagnostics::kSums> sums;
  sums.fill(zero);
  sums[0] = count(static_cast<double>(loss_tokens));
  if (d.entropy.defined()) {
    sums[5] = masked_sum(d.tokens->mask, d.entropy.detach().to(d.lp.scalar_type()));
    sums[6] = count(static_cast<double>(loss_tokens));
  }
  at::Tensor ratio_max, ratio_min;
  if (d.base.defined() && loss_tokens > 0) {
    if (d.behave != nullptr) {
      sums[7] = d.behave->changed.sum().to(opts.dtype());
      sums[8] = d.behave->weight.sum();
      sums[9] = masked_sum(d.valid, d.behave->log_ratio);
      sums[10] = d.valid.sum().to(opts.dtype());
    }
    const at::Tensor log_ratio = at::where(d.valid, d.lp - d.base, 0);
    const at::Tensor ratio = at::exp(log_ratio);
    const at::Tensor unclipped = -d.adv * ratio;
    const at::Tensor clipped =
        -d.adv * at::clamp(ratio, 1.0 - o.eps_clip_low, 1.0 + o.eps_clip_high);
    sums[1] = (d.valid & (unclipped < clipped)).sum().to(opts.dtype());
    if (o.dual_clip > 1) {
      const at::Tensor surrogate = at::maximum(unclipped, clipped);
      sums[2] = (d.valid & (d.adv < 0) & (-o.dual_clip * d.adv < surrogate)).sum().to(opts.dtype());
    }
    sums[3] = log_ratio.sum();
    sums[4] = masked_sum(d.valid, ratio);
    const double inf = std::numeric_limits<double>::infinity();
    ratio_max = at::where(d.valid, ratio, -inf).max();
    ratio_min = at::where(d.valid, ratio, inf).min();
  } else if (d.sequence_log_ratio.defined()) {
    const at::Tensor log_ratio = d.sequence_log_ratio.detach();
    const at::Tensor ratio = at::exp(log_ratio / static_cast<double>(loss_tokens));
    const double adv = d.sequence_advantage;
    const at::Tensor clipped = at::clamp(ratio, 1.0 - o.gspo_eps_low, 1.0 + o.gspo_eps_high);
    const at::Tensor token_count = count(static_cast<double>(loss_tokens));
    sums[1] = at::where(-adv * ratio < -adv * clipped, token_count, zero);
    sums[3] = log_ratio;
    sums[4] = ratio * token_count;
    ratio_max = ratio_min = ratio;
  }
  diagnostics.Add(at::stack(std::vector<at::Tensor>(sums.begin(), sums.end())), ratio_max,
                  ratio_min);
}

// The constants a loss reads per token, aligned with its log-probabilities (one rollout's or
// several rollouts' concatenated); undefined where the options do not need them.
struct TokenConstants {
  at::Tensor old;   // behaviour log-probabilities: every kind but kSft
  at::Tensor adv;   // advantages: kPpo, kDecoupledPpo
  at::Tensor prox;  // proximal log-probabilities: kDecoupledPpo
  at::Tensor ref;   // reference log-probabilities: kl_coef != 0
};

// The policy's per-token terms l_t of kSft, kPpo and kDecoupledPpo, unmasked and unnormalised;
// fills the diagnosis' ratio fields and, for decoupled PPO, `behave` (which the diagnosis points
// to). Masked positions are replaced by 0 before any nonlinearity, so that extreme values there
// (the dummy position 0, say) never produce inf or NaN in the loss or its gradient.
at::Tensor PolicyTokenTerms(const at::Tensor& lp, const LossTokens& tokens, const TokenConstants& c,
                            const LossOptions& o, Diagnosis& diagnosis, BehaviourWeights& behave) {
  const at::Tensor& mask = tokens.mask;
  auto masked = [&mask](const at::Tensor& x) { return at::where(mask, x, 0); };
  switch (o.kind) {
    case LossKind::kSft:
      return -masked(lp);
    case LossKind::kPpo:
      diagnosis.base = c.old;
      diagnosis.adv = c.adv;
      diagnosis.valid = mask;
      return ClippedSurrogate(at::exp(masked(lp - c.old)), c.adv, o);
    case LossKind::kDecoupledPpo:
      behave = BehaviourWeightsOf(c.prox, c.old, mask, tokens.count, o);
      diagnosis.base = c.prox;
      diagnosis.adv = c.adv;
      diagnosis.valid = behave.kept;  // the tokens that train
      diagnosis.behave = &behave;
      // Rejected tokens contribute exactly 0 (their weight is 0, and the surrogate of a token whose
      // ratio overflows must not turn that into NaN).
      return at::where(behave.kept,
                       ClippedSurrogate(at::exp(masked(lp - c.prox)), c.adv, o) * behave.weight, 0);
    case LossKind::kGspo:
      break;
  }
  TORCH_CHECK(false, "PolicyTokenTerms: ", KindName(o.kind), " is not a sum of token terms");
  return {};
}

// GSPO's clipped sequence loss L_s of one rollout (exactly 0, connected to `lp`, without loss
// tokens); fills the diagnosis' sequence fields.
at::Tensor GspoSequenceLoss(const at::Tensor& lp, const LossTokens& tokens, const at::Tensor& old,
                            const std::vector<float>& advantages, const LossOptions& o,
                            Diagnosis& diagnosis) {
  if (tokens.count == 0) return at::where(tokens.mask, lp, 0).sum();
  const double adv = advantages[tokens.first];
  const at::Tensor log_ratio = at::where(tokens.mask, lp - old, 0).sum();
  const at::Tensor s = at::exp(log_ratio / static_cast<double>(tokens.count));
  const at::Tensor clipped = at::clamp(s, 1.0 - o.gspo_eps_low, 1.0 + o.gspo_eps_high);
  diagnosis.sequence_log_ratio = log_ratio;
  diagnosis.sequence_advantage = adv;
  return at::maximum(-adv * s, -adv * clipped);
}

// `per_token` (undefined for GSPO) plus the regulariser g_t = -entropy_coef H_t + kl_coef k3_t
// where a coefficient is nonzero; masked positions hold 0 in g.
at::Tensor WithRegulariser(const at::Tensor& per_token, const at::Tensor& lp,
                           const at::Tensor& entropy, const at::Tensor& mask, const at::Tensor& ref,
                           const LossOptions& o) {
  auto masked = [&mask](const at::Tensor& x) { return at::where(mask, x, 0); };
  at::Tensor regulariser;
  if (o.entropy_coef != 0) regulariser = -o.entropy_coef * masked(entropy.to(lp.scalar_type()));
  if (o.kl_coef != 0) {
    const at::Tensor d = masked(ref - lp);  // ref - logp
    const at::Tensor k3 = o.kl_coef * (at::exp(d) - d - 1);
    regulariser = regulariser.defined() ? regulariser + k3 : k3;
  }
  if (!regulariser.defined()) return per_token;
  return per_token.defined() ? per_token + regulariser : regulariser;
}

}  // namespace

at::Tensor RolloutLoss(const RolloutLossInputs& in, const LossOptions& o,
                       const BatchLossContext& batch, DiagnosticsAccumulator* diagnostics) {
  if (o.custom) {
    at::Tensor loss = CustomRolloutLoss(in, o, batch);
    if (diagnostics != nullptr) {  // a custom loss says nothing of ratios: tokens and entropy
      const LossTokens tokens = LossTokensOf(*in.rollout, in.logprobs.options());
      Diagnose({.lp = in.logprobs.detach(), .tokens = &tokens, .entropy = in.entropy}, o,
               *diagnostics);
    }
    return loss;
  }
  CheckInputs(in, o);
  const Rollout& r = *in.rollout;
  const at::Tensor& lp = in.logprobs;
  const at::TensorOptions opts = at::TensorOptions().dtype(lp.scalar_type()).device(lp.device());

  const LossTokens tokens = LossTokensOf(r, opts);
  Diagnosis diagnosis{.lp = lp.detach(), .tokens = &tokens, .entropy = in.entropy};
  BehaviourWeights behave;  // decoupled PPO
  TokenConstants constants;
  if (o.kind != LossKind::kSft) constants.old = ToTensor(r.logprobs, opts);
  if (o.kind == LossKind::kPpo || o.kind == LossKind::kDecoupledPpo)
    constants.adv = ToTensor(*in.advantages, opts);
  if (o.kind == LossKind::kDecoupledPpo) constants.prox = in.proximal_logprobs.detach().to(opts);
  if (o.kl_coef != 0) constants.ref = ToTensor(r.ref_logprobs, opts);

  // Per-token terms l_t + g_t, still to be masked and summed (all but GSPO), or GSPO's sequence
  // loss.
  at::Tensor per_token, sequence_loss;
  if (o.kind == LossKind::kGspo) {
    sequence_loss = GspoSequenceLoss(lp, tokens, constants.old, *in.advantages, o, diagnosis);
  } else {
    per_token = PolicyTokenTerms(lp, tokens, constants, o, diagnosis, behave);
  }
  if (diagnostics != nullptr) Diagnose(diagnosis, o, *diagnostics);
  per_token = WithRegulariser(per_token, lp, in.entropy, tokens.mask, constants.ref, o);

  at::Tensor loss;
  if (per_token.defined()) {
    loss = NormalizeTokenSum(at::where(tokens.mask, per_token, 0).sum(), tokens.count, r, o, batch);
  }
  if (sequence_loss.defined()) {
    at::Tensor seq = NormalizeSequenceLoss(sequence_loss, tokens.count, r, o, batch);
    loss = loss.defined() ? loss + seq : seq;
  }
  return loss;
}

bool SumsTokenTerms(const LossOptions& o) {
  return !o.custom && o.kind != LossKind::kGspo &&
         !(o.rejection_sampling &&
           o.rejection_sampling->level == RejectionSampling::Level::kSequence);
}

namespace {

// Detached copies of `logprobs` and `entropy` (when defined) that require grad, the loss computed
// from them by `loss_of`, and its gradients: what RolloutLossAndGrad and RolloutsLossAndGrad
// return.
RolloutLossGrad LossAndGradOf(
    const at::Tensor& logprobs, const at::Tensor& entropy,
    const std::function<at::Tensor(const at::Tensor& lp, const at::Tensor& entropy)>& loss_of) {
  at::AutoGradMode enable_grad(true);
  std::vector<at::Tensor> inputs = {logprobs.detach().requires_grad_(true)};
  if (entropy.defined()) inputs.push_back(entropy.detach().requires_grad_(true));
  const at::Tensor loss = loss_of(inputs[0], entropy.defined() ? inputs[1] : at::Tensor());
  std::vector<at::Tensor> grads =
      torch::autograd::grad({loss}, inputs, /*grad_outputs=*/{}, /*retain_graph=*/false,
                            /*create_graph=*/false, /*allow_unused=*/true);
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) grads[i] = at::zeros_like(inputs[i]);
  }
  RolloutLossGrad out;
  out.loss = loss.detach();
  out.dlogprobs = grads[0].detach();
  if (entropy.defined()) out.dentropy = grads[1].detach();
  return out;
}

}  // namespace

RolloutLossGrad RolloutsLossAndGrad(const RolloutsLossInputs& in, const LossOptions& o,
                                    const BatchLossContext& batch,
                                    DiagnosticsAccumulator* diagnostics) {
  TORCH_CHECK(SumsTokenTerms(o),
              "RolloutsLossAndGrad: the loss is not a sum of per-token terms (a custom loss, "
              "kGspo or sequence-level rejection sampling): compute it rollout by rollout");
  const size_t n = in.rollouts.size();
  TORCH_CHECK(in.advantages.size() == n && in.proximal_logprobs.size() == n,
              "RolloutsLossAndGrad: ", n, " rollouts but ", in.advantages.size(),
              " advantage vectors and ", in.proximal_logprobs.size(),
              " proximal log-probabilities");
  TORCH_CHECK(in.logprobs.defined() && in.logprobs.dim() == 1,
              "RolloutsLossAndGrad: logprobs must be the rollouts' log-probabilities concatenated");
  // Each rollout's inputs checked as RolloutLossAndGrad checks them; its tokens' constants and
  // loss-token weights laid out as the concatenation.
  const at::TensorOptions opts = in.logprobs.options();
  std::vector<uint8_t> mask;
  std::vector<float> old, adv, ref;
  std::vector<double> weight;  // kSequenceMean: 1 / (M_r R) at rollout r's tokens
  std::vector<at::Tensor> prox;
  int64_t offset = 0, loss_tokens = 0;
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(in.rollouts[i] != nullptr, "RolloutsLossInputs.rollouts[", i, "] is null");
    const Rollout& r = *in.rollouts[i];
    const int64_t length = static_cast<int64_t>(r.tokens.size());
    TORCH_CHECK(offset + length <= in.logprobs.size(0), "rollout '", r.id,
                "': field 'logprobs': ", in.logprobs.size(0) - offset, " values left for ", length,
                " tokens");
    RolloutLossInputs one{
        .rollout = &r,
        .logprobs = in.logprobs.narrow(0, offset, length),
        .entropy = in.entropy.defined() ? in.entropy.narrow(0, offset, length) : at::Tensor(),
        .proximal_logprobs = in.proximal_logprobs[i],
        .advantages = in.advantages[i]};
    CheckInputs(one, o);
    offset += length;
    const int64_t count =
        std::count_if(r.loss_mask.begin(), r.loss_mask.end(), [](uint8_t m) { return m != 0; });
    loss_tokens += count;
    mask.insert(mask.end(), r.loss_mask.begin(), r.loss_mask.end());
    if (o.kind != LossKind::kSft) {
      old.insert(old.end(), r.logprobs.begin(), r.logprobs.end());
      adv.insert(adv.end(), one.advantages->begin(), one.advantages->end());
    }
    if (o.kind == LossKind::kDecoupledPpo) prox.push_back(one.proximal_logprobs.detach().to(opts));
    if (o.kl_coef != 0) ref.insert(ref.end(), r.ref_logprobs.begin(), r.ref_logprobs.end());
    CheckNormaliser(count, r, o, batch);
    if (o.normalization == Normalization::kSequenceMean) {
      const double w =
          count == 0 ? 0.0
                     : 1.0 / (static_cast<double>(count) * static_cast<double>(batch.num_rollouts));
      weight.insert(weight.end(), length, w);
    }
  }
  TORCH_CHECK(offset == in.logprobs.size(0), "RolloutsLossAndGrad: logprobs holds ",
              in.logprobs.size(0), " values for the rollouts' ", offset, " tokens");

  LossTokens tokens;
  tokens.count = loss_tokens;
  tokens.mask =
      CopyToDevice(at::from_blob(mask.data(), {offset}, at::kByte), opts.dtype(at::kBool));
  TokenConstants constants;
  if (o.kind != LossKind::kSft) {
    constants.old = ToTensor(old, opts);
    constants.adv = ToTensor(adv, opts);
  }
  if (o.kind == LossKind::kDecoupledPpo) constants.prox = at::cat(prox);
  if (o.kl_coef != 0) constants.ref = ToTensor(ref, opts);
  const at::Tensor weights =
      weight.empty() ? at::Tensor()
                     : CopyToDevice(at::from_blob(weight.data(), {offset}, at::kDouble), opts);

  return LossAndGradOf(
      in.logprobs, in.entropy, [&](const at::Tensor& lp, const at::Tensor& entropy) {
        Diagnosis diagnosis{.lp = lp.detach(), .tokens = &tokens, .entropy = entropy};
        BehaviourWeights behave;
        at::Tensor per_token = PolicyTokenTerms(lp, tokens, constants, o, diagnosis, behave);
        if (diagnostics != nullptr) Diagnose(diagnosis, o, *diagnostics);
        per_token = at::where(
            tokens.mask, WithRegulariser(per_token, lp, entropy, tokens.mask, constants.ref, o), 0);
        if (loss_tokens == 0) return per_token.sum();  // exactly 0, still connected to the inputs
        switch (o.normalization) {
          case Normalization::kTokenMean:
            return per_token.sum() / batch.total_loss_tokens;
          case Normalization::kSequenceMean:
            return (per_token * weights).sum();
          case Normalization::kSum:
            break;
        }
        return per_token.sum();
      });
}

RolloutLossGrad RolloutLossAndGrad(const RolloutLossInputs& in, const LossOptions& o,
                                   const BatchLossContext& batch,
                                   DiagnosticsAccumulator* diagnostics) {
  if (!o.custom) CheckInputs(in, o);
  return LossAndGradOf(in.logprobs, in.entropy,
                       [&](const at::Tensor& lp, const at::Tensor& entropy) {
                         RolloutLossInputs local = in;
                         local.logprobs = lp;
                         if (entropy.defined()) local.entropy = entropy;
                         return RolloutLoss(local, o, batch, diagnostics);
                       });
}

}  // namespace dta

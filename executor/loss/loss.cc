#include "executor/loss/loss.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

// A token sum S of the rollout, normalised as Normalization says.
at::Tensor NormalizeTokenSum(const at::Tensor& sum, int64_t loss_tokens, const Rollout& r,
                             const LossOptions& o, const BatchLossContext& batch) {
  if (loss_tokens == 0) return sum;  // exactly 0, still connected to the inputs
  switch (o.normalization) {
    case Normalization::kTokenMean:
      TORCH_CHECK(batch.total_loss_tokens > 0, "rollout '", r.id,
                  "': BatchLossContext.total_loss_tokens = ", batch.total_loss_tokens,
                  " but the rollout has ", loss_tokens, " loss tokens");
      return sum / batch.total_loss_tokens;
    case Normalization::kSequenceMean:
      TORCH_CHECK(batch.num_rollouts > 0, "rollout '", r.id,
                  "': BatchLossContext.num_rollouts = ", batch.num_rollouts);
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

bool UsesAdvantages(const LossOptions& loss, absl::Span<const Rollout> rollouts) {
  if (!loss.custom) return loss.kind != LossKind::kSft;
  return std::all_of(rollouts.begin(), rollouts.end(), [](const Rollout& r) {
    return r.reward.has_value() || !r.advantages.empty();
  });
}

std::vector<std::vector<float>> ComputeAdvantages(absl::Span<const Rollout> rollouts,
                                                  bool normalize_std) {
  absl::StatusOr<std::vector<std::vector<float>>> advantages =
      GroupAdvantages(rollouts, normalize_std);
  TORCH_CHECK(advantages.ok(), std::string(advantages.status().message()));
  return *std::move(advantages);
}

at::Tensor RolloutLoss(const RolloutLossInputs& in, const LossOptions& o,
                       const BatchLossContext& batch) {
  if (o.custom) return CustomRolloutLoss(in, o, batch);
  CheckInputs(in, o);
  const Rollout& r = *in.rollout;
  const at::Tensor& lp = in.logprobs;
  const at::TensorOptions opts = at::TensorOptions().dtype(lp.scalar_type()).device(lp.device());

  int64_t loss_tokens = 0;
  int64_t first_loss_token = -1;
  for (size_t t = 0; t < r.loss_mask.size(); ++t) {
    if (r.loss_mask[t] == 0) continue;
    if (first_loss_token < 0) first_loss_token = static_cast<int64_t>(t);
    ++loss_tokens;
  }
  const at::Tensor mask =
      CopyToDevice(at::from_blob(const_cast<uint8_t*>(r.loss_mask.data()),
                                 {static_cast<int64_t>(r.loss_mask.size())}, at::kByte),
                   opts.dtype(at::kBool));
  // Masked positions are replaced by 0 before any nonlinearity, so that extreme values there
  // (the dummy position 0, say) never produce inf or NaN in the loss or its gradient.
  auto masked = [&mask](const at::Tensor& x) { return at::where(mask, x, 0); };

  // Per-token terms l_t + g_t, still to be masked and summed.
  at::Tensor per_token;
  at::Tensor sequence_loss;  // GSPO only
  switch (o.kind) {
    case LossKind::kSft:
      per_token = -masked(lp);
      break;
    case LossKind::kPpo: {
      const at::Tensor old = ToTensor(r.logprobs, opts);
      const at::Tensor adv = ToTensor(*in.advantages, opts);
      per_token = ClippedSurrogate(at::exp(masked(lp - old)), adv, o);
      break;
    }
    case LossKind::kDecoupledPpo: {
      const at::Tensor old = ToTensor(r.logprobs, opts);
      const at::Tensor adv = ToTensor(*in.advantages, opts);
      const at::Tensor prox = in.proximal_logprobs.detach().to(opts);
      const at::Tensor behave_weight = at::exp(masked(prox - old));  // pi_prox / pi_behave
      per_token = ClippedSurrogate(at::exp(masked(lp - prox)), adv, o) * behave_weight;
      if (o.behave_imp_weight_cap > 0) {
        per_token = at::where(behave_weight <= o.behave_imp_weight_cap, per_token, 0);
      }
      break;
    }
    case LossKind::kGspo: {
      if (loss_tokens == 0) {
        sequence_loss = masked(lp).sum();  // exactly 0, connected to logprobs
        break;
      }
      const at::Tensor old = ToTensor(r.logprobs, opts);
      const double adv = (*in.advantages)[first_loss_token];
      const at::Tensor s = at::exp(masked(lp - old).sum() / static_cast<double>(loss_tokens));
      const at::Tensor clipped = at::clamp(s, 1.0 - o.gspo_eps_low, 1.0 + o.gspo_eps_high);
      sequence_loss = at::maximum(-adv * s, -adv * clipped);
      break;
    }
  }

  at::Tensor regulariser;
  if (o.entropy_coef != 0) {
    regulariser = -o.entropy_coef * masked(in.entropy.to(lp.scalar_type()));
  }
  if (o.kl_coef != 0) {
    const at::Tensor d = masked(ToTensor(r.ref_logprobs, opts) - lp);  // ref - logp
    const at::Tensor k3 = o.kl_coef * (at::exp(d) - d - 1);
    regulariser = regulariser.defined() ? regulariser + k3 : k3;
  }
  if (regulariser.defined()) {
    per_token = per_token.defined() ? per_token + regulariser : regulariser;
  }

  at::Tensor loss;
  if (per_token.defined()) {
    loss = NormalizeTokenSum(masked(per_token).sum(), loss_tokens, r, o, batch);
  }
  if (sequence_loss.defined()) {
    at::Tensor seq = NormalizeSequenceLoss(sequence_loss, loss_tokens, r, o, batch);
    loss = loss.defined() ? loss + seq : seq;
  }
  return loss;
}

RolloutLossGrad RolloutLossAndGrad(const RolloutLossInputs& in, const LossOptions& o,
                                   const BatchLossContext& batch) {
  if (!o.custom) CheckInputs(in, o);
  at::AutoGradMode enable_grad(true);
  RolloutLossInputs local = in;
  local.logprobs = in.logprobs.detach().requires_grad_(true);
  std::vector<at::Tensor> inputs = {local.logprobs};
  if (in.entropy.defined()) {
    local.entropy = in.entropy.detach().requires_grad_(true);
    inputs.push_back(local.entropy);
  }
  const at::Tensor loss = RolloutLoss(local, o, batch);
  std::vector<at::Tensor> grads =
      torch::autograd::grad({loss}, inputs, /*grad_outputs=*/{}, /*retain_graph=*/false,
                            /*create_graph=*/false, /*allow_unused=*/true);
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) grads[i] = at::zeros_like(inputs[i]);
  }
  RolloutLossGrad out;
  out.loss = loss.detach();
  out.dlogprobs = grads[0].detach();
  if (in.entropy.defined()) out.dentropy = grads[1].detach();
  return out;
}

}  // namespace dta

#include "executor/optim/adamw_update.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <system_error>

#include "kernels/adamw_step.h"

namespace dta {
namespace {

std::string FormatDouble(double x) {
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), x);  // shortest round-trip form
  TORCH_CHECK(ec == std::errc(), "cannot format ", x);
  return std::string(buf, end);
}

}  // namespace

AdamWStepScalars AdamWScalarsFor(const AdamWOptions& options, int64_t t) {
  AdamWStepScalars s;
  s.lr = options.lr;
  s.beta1 = options.beta1;
  s.beta2 = options.beta2;
  s.eps = options.eps;
  s.weight_decay = options.weight_decay;
  const double bias_correction1 = 1 - std::pow(options.beta1, static_cast<double>(t));
  const double bias_correction2 = 1 - std::pow(options.beta2, static_cast<double>(t));
  s.step_size = options.lr / bias_correction1;
  s.bias_correction2_sqrt = std::sqrt(bias_correction2);
  return s;
}

void AdamWUpdate(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                 const at::Tensor& grad, const AdamWStepScalars& s, double clip_coef) {
  if (kernels::FusedAdamWStepTakes(master, exp_avg, exp_avg_sq, grad)) {
    // Each double rounded to float32 where the ops below round it (kernels/adamw_step.h).
    kernels::FusedAdamWStep(
        master, exp_avg, exp_avg_sq, grad,
        {.grad_scale = static_cast<float>(clip_coef),
         .decay = s.weight_decay != 0 ? static_cast<float>(1 - s.lr * s.weight_decay) : 1.0f,
         .beta1 = static_cast<float>(s.beta1),
         .one_minus_beta1 = static_cast<float>(1 - s.beta1),
         .beta2 = static_cast<float>(s.beta2),
         .one_minus_beta2 = static_cast<float>(1 - s.beta2),
         .inv_bias_correction2_sqrt = static_cast<float>(1.0 / s.bias_correction2_sqrt),
         .eps = static_cast<float>(s.eps),
         .neg_step_size = static_cast<float>(-s.step_size)});
    return;
  }
  // torch.nn.utils.clip_grad_norm_'s multiplication (never in place: the caller's .grad stays),
  // then LibTorch's torch::optim::AdamW::step, operation for operation.
  const at::Tensor g = clip_coef != 1.0 ? grad.mul(clip_coef) : grad;
  if (s.weight_decay != 0) master.mul_(1 - s.lr * s.weight_decay);
  exp_avg.mul_(s.beta1).add_(g, 1 - s.beta1);
  exp_avg_sq.mul_(s.beta2).addcmul_(g, g, 1 - s.beta2);
  at::Tensor denom = (exp_avg_sq.sqrt() / s.bias_correction2_sqrt).add_(s.eps);
  master.addcdiv_(exp_avg, denom, -s.step_size);
}

double ClipCoefficient(double total_norm, double max_grad_norm) {
  if (max_grad_norm <= 0) return 1.0;
  // torch.nn.utils.clip_grad_norm_: clip_coef = max_norm / (total_norm + 1e-6), clamped to 1.
  return std::min(1.0, max_grad_norm / (total_norm + 1e-6));
}

void CheckAdamWOptions(const AdamWOptions& o, const std::string& context) {
  auto finite = [](double x) { return std::isfinite(x); };
  TORCH_CHECK(finite(o.lr) && o.lr >= 0, context, "invalid lr ", o.lr,
              " (must be finite and >= 0)");
  TORCH_CHECK(finite(o.beta1) && o.beta1 >= 0 && o.beta1 < 1, context, "invalid beta1 ", o.beta1,
              " (must be in [0, 1))");
  TORCH_CHECK(finite(o.beta2) && o.beta2 >= 0 && o.beta2 < 1, context, "invalid beta2 ", o.beta2,
              " (must be in [0, 1))");
  TORCH_CHECK(finite(o.eps) && o.eps >= 0, context, "invalid eps ", o.eps,
              " (must be finite and >= 0)");
  TORCH_CHECK(finite(o.weight_decay) && o.weight_decay >= 0, context, "invalid weight_decay ",
              o.weight_decay, " (must be finite and >= 0)");
  TORCH_CHECK(finite(o.max_grad_norm), context, "invalid max_grad_norm ", o.max_grad_norm,
              " (must be finite; <= 0 disables clipping)");
}

std::map<std::string, std::string> AdamWMetadata(const AdamWOptions& options, int64_t step) {
  return {
      {"step", std::to_string(step)},
      {"lr", FormatDouble(options.lr)},
      {"beta1", FormatDouble(options.beta1)},
      {"beta2", FormatDouble(options.beta2)},
      {"eps", FormatDouble(options.eps)},
      {"weight_decay", FormatDouble(options.weight_decay)},
      {"max_grad_norm", FormatDouble(options.max_grad_norm)},
  };
}

const std::string& MetadataEntry(const std::map<std::string, std::string>& metadata,
                                 const std::string& key, const std::string& context) {
  auto it = metadata.find(key);
  TORCH_CHECK(it != metadata.end(), context, "metadata has no '", key, "' entry");
  return it->second;
}

int64_t MetadataCount(const std::map<std::string, std::string>& metadata, const std::string& key,
                      const std::string& context) {
  const std::string& text = MetadataEntry(metadata, key, context);
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  TORCH_CHECK(ec == std::errc() && end == text.data() + text.size() && value >= 0, context,
              "metadata '", key, "' is '", text, "', not a non-negative integer");
  return value;
}

AdamWOptions AdamWOptionsFromMetadata(const std::map<std::string, std::string>& metadata,
                                      const std::string& context, int64_t* step) {
  *step = MetadataCount(metadata, "step", context);
  auto number = [&](const char* key) {
    const std::string& text = MetadataEntry(metadata, key, context);
    double value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    TORCH_CHECK(ec == std::errc() && end == text.data() + text.size(), context, "metadata '", key,
                "' is '", text, "', not a number");
    return value;
  };
  AdamWOptions options;
  options.lr = number("lr");
  options.beta1 = number("beta1");
  options.beta2 = number("beta2");
  options.eps = number("eps");
  options.weight_decay = number("weight_decay");
  options.max_grad_norm = number("max_grad_norm");
  CheckAdamWOptions(options, context);
  return options;
}

}  // namespace dta

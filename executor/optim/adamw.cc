#include "executor/optim/adamw.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstring>
#include <system_error>
#include <unordered_set>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/checkpoint/safetensors.h"

namespace dta {
namespace {

constexpr char kFormat[] = "dta.adamw.v1";
constexpr const char* kSuffixes[] = {".exp_avg", ".exp_avg_sq", ".master"};

at::ScalarType StateDtypeFor(at::ScalarType param_dtype) {
  return param_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

DType ToSafetensorsDtype(at::ScalarType t) { return t == at::kDouble ? DType::kF64 : DType::kF32; }

absl::Span<const int64_t> Span(c10::IntArrayRef sizes) { return {sizes.data(), sizes.size()}; }

void CheckOptions(const AdamWOptions& o, const std::string& context) {
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

std::string FormatDouble(double x) {
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), x);  // shortest round-trip form
  TORCH_CHECK(ec == std::errc(), "cannot format ", x);
  return std::string(buf, end);
}

// The global norm and, per defined grad, its parameter's index and its own norm (float64).
struct GradNorms {
  double total = 0.0;
  std::vector<size_t> index;
};

GradNorms ComputeGradNorms(const std::vector<std::pair<std::string, at::Tensor>>& named) {
  at::NoGradGuard no_grad;
  GradNorms out;
  std::vector<at::Tensor> norms;
  for (size_t i = 0; i < named.size(); ++i) {
    const at::Tensor& grad = named[i].second.grad();
    if (!grad.defined()) continue;
    at::Tensor norm = at::linalg_vector_norm(grad.detach(), 2, std::nullopt, false, at::kDouble);
    if (!norms.empty() && norm.device() != norms.front().device())
      norm = norm.to(norms.front().device());
    norms.push_back(std::move(norm));
    out.index.push_back(i);
  }
  if (!norms.empty()) out.total = at::linalg_vector_norm(at::stack(norms), 2).item<double>();
  return out;
}

}  // namespace

double GlobalGradNorm(const std::vector<std::pair<std::string, at::Tensor>>& named_parameters) {
  return ComputeGradNorms(named_parameters).total;
}

AdamW::AdamW(std::vector<std::pair<std::string, at::Tensor>> named_parameters, AdamWOptions options)
    : named_(std::move(named_parameters)), options_(options) {
  CheckOptions(options_, "AdamW: ");
  at::NoGradGuard no_grad;
  std::unordered_set<const void*> impls;
  states_.reserve(named_.size());
  for (size_t i = 0; i < named_.size(); ++i) {
    const auto& [name, param] = named_[i];
    TORCH_CHECK(param.defined(), "AdamW: parameter '", name, "' is an undefined tensor");
    const at::ScalarType dtype = param.scalar_type();
    TORCH_CHECK(
        dtype == at::kDouble || dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
        "AdamW: parameter '", name, "' has dtype ", dtype,
        "; expected Double, Float, BFloat16 or Half");
    TORCH_CHECK(index_.emplace(name, i).second, "AdamW: parameter name '", name, "' appears twice");
    TORCH_CHECK(impls.insert(param.unsafeGetTensorImpl()).second, "AdamW: parameter '", name,
                "' is the same tensor as an earlier parameter");
    ParamState s;
    s.dtype = StateDtypeFor(dtype);
    const auto state_options = param.options().dtype(s.dtype).requires_grad(false);
    s.exp_avg = at::zeros_like(param, state_options, at::MemoryFormat::Preserve);
    s.exp_avg_sq = at::zeros_like(param, state_options, at::MemoryFormat::Preserve);
    states_.push_back(std::move(s));
  }
}

void AdamW::set_lr(double lr) {
  TORCH_CHECK(std::isfinite(lr) && lr >= 0, "AdamW: invalid lr ", lr, " (must be finite and >= 0)");
  options_.lr = lr;
}

size_t AdamW::IndexOf(std::string_view name) const {
  auto it = index_.find(name);
  TORCH_CHECK(it != index_.end(), "AdamW: no parameter named '", std::string(name), "'");
  return it->second;
}

at::Tensor& AdamW::MasterFor(size_t i) {
  at::Tensor& param = named_[i].second;
  ParamState& s = states_[i];
  if (param.scalar_type() == s.dtype) return param;
  if (!s.master.defined()) s.master = param.detach().to(s.dtype);
  return s.master;
}

at::Tensor AdamW::master(std::string_view name) const {
  const size_t i = IndexOf(name);
  const at::Tensor& param = named_[i].second;
  const ParamState& s = states_[i];
  if (param.scalar_type() == s.dtype) return param;
  if (s.master.defined()) return s.master;
  return param.detach().to(s.dtype);
}

at::Tensor AdamW::exp_avg(std::string_view name) const { return states_[IndexOf(name)].exp_avg; }
at::Tensor AdamW::exp_avg_sq(std::string_view name) const {
  return states_[IndexOf(name)].exp_avg_sq;
}

StepStats AdamW::Step() {
  at::NoGradGuard no_grad;
  const GradNorms norms = ComputeGradNorms(named_);
  if (!std::isfinite(norms.total)) {
    for (size_t i : norms.index) {
      const auto& [name, param] = named_[i];
      TORCH_CHECK(at::isfinite(param.grad()).all().item<bool>(),
                  "AdamW: the gradient of parameter '", name,
                  "' is not finite (NaN or infinity); nothing was updated");
    }
    TORCH_CHECK(false, "AdamW: the global gradient norm (", norms.total,
                ") overflows float64 although every gradient is finite; nothing was updated");
  }

  StepStats stats;
  stats.grad_norm = norms.total;
  stats.clip_coef = 1.0;
  if (options_.max_grad_norm > 0) {
    // torch.nn.utils.clip_grad_norm_: clip_coef = max_norm / (total_norm + 1e-6), clamped to 1.
    stats.clip_coef = std::min(1.0, options_.max_grad_norm / (norms.total + 1e-6));
  }

  // LibTorch's torch::optim::AdamW::step, operation for operation.
  const int64_t t = step_ + 1;
  const double lr = options_.lr;
  const double beta1 = options_.beta1;
  const double beta2 = options_.beta2;
  const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(t));
  const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(t));
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);

  for (size_t i : norms.index) {
    at::Tensor& param = named_[i].second;
    ParamState& s = states_[i];
    at::Tensor grad = param.grad().detach();
    if (grad.scalar_type() != s.dtype) grad = grad.to(s.dtype);
    if (stats.clip_coef != 1.0)
      grad = grad.mul(stats.clip_coef);  // never in place: .grad is left alone

    at::Tensor& w = MasterFor(i);
    if (options_.weight_decay != 0) w.mul_(1 - lr * options_.weight_decay);
    s.exp_avg.mul_(beta1).add_(grad, 1 - beta1);
    s.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
    at::Tensor denom = (s.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(options_.eps);
    w.addcdiv_(s.exp_avg, denom, -step_size);
    if (s.master.defined()) param.copy_(w);  // round the master copy to the parameter's dtype
  }
  step_ = t;
  stats.step = step_;
  return stats;
}

void AdamW::ZeroGrad(bool set_to_none) {
  at::NoGradGuard no_grad;
  for (auto& [name, param] : named_) {
    if (!param.grad().defined()) continue;
    if (set_to_none) {
      param.mutable_grad() = at::Tensor();
    } else {
      param.mutable_grad().zero_();
    }
  }
}

void AdamW::SaveState(const std::string& path) const {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> host;  // keeps the bytes alive until written
  std::vector<TensorToWrite> tensors;
  host.reserve(3 * named_.size());
  tensors.reserve(3 * named_.size());
  auto add = [&](std::string name, const at::Tensor& t) {
    at::Tensor c = t.detach().to(at::kCPU).contiguous();
    TensorToWrite w;
    w.name = std::move(name);
    w.dtype = ToSafetensorsDtype(c.scalar_type());
    w.shape.assign(c.sizes().begin(), c.sizes().end());
    w.data = absl::Span<const uint8_t>(static_cast<const uint8_t*>(c.const_data_ptr()), c.nbytes());
    host.push_back(std::move(c));
    tensors.push_back(std::move(w));
  };
  for (size_t i = 0; i < named_.size(); ++i) {
    const auto& [name, param] = named_[i];
    const ParamState& s = states_[i];
    add(name + kSuffixes[0], s.exp_avg);
    add(name + kSuffixes[1], s.exp_avg_sq);
    add(name + kSuffixes[2], param.scalar_type() == s.dtype ? param
                             : s.master.defined()           ? s.master
                                                            : param.detach().to(s.dtype));
  }
  const std::map<std::string, std::string> metadata = {
      {"format", kFormat},
      {"step", std::to_string(step_)},
      {"lr", FormatDouble(options_.lr)},
      {"beta1", FormatDouble(options_.beta1)},
      {"beta2", FormatDouble(options_.beta2)},
      {"eps", FormatDouble(options_.eps)},
      {"weight_decay", FormatDouble(options_.weight_decay)},
      {"max_grad_norm", FormatDouble(options_.max_grad_norm)},
  };
  const absl::Status status = WriteSafetensors(path, tensors, metadata);
  TORCH_CHECK(status.ok(), "AdamW::SaveState('", path, "'): ", status.ToString());
}

void AdamW::LoadState(const std::string& path) {
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  TORCH_CHECK(file.ok(), "AdamW::LoadState: ", file.status().ToString());
  const std::string where = "AdamW state file '" + path + "': ";

  // Metadata: format, step and options.
  const std::map<std::string, std::string>& meta = file->metadata();
  auto entry = [&](const char* key) -> const std::string& {
    auto it = meta.find(key);
    TORCH_CHECK(it != meta.end(), where, "metadata has no '", key, "' entry");
    return it->second;
  };
  TORCH_CHECK(entry("format") == kFormat, where, "metadata format is '", entry("format"),
              "', expected '", kFormat, "'");
  int64_t step = 0;
  {
    const std::string& text = entry("step");
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), step);
    TORCH_CHECK(ec == std::errc() && end == text.data() + text.size() && step >= 0, where,
                "metadata 'step' is '", text, "', not a non-negative integer");
  }
  auto number = [&](const char* key) {
    const std::string& text = entry(key);
    double value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    TORCH_CHECK(ec == std::errc() && end == text.data() + text.size(), where, "metadata '", key,
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
  CheckOptions(options, where);

  // Every tensor of every parameter, with the right dtype and shape.
  std::vector<std::array<const TensorView*, 3>> views(named_.size());
  for (size_t i = 0; i < named_.size(); ++i) {
    const auto& [name, param] = named_[i];
    const DType want = ToSafetensorsDtype(states_[i].dtype);
    for (int k = 0; k < 3; ++k) {
      const std::string tensor = name + kSuffixes[k];
      const TensorView* view = file->Find(tensor);
      TORCH_CHECK(view != nullptr, where, "missing tensor '", tensor, "' for parameter '", name,
                  "'");
      TORCH_CHECK(view->dtype == want, where, "tensor '", tensor, "' has dtype ",
                  std::string(DTypeName(view->dtype)), ", expected ", std::string(DTypeName(want)),
                  " for parameter '", name, "' (", param.scalar_type(), ")");
      TORCH_CHECK(c10::IntArrayRef(view->shape) == param.sizes(), where, "tensor '", tensor,
                  "' has shape ", ShapeToString(view->shape), " but parameter '", name,
                  "' has shape ", ShapeToString(Span(param.sizes())));
      views[i][k] = view;
    }
  }
  // ... and nothing else.
  for (const TensorView& view : file->tensors()) {
    bool known = false;
    for (const char* suffix : kSuffixes) {
      const std::string_view s(suffix);
      if (view.name.size() > s.size() &&
          view.name.compare(view.name.size() - s.size(), s.size(), s) == 0 &&
          index_.count(std::string_view(view.name).substr(0, view.name.size() - s.size())) > 0) {
        known = true;
      }
    }
    TORCH_CHECK(known, where, "tensor '", view.name, "' belongs to no parameter of this optimizer");
  }

  // Restore.
  at::NoGradGuard no_grad;
  auto to_tensor = [](const TensorView& view, at::ScalarType dtype) {
    at::Tensor t = at::empty(c10::IntArrayRef(view.shape), at::TensorOptions().dtype(dtype));
    if (view.nbytes() > 0) std::memcpy(t.data_ptr(), view.data.data(), view.nbytes());
    return t;
  };
  for (size_t i = 0; i < named_.size(); ++i) {
    at::Tensor& param = named_[i].second;
    ParamState& s = states_[i];
    s.exp_avg.copy_(to_tensor(*views[i][0], s.dtype));
    s.exp_avg_sq.copy_(to_tensor(*views[i][1], s.dtype));
    const at::Tensor master = to_tensor(*views[i][2], s.dtype);
    if (param.scalar_type() == s.dtype) {
      param.copy_(master);
    } else {
      if (!s.master.defined()) {
        s.master = at::empty_like(param, param.options().dtype(s.dtype).requires_grad(false),
                                  at::MemoryFormat::Preserve);
      }
      s.master.copy_(master);
      param.copy_(s.master);
    }
  }
  step_ = step;
  options_ = options;
}

}  // namespace dta

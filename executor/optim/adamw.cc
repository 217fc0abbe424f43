#include "executor/optim/adamw.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <unordered_set>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/checkpoint/safetensors.h"
#include "executor/device/safetensors_tensors.h"

namespace dta {
namespace {

constexpr char kFormat[] = "dta.adamw.v1";
constexpr const char* kSuffixes[] = {".exp_avg", ".exp_avg_sq", ".master"};

at::ScalarType StateDtypeFor(at::ScalarType param_dtype) {
  return param_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

DType ToSafetensorsDtype(at::ScalarType t) { return t == at::kDouble ? DType::kF64 : DType::kF32; }

absl::Span<const int64_t> Span(c10::IntArrayRef sizes) { return {sizes.data(), sizes.size()}; }

// The float64 norms of the defined grads this rank counts (TensorParallelNorm::Counts), on the
// first one's device.
std::vector<at::Tensor> CountedNorms(const std::vector<std::pair<std::string, at::Tensor>>& named,
                                     const TensorParallelNorm& tensor_parallel) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> norms;
  for (size_t i = 0; i < named.size(); ++i) {
    const at::Tensor& grad = named[i].second.grad();
    if (!grad.defined()) continue;
    if (!tensor_parallel.Counts(i)) continue;  // another rank counts this replicated parameter
    at::Tensor norm = at::linalg_vector_norm(grad.detach(), 2, std::nullopt, false, at::kDouble);
    if (!norms.empty() && norm.device() != norms.front().device())
      norm = norm.to(norms.front().device());
    norms.push_back(std::move(norm));
  }
  return norms;
}

double SumOfSquares(const std::vector<at::Tensor>& norms) {
  return norms.empty() ? 0.0 : at::stack(norms).square().sum().item<double>();
}

// The global norm of the defined grads (float64): the norm of the per-tensor norms, or under
// tensor parallelism the square root of the squares summed over the ranks.
double ComputeGradNorm(const std::vector<std::pair<std::string, at::Tensor>>& named,
                       const TensorParallelNorm& tensor_parallel = {}) {
  const std::vector<at::Tensor> norms = CountedNorms(named, tensor_parallel);
  if (tensor_parallel.group == nullptr) {
    return norms.empty() ? 0.0 : at::linalg_vector_norm(at::stack(norms), 2).item<double>();
  }
  // Every rank takes part in the sum, whether or not it holds a gradient.
  const at::Device device = named.empty() ? at::Device(at::kCPU) : named.front().second.device();
  return std::sqrt(tensor_parallel.Sum(SumOfSquares(norms), device));
}

}  // namespace

double GlobalGradNorm(const std::vector<std::pair<std::string, at::Tensor>>& named_parameters) {
  return ComputeGradNorm(named_parameters);
}

AdamW::AdamW(std::vector<std::pair<std::string, at::Tensor>> named_parameters, AdamWOptions options,
             TensorParallelNorm tensor_parallel)
    : named_(std::move(named_parameters)),
      options_(options),
      tensor_parallel_(std::move(tensor_parallel)) {
  TORCH_CHECK(
      tensor_parallel_.group == nullptr || tensor_parallel_.replicated.size() == named_.size(),
      "AdamW: tensor_parallel.replicated must have one entry per parameter");
  CheckAdamWOptions(options_, "AdamW: ");
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

void AdamW::ResetMasterFromParameters() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < named_.size(); ++i) {
    if (states_[i].master.defined()) states_[i].master.copy_(named_[i].second.detach());
  }
}

StepStats AdamW::Step(NonFiniteGradients on_nonfinite) {
  return StepWithNorm(ComputeGradNorm(named_, tensor_parallel_), on_nonfinite);
}

double AdamW::GradSquares() const { return SumOfSquares(CountedNorms(named_, tensor_parallel_)); }

StepStats AdamW::StepWithNorm(double grad_norm, NonFiniteGradients on_nonfinite) {
  at::NoGradGuard no_grad;
  if (!std::isfinite(grad_norm) && on_nonfinite == NonFiniteGradients::kSkip) {
    return {.grad_norm = grad_norm, .step = step_, .lr = options_.lr, .skipped = true};
  }
  if (!std::isfinite(grad_norm)) {
    for (const auto& [name, param] : named_) {
      if (!param.grad().defined()) continue;
      TORCH_CHECK(at::isfinite(param.grad()).all().item<bool>(),
                  "AdamW: the gradient of parameter '", name,
                  "' is not finite (NaN or infinity); nothing was updated");
    }
    TORCH_CHECK(false, "AdamW: the global gradient norm (", grad_norm,
                ") is not finite although every gradient here is (another rank's is, which names "
                "the parameter, or the norm overflows float64); nothing was updated");
  }

  StepStats stats;
  stats.grad_norm = grad_norm;
  stats.clip_coef = ClipCoefficient(grad_norm, options_.max_grad_norm);
  const int64_t t = step_ + 1;
  const AdamWStepScalars scalars = AdamWScalarsFor(options_, t);
  for (size_t i = 0; i < named_.size(); ++i) {
    at::Tensor& param = named_[i].second;
    if (!param.grad().defined()) continue;
    ParamState& s = states_[i];
    at::Tensor grad = param.grad().detach();
    if (grad.scalar_type() != s.dtype) grad = grad.to(s.dtype);
    at::Tensor& w = MasterFor(i);
    AdamWUpdate(w, s.exp_avg, s.exp_avg_sq, grad, scalars, stats.clip_coef);
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
  auto add = [&](const std::string& name, const at::Tensor& t) {
    host.push_back(t.detach().to(at::kCPU).contiguous());
    tensors.push_back(ToWrite(name, ToSafetensorsDtype(host.back().scalar_type()), host.back()));
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
  std::map<std::string, std::string> metadata = AdamWMetadata(options_, step_);
  metadata["format"] = kFormat;
  const absl::Status status = WriteSafetensors(path, tensors, metadata);
  TORCH_CHECK(status.ok(), "AdamW::SaveState('", path, "'): ", status.ToString());
}

void AdamW::LoadState(const std::string& path) {
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  TORCH_CHECK(file.ok(), "AdamW::LoadState: ", file.status().ToString());
  const std::string where = "AdamW state file '" + path + "': ";

  // Metadata: format, step and options.
  const std::map<std::string, std::string>& meta = file->metadata();
  const std::string& format = MetadataEntry(meta, "format", where);
  TORCH_CHECK(format == kFormat, where, "metadata format is '", format, "', expected '", kFormat,
              "'");
  int64_t step = 0;
  const AdamWOptions options = AdamWOptionsFromMetadata(meta, where, &step);

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
  for (size_t i = 0; i < named_.size(); ++i) {
    at::Tensor& param = named_[i].second;
    ParamState& s = states_[i];
    s.exp_avg.copy_(TensorFromView(*views[i][0], s.dtype));
    s.exp_avg_sq.copy_(TensorFromView(*views[i][1], s.dtype));
    const at::Tensor master = TensorFromView(*views[i][2], s.dtype);
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

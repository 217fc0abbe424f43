#include "executor/distributed/grad_sync.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cmath>
#include <string_view>
#include <unordered_set>

#include "absl/strings/str_cat.h"

namespace dta {
namespace {

constexpr uint64_t kFnvOffset = 14695981039346656037ull;
constexpr uint64_t kFnvPrime = 1099511628211ull;

void Fnv1a(uint64_t& hash, std::string_view bytes) {
  for (unsigned char c : bytes) hash = (hash ^ c) * kFnvPrime;
}

// `t` flattened in element order: a view, or a copy when `t` is not contiguous.
at::Tensor Flat(const at::Tensor& t) { return t.reshape({-1}); }

// Copies the flat buffer's consecutive pieces into `targets`, in one fused op where it can.
void Unflatten(const at::Tensor& flat, const std::vector<at::Tensor>& targets) {
  std::vector<int64_t> numels;
  numels.reserve(targets.size());
  for (const at::Tensor& t : targets) numels.push_back(t.numel());
  std::vector<at::Tensor> sources = at::split_with_sizes(flat, numels, 0);
  for (size_t j = 0; j < sources.size(); ++j) sources[j] = sources[j].view(targets[j].sizes());
  at::_foreach_copy_(targets, sources);
}

}  // namespace

GradientSynchronizer::GradientSynchronizer(
    ProcessGroup& group, std::vector<std::pair<std::string, at::Tensor>> named_parameters,
    GradientSynchronizerOptions options)
    : group_(group), named_(std::move(named_parameters)), options_(options) {
  TORCH_CHECK(options_.bucket_bytes > 0, "GradientSynchronizer: bucket_bytes must be > 0, got ",
              options_.bucket_bytes);
  TORCH_CHECK(std::isfinite(options_.divide_by) && options_.divide_by != 0,
              "GradientSynchronizer: divide_by must be finite and non-zero, got ",
              options_.divide_by);
  const at::Device device = group_.device();
  std::unordered_set<std::string> names;
  for (const auto& [name, param] : named_) {
    TORCH_CHECK(names.insert(name).second, "GradientSynchronizer: parameter '", name,
                "' is listed twice");
    TORCH_CHECK(param.defined(), "GradientSynchronizer: parameter '", name, "' is undefined");
    TORCH_CHECK(at::isFloatingType(param.scalar_type()), "GradientSynchronizer: parameter '", name,
                "' has dtype ", param.scalar_type(), "; only floating-point parameters have grads");
    TORCH_CHECK(param.device().type() == device.type() &&
                    (!device.is_cuda() || param.device().index() == device.index()),
                "GradientSynchronizer: parameter '", name, "' is on ", param.device().str(),
                " but the ", group_.backend_name(), " process group runs on ", device.str());
  }

  // The plan: group by (device, dtype) in order of first appearance, then cut each group in order.
  std::vector<std::pair<at::Device, at::ScalarType>> keys;
  std::vector<std::vector<size_t>> members;
  for (size_t i = 0; i < named_.size(); ++i) {
    const at::Tensor& param = named_[i].second;
    const std::pair<at::Device, at::ScalarType> key(param.device(), GradType(param));
    size_t k = 0;
    while (k < keys.size() && keys[k] != key) ++k;
    if (k == keys.size()) {
      keys.push_back(key);
      members.emplace_back();
    }
    members[k].push_back(i);
  }
  for (size_t k = 0; k < keys.size(); ++k) {
    const auto element_size = static_cast<int64_t>(c10::elementSize(keys[k].second));
    GradientBucket bucket{keys[k].second, keys[k].first, {}, 0};
    for (size_t i : members[k]) {
      const int64_t numel = named_[i].second.numel();
      if (!bucket.parameters.empty() &&
          (bucket.numel + numel) * element_size > options_.bucket_bytes) {
        buckets_.push_back(std::move(bucket));
        bucket = GradientBucket{keys[k].second, keys[k].first, {}, 0};
      }
      bucket.parameters.push_back(i);
      bucket.numel += numel;
    }
    buckets_.push_back(std::move(bucket));
  }
  // A group of one never communicates, so it needs no buffers.
  if (group_.size() > 1) {
    flat_.reserve(buckets_.size());
    for (const GradientBucket& bucket : buckets_) {
      flat_.push_back(
          at::empty({bucket.numel}, at::TensorOptions().dtype(bucket.dtype).device(bucket.device)));
    }
    if (options_.verify_layout) VerifyLayout();
  }
}

std::string GradientSynchronizer::DescribeBucket(size_t b) const {
  const GradientBucket& bucket = buckets_[b];
  const size_t count = bucket.parameters.size();
  const std::string& first = named_[bucket.parameters.front()].first;
  const std::string& last = named_[bucket.parameters.back()].first;
  return absl::StrCat(
      "bucket ", b + 1, " of ", buckets_.size(), " (", c10::toString(bucket.dtype), " on ",
      bucket.device.str(), ", ", count, count == 1 ? " parameter '" : " parameters '", first,
      count == 1 ? "" : absl::StrCat("' .. '", last), "', ",
      bucket.numel * static_cast<int64_t>(c10::elementSize(bucket.dtype)), " bytes)");
}

void GradientSynchronizer::VerifyLayout() {
  uint64_t hash = kFnvOffset;
  Fnv1a(hash, absl::StrCat(options_.bucket_bytes, ";"));
  for (const auto& [name, param] : named_) {
    Fnv1a(hash, absl::StrCat(name.size(), ":", name, ",", c10::toString(param.scalar_type()), ",",
                             c10::DeviceTypeName(param.device().type()), ","));
    for (int64_t size : param.sizes()) Fnv1a(hash, absl::StrCat(size, "x"));
    Fnv1a(hash, ";");
  }
  // One MAX all-reduce of {h, -h} yields {max h, -min h}: the same on every rank, and max == min
  // iff every rank hashed the same layout, so the ranks fail (or pass) together.
  const auto mine = static_cast<int64_t>(hash >> 2);
  at::Tensor extremes =
      at::tensor(std::vector<int64_t>{mine, -mine}, at::TensorOptions().dtype(at::kLong))
          .to(group_.device());
  std::vector<at::Tensor> tensors = {extremes};
  c10d::AllreduceOptions allreduce_options;
  allreduce_options.reduceOp = c10d::ReduceOp::MAX;
  allreduce_options.timeout = group_.timeout();
  c10::intrusive_ptr<c10d::Work> work = group_.backend()->allreduce(tensors, allreduce_options);
  group_.Wait(*work, "all-reduce verifying the gradient bucket layout");
  at::Tensor host = extremes.cpu();
  const int64_t max = host[0].item<int64_t>();
  const int64_t min = -host[1].item<int64_t>();
  TORCH_CHECK(max == min, "GradientSynchronizer: rank ", group_.rank(), " of ", group_.size(),
              ": the ranks planned different gradient buckets (parameter names, shapes, dtypes or "
              "bucket_bytes differ; this rank has ",
              named_.size(), " parameters in ", buckets_.size(), " buckets)");
}

at::ScalarType GradientSynchronizer::GradType(const at::Tensor& param) const {
  const at::ScalarType dtype = param.scalar_type();
  const bool low_precision = dtype == at::kBFloat16 || dtype == at::kHalf;
  return options_.float32_grads && low_precision ? at::kFloat : dtype;
}

void GradientSynchronizer::SyncGradients() {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  grads.reserve(named_.size());
  for (auto& [name, param] : named_) {
    const at::Tensor& grad = param.grad();
    TORCH_CHECK(!grad.defined() ||
                    (grad.sizes() == param.sizes() && grad.scalar_type() == GradType(param) &&
                     grad.device() == param.device()),
                "GradientSynchronizer: rank ", group_.rank(), ": the grad of parameter '", name,
                "' is ", grad.scalar_type(), grad.sizes(), " on ", grad.device().str(),
                ", the parameter ", param.scalar_type(), param.sizes(), " on ",
                param.device().str());
  }
  for (auto& [name, param] : named_) {
    at::Tensor& grad = param.mutable_grad();
    if (!grad.defined()) grad = at::zeros_like(param, param.options().dtype(GradType(param)));
    grads.push_back(grad);
  }
  if (group_.size() == 1) {
    if (options_.divide_by != 1.0) {
      for (at::Tensor& grad : grads) grad.div_(options_.divide_by);
    }
    return;
  }

  c10d::AllreduceOptions allreduce_options;
  allreduce_options.reduceOp = c10d::ReduceOp::SUM;
  allreduce_options.timeout = group_.timeout();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.reserve(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    std::vector<at::Tensor> pieces;
    pieces.reserve(buckets_[b].parameters.size());
    for (size_t i : buckets_[b].parameters) pieces.push_back(Flat(grads[i]));
    at::cat_out(flat_[b], pieces, 0);
    std::vector<at::Tensor> tensors = {flat_[b]};
    // Every rank skips the same empty buckets (the plan is shared), so nobody is left waiting.
    works.push_back(
        buckets_[b].numel == 0 ? nullptr : group_.backend()->allreduce(tensors, allreduce_options));
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (!works[b]) continue;
    group_.Wait(*works[b], absl::StrCat("all-reduce of gradient ", DescribeBucket(b)));
    works[b].reset();
    if (options_.divide_by != 1.0) flat_[b].div_(options_.divide_by);
    std::vector<at::Tensor> targets;
    for (size_t i : buckets_[b].parameters) targets.push_back(grads[i]);
    Unflatten(flat_[b], targets);
  }
}

void GradientSynchronizer::BroadcastParameters(int root) {
  TORCH_CHECK(root >= 0 && root < group_.size(), "GradientSynchronizer: broadcast root ", root,
              " is out of range [0, ", group_.size(), ")");
  if (group_.size() == 1) return;
  at::NoGradGuard no_grad;
  const bool is_root = group_.rank() == root;
  c10d::BroadcastOptions broadcast_options;
  broadcast_options.rootRank = root;
  broadcast_options.timeout = group_.timeout();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.reserve(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (is_root) {
      std::vector<at::Tensor> pieces;
      for (size_t i : buckets_[b].parameters) {
        pieces.push_back(Flat(named_[i].second.detach().to(buckets_[b].dtype)));
      }
      at::cat_out(flat_[b], pieces, 0);
    }
    std::vector<at::Tensor> tensors = {flat_[b]};
    works.push_back(
        buckets_[b].numel == 0 ? nullptr : group_.backend()->broadcast(tensors, broadcast_options));
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (!works[b]) continue;
    group_.Wait(*works[b],
                absl::StrCat("broadcast from rank ", root, " of parameter ", DescribeBucket(b)));
    works[b].reset();
    if (is_root) continue;
    std::vector<at::Tensor> targets;
    for (size_t i : buckets_[b].parameters) targets.push_back(named_[i].second.detach());
    Unflatten(flat_[b], targets);
  }
}

}  // namespace dta

#include "executor/distributed/sharded_adamw.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <regex>
#include <unordered_set>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/checkpoint/safetensors.h"
#include "executor/device/memory.h"
#include "executor/device/pinned_host.h"
#include "executor/device/safetensors_tensors.h"
#include "executor/optim/host_adamw.h"

namespace dta {
namespace {

constexpr char kFormat[] = "dta.adamw.sharded.v1";
constexpr const char* kStateTensors[] = {"master", "exp_avg", "exp_avg_sq"};

// FNV-1a over "name[d0,d1,...];" of every parameter: two optimizers agree on the flat numbering
// iff their parameters have the same names and shapes in the same order.
std::string Fingerprint(const std::vector<std::pair<std::string, at::Tensor>>& named) {
  uint64_t hash = 1469598103934665603ull;
  auto mix = [&](const std::string& text) {
    for (unsigned char c : text) {
      hash ^= c;
      hash *= 1099511628211ull;
    }
  };
  for (const auto& [name, param] : named) {
    std::string entry = name + "[";
    for (int64_t d : param.sizes()) absl::StrAppend(&entry, d, ",");
    mix(entry + "];");
  }
  char text[17];
  std::snprintf(text, sizeof(text), "%016" PRIx64, hash);
  return text;
}

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

DType SafetensorsDtype(at::ScalarType t) { return t == at::kDouble ? DType::kF64 : DType::kF32; }

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// StreamedUpdate: one staging slot more per this many resident buckets (see there).
constexpr int64_t kResidentBucketsPerExtraSlot = 16;

}  // namespace

ShardedAdamW::ShardedAdamW(ProcessGroup* group,
                           std::vector<std::pair<std::string, at::Tensor>> named_parameters,
                           AdamWOptions options, ShardedAdamWOptions sharding)
    : group_(group), named_(std::move(named_parameters)), options_(options), sharding_(sharding) {
  CheckAdamWOptions(options_, "ShardedAdamW: ");
  TORCH_CHECK(sharding_.bucket_elements > 0, "ShardedAdamW: bucket_elements must be > 0, got ",
              sharding_.bucket_elements);
  TORCH_CHECK(sharding_.tensor_parallel.group == nullptr ||
                  sharding_.tensor_parallel.replicated.size() == named_.size(),
              "ShardedAdamW: tensor_parallel.replicated must have one entry per parameter");
  TORCH_CHECK(!named_.empty(), "ShardedAdamW: no parameters");
  if (group_ != nullptr) {
    rank_ = group_->rank();
    world_ = group_->size();
  }
  at::NoGradGuard no_grad;
  std::unordered_set<std::string> names;
  std::unordered_set<const void*> impls;
  param_dtype_ = named_.front().second.defined() ? named_.front().second.scalar_type() : at::kFloat;
  device_ = named_.front().second.defined() ? named_.front().second.device() : at::kCPU;
  offsets_.reserve(named_.size() + 1);
  offsets_.push_back(0);
  for (const auto& [name, param] : named_) {
    TORCH_CHECK(param.defined(), "ShardedAdamW: parameter '", name, "' is an undefined tensor");
    TORCH_CHECK(names.insert(name).second, "ShardedAdamW: parameter name '", name,
                "' appears twice");
    TORCH_CHECK(impls.insert(param.unsafeGetTensorImpl()).second, "ShardedAdamW: parameter '", name,
                "' is the same tensor as an earlier parameter");
    const at::ScalarType dtype = param.scalar_type();
    TORCH_CHECK(
        dtype == at::kDouble || dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
        "ShardedAdamW: parameter '", name, "' has dtype ", dtype,
        "; expected Double, Float, BFloat16 or Half");
    TORCH_CHECK(dtype == param_dtype_, "ShardedAdamW: parameter '", name, "' has dtype ", dtype,
                " but '", named_.front().first, "' has ", param_dtype_,
                ": every parameter must have one dtype");
    TORCH_CHECK(param.device() == device_, "ShardedAdamW: parameter '", name, "' is on ",
                param.device(), " but '", named_.front().first, "' is on ", device_);
    TORCH_CHECK(param.is_contiguous(), "ShardedAdamW: parameter '", name, "' is not contiguous");
    offsets_.push_back(offsets_.back() + param.numel());
  }
  if (group_ != nullptr) {
    TORCH_CHECK(group_->device().type() == device_.type(), "ShardedAdamW: the parameters are on ",
                device_, " but the group communicates on ", group_->device());
  }
  numel_ = offsets_.back();
  shard_ = std::max<int64_t>(1, CeilDiv(numel_, world_));
  state_dtype_ = param_dtype_ == at::kDouble ? at::kDouble : at::kFloat;
  fingerprint_ = Fingerprint(named_);

  grads_ = at::zeros({world_ * shard_}, at::TensorOptions().dtype(state_dtype_).device(device_));
  if (sharding_.offload && device_.is_cuda() &&
      sharding_.offload_update == OffloadUpdate::kOnDevice) {
    absl::StatusOr<at::Tensor> pinned = PinnedHostZeros(3 * shard_, state_dtype_);
    if (pinned.ok()) {
      pinned_ = pinned->view({3, shard_});
      exp_avg_ = pinned_[1];
      exp_avg_sq_ = pinned_[2];
      streamed_ = true;
      TORCH_CHECK(sharding_.resident_elements >= 0,
                  "ShardedAdamW: resident_elements must be >= 0, got ",
                  sharding_.resident_elements);
      const int64_t b = std::min(sharding_.bucket_elements, shard_);
      resident_ = sharding_.resident_elements >= shard_
                      ? shard_
                      : sharding_.resident_elements / b * b;  // whole buckets
      resident_state_ =
          at::zeros({3, resident_}, at::TensorOptions().dtype(state_dtype_).device(device_));
    } else {
      streaming_refused_ = pinned.status().ToString();
    }
  }
  if (!streamed_) {
    const at::TensorOptions state_options =
        at::TensorOptions().dtype(state_dtype_).device(sharding_.offload ? at::kCPU : device_);
    exp_avg_ = at::zeros({shard_}, state_options);
    exp_avg_sq_ = at::zeros({shard_}, state_options);
  }
  for (size_t i = 0; i < named_.size(); ++i) {
    at::Tensor& param = named_[i].second;
    param.mutable_grad() = grads_.narrow(0, offsets_[i], param.numel()).view(param.sizes());
  }
}

int64_t ShardedAdamW::shard_end() const {
  return std::min<int64_t>(numel_, (int64_t{rank_} + 1) * shard_);
}

void ShardedAdamW::set_lr(double lr) {
  TORCH_CHECK(std::isfinite(lr) && lr >= 0, "ShardedAdamW: invalid lr ", lr,
              " (must be finite and >= 0)");
  options_.lr = lr;
}

template <typename Fn>
void ShardedAdamW::ForEachPiece(int64_t flat_begin, int64_t count, Fn&& fn) const {
  const int64_t flat_end = std::min(flat_begin + count, numel_);
  if (flat_begin >= flat_end) return;
  // The parameter holding flat_begin: the last offset <= flat_begin.
  size_t i = std::upper_bound(offsets_.begin(), offsets_.end(), flat_begin) - offsets_.begin() - 1;
  for (int64_t at = flat_begin; at < flat_end; ++i) {
    const int64_t end = std::min(offsets_[i + 1], flat_end);
    if (end > at) fn(i, at - offsets_[i], end - at, at - flat_begin);
    at = std::max(at, end);
  }
}

at::Tensor ShardedAdamW::GradShard() const { return grads_.narrow(0, rank_ * shard_, shard_); }

std::string ShardedAdamW::Describe(const char* what, int64_t bucket, int64_t buckets) const {
  return absl::StrCat(what, " bucket ", bucket + 1, " of ", buckets, " (rank ", rank_, " of ",
                      world_, ", ", shard_, " elements per rank)");
}

void ShardedAdamW::ZeroGrad() {
  at::NoGradGuard no_grad;
  grads_.zero_();
}

void ShardedAdamW::ReduceGradients() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < named_.size(); ++i) {
    auto& [name, param] = named_[i];
    at::Tensor slot = grads_.narrow(0, offsets_[i], param.numel()).view(param.sizes());
    const at::Tensor& grad = param.grad();
    if (grad.defined() && grad.data_ptr() == slot.data_ptr()) continue;
    if (grad.defined()) {
      TORCH_CHECK(grad.sizes() == param.sizes(), "ShardedAdamW: the gradient of parameter '", name,
                  "' has shape ", grad.sizes(), " but the parameter has ", param.sizes());
      slot.copy_(grad);
    } else {
      slot.zero_();
    }
    param.mutable_grad() = slot;
  }
  if (world_ == 1) return;
  const at::Tensor matrix = grads_.view({world_, shard_});
  const int64_t b = std::min(sharding_.bucket_elements, shard_);
  const int64_t buckets = CeilDiv(shard_, b);
  // Two staging buffers: filling bucket j + 1 overlaps the reduction of bucket j.
  at::Tensor staging[2] = {at::empty({world_ * b}, grads_.options()),
                           at::empty({world_ * b}, grads_.options())};
  c10::intrusive_ptr<c10d::Work> works[2];
  c10d::ReduceScatterOptions reduce_options;
  reduce_options.reduceOp = c10d::ReduceOp::SUM;
  reduce_options.timeout = group_->timeout();
  for (int64_t j = 0; j < buckets; ++j) {
    const int k = static_cast<int>(j % 2);
    if (works[k]) {
      group_->Wait(*works[k], Describe("reduce-scatter of gradient", j - 2, buckets));
      works[k].reset();
    }
    const int64_t begin = j * b;
    const int64_t count = std::min(b, shard_ - begin);
    at::Tensor input = staging[k].narrow(0, 0, world_ * count);
    input.view({world_, count}).copy_(matrix.narrow(1, begin, count));
    at::Tensor output = matrix[rank_].narrow(0, begin, count);
    works[k] = group_->backend()->_reduce_scatter_base(output, input, reduce_options);
  }
  for (int64_t j = std::max<int64_t>(0, buckets - 2); j < buckets; ++j) {
    const int k = static_cast<int>(j % 2);
    if (works[k]) group_->Wait(*works[k], Describe("reduce-scatter of gradient", j, buckets));
  }
}

void ShardedAdamW::LoadResident(int rows) const {
  if (resident_ == 0) return;
  for (int row = 0; row < rows; ++row) {
    resident_state_[row].copy_(pinned_[row].narrow(0, 0, resident_));
  }
}

void ShardedAdamW::StoreResident() const {
  if (resident_ == 0) return;
  for (int row = 0; row < 3; ++row) {
    pinned_[row].narrow(0, 0, resident_).copy_(resident_state_[row]);
  }
}

const at::Tensor& ShardedAdamW::master_shard() const {
  StoreResident();
  return master_;
}

const at::Tensor& ShardedAdamW::exp_avg_shard() const {
  StoreResident();
  return exp_avg_;
}

const at::Tensor& ShardedAdamW::exp_avg_sq_shard() const {
  StoreResident();
  return exp_avg_sq_;
}

at::Tensor ShardedAdamW::NewMaster() const {
  if (pinned_.defined()) return pinned_[0].zero_();
  return at::zeros({shard_}, exp_avg_.options());
}

void ShardedAdamW::ResetMasterFromParameters() {
  if (!master_.defined()) return;  // the first Step takes it from the parameters anyway
  at::NoGradGuard no_grad;
  ForEachPiece(rank_ * shard_, shard_, [&](size_t i, int64_t in_param, int64_t n, int64_t local) {
    master_.narrow(0, local, n).copy_(named_[i].second.detach().view(-1).narrow(0, in_param, n));
  });
  LoadResident(/*rows=*/1);  // the moments on the GPU stay the newest
}

at::Tensor ShardedAdamW::MasterFromParameters() const {
  at::Tensor master = NewMaster();
  ForEachPiece(rank_ * shard_, shard_, [&](size_t i, int64_t in_param, int64_t n, int64_t local) {
    master.narrow(0, local, n).copy_(named_[i].second.detach().view(-1).narrow(0, in_param, n));
  });
  return master;
}

template <typename Produce>
void ShardedAdamW::PublishParameters(Produce&& produce) {
  const int64_t b = std::min(sharding_.bucket_elements, shard_);
  const int64_t buckets = CeilDiv(shard_, b);
  auto write = [&](int64_t flat_begin, int64_t count, const at::Tensor& values) {
    ForEachPiece(flat_begin, count, [&](size_t i, int64_t in_param, int64_t n, int64_t local) {
      named_[i].second.detach().view(-1).narrow(0, in_param, n).copy_(values.narrow(0, local, n));
    });
  };
  at::Tensor gathered;
  if (world_ > 1) {
    gathered = at::empty({world_ * b}, at::TensorOptions().dtype(param_dtype_).device(device_));
  }
  c10d::AllgatherOptions gather_options;
  gather_options.timeout = group_ != nullptr ? group_->timeout() : gather_options.timeout;
  for (int64_t j = 0; j < buckets; ++j) {
    const int64_t begin = j * b;
    const int64_t count = std::min(b, shard_ - begin);
    at::Tensor mine = produce(begin, count).contiguous();
    if (world_ == 1) {
      write(begin, count, mine);
      continue;
    }
    at::Tensor output = gathered.narrow(0, 0, world_ * count);
    c10::intrusive_ptr<c10d::Work> work =
        group_->backend()->_allgather_base(output, mine, gather_options);
    group_->WaitStreamOrdered(*work, Describe("all-gather of weight", j, buckets));
    const at::Tensor rows = output.view({world_, count});
    for (int q = 0; q < world_; ++q) write(q * shard_ + begin, count, rows[q]);
  }
}

double ShardedAdamW::GradSquares() const {
  at::NoGradGuard no_grad;
  const at::Tensor shard = GradShard();
  const int64_t b = std::min(sharding_.bucket_elements, shard_);
  const TensorParallelNorm& tensor_parallel = sharding_.tensor_parallel;
  std::vector<at::Tensor> norms;
  if (tensor_parallel.group == nullptr || tensor_parallel.group->rank() == 0) {
    for (int64_t begin = 0; begin < shard_; begin += b) {
      norms.push_back(at::linalg_vector_norm(shard.narrow(0, begin, std::min(b, shard_ - begin)), 2,
                                             std::nullopt, false, at::kDouble));
    }
  } else {
    // A tensor-parallel rank other than 0 leaves the replicated parameters to rank 0.
    ForEachPiece(rank_ * shard_, shard_, [&](size_t i, int64_t, int64_t n, int64_t local_at) {
      if (!tensor_parallel.Counts(i)) return;
      norms.push_back(at::linalg_vector_norm(shard.narrow(0, local_at, n), 2, std::nullopt, false,
                                             at::kDouble));
    });
  }
  return norms.empty() ? 0.0 : at::stack(norms).square().sum().item<double>();
}

StepStats ShardedAdamW::Step(NonFiniteGradients on_nonfinite) {
  const double local = GradSquares();
  const double data_parallel =
      group_ != nullptr ? group_->AllReduceScalars({local}).front() : local;
  return StepWithNorm(std::sqrt(sharding_.tensor_parallel.Sum(data_parallel, device_)),
                      on_nonfinite);
}

StepStats ShardedAdamW::StepWithNorm(double total, NonFiniteGradients on_nonfinite) {
  at::NoGradGuard no_grad;
  const at::Tensor shard = GradShard();
  if (!std::isfinite(total) && on_nonfinite == NonFiniteGradients::kSkip) {
    return {.grad_norm = total, .step = step_, .lr = options_.lr, .skipped = true};
  }
  if (!std::isfinite(total)) {
    ForEachPiece(rank_ * shard_, shard_, [&](size_t i, int64_t, int64_t n, int64_t local_at) {
      TORCH_CHECK(at::isfinite(shard.narrow(0, local_at, n)).all().item<bool>(),
                  "ShardedAdamW: the gradient of parameter '", named_[i].first,
                  "' is not finite (NaN or infinity); nothing was updated");
    });
    TORCH_CHECK(false, "ShardedAdamW: the global gradient norm (", total,
                ") is not finite: a gradient in another rank's slice is (that rank names the "
                "parameter); nothing was updated");
  }
  StepStats stats;
  stats.grad_norm = total;
  stats.clip_coef = ClipCoefficient(total, options_.max_grad_norm);
  if (!master_.defined()) {
    master_ = MasterFromParameters();
    LoadResident(/*rows=*/1);
  }
  const int64_t t = step_ + 1;
  const AdamWStepScalars scalars = AdamWScalarsFor(options_, t);
  if (streamed_) {
    StreamedUpdate(shard, stats.clip_coef, scalars);
  } else if (sharding_.offload && state_dtype_ == at::kFloat) {
    OffloadedUpdate(shard, stats.clip_coef, scalars);
  } else {
    PublishParameters([&](int64_t begin, int64_t count) {
      at::Tensor grad = shard.narrow(0, begin, count);
      if (sharding_.offload) grad = grad.to(at::kCPU);
      at::Tensor w = master_.narrow(0, begin, count);
      at::Tensor m = exp_avg_.narrow(0, begin, count);
      at::Tensor v = exp_avg_sq_.narrow(0, begin, count);
      AdamWUpdate(w, m, v, grad, scalars, stats.clip_coef);
      return w.to(device_, param_dtype_);  // rounds to the parameters' dtype
    });
  }
  step_ = t;
  stats.step = step_;
  return stats;
}

void ShardedAdamW::OffloadedUpdate(const at::Tensor& shard, double clip_coef,
                                   const AdamWStepScalars& scalars) {
  // A pipeline over the buckets with two pinned host buffers for gradients and two for the rounded
  // weights: bucket j + 1's gradients travel to the host while the host updates bucket j, and
  // bucket j's weights travel back (then are all-gathered) in stream order behind them.
  const int64_t b = std::min(sharding_.bucket_elements, shard_);
  const bool pinned = device_.is_cuda();
  const at::TensorOptions host = at::TensorOptions().pinned_memory(pinned);
  at::Tensor grads[2] = {at::empty({b}, host.dtype(at::kFloat)),
                         at::empty({b}, host.dtype(at::kFloat))};
  at::Tensor rounded[2] = {at::empty({b}, host.dtype(param_dtype_)),
                           at::empty({b}, host.dtype(param_dtype_))};
  c10::impl::VirtualGuardImpl guard(device_.type());
  offload_times_ = {};
  const Clock::time_point start = Clock::now();
  auto wait_for_copies = [&] {
    const Clock::time_point wait_start = Clock::now();
    if (pinned) guard.getStream(device_).synchronize();
    offload_times_.copy_wait += SecondsSince(wait_start);
  };
  auto fetch = [&](int64_t begin) {
    const int64_t count = std::min(b, shard_ - begin);
    grads[(begin / b) % 2].narrow(0, 0, count).copy_(shard.narrow(0, begin, count), pinned);
  };
  fetch(0);
  PublishParameters([&](int64_t begin, int64_t count) {
    const int k = static_cast<int>((begin / b) % 2);
    wait_for_copies();  // bucket j's gradients are on the host, bucket j - 1's weights left it
    if (begin + b < shard_) fetch(begin + b);
    at::Tensor w = master_.narrow(0, begin, count);
    at::Tensor m = exp_avg_.narrow(0, begin, count);
    at::Tensor v = exp_avg_sq_.narrow(0, begin, count);
    at::Tensor out = rounded[k].narrow(0, 0, count);
    const Clock::time_point update_start = Clock::now();
    HostAdamWUpdate(w, m, v, grads[k].narrow(0, 0, count), clip_coef, scalars, out);
    offload_times_.update += SecondsSince(update_start);
    return out.to(device_, /*non_blocking=*/pinned);
  });
  wait_for_copies();  // the pinned buffers outlive every copy from them
  offload_times_.total = SecondsSince(start);
}

void ShardedAdamW::StreamedUpdate(const at::Tensor& shard, double clip_coef,
                                  const AdamWStepScalars& scalars) {
  // Device slots of [3, b] (master, exp_avg, exp_avg_sq of one bucket); streamed bucket j uses
  // slot j % slots. It is copied in on `copy_in` (after the slot's previous bucket has left it),
  // updated on the compute stream, copied back on `copy_out`; the loads run slots - 1 buckets
  // ahead of the updates, so the bus carries buckets in and out at once while the GPU updates.
  // Two slots keep both directions busy once the streamed buckets are reached; the resident
  // buckets are updated first (PublishParameters' order), and extra slots let the first streamed
  // buckets travel meanwhile. A resident bucket's update moves ~3x a streamed bucket's bytes over
  // HBM, which is ~70x the bus, so one extra slot per 16 resident buckets covers their time; the
  // extra slots take at most half of the memory free now (the executor's, released), leaving the
  // rest to each bucket's temporaries and gathers, and fewer when an allocation fails.
  const int64_t b = std::min(sharding_.bucket_elements, shard_);
  const int64_t streamed_buckets = CeilDiv(shard_ - resident_, b);
  c10::impl::VirtualGuardImpl guard(device_.type());
  const c10::Stream compute = guard.getStream(device_);
  const c10::Stream copy_in = guard.getStreamFromGlobalPool(device_);
  const c10::Stream copy_out = guard.getStreamFromGlobalPool(device_);
  const at::TensorOptions slot_options = at::TensorOptions().dtype(state_dtype_).device(device_);
  const int64_t slot_bytes = 3 * b * static_cast<int64_t>(c10::elementSize(state_dtype_));
  const int64_t extra_slots = std::min(CeilDiv(resident_ / b, kResidentBucketsPerExtraSlot),
                                       FreeDeviceMemory(device_) / 2 / slot_bytes);
  const int64_t wanted_slots = std::min(streamed_buckets, 2 + extra_slots);
  std::vector<at::Tensor> slots;
  for (int64_t k = 0; k < wanted_slots; ++k) {
    try {
      slots.push_back(at::empty({3, b}, slot_options));
    } catch (const c10::OutOfMemoryError&) {
      if (k < std::min<int64_t>(2, wanted_slots)) throw;  // the pipeline needs two
      break;
    }
  }
  const int64_t count_slots = static_cast<int64_t>(slots.size());
  std::vector<c10::Event> loaded, updated, stored;
  for (int64_t k = 0; k < count_slots; ++k) {
    loaded.emplace_back(device_.type());
    updated.emplace_back(device_.type());
    stored.emplace_back(device_.type());
  }
  offload_times_ = {};
  const Clock::time_point start = Clock::now();
  // Streamed bucket j (elements [R + j b, ...)) uses slot j % count_slots.
  auto slot_of = [&](int64_t begin) {
    return static_cast<size_t>(((begin - resident_) / b) % count_slots);
  };
  auto load = [&](int64_t begin) {
    const size_t k = slot_of(begin);
    const int64_t count = std::min(b, shard_ - begin);
    const c10::StreamGuard on(copy_in);
    stored[k].block(copy_in);            // no-op before the slot's first use
    for (int row = 0; row < 3; ++row) {  // row by row: each a contiguous copy
      slots[k][row]
          .narrow(0, 0, count)
          .copy_(pinned_[row].narrow(0, begin, count),
                 /*non_blocking=*/true);
    }
    loaded[k].record(copy_in);
  };
  // The first streamed buckets travel while the resident ones are updated.
  for (int64_t j = 0; j < count_slots - 1 && resident_ + j * b < shard_; ++j) {
    load(resident_ + j * b);
  }
  // Updates the state rows [3, >= count] of elements [begin, begin + count); returns the new
  // weights rounded to the parameters' dtype (a copy even for float32 weights: a slot is refilled
  // once its state has left).
  auto update = [&](const at::Tensor& state, int64_t begin, int64_t count) {
    at::Tensor w = state[0].narrow(0, 0, count);
    at::Tensor m = state[1].narrow(0, 0, count);
    at::Tensor v = state[2].narrow(0, 0, count);
    AdamWUpdate(w, m, v, shard.narrow(0, begin, count), scalars, clip_coef);
    return w.to(param_dtype_, /*non_blocking=*/false, /*copy=*/true);
  };
  PublishParameters([&](int64_t begin, int64_t count) {
    // Whole buckets are resident, so [begin, begin + count) is either resident or streamed.
    if (begin < resident_) return update(resident_state_.narrow(1, begin, count), begin, count);
    const size_t k = slot_of(begin);
    const int64_t ahead = begin + (count_slots - 1) * b;
    if (ahead < shard_) load(ahead);
    loaded[k].block(compute);
    at::Tensor rounded = update(slots[k], begin, count);
    updated[k].record(compute);
    const c10::StreamGuard on(copy_out);
    updated[k].block(copy_out);
    for (int row = 0; row < 3; ++row) {
      pinned_[row]
          .narrow(0, begin, count)
          .copy_(slots[k][row].narrow(0, 0, count),
                 /*non_blocking=*/true);
    }
    stored[k].record(copy_out);
    return rounded;
  });
  // The host's state is final, and the slots idle, once the last copy back has finished.
  const Clock::time_point wait_start = Clock::now();
  copy_out.synchronize();
  offload_times_.copy_wait = SecondsSince(wait_start);
  offload_times_.total = SecondsSince(start);
}

std::string ShardedAdamW::ShardFileName(int rank, int world) {
  char name[64];
  std::snprintf(name, sizeof(name), "optimizer-%05d-of-%05d.safetensors", rank, world);
  return name;
}

std::vector<std::string> ShardedAdamW::ShardFiles(const std::string& directory) {
  static const std::regex pattern(R"(optimizer-\d{5}-of-\d{5}\.safetensors)");
  std::vector<std::string> files;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(directory, error)) {
    if (std::regex_match(entry.path().filename().string(), pattern)) {
      files.push_back(entry.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

void ShardedAdamW::SaveState(const std::string& path) const {
  at::NoGradGuard no_grad;
  const int64_t begin = std::min(numel_, rank_ * shard_);
  const int64_t count = shard_end() - begin;
  StoreResident();
  // Before the first step the parameters are the master weights.
  const at::Tensor master = master_.defined() ? master_ : MasterFromParameters();
  const at::Tensor state[] = {master, exp_avg_, exp_avg_sq_};
  std::vector<at::Tensor> host;
  std::vector<TensorToWrite> tensors;
  for (int k = 0; k < 3; ++k) {
    host.push_back(state[k].narrow(0, 0, count).to(at::kCPU).contiguous());
    tensors.push_back(ToWrite(kStateTensors[k], SafetensorsDtype(state_dtype_), host.back()));
  }
  std::map<std::string, std::string> metadata = AdamWMetadata(options_, step_);
  metadata["format"] = kFormat;
  metadata["numel"] = std::to_string(numel_);
  metadata["begin"] = std::to_string(begin);
  metadata["end"] = std::to_string(begin + count);
  metadata["parameters"] = fingerprint_;
  const absl::Status status = WriteSafetensors(path, tensors, metadata);
  TORCH_CHECK(status.ok(), "ShardedAdamW::SaveState('", path, "'): ", status.ToString());
}

void ShardedAdamW::LoadState(const std::vector<std::string>& paths) {
  TORCH_CHECK(!paths.empty(), "ShardedAdamW::LoadState: no state files given");
  struct Slice {
    int64_t begin = 0, end = 0;
    size_t file = 0;
    const TensorView* views[3] = {};
  };
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::vector<Slice> slices;
  int64_t step = -1;
  AdamWOptions options;
  for (const std::string& path : paths) {
    absl::StatusOr<SafetensorsFile> opened = SafetensorsFile::Open(path);
    TORCH_CHECK(opened.ok(), "ShardedAdamW::LoadState: ", opened.status().ToString());
    files.push_back(std::make_unique<SafetensorsFile>(std::move(*opened)));
    const SafetensorsFile& file = *files.back();
    const std::string where = "sharded AdamW state file '" + path + "': ";
    const std::map<std::string, std::string>& meta = file.metadata();
    const std::string& format = MetadataEntry(meta, "format", where);
    TORCH_CHECK(format == kFormat, where, "metadata format is '", format, "', expected '", kFormat,
                "'",
                format == "dta.adamw.v1" ? " (a replicated AdamW's state: resume it without "
                                           "optimizer sharding or offload)"
                                         : "");
    TORCH_CHECK(MetadataEntry(meta, "parameters", where) == fingerprint_, where,
                "it was saved for other parameters (names or shapes differ from this model's)");
    const int64_t numel = MetadataCount(meta, "numel", where);
    TORCH_CHECK(numel == numel_, where, "it holds state for ", numel,
                " elements, this optimizer has ", numel_);
    int64_t file_step = 0;
    const AdamWOptions file_options = AdamWOptionsFromMetadata(meta, where, &file_step);
    if (step < 0) {
      step = file_step;
      options = file_options;
    }
    TORCH_CHECK(file_step == step, where, "it is from step ", file_step, " but '", paths.front(),
                "' is from step ", step, ": pass the files of one checkpoint");
    Slice slice;
    slice.begin = MetadataCount(meta, "begin", where);
    slice.end = MetadataCount(meta, "end", where);
    slice.file = files.size() - 1;
    TORCH_CHECK(slice.begin <= slice.end && slice.end <= numel_, where, "its slice [", slice.begin,
                ", ", slice.end, ") is not within [0, ", numel_, ")");
    const DType want = SafetensorsDtype(state_dtype_);
    for (int k = 0; k < 3; ++k) {
      const TensorView* view = file.Find(kStateTensors[k]);
      TORCH_CHECK(view != nullptr, where, "missing tensor '", kStateTensors[k], "'");
      TORCH_CHECK(view->dtype == want, where, "tensor '", kStateTensors[k], "' has dtype ",
                  std::string(DTypeName(view->dtype)), ", expected ", std::string(DTypeName(want)));
      TORCH_CHECK(view->shape == std::vector<int64_t>{slice.end - slice.begin}, where, "tensor '",
                  kStateTensors[k], "' has shape ", ShapeToString(view->shape), ", expected [",
                  slice.end - slice.begin, "]");
      slice.views[k] = view;
    }
    slices.push_back(slice);
  }
  std::sort(slices.begin(), slices.end(),
            [](const Slice& a, const Slice& b) { return a.begin < b.begin; });
  for (size_t s = 1; s < slices.size(); ++s) {
    TORCH_CHECK(slices[s].begin >= slices[s - 1].end, "ShardedAdamW::LoadState: '",
                paths[slices[s].file], "' and '", paths[slices[s - 1].file],
                "' hold overlapping slices: pass the files of one checkpoint");
  }
  // This rank's slice must be covered.
  const int64_t want_begin = std::min(numel_, rank_ * shard_);
  const int64_t want_end = shard_end();
  int64_t covered = want_begin;
  for (const Slice& slice : slices) {
    if (slice.end <= covered || slice.begin >= want_end) continue;
    TORCH_CHECK(slice.begin <= covered, "ShardedAdamW::LoadState: no file holds elements [",
                covered, ", ", slice.begin, ") of ", numel_, " (rank ", rank_, " of ", world_,
                " needs [", want_begin, ", ", want_end, "); pass every ",
                "optimizer-*-of-*.safetensors file of the checkpoint)");
    covered = slice.end;
  }
  TORCH_CHECK(covered >= want_end, "ShardedAdamW::LoadState: no file holds elements [", covered,
              ", ", want_end, ") of ", numel_, " (rank ", rank_, " of ", world_,
              "); pass every optimizer-*-of-*.safetensors file of the checkpoint");

  at::NoGradGuard no_grad;
  master_ = NewMaster();
  at::Tensor* state[] = {&master_, &exp_avg_, &exp_avg_sq_};
  exp_avg_.zero_();
  exp_avg_sq_.zero_();
  for (const Slice& slice : slices) {
    const int64_t begin = std::max(slice.begin, want_begin);
    const int64_t end = std::min(slice.end, want_end);
    if (begin >= end) continue;
    for (int k = 0; k < 3; ++k) {
      const at::Tensor stored = TensorFromView(*slice.views[k], state_dtype_);
      state[k]
          ->narrow(0, begin - want_begin, end - begin)
          .copy_(stored.narrow(0, begin - slice.begin, end - begin));
    }
  }
  LoadResident(/*rows=*/3);
  step_ = step;
  options_ = options;
  PublishParameters([&](int64_t begin, int64_t count) {
    return master_.narrow(0, begin, count).to(device_, param_dtype_);
  });
}

}  // namespace dta

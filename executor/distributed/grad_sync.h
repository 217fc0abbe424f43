// Data-parallel gradient synchronisation: after every rank's backward pass, SyncGradients()
// replaces each parameter's .grad by its sum over the ranks (optionally divided by a constant), in
// a few large all-reduces instead of one per parameter.
//
// Buckets are planned once, at construction, from the parameter list alone (order, dtype, device,
// shape, and the bucket size), never from which grads happen to be defined, so every rank agrees
// on them as long as every rank passes the same parameter list; the constructor checks that with
// one collective and fails on every rank if not. Parameters are grouped by (device, dtype), keeping
// their order within a group (groups ordered by their first parameter), and each group is cut into
// buckets of at most `bucket_bytes`, except that a parameter larger than that gets a bucket of its
// own (parameters are never split). Each bucket owns a flat buffer (its total size), allocated
// once and reused by every step; together they hold one extra copy of the gradients.
//
// One SyncGradients():
//   1. every parameter whose grad is undefined gets a zero grad (the parameter's shape, dtype and
//      strides), so it contributes zeros: ranks whose samples skipped a parameter still take part;
//   2. for each bucket in turn: copy its grads into the flat buffer (one at::cat_out) and start an
//      asynchronous SUM all-reduce of the buffer, so flattening a bucket overlaps with the
//      communication of the buckets before it;
//   3. for each bucket in turn: wait for its all-reduce (ProcessGroup::timeout()), divide the
//      buffer by `divide_by` when that is not 1, and copy it back into the grads (copying back
//      overlaps with the later buckets' communication).
// Afterwards every parameter's .grad is defined and holds (sum over the ranks) / divide_by, equal
// to the exact sum up to the rounding of the backend's summation order and bit-identical on every
// rank. Grads that were defined keep their identity (they are written in place). A group of size
// 1 communicates nothing: step 1 and the division only.
//
// Errors: c10::Error (TORCH_CHECK) naming the rank, the bucket and the parameter. A failed or
// timed-out all-reduce leaves the grads partially synchronised and the group unusable (see
// process_group.h).
// Thread safety: none; the group's collectives must not be interleaved with other calls on it.
//
// Example:
//   GradientSynchronizer sync(*group, model.named_parameters(), {.bucket_bytes = 25 << 20});
//   sync.BroadcastParameters();  // every rank starts from rank 0's weights
//   for (...) {
//     optimizer.ZeroGrad();
//     ComputeGradients(model, rollouts, loss_options, executor_options);
//     sync.SyncGradients();
//     optimizer.Step();
//   }
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "executor/distributed/process_group.h"

namespace dta {

struct GradientSynchronizerOptions {
  // Upper bound on a bucket's bytes (a larger parameter gets a bucket of its own). Must be > 0.
  int64_t bucket_bytes = int64_t{25} << 20;
  // The summed grads are divided by this. 1 (the default) leaves the plain sum, which is what the
  // trainer wants: the dispatcher already normalises the loss over the global batch. Must be
  // finite and non-zero.
  double divide_by = 1.0;
  // Whether the constructor checks, with one all-reduce, that every rank planned the same buckets
  // (same names, shapes, dtypes, device types and bucket size). Off only for groups that must not
  // communicate at construction.
  bool verify_layout = true;
  // Grads of bfloat16 and float16 parameters are float32 (Decoder accumulates them so, the
  // buckets then sum in float32); false: every grad has its parameter's dtype.
  bool float32_grads = true;
};

// One bucket of the plan, for introspection.
struct GradientBucket {
  at::ScalarType dtype;
  at::Device device;
  std::vector<size_t> parameters;  // indices into named_parameters(), in order
  int64_t numel = 0;               // elements of the flat buffer
};

class GradientSynchronizer {
 public:
  // `group` must outlive this object. `named_parameters`: the tensors whose grads are synchronised,
  // each defined, of a floating dtype, on the group's device (CPU for Gloo, the group's GPU for
  // NCCL), under distinct names (order kept; every rank passes the same list). Allocates the
  // bucket buffers (not for a group of size 1), then with verify_layout runs one collective.
  // TORCH_CHECK naming the parameter on a violation or options outside their ranges, and naming
  // the rank when the ranks' layouts differ (then every rank fails).
  GradientSynchronizer(ProcessGroup& group,
                       std::vector<std::pair<std::string, at::Tensor>> named_parameters,
                       GradientSynchronizerOptions options = {});
  GradientSynchronizer(const GradientSynchronizer&) = delete;
  GradientSynchronizer& operator=(const GradientSynchronizer&) = delete;

  // Sums every parameter's grad over the ranks, as the header comment says. TORCH_CHECK naming the
  // parameter when a defined grad's shape, dtype or device differs from its parameter's (before
  // anything is communicated), and naming the rank and the bucket when an all-reduce fails or
  // times out.
  void SyncGradients();

  // Overwrites every parameter on every rank with rank `root`'s values (bucketed broadcasts through
  // the same buffers; in place, under no-grad). Grads are untouched. TORCH_CHECK when root is not
  // in [0, size), or naming the rank and the bucket when a broadcast fails or times out.
  void BroadcastParameters(int root = 0);

  const std::vector<GradientBucket>& buckets() const { return buckets_; }
  const std::vector<std::pair<std::string, at::Tensor>>& named_parameters() const { return named_; }
  const GradientSynchronizerOptions& options() const { return options_; }

 private:
  // E.g. "bucket 3 of 7 (Float on cpu, 12 parameters 'layers.0.wq' .. 'layers.1.wo', 4096 bytes)".
  std::string DescribeBucket(size_t b) const;
  void VerifyLayout();
  // The dtype of the parameter's grad (see GradientSynchronizerOptions::float32_grads).
  at::ScalarType GradType(const at::Tensor& param) const;

  ProcessGroup& group_;
  std::vector<std::pair<std::string, at::Tensor>> named_;
  GradientSynchronizerOptions options_;
  std::vector<GradientBucket> buckets_;
  std::vector<at::Tensor> flat_;  // per bucket: [bucket.numel], its dtype and device; size > 1 only
};

}  // namespace dta

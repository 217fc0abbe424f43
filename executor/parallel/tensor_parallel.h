// Tensor parallelism's two seams below the model: how a dimension is split across the
// tensor-parallel (TP) ranks of one model replica, and the collectives the split model runs over
// them. The model (executor/model) and the optimizers (executor/optim) see only this interface;
// executor/distributed implements it over a c10d process group (TensorParallelOverProcessGroup),
// so nothing below the trainers depends on how ranks talk.
//
// Collectives are matched across ranks by their order: the TP ranks of a replica run the same
// schedule over the same rollouts, so they issue the same collectives in the same order, forward
// and backward.
//
// Example:
//   IndexRange heads = SplitRange(config.num_attention_heads, tp.rank(), tp.size());
//   tp.AllReduce(partial_sums, TensorParallelReduce::kSum);  // every rank now holds the total
//   auto pending = tp.StartAllReduce(dx, TensorParallelReduce::kSum);
//   ...work that does not touch dx...
//   pending->Wait();
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace dta {

// [begin, end) of a split dimension.
struct IndexRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const IndexRange&) const = default;
};

// Part `part` of `total` items split into `parts` contiguous parts whose sizes differ by at most
// one: [floor(total p / parts), floor(total (p + 1) / parts)). TORCH_CHECK 0 <= part < parts and
// total >= 0.
IndexRange SplitRange(int64_t total, int part, int parts);

enum class TensorParallelReduce { kSum, kMax };

// A collective that has been started and not yet waited for. Wait() completes it (on CUDA: orders
// the current stream after it, without blocking the host); destruction without Wait() waits too,
// so a collective is never left behind by an exception. The reduced tensor must not be read or
// written before Wait().
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  virtual void Wait() = 0;
};

// The collectives over the TP ranks of one model replica.
class TensorParallelGroup {
 public:
  virtual ~TensorParallelGroup() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Replaces `tensor` (contiguous, on the model's device, the same shape on every rank) by its
  // element-wise reduction over the ranks, bit-identical on every rank. On CUDA it is ordered after
  // the current stream's work and later work on the current stream is ordered after it, without
  // blocking the host. TORCH_CHECK naming the rank when the collective fails or times out.
  virtual void AllReduce(at::Tensor& tensor, TensorParallelReduce op) const = 0;

  // AllReduce started without waiting, so that work that does not read `tensor` overlaps it (a
  // column-parallel layer's weight gradients run while its input gradient is summed). Collectives
  // still match across ranks by the order in which they are started.
  virtual std::unique_ptr<PendingCollective> StartAllReduce(at::Tensor& tensor,
                                                            TensorParallelReduce op) const = 0;

  // Every rank's `tensor` (contiguous, the same shape on every rank) concatenated along dimension 0
  // in rank order. Same ordering and errors as AllReduce.
  virtual at::Tensor AllGather(const at::Tensor& tensor) const = 0;
};

// The least `value` over the group's ranks (through a one-element int64 tensor on `device`, the
// model's); `value` itself without a group. For what every rank must agree on but measures alone:
// the free memory the executor sizes its automatic chunks from, so that every rank plans the
// same schedule (its collectives pair up only if they do).
int64_t LeastOverRanks(const TensorParallelGroup* group, int64_t value, at::Device device);

// What a global gradient norm (for clipping) spans under tensor parallelism: every rank's parts
// of the split parameters, and the parameters every rank holds whole (replicated) once: rank 0
// counts them.
struct TensorParallelNorm {
  const TensorParallelGroup* group = nullptr;  // null: no tensor parallelism
  std::vector<bool> replicated;                // per parameter, in the optimizer's order

  // Whether this rank adds parameter i's squares to its share of the norm.
  bool Counts(size_t i) const {
    return group == nullptr || group->rank() == 0 || !replicated.at(i);
  }
  // The sum of `local` over the group (in float64, through a one-element tensor on `device`);
  // `local` itself without a group.
  double Sum(double local, at::Device device) const;
};

}  // namespace dta

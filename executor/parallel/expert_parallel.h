// Expert parallelism's seam below the model: the collectives a sparse (mixture-of-experts) layer
// runs over the expert-parallel (EP) ranks, each of which holds one contiguous block of every
// sparse layer's experts (ExpertRange) and serves the tokens of every EP rank routed to them
// (docs/expert_parallelism.md). executor/distributed implements it over a c10d process group
// (ExpertParallelOverProcessGroup); the model sees only this interface.
//
// Collectives match across ranks by their order: the EP ranks must issue the same collectives in
// the same order even though they run different rollouts (the engine's lockstep sees to that; a
// rank without tokens still takes part, with zero rows).
//
// Example:
//   const IndexRange local = ExpertRange(config.num_experts, ep.rank(), ep.size());
//   const at::Tensor counts = ep.AllGather(per_expert_rows);  // [size, E]
//   at::Tensor received = at::empty({rows_in, hidden}, sent.options());
//   ep.StartAllToAll(received, sent, receive_splits, send_splits)->Wait();
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "executor/parallel/tensor_parallel.h"

namespace dta {

// The experts of EP rank `rank` of `ranks`: a contiguous block, sizes differing by at most one
// (SplitRange), so that a sort of (token, expert) pairs by expert also groups them by rank.
inline IndexRange ExpertRange(int64_t num_experts, int rank, int ranks) {
  return SplitRange(num_experts, rank, ranks);
}

// The collectives over the EP ranks.
class ExpertParallelGroup {
 public:
  virtual ~ExpertParallelGroup() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Every rank's `tensor` (contiguous, the same shape on every rank) stacked along a new dimension
  // 0 in rank order: [size, ...]. On CUDA stream-ordered, without blocking the host. TORCH_CHECK
  // naming the rank when the collective fails or times out.
  virtual at::Tensor AllGather(const at::Tensor& tensor) const = 0;

  // Starts the exchange of rows: rows [sum(send_splits[0 .. r)), + send_splits[r]) of `input` go
  // to rank r, and `output` receives receive_splits[r] rows from each rank r, in rank order. Each
  // rank's receive_splits[r] must equal rank r's send_splits[this rank]; zeros and zero-row
  // tensors are fine. Both tensors are contiguous with the same trailing shape and dtype, on the
  // group's device; `output` must not be read, nor `input` written, before Wait().
  virtual std::unique_ptr<PendingCollective> StartAllToAll(
      at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& receive_splits,
      const std::vector<int64_t>& send_splits) const = 0;
};

}  // namespace dta

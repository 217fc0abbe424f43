// AdamW with its state sharded across data-parallel ranks (ZeRO stage 1) and, optionally,
// offloaded to host memory: what lets a model whose optimizer state does not fit on every GPU
// train at all. It replaces both GradientSynchronizer (the all-reduce) and AdamW (the replicated
// state) on the trainer's data-parallel path.
//
// Layout. The parameters (all of one dtype, on one device) are numbered as one flat vector of N
// elements in their order, padded to world x S elements (S = ceil(N / world)); rank r owns the
// slice [r S, (r + 1) S) and keeps float32 master weights and both moments for it only (float64
// for float64 parameters), so the state costs 12 N / world bytes per rank instead of 12 N.
// Every parameter's .grad is a view into one flat gradient buffer of world x S elements (float32;
// float64 for float64 parameters), which the model's backward accumulates into as before.
//
// One step:
//   ReduceGradients()  in buckets, a SUM reduce-scatter of the flat gradients, so that this rank's
//                      slice of the buffer holds the sum over the ranks of its S gradients (the
//                      other slices keep this rank's own, unreduced values: read .grad only
//                      before).
//   Step()             the global gradient norm from every rank's slice (sums of squares in
//                      float64, all-reduced), the clip factor and the AdamW update of this rank's
//                      slice (AdamWUpdate: the arithmetic of AdamW, element for element), then, in
//                      buckets, the new weights rounded to the parameters' dtype and all-gathered
//                      into every rank's parameters.
// With offload the master weights and moments live in host memory and the GPU holds only the
// weights, the gradients and bucket-sized buffers. Where the update runs:
//   on the GPU (parameters on a GPU, OffloadUpdate::kOnDevice, the default): the state is
//     page-locked (PinnedHostZeros) and each bucket of it streams through the GPU: copied in on
//     one stream, updated by AdamWUpdate on the compute stream, copied back on a third, so that
//     the copies of the neighbouring buckets (both directions at once) overlap the update. 24 bytes
//     cross the bus per element, against ~30 bytes of host memory traffic for the host update and
//     far more bandwidth on the GPU's side. The bus is the step's limit, so the first
//     `resident_elements` of the slice (as many as the GPU's spare memory holds: the planner's
//     TrainingLayout::offload_resident_bytes) keep their state on the GPU and never cross it;
//     their update runs while the first streamed buckets travel.
//   on the host (parameters on the CPU, OffloadUpdate::kOnHost, or when the host memory cannot be
//     page-locked): each bucket of gradients is copied to the host and updated there in one fused
//     pass over every core (HostAdamWUpdate; float64 state keeps AdamWUpdate), the rounded weights
//     copied back, pipelined so that the copies of one bucket overlap the update of the next.
//
// Exactness: the update of an element is AdamW's, so with the same summed gradients and clip
// factor the weights equal AdamW's bit for bit (the state on the GPU or streamed through it; the
// host's fused float32 update: to float32 rounding); the global norm is the same sum in a
// different order (equal to ~1e-16 relative). The gradients' sum over the ranks rounds as the
// backend adds.
//
// State files (SaveState / LoadState): each rank writes its slice to its own safetensors file
// (ShardFileName), with "master", "exp_avg" and "exp_avg_sq" (the slice [begin, end) of the flat
// vector, unpadded) and the metadata {"format": "dta.adamw.sharded.v1", "numel", "begin", "end",
// "parameters" (a fingerprint of the names and shapes), "step", and the options}. LoadState reads
// the slices it needs from all the files of a checkpoint, so a checkpoint saved by any number of
// ranks resumes on any other number.
//
// Errors: c10::Error (TORCH_CHECK) naming the parameter, the file or the rank; a failed or
// timed-out collective leaves the group unusable (process_group.h).
// Thread safety: none; the group's collectives must not be interleaved with other calls on it.
//
// Example (every rank):
//   ShardedAdamW optimizer(group.get(), model.named_parameters(), {.lr = 1e-6},
//                          {.offload = true});
//   for (...) {
//     optimizer.ZeroGrad();
//     ComputeGradients(model, rollouts, loss_options, executor_options);
//     optimizer.ReduceGradients();
//     StepStats stats = optimizer.Step();
//   }
//   optimizer.SaveState(dir + "/" + ShardedAdamW::ShardFileName(rank, world));
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "executor/distributed/process_group.h"
#include "executor/optim/adamw.h"
#include "executor/parallel/tensor_parallel.h"

namespace dta {

// Where offloaded state is updated when the parameters are on a GPU (see the header comment).
enum class OffloadUpdate {
  kOnDevice,  // streamed through the GPU; the host update when the memory cannot be page-locked
  kOnHost,
};

struct ShardedAdamWOptions {
  // Master weights and moments in host memory (see the header comment).
  bool offload = false;
  OffloadUpdate offload_update = OffloadUpdate::kOnDevice;
  // Elements of this rank's slice per bucket: each reduce-scatter and all-gather moves world x
  // bucket_elements elements, and the offloaded update copies this many at a time. Must be > 0.
  int64_t bucket_elements = int64_t{16} << 20;
  // With offload streamed through the GPU: the first elements of this rank's slice whose state
  // stays on the GPU (rounded down to whole buckets; the whole slice when it holds it). The host
  // keeps a copy of all of it, brought up to date before it is read (SaveState, the accessors).
  // Ignored otherwise. Must be >= 0.
  int64_t resident_elements = 0;
  // Under tensor parallelism (the parameters are one TP rank's parts; `group` is the
  // data-parallel ranks of that TP rank): the global norm for clipping spans the TP ranks too.
  TensorParallelNorm tensor_parallel = {};
};

// Where the last offloaded Step() spent its time, seconds (zeros without offload).
struct OffloadTimes {
  // The host update: waiting for the gradients to reach the host (and the weights to leave).
  // Streamed through the GPU: waiting for the last bucket's state to reach the host.
  double copy_wait = 0;
  double update = 0;  // the host update (HostAdamWUpdate or AdamWUpdate); 0 when streamed
  double total = 0;   // the whole update and publication, the all-gathers included
};

class ShardedAdamW {
 public:
  // `group`: the data-parallel ranks the state is sharded across (must outlive this object), or
  // null for one rank (offload without sharding). `named_parameters`: as AdamW's, and moreover all
  // of one dtype and on one device (the group's device when there is a group). Every rank passes
  // the same list. Binds every parameter's .grad to its view of the gradient buffer (zeros).
  // TORCH_CHECK naming the parameter or option that is wrong.
  ShardedAdamW(ProcessGroup* group,
               std::vector<std::pair<std::string, at::Tensor>> named_parameters,
               AdamWOptions options = {}, ShardedAdamWOptions sharding = {});
  ShardedAdamW(const ShardedAdamW&) = delete;
  ShardedAdamW& operator=(const ShardedAdamW&) = delete;

  // Zeroes the gradient buffer (every .grad, kept bound to it).
  void ZeroGrad();

  // The reduce-scatter, as the header comment says. A .grad that was reset or replaced since
  // (undefined, or another tensor) is copied into the buffer and bound again first (zeros when
  // undefined). TORCH_CHECK naming the parameter when a grad's shape differs from its
  // parameter's, naming the rank and bucket when a collective fails.
  void ReduceGradients();

  // Clip and update this rank's slice, then all-gather the weights. Increments step(). When the
  // global norm is not finite nothing is updated on any rank and, as `on_nonfinite` says, every
  // rank raises (naming the parameter on the rank whose slice holds the non-finite gradient) or
  // every rank returns skipped = true.
  StepStats Step(NonFiniteGradients on_nonfinite = NonFiniteGradients::kRaise);

  // Step() in two halves, for parameters that clip together with other optimizers'
  // (TrainingOptimizer under expert parallelism): the sum of the squares of this rank's slice of
  // the reduced gradients as the global norm counts them (float64, no collective), and the step
  // given the global norm (every rank of the group calls it: the weights are all-gathered).
  double GradSquares() const;
  StepStats StepWithNorm(double grad_norm, NonFiniteGradients on_nonfinite);

  // Takes this rank's master slice from the parameters again (weights written into them by
  // other means); moments and the step count stay. No collective.
  void ResetMasterFromParameters();

  // Writes this rank's slice to `path` (see the header comment), replacing it atomically.
  void SaveState(const std::string& path) const;
  // Reads this rank's slice from `paths` (every file of one save, any number of ranks), then sets
  // the parameters to the rounded master weights (an all-gather: every rank calls it). Everything
  // is checked before anything changes: TORCH_CHECK naming the file when one cannot be read or its
  // format, fingerprint, element count or options disagree, or when the files do not cover this
  // rank's slice (naming the missing range).
  void LoadState(const std::vector<std::string>& paths);

  // "optimizer-00001-of-00004.safetensors": the file rank 1 of 4 saves.
  static std::string ShardFileName(int rank, int world);
  // The files ShardFileName names in `directory`, sorted; empty when there are none.
  static std::vector<std::string> ShardFiles(const std::string& directory);

  int64_t step() const { return step_; }
  const AdamWOptions& options() const { return options_; }
  void set_lr(double lr);
  const ShardedAdamWOptions& sharding() const { return sharding_; }
  const std::vector<std::pair<std::string, at::Tensor>>& named_parameters() const { return named_; }

  int rank() const { return rank_; }
  int world() const { return world_; }
  int64_t numel() const { return numel_; }                // N
  int64_t shard_begin() const { return rank_ * shard_; }  // r S
  int64_t shard_end() const;                              // min((r + 1) S, N)
  // This rank's state, [S] each (on the host when offloaded, the resident elements' copied there
  // first); master is undefined before the first Step or LoadState.
  const at::Tensor& master_shard() const;
  const at::Tensor& exp_avg_shard() const;
  const at::Tensor& exp_avg_sq_shard() const;
  // The elements of this rank's slice whose offloaded state stays on the GPU (0 without offload).
  int64_t resident_elements() const { return resident_; }
  const OffloadTimes& offload_times() const { return offload_times_; }
  // With offload: whether the update streams the state through the GPU, and if it was asked to
  // but cannot, why (the page-locking error; empty otherwise).
  bool streams_through_device() const { return streamed_; }
  const std::string& streaming_refused() const { return streaming_refused_; }

 private:
  // Calls fn(parameter index, offset in the parameter, elements, offset from flat_begin) for every
  // run of flat elements [flat_begin, flat_begin + count) that falls in a parameter.
  template <typename Fn>
  void ForEachPiece(int64_t flat_begin, int64_t count, Fn&& fn) const;
  // Row r of the [world, S] gradient buffer.
  at::Tensor GradShard() const;
  // For each bucket of this rank's slice: `produce(begin, count)` returns the new weights of
  // elements [shard_begin() + begin, + count) in the parameters' dtype on their device; they are
  // all-gathered and written into every rank's parameters.
  template <typename Produce>
  void PublishParameters(Produce&& produce);
  // [S] zeros of the state dtype where the master weights live (the page-locked block's row when
  // streaming).
  at::Tensor NewMaster() const;
  // This rank's slice of the parameters in the state dtype, where the state lives (padding zero).
  at::Tensor MasterFromParameters() const;
  // Step's update with the state in host memory (float32 state: HostAdamWUpdate, pipelined).
  void OffloadedUpdate(const at::Tensor& shard, double clip_coef, const AdamWStepScalars& scalars);
  // The resident elements' state: from the host copy to the GPU (the first `rows` of master,
  // exp_avg, exp_avg_sq), and back to the host copy (before it is read). No-ops without them.
  void LoadResident(int rows) const;
  void StoreResident() const;
  // Step's update with the state in page-locked host memory, streamed through the GPU.
  void StreamedUpdate(const at::Tensor& shard, double clip_coef, const AdamWStepScalars& scalars);
  std::string Describe(const char* what, int64_t bucket, int64_t buckets) const;

  ProcessGroup* group_;
  std::vector<std::pair<std::string, at::Tensor>> named_;
  AdamWOptions options_;
  ShardedAdamWOptions sharding_;
  int rank_ = 0;
  int world_ = 1;
  at::ScalarType param_dtype_;
  at::ScalarType state_dtype_;
  at::Device device_ = at::kCPU;
  std::vector<int64_t> offsets_;  // flat offset of each parameter; offsets_.back() == N
  int64_t numel_ = 0;
  int64_t shard_ = 0;          // S
  at::Tensor grads_;           // [world * S], the state dtype, on device_
  at::Tensor master_;          // [S], state dtype, on device_ or the host
  at::Tensor exp_avg_;         // [S]
  at::Tensor exp_avg_sq_;      // [S]
  at::Tensor pinned_;          // [3, S] page-locked host memory holding the three when streaming
  int64_t resident_ = 0;       // R: elements [0, R) of the slice keep their state on the GPU
  at::Tensor resident_state_;  // [3, R] on device_: the newest master, exp_avg, exp_avg_sq there
  bool streamed_ = false;
  std::string streaming_refused_;
  std::string fingerprint_;
  int64_t step_ = 0;
  OffloadTimes offload_times_;
};

}  // namespace dta

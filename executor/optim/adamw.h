// The trainer's optimizer: AdamW with global-norm gradient clipping, float32 master weights for
// low-precision parameters, and its state saved to / resumed from one safetensors file.
//
// One Step():
//   1. total = GlobalGradNorm(params): the L2 norm over every defined grad, accumulated in float64
//      (a parameter whose grad is undefined counts as zero). If it is not finite, NOTHING is
//      updated (parameters, moments, master weights and the step count stay as they were) and,
//      by default (NonFiniteGradients::kRaise), TORCH_CHECK fails naming the first parameter whose
//      grad holds a NaN or an infinity; with kSkip the step returns skipped = true instead (what
//      Megatron and AReaL's engines do with a loss spike: the caller zeroes the gradients and
//      goes on).
//   2. clip_coef = min(1, max_grad_norm / (total + 1e-6)) as torch.nn.utils.clip_grad_norm_
//      computes it (clip_coef = 1 when max_grad_norm <= 0). Every grad used below is g * clip_coef
//      (skipped when clip_coef == 1, which is bit-identical). The .grad tensors themselves are
//      never modified.
//   3. t = step() + 1, then for every parameter with a defined grad, with w its master weights
//      and g its (clipped) grad converted to the state dtype:
//        w  = w * (1 - lr * weight_decay)                         (decoupled weight decay)
//        m  = m * beta1 + (1 - beta1) * g
//        v  = v * beta2 + (1 - beta2) * g * g
//        w  = w - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//      and the parameter is set to w rounded to its dtype (round to nearest even). These are
//      the very tensor operations of LibTorch's torch::optim::AdamW::step (amsgrad off), so with
//      the same grads the results are bit-identical to it; Python's torch.optim.AdamW computes
//      m with lerp_ and agrees up to rounding. Parameters whose grad is undefined are
//      left alone (no decay, no moment update), as torch does; unlike torch, the step count t is
//      one count for the whole optimizer, so a parameter that misses steps still uses the global
//      t for its bias correction (the trainer gives every parameter a grad each step).
//
// State dtype and master weights: float64 parameters keep float64 moments, float32 parameters
// float32 moments, and for both the parameter itself is the master copy (nothing is duplicated).
// bfloat16 and float16 parameters keep float32 moments and a separate float32 master copy, which
// the update is applied to; the parameter is only ever its rounded image. The master copy is taken
// from the parameter at the first Step() (so weights loaded into the model after the optimizer is
// built are picked up) or restored by LoadState(); from then on the optimizer owns the values:
// writing a low-precision parameter by other means is overwritten at the next Step(). State lives
// on each parameter's device; moments are allocated (zeros) at construction.
//
// Saved state (SaveState / LoadState): one safetensors file with, for every parameter <p>,
// "<p>.exp_avg", "<p>.exp_avg_sq" and "<p>.master" (state dtype, the parameter's shape), and the
// metadata {"format": "dta.adamw.v1", "step", "lr", "beta1", "beta2", "eps", "weight_decay",
// "max_grad_norm"} (doubles in shortest round-trip form). Loading restores the step count, the
// options (as torch's load_state_dict restores its param_groups; change lr afterwards with
// set_lr), the moments, the master copies and the parameters (set to the rounded master), so a
// resumed run continues bit-identically to an uninterrupted one.
//
// Errors: c10::Error (TORCH_CHECK) naming the parameter, tensor or file.
// Thread safety: none; one call at a time.
//
// Example:
//   AdamW optimizer(model.named_parameters(), {.lr = 1e-6, .weight_decay = 0.01});
//   for (...) {
//     optimizer.ZeroGrad();
//     ComputeGradients(model, rollouts, loss_options, executor_options);
//     StepStats stats = optimizer.Step();
//   }
//   optimizer.SaveState("ckpt/optimizer.safetensors");
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "executor/optim/adamw_update.h"
#include "executor/parallel/tensor_parallel.h"

namespace dta {

struct StepStats {
  double grad_norm = 0.0;  // global L2 norm of the grads before clipping (NaN or inf if skipped)
  double clip_coef = 1.0;  // the factor applied to every grad (1 when not clipped)
  int64_t step = 0;        // the step count after this step (1 after the first)
  double lr = 0.0;         // the learning rate this step used
  bool skipped = false;    // the norm was not finite and nothing was updated (kSkip only)
};

// What Step() does when the global gradient norm is not finite (NaN or infinity). Either way
// nothing is updated; every rank of a distributed optimizer sees the same global norm, so all of
// them raise or all of them skip.
enum class NonFiniteGradients {
  kRaise,  // TORCH_CHECK naming the parameter whose gradient is not finite
  kSkip,   // return StepStats{.skipped = true}; the step count does not move
};

class AdamW {
 public:
  // `named_parameters`: the tensors to optimise, each defined, of dtype float64, float32, bfloat16
  // or float16, under distinct names and distinct tensors (the order is kept). TORCH_CHECK on a
  // violation, or on options outside lr >= 0, 0 <= beta1, beta2 < 1, eps >= 0,
  // weight_decay >= 0 (all finite).
  // With `tensor_parallel`, the parameters are one tensor-parallel rank's parts and the global
  // norm for clipping spans every rank's (a float64 scalar all-reduce per Step, every rank calls
  // it).
  AdamW(std::vector<std::pair<std::string, at::Tensor>> named_parameters, AdamWOptions options = {},
        TensorParallelNorm tensor_parallel = {});
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;
  AdamW(AdamW&&) = default;
  AdamW& operator=(AdamW&&) = default;

  // Clip, then one AdamW step under no-grad, as the header comment says. Increments step() even
  // when no parameter has a grad. When a grad is not finite nothing is updated and, as
  // `on_nonfinite` says, TORCH_CHECK names the parameter or the step is skipped.
  StepStats Step(NonFiniteGradients on_nonfinite = NonFiniteGradients::kRaise);

  // Step() in two halves, for parameters that clip together with other optimizers'
  // (TrainingOptimizer under expert parallelism): the sum of the squares of the gradients this rank
  // counts for the global norm (TensorParallelNorm::Counts; float64, no collective), and the step
  // given the global norm.
  double GradSquares() const;
  StepStats StepWithNorm(double grad_norm, NonFiniteGradients on_nonfinite);

  // Takes the master weights from the parameters again, as at the first Step (for weights
  // written into the parameters by other means, e.g. a checkpoint loaded into a live model);
  // moments and the step count stay.
  void ResetMasterFromParameters();

  // Zeroes every defined grad in place (keeping its memory), or with set_to_none resets every
  // grad to undefined.
  void ZeroGrad(bool set_to_none = false);

  // Writes the state (see the header comment), replacing `path` atomically. State on a GPU is
  // copied to host memory first (all of it at once). TORCH_CHECK naming the file on failure.
  void SaveState(const std::string& path) const;

  // Reads a file written by SaveState for the same parameters. Everything is checked before
  // anything changes; TORCH_CHECK naming the file and the tensor if the file cannot be read, the
  // format or a metadata entry is missing or invalid, a parameter's tensor is missing, has another
  // shape or dtype than this optimizer's state, or the file holds a tensor this optimizer has no
  // parameter for. On success restores step, options, moments, master weights and parameters.
  void LoadState(const std::string& path);

  int64_t step() const { return step_; }
  const AdamWOptions& options() const { return options_; }
  // For learning-rate schedules; TORCH_CHECK lr >= 0 and finite.
  void set_lr(double lr);
  const std::vector<std::pair<std::string, at::Tensor>>& named_parameters() const { return named_; }

  // Introspection (tests, debugging). TORCH_CHECK if there is no parameter `name`.
  // The master weights: the parameter itself for float32 / float64 parameters; for low-precision
  // ones the float32 copy, or before it exists (no Step or LoadState yet) the parameter
  // converted to float32 (a fresh tensor).
  at::Tensor master(std::string_view name) const;
  at::Tensor exp_avg(std::string_view name) const;
  at::Tensor exp_avg_sq(std::string_view name) const;

 private:
  struct ParamState {
    at::ScalarType dtype;  // the state dtype: float64 or float32
    at::Tensor exp_avg;
    at::Tensor exp_avg_sq;
    at::Tensor master;  // low-precision parameters only; undefined until the first Step / Load
  };

  size_t IndexOf(std::string_view name) const;
  // The master weights of parameter i (the parameter itself when it is in the state dtype),
  // creating the low-precision copy from the parameter if it does not exist yet.
  at::Tensor& MasterFor(size_t i);

  std::vector<std::pair<std::string, at::Tensor>> named_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in named_
  std::vector<ParamState> states_;
  AdamWOptions options_;
  TensorParallelNorm tensor_parallel_;
  int64_t step_ = 0;
};

// Global L2 norm of the defined grads of `named_parameters` (undefined grads count as zero), each
// tensor's norm and the total accumulated in float64, as torch.nn.utils.clip_grad_norm_ combines
// them (the norm of the per-tensor norms). NaN or infinity when a grad holds one.
double GlobalGradNorm(const std::vector<std::pair<std::string, at::Tensor>>& named_parameters);

}  // namespace dta

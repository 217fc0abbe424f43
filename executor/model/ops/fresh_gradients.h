// Gradients that a step overwrites instead of adding to, so that their zero fill is skipped.
//
// A training step zeroes every gradient and then adds each backward chunk's contribution. For the
// experts' stacked weights of a mixture-of-experts model the gradients are most of the memory
// (Qwen3-Next: 6.4 GB of float32 a layer), and the zero fill plus the first chunk's read of those
// zeros are a tenth of the step's expert work. With ExecutorOptions::replace_gradients the run
// marks such gradients fresh instead of zeroing them; the first writer of each takes the mark and
// writes its whole gradient (kernels::AddGroupedWeightGrad's overwrite), later chunks add as usual,
// and the marks nobody took are zero-filled when the run ends, so nothing outside the run ever
// reads a stale gradient.
//
// Example:
//   FreshGradients fresh;
//   fresh.Mark(param.grad());                  // its contents are now stale
//   if (fresh.Take(grad)) { grad = product; }  // the first writer
//   else { grad += product; }
//   fresh.ZeroUntaken();                       // at the end of the run
//
// Thread safety: Mark, Take and ZeroUntaken may be called from any thread (autograd runs backward
// on its own threads).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace dta {

class FreshGradients {
 public:
  FreshGradients() = default;
  FreshGradients(const FreshGradients&) = delete;
  FreshGradients& operator=(const FreshGradients&) = delete;
  // A run that ends with marks untaken (an exception in backward) leaves zeros, not stale values.
  ~FreshGradients();

  // Marks `grad` (a parameter's defined .grad) as holding stale values that stand for zeros.
  void Mark(const at::Tensor& grad);
  // True once per mark of this very tensor: the caller then writes all of `grad` (every element),
  // instead of adding to it. False for tensors not marked or already taken.
  bool Take(const at::Tensor& grad);
  // Zero-fills the marked gradients no writer took, and forgets every mark.
  void ZeroUntaken();

  // Handles that carry a FreshGradients through autograd functions' saved_data (0 for null), as
  // GroupHandle in ops/numerics.h carries a group: the run that owns it outlives its graphs.
  static int64_t Handle(FreshGradients* fresh) { return reinterpret_cast<int64_t>(fresh); }
  static FreshGradients* FromHandle(int64_t handle) {
    return reinterpret_cast<FreshGradients*>(handle);
  }

 private:
  std::mutex mutex_;
  std::vector<at::Tensor> marked_;  // guarded by mutex_
};

}  // namespace dta

#include "executor/model/ops/fresh_gradients.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <exception>
#include <utility>

namespace dta {

FreshGradients::~FreshGradients() {
  // Only marks an unwinding run left behind remain here; a failure to zero them (the device's
  // error that unwound the run) must not escape a destructor.
  try {
    ZeroUntaken();
  } catch (const std::exception&) {
  }
}

void FreshGradients::Mark(const at::Tensor& grad) {
  TORCH_CHECK(grad.defined(), "FreshGradients::Mark: an undefined gradient");
  std::lock_guard<std::mutex> lock(mutex_);
  marked_.push_back(grad);
}

bool FreshGradients::Take(const at::Tensor& grad) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = std::find_if(marked_.begin(), marked_.end(),
                               [&](const at::Tensor& marked) { return marked.is_same(grad); });
  if (it == marked_.end()) return false;
  marked_.erase(it);
  return true;
}

void FreshGradients::ZeroUntaken() {
  std::vector<at::Tensor> untaken;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    untaken = std::exchange(marked_, {});
  }
  at::NoGradGuard no_grad;
  for (at::Tensor& grad : untaken) grad.zero_();
}

}  // namespace dta

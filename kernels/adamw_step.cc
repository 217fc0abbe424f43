#include "kernels/adamw_step.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include "kernels/adamw_step_internal.h"
#include "kernels/cuda_dispatch.h"

namespace dta::kernels {
namespace {

// Whether t is a contiguous float32 tensor of master's size on master's device.
bool LikeMaster(const at::Tensor& t, const at::Tensor& master) {
  return t.defined() && internal::Dense(t, at::kFloat, master.device()) &&
         t.numel() == master.numel();
}

// Whether no two of the tensors share memory (the kernel reads each element once and writes it
// once; aliased operands would see each other's writes, where the ops see whole tensors).
bool Disjoint(std::initializer_list<const at::Tensor*> tensors) {
  for (auto a = tensors.begin(); a != tensors.end(); ++a) {
    for (auto b = a + 1; b != tensors.end(); ++b) {
      if (at::get_overlap_status(**a, **b) != at::MemOverlapStatus::No) return false;
    }
  }
  return true;
}

}  // namespace

bool FusedAdamWStepTakes(const at::Tensor& master, const at::Tensor& exp_avg,
                         const at::Tensor& exp_avg_sq, const at::Tensor& grad) {
  return master.defined() && internal::CudaKernelsFor(master, "DTA_FUSED_ADAMW") &&
         LikeMaster(master, master) && LikeMaster(exp_avg, master) &&
         LikeMaster(exp_avg_sq, master) && LikeMaster(grad, master) &&
         Disjoint({&master, &exp_avg, &exp_avg_sq, &grad});
}

void FusedAdamWStep(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                    const at::Tensor& grad, const AdamWStepFloats& floats) {
  TORCH_CHECK(master.defined() && master.is_cuda() && LikeMaster(master, master),
              "FusedAdamWStep: master must be a contiguous float32 CUDA tensor");
  const std::pair<const char*, const at::Tensor*> others[] = {
      {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}, {"grad", &grad}};
  for (const auto& [name, t] : others) {
    TORCH_CHECK(LikeMaster(*t, master), "FusedAdamWStep: ", name,
                " must be a contiguous float32 tensor of master's ", master.numel(),
                " elements on ", master.device());
  }
  TORCH_CHECK(Disjoint({&master, &exp_avg, &exp_avg_sq, &grad}),
              "FusedAdamWStep: master, exp_avg, exp_avg_sq and grad must not share memory");
#ifdef DTA_KERNELS_HAVE_CUDA
  internal::AdamWStepCuda(master.data_ptr<float>(), exp_avg.data_ptr<float>(),
                          exp_avg_sq.data_ptr<float>(), grad.data_ptr<float>(), master.numel(),
                          floats, master.device());
#else
  (void)floats;
  TORCH_CHECK(false, "FusedAdamWStep: dta was built without CUDA kernels");
#endif
}

}  // namespace dta::kernels

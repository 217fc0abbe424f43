// The CUDA path of kernels/adamw_step.h: a grid-stride loop over the elements, four at a time in
// 16-byte words when every array is 16-byte aligned. Every operation rounds to float32 through an
// explicit intrinsic (__fmul_rn, __fmaf_rn, ...), so the compiler cannot contract or reorder it:
// the sequence is ATen's (see the header comment), not whatever the optimizer would make of it.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

#include "kernels/adamw_step_internal.h"

namespace dta::kernels::internal {
namespace {

constexpr int kThreads = 256;

// One element, as LibTorch's op-by-op step computes it (kernels/adamw_step.h).
__device__ __forceinline__ void StepElement(const AdamWStepFloats& f, float& w, float& m, float& v,
                                            float g) {
  g = __fmul_rn(g, f.grad_scale);                              // grad.mul(clip)
  w = __fmul_rn(w, f.decay);                                   // master.mul_(1 - lr wd)
  m = __fmaf_rn(f.one_minus_beta1, g, __fmul_rn(m, f.beta1));  // mul_(b1).add_(g, 1 - b1)
  const float v_decayed = __fmul_rn(v, f.beta2);               // mul_(b2)
  v = f.one_minus_beta2 == 1.0f ? __fmaf_rn(g, g, v_decayed)   // addcmul_(g, g, 1)
                                : __fmaf_rn(f.one_minus_beta2, __fmul_rn(g, g), v_decayed);
  const float denom =  // (sqrt(v) / bc2).add_(eps)
      __fadd_rn(__fmul_rn(__fsqrt_rn(v), f.inv_bias_correction2_sqrt), f.eps);
  w = __fmaf_rn(f.neg_step_size, __fdiv_rn(m, denom), w);  // addcdiv_(m, denom, -step)
}

template <bool kVectorized>
__global__ void __launch_bounds__(kThreads)
    AdamWStepKernel(float* __restrict__ master, float* __restrict__ exp_avg,
                    float* __restrict__ exp_avg_sq, const float* __restrict__ grad, int64_t n,
                    AdamWStepFloats f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  int64_t scalar_begin = 0;
  if constexpr (kVectorized) {
    const int64_t words = n / 4;
    for (int64_t i = first; i < words; i += stride) {
      float4 w = reinterpret_cast<float4*>(master)[i];
      float4 m = reinterpret_cast<float4*>(exp_avg)[i];
      float4 v = reinterpret_cast<float4*>(exp_avg_sq)[i];
      const float4 g = reinterpret_cast<const float4*>(grad)[i];
      StepElement(f, w.x, m.x, v.x, g.x);
      StepElement(f, w.y, m.y, v.y, g.y);
      StepElement(f, w.z, m.z, v.z, g.z);
      StepElement(f, w.w, m.w, v.w, g.w);
      reinterpret_cast<float4*>(master)[i] = w;
      reinterpret_cast<float4*>(exp_avg)[i] = m;
      reinterpret_cast<float4*>(exp_avg_sq)[i] = v;
    }
    scalar_begin = words * 4;
  }
  for (int64_t i = scalar_begin + first; i < n; i += stride) {
    StepElement(f, master[i], exp_avg[i], exp_avg_sq[i], grad[i]);
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void AdamWStepCuda(float* master, float* exp_avg, float* exp_avg_sq, const float* grad, int64_t n,
                   const AdamWStepFloats& floats, const at::Device& device) {
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
  const bool vectorized =
      Aligned16(master) && Aligned16(exp_avg) && Aligned16(exp_avg_sq) && Aligned16(grad);
  // Enough blocks to fill every SM several times over; the loop strides over the rest.
  const int64_t per_thread = vectorized ? 4 : 1;
  const int64_t wanted = (n / per_thread + kThreads - 1) / kThreads + 1;
  const int64_t resident =
      static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 8;
  const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min(wanted, resident)));
  if (vectorized) {
    AdamWStepKernel<true>
        <<<blocks, kThreads, 0, stream>>>(master, exp_avg, exp_avg_sq, grad, n, floats);
  } else {
    AdamWStepKernel<false>
        <<<blocks, kThreads, 0, stream>>>(master, exp_avg, exp_avg_sq, grad, n, floats);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dta::kernels::internal

// The log-sum-exp merge of kernels/chunk_attention.h: one warp per (token, head) row.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "kernels/dependent_launch.cuh"

namespace dta::kernels::internal {
namespace {

constexpr int kMergeWarps = 8;

__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(float v) { return v; }
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ float FromFloat(float v) {
  return v;
}

// out = out_a w_a + out_b w_b with w_p = exp(lse_p - lse), lse = log(exp(lse_a) + exp(lse_b)),
// in float32, rounded once. out_* [T, H, D]; lse_* [H, T].
template <typename T>
__global__ void MergeAttentionKernel(const T* out_a, const float* lse_a, const T* out_b,
                                     const float* lse_b, T* out, float* lse, int64_t tokens,
                                     int64_t heads, int64_t dim) {
  WaitForPreviousKernels();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kMergeWarps + threadIdx.x / 32;
  if (row >= tokens * heads) return;
  const int lane = threadIdx.x % 32;
  const int64_t t = row / heads;
  const int64_t h = row % heads;
  const float la = lse_a[h * tokens + t];
  const float lb = lse_b[h * tokens + t];
  const float m = fmaxf(la, lb);
  const float ea = expf(la - m);
  const float eb = expf(lb - m);
  const float sum = ea + eb;
  const float wa = ea / sum;
  const float wb = eb / sum;
  const int64_t base = row * dim;
  for (int64_t c = lane; c < dim; c += 32) {
    out[base + c] = FromFloat<T>(ToFloat(out_a[base + c]) * wa + ToFloat(out_b[base + c]) * wb);
  }
  if (lane == 0) lse[h * tokens + t] = m + logf(sum);
}

template <typename T>
void Launch(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
            const at::Tensor& lse_b, at::Tensor& out, at::Tensor& lse) {
  const int64_t rows = out_a.size(0) * out_a.size(1);
  const int64_t blocks = (rows + kMergeWarps - 1) / kMergeWarps;
  C10_CUDA_CHECK(LaunchAfterPrevious(
      MergeAttentionKernel<T>, static_cast<unsigned>(blocks), 32 * kMergeWarps, 0,
      at::cuda::getCurrentCUDAStream(), static_cast<const T*>(out_a.data_ptr()),
      lse_a.data_ptr<float>(), static_cast<const T*>(out_b.data_ptr()), lse_b.data_ptr<float>(),
      static_cast<T*>(out.data_ptr()), lse.data_ptr<float>(), out_a.size(0), out_a.size(1),
      out_a.size(2)));
}

}  // namespace

void MergeAttentionCuda(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                        const at::Tensor& lse_b, at::Tensor& out, at::Tensor& lse) {
  if (out_a.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(out_a.device());
  switch (out_a.scalar_type()) {
    case at::kBFloat16:
      return Launch<__nv_bfloat16>(out_a, lse_a, out_b, lse_b, out, lse);
    case at::kHalf:
      return Launch<__half>(out_a, lse_a, out_b, lse_b, out, lse);
    case at::kFloat:
      return Launch<float>(out_a, lse_a, out_b, lse_b, out, lse);
    default:
      TORCH_CHECK(false, "MergeAttention: no kernel for ", out_a.scalar_type());
  }
}

}  // namespace dta::kernels::internal

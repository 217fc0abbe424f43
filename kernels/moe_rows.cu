// The CUDA path of kernels/moe_rows.h: one block per output row, its columns across the threads;
// a token's k pairs are summed in order j = 0 .. k - 1 in float32.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/dependent_launch.cuh"
#include "kernels/moe_rows_internal.h"

namespace dta::kernels::internal {
namespace {

constexpr int kThreads = 256;

// out[t] = sum_j term_j over token t's pairs j = 0 .. k - 1 (row r = inverse[t k + j]):
// a[r] * weights[t k + j] when kWeighted (the combine), else a[r] + b[r] (b may be null). Rounded
// products and sums, never fused (ATen's multiply or add, then its sum).
template <bool kWeighted>
__global__ void __launch_bounds__(kThreads)
    SumOverPairsKernel(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
                       const float* __restrict__ weights, const int64_t* __restrict__ inverse,
                       float* __restrict__ out, int64_t k, int64_t hidden) {
  WaitForPreviousKernels();
  const int64_t t = blockIdx.x;
  for (int64_t col = threadIdx.x; col < hidden; col += kThreads) {
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t at = inverse[t * k + j] * hidden + col;
      float term = __bfloat162float(a[at]);
      if constexpr (kWeighted) {
        term = __fmul_rn(term, weights[t * k + j]);
      } else if (b != nullptr) {
        term = __fadd_rn(term, __bfloat162float(b[at]));
      }
      sum = __fadd_rn(sum, term);
    }
    out[t * hidden + col] = sum;
  }
}

__global__ void __launch_bounds__(kThreads)
    GatherPairsKernel(const float* __restrict__ dy, const int64_t* __restrict__ token,
                      const float* __restrict__ w, __nv_bfloat16* __restrict__ rows,
                      __nv_bfloat16* __restrict__ scaled, int64_t hidden) {
  WaitForPreviousKernels();
  const int64_t p = blockIdx.x;
  const float* source = dy + token[p] * hidden;
  const float weight = w[p];
  for (int64_t col = threadIdx.x; col < hidden; col += kThreads) {
    const float value = source[col];
    rows[p * hidden + col] = __float2bfloat16_rn(value);
    scaled[p * hidden + col] = __float2bfloat16_rn(__fmul_rn(value, weight));
  }
}

const __nv_bfloat16* Bf16(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<const __nv_bfloat16*>(t.const_data_ptr()) : nullptr;
}
__nv_bfloat16* MutableBf16(at::Tensor& t) { return reinterpret_cast<__nv_bfloat16*>(t.data_ptr()); }

}  // namespace

void LaunchCombinePairs(const at::Tensor& rows, const at::Tensor& inverse,
                        const at::Tensor& weights, at::Tensor& y) {
  const c10::cuda::CUDAGuard guard(rows.device());
  C10_CUDA_CHECK(LaunchAfterPrevious(
      SumOverPairsKernel<true>, static_cast<unsigned>(y.size(0)), kThreads, 0,
      at::cuda::getCurrentCUDAStream(), Bf16(rows), nullptr, weights.const_data_ptr<float>(),
      inverse.const_data_ptr<int64_t>(), y.data_ptr<float>(), weights.size(1), rows.size(1)));
}

void LaunchGatherPairs(const at::Tensor& dy, const at::Tensor& token, const at::Tensor& w,
                       at::Tensor& rows, at::Tensor& scaled) {
  const c10::cuda::CUDAGuard guard(dy.device());
  C10_CUDA_CHECK(LaunchAfterPrevious(
      GatherPairsKernel, static_cast<unsigned>(token.numel()), kThreads, 0,
      at::cuda::getCurrentCUDAStream(), dy.const_data_ptr<float>(), token.const_data_ptr<int64_t>(),
      w.const_data_ptr<float>(), MutableBf16(rows), MutableBf16(scaled), dy.size(1)));
}

void LaunchSumPairs(const at::Tensor& a, const at::Tensor& b, const at::Tensor& inverse,
                    int64_t top_k, at::Tensor& dx) {
  const c10::cuda::CUDAGuard guard(a.device());
  C10_CUDA_CHECK(LaunchAfterPrevious(SumOverPairsKernel<false>, static_cast<unsigned>(dx.size(0)),
                                     kThreads, 0, at::cuda::getCurrentCUDAStream(), Bf16(a),
                                     Bf16(b), nullptr, inverse.const_data_ptr<int64_t>(),
                                     dx.data_ptr<float>(), top_k, a.size(1)));
}

}  // namespace dta::kernels::internal

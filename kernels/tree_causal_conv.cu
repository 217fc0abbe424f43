// The CUDA path of kernels/tree_causal_conv.h: one thread per (token or table row, channel), so a
// warp reads 32 consecutive channels of one row; every product and sum rounded separately.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "kernels/float_access.cuh"
#include "kernels/tree_causal_conv.h"
#include "kernels/tree_causal_conv_internal.h"

namespace dta::kernels::internal {
namespace {

constexpr int kThreads = 256;
// Tokens per partial sum of the weight's gradient (then the partials in order).
constexpr int64_t kTokensPerPartial = 256;

// The convolution's table: row 0 zeros, rows 1..p the context, rows p + 1.. x.
struct Table {
  In x;
  In context;
  int64_t p;
  int64_t channels;
};

Table TableOf(const at::Tensor& x, const at::Tensor& context) {
  return {InOf(x), context.numel() > 0 ? InOf(context) : InOf(x), context.size(0), x.size(1)};
}

__device__ __forceinline__ float TableAt(const Table& table, int64_t row, int64_t c) {
  if (row == 0) return 0.f;
  if (row <= table.p) return Load(table.context, (row - 1) * table.channels + c);
  return Load(table.x, (row - 1 - table.p) * table.channels + c);
}

// sum_j weight[c, j] * table[index[t, j], c], in order j = 0 .. kernel - 1.
__device__ __forceinline__ float PreActivation(const Table& table, In weight,
                                               const int64_t* __restrict__ index, int kernel,
                                               int64_t t, int64_t c) {
  float pre = 0.f;
  for (int j = 0; j < kernel; ++j) {
    const float tap = TableAt(table, index[t * kernel + j], c);
    pre = __fadd_rn(pre, __fmul_rn(tap, Load(weight, c * kernel + j)));
  }
  return pre;
}

// ATen's silu and its derivative's product with dy (float arithmetic, no contraction).
__device__ __forceinline__ float Sigmoid(float x) { return __fdiv_rn(1.f, 1.f + expf(-x)); }

__global__ void __launch_bounds__(kThreads)
    ConvForwardKernel(Table table, In weight, const int64_t* __restrict__ index, int kernel,
                      int64_t total, Out out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= total) return;
  const float pre =
      PreActivation(table, weight, index, kernel, i / table.channels, i % table.channels);
  Store(out, i, __fdiv_rn(pre, __fadd_rn(1.f, expf(-pre))));
}

__global__ void __launch_bounds__(kThreads)
    ConvPreGradKernel(In grad_out, Table table, In weight, const int64_t* __restrict__ index,
                      int kernel, int64_t total, float* __restrict__ dpre) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= total) return;
  const float pre =
      PreActivation(table, weight, index, kernel, i / table.channels, i % table.channels);
  const float s = Sigmoid(pre);
  dpre[i] =
      __fmul_rn(__fmul_rn(Load(grad_out, i), s), __fadd_rn(1.f, __fmul_rn(pre, __fsub_rn(1.f, s))));
}

// Table row r >= 1 (thread i: r = 1 + i / channels): the sum of dpre[t, c] * weight[c, j] over
// its pairs in sorted order, into the context's row r - 1 or x's row r - 1 - p.
__global__ void __launch_bounds__(kThreads)
    ConvTableGradKernel(const float* __restrict__ dpre, In weight,
                        const int64_t* __restrict__ pairs, const int64_t* __restrict__ starts,
                        int kernel, int64_t p, int64_t channels, int64_t total, Out dx,
                        Out dcontext) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= total) return;
  const int64_t row = 1 + i / channels, c = i % channels;
  float sum = 0.f;
  for (int64_t q = starts[row]; q < starts[row + 1]; ++q) {
    const int64_t pair = pairs[q];
    const int64_t t = pair / kernel;
    const int j = static_cast<int>(pair - t * kernel);
    sum = __fadd_rn(sum, __fmul_rn(dpre[t * channels + c], Load(weight, c * kernel + j)));
  }
  if (row <= p) {
    Store(dcontext, (row - 1) * channels + c, sum);
  } else {
    Store(dx, (row - 1 - p) * channels + c, sum);
  }
}

// partial[b, c, j] = sum over tokens t of block b (kTokensPerPartial each, in order) of
// dpre[t, c] * table[index[t, j], c]; blockIdx.y = b.
__global__ void __launch_bounds__(kThreads)
    ConvWeightPartialKernel(const float* __restrict__ dpre, Table table,
                            const int64_t* __restrict__ index, int kernel, int64_t tokens,
                            float* __restrict__ partial) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= table.channels) return;
  const int64_t b = blockIdx.y;
  const int64_t t1 = min(tokens, (b + 1) * kTokensPerPartial);
  float sum[kMaxConvTaps] = {};
  for (int64_t t = b * kTokensPerPartial; t < t1; ++t) {
    const float d = dpre[t * table.channels + c];
#pragma unroll
    for (int j = 0; j < kMaxConvTaps; ++j) {
      if (j < kernel) {
        const float tap = TableAt(table, index[t * kernel + j], c);
        sum[j] = __fadd_rn(sum[j], __fmul_rn(d, tap));
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kMaxConvTaps; ++j) {
    if (j < kernel) partial[(b * table.channels + c) * kernel + j] = sum[j];
  }
}

// dweight[i] = the partials of entry i summed in block order.
__global__ void __launch_bounds__(kThreads)
    ConvWeightSumKernel(const float* __restrict__ partial, int64_t blocks, int64_t entries,
                        Out dweight) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= entries) return;
  float sum = 0.f;
  for (int64_t b = 0; b < blocks; ++b) sum = __fadd_rn(sum, partial[b * entries + i]);
  Store(dweight, i, sum);
}

unsigned Blocks(int64_t threads) {
  return static_cast<unsigned>((threads + kThreads - 1) / kThreads);
}

}  // namespace

void LaunchConvForward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& context,
                       const at::Tensor& index, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t total = x.numel();
  ConvForwardKernel<<<Blocks(total), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      TableOf(x, context), InOf(weight), index.data_ptr<int64_t>(),
      static_cast<int>(weight.size(1)), total, OutOf(out));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void LaunchConvPreGrad(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& context, const at::Tensor& index, at::Tensor& dpre) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t total = x.numel();
  ConvPreGradKernel<<<Blocks(total), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      InOf(grad_out), TableOf(x, context), InOf(weight), index.data_ptr<int64_t>(),
      static_cast<int>(weight.size(1)), total, dpre.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void LaunchConvTableGrad(const at::Tensor& dpre, const at::Tensor& weight, const at::Tensor& pairs,
                         const at::Tensor& starts, at::Tensor& dx, at::Tensor& dcontext) {
  const c10::cuda::CUDAGuard guard(dpre.device());
  const int64_t channels = dpre.size(1);
  const int64_t total = (dx.size(0) + dcontext.size(0)) * channels;
  if (total == 0) return;
  ConvTableGradKernel<<<Blocks(total), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      dpre.data_ptr<float>(), InOf(weight), pairs.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
      static_cast<int>(weight.size(1)), dcontext.size(0), channels, total, OutOf(dx),
      dcontext.numel() > 0 ? OutOf(dcontext) : OutOf(dx));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void LaunchConvWeightGrad(const at::Tensor& dpre, const at::Tensor& x, const at::Tensor& context,
                          const at::Tensor& index, at::Tensor& dweight) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t tokens = x.size(0), channels = x.size(1), kernel = dweight.size(1);
  const int64_t blocks = (tokens + kTokensPerPartial - 1) / kTokensPerPartial;
  TORCH_CHECK(blocks <= 65535, "tree causal convolution: ", tokens, " tokens in one call");
  const at::Tensor partial = at::empty({blocks, channels, kernel}, dpre.options());
  const auto stream = at::cuda::getCurrentCUDAStream();
  ConvWeightPartialKernel<<<dim3(Blocks(channels), static_cast<unsigned>(blocks)), kThreads, 0,
                            stream>>>(dpre.data_ptr<float>(), TableOf(x, context),
                                      index.data_ptr<int64_t>(), static_cast<int>(kernel), tokens,
                                      partial.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  ConvWeightSumKernel<<<Blocks(channels * kernel), kThreads, 0, stream>>>(
      partial.data_ptr<float>(), blocks, channels * kernel, OutOf(dweight));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dta::kernels::internal

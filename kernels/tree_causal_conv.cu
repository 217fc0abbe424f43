// The CUDA path of kernels/tree_causal_conv.h: a thread per 8 consecutive channels (one 16-byte
// access of bfloat16 or float16 rows, two of float32) and a loop over tokens or table rows, so that
// a thread loads its channels' weights once and a warp reads 256 consecutive channels of a row;
// where channels or addresses do not allow it, a thread per channel. Every product and sum rounded
// separately, in the same order either way (bitwise the same results).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "core/base/env_switch.h"
#include "kernels/dependent_launch.cuh"
#include "kernels/float_access.cuh"
#include "kernels/tree_causal_conv.h"
#include "kernels/tree_causal_conv_internal.h"

namespace dta::kernels::internal {
namespace {

constexpr int kThreads = 256;
// Tokens per partial sum of the weight's gradient (then the partials in order).
constexpr int64_t kTokensPerPartial = 256;
// The most blocks along the token (or table row) dimension, each taking a contiguous range of
// them: a thread loads its channels' weights once for many tokens, and consecutive tokens read
// overlapping table rows (a row is tap j of one token and tap j - 1 of the next).
constexpr int64_t kMaxRowBlocks = 512;

// This block's range [begin, end) of `rows` rows split into gridDim.y contiguous ranges.
struct RowRange {
  int64_t begin, end;
};
__device__ __forceinline__ RowRange BlockRows(int64_t rows) {
  const int64_t per = (rows + gridDim.y - 1) / gridDim.y;
  const int64_t begin = blockIdx.y * per;
  return {begin, min(rows, begin + per)};
}

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

// Elements i .. i + kV - 1 of `in` as float32: Load8 for kV = kVector (i a multiple of 8, the
// data 16-byte aligned), else kV scalar loads.
template <int kV>
__device__ __forceinline__ void LoadRow(In in, int64_t i, float (&v)[kV]) {
  if constexpr (kV == kVector) {
    Load8(in, i, v);
  } else {
#pragma unroll
    for (int k = 0; k < kV; ++k) v[k] = Load(in, i + k);
  }
}

// v rounded to out's type into elements i .. i + kV - 1 (alignment as LoadRow's).
template <int kV>
__device__ __forceinline__ void StoreRow(Out out, int64_t i, const float (&v)[kV]) {
  if constexpr (kV == kVector) {
    Store8(out, i, v);
  } else {
#pragma unroll
    for (int k = 0; k < kV; ++k) Store(out, i + k, v[k]);
  }
}

// Channels c .. c + kV - 1 of table row `row`.
template <int kV>
__device__ __forceinline__ void TableRow(const Table& table, int64_t row, int64_t c,
                                         float (&v)[kV]) {
  if (row == 0) {
#pragma unroll
    for (int k = 0; k < kV; ++k) v[k] = 0.f;
  } else if (row <= table.p) {
    LoadRow<kV>(table.context, (row - 1) * table.channels + c, v);
  } else {
    LoadRow<kV>(table.x, (row - 1 - table.p) * table.channels + c, v);
  }
}

// weight[c + k, j] for the thread's channels and every tap j < kernel.
template <int kV>
__device__ __forceinline__ void LoadWeights(In weight, int64_t c, int kernel,
                                            float (&w)[kV][kMaxConvTaps]) {
#pragma unroll
  for (int k = 0; k < kV; ++k) {
#pragma unroll
    for (int j = 0; j < kMaxConvTaps; ++j)
      w[k][j] = j < kernel ? Load(weight, (c + k) * kernel + j) : 0.f;
  }
}

// pre[k] = sum_j weight[c + k, j] * table[index[t, j], c + k], in order j = 0 .. kernel - 1.
template <int kV>
__device__ __forceinline__ void PreActivation(const Table& table,
                                              const float (&w)[kV][kMaxConvTaps],
                                              const int64_t* __restrict__ index, int kernel,
                                              int64_t t, int64_t c, float (&pre)[kV]) {
#pragma unroll
  for (int k = 0; k < kV; ++k) pre[k] = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxConvTaps; ++j) {
    if (j < kernel) {
      float tap[kV];
      TableRow<kV>(table, index[t * kernel + j], c, tap);
#pragma unroll
      for (int k = 0; k < kV; ++k) pre[k] = __fadd_rn(pre[k], __fmul_rn(tap[k], w[k][j]));
    }
  }
}

// ATen's sigmoid (float arithmetic, no contraction).
__device__ __forceinline__ float Sigmoid(float x) { return __fdiv_rn(1.f, 1.f + expf(-x)); }

// The first channel of the thread (blockIdx.x, threadIdx.x) of blocks of kBlock threads, or -1
// past the channels.
template <int kV, int kBlock = kThreads>
__device__ __forceinline__ int64_t FirstChannel(int64_t channels) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x) * kV;
  return c < channels ? c : -1;
}

template <int kV>
__global__ void __launch_bounds__(kThreads)
    ConvForwardKernel(Table table, In weight, const int64_t* __restrict__ index, int kernel,
                      int64_t tokens, Out out) {
  WaitForPreviousKernels();
  const int64_t c = FirstChannel<kV>(table.channels);
  if (c < 0) return;
  float w[kV][kMaxConvTaps];
  LoadWeights<kV>(weight, c, kernel, w);
  const RowRange range = BlockRows(tokens);
  for (int64_t t = range.begin; t < range.end; ++t) {
    float v[kV];
    PreActivation<kV>(table, w, index, kernel, t, c, v);
#pragma unroll
    for (int k = 0; k < kV; ++k) v[k] = __fdiv_rn(v[k], __fadd_rn(1.f, expf(-v[k])));
    StoreRow<kV>(out, t * table.channels + c, v);
  }
}

template <int kV>
__global__ void __launch_bounds__(kThreads)
    ConvPreGradKernel(In grad_out, Table table, In weight, const int64_t* __restrict__ index,
                      int kernel, int64_t tokens, float* __restrict__ dpre) {
  WaitForPreviousKernels();
  const int64_t c = FirstChannel<kV>(table.channels);
  if (c < 0) return;
  float w[kV][kMaxConvTaps];
  LoadWeights<kV>(weight, c, kernel, w);
  const RowRange range = BlockRows(tokens);
  for (int64_t t = range.begin; t < range.end; ++t) {
    float pre[kV], g[kV];
    PreActivation<kV>(table, w, index, kernel, t, c, pre);
    LoadRow<kV>(grad_out, t * table.channels + c, g);
#pragma unroll
    for (int k = 0; k < kV; ++k) {
      const float s = Sigmoid(pre[k]);
      g[k] = __fmul_rn(__fmul_rn(g[k], s), __fadd_rn(1.f, __fmul_rn(pre[k], __fsub_rn(1.f, s))));
    }
    StoreRow<kV>(Out{dpre, Dtype::kFloat}, t * table.channels + c, g);
  }
}

// Table rows r >= 1 (the block's range of them): the sum of dpre[t, c] * weight[c, j] over the
// row's pairs in sorted order, into the context's row r - 1 or x's row r - 1 - p.
template <int kV>
__global__ void __launch_bounds__(kThreads)
    ConvTableGradKernel(const float* __restrict__ dpre, In weight,
                        const int64_t* __restrict__ pairs, const int64_t* __restrict__ starts,
                        int kernel, int64_t p, int64_t channels, int64_t rows, Out dx,
                        Out dcontext) {
  WaitForPreviousKernels();
  const int64_t c = FirstChannel<kV>(channels);
  if (c < 0) return;
  float w[kV][kMaxConvTaps];
  LoadWeights<kV>(weight, c, kernel, w);
  const RowRange range = BlockRows(rows);
  for (int64_t row = 1 + range.begin; row <= range.end; ++row) {
    float sum[kV];
#pragma unroll
    for (int k = 0; k < kV; ++k) sum[k] = 0.f;
    for (int64_t q = starts[row]; q < starts[row + 1]; ++q) {
      const int64_t pair = pairs[q];
      const int64_t t = pair / kernel;
      const int j = static_cast<int>(pair - t * kernel);
      float d[kV];
      LoadRow<kV>(In{dpre, Dtype::kFloat}, t * channels + c, d);
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        float weight_j = 0.f;
#pragma unroll
        for (int i = 0; i < kMaxConvTaps; ++i) weight_j = i == j ? w[k][i] : weight_j;
        sum[k] = __fadd_rn(sum[k], __fmul_rn(d[k], weight_j));
      }
    }
    if (row <= p) {
      StoreRow<kV>(dcontext, (row - 1) * channels + c, sum);
    } else {
      StoreRow<kV>(dx, (row - 1 - p) * channels + c, sum);
    }
  }
}

// partial[b, c, j] = sum over tokens t of block b (kTokensPerPartial each, in order) of
// dpre[t, c] * table[index[t, j], c]; blockIdx.y = b. Blocks of kPartialThreads threads: a call's
// few hundred token blocks times the channels' few blocks would not fill the GPU with larger ones.
constexpr int kPartialThreads = 64;
template <int kV>
__global__ void __launch_bounds__(kPartialThreads)
    ConvWeightPartialKernel(const float* __restrict__ dpre, Table table,
                            const int64_t* __restrict__ index, int kernel, int64_t tokens,
                            float* __restrict__ partial) {
  WaitForPreviousKernels();
  const int64_t c = FirstChannel<kV, kPartialThreads>(table.channels);
  if (c < 0) return;
  const int64_t b = blockIdx.y;
  const int64_t t1 = min(tokens, (b + 1) * kTokensPerPartial);
  float sum[kV][kMaxConvTaps] = {};
  for (int64_t t = b * kTokensPerPartial; t < t1; ++t) {
    float d[kV];
    LoadRow<kV>(In{dpre, Dtype::kFloat}, t * table.channels + c, d);
#pragma unroll
    for (int j = 0; j < kMaxConvTaps; ++j) {
      if (j < kernel) {
        float tap[kV];
        TableRow<kV>(table, index[t * kernel + j], c, tap);
#pragma unroll
        for (int k = 0; k < kV; ++k) sum[k][j] = __fadd_rn(sum[k][j], __fmul_rn(d[k], tap[k]));
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kV; ++k) {
#pragma unroll
    for (int j = 0; j < kMaxConvTaps; ++j) {
      if (j < kernel) partial[(b * table.channels + c + k) * kernel + j] = sum[k][j];
    }
  }
}

// dweight[i] = the partials of entry i summed in block order.
__global__ void __launch_bounds__(kThreads)
    ConvWeightSumKernel(const float* __restrict__ partial, int64_t blocks, int64_t entries,
                        Out dweight) {
  WaitForPreviousKernels();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= entries) return;
  float sum = 0.f;
  for (int64_t b = 0; b < blocks; ++b) sum = __fadd_rn(sum, partial[b * entries + i]);
  Store(dweight, i, sum);
}

unsigned Blocks(int64_t threads) {
  return static_cast<unsigned>((threads + kThreads - 1) / kThreads);
}

// Whether the 8-channel kernels take these tensors: whole vectors of channels, every row tensor
// 16-byte aligned (undefined or empty ones aside), and DTA_CONV_VECTORS not "0" (read at every
// launch: the before/after switch of benchmarks).
bool Vectorized(int64_t channels, std::initializer_list<const at::Tensor*> rows) {
  if (channels % kVector != 0 || !EnvSwitchOn("DTA_CONV_VECTORS")) return false;
  for (const at::Tensor* t : rows) {
    if (t->defined() && t->numel() > 0 && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0)
      return false;
  }
  return true;
}

// The grid of a kernel over `channels` (kV a thread) and `rows` tokens or table rows.
template <int kV>
dim3 Grid(int64_t channels, int64_t rows) {
  return dim3(Blocks((channels + kV - 1) / kV),
              static_cast<unsigned>(std::clamp<int64_t>(rows, 1, kMaxRowBlocks)));
}

}  // namespace

void LaunchConvForward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& context,
                       const at::Tensor& index, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t tokens = x.size(0), channels = x.size(1);
  const int kernel = static_cast<int>(weight.size(1));
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (Vectorized(channels, {&x, &context, &out})) {
    C10_CUDA_CHECK(LaunchAfterPrevious(ConvForwardKernel<kVector>, Grid<kVector>(channels, tokens),
                                       kThreads, 0, stream, TableOf(x, context), InOf(weight),
                                       index.data_ptr<int64_t>(), kernel, tokens, OutOf(out)));
  } else {
    C10_CUDA_CHECK(LaunchAfterPrevious(ConvForwardKernel<1>, Grid<1>(channels, tokens), kThreads, 0,
                                       stream, TableOf(x, context), InOf(weight),
                                       index.data_ptr<int64_t>(), kernel, tokens, OutOf(out)));
  }
}

void LaunchConvPreGrad(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& context, const at::Tensor& index, at::Tensor& dpre) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t tokens = x.size(0), channels = x.size(1);
  const int kernel = static_cast<int>(weight.size(1));
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (Vectorized(channels, {&grad_out, &x, &context, &dpre})) {
    C10_CUDA_CHECK(LaunchAfterPrevious(ConvPreGradKernel<kVector>, Grid<kVector>(channels, tokens),
                                       kThreads, 0, stream, InOf(grad_out), TableOf(x, context),
                                       InOf(weight), index.data_ptr<int64_t>(), kernel, tokens,
                                       dpre.data_ptr<float>()));
  } else {
    C10_CUDA_CHECK(LaunchAfterPrevious(ConvPreGradKernel<1>, Grid<1>(channels, tokens), kThreads, 0,
                                       stream, InOf(grad_out), TableOf(x, context), InOf(weight),
                                       index.data_ptr<int64_t>(), kernel, tokens,
                                       dpre.data_ptr<float>()));
  }
}

void LaunchConvTableGrad(const at::Tensor& dpre, const at::Tensor& weight, const at::Tensor& pairs,
                         const at::Tensor& starts, at::Tensor& dx, at::Tensor& dcontext) {
  const c10::cuda::CUDAGuard guard(dpre.device());
  const int64_t channels = dpre.size(1);
  const int64_t rows = dx.size(0) + dcontext.size(0);
  if (rows == 0 || channels == 0) return;
  const int kernel = static_cast<int>(weight.size(1));
  const Out dcontext_out = dcontext.numel() > 0 ? OutOf(dcontext) : OutOf(dx);
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (Vectorized(channels, {&dpre, &dx, &dcontext})) {
    C10_CUDA_CHECK(LaunchAfterPrevious(
        ConvTableGradKernel<kVector>, Grid<kVector>(channels, rows), kThreads, 0, stream,
        dpre.data_ptr<float>(), InOf(weight), pairs.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
        kernel, dcontext.size(0), channels, rows, OutOf(dx), dcontext_out));
  } else {
    C10_CUDA_CHECK(LaunchAfterPrevious(
        ConvTableGradKernel<1>, Grid<1>(channels, rows), kThreads, 0, stream,
        dpre.data_ptr<float>(), InOf(weight), pairs.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
        kernel, dcontext.size(0), channels, rows, OutOf(dx), dcontext_out));
  }
}

void LaunchConvWeightGrad(const at::Tensor& dpre, const at::Tensor& x, const at::Tensor& context,
                          const at::Tensor& index, at::Tensor& dweight) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t tokens = x.size(0), channels = x.size(1), kernel = dweight.size(1);
  const int64_t blocks = (tokens + kTokensPerPartial - 1) / kTokensPerPartial;
  TORCH_CHECK(blocks <= 65535, "tree causal convolution: ", tokens, " tokens in one call");
  const at::Tensor partial = at::empty({blocks, channels, kernel}, dpre.options());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto launch = [&](auto vector) {
    constexpr int kV = decltype(vector)::value;
    const int64_t threads = (channels + kV - 1) / kV;
    const auto channel_blocks =
        static_cast<unsigned>((threads + kPartialThreads - 1) / kPartialThreads);
    C10_CUDA_CHECK(LaunchAfterPrevious(
        ConvWeightPartialKernel<kV>, dim3(channel_blocks, static_cast<unsigned>(blocks)),
        kPartialThreads, 0, stream, dpre.data_ptr<float>(), TableOf(x, context),
        index.data_ptr<int64_t>(), static_cast<int>(kernel), tokens, partial.data_ptr<float>()));
  };
  if (Vectorized(channels, {&dpre, &x, &context})) {
    launch(std::integral_constant<int, kVector>());
  } else {
    launch(std::integral_constant<int, 1>());
  }
  C10_CUDA_CHECK(LaunchAfterPrevious(ConvWeightSumKernel, Blocks(channels * kernel), kThreads, 0,
                                     stream, partial.data_ptr<float>(), blocks, channels * kernel,
                                     OutOf(dweight)));
}

}  // namespace dta::kernels::internal

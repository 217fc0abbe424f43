// The CUDA kernels of kernels/head_norms.h: memory-bound, a warp per kRowsPerWarp consecutive
// (token, head) rows of D = 32 E columns, lane l holding columns l + 32 e, every row's loads
// issued before the first row's warp-wide sum (a row is only D elements). Elementwise arithmetic
// uses explicitly rounded float32 operations (__fmul_rn and friends, never contracted into FMAs)
// in the ATen path's order, so the two differ only in how a row's sums are ordered. The gated
// norm's weight gradient is per-block partial sums (a fixed number of blocks for a row count),
// summed by the caller: deterministic, without atomics.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

#include "kernels/dependent_launch.cuh"
#include "kernels/float_access.cuh"
#include "kernels/head_norms_internal.h"
#include "kernels/warp_sum.cuh"

namespace dta::kernels::internal {
namespace {

constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 4;
constexpr int64_t kRowsPerBlock = kWarps * kRowsPerWarp;
// The gated backward's blocks (its weight gradient's partial rows): enough for every SM to hold
// several, so that rows in flight hide the loads' latency.
constexpr int64_t kMaxGatedBackwardBlocks = 4096;
constexpr int64_t kMaxBlocks = 65535;

// Where row r = (token, head) of x and z starts: heads D apart, tokens x_stride and z_stride
// elements apart (z unused without the gate). Rows number fewer than 2^31 (checked at launch): one
// 32-bit division a row.
struct HeadRows {
  uint32_t heads;
  int64_t x_stride, z_stride;
  struct Bases {
    int64_t x, z;
  };
  template <int D>
  __device__ __forceinline__ Bases Of(int64_t row) const {
    const uint32_t token = static_cast<uint32_t>(row) / heads;
    const int64_t head_offset =
        static_cast<int64_t>(static_cast<uint32_t>(row) - token * heads) * D;
    return {token * x_stride + head_offset, token * z_stride + head_offset};
  }
};

HeadRows RowsOf(const at::Tensor& x, const at::Tensor& z) {
  TORCH_CHECK(x.size(0) * x.size(1) < (int64_t{1} << 31), "head norms: ", x.size(0) * x.size(1),
              " rows (at most 2^31 - 1)");
  return {static_cast<uint32_t>(x.size(1)), x.stride(0), z.defined() ? z.stride(0) : 0};
}

// ATen's float32 silu x / (1 + exp(-x)) and sigmoid 1 / (1 + exp(-x)), from one exp.
struct SiluTerms {
  float silu, sigmoid;
};
__device__ __forceinline__ SiluTerms SiluOf(float x) {
  const float denominator = __fadd_rn(1.0f, expf(-x));
  return {__fdiv_rn(x, denominator), __fdiv_rn(1.0f, denominator)};
}

// kGated: y = ((x r) w) silu(z), r = rsqrt(mean(x^2) + eps); else y = x r, r = rsqrt(sum(x^2) +
// eps).
template <int E, bool kGated>
__global__ void __launch_bounds__(32 * kWarps)
    HeadNormForwardKernel(In x, In w, In z, HeadRows layout, Out y, float* rstd, int64_t rows,
                          float eps) {
  WaitForPreviousKernels();
  constexpr int D = 32 * E;
  constexpr int R = kRowsPerWarp;
  const int lane = threadIdx.x % 32;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * R;
  if (first >= rows) return;
  [[maybe_unused]] float weight[E];
  [[maybe_unused]] float gate[R][E];
  float v[R][E];
  if constexpr (kGated) {
#pragma unroll
    for (int e = 0; e < E; ++e) weight[e] = Load(w, lane + 32 * e);
  }
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t row = first + i < rows ? first + i : first;  // past the end: a row read twice
    const HeadRows::Bases at = layout.Of<D>(row);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      v[i][e] = Load(x, at.x + lane + 32 * e);
      if constexpr (kGated) gate[i][e] = Load(z, at.z + lane + 32 * e);
    }
  }
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t row = first + i;
    if (row >= rows) break;
    float sum = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) sum = __fadd_rn(sum, __fmul_rn(v[i][e], v[i][e]));
    const float total = WarpSum(sum);
    const float r = rsqrtf(__fadd_rn(kGated ? __fmul_rn(total, 1.0f / D) : total, eps));
    if (lane == 0) rstd[row] = r;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float normed = __fmul_rn(v[i][e], r);
      Store(y, row * D + lane + 32 * e,
            kGated ? __fmul_rn(__fmul_rn(normed, weight[e]), SiluOf(gate[i][e]).silu) : normed);
    }
  }
}

// Per row: dn = dy (L2) or dy silu(z) w (gated), dx = r (dn - normed mean(dn normed)) (the sum
// for L2), and for the gated norm dz = ((dy (normed w)) s) (1 + z (1 - s)) with s = sigmoid(z)
// (ATen's silu backward) and the weight gradient's dy silu(z) normed, summed over each warp's
// rows in registers, then over the block's warps into its row of partials.
template <int E, bool kGated>
__global__ void __launch_bounds__(32 * kWarps)
    HeadNormBackwardKernel(In dy, In x, In w, In z, HeadRows layout, const float* rstd, Out dx,
                           Out dz, float* partials, int64_t rows) {
  WaitForPreviousKernels();
  constexpr int D = 32 * E;
  constexpr int R = kRowsPerWarp;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  [[maybe_unused]] float acc[E], weight[E];
  if constexpr (kGated) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      acc[e] = 0.0f;
      weight[e] = Load(w, lane + 32 * e);
    }
  }
  for (int64_t first = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * R; first < rows;
       first += static_cast<int64_t>(gridDim.x) * kWarps * R) {
    float d[R][E], xs[R][E], r[R];
    [[maybe_unused]] float zs[R][E];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int64_t row = first + i < rows ? first + i : first;  // past the end: a row read twice
      const HeadRows::Bases at = layout.Of<D>(row);
      r[i] = rstd[row];
#pragma unroll
      for (int e = 0; e < E; ++e) {
        d[i][e] = Load(dy, row * D + lane + 32 * e);
        xs[i][e] = Load(x, at.x + lane + 32 * e);
        if constexpr (kGated) zs[i][e] = Load(z, at.z + lane + 32 * e);
      }
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int64_t row = first + i;
      if (row >= rows) break;
      float normed[E], dn[E];
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        normed[e] = __fmul_rn(xs[i][e], r[i]);
        if constexpr (kGated) {
          const SiluTerms t = SiluOf(zs[i][e]);
          const float slope = __fadd_rn(1.0f, __fmul_rn(zs[i][e], __fsub_rn(1.0f, t.sigmoid)));
          const float da = __fmul_rn(d[i][e], __fmul_rn(normed[e], weight[e]));
          Store(dz, row * D + lane + 32 * e, __fmul_rn(__fmul_rn(da, t.sigmoid), slope));
          const float g = __fmul_rn(d[i][e], t.silu);
          acc[e] = __fadd_rn(acc[e], __fmul_rn(g, normed[e]));
          dn[e] = __fmul_rn(g, weight[e]);
        } else {
          dn[e] = d[i][e];
        }
        dot = __fadd_rn(dot, __fmul_rn(dn[e], normed[e]));
      }
      const float total = WarpSum(dot);
      const float mean = kGated ? __fmul_rn(total, 1.0f / D) : total;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        Store(dx, row * D + lane + 32 * e,
              __fmul_rn(r[i], __fsub_rn(dn[e], __fmul_rn(normed[e], mean))));
      }
    }
  }
  if constexpr (kGated) WriteBlockColumnSums<kWarps>(acc, partials);
}

// Calls launch(std::integral_constant<int, E>{}) for D = 32 E.
template <typename Launch>
void WithHeadDim(int64_t d, const Launch& launch) {
  switch (d) {
    case 64:
      return launch(std::integral_constant<int, 2>{});
    case 128:
      return launch(std::integral_constant<int, 4>{});
    case 256:
      return launch(std::integral_constant<int, 8>{});
    default:
      TORCH_CHECK(false, "head norms: no kernel for head_dim ", d);
  }
}

unsigned BlocksFor(int64_t rows, int64_t most) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, 1, most));
}

}  // namespace

int64_t HeadNormBackwardBlocks(int64_t rows) { return BlocksFor(rows, kMaxGatedBackwardBlocks); }

void HeadNormForwardCuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& z,
                         double eps, at::Tensor& y, at::Tensor& rstd) {
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t rows = x.size(0) * x.size(1);
  const bool gated = weight.defined();
  const In w = gated ? InOf(weight) : In{nullptr, Dtype::kFloat};
  const In gate = gated ? InOf(z) : In{nullptr, Dtype::kFloat};
  const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  WithHeadDim(x.size(2), [&](auto per_lane) {
    constexpr int E = decltype(per_lane)::value;
    auto* kernel = gated ? HeadNormForwardKernel<E, true> : HeadNormForwardKernel<E, false>;
    C10_CUDA_CHECK(LaunchAfterPrevious(kernel, blocks, 32 * kWarps, 0, stream, InOf(x), w, gate,
                                       RowsOf(x, z), OutOf(y), rstd.data_ptr<float>(), rows,
                                       static_cast<float>(eps)));
  });
}

void HeadNormBackwardCuda(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                          const at::Tensor& z, const at::Tensor& rstd, at::Tensor& dx,
                          at::Tensor& dz, at::Tensor& weight_partials) {
  const bool gated = weight.defined();
  if (x.numel() == 0) {
    if (gated) weight_partials.zero_();
    return;
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t rows = x.size(0) * x.size(1);
  const In none{nullptr, Dtype::kFloat};
  const unsigned blocks =
      gated ? static_cast<unsigned>(weight_partials.size(0)) : BlocksFor(rows, kMaxBlocks);
  WithHeadDim(x.size(2), [&](auto per_lane) {
    constexpr int E = decltype(per_lane)::value;
    auto* kernel = gated ? HeadNormBackwardKernel<E, true> : HeadNormBackwardKernel<E, false>;
    C10_CUDA_CHECK(LaunchAfterPrevious(kernel, blocks, 32 * kWarps, 0, stream, InOf(dy), InOf(x),
                                       gated ? InOf(weight) : none, gated ? InOf(z) : none,
                                       RowsOf(x, z), rstd.data_ptr<float>(), OutOf(dx),
                                       gated ? OutOf(dz) : Out{nullptr, Dtype::kFloat},
                                       gated ? weight_partials.data_ptr<float>() : nullptr, rows));
  });
}

}  // namespace dta::kernels::internal

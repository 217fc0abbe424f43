// The CUDA kernels of kernels/fused_layers.h. Memory-bound row and elementwise kernels: one block
// per run of a few residual-stream rows for RMSNorm, one warp per (token, head) for the q/k norm
// with RoPE, a grid-stride loop for SwiGLU. Elementwise arithmetic uses explicitly rounded float32
// operations (__fmul_rn and friends, never contracted into FMAs) in the ATen path's order, so the
// two paths differ only in how a row's sums are ordered. Norm weight gradients are per-block
// partial sums over row blocks whose number depends only on the row count, summed by the caller:
// deterministic, without atomics.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "kernels/dependent_launch.cuh"
#include "kernels/float_access.cuh"
#include "kernels/fused_layers_internal.h"
#include "kernels/warp_sum.cuh"

namespace dta::kernels::internal {
namespace {

// The sum of v over the block (at most 1,024 threads), on every thread. `shared` holds 32 floats.
__device__ float BlockSum(float v, float* shared) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  v = WarpSum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (blockDim.x + 31) / 32 ? shared[lane] : 0.0f;
    v = WarpSum(v);
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  v = shared[0];
  __syncthreads();  // shared is reused by the next call
  return v;
}

// The RMSNorm kernels over [rows, n]: a block of kNormThreads threads takes a run of
// kNormRowsPerBlock rows (more when the rows outnumber kNormMaxBlocks of them), thread t columns
// t + kNormThreads k (k < E), which it reads once per row into registers. Several blocks per SM
// overlap one block's row-wide sum with the others' loads; the backward's weight-gradient partials
// ([blocks, n]) stay a small fraction of the rows' bytes. A thread sums its columns in increasing
// order, as a strided loop over the row would. What a thread keeps across rows (the norm's weight,
// the backward's weight-gradient sums) lives in shared memory (NormColumns): in registers it took
// the backward at E = 16 (4,096-wide rows) to 160 registers, one block of 8 warps per SM; with
// them in shared memory it takes 128, two blocks per SM, and runs 1.6x faster on an H200 (a launch
// bound asking for three spilled and ran slower than one).
constexpr int kNormThreads = 256;
constexpr int64_t kNormRowsPerBlock = 4;
constexpr int64_t kNormMaxBlocks = 1024;

int64_t NormRowBlocks(int64_t rows) {
  return std::clamp<int64_t>((rows + kNormRowsPerBlock - 1) / kNormRowsPerBlock, 1, kNormMaxBlocks);
}

// The rows each of `blocks` blocks takes (the last one possibly fewer).
int64_t NormRowsPerBlock(int64_t rows, int64_t blocks) { return (rows + blocks - 1) / blocks; }

// Calls launch(std::integral_constant<int, E>{}) with the smallest instance E (columns per
// thread) of the RMSNorm kernels that covers a row of n <= kFusedNormMaxRow.
template <typename Launch>
void WithColumnsPerThread(int64_t n, const Launch& launch) {
  static_assert(kFusedNormMaxRow <= 32 * kNormThreads, "the largest instance covers a row");
  const int64_t per_thread = (n + kNormThreads - 1) / kNormThreads;
  if (per_thread <= 4) return launch(std::integral_constant<int, 4>{});
  if (per_thread <= 8) return launch(std::integral_constant<int, 8>{});
  if (per_thread <= 12) return launch(std::integral_constant<int, 12>{});
  if (per_thread <= 16) return launch(std::integral_constant<int, 16>{});
  if (per_thread <= 24) return launch(std::integral_constant<int, 24>{});
  return launch(std::integral_constant<int, 32>{});
}

__device__ __forceinline__ int64_t NormColumn(int k) {
  return threadIdx.x + static_cast<int64_t>(kNormThreads) * k;
}

// This thread's E columns of the row of n elements at `base` (0 past the row): a row of x or dy.
template <int E>
__device__ __forceinline__ void LoadNormColumns(In t, int64_t base, int64_t n, float (&values)[E]) {
#pragma unroll
  for (int k = 0; k < E; ++k) values[k] = NormColumn(k) < n ? Load(t, base + NormColumn(k)) : 0.0f;
}

// A float per column of the row in shared memory, of which this thread uses only its own E
// columns (no barrier needed; consecutive threads, consecutive banks): what a norm kernel keeps
// across its rows. `arrays` of them take NormSharedBytes<E>(arrays) of dynamic shared memory.
template <int E>
struct NormColumns {
  float* values;  // [E * kNormThreads]
  __device__ __forceinline__ float& operator[](int k) const { return values[NormColumn(k)]; }
};

template <int E>
constexpr size_t NormSharedBytes(int arrays) {
  return static_cast<size_t>(arrays) * E * kNormThreads * sizeof(float);
}

// The i-th of the kernel's NormColumns arrays.
template <int E>
__device__ __forceinline__ NormColumns<E> SharedNormColumns(int i) {
  extern __shared__ float norm_shared[];
  return {norm_shared + i * E * kNormThreads};
}

// The norm's weight (n elements) into this thread's columns of `weight` (0 past the row).
template <int E>
__device__ __forceinline__ void LoadNormWeight(In w, int64_t n, const NormColumns<E>& weight) {
#pragma unroll
  for (int k = 0; k < E; ++k) weight[k] = NormColumn(k) < n ? Load(w, NormColumn(k)) : 0.0f;
}

// y = w * (x * rstd) for this thread's columns of the row at `base`.
template <int E>
__device__ __forceinline__ void StoreNormed(Out y, int64_t base, int64_t n,
                                            const NormColumns<E>& weight, const float (&xs)[E],
                                            float r) {
#pragma unroll
  for (int k = 0; k < E; ++k) {
    if (NormColumn(k) < n)
      Store(y, base + NormColumn(k), __fmul_rn(weight[k], __fmul_rn(xs[k], r)));
  }
}

// The first row of this block's run and the end of the run.
__device__ __forceinline__ int64_t FirstNormRow(int64_t rows_per_block) {
  return static_cast<int64_t>(blockIdx.x) * rows_per_block;
}
__device__ __forceinline__ int64_t NormRowsEnd(int64_t rows, int64_t rows_per_block) {
  const int64_t end = FirstNormRow(rows_per_block) + rows_per_block;
  return end < rows ? end : rows;
}

// rstd = rsqrt(mean(x^2) + eps), y = w * (x * rstd), per row. With an addend (contiguous rows;
// null data: none) the row normalised is x + addend, rounded to sum's type as ATen's add rounds
// it, and written to sum (contiguous rows) on the way.
template <int E>
__global__ void __launch_bounds__(kNormThreads)
    RmsNormForwardKernel(In x, int64_t x_ld, In addend, Out sum_out, In w, Out y, float* rstd,
                         int64_t rows, int64_t n, int64_t rows_per_block, float eps) {
  WaitForPreviousKernels();
  __shared__ float shared[32];
  const NormColumns<E> weight = SharedNormColumns<E>(0);
  LoadNormWeight(w, n, weight);
  for (int64_t row = FirstNormRow(rows_per_block); row < NormRowsEnd(rows, rows_per_block); ++row) {
    float xs[E];
    LoadNormColumns(x, row * x_ld, n, xs);
    if (addend.data != nullptr) {
      float as[E];
      LoadNormColumns(addend, row * n, n, as);
#pragma unroll
      for (int k = 0; k < E; ++k) {
        xs[k] = Round(__fadd_rn(xs[k], as[k]), sum_out.type);
        if (NormColumn(k) < n) Store(sum_out, row * n + NormColumn(k), xs[k]);
      }
    }
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < E; ++k) sum = __fadd_rn(sum, __fmul_rn(xs[k], xs[k]));
    const float r = rsqrtf(__fadd_rn(__fmul_rn(BlockSum(sum, shared), 1.0f / n), eps));
    if (threadIdx.x == 0) rstd[row] = r;
    StoreNormed(y, row * n, n, weight, xs, r);
  }
}

// The forward's y from its rstd.
template <int E>
__global__ void __launch_bounds__(kNormThreads)
    RmsNormApplyKernel(In x, int64_t x_ld, In w, const float* rstd, Out y, int64_t rows, int64_t n,
                       int64_t rows_per_block) {
  WaitForPreviousKernels();
  const NormColumns<E> weight = SharedNormColumns<E>(0);
  LoadNormWeight(w, n, weight);
  for (int64_t row = FirstNormRow(rows_per_block); row < NormRowsEnd(rows, rows_per_block); ++row) {
    const float r = rstd[row];
    float xs[E];
    LoadNormColumns(x, row * x_ld, n, xs);
    StoreNormed(y, row * n, n, weight, xs, r);
  }
}

// dx and the weight gradient's partial sums in one pass over dy and x: per row, dot = sum of
// dn normed (one block-wide sum), then dx = rstd (dn - normed dot / n), dn = dy w, normed = x rstd;
// each thread adds its columns' dy normed over the block's rows (NormColumns) and writes them as
// the block's row of partials. A residual gradient (may be null) is loaded with the row, before the
// block-wide sum, so that its latency hides under the sum's.
template <int E>
__global__ void __launch_bounds__(kNormThreads)
    RmsNormBackwardKernel(In dy, In x, int64_t x_ld, In w, const float* rstd,
                          const float* __restrict__ residual, float* __restrict__ dx,
                          float* partials, int64_t rows, int64_t n, int64_t rows_per_block) {
  WaitForPreviousKernels();
  __shared__ float shared[32];
  const NormColumns<E> weight = SharedNormColumns<E>(0), acc = SharedNormColumns<E>(1);
  LoadNormWeight(w, n, weight);
#pragma unroll
  for (int k = 0; k < E; ++k) acc[k] = 0.0f;
  for (int64_t row = FirstNormRow(rows_per_block); row < NormRowsEnd(rows, rows_per_block); ++row) {
    const int64_t base = row * n;
    const float r = rstd[row];
    float xs[E], dys[E], res[E];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const int64_t c = NormColumn(k);
      xs[k] = c < n ? Load(x, row * x_ld + c) : 0.0f;
      dys[k] = c < n ? Load(dy, base + c) : 0.0f;
      res[k] = residual != nullptr && c < n ? residual[base + c] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < E; ++k) {
      dot = __fadd_rn(dot, __fmul_rn(__fmul_rn(dys[k], weight[k]), __fmul_rn(xs[k], r)));
    }
    const float mean = __fmul_rn(BlockSum(dot, shared), 1.0f / n);
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const int64_t c = NormColumn(k);
      if (c < n) {
        const float normed = __fmul_rn(xs[k], r);
        const float d =
            __fmul_rn(r, __fsub_rn(__fmul_rn(dys[k], weight[k]), __fmul_rn(normed, mean)));
        // The residual connection's gradient, one rounded add: the bits autograd's sum of the two
        // would give.
        dx[base + c] = residual != nullptr ? __fadd_rn(d, res[k]) : d;
        acc[k] = __fadd_rn(acc[k], __fmul_rn(dys[k], normed));
      }
    }
  }
#pragma unroll
  for (int k = 0; k < E; ++k) {
    if (NormColumn(k) < n) partials[static_cast<int64_t>(blockIdx.x) * n + NormColumn(k)] = acc[k];
  }
}

constexpr int kRopeWarps = 4;
// Rows a warp takes at once: their loads are all issued before the first row's warp-wide sum, so
// that enough bytes are in flight (a warp's row is only D elements).
constexpr int kRopeRowsPerWarp = 4;
constexpr int64_t kRopeRowsPerBlock = kRopeWarps * kRopeRowsPerWarp;

// A warp's rows are consecutive (token, head) rows starting at a multiple of kRopeRowsPerWarp, so
// with a head count that is a multiple of it they are one token's heads, whose rotary table row the
// warp then loads once, with the rows' values (loaded where used, after the values had arrived,
// the tables left the kernels waiting on memory most of their time: 1.1 TB/s on an H200).
// This lane's E columns of the table row of `row`'s token: cos and sin at columns lane + 32 e.
template <int E>
struct RopeTableColumns {
  float cos[E], sin[E];
  __device__ __forceinline__ void Load(const float* cos_table, const float* sin_table, int64_t row,
                                       int64_t heads, int lane) {
    const int64_t table = (row / heads) * (32 * E);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      cos[e] = cos_table[table + lane + 32 * e];
      sin[e] = sin_table[table + lane + 32 * e];
    }
  }
};

// A warp per kRopeRowsPerWarp consecutive (token, head) rows of D = 32 E columns; lane l holds
// columns l + 32 e, so the rotate-half partner of column c (c +- D/2) is element e +- E/2 of the
// same lane. With kNorm the q/k norm first (its output rounded to x's dtype, rstd written), else
// RoPE alone (the families without a q/k norm; w and rstd unused).
template <int E, bool kNorm>
__global__ void RopeForwardKernel(In x, In w, const float* cos, const float* sin, Out y,
                                  float* rstd, int64_t rows, int64_t heads, float eps) {
  WaitForPreviousKernels();
  constexpr int D = 32 * E;
  constexpr int R = kRopeRowsPerWarp;
  const int lane = threadIdx.x % 32;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kRopeWarps + threadIdx.x / 32) * R;
  if (first >= rows) return;
  [[maybe_unused]] float weight[E];
  float v[R][E];
  if constexpr (kNorm) {
#pragma unroll
    for (int e = 0; e < E; ++e) weight[e] = Load(w, lane + 32 * e);
  }
  const bool one_token = heads % R == 0;
  RopeTableColumns<E> tab;
  if (one_token) tab.Load(cos, sin, first, heads, lane);
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t row = first + i < rows ? first + i : first;  // past the end: a row read twice
#pragma unroll
    for (int e = 0; e < E; ++e) v[i][e] = Load(x, row * D + lane + 32 * e);
  }
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t row = first + i;
    if (row >= rows) break;
    if (!one_token) tab.Load(cos, sin, row, heads, lane);
    float normed[E];
    if constexpr (kNorm) {
      float sum = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) sum = __fadd_rn(sum, __fmul_rn(v[i][e], v[i][e]));
      const float r = rsqrtf(__fadd_rn(__fmul_rn(WarpSum(sum), 1.0f / D), eps));
      if (lane == 0) rstd[row] = r;
#pragma unroll
      for (int e = 0; e < E; ++e)
        normed[e] = Round(__fmul_rn(weight[e], __fmul_rn(v[i][e], r)), x.type);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) normed[e] = v[i][e];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float rotated = e < E / 2 ? -normed[e + E / 2] : normed[e - E / 2];
      Store(y, row * D + lane + 32 * e,
            __fadd_rn(__fmul_rn(normed[e], tab.cos[e]), __fmul_rn(rotated, tab.sin[e])));
    }
  }
}

// RoPE's backward (rounded to dy's dtype), then, with kNorm, the norm's; the warps stride over
// groups of kRopeRowsPerWarp rows (all their loads first), each keeping its lanes' share of the
// weight gradient, and the block's warps add theirs into its partial row. Without kNorm, RoPE's
// gradient is dx (x, w, rstd and partials unused).
template <int E, bool kNorm>
__global__ void RopeBackwardKernel(In dy, In x, In w, const float* rstd, const float* cos,
                                   const float* sin, Out dx, float* partials, int64_t rows,
                                   int64_t heads) {
  WaitForPreviousKernels();
  constexpr int D = 32 * E;
  constexpr int R = kRopeRowsPerWarp;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  [[maybe_unused]] float acc[E], weight[E];
  if constexpr (kNorm) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      acc[e] = 0.0f;
      weight[e] = Load(w, lane + 32 * e);
    }
  }
  const bool one_token = heads % R == 0;
  for (int64_t first = (static_cast<int64_t>(blockIdx.x) * kRopeWarps + warp) * R; first < rows;
       first += static_cast<int64_t>(gridDim.x) * kRopeWarps * R) {
    float d[R][E];
    [[maybe_unused]] float xs[R][E], rs[R];
    RopeTableColumns<E> tab;
    if (one_token) tab.Load(cos, sin, first, heads, lane);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int64_t row = first + i < rows ? first + i : first;  // past the end: a row read twice
      if constexpr (kNorm) rs[i] = rstd[row];
#pragma unroll
      for (int e = 0; e < E; ++e) {
        d[i][e] = Load(dy, row * D + lane + 32 * e);
        if constexpr (kNorm) xs[i][e] = Load(x, row * D + lane + 32 * e);
      }
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int64_t row = first + i;
      if (row >= rows) break;
      const int64_t base = row * D;
      if (!one_token) tab.Load(cos, sin, row, heads, lane);
      float g[E];
#pragma unroll
      for (int e = 0; e < E; ++e) {
        // g cos + [g2 sin2, -g1 sin1].
        const int partner = e < E / 2 ? e + E / 2 : e - E / 2;
        const float gs = __fmul_rn(d[i][partner], tab.sin[partner]);
        g[e] = Round(__fadd_rn(__fmul_rn(d[i][e], tab.cos[e]), e < E / 2 ? gs : -gs), dy.type);
      }
      if constexpr (!kNorm) {
#pragma unroll
        for (int e = 0; e < E; ++e) Store(dx, base + lane + 32 * e, g[e]);
      } else {
        const float r = rs[i];
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const float normed = __fmul_rn(xs[i][e], r);
          dot = __fadd_rn(dot, __fmul_rn(__fmul_rn(g[e], weight[e]), normed));
          acc[e] = __fadd_rn(acc[e], __fmul_rn(g[e], normed));
        }
        const float mean = __fmul_rn(WarpSum(dot), 1.0f / D);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const float normed = __fmul_rn(xs[i][e], r);
          const float dn = __fmul_rn(g[e], weight[e]);
          Store(dx, base + lane + 32 * e, __fmul_rn(r, __fsub_rn(dn, __fmul_rn(normed, mean))));
        }
      }
    }
  }
  if constexpr (kNorm) WriteBlockColumnSums<kRopeWarps>(acc, partials);
}

constexpr int kElementwiseThreads = 256;

int ElementwiseBlocks(int64_t n) {
  return static_cast<int>(
      std::min<int64_t>((n + kElementwiseThreads - 1) / kElementwiseThreads, int64_t{1} << 16));
}

// ATen's silu and sigmoid, x / (1 + exp(-x)) and 1 / (1 + exp(-x)), and the backward's products in
// the ATen path's order: ((g u) s) (1 + x (1 - s)) and (g x) s.
__device__ __forceinline__ float Silu(float x) { return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x))); }

struct SwiGluGradient {
  float dgate, dup, product;
};
__device__ __forceinline__ SwiGluGradient SwiGluAt(float g, float x, float u) {
  const float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x)));
  const float slope = __fadd_rn(1.0f, __fmul_rn(x, __fsub_rn(1.0f, s)));
  return {__fmul_rn(__fmul_rn(__fmul_rn(g, u), s), slope), __fmul_rn(__fmul_rn(g, x), s),
          __fmul_rn(Silu(x), u)};
}

// kVectorized: every tensor is 16-byte aligned, n is a multiple of 8, the outputs and gate/up are
// bfloat16 and d is bfloat16 or float32.
// gate and up are [rows, cols] at row stride `in_ld` (their own, or the two halves of one
// [rows, 2 cols] projection); d, out and product are contiguous [rows, cols]; dgate and dup are at
// row stride `out_ld`. Element i of the contiguous ones sits at row i / cols, column i % cols.
struct SwiGluLayout {
  int64_t cols, in_ld, out_ld;
  __device__ __forceinline__ int64_t In(int64_t i) const { return i / cols * in_ld + i % cols; }
  __device__ __forceinline__ int64_t Out(int64_t i) const { return i / cols * out_ld + i % cols; }
};

template <bool kVectorized>
__global__ void SwiGluForwardKernel(In gate, In up, Out out, int64_t n, SwiGluLayout layout) {
  WaitForPreviousKernels();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if constexpr (kVectorized) {
    for (int64_t i = first * kVector; i < n; i += stride * kVector) {
      float g[kVector], u[kVector];
      const int64_t at = layout.In(i);  // eight elements of one row (cols % 8 == 0)
      Load8(gate, at, g);
      Load8(up, at, u);
#pragma unroll
      for (int k = 0; k < kVector; ++k) g[k] = __fmul_rn(Silu(g[k]), u[k]);
      Store8(out, i, g);
    }
  } else {
    for (int64_t i = first; i < n; i += stride) {
      const int64_t at = layout.In(i);
      Store(out, i, __fmul_rn(Silu(Load(gate, at)), Load(up, at)));
    }
  }
}

template <bool kVectorized>
__global__ void SwiGluBackwardKernel(In d, In gate, In up, Out dgate, Out dup, Out product,
                                     int64_t n, SwiGluLayout layout) {
  WaitForPreviousKernels();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if constexpr (kVectorized) {
    for (int64_t i = first * kVector; i < n; i += stride * kVector) {
      float g[kVector], x[kVector], u[kVector], dg[kVector], du[kVector], pr[kVector];
      const int64_t in = layout.In(i), out = layout.Out(i);
      Load8(d, i, g);
      Load8(gate, in, x);
      Load8(up, in, u);
#pragma unroll
      for (int k = 0; k < kVector; ++k) {
        const SwiGluGradient r = SwiGluAt(g[k], x[k], u[k]);
        dg[k] = r.dgate, du[k] = r.dup, pr[k] = r.product;
      }
      Store8(dgate, out, dg);
      Store8(dup, out, du);
      if (product.data != nullptr) Store8(product, i, pr);
    }
  } else {
    for (int64_t i = first; i < n; i += stride) {
      const int64_t in = layout.In(i), out = layout.Out(i);
      const SwiGluGradient r = SwiGluAt(Load(d, i), Load(gate, in), Load(up, in));
      Store(dgate, out, r.dgate);
      Store(dup, out, r.dup);
      if (product.data != nullptr) Store(product, i, r.product);
    }
  }
}

// Gated attention's output gate, y = a sigmoid(x): ATen's sigmoid 1 / (1 + exp(-x)) and the
// backward's products in ATen's order, da = dy s and dx = ((dy a) (1 - s)) s (mul's, then
// sigmoid_backward's), so that the kernels give the ATen path's bits. a, dy, y, da and dx are
// contiguous [rows, cols]; x is at row stride `gate_ld` (the gate half of the query projection's
// [query, gate] rows). kVectorized: every tensor bfloat16 (dy bfloat16 or float32) and 16-byte
// aligned, cols, gate_ld and n multiples of 8.
struct GateLayout {
  int64_t cols, gate_ld;
  __device__ __forceinline__ int64_t Gate(int64_t i) const { return i / cols * gate_ld + i % cols; }
};

__device__ __forceinline__ float Sigmoid(float x) {
  return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x)));
}

template <bool kVectorized>
__global__ void SigmoidGateForwardKernel(In a, In x, Out y, int64_t n, GateLayout layout) {
  WaitForPreviousKernels();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if constexpr (kVectorized) {
    for (int64_t i = first * kVector; i < n; i += stride * kVector) {
      float av[kVector], xv[kVector];
      Load8(a, i, av);
      Load8(x, layout.Gate(i), xv);  // eight elements of one row (cols % 8 == 0)
#pragma unroll
      for (int k = 0; k < kVector; ++k) av[k] = __fmul_rn(av[k], Sigmoid(xv[k]));
      Store8(y, i, av);
    }
  } else {
    for (int64_t i = first; i < n; i += stride) {
      Store(y, i, __fmul_rn(Load(a, i), Sigmoid(Load(x, layout.Gate(i)))));
    }
  }
}

template <bool kVectorized>
__global__ void SigmoidGateBackwardKernel(In dy, In a, In x, Out da, Out dx, int64_t n,
                                          GateLayout layout) {
  WaitForPreviousKernels();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const auto gradients = [](float g, float av, float xv, float& dav, float& dxv) {
    const float s = Sigmoid(xv);
    dav = __fmul_rn(g, s);
    dxv = __fmul_rn(__fmul_rn(__fmul_rn(g, av), __fsub_rn(1.0f, s)), s);
  };
  if constexpr (kVectorized) {
    for (int64_t i = first * kVector; i < n; i += stride * kVector) {
      float g[kVector], av[kVector], xv[kVector], dav[kVector], dxv[kVector];
      Load8(dy, i, g);
      Load8(a, i, av);
      Load8(x, layout.Gate(i), xv);
#pragma unroll
      for (int k = 0; k < kVector; ++k) gradients(g[k], av[k], xv[k], dav[k], dxv[k]);
      Store8(da, i, dav);
      Store8(dx, i, dxv);
    }
  } else {
    for (int64_t i = first; i < n; i += stride) {
      float dav, dxv;
      gradients(Load(dy, i), Load(a, i), Load(x, layout.Gate(i)), dav, dxv);
      Store(da, i, dav);
      Store(dx, i, dxv);
    }
  }
}

template <int E>
void LaunchRopeForward(const at::Tensor& x, const at::Tensor& weight, double eps,
                       const at::Tensor& cos, const at::Tensor& sin, at::Tensor& y,
                       at::Tensor& rstd, cudaStream_t stream) {
  const int64_t rows = x.size(0) * x.size(1);
  const int blocks = static_cast<int>((rows + kRopeRowsPerBlock - 1) / kRopeRowsPerBlock);
  if (weight.defined()) {
    C10_CUDA_CHECK(LaunchAfterPrevious(RopeForwardKernel<E, true>, blocks, 32 * kRopeWarps, 0,
                                       stream, InOf(x), InOf(weight), cos.data_ptr<float>(),
                                       sin.data_ptr<float>(), OutOf(y), rstd.data_ptr<float>(),
                                       rows, x.size(1), static_cast<float>(eps)));
  } else {
    C10_CUDA_CHECK(LaunchAfterPrevious(RopeForwardKernel<E, false>, blocks, 32 * kRopeWarps, 0,
                                       stream, InOf(x), In{nullptr, Dtype::kFloat},
                                       cos.data_ptr<float>(), sin.data_ptr<float>(), OutOf(y),
                                       nullptr, rows, x.size(1), 0.0f));
  }
}

template <int E>
void LaunchRopeBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                        const at::Tensor& rstd, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor& dx, at::Tensor& partials, cudaStream_t stream) {
  const int64_t rows = dy.size(0) * dy.size(1);
  // One row of partials per block when there is a norm.
  const int blocks = static_cast<int>(
      weight.defined() ? partials.size(0)
                       : RmsNormRopeBackwardBlocks(rows, dy.size(2), dy.device().index()));
  if (weight.defined()) {
    C10_CUDA_CHECK(LaunchAfterPrevious(
        RopeBackwardKernel<E, true>, blocks, 32 * kRopeWarps, 0, stream, InOf(dy), InOf(x),
        InOf(weight), rstd.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
        OutOf(dx), partials.data_ptr<float>(), rows, dy.size(1)));
  } else {
    const In none{nullptr, Dtype::kFloat};
    C10_CUDA_CHECK(LaunchAfterPrevious(RopeBackwardKernel<E, false>, blocks, 32 * kRopeWarps, 0,
                                       stream, InOf(dy), none, none, nullptr, cos.data_ptr<float>(),
                                       sin.data_ptr<float>(), OutOf(dx), nullptr, rows,
                                       dy.size(1)));
  }
}

// The log-probability head (one slice of float32 logits [rows, vocab]). Row statistics: one block
// per row, each thread an online softmax over its strided elements (its max, sum exp(z - max) and
// sum exp(z - max) z, rescaled when the max grows), merged over the block.
constexpr int kRowStatsThreads = 512;

struct SoftmaxPartial {
  float max, sum, dot;
};

template <bool kWithDot>
__device__ __forceinline__ void AddLogit(SoftmaxPartial& p, float z) {
  if (z > p.max) {
    const float r = expf(p.max - z);  // 0 for the first element (max = -inf)
    p.sum *= r;
    if constexpr (kWithDot) p.dot *= r;
    p.max = z;
  }
  const float e = expf(z - p.max);
  p.sum += e;
  if constexpr (kWithDot) p.dot += e * z;
}

__device__ __forceinline__ SoftmaxPartial Merge(SoftmaxPartial a, SoftmaxPartial b) {
  if (b.max > a.max) {
    const SoftmaxPartial t = a;
    a = b;
    b = t;
  }
  if (b.max == -INFINITY) return a;
  const float r = expf(b.max - a.max);
  return {a.max, a.sum + b.sum * r, a.dot + b.dot * r};
}

__device__ __forceinline__ SoftmaxPartial MergeWarp(SoftmaxPartial p) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    p = Merge(p, {__shfl_xor_sync(0xffffffffu, p.max, offset),
                  __shfl_xor_sync(0xffffffffu, p.sum, offset),
                  __shfl_xor_sync(0xffffffffu, p.dot, offset)});
  }
  return p;
}

template <bool kWithDot>
__global__ void LogitRowStatsKernel(const float* __restrict__ logits, int64_t vocab,
                                    bool vectorized, const int64_t* __restrict__ targets,
                                    float* __restrict__ lse, float* __restrict__ target,
                                    float* __restrict__ mean) {
  WaitForPreviousKernels();
  const int64_t row = blockIdx.x;
  const float* z = logits + row * vocab;
  SoftmaxPartial p{-INFINITY, 0.f, 0.f};
  if (vectorized) {  // vocab % 4 == 0, 16-byte aligned rows
    const float4* z4 = reinterpret_cast<const float4*>(z);
    for (int64_t i = threadIdx.x; i < vocab / 4; i += blockDim.x) {
      const float4 v = z4[i];
      AddLogit<kWithDot>(p, v.x);
      AddLogit<kWithDot>(p, v.y);
      AddLogit<kWithDot>(p, v.z);
      AddLogit<kWithDot>(p, v.w);
    }
  } else {
    for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) AddLogit<kWithDot>(p, z[i]);
  }
  p = MergeWarp(p);
  __shared__ SoftmaxPartial warps[kRowStatsThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warps[warp] = p;
  __syncthreads();
  if (warp != 0) return;
  p = lane < static_cast<int>(blockDim.x / 32) ? warps[lane] : SoftmaxPartial{-INFINITY, 0.f, 0.f};
  p = MergeWarp(p);
  if (lane == 0) {
    lse[row] = p.max + logf(p.sum);
    target[row] = z[targets[row]];
    if constexpr (kWithDot) mean[row] = p.dot / p.sum;
  }
}

// The logits' gradient, elementwise in the ATen path's order and rounding (see LogitGradient):
// p = exp(z - lse); t = (z - mean) g_entropy + g_logprob, or g_logprob; d = -(p t); the target
// gets + g_logprob (times its weight); then times scale. Blocks (x, row) stride over the row.
// kVectorized (a bfloat16 output, the vocabulary a multiple of 8, both rows 16-byte aligned): eight
// elements per access, the float32 logits read as two float4 and the gradient written as one
// 16-byte store; each thread takes many such groups, so that a block's per-row set-up is paid once
// per thousands of elements, not per 256 (the scalar kernel ran at a third of the bandwidth).
template <bool kWithEntropy, bool kVectorized>
__global__ void LogitGradKernel(const float* __restrict__ logits, int64_t vocab,
                                const float* __restrict__ lse, const int64_t* __restrict__ targets,
                                const float* __restrict__ target_weight,
                                const float* __restrict__ grad_logprob,
                                const float* __restrict__ mean,
                                const float* __restrict__ grad_entropy, float scale, bool scaled,
                                Out out) {
  WaitForPreviousKernels();
  const int64_t row = blockIdx.y;
  const float l = lse[row], g = grad_logprob[row];
  const float m = kWithEntropy ? mean[row] : 0.f, ge = kWithEntropy ? grad_entropy[row] : 0.f;
  const int64_t y = targets[row];
  const float at_target = target_weight != nullptr ? __fmul_rn(g, target_weight[row]) : g;
  const auto gradient = [&](float z, int64_t i) {
    const float p = expf(__fsub_rn(z, l));
    const float t = kWithEntropy ? __fadd_rn(__fmul_rn(__fsub_rn(z, m), ge), g) : g;
    float d = -__fmul_rn(p, t);
    if (i == y) d = __fadd_rn(d, at_target);
    if (scaled) d = __fmul_rn(d, scale);
    return d;
  };
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if constexpr (kVectorized) {
    const In row_logits{logits + row * vocab, Dtype::kFloat};
    const Out row_out{static_cast<__nv_bfloat16*>(out.data) + row * vocab, Dtype::kBFloat16};
    for (int64_t group = first; group < vocab / kVector; group += stride) {
      const int64_t i = group * kVector;
      float d[kVector];
      Load8(row_logits, i, d);
#pragma unroll
      for (int k = 0; k < kVector; ++k) d[k] = gradient(d[k], i + k);
      Store8(row_out, i, d);
    }
  } else {
    for (int64_t i = first; i < vocab; i += stride) {
      Store(out, row * vocab + i, gradient(logits[row * vocab + i], i));
    }
  }
}

// A norm kernel of E columns per thread, with `arrays` NormColumns arrays of dynamic shared memory,
// on `blocks` blocks after the previous kernel. Above 48 KiB (E >= 24 with two arrays) the kernel
// must first be allowed the memory, on the current device.
template <int E, typename... Params, typename... Args>
[[nodiscard]] cudaError_t LaunchNorm(void (*kernel)(Params...), int arrays, int64_t blocks,
                                     cudaStream_t stream, Args&&... args) {
  const size_t bytes = NormSharedBytes<E>(arrays);
  if (bytes + 1024 > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return err;
  }
  return LaunchAfterPrevious(kernel, static_cast<unsigned>(blocks), kNormThreads, bytes, stream,
                             std::forward<Args>(args)...);
}

}  // namespace

void RmsNormForwardCuda(const at::Tensor& x, const at::Tensor& addend, const at::Tensor& weight,
                        double eps, at::Tensor& sum, at::Tensor& y, at::Tensor& rstd) {
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), n = x.size(1), blocks = NormRowBlocks(rows);
  const bool add = addend.defined();
  WithColumnsPerThread(n, [&](auto columns) {
    constexpr int E = decltype(columns)::value;
    C10_CUDA_CHECK(LaunchNorm<E>(
        RmsNormForwardKernel<E>, 1, blocks, at::cuda::getCurrentCUDAStream(), InOf(x), x.stride(0),
        add ? InOf(addend) : In{nullptr, Dtype::kFloat},
        add ? OutOf(sum) : Out{nullptr, Dtype::kFloat}, InOf(weight), OutOf(y),
        rstd.data_ptr<float>(), rows, n, NormRowsPerBlock(rows, blocks), static_cast<float>(eps)));
  });
}

void RmsNormApplyCuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rstd,
                      at::Tensor& y) {
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), n = x.size(1), blocks = NormRowBlocks(rows);
  WithColumnsPerThread(n, [&](auto columns) {
    constexpr int E = decltype(columns)::value;
    C10_CUDA_CHECK(LaunchNorm<E>(RmsNormApplyKernel<E>, 1, blocks, at::cuda::getCurrentCUDAStream(),
                                 InOf(x), x.stride(0), InOf(weight), rstd.data_ptr<float>(),
                                 OutOf(y), rows, n, NormRowsPerBlock(rows, blocks)));
  });
}

int64_t RmsNormBackwardBlocks(int64_t rows) { return NormRowBlocks(rows); }

void RmsNormBackwardCuda(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& rstd, const at::Tensor& residual, at::Tensor& dx,
                         at::Tensor& weight_partials) {
  if (x.numel() == 0) {
    weight_partials.zero_();
    return;
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t rows = x.size(0);
  const int64_t n = x.size(1);
  const int64_t blocks = weight_partials.size(0);
  WithColumnsPerThread(n, [&](auto columns) {
    constexpr int E = decltype(columns)::value;
    C10_CUDA_CHECK(LaunchNorm<E>(RmsNormBackwardKernel<E>, 2, blocks, stream, InOf(dy), InOf(x),
                                 x.stride(0), InOf(weight), rstd.data_ptr<float>(),
                                 residual.defined() ? residual.data_ptr<float>() : nullptr,
                                 dx.data_ptr<float>(), weight_partials.data_ptr<float>(), rows, n,
                                 NormRowsPerBlock(rows, blocks)));
  });
}

void RmsNormRopeForwardCuda(const at::Tensor& x, const at::Tensor& weight, double eps,
                            const at::Tensor& cos, const at::Tensor& sin, at::Tensor& y,
                            at::Tensor& rstd) {
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  switch (x.size(2)) {
    case 64:
      return LaunchRopeForward<2>(x, weight, eps, cos, sin, y, rstd, stream);
    case 128:
      return LaunchRopeForward<4>(x, weight, eps, cos, sin, y, rstd, stream);
    case 192:
      return LaunchRopeForward<6>(x, weight, eps, cos, sin, y, rstd, stream);
    case 256:
      return LaunchRopeForward<8>(x, weight, eps, cos, sin, y, rstd, stream);
    default:
      TORCH_CHECK(false, "RopeForward: no kernel for head_dim ", x.size(2));
  }
}

namespace {

// The blocks of RopeBackwardKernel<E, true> (the norm's instance, the one with more registers)
// that `device` holds at once, looked up once per device.
template <int E>
int64_t ResidentRopeBackwardBlocks(int device) {
  static std::mutex mutex;
  static std::map<int, int64_t> resident;
  const std::lock_guard<std::mutex> lock(mutex);
  auto [it, added] = resident.try_emplace(device, 0);
  if (added) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, RopeBackwardKernel<E, true>, 32 * kRopeWarps, 0));
    it->second = std::max(per_sm, 1) *
                 static_cast<int64_t>(at::cuda::getDeviceProperties(device)->multiProcessorCount);
  }
  return it->second;
}

}  // namespace

int64_t RmsNormRopeBackwardBlocks(int64_t rows, int64_t head_dim, int device) {
  const int64_t wanted = std::max<int64_t>(1, (rows + kRopeRowsPerBlock - 1) / kRopeRowsPerBlock);
  switch (head_dim) {
    case 64:
      return std::min(wanted, ResidentRopeBackwardBlocks<2>(device));
    case 128:
      return std::min(wanted, ResidentRopeBackwardBlocks<4>(device));
    case 192:
      return std::min(wanted, ResidentRopeBackwardBlocks<6>(device));
    case 256:
      return std::min(wanted, ResidentRopeBackwardBlocks<8>(device));
    default:
      return wanted;  // no kernel: RmsNormRopeBackwardCuda refuses the head dim
  }
}

void RmsNormRopeBackwardCuda(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& rstd, const at::Tensor& cos, const at::Tensor& sin,
                             at::Tensor& dx, at::Tensor& weight_partials) {
  if (dy.numel() == 0) {
    if (weight_partials.defined()) weight_partials.zero_();
    return;
  }
  const c10::cuda::CUDAGuard guard(dy.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  switch (dy.size(2)) {
    case 64:
      return LaunchRopeBackward<2>(dy, x, weight, rstd, cos, sin, dx, weight_partials, stream);
    case 128:
      return LaunchRopeBackward<4>(dy, x, weight, rstd, cos, sin, dx, weight_partials, stream);
    case 192:
      return LaunchRopeBackward<6>(dy, x, weight, rstd, cos, sin, dx, weight_partials, stream);
    case 256:
      return LaunchRopeBackward<8>(dy, x, weight, rstd, cos, sin, dx, weight_partials, stream);
    default:
      TORCH_CHECK(false, "RopeBackward: no kernel for head_dim ", dy.size(2));
  }
}

namespace {

bool Vectorizable(int64_t n, std::initializer_list<const at::Tensor*> tensors) {
  if (n % kVector != 0) return false;
  for (const at::Tensor* t : tensors) {
    if (t->defined() && (reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0 ||
                         (t->scalar_type() != at::kBFloat16 && t->scalar_type() != at::kFloat))) {
      return false;
    }
  }
  return true;
}

}  // namespace

void SwiGluForwardCuda(const at::Tensor& gate, const at::Tensor& up, int64_t in_ld,
                       at::Tensor& out) {
  const int64_t n = gate.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(gate.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const SwiGluLayout layout{.cols = gate.size(-1), .in_ld = in_ld, .out_ld = gate.size(-1)};
  const bool bf16 = gate.scalar_type() == at::kBFloat16 && up.scalar_type() == at::kBFloat16 &&
                    out.scalar_type() == at::kBFloat16;
  if (bf16 && layout.cols % kVector == 0 && in_ld % kVector == 0 &&
      Vectorizable(n, {&gate, &up, &out})) {
    C10_CUDA_CHECK(LaunchAfterPrevious(SwiGluForwardKernel<true>, ElementwiseBlocks(n / kVector),
                                       kElementwiseThreads, 0, stream, InOf(gate), InOf(up),
                                       OutOf(out), n, layout));
  } else {
    C10_CUDA_CHECK(LaunchAfterPrevious(SwiGluForwardKernel<false>, ElementwiseBlocks(n),
                                       kElementwiseThreads, 0, stream, InOf(gate), InOf(up),
                                       OutOf(out), n, layout));
  }
}

void SwiGluBackwardCuda(const at::Tensor& d, const at::Tensor& gate, const at::Tensor& up,
                        int64_t in_ld, at::Tensor& dgate, at::Tensor& dup, int64_t out_ld,
                        at::Tensor& product) {
  const int64_t n = gate.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(gate.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const Out product_out = product.defined() ? OutOf(product) : Out{nullptr, Dtype::kFloat};
  const SwiGluLayout layout{.cols = gate.size(-1), .in_ld = in_ld, .out_ld = out_ld};
  bool bf16 = true;
  for (const at::Tensor* t :
       std::initializer_list<const at::Tensor*>{&gate, &up, &dgate, &dup, &product}) {
    if (t->defined() && t->scalar_type() != at::kBFloat16) bf16 = false;
  }
  if (bf16 && layout.cols % kVector == 0 && in_ld % kVector == 0 && out_ld % kVector == 0 &&
      Vectorizable(n, {&d, &gate, &up, &dgate, &dup, &product})) {
    C10_CUDA_CHECK(LaunchAfterPrevious(SwiGluBackwardKernel<true>, ElementwiseBlocks(n / kVector),
                                       kElementwiseThreads, 0, stream, InOf(d), InOf(gate),
                                       InOf(up), OutOf(dgate), OutOf(dup), product_out, n, layout));
  } else {
    C10_CUDA_CHECK(LaunchAfterPrevious(SwiGluBackwardKernel<false>, ElementwiseBlocks(n),
                                       kElementwiseThreads, 0, stream, InOf(d), InOf(gate),
                                       InOf(up), OutOf(dgate), OutOf(dup), product_out, n, layout));
  }
}

void SigmoidGateForwardCuda(const at::Tensor& a, const at::Tensor& x, int64_t gate_ld,
                            at::Tensor& y) {
  const int64_t n = a.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const GateLayout layout{.cols = a.size(-1), .gate_ld = gate_ld};
  const bool bf16 = a.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16 &&
                    y.scalar_type() == at::kBFloat16;
  if (bf16 && layout.cols % kVector == 0 && gate_ld % kVector == 0 &&
      Vectorizable(n, {&a, &x, &y})) {
    C10_CUDA_CHECK(LaunchAfterPrevious(SigmoidGateForwardKernel<true>,
                                       ElementwiseBlocks(n / kVector), kElementwiseThreads, 0,
                                       stream, InOf(a), InOf(x), OutOf(y), n, layout));
  } else {
    C10_CUDA_CHECK(LaunchAfterPrevious(SigmoidGateForwardKernel<false>, ElementwiseBlocks(n),
                                       kElementwiseThreads, 0, stream, InOf(a), InOf(x), OutOf(y),
                                       n, layout));
  }
}

void SigmoidGateBackwardCuda(const at::Tensor& dy, const at::Tensor& a, const at::Tensor& x,
                             int64_t gate_ld, at::Tensor& da, at::Tensor& dx) {
  const int64_t n = a.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const GateLayout layout{.cols = a.size(-1), .gate_ld = gate_ld};
  bool bf16 = true;
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&a, &x, &da, &dx}) {
    if (t->scalar_type() != at::kBFloat16) bf16 = false;
  }
  if (bf16 && layout.cols % kVector == 0 && gate_ld % kVector == 0 &&
      Vectorizable(n, {&dy, &a, &x, &da, &dx})) {
    C10_CUDA_CHECK(LaunchAfterPrevious(
        SigmoidGateBackwardKernel<true>, ElementwiseBlocks(n / kVector), kElementwiseThreads, 0,
        stream, InOf(dy), InOf(a), InOf(x), OutOf(da), OutOf(dx), n, layout));
  } else {
    C10_CUDA_CHECK(LaunchAfterPrevious(SigmoidGateBackwardKernel<false>, ElementwiseBlocks(n),
                                       kElementwiseThreads, 0, stream, InOf(dy), InOf(a), InOf(x),
                                       OutOf(da), OutOf(dx), n, layout));
  }
}

// accumulator[c] += sum over rows r of partials[r, c]: a block per 32 columns, its 8 warps each
// summing a stride of rows for a lane's column, then the 8 sums added in warp order (deterministic:
// the same order on every run).
constexpr int kColumnSumWarps = 8;

__global__ void __launch_bounds__(32 * kColumnSumWarps)
    AddColumnSumsKernel(const float* __restrict__ partials, int64_t rows, int64_t cols,
                        float* __restrict__ accumulator) {
  WaitForPreviousKernels();
  __shared__ float sums[kColumnSumWarps][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + lane;
  float sum = 0.f;
  if (col < cols) {
    for (int64_t r = warp; r < rows; r += kColumnSumWarps) sum += partials[r * cols + col];
  }
  sums[warp][lane] = sum;
  __syncthreads();
  if (warp == 0 && col < cols) {
    float total = 0.f;
    for (int w = 0; w < kColumnSumWarps; ++w) total += sums[w][lane];
    accumulator[col] += total;
  }
}

void AddColumnSumsCuda(const at::Tensor& partials, at::Tensor& accumulator) {
  const int64_t rows = partials.size(0), cols = partials.size(1);
  if (cols == 0) return;
  const c10::cuda::CUDAGuard guard(partials.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(LaunchAfterPrevious(AddColumnSumsKernel, static_cast<unsigned>((cols + 31) / 32),
                                     32 * kColumnSumWarps, 0, stream, partials.data_ptr<float>(),
                                     rows, cols, accumulator.data_ptr<float>()));
}

void LogitRowStatsCuda(const at::Tensor& logits, const at::Tensor& targets, at::Tensor& lse,
                       at::Tensor& target, at::Tensor& mean) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool vectorized =
      vocab % 4 == 0 && reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0;
  const auto launch = [&](auto kernel) {
    C10_CUDA_CHECK(LaunchAfterPrevious(
        kernel, rows, kRowStatsThreads, 0, stream, logits.data_ptr<float>(), vocab, vectorized,
        targets.data_ptr<int64_t>(), lse.data_ptr<float>(), target.data_ptr<float>(),
        mean.defined() ? mean.data_ptr<float>() : nullptr));
  };
  if (mean.defined()) {
    launch(LogitRowStatsKernel<true>);
  } else {
    launch(LogitRowStatsKernel<false>);
  }
}

void LogitGradCuda(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& targets,
                   const at::Tensor& target_weight, const at::Tensor& grad_logprob,
                   const at::Tensor& mean, const at::Tensor& grad_entropy, double scale,
                   at::Tensor& out) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (rows == 0 || vocab == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool vectorized = vocab % kVector == 0 && out.scalar_type() == at::kBFloat16 &&
                          reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  // Vectorized: about kLogitGradBlocks blocks in all (a few waves of the largest GPUs), at least
  // one per row; scalar: a block per 256 elements of a row (at most 1,024 per row).
  constexpr int64_t kLogitGradBlocks = 2048;
  const int64_t units = vectorized ? vocab / kVector : vocab;
  const int64_t per_row_limit = vectorized ? std::max<int64_t>(1, kLogitGradBlocks / rows) : 1024;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(
                      (units + kElementwiseThreads - 1) / kElementwiseThreads, per_row_limit)),
                  static_cast<unsigned>(rows));
  const bool with_entropy = mean.defined();
  const auto launch = [&](auto kernel) {
    C10_CUDA_CHECK(LaunchAfterPrevious(
        kernel, grid, kElementwiseThreads, 0, stream, logits.data_ptr<float>(), vocab,
        lse.data_ptr<float>(), targets.data_ptr<int64_t>(),
        target_weight.defined() ? target_weight.data_ptr<float>() : nullptr,
        grad_logprob.data_ptr<float>(), with_entropy ? mean.data_ptr<float>() : nullptr,
        with_entropy ? grad_entropy.data_ptr<float>() : nullptr, static_cast<float>(scale),
        scale != 1.0, OutOf(out)));
  };
  if (with_entropy) {
    vectorized ? launch(LogitGradKernel<true, true>) : launch(LogitGradKernel<true, false>);
  } else {
    vectorized ? launch(LogitGradKernel<false, true>) : launch(LogitGradKernel<false, false>);
  }
}

}  // namespace dta::kernels::internal

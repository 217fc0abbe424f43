// Fixed-order sums of the kernels: over a warp's 32 lanes (WarpSum) and over a block's warps
// (WriteBlockColumnSums), so run-to-run bitwise reproducible.
#ifndef DTA_KERNELS_WARP_SUM_CUH_
#define DTA_KERNELS_WARP_SUM_CUH_

namespace dta::kernels {

// The sum of v over a warp's 32 lanes, on every lane: a butterfly of shuffles. Every lane of the
// warp must call it.
template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Each warp's per-lane sums of D = 32 E columns (lane l holds columns l + 32 e), added over the
// block's kWarps warps in warp order and written as the block's row of `partials` ([blocks, D]):
// the per-block partial sums of a norm weight's gradient, in a fixed order. Every thread of the
// block must call it (it synchronises the block).
template <int kWarps, int E>
__device__ __forceinline__ void WriteBlockColumnSums(const float (&acc)[E], float* partials) {
  constexpr int D = 32 * E;
  __shared__ float block_acc[kWarps][D];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int e = 0; e < E; ++e) block_acc[warp][lane + 32 * e] = acc[e];
  __syncthreads();
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) total = __fadd_rn(total, block_acc[k][c]);
    partials[static_cast<int64_t>(blockIdx.x) * D + c] = total;
  }
}

}  // namespace dta::kernels

#endif  // DTA_KERNELS_WARP_SUM_CUH_

// The sum of v over a warp's 32 lanes, on every lane: a butterfly of shuffles in a fixed order, so
// run-to-run bitwise reproducible. Every lane of the warp must call it.
#ifndef DTA_KERNELS_WARP_SUM_CUH_
#define DTA_KERNELS_WARP_SUM_CUH_

namespace dta::kernels {

template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

}  // namespace dta::kernels

#endif  // DTA_KERNELS_WARP_SUM_CUH_

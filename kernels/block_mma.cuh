// Tensor-core products of small matrices a thread block holds (shared memory, or global memory
// for the accumulator), for kernels whose per-block work is a few [64, 64] x [64, 128] products
// between scalar phases (kernels/gated_delta_chunk.cu).
//
// BlockGemm<T, kTransA, kTransB>: C (+)= op(A) op(B), op(A) [m, k], op(B) [k, n], row-major with
// leading dimensions; kTransA reads A stored [k, m], kTransB reads B stored [n, k]. The block's
// warps take 16 x 16 output tiles (8 x 8 in float64) in turn; each sums over k in ascending steps
// (a fixed order: bitwise reproducible). Warp-level mma.sync with fragments loaded by plain
// loads (so the compiler keeps shared-memory loads as such). Accuracy is the type's own:
//   float:  m16n8k8 TF32 with the 3xTF32 split (x = hi + lo, hi rounded to TF32 by two integer
//           operations, lo = x - hi exact; lo * hi + hi * lo + hi * hi): float32-level products
//           on tensor cores (a plain TF32 product would keep 10 mantissa bits);
//   double: m8n8k4 DMMA, float64 fused multiply-adds.
// Preconditions (unchecked, device code): m, n multiples of 16, k a multiple of 8; all threads of
// the block call it (warps without a tile return at once; the caller synchronises after).
#ifndef DTA_KERNELS_BLOCK_MMA_CUH_
#define DTA_KERNELS_BLOCK_MMA_CUH_

#include <cstdint>

namespace dta::kernels::block_mma {

// x rounded to TF32 (10 mantissa bits, ties away from zero), as the bits mma reads.
__device__ __forceinline__ uint32_t RoundTf32(float x) {
  return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
}

__device__ __forceinline__ void MmaTf32(float (&c)[4], const uint32_t (&a)[4],
                                        const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void MmaF64(double (&c)[2], double a, double b) {
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};\n"
               : "+d"(c[0]), "+d"(c[1])
               : "d"(a), "d"(b));
}

// Element (i, k) of op(A) and (k, j) of op(B).
template <bool kTrans, typename T>
__device__ __forceinline__ T At(const T* x, int ld, int row, int col) {
  return kTrans ? x[col * ld + row] : x[row * ld + col];
}

// One warp's 16 x 16 tile at (r0, c0) in float32: two m16n8k8 column halves. Lane (g, t) =
// (lane / 4, lane % 4) holds rows g and g + 8 of columns 2t, 2t + 1 of each half.
template <bool kTransA, bool kTransB>
__device__ __forceinline__ void WarpTile(int r0, int c0, int k, const float* a, int lda,
                                         const float* b, int ldb, float* c, int ldc,
                                         bool accumulate) {
  const int lane = static_cast<int>(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  float acc[2][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = r0 + g + (e / 2) * 8, col = c0 + 8 * h + 2 * t + e % 2;
      acc[h][e] = accumulate ? c[row * ldc + col] : 0.f;
    }
  }
  for (int k0 = 0; k0 < k; k0 += 8) {
    const float a_x[4] = {
        At<kTransA>(a, lda, r0 + g, k0 + t), At<kTransA>(a, lda, r0 + g + 8, k0 + t),
        At<kTransA>(a, lda, r0 + g, k0 + t + 4), At<kTransA>(a, lda, r0 + g + 8, k0 + t + 4)};
    uint32_t a_hi[4], a_lo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      a_hi[e] = RoundTf32(a_x[e]);
      a_lo[e] = __float_as_uint(a_x[e] - __uint_as_float(a_hi[e]));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = c0 + 8 * h + g;
      const float b_x[2] = {At<kTransB>(b, ldb, k0 + t, col), At<kTransB>(b, ldb, k0 + t + 4, col)};
      uint32_t b_hi[2], b_lo[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        b_hi[e] = RoundTf32(b_x[e]);
        b_lo[e] = __float_as_uint(b_x[e] - __uint_as_float(b_hi[e]));
      }
      MmaTf32(acc[h], a_lo, b_hi);
      MmaTf32(acc[h], a_hi, b_lo);
      MmaTf32(acc[h], a_hi, b_hi);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = r0 + g + (e / 2) * 8, col = c0 + 8 * h + 2 * t + e % 2;
      c[row * ldc + col] = acc[h][e];
    }
  }
}

// One warp's 8 x 8 tile at (r0, c0) in float64: lane (g, t) holds row g, columns 2t and 2t + 1.
template <bool kTransA, bool kTransB>
__device__ __forceinline__ void WarpTile(int r0, int c0, int k, const double* a, int lda,
                                         const double* b, int ldb, double* c, int ldc,
                                         bool accumulate) {
  const int lane = static_cast<int>(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  double acc[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) acc[e] = accumulate ? c[(r0 + g) * ldc + c0 + 2 * t + e] : 0.0;
  for (int k0 = 0; k0 < k; k0 += 4) {
    MmaF64(acc, At<kTransA>(a, lda, r0 + g, k0 + t), At<kTransB>(b, ldb, k0 + t, c0 + g));
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) c[(r0 + g) * ldc + c0 + 2 * t + e] = acc[e];
}

template <typename T>
inline constexpr int kTile = sizeof(T) == 8 ? 8 : 16;

template <typename T, bool kTransA, bool kTransB>
__device__ __forceinline__ void BlockGemm(int m, int n, int k, const T* a, int lda, const T* b,
                                          int ldb, T* c, int ldc, bool accumulate,
                                          bool lower_only = false) {
  constexpr int kSide = kTile<T>;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int warps = static_cast<int>(blockDim.x) / 32;
  const int tiles_n = n / kSide;
  const int tiles = (m / kSide) * tiles_n;
  for (int tile = warp; tile < tiles; tile += warps) {
    const int r0 = (tile / tiles_n) * kSide, c0 = (tile % tiles_n) * kSide;
    if (lower_only && c0 > r0) continue;  // every element above the diagonal
    WarpTile<kTransA, kTransB>(r0, c0, k, a, lda, b, ldb, c, ldc, accumulate);
  }
}

}  // namespace dta::kernels::block_mma

#endif  // DTA_KERNELS_BLOCK_MMA_CUH_

// FlashAttention-2 style tree attention for sm_80+ (tuned on sm_90): bf16 operands through
// mma.sync m16n8k16 with fp32 accumulation, ldmatrix from XOR-swizzled shared memory, cp.async
// double buffering, online softmax in base 2. Framework-free: pointers, strides, sizes and a
// stream in, cudaError_t out (kernels/tree_attention.cu wraps it for ATen).
//
// Index spaces. Keys are P prefix rows then T chunk rows; key tiles are kKeyTile rows, the prefix
// tiles first (the last one possibly partial) and then the chunk tiles aligned at chunk row 0, so
// chunk tile c holds chunk keys [c * kKeyTile, (c + 1) * kKeyTile) and query/key tiles of the
// chunk share one grid. Query i sees chunk key j iff j <= i < key_end[j]; a (query tile
// [i0, i1), chunk key tile [j0, j1)) pair is skipped without loading it iff i1 <= j0 or
// i0 >= max(key_end[j0..j1)), and is unmasked iff j1 - 1 <= i0 and i1 <= min(key_end[j0..j1)).
//
// Kernels:
//   PrepareKernel    key_end -> int32 copy, per key tile max and min of key_end.
//   ForwardKernel    one CTA per (query tile, query head), loops over the visible key tiles.
//   RowDotKernel     row_dot[h][i] = sum_d dO[i][h][d] * O[i][h][d] (FA2's D_i).
//   DqKernel         one CTA per (query tile, query head): recomputes P and dP, dQ = dS K.
//   DkDvKernel       one CTA per (key tile, kv head), looping over the kv head's query heads and
//                    the query tiles that see the key tile; chunk rows are written, prefix rows
//                    are added into float32 accumulators.
// Each output element is owned by one thread with a fixed summation order and no atomics, so the
// backward is deterministic. dQ is recomputed in its own kernel (3 MMAs per score instead of
// FlashAttention-2's atomically accumulated 1) to keep it so.
//
// D = 64, 128 and 256 (Tiles: at 256 one m16 tile per forward warp and dK/dV split along D over
// 8 warps; up to 193 KiB of shared memory per block, which sm_90 and sm_100 have, sm_80 not).
//
// On an H100 (dta-attention-bench, causal chains, D = 128) the forward runs at about 0.8 and
// forward + backward at about 0.7 of PyTorch's FlashAttention-2. The D = 128 forward and dK/dV
// kernels sit at 255 registers with a few dozen bytes of spills; fewer accumulators per warp
// (8-warp forward, 32-query dK/dV tiles, paired dK/dV warps) measured slower.
#ifndef DTA_KERNELS_TREE_ATTENTION_KERNEL_CUH_
#define DTA_KERNELS_TREE_ATTENTION_KERNEL_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/dependent_launch.cuh"

namespace dta::kernels {

using bf16 = __nv_bfloat16;

// Every pointer addresses row 0, head 0 of its tensor; *_row_stride is in elements between rows.
// Heads are contiguous (head h of a row starts at h * head_dim), rows 16-byte aligned.
struct TreeAttentionParams {
  const bf16* q = nullptr;  // [T, Hq, D]
  int64_t q_row_stride = 0;
  const bf16* k = nullptr;  // [T, Hkv, D]
  int64_t k_row_stride = 0;
  const bf16* v = nullptr;  // [T, Hkv, D]
  int64_t v_row_stride = 0;
  const bf16* prefix_k = nullptr;  // [P, Hkv, D]; null when P = 0
  int64_t prefix_k_row_stride = 0;
  const bf16* prefix_v = nullptr;  // [P, Hkv, D]; null when P = 0
  int64_t prefix_v_row_stride = 0;
  const int32_t* key_end = nullptr;       // [T], filled by the prepare kernel
  const int32_t* tile_max_end = nullptr;  // [ceil(T / kKeyTile)], likewise
  const int32_t* tile_min_end = nullptr;  // [ceil(T / kKeyTile)], likewise
  int tokens = 0;                         // T >= 1
  int prefix = 0;                         // P >= 0
  int q_heads = 0;                        // Hq
  int kv_heads = 0;                       // Hkv, divides Hq
  float scale = 0.f;                      // multiplies q . k
  float scale_log2 = 0.f;                 // scale * log2(e)

  // Forward outputs.
  bf16* out = nullptr;  // [T, Hq, D]
  int64_t out_row_stride = 0;
  float* lse = nullptr;  // [Hq, T] natural log-sum-exp of the scaled scores

  // Backward: out and lse above are inputs; grad_out, row_dot and the gradients.
  const bf16* grad_out = nullptr;  // [T, Hq, D]
  int64_t grad_out_row_stride = 0;
  float* row_dot = nullptr;  // [Hq, T] workspace
  // The Hopper dK/dV kernel's workspace (HopperBackwardRowStatsFloats): per query head and 64-row
  // query tile its rows' lse * log2(e) (+inf past T), then their row_dot (0 past T). Unused by
  // these kernels.
  float* row_stats = nullptr;
  // The Hopper single-kernel backward's workspace (HopperFusedBackwardDqAccumFloats and
  // HopperFusedBackwardSemaphores): dQ's float32 partial sums per query head and 64-row query tile,
  // and one int32 per such tile, zeroed before the launch, that orders the key tiles adding into
  // it. Unused by these kernels.
  float* dq_accum = nullptr;
  int32_t* dq_semaphore = nullptr;
  bf16* dq = nullptr;  // [T, Hq, D]
  int64_t dq_row_stride = 0;
  bf16* dk = nullptr;  // [T, Hkv, D]
  int64_t dk_row_stride = 0;
  bf16* dv = nullptr;  // [T, Hkv, D]
  int64_t dv_row_stride = 0;
  float* grad_prefix_k = nullptr;  // [P, Hkv, D], added into; rows 8-byte aligned
  int64_t grad_prefix_k_row_stride = 0;
  float* grad_prefix_v = nullptr;  // [P, Hkv, D], added into
  int64_t grad_prefix_v_row_stride = 0;
};

namespace tree_attention_detail {

constexpr int kKeyTile = 64;  // key tile rows of every kernel, and the granularity of tile_*_end
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void CpAsync4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }

__device__ __forceinline__ void CpAsyncWaitAll() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a * b for one m16n8k16 tile: a row-major 16x16, b "col" 16x8, c 16x8 fp32.
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Tiles are row-major with D bf16 per row; the 16-byte chunk c of row r sits at chunk c ^ (r % 8),
// so the 8 rows an ldmatrix reads fall into 8 different bank groups.
template <int D>
__device__ __forceinline__ int Swizzle(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

// Asynchronously copies rows [0, R) of a tile; rows >= valid_rows are zero-filled. src points at
// the tile's row 0 and the right head; fallback is any readable address.
template <int D, int R, int kThreads>
__device__ __forceinline__ void LoadTile(bf16* smem, const bf16* src, int64_t row_stride,
                                         int valid_rows, const void* fallback, int tid) {
  constexpr int kChunks = D / 8;
  constexpr int kRowStep = kThreads / kChunks;  // rows covered by one pass of the threads
  static_assert(kThreads % kChunks == 0 && R % kRowStep == 0,
                "tile must split evenly over the threads");
  // Each thread copies one fixed 16-byte column at rows r0, r0 + kRowStep, ...; when kRowStep is a
  // multiple of 8 the swizzle of its column is the same in every row it touches.
  const int r0 = tid / kChunks;
  const int c = tid % kChunks;
  const bf16* g = src + r0 * row_stride + c * 8;
  const uint32_t s = SmemAddr(smem + Swizzle<D>(r0, c));
#pragma unroll
  for (int i = 0; i < R / kRowStep; ++i) {
    const int r = r0 + i * kRowStep;
    const bool valid = r < valid_rows;
    uint32_t dst;
    if constexpr (kRowStep % 8 == 0) {
      dst = s + i * kRowStep * D * 2;
    } else {
      dst = SmemAddr(smem + Swizzle<D>(r, c));  // D = 256 with 128 threads: 4 rows a pass
    }
    CpAsync16(dst, valid ? static_cast<const void*>(g + i * kRowStep * row_stride) : fallback,
              valid);
  }
}

// A operand (rows [row0, row0 + 16), cols [col0, col0 + 16)) of a row-major tile; also the B
// operand of tile rows k0.. as the k dim and cols n0.., n0 + 8.. as two n8 tiles (LoadBTrans).
template <int D>
__device__ __forceinline__ void LoadA(uint32_t (&a)[4], uint32_t tile, int row0, int col0,
                                      int lane) {
  const int r = row0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int c = (col0 >> 3) + (lane >> 4);
  LdMatrixX4(a, tile + Swizzle<D>(r, c) * 2);
}

// B operand whose k dim runs along the tile's rows: b[0..1] for n cols [n0, n0 + 8), b[2..3] for
// [n0 + 8, n0 + 16), k rows [k0, k0 + 16).
template <int D>
__device__ __forceinline__ void LoadBTrans(uint32_t (&b)[4], uint32_t tile, int k0, int n0,
                                           int lane) {
  const int r = k0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int c = (n0 >> 3) + (lane >> 4);
  LdMatrixX4Trans(b, tile + Swizzle<D>(r, c) * 2);
}

// B operand whose k dim runs along the tile's columns (B = tile^T): b[0..1] for tile rows
// [n0, n0 + 8), b[2..3] for [n0 + 8, n0 + 16), k cols [k0, k0 + 16).
template <int D>
__device__ __forceinline__ void LoadB(uint32_t (&b)[4], uint32_t tile, int n0, int k0, int lane) {
  const int r = n0 + (lane & 7) + (lane >> 4) * 8;
  const int c = (k0 >> 3) + ((lane >> 3) & 1);
  LdMatrixX4(b, tile + Swizzle<D>(r, c) * 2);
}

// The accumulator of a 16 x 16 slice (n8 tiles 2kk and 2kk + 1) as a bf16 A operand.
__device__ __forceinline__ void AccToA(uint32_t (&a)[4], const float (&lo)[4],
                                       const float (&hi)[4]) {
  a[0] = PackBf16(lo[0], lo[1]);
  a[1] = PackBf16(lo[2], lo[3]);
  a[2] = PackBf16(hi[0], hi[1]);
  a[3] = PackBf16(hi[2], hi[3]);
}

// Key tile `it` of the key sequence: prefix tiles first, then chunk tiles.
struct KeyTile {
  bool is_prefix;
  int row0;   // first row within the prefix or within the chunk
  int valid;  // rows that exist (may exceed kKeyTile)
};

__device__ __forceinline__ KeyTile KeyTileAt(const TreeAttentionParams& p, int it, int n_pre) {
  if (it < n_pre) return {true, it * kKeyTile, p.prefix - it * kKeyTile};
  const int row0 = (it - n_pre) * kKeyTile;
  return {false, row0, p.tokens - row0};
}

// True when query rows [i0, i1) (i1 <= T) see every key of chunk key tile c.
__device__ __forceinline__ bool ChunkTileFullyVisible(const TreeAttentionParams& p, int c, int i0,
                                                      int i1) {
  const int j0 = c * kKeyTile;
  return j0 + kKeyTile <= p.tokens && j0 + kKeyTile - 1 <= i0 && i1 <= p.tile_min_end[c];
}

// Masks a query-major score tile s[MT][NT][4] (rows = queries of this warp starting at global
// query row0, cols = keys of tile kt) with -inf where a query does not see a key.
template <int MT, int NT>
__device__ __forceinline__ void MaskQueryMajor(float (&s)[MT][NT][4], const TreeAttentionParams& p,
                                               const KeyTile& kt, int row0, int lane) {
  const int g = lane >> 2;
  const int t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key = kt.row0 + nt * 8 + 2 * t + e;
      if (kt.is_prefix) {
        if (key >= p.prefix) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            s[mt][nt][e] = -INFINITY;
            s[mt][nt][2 + e] = -INFINITY;
          }
        }
      } else {
        const int end = key < p.tokens ? p.key_end[key] : 0;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int i = row0 + mt * 16 + g + 8 * r;
            if (!(key <= i && i < end)) s[mt][nt][2 * r + e] = -INFINITY;
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Prepare: int32 key_end and per key tile max / min, and a zeroed counter (for the Hopper forward's
// persistent CTAs) when one is given: one launch fewer than a memset of its own.

template <typename Index>
__global__ void PrepareKernel(const Index* key_end, int tokens, int32_t* key_end32,
                              int32_t* tile_max, int32_t* tile_min, int32_t* zeroed_counter) {
  internal::WaitForPreviousKernels();
  static_assert(kKeyTile == 64, "two warps per tile");
  __shared__ int32_t smax[2], smin[2];
  const int j = blockIdx.x * kKeyTile + threadIdx.x;
  if (j == 0 && zeroed_counter != nullptr) *zeroed_counter = 0;
  int32_t hi = -1, lo = 0x7fffffff;
  if (j < tokens) {
    const int32_t e = static_cast<int32_t>(key_end[j]);
    key_end32[j] = e;
    hi = lo = e;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, offset));
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, offset));
  }
  if ((threadIdx.x & 31) == 0) {
    smax[threadIdx.x >> 5] = hi;
    smin[threadIdx.x >> 5] = lo;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    tile_max[blockIdx.x] = max(smax[0], smax[1]);
    tile_min[blockIdx.x] = min(smin[0], smin[1]);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward.

template <int D, int BM, int kWarps>
struct ForwardConfig {
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBN = kKeyTile;
  static constexpr int kMT = BM / (16 * kWarps);  // m16 tiles per warp
  static constexpr int kSmemBytes = (BM * D + 2 * 2 * kBN * D) * static_cast<int>(sizeof(bf16));
  static_assert(kMT * 16 * kWarps == BM, "BM must be a multiple of 16 * warps");
};

template <int D, int BM, int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 2) ForwardKernel(const TreeAttentionParams p) {
  using Config = ForwardConfig<D, BM, kWarps>;
  constexpr int kThreads = Config::kThreads;
  constexpr int BN = Config::kBN;
  constexpr int MT = Config::kMT;
  constexpr int NT = BN / 8;
  constexpr int DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* s_q = reinterpret_cast<bf16*>(smem_raw);
  bf16* s_k = s_q + BM * D;      // two buffers
  bf16* s_v = s_k + 2 * BN * D;  // two buffers

  // Heavier (later) query tiles first: under causal masks they see the most keys.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y;
  const int hk = h / (p.q_heads / p.kv_heads);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int tokens = p.tokens;
  const int i0 = m_block * BM;
  const int i1 = min(i0 + BM, tokens);
  const int n_pre = (p.prefix + BN - 1) / BN;
  const int n_total = n_pre + (i1 + BN - 1) / BN;
  const int warp_row0 = warp * 16 * MT;

  auto next_visible = [&](int it) {
    while (it < n_total && it >= n_pre && p.tile_max_end[it - n_pre] <= i0) ++it;
    return it;
  };
  auto load_kv = [&](int it, int buf) {
    const KeyTile kt = KeyTileAt(p, it, n_pre);
    const bf16* kb = kt.is_prefix ? p.prefix_k + kt.row0 * p.prefix_k_row_stride
                                  : p.k + kt.row0 * p.k_row_stride;
    const bf16* vb = kt.is_prefix ? p.prefix_v + kt.row0 * p.prefix_v_row_stride
                                  : p.v + kt.row0 * p.v_row_stride;
    const int64_t ks = kt.is_prefix ? p.prefix_k_row_stride : p.k_row_stride;
    const int64_t vs = kt.is_prefix ? p.prefix_v_row_stride : p.v_row_stride;
    LoadTile<D, BN, kThreads>(s_k + buf * BN * D, kb + hk * D, ks, kt.valid, p.k, tid);
    LoadTile<D, BN, kThreads>(s_v + buf * BN * D, vb + hk * D, vs, kt.valid, p.v, tid);
  };

  LoadTile<D, BM, kThreads>(s_q, p.q + i0 * p.q_row_stride + h * D, p.q_row_stride, tokens - i0,
                            p.q, tid);
  int it = next_visible(0);
  load_kv(it, 0);
  CpAsyncCommit();

  float o[MT][DT][4];
  float row_max[MT][2];
  float row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[mt][r] = -INFINITY;
      row_sum[mt][r] = 0.f;
    }
  }
  const uint32_t q_addr = SmemAddr(s_q);
  const float scale_log2 = p.scale_log2;
  int buf = 0;
  while (it < n_total) {
    const int nxt = next_visible(it + 1);
    CpAsyncWaitAll();
    __syncthreads();
    if (nxt < n_total) load_kv(nxt, buf ^ 1);
    CpAsyncCommit();
    const uint32_t k_addr = SmemAddr(s_k + buf * BN * D);
    const uint32_t v_addr = SmemAddr(s_v + buf * BN * D);

    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) LoadA<D>(a[mt], q_addr, warp_row0 + mt * 16, kk * 16, lane);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t b[4];
        LoadB<D>(b, k_addr, np * 16, kk * 16, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma(s[mt][2 * np], a[mt], b[0], b[1]);
          Mma(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }

    const KeyTile kt = KeyTileAt(p, it, n_pre);
    const bool needs_mask =
        kt.is_prefix ? kt.valid < BN : !ChunkTileFullyVisible(p, it - n_pre, i0, i1);
    if (needs_mask) MaskQueryMajor<MT, NT>(s, p, kt, i0 + warp_row0, lane);

      // Online softmax. Rows with nothing visible yet keep max -inf; m_use = 0 keeps them at 0.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = row_max[mt][r];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_use = mx == -INFINITY ? 0.f : mx * scale_log2;
        const float alpha = Exp2(row_max[mt][r] * scale_log2 - m_use);
        row_max[mt][r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pr = Exp2(s[mt][nt][2 * r + e] * scale_log2 - m_use);
            s[mt][nt][2 * r + e] = pr;
            sum += pr;
          }
        }
        row_sum[mt][r] = row_sum[mt][r] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          o[mt][dt][2 * r] *= alpha;
          o[mt][dt][2 * r + 1] *= alpha;
        }
      }
    }

#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) AccToA(a[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        LoadBTrans<D>(b, v_addr, kk * 16, dp * 16, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma(o[mt][2 * dp], a[mt], b[0], b[1]);
          Mma(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
    }
    buf ^= 1;
    it = nxt;
  }
  CpAsyncWaitAll();

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = row_sum[mt][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int row = i0 + warp_row0 + mt * 16 + g + 8 * r;
      if (row >= tokens) continue;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      bf16* dst = p.out + row * p.out_row_stride + h * D + 2 * t;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        *reinterpret_cast<uint32_t*>(dst + dt * 8) =
            PackBf16(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
      }
      if (t == 0) {
        p.lse[static_cast<int64_t>(h) * tokens + row] =
            sum > 0.f ? row_max[mt][r] * p.scale + logf(sum) : -INFINITY;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: row_dot = rowsum(dO * O).

template <int D>
__global__ void RowDotKernel(const TreeAttentionParams p) {
  internal::WaitForPreviousKernels();
  constexpr int kLanes = D / 8;  // threads per (row, head), 16 bytes each
  constexpr int kRowsPerBlock = 256 / kLanes;
  const int sub = threadIdx.x % kLanes;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  const bool valid = idx < static_cast<int64_t>(p.tokens) * p.q_heads;
  const int row = valid ? static_cast<int>(idx / p.q_heads) : 0;
  const int h = valid ? static_cast<int>(idx % p.q_heads) : 0;
  float acc = 0.f;
  if (valid) {
    const uint4 go =
        *reinterpret_cast<const uint4*>(p.grad_out + row * p.grad_out_row_stride + h * D + sub * 8);
    const uint4 ou =
        *reinterpret_cast<const uint4*>(p.out + row * p.out_row_stride + h * D + sub * 8);
    const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&go);
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&ou);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 fa = __bfloat1622float2(a[e]);
      const float2 fb = __bfloat1622float2(b[e]);
      acc += fa.x * fb.x + fa.y * fb.y;
    }
  }
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset >>= 1) {
    acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  }
  if (valid && sub == 0) p.row_dot[static_cast<int64_t>(h) * p.tokens + row] = acc;
}

// ---------------------------------------------------------------------------------------------
// Backward: dQ, query-major, Q and dO fragments held in registers.

template <int D, int BM, int kWarps>
struct DqConfig {
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBN = kKeyTile;
  static constexpr int kSmemBytes = (2 * BM * D + 2 * 2 * kBN * D) * static_cast<int>(sizeof(bf16));
  static_assert(BM == 16 * kWarps, "one m16 tile per warp");
};

template <int D, int BM, int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 2) DqKernel(const TreeAttentionParams p) {
  using Config = DqConfig<D, BM, kWarps>;
  constexpr int kThreads = Config::kThreads;
  constexpr int BN = Config::kBN;
  constexpr int NT = BN / 8;
  constexpr int DT = D / 8;
  constexpr int KD = D / 16;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* s_q = reinterpret_cast<bf16*>(smem_raw);
  bf16* s_do = s_q + BM * D;
  bf16* s_k = s_do + BM * D;     // two buffers
  bf16* s_v = s_k + 2 * BN * D;  // two buffers

  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y;
  const int hk = h / (p.q_heads / p.kv_heads);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int tokens = p.tokens;
  const int i0 = m_block * BM;
  const int i1 = min(i0 + BM, tokens);
  const int n_pre = (p.prefix + BN - 1) / BN;
  const int n_total = n_pre + (i1 + BN - 1) / BN;
  const int warp_row0 = warp * 16;

  auto next_visible = [&](int it) {
    while (it < n_total && it >= n_pre && p.tile_max_end[it - n_pre] <= i0) ++it;
    return it;
  };
  auto load_kv = [&](int it, int buf) {
    const KeyTile kt = KeyTileAt(p, it, n_pre);
    const bf16* kb = kt.is_prefix ? p.prefix_k + kt.row0 * p.prefix_k_row_stride
                                  : p.k + kt.row0 * p.k_row_stride;
    const bf16* vb = kt.is_prefix ? p.prefix_v + kt.row0 * p.prefix_v_row_stride
                                  : p.v + kt.row0 * p.v_row_stride;
    const int64_t ks = kt.is_prefix ? p.prefix_k_row_stride : p.k_row_stride;
    const int64_t vs = kt.is_prefix ? p.prefix_v_row_stride : p.v_row_stride;
    LoadTile<D, BN, kThreads>(s_k + buf * BN * D, kb + hk * D, ks, kt.valid, p.k, tid);
    LoadTile<D, BN, kThreads>(s_v + buf * BN * D, vb + hk * D, vs, kt.valid, p.v, tid);
  };

  LoadTile<D, BM, kThreads>(s_q, p.q + i0 * p.q_row_stride + h * D, p.q_row_stride, tokens - i0,
                            p.q, tid);
  LoadTile<D, BM, kThreads>(s_do, p.grad_out + i0 * p.grad_out_row_stride + h * D,
                            p.grad_out_row_stride, tokens - i0, p.grad_out, tid);
  int it = next_visible(0);
  load_kv(it, 0);
  CpAsyncCommit();

  // Per row: lse in base 2 (+inf past the end, so those rows get P = 0) and row_dot.
  float lse2[2];
  float rdot[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = i0 + warp_row0 + g + 8 * r;
    const int64_t at = static_cast<int64_t>(h) * tokens + row;
    lse2[r] = row < tokens ? p.lse[at] * kLog2e : INFINITY;
    rdot[r] = row < tokens ? p.row_dot[at] : 0.f;
  }

  // Q and dO fragments are re-read from shared memory every tile: holding them in registers
  // (64 more per thread at D = 128) serializes every ldmatrix behind its MMAs (4% slower).
  const uint32_t q_addr = SmemAddr(s_q);
  const uint32_t do_addr = SmemAddr(s_do);

  float dq[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[dt][e] = 0.f;
  }
  const float scale_log2 = p.scale_log2;
  int buf = 0;
  while (it < n_total) {
    const int nxt = next_visible(it + 1);
    CpAsyncWaitAll();
    __syncthreads();
    if (nxt < n_total) load_kv(nxt, buf ^ 1);
    CpAsyncCommit();
    const uint32_t k_addr = SmemAddr(s_k + buf * BN * D);
    const uint32_t v_addr = SmemAddr(s_v + buf * BN * D);

    float s[1][NT][4];
    float dp[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[0][nt][e] = 0.f;
        dp[nt][e] = 0.f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      uint32_t qa[4];
      uint32_t da[4];
      LoadA<D>(qa, q_addr, warp_row0, kk * 16, lane);
      LoadA<D>(da, do_addr, warp_row0, kk * 16, lane);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t b[4];
        LoadB<D>(b, k_addr, np * 16, kk * 16, lane);
        Mma(s[0][2 * np], qa, b[0], b[1]);
        Mma(s[0][2 * np + 1], qa, b[2], b[3]);
        uint32_t c[4];
        LoadB<D>(c, v_addr, np * 16, kk * 16, lane);
        Mma(dp[2 * np], da, c[0], c[1]);
        Mma(dp[2 * np + 1], da, c[2], c[3]);
      }
    }
    const KeyTile kt = KeyTileAt(p, it, n_pre);
    const bool needs_mask =
        kt.is_prefix ? kt.valid < BN : !ChunkTileFullyVisible(p, it - n_pre, i0, i1);
    if (needs_mask) MaskQueryMajor<1, NT>(s, p, kt, i0 + warp_row0, lane);
      // dS = P * (dP - row_dot), reusing dp.
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pr = Exp2(s[0][nt][e] * scale_log2 - lse2[e >> 1]);
        dp[nt][e] = pr * (dp[nt][e] - rdot[e >> 1]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      AccToA(a, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
      for (int dpi = 0; dpi < D / 16; ++dpi) {
        uint32_t b[4];
        LoadBTrans<D>(b, k_addr, kk * 16, dpi * 16, lane);
        Mma(dq[2 * dpi], a, b[0], b[1]);
        Mma(dq[2 * dpi + 1], a, b[2], b[3]);
      }
    }
    buf ^= 1;
    it = nxt;
  }
  CpAsyncWaitAll();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = i0 + warp_row0 + g + 8 * r;
    if (row >= tokens) continue;
    bf16* dst = p.dq + row * p.dq_row_stride + h * D + 2 * t;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      *reinterpret_cast<uint32_t*>(dst + dt * 8) =
          PackBf16(dq[dt][2 * r] * p.scale, dq[dt][2 * r + 1] * p.scale);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: dK and dV, key-major: each warp owns 16 key rows of the tile and both accumulators,
// so P^T and dS^T go from accumulators straight into the next MMA's A operand. (Tried and slower
// on H100: pairs of warps sharing 32 key rows, one computing P^T and dV, the other dS^T and dK,
// exchanging P^T through shared memory: 1 CTA of 8 warps per SM hides latency worse.)
// kDSplit > 1 (D = 256, where one warp cannot hold 2 x 16 x D accumulators) splits D as
// FlashAttention-3 splits its hdim-256 dK/dV accumulators: kDSplit warps share 16 key rows, each
// recomputes their P^T and dS^T over all of D (the same instructions, so the same values) and
// accumulates dK and dV for its D / kDSplit columns.

template <int D, int BM, int kDSplit>
struct DkDvConfig {
  static constexpr int kWarps = 4 * kDSplit;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBN = 16 * 4;
  static constexpr int kSmemBytes =
      (2 * kBN * D + 2 * 2 * BM * D) * static_cast<int>(sizeof(bf16)) +
      2 * 2 * BM * static_cast<int>(sizeof(float));
  static_assert(kBN == kKeyTile, "one tile_*_end entry per key tile");
  static_assert(D % (16 * kDSplit) == 0, "whole k16 slices per warp");
};

// Two CTAs per SM bound 256-thread CTAs to 128 registers: the split kernel asks for one.
template <int D, int BM, int kDSplit>
__global__ void __launch_bounds__(kDSplit * 128, kDSplit == 1 ? 2 : 1)
    DkDvKernel(const TreeAttentionParams p) {
  using Config = DkDvConfig<D, BM, kDSplit>;
  constexpr int kThreads = Config::kThreads;
  constexpr int BN = Config::kBN;
  constexpr int NQ = BM / 8;
  constexpr int DW = D / kDSplit;  // columns of dK and dV per warp
  constexpr int DT = DW / 8;
  constexpr int KD = D / 16;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* s_k = reinterpret_cast<bf16*>(smem_raw);
  bf16* s_v = s_k + BN * D;
  bf16* s_q = s_v + BN * D;
  bf16* s_do = s_q + 2 * BM * D;
  float* s_lse = reinterpret_cast<float*>(s_do + 2 * BM * D);
  float* s_rdot = s_lse + 2 * BM;

  const int n_block = blockIdx.x;
  const int hk = blockIdx.y;
  const int group = p.q_heads / p.kv_heads;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int tokens = p.tokens;
  const int n_pre = (p.prefix + BN - 1) / BN;
  const KeyTile kt = KeyTileAt(p, n_block, n_pre);
  const int chunk_tile = n_block - n_pre;
  const int q_first = kt.is_prefix ? 0 : kt.row0 / BM;
  const int q_last =
      kt.is_prefix ? (tokens + BM - 1) / BM : (p.tile_max_end[chunk_tile] + BM - 1) / BM;
  const int nq = q_last - q_first;
  const int n_iter = group * nq;
  {
    const bf16* kb = kt.is_prefix ? p.prefix_k + kt.row0 * p.prefix_k_row_stride
                                  : p.k + kt.row0 * p.k_row_stride;
    const bf16* vb = kt.is_prefix ? p.prefix_v + kt.row0 * p.prefix_v_row_stride
                                  : p.v + kt.row0 * p.v_row_stride;
    const int64_t ks = kt.is_prefix ? p.prefix_k_row_stride : p.k_row_stride;
    const int64_t vs = kt.is_prefix ? p.prefix_v_row_stride : p.v_row_stride;
    LoadTile<D, BN, kThreads>(s_k, kb + hk * D, ks, kt.valid, p.k, tid);
    LoadTile<D, BN, kThreads>(s_v, vb + hk * D, vs, kt.valid, p.v, tid);
  }
  auto load_q = [&](int iter, int buf) {
    const int h = hk * group + iter / nq;
    const int q0 = (q_first + iter % nq) * BM;
    LoadTile<D, BM, kThreads>(s_q + buf * BM * D, p.q + q0 * p.q_row_stride + h * D, p.q_row_stride,
                              tokens - q0, p.q, tid);
    LoadTile<D, BM, kThreads>(s_do + buf * BM * D, p.grad_out + q0 * p.grad_out_row_stride + h * D,
                              p.grad_out_row_stride, tokens - q0, p.grad_out, tid);
    for (int idx = tid; idx < BM; idx += kThreads) {
      const bool ok = q0 + idx < tokens;
      const int64_t at = static_cast<int64_t>(h) * tokens + q0 + idx;
      CpAsync4(SmemAddr(s_lse + buf * BM + idx), ok ? p.lse + at : p.lse, ok);
      CpAsync4(SmemAddr(s_rdot + buf * BM + idx), ok ? p.row_dot + at : p.row_dot, ok);
    }
  };
  if (n_iter > 0) load_q(0, 0);
  CpAsyncCommit();

  float dk[DT][4];
  float dv[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      dk[dt][e] = 0.f;
      dv[dt][e] = 0.f;
    }
  }
  const int key_row0 = kt.row0 + (warp % 4) * 16;
  const int col0 = (warp / 4) * DW;  // this warp's first column of dK and dV
  int key_end_r[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = key_row0 + g + 8 * r;
    key_end_r[r] = (!kt.is_prefix && j < tokens) ? p.key_end[j] : 0;
  }
  const uint32_t k_addr = SmemAddr(s_k);
  const uint32_t v_addr = SmemAddr(s_v);
  const float scale_log2 = p.scale_log2;

  for (int iter = 0; iter < n_iter; ++iter) {
    const int buf = iter & 1;
    CpAsyncWaitAll();
    __syncthreads();
    if (iter + 1 < n_iter) load_q(iter + 1, buf ^ 1);
    CpAsyncCommit();
    const int q0 = (q_first + iter % nq) * BM;
    const uint32_t q_addr = SmemAddr(s_q + buf * BM * D);
    const uint32_t do_addr = SmemAddr(s_do + buf * BM * D);
    const float* lse = s_lse + buf * BM;
    const float* rdot = s_rdot + buf * BM;

    float s[NQ][4];
    float dpt[NQ][4];
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = 0.f;
        dpt[nt][e] = 0.f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      uint32_t ka[4];
      uint32_t va[4];
      LoadA<D>(ka, k_addr, (warp % 4) * 16, kk * 16, lane);
      LoadA<D>(va, v_addr, (warp % 4) * 16, kk * 16, lane);
#pragma unroll
      for (int np = 0; np < BM / 16; ++np) {
        uint32_t b[4];
        LoadB<D>(b, q_addr, np * 16, kk * 16, lane);
        Mma(s[2 * np], ka, b[0], b[1]);
        Mma(s[2 * np + 1], ka, b[2], b[3]);
        uint32_t c[4];
        LoadB<D>(c, do_addr, np * 16, kk * 16, lane);
        Mma(dpt[2 * np], va, c[0], c[1]);
        Mma(dpt[2 * np + 1], va, c[2], c[3]);
      }
    }
    const int q1 = min(q0 + BM, tokens);
    const bool needs_mask =
        q0 + BM > tokens ||
        (kt.is_prefix ? kt.valid < BN : !ChunkTileFullyVisible(p, chunk_tile, q0, q1));
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = nt * 8 + 2 * t + e;
        const float l2 = lse[col] * kLog2e;
        const float rd = rdot[col];
        const int i = q0 + col;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float x = s[nt][2 * r + e] * scale_log2 - l2;
          if (needs_mask) {
            const int j = key_row0 + g + 8 * r;
            const bool visible =
                i < tokens && (kt.is_prefix ? j < p.prefix : (j <= i && i < key_end_r[r]));
            if (!visible) x = -INFINITY;
          }
          const float pr = Exp2(x);
          s[nt][2 * r + e] = pr;
          dpt[nt][2 * r + e] = pr * (dpt[nt][2 * r + e] - rd);
        }
      }
    }
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      uint32_t pa[4];
      uint32_t sa[4];
      AccToA(pa, s[2 * kk], s[2 * kk + 1]);
      AccToA(sa, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
      for (int dpi = 0; dpi < DW / 16; ++dpi) {
        uint32_t b[4];
        LoadBTrans<D>(b, do_addr, kk * 16, col0 + dpi * 16, lane);
        Mma(dv[2 * dpi], pa, b[0], b[1]);
        Mma(dv[2 * dpi + 1], pa, b[2], b[3]);
        uint32_t c[4];
        LoadBTrans<D>(c, q_addr, kk * 16, col0 + dpi * 16, lane);
        Mma(dk[2 * dpi], sa, c[0], c[1]);
        Mma(dk[2 * dpi + 1], sa, c[2], c[3]);
      }
    }
  }
  CpAsyncWaitAll();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = key_row0 + g + 8 * r;
    if (kt.is_prefix) {
      if (j >= p.prefix) continue;
      float* gk = p.grad_prefix_k + j * p.grad_prefix_k_row_stride + hk * D + col0 + 2 * t;
      float* gv = p.grad_prefix_v + j * p.grad_prefix_v_row_stride + hk * D + col0 + 2 * t;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        float2 ak = *reinterpret_cast<float2*>(gk + dt * 8);
        float2 av = *reinterpret_cast<float2*>(gv + dt * 8);
        ak.x += dk[dt][2 * r] * p.scale;
        ak.y += dk[dt][2 * r + 1] * p.scale;
        av.x += dv[dt][2 * r];
        av.y += dv[dt][2 * r + 1];
        *reinterpret_cast<float2*>(gk + dt * 8) = ak;
        *reinterpret_cast<float2*>(gv + dt * 8) = av;
      }
    } else {
      if (j >= tokens) continue;
      bf16* ok = p.dk + j * p.dk_row_stride + hk * D + col0 + 2 * t;
      bf16* ov = p.dv + j * p.dv_row_stride + hk * D + col0 + 2 * t;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        *reinterpret_cast<uint32_t*>(ok + dt * 8) =
            PackBf16(dk[dt][2 * r] * p.scale, dk[dt][2 * r + 1] * p.scale);
        *reinterpret_cast<uint32_t*>(ov + dt * 8) = PackBf16(dv[dt][2 * r], dv[dt][2 * r + 1]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers. Tile shapes per head dim live here and nowhere else.

template <int D>
struct Tiles {
  static constexpr int kForwardMaxBM = 128;  // 64 or 128 by the grid's size (LaunchForward)
  static constexpr int kDqBM = 64;
  static constexpr int kDqWarps = 4;
  static constexpr int kDkDvBM = 64;
  static constexpr int kDkDvSplit = 1;
};

// D = 256: 64-row query tiles (a 16 x 256 output accumulator per warp is 128 floats a thread),
// dK/dV split over 8 warps. Shared memory: forward 160 KiB, dQ 192 KiB, dK/dV 193 KiB, one CTA
// per SM; more than sm_80's 163 KiB (TreeAttentionKernelSmemBytes says, the caller checks).
// ptxas (sm_90): 255 registers each; forward no spills, dQ 44 and dK/dV 60 bytes of spill stores.
template <>
struct Tiles<256> {
  static constexpr int kForwardMaxBM = 64;
  static constexpr int kDqBM = 64;
  static constexpr int kDqWarps = 4;
  static constexpr int kDkDvBM = 64;
  static constexpr int kDkDvSplit = 2;
};

// The most dynamic shared memory any kernel takes at head dim D.
template <int D>
constexpr int MaxSmemBytes() {
  using T = Tiles<D>;
  const int fwd = ForwardConfig<D, T::kForwardMaxBM, 4>::kSmemBytes;
  const int dq = DqConfig<D, T::kDqBM, T::kDqWarps>::kSmemBytes;
  const int dkdv = DkDvConfig<D, T::kDkDvBM, T::kDkDvSplit>::kSmemBytes;
  return fwd > dq ? (fwd > dkdv ? fwd : dkdv) : (dq > dkdv ? dq : dkdv);
}

template <typename Kernel>
cudaError_t LaunchWithSmem(Kernel kernel, dim3 grid, int threads, int smem, cudaStream_t stream,
                           const TreeAttentionParams& p) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, threads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <int D, int BM>
cudaError_t LaunchForwardWith(const TreeAttentionParams& p, cudaStream_t stream) {
  using Config = ForwardConfig<D, BM, 4>;
  const dim3 grid((p.tokens + BM - 1) / BM, p.q_heads);
  return LaunchWithSmem(ForwardKernel<D, BM, 4>, grid, Config::kThreads, Config::kSmemBytes, stream,
                        p);
}

// 128-row query tiles (2 m16 tiles per warp) are fastest when they fill the GPU, two CTAs per SM;
// short chunks over a long prefix get 64-row tiles so that more CTAs share the prefix's work.
template <int D>
cudaError_t LaunchForward(const TreeAttentionParams& p, cudaStream_t stream) {
  if constexpr (Tiles<D>::kForwardMaxBM == 64) {
    return LaunchForwardWith<D, 64>(p, stream);
  } else {
    int device = 0;
    int sms = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess)
      err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    const int64_t big_tiles = static_cast<int64_t>((p.tokens + 127) / 128) * p.q_heads;
    if (big_tiles < 2 * sms) return LaunchForwardWith<D, 64>(p, stream);
    return LaunchForwardWith<D, 128>(p, stream);
  }
}

template <int D>
cudaError_t LaunchRowDot(const TreeAttentionParams& p, cudaStream_t stream) {
  constexpr int kRowsPerBlock = 256 / (D / 8);
  const int64_t rows = static_cast<int64_t>(p.tokens) * p.q_heads;
  return internal::LaunchAfterPrevious(
      RowDotKernel<D>, static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), 256, 0,
      stream, p);
}

template <int D>
cudaError_t LaunchDq(const TreeAttentionParams& p, cudaStream_t stream) {
  using T = Tiles<D>;
  using Config = DqConfig<D, T::kDqBM, T::kDqWarps>;
  const dim3 grid((p.tokens + T::kDqBM - 1) / T::kDqBM, p.q_heads);
  return LaunchWithSmem(DqKernel<D, T::kDqBM, T::kDqWarps>, grid, Config::kThreads,
                        Config::kSmemBytes, stream, p);
}

template <int D>
cudaError_t LaunchDkDv(const TreeAttentionParams& p, cudaStream_t stream) {
  using T = Tiles<D>;
  using Config = DkDvConfig<D, T::kDkDvBM, T::kDkDvSplit>;
  const int tiles = (p.prefix + kKeyTile - 1) / kKeyTile + (p.tokens + kKeyTile - 1) / kKeyTile;
  return LaunchWithSmem(DkDvKernel<D, T::kDkDvBM, T::kDkDvSplit>, dim3(tiles, p.kv_heads),
                        Config::kThreads, Config::kSmemBytes, stream, p);
}

}  // namespace tree_attention_detail

// Fills key_end32 [T], tile_max_end and tile_min_end [ceil(T / 64)] from key_end [T] (int64 when
// key_end_is_int64, else int32), and sets *zeroed_counter to 0 unless it is null (the Hopper
// forward's work counter). Run before the forward and the backward.
inline cudaError_t LaunchTreeAttentionPrepare(const void* key_end, bool key_end_is_int64,
                                              int tokens, int32_t* key_end32, int32_t* tile_max_end,
                                              int32_t* tile_min_end, int32_t* zeroed_counter,
                                              cudaStream_t stream) {
  using tree_attention_detail::kKeyTile;
  const int blocks = (tokens + kKeyTile - 1) / kKeyTile;
  if (key_end_is_int64) {
    return internal::LaunchAfterPrevious(tree_attention_detail::PrepareKernel<int64_t>, blocks,
                                         kKeyTile, 0, stream, static_cast<const int64_t*>(key_end),
                                         tokens, key_end32, tile_max_end, tile_min_end,
                                         zeroed_counter);
  }
  return internal::LaunchAfterPrevious(tree_attention_detail::PrepareKernel<int32_t>, blocks,
                                       kKeyTile, 0, stream, static_cast<const int32_t*>(key_end),
                                       tokens, key_end32, tile_max_end, tile_min_end,
                                       zeroed_counter);
}

// The most dynamic shared memory per block the kernels take at head_dim (64, 128 or 256; 0 for
// others): the device's opt-in limit must reach it.
constexpr int TreeAttentionKernelSmemBytes(int head_dim) {
  namespace d = tree_attention_detail;
  return head_dim == 64    ? d::MaxSmemBytes<64>()
         : head_dim == 128 ? d::MaxSmemBytes<128>()
         : head_dim == 256 ? d::MaxSmemBytes<256>()
                           : 0;
}

// Writes p.out and p.lse. head_dim must be 64, 128 or 256, else cudaErrorInvalidValue.
inline cudaError_t LaunchTreeAttentionForward(const TreeAttentionParams& p, int head_dim,
                                              cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      return tree_attention_detail::LaunchForward<64>(p, stream);
    case 128:
      return tree_attention_detail::LaunchForward<128>(p, stream);
    case 256:
      return tree_attention_detail::LaunchForward<256>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// The backward is three launches: RowDot writes p.row_dot; then Dq (p.dq) and DkDv (p.dk, p.dv,
// adding into p.grad_prefix_k / p.grad_prefix_v) both read it and may run concurrently.
enum class TreeAttentionBackwardPart { kRowDot, kDq, kDkDv };

inline cudaError_t LaunchTreeAttentionBackward(const TreeAttentionParams& p, int head_dim,
                                               TreeAttentionBackwardPart part,
                                               cudaStream_t stream) {
  namespace d = tree_attention_detail;
  switch (head_dim) {
    case 64:
      return part == TreeAttentionBackwardPart::kRowDot ? d::LaunchRowDot<64>(p, stream)
             : part == TreeAttentionBackwardPart::kDq   ? d::LaunchDq<64>(p, stream)
                                                        : d::LaunchDkDv<64>(p, stream);
    case 128:
      return part == TreeAttentionBackwardPart::kRowDot ? d::LaunchRowDot<128>(p, stream)
             : part == TreeAttentionBackwardPart::kDq   ? d::LaunchDq<128>(p, stream)
                                                        : d::LaunchDkDv<128>(p, stream);
    case 256:
      return part == TreeAttentionBackwardPart::kRowDot ? d::LaunchRowDot<256>(p, stream)
             : part == TreeAttentionBackwardPart::kDq   ? d::LaunchDq<256>(p, stream)
                                                        : d::LaunchDkDv<256>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace dta::kernels

#endif  // DTA_KERNELS_TREE_ATTENTION_KERNEL_CUH_

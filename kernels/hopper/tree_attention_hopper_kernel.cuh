// The Hopper tree-attention forward kernel (see tree_attention_hopper.h) and the building blocks
// the backward kernels share with it (MMA and shared-memory types, TileWalk, KeyTileLoader,
// WarpgroupGemm, MaskTile, the host-side TMA helpers): CuTe / CUTLASS code, included only by
// tree_attention_hopper.cu and tree_attention_hopper_backward.cu (compiled for sm_90a).
//
// Persistent: one CTA per SM runs work units (a 128-row query tile of one query head) handed out
// in order, longest first under causal masks (UnitAt; the first wave by blockIdx.x, then through
// an atomic counter). Three warpgroups:
//   warpgroup 0    producer: one thread issues the TMA loads of each unit's Q and of every visible
//                  (prefix, then chunk) K and V tile into kStages-deep PipelineTmaAsync rings;
//                  the next unit's first K tile and Q load while the consumers finish a unit.
//                  Its registers are given to the consumers (setmaxnreg).
//   warpgroups 1-2 consumers, 64 query rows each: S = Q K^T (wgmma, both operands in shared
//                  memory), the tree mask, the online softmax in base 2, O += P V (wgmma, P from
//                  registers). Tile n's Q K^T and tile n-1's P V are in flight together while the
//                  softmax of tile n waits only for the first (FlashAttention-3's intra-warpgroup
//                  overlap), and the two warpgroups take turns issuing GEMMs (its ping-pong), so
//                  that one's softmax runs under the other's GEMMs. O and lse are written straight
//                  from registers.
// The visible tiles are walked by producer and consumers alike (TileWalk): every prefix tile,
// then the chunk tiles c with c * kBN < i1 and max(key_end over the tile) > i0, read from the
// 64-key granular tile_max_end the prepare kernel writes; the others are never loaded. Tiles
// whose every key is visible to every query row of a warpgroup skip the mask.
#ifndef DTA_KERNELS_HOPPER_TREE_ATTENTION_HOPPER_KERNEL_CUH_
#define DTA_KERNELS_HOPPER_TREE_ATTENTION_HOPPER_KERNEL_CUH_

#include <cuda_runtime.h>

#include <cstdint>

// cute/tensor.hpp first: the atom headers after it rely on its declarations.
#include "cute/tensor.hpp"
// clang-format off
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/atom/copy_traits_sm90_tma.hpp"
#include "cute/atom/mma_traits_sm90_gmma.hpp"
// clang-format on
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/pipeline.hpp"
#include "kernels/tree_attention_kernel.cuh"

namespace dta::kernels::hopper_detail {

using namespace cute;
using Element = cutlass::bfloat16_t;

// The building blocks of both directions' kernels. Two consumer warpgroups stack along M.
using WarpgroupPair = Layout<Shape<_2, _1, _1>>;

// wgmma of (64 rows per warpgroup) x N, K deep, both operands in shared memory.
template <int N, int K>
using SmemSmemMma = decltype(make_tiled_mma(
    GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<N>, Int<K>>>(), WarpgroupPair{}));

// The same with A from registers (K-major) and B an MN-major view of shared memory.
template <int N, int K>
using RegSmemMma = decltype(make_tiled_mma(
    GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<N>, Int<K>>, GMMA::Major::K,
                         GMMA::Major::MN>(),
    WarpgroupPair{}));

// kStages tiles of kRows rows of D elements, 128-byte swizzled: the K-major operand of a wgmma
// and TMA's destination.
template <int kRows, int D, int kStages>
using StagedTiles = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                           Shape<Int<kRows>, Int<D>, Int<kStages>>{}));

// The same memory as kStages (D, kRows) tiles, D contiguous: the MN-major B operand (V^T in P V).
template <int kRows, int D, int kStages>
using StagedTilesT = decltype(composition(
    StagedTiles<kRows, D, kStages>{},
    make_ordered_layout(Shape<Int<D>, Int<kRows>, Int<kStages>>{}, Step<_2, _1, _3>{})));

// D = 256 (FlashAttention-3's hdim-256 shape, its 80-key tiles rounded to our 64-key prepare
// tiles): 64-key tiles, 2 stages, Q 64 KiB + 2 x (K + V) 128 KiB: 192 KiB; a consumer thread holds
// 128 floats of O and 32 of S (ptxas: 60 bytes of spill stores, none at D = 64 and 128).
template <int D>
struct ForwardTraits {
  static_assert(D == 64 || D == 128 || D == 256, "head dims with a tile shape");
  static constexpr int kBM = 128;                   // query rows per CTA: two warpgroups of 64
  static constexpr int kBN = D == 256 ? 64 : 128;   // key rows per tile
  static constexpr int kStages = D == 256 ? 2 : 3;  // D = 128: Q 32 KiB + 3 x (K + V) 192 KiB
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kSubTiles = kBN / tree_attention_detail::kKeyTile;  // tile_*_end per tile
  static_assert(kBN % tree_attention_detail::kKeyTile == 0, "tiles cover whole prepare tiles");

  using TileQ = Shape<Int<kBM>, Int<D>>;
  using TileKV = Shape<Int<kBN>, Int<D>>;
  using TiledMmaQK = SmemSmemMma<kBN, D>;
  using TiledMmaPV = RegSmemMma<D, kBN>;

  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, TileQ{}));
  using SmemLayoutKV = StagedTiles<kBN, D, kStages>;
  using SmemLayoutVt = StagedTilesT<kBN, D, kStages>;  // V^T, the B operand of P V

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;
  static constexpr uint32_t kTileBytes = kBN * D * sizeof(Element);
  static constexpr uint32_t kQBytes = kBM * D * sizeof(Element);

  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> v;
    typename Pipeline::SharedStorage pipeline_k;
    typename Pipeline::SharedStorage pipeline_v;
    cutlass::arch::ClusterTransactionBarrier barrier_q;  // Q landed (one phase per unit)
    cutlass::arch::ClusterBarrier barrier_q_empty;       // the consumers are done with Q
    int unit;  // the unit whose Q barrier_q announces; >= the unit count: no more work
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));

  // Global tensors as TMA sees them: (rows, D, heads) with strides (row_stride, 1, D).
  using GmemShape = Shape<int32_t, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)),
                                          GmemShape{}, GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{}, TileQ{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutKV{}),
                                       TileKV{}, _1{}));
};

template <int D>
struct ForwardParams {
  using Traits = ForwardTraits<D>;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k;         // chunk keys [T, Hkv, D]
  typename Traits::TmaKV tma_v;         // chunk values
  typename Traits::TmaKV tma_prefix_k;  // prefix keys [P, Hkv, D]; the chunk's when P = 0
  typename Traits::TmaKV tma_prefix_v;
  const int32_t* key_end = nullptr;       // [T] (prepare kernel)
  const int32_t* tile_max_end = nullptr;  // [ceil(T / 64)]
  const int32_t* tile_min_end = nullptr;  // [ceil(T / 64)]
  int tokens = 0;
  int prefix = 0;
  int q_heads = 0;
  int kv_heads = 0;
  int m_blocks = 0;       // ceil(T / kBM)
  int section_heads = 1;  // query heads per scheduling section (a multiple of Hq / Hkv)
  float scale = 0.f;
  float scale_log2 = 0.f;
  int* unit_counter = nullptr;  // zeroed before the launch; units handed out past the first wave
  bf16* out = nullptr;          // [T, Hq, D]
  int64_t out_row_stride = 0;
  float* lse = nullptr;  // [Hq, T]
};

// Host side, shared by the launchers: TMA's rules for a [rows, heads, D] operand (16-byte aligned
// start and row stride), and the operand as TMA sees it, (rows, D, heads) with strides
// (row_stride, 1, D). A single row has stride 0 in the params; TMA wants a positive multiple of
// 16 bytes and never steps past row 0 there.
inline bool Aligned16(const void* ptr, int64_t row_stride) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 &&
         (row_stride * static_cast<int64_t>(sizeof(bf16))) % 16 == 0;
}

// True when q, k, v and the prefix (when P > 0) fit TMA and T + P fits int32.
inline bool OperandsFitTma(const TreeAttentionParams& p) {
  return Aligned16(p.q, p.q_row_stride) && Aligned16(p.k, p.k_row_stride) &&
         Aligned16(p.v, p.v_row_stride) &&
         (p.prefix == 0 || (Aligned16(p.prefix_k, p.prefix_k_row_stride) &&
                            Aligned16(p.prefix_v, p.prefix_v_row_stride))) &&
         static_cast<int64_t>(p.tokens) + p.prefix < INT32_MAX;
}

template <int D>
typename ForwardTraits<D>::GmemTensor Gmem(const bf16* ptr, int rows, int heads,
                                           int64_t row_stride) {
  const int64_t stride = row_stride > 0 ? row_stride : static_cast<int64_t>(heads) * D;
  return make_tensor(make_gmem_ptr(reinterpret_cast<const Element*>(ptr)),
                     make_shape(rows, static_cast<int32_t>(D), heads),
                     make_stride(stride, _1{}, static_cast<int64_t>(D)));
}

// Sets params.tma_k, tma_v, tma_prefix_k and tma_prefix_v ((kBN, D) boxes) from p; the prefix
// ones alias the chunk's when P = 0 (no prefix tile is visited then).
template <int D, class Params>
void SetKeyValueTmas(const TreeAttentionParams& p, Params& params) {
  const auto slayout = take<0, 2>(typename ForwardTraits<D>::SmemLayoutKV{});
  const auto tile = typename ForwardTraits<D>::TileKV{};
  auto tma = [&](const bf16* ptr, int rows, int64_t row_stride) {
    return make_tma_copy(SM90_TMA_LOAD{}, Gmem<D>(ptr, rows, p.kv_heads, row_stride), slayout, tile,
                         _1{});
  };
  params.tma_k = tma(p.k, p.tokens, p.k_row_stride);
  params.tma_v = tma(p.v, p.tokens, p.v_row_stride);
  params.tma_prefix_k =
      p.prefix > 0 ? tma(p.prefix_k, p.prefix, p.prefix_k_row_stride) : params.tma_k;
  params.tma_prefix_v =
      p.prefix > 0 ? tma(p.prefix_v, p.prefix, p.prefix_v_row_stride) : params.tma_v;
}

// The key tiles one query tile [i0, i1) visits, in order: prefix tiles [0, n_pre), then chunk
// tile c as index n_pre + c for the c that some query of the tile may see.
template <int kBN, int kSubTiles>
struct TileWalk {
  const int32_t* tile_max_end;
  int n_pre;
  int n_total;
  int n_sub;  // ceil(T / 64)
  int i0;

  // tile_max_end of chunk tile c's sub-tiles (-1 past the chunk), loaded together.
  __device__ __forceinline__ void LoadMaxEnds(int c, int (&max_end)[kSubTiles]) const {
#pragma unroll
    for (int s = 0; s < kSubTiles; ++s) {
      const int sub = c * kSubTiles + s;
      max_end[s] = c >= 0 && sub < n_sub ? __ldg(tile_max_end + sub) : -1;
    }
  }

  __device__ __forceinline__ bool SeenGiven(const int (&max_end)[kSubTiles]) const {
    int m = -1;
#pragma unroll
    for (int s = 0; s < kSubTiles; ++s) m = max(m, max_end[s]);
    return m > i0;
  }

  __device__ __forceinline__ bool ChunkTileSeen(int c) const {
    int max_end[kSubTiles];
    LoadMaxEnds(c, max_end);
    return SeenGiven(max_end);
  }

  // The first visited tile index >= it, or n_total.
  __device__ __forceinline__ int Next(int it) const {
    while (it < n_total && it >= n_pre && !ChunkTileSeen(it - n_pre)) ++it;
    return it;
  }

  // Next(it + 1) from the tile_max_end of tile it + 1 loaded earlier (LoadMaxEnds(it + 1 - n_pre)):
  // no load waited for unless tile it + 1 is skipped (a tree's hidden tile, rare).
  __device__ __forceinline__ int NextGiven(int it, const int (&max_end_after)[kSubTiles]) const {
    const int after = it + 1;
    if (after >= n_total || after < n_pre || SeenGiven(max_end_after)) return min(after, n_total);
    return Next(after + 1);
  }
};

// The TMA loads of kv head hk's key (or value) tiles into the stages of s ((kBN, D, stages)), in
// TileWalk's index space: load(it, stage, barrier) copies prefix tile it < n_pre or chunk tile
// it - n_pre. chunk and prefix are the params' descriptors (tma_k and tma_prefix_k, or the v ones).
template <int D, class Tma, class Params, class SmemTensor>
__device__ __forceinline__ auto KeyTileLoader(const Tma& chunk, const Tma& prefix, const Params& p,
                                              int hk, int n_pre, SmemTensor& s) {
  const auto tile = typename ForwardTraits<D>::TileKV{};
  Tensor m_chunk = chunk.get_tma_tensor(make_shape(p.tokens, D, p.kv_heads));
  Tensor m_prefix = prefix.get_tma_tensor(make_shape(max(p.prefix, 1), D, p.kv_heads));
  auto t_chunk =
      tma_partition(chunk, _0{}, Layout<_1>{}, group_modes<0, 2>(s),
                    group_modes<0, 2>(local_tile(m_chunk(_, _, hk), tile, make_coord(_, _0{}))));
  auto t_prefix =
      tma_partition(prefix, _0{}, Layout<_1>{}, group_modes<0, 2>(s),
                    group_modes<0, 2>(local_tile(m_prefix(_, _, hk), tile, make_coord(_, _0{}))));
  return [=, &chunk, &prefix](int it, int stage, uint64_t& barrier) {
    if (it < n_pre) {
      copy(prefix.with(barrier, 0), get<0>(t_prefix)(_, it), get<1>(t_prefix)(_, stage));
    } else {
      copy(chunk.with(barrier, 0), get<0>(t_chunk)(_, it - n_pre), get<1>(t_chunk)(_, stage));
    }
  };
}

// tile_min_end of tile `it`'s sub-tiles when it is a chunk tile wholly inside the chunk (T
// otherwise: TileNeedsMaskGiven does not read them then), loaded together.
template <int kBN, int kSubTiles, class Params>
__device__ __forceinline__ void LoadMinEnds(const Params& p, int it, int n_pre,
                                            int (&min_end)[kSubTiles]) {
  const int c = it - n_pre;
  const bool inside = c >= 0 && (c + 1) * kBN <= p.tokens;
#pragma unroll
  for (int s = 0; s < kSubTiles; ++s)
    min_end[s] = inside ? __ldg(p.tile_min_end + c * kSubTiles + s) : p.tokens;
}

// True when tile `it` of a TileWalk (prefix tiles [0, n_pre) of kBN rows, then chunk tiles) hides
// some key from some of the query rows [w0, w1) (w1 <= T): the tile then needs the mask. min_end:
// LoadMinEnds(it).
template <int kBN, int kSubTiles, class Params>
__device__ __forceinline__ bool TileNeedsMaskGiven(const Params& p, int it, int n_pre, int w0,
                                                   int w1, const int (&min_end)[kSubTiles]) {
  if (it < n_pre) return (it + 1) * kBN > p.prefix;
  const int c = it - n_pre;
  const int j1 = (c + 1) * kBN;
  if (w0 >= p.tokens || j1 > p.tokens || j1 - 1 > w0) return true;
  int m = p.tokens;
#pragma unroll
  for (int s = 0; s < kSubTiles; ++s) m = min(m, min_end[s]);
  return w1 > m;
}

template <int kBN, int kSubTiles, class Params>
__device__ __forceinline__ bool TileNeedsMask(const Params& p, int it, int n_pre, int w0, int w1) {
  int min_end[kSubTiles];
  LoadMinEnds<kBN, kSubTiles>(p, it, n_pre, min_end);
  return TileNeedsMaskGiven<kBN, kSubTiles>(p, it, n_pre, w0, w1, min_end);
}

// Writes the fp32 accumulator acc (element i at (row, col) = coords(i) of its tile) as bf16 to
// rows row0 + row < rows of dst (row stride in elements), each pair of columns scaled by
// scale_of(i).
template <class TA, class TC, class Scale>
__device__ __forceinline__ void StoreBf16Rows(const TA& acc, const TC& coords, int row0, int rows,
                                              bf16* dst, int64_t row_stride, Scale&& scale_of) {
#pragma unroll
  for (int i = 0; i < size(acc); i += 2) {
    const int row = row0 + get<0>(coords(i));
    if (row >= rows) continue;
    const float s = scale_of(i);
    *reinterpret_cast<__nv_bfloat162*>(dst + row * row_stride + get<1>(coords(i))) =
        __floats2bfloat162_rn(acc(i) * s, acc(i + 1) * s);
  }
}

// FlashAttention-3's warpgroup GEMM: fences, arrive, one wgmma per k block, commit; waits for
// all but kWait batches when kWait >= 0.
template <bool kZeroInit, int kWait, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void WarpgroupGemm(TiledMma& mma, const TA& a, const TB& b, TC& c) {
  constexpr bool kRegisterA =
      !cute::is_base_of<cute::GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(c);
  if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<TA&>(a));
}

// The fp32 accumulator layout ((2, 2, N / 8), 1, 1) of a 64 x N wgmma seen as the bf16 A operand
// ((2, 2, 2), 1, N / 16) of a k16 wgmma: the same registers, regrouped (FlashAttention-3's
// convert_layout_acc_Aregs).
template <class Layout0>
__device__ __forceinline__ auto AccLayoutAsA(Layout0 acc) {
  using X = Underscore;
  auto l = logical_divide(get<0>(acc), Shape<X, X, _2>{});  // (2, 2, (2, N / 16))
  return make_layout(make_layout(get<0>(l), get<1>(l), get<2, 0>(l)), get<1>(acc),
                     coalesce(make_layout(get<2, 1>(l), get<2>(acc))));
}

__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Accumulator element i of a thread holds row g + 8 * ((i / 2) % 2) of its warp's 16 rows and
// column 8 * (i / 4) + 2 * (lane % 4) + i % 2: rows reduce over the 4 threads of a quad.
template <int kCols>
struct RowState {
  float max[2] = {-INFINITY, -INFINITY};  // raw (unscaled) running max; -inf while nothing seen
  float sum[2] = {0.f, 0.f};              // this thread's partial sum of exp2
};

// Online softmax over one masked score tile s (kCols columns per row): s becomes exp2 of the
// scaled scores against the new running max; alpha gets the factor that rescales O and the sum.
// Both rows at once and four partial maxima and sums per row: one warp per warpgroup runs on each
// scheduler, so the instruction-level parallelism has to come from within the thread.
template <int kCols, class TS>
__device__ __forceinline__ void SoftmaxStep(TS& s, RowState<kCols>& st, float (&alpha)[2],
                                            float scale_log2) {
  constexpr int kNt = kCols / 8;
  constexpr int kParts = 4;
  static_assert(kNt % kParts == 0, "columns split evenly over the partial reductions");
  float part[2][kParts];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int k = 0; k < kParts; ++k) part[r][k] = k == 0 ? st.max[r] : -INFINITY;
  }
#pragma unroll
  for (int n = 0; n < kNt; ++n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      part[r][n % kParts] =
          fmaxf(part[r][n % kParts], fmaxf(s(4 * n + 2 * r), s(4 * n + 2 * r + 1)));
    }
  }
  float m_use[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = fmaxf(fmaxf(part[r][0], part[r][1]), fmaxf(part[r][2], part[r][3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // Rows with nothing visible yet keep max -inf; m_use = 0 keeps their probabilities at 0.
    m_use[r] = mx == -INFINITY ? 0.f : mx * scale_log2;
    alpha[r] = Exp2(st.max[r] * scale_log2 - m_use[r]);
    st.max[r] = mx;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int k = 0; k < kParts; ++k) part[r][k] = 0.f;
  }
#pragma unroll
  for (int n = 0; n < kNt; ++n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pr = Exp2(fmaf(s(4 * n + 2 * r + e), scale_log2, -m_use[r]));
        s(4 * n + 2 * r + e) = pr;
        part[r][n % kParts] += pr;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    st.sum[r] = st.sum[r] * alpha[r] + ((part[r][0] + part[r][1]) + (part[r][2] + part[r][3]));
  }
}

template <class TO>
__device__ __forceinline__ void RescaleRows(TO& o, const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < size(o); ++i) o(i) *= alpha[(i >> 1) & 1];
}

// Sets s to -inf where query row i0 + row does not see key j0 + col of the tile; coords holds
// each element's (row, col) within the (kBM, kBN) tile. s is a 64 x N wgmma accumulator: elements
// 4n + {0, 1} of a thread hold columns c, c + 1 of one row and 4n + {2, 3} the same columns of
// another, c even. So a thread's key_end entries are one pair of adjacent keys per n, read with
// one 8-byte load (key_end is 16-byte aligned, j0 even), a batch of pairs issued before their
// compares: their latencies overlap instead of adding up (ncu: one load waited for per column
// before).
template <class TS, class TC>
__device__ __forceinline__ void MaskTile(TS& s, const TC& coords, bool is_prefix, int i0, int j0,
                                         int tokens, int prefix, const int32_t* key_end) {
  constexpr int kPairs = decltype(size(s))::value / 4;
  static_assert(kPairs * 4 == decltype(size(s))::value, "a wgmma accumulator: 4 elements per n");
  if (is_prefix) {
#pragma unroll
    for (int i = 0; i < size(s); ++i) {
      if (j0 + get<1>(coords(i)) >= prefix) s(i) = -INFINITY;
    }
    return;
  }
  // kBatch pairs at a time: more would hold more registers across the loads and spill the
  // forward's consumers (8 pairs spilled the dQ kernel's, all 16 the forward's).
  constexpr int kBatch = kPairs < 4 ? kPairs : 4;
  static_assert(kPairs % kBatch == 0, "whole batches of pairs");
#pragma unroll
  for (int n0 = 0; n0 < kPairs; n0 += kBatch) {
    int2 end[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int key = j0 + get<1>(coords(4 * (n0 + b)));
      if (key + 1 < tokens) {
        end[b] = __ldg(reinterpret_cast<const int2*>(key_end + key));
      } else {
        end[b] = make_int2(key < tokens ? __ldg(key_end + key) : 0, 0);  // keys >= T: hidden
      }
    }
#pragma unroll
    for (int i = 4 * n0; i < 4 * (n0 + kBatch); ++i) {
      const int query = i0 + get<0>(coords(i));
      const int key = j0 + get<1>(coords(i));
      const int e = i % 2 == 0 ? end[i / 4 - n0].x : end[i / 4 - n0].y;
      if (!(key <= query && query < e)) s(i) = -INFINITY;
    }
  }
}

// Work unit u (a query tile of one head) of the persistent grid. Units walk sections of
// section_heads query heads whose keys and values fit in L2 together; within a section heads vary
// fastest and later (heavier under causal masks) query tiles come first.
struct WorkUnit {
  int h;
  int m_block;
};

template <int D>
__device__ __forceinline__ WorkUnit UnitAt(const ForwardParams<D>& p, int u) {
  const int per_section = p.section_heads * p.m_blocks;
  const int section = u / per_section;
  const int in_section = u - section * per_section;
  const int heads_here = min(p.section_heads, p.q_heads - section * p.section_heads);
  return {section * p.section_heads + in_section % heads_here,
          p.m_blocks - 1 - in_section / heads_here};
}

template <int D>
__global__ void __launch_bounds__(ForwardTraits<D>::kThreads, 1)
    HopperForwardKernel(const __grid_constant__ ForwardParams<D> p) {
  using Traits = ForwardTraits<D>;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Traits::PipelineState;
  using Walk = TileWalk<ForwardTraits<D>::kBN, Traits::kSubTiles>;
  constexpr int kBM = Traits::kBM;
  constexpr int kBN = Traits::kBN;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  const int warpgroup = threadIdx.x / 128;
  const int tokens = p.tokens;
  const int total_units = p.m_blocks * p.q_heads;
  const int n_pre = (p.prefix + kBN - 1) / kBN;
  const int n_sub =
      (tokens + tree_attention_detail::kKeyTile - 1) / tree_attention_detail::kKeyTile;
  auto walk_of = [&](int i0) {
    const int i1 = min(i0 + kBM, tokens);
    return Walk{p.tile_max_end, n_pre, n_pre + (i1 + kBN - 1) / kBN, n_sub, i0};
  };

  if (threadIdx.x == 0) {
    smem.barrier_q.init(1);
    smem.barrier_q_empty.init(Traits::kConsumerThreads);
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
  }
  typename Pipeline::Params pipeline_params;
  pipeline_params.transaction_bytes = Traits::kTileBytes;
  pipeline_params.role =
      warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipeline_params.is_leader = threadIdx.x == 0;
  pipeline_params.num_consumers = Traits::kConsumerThreads;
  Pipeline pipeline_k(smem.pipeline_k, pipeline_params, Shape<_1, _1, _1>{});
  Pipeline pipeline_v(smem.pipeline_v, pipeline_params, Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (threadIdx.x != 0) return;
    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(tokens, D, p.q_heads));
    PipelineState write = cutlass::make_producer_start_state<Pipeline>();
    // Units are handed out in order, the first wave by blockIdx.x and then one at a time to the
    // CTA that asks first (greedy longest-first, and the units in flight stay close in the order,
    // so their keys and values share L2). The consumers learn each unit through smem.unit,
    // published with Q's barrier; a unit >= total_units tells them to stop.
    for (int r = 0, u = blockIdx.x;; ++r, u = gridDim.x + atomicAdd(p.unit_counter, 1)) {
      if (u >= total_units) {
        if (r > 0) smem.barrier_q_empty.wait((r - 1) & 1);
        smem.unit = u;
        smem.barrier_q.arrive();
        break;
      }
      const WorkUnit unit = UnitAt(p, u);
      const int hk = unit.h / (p.q_heads / p.kv_heads);
      const Walk walk = walk_of(unit.m_block * kBM);
      Tensor gQ =
          local_tile(mQ(_, _, unit.h), typename Traits::TileQ{}, make_coord(unit.m_block, _0{}));
      auto [tQgQ, tQsQ] =
          tma_partition(p.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto load_k_tile = KeyTileLoader<D>(p.tma_k, p.tma_prefix_k, p, hk, n_pre, sK);
      auto load_v_tile = KeyTileLoader<D>(p.tma_v, p.tma_prefix_v, p, hk, n_pre, sV);
      auto load_k = [&](int it) {
        const int stage = write.index();
        pipeline_k.producer_acquire(write);
        load_k_tile(it, stage, *pipeline_k.producer_get_barrier(write));
      };
      auto load_v = [&](int it) {
        const int stage = write.index();
        pipeline_v.producer_acquire(write);
        load_v_tile(it, stage, *pipeline_v.producer_get_barrier(write));
      };
      // The unit's first K tile may load while the consumers finish the previous unit; its Q
      // waits until they have read the previous Q.
      int it = walk.Next(0);
      if (it < walk.n_total) load_k(it);
      if (r > 0) smem.barrier_q_empty.wait((r - 1) & 1);
      smem.unit = u;
      smem.barrier_q.arrive_and_expect_tx(Traits::kQBytes);
      copy(p.tma_q.with(reinterpret_cast<cutlass::arch::ClusterTransactionBarrier::ValueType&>(
                            smem.barrier_q),
                        0),
           tQgQ, tQsQ);
      if (it < walk.n_total) {
        load_v(it);
        ++write;
        for (it = walk.Next(it + 1); it < walk.n_total; it = walk.Next(it + 1)) {
          load_k(it);
          load_v(it);
          ++write;
        }
      }
    }
    return;
  }

  // Consumers.
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int ctid = threadIdx.x - 128;
  const int wg = warpgroup - 1;

  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(ctid);
  auto thr_pv = mma_pv.get_thread_slice(ctid);
  Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);  // (MMA, MMA_M, MMA_K)
  Tensor tSrK = thr_qk.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_K, stages)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);
  Tensor acc_s = partition_fragment_C(mma_qk, Shape<Int<kBM>, Int<kBN>>{});
  Tensor acc_o = partition_fragment_C(mma_pv, Shape<Int<kBM>, Int<D>>{});
  static_assert(decltype(size(acc_s))::value == kBN / 2, "64 x kBN per warpgroup");
  static_assert(decltype(size(acc_o))::value == D / 2, "64 x D per warpgroup");
  Tensor coords_s = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));
  Tensor coords_o = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<D>>{}));
  Tensor r_p = make_tensor<Element>(acc_s.layout());
  Tensor tOrP = make_tensor(r_p.data(), AccLayoutAsA(acc_s.layout()));
  const float scale_log2 = p.scale_log2;

  // FlashAttention-3's warpgroup ping-pong: a warpgroup issues its GEMMs only after the other one
  // has issued its own, so that one's softmax overlaps the other's GEMMs. Named barriers 0 (for
  // warpgroup 1) and 1 (warpgroup 2) of 256 threads: sync on one's own, arrive on the other's.
  // Both warpgroups issue the same number of GEMM batches per unit, so the turns stay paired.
  auto scheduler_sync = [&] { cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, wg); };
  auto scheduler_arrive = [&] {
    cutlass::arch::NamedBarrier::arrive(Traits::kConsumerThreads, 1 - wg);
  };
  if (wg == 0) cutlass::arch::NamedBarrier::arrive(Traits::kConsumerThreads, 0);  // goes first

  PipelineState read_k;
  PipelineState read_v;
  for (int r = 0;; ++r) {
    smem.barrier_q.wait(r & 1);
    const int u = smem.unit;
    if (u >= total_units) break;
    const WorkUnit unit = UnitAt(p, u);
    const int h = unit.h;
    const int i0 = unit.m_block * kBM;
    const Walk walk = walk_of(i0);
    // Query rows [w0, w1) of this warpgroup; w0 >= T when the chunk ends before it.
    const int w0 = i0 + wg * 64;
    const int w1 = min(w0 + 64, tokens);

    // True when tile `it` needs the mask for this warpgroup's rows (some key of it is hidden from
    // some row). Asked directly for a unit's first tile, whose Q K^T runs meanwhile.
    auto needs_mask = [&](int it) {
      return TileNeedsMask<kBN, Traits::kSubTiles>(p, it, n_pre, w0, w1);
    };
    auto mask = [&](int it) {
      const bool is_prefix = it < n_pre;
      const int j0 = (is_prefix ? it : it - n_pre) * kBN;
      MaskTile(acc_s, coords_s, is_prefix, i0, j0, tokens, p.prefix, p.key_end);
    };
    // P in bf16, two columns per cvt.rn.bf16x2.
    auto to_p = [&]() {
      Tensor r_p32 = recast<uint32_t>(r_p);
#pragma unroll
      for (int i = 0; i < size(r_p32); ++i) {
        __nv_bfloat162 v = __floats2bfloat162_rn(acc_s(2 * i), acc_s(2 * i + 1));
        r_p32(i) = reinterpret_cast<uint32_t&>(v);
      }
    };

    // The facts of the tile after the current one (does it need the mask, which tile follows
    // it) come from global loads issued one tile early, while the GEMMs run, and read a tile
    // later: their latency never sits between a tile's Q K^T and its softmax (ncu: the walk's
    // dependent loads stalled the consumers for a tenth of the samples before).
    int min_end_ahead[Traits::kSubTiles];  // tile_min_end of `next`
    int max_end_ahead[Traits::kSubTiles];  // tile_max_end of `next + 1`
    auto load_ahead = [&](int next) {
      LoadMinEnds<kBN, Traits::kSubTiles>(p, next, n_pre, min_end_ahead);
      walk.LoadMaxEnds(next + 1 - n_pre, max_end_ahead);
    };

    RowState<kBN> st;
    float alpha[2];
    clear(acc_o);
    int it = walk.Next(0);
    if (it < walk.n_total) {
      pipeline_k.consumer_wait(read_k);
      scheduler_sync();
      WarpgroupGemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), acc_s);
      scheduler_arrive();
      bool masked = needs_mask(it);
      int next = walk.Next(it + 1);
      load_ahead(next);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_s);
      pipeline_k.consumer_release(read_k);
      ++read_k;
      if (masked) mask(it);
      SoftmaxStep(acc_s, st, alpha, scale_log2);
      to_p();
      it = next;
      while (it < walk.n_total) {
        masked = TileNeedsMaskGiven<kBN, Traits::kSubTiles>(p, it, n_pre, w0, w1, min_end_ahead);
        next = walk.NextGiven(it, max_end_ahead);
        pipeline_k.consumer_wait(read_k);
        scheduler_sync();
        WarpgroupGemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), acc_s);
        pipeline_v.consumer_wait(read_v);
        WarpgroupGemm<false, -1>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), acc_o);
        scheduler_arrive();
        load_ahead(next);
        warpgroup_wait<1>();  // Q K^T of this tile done; P V of the previous one may run on
        warpgroup_fence_operand(acc_s);
        pipeline_k.consumer_release(read_k);
        ++read_k;
        if (masked) mask(it);
        SoftmaxStep(acc_s, st, alpha, scale_log2);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        warpgroup_fence_operand(r_p);
        pipeline_v.consumer_release(read_v);
        ++read_v;
        RescaleRows(acc_o, alpha);
        to_p();
        it = next;
      }
      // Every Q K^T of the unit is done: the producer may load the next unit's Q.
      smem.barrier_q_empty.arrive();
      pipeline_v.consumer_wait(read_v);
      WarpgroupGemm<false, 0>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), acc_o);
      pipeline_v.consumer_release(read_v);
      ++read_v;
    } else {
      smem.barrier_q_empty.arrive();
    }

    // Epilogue: normalise, write O and the natural log-sum-exp.
    float inv[2];
    float lse[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      float sum = st.sum[q];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      inv[q] = sum > 0.f ? 1.f / sum : 0.f;
      lse[q] = sum > 0.f ? st.max[q] * p.scale + logf(sum) : -INFINITY;
    }
    StoreBf16Rows(acc_o, coords_o, i0, tokens, p.out + h * D, p.out_row_stride,
                  [&](int i) { return inv[(i >> 1) & 1]; });
    if ((threadIdx.x & 3) == 0) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int row = i0 + get<0>(coords_o(2 * q));
        if (row < tokens) p.lse[static_cast<int64_t>(h) * tokens + row] = lse[q];
      }
    }
  }
}

}  // namespace dta::kernels::hopper_detail

#endif  // DTA_KERNELS_HOPPER_TREE_ATTENTION_HOPPER_KERNEL_CUH_

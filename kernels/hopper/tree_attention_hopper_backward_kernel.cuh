// The Hopper tree-attention backward kernels (see tree_attention_hopper.h): CuTe / CUTLASS device
// code, included only by tree_attention_hopper_backward.cu (compiled for sm_90a).
//
// Two kernels, as in the FlashAttention-2 backward of kernels/tree_attention_kernel.cuh, so that
// every gradient element is owned by one thread that sums in a fixed order (no atomics: bitwise
// deterministic). Both read row_dot (rowsum(dO * O), written by the FlashAttention-2 RowDotKernel)
// and lse, and recompute P = exp(scale * Q K^T - lse). Three warpgroups each, one CTA per SM:
//   warpgroup 0    producer: one thread issues TMA loads into a PipelineTmaAsync ring; its
//                  registers go to the consumers (setmaxnreg).
//   warpgroups 1-2 consumers running warpgroup MMAs (wgmma) with fp32 accumulators.
//
// HopperDqKernel: one CTA per (128-row query tile, query head); each consumer warpgroup owns 64
// query rows. Q and dO load once; K and V of every visible key tile (the forward's TileWalk)
// stream through the ring. Per tile: S = Q K^T and dP = dO V^T issued together (both operands in
// shared memory), P = exp(S - lse), dS = P * (dP - row_dot) in registers, dQ += dS K
// (dS from registers, K^T as a view of the K tile). dQ is scaled and written from registers.
//
// HopperDkDvKernel: one CTA per (128-key tile, kv head); each consumer warpgroup owns 64 keys,
// K and V load once. For each query head of the kv head's group, for each 64-row query tile that
// sees the key tile (prefix tiles: all of them; chunk tile c: [c * 128, max key_end over it)), Q,
// dO and the tile's row statistics (lse * log2(e) and row_dot, which HopperRowStatsKernel lays
// out per tile, padded) stream through the ring. Per query tile: S^T = K Q^T and dP^T = V dO^T
// (shared memory operands) issued together; P^T as soon as S^T is done, while dP^T runs, in one
// of two copies of the loop (tiles every query of which every key sees skip the mask); dV += P^T
// dO issued at once; dS^T while dV runs; dK += dS^T Q (P^T and dS^T from registers, dO^T and Q^T
// as views of the stage). Chunk rows are written in bf16; prefix rows are added into the float32
// accumulators, each element by its one thread.
//
// Both kernels sum in the FlashAttention-2 kernels' order (64-row query tiles, keys in 16-wide
// steps, prefix tiles first), so their gradients come out bitwise equal to those kernels' on the
// tests' cases. No GEMM stays in flight across a loop's back edge: ptxas then waits for it anyway
// (C7517), or serialises every GEMM of the loop. The price of determinism is 7 GEMMs per score
// tile instead of 5 (dQ recomputes S and dP).
//
// HopperDkDvKernel<D, true> (opt-in, D = 64 and 128; D = 256 in the head-split file) is
// FlashAttention-3's single kernel with a fixed-order dQ reduction: the dK/dV kernel also writes
// each query tile's dS^T to shared memory, computes dQ's part dS K, and a writer warp adds the
// parts into a float32 workspace in a fixed order of key tiles (FusedTileOrder, one semaphore per
// query tile); HopperDqFromPartsKernel then writes dQ. 5 GEMMs per score tile, bitwise
// deterministic, dK and dV bitwise those of the two kernels; on the H200 still slower than them
// (docs/benchmarks.md: the warpgroups meet at every tile for dS, and the ordered float32 adds stall
// them). A writer that waits 30 s for a tile's earlier parts traps (kDqWaitLimitNs): a broken
// order fails the launch instead of hanging.
#ifndef DTA_KERNELS_HOPPER_TREE_ATTENTION_HOPPER_BACKWARD_KERNEL_CUH_
#define DTA_KERNELS_HOPPER_TREE_ATTENTION_HOPPER_BACKWARD_KERNEL_CUH_

#include <type_traits>

#include "kernels/hopper/tree_attention_hopper.h"
#include "kernels/hopper/tree_attention_hopper_kernel.cuh"

namespace dta::kernels::hopper_detail {

template <int D>
struct BackwardTraits {
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = 128 + kConsumerThreads;
  using Forward = ForwardTraits<D>;

  // dQ kernel: 128 query rows (2 x 64), 128-key tiles, K and V per stage. The forward's TMA boxes
  // (Q and dO as the forward's Q, K and V as its K and V).
  static constexpr int kDqBM = 128;
  static constexpr int kDqBN = 128;
  static constexpr int kDqStages = 2;  // Q + dO 64 KiB, 2 x (K + V) 128 KiB
  static constexpr int kDqSubTiles = kDqBN / tree_attention_detail::kKeyTile;
  static_assert(kDqBM == Forward::kBM && kDqBN == Forward::kBN, "the forward's TMA boxes");
  using TiledMmaS = SmemSmemMma<kDqBN, D>;            // S = Q K^T and dP = dO V^T
  using TiledMmaDq = RegSmemMma<D, kDqBN>;            // dQ += dS K
  using SmemLayoutQ = typename Forward::SmemLayoutQ;  // (128, D), also dO
  using SmemLayoutKV = StagedTiles<kDqBN, D, kDqStages>;
  using SmemLayoutKt = StagedTilesT<kDqBN, D, kDqStages>;  // K^T, the B operand of dS K
  using PipelineDq = cutlass::PipelineTmaAsync<kDqStages>;
  static constexpr uint32_t kDqTileBytes = kDqBN * D * sizeof(Element);
  static constexpr uint32_t kDqQBytes = kDqBM * D * sizeof(Element);

  struct DqSharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> d_out;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> v;
    typename PipelineDq::SharedStorage pipeline;
    cutlass::arch::ClusterTransactionBarrier barrier_q;  // Q and dO landed
  };
  static constexpr int kDqSmemBytes = static_cast<int>(sizeof(DqSharedStorage));

  // dK/dV kernel: 128 keys (2 x 64) in the forward's key tiles, 64-row query tiles, Q and dO per
  // stage (the stage count and shared storage are DkDvConfig's).
  static constexpr int kKvBN = Forward::kBN;
  static constexpr int kKvBM = kHopperBackwardQueryTile;
  static constexpr int kKvSubTiles = kKvBN / tree_attention_detail::kKeyTile;
  using TiledMmaSt = SmemSmemMma<kKvBM, D>;        // S^T = K Q^T and dP^T = V dO^T
  using TiledMmaDkv = RegSmemMma<D, kKvBM>;        // dV += P^T dO and dK += dS^T Q
  using SmemLayoutK = StagedTiles<kKvBN, D, 1>;    // also V; one stage
  using SmemLayoutQdO = StagedTiles<kKvBM, D, 1>;  // one stage: the TMA boxes of Q and dO
  static constexpr uint32_t kKvTileBytes = kKvBN * D * sizeof(Element);
  static constexpr uint32_t kKvQBytes = kKvBM * D * sizeof(Element);
  // A query tile's row statistics (row_stats: lse * log2(e), then row_dot), bulk-copied with its
  // Q and dO.
  static constexpr int kKvStatFloats = 2 * kKvBM;
  static constexpr uint32_t kKvStatBytes = kKvStatFloats * sizeof(float);
  static constexpr uint32_t kKvStageBytes = 2 * kKvQBytes + kKvStatBytes;

  // The single-kernel backward (the dK/dV kernel computing dQ too): each query tile's dS^T goes to
  // shared memory (two buffers, queries contiguous), the warpgroups compute the tile's dQ part
  // dS K (both operands in shared memory), and a writer warp adds it into p.dq_accum in a fixed
  // order of key tiles. At D = 128 the two warpgroups split D ((64, 64) each over all 128 keys,
  // whole 128-byte swizzle atoms of K^T); at D = 64 (a single atom) they split the keys instead:
  // each multiplies its own 64 keys' dS by their rows of K, (64, 64) over 64 keys, without waiting
  // for the other's dS^T, and the writer adds the two partial parts in warpgroup order.
  static constexpr bool kDqKeySplit = D == 64;
  using SmemLayoutDsT = StagedTiles<kKvBN, kKvBM, 2>;  // dS^T (keys, queries) x 2 buffers
  using SmemLayoutDs = StagedTilesT<kKvBN, kKvBM, 2>;  // the same as dS (queries, keys)
  using SmemLayoutKvKt = StagedTilesT<kKvBN, D, 1>;    // K^T (D, keys): B of dS K
  // A warpgroup's 64 keys under the key split: rows [64 w, 64 w + 64) of a (128, 64) tile of
  // 128-byte atoms are the 64 x 64 tile at element offset 64 w * 64 (the atoms stack along rows).
  using SmemLayoutDsHalf = StagedTilesT<kKvBN / 2, kKvBM, 1>;  // dS (queries, 64 keys)
  using SmemLayoutKtHalf = StagedTilesT<kKvBN / 2, D, 1>;      // K^T (D, 64 keys)
  using TiledMmaDqPart = std::conditional_t<
      kDqKeySplit,
      decltype(make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<D>, Int<kKvBN / 2>>,
                               GMMA::Major::MN, GMMA::Major::MN>(),
          Layout<Shape<_1, _1, _1>>{})),  // one warpgroup, its own keys
      decltype(make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<D / 2>, Int<kKvBN>>,
                               GMMA::Major::MN, GMMA::Major::MN>(),
          Layout<Shape<_1, _2, _1>>{}))>;          // the two warpgroups split D
  static constexpr int kDqPartFloats = kKvBM * D;  // one query tile's dQ part
  // A buffer handed to the writer: the part's two halves of D side by side, or under the key
  // split the two warpgroups' partial parts one after the other.
  static constexpr int kDqBufferFloats = kDqKeySplit ? 2 * kDqPartFloats : kDqPartFloats;
  static constexpr int kDqBuffers = 2;  // the consumers fill one while the writer adds the other
  // HopperDqFromPartsKernel's CTAs per query tile: one per half of D, or one under the key split.
  static constexpr int kDqFromPartsCtas = kDqKeySplit ? 1 : 2;

  using TmaQ = typename Forward::TmaQ;    // (128, D) boxes: Q and dO of the dQ kernel
  using TmaKV = typename Forward::TmaKV;  // (128, D) boxes: K, V, prefix K and V
  using TmaQ64 =
      decltype(make_tma_copy(SM90_TMA_LOAD{}, typename Forward::GmemTensor{},
                             take<0, 2>(SmemLayoutQdO{}), Shape<Int<kKvBM>, Int<D>>{}, _1{}));
};

// The dK/dV kernel's stages and shared memory, without dQ (4 stages: K + V 64 KiB, 4 x (Q + dO)
// 128 KiB at D = 128) and with it (2 stages, + dS^T 2 x 16 KiB + dQ's buffers 2 x 32 KiB at D = 64
// and 128).
template <int D, bool kWithDq>
struct DkDvConfig {
  using Traits = BackwardTraits<D>;
  static constexpr int kStages = kWithDq ? 2 : 4;
  static constexpr int kDsElements = kWithDq ? cute::cosize_v<typename Traits::SmemLayoutDsT> : 1;
  static constexpr int kDqFloats = kWithDq ? Traits::kDqBuffers * Traits::kDqBufferFloats : 4;
  using SmemLayoutQdO = StagedTiles<Traits::kKvBM, D, kStages>;
  using SmemLayoutQdOt = StagedTilesT<Traits::kKvBM, D, kStages>;  // Q^T and dO^T, B operands
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutK>, 1024> v;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQdO>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQdO>, 1024> d_out;
    cute::array_aligned<Element, kDsElements, 1024> ds;
    cute::array_aligned<float, kDqFloats, 128> dq;
    cute::array_aligned<float, kStages * Traits::kKvStatFloats, 16> row_stats;
    typename Pipeline::SharedStorage pipeline;
    cutlass::arch::ClusterTransactionBarrier barrier_kv;  // K and V landed
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "fits an SM");
};

// The shared params (sizes, workspace, lse, row_dot, gradients; their pointers to q, k, v and
// grad_out are the TMA descriptors' sources) and the TMA descriptors of both kernels.
template <int D>
struct BackwardParams : TreeAttentionParams {
  using Traits = BackwardTraits<D>;
  typename Traits::TmaQ tma_q;          // Q [T, Hq, D], 128-row boxes
  typename Traits::TmaQ tma_do;         // dO [T, Hq, D], 128-row boxes
  typename Traits::TmaQ64 tma_q64;      // Q, 64-row boxes
  typename Traits::TmaQ64 tma_do64;     // dO, 64-row boxes
  typename Traits::TmaKV tma_k;         // chunk keys [T, Hkv, D]
  typename Traits::TmaKV tma_v;         // chunk values
  typename Traits::TmaKV tma_prefix_k;  // prefix keys [P, Hkv, D]; the chunk's when P = 0
  typename Traits::TmaKV tma_prefix_v;
};

// Sets up the TMA-fed pipeline of a backward kernel: warpgroup 0 produces, the rest consume.
template <class Pipeline>
__device__ __forceinline__ typename Pipeline::Params BackwardPipelineParams(uint32_t bytes,
                                                                            int consumers) {
  typename Pipeline::Params params;
  params.transaction_bytes = bytes;
  params.role =
      threadIdx.x < 128 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = consumers;
  return params;
}

// Adds the fp32 accumulator acc times scale into float32 rows row0 + row < rows of dst (row stride
// in elements, 8-byte aligned rows): element i at (row, col) = coords(i), one thread per element.
template <class TA, class TC>
__device__ __forceinline__ void AddFloatRows(const TA& acc, const TC& coords, int row0, int rows,
                                             float* dst, int64_t row_stride, float scale) {
#pragma unroll
  for (int i = 0; i < size(acc); i += 2) {
    const int row = row0 + get<0>(coords(i));
    if (row >= rows) continue;
    float2* d = reinterpret_cast<float2*>(dst + row * row_stride + get<1>(coords(i)));
    float2 a = *d;
    a.x += acc(i) * scale;
    a.y += acc(i + 1) * scale;
    *d = a;
  }
}

// Fills p.row_stats from p.lse and p.row_dot (one thread per padded row): the dK/dV kernel's
// producer then copies a query tile's statistics with one bulk copy, and its consumers read them
// from shared memory without bounds tests. lse * log2(e) is the multiply the kernels did in
// registers, so P comes out in the same bits.
template <int BM>
__global__ void HopperRowStatsKernel(const TreeAttentionParams p) {
  internal::WaitForPreviousKernels();
  const int m_blocks = (p.tokens + BM - 1) / BM;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(p.q_heads) * m_blocks * BM) return;
  const int64_t tile = idx / BM;  // h * m_blocks + m
  const int column = static_cast<int>(idx % BM);
  const int h = static_cast<int>(tile / m_blocks);
  const int row = static_cast<int>(tile % m_blocks) * BM + column;
  const int64_t at = static_cast<int64_t>(h) * p.tokens + row;
  float* stats = p.row_stats + tile * 2 * BM;
  stats[column] = row < p.tokens ? p.lse[at] * tree_attention_detail::kLog2e : INFINITY;
  stats[BM + column] = row < p.tokens ? p.row_dot[at] : 0.f;
}

// The query tile a dQ kernel's CTA owns (later, heavier under causal masks, query tiles first,
// heads fastest), its kv head and the key tiles it visits.
template <int kBM, int kBN, int kSubTiles>
struct DqUnit {
  int h;
  int m_block;
  int hk;
  int i0;
  int i1;  // min(i0 + kBM, T)
  TileWalk<kBN, kSubTiles> walk;

  __device__ __forceinline__ explicit DqUnit(const TreeAttentionParams& p) {
    const int m_blocks = (p.tokens + kBM - 1) / kBM;
    h = blockIdx.x % p.q_heads;
    m_block = m_blocks - 1 - static_cast<int>(blockIdx.x / p.q_heads);
    hk = h / (p.q_heads / p.kv_heads);
    i0 = m_block * kBM;
    i1 = min(i0 + kBM, p.tokens);
    const int n_pre = (p.prefix + kBN - 1) / kBN;
    constexpr int kSub = tree_attention_detail::kKeyTile;
    walk = {p.tile_max_end, n_pre, n_pre + (i1 + kBN - 1) / kBN, (p.tokens + kSub - 1) / kSub, i0};
  }
};

// The key tile a dK/dV kernel's CTA owns (prefix tiles first, then chunk tiles from the start:
// heavier under causal masks first), its kv head and the query tiles [q_first, q_first + nq) of
// each query head of the group that see it.
template <int kBM, int kBN, int kSubTiles>
struct DkDvUnit {
  int tile;  // prefix tile `tile` < n_pre, else chunk tile tile - n_pre
  int hk;
  int n_pre;
  bool is_prefix;
  int j0;  // the tile's first key, within the prefix or the chunk
  int q_first = 0;
  int nq;
  int tile_min_end = 0;  // min key_end over the tile's keys (chunk tiles whole in the chunk)

  __device__ __forceinline__ explicit DkDvUnit(const TreeAttentionParams& p)
      : DkDvUnit(p, blockIdx.x / p.kv_heads, blockIdx.x % p.kv_heads) {}

  __device__ __forceinline__ DkDvUnit(const TreeAttentionParams& p, int key_tile, int kv_head) {
    tile = key_tile;
    hk = kv_head;
    n_pre = (p.prefix + kBN - 1) / kBN;
    is_prefix = tile < n_pre;
    j0 = (is_prefix ? tile : tile - n_pre) * kBN;
    int q_last = (p.tokens + kBM - 1) / kBM;
    if (!is_prefix) {
      const int n_sub =
          (p.tokens + tree_attention_detail::kKeyTile - 1) / tree_attention_detail::kKeyTile;
      int max_end = 0;
      tile_min_end = p.tokens;
#pragma unroll
      for (int s = 0; s < kSubTiles; ++s) {
        const int sub = j0 / tree_attention_detail::kKeyTile + s;
        if (sub < n_sub) {
          max_end = max(max_end, __ldg(p.tile_max_end + sub));
          tile_min_end = min(tile_min_end, __ldg(p.tile_min_end + sub));
        }
      }
      q_first = j0 / kBM;
      q_last = (max_end + kBM - 1) / kBM;
    }
    nq = max(q_last - q_first, 0);
  }
};

// A dQ kernel's producer thread, after the unit's Q and dO: K and V of every key tile the walk
// visits into the stages of sK and sV ((rows, D, stages)) through `pipeline`.
template <int D, class Params, class Unit, class SmemKV, class Pipeline>
__device__ __forceinline__ void ProduceKeyTiles(const Params& p, const Unit& u, SmemKV& sK,
                                                SmemKV& sV, Pipeline& pipeline) {
  auto load_k = KeyTileLoader<D>(p.tma_k, p.tma_prefix_k, p, u.hk, u.walk.n_pre, sK);
  auto load_v = KeyTileLoader<D>(p.tma_v, p.tma_prefix_v, p, u.hk, u.walk.n_pre, sV);
  auto write = cutlass::make_producer_start_state<Pipeline>();
  for (int it = u.walk.Next(0); it < u.walk.n_total; it = u.walk.Next(it + 1)) {
    pipeline.producer_acquire(write);
    const int stage = write.index();
    auto& bar = *pipeline.producer_get_barrier(write);
    load_k(it, stage, bar);
    load_v(it, stage, bar);
    ++write;
  }
}

// A dQ kernel's producer thread: the unit's Q and dO (kBM-row boxes of tma_q and tma_do) into sQ
// and sdO (a tile, or a ring of one stage) on q_barrier, then ProduceKeyTiles.
template <int D, int kBM, class Params, class Tma, class Unit, class SmemQ, class SmemKV,
          class Pipeline>
__device__ __forceinline__ void ProduceDqInputs(const Params& p, const Tma& tma_q,
                                                const Tma& tma_do, const Unit& u, SmemQ& sQ,
                                                SmemQ& sdO,
                                                cutlass::arch::ClusterTransactionBarrier& q_barrier,
                                                SmemKV& sK, SmemKV& sV, Pipeline& pipeline) {
  Tensor mQ = tma_q.get_tma_tensor(make_shape(p.tokens, D, p.q_heads));
  Tensor mdO = tma_do.get_tma_tensor(make_shape(p.tokens, D, p.q_heads));
  auto tile_q = Shape<Int<kBM>, Int<D>>{};
  Tensor gQ = local_tile(mQ(_, _, u.h), tile_q, make_coord(u.m_block, _0{}));
  Tensor gdO = local_tile(mdO(_, _, u.h), tile_q, make_coord(u.m_block, _0{}));
  auto [tQg, tQs] =
      tma_partition(tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
  auto [tdOg, tdOs] =
      tma_partition(tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
  q_barrier.arrive_and_expect_tx(2 * kBM * D * sizeof(Element));
  auto& bar_q = reinterpret_cast<cutlass::arch::ClusterTransactionBarrier::ValueType&>(q_barrier);
  if constexpr (decltype(rank(sQ))::value == 3) {
    copy(tma_q.with(bar_q, 0), tQg, tQs(_, 0));
    copy(tma_do.with(bar_q, 0), tdOg, tdOs(_, 0));
  } else {
    copy(tma_q.with(bar_q, 0), tQg, tQs);
    copy(tma_do.with(bar_q, 0), tdOg, tdOs);
  }
  ProduceKeyTiles<D>(p, u, sK, sV, pipeline);
}

// A dK/dV kernel's producer thread: the unit's K and V tile into sK and sV ((rows, D, 1)) on
// barrier_kv, then, for each query head of the group and each query tile that sees the keys, the
// tile's Q and dO (kBM-row boxes of tma_q and tma_do) into the stages of sQ and sdO and its row
// statistics (p.row_stats, kStatFloats per tile) into stats[stage * kStatFloats] through
// `pipeline`.
template <int D, int kBM, int kStatFloats, class Params, class Tma, class Unit, class SmemKV,
          class SmemQ, class Pipeline>
__device__ __forceinline__ void ProduceQueryTiles(const Params& p, const Tma& tma_q,
                                                  const Tma& tma_do, const Unit& u, SmemKV& sK,
                                                  SmemKV& sV, SmemQ& sQ, SmemQ& sdO, float* stats,
                                                  cutlass::arch::ClusterTransactionBarrier& kv,
                                                  uint32_t kv_bytes, Pipeline& pipeline) {
  auto& bar_kv = reinterpret_cast<cutlass::arch::ClusterTransactionBarrier::ValueType&>(kv);
  kv.arrive_and_expect_tx(kv_bytes);
  KeyTileLoader<D>(p.tma_k, p.tma_prefix_k, p, u.hk, u.n_pre, sK)(u.tile, 0, bar_kv);
  KeyTileLoader<D>(p.tma_v, p.tma_prefix_v, p, u.hk, u.n_pre, sV)(u.tile, 0, bar_kv);
  Tensor mQ = tma_q.get_tma_tensor(make_shape(p.tokens, D, p.q_heads));
  Tensor mdO = tma_do.get_tma_tensor(make_shape(p.tokens, D, p.q_heads));
  auto tile_q = Shape<Int<kBM>, Int<D>>{};
  const int m_blocks = (p.tokens + kBM - 1) / kBM;
  const int group = p.q_heads / p.kv_heads;
  auto write = cutlass::make_producer_start_state<Pipeline>();
  for (int iter = 0; iter < group * u.nq; ++iter) {
    const int h = u.hk * group + iter / u.nq;
    const int m = u.q_first + iter % u.nq;
    Tensor gQ = local_tile(mQ(_, _, h), tile_q, make_coord(m, _0{}));
    Tensor gdO = local_tile(mdO(_, _, h), tile_q, make_coord(m, _0{}));
    auto [tQg, tQs] =
        tma_partition(tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tdOg, tdOs] =
        tma_partition(tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
    pipeline.producer_acquire(write);
    const int stage = write.index();
    auto* bar = pipeline.producer_get_barrier(write);
    copy(tma_q.with(*bar, 0), tQg, tQs(_, stage));
    copy(tma_do.with(*bar, 0), tdOg, tdOs(_, stage));
    SM90_BULK_COPY_G2S::copy(p.row_stats + (static_cast<int64_t>(h) * m_blocks + m) * kStatFloats,
                             bar, stats + stage * kStatFloats, kStatFloats * sizeof(float));
    ++write;
  }
}

// ---------------------------------------------------------------------------------------------
// dQ.

template <int D>
__global__ void __launch_bounds__(BackwardTraits<D>::kThreads, 1)
    HopperDqKernel(const __grid_constant__ BackwardParams<D> p) {
  using Traits = BackwardTraits<D>;
  using Pipeline = typename Traits::PipelineDq;
  using PipelineState = cutlass::PipelineState<Traits::kDqStages>;
  constexpr int kBM = Traits::kDqBM;
  constexpr int kBN = Traits::kDqBN;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::DqSharedStorage*>(smem_raw);

  const int warpgroup = threadIdx.x / 128;
  const int tokens = p.tokens;
  const DqUnit<kBM, kBN, Traits::kDqSubTiles> unit(p);
  const int h = unit.h;
  const int i0 = unit.i0;
  const int n_pre = unit.walk.n_pre;
  const auto& walk = unit.walk;

  if (threadIdx.x == 0) {
    smem.barrier_q.init(1);
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
  }
  Pipeline pipeline(
      smem.pipeline,
      BackwardPipelineParams<Pipeline>(2 * Traits::kDqTileBytes, Traits::kConsumerThreads),
      Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.d_out.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (threadIdx.x != 0) return;
    static_assert(Traits::kDqQBytes == kBM * D * sizeof(Element), "Q's box is the unit's tile");
    ProduceDqInputs<D, kBM>(p, p.tma_q, p.tma_do, unit, sQ, sdO, smem.barrier_q, sK, sV, pipeline);
    return;
  }

  // Consumers.
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int ctid = threadIdx.x - 128;
  const int wg = warpgroup - 1;
  typename Traits::TiledMmaS mma_s;
  typename Traits::TiledMmaDq mma_dq;
  auto thr_s = mma_s.get_thread_slice(ctid);
  auto thr_dq = mma_dq.get_thread_slice(ctid);
  Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKt{});
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);
  Tensor tSrdO = thr_s.partition_fragment_A(sdO);
  Tensor tSrK = thr_s.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_K, stages)
  Tensor tSrV = thr_s.partition_fragment_B(sV);
  Tensor tDqrKt = thr_dq.partition_fragment_B(sKt);
  Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBM>, Int<kBN>>{});
  Tensor acc_dp = partition_fragment_C(mma_s, Shape<Int<kBM>, Int<kBN>>{});
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBM>, Int<D>>{});
  static_assert(decltype(size(acc_s))::value == kBN / 2, "64 x kBN per warpgroup");
  static_assert(decltype(size(acc_dq))::value == D / 2, "64 x D per warpgroup");
  Tensor coords_s = thr_s.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));
  Tensor coords_dq = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<D>>{}));
  Tensor r_ds = make_tensor<Element>(acc_s.layout());
  Tensor tDqrDs = make_tensor(r_ds.data(), AccLayoutAsA(acc_s.layout()));
  const float scale_log2 = p.scale_log2;

  // This thread's two query rows (element i holds row r = (i / 2) % 2 of its pair): log2-domain
  // lse and row_dot; rows past the chunk get lse = +inf, so that their P is 0.
  float lse2[2];
  float rdot[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = i0 + get<0>(coords_s(2 * r));
    const int64_t at = static_cast<int64_t>(h) * tokens + row;
    lse2[r] = row < tokens ? __ldg(p.lse + at) * tree_attention_detail::kLog2e : INFINITY;
    rdot[r] = row < tokens ? __ldg(p.row_dot + at) : 0.f;
  }
  const int w0 = i0 + wg * 64;
  const int w1 = min(w0 + 64, tokens);
  auto needs_mask = [&](int it) {
    return TileNeedsMask<kBN, Traits::kDqSubTiles>(p, it, n_pre, w0, w1);
  };

  clear(acc_dq);
  smem.barrier_q.wait(0);
  // Per tile: S and dP issued together, P = exp(S - lse), dS, then dQ += dS K, waited before the
  // next tile: a GEMM kept in flight across the loop's back edge makes ptxas wait for it anyway
  // (C7517), and the other warpgroup's GEMMs fill the tensor cores meanwhile. ptxas schedules the
  // exp after the wait for dP (pinning it before spills: P, dP and dQ do not fit the registers).
  PipelineState read;
  for (int it = walk.Next(0); it < walk.n_total; it = walk.Next(it + 1)) {
    pipeline.consumer_wait(read);
    const int stage = read.index();
    WarpgroupGemm<true, -1>(mma_s, tSrQ, tSrK(_, _, _, stage), acc_s);
    WarpgroupGemm<true, -1>(mma_s, tSrdO, tSrV(_, _, _, stage), acc_dp);
    const bool masked = needs_mask(it);
    warpgroup_wait<1>();  // this tile's S
    warpgroup_fence_operand(acc_s);
    if (masked) {
      const bool is_prefix = it < n_pre;
      const int j0 = (is_prefix ? it : it - n_pre) * kBN;
      MaskTile(acc_s, coords_s, is_prefix, i0, j0, tokens, p.prefix, p.key_end);
    }
#pragma unroll
    for (int i = 0; i < size(acc_s); ++i) {
      acc_s(i) = Exp2(fmaf(acc_s(i), scale_log2, -lse2[(i >> 1) & 1]));
    }
    warpgroup_wait<0>();  // this tile's dP
    warpgroup_fence_operand(acc_dp);
    // dS = P * (dP - row_dot), two columns per cvt.rn.bf16x2.
    Tensor r_ds32 = recast<uint32_t>(r_ds);
#pragma unroll
    for (int i = 0; i < size(r_ds32); ++i) {
      const int r = i & 1;  // element 2i holds row (i % 2) of the pair
      __nv_bfloat162 v = __floats2bfloat162_rn(acc_s(2 * i) * (acc_dp(2 * i) - rdot[r]),
                                               acc_s(2 * i + 1) * (acc_dp(2 * i + 1) - rdot[r]));
      r_ds32(i) = reinterpret_cast<uint32_t&>(v);
    }
    WarpgroupGemm<false, 0>(mma_dq, tDqrDs, tDqrKt(_, _, _, stage), acc_dq);
    warpgroup_fence_operand(r_ds);
    pipeline.consumer_release(read);
    ++read;
  }

  StoreBf16Rows(acc_dq, coords_dq, i0, tokens, p.dq + h * D, p.dq_row_stride,
                [&](int) { return p.scale; });
}

// ---------------------------------------------------------------------------------------------
// dK and dV, and with kWithDq dQ too.

// The single kernel's order of key tiles: the CTAs run the chunk's key tiles last first, then the
// prefix tiles last first (blockIdx order), and each query tile's dQ sums their parts in that same
// order. A chunk tile's first query tile is the diagonal one, which no later-launched tile adds to
// before it; under causal masks a later key tile reaches any query tile after fewer iterations
// than an earlier one (FlashAttention's shortest-first deterministic order), so CTAs rarely wait.
// Every tile waits only for tiles launched before it, so the kernel always makes progress.
struct FusedTileOrder {
  int tile;  // DkDvUnit's index: prefix tile < n_pre, else chunk tile tile - n_pre
  int hk;

  template <int kBN>
  __device__ __forceinline__ static FusedTileOrder Of(const TreeAttentionParams& p) {
    const int order = blockIdx.x / p.kv_heads;
    const int n_pre = (p.prefix + kBN - 1) / kBN;
    const int n_chunk = (p.tokens + kBN - 1) / kBN;
    const int tile = order < n_chunk ? n_pre + n_chunk - 1 - order : n_pre - 1 - (order - n_chunk);
    return {tile, static_cast<int>(blockIdx.x % p.kv_heads)};
  }
};

// The number of chunk key tiles after chunk tile c (c = -1: all of them) whose dQ part query tile m
// receives: tiles c' > c that start at or before the query tile's first row (c' <= m kBM / kBN) and
// have a key some row past m kBM sees (max key_end > m kBM), as DkDvUnit's query range
// [c' kBN / kBM, ceil(max key_end / kBM)). Warp-wide (every lane gets the count).
template <int kBM, int kBN, int kSubTiles>
__device__ __forceinline__ int LaterChunkTilesSeen(const TreeAttentionParams& p, int c, int m,
                                                   int lane) {
  const int last = m * kBM / kBN;
  const int n_sub =
      (p.tokens + tree_attention_detail::kKeyTile - 1) / tree_attention_detail::kKeyTile;
  int count = 0;
  for (int base = c + 1; base <= last; base += 32) {
    const int other = base + lane;
    int max_end = 0;
    if (other <= last) {
#pragma unroll
      for (int s = 0; s < kSubTiles; ++s) {
        const int sub = other * kSubTiles + s;
        if (sub < n_sub) max_end = max(max_end, __ldg(p.tile_max_end + sub));
      }
    }
    count += __popc(__ballot_sync(0xffffffffu, max_end > m * kBM));
  }
  return count;
}

// Named barriers of the single kernel (ids past CUTLASS's reserved ones), between the consumer
// warpgroups (dS^T of a query tile is in shared memory) and, per dQ buffer b, between them and the
// writer warp (the buffer holds a query tile's part: kDqFull + b; it is free again: kDqEmpty + b).
// One barrier per buffer and direction: the consumers may fill one buffer while the writer has not
// yet taken the other, and a barrier must not see two rounds of arrivals at once.
// Under the key split, warpgroup w's own dS^T rows are in place: kDsWritten + w (128 threads).
enum FusedBarrier : uint32_t { kDsReady = 0, kDqFull = 1, kDqEmpty = 3, kDsWritten = 5 };
constexpr uint32_t kDqBarrierThreads = 256 + 32;

__device__ __forceinline__ int LoadAcquire(const int32_t* at) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(at) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

// The longest the writer waits for a query tile's earlier parts. Every wait is for CTAs launched
// before this one (FusedTileOrder), which finish in far less on any problem the kernel takes; a
// wait this long means a count that can never be reached (a broken order), and the kernel traps so
// that the launch fails with an error (CUDA's "unspecified launch failure") instead of hanging. No
// message: a printf's arguments here cost the kernel spills.
constexpr uint64_t kDqWaitLimitNs = uint64_t{30} * 1000 * 1000 * 1000;

__device__ __forceinline__ void AddRelease(int32_t* at, int32_t v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" : : "l"(at), "r"(v) : "memory");
}

// bytes (a multiple of 16) of shared memory at src stored into, or added (float32) into, dst.
__device__ __forceinline__ void BulkStoreOrAdd(bool add, float* dst, const float* src, int bytes) {
  const uint32_t s = cute::cast_smem_ptr_to_uint(src);
  if (add) {
    asm volatile(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
        "r"(s), "r"(bytes)
        : "memory");
  } else {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(s),
                 "r"(bytes)
                 : "memory");
  }
}

// The single kernel's writer warp (lane `lane` of warp 1): for each query tile the consumers
// iterate (same order), waits until every key tile before this one in FusedTileOrder has added its
// dQ part (the tile's semaphore counts them), then stores the part (the first) or adds it into
// p.dq_accum with bulk copies from shared memory (one per warpgroup half; under the key split
// one, of the two warpgroups' partial parts added here first), and counts itself in. Float32 adds
// in a fixed order: bitwise deterministic.
template <class Traits, class Params, class Unit>
__device__ __forceinline__ void WriteDqParts(const Params& p, const Unit& u, float* parts,
                                             int lane) {
  using cutlass::arch::NamedBarrier;
  constexpr int kBM = Traits::kKvBM;
  constexpr int kBN = Traits::kKvBN;
  constexpr int kPartFloats = Traits::kDqPartFloats;
  constexpr bool kKeySplit = Traits::kDqKeySplit;
  const int m_blocks = (p.tokens + kBM - 1) / kBM;
  const int group = p.q_heads / p.kv_heads;
  const int n_iter = group * u.nq;
  const int c = u.is_prefix ? -1 : u.tile - u.n_pre;
  const int prefix_after = u.is_prefix ? u.n_pre - 1 - u.tile : 0;
  constexpr int kHalfFloats = kPartFloats / 2;
  auto free_buffer = [&](int b) { NamedBarrier::arrive(kDqBarrierThreads, kDqEmpty + b); };
  auto count_in = [&](int32_t* semaphore, bool all) {
    if (lane == 0) {
      if (all) {
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
      } else {
        asm volatile("cp.async.bulk.wait_group 1;" ::: "memory");
      }
      asm volatile("fence.proxy.async.global;" ::: "memory");
      AddRelease(semaphore, 1);
    }
    __syncwarp();
  };
  constexpr int kBuffers = Traits::kDqBuffers;
  static_assert(kBuffers == 1 || kBuffers == 2, "one buffer, or two in turn");
  free_buffer(0);
  if (kBuffers == 2 && n_iter > 1) free_buffer(1);  // no arrival left pending at exit
  int32_t* pending = nullptr;  // the previous tile's semaphore: its sums are still in flight
  for (int iter = 0; iter < n_iter; ++iter) {
    const int h = u.hk * group + iter / u.nq;
    const int m = u.q_first + iter % u.nq;
    const int before =
        prefix_after + LaterChunkTilesSeen<kBM, kBN, Traits::kKvSubTiles>(p, c, m, lane);
    const int64_t tile = static_cast<int64_t>(h) * m_blocks + m;
    int32_t* semaphore = p.dq_semaphore + tile;
    float* dst = p.dq_accum + tile * kPartFloats;
    const int buffer = iter % kBuffers;
    float* part = parts + buffer * Traits::kDqBufferFloats;
    if (lane == 0) {
      const uint64_t waiting_since = GlobalTimerNs();
      while (LoadAcquire(semaphore) != before) {
        if (GlobalTimerNs() - waiting_since > kDqWaitLimitNs) __trap();
      }
      asm volatile("fence.proxy.async.global;" ::: "memory");
    }
    __syncwarp();
    NamedBarrier::sync(kDqBarrierThreads, kDqFull + buffer);
    if constexpr (kKeySplit) {
      // The second warpgroup's partial part added to the first's (their float2s lie in the same
      // thread order), then handed to the bulk copy, which reads through the async proxy.
      float4* sum = reinterpret_cast<float4*>(part);
      const float4* second = reinterpret_cast<const float4*>(part + kPartFloats);
      for (int i = lane; i < kPartFloats / 4; i += 32) {
        float4 a = sum[i];
        const float4 b = second[i];
        a.x += b.x;
        a.y += b.y;
        a.z += b.z;
        a.w += b.w;
        sum[i] = a;
      }
      cutlass::arch::fence_view_async_shared();
      __syncwarp();
      if (lane == 0) BulkStoreOrAdd(before > 0, dst, part, kPartFloats * sizeof(float));
    } else if (lane == 0) {
      for (int w = 0; w < 2; ++w) {
        BulkStoreOrAdd(before > 0, dst + w * kHalfFloats, part + w * kHalfFloats,
                       kHalfFloats * sizeof(float));
      }
    }
    if (lane == 0) asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if constexpr (kBuffers == 1) {
      // The only buffer serves the next tile once the bulk copies have read it.
      if (lane == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      __syncwarp();
      if (iter + 1 < n_iter) free_buffer(0);
    }
    // The previous tile's sums complete while this tile's are in flight (FlashAttention's delayed
    // release: later key tiles reach a query tile at least an iteration after this one under
    // causal masks); with two buffers, its buffer then serves the next tile.
    if (pending != nullptr) {
      count_in(pending, false);
      if (kBuffers == 2 && iter + 1 < n_iter) free_buffer((iter - 1) & 1);
    }
    pending = semaphore;
  }
  if (pending != nullptr) count_in(pending, true);
}

// A consumer thread's share of a query tile's dQ part (acc, its warpgroup's slot: a half of D, or
// under the key split the warpgroup's partial part) into dQ buffer `buf` of `buffers` once the
// writer warp has freed it, in thread order (conflict-free; HopperDqFromPartsKernel reads it back
// in the same order), then handed to the writer.
template <class Traits, class TA>
__device__ __forceinline__ void HandDqPartToWriter(float* buffers, const TA& acc, int buf,
                                                   int ctid) {
  using cutlass::arch::NamedBarrier;
  NamedBarrier::sync(kDqBarrierThreads, kDqEmpty + buf);
  constexpr int kSlotFloats =
      Traits::kDqKeySplit ? Traits::kDqPartFloats : Traits::kDqPartFloats / 2;
  float2* part = reinterpret_cast<float2*>(buffers) +
                 (buf * Traits::kDqBufferFloats + ctid / 128 * kSlotFloats) / 2 + ctid % 128;
#pragma unroll
  for (int j = 0; j < size(acc) / 2; ++j) part[j * 128] = make_float2(acc(2 * j), acc(2 * j + 1));
  cutlass::arch::fence_view_async_shared();
  NamedBarrier::arrive(kDqBarrierThreads, kDqFull + buf);
}

// The single kernel's dQ part of one query tile, by both consumer warpgroups once the dK GEMM is
// issued: dS^T (this thread's bf16 pairs, r_dst32, at coords_st) into shared buffer `buf`, then
// dQ's part dS K ((64, D / 2) per warpgroup over all keys, or under the key split (64, D) over the
// warpgroup's own keys; the wait covers the dV and dK GEMMs too), handed to the writer warp through
// dQ buffer `buf` in thread order (conflict-free; HopperDqFromPartsKernel reads it back in the same
// order).
template <int D, class Storage, class TC, class TR>
__device__ __forceinline__ void DqPart(Storage& smem, const TC& coords_st, const TR& r_dst32,
                                       int buf, int ctid) {
  using Traits = BackwardTraits<D>;
  using cutlass::arch::NamedBarrier;
  Tensor sDsT = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutDsT{});
#pragma unroll
  for (int i = 0; i < size(r_dst32); ++i) {
    const auto c = coords_st(2 * i);
    *reinterpret_cast<uint32_t*>(&sDsT(get<0>(c), get<1>(c), buf)) = r_dst32(i);
  }
  cutlass::arch::fence_view_async_shared();
  const int w = ctid / 128;
  typename Traits::TiledMmaDqPart mma;
  Tensor acc = partition_fragment_C(mma, Shape<Int<Traits::kKvBM>, Int<D>>{});
  if constexpr (Traits::kDqKeySplit) {
    // This warpgroup's keys only: its own rows of dS^T (written above by its own threads, read by
    // no other; its GEMM on this buffer two tiles ago is done) and of K.
    static_assert(Traits::kKvBN == 128 && D == 64, "one 128-byte atom per row: halves stack");
    constexpr int kHalfKeys = Traits::kKvBN / 2;
    // Every thread of the warpgroup has written its rows before any of its wgmmas reads them.
    NamedBarrier::sync(128, kDsWritten + w);
    auto thr = mma.get_thread_slice(ctid % 128);
    Tensor sDs =
        make_tensor(make_smem_ptr(smem.ds.data() + (buf * 2 + w) * kHalfKeys * Traits::kKvBM),
                    typename Traits::SmemLayoutDsHalf{});
    Tensor sKt = make_tensor(make_smem_ptr(smem.k.data() + w * kHalfKeys * D),
                             typename Traits::SmemLayoutKtHalf{});
    Tensor t_ds = thr.partition_fragment_A(sDs);  // (MMA, MMA_M, MMA_K, 1)
    Tensor t_kt = thr.partition_fragment_B(sKt);
    WarpgroupGemm<true, 0>(mma, t_ds(_, _, _, 0), t_kt(_, _, _, 0), acc);
  } else {
    // Both halves of dS^T are in place; the other warpgroup's GEMM on this buffer two tiles ago
    // is done (it waited for it before reaching this barrier).
    NamedBarrier::sync(Traits::kConsumerThreads, kDsReady);
    auto thr = mma.get_thread_slice(ctid);
    Tensor sDs = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutDs{});
    Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKvKt{});
    Tensor t_ds = thr.partition_fragment_A(sDs);  // (MMA, MMA_M, MMA_K, buffers)
    Tensor t_kt = thr.partition_fragment_B(sKt);
    WarpgroupGemm<true, 0>(mma, t_ds(_, _, _, buf), t_kt(_, _, _, 0), acc);
  }
  HandDqPartToWriter<Traits>(smem.dq.data(), acc, buf, ctid);
}

template <int D, bool kWithDq>
__global__ void __launch_bounds__(BackwardTraits<D>::kThreads, 1)
    HopperDkDvKernel(const __grid_constant__ BackwardParams<D> p) {
  using Traits = BackwardTraits<D>;
  using Config = DkDvConfig<D, kWithDq>;
  using Pipeline = typename Config::Pipeline;
  using PipelineState = cutlass::PipelineState<Config::kStages>;
  using cutlass::arch::NamedBarrier;
  constexpr int kBM = Traits::kKvBM;
  constexpr int kBN = Traits::kKvBN;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename Config::SharedStorage*>(smem_raw);

  const int warpgroup = threadIdx.x / 128;
  const int tokens = p.tokens;
  const DkDvUnit<kBM, kBN, Traits::kKvSubTiles> unit = [&] {
    if constexpr (kWithDq) {
      const FusedTileOrder order = FusedTileOrder::Of<kBN>(p);
      return DkDvUnit<kBM, kBN, Traits::kKvSubTiles>(p, order.tile, order.hk);
    } else {
      return DkDvUnit<kBM, kBN, Traits::kKvSubTiles>(p);
    }
  }();
  const int hk = unit.hk;
  const bool is_prefix = unit.is_prefix;
  const int j0 = unit.j0;
  const int nq = unit.nq;
  const int n_iter = (p.q_heads / p.kv_heads) * nq;

  if (threadIdx.x == 0) {
    smem.barrier_kv.init(1);
    cute::prefetch_tma_descriptor(p.tma_q64.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do64.get_tma_descriptor());
  }
  Pipeline pipeline(
      smem.pipeline,
      BackwardPipelineParams<Pipeline>(Traits::kKvStageBytes, Traits::kConsumerThreads),
      Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutK{});
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Config::SmemLayoutQdO{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.d_out.data()), typename Config::SmemLayoutQdO{});

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (threadIdx.x == 0) {
      ProduceQueryTiles<D, kBM, Traits::kKvStatFloats>(p, p.tma_q64, p.tma_do64, unit, sK, sV, sQ,
                                                       sdO, smem.row_stats.data(), smem.barrier_kv,
                                                       2 * Traits::kKvTileBytes, pipeline);
    } else if constexpr (kWithDq) {
      if (threadIdx.x / 32 == 1) {
        WriteDqParts<Traits>(p, unit, smem.dq.data(), threadIdx.x % 32);
      }
    }
    return;
  }

  // Consumers.
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int ctid = threadIdx.x - 128;
  typename Traits::TiledMmaSt mma_st;
  typename Traits::TiledMmaDkv mma_dkv;
  auto thr_st = mma_st.get_thread_slice(ctid);
  auto thr_dkv = mma_dkv.get_thread_slice(ctid);
  Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Config::SmemLayoutQdOt{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem.d_out.data()), typename Config::SmemLayoutQdOt{});
  Tensor tSrK = thr_st.partition_fragment_A(sK)(_, _, _, 0);
  Tensor tSrV = thr_st.partition_fragment_A(sV)(_, _, _, 0);
  Tensor tSrQ = thr_st.partition_fragment_B(sQ);  // (MMA, MMA_N, MMA_K, stages)
  Tensor tSrdO = thr_st.partition_fragment_B(sdO);
  Tensor tKvrQt = thr_dkv.partition_fragment_B(sQt);
  Tensor tKvrdOt = thr_dkv.partition_fragment_B(sdOt);
  Tensor acc_st = partition_fragment_C(mma_st, Shape<Int<kBN>, Int<kBM>>{});
  Tensor acc_dpt = partition_fragment_C(mma_st, Shape<Int<kBN>, Int<kBM>>{});
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBN>, Int<D>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBN>, Int<D>>{});
  static_assert(decltype(size(acc_st))::value == kBM / 2, "64 x kBM per warpgroup");
  static_assert(decltype(size(acc_dk))::value == D / 2, "64 x D per warpgroup");
  Tensor coords_st = thr_st.partition_C(make_identity_tensor(Shape<Int<kBN>, Int<kBM>>{}));
  Tensor coords_dkv = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBN>, Int<D>>{}));
  Tensor r_pt = make_tensor<Element>(acc_st.layout());
  Tensor r_dst = make_tensor<Element>(acc_st.layout());
  Tensor tKvrPt = make_tensor(r_pt.data(), AccLayoutAsA(acc_st.layout()));
  Tensor tKvrdSt = make_tensor(r_dst.data(), AccLayoutAsA(acc_st.layout()));
  const float scale_log2 = p.scale_log2;

  // This thread's two keys (rows) and their key_end (0 past the chunk or in the prefix).
  int key[2];
  int key_end[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    key[r] = j0 + get<0>(coords_st(2 * r));
    key_end[r] = (!is_prefix && key[r] < tokens) ? __ldg(p.key_end + key[r]) : 0;
  }
  const bool key_tile_partial = is_prefix ? j0 + kBN > p.prefix : j0 + kBN > tokens;

  clear(acc_dk);
  clear(acc_dv);
  smem.barrier_kv.wait(0);
  PipelineState read;
  for (int iter = 0; iter < n_iter; ++iter) {
    const int q0 = (unit.q_first + iter % nq) * kBM;
    pipeline.consumer_wait(read);
    const int stage = read.index();
    WarpgroupGemm<true, -1>(mma_st, tSrK, tSrQ(_, _, _, stage), acc_st);
    WarpgroupGemm<true, -1>(mma_st, tSrV, tSrdO(_, _, _, stage), acc_dpt);
    // Unmasked iff every key of the tile sees every query of the tile.
    const bool masked = key_tile_partial || q0 + kBM > tokens ||
                        (!is_prefix && (j0 + kBN - 1 > q0 || q0 + kBM > unit.tile_min_end));
    const float* stats = smem.row_stats.data() + stage * Traits::kKvStatFloats;
    // Element i holds key row (i / 2) % 2 of the pair and query column 8 (i / 4) + 2 t + i % 2:
    // elements 2 i and 2 i + 1 are columns 8 (i / 2) + 2 t + {0, 1} of row i % 2, so each
    // float2 of the statistics serves four elements.
    auto stat_pair = [&](int n, int offset) {
      return *reinterpret_cast<const float2*>(stats + offset + get<1>(coords_st(4 * n)));
    };
    // P^T in place of S^T (and in bf16 for dV), while dP^T is still in flight (FlashAttention-3's
    // intra-warpgroup overlap). Two copies of the loop, chosen once per tile: the unmasked one is
    // the math alone.
    warpgroup_wait<1>();  // this tile's S^T
    warpgroup_fence_operand(acc_st);
    Tensor r_pt32 = recast<uint32_t>(r_pt);
    auto probabilities = [&](auto masked_tile) {
#pragma unroll
      for (int n = 0; n < kBM / 8; ++n) {
        const float2 lse2 = stat_pair(n, 0);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = 2 * n + r;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = fmaf(acc_st(2 * i + e), scale_log2, -(e == 0 ? lse2.x : lse2.y));
            if constexpr (decltype(masked_tile)::value) {
              const int query = q0 + get<1>(coords_st(4 * n)) + e;
              const bool visible = is_prefix ? (key[r] < p.prefix && query < tokens)
                                             : (key[r] <= query && query < key_end[r]);
              if (!visible) x = -INFINITY;
            }
            acc_st(2 * i + e) = Exp2(x);
          }
          __nv_bfloat162 vp = __floats2bfloat162_rn(acc_st(2 * i), acc_st(2 * i + 1));
          r_pt32(i) = reinterpret_cast<uint32_t&>(vp);
        }
      }
    };
    if (masked) {
      probabilities(cute::true_type{});
    } else {
      probabilities(cute::false_type{});
    }
    WarpgroupGemm<false, -1>(mma_dkv, tKvrPt, tKvrdOt(_, _, _, stage), acc_dv);
    // dS^T = P^T * (dP^T - row_dot) while dV runs.
    warpgroup_wait<1>();  // this tile's dP^T
    warpgroup_fence_operand(acc_dpt);
    Tensor r_dst32 = recast<uint32_t>(r_dst);
#pragma unroll
    for (int n = 0; n < kBM / 8; ++n) {
      const float2 rdot = stat_pair(n, kBM);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = 2 * n + r;
        const float ds0 = acc_st(2 * i) * (acc_dpt(2 * i) - rdot.x);
        const float ds1 = acc_st(2 * i + 1) * (acc_dpt(2 * i + 1) - rdot.y);
        __nv_bfloat162 vs = __floats2bfloat162_rn(ds0, ds1);
        r_dst32(i) = reinterpret_cast<uint32_t&>(vs);
      }
    }
    if constexpr (!kWithDq) {
      WarpgroupGemm<false, 0>(mma_dkv, tKvrdSt, tKvrQt(_, _, _, stage), acc_dk);
      warpgroup_fence_operand(acc_dv);
      pipeline.consumer_release(read);
    } else {
      WarpgroupGemm<false, -1>(mma_dkv, tKvrdSt, tKvrQt(_, _, _, stage), acc_dk);
      DqPart<D>(smem, coords_st, r_dst32, iter & 1, ctid);
      warpgroup_fence_operand(acc_dv);
      warpgroup_fence_operand(acc_dk);
      pipeline.consumer_release(read);
    }
    ++read;
  }

  if (is_prefix) {
    AddFloatRows(acc_dk, coords_dkv, j0, p.prefix, p.grad_prefix_k + hk * D,
                 p.grad_prefix_k_row_stride, p.scale);
    AddFloatRows(acc_dv, coords_dkv, j0, p.prefix, p.grad_prefix_v + hk * D,
                 p.grad_prefix_v_row_stride, 1.f);
  } else {
    StoreBf16Rows(acc_dk, coords_dkv, j0, tokens, p.dk + hk * D, p.dk_row_stride,
                  [&](int) { return p.scale; });
    StoreBf16Rows(acc_dv, coords_dkv, j0, tokens, p.dv + hk * D, p.dv_row_stride,
                  [](int) { return 1.f; });
  }
}

// dQ = scale * p.dq_accum in bf16 (the single kernel's epilogue): one CTA of 128 threads per query
// head, 64-row query tile and half of D (all of D under the key split); thread t reads the float2s
// it wrote from HandDqPartToWriter's order and finds their rows and columns from the same MMA
// layout. Traits: BackwardTraits<D>, or HeadSplitBackwardTraits<D> at wide heads.
template <int D, class Traits>
__global__ void __launch_bounds__(128) HopperDqFromPartsKernel(const TreeAttentionParams p) {
  constexpr int kBM = Traits::kKvBM;
  constexpr int kCtas = Traits::kDqFromPartsCtas;
  const int half = static_cast<int>(blockIdx.x % kCtas);
  const int64_t tile = blockIdx.x / kCtas;
  const int m_blocks = (p.tokens + kBM - 1) / kBM;
  const int h = static_cast<int>(tile / m_blocks);
  const int row0 = static_cast<int>(tile % m_blocks) * kBM;
  typename Traits::TiledMmaDqPart mma;
  auto thr = mma.get_thread_slice(half * 128 + threadIdx.x);
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<D>>{}));
  const float2* src = reinterpret_cast<const float2*>(p.dq_accum + tile * Traits::kDqPartFloats) +
                      half * (Traits::kDqPartFloats / 4) + threadIdx.x;
#pragma unroll
  for (int j = 0; j < size(coords) / 2; ++j) {
    const int row = row0 + get<0>(coords(2 * j));
    if (row >= p.tokens) continue;
    const float2 a = src[j * 128];
    *reinterpret_cast<__nv_bfloat162*>(p.dq + row * p.dq_row_stride + h * D +
                                       get<1>(coords(2 * j))) =
        __floats2bfloat162_rn(a.x * p.scale, a.y * p.scale);
  }
}

}  // namespace dta::kernels::hopper_detail

#endif  // DTA_KERNELS_HOPPER_TREE_ATTENTION_HOPPER_BACKWARD_KERNEL_CUH_

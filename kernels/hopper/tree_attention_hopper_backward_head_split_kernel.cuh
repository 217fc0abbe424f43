// The Hopper tree-attention backward at wide heads (D = 256: Qwen3-Next's and Qwen3.5's attention
// layers): CuTe / CUTLASS device code, included only by tree_attention_hopper_backward.cu.
//
// The layout of tree_attention_hopper_backward_kernel.cuh does not fit D = 256: a warpgroup that
// owns 64 keys would hold 64 x 256 floats of dK and as many of dV (256 registers a thread), and
// its dQ kernel's 128-row Q and dO tiles leave no room for a K/V ring. Here, as in
// FlashAttention-3's hdim-256 backward, the two consumer warpgroups share one 64 x 64 score tile
// and split the head dim of the gradient they accumulate:
//   S = Q K^T and dP = dO V^T (64 queries x 64 keys): warpgroup w computes keys [32 w, 32 w + 32)
//   (wgmma N = 32, both operands in shared memory); P = exp2(S - lse) and dS = P * (dP - row_dot)
//   in registers, written in bf16 to shared memory (two buffers, alternate tiles: a tile's writes
//   never wait for the other warpgroup's GEMMs on the previous one), then one named barrier;
//   warpgroup w accumulates columns [w D / 2, (w + 1) D / 2) of the gradient from the whole
//   P / dS tile (both operands in shared memory).
// HopperDkDvHeadSplitKernel: one CTA per (64-key tile, kv head). K and V load once; Q, dO and the
// row statistics of each visible 64-row query tile of each query head of the group stream through
// a 2-stage ring (the tiles and order of HopperDkDvKernel). dV += P^T dO, dK += dS^T Q (P^T and
// dS^T as MN-major views of the shared tiles, dO^T and Q^T of the stage).
// HopperDqHeadSplitKernel: one CTA per (64-row query tile, query head). Q and dO load once; K and
// V of every visible key tile (TileWalk) stream through a 2-stage ring. dQ += dS K.
// A consumer thread holds 64 + 64 floats of dK and dV (dQ: 64) and 16 + 16 of S and dP. Every
// gradient element is summed by one thread in a fixed order: bitwise deterministic.
// HopperDkDvHeadSplitKernel<D, true> is the single-kernel backward at this head dim (opt-in, as at
// D = 64 and 128 in tree_attention_hopper_backward_kernel.cuh): after dV and dK each score tile's
// dQ part dS K ((64, D / 2) per warpgroup from the shared dS tile and the unit's K) goes through a
// shared buffer to the writer warp, which adds it into the float32 workspace in the fixed order of
// key tiles (WriteDqParts). The part's buffer (64 KiB) takes the second stage of Q and dO, so the
// next tile's Q and dO load only under dQ's GEMM, and the consumers wait for the writer at every
// tile: slower than the two kernels (docs/benchmarks.md), exact and deterministic like them.
#ifndef DTA_KERNELS_HOPPER_TREE_ATTENTION_HOPPER_BACKWARD_HEAD_SPLIT_KERNEL_CUH_
#define DTA_KERNELS_HOPPER_TREE_ATTENTION_HOPPER_BACKWARD_HEAD_SPLIT_KERNEL_CUH_

#include "kernels/hopper/tree_attention_hopper_backward_kernel.cuh"

namespace dta::kernels::hopper_detail {

template <int D>
struct HeadSplitBackwardTraits {
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kBM = kHopperBackwardQueryTile;  // query rows of a score tile
  static constexpr int kBN = ForwardTraits<D>::kBN;     // keys of a score tile: the forward's boxes
  static_assert(kBM == 64 && kBN == tree_attention_detail::kKeyTile,
                "64 x 64 score tiles: one tile_*_end entry per key tile");
  static constexpr int kStages = 2;
  static constexpr int kHalf = D / 2;  // gradient columns per warpgroup

  // The two consumer warpgroups side by side along N.
  using WarpgroupsAlongN = Layout<Shape<_1, _2, _1>>;
  // S = Q K^T and dP = dO V^T: warpgroup w computes keys [32 w, 32 w + 32).
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBN / 2>, Int<D>>>(),
      WarpgroupsAlongN{}));
  // dV += P^T dO and dK += dS^T Q: (keys, queries) and (D, queries) operands, both MN-major.
  using TiledMmaDkv = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHalf>, Int<kBM>>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      WarpgroupsAlongN{}));
  // dQ += dS K: dS (queries, keys) K-major, K^T (D, keys) MN-major.
  using TiledMmaDq = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHalf>, Int<kBN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      WarpgroupsAlongN{}));

  // 64-row tiles of D elements (the forward's K/V box), alone or as the ring, and their transposed
  // views; P and dS as (queries, keys, buffer) and (keys, queries, buffer).
  using SmemLayoutOne = StagedTiles<64, D, 1>;
  using SmemLayoutOneT = StagedTilesT<64, D, 1>;
  using SmemLayoutRing = StagedTiles<64, D, kStages>;
  using SmemLayoutRingT = StagedTilesT<64, D, kStages>;
  using SmemLayoutScores = StagedTiles<kBM, kBN, 2>;
  using SmemLayoutScoresT = StagedTilesT<kBM, kBN, 2>;

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kTileBytes = 64 * D * sizeof(Element);
  static constexpr int kStatFloats = 2 * kBM;  // lse * log2(e), then row_dot
  static constexpr uint32_t kStatBytes = kStatFloats * sizeof(float);

  // The single-kernel backward's dQ part of a score tile, dS K: (64 queries, D) over the tile's 64
  // keys, each warpgroup its half of D (TiledMmaDq). The names WriteDqParts and
  // HopperDqFromPartsKernel read (tree_attention_hopper_backward_kernel.cuh): a 64-row query tile,
  // 64-key tiles, one buffer of the part's two halves of D side by side (the shared memory holds
  // no second one), read back by one CTA per half.
  static constexpr int kKvBM = kBM;
  static constexpr int kKvBN = kBN;
  static constexpr int kKvSubTiles = 1;
  static constexpr bool kDqKeySplit = false;
  static constexpr int kDqPartFloats = kBM * D;
  static constexpr int kDqBufferFloats = kDqPartFloats;
  static constexpr int kDqBuffers = 1;
  static constexpr int kDqFromPartsCtas = 2;
  using TiledMmaDqPart = TiledMmaDq;

  // Q 32 KiB + dO 32 KiB + 2 x (K + V) 128 KiB + dS 16 KiB: 208 KiB.
  struct DqSharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutOne>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutOne>, 1024> d_out;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutRing>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutRing>, 1024> v;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutScores>, 1024> ds;
    typename Pipeline::SharedStorage pipeline;
    cutlass::arch::ClusterTransactionBarrier barrier_q;  // Q and dO landed
  };
  static constexpr int kDqSmemBytes = static_cast<int>(sizeof(DqSharedStorage));
  static_assert(kDqSmemBytes <= 227 * 1024, "fits an SM");
};

// The dK/dV kernel's stages and shared memory: without dQ K 32 KiB + V 32 KiB + 2 x (Q + dO)
// 128 KiB + P and dS 2 x 16 KiB (225 KiB with the row statistics); with it one stage of Q and dO
// (64 KiB) and dQ's buffer (64 x 256 floats, 64 KiB) in place of the second stage: 225 KiB again.
// With one stage the next tile's Q and dO load while the consumers compute dQ's part (they release
// the stage once the dV and dK GEMMs are done).
template <int D, bool kWithDq>
struct HeadSplitDkDvConfig {
  using Traits = HeadSplitBackwardTraits<D>;
  static constexpr int kStages = kWithDq ? 1 : Traits::kStages;
  static constexpr int kDqFloats = kWithDq ? Traits::kDqBuffers * Traits::kDqBufferFloats : 4;
  using SmemLayoutQdO = StagedTiles<Traits::kBM, D, kStages>;
  using SmemLayoutQdOt = StagedTilesT<Traits::kBM, D, kStages>;  // Q^T and dO^T, B operands
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutOne>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutOne>, 1024> v;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQdO>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQdO>, 1024> d_out;
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutScores>, 1024> p;
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutScores>, 1024> ds;
    cute::array_aligned<float, kStages * Traits::kStatFloats, 16> row_stats;
    typename Pipeline::SharedStorage pipeline;
    cutlass::arch::ClusterTransactionBarrier barrier_kv;  // K and V landed
    cute::array_aligned<float, kDqFloats, 128> dq;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "fits an SM");
};

// The shared params and the TMA descriptors, all (64, D) boxes (the forward's K/V box at D = 256).
template <int D>
struct HeadSplitBackwardParams : TreeAttentionParams {
  using Tma = typename ForwardTraits<D>::TmaKV;
  Tma tma_q;         // Q [T, Hq, D]
  Tma tma_do;        // dO [T, Hq, D]
  Tma tma_k;         // chunk keys [T, Hkv, D]
  Tma tma_v;         // chunk values
  Tma tma_prefix_k;  // prefix keys [P, Hkv, D]; the chunk's when P = 0
  Tma tma_prefix_v;
};

// The named barrier over both consumer warpgroups that publishes a score tile's P and dS.
constexpr uint32_t kScoresWrittenBarrier = 0;

// Writes the fp32 pairs (i, i + 1) of acc as bf16 pairs at the matching elements of dst (acc's
// partition of a shared-memory tile: element pairs are adjacent keys, one 4-byte store each),
// value(i) giving each element.
template <class TD, class Value>
__device__ __forceinline__ void StoreScorePairs(TD&& dst, int count, Value&& value) {
#pragma unroll
  for (int i = 0; i < count; i += 2) {
    __nv_bfloat162 pair = __floats2bfloat162_rn(value(i), value(i + 1));
    *reinterpret_cast<__nv_bfloat162*>(&dst(i)) = pair;
  }
}

// After a score tile's P and dS are in shared memory: make the generic-proxy stores visible to the
// wgmma (async proxy) reads, then wait for the other warpgroup's half of the tile.
__device__ __forceinline__ void PublishScores(int consumer_threads) {
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::NamedBarrier::sync(consumer_threads, kScoresWrittenBarrier);
}

// ---------------------------------------------------------------------------------------------
// dK and dV.

template <int D, bool kWithDq>
__global__ void __launch_bounds__(HeadSplitBackwardTraits<D>::kThreads, 1)
    HopperDkDvHeadSplitKernel(const __grid_constant__ HeadSplitBackwardParams<D> p) {
  using Traits = HeadSplitBackwardTraits<D>;
  using Config = HeadSplitDkDvConfig<D, kWithDq>;
  using Pipeline = typename Config::Pipeline;
  using PipelineState = cutlass::PipelineState<Config::kStages>;
  constexpr int kBM = Traits::kBM;
  constexpr int kBN = Traits::kBN;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename Config::SharedStorage*>(smem_raw);

  const int warpgroup = threadIdx.x / 128;
  const int tokens = p.tokens;
  const DkDvUnit<kBM, kBN, 1> unit = [&] {
    if constexpr (kWithDq) {
      const FusedTileOrder order = FusedTileOrder::Of<kBN>(p);
      return DkDvUnit<kBM, kBN, 1>(p, order.tile, order.hk);
    } else {
      return DkDvUnit<kBM, kBN, 1>(p);
    }
  }();
  const bool is_prefix = unit.is_prefix;
  const int j0 = unit.j0;
  const int n_iter = (p.q_heads / p.kv_heads) * unit.nq;

  if (threadIdx.x == 0) {
    smem.barrier_kv.init(1);
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
  }
  Pipeline pipeline(smem.pipeline,
                    BackwardPipelineParams<Pipeline>(2 * Traits::kTileBytes + Traits::kStatBytes,
                                                     Traits::kConsumerThreads),
                    Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutOne{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutOne{});
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Config::SmemLayoutQdO{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.d_out.data()), typename Config::SmemLayoutQdO{});

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (threadIdx.x == 0) {
      ProduceQueryTiles<D, kBM, Traits::kStatFloats>(p, p.tma_q, p.tma_do, unit, sK, sV, sQ, sdO,
                                                     smem.row_stats.data(), smem.barrier_kv,
                                                     2 * Traits::kTileBytes, pipeline);
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
  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmaDkv mma_dkv;
  auto thr_sdp = mma_sdp.get_thread_slice(ctid);
  auto thr_dkv = mma_dkv.get_thread_slice(ctid);
  Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Config::SmemLayoutQdOt{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem.d_out.data()), typename Config::SmemLayoutQdOt{});
  Tensor sP = make_tensor(make_smem_ptr(smem.p.data()), typename Traits::SmemLayoutScores{});
  Tensor sdS = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutScores{});
  Tensor sPt = make_tensor(make_smem_ptr(smem.p.data()), typename Traits::SmemLayoutScoresT{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutScoresT{});
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);  // (MMA, MMA_M, MMA_K, stages)
  Tensor tSrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK)(_, _, _, 0);
  Tensor tSrV = thr_sdp.partition_fragment_B(sV)(_, _, _, 0);
  Tensor tKvrPt = thr_dkv.partition_fragment_A(sPt);  // (MMA, MMA_M, MMA_K, buffers)
  Tensor tKvrdSt = thr_dkv.partition_fragment_A(sdSt);
  Tensor tKvrdOt = thr_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, stages)
  Tensor tKvrQt = thr_dkv.partition_fragment_B(sQt);
  Tensor tPsP = thr_sdp.partition_C(sP);  // this thread's score elements in shared memory
  Tensor tPsdS = thr_sdp.partition_C(sdS);
  Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBM>, Int<kBN>>{});
  Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBM>, Int<kBN>>{});
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBN>, Int<D>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBN>, Int<D>>{});
  static_assert(decltype(size(acc_s))::value == kBN / 4, "64 x 32 per warpgroup");
  static_assert(decltype(size(acc_dk))::value == D / 4, "64 x D / 2 per warpgroup");
  // The single kernel's dQ part (unused without it: no registers).
  typename Traits::TiledMmaDq mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(ctid);
  Tensor tDqrdS = thr_dq.partition_fragment_A(sdS);  // (MMA, MMA_M, MMA_K, buffers)
  Tensor tDqrKt = thr_dq.partition_fragment_B(
      make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutOneT{}))(_, _, _, 0);
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBM>, Int<D>>{});
  Tensor coords_s = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));
  Tensor coords_dkv = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBN>, Int<D>>{}));
  const float scale_log2 = p.scale_log2;
  const bool key_tile_partial = is_prefix ? j0 + kBN > p.prefix : j0 + kBN > tokens;

  clear(acc_dk);
  clear(acc_dv);
  smem.barrier_kv.wait(0);
  PipelineState read;
  for (int iter = 0; iter < n_iter; ++iter) {
    const int q0 = (unit.q_first + iter % unit.nq) * kBM;
    const int buffer = iter & 1;
    pipeline.consumer_wait(read);
    const int stage = read.index();
    WarpgroupGemm<true, -1>(mma_sdp, tSrQ(_, _, _, stage), tSrK, acc_s);
    WarpgroupGemm<true, -1>(mma_sdp, tSrdO(_, _, _, stage), tSrV, acc_dp);
    // Unmasked iff every key of the tile sees every query of the tile.
    const bool masked = key_tile_partial || q0 + kBM > tokens ||
                        (!is_prefix && (j0 + kBN - 1 > q0 || q0 + kBM > unit.tile_min_end));
    // This thread's two query rows (element i holds row (i / 2) % 2 of its pair): their lse2 is
    // +inf and row_dot 0 past the chunk, so that their P and dS are 0.
    const float* stats = smem.row_stats.data() + stage * Traits::kStatFloats;
    float lse2[2];
    float rdot[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = get<0>(coords_s(2 * r));
      lse2[r] = stats[row];
      rdot[r] = stats[kBM + row];
    }
    warpgroup_wait<1>();  // this tile's S
    warpgroup_fence_operand(acc_s);
    if (masked) MaskTile(acc_s, coords_s, is_prefix, q0, j0, tokens, p.prefix, p.key_end);
#pragma unroll
    for (int i = 0; i < size(acc_s); ++i) {
      acc_s(i) = Exp2(fmaf(acc_s(i), scale_log2, -lse2[(i >> 1) & 1]));
    }
    StoreScorePairs(tPsP(_, _, _, buffer), size(acc_s), [&](int i) { return acc_s(i); });
    warpgroup_wait<0>();  // this tile's dP
    warpgroup_fence_operand(acc_dp);
    StoreScorePairs(tPsdS(_, _, _, buffer), size(acc_s),
                    [&](int i) { return acc_s(i) * (acc_dp(i) - rdot[(i >> 1) & 1]); });
    PublishScores(Traits::kConsumerThreads);
    WarpgroupGemm<false, -1>(mma_dkv, tKvrPt(_, _, _, buffer), tKvrdOt(_, _, _, stage), acc_dv);
    if constexpr (!kWithDq) {
      WarpgroupGemm<false, 0>(mma_dkv, tKvrdSt(_, _, _, buffer), tKvrQt(_, _, _, stage), acc_dk);
      warpgroup_fence_operand(acc_dv);
      pipeline.consumer_release(read);
    } else {
      // dQ's part dS K from the same dS buffer and the unit's K, issued behind dK: once dV and dK
      // are done the stage goes back to the producer, whose next Q and dO load under dQ's GEMM.
      WarpgroupGemm<false, -1>(mma_dkv, tKvrdSt(_, _, _, buffer), tKvrQt(_, _, _, stage), acc_dk);
      WarpgroupGemm<true, 1>(mma_dq, tDqrdS(_, _, _, buffer), tDqrKt, acc_dq);
      warpgroup_fence_operand(acc_dv);
      warpgroup_fence_operand(acc_dk);
      pipeline.consumer_release(read);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_dq);
      HandDqPartToWriter<Traits>(smem.dq.data(), acc_dq, 0, ctid);
    }
    ++read;
  }

  const int hk = unit.hk;
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

// ---------------------------------------------------------------------------------------------
// dQ.

template <int D>
__global__ void __launch_bounds__(HeadSplitBackwardTraits<D>::kThreads, 1)
    HopperDqHeadSplitKernel(const __grid_constant__ HeadSplitBackwardParams<D> p) {
  using Traits = HeadSplitBackwardTraits<D>;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = cutlass::PipelineState<Traits::kStages>;
  constexpr int kBM = Traits::kBM;
  constexpr int kBN = Traits::kBN;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::DqSharedStorage*>(smem_raw);

  const int warpgroup = threadIdx.x / 128;
  const int tokens = p.tokens;
  const DqUnit<kBM, kBN, 1> unit(p);
  const int h = unit.h;
  const int i0 = unit.i0;
  const int i1 = unit.i1;
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
      BackwardPipelineParams<Pipeline>(2 * Traits::kTileBytes, Traits::kConsumerThreads),
      Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutOne{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.d_out.data()), typename Traits::SmemLayoutOne{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutRing{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutRing{});

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (threadIdx.x != 0) return;
    ProduceDqInputs<D, kBM>(p, p.tma_q, p.tma_do, unit, sQ, sdO, smem.barrier_q, sK, sV, pipeline);
    return;
  }

  // Consumers.
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int ctid = threadIdx.x - 128;
  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmaDq mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(ctid);
  auto thr_dq = mma_dq.get_thread_slice(ctid);
  Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutRingT{});
  Tensor sdS = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutScores{});
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ)(_, _, _, 0);
  Tensor tSrdO = thr_sdp.partition_fragment_A(sdO)(_, _, _, 0);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_K, stages)
  Tensor tSrV = thr_sdp.partition_fragment_B(sV);
  Tensor tDqrdS = thr_dq.partition_fragment_A(sdS);  // (MMA, MMA_M, MMA_K, buffers)
  Tensor tDqrKt = thr_dq.partition_fragment_B(sKt);  // (MMA, MMA_N, MMA_K, stages)
  Tensor tPsdS = thr_sdp.partition_C(sdS);
  Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBM>, Int<kBN>>{});
  Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBM>, Int<kBN>>{});
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBM>, Int<D>>{});
  static_assert(decltype(size(acc_dq))::value == D / 4, "64 x D / 2 per warpgroup");
  Tensor coords_s = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));
  Tensor coords_dq = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<D>>{}));
  const float scale_log2 = p.scale_log2;

  // This thread's two query rows (element i holds row (i / 2) % 2 of its pair): log2-domain lse
  // and row_dot; rows past the chunk get lse = +inf, so that their P is 0.
  float lse2[2];
  float rdot[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = i0 + get<0>(coords_s(2 * r));
    const int64_t at = static_cast<int64_t>(h) * tokens + row;
    lse2[r] = row < tokens ? __ldg(p.lse + at) * tree_attention_detail::kLog2e : INFINITY;
    rdot[r] = row < tokens ? __ldg(p.row_dot + at) : 0.f;
  }

  clear(acc_dq);
  smem.barrier_q.wait(0);
  PipelineState read;
  int buffer = 0;
  for (int it = walk.Next(0); it < walk.n_total; it = walk.Next(it + 1), buffer ^= 1) {
    pipeline.consumer_wait(read);
    const int stage = read.index();
    WarpgroupGemm<true, -1>(mma_sdp, tSrQ, tSrK(_, _, _, stage), acc_s);
    WarpgroupGemm<true, -1>(mma_sdp, tSrdO, tSrV(_, _, _, stage), acc_dp);
    const bool masked = TileNeedsMask<kBN, 1>(p, it, n_pre, i0, i1);
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
    StoreScorePairs(tPsdS(_, _, _, buffer), size(acc_s),
                    [&](int i) { return acc_s(i) * (acc_dp(i) - rdot[(i >> 1) & 1]); });
    PublishScores(Traits::kConsumerThreads);
    WarpgroupGemm<false, 0>(mma_dq, tDqrdS(_, _, _, buffer), tDqrKt(_, _, _, stage), acc_dq);
    pipeline.consumer_release(read);
    ++read;
  }

  StoreBf16Rows(acc_dq, coords_dq, i0, tokens, p.dq + h * D, p.dq_row_stride,
                [&](int) { return p.scale; });
}

}  // namespace dta::kernels::hopper_detail

#endif  // DTA_KERNELS_HOPPER_TREE_ATTENTION_HOPPER_BACKWARD_HEAD_SPLIT_KERNEL_CUH_

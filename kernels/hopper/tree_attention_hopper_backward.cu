// Host side of the Hopper backward: TMA descriptors from the shared params, then the launches.
#include <cstdint>
#include <type_traits>

#include "kernels/hopper/tree_attention_hopper.h"
#include "kernels/hopper/tree_attention_hopper_backward_head_split_kernel.cuh"
#include "kernels/hopper/tree_attention_hopper_backward_kernel.cuh"

namespace dta::kernels {
namespace hopper_detail {
namespace {

template <int D>
BackwardParams<D> MakeBackwardParams(const TreeAttentionParams& p) {
  using Traits = BackwardTraits<D>;
  using Forward = typename Traits::Forward;
  BackwardParams<D> bp;
  static_cast<TreeAttentionParams&>(bp) = p;
  const auto slayout_q = typename Forward::SmemLayoutQ{};
  const auto slayout_q64 = take<0, 2>(typename Traits::SmemLayoutQdO{});
  const auto tile_q = typename Forward::TileQ{};
  const auto tile_q64 = Shape<Int<Traits::kKvBM>, Int<D>>{};
  const auto q = Gmem<D>(p.q, p.tokens, p.q_heads, p.q_row_stride);
  const auto d_out = Gmem<D>(p.grad_out, p.tokens, p.q_heads, p.grad_out_row_stride);
  bp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, q, slayout_q, tile_q, _1{});
  bp.tma_do = make_tma_copy(SM90_TMA_LOAD{}, d_out, slayout_q, tile_q, _1{});
  bp.tma_q64 = make_tma_copy(SM90_TMA_LOAD{}, q, slayout_q64, tile_q64, _1{});
  bp.tma_do64 = make_tma_copy(SM90_TMA_LOAD{}, d_out, slayout_q64, tile_q64, _1{});
  SetKeyValueTmas<D>(p, bp);
  return bp;
}

template <int D>
HeadSplitBackwardParams<D> MakeHeadSplitParams(const TreeAttentionParams& p) {
  HeadSplitBackwardParams<D> bp;
  static_cast<TreeAttentionParams&>(bp) = p;
  const auto slayout = take<0, 2>(typename ForwardTraits<D>::SmemLayoutKV{});
  const auto tile = typename ForwardTraits<D>::TileKV{};
  bp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, Gmem<D>(p.q, p.tokens, p.q_heads, p.q_row_stride),
                           slayout, tile, _1{});
  bp.tma_do = make_tma_copy(SM90_TMA_LOAD{},
                            Gmem<D>(p.grad_out, p.tokens, p.q_heads, p.grad_out_row_stride),
                            slayout, tile, _1{});
  SetKeyValueTmas<D>(p, bp);
  return bp;
}

// kernel on ctas CTAs of `threads` threads.
template <class Kernel, class Params>
cudaError_t Launch(Kernel kernel, int64_t ctas, int threads, int smem, const Params& params,
                   cudaStream_t stream) {
  if (ctas <= 0 || ctas > INT32_MAX) return cudaErrorInvalidValue;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(ctas), threads, smem, stream>>>(params);
  return cudaGetLastError();
}

// Fills p.row_stats (HopperRowStatsKernel) for the dK/dV kernels' 64-row query tiles.
cudaError_t LaunchRowStats(const TreeAttentionParams& p, cudaStream_t stream) {
  constexpr int kBM = kHopperBackwardQueryTile;
  constexpr int kStatThreads = 256;
  const int64_t rows = static_cast<int64_t>(p.q_heads) * ((p.tokens + kBM - 1) / kBM) * kBM;
  return internal::LaunchAfterPrevious(
      HopperRowStatsKernel<kBM>, static_cast<unsigned>((rows + kStatThreads - 1) / kStatThreads),
      kStatThreads, 0, stream, p);
}

template <int D>
cudaError_t LaunchBackward(const TreeAttentionParams& p, TreeAttentionBackwardPart part,
                           cudaStream_t stream) {
  using Traits = BackwardTraits<D>;
  if (!OperandsFitTma(p) || !Aligned16(p.grad_out, p.grad_out_row_stride)) {
    return cudaErrorInvalidValue;
  }
  const BackwardParams<D> bp = MakeBackwardParams<D>(p);
  switch (part) {
    case TreeAttentionBackwardPart::kDq: {
      const int64_t m_blocks = (p.tokens + Traits::kDqBM - 1) / Traits::kDqBM;
      return Launch(HopperDqKernel<D>, m_blocks * p.q_heads, Traits::kThreads, Traits::kDqSmemBytes,
                    bp, stream);
    }
    case TreeAttentionBackwardPart::kDkDv: {
      if (p.row_stats == nullptr) return cudaErrorInvalidValue;
      static_assert(Traits::kKvBM == kHopperBackwardQueryTile, "row_stats' tiles");
      constexpr int kBN = Traits::kKvBN;
      const cudaError_t err = LaunchRowStats(p, stream);
      if (err != cudaSuccess) return err;
      const int64_t tiles = (p.prefix + kBN - 1) / kBN + (p.tokens + kBN - 1) / kBN;
      return Launch(HopperDkDvKernel<D, false>, tiles * p.kv_heads, Traits::kThreads,
                    DkDvConfig<D, false>::kSmemBytes, bp, stream);
    }
    default:
      return cudaErrorInvalidValue;
  }
}

// The single-kernel backward: row statistics, the semaphores zeroed, dK/dV with dQ's parts, then
// dQ from its float32 sums. Wide heads (D > 128) run the head-split kernel's variant, as
// LaunchHopperTreeAttentionBackward runs the head-split kernels there.
template <int D>
cudaError_t LaunchFusedBackward(const TreeAttentionParams& p, cudaStream_t stream) {
  constexpr bool kHeadSplit = D > 128;
  using Traits = std::conditional_t<kHeadSplit, HeadSplitBackwardTraits<D>, BackwardTraits<D>>;
  if (!OperandsFitTma(p) || !Aligned16(p.grad_out, p.grad_out_row_stride) ||
      p.row_stats == nullptr || p.dq_accum == nullptr || p.dq_semaphore == nullptr) {
    return cudaErrorInvalidValue;
  }
  static_assert(Traits::kKvBM == kHopperBackwardQueryTile, "row_stats' and the workspace's tiles");
  cudaError_t err = LaunchRowStats(p, stream);
  if (err != cudaSuccess) return err;
  const int64_t m_blocks = (p.tokens + Traits::kKvBM - 1) / Traits::kKvBM;
  err = cudaMemsetAsync(p.dq_semaphore, 0, m_blocks * p.q_heads * sizeof(int32_t), stream);
  if (err != cudaSuccess) return err;
  constexpr int kBN = Traits::kKvBN;
  const int64_t ctas = ((p.prefix + kBN - 1) / kBN + (p.tokens + kBN - 1) / kBN) * p.kv_heads;
  if constexpr (kHeadSplit) {
    err = Launch(HopperDkDvHeadSplitKernel<D, true>, ctas, Traits::kThreads,
                 HeadSplitDkDvConfig<D, true>::kSmemBytes, MakeHeadSplitParams<D>(p), stream);
  } else {
    err = Launch(HopperDkDvKernel<D, true>, ctas, Traits::kThreads, DkDvConfig<D, true>::kSmemBytes,
                 MakeBackwardParams<D>(p), stream);
  }
  if (err != cudaSuccess) return err;
  return Launch(HopperDqFromPartsKernel<D, Traits>, m_blocks * p.q_heads * Traits::kDqFromPartsCtas,
                128, 0, p, stream);
}

// The same parts at wide heads (tree_attention_hopper_backward_head_split_kernel.cuh).
template <int D>
cudaError_t LaunchHeadSplitBackward(const TreeAttentionParams& p, TreeAttentionBackwardPart part,
                                    cudaStream_t stream) {
  using Traits = HeadSplitBackwardTraits<D>;
  if (!OperandsFitTma(p) || !Aligned16(p.grad_out, p.grad_out_row_stride)) {
    return cudaErrorInvalidValue;
  }
  const HeadSplitBackwardParams<D> bp = MakeHeadSplitParams<D>(p);
  switch (part) {
    case TreeAttentionBackwardPart::kDq: {
      const int64_t m_blocks = (p.tokens + Traits::kBM - 1) / Traits::kBM;
      return Launch(HopperDqHeadSplitKernel<D>, m_blocks * p.q_heads, Traits::kThreads,
                    Traits::kDqSmemBytes, bp, stream);
    }
    case TreeAttentionBackwardPart::kDkDv: {
      if (p.row_stats == nullptr) return cudaErrorInvalidValue;
      const cudaError_t err = LaunchRowStats(p, stream);
      if (err != cudaSuccess) return err;
      constexpr int kBN = Traits::kBN;
      const int64_t tiles = (p.prefix + kBN - 1) / kBN + (p.tokens + kBN - 1) / kBN;
      return Launch(HopperDkDvHeadSplitKernel<D, false>, tiles * p.kv_heads, Traits::kThreads,
                    HeadSplitDkDvConfig<D, false>::kSmemBytes, bp, stream);
    }
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace
}  // namespace hopper_detail

cudaError_t LaunchHopperTreeAttentionFusedBackward(const TreeAttentionParams& p, int head_dim,
                                                   cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      return hopper_detail::LaunchFusedBackward<64>(p, stream);
    case 128:
      return hopper_detail::LaunchFusedBackward<128>(p, stream);
    case 256:
      return hopper_detail::LaunchFusedBackward<256>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchHopperTreeAttentionBackward(const TreeAttentionParams& p, int head_dim,
                                              TreeAttentionBackwardPart part, cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      return hopper_detail::LaunchBackward<64>(p, part, stream);
    case 128:
      return hopper_detail::LaunchBackward<128>(p, part, stream);
    case 256:
      return hopper_detail::LaunchHeadSplitBackward<256>(p, part, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace dta::kernels

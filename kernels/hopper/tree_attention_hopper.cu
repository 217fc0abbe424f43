// Host side of the Hopper forward: TMA descriptors from the shared params, then the launch.
#include "kernels/hopper/tree_attention_hopper.h"

#include <algorithm>
#include <cstdint>
#include <limits>

#include "kernels/hopper/tree_attention_hopper_kernel.cuh"

namespace dta::kernels {
namespace hopper_detail {
namespace {

bool Aligned16(const void* ptr, int64_t row_stride) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 &&
         (row_stride * static_cast<int64_t>(sizeof(bf16))) % 16 == 0;
}

// (rows, D, heads) over rows of `heads` contiguous heads. A single row has stride 0 in the
// params; TMA wants a positive multiple of 16 bytes and never steps past row 0 there.
template <int D>
typename ForwardTraits<D>::GmemTensor Gmem(const bf16* ptr, int rows, int heads,
                                           int64_t row_stride) {
  const int64_t stride = row_stride > 0 ? row_stride : static_cast<int64_t>(heads) * D;
  return make_tensor(make_gmem_ptr(reinterpret_cast<const Element*>(ptr)),
                     make_shape(rows, static_cast<int32_t>(D), heads),
                     make_stride(stride, _1{}, static_cast<int64_t>(D)));
}

template <int D>
cudaError_t LaunchForward(const TreeAttentionParams& p, int32_t* unit_counter,
                          cudaStream_t stream) {
  using Traits = ForwardTraits<D>;
  const bool has_prefix = p.prefix > 0;
  if (!Aligned16(p.q, p.q_row_stride) || !Aligned16(p.k, p.k_row_stride) ||
      !Aligned16(p.v, p.v_row_stride) ||
      (has_prefix && (!Aligned16(p.prefix_k, p.prefix_k_row_stride) ||
                      !Aligned16(p.prefix_v, p.prefix_v_row_stride))) ||
      static_cast<int64_t>(p.tokens) + p.prefix >= std::numeric_limits<int32_t>::max()) {
    return cudaErrorInvalidValue;
  }
  ForwardParams<D> fp;
  const auto slayout_kv = take<0, 2>(typename Traits::SmemLayoutKV{});
  const auto tile_kv = typename Traits::TileKV{};
  fp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, Gmem<D>(p.q, p.tokens, p.q_heads, p.q_row_stride),
                           typename Traits::SmemLayoutQ{}, typename Traits::TileQ{}, _1{});
  fp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, Gmem<D>(p.k, p.tokens, p.kv_heads, p.k_row_stride),
                           slayout_kv, tile_kv, _1{});
  fp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, Gmem<D>(p.v, p.tokens, p.kv_heads, p.v_row_stride),
                           slayout_kv, tile_kv, _1{});
  if (has_prefix) {
    fp.tma_prefix_k = make_tma_copy(
        SM90_TMA_LOAD{}, Gmem<D>(p.prefix_k, p.prefix, p.kv_heads, p.prefix_k_row_stride),
        slayout_kv, tile_kv, _1{});
    fp.tma_prefix_v = make_tma_copy(
        SM90_TMA_LOAD{}, Gmem<D>(p.prefix_v, p.prefix, p.kv_heads, p.prefix_v_row_stride),
        slayout_kv, tile_kv, _1{});
  } else {
    fp.tma_prefix_k = fp.tma_k;  // never used: no prefix tile is visited
    fp.tma_prefix_v = fp.tma_v;
  }
  fp.key_end = p.key_end;
  fp.tile_max_end = p.tile_max_end;
  fp.tile_min_end = p.tile_min_end;
  fp.tokens = p.tokens;
  fp.prefix = p.prefix;
  fp.q_heads = p.q_heads;
  fp.kv_heads = p.kv_heads;
  fp.m_blocks = (p.tokens + Traits::kBM - 1) / Traits::kBM;
  // Sections of query heads whose K and V (all P + T rows) fit in kL2Bytes together, whole GQA
  // groups each (FlashAttention-3's L2 swizzle).
  constexpr int64_t kL2Bytes = 32 << 20;
  const int64_t kv_head_bytes =
      (static_cast<int64_t>(p.tokens) + p.prefix) * D * 2 * static_cast<int64_t>(sizeof(bf16));
  const int64_t kv_fit = std::max<int64_t>(1, kL2Bytes / kv_head_bytes);
  const int group = p.q_heads / p.kv_heads;
  fp.section_heads = static_cast<int>(std::min<int64_t>(p.q_heads, kv_fit * group));
  fp.scale = p.scale;
  fp.scale_log2 = p.scale_log2;
  fp.out = p.out;
  fp.out_row_stride = p.out_row_stride;
  fp.lse = p.lse;
  fp.unit_counter = unit_counter;

  auto kernel = HopperForwardKernel<D>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  // Persistent: one CTA per SM (at most one per unit), each running a snake of units.
  const int64_t units = static_cast<int64_t>(fp.m_blocks) * p.q_heads;
  if (units > std::numeric_limits<int32_t>::max()) return cudaErrorInvalidValue;
  int device = 0;
  int sms = 0;
  err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(units, sms)));
  err = cudaMemsetAsync(unit_counter, 0, sizeof(int32_t), stream);
  if (err != cudaSuccess) return err;
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(fp);
  return cudaGetLastError();
}

}  // namespace
}  // namespace hopper_detail

bool HopperTreeAttentionSupportsHeadDim(int head_dim) { return head_dim == 128; }

cudaError_t LaunchHopperTreeAttentionForward(const TreeAttentionParams& p, int head_dim,
                                             int32_t* unit_counter, cudaStream_t stream) {
  switch (head_dim) {
    case 128:
      return hopper_detail::LaunchForward<128>(p, unit_counter, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace dta::kernels

// Host side of the Hopper forward: TMA descriptors from the shared params, then the launch.
#include "kernels/hopper/tree_attention_hopper.h"

#include <algorithm>
#include <cstdint>
#include <limits>

#include "kernels/hopper/tree_attention_hopper_kernel.cuh"

namespace dta::kernels {
namespace hopper_detail {
namespace {

template <int D>
cudaError_t LaunchForward(const TreeAttentionParams& p, int32_t* unit_counter,
                          cudaStream_t stream) {
  using Traits = ForwardTraits<D>;
  if (!OperandsFitTma(p)) return cudaErrorInvalidValue;
  ForwardParams<D> fp;
  fp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, Gmem<D>(p.q, p.tokens, p.q_heads, p.q_row_stride),
                           typename Traits::SmemLayoutQ{}, typename Traits::TileQ{}, _1{});
  SetKeyValueTmas<D>(p, fp);
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
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(fp);
  return cudaGetLastError();
}

}  // namespace
}  // namespace hopper_detail

cudaError_t LaunchHopperTreeAttentionForward(const TreeAttentionParams& p, int head_dim,
                                             int32_t* unit_counter, cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      return hopper_detail::LaunchForward<64>(p, unit_counter, stream);
    case 128:
      return hopper_detail::LaunchForward<128>(p, unit_counter, stream);
    case 256:
      return hopper_detail::LaunchForward<256>(p, unit_counter, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace dta::kernels

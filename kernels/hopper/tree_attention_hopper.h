// The Hopper (sm_90a) forward and backward of tree attention: FlashAttention-3 style, built on
// CuTe. The forward: a producer warp streams Q and the visible K/V tiles with TMA into a
// multi-stage shared-memory pipeline; two consumer warpgroups (64 query rows each) run Q K^T and
// P V as warpgroup MMAs (wgmma, fp32 accumulation), the softmax of one key tile overlapping the
// next tile's Q K^T. The backward: the same producer / consumer split in a dQ kernel (query-tile
// major) and a dK/dV kernel (key-tile major) with no cross-CTA sums, or, opt-in at head dim 128,
// one kernel per key tile computing dK, dV and dQ's parts, added in a fixed order; both
// deterministic (tree_attention_hopper_backward_kernel.cuh; at head dim 256 the head-split kernels
// of tree_attention_hopper_backward_head_split_kernel.cuh). Same semantics, index spaces, tile
// skipping and outputs as the FlashAttention-2 kernels in kernels/tree_attention_kernel.cuh (which
// stay the fallback for every other GPU and shape).
//
// Framework-free: the shared TreeAttentionParams in, cudaError_t out. Thread safety: stateless.
// Only compiled when CMake finds the CUTLASS headers (DTA_KERNELS_HAVE_HOPPER).
#ifndef DTA_KERNELS_HOPPER_TREE_ATTENTION_HOPPER_H_
#define DTA_KERNELS_HOPPER_TREE_ATTENTION_HOPPER_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/hopper/head_dims.h"
#include "kernels/tree_attention_kernel.cuh"

namespace dta::kernels {

// Writes p.out [T, Hq, D] and p.lse [Hq, T] exactly as LaunchTreeAttentionForward does, on a
// device of compute capability 9.0. Requires p.key_end, p.tile_max_end and p.tile_min_end filled
// by LaunchTreeAttentionPrepare on the same stream; q, k, v, prefix_k, prefix_v with 16-byte
// aligned starts and row strides and contiguous heads (TMA's rules), out with 4-byte aligned rows,
// and one int32 of device memory in unit_counter that holds 0 when the launch runs in `stream`'s
// order (LaunchTreeAttentionPrepare's zeroed_counter: the persistent CTAs count their work units
// through it), not used by a concurrent launch.
// Returns cudaErrorInvalidValue for a head_dim HopperTreeAttentionForwardSupportsHeadDim rejects,
// misaligned operands or T + P >= 2^31, else the error of the launch.
cudaError_t LaunchHopperTreeAttentionForward(const TreeAttentionParams& p, int head_dim,
                                             int32_t* unit_counter, cudaStream_t stream);

// The query tile of the backward's dK/dV kernel, and the floats of the row statistics workspace
// (p.row_stats) its kDkDv part needs: per query head and tile, the tile's lse * log2(e), then its
// row_dot.
constexpr int kHopperBackwardQueryTile = 64;
inline int64_t HopperBackwardRowStatsFloats(int64_t tokens, int64_t q_heads) {
  const int64_t tiles = (tokens + kHopperBackwardQueryTile - 1) / kHopperBackwardQueryTile;
  return q_heads * tiles * 2 * kHopperBackwardQueryTile;
}

// One part of the backward on a device of compute capability 9.0, with the effects
// LaunchTreeAttentionBackward documents: kDq writes p.dq; kDkDv writes p.dk and p.dv and adds into
// p.grad_prefix_k / p.grad_prefix_v. Both read p.lse and p.row_dot, so kRowDot (the
// FlashAttention-2 launch, not this one) runs first on the stream; the two parts may then run
// concurrently. kDkDv first fills p.row_stats (its workspace, required) from them. Each gradient
// element is summed by one thread in a fixed order: bitwise deterministic. Requires the prepare
// kernel's workspace as the forward does, q, k, v, the prefix and grad_out under TMA's rules,
// dq/dk/dv with 4-byte aligned rows and grad_prefix_k/v with 8-byte aligned rows. Returns
// cudaErrorInvalidValue for a head_dim HopperTreeAttentionBackwardSupportsHeadDim rejects, an
// unsupported part, misaligned operands or T + P >= 2^31, else the error of the launch.
cudaError_t LaunchHopperTreeAttentionBackward(const TreeAttentionParams& p, int head_dim,
                                              TreeAttentionBackwardPart part, cudaStream_t stream);

// The single-kernel backward (FlashAttention-3's; opt-in, DTA_HOPPER_ATTENTION_BACKWARD_FUSED=1,
// slower than the two kernels on the H200 so far): one pass over each key tile computes dK, dV and
// dQ's part from that tile, and the parts of each 64-row query tile are summed in float32 in a
// fixed order of key tiles (each tile's int32 semaphore in p.dq_semaphore counts the parts added;
// bitwise deterministic), then written to p.dq in bf16. The same effects and requirements as the
// kDq and kDkDv parts together, plus its workspace: p.row_stats, p.dq_accum
// (HopperFusedBackwardDqAccumFloats) and p.dq_semaphore (HopperFusedBackwardSemaphores, zeroed
// here on the stream). Returns cudaErrorInvalidValue for a head_dim
// HopperTreeAttentionFusedBackwardSupportsHeadDim rejects, a missing workspace, misaligned operands
// or T + P >= 2^31, else the error of the launch.
inline int64_t HopperFusedBackwardSemaphores(int64_t tokens, int64_t q_heads) {
  return q_heads * ((tokens + kHopperBackwardQueryTile - 1) / kHopperBackwardQueryTile);
}
inline int64_t HopperFusedBackwardDqAccumFloats(int64_t tokens, int64_t q_heads, int64_t head_dim) {
  return HopperFusedBackwardSemaphores(tokens, q_heads) * kHopperBackwardQueryTile * head_dim;
}
cudaError_t LaunchHopperTreeAttentionFusedBackward(const TreeAttentionParams& p, int head_dim,
                                                   cudaStream_t stream);

}  // namespace dta::kernels

#endif  // DTA_KERNELS_HOPPER_TREE_ATTENTION_HOPPER_H_

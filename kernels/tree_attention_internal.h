// Shared by the reference and the CUDA path: input checks and the CUDA entry points. Not part of
// the public API; include kernels/tree_attention.h instead.
#ifndef DTA_KERNELS_TREE_ATTENTION_INTERNAL_H_
#define DTA_KERNELS_TREE_ATTENTION_INTERNAL_H_

#include <ATen/ATen.h>

#include <cstdint>

#include "kernels/tree_attention.h"

namespace dta::kernels::internal {

struct TreeAttentionShape {
  int64_t tokens = 0;    // T: chunk rows
  int64_t prefix = 0;    // P: cached prefix rows
  int64_t q_heads = 0;   // Hq
  int64_t kv_heads = 0;  // Hkv
  int64_t head_dim = 0;  // D
};

// True when prefix_k holds rows (defined and non-empty).
bool HasPrefix(const at::Tensor& prefix_k);

// TORCH_CHECKs every forward requirement of kernels/tree_attention.h; returns the sizes.
TreeAttentionShape CheckForwardInputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                      const at::Tensor& key_end);

// TORCH_CHECKs the backward's extra tensors against the forward's sizes.
void CheckBackwardInputs(const TreeAttentionShape& shape, const at::Tensor& q,
                         const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                         const at::Tensor& grad_prefix_k, const at::Tensor& grad_prefix_v);

// True when ForwardCuda runs the Hopper forward (kernels/hopper/) rather than the
// FlashAttention-2 one for these checked, kernel-supported inputs: a build with the CUTLASS headers
// (DTA_KERNELS_HAVE_HOPPER), q on a device of compute capability 9.x, a head dim of
// HopperTreeAttentionForwardSupportsHeadDim (kernels/hopper/head_dims.h), and the environment
// variable DTA_HOPPER_ATTENTION unset or not "0". The variable is read at every call, so one
// process can compare both kernels.
bool UsesHopperForward(const TreeAttentionShape& shape, const at::Tensor& q);

// True when BackwardCuda runs the Hopper dQ and dK/dV kernels (kernels/hopper/) rather than the
// FlashAttention-2 ones: the same requirements as UsesHopperForward, with
// HopperTreeAttentionBackwardSupportsHeadDim and the environment variable
// DTA_HOPPER_ATTENTION_BACKWARD (unset or not "0"; read at every call) in place of
// DTA_HOPPER_ATTENTION. Either direction may run either kernel: out and lse are the same contract.
bool UsesHopperBackward(const TreeAttentionShape& shape, const at::Tensor& q);

// True when BackwardCuda runs the Hopper single-kernel backward (dK, dV and dQ's parts in one
// kernel) instead of the Hopper dQ and dK/dV kernels: UsesHopperBackward at a head dim
// HopperTreeAttentionFusedBackwardSupportsHeadDim accepts, and the environment variable
// DTA_HOPPER_ATTENTION_BACKWARD_FUSED is "1" (opt-in: on the H200 it is slower than the two
// kernels at every head dim, docs/benchmarks.md; read at every call).
bool UsesHopperFusedBackward(const TreeAttentionShape& shape, const at::Tensor& q);

// The CUDA path (kernels/tree_attention.cu). Inputs are already checked. Defined only when the
// library is built with nvcc (DTA_KERNELS_HAVE_CUDA).

// The most dynamic shared memory per block the kernels take at head_dim (64, 128, 256; 0 for
// others).
int64_t KernelSmemBytes(int64_t head_dim);

TreeAttentionOutput ForwardCuda(const TreeAttentionShape& shape, const at::Tensor& q,
                                const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                const at::Tensor& key_end, double scale);
TreeAttentionGrads BackwardCuda(const TreeAttentionShape& shape, const at::Tensor& grad_out,
                                const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                const at::Tensor& key_end, const at::Tensor& out,
                                const at::Tensor& lse, double scale, at::Tensor& grad_prefix_k,
                                at::Tensor& grad_prefix_v);

}  // namespace dta::kernels::internal

#endif  // DTA_KERNELS_TREE_ATTENTION_INTERNAL_H_

// Attention of a causal chain without a cached prefix (every query sees the keys up to and
// including its own position: a dense rollout, or the first chunk of a root-to-leaf path) through
// cuDNN's fused attention, the kernel PyTorch's scaled_dot_product_attention (and so Hugging Face's
// "sdpa") runs on Hopper: FlashAttention-3-class wgmma kernels, about 2.9x kernels/tree_attention's
// on an H100 (docs/benchmarks.md). The same kernels also compute a chunk's attention to its whole
// prefix (PrefixAttentionForward, no mask), which kernels/chunk_attention.h merges with the chunk's
// own part.
//
// Grouped-query attention: the K/V heads are repeated to the query heads for the call and their
// gradients summed back over each group (in float32, rounded once).
//
// ChainAttentionSupports says whether this path takes the inputs: CUDA, bfloat16 or float16, at
// least two tokens, head dim a multiple of 8 up to 128, and cuDNN attention neither disabled
// (DTA_CUDNN_ATTENTION=0 in the environment, read once: the before/after switch of benchmarks) nor
// found unavailable by an earlier call (the first failure is reported once on stderr, and tree
// attention runs from then on).
//
// Usage:
//   if (ChainAttentionSupports(q, k)) {
//     ChainAttentionOutput fwd = ChainAttentionForward(q, k, v, scale);
//     ...
//     TreeAttentionGrads g = ChainAttentionBackward(d_out, q, k, v, fwd, scale);
//   }
//
// Thread safety: calls run on the current CUDA stream of q's device.
// Failure: c10::Error from the shape checks; a cuDNN failure in either direction is also a
// c10::Error, after which ChainAttentionSupports returns false (the model then runs tree attention,
// recomputing the forward for a backward that failed).
#ifndef DTA_KERNELS_CHAIN_ATTENTION_H_
#define DTA_KERNELS_CHAIN_ATTENTION_H_

#include <ATen/ATen.h>

#include "kernels/tree_attention.h"

namespace dta::kernels {

struct ChainAttentionOutput {
  at::Tensor out;  // [T, Hq, D], q's dtype
  // What the backward needs besides the inputs: cuDNN's [1, Hq, T, D] output and log-sum-exp, and
  // its random-number state (unused: no dropout, but part of its interface).
  at::Tensor out_bhsd, logsumexp, philox_seed, philox_offset;
};

bool ChainAttentionSupports(const at::Tensor& q, const at::Tensor& k);

// Whether a cuDNN call failed in this process (and was reported): callers then redo the work with
// tree attention.
bool CudnnAttentionFailed();

// q [T, Hq, D]; k, v [T, Hkv, D] (Hq a multiple of Hkv), on one CUDA device, one dtype.
ChainAttentionOutput ChainAttentionForward(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, double scale);

// dq, dk, dv (q's dtype) given grad_out [T, Hq, D] and the forward's output.
TreeAttentionGrads ChainAttentionBackward(const at::Tensor& grad_out, const at::Tensor& q,
                                          const at::Tensor& k, const at::Tensor& v,
                                          const ChainAttentionOutput& forward, double scale);

// Attention of every query q [T, Hq, D] to every row of prefix_k, prefix_v [P, Hkv, D] (no mask:
// the prefix part of a chunk, kernels/chunk_attention.h), under the same conditions.
ChainAttentionOutput PrefixAttentionForward(const at::Tensor& q, const at::Tensor& prefix_k,
                                            const at::Tensor& prefix_v, double scale);

// dq (q's dtype) and the prefix's dk, dv (float32: summed over each KV head's query heads in
// float32 and not rounded, for the caller's float32 accumulators) given grad_out [T, Hq, D] and an
// output and log-sum-exp
// (`forward`, or WithMergedOutput's).
TreeAttentionGrads PrefixAttentionBackward(const at::Tensor& grad_out, const at::Tensor& q,
                                           const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                           const ChainAttentionOutput& forward, double scale);

// `part` (a forward's output) with its output and log-sum-exp replaced by those of attention over
// more keys (a log-sum-exp merge): out [T, Hq, D] contiguous, lse [Hq, T] float32. A backward given
// it computes this part's share of the whole's gradients.
ChainAttentionOutput WithMergedOutput(const ChainAttentionOutput& part, const at::Tensor& out,
                                      const at::Tensor& lse);

}  // namespace dta::kernels

#endif  // DTA_KERNELS_CHAIN_ATTENTION_H_

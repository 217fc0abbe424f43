// The exact ATen reference of kernels/tree_attention.h: any device, any floating dtype, with the
// same contracts as TreeAttentionForward / TreeAttentionBackward. It materializes the mask and the
// scores for a block of query rows at a time (about 4M scores a block, over the keys the block's
// rows may see), so memory is O(Hq * rows * (P + T)) beyond the inputs; it computes in float64 for
// float64 inputs and in float32 otherwise. The backward uses the explicit formulas
// dS = P * (dP - rowsum(dO * O)), dQ = scale * dS K, dK = scale * dS^T Q, dV = P^T dO.
#ifndef DTA_KERNELS_TREE_ATTENTION_REFERENCE_H_
#define DTA_KERNELS_TREE_ATTENTION_REFERENCE_H_

#include <ATen/ATen.h>

#include "kernels/tree_attention.h"

namespace dta::kernels {

// [T, P + T] bool: entry (i, l) is true iff query i sees key l (prefix keys first). key_end [T]
// on any device; the mask is built on key_end's device.
at::Tensor TreeAttentionMask(const at::Tensor& key_end, int64_t prefix_len);

TreeAttentionOutput ReferenceTreeAttentionForward(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, const at::Tensor& prefix_k,
                                                  const at::Tensor& prefix_v,
                                                  const at::Tensor& key_end, double scale);

TreeAttentionGrads ReferenceTreeAttentionBackward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& prefix_k, const at::Tensor& prefix_v, const at::Tensor& key_end,
    const at::Tensor& out, const at::Tensor& lse, double scale, at::Tensor& grad_prefix_k,
    at::Tensor& grad_prefix_v);

// Attention of every query to every row of a prefix, without a mask (the prefix part of a chunk,
// kernels/chunk_attention.h): q [T, Hq, D], prefix_k and prefix_v [P >= 1, Hkv, D].
TreeAttentionOutput ReferencePrefixAttentionForward(const at::Tensor& q, const at::Tensor& prefix_k,
                                                    const at::Tensor& prefix_v, double scale);

// Its gradients against an output and log-sum-exp that may be those of attention over more keys
// (the merged ones): returns dq (q's dtype) and ADDS the prefix's dK, dV into grad_prefix_k/v when
// they are defined.
at::Tensor ReferencePrefixAttentionBackward(const at::Tensor& grad_out, const at::Tensor& q,
                                            const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                            const at::Tensor& out, const at::Tensor& lse,
                                            double scale, const at::Tensor& grad_prefix_k,
                                            const at::Tensor& grad_prefix_v);

}  // namespace dta::kernels

#endif  // DTA_KERNELS_TREE_ATTENTION_REFERENCE_H_

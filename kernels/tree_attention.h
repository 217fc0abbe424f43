// Tree attention: a chunk of T query tokens on top of a cached prefix of P key/value rows, where
// the chunk's tokens are in DFS order of a prefix tree and each token attends to its ancestors.
//
// Keys are the P prefix rows followed by the T chunk rows. Query i (0 <= i < T) sees every prefix
// key, and chunk key j iff j <= i < key_end[j]: key j is visible to the contiguous interval of
// query rows that make up its subtree. A causal chain is key_end[j] = T for every j. Grouped-query
// attention: query head h reads kv head h / (Hq / Hkv).
//
// On CUDA with bf16 inputs and head dim 64, 128 or 256 (TreeAttentionKernelSupports), both
// directions run FlashAttention-2 style kernels (kernels/tree_attention_kernel.cuh): O(T * D)
// memory, tiles that no query of a tile can see are skipped without being loaded, and the backward
// is deterministic (bitwise equal across runs). On Hopper (compute capability 9.x) FlashAttention-3
// style kernels run instead (kernels/hopper/: TMA, warp specialisation, wgmma; same mask, tile
// skipping, out and lse; a deterministic backward bitwise equal to the FlashAttention-2 one) at the
// head dims kernels/hopper/head_dims.h lists for each direction, when the build found the CUTLASS
// headers: the forward unless DTA_HOPPER_ATTENTION is "0", the backward unless
// DTA_HOPPER_ATTENTION_BACKWARD is "0" (both read at every call). Every other input (CPU,
// float32/float64, other head dims) runs the exact ATen reference in
// kernels/tree_attention_reference.h, which builds the [T, P + T] mask and computes in float64 for
// float64 inputs, float32 otherwise.
//
// Usage, one layer of one chunk:
//   TreeAttentionOutput fwd = TreeAttentionForward(q, k, v, cache_k.slice(0, 0, P),
//                                                  cache_v.slice(0, 0, P), key_end, 1 / sqrt(D));
//   TreeAttentionGrads g = TreeAttentionBackward(d_out, q, k, v, cache_k.slice(0, 0, P),
//                                                cache_v.slice(0, 0, P), key_end, fwd.out, fwd.lse,
//                                                1 / sqrt(D), grad_k_acc_view, grad_v_acc_view);
//
// Thread safety: stateless; calls run on the current CUDA stream of q's device.
// Failure: every shape, dtype and device requirement below is a TORCH_CHECK (c10::Error). key_end
// values are trusted on CUDA (checking them would synchronize); the reference checks them on CPU.
#ifndef DTA_KERNELS_TREE_ATTENTION_H_
#define DTA_KERNELS_TREE_ATTENTION_H_

#include <ATen/ATen.h>

namespace dta::kernels {

struct TreeAttentionOutput {
  at::Tensor out;  // [T, Hq, D], dtype of q
  at::Tensor lse;  // [Hq, T] float32 (float64 for float64 q): log-sum-exp of the scaled scores
};

// q [T, Hq, D]; k, v [T, Hkv, D]: the chunk's keys and values; prefix_k, prefix_v [P, Hkv, D], or
// undefined / zero rows for P = 0; key_end [T] int64 or int32 on q's device, with
// j < key_end[j] <= T and the intervals [j, key_end[j]) nested or disjoint. scale multiplies the
// scores (1 / sqrt(D) usually). All tensors on one device with one floating dtype; each may be a
// strided view whose last two dims are contiguous (prefix_k is typically a slice of a
// preallocated [max_len, Hkv, D] cache). Other layouts work too; the CUDA path then copies them.
TreeAttentionOutput TreeAttentionForward(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& prefix_k,
                                         const at::Tensor& prefix_v, const at::Tensor& key_end,
                                         double scale);

struct TreeAttentionGrads {
  at::Tensor dq;  // [T, Hq, D], dtype of q
  at::Tensor dk;  // [T, Hkv, D], dtype of q
  at::Tensor dv;  // [T, Hkv, D], dtype of q
};

// Gradients of the chunk's q, k, v given grad_out [T, Hq, D] and the forward's out and lse. The
// prefix gradients are ADDED in place into grad_prefix_k / grad_prefix_v: [P, Hkv, D] float32
// (float64 for float64 inputs) views of caller-owned accumulators, rows possibly strided, last
// two dims contiguous (required on CUDA); rows outside the views are never touched. Undefined
// or empty when P = 0. The CUDA path allocates nothing of size P when the prefix rows are 16-byte
// aligned with contiguous last two dims.
TreeAttentionGrads TreeAttentionBackward(const at::Tensor& grad_out, const at::Tensor& q,
                                         const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                         const at::Tensor& key_end, const at::Tensor& out,
                                         const at::Tensor& lse, double scale,
                                         at::Tensor& grad_prefix_k, at::Tensor& grad_prefix_v);

// True when the CUDA kernels handle these inputs: CUDA tensors, bf16, head dim 64, 128 or 256,
// Hq % Hkv == 0, a device whose shared memory per block fits the kernels (sm_90 for 256: up to
// 193 KiB), and a build with nvcc. False otherwise (the reference runs then).
bool TreeAttentionKernelSupports(const at::Tensor& q, const at::Tensor& k);

}  // namespace dta::kernels

#endif  // DTA_KERNELS_TREE_ATTENTION_H_

// The tree-causal depthwise convolution of Gated DeltaNet's mixer (TreeCausalConv in
// executor/model/ops/gated_delta_net.h) as CUDA kernels, one launch forward and four backward
// (besides ATen's stable sort of the index), instead of ATen's gather of every tap ([T, kernel, C]
// float32: 5.4 GB a layer for 40K tokens of Qwen3-Next-80B's 8,192 channels) and the element-wise
// products and sums over it.
//
// Each token t reads `kernel` rows of a table whose row 0 is zeros, rows 1..P the context (the
// inputs of the tokens above the chunk) and rows P + 1.. the chunk's inputs x; index [T, kernel]
// names them (ConvAncestorIndex: a token's ancestors on its path, so a branch point's row is read
// by each of its children). Then
//   pre[t, c] = sum_j weight[c, j] * table[index[t, j], c],   out[t, c] = silu(pre[t, c]).
// Backward recomputes pre (nothing but the inputs is kept), dpre = grad * silu'(pre), and
//   dtable[r, c] = sum over the pairs (t, j) with index[t, j] = r of dpre[t, c] * weight[c, j]
//   (in the order of t * kernel + j: the pairs sorted stably by row, no atomics),
//   dweight[c, j] = sum_t dpre[t, c] * table[index[t, j], c]
//   (per block of 256 tokens, then the blocks in order): bitwise reproducible.
//
// Numerics: float32 for bfloat16, float16 and float32 inputs (what the ATen path computes in),
// products and sums rounded separately (never fused), silu as ATen computes it; outputs rounded
// once to their tensors' dtypes. The ATen path differs only in the order of its sums.
//
// Example (Gated DeltaNet's convolution on the GPU):
//   if (kernels::TreeCausalConvKernelRuns(x, weight, context, index)) {
//     at::Tensor out = kernels::TreeCausalConvForward(x, weight, context, index);
//     kernels::TreeCausalConvGrads g =
//         kernels::TreeCausalConvBackward(grad_out, x, weight, context, index);
//   }
//
// Thread safety: stateless (the environment is read at each call); the work runs on the current
// stream of the inputs' device.
#ifndef DTA_KERNELS_TREE_CAUSAL_CONV_H_
#define DTA_KERNELS_TREE_CAUSAL_CONV_H_

#include <ATen/ATen.h>

#include <cstdint>

namespace dta::kernels {

// The most taps a kernel runs with (Qwen3-Next and Qwen3.5: 4).
inline constexpr int64_t kMaxConvTaps = 8;

// True when the kernels take this call: built with CUDA, x on a CUDA device, the environment
// variable DTA_CONV_KERNEL not "0" (read at every call: the before/after switch of benchmarks);
// x [T, C] and context [P, C] (P >= 0) contiguous of one floating type among bfloat16, float16
// and float32; weight [C, kernel] contiguous, floating but not float64, kernel <= kMaxConvTaps;
// index [T, kernel] int64 contiguous; all on x's device. Anything else takes the caller's ATen
// path.
bool TreeCausalConvKernelRuns(const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& context, const at::Tensor& index);

// out [T, C] in x's dtype. Requires TreeCausalConvKernelRuns; index entries in [0, 1 + P + T).
at::Tensor TreeCausalConvForward(const at::Tensor& x, const at::Tensor& weight,
                                 const at::Tensor& context, const at::Tensor& index);

struct TreeCausalConvGrads {
  at::Tensor x;        // [T, C], x's dtype
  at::Tensor weight;   // [C, kernel], weight's dtype
  at::Tensor context;  // [P, C], context's dtype
};

// The gradients of sum(out * grad_out) with respect to x, weight and context. Requires
// TreeCausalConvKernelRuns and grad_out [T, C] contiguous of x's dtype.
TreeCausalConvGrads TreeCausalConvBackward(const at::Tensor& grad_out, const at::Tensor& x,
                                           const at::Tensor& weight, const at::Tensor& context,
                                           const at::Tensor& index);

}  // namespace dta::kernels

#endif  // DTA_KERNELS_TREE_CAUSAL_CONV_H_

// The Qwen3 decoder's elementwise layers, each direction in one CUDA kernel instead of the 5 to 15
// ATen kernels of their composition: RMSNorm (the input and post-attention norms over the float32
// residual stream, the final norm), RMSNorm followed by rotary embedding (the per-head q/k norms),
// rotary embedding alone (families without q/k norms), SwiGLU, and the log-probability head's
// softmax statistics and logits gradient. The model calls
// these functions; on the GPU they cut a layer's launches and its
// passes over activations, which bounded the step at small chunks (kernel launches, not FLOPs).
//
// Numerics are the model's (executor/model/ops/numerics.h): the compute type is float64 for
// float64 inputs and float32 otherwise; every result is computed in it and rounded once to its
// output type. The q/k path rounds the normalised head to x's dtype before RoPE, as the unfused
// graph did, and its backward rounds RoPE's input gradient to dy's dtype before the norm's
// backward. Every function has an exact ATen path (the CPU, float64, and whatever the kernels do
// not take), which computes the same expressions in the same order; the CUDA kernels differ from it
// only in the order of the float32 sums of a row (and of a norm weight's gradient over rows).
//
// CUDA kernels run when the library is built with nvcc, the tensors are on a CUDA device, the
// compute type is float32 (x, weight and outputs float32, bfloat16 or float16), and:
//   - RMSNorm: the row length is at most 8,192;
//   - RMSNorm + RoPE, RoPE: head_dim is a multiple of 64, at most 256.
// DTA_FUSED_LAYERS=0 in the environment (read once) makes every call take the ATen path: the
// before/after switch of benchmarks, and a way to rule the kernels out when debugging.
// DTA_FUSED_ROPE=0 (read at every call) does the same for RopeForward / RopeBackward alone.
//
// Example, a norm over the residual stream h [T, hidden] (float32) of a bfloat16 model:
//   RmsNormResult n = RmsNormForward(h, norm_weight, 1e-6, at::kBFloat16);   // n.y bf16
//   ...
//   at::Tensor dh = RmsNormBackward(dy, h, norm_weight, n.rstd, norm_weight_grad);  // float32
//
// Thread safety: stateless; CUDA calls run on the current stream of the inputs' device.
// Failure: TORCH_CHECK (c10::Error) naming the tensor whose shape, dtype or device is wrong.
#ifndef DTA_KERNELS_FUSED_LAYERS_H_
#define DTA_KERNELS_FUSED_LAYERS_H_

#include <ATen/ATen.h>

#include <utility>

namespace dta::kernels {

struct RmsNormResult {
  at::Tensor y;     // x's shape, in the requested output type
  at::Tensor rstd;  // x's shape with a last dimension of 1, compute type: 1 / rms of each row
  at::Tensor sum;   // with an addend: x + addend, in x's dtype (undefined without one)
};

// y = (weight * (x * rstd)).to(out_type), rstd = 1 / sqrt(mean(x^2) + eps) over x's last
// dimension. x [..., n] floating; weight [n] floating, on x's device. With `addend` (x's shape,
// floating, whose promotion with x is x's dtype: the float32 residual stream plus a bfloat16
// block output) the norm is of x + addend, returned as `sum`: a residual connection's add folded
// into the norm after it, in the same pass over the row (bitwise ATen's add followed by the norm).
RmsNormResult RmsNormForward(const at::Tensor& x, const at::Tensor& weight, double eps,
                             at::ScalarType out_type, const at::Tensor& addend = at::Tensor());

// RmsNormForward's y from its rstd, bitwise the same: what backward recomputes instead of keeping.
at::Tensor RmsNormApply(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rstd,
                        at::ScalarType out_type);

// The gradient of x (compute type, x's shape) given dy (x's shape, any floating dtype: taken in the
// compute type) and RmsNormForward's rstd. Adds the weight's gradient, the sum over rows of
// dy * x * rstd, into weight_grad ([n], floating: a .grad accumulator or a view of one). With
// residual_grad (x's shape, compute type) the result is the norm's gradient plus residual_grad,
// one rounded add per element: the gradient of x when x also feeds a residual connection,
// summed in the same kernel instead of by autograd afterwards (bitwise the same).
at::Tensor RmsNormBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& rstd, at::Tensor& weight_grad,
                           const at::Tensor& residual_grad = at::Tensor());

// Qwen3's per-head q/k norm and rotary embedding: n = RmsNormForward(x, weight, eps, x's dtype).y
// over head_dim, y = (n cos + rotate_half(n) sin).to(x's dtype), rotate_half(n) = [-n2, n1].
// x [T, H, D]; weight [D]; cos, sin [T, 1, D] in the compute type. rstd is [T, H, 1].
RmsNormResult RmsNormRopeForward(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const at::Tensor& cos, const at::Tensor& sin);

// The gradient of x (x's dtype) given dy [T, H, D]: RoPE's backward (g cos + [g2 sin2, -g1 sin1]
// in the compute type, rounded to dy's dtype), then RmsNormBackward, whose weight gradient is
// added into weight_grad.
at::Tensor RmsNormRopeBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& rstd, const at::Tensor& cos, const at::Tensor& sin,
                               at::Tensor& weight_grad);

// RoPE alone (the families without a q/k norm: Qwen2, Llama): y = (x cos + rotate_half(x) sin)
// computed in cos's dtype and rounded once to x's dtype; RmsNormRopeForward's RoPE without the
// norm. x [T, H, D]; cos, sin [T, 1, D].
at::Tensor RopeForward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// RopeForward's input gradient given dy [T, H, D]: dy cos + [(dy sin)2, -(dy sin)1] in cos's
// dtype, rounded to dy's dtype.
at::Tensor RopeBackward(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin);

// silu(gate) * up in the compute type, rounded to gate's dtype. gate and up of one shape; on CUDA
// the two halves of one stacked [rows, 2 n] projection output are read in place.
at::Tensor SwiGluForward(const at::Tensor& gate, const at::Tensor& up);

struct SwiGluGrads {
  at::Tensor dgate;    // gate's dtype
  at::Tensor dup;      // up's dtype
  at::Tensor product;  // SwiGluForward(gate, up), bitwise, when asked for; else undefined
  at::Tensor stacked;  // with `stacked`: [rows, 2 n], dgate and dup its two halves (views)
};

// The gradients of gate and up given d, the product's gradient (gate's shape, any floating dtype).
// with_product also recomputes the forward's product in the same pass over gate and up (what
// backward needs for the next projection's weight gradient). stacked (2-D gate and up) writes
// dgate and dup side by side into one [rows, 2 n] tensor, the gradient of a stacked gate/up
// projection's output, which then needs no concatenation.
SwiGluGrads SwiGluBackward(const at::Tensor& d, const at::Tensor& gate, const at::Tensor& up,
                           bool with_product = false, bool stacked = false);

// Gated attention's output gate (Qwen3-Next): attention * sigmoid(gate) in the compute type,
// rounded once to attention's dtype. gate has attention's shape; on CUDA its rows may be strided
// (the gate half of each head's [query, gate] projection is read in place). The CUDA kernels give
// the ATen expressions' bits; DTA_FUSED_OUTPUT_GATE=0 (read at every call) runs the expressions
// instead, for before/after measurements.
at::Tensor SigmoidGateForward(const at::Tensor& attention, const at::Tensor& gate);

struct SigmoidGateGrads {
  at::Tensor dattention;  // attention's dtype, contiguous
  at::Tensor dgate;       // gate's dtype, contiguous
};

// The gradients given dy, the gated output's gradient (attention's shape, any floating dtype):
// dy s and dy attention (1 - s) s with s = sigmoid(gate), in the compute type.
SigmoidGateGrads SigmoidGateBackward(const at::Tensor& dy, const at::Tensor& attention,
                                     const at::Tensor& gate);

// The log-probability head's elementwise work on one slice of logits z [rows, vocab] (float32 or
// float64, from the lm_head GEMM; the model keeps no [tokens x vocab] tensor beyond a slice).
// The CUDA kernels take float32 logits: statistics in one pass over each row (an online softmax),
// the gradient in one pass writing out_type, where ATen makes 4 to 8 passes and keeps a second
// float32 slice.
struct LogitRowStats {
  at::Tensor lse;     // [rows] log sum_v exp(z_v)
  at::Tensor target;  // [rows] z at the row's target
  at::Tensor mean;    // [rows] E_p[z] = sum_v p_v z_v (with_mean), else undefined
};
// targets [rows] int64, each in [0, vocab).
LogitRowStats LogitRowStatsForward(const at::Tensor& logits, const at::Tensor& targets,
                                   bool with_mean);

// d/dz of sum over rows of g_logprob log p(target) + g_entropy H(p), p = softmax(z), times scale,
// in out_type: scale (-p (g_logprob + (z - mean) g_entropy) + onehot(target) g_logprob w) with
// w = target_weight (the rows whose target this slice holds: 1 or 0; undefined = 1).
// grad_logprob, lse [rows]; mean and grad_entropy both undefined (no entropy term) or [rows].
// out: where to write it ([rows, vocab] of out_type, contiguous; the CUDA kernel writes it in
// place, the CPU path copies into it), or undefined for a new tensor; returns it.
at::Tensor LogitGradient(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& targets,
                         const at::Tensor& target_weight, const at::Tensor& grad_logprob,
                         const at::Tensor& mean, const at::Tensor& grad_entropy, double scale,
                         at::ScalarType out_type, at::Tensor out = {});

}  // namespace dta::kernels

#endif  // DTA_KERNELS_FUSED_LAYERS_H_

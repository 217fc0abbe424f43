// The Gated DeltaNet's per-head norms over rows of [T, H, D]: the L2 norm of q and k before the
// delta rule, and the gated RMSNorm of the rule's output, y = norm(o) * weight * silu(z). Each
// direction is one CUDA kernel (a warp per row, several rows in flight) instead of the 5 to 9
// ATen kernels of their composition forward and 10 to 16 backward, each of which read and wrote a
// float32 [T, H, D] tensor: on Qwen3-Next's shapes those passes were ~60 ms of a step.
//
// Numerics are the model's (executor/model/ops/numerics.h): computed in the compute type (float64
// for float64 inputs, float32 otherwise), rounded once to each output's type. The ATen path (the
// CPU, float64, and whatever the kernels do not take) computes the expressions the model used
// before the kernels; the CUDA kernels differ from it only in the order of a row's float32 sums
// and of the norm weight's gradient over rows (per-block partial sums in a fixed order:
// deterministic). Kernels run on a CUDA device when the compute type is float32 and D is 64, 128
// or 256; DTA_FUSED_LAYERS=0 (read once, kernels/fused_layers.h) takes the ATen path, and
// DTA_FUSED_HEAD_NORMS=0 (read at every call) does for these norms alone.
//
// Rows are read where they lie: x and z may be views with any stride between tokens as long as a
// token's H heads of D elements are contiguous (the q and k columns of the convolution's output).
//
// Example (the mixer's tail, o [T, H, D] float32, z [T, H, D] bfloat16):
//   HeadNormResult n = GatedRmsNormForward(o, norm_weight, z, 1e-6, at::kBFloat16);
//   ...
//   GatedRmsNormGrads g = GatedRmsNormBackward(dy, o, norm_weight, z, n.rstd, norm_weight_grad);
//
// Thread safety: stateless; CUDA calls run on the current stream of the inputs' device.
// Failure: TORCH_CHECK (c10::Error) naming the tensor whose shape, dtype or device is wrong.
#ifndef DTA_KERNELS_HEAD_NORMS_H_
#define DTA_KERNELS_HEAD_NORMS_H_

#include <ATen/ATen.h>

namespace dta::kernels {

struct HeadNormResult {
  at::Tensor y;     // [T, H, D]
  at::Tensor rstd;  // [T, H, 1], compute type
};

// y = xc * rstd with xc = x in the compute type and rstd = rsqrt(sum(xc^2) + eps) over D; y in
// the compute type. x [T, H, D] floating.
HeadNormResult L2NormForward(const at::Tensor& x, double eps);
// The gradient of x, in x's dtype, given dy (x's shape, any floating dtype):
// rstd (dy - y sum(dy y)) with y = xc rstd.
at::Tensor L2NormBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& rstd);

// y = ((xc * rstd) * weight * silu(zc)).to(out_type), rstd = rsqrt(mean(xc^2) + eps) over D, xc
// and zc x and z in the compute type. x, z [T, H, D] floating; weight [D].
HeadNormResult GatedRmsNormForward(const at::Tensor& x, const at::Tensor& weight,
                                   const at::Tensor& z, double eps, at::ScalarType out_type);
struct GatedRmsNormGrads {
  at::Tensor dx;  // compute type
  at::Tensor dz;  // z's dtype
};
// The gradients of x and z given dy ([T, H, D], any floating dtype); adds the weight's gradient,
// the sum over rows of dy silu(z) normed, into weight_grad ([D], floating).
GatedRmsNormGrads GatedRmsNormBackward(const at::Tensor& dy, const at::Tensor& x,
                                       const at::Tensor& weight, const at::Tensor& z,
                                       const at::Tensor& rstd, at::Tensor& weight_grad);

}  // namespace dta::kernels

#endif  // DTA_KERNELS_HEAD_NORMS_H_

#include "kernels/head_norms.h"

#include <c10/util/Exception.h>

#include <vector>

#include "core/base/env_switch.h"
#include "kernels/fused_layers_internal.h"
#include "kernels/head_norms_internal.h"

namespace dta::kernels {
namespace {

at::ScalarType ComputeType(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void CheckHeads(const char* what, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined() && t.dim() == 3 && at::isFloatingType(t.scalar_type()), what, ": ", name,
              " must be a floating [T, H, D] tensor, got ",
              t.defined() ? t.sizes() : at::IntArrayRef{});
}

void CheckLike(const char* what, const char* name, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK(t.defined() && t.sizes() == x.sizes(), what, ": ", name, " ",
              t.defined() ? t.sizes() : at::IntArrayRef{}, " must have x's shape ", x.sizes());
  TORCH_CHECK(t.device() == x.device(), what, ": ", name, " is on ", t.device(), ", x on ",
              x.device());
}

void CheckRstd(const char* what, const at::Tensor& rstd, const at::Tensor& x) {
  TORCH_CHECK(rstd.defined() && rstd.sizes() == at::IntArrayRef({x.size(0), x.size(1), 1}), what,
              ": rstd ", rstd.defined() ? rstd.sizes() : at::IntArrayRef{}, " must be [", x.size(0),
              ", ", x.size(1), ", 1]");
}

void CheckWeight(const char* what, const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK(weight.defined() && weight.dim() == 1 && weight.size(0) == x.size(2), what,
              ": weight ", weight.defined() ? weight.sizes() : at::IntArrayRef{},
              " must be [D] for x ", x.sizes());
  TORCH_CHECK(weight.device() == x.device(), what, ": weight is on ", weight.device(), ", x on ",
              x.device());
}

// A [T, H, D] tensor the kernels read in place (heads contiguous, any token stride), else a
// contiguous copy.
at::Tensor Readable(const at::Tensor& t) {
  if (t.stride(2) == 1 && t.stride(1) == t.size(2) && t.stride(0) >= t.size(1) * t.size(2))
    return t;
  return t.contiguous();
}

// Whether the kernels take these tensors: float32 compute on a CUDA device, a head dim they have.
// DTA_FUSED_HEAD_NORMS=0 (read at every call: before/after measurements in one process) takes
// the ATen path for these norms alone.
bool UseKernels(const at::Tensor& x, std::initializer_list<const at::Tensor*> tensors,
                std::initializer_list<at::ScalarType> out_types = {}) {
  return internal::FusedKernelsTake(tensors, out_types) && ComputeType(x) == at::kFloat &&
         internal::HeadNormKernelDim(x.size(2)) && EnvSwitchOn("DTA_FUSED_HEAD_NORMS");
}

}  // namespace

HeadNormResult L2NormForward(const at::Tensor& x, double eps) {
  CheckHeads("L2NormForward", "x", x);
  if (UseKernels(x, {&x})) {
    at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::kFloat));
    at::Tensor rstd = at::empty({x.size(0), x.size(1), 1}, y.options());
    internal::HeadNormForwardCuda(Readable(x), at::Tensor(), at::Tensor(), eps, y, rstd);
    return {y, rstd};
  }
  const at::Tensor xc = x.to(ComputeType(x));
  const at::Tensor rstd = at::rsqrt((xc * xc).sum(-1, /*keepdim=*/true) + eps);
  return {xc * rstd, rstd};
}

at::Tensor L2NormBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& rstd) {
  CheckHeads("L2NormBackward", "x", x);
  CheckLike("L2NormBackward", "dy", dy, x);
  CheckRstd("L2NormBackward", rstd, x);
  if (UseKernels(x, {&x, &dy, &rstd}) && rstd.scalar_type() == at::kFloat) {
    at::Tensor dx = at::empty(x.sizes(), x.options());
    at::Tensor none;
    internal::HeadNormBackwardCuda(dy.contiguous(), Readable(x), at::Tensor(), at::Tensor(),
                                   rstd.contiguous(), dx, none, none);
    return dx;
  }
  const at::Tensor y = x.to(rstd.scalar_type()) * rstd;
  const at::Tensor dyc = dy.to(rstd.scalar_type());
  return (rstd * (dyc - y * (dyc * y).sum(-1, /*keepdim=*/true))).to(x.scalar_type());
}

HeadNormResult GatedRmsNormForward(const at::Tensor& x, const at::Tensor& weight,
                                   const at::Tensor& z, double eps, at::ScalarType out_type) {
  CheckHeads("GatedRmsNormForward", "x", x);
  CheckWeight("GatedRmsNormForward", weight, x);
  CheckLike("GatedRmsNormForward", "z", z, x);
  if (UseKernels(x, {&x, &weight, &z}, {out_type})) {
    at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_type));
    at::Tensor rstd = at::empty({x.size(0), x.size(1), 1}, x.options().dtype(at::kFloat));
    internal::HeadNormForwardCuda(Readable(x), weight.contiguous(), Readable(z), eps, y, rstd);
    return {y, rstd};
  }
  const at::ScalarType type = ComputeType(x);
  const at::Tensor xc = x.to(type);
  const at::Tensor rstd = at::rsqrt(xc.pow(2).mean(-1, /*keepdim=*/true) + eps);
  const at::Tensor y = (xc * rstd * weight.to(type) * at::silu(z.to(type))).to(out_type);
  return {y, rstd};
}

GatedRmsNormGrads GatedRmsNormBackward(const at::Tensor& dy, const at::Tensor& x,
                                       const at::Tensor& weight, const at::Tensor& z,
                                       const at::Tensor& rstd, at::Tensor& weight_grad) {
  CheckHeads("GatedRmsNormBackward", "x", x);
  CheckWeight("GatedRmsNormBackward", weight, x);
  CheckLike("GatedRmsNormBackward", "z", z, x);
  CheckLike("GatedRmsNormBackward", "dy", dy, x);
  CheckRstd("GatedRmsNormBackward", rstd, x);
  TORCH_CHECK(weight_grad.defined() && weight_grad.sizes() == weight.sizes(),
              "GatedRmsNormBackward: weight_grad must have weight's shape ", weight.sizes());
  if (UseKernels(x, {&x, &weight, &z, &dy, &rstd}) && rstd.scalar_type() == at::kFloat) {
    at::Tensor dx = at::empty(x.sizes(), x.options().dtype(at::kFloat));
    at::Tensor dz = at::empty(z.sizes(), z.options());
    at::Tensor partials = at::empty(
        {internal::HeadNormBackwardBlocks(x.size(0) * x.size(1)), x.size(2)}, dx.options());
    internal::HeadNormBackwardCuda(dy.contiguous(), Readable(x), weight.contiguous(), Readable(z),
                                   rstd.contiguous(), dx, dz, partials);
    internal::AddPartialSums(partials, weight_grad);
    return {dx, dz};
  }
  // y = a silu(z) with a = normed w, normed = x rstd: ATen's silu backward for z; for x the
  // RMSNorm backward of dn = dy silu(z) w.
  const at::ScalarType type = rstd.scalar_type();
  const at::Tensor normed = x.to(type) * rstd;
  const at::Tensor dyc = dy.to(type), zc = z.to(type), w = weight.to(type);
  const at::Tensor dz = at::silu_backward(dyc * (normed * w), zc).to(z.scalar_type());
  const at::Tensor g = dyc * at::silu(zc);
  weight_grad.add_((g * normed).reshape({-1, x.size(2)}).sum(0).to(weight_grad.scalar_type()));
  const at::Tensor dn = g * w;
  return {rstd * (dn - normed * (dn * normed).mean(-1, /*keepdim=*/true)), dz};
}

}  // namespace dta::kernels

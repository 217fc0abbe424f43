#include "kernels/fused_layers.h"

#include <c10/util/Exception.h>

#include "core/base/env_switch.h"
#include "kernels/fused_layers_internal.h"

namespace dta::kernels::internal {
namespace {

bool FusedLayersEnabled() {
  static const bool enabled = EnvSwitchOn("DTA_FUSED_LAYERS");
  return enabled;
}

bool IsKernelDtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

}  // namespace

bool FusedKernelsTake(std::initializer_list<const at::Tensor*> tensors,
                      std::initializer_list<at::ScalarType> out_types) {
#ifdef DTA_KERNELS_HAVE_CUDA
  if (!FusedLayersEnabled()) return false;
  const at::Device device = (*tensors.begin())->device();
  if (!device.is_cuda()) return false;
  for (const at::Tensor* t : tensors) {
    if (t->device() != device || !IsKernelDtype(t->scalar_type())) return false;
  }
  for (at::ScalarType t : out_types) {
    if (!IsKernelDtype(t)) return false;
  }
  return true;
#else
  (void)tensors;
  (void)out_types;
  return false;
#endif
}

void AddPartialSums(const at::Tensor& partials, at::Tensor& weight_grad) {
#ifdef DTA_KERNELS_HAVE_CUDA
  if (weight_grad.is_cuda() && weight_grad.scalar_type() == at::kFloat &&
      weight_grad.is_contiguous()) {
    AddColumnSumsCuda(partials, weight_grad);
    return;
  }
#endif
  weight_grad.add_(partials.sum(0).to(weight_grad.scalar_type()));
}

}  // namespace dta::kernels::internal

namespace dta::kernels {
namespace {

at::ScalarType ComputeType(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// DTA_FUSED_ROPE=0: RoPE alone takes the ATen path (read at every call: before/after measurements
// of its kernel in one process).
bool FusedRopeEnabled() { return EnvSwitchOn("DTA_FUSED_ROPE"); }

bool UseCuda(std::initializer_list<const at::Tensor*> tensors,
             std::initializer_list<at::ScalarType> out_types = {}) {
  return internal::FusedKernelsTake(tensors, out_types);
}

void AddPartials(const at::Tensor& partials, at::Tensor& weight_grad) {
  internal::AddPartialSums(partials, weight_grad);
}

void CheckNormInputs(const char* what, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.defined() && weight.defined(), what, ": x and weight must be defined");
  TORCH_CHECK(x.dim() >= 1 && at::isFloatingType(x.scalar_type()), what,
              ": x must be a floating tensor with a dimension, got ", x.scalar_type(), " ",
              x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), what, ": weight ", weight.sizes(),
              " must be [n] for x ", x.sizes());
  TORCH_CHECK(weight.device() == x.device(), what, ": weight is on ", weight.device(), ", x on ",
              x.device());
}

void CheckSameShape(const char* what, const char* name, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK(t.defined() && t.sizes() == x.sizes(), what, ": ", name, " ",
              t.defined() ? t.sizes() : at::IntArrayRef{}, " must have x's shape ", x.sizes());
  TORCH_CHECK(t.device() == x.device(), what, ": ", name, " is on ", t.device(), ", x on ",
              x.device());
}

void CheckRstd(const char* what, const at::Tensor& rstd, const at::Tensor& x) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = 1;
  TORCH_CHECK(rstd.defined() && rstd.sizes() == at::IntArrayRef(shape), what, ": rstd ",
              rstd.defined() ? rstd.sizes() : at::IntArrayRef{}, " must be ",
              at::IntArrayRef(shape));
}

void CheckRopeTables(const char* what, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, what, ": x must be [T, H, D] with D even, got ",
              x.sizes());
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->defined() && t->dim() == 3 && t->size(0) == x.size(0) && t->size(1) == 1 &&
                    t->size(2) == x.size(2),
                what, ": cos and sin must be [T, 1, D] for x ", x.sizes());
    TORCH_CHECK(t->device() == x.device(), what, ": cos and sin must be on x's device");
  }
}

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

// The ATen paths: the model's expressions as they were before the kernels, kept exact.
at::Tensor RopeReference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor xc = x.to(cos.scalar_type());
  return (xc * cos + RotateHalf(xc) * sin).to(x.scalar_type());
}

at::Tensor RopeBackwardReference(const at::Tensor& dy, const at::Tensor& cos,
                                 const at::Tensor& sin) {
  const at::Tensor g = dy.to(cos.scalar_type());
  // rotate_half is x -> [-x2, x1]; its transpose is z -> [z2, -z1].
  const at::Tensor gs = g * sin;
  const int64_t half = gs.size(-1) / 2;
  return (g * cos + at::cat({gs.slice(-1, half), -gs.slice(-1, 0, half)}, -1)).to(dy.scalar_type());
}

at::Tensor RmsNormBackwardReference(const at::Tensor& dy, const at::Tensor& x,
                                    const at::Tensor& weight, const at::Tensor& rstd,
                                    at::Tensor& weight_grad) {
  const at::Tensor normed = x.to(rstd.scalar_type()) * rstd;
  const at::Tensor dyc = dy.to(rstd.scalar_type());
  weight_grad.add_(
      (dyc * normed).reshape({-1, weight.size(0)}).sum(0).to(weight_grad.scalar_type()));
  // d normed = dy * w;  dx = rstd * (d normed - normed * mean(d normed * normed)).
  const at::Tensor dnormed = dyc * weight.to(dyc.scalar_type());
  return rstd * (dnormed - normed * (dnormed * normed).mean(-1, /*keepdim=*/true));
}

// Rows of x as the kernels see them: [rows, n], contiguous.
at::Tensor Rows(const at::Tensor& x) { return x.contiguous().view({-1, x.size(-1)}); }

// x's rows as a [rows, n] view the RMSNorm kernels read in place: unit column stride and one
// stride between consecutive rows (a head's slice of wider rows, as gated attention's queries);
// else a contiguous copy.
at::Tensor StridedRows(const at::Tensor& x) {
  const int64_t n = x.size(-1);
  if (x.dim() < 2 || x.stride(-1) != 1 || x.stride(-2) < n) return Rows(x);
  const int64_t ld = x.stride(-2);
  int64_t expected = ld * x.size(-2);
  for (int64_t d = x.dim() - 3; d >= 0; --d) {
    if (x.size(d) != 1 && x.stride(d) != expected) return Rows(x);
    expected *= x.size(d);
  }
  return x.as_strided({x.numel() / n, n}, {ld, 1});
}

}  // namespace

RmsNormResult RmsNormForward(const at::Tensor& x, const at::Tensor& weight, double eps,
                             at::ScalarType out_type, const at::Tensor& addend) {
  CheckNormInputs("RmsNormForward", x, weight);
  if (addend.defined()) {
    CheckSameShape("RmsNormForward", "addend", addend, x);
    TORCH_CHECK(addend.device() == x.device() && at::isFloatingType(addend.scalar_type()) &&
                    at::result_type(x, addend) == x.scalar_type(),
                "RmsNormForward: addend must be a floating tensor on x's device whose sum with x "
                "stays x's dtype (",
                x.scalar_type(), "), got ", addend.scalar_type(), " on ", addend.device());
  }
  if (UseCuda({&x, &weight}, {out_type}) && x.size(-1) <= internal::kFusedNormMaxRow &&
      (!addend.defined() || UseCuda({&addend}))) {
    const at::Tensor rows = StridedRows(x);
    at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_type));
    std::vector<int64_t> rstd_shape = x.sizes().vec();
    rstd_shape.back() = 1;
    at::Tensor rstd = at::empty(rstd_shape, x.options().dtype(at::kFloat));
    at::Tensor sum = addend.defined() ? at::empty(x.sizes(), x.options()) : at::Tensor();
    internal::RmsNormForwardCuda(rows, addend.defined() ? Rows(addend) : at::Tensor(),
                                 weight.contiguous(), eps, sum, y, rstd);
    return {y, rstd, sum};
  }
  const at::Tensor sum = addend.defined() ? x + addend : at::Tensor();
  const at::Tensor xc = (addend.defined() ? sum : x).to(ComputeType(weight.scalar_type()));
  const at::Tensor rstd = at::rsqrt(xc.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return {(weight.to(xc.scalar_type()) * (xc * rstd)).to(out_type), rstd, sum};
}

at::Tensor RmsNormApply(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rstd,
                        at::ScalarType out_type) {
  CheckNormInputs("RmsNormApply", x, weight);
  CheckRstd("RmsNormApply", rstd, x);
  if (UseCuda({&x, &weight, &rstd}, {out_type}) && rstd.scalar_type() == at::kFloat &&
      x.size(-1) <= internal::kFusedNormMaxRow) {
    at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_type));
    internal::RmsNormApplyCuda(StridedRows(x), weight.contiguous(), rstd.contiguous(), y);
    return y;
  }
  const at::Tensor normed = x.to(rstd.scalar_type()) * rstd;
  return (weight.to(normed.scalar_type()) * normed).to(out_type);
}

at::Tensor RmsNormBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& rstd, at::Tensor& weight_grad,
                           const at::Tensor& residual_grad) {
  CheckNormInputs("RmsNormBackward", x, weight);
  CheckSameShape("RmsNormBackward", "dy", dy, x);
  CheckRstd("RmsNormBackward", rstd, x);
  TORCH_CHECK(weight_grad.defined() && weight_grad.sizes() == weight.sizes(),
              "RmsNormBackward: weight_grad must have weight's shape ", weight.sizes());
  const bool residual = residual_grad.defined();
  if (residual) {
    CheckSameShape("RmsNormBackward", "residual_grad", residual_grad, x);
    TORCH_CHECK(residual_grad.scalar_type() == rstd.scalar_type(),
                "RmsNormBackward: residual_grad must be in the compute type ", rstd.scalar_type(),
                ", got ", residual_grad.scalar_type());
  }
  if (UseCuda({&dy, &x, &weight, &rstd}) && rstd.scalar_type() == at::kFloat &&
      x.size(-1) <= internal::kFusedNormMaxRow) {
    const at::Tensor rows = StridedRows(x);
    at::Tensor dx = at::empty(x.sizes(), x.options().dtype(at::kFloat));
    at::Tensor partials = at::empty({internal::RmsNormBackwardBlocks(rows.size(0)), x.size(-1)},
                                    x.options().dtype(at::kFloat));
    internal::RmsNormBackwardCuda(Rows(dy), rows, weight.contiguous(), rstd.contiguous(),
                                  residual ? Rows(residual_grad) : at::Tensor(), dx, partials);
    AddPartials(partials, weight_grad);
    return dx;
  }
  at::Tensor dx = RmsNormBackwardReference(dy, x, weight, rstd, weight_grad);
  if (residual) dx.add_(residual_grad);
  return dx;
}

namespace {

// True when the RoPE kernels' shape and table rules admit x [T, H, D] (UseCuda decides the rest).
bool RopeKernelShape(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
         internal::FusedRopeHeadDim(x.size(2));
}

// A [T, 1, D] rotary table as the kernels read it: [T, D], contiguous (D named, not inferred:
// a chunk of no tokens has a [0, 1, D] table).
at::Tensor KernelTable(const at::Tensor& table) {
  return table.reshape({table.size(0), table.size(-1)}).contiguous();
}

}  // namespace

RmsNormResult RmsNormRopeForward(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const at::Tensor& cos, const at::Tensor& sin) {
  CheckNormInputs("RmsNormRopeForward", x, weight);
  CheckRopeTables("RmsNormRopeForward", cos, sin, x);
  if (UseCuda({&x, &weight, &cos, &sin}) && RopeKernelShape(x, cos, sin)) {
    at::Tensor y = at::empty(x.sizes(), x.options());
    at::Tensor rstd = at::empty({x.size(0), x.size(1), 1}, x.options().dtype(at::kFloat));
    internal::RmsNormRopeForwardCuda(x.contiguous(), weight.contiguous(), eps, KernelTable(cos),
                                     KernelTable(sin), y, rstd);
    return {y, rstd};
  }
  RmsNormResult normed = RmsNormForward(x, weight, eps, x.scalar_type());
  return {RopeReference(normed.y, cos, sin), normed.rstd};
}

at::Tensor RopeForward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  CheckRopeTables("RopeForward", cos, sin, x);
  if (FusedRopeEnabled() && UseCuda({&x, &cos, &sin}) && RopeKernelShape(x, cos, sin)) {
    at::Tensor y = at::empty(x.sizes(), x.options());
    at::Tensor no_rstd;
    internal::RmsNormRopeForwardCuda(x.contiguous(), at::Tensor(), 0.0, KernelTable(cos),
                                     KernelTable(sin), y, no_rstd);
    return y;
  }
  return RopeReference(x, cos, sin);
}

at::Tensor RopeBackward(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin) {
  CheckRopeTables("RopeBackward", cos, sin, dy);
  if (FusedRopeEnabled() && UseCuda({&dy, &cos, &sin}) && RopeKernelShape(dy, cos, sin)) {
    at::Tensor dx = at::empty(dy.sizes(), dy.options());
    at::Tensor no_partials;
    internal::RmsNormRopeBackwardCuda(dy.contiguous(), at::Tensor(), at::Tensor(), at::Tensor(),
                                      KernelTable(cos), KernelTable(sin), dx, no_partials);
    return dx;
  }
  return RopeBackwardReference(dy, cos, sin);
}

at::Tensor RmsNormRopeBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& rstd, const at::Tensor& cos, const at::Tensor& sin,
                               at::Tensor& weight_grad) {
  CheckNormInputs("RmsNormRopeBackward", x, weight);
  CheckSameShape("RmsNormRopeBackward", "dy", dy, x);
  CheckRopeTables("RmsNormRopeBackward", cos, sin, x);
  CheckRstd("RmsNormRopeBackward", rstd, x);
  TORCH_CHECK(weight_grad.defined() && weight_grad.sizes() == weight.sizes(),
              "RmsNormRopeBackward: weight_grad must have weight's shape ", weight.sizes());
  if (UseCuda({&dy, &x, &weight, &rstd, &cos, &sin}) && rstd.scalar_type() == at::kFloat &&
      dy.scalar_type() == x.scalar_type() && RopeKernelShape(x, cos, sin)) {
    at::Tensor dx = at::empty(x.sizes(), x.options());
    at::Tensor partials = at::empty(
        {internal::RmsNormRopeBackwardBlocks(x.size(0) * x.size(1), x.size(2), x.device().index()),
         x.size(2)},
        x.options().dtype(at::kFloat));
    internal::RmsNormRopeBackwardCuda(dy.contiguous(), x.contiguous(), weight.contiguous(),
                                      rstd.contiguous(), KernelTable(cos), KernelTable(sin), dx,
                                      partials);
    AddPartials(partials, weight_grad);
    return dx;
  }
  const at::Tensor g = RopeBackwardReference(dy, cos, sin);
  return RmsNormBackwardReference(g, x, weight, rstd, weight_grad).to(x.scalar_type());
}

namespace {

// The distance between rows of a [..., cols] tensor that the kernels can read in place: cols when
// it is contiguous, the row stride of a 2-D view with unit column stride (one half of a stacked
// projection's output), -1 otherwise.
int64_t RowStride(const at::Tensor& t) {
  if (t.is_contiguous()) return t.size(-1);
  if (t.dim() == 2 && t.stride(1) == 1 && t.stride(0) >= t.size(1)) return t.stride(0);
  return -1;
}

// gate and up with one row stride the kernels can read, copied to contiguous if need be.
struct GateUp {
  at::Tensor gate, up;
  int64_t ld;
};
GateUp ReadableGateUp(const at::Tensor& gate, const at::Tensor& up) {
  const int64_t ld = RowStride(gate);
  if (ld >= 0 && ld == RowStride(up)) return {gate, up, ld};
  return {gate.contiguous(), up.contiguous(), gate.size(-1)};
}

}  // namespace

at::Tensor SwiGluForward(const at::Tensor& gate, const at::Tensor& up) {
  CheckSameShape("SwiGluForward", "up", up, gate);
  if (UseCuda({&gate, &up})) {
    at::Tensor out = at::empty(gate.sizes(), gate.options());
    const GateUp in = ReadableGateUp(gate, up);
    internal::SwiGluForwardCuda(in.gate, in.up, in.ld, out);
    return out;
  }
  const at::ScalarType ct = ComputeType(gate.scalar_type());
  return (at::silu(gate.to(ct)) * up.to(ct)).to(gate.scalar_type());
}

SwiGluGrads SwiGluBackward(const at::Tensor& d, const at::Tensor& gate, const at::Tensor& up,
                           bool with_product, bool stacked) {
  CheckSameShape("SwiGluBackward", "up", up, gate);
  CheckSameShape("SwiGluBackward", "d", d, gate);
  TORCH_CHECK(!stacked || (gate.dim() == 2 && gate.scalar_type() == up.scalar_type()),
              "SwiGluBackward: stacked gradients need 2-D gate and up of one dtype, got ",
              gate.sizes(), " ", gate.scalar_type(), " and ", up.scalar_type());
  if (UseCuda({&d, &gate, &up})) {
    SwiGluGrads grads;
    if (with_product) grads.product = at::empty(gate.sizes(), gate.options());
    int64_t out_ld = gate.size(-1);
    if (stacked) {
      grads.stacked = at::empty({gate.size(0), 2 * gate.size(1)}, gate.options());
      grads.dgate = grads.stacked.narrow(1, 0, gate.size(1));
      grads.dup = grads.stacked.narrow(1, gate.size(1), gate.size(1));
      out_ld = 2 * gate.size(1);
    } else {
      grads.dgate = at::empty(gate.sizes(), gate.options());
      grads.dup = at::empty(up.sizes(), up.options());
    }
    const GateUp in = ReadableGateUp(gate, up);
    internal::SwiGluBackwardCuda(d.contiguous(), in.gate, in.up, in.ld, grads.dgate, grads.dup,
                                 out_ld, grads.product);
    return grads;
  }
  const at::ScalarType ct = ComputeType(gate.scalar_type());
  const at::Tensor g = d.to(ct);
  const at::Tensor gc = gate.to(ct);
  const at::Tensor uc = up.to(ct);
  const at::Tensor sigmoid = at::sigmoid(gc);
  // d silu / d gate = sigmoid * (1 + gate * (1 - sigmoid)).
  const at::Tensor dgate = g * uc * sigmoid * (1 + gc * (1 - sigmoid));
  SwiGluGrads grads{.dgate = dgate.to(gate.scalar_type()),
                    .dup = (g * gc * sigmoid).to(up.scalar_type()),
                    .product = with_product ? SwiGluForward(gate, up) : at::Tensor(),
                    .stacked = at::Tensor()};
  if (stacked) {
    grads.stacked = at::cat({grads.dgate, grads.dup}, 1);
    grads.dgate = grads.stacked.narrow(1, 0, gate.size(1));
    grads.dup = grads.stacked.narrow(1, gate.size(1), gate.size(1));
  }
  return grads;
}

namespace {

// The row stride at which the kernels read a [..., cols] gate: its rows must be equally spaced
// (a [T, H, D] view of [T, H, 2 D] rows is: stride(0) = H stride(1)); -1 otherwise.
int64_t GateRowStride(const at::Tensor& gate) {
  if (gate.is_contiguous()) return gate.size(-1);
  if (gate.dim() < 2 || gate.stride(-1) != 1) return -1;
  const int64_t ld = gate.stride(-2);
  int64_t expected = ld * gate.size(-2);
  for (int64_t d = gate.dim() - 3; d >= 0; --d) {
    if (gate.size(d) != 1 && gate.stride(d) != expected) return -1;
    expected *= gate.size(d);
  }
  return ld >= gate.size(-1) ? ld : -1;
}

// The gate as the kernels read it: in place where its rows are equally spaced, else a contiguous
// copy.
struct ReadableRows {
  at::Tensor rows;
  int64_t ld;
};
ReadableRows ReadableGate(const at::Tensor& gate) {
  const int64_t ld = GateRowStride(gate);
  if (ld >= 0) return {gate, ld};
  return {gate.contiguous(), gate.size(-1)};
}

}  // namespace

at::Tensor SigmoidGateForward(const at::Tensor& attention, const at::Tensor& gate) {
  CheckSameShape("SigmoidGateForward", "gate", gate, attention);
  if (UseCuda({&attention, &gate}) && EnvSwitchOn("DTA_FUSED_OUTPUT_GATE")) {
    const at::Tensor a = attention.contiguous();
    const ReadableRows x = ReadableGate(gate);
    at::Tensor y = at::empty(a.sizes(), a.options());
    internal::SigmoidGateForwardCuda(a, x.rows, x.ld, y);
    return y;
  }
  const at::ScalarType ct = ComputeType(attention.scalar_type());
  return (attention.to(ct) * at::sigmoid(gate.to(ct))).to(attention.scalar_type());
}

SigmoidGateGrads SigmoidGateBackward(const at::Tensor& dy, const at::Tensor& attention,
                                     const at::Tensor& gate) {
  CheckSameShape("SigmoidGateBackward", "gate", gate, attention);
  CheckSameShape("SigmoidGateBackward", "dy", dy, attention);
  if (UseCuda({&dy, &attention, &gate}) && EnvSwitchOn("DTA_FUSED_OUTPUT_GATE")) {
    const at::Tensor a = attention.contiguous();
    const ReadableRows x = ReadableGate(gate);
    SigmoidGateGrads grads{.dattention = at::empty(a.sizes(), a.options()),
                           .dgate = at::empty(a.sizes(), gate.options())};
    internal::SigmoidGateBackwardCuda(dy.contiguous(), a, x.rows, x.ld, grads.dattention,
                                      grads.dgate);
    return grads;
  }
  const at::ScalarType ct = ComputeType(attention.scalar_type());
  const at::Tensor g = dy.to(ct);
  const at::Tensor s = at::sigmoid(gate.to(ct));
  return {.dattention = (g * s).to(attention.scalar_type()).contiguous(),
          .dgate = (g * attention.to(ct) * (1 - s) * s).to(gate.scalar_type()).contiguous()};
}

namespace {

// Whether the log-probability head's kernels take these float32 tensors on one CUDA device.
bool UseLogitKernels(const at::Tensor& logits, std::initializer_list<const at::Tensor*> rows,
                     at::ScalarType out_type = at::kFloat) {
  if (logits.scalar_type() != at::kFloat || !UseCuda({&logits}, {out_type})) return false;
  for (const at::Tensor* t : rows) {
    if (t->defined() && (t->scalar_type() != at::kFloat || t->device() != logits.device()))
      return false;
  }
  return true;
}

void CheckLogitInputs(const char* what, const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(logits.dim() == 2 && at::isFloatingType(logits.scalar_type()), what,
              ": logits must be a floating [rows, vocab] tensor, got ", logits.scalar_type(), " ",
              logits.sizes());
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0) &&
                  targets.scalar_type() == at::kLong && targets.device() == logits.device(),
              what, ": targets must be int64 [", logits.size(0), "] on ", logits.device(), ", got ",
              targets.scalar_type(), " ", targets.sizes(), " on ", targets.device());
}

}  // namespace

LogitRowStats LogitRowStatsForward(const at::Tensor& logits, const at::Tensor& targets,
                                   bool with_mean) {
  CheckLogitInputs("LogitRowStatsForward", logits, targets);
  LogitRowStats stats;
  if (UseLogitKernels(logits, {})) {
#ifdef DTA_KERNELS_HAVE_CUDA
    const at::Tensor z = logits.contiguous();
    stats.lse = at::empty({z.size(0)}, z.options());
    stats.target = at::empty({z.size(0)}, z.options());
    if (with_mean) stats.mean = at::empty({z.size(0)}, z.options());
    internal::LogitRowStatsCuda(z, targets.contiguous(), stats.lse, stats.target, stats.mean);
    return stats;
#endif
  }
  const at::Tensor max = logits.amax(-1);
  const at::Tensor exp = (logits - max.unsqueeze(1)).exp_();
  const at::Tensor sum = exp.sum(-1);
  stats.lse = max + sum.log();
  stats.target = logits.gather(1, targets.unsqueeze(1)).squeeze(1);
  if (with_mean) stats.mean = (exp * logits).sum(-1) / sum;
  return stats;
}

at::Tensor LogitGradient(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& targets,
                         const at::Tensor& target_weight, const at::Tensor& grad_logprob,
                         const at::Tensor& mean, const at::Tensor& grad_entropy, double scale,
                         at::ScalarType out_type, at::Tensor out) {
  CheckLogitInputs("LogitGradient", logits, targets);
  TORCH_CHECK(!out.defined() || (out.sizes() == logits.sizes() && out.scalar_type() == out_type &&
                                 out.is_contiguous() && out.device() == logits.device()),
              "LogitGradient: out must be a contiguous ", out_type, " ", logits.sizes(),
              " tensor on ", logits.device());
  TORCH_CHECK(mean.defined() == grad_entropy.defined(),
              "LogitGradient: mean and grad_entropy go together");
  for (const at::Tensor* t : {&lse, &grad_logprob, &target_weight, &mean, &grad_entropy}) {
    TORCH_CHECK(!t->defined() || (t->dim() == 1 && t->size(0) == logits.size(0)),
                "LogitGradient: per-row tensors must be [", logits.size(0), "], got ", t->sizes());
  }
  if (UseLogitKernels(logits, {&lse, &grad_logprob, &target_weight, &mean, &grad_entropy},
                      out_type)) {
#ifdef DTA_KERNELS_HAVE_CUDA
    if (!out.defined()) out = at::empty(logits.sizes(), logits.options().dtype(out_type));
    const auto contiguous = [](const at::Tensor& t) { return t.defined() ? t.contiguous() : t; };
    internal::LogitGradCuda(logits.contiguous(), contiguous(lse), targets.contiguous(),
                            contiguous(target_weight), contiguous(grad_logprob), contiguous(mean),
                            contiguous(grad_entropy), scale, out);
    return out;
#endif
  }
  // In place on two slices: the logits' copy, and the softmax that becomes the gradient.
  at::Tensor grad = (logits - lse.unsqueeze(1)).exp_();  // p
  const at::Tensor g = grad_logprob.to(logits.scalar_type()).unsqueeze(1);
  if (mean.defined()) {
    const at::Tensor t = logits - mean.unsqueeze(1);
    t.mul_(grad_entropy.to(logits.scalar_type()).unsqueeze(1)).add_(g);
    grad.mul_(t).neg_();
  } else {
    grad.mul_(g).neg_();
  }
  grad.scatter_add_(1, targets.unsqueeze(1),
                    target_weight.defined() ? g * target_weight.unsqueeze(1) : g);
  if (scale != 1.0) grad.mul_(scale);
  if (!out.defined()) return grad.to(out_type);
  return out.copy_(grad);
}

}  // namespace dta::kernels

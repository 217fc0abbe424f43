#include "executor/model/ops/rope.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "kernels/fused_layers.h"

namespace dta {
namespace {

// Each expression below follows transformers' in modeling_rope_utils.py, operation by operation
// (Python's `s / t` on a tensor is t.reciprocal() * s), so that a float32 model computes what
// transformers does and a float64 one its exact counterpart.

// 1 / theta^(2i / dim), i < dim / 2.
at::Tensor DefaultFrequencies(double theta, int64_t dim, at::TensorOptions options) {
  const at::Tensor exponents = at::arange(0, dim, 2, options) / static_cast<double>(dim);
  return 1.0 / at::pow(theta, exponents);
}

// _compute_llama3_parameters: wavelengths above original / low_freq_factor are divided by factor,
// those below original / high_freq_factor kept, and the band between interpolated smoothly.
at::Tensor Llama3Frequencies(const at::Tensor& inv_freq, const RopeScaling& rope) {
  const double context = static_cast<double>(rope.original_max_position_embeddings);
  const double low_freq_wavelen = context / rope.low_freq_factor;
  const double high_freq_wavelen = context / rope.high_freq_factor;
  const at::Tensor wavelen = inv_freq.reciprocal() * (2 * std::numbers::pi);
  const at::Tensor scaled = at::where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq);
  const at::Tensor smooth = (wavelen.reciprocal() * context - rope.low_freq_factor) /
                            (rope.high_freq_factor - rope.low_freq_factor);
  const at::Tensor smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled;
  const at::Tensor medium =
      (wavelen < high_freq_wavelen).logical_not() & (wavelen > low_freq_wavelen).logical_not();
  return at::where(medium, smoothed, scaled);
}

// _compute_yarn_parameters' find_correction_dim: the dimension that turns num_rotations times over
// the original context.
double CorrectionDim(double num_rotations, int64_t dim, double base, double context) {
  return (static_cast<double>(dim) * std::log(context / (num_rotations * 2 * std::numbers::pi))) /
         (2 * std::log(base));
}

// _compute_yarn_parameters: interpolated frequencies (/ factor) below the correction range,
// extrapolated (unchanged) ones above it, a linear ramp between.
at::Tensor YarnFrequencies(double base, int64_t dim, const RopeScaling& rope,
                           at::TensorOptions options) {
  const at::Tensor pos_freqs =
      at::pow(base, at::arange(0, dim, 2, options) / static_cast<double>(dim));
  const at::Tensor extrapolation = 1.0 / pos_freqs;
  const at::Tensor interpolation = 1.0 / (pos_freqs * rope.factor);
  const double context = static_cast<double>(rope.original_max_position_embeddings);
  double low = CorrectionDim(rope.beta_fast, dim, base, context);
  double high = CorrectionDim(rope.beta_slow, dim, base, context);
  if (rope.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // linear_ramp_factor's guard against a zero-width ramp
  const at::Tensor ramp = ((at::arange(dim / 2, options) - low) / (high - low)).clamp(0, 1);
  const at::Tensor extrapolation_factor = 1 - ramp;
  return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
}

void CheckTables(const char* what, const at::Tensor& x, const at::Tensor& cos,
                 const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3, what, ": x must be [T, H, D], got ", x.sizes());
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == x.size(0) && t->size(1) == 1 &&
                    t->size(2) % 2 == 0 && t->size(2) > 0 && t->size(2) <= x.size(2),
                what, ": cos and sin must be [T, 1, R] with R even and at most D for x ", x.sizes(),
                ", got ", t->sizes());
  }
  TORCH_CHECK(cos.sizes() == sin.sizes(), what, ": cos ", cos.sizes(), " and sin ", sin.sizes(),
              " differ");
}

// Partial rotary (tables narrower than the head): the rotated part y[..., :R] joined with the
// rest of the head, which passes unchanged (its gradient too).
at::Tensor JoinUnrotated(const at::Tensor& rotated, const at::Tensor& x) {
  if (rotated.size(-1) == x.size(-1)) return rotated;
  return at::cat({rotated, x.slice(-1, rotated.size(-1))}, -1);
}

}  // namespace

at::Tensor RopeInverseFrequencies(const ModelConfig& config, at::TensorOptions options) {
  const int64_t dim = RotaryDim(config);
  TORCH_CHECK(dim > 0 && dim % 2 == 0, "RoPE needs a positive, even rotary dimension, got ", dim,
              " (head_dim ", config.head_dim, ", partial_rotary_factor ",
              config.partial_rotary_factor, ")");
  const RopeScaling& rope = config.rope_scaling;
  switch (rope.type) {
    case RopeType::kDefault:
      return DefaultFrequencies(config.rope_theta, dim, options);
    case RopeType::kLinear:
      return DefaultFrequencies(config.rope_theta, dim, options) / rope.factor;
    case RopeType::kLlama3:
      return Llama3Frequencies(DefaultFrequencies(config.rope_theta, dim, options), rope);
    case RopeType::kYarn:
      return YarnFrequencies(config.rope_theta, dim, rope, options);
  }
  TORCH_CHECK(false, "RopeInverseFrequencies: unknown rope type ", static_cast<int>(rope.type));
}

std::pair<at::Tensor, at::Tensor> RopeTables(const at::Tensor& inv_freq,
                                             const at::Tensor& positions, double attention_factor) {
  const at::Tensor freqs =
      positions.to(inv_freq.scalar_type()).unsqueeze(1) * inv_freq.unsqueeze(0);
  const at::Tensor angles = at::cat({freqs, freqs}, -1);
  at::Tensor cos = angles.cos();
  at::Tensor sin = angles.sin();
  if (attention_factor != 1.0) {
    cos.mul_(attention_factor);
    sin.mul_(attention_factor);
  }
  return {cos, sin};
}

at::Tensor RopeForward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  CheckTables("RopeForward", x, cos, sin);
  return JoinUnrotated(kernels::RopeForward(x.slice(-1, 0, cos.size(-1)), cos, sin), x);
}

at::Tensor RopeBackward(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin) {
  CheckTables("RopeBackward", dy, cos, sin);
  return JoinUnrotated(kernels::RopeBackward(dy.slice(-1, 0, cos.size(-1)), cos, sin), dy);
}

}  // namespace dta

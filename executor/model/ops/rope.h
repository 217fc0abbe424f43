// Rotary position embedding for the decoder: the inverse frequencies of each rope type
// (transformers' rope_init_fn of "default", "linear", "llama3" and "yarn" in
// modeling_rope_utils.py, the same expressions in the given dtype), the cos/sin tables of a chunk,
// and RoPE on its own (the families without a q/k norm; Qwen3's norm and RoPE run fused in
// kernels/fused_layers.h). RoPE itself is kernels/fused_layers.h's RopeForward / RopeBackward
// (one CUDA kernel per direction on the GPU) on the rotated part of each head.
//
// Example:
//   const at::Tensor inv_freq = RopeInverseFrequencies(config, at::TensorOptions(at::kFloat));
//   auto [cos, sin] = RopeTables(inv_freq, positions, RopeAttentionFactor(config.rope_scaling));
//   at::Tensor q_rotated = RopeForward(q, cos.unsqueeze(1), sin.unsqueeze(1));
//
// Thread safety: stateless. Failure: TORCH_CHECK (c10::Error) on shapes that do not fit.
#pragma once

#include <ATen/ATen.h>

#include <utility>

#include "core/model/model_config.h"

namespace dta {

// inv_freq [R / 2] for config.rope_theta, the rotary dimension R = RotaryDim(config) (head_dim,
// or its partial_rotary_factor share) and rope_scaling, computed with `options` (the compute dtype:
// float32 as transformers, float64 for exact references). TORCH_CHECK on an odd R.
at::Tensor RopeInverseFrequencies(const ModelConfig& config, at::TensorOptions options);

// cos and sin [T, R] of the angles positions x inv_freq (each frequency twice, as
// transformers' cat((freqs, freqs))), multiplied by attention_factor (YaRN's; 1: none), in
// inv_freq's dtype. positions [T] int64 on inv_freq's device.
std::pair<at::Tensor, at::Tensor> RopeTables(const at::Tensor& inv_freq,
                                             const at::Tensor& positions, double attention_factor);

// y = x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1], computed in cos's dtype and rounded
// once to x's dtype (kernels/fused_layers.h's RoPE after the norm, without the norm).
// x [T, H, D]; cos, sin [T, 1, R] with R <= D even: partial rotary (transformers'
// apply_rotary_pos_emb) rotates x[..., :R] and passes the rest of each head unchanged.
at::Tensor RopeForward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// RopeForward's input gradient given dy [T, H, D]: dy cos + [(dy sin)2, -(dy sin)1] on the rotated
// part, computed in cos's dtype and rounded to dy's; dy itself on the rest.
at::Tensor RopeBackward(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace dta

// The arithmetic of one AdamW step, shared by every layout of the optimizer state: AdamW (the whole
// state on each rank) and ShardedAdamW (executor/distributed: each data-parallel rank owns a slice,
// on the GPU or offloaded to the host). One definition, so that every layout computes the same
// values from the same gradients.
//
// For step t (1-based) with options o, the master weights w, moments m and v and the gradient g
// times the clip factor c (all of the state dtype, same shape), AdamWUpdate computes, in place:
//   g = g * c
//   w = w * (1 - lr * weight_decay)
//   m = m * beta1 + (1 - beta1) * g
//   v = v * beta2 + (1 - beta2) * g * g
//   w = w - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// with the very tensor operations of LibTorch's torch::optim::AdamW::step (amsgrad off) after
// torch.nn.utils.clip_grad_norm_'s multiplication. Float32 state on a GPU takes one fused kernel
// with the same float32 results bit for bit (kernels/adamw_step.h; DTA_FUSED_ADAMW=0 takes the
// ops).
//
//   const AdamWStepScalars scalars = AdamWScalarsFor(options, step + 1);
//   AdamWUpdate(master, exp_avg, exp_avg_sq, grad, scalars, clip_coef);
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>

namespace dta {

struct AdamWOptions {
  double lr = 1e-6;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;  // decoupled: w *= 1 - lr * weight_decay each step
  double max_grad_norm = 1.0;  // global L2 norm clip; <= 0 disables clipping
};

// The scalars of step t, computed once per step.
struct AdamWStepScalars {
  double lr = 0;
  double beta1 = 0;
  double beta2 = 0;
  double eps = 0;
  double weight_decay = 0;
  double step_size = 0;              // lr / (1 - beta1^t)
  double bias_correction2_sqrt = 0;  // sqrt(1 - beta2^t)
};

AdamWStepScalars AdamWScalarsFor(const AdamWOptions& options, int64_t t);

// One update in place, as the header comment says; `grad` itself is left alone. Under no-grad;
// every tensor on one device.
void AdamWUpdate(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                 const at::Tensor& grad, const AdamWStepScalars& scalars, double clip_coef = 1.0);

// torch.nn.utils.clip_grad_norm_'s factor: min(1, max_grad_norm / (total_norm + 1e-6)), or 1 when
// max_grad_norm <= 0.
double ClipCoefficient(double total_norm, double max_grad_norm);

// TORCH_CHECK, starting the message with `context`, unless lr >= 0, 0 <= beta1, beta2 < 1,
// eps >= 0, weight_decay >= 0 and all are finite.
void CheckAdamWOptions(const AdamWOptions& options, const std::string& context);

// The options and the step count as safetensors metadata ("step", "lr", "beta1", "beta2", "eps",
// "weight_decay", "max_grad_norm"; doubles in shortest round-trip form), and back. Reading
// TORCH_CHECKs, starting with `context`, on a missing or malformed entry or invalid options.
std::map<std::string, std::string> AdamWMetadata(const AdamWOptions& options, int64_t step);
AdamWOptions AdamWOptionsFromMetadata(const std::map<std::string, std::string>& metadata,
                                      const std::string& context, int64_t* step);

// The entry `key` of `metadata`; TORCH_CHECK (starting with `context`) when it is missing.
const std::string& MetadataEntry(const std::map<std::string, std::string>& metadata,
                                 const std::string& key, const std::string& context);
// Parses a non-negative integer entry; TORCH_CHECK naming it otherwise.
int64_t MetadataCount(const std::map<std::string, std::string>& metadata, const std::string& key,
                      const std::string& context);

}  // namespace dta

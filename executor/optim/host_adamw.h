// AdamW's update fused into one pass over host memory, for optimizer state offloaded to the host
// (ShardedAdamW): reads each element's gradient, master weight and moments once, writes them back
// and writes the weight rounded to the parameters' dtype, on every core (at::get_num_threads()
// threads). The
// chain of tensor operations in AdamWUpdate makes about a dozen passes over memory instead, which
// left an offloaded Qwen3-8B step spending three quarters of its time in the optimizer.
//
// The arithmetic is AdamWUpdate's (adamw_update.h), element by element in float32 with the same
// constants: the results agree with it to float32 rounding (the compiler may contract a multiply
// and an add that ATen's kernels round separately, or the reverse), not bit for bit. Float64 state
// keeps AdamWUpdate, so float64 runs stay exact references.
#pragma once

#include <ATen/ATen.h>

#include "executor/optim/adamw_update.h"

namespace dta {

// master, exp_avg, exp_avg_sq: contiguous float32 CPU tensors of n elements, updated in place.
// grad: contiguous float32 CPU, n elements, multiplied by clip_coef first. rounded: contiguous CPU
// tensor of n elements of float32, bfloat16 or float16, receives the new master weights rounded
// to its dtype. TORCH_CHECK on other dtypes, devices or sizes.
void HostAdamWUpdate(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                     const at::Tensor& grad, double clip_coef, const AdamWStepScalars& scalars,
                     at::Tensor& rounded);

}  // namespace dta

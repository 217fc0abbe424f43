// AdamW's update of float32 state on a GPU in one pass: each element's master weight, moments and
// gradient are read once and written once (28 bytes), where LibTorch's op-by-op step
// (torch::optim::AdamW, executor/optim/adamw_update.h) launches nine kernels that move ~90 bytes
// per element. On an 8B model that is the difference between ~0.2 s and ~0.06 s of HBM traffic
// per step, and for an optimizer streamed through the GPU from host memory the update of the part
// kept on the GPU is exposed time.
//
// Exactness: bit for bit the float32 values of the op-by-op step on CUDA. Each of its ops rounds
// its result to float32 and so does each step here, in the same order and with the same fused
// multiply-adds as ATen's CUDA kernels (add with alpha: fma(alpha, b, a); addcmul and addcdiv:
// fma(alpha, b op c, a), and fma(b, c, a) for addcmul when alpha is 1; division by a double
// scalar: multiplication by its reciprocal, taken in double and rounded to float32). Every double
// scalar is rounded to float32 where ATen rounds it; AdamWStepFloats holds them so rounded.
// adamw_update_test checks the equality against torch::optim::AdamW on the GPU.
//
// Example (state and gradient contiguous float32 on one GPU):
//   if (FusedAdamWStepTakes(master, exp_avg, exp_avg_sq, grad))
//     FusedAdamWStep(master, exp_avg, exp_avg_sq, grad, floats);
//
// Thread safety: stateless; runs on the current stream of the tensors' device.
// Failure: TORCH_CHECK (c10::Error) naming the tensor whose dtype, device or size is wrong.
#ifndef DTA_KERNELS_ADAMW_STEP_H_
#define DTA_KERNELS_ADAMW_STEP_H_

#include <ATen/ATen.h>

namespace dta::kernels {

// The scalars of one step, each rounded to float32 as ATen rounds it (see the header comment).
struct AdamWStepFloats {
  float grad_scale = 1;                 // the clip factor (g * grad_scale; 1 leaves g as it is)
  float decay = 1;                      // 1 - lr * weight_decay (1 without weight decay)
  float beta1 = 0;                      // exp_avg's decay
  float one_minus_beta1 = 0;            // add_'s alpha
  float beta2 = 0;                      // exp_avg_sq's decay
  float one_minus_beta2 = 0;            // addcmul_'s alpha
  float inv_bias_correction2_sqrt = 0;  // 1 / sqrt(1 - beta2^t), taken in double
  float eps = 0;
  float neg_step_size = 0;  // -lr / (1 - beta1^t), addcdiv_'s alpha
};

// Whether the fused kernel takes these tensors: built with CUDA, all four contiguous float32
// tensors of one size on one CUDA device, no two sharing memory, and DTA_FUSED_ADAMW not "0" (read
// at every call, for before/after measurements in one process).
bool FusedAdamWStepTakes(const at::Tensor& master, const at::Tensor& exp_avg,
                         const at::Tensor& exp_avg_sq, const at::Tensor& grad);

// In place, for every element:
//   g = grad * grad_scale
//   master = master * decay
//   exp_avg = exp_avg * beta1 + one_minus_beta1 * g
//   exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * g * g
//   master = master + neg_step_size * exp_avg / (sqrt(exp_avg_sq) * inv_bias_correction2_sqrt +
//   eps)
// rounded as the header comment says. TORCH_CHECK unless FusedAdamWStepTakes' layout holds (the
// switch aside).
void FusedAdamWStep(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                    const at::Tensor& grad, const AdamWStepFloats& floats);

}  // namespace dta::kernels

#endif  // DTA_KERNELS_ADAMW_STEP_H_

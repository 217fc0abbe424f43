// The CUDA entry points of kernels/fused_layers.h, defined in fused_layers.cu when the library is
// built with nvcc (DTA_KERNELS_HAVE_CUDA), and the two host helpers the fused kernels share
// (defined in fused_layers.cc). Inputs are checked, contiguous (unless said) and on one CUDA
// device; each function runs on the current stream. Not part of the public API.
#ifndef DTA_KERNELS_FUSED_LAYERS_INTERNAL_H_
#define DTA_KERNELS_FUSED_LAYERS_INTERNAL_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <initializer_list>

namespace dta::kernels::internal {

// Whether the fused kernels (these and kernels/head_norms.h's) take these tensors: the library has
// CUDA, DTA_FUSED_LAYERS is on (read once), and the tensors are on one CUDA device in float32,
// bfloat16 or float16, as are out_types.
bool FusedKernelsTake(std::initializer_list<const at::Tensor*> tensors,
                      std::initializer_list<at::ScalarType> out_types = {});

// weight_grad += partials ([rows, n]) summed over rows: one kernel when weight_grad is a contiguous
// float32 tensor on the GPU (the accumulators of bfloat16 and float32 models), else ATen's sum and
// add. Defined whether or not the library has CUDA.
void AddPartialSums(const at::Tensor& partials, at::Tensor& weight_grad);

// The longest row the RMSNorm kernels take, and the head dims of the q/k kernels.
inline constexpr int64_t kFusedNormMaxRow = 8192;
inline bool FusedRopeHeadDim(int64_t d) { return d % 64 == 0 && d <= 256; }

// x [rows, n] with unit column stride, its rows x.stride(0) apart (not necessarily contiguous);
// writes y [rows, n] and rstd [rows] (float32). The same x in the two below. With addend defined
// ([rows, n], contiguous) the rows normalised are x + addend, written to sum ([rows, n],
// contiguous; undefined without an addend).
void RmsNormForwardCuda(const at::Tensor& x, const at::Tensor& addend, const at::Tensor& weight,
                        double eps, at::Tensor& sum, at::Tensor& y, at::Tensor& rstd);
// y from a known rstd.
void RmsNormApplyCuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& rstd,
                      at::Tensor& y);
// dx [rows, n] float32, plus residual ([rows, n] float32, contiguous) when defined;
// weight_partials [RmsNormBackwardBlocks(rows), n] float32, summed by the caller. One kernel: the
// rows are read once for both.
void RmsNormBackwardCuda(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& rstd, const at::Tensor& residual, at::Tensor& dx,
                         at::Tensor& weight_partials);
// The number of row blocks (weight_partials' rows) RmsNormBackwardCuda uses for `rows` rows.
int64_t RmsNormBackwardBlocks(int64_t rows);

// x [T, H, D]; cos, sin [T, D] float32; y [T, H, D] in x's dtype; rstd [T * H]. With weight
// undefined, RoPE alone (eps and rstd unused).
void RmsNormRopeForwardCuda(const at::Tensor& x, const at::Tensor& weight, double eps,
                            const at::Tensor& cos, const at::Tensor& sin, at::Tensor& y,
                            at::Tensor& rstd);
// dx [T, H, D] in x's dtype; weight_partials [RmsNormRopeBackwardBlocks(T * H, D, device), D]
// float32. With weight undefined, RoPE's backward alone: dx in dy's dtype (x, rstd and
// weight_partials unused).
void RmsNormRopeBackwardCuda(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& rstd, const at::Tensor& cos, const at::Tensor& sin,
                             at::Tensor& dx, at::Tensor& weight_partials);
// The backward's blocks for `rows` (token, head) rows of head_dim columns on CUDA device `device`:
// one per 16 rows, at most as many as the device holds at once (the kernel's warps stride over the
// rest; a second, partial wave of blocks started only when the first had finished its rows). The
// weight-gradient partials, a row per block, are summed in a fixed order: the same bits on every
// run on one device model.
int64_t RmsNormRopeBackwardBlocks(int64_t rows, int64_t head_dim, int device);

// accumulator [n] float32 += partials [rows, n] float32 summed over rows, in a fixed order (the
// norms' weight gradients from their per-block partial sums, in one launch).
void AddColumnSumsCuda(const at::Tensor& partials, at::Tensor& accumulator);

// gate and up: [..., cols] with rows `in_ld` elements apart (cols when contiguous; 2 cols for the
// halves of one [rows, 2 cols] tensor); out, d and product contiguous; dgate and dup rows `out_ld`
// apart.
void SwiGluForwardCuda(const at::Tensor& gate, const at::Tensor& up, int64_t in_ld,
                       at::Tensor& out);
// product: undefined, or where SwiGluForward's result is written too.
void SwiGluBackwardCuda(const at::Tensor& d, const at::Tensor& gate, const at::Tensor& up,
                        int64_t in_ld, at::Tensor& dgate, at::Tensor& dup, int64_t out_ld,
                        at::Tensor& product);

// a, y, dy, da and dx: contiguous [..., cols]; x: the same shape with rows `gate_ld` elements
// apart.
void SigmoidGateForwardCuda(const at::Tensor& a, const at::Tensor& x, int64_t gate_ld,
                            at::Tensor& y);
void SigmoidGateBackwardCuda(const at::Tensor& dy, const at::Tensor& a, const at::Tensor& x,
                             int64_t gate_ld, at::Tensor& da, at::Tensor& dx);

// logits [rows, vocab] float32 contiguous, targets [rows] int64; lse, target [rows] float32, mean
// [rows] float32 or undefined (not computed).
void LogitRowStatsCuda(const at::Tensor& logits, const at::Tensor& targets, at::Tensor& lse,
                       at::Tensor& target, at::Tensor& mean);
// out [rows, vocab] (float32, bfloat16 or float16); lse, grad_logprob [rows] float32;
// target_weight, mean and grad_entropy [rows] float32 or undefined (mean and grad_entropy both or
// neither).
void LogitGradCuda(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& targets,
                   const at::Tensor& target_weight, const at::Tensor& grad_logprob,
                   const at::Tensor& mean, const at::Tensor& grad_entropy, double scale,
                   at::Tensor& out);

}  // namespace dta::kernels::internal

#endif  // DTA_KERNELS_FUSED_LAYERS_INTERNAL_H_

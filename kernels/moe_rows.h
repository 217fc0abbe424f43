// The row gathers and sums around a mixture-of-experts block's grouped GEMMs (executor/model/ops/
// moe.h), each one pass over its rows on CUDA instead of ATen's conversions, gathers, products
// and reductions (four to six passes over [pairs, hidden] float32 tensors per layer and call):
//   CombinePairs   a token's output from its k pairs' expert outputs and routing weights,
//   GatherPairs    the pairs' output gradients for the down projection (input and weight grads),
//   SumPairs       a token's input gradient from its k pairs' two GEMM outputs.
// The arithmetic is ATen's (bfloat16 widened exactly, float32 products and sums rounded to nearest
// even, never fused), but for the order of a token's k terms: j = 0 .. k - 1 here, as ATen's
// reduction pairs them otherwise (equal to float32 rounding; deterministic either way). The CUDA
// kernels take bfloat16 rows with float32 weights and gradients, contiguous, int64 indices;
// anything else (the CPU, float64 models) runs the ATen ops.
// DTA_MOE_ROWS=0 in the environment sends everything through ATen (before/after measurements).
//
//   const at::Tensor y = CombinePairs(out, inverse, weights);  // [T, H]
#ifndef DTA_KERNELS_MOE_ROWS_H_
#define DTA_KERNELS_MOE_ROWS_H_

#include <ATen/ATen.h>

#include <cstdint>

namespace dta::kernels {

// y[t] = sum_j weights[t, j] * rows[inverse[t k + j]]: rows [N, H] (the pairs' expert outputs in
// expert order), inverse [T k] int64 (pair t k + j's row), weights [T, k]. Returns [T, H] in
// weights' dtype.
at::Tensor CombinePairs(const at::Tensor& rows, const at::Tensor& inverse,
                        const at::Tensor& weights);

struct PairGradients {
  at::Tensor rows;    // [N, H]: dy[token[p]] in `type`
  at::Tensor scaled;  // [N, H]: dy[token[p]] * w[p] (in dy's dtype), then in `type`
};
// The pairs' output gradients: dy [T, H], token [N] int64 (pair p's token), w [N] (pair p's
// routing weight, dy's dtype).
PairGradients GatherPairs(const at::Tensor& dy, const at::Tensor& token, const at::Tensor& w,
                          at::ScalarType type);

// dx[t] = sum_j (a[inverse[t k + j]] + b[inverse[t k + j]]), each widened to `out_type` first:
// a and b [N, H] (b may be undefined: a alone), inverse [T k] int64. Returns [T, H].
at::Tensor SumPairs(const at::Tensor& a, const at::Tensor& b, const at::Tensor& inverse,
                    int64_t top_k, at::ScalarType out_type);

}  // namespace dta::kernels

#endif  // DTA_KERNELS_MOE_ROWS_H_

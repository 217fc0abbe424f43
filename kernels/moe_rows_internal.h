// Internal to kernels/moe_rows: the CUDA launchers (moe_rows.cu), each for bfloat16 rows and
// float32 weights and gradients, contiguous, int64 indices, on the current stream.
#ifndef DTA_KERNELS_MOE_ROWS_INTERNAL_H_
#define DTA_KERNELS_MOE_ROWS_INTERNAL_H_

#include <ATen/ATen.h>

#include <cstdint>

namespace dta::kernels::internal {

void LaunchCombinePairs(const at::Tensor& rows, const at::Tensor& inverse,
                        const at::Tensor& weights, at::Tensor& y);
void LaunchGatherPairs(const at::Tensor& dy, const at::Tensor& token, const at::Tensor& w,
                       at::Tensor& rows, at::Tensor& scaled);
void LaunchSumPairs(const at::Tensor& a, const at::Tensor& b, const at::Tensor& inverse,
                    int64_t top_k, at::Tensor& dx);

}  // namespace dta::kernels::internal

#endif  // DTA_KERNELS_MOE_ROWS_INTERNAL_H_

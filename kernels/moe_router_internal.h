// Internal to kernels/moe_router: the CUDA launchers (moe_router.cu), on the current stream, for
// contiguous operands on one device that kernels/moe_router.cc has checked: T > 0, E <=
// kRouterMaxExperts (kSortMaxExperts for the sort), float32 probs and gradients, int64 ids,
// bfloat16, float16 or float32 logits and output types.
#ifndef DTA_KERNELS_MOE_ROUTER_INTERNAL_H_
#define DTA_KERNELS_MOE_ROUTER_INTERNAL_H_

#include <ATen/ATen.h>

#include <cstdint>

namespace dta::kernels::internal {

// The most experts the sort kernels take (a counter per expert per warp in shared memory).
inline constexpr int64_t kSortMaxExperts = 2048;

// logits [T, E]; replay [T, k] or undefined. Writes probs [T, E], own_index [T, k], index [T, k]
// (only with replay), weights [T, k] float32, and adds the mismatches to `mismatches` (an int64
// scalar the caller zeroed; undefined without replay).
void LaunchRouteTokens(const at::Tensor& logits, const at::Tensor& replay, int64_t top_k,
                       bool norm_topk, at::ScalarType weight_type, at::Tensor& probs,
                       at::Tensor& own_index, at::Tensor& index, at::Tensor& weights,
                       at::Tensor& mismatches);

// index [T, k], T k < 2^31. Writes order, inverse, token [T k] and ends [E].
void LaunchSortPairs(const at::Tensor& index, int64_t experts, at::Tensor& order,
                     at::Tensor& inverse, at::Tensor& token, at::Tensor& ends);

// probs [T, E], index [T, k], dweights_sorted and inverse [T k], extra [T, E] or undefined.
// Writes dlogits [T, E] (its dtype the output type).
void LaunchRouterBackward(const at::Tensor& probs, const at::Tensor& index,
                          const at::Tensor& dweights_sorted, const at::Tensor& inverse,
                          bool norm_topk, const at::Tensor& extra, at::Tensor& dlogits);

}  // namespace dta::kernels::internal

#endif  // DTA_KERNELS_MOE_ROUTER_INTERNAL_H_

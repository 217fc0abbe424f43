// The router of a mixture-of-experts block (executor/model/ops/moe.h) around its grouped GEMMs: on
// CUDA one kernel per step instead of the ten or so small ATen launches per layer and call that
// each step takes (conversion, softmax, top-k, gathers, sums, divisions; a stable sort, scatter
// and search; index_select, gather, scatter, products and sums):
//   RouteTokens     the softmax over the experts, the router's own top k, the replayed ids where
//                   recorded, the routing weights and the replay's mismatch count,
//   SortPairs       the (token, slot) pairs sorted by expert (a stable counting sort),
//   RouterBackward  the logits' gradient from the routing weights' (and the aux loss's on probs).
// No host synchronisation anywhere (the mismatch count stays on the device).
//
// The CUDA kernels take bfloat16, float16 or float32 logits (float32 probs and gradients) for up
// to kRouterMaxExperts experts, one warp per token, float32 throughout with a fixed reduction
// order: bitwise repeatable, and ATen's arithmetic but for the order of sums (softmax: exp(z -
// max) / sum, the sum over the lanes' strided partial sums; the renormalisation and the backward's
// slot sums in slot order j = 0 .. k - 1), so they differ from ATen by float32 rounding. Top-k
// ties: the kernel takes the lower expert index first (NaN ranks highest, as at::topk); ATen's
// topk leaves the order of equal values unspecified. SortPairs is integer data: bit for bit ATen's.
// Anything else (the CPU, float64 models, more experts) runs the ATen ops, as does everything
// with DTA_MOE_ROUTER=0 in the environment (read at every call; before/after measurements).
//
//   const Routing r = RouteTokens(logits, 8, /*norm_topk=*/true, at::kBFloat16, replay);
//   const PairOrder pairs = SortPairs(r.index, experts);
//   ...
//   const at::Tensor dlogits = RouterBackward(r.probs, r.index, dweights_sorted, pairs.inverse,
//                                             /*norm_topk=*/true, dprobs_aux, at::kBFloat16);
#ifndef DTA_KERNELS_MOE_ROUTER_H_
#define DTA_KERNELS_MOE_ROUTER_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace dta::kernels {

// The most experts the CUDA router kernels take (a token's row lives in one warp's registers).
inline constexpr int64_t kRouterMaxExperts = 1024;

// One chunk's routing. The compute dtype `ct` is float32, float64 for float64 logits.
struct Routing {
  at::Tensor probs;       // [T, E] ct: softmax of the logits
  at::Tensor own_index;   // [T, k] int64: the router's own top k, by descending probability
  at::Tensor index;       // [T, k] int64: the replayed ids where the row is recorded, else own
  at::Tensor weights;     // [T, k] ct: probs at index (over their sum with norm_topk), rounded to
                          // the weights' dtype and widened back
  at::Tensor mismatches;  // int64 scalar on the device: recorded rows whose replayed id set
                          // differs from the own top-k set (undefined without replay)
};

// Routes T tokens to top_k of E experts. logits [T, E] (the weights' dtype); replay [T, k] int64
// or absent: a row of ids >= 0 is recorded and routed as given, any other row (all -1) routes
// itself; it may be on the host (copied to logits' device, a blocking copy). Throws if replay is
// not [T, k] int64 or top_k is not in [1, E]; a replayed id >= E is a device-side assertion on
// CUDA (as ATen's gather), an error on the CPU. Without replay, index is own_index (one tensor).
Routing RouteTokens(const at::Tensor& logits, int64_t top_k, bool norm_topk,
                    at::ScalarType weight_type, const std::optional<at::Tensor>& replay);

// The T k pairs (token t, slot j) = pair t k + j, stably sorted by expert (index[t, j]).
struct PairOrder {
  at::Tensor order;    // [T k] int64: sorted place -> pair
  at::Tensor inverse;  // [T k] int64: pair -> sorted place
  at::Tensor token;    // [T k] int64: the token of the pair at each sorted place (order / k)
  at::Tensor ends;     // [E] int64: each expert's end in the sorted pairs (running row counts)
};

// index [T, k] int64 with ids in [0, experts) (outside is a device-side assertion on CUDA).
// T = 0 gives empty tensors and ends of zeros.
PairOrder SortPairs(const at::Tensor& index, int64_t experts);

// The router logits' gradient, [T, E] in out_type: through the routing weights (dweights_sorted
// [T k] in sorted-pair order, probs' dtype; inverse [T k] from SortPairs), their renormalisation
// when norm_topk, and the softmax. probs [T, E] and index [T, k] as RouteTokens returned them;
// dprobs_extra [T, E] (converted to probs' dtype) or undefined: a gradient on probs itself (the
// load-balancing loss's). A duplicated id in a row (replayed) takes its last slot's gradient on
// CUDA (ATen's scatter leaves which one unspecified).
at::Tensor RouterBackward(const at::Tensor& probs, const at::Tensor& index,
                          const at::Tensor& dweights_sorted, const at::Tensor& inverse,
                          bool norm_topk, const at::Tensor& dprobs_extra, at::ScalarType out_type);

}  // namespace dta::kernels

#endif  // DTA_KERNELS_MOE_ROUTER_H_

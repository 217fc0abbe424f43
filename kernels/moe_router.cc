#include "kernels/moe_router.h"

#include <c10/util/Exception.h>

#include <limits>
#include <tuple>

#include "kernels/cuda_dispatch.h"
#include "kernels/moe_router_internal.h"

namespace dta::kernels {
namespace {

using internal::Dense;

// Whether the CUDA kernels run for operands on t's device (see the header).
bool KernelsFor(const at::Tensor& t) { return internal::CudaKernelsFor(t, "DTA_MOE_ROUTER"); }

// A dtype the kernels read and write (as float32).
bool KernelType(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
}

}  // namespace

Routing RouteTokens(const at::Tensor& logits, int64_t top_k, bool norm_topk,
                    at::ScalarType weight_type, const std::optional<at::Tensor>& replay) {
  TORCH_CHECK(logits.dim() == 2, "RouteTokens: logits must be [T, E], got ", logits.sizes());
  const int64_t t = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "RouteTokens: top ", top_k, " of ", experts,
              " experts");
  at::Tensor ids;  // the replayed experts on logits' device, or undefined
  if (replay.has_value() && replay->defined()) {
    TORCH_CHECK(replay->dim() == 2 && replay->size(0) == t && replay->size(1) == top_k &&
                    replay->scalar_type() == at::kLong,
                "RouteTokens: replayed experts must be [T, k] = [", t, ", ", top_k, "] int64, got ",
                replay->sizes(), " ", replay->scalar_type());
    ids = replay->to(logits.device());
  }
  const at::TensorOptions longs = logits.options().dtype(at::kLong);
  if (t > 0 && experts <= kRouterMaxExperts && KernelsFor(logits) &&
      KernelType(logits.scalar_type()) && KernelType(weight_type)) {
    const at::TensorOptions floats = logits.options().dtype(at::kFloat);
    Routing r{.probs = at::empty({t, experts}, floats),
              .own_index = at::empty({t, top_k}, longs),
              .index = ids.defined() ? at::empty({t, top_k}, longs) : at::Tensor(),
              .weights = at::empty({t, top_k}, floats),
              .mismatches = ids.defined() ? at::zeros({}, longs) : at::Tensor()};
    if (!ids.defined()) r.index = r.own_index;
    internal::LaunchRouteTokens(logits.contiguous(), ids.defined() ? ids.contiguous() : ids, top_k,
                                norm_topk, weight_type, r.probs, r.own_index, r.index, r.weights,
                                r.mismatches);
    return r;
  }
  const at::ScalarType ct = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  Routing r;
  r.probs = at::softmax(logits.to(ct), -1);
  at::Tensor top;
  std::tie(top, r.own_index) = at::topk(r.probs, top_k, -1);
  r.index = r.own_index;
  if (ids.defined()) {
    // Rows without a record (-1) keep the router's own choice.
    const at::Tensor recorded = ids.ge(0).all(-1, true);
    r.index = at::where(recorded, ids, r.own_index);
    top = r.probs.gather(1, r.index);
    const at::Tensor differs = std::get<0>(at::sort(ids, -1))
                                   .ne(std::get<0>(at::sort(r.own_index, -1)))
                                   .any(-1, /*keepdim=*/true);
    r.mismatches = differs.logical_and(recorded).sum();
  }
  const at::Tensor weights = norm_topk ? top / top.sum(-1, true) : top;
  r.weights = weights.to(weight_type).to(ct);
  return r;
}

PairOrder SortPairs(const at::Tensor& index, int64_t experts) {
  TORCH_CHECK(index.dim() == 2 && index.scalar_type() == at::kLong,
              "SortPairs: index must be [T, k] int64, got ", index.sizes(), " ",
              index.scalar_type());
  const int64_t top_k = index.size(1), pairs = index.numel();
  const at::TensorOptions options = index.options();
  if (pairs == 0) {
    return {.order = at::empty({0}, options),
            .inverse = at::empty({0}, options),
            .token = at::empty({0}, options),
            .ends = at::zeros({experts}, options)};
  }
  if (KernelsFor(index) && experts <= internal::kSortMaxExperts &&
      pairs <= std::numeric_limits<int32_t>::max() / 2) {
    PairOrder p{.order = at::empty({pairs}, options),
                .inverse = at::empty({pairs}, options),
                .token = at::empty({pairs}, options),
                .ends = at::empty({experts}, options)};
    internal::LaunchSortPairs(index.contiguous(), experts, p.order, p.inverse, p.token, p.ends);
    return p;
  }
  const at::Tensor flat = index.reshape({-1});
  const auto [sorted, order] = at::sort(flat, /*stable=*/true, 0, false);
  return {.order = order,
          .inverse =
              at::empty_like(order).scatter_(0, order, at::arange(order.size(0), order.options())),
          .token = at::div(order, top_k, "floor"),
          // Each expert's end in the sorted pairs, found on the device (no host read).
          .ends = at::searchsorted(sorted, at::arange(experts, flat.options()),
                                   /*out_int32=*/false, /*right=*/true)};
}

at::Tensor RouterBackward(const at::Tensor& probs, const at::Tensor& index,
                          const at::Tensor& dweights_sorted, const at::Tensor& inverse,
                          bool norm_topk, const at::Tensor& dprobs_extra, at::ScalarType out_type) {
  TORCH_CHECK(probs.dim() == 2 && index.dim() == 2 && index.size(0) == probs.size(0),
              "RouterBackward: probs [T, E] and index [T, k], got ", probs.sizes(), " and ",
              index.sizes());
  const int64_t t = probs.size(0), experts = probs.size(1), top_k = index.size(1);
  TORCH_CHECK(dweights_sorted.numel() == t * top_k && inverse.numel() == t * top_k,
              "RouterBackward: ", dweights_sorted.numel(), " weight gradients and ",
              inverse.numel(), " places for ", t, " tokens of ", top_k);
  TORCH_CHECK(!dprobs_extra.defined() || dprobs_extra.sizes() == probs.sizes(),
              "RouterBackward: dprobs_extra must be [T, E] = ", probs.sizes(), ", got ",
              dprobs_extra.sizes());
  const at::Tensor extra =
      dprobs_extra.defined() ? dprobs_extra.to(probs.scalar_type()) : at::Tensor();
  const at::Device device = probs.device();
  if (t > 0 && experts <= kRouterMaxExperts && KernelsFor(probs) && KernelType(out_type) &&
      Dense(probs, at::kFloat, device) && Dense(index, at::kLong, device) &&
      Dense(dweights_sorted, at::kFloat, device) && Dense(inverse, at::kLong, device) &&
      (!extra.defined() || Dense(extra, at::kFloat, device))) {
    at::Tensor dlogits = at::empty({t, experts}, probs.options().dtype(out_type));
    internal::LaunchRouterBackward(probs, index, dweights_sorted, inverse, norm_topk, extra,
                                   dlogits);
    return dlogits;
  }
  at::Tensor dtop = dweights_sorted.reshape({-1}).index_select(0, inverse).view({t, top_k});
  if (norm_topk) {
    const at::Tensor top = probs.gather(1, index);
    const at::Tensor sum = top.sum(-1, true);
    dtop = (dtop - (dtop * (top / sum)).sum(-1, true)) / sum;
  }
  at::Tensor dprobs = at::zeros_like(probs).scatter_(1, index, dtop);
  if (extra.defined()) dprobs.add_(extra);
  return (probs * (dprobs - (dprobs * probs).sum(-1, true))).to(out_type);
}

}  // namespace dta::kernels

#include "executor/model/ops/moe.h"

#include <memory>
#include <vector>

#include "executor/model/ops/fresh_gradients.h"
#include "executor/model/ops/numerics.h"
#include "kernels/fused_layers.h"
#include "kernels/grouped_gemm.h"
#include "kernels/moe_router.h"
#include "kernels/moe_rows.h"

namespace dta {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// Grouped GEMMs over rows sorted by expert: rows [ends[e - 1], ends[e]) belong to expert e (ends:
// [E] int64, the running sum of the experts' row counts, on the rows' device). On CUDA one
// at::_grouped_mm each (no host read-back of the routing; its output has its inputs' dtype); on
// the CPU, where it takes no float64, a loop over the experts that have rows.
// CUDA's grouped GEMM takes no float64 and needs rows of 16-byte multiples: float64 models (the
// exact references) and odd shapes (tiny test models) loop there too.
// Whether it takes a product on `t`'s device with operands of `type` whose rows hold k and m.
bool UseGroupedMm(const at::Tensor& t, at::ScalarType type, int64_t k, int64_t m) {
  const auto bytes = static_cast<int64_t>(c10::elementSize(type));
  return t.is_cuda() && type != at::kDouble && k * bytes % 16 == 0 && m * bytes % 16 == 0;
}

// The experts' row ranges on the host (CPU path only).
std::vector<int64_t> HostEnds(const at::Tensor& ends) {
  const at::Tensor host = ends.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(host.const_data_ptr<int64_t>(),
                              host.const_data_ptr<int64_t>() + host.numel());
}

// y[rows of e] = x[rows of e] @ (transpose ? w[e]^T : w[e]), in `dtype` (CUDA: w's dtype, then
// converted). x [N, K]; w [E, M, K] with transpose, [E, K, M] without.
at::Tensor GroupedMatmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ends,
                         bool transpose, at::ScalarType dtype) {
  const at::Tensor weights = transpose ? w.transpose(1, 2) : w;  // [E, K, M]
  if (UseGroupedMm(x, w.scalar_type(), weights.size(1), weights.size(2))) {
    return at::_grouped_mm(x.to(w.scalar_type()), weights, ends.to(at::kInt)).to(dtype);
  }
  at::Tensor y = at::empty({x.size(0), weights.size(2)}, x.options().dtype(dtype));
  const std::vector<int64_t> host = HostEnds(ends);
  int64_t begin = 0;
  for (size_t e = 0; e < host.size(); ++e) {
    const int64_t end = host[e];
    if (end > begin)
      y.slice(0, begin, end).copy_(MatmulTo(x.slice(0, begin, end), weights[e], dtype));
    begin = end;
  }
  return y;
}

// accumulator[e] += dy[rows of e]^T @ x[rows of e]: a stacked weight's gradient. dy [N, M],
// x [N, K], accumulator [E, M, K]. On Hopper one grouped GEMM of our own (kernels/grouped_gemm.h)
// accumulates the bfloat16 operands' product into the float32 gradient in place. Elsewhere on CUDA
// at::_grouped_mm returns its inputs' dtype, so the product is formed from float32 copies of dy
// and x (in the accumulator's precision, 15x slower on an H200): a bfloat16 product would round
// every chunk's expert gradient to bfloat16 before the float32 sum, an error that grows with the
// number of chunks (dta with small B).
// With `overwrite` the accumulator's contents are stale (FreshGradients): the product replaces
// them.
void AddGroupedWeightGrad(at::Tensor& accumulator, const at::Tensor& dy, const at::Tensor& x,
                          const at::Tensor& ends, bool overwrite) {
  // One grouped GEMM of the bfloat16 operands into the float32 gradient where the GPU has it.
  const at::ScalarType wide = accumulator.scalar_type();
  if (dy.is_cuda() && wide != at::kDouble &&
      kernels::AddGroupedWeightGrad(accumulator, dy, x, ends, overwrite))
    return;
  if (overwrite) accumulator.zero_();
  if (UseGroupedMm(dy, wide, dy.size(1), x.size(1))) {
    accumulator.add_(at::_grouped_mm(dy.to(wide).t(), x.to(wide), ends.to(at::kInt)));
    return;
  }
  const std::vector<int64_t> host = HostEnds(ends);
  int64_t begin = 0;
  for (size_t e = 0; e < host.size(); ++e) {
    const int64_t end = host[e];
    if (end > begin) {
      at::Tensor slot = accumulator[e];
      AddMatmul(slot, dy.slice(0, begin, end).t(), x.slice(0, begin, end));
    }
    begin = end;
  }
}

// How one sparse layer's (token, expert) pairs travel between the expert-parallel ranks. Each
// rank's pairs, sorted by expert, are already grouped by destination (a rank's experts are one
// contiguous block, ExpertRange) and arrive grouped by source; the local experts' grouped GEMMs
// need them grouped by expert, so the received rows are permuted (Megatron's sort_chunks_by_idxs).
struct ExpertExchange {
  std::vector<int64_t> send;     // pairs to each rank
  std::vector<int64_t> receive;  // pairs from each rank
  at::Tensor to_expert_order;    // [M]: the received row at each expert-ordered row
  at::Tensor to_source_order;    // [M]: the expert-ordered row of each received row
  at::Tensor ends;               // [local experts] int64: the local experts' ends, expert order
};

// The exchange of pairs whose per-expert ends (over all E experts) are `ends`: one all-gather of
// every rank's counts and one read of them on the host (the only host synchronisation of an
// expert-parallel layer: the all-to-all takes its splits on the host).
ExpertExchange PlanExchange(const ExpertParallelGroup& ep, const at::Tensor& ends) {
  const int64_t experts = ends.size(0);
  const at::Tensor counts = at::diff(ends, 1, 0, at::zeros({1}, ends.options()));
  const at::Tensor all = ep.AllGather(counts.contiguous()).to(at::kCPU).contiguous();  // [R, E]
  const int ranks = ep.size();
  const int me = ep.rank();
  const auto count = [&](int rank, int64_t expert) {
    return all.const_data_ptr<int64_t>()[rank * experts + expert];
  };
  const IndexRange mine = ExpertRange(experts, me, ranks);
  ExpertExchange exchange;
  exchange.send.assign(ranks, 0);
  exchange.receive.assign(ranks, 0);
  for (int r = 0; r < ranks; ++r) {
    const IndexRange block = ExpertRange(experts, r, ranks);
    for (int64_t e = block.begin; e < block.end; ++e) exchange.send[r] += count(me, e);
    for (int64_t e = mine.begin; e < mine.end; ++e) exchange.receive[r] += count(r, e);
  }
  // Received rows: source by source, each source's rows expert by expert.
  std::vector<int64_t> start(ranks * mine.size());
  int64_t row = 0;
  for (int r = 0; r < ranks; ++r) {
    for (int64_t j = 0; j < mine.size(); ++j) {
      start[r * mine.size() + j] = row;
      row += count(r, mine.begin + j);
    }
  }
  std::vector<int64_t> to_expert, ends_local;
  to_expert.reserve(row);
  for (int64_t j = 0; j < mine.size(); ++j) {
    for (int r = 0; r < ranks; ++r) {
      const int64_t first = start[r * mine.size() + j];
      for (int64_t i = 0; i < count(r, mine.begin + j); ++i) to_expert.push_back(first + i);
    }
    ends_local.push_back(static_cast<int64_t>(to_expert.size()));
  }
  std::vector<int64_t> to_source(to_expert.size());
  for (size_t i = 0; i < to_expert.size(); ++i) to_source[to_expert[i]] = static_cast<int64_t>(i);
  const at::TensorOptions index = ends.options();
  exchange.to_expert_order = at::tensor(to_expert, at::kLong).to(index.device());
  exchange.to_source_order = at::tensor(to_source, at::kLong).to(index.device());
  exchange.ends = at::tensor(ends_local, at::kLong).to(index.device());
  return exchange;
}

// An all-to-all in flight: `rows` holds what arrives once Wait() returns (on CUDA: once the stream
// has waited for it, so kernels queued before the wait overlap the transfer).
struct PendingExchange {
  at::Tensor rows;
  std::unique_ptr<PendingCollective> pending;
  at::Tensor Wait() {
    pending->Wait();
    return rows;
  }
};

// `rows` [n, ...] sent by the splits `send` and received by `receive`: [sum(receive), ...].
PendingExchange StartExchange(const ExpertParallelGroup& ep, const at::Tensor& rows,
                              const std::vector<int64_t>& receive,
                              const std::vector<int64_t>& send) {
  int64_t total = 0;
  for (const int64_t n : receive) total += n;
  std::vector<int64_t> shape = rows.sizes().vec();
  shape[0] = total;
  at::Tensor out = at::empty(shape, rows.options());
  std::unique_ptr<PendingCollective> pending =
      ep.StartAllToAll(out, rows.contiguous(), receive, send);
  return {std::move(out), std::move(pending)};
}

at::Tensor Exchange(const ExpertParallelGroup& ep, const at::Tensor& rows,
                    const std::vector<int64_t>& receive, const std::vector<int64_t>& send) {
  return StartExchange(ep, rows, receive, send).Wait();
}

std::vector<int64_t> IntList(const c10::IValue& value) { return value.toIntVector(); }

}  // namespace

variable_list SparseMoe::forward(AutogradContext* ctx, const at::Tensor& x,
                                 const at::Tensor& norm_weight, double eps,
                                 const at::Tensor& router, const at::Tensor& gate,
                                 const at::Tensor& up, const at::Tensor& down, int64_t top_k,
                                 bool norm_topk, int64_t group, int64_t expert_group,
                                 const std::optional<at::Tensor>& norm_accumulator, bool residual,
                                 const std::optional<at::Tensor>& replay, int64_t fresh_gradients) {
  const at::ScalarType type = gate.scalar_type();
  const at::ScalarType ct = ComputeType(type);
  const int64_t experts = router.size(0);
  kernels::RmsNormResult normed = kernels::RmsNormForward(x, norm_weight, eps, type);
  const at::Tensor& xb = normed.y;
  // The routing and the (token, slot) pairs sorted by expert (kernels/moe_router.h): `inverse`
  // maps pair t k + slot to its sorted place, `ends` holds each expert's end in the sorted pairs,
  // found on the device (no host read).
  const kernels::Routing routing =
      kernels::RouteTokens(at::mm(xb, router.t()), top_k, norm_topk, type, replay);
  const at::Tensor &probs = routing.probs, &index = routing.index, &weights = routing.weights;
  const at::Tensor& own_index = routing.own_index;
  const kernels::PairOrder pairs = kernels::SortPairs(index, experts);
  const at::Tensor &order = pairs.order, &inverse = pairs.inverse, &token = pairs.token,
                   &ends = pairs.ends;
  const at::Tensor xs = xb.index_select(0, token);
  // The rows this rank's experts serve, sorted by expert: its own pairs, or under expert
  // parallelism every rank's pairs routed to its block of experts.
  const ExpertParallelGroup* ep = ExpertGroupOf(expert_group);
  TORCH_CHECK(ep != nullptr || gate.size(0) == experts, "SparseMoe: ", gate.size(0),
              " experts' weights for a router of ", experts, " without expert parallelism");
  ExpertExchange exchange;
  at::Tensor served = xs, served_ends = ends;
  if (ep != nullptr) {
    TORCH_CHECK(gate.size(0) == ExpertRange(experts, ep->rank(), ep->size()).size(),
                "SparseMoe: expert-parallel rank ", ep->rank(), " of ", ep->size(), " holds ",
                gate.size(0), " experts' weights, not its block of the router's ", experts);
    exchange = PlanExchange(*ep, ends);
    served = Exchange(*ep, xs, exchange.receive, exchange.send)
                 .index_select(0, exchange.to_expert_order);
    served_ends = exchange.ends;
  }
  const at::Tensor gate_out = GroupedMatmul(served, gate, served_ends, /*transpose=*/true, type);
  const at::Tensor up_out = GroupedMatmul(served, up, served_ends, /*transpose=*/true, type);
  // [T k, H] (served rows under EP): in the GEMM's dtype, widened by the combine (or before the
  // exchange under EP, which sends the compute type).
  at::Tensor out = GroupedMatmul(kernels::SwiGluForward(gate_out, up_out), down, served_ends,
                                 /*transpose=*/true, ep != nullptr ? ct : type);
  if (ep != nullptr) {
    out = Exchange(*ep, out.index_select(0, exchange.to_source_order), exchange.send,
                   exchange.receive);
  }
  at::Tensor y = kernels::CombinePairs(out, inverse, weights);
  SumOverRanks(GroupOf(group), y);
  // Under expert parallelism the served rows are saved: another rank's tokens cannot be recomputed
  // here.
  ctx->save_for_backward({x, norm_weight, normed.rstd, router, gate, up, down, probs, index,
                          weights, order, inverse, token, served_ends, gate_out, up_out,
                          ep != nullptr ? served : at::Tensor(), exchange.to_expert_order,
                          exchange.to_source_order});
  ctx->saved_data["expert_parallel"] = expert_group;
  ctx->saved_data["send"] = exchange.send;
  ctx->saved_data["receive"] = exchange.receive;
  ctx->saved_data["x_type"] = static_cast<int64_t>(x.scalar_type());
  ctx->saved_data["norm_topk"] = norm_topk;
  ctx->saved_data["tensor_parallel"] = group;
  ctx->saved_data["accumulator"] = norm_accumulator.value_or(at::Tensor());
  ctx->saved_data["residual"] = residual;
  ctx->saved_data["fresh_gradients"] = fresh_gradients;
  ctx->mark_non_differentiable({own_index});
  if (residual) return {y, probs, own_index, x};
  return {y, probs, own_index};
}

variable_list SparseMoe::backward(AutogradContext* ctx, variable_list grads) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor &x = saved[0], &norm_weight = saved[1], &rstd = saved[2], &router = saved[3],
                   &gate = saved[4], &up = saved[5], &down = saved[6], &probs = saved[7],
                   &index = saved[8], &weights = saved[9], &order = saved[10], &inverse = saved[11],
                   &token = saved[12], &ends = saved[13], &gate_out = saved[14],
                   &up_out = saved[15], &served_xs = saved[16], &to_expert_order = saved[17],
                   &to_source_order = saved[18];
  const TensorParallelGroup* ranks = GroupOf(ctx);
  const ExpertParallelGroup* ep = ExpertGroupOf(ctx->saved_data["expert_parallel"].toInt());
  const std::vector<int64_t> send = IntList(ctx->saved_data["send"]);
  const std::vector<int64_t> receive = IntList(ctx->saved_data["receive"]);
  const at::ScalarType type = gate.scalar_type();
  const at::ScalarType ct = ComputeType(type);
  const int64_t top_k = index.size(1);
  const int64_t hidden = x.size(1);
  const at::Tensor w_pairs = weights.reshape({-1}).index_select(0, order).unsqueeze(1);  // [T k, 1]
  // Under expert parallelism the pairs' output gradients go to their experts' ranks (sent with
  // their weights as one more column) while n(x) is recomputed for the router's gradient.
  PendingExchange to_experts;
  if (ep != nullptr) {
    const at::Tensor dy_pairs = grads[0].to(ct).index_select(0, token);  // [T k, H]
    to_experts = StartExchange(*ep, at::cat({dy_pairs, w_pairs}, 1), receive, send);
  }
  const at::Tensor xb = kernels::RmsNormApply(x, norm_weight, rstd, type);
  // The served rows' gradients (in the GEMMs' dtype, and times their routing weights for the down
  // projection's weight gradient): this rank's pairs, sorted, or under expert parallelism every
  // rank's pairs for its experts.
  kernels::PairGradients dy;
  at::Tensor w = w_pairs, xs = served_xs;
  if (ep == nullptr) {
    xs = xb.index_select(0, token);
    dy = kernels::GatherPairs(grads[0].to(ct).contiguous(), token, w_pairs, type);
  } else {
    const at::Tensor served = to_experts.Wait().index_select(0, to_expert_order);
    w = served.narrow(1, hidden, 1);
    const at::Tensor served_dy = served.narrow(1, 0, hidden);
    dy = {.rows = served_dy.to(type), .scaled = (served_dy * w).to(type)};
  }
  // g = dy @ down_e, the gradient of the expert's SwiGLU product before its routing weight.
  const at::Tensor g = GroupedMatmul(dy.rows, down, ends, /*transpose=*/false, ct);
  kernels::SwiGluGrads swiglu =
      kernels::SwiGluBackward(g * w, gate_out, up_out, /*with_product=*/true);
  // d weight = <dy, down_e product> = <g, product>: partial over the ranks' intermediate slices.
  at::Tensor dweights = (g * swiglu.product.to(ct)).sum(-1);
  std::unique_ptr<PendingCollective> dweights_sum;
  if (ep == nullptr) dweights_sum = StartSumOverRanks(ranks, dweights);
  // The pairs' input gradients through gate and up, in the GEMMs' dtype: summed per token (each
  // widened) below, or under expert parallelism widened and summed, and sent back to the pairs'
  // ranks (in their sorted order, with the weights' gradients as a column) while the experts'
  // weight gradients are formed.
  const at::ScalarType dxs_type = ep != nullptr ? ct : type;
  at::Tensor dxs = GroupedMatmul(swiglu.dgate, gate, ends, /*transpose=*/false, dxs_type);
  at::Tensor dxs_up = GroupedMatmul(swiglu.dup, up, ends, /*transpose=*/false, dxs_type);
  PendingExchange back;
  if (ep != nullptr) {
    dxs.add_(dxs_up);
    back = StartExchange(*ep,
                         at::cat({dxs, dweights.unsqueeze(1)}, 1).index_select(0, to_source_order),
                         send, receive);
    dxs = at::Tensor();
    dxs_up = at::Tensor();
  }
  FreshGradients* fresh = FreshGradients::FromHandle(ctx->saved_data["fresh_gradients"].toInt());
  const auto add_weight_grad = [&](const at::Tensor& weight, const at::Tensor& rows_dy,
                                   const at::Tensor& rows_x) {
    at::Tensor& grad = GradAccumulator(weight);
    AddGroupedWeightGrad(grad, rows_dy, rows_x, ends, fresh != nullptr && fresh->Take(grad));
  };
  add_weight_grad(down, dy.scaled, swiglu.product);
  add_weight_grad(gate, swiglu.dgate, xs);
  add_weight_grad(up, swiglu.dup, xs);
  if (ep != nullptr) {
    const at::Tensor rows = back.Wait();
    dxs = rows.narrow(1, 0, hidden);
    dweights = rows.select(1, hidden).contiguous();
    dweights_sum = StartSumOverRanks(ranks, dweights);
  }
  at::Tensor dxb = kernels::SumPairs(dxs, dxs_up, inverse, top_k, ct);  // [T, H]
  std::unique_ptr<PendingCollective> dxb_sum = StartSumOverRanks(ranks, dxb);
  if (dweights_sum != nullptr) dweights_sum->Wait();
  // Through the top-k selection (and its renormalisation) and the softmax, with the load-balancing
  // loss's gradient on the probabilities (whole on every rank: it is computed from the routing,
  // which every rank shares).
  const at::Tensor dlogits = kernels::RouterBackward(
      probs, index, dweights, inverse, ctx->saved_data["norm_topk"].toBool(), grads[1], type);
  AddMatmul(GradAccumulator(router), dlogits.t(), xb);
  if (dxb_sum != nullptr) dxb_sum->Wait();
  AddMatmul(dxb, dlogits, router);
  at::Tensor norm_accumulator = NormWeightAccumulator(ctx, norm_weight);
  // The residual output's gradient (materialised: zeros when it got none).
  const at::Tensor residual_grad =
      ctx->saved_data["residual"].toBool() ? grads[3].to(rstd.scalar_type()) : at::Tensor();
  const at::Tensor dx = kernels::RmsNormBackward(dxb.to(rstd.scalar_type()), x, norm_weight, rstd,
                                                 norm_accumulator, residual_grad)
                            .to(static_cast<at::ScalarType>(ctx->saved_data["x_type"].toInt()));
  variable_list result = {dx};
  result.resize(15);  // one per forward argument: the weights' gradients are accumulated above
  return result;
}

}  // namespace dta

// Qwen3-MoE's sparse mixture-of-experts block (ModelConfig's IsSparseLayer) as one autograd
// function, fused with the post-attention norm before it. A chunk's tokens are routed once per
// forward, and each expert projection is one grouped GEMM over the (token, expert) pairs sorted by
// expert: at::_grouped_mm on CUDA, with no host read-back of the routing; on the CPU, and for
// float64 anywhere, a loop over the experts with tokens. The experts' weight gradients accumulate
// in float32: on Hopper through one grouped GEMM of our own into the float32 .grad
// (kernels/grouped_gemm.h); on other GPUs from float32 copies (at::_grouped_mm returns its inputs'
// dtype, and a bfloat16 product would round each chunk's gradient before the float32 sum).
//
// Example:
//   variable_list moe = SparseMoe::apply(h, post_norm, eps, router, experts_gate, experts_up,
//       experts_down, /*top_k=*/8, /*norm_topk=*/true, /*group=*/0, /*expert_group=*/0,
//       std::nullopt,
//       /*residual=*/false, /*replay=*/std::nullopt, /*fresh_gradients=*/0);
//   at::Tensor out = h + moe[0];
//
// Thread safety: stateless; backward accumulates into the router's and the experts' .grad.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <optional>

namespace dta {

// Qwen3-MoE's sparse block on the residual stream x [T, H], as transformers'
// Qwen3MoeSparseMoeBlock after the post-attention norm n: router logits n(x) @ router^T in the
// weights' dtype; softmax in the compute dtype; the top-k (torch.topk; on CUDA one kernel,
// kernels/moe_router.h, whose ties go to the lower expert index) probabilities, renormalised
// to sum to 1 with norm_topk, rounded to the weights' dtype; y = sum_k w_k down_e(silu(gate_e n(x))
// * up_e n(x)) over the token's experts e, formed in the compute dtype (it feeds the residual
// stream). The token-expert pairs are sorted by expert (a stable sort: deterministic) and the
// experts run as grouped GEMMs; each token's k outputs are gathered back and summed in slot order,
// without atomics. Backward keeps the pairs' gate and up outputs (not their product, nor n(x) or
// its gathered copy, which it recomputes), the softmax probabilities and the sort.
//
// Tensor parallelism: every rank holds a slice of each expert's intermediate rows (columns of
// down) and the whole router, so routing is the same on every rank. y is a sum of the ranks'
// partial sums (one all-reduce in forward, as SwiGluDown). In backward the routing weights'
// gradient <dy, expert output> is a partial sum per rank (each sees its intermediate slice), and
// so is the gradient of n(x) through the experts: both are summed over the ranks; the router's
// part of n(x)'s gradient and the router's weight gradient are then whole on every rank.
//
// Routing replay (R3: the experts the inference engine routed each token to, replayed in training
// so that both route alike): with `replay` [T, k] (int64 expert ids, each row k distinct ids in
// [0, E), or every entry -1 where the engine recorded none: that token routes itself), a token's
// experts are its replayed ids in their order, and its routing weights the trainer's softmax
// probabilities at those ids, renormalised with norm_topk, as Megatron-Core's RouterReplay (which
// verl, slime and AReaL use). The router's gradient flows through the softmax as without replay
// (with norm_topk only the replayed logits get one); the ids carry none.
//
// Outputs: y [T, H]; the softmax probabilities [T, E] (compute dtype), through which a gradient
// seeded by the router's load-balancing loss reaches the router; the router's own top-k expert
// indices [T, k] (int64, not differentiable; what the load-balancing loss counts, with replay as
// without, as Megatron's); with `residual`, x itself for the residual connection, whose gradient
// the norm's backward kernel then adds (as Projections' `residual`).
//
// Expert parallelism (expert_group: ExpertGroupHandle in numerics.h; 0: none): each EP rank holds
// one block of the experts (ExpertRange) and the whole router, so a rank routes its own tokens; the
// sorted pairs go to their experts' ranks with one all-to-all (after one all-gather of per-expert
// counts, read on the host for the splits: the layer's one host synchronisation), the served rows
// run the local experts' grouped GEMMs in expert order, and the outputs come back with a second
// all-to-all, in the pairs' sorted order, to be combined as without EP. Backward mirrors it with
// the forward's splits: the pairs' gradients and routing weights go to the experts (one
// all-to-all), the inputs' and the weights' gradients come back (another, in flight while the
// local experts' weight gradients are formed). The expert side keeps
// the rows it served (it cannot recompute other ranks' tokens). Every EP rank must call the
// function the same number of times in the same order, also with zero tokens.
//
// router [E, H]; gate and up [E_l, I, H], down [E_l, H, I] (this rank's experts, E_l = E without
// expert parallelism; each TP rank's intermediate slice); group: the tensor-parallel group's handle
// (GroupHandle in numerics.h; 0: none). The norm weight's gradient
// goes into `norm_accumulator` when given, else into the norm weight's .grad. fresh_gradients: a
// FreshGradients handle (ops/fresh_gradients.h; 0: none) whose marked expert gradients backward
// writes instead of adding to.
class SparseMoe : public torch::autograd::Function<SparseMoe> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& norm_weight,
      double eps, const at::Tensor& router, const at::Tensor& gate, const at::Tensor& up,
      const at::Tensor& down, int64_t top_k, bool norm_topk, int64_t group, int64_t expert_group,
      const std::optional<at::Tensor>& norm_accumulator, bool residual,
      const std::optional<at::Tensor>& replay, int64_t fresh_gradients);

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

}  // namespace dta

// Log-probabilities (and entropy) of target tokens through the LM head, over a vocabulary split
// across the tensor-parallel ranks or whole, a slice of rows at a time so that neither pass holds
// more than one slice's [rows x vocabulary] logits. The logits' row statistics and gradient run
// kernels/fused_layers.h.
//
// Example:
//   variable_list out = SlicedLogprobs::apply(hidden, lm_head, targets, /*slice_rows=*/512,
//       /*inverse_temperature=*/1.0, /*want_entropy=*/true, /*group=*/0, /*vocab_first=*/0);
//   // out[0]: log p(targets[i] | hidden[i]), out[1]: entropy (zeros without want_entropy)
//
// Thread safety: stateless; backward accumulates into the weight's .grad.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>

namespace dta {

// log p(target) (and entropy) of each row of hidden @ weight^T, over the vocabulary. Neither pass
// keeps a [rows x vocab] tensor beyond one slice: backward recomputes each slice's logits. Logits
// are formed in float32 (float64 for float64 models) directly from the matmul. hidden may be wider
// than the weight (the final norm's float32 output): it is rounded once to the weight's dtype, that
// copy is what backward keeps, and the gradient comes back in hidden's dtype, so a row that
// predicts several children in a packed tree sums their gradients without rounding each.
//
// Vocabulary-parallel: weight holds this rank's vocabulary rows [vocab_first, + rows). Per slice of
// rows, the ranks agree on each row's max logit m (an all-reduce max), then sum their shares of
// S = sum exp(z - m), of the target's logit (from the rank that holds it) and, for the entropy, of
// U = sum exp(z - m) z (one all-reduce of [3, slice]): lse = m + log S, log p = z_y - lse,
// H = lse - U / S. Backward needs no collective until the hidden state's gradient, whose per-rank
// parts are summed once.
//
// hidden [N, H], weight [V_rank, H], targets [N] int64 (vocabulary ids); group: the tensor-parallel
// group's handle (GroupHandle in numerics.h; 0: none).
class SlicedLogprobs : public torch::autograd::Function<SlicedLogprobs> {
 public:
  // inverse_temperature: the logits are z / T = (hidden . weight) * inverse_temperature.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& wide_hidden,
                                                const at::Tensor& weight, const at::Tensor& targets,
                                                int64_t slice_rows, double inverse_temperature,
                                                bool want_entropy, int64_t group,
                                                int64_t vocab_first);

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

}  // namespace dta

#include "executor/model/ops/logprobs.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "core/base/env_switch.h"
#include "executor/model/ops/numerics.h"
#include "kernels/fused_layers.h"

namespace dta {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// Row-wise dot products of two [rows, n] tensors as a batched matrix product, without the [rows, n]
// elementwise product.
at::Tensor RowDot(const at::Tensor& a, const at::Tensor& b) {
  return at::bmm(a.unsqueeze(1), b.unsqueeze(2)).view({a.size(0)});
}

}  // namespace

variable_list SlicedLogprobs::forward(AutogradContext* ctx, const at::Tensor& wide_hidden,
                                      const at::Tensor& weight, const at::Tensor& targets,
                                      int64_t slice_rows, double inverse_temperature,
                                      bool want_entropy, int64_t group, int64_t vocab_first) {
  const TensorParallelGroup* ranks = GroupOf(group);
  const at::Tensor hidden = wide_hidden.to(weight.scalar_type());
  const at::ScalarType ct = ComputeType(hidden.scalar_type());
  const int64_t rows = hidden.size(0);
  const VocabularyRows target_rows = RowsOfSlice(targets, vocab_first, weight.size(0), group != 0);
  at::Tensor logprobs = at::empty({rows}, hidden.options().dtype(ct));
  at::Tensor entropy = at::zeros({rows}, hidden.options().dtype(ct));
  // Kept for backward: each row's log-sum-exp and, for the entropy, E_p[z].
  at::Tensor lse = at::empty({rows}, hidden.options().dtype(ct));
  at::Tensor mean_logit =
      want_entropy ? at::empty({rows}, hidden.options().dtype(ct)) : at::Tensor();
  // At most two [slice, vocab] tensors at a time: the logits and exp(z - m) (one on one rank,
  // where the fused row statistics read the logits once).
  for (int64_t begin = 0; begin < rows; begin += slice_rows) {
    const int64_t end = std::min(rows, begin + slice_rows);
    at::Tensor logits = MatmulTo(hidden.slice(0, begin, end), weight.t(), ct);
    if (inverse_temperature != 1.0) logits.mul_(inverse_temperature);
    const at::Tensor slice_targets = target_rows.rows.slice(0, begin, end);
    at::Tensor row_lse, target, mean;
    if (ranks == nullptr) {
      kernels::LogitRowStats stats =
          kernels::LogitRowStatsForward(logits, slice_targets, want_entropy);
      row_lse = std::move(stats.lse);
      target = std::move(stats.target);
      mean = std::move(stats.mean);
    } else {
      at::Tensor max = logits.amax(-1);
      ranks->AllReduce(max, TensorParallelReduce::kMax);
      const at::Tensor exp = (logits - max.unsqueeze(1)).exp_();
      target = logits.gather(1, slice_targets.unsqueeze(1)).squeeze(1);
      if (target_rows.owned.defined()) target.mul_(target_rows.owned.slice(0, begin, end));
      std::vector<at::Tensor> sums = {exp.sum(-1), target};
      if (want_entropy) sums.push_back(RowDot(exp, logits));
      at::Tensor summed = at::stack(sums);
      SumOverRanks(ranks, summed);
      row_lse = max + summed[0].log();
      target = summed[1];
      if (want_entropy) mean = summed[2] / summed[0];
    }
    lse.slice(0, begin, end).copy_(row_lse);
    logprobs.slice(0, begin, end).copy_(target - row_lse);
    if (want_entropy) {
      mean_logit.slice(0, begin, end).copy_(mean);
      entropy.slice(0, begin, end).copy_(row_lse - mean);
    }
  }
  ctx->save_for_backward({hidden, weight, target_rows.rows, target_rows.owned, lse, mean_logit});
  ctx->saved_data["hidden_type"] = static_cast<int64_t>(wide_hidden.scalar_type());
  ctx->saved_data["slice_rows"] = slice_rows;
  ctx->saved_data["inverse_temperature"] = inverse_temperature;
  ctx->saved_data["tensor_parallel"] = group;
  return {logprobs, entropy};
}

variable_list SlicedLogprobs::backward(AutogradContext* ctx, variable_list grads) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor& hidden = saved[0];
  const at::Tensor& weight = saved[1];
  const at::Tensor& targets = saved[2];  // rows of this rank's slice
  const at::Tensor& owned = saved[3];    // undefined: every target is in the slice
  const at::Tensor& lse = saved[4];
  const at::Tensor& mean_logit = saved[5];
  const int64_t slice_rows = ctx->saved_data["slice_rows"].toInt();
  const double inverse_temperature = ctx->saved_data["inverse_temperature"].toDouble();
  const at::ScalarType ct = ComputeType(hidden.scalar_type());
  at::Tensor& grad_weight = GradAccumulator(weight);
  const auto hidden_type = static_cast<at::ScalarType>(ctx->saved_data["hidden_type"].toInt());
  at::Tensor grad_hidden = at::empty(hidden.sizes(), hidden.options().dtype(hidden_type));
  const int64_t rows = hidden.size(0);
  std::vector<std::unique_ptr<PendingCollective>> pending;
  // The logits' gradients of several slices feed one weight-gradient matmul: each such matmul
  // reads and writes the whole float32 [vocabulary, hidden] accumulator (1.2 GB at Qwen3's
  // vocabulary and hidden 2,048), which one per 512-row slice made memory-bound. As many slices
  // as fit in what the memory estimate already allows a slice (two compute-type slices and one
  // weight-type: core/layout/executor_memory.h) beside the slice's compute-type logits: three in
  // bfloat16, two in float32 and float64. DTA_LOGPROB_GROUPS=0 (read at every call) takes one
  // slice a matmul, the before/after switch of benchmarks.
  const int64_t compute_bytes = c10::elementSize(ct), weight_bytes = weight.element_size();
  const int64_t slices = EnvSwitchOn("DTA_LOGPROB_GROUPS")
                             ? std::max<int64_t>(1, (compute_bytes + weight_bytes) / weight_bytes)
                             : 1;
  const int64_t group_rows = std::min(rows, slices * slice_rows);
  at::Tensor gathered;  // [group_rows, vocabulary] in the weight's dtype
  int64_t group_begin = 0;
  // Per slice: the float32 logits and their gradient in the model dtype (on the CPU and in
  // float64, a second float32 slice: kernels/fused_layers.h).
  for (int64_t begin = 0; begin < rows; begin += slice_rows) {
    const int64_t end = std::min(rows, begin + slice_rows);
    const at::Tensor h = hidden.slice(0, begin, end);
    at::Tensor logits = MatmulTo(h, weight.t(), ct);
    if (inverse_temperature != 1.0) logits.mul_(inverse_temperature);
    // d logp(y) / d z = onehot(y) - p;  d entropy / d z = -p (z - E_p[z]); the gradient so far
    // is with respect to z / T. The two matmuls run in the model dtype (bfloat16 tensor cores
    // on the GPU), d hidden comes out in hidden's dtype.
    const bool with_entropy = mean_logit.defined() && grads[1].defined();
    if (!gathered.defined()) gathered = at::empty({group_rows, weight.size(0)}, weight.options());
    const at::Tensor g = kernels::LogitGradient(
        logits, lse.slice(0, begin, end), targets.slice(0, begin, end),
        owned.defined() ? owned.slice(0, begin, end).to(ct) : at::Tensor(),
        grads[0].slice(0, begin, end).to(ct),
        with_entropy ? mean_logit.slice(0, begin, end) : at::Tensor(),
        with_entropy ? grads[1].slice(0, begin, end).to(ct) : at::Tensor(), inverse_temperature,
        hidden.scalar_type(), gathered.narrow(0, begin - group_begin, end - begin));
    logits.reset();
    at::Tensor grad_rows = grad_hidden.slice(0, begin, end);
    grad_rows.copy_(MatmulTo(g, weight, hidden_type));
    // Each rank's vocabulary slice contributes its part of d hidden: the rows' sum runs while
    // the weight gradient and the next slice are computed.
    if (auto sum = StartSumOverRanks(GroupOf(ctx), grad_rows)) pending.push_back(std::move(sum));
    if (end - group_begin == group_rows || end == rows) {
      AddMatmul(grad_weight, gathered.narrow(0, 0, end - group_begin).t(),
                hidden.slice(0, group_begin, end));
      group_begin = end;
    }
  }
  for (const auto& sum : pending) sum->Wait();
  return {grad_hidden,  at::Tensor(), at::Tensor(), at::Tensor(),
          at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
}

}  // namespace dta

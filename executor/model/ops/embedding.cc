#include "executor/model/ops/embedding.h"

#include "executor/model/ops/gather_rows.h"
#include "executor/model/ops/numerics.h"

namespace dta {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor Embedding::forward(AutogradContext* ctx, const at::Tensor& table, const at::Tensor& ids,
                              int64_t group, int64_t vocab_first) {
  const VocabularyRows v = RowsOfSlice(ids, vocab_first, table.size(0), group != 0);
  ctx->save_for_backward({table, v.rows, v.owned});
  at::Tensor out = table.index_select(0, v.rows).to(ComputeType(table.scalar_type()));
  if (v.owned.defined()) {
    out.mul_(v.owned.unsqueeze(1));
    SumOverRanks(GroupOf(group), out);
  }
  return out;
}

variable_list Embedding::backward(AutogradContext* ctx, variable_list grads) {
  const auto saved = ctx->get_saved_variables();
  at::Tensor& accumulator = GradAccumulator(saved[0]);
  at::Tensor g = grads[0].to(accumulator.scalar_type());
  if (saved[2].defined()) g = g * saved[2].unsqueeze(1);
  AddRowsInto(accumulator, saved[1], g);  // repeated ids summed in a fixed order
  return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
}

}  // namespace dta

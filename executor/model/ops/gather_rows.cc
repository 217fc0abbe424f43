// Row gathers with a reproducible backward (gather_rows.h).
#include "executor/model/ops/gather_rows.h"

#include <torch/autograd.h>

#include <vector>

namespace dta {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class GatherRowsFunction : public torch::autograd::Function<GatherRowsFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& table,
                            const at::Tensor& index) {
    ctx->save_for_backward({index});
    ctx->saved_data["table_sizes"] = table.sizes().vec();
    return table.index_select(0, index);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor index = ctx->get_saved_variables()[0];
    const std::vector<int64_t> sizes = ctx->saved_data["table_sizes"].toIntVector();
    at::Tensor grad = at::zeros(sizes, grads[0].options());
    AddRowsInto(grad, index, grads[0]);
    return {grad, at::Tensor()};
  }
};

}  // namespace

void AddRowsInto(at::Tensor& accumulator, const at::Tensor& index, const at::Tensor& rows) {
  TORCH_CHECK(index.dim() == 1 && rows.dim() >= 1 && rows.size(0) == index.size(0),
              "AddRowsInto: index must be [N] and rows [N, ...], got ", index.sizes(), " and ",
              rows.sizes());
  TORCH_CHECK(rows.scalar_type() == accumulator.scalar_type(),
              "AddRowsInto: rows must have the accumulator's dtype (", accumulator.scalar_type(),
              "), got ", rows.scalar_type());
  if (index.numel() == 0) return;
  if (accumulator.is_cuda()) {
    accumulator.index_put_({index.to(at::kLong)}, rows, /*accumulate=*/true);
  } else {
    accumulator.index_add_(0, index, rows);
  }
}

at::Tensor GatherRows(const at::Tensor& table, const at::Tensor& index) {
  TORCH_CHECK(index.dim() == 1, "GatherRows: index must be [N], got ", index.sizes());
  return GatherRowsFunction::apply(table, index);
}

}  // namespace dta

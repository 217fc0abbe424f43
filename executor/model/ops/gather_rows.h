// Row gathers whose gradients are bitwise reproducible on the GPU. A gather's backward sums the
// gradient rows of repeated indices (a token id seen twice in a chunk, a convolution input read
// by the next kernel - 1 tokens, a branch point's hidden state predicting each child); ATen's
// index_add_ sums them with atomics on CUDA, in an order that changes from run to run, so two
// identical float32 steps differed in their last bits (the embedding's and Qwen3-Next's
// in_proj_qkvz gradients, and everything below a linear-attention layer). These sum them in a
// fixed order instead.
//
// Example (the embedding's backward):
//   AddRowsInto(table_grad, token_ids, grad_rows);   // table_grad[token_ids[i]] += grad_rows[i]
#pragma once

#include <ATen/ATen.h>

namespace dta {

// accumulator[index[i]] += rows[i] for every i: index [N] integer, rows [N, ...] matching
// accumulator's trailing shape, in accumulator's dtype. On CUDA through index_put_'s accumulating
// path (the indices sorted stably, each index's rows summed in their order: the same bits on every
// run); elsewhere index_add_ (sequential on the CPU, in index order).
void AddRowsInto(at::Tensor& accumulator, const at::Tensor& index, const at::Tensor& rows);

// table.index_select(0, index), differentiable in table, whose gradient is summed by AddRowsInto.
// index [N] integer on table's device.
at::Tensor GatherRows(const at::Tensor& table, const at::Tensor& index);

}  // namespace dta

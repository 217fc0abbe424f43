// The token embedding's lookup, vocabulary-parallel under tensor parallelism (Megatron's
// VocabParallelEmbedding), with a backward that sums repeated ids in a fixed order (gather_rows.h).
//
// Example:
//   at::Tensor h = Embedding::apply(table, token_ids, /*group=*/0, /*vocab_first=*/0);
//
// Thread safety: stateless; backward accumulates into the table's .grad.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>

namespace dta {

// Rows of the embedding table, in the compute dtype (the residual stream's: float32 for bfloat16
// models), so backward receives the residual gradient unrounded. Vocabulary-parallel: each rank
// looks up the ids in its slice (zeros elsewhere) and the rows are summed over the ranks.
// table [V_rank, H] holds the vocabulary rows [vocab_first, vocab_first + V_rank); ids [T] int64;
// group: the tensor-parallel group's handle (GroupHandle in numerics.h; 0: none). Returns [T, H].
class Embedding : public torch::autograd::Function<Embedding> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& table,
                            const at::Tensor& ids, int64_t group, int64_t vocab_first);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

}  // namespace dta

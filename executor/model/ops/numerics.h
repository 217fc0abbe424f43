// What every op of the decoder (executor/model/decoder.h) shares: its compute and accumulator
// dtypes, the gradient accumulation into each parameter's .grad, matmuls with a wider result, the
// tensor-parallel group as autograd functions carry it and the sums over its ranks, and the scale
// of a zero-centred norm.
//
// Numerics follow Hugging Face's models: norms, RoPE and softmax run in at least float32 (the
// compute type; float64 models stay float64 throughout, so float64 runs are exact references).
//
// Gradients: backward adds each parameter's gradient straight into its .grad, which is float32 for
// bfloat16/float16 parameters (and the parameter's dtype otherwise): many chunk backwards into one
// step's gradient neither round to bfloat16 each time nor allocate full-size gradients per call.
//
// Thread safety: stateless, but GradAccumulator and the ops' backwards write parameters' .grad.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "executor/parallel/expert_parallel.h"
#include "executor/parallel/tensor_parallel.h"

namespace dta {

// Norms, RoPE tables, softmax and log-softmax run in at least float32, as in Hugging Face.
at::ScalarType ComputeType(at::ScalarType dtype);

// Gradients accumulate in float32 (float64 for float64 parameters).
at::ScalarType AccumulatorType(at::ScalarType dtype);

// Every parameter's gradient is accumulated by the autograd functions of ops/ straight into its
// .grad tensor (float32 for low-precision parameters, the parameter's dtype otherwise), as
// Megatron's fused weight-gradient accumulation does: a chunk's backward never materializes a
// fresh full-size weight gradient that autograd would then add, and many chunk backwards into one
// step's gradient do not round to bfloat16 each time. The parameters still require grad (so the
// functions are recorded), but autograd never accumulates into them itself. Returns the .grad,
// created (zeros in AccumulatorType) when there is none yet.
at::Tensor& GradAccumulator(const at::Tensor& parameter);

// accumulator += a @ b, with a and b in the compute dtype and the product accumulated in the
// accumulator's precision (cuBLAS with a float32 C on CUDA).
void AddMatmul(at::Tensor& accumulator, const at::Tensor& a, const at::Tensor& b);

// a @ b with the result in `dtype` (float32 logits from bfloat16 inputs without a rounding step).
at::Tensor MatmulTo(const at::Tensor& a, const at::Tensor& b, at::ScalarType dtype);

// The tensor-parallel group travels through autograd functions' saved_data as an integer: the
// model owns the group and outlives the graphs it builds. 0 for null or a group of one rank.
int64_t GroupHandle(const TensorParallelGroup* group);
// The group of a handle (null for 0), or of an autograd function that saved one as
// saved_data["tensor_parallel"].
const TensorParallelGroup* GroupOf(int64_t handle);
const TensorParallelGroup* GroupOf(torch::autograd::AutogradContext* ctx);

// The expert-parallel group travels the same way (0 for null or a group of one rank).
int64_t ExpertGroupHandle(const ExpertParallelGroup* group);
const ExpertParallelGroup* ExpertGroupOf(int64_t handle);

// The sum over the tensor-parallel ranks, in place, started without waiting (null without a
// group).
std::unique_ptr<PendingCollective> StartSumOverRanks(const TensorParallelGroup* group,
                                                     at::Tensor& tensor);

// The sum over the tensor-parallel ranks, in place (nothing without a group).
void SumOverRanks(const TensorParallelGroup* group, at::Tensor& tensor);

// Token ids relative to this rank's vocabulary slice [first, first + rows): the row of each id
// (0 for ids outside), and which ids are inside (undefined when the slice is the whole
// vocabulary).
struct VocabularyRows {
  at::Tensor rows, owned;
};
VocabularyRows RowsOfSlice(const at::Tensor& ids, int64_t first, int64_t rows, bool split);

// Where a norm function adds its weight's gradient: the accumulator it was given
// (saved_data["accumulator"]: a partial sum under tensor parallelism), else the weight's .grad.
at::Tensor NormWeightAccumulator(torch::autograd::AutogradContext* ctx, const at::Tensor& weight);

// What a norm multiplies by and where its weight's gradient goes: for zero-centred families
// (HasZeroCentredNorms, transformers' Qwen3NextRMSNorm) 1 + w in the compute dtype, the gradient
// into w's .grad (undefined with grad mode off); else w itself and an undefined accumulator (the
// norm functions then use w's .grad).
struct NormScale {
  at::Tensor weight, accumulator;
};
NormScale NormScaleOf(const at::Tensor& norm_weight, bool zero_centred);

// t, or nullopt where t is undefined: the optional tensor arguments of the autograd functions.
std::optional<at::Tensor> Optional(const at::Tensor& t);

}  // namespace dta

// The executor's own peak GPU memory (executor/engine: dta's path stack and chunk graphs, dense's
// and packed's forward graphs, the log-probability head, backward's transients) as a function of
// the model's shape, the tensor-parallel degree, the weights' dtype and the executor options that
// drive it: the layout planner's activation term (memory_plan.h). Torch-free: it counts bytes from
// the config, as CountParameters does; executor/engine allocates what it counts.
//
// The model, per token, for L layers, hidden size h, this rank's q = heads/TP x head_dim,
// kv = kv_heads/TP x head_dim and i = intermediate/TP, weight bytes w (2: bfloat16) and compute
// bytes c = max(w, 4) (the residual stream, accumulators, norms: float32 for bfloat16 models):
//   stack      dta: the longest rollout's positions, allocated at the start of every step:
//              L x kv x 2 (w + c)   K and V, and their dK/dV accumulators
//              + 2 h c + 4 c        the final hidden state and its accumulator, log-probability,
//                                   entropy and their accumulators
//   graphs     the tokens whose forward graphs are alive at once (dta: the schedule's invariant
//              "live graphs never exceed B + the graph budget", and never more than the path they
//              lie on), each keeping per layer (executor/model/decoder.h)
//              2 h c                the two residual-stream norm inputs
//              (3 q + 3 kv + 2 i) w q and k before their norms and after RoPE, v, the attention
//                                   output, the MLP's gate and up ((2 q + 2 kv + 2 i) w for the
//                                   families without q/k norms: RoPE alone keeps nothing)
//              c (2 + 2 heads + kv_heads)  the norms' 1/rms and attention's log-sum-exp
//                                   (c (2 + heads) without q/k norms); a sparse MoE layer
//                                   keeps instead of the MLP's gate and up its k experts'
//                                   (2 k ie w, ie = moe_intermediate/TP), the router's softmax
//                                   and k weights ((E + k) c) and 4 k int64 routing indices
//              Qwen3-Next: gated attention keeps the output gate and the gated output (2 q w
//              more); a Gated DeltaNet layer keeps about 5 times an attention layer's (its eager
//              ATen graph: the convolution's input, q and k before their L2 norms, the delta
//              rule's per-head tensors and 64 x 64 chunk matrices, no recurrent state;
//              GraphBytesPerToken in executor/engine/executor.h spells the terms; the fused
//              GPU path of kernels/gated_delta_chunk.h keeps less, so there it is a bound), and it
//              keeps nothing per stack position: per kept chunk end one float32 recurrent state and
//              the last kernel - 1 convolution inputs, conv_dim = 2 key_dim + value_dim elements (w
//              + c) each, with their accumulators (all of them of this rank's key heads/TP and
//              value heads/TP)
//              and per chunk 2 h c + h w (the final norm's input and output, lm_head's rounded
//              copy), 2 head_dim c (RoPE tables) and 24 (ids, positions, tree mask). With layer
//              replay (checkpointing) a graph keeps only each layer's input (h c per layer) plus
//              one layer's graph.
//   workspace  the largest chunk's backward transients, per chunk token: dta's bf16 copies of
//              its dK/dV seeds (2 L kv w, alive for the whole backward), SwiGLU's backward
//              intermediates (7 i c) and the residual gradient's (4 h c)
//   logprob    the vocabulary-sliced log-probability head: min(slice rows, chunk) rows of the
//   head       vocabulary/TP logits, at most two compute-type slices and one weight-type one
//              (2 c + w bytes per logit; backward's one compute-type slice beside the weight-type
//              gradients of the (c + w) / w slices it gathers for a weight-gradient matmul fits
//              the same bytes)
//
// Calibrated on an H100 (docs/benchmarks.md, "Measured: the executor's memory"): with the token
// counts of the schedule the executor actually ran, the estimate is 1% to 7% above every measured
// peak (0.6B to 8B, B from 1,024 to 16,384, graph budgets 0 to 16,384, packing, rollouts of 7,821
// and 16,384 tokens; dense, packed and layer replay 1% to 5%), never below. From the options
// alone (PlannedExecutorTokens) it is an upper bound: trees that branch before a chunk fills keep
// fewer graphs alive than B + the budget (2.6x fewer tokens at B 4,096 and budget 4,096 on the
// tau2 preset).
//
//   ExecutorMemoryOptions options{.longest_rollout = 8192, .block_size = 4096, .graph_budget = 0};
//   int64_t bytes = EstimateExecutorMemory(config, options, /*tensor_parallel=*/2).total();
#pragma once

#include <cstdint>

#include "core/model/model_config.h"

namespace dta {

// The executor's method, as the planner sees it (executor/engine's Method).
enum class ExecutorKind { kDta, kDense, kPacked };

// ExecutorMemoryOptions::block_size and graph_budget: the executor sizes it from the memory free
// when the step starts (ExecutorOptions' kAutoBlockSize and kAutoGraphBudget).
inline constexpr int64_t kAutomaticCapacity = -1;
// The longest rollout planned for when the workload is not known at start.
inline constexpr int64_t kDefaultPlannedRollout = 8192;
// The block size planned for an automatic one: the executor takes the longest rollout when its
// graph fits in the memory the plan leaves, and less (down to 256 tokens) when it does not; the
// plan reserves this much so that chunks stay large enough to run near the GPU's peak.
inline constexpr int64_t kPlannedAutomaticBlock = 2048;

// The planner's view of ExecutorOptions and of the workload.
struct ExecutorMemoryOptions {
  ExecutorKind method = ExecutorKind::kDta;
  // The longest rollout, tokens (>= 1): dta's stack is allocated for it and dense forwards it
  // whole. Default: kDefaultPlannedRollout (tau2-like agent rollouts reach 8,061 tokens); give the
  // batch's when it is known.
  int64_t longest_rollout = kDefaultPlannedRollout;
  // dta: B, the most tokens per chunk (>= 1), or kAutomaticCapacity (planned at
  // min(longest rollout, kPlannedAutomaticBlock); the executor grows it into what the plan
  // leaves). A B at or above the longest rollout means one chunk per piece of a path.
  int64_t block_size = kAutomaticCapacity;
  // dta: tokens whose graphs may be kept beyond the chunk in backward (>= 0), or
  // kAutomaticCapacity (planned as 0: the automatic budget takes what the plan leaves).
  int64_t graph_budget = kAutomaticCapacity;
  // dta: packed steps of up to B tokens above the stack (they may exceed the longest rollout;
  // with an unbounded B, the tree when it is known, else one longest rollout: give B). Default:
  // on, as ExecutorOptions::pack.
  bool pack = true;
  // packed: the most unique tokens per packed forward (>= 0); 0: the whole tree at once.
  int64_t token_capacity = 0;
  // The batch's unique tokens when known (packed with token_capacity 0); 0: unknown, and then the
  // longest rollout stands in for the tree (an underestimate for any batch of several branches:
  // give token_capacity or an explicit reserve).
  int64_t tree_tokens = 0;
  // dense and packed: layer replay (activation checkpointing).
  bool checkpointing = false;
  // ExecutorOptions::logprob_slice_rows (>= 1).
  int64_t logprob_slice_rows = 512;
  // The expert-parallel ranks the sparse layers' experts are spread over (>= 1): above 1 each
  // sparse layer's graph also keeps the rows its experts served (LayerSavedBytes).
  int32_t expert_parallel = 1;
};

// The token counts that drive the executor's memory.
struct ExecutorTokens {
  int64_t stack = 0;   // positions of dta's path stack; 0 for dense and packed
  int64_t graphs = 0;  // tokens whose forward graphs are alive at once
  int64_t chunk = 0;   // the largest single forward and backward
};

// The counts the options allow at most (see the header comment); automatic capacities at their
// planned values. Requires valid options (PlanLayout checks them, naming the field).
ExecutorTokens PlannedExecutorTokens(const ExecutorMemoryOptions& options);

// Bytes on one GPU, per term of the header comment.
struct ExecutorMemoryEstimate {
  int64_t stack = 0;
  int64_t graphs = 0;
  int64_t workspace = 0;
  int64_t logprob_head = 0;
  int64_t total() const { return stack + graphs + workspace + logprob_head; }
};

// The executor's peak on one of `tensor_parallel` ranks holding weights of `weight_bytes` bytes,
// for the token counts `tokens` (e.g. a known schedule's) under `options`' method, checkpointing
// and slice rows. Requires tensor_parallel >= 1 and weight_bytes >= 1.
ExecutorMemoryEstimate EstimateExecutorMemory(const ModelConfig& config,
                                              const ExecutorMemoryOptions& options,
                                              const ExecutorTokens& tokens,
                                              int32_t tensor_parallel = 1,
                                              int32_t weight_bytes = 2);

// The same for PlannedExecutorTokens(options).
ExecutorMemoryEstimate EstimateExecutorMemory(const ModelConfig& config,
                                              const ExecutorMemoryOptions& options,
                                              int32_t tensor_parallel = 1,
                                              int32_t weight_bytes = 2);

}  // namespace dta

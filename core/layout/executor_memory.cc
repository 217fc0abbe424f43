#include "core/layout/executor_memory.h"

#include <algorithm>

namespace dta {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A packed step's B beyond this (kUnboundedBlock, in practice) is bounded only by the tree.
constexpr int64_t kUnknownTreeBlock = int64_t{1} << 40;

}  // namespace

ExecutorTokens PlannedExecutorTokens(const ExecutorMemoryOptions& o) {
  const int64_t longest = std::max<int64_t>(o.longest_rollout, 1);
  ExecutorTokens tokens;
  switch (o.method) {
    case ExecutorKind::kDense:
      // Every rollout on its own, its whole graph alive until its backward.
      tokens.graphs = tokens.chunk = longest;
      break;
    case ExecutorKind::kPacked: {
      // One packed forward of at most token_capacity unique tokens (and never more than the tree);
      // 0: the whole tree, or the longest rollout in its stead when the tree is not known.
      const int64_t tree = o.tree_tokens > 0 ? o.tree_tokens : longest;
      if (o.token_capacity == 0) {
        tokens.graphs = tree;
      } else {
        tokens.graphs =
            o.tree_tokens > 0 ? std::min(o.token_capacity, o.tree_tokens) : o.token_capacity;
      }
      tokens.chunk = tokens.graphs;
      break;
    }
    case ExecutorKind::kDta: {
      const int64_t block =
          o.block_size == kAutomaticCapacity ? kPlannedAutomaticBlock : o.block_size;
      const int64_t budget = o.graph_budget == kAutomaticCapacity ? 0 : o.graph_budget;
      tokens.stack = longest;
      if (o.pack) {
        // A packed step of up to B unique tokens (never more than the tree) sits above the kept
        // graphs, which lie on the path. An unbounded B with no tree known plans for one rollout.
        tokens.chunk = o.block_size == kAutomaticCapacity ? std::min(block, longest) : block;
        if (o.tree_tokens > 0) tokens.chunk = std::min(tokens.chunk, o.tree_tokens);
        if (tokens.chunk > kUnknownTreeBlock) tokens.chunk = longest;
        tokens.graphs = std::min(budget, longest) + tokens.chunk;
      } else {
        // Kept graphs and the chunk in backward are disjoint pieces of the one path on the stack.
        tokens.chunk = std::min(block, longest);
        tokens.graphs = std::min(tokens.chunk + std::min(budget, longest), longest);
      }
      break;
    }
  }
  return tokens;
}

ExecutorMemoryEstimate EstimateExecutorMemory(const ModelConfig& config,
                                              const ExecutorMemoryOptions& options,
                                              const ExecutorTokens& tokens, int32_t tensor_parallel,
                                              int32_t weight_bytes) {
  const int64_t tp = std::max(tensor_parallel, 1);
  const int64_t w = std::max(weight_bytes, 1);
  const int64_t c = std::max<int64_t>(w, 4);  // float32 (float64 for float64 models)
  const int64_t layers = config.num_hidden_layers;
  const int64_t h = config.hidden_size;
  const int64_t d = config.head_dim;
  // This rank's part (tensor parallelism needs heads and KV heads divisible by TP; the MLP's
  // intermediate rows and the vocabulary split with the larger parts first).
  const int64_t heads = config.num_attention_heads / tp;
  const int64_t kv_heads = config.num_key_value_heads / tp;
  const int64_t q = heads * d;
  const int64_t kv = kv_heads * d;
  const int64_t i = CeilDiv(config.intermediate_size, tp);
  const int64_t vocab = CeilDiv(config.vocab_size, tp);
  // Qwen3-Next's Gated DeltaNet layers (whole: they have no tensor-parallel split, and the
  // planner allows them no TP).
  const int64_t value_heads = config.linear_num_value_heads;
  const int64_t key_head_dim = config.linear_key_head_dim;
  const int64_t value_head_dim = config.linear_value_head_dim;
  const int64_t key_dim = config.linear_num_key_heads * key_head_dim;
  const int64_t value_dim = value_heads * value_head_dim;
  const int64_t conv_dim = 2 * key_dim + value_dim;
  const int64_t kernel = config.linear_conv_kernel_dim;
  const int64_t state = value_heads * key_head_dim * value_head_dim;  // one layer's, elements
  constexpr int64_t kDeltaRuleChunk = 64;  // ChunkedGatedDeltaRule's chunk_size
  int64_t linear_layers = 0;
  for (int64_t l = 0; l < layers; ++l) linear_layers += IsLinearAttentionLayer(config, l) ? 1 : 0;
  const int64_t attention_layers = layers - linear_layers;

  ExecutorMemoryEstimate m;
  // K, V and their dK, dV accumulators per attention layer, the convolution inputs and their
  // accumulator per linear layer (dta.cc's PathStack); the final hidden state and its accumulator;
  // the log-probability and entropy with theirs.
  m.stack = tokens.stack *
            ((attention_layers * kv * 2 + linear_layers * conv_dim) * (w + c) + 2 * h * c + 4 * c);
  // Linear layers' recurrent states and their accumulators (compute type) at every chunk end on
  // the path: ceil(path / chunk) of them when chunks cut the path only every B tokens; a path
  // that crosses more chunk ends (chunks cut short at branch points) holds more.
  if (tokens.stack > 0 && linear_layers > 0) {
    const int64_t boundaries = CeilDiv(tokens.stack, std::max<int64_t>(tokens.chunk, 1));
    m.stack += boundaries * linear_layers * 2 * state * c;
  }

  // What autograd keeps of one layer for one token: the two residual-stream norm inputs; q and k
  // before their norms (Qwen3's q/k norm; RoPE alone keeps nothing) and after RoPE, v, the
  // attention output; the MLP's gate and up; the norms' 1/rms (the residual ones, q's and k's per
  // head) and attention's log-sum-exp per head. Gated attention (qwen3_next) also keeps the output
  // gate and the gated output o_proj reads.
  // A sparse (mixture-of-experts) layer keeps its k experts' gate and up (this rank's slice of
  // moe_intermediate_size), the softmax over the experts and the k routing weights, and 4 k int64
  // indices (top-k, the sort, its inverse, each pair's token) instead of the MLP's gate and up; a
  // shared expert (qwen3_next) its gate and up, its sigmoid gate and the [h] output it scales.
  const bool qk_norm = HasQkNorm(config);
  const int64_t pre_norm = qk_norm ? q + kv : 0;
  const int64_t gated = HasGatedAttention(config) ? 2 * q : 0;
  const int64_t attention = 2 * h * c + (2 * q + 2 * kv + pre_norm + gated) * w +
                            c * (2 + heads + (qk_norm ? heads + kv_heads : 0));
  // A Gated DeltaNet layer, an estimate of what the eager ATen autograd of
  // executor/model/gated_delta_net.cc saves (measured by replaying its ops in PyTorch with
  // saved-tensor hooks: within 0.3% for chunks of whole 64-token delta-rule chunks; shorter chunks
  // pad to 64): the residual norm inputs (2 h c) and out_proj's input (value_dim w), and in the
  // compute type the convolution's taps and pre-activation ((kernel + 1) conv_dim), q and k
  // before their L2 norms (2 key_dim), the delta rule's per-head q, k, k beta, their decayed and
  // solved forms (6 value_heads key_head_dim), v, the solved values, the corrected values, the
  // output, its norm, the gated product and z with silu(z) (8 value_dim), the chunk-local decay and
  // attention matrices (5 value_heads x 64), one recurrent state per 64 tokens and a few per-head
  // scalars (10 value_heads). About 8x a gated attention layer's bytes for Qwen3-Next-80B-A3B's
  // shapes (497 KiB a token in bfloat16): a fused kernel would keep a fraction of it.
  const int64_t linear =
      2 * h * c + value_dim * w +
      c * ((kernel + 1) * conv_dim + 2 * key_dim + 6 * value_heads * key_head_dim + 8 * value_dim +
           5 * value_heads * kDeltaRuleChunk + state / kDeltaRuleChunk + 10 * value_heads);
  const int64_t k = config.num_experts_per_tok;
  const int64_t expert_i = CeilDiv(config.moe_intermediate_size, tp);
  const int64_t shared_i =
      HasSharedExpert(config) ? CeilDiv(config.shared_expert_intermediate_size, tp) : 0;
  const int64_t shared = HasSharedExpert(config) ? 2 * shared_i * w + h * c + c : 0;
  const int64_t sparse = 2 * k * expert_i * w + (config.num_experts + k) * c + 4 * k * 8 + shared;
  int64_t all_layers = 0, largest_layer = 0, widest_mlp = 0;
  bool any_sparse = false;
  for (int64_t l = 0; l < layers; ++l) {
    const bool is_sparse = IsSparseLayer(config, l);
    any_sparse = any_sparse || is_sparse;
    const int64_t layer =
        (IsLinearAttentionLayer(config, l) ? linear : attention) + (is_sparse ? sparse : 2 * i * w);
    all_layers += layer;
    largest_layer = std::max(largest_layer, layer);
    widest_mlp = std::max(widest_mlp, is_sparse ? std::max(k * expert_i, shared_i) : i);
  }
  // Layer replay keeps each layer's input and rebuilds one layer's graph at a time.
  const bool replay = options.checkpointing && options.method != ExecutorKind::kDta;
  const int64_t per_token_layers = replay ? layers * h * c + largest_layer : all_layers;
  // Per chunk: the final norm's input and output, lm_head's rounded copy of it, RoPE's cos and sin
  // (the rotated dimensions), the token ids, positions and tree mask (int64).
  const int64_t per_token_chunk = 2 * h * c + h * w + 2 * RotaryDim(config) * c + 3 * 8;
  m.graphs = tokens.graphs * (per_token_layers + per_token_chunk);

  // The chunk in backward: dta seeds its K/V outputs (convolution inputs at linear layers) with
  // weight-dtype copies of the stack's accumulators (alive for the whole backward); SwiGLU's
  // backward holds up to seven [T, i] compute-type tensors (the recomputed product's inputs,
  // d product, gate, up, sigmoid and two partials); the residual stream's gradient and the norm
  // backward's temporaries four [T, h] ones.
  const int64_t seeds = options.method == ExecutorKind::kDta
                            ? (attention_layers * 2 * kv + linear_layers * conv_dim) * w
                            : 0;
  // A sparse layer's backward runs SwiGLU over k pairs per token and holds the pairs' gathered
  // output and input gradients (two [T k, h] compute-type tensors). A linear layer's convolution
  // backward holds the gradients of its taps and of the table they gather from ((kernel + 2)
  // conv_dim compute-type elements per token; not measured).
  m.workspace =
      tokens.chunk * (seeds + 7 * widest_mlp * c + 4 * h * c + (any_sparse ? 2 * k * h * c : 0) +
                      (linear_layers > 0 ? (kernel + 2) * conv_dim * c : 0));

  // Two compute-type [rows, vocabulary] slices (logits and exp or their gradient) and the
  // weight-type copy of the gradient backward feeds to the matmuls.
  const int64_t rows = std::min(std::max<int64_t>(options.logprob_slice_rows, 1), tokens.chunk);
  m.logprob_head = rows * vocab * (2 * c + w);
  return m;
}

ExecutorMemoryEstimate EstimateExecutorMemory(const ModelConfig& config,
                                              const ExecutorMemoryOptions& options,
                                              int32_t tensor_parallel, int32_t weight_bytes) {
  return EstimateExecutorMemory(config, options, PlannedExecutorTokens(options), tensor_parallel,
                                weight_bytes);
}

}  // namespace dta

#include "core/layout/executor_memory.h"

#include <algorithm>
#include <vector>

#include "core/model/layer_spec.h"

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
  const int64_t k = config.num_experts_per_tok;
  // This rank's part of the vocabulary (split with the larger parts first).
  const int64_t vocab = CeilDiv(config.vocab_size, tp);
  // Qwen3-Next's Gated DeltaNet layers, this rank's key and value heads (TP divides the key
  // heads, and each key head has a group of value heads).
  const int64_t value_heads = config.linear_num_value_heads / tp;
  const int64_t state = value_heads * config.linear_key_head_dim * config.linear_value_head_dim;
  const int64_t conv_dim = 2 * (config.linear_num_key_heads / tp) * config.linear_key_head_dim +
                           value_heads * config.linear_value_head_dim;
  const int64_t kernel = config.linear_conv_kernel_dim;
  const ModelSpec spec = BuildModelSpec(config);
  std::vector<BlockSavedBytes> saved;
  int64_t linear_layers = 0, cache = 0;  // cache: the attention layers' K/V per position
  for (const LayerSpec& layer : spec.layers) {
    saved.push_back(LayerSavedBytes(config, layer, w, tp, options.expert_parallel));
    linear_layers += layer.linear_attention() ? 1 : 0;
    if (!layer.linear_attention()) cache += saved.back().cache;
  }

  ExecutorMemoryEstimate m;
  // K, V and their dK, dV accumulators per attention layer (dta.cc's PathStack); the final hidden
  // state and its accumulator; the log-probability and entropy with theirs.
  m.stack = tokens.stack * (cache * (w + c) + 2 * h * c + 4 * c);
  // Linear layers' recurrent states and their accumulators (compute type), and their last
  // kernel - 1 convolution inputs with accumulators, at every chunk end on the path: ceil(path /
  // chunk) of them when chunks cut the path only every B tokens; a path that crosses more chunk
  // ends (chunks cut short at branch points) holds more.
  if (tokens.stack > 0 && linear_layers > 0) {
    const int64_t boundaries = CeilDiv(tokens.stack, std::max<int64_t>(tokens.chunk, 1));
    m.stack += boundaries * linear_layers * (2 * state * c + (kernel - 1) * conv_dim * (w + c));
  }

  // What autograd keeps of each layer for one token, its tensors and its norms' and attention's
  // per-row statistics (core/model/layer_spec.h).
  int64_t all_layers = 0, largest_layer = 0, widest_mlp = 0;
  bool any_sparse = false;
  for (size_t l = 0; l < saved.size(); ++l) {
    const int64_t layer = saved[l].tensors + saved[l].statistics;
    all_layers += layer;
    largest_layer = std::max(largest_layer, layer);
    widest_mlp = std::max(widest_mlp, saved[l].mlp_width);
    any_sparse = any_sparse || spec.layers[l].sparse();
  }
  // Layer replay keeps each layer's input and rebuilds one layer's graph at a time.
  const bool replay = options.checkpointing && options.method != ExecutorKind::kDta;
  const int64_t per_token_layers = replay ? layers * h * c + largest_layer : all_layers;
  // Per chunk: the final norm's input and output, lm_head's rounded copy of it, RoPE's cos and sin
  // (the rotated dimensions), the token ids, positions and tree mask (int64).
  const int64_t per_token_chunk = 2 * h * c + h * w + 2 * RotaryDim(config) * c + 3 * 8;
  m.graphs = tokens.graphs * (per_token_layers + per_token_chunk);

  // The chunk in backward: dta seeds its K/V outputs with weight-dtype copies of the stack's
  // accumulators (alive for the whole backward; at linear layers the kernel - 1 convolution rows
  // before its end, a constant); SwiGLU's
  // backward holds up to seven [T, i] compute-type tensors (the recomputed product's inputs,
  // d product, gate, up, sigmoid and two partials); the residual stream's gradient and the norm
  // backward's temporaries four [T, h] ones.
  const int64_t seeds = options.method == ExecutorKind::kDta ? cache * w : 0;
  // A sparse layer's backward runs SwiGLU over k pairs per token and holds the pairs' gathered
  // output and input gradients (two [T k, h] compute-type tensors). A linear layer's convolution
  // backward holds the gradients of its taps and of the table they gather from ((kernel + 2)
  // conv_dim compute-type elements per token; not measured).
  m.workspace =
      tokens.chunk * (seeds + 7 * widest_mlp * c + 4 * h * c + (any_sparse ? 2 * k * h * c : 0) +
                      (linear_layers > 0 ? (kernel + 2) * conv_dim * c : 0));
  if (options.method == ExecutorKind::kDta && tokens.chunk > 0)
    m.workspace += linear_layers * (kernel - 1) * conv_dim * w;

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

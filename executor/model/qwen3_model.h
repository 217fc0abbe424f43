// A decoder of the families in core/checkpoint/model_family.h (RMSNorm, RoPE with explicit position
// ids and optional rope scaling, grouped-query attention with Qwen3's q/k norm or without, optional
// q/k/v and o_proj biases, SwiGLU MLP or, in Qwen3-MoE's sparse layers, a top-k routed mixture of
// SwiGLU experts, optional tied embeddings) whose one core call is "forward a chunk of tokens on
// top of a cached prefix".
//
// Qwen3-Next (qwen3_next, as transformers' Qwen3NextForCausalLM): layers whose layer_types entry
// is "linear_attention" run Gated DeltaNet (gated_delta_net.h) instead of attention: in_proj_qkvz
// and in_proj_ba as one fused projection after the input norm, the tree convolution and delta
// rule, the gated norm, out_proj into the residual stream; their cache is the convolution inputs
// (in PrefixKv::keys) and the recurrent state (PrefixKv::states), and small parameters (conv1d,
// dt_bias, A_log, the gated norm) enter as float32 leaves whose gradients go into their .grad.
// The other layers are gated attention: q_proj yields each head's query and output gate
// interleaved per head, the attention output is multiplied by sigmoid(gate) (compute dtype,
// rounded once); RoPE rotates the first partial_rotary_factor share of each head (the fused q/k
// norm + RoPE kernel then gives way to the norm followed by rope.h's RoPE). Every RMSNorm but the
// gated one scales by 1 + w (transformers' Qwen3NextRMSNorm): the kernels get 1 + w in the
// compute dtype and its gradient goes into w's .grad. Sparse blocks add a shared SwiGLU expert
// scaled by sigmoid(n(x) @ shared_expert_gate^T). No tensor parallelism for this family yet. Every
// execution method (dense, packed tree, push/pop dta) is a schedule over Forward() and Logprobs().
//
// Numerics follow Hugging Face's models (norms, RoPE and softmax in at least float32; float64
// models stay float64 throughout, so float64 runs are exact references), with fewer roundings in
// bfloat16: the residual stream between layers and its gradient are float32 (Megatron's fp32
// residual connection: the norms read it unrounded, o_proj and down_proj write into it from float32
// matmul outputs, the projections' input gradients are summed in float32), and RMSNorm, RoPE and
// SwiGLU compute in float32 and round once. A q/k/v bias is added inside its matmul (one rounding,
// as torch's linear); o_proj's is added in float32 to its float32 output. Matmul operands and saved
// activations stay bfloat16. Backward recomputes the cheap elementwise results it needs (the two
// residual norms' rounded outputs, the SwiGLU product) instead of keeping them: per layer and token
// a graph holds the two residual-stream inputs, q and k before their norms (Qwen3 only: RoPE alone
// keeps nothing) and after RoPE, v, the attention output, and the MLP's gate and up
// (GraphBytesPerToken in executor/engine/executor.h counts exactly these).
//
// Mixture of experts (Qwen3-MoE's sparse layers, ModelConfig's IsSparseLayer): as transformers'
// Qwen3MoeSparseMoeBlock, router logits n(h) @ gate^T in the weights' dtype, softmax in the compute
// dtype, torch.topk, optionally renormalised, the weights rounded to the weights' dtype, and
// y = sum over the token's k experts of w_e down_e(silu(gate_e n(h)) * up_e n(h)), formed in the
// compute dtype. A chunk's tokens are routed once per forward; the (token, expert) pairs are sorted
// by expert (stable) and each projection is one grouped GEMM over them (at::_grouped_mm on CUDA,
// with no host read-back of the routing; on the CPU, and for float64 anywhere, a loop over the
// experts with tokens); a token's k outputs are summed without atomics. The experts of a layer are
// stacked parameters, "model.layers.L.mlp.experts.gate_proj" and "...up_proj" [E, I, H] and
// "...down_proj" [E, H, I] (I = moe_intermediate_size), beside the router "model.layers.L.mlp.gate.
// weight" [E, H]; checkpoints hold the Hub's per-expert tensors (qwen3_checkpoint.h). A sparse
// layer's graph keeps, per token, its k experts' gate and up outputs and the routing (the softmax,
// the top-k weights and indices, the sort). On CUDA the grouped GEMMs return their inputs' dtype,
// so the experts' weight gradients are formed from float32 copies (a bfloat16 product would round
// each chunk's gradient before the float32 sum; slower, until a grouped GEMM with a float32 output
// of our own). With ChunkInput::router_statistics the forward also returns each token's router
// statistics, from which the loss adds the router's load-balancing term (LossOptions::
// router_aux_loss_coef, transformers' aux_loss per rollout).
//
// Gradients: backward adds each parameter's gradient straight into its .grad, which is float32 for
// bfloat16/float16 parameters (and the parameter's dtype otherwise): many chunk backwards into one
// step's gradient neither round to bfloat16 each time nor allocate full-size gradients per call.
// Attention runs kernels/chunk_attention.h, which picks the path: tree attention (FlashAttention-
// style tree-masked kernels on the GPU, an exact ATen reference elsewhere), cuDNN's fused attention
// for a causal chain without a prefix on the GPU, and optionally cuDNN for the prefix merged with
// the chunk's part by log-sum-exp. RMSNorm, the q/k norms with RoPE and
// SwiGLU run kernels/fused_layers (one CUDA kernel per direction; the same ATen expressions
// elsewhere); RoPE without a norm runs the ATen expressions of rope.h.
//
// Example:
//   Decoder model(config, at::TensorOptions().dtype(at::kDouble));
//   model.InitRandom(/*seed=*/1);
//   ChunkOutput out = model.Forward({.tokens = ids, .positions = at::arange(n, at::kLong)});
//   at::Tensor logp = model.Logprobs(out.hidden.slice(0, 0, n - 1), ids.slice(0, 1, n));
//
// Tensor parallelism (Megatron's layout, given a TensorParallelGroup of T ranks): rank r holds
// heads [H r / T, H (r + 1) / T) of q_proj and o_proj, and the matching KV heads of k_proj and
// v_proj (T must divide both head counts); a contiguous slice of the MLP's intermediate rows of
// gate_proj and up_proj (columns of down_proj); and a contiguous slice of the vocabulary of the
// embedding and lm_head. Norm weights are whole on every rank; q/k/v biases are split as their
// projections' rows, o_proj's bias is whole on every rank and added once, after the sum over the
// ranks (its gradient is then whole on every rank too). The column-parallel projections
// (q, k, v, gate, up) all-reduce their input's gradient in backward (inside the fused norm, before
// the norm's own backward) while their weight gradients are computed; the row-parallel ones
// (o_proj, down_proj) and the embedding lookup all-reduce their output in forward;
// log-probabilities and entropy combine each vocabulary slice's max and sums with two small
// all-reduces per slice of rows, and the hidden state's gradient with one per slice of rows,
// running while the next slice and lm_head's weight gradient are computed. Experts: each rank
// holds a contiguous slice of every expert's intermediate rows (rows of gate and up, columns of
// down) and the whole router, so all ranks route alike; the block's output is summed over the ranks
// in forward, and in backward the routing weights' gradient (<dy, expert output>, a partial sum per
// rank) and the experts' part of the input's gradient are all-reduced, which leaves the router's
// gradient whole on every rank. The residual stream, the
// final hidden states and the norm weights' gradients are then the same on every rank; K/V (and the
// executor's stack of them) hold only the rank's own KV heads. q_norm and k_norm see only the
// rank's heads, so their gradients are partial sums that ReduceTensorParallelGradients() completes
// (ComputeGradients calls it).
//
// Thread safety: Forward and Logprobs are const and may run concurrently (without tensor
// parallelism: its collectives must be issued in the same order on every rank); mutating
// parameters (an optimizer step) must not overlap them. Not copyable (parameters are shared
// tensors).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/checkpoint/qwen3_config.h"
#include "executor/model/gated_delta_net.h"
#include "executor/parallel/tensor_parallel.h"

namespace dta {

// The cached prefix one forward call attends to, per layer.
struct PrefixKv {
  // K and V of the prefix, [P, kv_heads, head_dim] each (typically views of a preallocated
  // path-length buffer: never copied or concatenated). At a linear-attention layer
  // (gated_delta_net.h) keys holds the prefix's convolution inputs [P, conv_dim] (the layer reads
  // the last conv_kernel - 1 rows) and values is undefined.
  std::vector<at::Tensor> keys = {};
  std::vector<at::Tensor> values = {};
  // Gradient accumulators of the same shape (float32; float64 for float64 models), or empty.
  // The prefix tensors are constants of the graph: backward adds d loss / d prefix K and V into
  // these accumulators in place, or drops them when there are none.
  std::vector<at::Tensor> grad_keys = {};
  std::vector<at::Tensor> grad_values = {};
  // Linear-attention layers: the recurrent state after the prefix's last token [value_heads,
  // key_head_dim, value_head_dim] and its gradient accumulator (backward adds d loss / d state);
  // undefined at attention layers. Empty for models without linear layers.
  std::vector<at::Tensor> states = {};
  std::vector<at::Tensor> grad_states = {};

  bool empty() const { return keys.empty(); }
};

// One layer's slice of a PrefixKv (undefined tensors when there is no prefix).
struct LayerPrefix {
  at::Tensor keys = {}, values = {}, grad_keys = {}, grad_values = {};
  at::Tensor state = {}, grad_state = {};  // linear-attention layers (see PrefixKv)
};

// The tokens of one forward call and the context they sit on.
struct ChunkInput {
  at::Tensor tokens = {};     // [T] int64 token ids
  at::Tensor positions = {};  // [T] int64 original position ids (offsets in their rollouts)
  // Tree structure inside the chunk, tokens in DFS order: key j is visible to queries
  // j .. key_end[j] - 1 (its subtree). [T] int64; undefined means a plain causal chain.
  at::Tensor key_end = {};
  // The same tree as each token's parent (its index in the chunk, -1 for a root), on the host:
  // what linear-attention layers route their recurrent state along. Required with key_end when the
  // model has linear layers; empty means a chain.
  std::vector<int64_t> parents = {};
  // Linear-attention layers, chains only: also return the recurrent states after the first p
  // tokens for each p here (sorted, in (0, T)): where later chunks start inside this one.
  std::vector<int64_t> state_points = {};
  // The cached prefix every chunk token attends to; empty means none.
  PrefixKv prefix = {};
  // Sparse (MoE) layers report their routing (ChunkOutput::router_probs and router_counts): what
  // the router's load-balancing loss is computed from.
  bool router_statistics = false;
};

struct ChunkOutput {
  at::Tensor hidden;               // [T, hidden_size], after the final norm, in the compute dtype
  std::vector<at::Tensor> keys;    // per layer [T, kv_heads, head_dim], after k-norm and RoPE
  std::vector<at::Tensor> values;  // per layer [T, kv_heads, head_dim]
  // Linear-attention layers: keys holds the convolution inputs [T, conv_dim] and values is
  // undefined; states the recurrent state after the chunk's last token (undefined at attention
  // layers; empty without linear layers).
  std::vector<at::Tensor> states;
  // Per ChunkInput::state_points entry, the states after that many tokens (per layer, as states).
  std::vector<std::vector<at::Tensor>> point_states;
  // With ChunkInput::router_statistics, summed over the sparse layers, per token [T, num_experts]
  // in the compute dtype: the router's softmax probabilities (differentiable: a gradient seeded
  // here reaches the routers and everything below them) and how many of the layers put each expert
  // in the token's top-k (a constant). Undefined otherwise.
  at::Tensor router_probs, router_counts;
};

// What every layer of one Forward call shares: RoPE tables and the chunk's tree mask.
struct ChunkContext {
  at::Tensor cos, sin;  // [T, 1, R], R = RotaryDim(config) (head_dim without partial rotary)
  at::Tensor key_end;   // [T]
  bool chain = false;   // a plain causal chain (ChunkInput::key_end undefined)
  // Linear-attention layers (none: undefined and empty): the rows each token's convolution reads
  // (ConvAncestorIndex over the context's last conv_context_rows rows) and the chunk's chains.
  at::Tensor conv_index;
  std::vector<TokenRun> runs;
  int64_t conv_context_rows = 0;
  // Per ChunkInput::state_points entry, the run of `runs` that ends there.
  std::vector<int64_t> point_runs;
  bool router_statistics = false;  // ChunkInput::router_statistics
};

struct LayerOutput {
  at::Tensor hidden;                     // [T, hidden_size], the residual stream after the layer
  at::Tensor keys;                       // [T, kv_heads, head_dim]
  at::Tensor values;                     // [T, kv_heads, head_dim]
  at::Tensor state;                      // linear-attention layers (see ChunkOutput)
  std::vector<at::Tensor> point_states;  // per ChunkContext::point_runs entry
  // A sparse layer with ChunkContext::router_statistics: its router's softmax probabilities and
  // top-k indicators [T, num_experts] (see ChunkOutput); undefined otherwise.
  at::Tensor router_probs, router_counts;
};

// How one parameter is split across the tensor-parallel ranks.
// How Logprobs turns hidden states into log-probabilities.
struct LogprobOptions {
  // Rows of the [rows x vocabulary] logits computed at once.
  int64_t slice_rows = 512;
  // log softmax(logits / temperature) (> 0): the sampling temperature of the rollouts.
  double temperature = 1.0;
};

struct ParameterSplit {
  int64_t dim = -1;                 // the split dimension; -1: every rank holds all of it
  std::vector<int64_t> full_shape;  // the whole parameter's shape
  IndexRange range;                 // this rank's part of dimension `dim`
  bool replicated() const { return dim < 0; }
};

class Decoder {
 public:
  // Parameters are allocated (zeros) with `options` (dtype, device) and require grad. With
  // `tensor_parallel` (null or size 1: the whole model), this rank's part of each (see the header
  // comment). TORCH_CHECK when ValidateModelConfig refuses the config (naming the field) or the
  // group's size does not divide both head counts.
  Decoder(const ModelConfig& config, at::TensorOptions options,
          std::shared_ptr<const TensorParallelGroup> tensor_parallel = nullptr);
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;
  Decoder(Decoder&&) = default;
  Decoder& operator=(Decoder&&) = default;

  // Deterministic random weights: matrices and biases ~ N(0, std), norm weights and dt_bias
  // ~ 1 + N(0, std / 4) (zero-centred norms ~ N(0, std / 4)), A_log ~ -2 + N(0, std / 4). Drawn
  // whole on the host's threads and then split, so a seed means the same model at every
  // tensor-parallel size, on every device and however many threads draw it.
  void InitRandom(uint64_t seed, double std = 0.02);

  const ModelConfig& config() const { return config_; }
  at::TensorOptions options() const { return options_; }
  // Every parameter under its Hugging Face name ("model.layers.0.self_attn.q_proj.weight",
  // "...q_proj.bias", ...), in a fixed order (a projection's bias right after its weight); this
  // rank's part of it under tensor parallelism. lm_head.weight is absent when embeddings are tied,
  // q_norm and k_norm without the family's q/k norm, biases where the family has none.
  const std::vector<std::pair<std::string, at::Tensor>>& named_parameters() const { return named_; }
  at::Tensor parameter(const std::string& name) const;

  // Tensor parallelism. Null and 1 without it.
  const TensorParallelGroup* tensor_parallel() const { return tensor_parallel_.get(); }
  int tensor_parallel_size() const { return tensor_parallel_ ? tensor_parallel_->size() : 1; }
  // Per parameter (parallel to named_parameters()), how it is split.
  const std::vector<ParameterSplit>& parameter_splits() const { return splits_; }
  // The heads and KV heads of this rank (all of them without tensor parallelism).
  int64_t local_heads() const { return heads_.size(); }
  int64_t local_kv_heads() const { return kv_heads_.size(); }
  // The whole of parameter `index` (of named_parameters()), detached, on the parameters' device:
  // an all-gather over the tensor-parallel ranks for a split one (every rank must call it, in the
  // same order), the parameter itself otherwise.
  at::Tensor GatherParameter(size_t index) const;
  // What the optimizer's global gradient norm spans (every parameter's split or replication).
  TensorParallelNorm gradient_norm_scope() const;
  // This rank's part of a whole parameter `full` (e.g. read from a checkpoint): a view.
  at::Tensor LocalPart(size_t index, const at::Tensor& full) const;
  // Completes the gradients that backward leaves partial under tensor parallelism (q_norm's and
  // k_norm's, which each rank sees only through its own heads): one all-reduce of all of them,
  // added into their .grad. Every rank calls it once after its backward passes (ComputeGradients
  // does); without tensor parallelism it does nothing.
  void ReduceTensorParallelGradients() const;

  // Runs the decoder over a chunk. Builds an autograd graph iff grad mode is on and something
  // requires grad. TORCH_CHECK on inconsistent shapes.
  ChunkOutput Forward(const ChunkInput& input) const;

  // Forward() in pieces, for schedules that recompute layer by layer (activation checkpointing):
  // Forward = FinalNorm(ForwardLayer(L-1, ... ForwardLayer(0, Embed(tokens)) ...)).
  ChunkContext MakeContext(const ChunkInput& input) const;
  at::Tensor Embed(const at::Tensor& tokens) const;
  LayerOutput ForwardLayer(int64_t layer, const at::Tensor& hidden, const ChunkContext& context,
                           const LayerPrefix& prefix = {}) const;
  // The final RMSNorm, in the compute dtype (float32 for bfloat16 models; see Logprobs).
  at::Tensor FinalNorm(const at::Tensor& hidden) const;

  // log p(targets[i] | hidden[i]) per row, through lm_head and a log-softmax over the vocabulary
  // (of the logits divided by options.temperature) computed options.slice_rows rows at a time:
  // neither forward nor backward ever holds more than slice_rows x vocab logits. With `entropy`,
  // also each row's entropy. Differentiable with respect to hidden and lm_head (or the tied
  // embedding). hidden [N, hidden_size], targets [N]. hidden may be wider than lm_head (FinalNorm's
  // float32 output): it is rounded once to lm_head's dtype for the matmuls, and its gradient is
  // returned in its own dtype.
  at::Tensor Logprobs(const at::Tensor& hidden, const at::Tensor& targets,
                      at::Tensor* entropy = nullptr, const LogprobOptions& options = {}) const;

  // Qwen3-Next's linear-attention (Gated DeltaNet) layers, whose cache is their convolution
  // inputs and a recurrent state (PrefixKv); false at every layer of the other families.
  bool is_linear_layer(int64_t layer) const {
    return !linear_layers_.empty() && linear_layers_[layer];
  }
  bool has_linear_layers() const { return !linear_layers_.empty(); }
  const GatedDeltaNetShape& linear_shape() const { return linear_shape_; }

 private:
  struct Layer {
    at::Tensor input_norm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, post_norm, gate_proj,
        up_proj, down_proj;
    // Undefined where the family has none (core/checkpoint/model_family.h).
    at::Tensor q_bias, k_bias, v_bias, o_bias;
    // A sparse mixture-of-experts layer (IsSparseLayer) has these instead of gate_proj, up_proj
    // and down_proj: the router [E, H] and the experts stacked, [E, I, H], [E, I, H], [E, H, I].
    at::Tensor router, experts_gate, experts_up, experts_down;
    // Qwen3-Next's shared expert beside the routed ones (HasSharedExpert): a SwiGLU MLP [S, H],
    // [S, H], [H, S] and its gate [1, H].
    at::Tensor shared_gate, shared_up, shared_down, shared_expert_gate;
    // A linear-attention layer (is_linear_layer) has these instead of the attention's q/k/v/o
    // projections and q/k norms.
    GatedDeltaNetWeights linear;
  };
  // What a norm multiplies by and where its weight's gradient goes: for zero-centred families
  // (HasZeroCentredNorms) 1 + w in the compute dtype, the gradient into w's .grad; else w itself
  // and an undefined accumulator (the norm functions then use w's .grad).
  struct NormScale {
    at::Tensor weight, accumulator;
  };
  NormScale ScaleOf(const at::Tensor& norm_weight) const;
  // The attention half of a layer (full attention or Gated DeltaNet), on the residual stream h:
  // h plus the mixer's output, with the layer's cache rows (and state).
  LayerOutput AttentionHalf(int64_t layer, const at::Tensor& h, const ChunkContext& context,
                            const LayerPrefix& prefix) const;
  LayerOutput LinearAttentionHalf(int64_t layer, const at::Tensor& h, const ChunkContext& context,
                                  const LayerPrefix& prefix) const;
  // The MLP half: dense SwiGLU or the sparse block (with the shared expert), added to h: sets
  // out.hidden (and, with router statistics, out.router_probs and out.router_counts).
  void MlpHalf(int64_t layer, const at::Tensor& h, const ChunkContext& context,
               LayerOutput& out) const;
  // A parameter of `full_shape`, split along `dim` into `range` (dim -1: whole).
  at::Tensor Add(const std::string& name, std::vector<int64_t> full_shape, int64_t dim = -1,
                 IndexRange range = {});
  // Parameters of [rows, cols] split by rows (dim 0) into `range` like Add's, each its own leaf but
  // stored as consecutive row blocks of one tensor (gate_proj over up_proj): a projection onto all
  // of them is then one GEMM, and their gradients one accumulation (Projections).
  std::vector<at::Tensor> AddStacked(const std::vector<std::string>& names,
                                     const std::vector<std::vector<int64_t>>& full_shapes,
                                     IndexRange range);
  // out_type: the result's dtype; default the weight's.
  // accumulator: where the weight's gradient goes (default: its .grad).
  at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight,
                     std::optional<at::ScalarType> out_type = std::nullopt,
                     const at::Tensor& accumulator = at::Tensor()) const;
  // cos and sin tables [T, head_dim] for the given positions, in the compute dtype (YaRN's
  // attention factor included).
  std::pair<at::Tensor, at::Tensor> Rope(const at::Tensor& positions) const;

  ModelConfig config_;
  at::TensorOptions options_;
  std::shared_ptr<const TensorParallelGroup> tensor_parallel_;
  IndexRange heads_, kv_heads_, intermediate_, moe_intermediate_, vocab_;  // this rank's parts
  at::Tensor embed_, final_norm_, lm_head_;
  at::Tensor inv_freq_;  // RoPE's inverse frequencies [R / 2], compute dtype (rope.h)
  std::vector<Layer> layers_;
  std::vector<std::pair<std::string, at::Tensor>> named_;
  std::vector<ParameterSplit> splits_;
  // Under tensor parallelism, the partial gradients of q_norm and k_norm ([layers, 2, head_dim],
  // the accumulator dtype) until ReduceTensorParallelGradients.
  at::Tensor partial_norm_grads_;
  // Per layer, whether it is a linear-attention layer; empty without any.
  std::vector<bool> linear_layers_;
  GatedDeltaNetShape linear_shape_;
};

// The class's name before it served every family; gone in the next release.
using Qwen3Model [[deprecated("use dta::Decoder")]] = Decoder;

}  // namespace dta

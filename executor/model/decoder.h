// A decoder of the families in core/model/family.h (RMSNorm, RoPE with explicit position
// ids and optional rope scaling, grouped-query attention with Qwen3's q/k norm or without, optional
// q/k/v and o_proj biases, SwiGLU MLP or, in Qwen3-MoE's sparse layers, a top-k routed mixture of
// SwiGLU experts, optional tied embeddings) whose one core call is "forward a chunk of tokens on
// top of a cached prefix" (the chunk's types: chunk_io.h). Every execution method (dense, packed
// tree, push/pop dta) is a schedule over Forward() and Logprobs().
//
// The decoder allocates its parameters from the layer spec (core/model/layer_spec.h: which blocks
// each layer has, every parameter's name, shape and tensor-parallel split) and runs each layer as
// two blocks on the residual stream, each adding its output to it: the attention half
// (blocks/attention_block.h; Gated DeltaNet at Qwen3-Next's linear-attention layers,
// blocks/gated_delta_net_block.h) and the MLP half (dense or sparse, blocks/mlp_blocks.h). The
// blocks are built from the autograd functions of ops/, whose headers give each one's numerics.
//
// Qwen3-Next (qwen3_next, as transformers' Qwen3NextForCausalLM): layers whose layer_types entry
// is "linear_attention" run Gated DeltaNet instead of attention; their cache is the convolution
// inputs (in PrefixKv::keys) and the recurrent state (PrefixKv::states). The other layers are gated
// attention. Every RMSNorm but the gated one scales by 1 + w (transformers' Qwen3NextRMSNorm): the
// kernels get 1 + w in the compute dtype and its gradient goes into w's .grad (ops/numerics.h's
// NormScaleOf). Sparse blocks add a shared SwiGLU expert. Qwen3.5 (qwen3_5_text, qwen3_5_moe_text,
// as transformers' Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM) has the same layers, its Gated
// DeltaNet's input projections separate (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a): the block
// reads both layouts as one (ops/gated_delta_net.h's LinearProjections).
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
// (GraphBytesPerToken in executor/engine/executor.h counts exactly these). Backward adds each
// parameter's gradient straight into its .grad, float32 for bfloat16/float16 parameters
// (ops/numerics.h).
//
// Mixture of experts (Qwen3-MoE's sparse layers, ModelConfig's IsSparseLayer; the block's numerics
// in ops/moe.h): the experts of a layer are stacked parameters, "model.layers.L.mlp.experts.
// gate_proj" and "...up_proj" [E, I, H] and "...down_proj" [E, H, I] (I = moe_intermediate_size),
// beside the router "model.layers.L.mlp.gate.weight" [E, H]; checkpoints hold the Hub's per-expert
// tensors (hf_checkpoint.h). A sparse layer's graph keeps, per token, its k experts' gate and up
// outputs and the routing (the softmax, the top-k weights and indices, the sort). With
// ChunkInput::router_statistics the forward also returns each token's router statistics, from
// which the loss adds the router's load-balancing term (LossOptions::router_aux_loss_coef,
// transformers' aux_loss per rollout).
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
// Qwen3-Next under tensor parallelism: gated attention splits as attention does (q_proj's rows per
// head are [query, gate]). Gated DeltaNet splits by key heads, each with its group of value heads
// (T must divide the key heads): rank r holds its key heads' rows of in_proj_qkvz and in_proj_ba
// (grouped per key head), its part of each of conv1d's three channel segments [q | k | v]
// (TensorParallelSplit::segments; the rank's part is its slice of each, concatenated; Qwen3.5's
// in_proj_qkv alike, its in_proj_z, in_proj_b and in_proj_a by value heads), its value heads'
// dt_bias, A_log and columns of out_proj; the projections are column- and row-parallel as
// above, the mixer runs on the rank's heads (linear_shape() counts them), and its cache (the
// convolution inputs, the recurrent state) holds only them. The gated norm's weight is whole and
// its gradient a partial sum, completed with q_norm's and k_norm's. The shared expert splits like
// a dense MLP; its gate [1, hidden] is whole on every rank, computed alike on each from the whole
// input and the summed expert output, so its weight gradient is whole and its share of the
// input's gradient is added once, after the column-parallel sum (Projections' `replicated`).
//
// Thread safety: Forward and Logprobs are const and may run concurrently (without tensor
// parallelism: its collectives must be issued in the same order on every rank); mutating
// parameters (an optimizer step) must not overlap them. Not copyable (parameters are shared
// tensors).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/model/layer_spec.h"
#include "core/model/model_config.h"
#include "executor/model/blocks/attention_block.h"
#include "executor/model/blocks/block_shared.h"
#include "executor/model/blocks/gated_delta_net_block.h"
#include "executor/model/blocks/mlp_blocks.h"
#include "executor/model/chunk_io.h"
#include "executor/model/ops/fresh_gradients.h"
#include "executor/model/ops/gated_delta_net.h"
#include "executor/parallel/expert_parallel.h"
#include "executor/parallel/tensor_parallel.h"

namespace dta {

// How Logprobs turns hidden states into log-probabilities.
struct LogprobOptions {
  // Rows of the [rows x vocabulary] logits computed at once.
  int64_t slice_rows = 512;
  // log softmax(logits / temperature) (> 0): the sampling temperature of the rollouts.
  double temperature = 1.0;
};

// How one parameter is split across the tensor-parallel ranks (and, for a sparse layer's stacked
// experts, the expert-parallel ranks).
struct ParameterSplit {
  int64_t dim = -1;                 // the split dimension; -1: every rank holds all of it
  std::vector<int64_t> full_shape;  // the whole parameter's shape
  // Dimension `dim` as the layer spec splits it (TensorParallelSplit): consecutive segments of
  // these sizes (one: the whole dimension), each of `units` equal units.
  int64_t units = 0;
  std::vector<int64_t> segments;
  // This rank's part of dimension `dim`: its units of each segment, in the whole dimension's
  // indices (RangesOf this rank), held concatenated in order.
  std::vector<IndexRange> ranges;
  // Stacked experts [E, ...] under expert parallelism: this rank's experts (dimension 0), the
  // tensor-parallel split applying within them; empty otherwise.
  IndexRange experts;
  bool replicated() const { return dim < 0; }
  bool expert_parallel() const { return experts.size() > 0; }
  // What rank `rank` of `ranks` holds of dimension `dim`, as `ranges` is for this rank.
  std::vector<IndexRange> RangesOf(int rank, int ranks) const;
  // This rank's part of `full` along dimension `dim` (full's other dimensions as they are): a view
  // of one range, a concatenation (a copy) of several; `full` itself when replicated.
  at::Tensor Narrow(const at::Tensor& full) const;
};

class Decoder {
 public:
  // Parameters are allocated (zeros) with `options` (dtype, device) and require grad. With
  // `tensor_parallel` (null or size 1: the whole model), this rank's part of each (see the header
  // comment). With `expert_parallel` (null or size 1: every expert), this rank's block of every
  // sparse layer's experts (ExpertRange), whose tokens the EP ranks exchange (ops/moe.h): every EP
  // rank must then run the same sequence of forward and backward calls. TORCH_CHECK when
  // ValidateModelConfig refuses the config (naming the field), the group's size does not divide
  // the KV heads (and so the heads) or the linear-attention layers' key heads (and so their value
  // heads), naming them, or the EP group is larger than the number of experts.
  Decoder(const ModelConfig& config, at::TensorOptions options,
          std::shared_ptr<const TensorParallelGroup> tensor_parallel = nullptr,
          std::shared_ptr<const ExpertParallelGroup> expert_parallel = nullptr);
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
  // Every parameter of the layer spec (core/model/layer_spec.h's BuildModelSpec(config())
  // .Parameters(), in its order: a projection's bias right after its weight) under its name
  // ("model.layers.0.self_attn.q_proj.weight", "...q_proj.bias", ...); this rank's part of it
  // under tensor parallelism. lm_head.weight is absent when embeddings are tied,
  // q_norm and k_norm without the family's q/k norm, biases where the family has none.
  const std::vector<std::pair<std::string, at::Tensor>>& named_parameters() const { return named_; }
  at::Tensor parameter(const std::string& name) const;

  // Expert parallelism. Null and 1 without it.
  const ExpertParallelGroup* expert_parallel() const { return expert_parallel_.get(); }
  int expert_parallel_size() const { return expert_parallel_ ? expert_parallel_->size() : 1; }

  // Tensor parallelism. Null and 1 without it.
  const TensorParallelGroup* tensor_parallel() const { return tensor_parallel_.get(); }
  int tensor_parallel_size() const { return tensor_parallel_ ? tensor_parallel_->size() : 1; }
  // Per parameter (parallel to named_parameters()), how it is split.
  const std::vector<ParameterSplit>& parameter_splits() const { return splits_; }
  // The heads and KV heads of this rank (all of them without tensor parallelism).
  int64_t local_heads() const { return heads_.size(); }
  int64_t local_kv_heads() const { return kv_heads_.size(); }
  // The whole of parameter `index` (of named_parameters()), detached, on the parameters' device:
  // an all-gather over the tensor-parallel ranks for a split one, and over the expert-parallel
  // ranks for experts (every rank of those groups must call it, in the same order), the parameter
  // itself otherwise.
  at::Tensor GatherParameter(size_t index) const;
  // What the optimizer's global gradient norm spans (every parameter's split or replication).
  TensorParallelNorm gradient_norm_scope() const;
  // This rank's part of a whole parameter `full` (e.g. read from a checkpoint): a view, or a copy
  // for a segmented split (ParameterSplit::Narrow).
  at::Tensor LocalPart(size_t index, const at::Tensor& full) const;
  // Completes the gradients that backward leaves partial under tensor parallelism (q_norm's and
  // k_norm's, and the Gated DeltaNet's gated norm's, which each rank sees only through its own
  // heads): one all-reduce of all of them, added into their .grad. Every rank calls it once after
  // its backward passes (ComputeGradients does); without tensor parallelism it does nothing.
  void ReduceTensorParallelGradients() const;
  // Bytes of the gradients backward will create: each parameter without a .grad yet gets one, in
  // its accumulator dtype (GradAccumulator in ops/numerics.h), during its first backward. What a
  // step sized from the device's free memory must leave for them (0 once every .grad exists).
  int64_t UncreatedGradientBytes() const;
  // Starts a run whose gradients replace what .grad holds instead of adding to it
  // (ExecutorOptions::replace_gradients): every defined gradient is zeroed (one fused pass), except
  // the sparse layers' stacked experts', which `fresh` marks instead (ops/fresh_gradients.h) and
  // whose first backward writes them whole; graphs built until StartFreshGradients(nullptr) carry
  // `fresh`, which must outlive them. Undefined gradients stay undefined (created as zeros).
  void StartFreshGradients(FreshGradients* fresh) const;

  // Runs the decoder over a chunk. Builds an autograd graph iff grad mode is on and something
  // requires grad. TORCH_CHECK on inconsistent shapes.
  ChunkOutput Forward(const ChunkInput& input) const;

  // Forward() in pieces, for schedules that recompute layer by layer (activation checkpointing):
  // Forward = FinalNorm(ForwardLayer(L-1, ... ForwardLayer(0, Embed(tokens)) ...)).
  ChunkContext MakeContext(const ChunkInput& input) const;
  at::Tensor Embed(const at::Tensor& tokens) const;
  LayerOutput ForwardLayer(int64_t layer, const at::Tensor& hidden, const ChunkContext& context,
                           const LayerPrefix& prefix = {}) const;
  // Expert parallelism's empty call (executor/engine/lockstep.h): the MLP blocks of the sparse
  // layers alone, on zero tokens, in layer order, each fed the previous one's output (so that a
  // backward from the result runs them last layer first, as a real call's backward does). Their
  // expert-parallel collectives are a real call's, and this rank's experts serve the other ranks'
  // rows; the rest of the model is skipped on every rank of the tensor-parallel group alike. Only
  // sparse layer `layer` when >= 0 (layer-by-layer recomputation). Returns [0, hidden_size] in the
  // compute dtype, with a graph iff grad mode is on.
  at::Tensor ForwardSparseLayersOnEmpty(int64_t layer = -1) const;
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
  // Their sizes, with this rank's key and value heads (all of them without tensor parallelism).
  const GatedDeltaNetShape& linear_shape() const { return linear_shape_; }

 private:
  struct Layer {
    at::Tensor input_norm, post_norm;
    // The attention half's weights; a linear-attention layer (is_linear_layer) has `linear`
    // instead.
    AttentionWeights attention;
    GatedDeltaNetWeights linear;
    // Dense or sparse (IsSparseLayer).
    MlpWeights mlp;
    int64_t sparse_index = -1;  // among the sparse layers; -1 for a dense MLP
  };
  // What layer `layer`'s blocks share with the decoder (pointing into it).
  BlockShared SharedWithBlocks(int64_t layer) const;
  // Where a layer parameter of `role` goes.
  static at::Tensor* Slot(Layer& layer, ParameterRole role);
  // How `spec` is split, this rank's part of it included.
  ParameterSplit SplitOf(const ParameterSpec& spec) const;
  // The parameter `spec` describes, this rank's part of it, zeros.
  at::Tensor Add(const ParameterSpec& spec);
  // Two [rows, cols] parameters split alike by rows (gate_proj and up_proj), each its own leaf but
  // stored as consecutive row blocks of one tensor: a projection onto both is then one GEMM, and
  // their gradients one accumulation (Projections).
  std::vector<at::Tensor> AddStacked(const ParameterSpec& first, const ParameterSpec& second);
  // cos and sin tables [T, R] (R = RotaryDim(config)) for the given positions, in the compute dtype
  // (YaRN's attention factor included).
  std::pair<at::Tensor, at::Tensor> Rope(const at::Tensor& positions) const;

  ModelConfig config_;
  at::TensorOptions options_;
  std::shared_ptr<const TensorParallelGroup> tensor_parallel_;
  std::shared_ptr<const ExpertParallelGroup> expert_parallel_;
  IndexRange experts_;  // this rank's experts (all of them without expert parallelism)
  IndexRange heads_, kv_heads_, intermediate_, moe_intermediate_, vocab_;  // this rank's parts
  at::Tensor embed_, final_norm_, lm_head_;
  at::Tensor inv_freq_;  // RoPE's inverse frequencies [R / 2], compute dtype (ops/rope.h)
  std::vector<Layer> layers_;
  std::vector<std::pair<std::string, at::Tensor>> named_;
  std::vector<ParameterSplit> splits_;
  // Under tensor parallelism, the partial gradients of the norm weights the ranks see through
  // their own heads only, until ReduceTensorParallelGradients: one buffer (the accumulator dtype),
  // and per layer a view of it (BlockShared::partial_norm_grads; undefined for a layer without).
  at::Tensor partial_norm_grads_;
  std::vector<at::Tensor> layer_partial_norm_grads_;
  // During a run that replaces gradients, its marks (StartFreshGradients); null otherwise. Mutable:
  // which run the graphs belong to, not the model's state.
  mutable FreshGradients* fresh_gradients_ = nullptr;
  // Per layer, whether it is a linear-attention layer; empty without any.
  std::vector<bool> linear_layers_;
  GatedDeltaNetShape linear_shape_;
};

// The class's name before it served every family; gone in the next release.
using Qwen3Model [[deprecated("use dta::Decoder")]] = Decoder;

}  // namespace dta

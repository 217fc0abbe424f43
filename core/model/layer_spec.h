// The decoder's architecture worked out once, without LibTorch: per layer its blocks (the token
// mixer, the MLP, the norm) and one list of every parameter with its Hugging Face name, whole
// shape and tensor-parallel split, in the order the decoder holds them. The decoder
// (executor/model/decoder.h) allocates from it, CountParameters (core/layout/memory_plan.h) sums
// it, the Hugging Face checkpoint code maps its names, and the activation-memory estimates
// (GraphBytesPerToken, EstimateExecutorMemory) add up its blocks' saved bytes (LayerSavedBytes).
//
// A family is a combination of these blocks (core/model/family.h's traits pick them); a new block
// kind is added here, in the decoder's blocks (executor/model/blocks/) and in LayerSavedBytes.
//
// Example:
//   const ModelSpec spec = BuildModelSpec(*ModelPreset("qwen3-8b"));
//   for (const ParameterSpec& p : spec.Parameters()) std::cout << p.name << "\n";
//
// Thread safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/model/model_config.h"

namespace dta {

// A layer's token mixer.
enum class MixerKind {
  kAttention,       // softmax attention over K/V (grouped-query, RoPE, optional q/k norms)
  kGatedAttention,  // the same, its output multiplied by sigmoid of a per-head gate (Qwen3-Next)
  kGatedDeltaNet,   // Gated DeltaNet linear attention (Qwen3-Next's and Qwen3.5's linear layers)
};

// A layer's MLP.
enum class MlpKind {
  kSwiGlu,                     // down(silu(gate x) * up x)
  kSparseMoe,                  // a router and top-k routed SwiGLU experts
  kSparseMoeWithSharedExpert,  // the same plus a SwiGLU shared expert scaled by a sigmoid gate
};

// The RMSNorms' scale.
enum class NormKind {
  kRms,             // x / rms(x) * w
  kZeroCentredRms,  // x / rms(x) * (1 + w), w stored zero-centred (Qwen3NextRMSNorm)
};

// What a parameter is to the decoder (which tensor of which block it fills).
enum class ParameterRole {
  kEmbedding,
  kFinalNorm,
  kLmHead,
  kInputNorm,
  kPostNorm,
  kQProj,
  kQBias,
  kKProj,
  kKBias,
  kVProj,
  kVBias,
  kOProj,
  kOBias,
  kQNorm,
  kKNorm,
  kLinearInProjQkvz,  // Qwen3-Next's, grouped per key head
  kLinearInProjBa,
  kLinearInProjQkv,  // Qwen3.5's: [q | k | v], as conv1d's channels
  kLinearInProjZ,
  kLinearInProjB,
  kLinearInProjA,
  kLinearConv1d,
  kLinearDtBias,
  kLinearALog,
  kLinearNorm,
  kLinearOutProj,
  kGateProj,
  kUpProj,
  kDownProj,
  kRouter,
  kExpertsGate,
  kExpertsUp,
  kExpertsDown,
  kSharedGate,
  kSharedUp,
  kSharedDown,
  kSharedExpertGate,
};

// How a parameter is split across T tensor-parallel ranks: dimension `dim` is `units` equal units
// (heads, rows, vocabulary entries) and rank r holds the contiguous units SplitRange(units, r, T)
// (executor/parallel/tensor_parallel.h: the larger parts first). With `segments`, dimension `dim`
// is consecutive segments of those sizes (summing to it), each of `units` equal units split alike,
// and rank r holds its units of every segment, concatenated in order: Gated DeltaNet's conv1d,
// whose channels are [q | k | v], each by key heads (and Qwen3.5's in_proj_qkv, whose rows are
// those channels). dim -1: every rank holds all of it.
struct TensorParallelSplit {
  int dim = -1;
  int64_t units = 0;
  std::vector<int64_t> segments = {};  // empty: one segment, the whole dimension
  bool replicated() const { return dim < 0; }
  bool operator==(const TensorParallelSplit&) const = default;
};

struct ParameterSpec {
  // Its name, the Hugging Face name where transformers has one tensor ("model.layers.0.self_attn.
  // q_proj.weight"); a sparse layer's experts are stacked, [E, ...], as
  // "model.layers.L.mlp.experts.gate_proj" (and up_proj, down_proj).
  std::string name;
  ParameterRole role;
  std::vector<int64_t> shape;  // the whole parameter's
  TensorParallelSplit split;

  int64_t numel() const;
  // The sizes of the segments along split.dim: split.segments, or the whole dimension as one
  // segment. Empty when replicated.
  std::vector<int64_t> SplitSegments() const;
  // Whether Hugging Face checkpoints hold it as one tensor per expert (the stacked experts).
  bool per_expert() const;
  // Its tensors in a Hugging Face checkpoint, as the Hub and transformers' save_pretrained store
  // them: its own name, or for the stacked experts "model.layers.L.mlp.experts.<e>.gate_proj.
  // weight" (up_proj, down_proj) for e in [0, E), each of shape[1:].
  std::vector<std::string> CheckpointNames() const;
};

struct LayerSpec {
  int64_t index = 0;
  MixerKind mixer = MixerKind::kAttention;
  MlpKind mlp = MlpKind::kSwiGlu;
  NormKind norm = NormKind::kRms;
  bool qk_norm = false;  // attention: per-head RMSNorm of q and k before RoPE
  bool qkv_bias = false;
  bool o_bias = false;
  // Whether the decoder can split this layer across tensor-parallel ranks (every block kind can;
  // a block without a split would set it false, and the decoder and the layout planner would then
  // refuse a tensor-parallel size above 1 for its models).
  bool tensor_parallel = true;
  // In the decoder's order: input norm, the mixer's, post-attention norm, the MLP's (a dense MLP's
  // gate_proj and up_proj adjacent: the decoder stores them as one tensor).
  std::vector<ParameterSpec> parameters;

  bool sparse() const { return mlp != MlpKind::kSwiGlu; }
  bool linear_attention() const { return mixer == MixerKind::kGatedDeltaNet; }
};

struct ModelSpec {
  ParameterSpec embedding;
  std::vector<LayerSpec> layers;
  ParameterSpec final_norm;
  bool tied_embeddings = false;  // lm_head is the embedding (no parameter of its own)
  ParameterSpec lm_head;         // unset (empty name) when tied

  // Every parameter in the decoder's order: the embedding, each layer's, the final norm, lm_head.
  std::vector<ParameterSpec> Parameters() const;
  bool tensor_parallel() const;  // every layer's tensor_parallel
};

// The spec of a config ValidateModelConfig accepts (the result for another is unspecified).
ModelSpec BuildModelSpec(const ModelConfig& config);
LayerSpec BuildLayerSpec(const ModelConfig& config, int64_t layer);

// What autograd keeps of one layer for one token on one of T tensor-parallel ranks, in bytes, with
// parameters of `element_bytes` (2 for bfloat16) and a compute type of max(element_bytes, 4):
//   tensors:    the saved activations (see each block in executor/model/blocks/): the two
//               residual-stream norm inputs (compute type); attention's q and k before their norms
//               (with q/k norms) and after RoPE, v, the output (and the gate and gated output of
//               gated attention); a Gated DeltaNet layer's estimate (executor/model/ops/
//               gated_delta_net.h's eager autograd, measured within 0.3%); a dense MLP's gate and
//               up; a sparse MLP's k experts' gate and up, the router's softmax and top-k weights,
//               4 k int64 indices, and a shared expert's gate, up, sigmoid gate and scaled output;
//               under expert parallelism (E ranks > 1) also the rows the expert side served and
//               keeps (k hidden-size rows per token on average, other ranks' tokens it cannot
//               recompute) and their two int64 permutations.
//   statistics: an attention layer's per-row norm statistics (the two residual norms' 1/rms, q's
//               and k's per head) and log-sum-exp per head (compute type); a Gated DeltaNet
//               layer's are in its tensors.
//   mlp_width:  the widest [T, x] of the MLP's backward (intermediate slice, or k experts' or the
//               shared expert's).
//   cache:      the elements per token a later chunk reads back (K and V, or the convolution
//               inputs of a Gated DeltaNet layer).
struct BlockSavedBytes {
  int64_t tensors = 0;
  int64_t statistics = 0;
  int64_t mlp_width = 0;
  int64_t cache = 0;
};
BlockSavedBytes LayerSavedBytes(const ModelConfig& config, const LayerSpec& layer,
                                int64_t element_bytes, int64_t tensor_parallel,
                                int64_t expert_parallel = 1);

}  // namespace dta

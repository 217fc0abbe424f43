#include "core/model/layer_spec.h"

#include <algorithm>
#include <string_view>
#include <utility>

namespace dta {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The delta rule's chunk (ChunkedGatedDeltaRule's chunk_size).
constexpr int64_t kDeltaRuleChunk = 64;

class LayerBuilder {
 public:
  LayerBuilder(LayerSpec& layer, std::string prefix) : layer_(layer), prefix_(std::move(prefix)) {}

  void Add(const std::string& name, ParameterRole role, std::vector<int64_t> shape, int dim = -1,
           int64_t units = 0, std::vector<int64_t> segments = {}) {
    layer_.parameters.push_back(
        {.name = prefix_ + name,
         .role = role,
         .shape = std::move(shape),
         .split = {.dim = dim, .units = units, .segments = std::move(segments)}});
  }

 private:
  LayerSpec& layer_;
  std::string prefix_;
};

void AddAttention(const ModelConfig& c, LayerSpec& layer, LayerBuilder& add) {
  const int64_t hidden = c.hidden_size;
  const int64_t heads = c.num_attention_heads;
  const int64_t kv_heads = c.num_key_value_heads;
  const int64_t q_dim = heads * c.head_dim;
  const int64_t kv_dim = kv_heads * c.head_dim;
  // Gated attention: q_proj's rows are each head's query and output gate, [q_h, gate_h] per head.
  const int64_t q_rows = layer.mixer == MixerKind::kGatedAttention ? 2 * q_dim : q_dim;
  // Column-parallel biases split as their projection's rows; o_proj's is whole on every rank.
  add.Add("self_attn.q_proj.weight", ParameterRole::kQProj, {q_rows, hidden}, 0, heads);
  if (layer.qkv_bias) add.Add("self_attn.q_proj.bias", ParameterRole::kQBias, {q_rows}, 0, heads);
  add.Add("self_attn.k_proj.weight", ParameterRole::kKProj, {kv_dim, hidden}, 0, kv_heads);
  if (layer.qkv_bias) {
    add.Add("self_attn.k_proj.bias", ParameterRole::kKBias, {kv_dim}, 0, kv_heads);
  }
  add.Add("self_attn.v_proj.weight", ParameterRole::kVProj, {kv_dim, hidden}, 0, kv_heads);
  if (layer.qkv_bias) {
    add.Add("self_attn.v_proj.bias", ParameterRole::kVBias, {kv_dim}, 0, kv_heads);
  }
  add.Add("self_attn.o_proj.weight", ParameterRole::kOProj, {hidden, q_dim}, 1, heads);
  if (layer.o_bias) add.Add("self_attn.o_proj.bias", ParameterRole::kOBias, {hidden});
  if (layer.qk_norm) {
    add.Add("self_attn.q_norm.weight", ParameterRole::kQNorm, {c.head_dim});
    add.Add("self_attn.k_norm.weight", ParameterRole::kKNorm, {c.head_dim});
  }
}

// Gated DeltaNet, named as transformers' Qwen3NextGatedDeltaNet (or Qwen3_5GatedDeltaNet), split
// by key heads (each with its group of value heads): Qwen3-Next's input projections' rows are
// grouped per key head; conv1d's channels, and Qwen3.5's in_proj_qkv's rows, are [all q | all k |
// all v] (three segments); Qwen3.5's in_proj_z, in_proj_b and in_proj_a, dt_bias, A_log and
// out_proj's columns are per value head (a rank's key heads own a contiguous block of them); the
// gated norm's weight is shared by the heads (whole on every rank).
void AddGatedDeltaNet(const ModelConfig& c, LayerBuilder& add) {
  const int64_t hidden = c.hidden_size;
  const int64_t key_heads = c.linear_num_key_heads;
  const int64_t value_heads = c.linear_num_value_heads;
  const int64_t key_dim = key_heads * c.linear_key_head_dim;
  const int64_t value_dim = value_heads * c.linear_value_head_dim;
  const int64_t conv_dim = 2 * key_dim + value_dim;
  const std::vector<int64_t> qkv_segments = {key_dim, key_dim, value_dim};
  if (HasSeparateLinearProjections(c)) {
    add.Add("linear_attn.in_proj_qkv.weight", ParameterRole::kLinearInProjQkv, {conv_dim, hidden},
            0, key_heads, qkv_segments);
    add.Add("linear_attn.in_proj_z.weight", ParameterRole::kLinearInProjZ, {value_dim, hidden}, 0,
            value_heads);
    add.Add("linear_attn.in_proj_b.weight", ParameterRole::kLinearInProjB, {value_heads, hidden}, 0,
            value_heads);
    add.Add("linear_attn.in_proj_a.weight", ParameterRole::kLinearInProjA, {value_heads, hidden}, 0,
            value_heads);
  } else {
    add.Add("linear_attn.in_proj_qkvz.weight", ParameterRole::kLinearInProjQkvz,
            {2 * key_dim + 2 * value_dim, hidden}, 0, key_heads);
    add.Add("linear_attn.in_proj_ba.weight", ParameterRole::kLinearInProjBa,
            {2 * value_heads, hidden}, 0, key_heads);
  }
  add.Add("linear_attn.conv1d.weight", ParameterRole::kLinearConv1d,
          {conv_dim, 1, c.linear_conv_kernel_dim}, 0, key_heads, qkv_segments);
  add.Add("linear_attn.dt_bias", ParameterRole::kLinearDtBias, {value_heads}, 0, value_heads);
  add.Add("linear_attn.A_log", ParameterRole::kLinearALog, {value_heads}, 0, value_heads);
  add.Add("linear_attn.norm.weight", ParameterRole::kLinearNorm, {c.linear_value_head_dim});
  add.Add("linear_attn.out_proj.weight", ParameterRole::kLinearOutProj, {hidden, value_dim}, 1,
          value_heads);
}

void AddMlp(const ModelConfig& c, const LayerSpec& layer, LayerBuilder& add) {
  const int64_t hidden = c.hidden_size;
  if (!layer.sparse()) {
    const int64_t inter = c.intermediate_size;
    add.Add("mlp.gate_proj.weight", ParameterRole::kGateProj, {inter, hidden}, 0, inter);
    add.Add("mlp.up_proj.weight", ParameterRole::kUpProj, {inter, hidden}, 0, inter);
    add.Add("mlp.down_proj.weight", ParameterRole::kDownProj, {hidden, inter}, 1, inter);
    return;
  }
  // The experts stacked per layer (the checkpoint code maps them to the Hub's per-expert tensors);
  // each rank holds a slice of every expert's intermediate rows and the whole router.
  const int64_t experts = c.num_experts;
  const int64_t moe = c.moe_intermediate_size;
  add.Add("mlp.experts.gate_proj", ParameterRole::kExpertsGate, {experts, moe, hidden}, 1, moe);
  add.Add("mlp.experts.up_proj", ParameterRole::kExpertsUp, {experts, moe, hidden}, 1, moe);
  add.Add("mlp.experts.down_proj", ParameterRole::kExpertsDown, {experts, hidden, moe}, 2, moe);
  add.Add("mlp.gate.weight", ParameterRole::kRouter, {experts, hidden});
  if (layer.mlp == MlpKind::kSparseMoeWithSharedExpert) {
    // Split like a dense MLP, its gate whole like the router.
    const int64_t shared = c.shared_expert_intermediate_size;
    add.Add("mlp.shared_expert.gate_proj.weight", ParameterRole::kSharedGate, {shared, hidden}, 0,
            shared);
    add.Add("mlp.shared_expert.up_proj.weight", ParameterRole::kSharedUp, {shared, hidden}, 0,
            shared);
    add.Add("mlp.shared_expert.down_proj.weight", ParameterRole::kSharedDown, {hidden, shared}, 1,
            shared);
    add.Add("mlp.shared_expert_gate.weight", ParameterRole::kSharedExpertGate, {1, hidden});
  }
}

}  // namespace

int64_t ParameterSpec::numel() const {
  int64_t n = 1;
  for (const int64_t size : shape) n *= size;
  return n;
}

std::vector<int64_t> ParameterSpec::SplitSegments() const {
  if (split.replicated()) return {};
  if (!split.segments.empty()) return split.segments;
  return {shape[split.dim]};
}

bool ParameterSpec::per_expert() const {
  return role == ParameterRole::kExpertsGate || role == ParameterRole::kExpertsUp ||
         role == ParameterRole::kExpertsDown;
}

std::vector<std::string> ParameterSpec::CheckpointNames() const {
  if (!per_expert()) return {name};
  constexpr std::string_view kExperts = ".mlp.experts.";
  const size_t at = name.rfind(kExperts) + kExperts.size();
  const std::string prefix = name.substr(0, at);
  const std::string projection = name.substr(at);
  std::vector<std::string> names;
  for (int64_t e = 0; e < shape[0]; ++e) {
    names.push_back(prefix + std::to_string(e) + "." + projection + ".weight");
  }
  return names;
}

LayerSpec BuildLayerSpec(const ModelConfig& c, int64_t index) {
  LayerSpec layer;
  layer.index = index;
  if (IsLinearAttentionLayer(c, index)) {
    layer.mixer = MixerKind::kGatedDeltaNet;
  } else {
    layer.mixer = HasGatedAttention(c) ? MixerKind::kGatedAttention : MixerKind::kAttention;
    layer.qk_norm = HasQkNorm(c);
    layer.qkv_bias = c.attention_bias;
    layer.o_bias = HasOProjBias(c);
  }
  if (IsSparseLayer(c, index)) {
    layer.mlp = HasSharedExpert(c) ? MlpKind::kSparseMoeWithSharedExpert : MlpKind::kSparseMoe;
  }
  layer.norm = HasZeroCentredNorms(c) ? NormKind::kZeroCentredRms : NormKind::kRms;

  LayerBuilder add(layer, "model.layers." + std::to_string(index) + ".");
  const int64_t hidden = c.hidden_size;
  add.Add("input_layernorm.weight", ParameterRole::kInputNorm, {hidden});
  if (layer.linear_attention()) {
    AddGatedDeltaNet(c, add);
  } else {
    AddAttention(c, layer, add);
  }
  add.Add("post_attention_layernorm.weight", ParameterRole::kPostNorm, {hidden});
  AddMlp(c, layer, add);
  return layer;
}

ModelSpec BuildModelSpec(const ModelConfig& c) {
  ModelSpec spec;
  const int64_t hidden = c.hidden_size;
  const TensorParallelSplit by_vocabulary = {.dim = 0, .units = c.vocab_size};
  spec.embedding = {.name = "model.embed_tokens.weight",
                    .role = ParameterRole::kEmbedding,
                    .shape = {c.vocab_size, hidden},
                    .split = by_vocabulary};
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    spec.layers.push_back(BuildLayerSpec(c, layer));
  }
  spec.final_norm = {.name = "model.norm.weight",
                     .role = ParameterRole::kFinalNorm,
                     .shape = {hidden},
                     .split = {}};
  spec.tied_embeddings = c.tie_word_embeddings;
  if (!spec.tied_embeddings) {
    spec.lm_head = {.name = "lm_head.weight",
                    .role = ParameterRole::kLmHead,
                    .shape = {c.vocab_size, hidden},
                    .split = by_vocabulary};
  }
  return spec;
}

std::vector<ParameterSpec> ModelSpec::Parameters() const {
  std::vector<ParameterSpec> all = {embedding};
  for (const LayerSpec& layer : layers) {
    all.insert(all.end(), layer.parameters.begin(), layer.parameters.end());
  }
  all.push_back(final_norm);
  if (!tied_embeddings) all.push_back(lm_head);
  return all;
}

bool ModelSpec::tensor_parallel() const {
  return std::all_of(layers.begin(), layers.end(),
                     [](const LayerSpec& layer) { return layer.tensor_parallel; });
}

BlockSavedBytes LayerSavedBytes(const ModelConfig& c, const LayerSpec& layer, int64_t element_bytes,
                                int64_t tensor_parallel, int64_t expert_parallel) {
  const int64_t tp = std::max<int64_t>(tensor_parallel, 1);
  const int64_t w = std::max<int64_t>(element_bytes, 1);
  const int64_t compute = std::max<int64_t>(w, 4);  // float32 (float64 for float64 models)
  const int64_t h = c.hidden_size;
  BlockSavedBytes bytes;
  // The two residual-stream norm inputs, whole on every rank.
  bytes.tensors = 2 * h * compute;
  if (layer.linear_attention()) {
    // Gated DeltaNet, on this rank's key and value heads: out_proj's input (value_dim w), the
    // convolution's input (conv_dim w; its taps and pre-activation are recomputed in backward) and
    // output (conv_dim w: q and k's L2 norms keep views of it) and z (value_dim w, kept by the
    // gated norm); in the compute type the delta rule's per-head q, k, k beta, their decayed and
    // solved forms (6 value_heads key_head_dim), v, the solved values and the output (3
    // value_dim), the chunk-local decay and attention matrices (5 value_heads x 64) and a few
    // per-head scalars (10 value_heads, which cover the norms' statistics); not the recurrent
    // states or the corrected values, which backward recomputes (kernels/chunk_state_recurrence.h's
    // ChunkStateOutput). About 4x a gated attention layer's bytes for Qwen3-Next-80B-A3B's shapes.
    const int64_t value_heads = c.linear_num_value_heads / tp;
    const int64_t key_dim = c.linear_num_key_heads / tp * c.linear_key_head_dim;
    const int64_t value_dim = value_heads * c.linear_value_head_dim;
    const int64_t conv_dim = 2 * key_dim + value_dim;
    bytes.tensors += 2 * (value_dim + conv_dim) * w +
                     compute * (6 * value_heads * c.linear_key_head_dim + 3 * value_dim +
                                5 * value_heads * kDeltaRuleChunk + 10 * value_heads);
    bytes.cache = conv_dim;
  } else {
    // This rank's heads: q and k after RoPE, v, the attention output; q and k before their norms;
    // gated attention's gate and gated output. The residual norms' 1/rms, and per head the
    // log-sum-exp and q's and k's 1/rms.
    const int64_t heads = c.num_attention_heads / tp;
    const int64_t kv_heads = c.num_key_value_heads / tp;
    const int64_t q = heads * c.head_dim;
    const int64_t kv = kv_heads * c.head_dim;
    const int64_t pre_norm = layer.qk_norm ? q + kv : 0;
    const int64_t gated = layer.mixer == MixerKind::kGatedAttention ? 2 * q : 0;
    bytes.tensors += (2 * q + 2 * kv + pre_norm + gated) * w;
    bytes.statistics = compute * (2 + heads + (layer.qk_norm ? heads + kv_heads : 0));
    bytes.cache = 2 * kv;
  }
  if (!layer.sparse()) {
    const int64_t intermediate = CeilDiv(c.intermediate_size, tp);
    bytes.tensors += 2 * intermediate * w;  // gate and up
    bytes.mlp_width = intermediate;
    return bytes;
  }
  // The k experts' gate and up (this rank's slice), the router's softmax over the experts and the
  // k routing weights, the top-k indices, the sort, its inverse and each pair's token (int64).
  const int64_t k = c.num_experts_per_tok;
  const int64_t expert = CeilDiv(c.moe_intermediate_size, tp);
  bytes.tensors += 2 * k * expert * w + (c.num_experts + k) * compute +
                   4 * k * static_cast<int64_t>(sizeof(int64_t));
  // Under expert parallelism the rows this rank's experts served, whole hidden size, and the
  // permutations between source and expert order (ops/moe.h): k per token when the experts are
  // balanced.
  if (expert_parallel > 1) bytes.tensors += k * (h * w + 2 * static_cast<int64_t>(sizeof(int64_t)));
  bytes.mlp_width = k * expert;
  if (layer.mlp == MlpKind::kSparseMoeWithSharedExpert) {
    // Its gate and up, its sigmoid gate and the [h] output it scales.
    const int64_t shared = CeilDiv(c.shared_expert_intermediate_size, tp);
    bytes.tensors += 2 * shared * w + h * compute + compute;
    bytes.mlp_width = std::max(bytes.mlp_width, shared);
  }
  return bytes;
}

}  // namespace dta

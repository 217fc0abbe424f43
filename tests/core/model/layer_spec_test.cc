// The layer spec (core/model/layer_spec.h) against the families' configs: which blocks each layer
// has, every parameter's name, shape and tensor-parallel split, the saved bytes of each block; and
// a family that exists only in the tests (tests/testing/test_family.h), registered at run time,
// through config.json, presets and the spec. The decoder's own parameters against the spec, for
// every preset: tests/executor/model/layer_spec_decoder_test.
#include "core/model/layer_spec.h"

#include <algorithm>
#include <set>
#include <string>

#include "core/model/config_json.h"
#include "core/model/family.h"
#include "core/model/model_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/test_family.h"

namespace dta {
namespace {

using ::testing::HasSubstr;

ModelConfig Small(const std::string& model_type) {
  ModelConfig c;
  c.model_type = model_type;
  c.vocab_size = 37;
  c.hidden_size = 24;
  c.intermediate_size = 40;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  return c;
}

std::vector<std::string> Names(const LayerSpec& layer) {
  std::vector<std::string> names;
  for (const ParameterSpec& p : layer.parameters) names.push_back(p.name);
  return names;
}

TEST(LayerSpec, Qwen3LayerIsAttentionWithQkNormsAndASwiGlu) {
  const LayerSpec layer = BuildLayerSpec(Small("qwen3"), 2);
  EXPECT_EQ(layer.mixer, MixerKind::kAttention);
  EXPECT_EQ(layer.mlp, MlpKind::kSwiGlu);
  EXPECT_EQ(layer.norm, NormKind::kRms);
  EXPECT_TRUE(layer.qk_norm);
  EXPECT_FALSE(layer.qkv_bias);
  EXPECT_TRUE(layer.tensor_parallel);
  EXPECT_EQ(Names(layer), (std::vector<std::string>{
                              "model.layers.2.input_layernorm.weight",
                              "model.layers.2.self_attn.q_proj.weight",
                              "model.layers.2.self_attn.k_proj.weight",
                              "model.layers.2.self_attn.v_proj.weight",
                              "model.layers.2.self_attn.o_proj.weight",
                              "model.layers.2.self_attn.q_norm.weight",
                              "model.layers.2.self_attn.k_norm.weight",
                              "model.layers.2.post_attention_layernorm.weight",
                              "model.layers.2.mlp.gate_proj.weight",
                              "model.layers.2.mlp.up_proj.weight",
                              "model.layers.2.mlp.down_proj.weight",
                          }));
  // q_proj [heads * head_dim, hidden] split by heads, o_proj by its columns, the MLP by rows.
  EXPECT_EQ(layer.parameters[1].shape, (std::vector<int64_t>{32, 24}));
  EXPECT_EQ(layer.parameters[1].split, (TensorParallelSplit{.dim = 0, .units = 4}));
  EXPECT_EQ(layer.parameters[2].split, (TensorParallelSplit{.dim = 0, .units = 2}));
  EXPECT_EQ(layer.parameters[4].split, (TensorParallelSplit{.dim = 1, .units = 4}));
  EXPECT_TRUE(layer.parameters[5].split.replicated());
  EXPECT_EQ(layer.parameters[10].shape, (std::vector<int64_t>{24, 40}));
  EXPECT_EQ(layer.parameters[10].split, (TensorParallelSplit{.dim = 1, .units = 40}));
}

TEST(LayerSpec, BiasesFollowTheFamily) {
  const LayerSpec qwen2 = BuildLayerSpec(
      [] {
        ModelConfig c = Small("qwen2");
        c.attention_bias = true;
        return c;
      }(),
      0);
  EXPECT_FALSE(qwen2.qk_norm);
  EXPECT_TRUE(qwen2.qkv_bias);
  EXPECT_FALSE(qwen2.o_bias);
  ModelConfig llama = Small("llama");
  llama.attention_bias = true;
  const LayerSpec biased = BuildLayerSpec(llama, 0);
  EXPECT_TRUE(biased.o_bias);
  const std::vector<std::string> names = Names(biased);
  EXPECT_EQ(std::count(names.begin(), names.end(), "model.layers.0.self_attn.o_proj.bias"), 1);
  // o_proj's bias is added once after the sum over ranks: whole on every rank.
  for (const ParameterSpec& p : biased.parameters) {
    if (p.role == ParameterRole::kOBias) {
      EXPECT_TRUE(p.split.replicated());
    }
    if (p.role == ParameterRole::kQBias) {
      EXPECT_EQ(p.split, (TensorParallelSplit{.dim = 0, .units = 4}));
    }
  }
}

TEST(LayerSpec, MoeLayersFollowTheSparseStepAndDenseList) {
  ModelConfig c = Small("qwen3_moe");
  c.num_experts = 5;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 6;
  c.decoder_sparse_step = 1;
  c.mlp_only_layers = {1};
  ASSERT_TRUE(ValidateModelConfig(c).ok()) << ValidateModelConfig(c);
  const ModelSpec spec = BuildModelSpec(c);
  for (const LayerSpec& layer : spec.layers) {
    EXPECT_EQ(layer.sparse(), IsSparseLayer(c, layer.index)) << layer.index;
    EXPECT_EQ(layer.mlp, layer.index == 1 ? MlpKind::kSwiGlu : MlpKind::kSparseMoe);
  }
  const LayerSpec& sparse = spec.layers[0];
  const ParameterSpec& down = sparse.parameters[sparse.parameters.size() - 2];
  EXPECT_EQ(down.name, "model.layers.0.mlp.experts.down_proj");
  EXPECT_EQ(down.shape, (std::vector<int64_t>{5, 24, 6}));
  EXPECT_EQ(down.split, (TensorParallelSplit{.dim = 2, .units = 6}));
  EXPECT_EQ(sparse.parameters.back().name, "model.layers.0.mlp.gate.weight");
  EXPECT_TRUE(sparse.parameters.back().split.replicated());
  // Checkpoints hold one tensor per expert, the router as itself.
  EXPECT_TRUE(down.per_expert());
  EXPECT_EQ(down.CheckpointNames(), (std::vector<std::string>{
                                        "model.layers.0.mlp.experts.0.down_proj.weight",
                                        "model.layers.0.mlp.experts.1.down_proj.weight",
                                        "model.layers.0.mlp.experts.2.down_proj.weight",
                                        "model.layers.0.mlp.experts.3.down_proj.weight",
                                        "model.layers.0.mlp.experts.4.down_proj.weight",
                                    }));
  EXPECT_EQ(sparse.parameters.back().CheckpointNames(),
            (std::vector<std::string>{"model.layers.0.mlp.gate.weight"}));
}

TEST(LayerSpec, Qwen3NextHasLinearGatedAndSharedExpertBlocksSplitByHeads) {
  const ModelConfig c = *ModelPreset("qwen3-next-small");
  const ModelSpec spec = BuildModelSpec(c);
  ASSERT_EQ(spec.layers.size(), 4u);
  for (const LayerSpec& layer : spec.layers) {
    EXPECT_EQ(layer.mixer,
              layer.index == 3 ? MixerKind::kGatedAttention : MixerKind::kGatedDeltaNet);
    EXPECT_EQ(layer.mlp, MlpKind::kSparseMoeWithSharedExpert);
    EXPECT_EQ(layer.norm, NormKind::kZeroCentredRms);
    EXPECT_TRUE(layer.tensor_parallel);
  }
  EXPECT_TRUE(spec.tensor_parallel());
  // Gated attention: q_proj holds each head's query and gate, split by heads.
  const ParameterSpec& q_proj = spec.layers[3].parameters[1];
  EXPECT_EQ(q_proj.name, "model.layers.3.self_attn.q_proj.weight");
  EXPECT_EQ(q_proj.shape, (std::vector<int64_t>{2 * 16 * 256, 2048}));
  EXPECT_EQ(q_proj.split, (TensorParallelSplit{.dim = 0, .units = 16}));
  // Gated DeltaNet (16 key heads of 128, 32 value heads of 128): by key heads, conv1d's q, k and v
  // channels each; the per-value-head vectors and out_proj's columns by value heads; the gated
  // norm whole.
  std::vector<TensorParallelSplit> linear;
  for (const ParameterSpec& p : spec.layers[0].parameters) linear.push_back(p.split);
  EXPECT_EQ(spec.layers[0].parameters[1].name, "model.layers.0.linear_attn.in_proj_qkvz.weight");
  EXPECT_EQ(linear[1], (TensorParallelSplit{.dim = 0, .units = 16}));  // in_proj_qkvz
  EXPECT_EQ(linear[2], (TensorParallelSplit{.dim = 0, .units = 16}));  // in_proj_ba
  EXPECT_EQ(linear[3], (TensorParallelSplit{
                           .dim = 0, .units = 16, .segments = {2048, 2048, 4096}}));  // conv1d
  EXPECT_EQ(spec.layers[0].parameters[3].SplitSegments(), (std::vector<int64_t>{2048, 2048, 4096}));
  EXPECT_EQ(spec.layers[0].parameters[1].SplitSegments(),
            (std::vector<int64_t>{2 * 2048 + 2 * 4096}));
  EXPECT_EQ(linear[4], (TensorParallelSplit{.dim = 0, .units = 32}));  // dt_bias
  EXPECT_EQ(linear[5], (TensorParallelSplit{.dim = 0, .units = 32}));  // A_log
  EXPECT_TRUE(linear[6].replicated());                                 // norm
  EXPECT_EQ(linear[7], (TensorParallelSplit{.dim = 1, .units = 32}));  // out_proj
  // The shared expert like a dense MLP, its gate whole.
  const std::vector<ParameterSpec>& mlp = spec.layers[0].parameters;
  EXPECT_EQ(mlp[mlp.size() - 4].split, (TensorParallelSplit{.dim = 0, .units = 512}));
  EXPECT_EQ(mlp[mlp.size() - 2].split, (TensorParallelSplit{.dim = 1, .units = 512}));
  EXPECT_EQ(mlp.back().name, "model.layers.0.mlp.shared_expert_gate.weight");
  EXPECT_TRUE(mlp.back().split.replicated());
}

// Qwen3.5: Qwen3-Next's layers, its Gated DeltaNet's input projections separate: in_proj_qkv's
// rows are conv1d's channels [q | k | v] (split alike, by key heads in each segment), in_proj_z's,
// in_proj_b's and in_proj_a's per value head. Dense MLPs (qwen3_5_text), or a sparse block with a
// shared expert in every layer (qwen3_5_moe_text); the parameters count as the projections'
// sizes say.
TEST(LayerSpec, Qwen35SplitsItsSeparateLinearProjectionsByHeads) {
  ModelConfig c = *ModelPreset("qwen3-next-small");
  c.model_type = "qwen3_5_moe_text";
  c.intermediate_size = 0;
  ASSERT_TRUE(ValidateModelConfig(c).ok()) << ValidateModelConfig(c);
  const ModelSpec spec = BuildModelSpec(c);
  const std::vector<ParameterSpec>& linear = spec.layers[0].parameters;
  std::vector<std::string> names;
  for (const ParameterSpec& p : linear) names.push_back(p.name);
  const std::string prefix = "model.layers.0.linear_attn.";
  ASSERT_GE(names.size(), 10u);
  EXPECT_EQ(
      std::vector<std::string>(names.begin() + 1, names.begin() + 10),
      (std::vector<std::string>{prefix + "in_proj_qkv.weight", prefix + "in_proj_z.weight",
                                prefix + "in_proj_b.weight", prefix + "in_proj_a.weight",
                                prefix + "conv1d.weight", prefix + "dt_bias", prefix + "A_log",
                                prefix + "norm.weight", prefix + "out_proj.weight"}));
  // 16 key heads of 128, 32 value heads of 128.
  const TensorParallelSplit channels = {.dim = 0, .units = 16, .segments = {2048, 2048, 4096}};
  EXPECT_EQ(linear[1].shape, (std::vector<int64_t>{8192, 2048}));
  EXPECT_EQ(linear[1].split, channels);
  EXPECT_EQ(linear[5].split, channels);  // conv1d
  EXPECT_EQ(linear[2].shape, (std::vector<int64_t>{4096, 2048}));
  EXPECT_EQ(linear[2].split, (TensorParallelSplit{.dim = 0, .units = 32}));
  for (const size_t i : {3u, 4u}) {
    EXPECT_EQ(linear[i].shape, (std::vector<int64_t>{32, 2048}));
    EXPECT_EQ(linear[i].split, (TensorParallelSplit{.dim = 0, .units = 32}));
  }
  // As many weights as Qwen3-Next's grouped projections: the same layer, laid out otherwise.
  const ModelSpec next = BuildModelSpec(*ModelPreset("qwen3-next-small"));
  EXPECT_EQ(linear[1].numel() + linear[2].numel() + linear[3].numel() + linear[4].numel(),
            next.layers[0].parameters[1].numel() + next.layers[0].parameters[2].numel());
  for (const LayerSpec& layer : spec.layers) {
    EXPECT_EQ(layer.mlp, MlpKind::kSparseMoeWithSharedExpert) << layer.index;
    EXPECT_EQ(layer.norm, NormKind::kZeroCentredRms);
    EXPECT_EQ(layer.mixer,
              layer.index == 3 ? MixerKind::kGatedAttention : MixerKind::kGatedDeltaNet);
    EXPECT_EQ(
        LayerSavedBytes(c, layer, 2, 4).tensors,
        LayerSavedBytes(*ModelPreset("qwen3-next-small"), next.layers[layer.index], 2, 4).tensors);
  }
  // The dense family: the same mixers, dense MLPs.
  c = *ModelPreset("qwen3-next-small");
  c.model_type = "qwen3_5_text";
  c.num_experts = c.num_experts_per_tok = c.moe_intermediate_size = 0;
  c.shared_expert_intermediate_size = 0;
  c.norm_topk_prob = false;
  c.router_aux_loss_coef = 0;
  ASSERT_TRUE(ValidateModelConfig(c).ok()) << ValidateModelConfig(c);
  for (const LayerSpec& layer : BuildModelSpec(c).layers) {
    EXPECT_EQ(layer.mlp, MlpKind::kSwiGlu);
    EXPECT_EQ(layer.parameters[1].name.ends_with("in_proj_qkv.weight"), layer.linear_attention());
  }
}

// A Gated DeltaNet layer on T ranks keeps 1 / T of its per-head tensors and cache: everything but
// the residual stream's two norm inputs.
TEST(LayerSpec, SavedBytesOfAGatedDeltaNetLayerDivideByTheRanks) {
  const ModelConfig c = *ModelPreset("qwen3-next-small");
  const LayerSpec layer = BuildLayerSpec(c, 0);
  ASSERT_TRUE(layer.linear_attention());
  const int64_t residual = 2 * c.hidden_size * 4;
  const BlockSavedBytes one = LayerSavedBytes(c, layer, 2, 1);
  const int64_t mlp = 2 * c.num_experts_per_tok * c.moe_intermediate_size * 2 +
                      (c.num_experts + c.num_experts_per_tok) * 4 + 4 * c.num_experts_per_tok * 8 +
                      2 * c.shared_expert_intermediate_size * 2 + c.hidden_size * 4 + 4;
  for (const int64_t tp : {2, 4, 8}) {
    const BlockSavedBytes split = LayerSavedBytes(c, layer, 2, tp);
    const int64_t mlp_split =
        2 * c.num_experts_per_tok * (c.moe_intermediate_size / tp) * 2 +
        (c.num_experts + c.num_experts_per_tok) * 4 + 4 * c.num_experts_per_tok * 8 +
        2 * (c.shared_expert_intermediate_size / tp) * 2 + c.hidden_size * 4 + 4;
    EXPECT_EQ(one.tensors - residual - mlp, tp * (split.tensors - residual - mlp_split)) << tp;
    EXPECT_EQ(one.cache, tp * split.cache) << tp;
  }
}

TEST(LayerSpec, EveryPresetNamesEachParameterOnceAndItsSplitsDivideTheirDimensions) {
  for (const std::string& name : ModelPresetNames()) {
    const ModelConfig c = *ModelPreset(name);
    const ModelSpec spec = BuildModelSpec(c);
    std::set<std::string> seen;
    int64_t total = 0;
    for (const ParameterSpec& p : spec.Parameters()) {
      EXPECT_TRUE(seen.insert(p.name).second) << name << ": " << p.name << " twice";
      total += p.numel();
      if (p.split.replicated()) continue;
      ASSERT_LT(p.split.dim, static_cast<int>(p.shape.size())) << p.name;
      EXPECT_GT(p.split.units, 0) << p.name;
      int64_t segments = 0;
      for (const int64_t size : p.SplitSegments()) {
        EXPECT_EQ(size % p.split.units, 0) << name << ": " << p.name;
        segments += size;
      }
      EXPECT_EQ(segments, p.shape[p.split.dim]) << name << ": " << p.name;
    }
    EXPECT_EQ(seen.count("lm_head.weight"), c.tie_word_embeddings ? 0u : 1u) << name;
    EXPECT_EQ(spec.layers.size(), static_cast<size_t>(c.num_hidden_layers));
    EXPECT_GT(total, 0);
  }
}

// A small Qwen3's saved bytes per layer and token, bfloat16, by hand: the residual stream's two
// norm inputs 2 x 24 x 4; q, k after RoPE, v and the output (2 x 32 + 2 x 16) x 2 and q, k before
// their norms (32 + 16) x 2; the MLP's gate and up 2 x 40 x 2; statistics (2 + 4 + 4 + 2) x 4.
TEST(LayerSpec, SavedBytesOfADenseLayer) {
  const ModelConfig c = Small("qwen3");
  const BlockSavedBytes bytes = LayerSavedBytes(c, BuildLayerSpec(c, 0), 2, 1);
  EXPECT_EQ(bytes.tensors, 2 * 24 * 4 + (2 * 32 + 2 * 16) * 2 + (32 + 16) * 2 + 2 * 40 * 2);
  EXPECT_EQ(bytes.statistics, (2 + 4 + 4 + 2) * 4);
  EXPECT_EQ(bytes.mlp_width, 40);
  EXPECT_EQ(bytes.cache, 2 * 16);
  // Two ranks: half the heads and the intermediate rows; the residual stream stays whole.
  const BlockSavedBytes half = LayerSavedBytes(c, BuildLayerSpec(c, 0), 2, 2);
  EXPECT_EQ(half.tensors, 2 * 24 * 4 + (16 + 8 + 16 + 8 + 16 + 8) * 2 + 2 * 20 * 2);
  EXPECT_EQ(half.cache, 16);
}

TEST(LayerSpec, SavedBytesOfASparseLayerWithASharedExpert) {
  RegisterTestFamily();
  const ModelConfig c = TestHybridModel(Small("qwen3"));
  ASSERT_TRUE(ValidateModelConfig(c).ok()) << ValidateModelConfig(c);
  const LayerSpec layer = BuildLayerSpec(c, 1);
  ASSERT_EQ(layer.mlp, MlpKind::kSparseMoeWithSharedExpert);
  const BlockSavedBytes dense = LayerSavedBytes(c, BuildLayerSpec(c, 0), 2, 1);
  const BlockSavedBytes sparse = LayerSavedBytes(c, layer, 2, 1);
  // The dense MLP's gate and up replaced by 2 experts' (width 6), the softmax over 5 experts and
  // 2 weights, 8 int64 indices, and the shared expert's gate and up (5), its gate and output.
  EXPECT_EQ(sparse.tensors - dense.tensors,
            2 * 2 * 6 * 2 + (5 + 2) * 4 + 4 * 2 * 8 + 2 * 5 * 2 + 24 * 4 + 4 - 2 * 40 * 2);
  EXPECT_EQ(sparse.mlp_width, 12);
}

TEST(LayerSpec, ExpertParallelSparseLayersAlsoKeepTheRowsTheyServed) {
  const ModelConfig c = *ModelPreset("qwen3-30b-a3b");
  const LayerSpec sparse = BuildLayerSpec(c, 0);
  ASSERT_TRUE(sparse.sparse());
  for (const int64_t tp : {1, 2}) {
    const BlockSavedBytes alone = LayerSavedBytes(c, sparse, 2, tp);
    EXPECT_EQ(LayerSavedBytes(c, sparse, 2, tp, 1).tensors, alone.tensors);
    // k = 8 served rows of the whole hidden size (2,048, bf16) and two int64 permutations each.
    for (const int64_t ep : {2, 8}) {
      EXPECT_EQ(LayerSavedBytes(c, sparse, 2, tp, ep).tensors - alone.tensors,
                8 * (2048 * 2 + 2 * 8));
    }
  }
  const ModelConfig dense = *ModelPreset("qwen3-8b");
  EXPECT_EQ(LayerSavedBytes(dense, BuildLayerSpec(dense, 0), 2, 1, 4).tensors,
            LayerSavedBytes(dense, BuildLayerSpec(dense, 0), 2, 1).tensors);
}

// The test-only family: one registration, and everything that reads families knows it.
TEST(TestFamily, ARegisteredFamilyIsParsedWrittenAndSpecifiedLikeAShippedOne) {
  RegisterTestFamily();
  const ModelFamily* family = FindModelFamily("dta_test_hybrid");
  ASSERT_NE(family, nullptr);
  EXPECT_THAT(DescribeModelFamilies(), HasSubstr("dta_test_hybrid (dta test hybrid)"));
  const std::vector<std::string> types = ModelFamilyTypes();
  EXPECT_NE(std::find(types.begin(), types.end(), "dta_test_hybrid"), types.end());
  EXPECT_TRUE(std::is_sorted(types.begin(), types.end()));
  // Registering it (or another family of its model_type) again is refused.
  EXPECT_EQ(RegisterModelFamily(&kTestHybridFamily).code(), absl::StatusCode::kAlreadyExists);

  const ModelConfig c = TestHybridModel(Small("qwen3"));
  ASSERT_TRUE(ValidateModelConfig(c).ok()) << ValidateModelConfig(c);
  const std::string json = ModelConfigToJson(c);
  EXPECT_THAT(json, HasSubstr("\"DtaTestHybridForCausalLM\""));
  EXPECT_THAT(json, HasSubstr("\"shared_expert_intermediate_size\": 5"));
  const absl::StatusOr<ModelConfig> parsed = ParseModelConfig(json);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, c);
  // Its traits: biases on q/k/v always, no gated attention or linear layers.
  ModelConfig unbiased = c;
  unbiased.attention_bias = false;
  EXPECT_THAT(ValidateModelConfig(unbiased).message(), HasSubstr("attention_bias"));
  ModelConfig linear = c;
  linear.layer_types.assign(4, LayerType::kFullAttention);
  EXPECT_THAT(ValidateModelConfig(linear).message(), HasSubstr("layer_types"));

  const ModelSpec spec = BuildModelSpec(c);
  EXPECT_EQ(spec.layers[0].mlp, MlpKind::kSwiGlu);
  for (int64_t l = 1; l < 4; ++l) {
    const LayerSpec& layer = spec.layers[l];
    EXPECT_EQ(layer.mixer, MixerKind::kAttention);
    EXPECT_EQ(layer.mlp, MlpKind::kSparseMoeWithSharedExpert);
    EXPECT_EQ(layer.norm, NormKind::kZeroCentredRms);
    EXPECT_TRUE(layer.qk_norm && layer.qkv_bias && !layer.o_bias);
  }
}

}  // namespace
}  // namespace dta

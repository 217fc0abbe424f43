// The model families (core/model/family.h) through config.json: the Hub configs of
// Llama 3.2 1B, Llama 3.1 8B, Qwen2.5 1.5B and Qwen3-30B-A3B parse to their presets, absent fields
// take each family's transformers defaults, every rope type (linear, llama3, yarn; both spellings)
// is read as transformers 5 reads it, everything else is refused naming the field, and every config
// written parses back to itself bit for bit. Qwen3-Next's own fields: qwen3_next_config_test.
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "core/model/config_json.h"
#include "core/model/family.h"
#include "core/model/model_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/core/checkpoint/test_dir.h"
#include "tests/core/model/refused_configs.h"

namespace dta {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;
using testing::ParseOk;

// meta-llama/Llama-3.2-1B's config.json.
constexpr char kLlama32_1B[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// meta-llama/Llama-3.1-8B's config.json (no head_dim: hidden_size / num_attention_heads).
constexpr char kLlama31_8B[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// Qwen/Qwen2.5-1.5B-Instruct's config.json (no attention_bias: Qwen2 always has q/k/v biases; a
// sliding window that use_sliding_window false turns off).
constexpr char kQwen25_1_5B[] = R"({
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "hidden_act": "silu",
  "hidden_size": 1536,
  "initializer_range": 0.02,
  "intermediate_size": 8960,
  "max_position_embeddings": 32768,
  "max_window_layers": 21,
  "model_type": "qwen2",
  "num_attention_heads": 12,
  "num_hidden_layers": 28,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 32768,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.1",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// Qwen/Qwen3-30B-A3B's config.json.
constexpr char kQwen3_30B_A3B[] = R"({
  "architectures": ["Qwen3MoeForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "decoder_sparse_step": 1,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 6144,
  "max_position_embeddings": 40960,
  "max_window_layers": 48,
  "mlp_only_layers": [],
  "model_type": "qwen3_moe",
  "moe_intermediate_size": 768,
  "norm_topk_prob": true,
  "num_attention_heads": 32,
  "num_experts": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 48,
  "num_key_value_heads": 4,
  "output_router_logits": false,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.001,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// A small config of `model_type` with `edit` merged in (JSON merge patch: null deletes).
std::string Small(const std::string& model_type, const std::string& edit = "{}") {
  Json json = Json::parse(R"({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2})");
  json["model_type"] = model_type;
  json.merge_patch(Json::parse(edit));
  return json.dump();
}

TEST(ModelFamily, TableHasEachFamilysTraits) {
  EXPECT_THAT(ModelFamilyTypes(), ElementsAre("llama", "qwen2", "qwen3", "qwen3_5_moe_text",
                                              "qwen3_5_text", "qwen3_moe", "qwen3_next"));
  const ModelFamily* moe = FindModelFamily("qwen3_moe");
  ASSERT_NE(moe, nullptr);
  EXPECT_EQ(moe->architecture, "Qwen3MoeForCausalLM");
  EXPECT_TRUE(moe->qk_norm);
  EXPECT_TRUE(moe->moe);
  EXPECT_EQ(moe->attention_bias, AttentionBiasRule::kNone);
  EXPECT_EQ(moe->default_head_dim, 0);
  EXPECT_FALSE(FindModelFamily("qwen3")->moe);
  const ModelFamily* qwen3 = FindModelFamily("qwen3");
  const ModelFamily* qwen2 = FindModelFamily("qwen2");
  const ModelFamily* llama = FindModelFamily("llama");
  ASSERT_NE(qwen3, nullptr);
  ASSERT_NE(qwen2, nullptr);
  ASSERT_NE(llama, nullptr);
  EXPECT_EQ(FindModelFamily("mistral"), nullptr);
  EXPECT_EQ(FindModelFamily("Qwen3"), nullptr);  // model_type is case-sensitive, as in transformers
  EXPECT_EQ(qwen3->architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(qwen2->architecture, "Qwen2ForCausalLM");
  EXPECT_EQ(llama->architecture, "LlamaForCausalLM");
  EXPECT_TRUE(qwen3->qk_norm);
  EXPECT_FALSE(qwen2->qk_norm);
  EXPECT_FALSE(llama->qk_norm);
  EXPECT_EQ(qwen3->attention_bias, AttentionBiasRule::kNone);
  EXPECT_EQ(qwen2->attention_bias, AttentionBiasRule::kQkvAlways);
  EXPECT_EQ(llama->attention_bias, AttentionBiasRule::kFromConfig);
  const ModelFamily* next = FindModelFamily("qwen3_next");
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(next->architecture, "Qwen3NextForCausalLM");
  EXPECT_TRUE(next->qk_norm);
  EXPECT_TRUE(next->moe);
  EXPECT_EQ(next->attention_bias, AttentionBiasRule::kFromConfig);
  EXPECT_EQ(next->default_head_dim, 256);
  EXPECT_TRUE(next->zero_centred_norms && next->gated_attention && next->shared_expert &&
              next->linear_attention && next->partial_rotary);
  EXPECT_EQ(next->default_partial_rotary_factor, 0.25);
  EXPECT_FALSE(next->separate_linear_projections || next->every_layer_sparse);
  EXPECT_TRUE(next->multimodal_model_type.empty());
  // Qwen3.5: Qwen3-Next's layers with separate Gated DeltaNet projections, inside a
  // vision-language model on the Hub; dense, or sparse in every layer.
  const ModelFamily* dense35 = FindModelFamily("qwen3_5_text");
  const ModelFamily* moe35 = FindModelFamily("qwen3_5_moe_text");
  ASSERT_NE(dense35, nullptr);
  ASSERT_NE(moe35, nullptr);
  EXPECT_EQ(dense35->architecture, "Qwen3_5ForCausalLM");
  EXPECT_EQ(moe35->architecture, "Qwen3_5MoeForCausalLM");
  EXPECT_EQ(FindModelFamilyByMultimodalType("qwen3_5"), dense35);
  EXPECT_EQ(FindModelFamilyByMultimodalType("qwen3_5_moe"), moe35);
  EXPECT_EQ(FindModelFamilyByMultimodalType(""), nullptr);
  EXPECT_EQ(FindModelFamilyByMultimodalType("qwen3_5_text"), nullptr);
  for (const ModelFamily* family : {dense35, moe35}) {
    EXPECT_TRUE(family->qk_norm && family->zero_centred_norms && family->gated_attention &&
                family->linear_attention && family->partial_rotary &&
                family->separate_linear_projections)
        << family->model_type;
    EXPECT_EQ(family->attention_bias, AttentionBiasRule::kFromConfig);
    EXPECT_EQ(family->default_partial_rotary_factor, 0.25);
  }
  EXPECT_FALSE(dense35->moe || dense35->shared_expert || dense35->every_layer_sparse);
  EXPECT_TRUE(moe35->moe && moe35->shared_expert && moe35->every_layer_sparse);
  for (const ModelFamily* family : {moe, qwen3, qwen2, llama}) {
    EXPECT_FALSE(family->zero_centred_norms || family->gated_attention || family->shared_expert ||
                 family->linear_attention || family->partial_rotary)
        << family->model_type;
    EXPECT_EQ(family->default_partial_rotary_factor, 1.0) << family->model_type;
  }
}

TEST(ModelFamily, ParsesTheHubConfigsIntoThePresets) {
  const ModelConfig llama1b = ParseOk(kLlama32_1B);
  EXPECT_EQ(llama1b.model_type, "llama");
  EXPECT_EQ(llama1b.head_dim, 64);
  EXPECT_EQ(llama1b.rope_theta, 500000.0);
  EXPECT_EQ(llama1b.rope_scaling.type, RopeType::kLlama3);
  EXPECT_EQ(llama1b.rope_scaling.factor, 32.0);
  EXPECT_EQ(llama1b.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(llama1b.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(llama1b.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(llama1b.rms_norm_eps, 1e-5);
  EXPECT_FALSE(llama1b.attention_bias);
  EXPECT_FALSE(HasQkNorm(llama1b));
  EXPECT_FALSE(HasOProjBias(llama1b));
  EXPECT_EQ(llama1b, *ModelPreset("llama-3.2-1b"));
  EXPECT_EQ(llama1b, *ModelPreset("meta-llama/Llama-3.2-1B"));

  const ModelConfig llama8b = ParseOk(kLlama31_8B);
  EXPECT_EQ(llama8b.head_dim, 128);  // 4096 / 32
  EXPECT_EQ(llama8b.rope_scaling.factor, 8.0);
  EXPECT_FALSE(llama8b.tie_word_embeddings);
  EXPECT_EQ(llama8b, *ModelPreset("llama-3.1-8b"));
  EXPECT_EQ(llama8b, *ModelPreset("meta-llama/Llama-3.1-8B"));

  const ModelConfig qwen25 = ParseOk(kQwen25_1_5B);
  EXPECT_EQ(qwen25.model_type, "qwen2");
  EXPECT_EQ(qwen25.head_dim, 128);  // 1536 / 12
  EXPECT_TRUE(qwen25.attention_bias);
  EXPECT_FALSE(HasQkNorm(qwen25));
  EXPECT_FALSE(HasOProjBias(qwen25));
  EXPECT_EQ(qwen25.rope_scaling, RopeScaling());
  EXPECT_EQ(qwen25, *ModelPreset("qwen2.5-1.5b"));
  EXPECT_EQ(qwen25, *ModelPreset("Qwen/Qwen2.5-1.5B"));

  const ModelConfig moe = ParseOk(kQwen3_30B_A3B);
  EXPECT_EQ(moe.model_type, "qwen3_moe");
  EXPECT_EQ(moe.num_experts, 128);
  EXPECT_EQ(moe.num_experts_per_tok, 8);
  EXPECT_EQ(moe.moe_intermediate_size, 768);
  EXPECT_TRUE(moe.norm_topk_prob);
  EXPECT_TRUE(HasQkNorm(moe));
  EXPECT_TRUE(IsMoe(moe));
  EXPECT_EQ(moe, *ModelPreset("qwen3-30b-a3b"));
  EXPECT_EQ(moe, *ModelPreset("Qwen/Qwen3-30B-A3B"));
  // The benchmark model: the same layers, 4 of them.
  ModelConfig small = *ModelPreset("qwen3-moe-small");
  EXPECT_EQ(small.num_hidden_layers, 4);
  small.num_hidden_layers = 48;
  EXPECT_EQ(small, moe);

  // Qwen3-235B-A22B's config.json differs from Qwen3-30B-A3B's in these fields.
  Json large = Json::parse(kQwen3_30B_A3B);
  large.merge_patch(Json::parse(R"({"hidden_size": 4096, "intermediate_size": 12288,
      "max_window_layers": 94, "moe_intermediate_size": 1536, "num_attention_heads": 64,
      "num_hidden_layers": 94})"));
  EXPECT_EQ(ParseOk(large.dump()), *ModelPreset("qwen3-235b-a22b"));
  EXPECT_EQ(ParseOk(large.dump()), *ModelPreset("Qwen/Qwen3-235B-A22B"));

  EXPECT_THAT(
      ModelPresetNames(),
      ElementsAre("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b",
                  "qwen2.5-1.5b", "llama-3.2-1b", "llama-3.1-8b", "qwen3-30b-a3b",
                  "qwen3-235b-a22b", "qwen3-moe-small", "qwen3-next-80b-a3b", "qwen3-next-small"));
  for (const std::string& name : ModelPresetNames()) {
    const absl::StatusOr<ModelConfig> preset = ModelPreset(name);
    ASSERT_TRUE(preset.ok()) << preset.status();
    EXPECT_TRUE(ValidateModelConfig(*preset).ok()) << name;
    EXPECT_EQ(preset->torch_dtype, "bfloat16") << name;
  }
}

TEST(ModelFamily, AbsentFieldsTakeEachFamilysDefaults) {
  const ModelConfig llama = ParseOk(Small("llama", R"({"num_key_value_heads": null})"));
  EXPECT_EQ(llama.vocab_size, 32000);
  EXPECT_EQ(llama.head_dim, 16);  // 64 / 4
  EXPECT_EQ(llama.num_key_value_heads, 4);
  EXPECT_EQ(llama.max_position_embeddings, 2048);
  EXPECT_EQ(llama.rms_norm_eps, 1e-6);
  EXPECT_EQ(llama.rope_theta, 10000.0);
  EXPECT_FALSE(llama.attention_bias);
  EXPECT_FALSE(llama.tie_word_embeddings);
  EXPECT_EQ(llama.torch_dtype, "float32");

  const ModelConfig qwen2 = ParseOk(Small("qwen2"));
  EXPECT_EQ(qwen2.vocab_size, 151936);
  EXPECT_EQ(qwen2.head_dim, 16);
  EXPECT_EQ(qwen2.max_position_embeddings, 32768);
  EXPECT_TRUE(qwen2.attention_bias);

  // Qwen3 keeps its fixed head_dim default; an absent model_type is Qwen3.
  const ModelConfig qwen3 = ParseOk(Small("qwen3", R"({"model_type": null})"));
  EXPECT_EQ(qwen3.model_type, "qwen3");
  EXPECT_EQ(qwen3.head_dim, 128);
  EXPECT_TRUE(HasQkNorm(qwen3));
  EXPECT_EQ(qwen3.num_experts, 0);
  EXPECT_FALSE(IsMoe(qwen3));

  // Qwen3MoeConfig's defaults; intermediate_size is not required.
  const ModelConfig moe = ParseOk(Small("qwen3_moe", R"({"intermediate_size": null})"));
  EXPECT_EQ(moe.head_dim, 16);  // 64 / 4, not Qwen3's 128
  EXPECT_EQ(moe.intermediate_size, 6144);
  EXPECT_EQ(moe.num_experts, 128);
  EXPECT_EQ(moe.num_experts_per_tok, 8);
  EXPECT_EQ(moe.moe_intermediate_size, 768);
  EXPECT_FALSE(moe.norm_topk_prob);
  EXPECT_EQ(moe.decoder_sparse_step, 1);
  EXPECT_TRUE(moe.mlp_only_layers.empty());
  EXPECT_EQ(moe.router_aux_loss_coef, 0.001);
  EXPECT_FALSE(moe.output_router_logits);
  EXPECT_EQ(moe.vocab_size, 151936);
  EXPECT_EQ(moe.max_position_embeddings, 32768);
  // transformers 5 writes num_local_experts; both spellings agreeing are fine; null layers: [].
  EXPECT_EQ(ParseOk(Small("qwen3_moe", R"({"num_local_experts": 6, "num_experts_per_tok": 2})"))
                .num_experts,
            6);
  EXPECT_EQ(ParseOk(Small("qwen3_moe", R"({"num_local_experts": 6, "num_experts": 6,
                                           "num_experts_per_tok": 2})"))
                .num_experts,
            6);
  EXPECT_TRUE(ParseOk(Small("qwen3_moe", R"({"mlp_only_layers": null})")).mlp_only_layers.empty());
  // Other families ignore MoE fields, as transformers does.
  EXPECT_EQ(ParseOk(Small("qwen3", R"({"num_experts": 8})")).num_experts, 0);
}

// transformers' Qwen3MoeDecoderLayer: sparse iff not in mlp_only_layers, experts > 0 and
// (layer + 1) % decoder_sparse_step == 0.
TEST(ModelFamily, SparseLayersFollowTransformersRule) {
  ModelConfig c = ParseOk(Small("qwen3_moe", R"({"num_hidden_layers": 6, "decoder_sparse_step": 2,
                             "mlp_only_layers": [3], "num_experts": 4, "num_experts_per_tok": 2})"));
  std::vector<bool> sparse;
  for (int64_t l = 0; l < 6; ++l) sparse.push_back(IsSparseLayer(c, l));
  EXPECT_THAT(sparse, ElementsAre(false, true, false, false, false, true));
  c.decoder_sparse_step = 1;
  c.mlp_only_layers = {0, 5};
  sparse.clear();
  for (int64_t l = 0; l < 6; ++l) sparse.push_back(IsSparseLayer(c, l));
  EXPECT_THAT(sparse, ElementsAre(false, true, true, true, true, false));
  EXPECT_FALSE(IsSparseLayer(*ModelPreset("qwen3-8b"), 0));
  EXPECT_TRUE(IsSparseLayer(*ModelPreset("qwen3-30b-a3b"), 47));
}

TEST(ModelFamily, AttentionBiasesFollowTheFamily) {
  const ModelConfig llama = ParseOk(Small("llama", R"({"attention_bias": true})"));
  EXPECT_TRUE(llama.attention_bias);
  EXPECT_TRUE(HasOProjBias(llama));
  // transformers' Qwen2 has no attention_bias field: q/k/v biases whatever config.json says.
  const ModelConfig qwen2 = ParseOk(Small("qwen2", R"({"attention_bias": false})"));
  EXPECT_TRUE(qwen2.attention_bias);
  EXPECT_FALSE(HasOProjBias(qwen2));
  // A hand-built Qwen2 config without biases would not be a Qwen2.
  ModelConfig no_bias = qwen2;
  no_bias.attention_bias = false;
  const absl::Status status = ValidateModelConfig(no_bias);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("field 'attention_bias': must be true"));
}

TEST(ModelFamily, ReadsEveryRopeTypeAsTransformersDoes) {
  const ModelConfig linear =
      ParseOk(Small("llama", R"({"rope_scaling": {"type": "linear", "factor": 2.5}})"));
  EXPECT_EQ(linear.rope_scaling.type, RopeType::kLinear);
  EXPECT_EQ(linear.rope_scaling.factor, 2.5);
  EXPECT_EQ(RopeAttentionFactor(linear.rope_scaling), 1.0);

  // transformers 5's spelling: rope_parameters carries rope_theta.
  const ModelConfig llama3 = ParseOk(Small("llama", R"({"rope_theta": 1.0, "rope_parameters": {
      "rope_type": "llama3", "rope_theta": 20000.0, "factor": 8.0, "low_freq_factor": 2.0,
      "high_freq_factor": 5.0, "original_max_position_embeddings": 1024}})"));
  EXPECT_EQ(llama3.rope_theta, 20000.0);
  EXPECT_EQ(llama3.rope_scaling.type, RopeType::kLlama3);
  EXPECT_EQ(llama3.rope_scaling.low_freq_factor, 2.0);
  EXPECT_EQ(llama3.rope_scaling.high_freq_factor, 5.0);
  EXPECT_EQ(llama3.rope_scaling.original_max_position_embeddings, 1024);

  // YaRN: betas default to 32 and 1 (also for 0), the original context to max_position_embeddings.
  const ModelConfig yarn = ParseOk(
      Small("qwen2", R"({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn",
      "factor": 4.0, "beta_fast": 0}})"));
  EXPECT_EQ(yarn.rope_scaling.type, RopeType::kYarn);
  EXPECT_EQ(yarn.rope_scaling.beta_fast, 32.0);
  EXPECT_EQ(yarn.rope_scaling.beta_slow, 1.0);
  EXPECT_EQ(yarn.rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_TRUE(yarn.rope_scaling.truncate);
  EXPECT_DOUBLE_EQ(RopeAttentionFactor(yarn.rope_scaling), 0.1 * std::log(4.0) + 1.0);

  // A null factor is the ratio of the context lengths; a top-level original context wins.
  // (Written whole: a merge patch would delete the null.)
  const ModelConfig ratio = ParseOk(R"({"hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 4096,
      "original_max_position_embeddings": 512, "rope_scaling": {"rope_type": "yarn",
      "factor": null, "original_max_position_embeddings": 1024, "beta_fast": 16, "beta_slow": 2,
      "truncate": false}})");
  EXPECT_EQ(ratio.rope_scaling.original_max_position_embeddings, 512);
  EXPECT_EQ(ratio.rope_scaling.factor, 8.0);
  EXPECT_EQ(ratio.rope_scaling.beta_fast, 16.0);
  EXPECT_EQ(ratio.rope_scaling.beta_slow, 2.0);
  EXPECT_FALSE(ratio.rope_scaling.truncate);
  // transformers reads truncate with .get("truncate", True): an explicit null turns it off.
  const ModelConfig untruncated = ParseOk(R"({"hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "rope_scaling": {"rope_type": "yarn",
      "factor": 2.0, "truncate": null}})");
  EXPECT_FALSE(untruncated.rope_scaling.truncate);

  // The attention factor: explicit, else from mscale and mscale_all_dim when both are non-zero.
  const ModelConfig mscale = ParseOk(
      Small("llama", R"({"rope_scaling": {"rope_type": "yarn", "factor": 40, "mscale": 0.707,
      "mscale_all_dim": 1.3, "original_max_position_embeddings": 64}})"));
  EXPECT_DOUBLE_EQ(RopeAttentionFactor(mscale.rope_scaling),
                   (0.1 * 0.707 * std::log(40.0) + 1) / (0.1 * 1.3 * std::log(40.0) + 1));
  RopeScaling only_mscale = mscale.rope_scaling;
  only_mscale.mscale_all_dim = 0.0;
  EXPECT_DOUBLE_EQ(RopeAttentionFactor(only_mscale), 0.1 * std::log(40.0) + 1);
  RopeScaling explicit_factor = mscale.rope_scaling;
  explicit_factor.attention_factor = 0.75;
  EXPECT_EQ(RopeAttentionFactor(explicit_factor), 0.75);
  RopeScaling shrink = only_mscale;
  shrink.factor = 0.5;
  EXPECT_EQ(RopeAttentionFactor(shrink), 1.0);

  // transformers 5: a non-empty rope_scaling wins over rope_parameters (whose rope_theta then
  // does not count); an empty or null one does not.
  const ModelConfig both = ParseOk(Small("llama", R"({"rope_theta": 7000.0,
      "rope_scaling": {"rope_type": "linear", "factor": 3.0},
      "rope_parameters": {"rope_type": "default", "rope_theta": 9000.0}})"));
  EXPECT_EQ(both.rope_scaling.type, RopeType::kLinear);
  EXPECT_EQ(both.rope_theta, 7000.0);
  const ModelConfig empty = ParseOk(Small("llama", R"({"rope_scaling": {},
      "rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 9000.0}})"));
  EXPECT_EQ(empty.rope_scaling.type, RopeType::kLinear);
  EXPECT_EQ(empty.rope_theta, 9000.0);
  // Fields of other rope types are ignored.
  const ModelConfig plain = ParseOk(Small("qwen3", R"({"rope_scaling": {"rope_type": "default",
      "factor": 4.0}})"));
  EXPECT_EQ(plain.rope_scaling, RopeScaling());
}

struct Refusal {
  std::string model_type;
  std::string edit;
  absl::StatusCode code;
  std::string expected;
};

TEST(ModelFamily, RefusesWhatItCannotBuildNamingTheField) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  const auto kUnsupported = absl::StatusCode::kUnimplemented;
  const std::vector<Refusal> cases = {
      {"mistral", "{}", kUnsupported,
       "field 'model_type': 'mistral' is not supported (supported: llama, qwen2, qwen3, "
       "qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next)"},
      {"qwen3_vl", "{}", kUnsupported, "field 'model_type': 'qwen3_vl' is not supported"},
      // Qwen3.5's vision-language config.json holds the decoder's in text_config.
      {"qwen3_5", "{}", kInvalid, "field 'text_config': missing"},
      {"qwen3_moe", R"({"num_experts": 4, "num_experts_per_tok": 5})", kInvalid,
       "field 'num_experts_per_tok': 5 is more than num_experts = 4"},
      {"qwen3_moe", R"({"num_experts": 0})", kInvalid, "field 'num_experts': 0 is not positive"},
      {"qwen3_moe", R"({"num_experts_per_tok": 0})", kInvalid,
       "field 'num_experts_per_tok': 0 is not positive"},
      {"qwen3_moe", R"({"moe_intermediate_size": 0})", kInvalid,
       "field 'moe_intermediate_size': 0 is not positive"},
      {"qwen3_moe", R"({"intermediate_size": 0})", kInvalid,
       "field 'intermediate_size': 0 is not positive"},
      {"qwen3_moe", R"({"decoder_sparse_step": 0})", kInvalid,
       "field 'decoder_sparse_step': 0 is not positive"},
      {"qwen3_moe", R"({"mlp_only_layers": [0, 2]})", kInvalid,
       "field 'mlp_only_layers': layer 2 is not in [0, num_hidden_layers = 2)"},
      {"qwen3_moe", R"({"mlp_only_layers": [-1]})", kInvalid,
       "field 'mlp_only_layers': layer -1 is not in"},
      {"qwen3_moe", R"({"mlp_only_layers": [1, 1]})", kInvalid,
       "field 'mlp_only_layers': layer 1 is listed twice"},
      {"qwen3_moe", R"({"mlp_only_layers": 1})", kInvalid,
       "field 'mlp_only_layers': must be an array"},
      {"qwen3_moe", R"({"mlp_only_layers": ["1"]})", kInvalid,
       "field 'mlp_only_layers': must hold layer indices"},
      {"qwen3_moe", R"({"num_experts": 8, "num_local_experts": 6})", kInvalid,
       "field 'num_local_experts': 6 differs from num_experts = 8"},
      {"qwen3_moe", R"({"num_experts": 2.5})", kInvalid, "field 'num_experts': must be an integer"},
      {"qwen3_moe", R"({"norm_topk_prob": 1})", kInvalid,
       "field 'norm_topk_prob': must be true or false"},
      {"qwen3_moe", R"({"router_aux_loss_coef": -0.1})", kInvalid,
       "field 'router_aux_loss_coef': -0.1 is not finite and >= 0"},
      {"qwen3_moe", R"({"attention_bias": true})", kUnsupported,
       "field 'attention_bias': attention biases are not supported for Qwen3-MoE"},
      {"qwen3_moe", R"({"use_sliding_window": true})", kUnsupported, "field 'use_sliding_window'"},
      {"qwen3_moe", R"({"hidden_act": "gelu"})", kUnsupported, "field 'hidden_act'"},
      {"llama", R"({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})", kUnsupported,
       "field 'rope_scaling': rope type 'dynamic' is not supported"},
      {"qwen2", R"({"rope_parameters": {"rope_type": "longrope", "short_factor": [1]}})",
       kUnsupported, "field 'rope_parameters': rope type 'longrope' is not supported"},
      {"llama", R"({"rope_scaling": {"type": "ntk", "factor": 2.0}})", kUnsupported,
       "rope type 'ntk'"},
      {"llama", R"({"partial_rotary_factor": 0.5})", kUnsupported,
       "field 'partial_rotary_factor': 0.5 is not supported"},
      {"qwen2",
       R"({"rope_scaling": {"rope_type": "linear", "factor": 2, "partial_rotary_factor": 0.25}})",
       kUnsupported, "field 'rope_scaling.partial_rotary_factor'"},
      {"llama", R"({"mlp_bias": true})", kUnsupported, "field 'mlp_bias'"},
      {"qwen3", R"({"attention_bias": true})", kUnsupported,
       "field 'attention_bias': attention biases are not supported"},
      {"qwen2", R"({"use_sliding_window": true})", kUnsupported, "field 'use_sliding_window'"},
      {"qwen2", R"({"layer_types": ["sliding_attention", "full_attention"]})", kUnsupported,
       "field 'layer_types': layer 0 is \"sliding_attention\""},
      // Linear attention is Qwen3-Next's alone.
      {"qwen3", R"({"layer_types": ["full_attention", "linear_attention"]})", kUnsupported,
       "field 'layer_types': layer 1 is \"linear_attention\""},
      {"qwen3_moe", R"({"layer_types": ["linear_attention", "full_attention"]})", kUnsupported,
       "field 'layer_types': layer 0 is \"linear_attention\""},
      {"qwen3_moe", R"({"partial_rotary_factor": 0.25})", kUnsupported,
       "field 'partial_rotary_factor': 0.25 is not supported"},
      {"llama", R"({"hidden_act": "gelu"})", kUnsupported, "field 'hidden_act'"},
      {"qwen2", R"({"attention_dropout": 0.1})", kUnsupported, "field 'attention_dropout'"},
      {"llama", R"({"hidden_size": 66, "head_dim": 16})", kInvalid,
       "field 'hidden_size': 66 is not a multiple of num_attention_heads = 4"},
      {"llama", R"({"attention_bias": "yes"})", kInvalid,
       "field 'attention_bias': must be true or false"},
      {"llama", R"({"rope_scaling": {"rope_type": "linear"}})", kInvalid,
       "field 'rope_scaling.factor': missing"},
      {"llama", R"({"rope_scaling": {"rope_type": "linear", "factor": "2"}})", kInvalid,
       "field 'rope_scaling.factor': must be a number"},
      {"llama", R"({"rope_scaling": {"rope_type": "linear", "factor": 0}})", kInvalid,
       "field 'rope_scaling.factor': 0 is not positive and finite"},
      {"llama", R"({"rope_parameters": {"rope_type": "llama3", "factor": 8, "high_freq_factor": 4,
          "original_max_position_embeddings": 8192}})",
       kInvalid, "field 'rope_parameters.low_freq_factor': missing"},
      {"llama", R"({"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4,
          "high_freq_factor": 4, "original_max_position_embeddings": 8192}})",
       kInvalid, "field 'rope_scaling.high_freq_factor': 4 must be finite and greater"},
      {"llama", R"({"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1,
          "high_freq_factor": 4, "original_max_position_embeddings": 0}})",
       kInvalid, "field 'rope_scaling.original_max_position_embeddings': 0 is not positive"},
      {"llama", R"({"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1,
          "high_freq_factor": 4, "original_max_position_embeddings": 81.5}})",
       kInvalid, "field 'rope_scaling.original_max_position_embeddings': must be an integer"},
      {"qwen2", R"({"rope_scaling": {"rope_type": "yarn"}})", kInvalid,
       "field 'rope_scaling.factor': missing"},
      {"qwen2", R"({"rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_slow": -1}})",
       kInvalid, "field 'rope_scaling.beta_slow': -1 is not positive and finite"},
      {"qwen2", R"({"rope_scaling": {"rope_type": "yarn", "factor": 4, "attention_factor": -2}})",
       kInvalid, "field 'rope_scaling.attention_factor'"},
      {"qwen2", R"({"rope_scaling": {"rope_type": "yarn", "factor": 4, "truncate": 1}})", kInvalid,
       "field 'rope_scaling.truncate': must be true or false"},
      {"llama", R"({"rope_scaling": {"rope_type": 3}})", kInvalid,
       "field 'rope_scaling.rope_type': must be a string"},
      {"llama", R"({"rope_scaling": "llama3"})", kInvalid,
       "field 'rope_scaling': must be an object or null"},
      {"llama", R"({"rope_parameters": {"rope_type": "default", "rope_theta": -5}})", kInvalid,
       "field 'rope_theta': -5 is not positive and finite"},
  };
  std::vector<testing::RefusedConfig> refused;
  for (const Refusal& c : cases) {
    refused.push_back(
        {c.model_type + " " + c.edit, Small(c.model_type, c.edit), c.code, c.expected});
  }
  testing::ExpectRefused(Json::object(), refused);
  // Llama has no sliding-window fields: transformers ignores them, and so does dta.
  EXPECT_TRUE(ParseModelConfig(Small("llama", R"({"use_sliding_window": true})")).ok());

  // A dense family's struct with experts is not a model dta can build.
  ModelConfig dense = *ModelPreset("qwen3-0.6b");
  dense.num_experts = 8;
  EXPECT_THAT(
      std::string(ValidateModelConfig(dense).message()),
      HasSubstr("field 'num_experts': is a mixture-of-experts field; Qwen3 has no experts"));
  dense = *ModelPreset("llama-3.2-1b");
  dense.mlp_only_layers = {0};
  EXPECT_EQ(ValidateModelConfig(dense).code(), absl::StatusCode::kInvalidArgument);
}

// Configs that exercise every field each family writes.
std::vector<ModelConfig> OddConfigs() {
  std::vector<ModelConfig> configs;
  for (const std::string& name : ModelPresetNames()) configs.push_back(*ModelPreset(name));
  ModelConfig llama = *ModelPreset("llama-3.2-1b");
  llama.attention_bias = true;
  llama.rms_norm_eps = 1.0 / 3.0 * 1e-5;
  llama.rope_theta = 12345.678901234567;
  llama.rope_scaling.factor = 1.0 / 7.0;
  llama.rope_scaling.low_freq_factor = 0.3;
  llama.rope_scaling.high_freq_factor = 2.0 / 3.0;
  llama.torch_dtype = "float64";
  configs.push_back(llama);
  ModelConfig linear = *ModelPreset("llama-3.1-8b");
  linear.rope_scaling = {.type = RopeType::kLinear, .factor = 2.75};
  configs.push_back(linear);
  ModelConfig yarn = *ModelPreset("qwen2.5-1.5b");
  yarn.rope_scaling = {.type = RopeType::kYarn,
                       .factor = 4.0,
                       .original_max_position_embeddings = 32768,
                       .beta_fast = 24.5,
                       .beta_slow = 1.0 / 3.0,
                       .attention_factor = 0.9,
                       .mscale = 0.707,
                       .mscale_all_dim = 0.0,
                       .truncate = false};
  configs.push_back(yarn);
  ModelConfig moe = *ModelPreset("qwen3-30b-a3b");
  moe.norm_topk_prob = false;
  moe.decoder_sparse_step = 3;
  moe.mlp_only_layers = {0, 7, 47};
  moe.router_aux_loss_coef = 1.0 / 3.0 * 1e-3;
  moe.output_router_logits = true;
  moe.num_experts = 60;
  moe.num_experts_per_tok = 60;
  moe.moe_intermediate_size = 1407;
  moe.rope_scaling = {.type = RopeType::kLinear, .factor = 2.5};
  configs.push_back(moe);
  ModelConfig plain_yarn = *ModelPreset("qwen3-0.6b");
  plain_yarn.rope_scaling = {
      .type = RopeType::kYarn, .factor = 4.0, .original_max_position_embeddings = 32768};
  configs.push_back(plain_yarn);
  return configs;
}

TEST(ModelFamily, ConfigsRoundTripBitForBitAndLookLikeTransformers) {
  for (const ModelConfig& config : OddConfigs()) {
    SCOPED_TRACE(ModelConfigToJson(config));
    ASSERT_TRUE(ValidateModelConfig(config).ok()) << ValidateModelConfig(config);
    const std::string text = ModelConfigToJson(config);
    const absl::StatusOr<ModelConfig> back = ParseModelConfig(text);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, config);
    const Json json = Json::parse(text);
    const ModelFamily& family = *FindModelFamily(config.model_type);
    EXPECT_EQ(json["model_type"], config.model_type);
    EXPECT_EQ(json["architectures"], Json::array({std::string(family.architecture)}));
    EXPECT_EQ(json["head_dim"], config.head_dim);
    EXPECT_EQ(json.contains("attention_bias"), config.model_type != "qwen2");
    EXPECT_EQ(json.contains("use_sliding_window"), family.sliding_window_fields);
    EXPECT_EQ(json.contains("mlp_bias"), config.model_type == "llama");
    EXPECT_EQ(json.contains("num_experts"), family.moe);
    // Qwen3-Next's fields only for it (their values: qwen3_next_config_test).
    for (const char* field : {"layer_types", "linear_num_key_heads", "partial_rotary_factor",
                              "shared_expert_intermediate_size", "rope_parameters"}) {
      EXPECT_EQ(json.contains(field), config.model_type == "qwen3_next") << field;
    }
    if (family.moe) {
      EXPECT_EQ(json["num_experts_per_tok"], config.num_experts_per_tok);
      EXPECT_EQ(json["moe_intermediate_size"], config.moe_intermediate_size);
      EXPECT_EQ(json["norm_topk_prob"], config.norm_topk_prob);
      EXPECT_EQ(json["decoder_sparse_step"], config.decoder_sparse_step);
      EXPECT_EQ(json["mlp_only_layers"], config.mlp_only_layers);
      EXPECT_EQ(json["router_aux_loss_coef"], config.router_aux_loss_coef);
      EXPECT_EQ(json["output_router_logits"], config.output_router_logits);
      EXPECT_FALSE(json.contains("num_local_experts"));
    }
    if (config.rope_scaling.type == RopeType::kDefault) {
      EXPECT_TRUE(json["rope_scaling"].is_null());
    } else {
      EXPECT_EQ(json["rope_scaling"]["rope_type"],
                std::string(RopeTypeName(config.rope_scaling.type)));
      EXPECT_EQ(json["rope_scaling"]["factor"], config.rope_scaling.factor);
    }
  }
  const Json llama = Json::parse(ModelConfigToJson(*ModelPreset("llama-3.1-8b")));
  EXPECT_EQ(llama["rope_scaling"], Json::parse(R"({"rope_type": "llama3", "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})"));
  EXPECT_EQ(llama["mlp_bias"], false);
  EXPECT_EQ(llama["pretraining_tp"], 1);
  EXPECT_EQ(llama["rope_theta"], 500000.0);
  // YaRN's betas only when they are not transformers' defaults.
  const Json yarn = Json::parse(ModelConfigToJson(OddConfigs().back()));
  EXPECT_EQ(yarn["rope_scaling"], Json::parse(R"({"rope_type": "yarn", "factor": 4.0,
      "original_max_position_embeddings": 32768})"));
}

TEST(ModelFamily, SavingOverABaseRewritesItsRopeParameters) {
  const std::string dir = testing::FreshTestDir("model_family");
  // A transformers 5 Llama config.json: rope_parameters, no rope_scaling; and Phi-3's top-level
  // original context.
  std::ofstream(dir + "/base.json") << R"({"model_type": "llama", "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      "eos_token_id": [1, 2], "original_max_position_embeddings": 100,
      "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 100}})";
  ModelConfig config = ParseOk(Small("llama", R"({"attention_bias": true, "rope_theta": 30000.0,
      "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 2.0,
      "high_freq_factor": 8.0, "original_max_position_embeddings": 4096}})"));
  ASSERT_TRUE(SaveModelConfig(config, dir + "/out", dir + "/base.json").ok());
  std::ifstream in(dir + "/out/config.json");
  const Json saved = Json::parse(in);
  EXPECT_EQ(saved["eos_token_id"], Json::parse("[1, 2]"));  // kept from the base
  EXPECT_EQ(saved["rope_parameters"]["rope_theta"], 30000.0);
  EXPECT_EQ(saved["rope_parameters"]["factor"], 16.0);
  EXPECT_EQ(saved["original_max_position_embeddings"], 4096);
  EXPECT_EQ(*LoadModelConfig(dir + "/out"), config);

  // Saved as a default-rope model, the base's rope_parameters become the default rope's.
  config.rope_scaling = RopeScaling();
  ASSERT_TRUE(SaveModelConfig(config, dir + "/plain", dir + "/base.json").ok());
  std::ifstream plain_in(dir + "/plain/config.json");
  const Json plain = Json::parse(plain_in);
  EXPECT_EQ(plain["rope_parameters"], Json::parse(R"({"rope_type": "default",
      "rope_theta": 30000.0})"));
  EXPECT_FALSE(plain.contains("original_max_position_embeddings"));
  EXPECT_EQ(plain["eos_token_id"], Json::parse("[1, 2]"));
  EXPECT_EQ(*LoadModelConfig(dir + "/plain"), config);

  // A transformers 5 Qwen3-MoE base spells num_local_experts: it is rewritten too.
  std::ofstream(dir + "/moe.json") << Small("qwen3_moe", R"({"num_local_experts": 8,
      "num_experts_per_tok": 2, "eos_token_id": 7})");
  ModelConfig moe = *LoadModelConfig(dir + "/moe.json");
  moe.num_experts = 16;
  ASSERT_TRUE(SaveModelConfig(moe, dir + "/moe", dir + "/moe.json").ok());
  std::ifstream moe_in(dir + "/moe/config.json");
  const Json moe_saved = Json::parse(moe_in);
  EXPECT_EQ(moe_saved["num_local_experts"], 16);
  EXPECT_EQ(moe_saved["num_experts"], 16);
  EXPECT_EQ(moe_saved["eos_token_id"], 7);
  EXPECT_EQ(*LoadModelConfig(dir + "/moe"), moe);
}

}  // namespace
}  // namespace dta

// Qwen3.5's language models (model_type "qwen3_5_text" and "qwen3_5_moe_text") through
// config.json: the vision-language config.json the Hub's Qwen3.5 models have (model_type "qwen3_5"
// or "qwen3_5_moe") is read through its text_config; absent fields take transformers'
// Qwen3_5TextConfig and Qwen3_5MoeTextConfig defaults; the mixture-of-experts family is sparse in
// every layer and reads none of the fields its transformers config lacks; what dta cannot build is
// refused naming the field; every config written is the decoder's alone and parses back to itself
// bit for bit, also over a vision-language base.
#include <fstream>
#include <string>
#include <vector>

#include "core/model/config_json.h"
#include "core/model/family.h"
#include "core/model/layer_spec.h"
#include "core/model/model_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/core/checkpoint/test_dir.h"
#include "tests/core/model/refused_configs.h"

namespace dta {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;
using testing::ParseOk;

constexpr LayerType kFull = LayerType::kFullAttention;
constexpr LayerType kLinear = LayerType::kLinearAttention;

// A config.json in the layout of the Hub's Qwen3.5 models (transformers 5's save_pretrained of
// Qwen3_5ForConditionalGeneration): the language model's config in text_config, with the
// multimodal RoPE's sections in its rope_parameters, beside a vision_config; 8 layers of a small
// shape.
constexpr char kVisionLanguage[] = R"({
  "architectures": ["Qwen3_5ForConditionalGeneration"],
  "image_token_id": 248056,
  "model_type": "qwen3_5",
  "text_config": {
    "attention_bias": false,
    "attention_dropout": 0.0,
    "bos_token_id": null,
    "dtype": "bfloat16",
    "eos_token_id": 248044,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3584,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "model_type": "qwen3_5_text",
    "mtp_num_hidden_layers": 1,
    "num_attention_heads": 8,
    "num_hidden_layers": 8,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, 11, 10],
                        "partial_rotary_factor": 0.25, "rope_theta": 10000000,
                        "rope_type": "default"},
    "tie_word_embeddings": false,
    "use_cache": true,
    "vocab_size": 248320
  },
  "tie_word_embeddings": true,
  "transformers_version": "5.23.0",
  "video_token_id": 248057,
  "vision_config": {"depth": 12, "hidden_size": 768, "model_type": "qwen3_5_vision",
                    "num_heads": 12, "out_hidden_size": 1024}
})";

// The same language model as qwen3_5_moe's: experts instead of a dense MLP.
std::string MoeVisionLanguage() {
  Json json = Json::parse(kVisionLanguage);
  json["model_type"] = "qwen3_5_moe";
  json["architectures"] = {"Qwen3_5MoeForConditionalGeneration"};
  Json& text = json["text_config"];
  text["model_type"] = "qwen3_5_moe_text";
  text.erase("intermediate_size");
  text.merge_patch(Json::parse(R"({"num_experts": 64, "num_experts_per_tok": 4,
      "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
      "router_aux_loss_coef": 0.001, "output_router_logits": false})"));
  return json.dump();
}

// A small config.json of `model_type` with `edit` merged in (JSON merge patch: null deletes).
std::string Small(const std::string& model_type, const std::string& edit = "{}") {
  Json json = Json::parse(R"({"hidden_size": 64, "num_hidden_layers": 4,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
      "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
      "linear_value_head_dim": 8})");
  json["model_type"] = model_type;
  if (model_type == "qwen3_5_text") json["intermediate_size"] = 96;
  if (model_type == "qwen3_5_moe_text") {
    json.merge_patch(Json::parse(R"({"num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8})"));
  }
  json.merge_patch(Json::parse(edit));
  return json.dump();
}

TEST(Qwen35Config, ReadsTheVisionLanguageConfigThroughItsTextConfig) {
  const ModelConfig c = ParseOk(kVisionLanguage);
  EXPECT_EQ(c.model_type, "qwen3_5_text");
  EXPECT_EQ(c.vocab_size, 248320);
  EXPECT_EQ(c.hidden_size, 1024);
  EXPECT_EQ(c.intermediate_size, 3584);
  EXPECT_EQ(c.num_hidden_layers, 8);
  EXPECT_EQ(c.num_attention_heads, 8);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.max_position_embeddings, 262144);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  // rope_parameters' theta and partial rotary; mrope_section only says which position component
  // each frequency reads, and text positions have three equal ones.
  EXPECT_EQ(c.rope_theta, 1e7);
  EXPECT_EQ(c.rope_scaling, RopeScaling());
  EXPECT_EQ(c.partial_rotary_factor, 0.25);
  EXPECT_EQ(RotaryDim(c), 64);
  EXPECT_EQ(c.layer_types, std::vector<LayerType>({kLinear, kLinear, kLinear, kFull, kLinear,
                                                   kLinear, kLinear, kFull}));
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 16);
  EXPECT_EQ(c.linear_key_head_dim, 128);
  EXPECT_EQ(c.linear_value_head_dim, 128);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_FALSE(IsMoe(c));
  // The vision-language model's tie_word_embeddings, by which its checkpoint was saved.
  EXPECT_TRUE(c.tie_word_embeddings);
  Json untied = Json::parse(kVisionLanguage);
  untied.erase("tie_word_embeddings");
  EXPECT_FALSE(ParseOk(untied.dump()).tie_word_embeddings);
  // The text_config alone is the same decoder.
  Json text = Json::parse(kVisionLanguage)["text_config"];
  text["tie_word_embeddings"] = true;
  EXPECT_EQ(ParseOk(text.dump()), c);
  // Without a model_type, text_config is the wrapper's language model.
  Json unnamed = Json::parse(kVisionLanguage);
  unnamed["text_config"].erase("model_type");
  EXPECT_EQ(ParseOk(unnamed.dump()), c);

  const ModelConfig moe = ParseOk(MoeVisionLanguage());
  EXPECT_EQ(moe.model_type, "qwen3_5_moe_text");
  EXPECT_EQ(moe.num_experts, 64);
  EXPECT_EQ(moe.num_experts_per_tok, 4);
  EXPECT_EQ(moe.moe_intermediate_size, 256);
  EXPECT_EQ(moe.shared_expert_intermediate_size, 256);
  EXPECT_TRUE(moe.norm_topk_prob);
  EXPECT_EQ(moe.intermediate_size, 0);
  for (int64_t layer = 0; layer < moe.num_hidden_layers; ++layer) {
    EXPECT_TRUE(IsSparseLayer(moe, layer)) << layer;
  }
}

// transformers 5's Qwen3_5TextConfig and Qwen3_5MoeTextConfig defaults (checked with from_dict of
// the same files).
TEST(Qwen35Config, AbsentFieldsTakeTransformersDefaults) {
  for (const std::string type : {"qwen3_5_text", "qwen3_5_moe_text"}) {
    SCOPED_TRACE(type);
    Json json = Json::parse(Small(type));
    for (const char* field :
         {"num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
          "linear_key_head_dim", "linear_value_head_dim"}) {
      json.erase(field);
    }
    json["hidden_size"] = 4096;
    json["num_attention_heads"] = 32;
    const ModelConfig c = ParseOk(json.dump());
    EXPECT_EQ(c.vocab_size, 248320);
    EXPECT_EQ(c.head_dim, 256);
    EXPECT_EQ(c.num_key_value_heads, type == "qwen3_5_text" ? 4 : 2);
    EXPECT_EQ(c.max_position_embeddings, 32768);
    EXPECT_EQ(c.rope_theta, 10000.0);
    EXPECT_EQ(c.partial_rotary_factor, 0.25);
    EXPECT_FALSE(c.tie_word_embeddings);
    EXPECT_FALSE(c.attention_bias);
    EXPECT_EQ(c.layer_types, std::vector<LayerType>({kLinear, kLinear, kLinear, kFull}));
    EXPECT_EQ(c.linear_num_key_heads, 16);
    EXPECT_EQ(c.linear_num_value_heads, 32);
    EXPECT_EQ(c.linear_key_head_dim, 128);
    EXPECT_EQ(c.linear_value_head_dim, 128);
    EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  }
  const ModelConfig moe = ParseOk(R"({"model_type": "qwen3_5_moe_text", "hidden_size": 64,
      "num_hidden_layers": 2, "num_attention_heads": 4})");
  EXPECT_EQ(moe.num_experts, 256);
  EXPECT_EQ(moe.num_experts_per_tok, 8);
  EXPECT_EQ(moe.moe_intermediate_size, 512);
  EXPECT_EQ(moe.shared_expert_intermediate_size, 512);
  EXPECT_EQ(moe.router_aux_loss_coef, 0.001);
  // The dense family has no experts: their fields mean nothing to Qwen3_5TextConfig.
  const ModelConfig dense = ParseOk(Small("qwen3_5_text", R"({"num_experts": 8})"));
  EXPECT_EQ(dense.num_experts, 0);
}

// Qwen3_5MoeTextConfig has no intermediate_size, decoder_sparse_step, mlp_only_layers or
// norm_topk_prob: its every layer is a sparse block that renormalises its top-k weights, whatever
// config.json says, and a config that says otherwise cannot be built.
TEST(Qwen35Config, TheMixtureOfExpertsFamilyIsSparseInEveryLayer) {
  const ModelConfig c = ParseOk(Small("qwen3_5_moe_text", R"({"intermediate_size": 96,
      "decoder_sparse_step": 2, "mlp_only_layers": [0], "norm_topk_prob": false})"));
  EXPECT_EQ(c, ParseOk(Small("qwen3_5_moe_text")));
  EXPECT_EQ(c.intermediate_size, 0);
  EXPECT_EQ(c.decoder_sparse_step, 1);
  EXPECT_TRUE(c.mlp_only_layers.empty());
  EXPECT_TRUE(c.norm_topk_prob);
  const ModelSpec spec = BuildModelSpec(c);
  for (const LayerSpec& layer : spec.layers) {
    EXPECT_EQ(layer.mlp, MlpKind::kSparseMoeWithSharedExpert) << layer.index;
  }
  ModelConfig dense_layer = c;
  dense_layer.mlp_only_layers = {1};
  ModelConfig step = c;
  step.decoder_sparse_step = 2;
  ModelConfig unnormalised = c;
  unnormalised.norm_topk_prob = false;
  ModelConfig width = c;
  width.intermediate_size = 96;
  ModelConfig no_experts = c;
  no_experts.num_experts = 0;
  const std::vector<std::pair<ModelConfig, std::string>> refused = {
      {dense_layer, "field 'mlp_only_layers'"},
      {step, "field 'decoder_sparse_step'"},
      {unnormalised, "field 'norm_topk_prob'"},
      {width, "field 'intermediate_size'"},
      {no_experts, "field 'num_experts': 0 is not positive"},
  };
  for (const auto& [config, expected] : refused) {
    const absl::Status status = ValidateModelConfig(config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << expected;
    EXPECT_THAT(std::string(status.message()), HasSubstr(expected));
  }
  // The dense family needs its MLP width, as every dense family.
  ModelConfig dense = ParseOk(Small("qwen3_5_text"));
  dense.intermediate_size = 0;
  EXPECT_THAT(ValidateModelConfig(dense).message(), HasSubstr("field 'intermediate_size'"));
}

TEST(Qwen35Config, RefusesWhatItCannotBuildNamingTheField) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  const auto kUnsupported = absl::StatusCode::kUnimplemented;
  testing::ExpectRefused(
      Json::parse(kVisionLanguage),
      {
          {"no text_config", R"({"text_config": null})", kInvalid,
           "field 'text_config': missing: a 'qwen3_5' config.json holds its language model's "
           "config there"},
          {"text_config not an object", R"({"text_config": [1]})", kInvalid,
           "field 'text_config': must be an object"},
          {"another decoder", R"({"text_config": {"model_type": "qwen3_next"}})", kUnsupported,
           "field 'text_config.model_type': 'qwen3_next' is not the language model of 'qwen3_5' "
           "('qwen3_5_text')"},
          {"a field inside", R"({"text_config": {"hidden_size": null}})", kInvalid,
           "text_config: field 'hidden_size': missing"},
          {"linear sizes", R"({"text_config": {"linear_num_value_heads": 24}})", kInvalid,
           "text_config: field 'linear_num_value_heads': 24 is not a multiple of "
           "linear_num_key_heads = 16"},
          {"rope type", R"({"text_config": {"rope_parameters": {"rope_type": "dynamic"}}})",
           kUnsupported, "text_config: field 'rope_parameters': rope type 'dynamic'"},
      });
  testing::ExpectRefused(
      Json::parse(MoeVisionLanguage()),
      {
          {"the dense decoder", R"({"text_config": {"model_type": "qwen3_5_text"}})", kUnsupported,
           "'qwen3_5_text' is not the language model of 'qwen3_5_moe'"},
          {"top-k", R"({"text_config": {"num_experts_per_tok": 65}})", kInvalid,
           "text_config: field 'num_experts_per_tok': 65 is more than num_experts = 64"},
      });
}

// What dta writes is the decoder alone, under its own model_type and architecture, with the
// fields of its transformers config and no others.
TEST(Qwen35Config, WrittenConfigsRoundTripAsTheDecodersOwn) {
  for (const std::string& source : {std::string(kVisionLanguage), MoeVisionLanguage()}) {
    ModelConfig config = ParseOk(source);
    config.attention_bias = true;
    config.partial_rotary_factor = 0.5;
    config.layer_types[2] = kFull;
    SCOPED_TRACE(config.model_type);
    ASSERT_TRUE(ValidateModelConfig(config).ok()) << ValidateModelConfig(config);
    const std::string text = ModelConfigToJson(config);
    EXPECT_EQ(ParseOk(text), config);
    const Json json = Json::parse(text);
    const bool moe = config.model_type == "qwen3_5_moe_text";
    EXPECT_EQ(json["model_type"], config.model_type);
    EXPECT_EQ(json["architectures"],
              Json::array({moe ? "Qwen3_5MoeForCausalLM" : "Qwen3_5ForCausalLM"}));
    EXPECT_FALSE(json.contains("text_config"));
    EXPECT_EQ(json["rope_parameters"]["partial_rotary_factor"], 0.5);
    EXPECT_EQ(json["layer_types"][2], "full_attention");
    EXPECT_FALSE(json.contains("full_attention_interval"));  // no interval gives these layers
    EXPECT_EQ(json.contains("intermediate_size"), !moe);
    EXPECT_EQ(json.contains("num_experts"), moe);
    EXPECT_EQ(json.contains("shared_expert_intermediate_size"), moe);
    for (const char* field : {"decoder_sparse_step", "mlp_only_layers", "norm_topk_prob",
                              "use_sliding_window", "mlp_bias"}) {
      EXPECT_FALSE(json.contains(field)) << field;
    }
  }
}

// Exporting a model loaded from a vision-language checkpoint: the config written is its
// decoder's, keeping what the text_config holds beyond the struct (eos_token_id, the multimodal
// RoPE's sections) and nothing of the vision model.
TEST(Qwen35Config, SavingOverTheVisionLanguageConfigKeepsItsTextConfigsFields) {
  const std::string dir = testing::FreshTestDir("qwen3_5_config");
  std::ofstream(dir + "/vl.json") << kVisionLanguage;
  ModelConfig config = ParseOk(kVisionLanguage);
  config.rope_theta = 5e6;
  ASSERT_TRUE(SaveModelConfig(config, dir + "/out", dir + "/vl.json").ok());
  std::ifstream in(dir + "/out/config.json");
  const Json saved = Json::parse(in);
  EXPECT_EQ(saved["model_type"], "qwen3_5_text");
  EXPECT_EQ(saved["architectures"], Json::array({"Qwen3_5ForCausalLM"}));
  EXPECT_EQ(saved["eos_token_id"], 248044);
  EXPECT_EQ(saved["mtp_num_hidden_layers"], 1);
  EXPECT_EQ(saved["dtype"], "bfloat16");
  EXPECT_EQ(saved["tie_word_embeddings"], true);
  EXPECT_EQ(saved["rope_parameters"], Json::parse(R"({"mrope_interleaved": true,
      "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25, "rope_theta": 5000000.0,
      "rope_type": "default"})"));
  for (const char* field : {"text_config", "vision_config", "image_token_id"}) {
    EXPECT_FALSE(saved.contains(field)) << field;
  }
  const absl::StatusOr<ModelConfig> back = LoadModelConfig(dir + "/out");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, config);
}

}  // namespace
}  // namespace dta

// Qwen3-Next (model_type "qwen3_next") through config.json: the Hub config of
// Qwen3-Next-80B-A3B-Instruct parses to its preset, absent fields take transformers'
// Qwen3NextConfig defaults, layer_types are read or built from full_attention_interval, and
// partial_rotary_factor is read where transformers 5 reads it; what dta cannot build is refused
// naming the field, the other families keep refusing Qwen3-Next's fields, and every config written
// parses back to itself bit for bit in the layout transformers 5 writes.
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

constexpr LayerType kFull = LayerType::kFullAttention;
constexpr LayerType kLinear = LayerType::kLinearAttention;

// Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (no layer_types: full_attention_interval).
constexpr char kQwen3Next80B[] = R"({
  "architectures": ["Qwen3NextForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "decoder_sparse_step": 1,
  "eos_token_id": 151645,
  "full_attention_interval": 4,
  "head_dim": 256,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 5120,
  "linear_conv_kernel_dim": 4,
  "linear_key_head_dim": 128,
  "linear_num_key_heads": 16,
  "linear_num_value_heads": 32,
  "linear_value_head_dim": 128,
  "max_position_embeddings": 262144,
  "mlp_only_layers": [],
  "model_type": "qwen3_next",
  "moe_intermediate_size": 512,
  "norm_topk_prob": true,
  "num_attention_heads": 16,
  "num_experts": 512,
  "num_experts_per_tok": 10,
  "num_hidden_layers": 48,
  "num_key_value_heads": 2,
  "output_router_logits": false,
  "partial_rotary_factor": 0.25,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 10000000,
  "router_aux_loss_coef": 0.001,
  "shared_expert_intermediate_size": 512,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.57.0.dev0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// A small Qwen3-Next config.json with `edit` merged in (JSON merge patch: null deletes).
std::string Small(const std::string& edit = "{}") {
  Json json = Json::parse(R"({"model_type": "qwen3_next", "hidden_size": 64,
      "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 4,
      "linear_num_value_heads": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
      "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
      "shared_expert_intermediate_size": 8})");
  json.merge_patch(Json::parse(edit));
  return json.dump();
}

std::vector<LayerType> Pattern(int64_t layers, int64_t interval) {
  std::vector<LayerType> types;
  for (int64_t i = 0; i < layers; ++i) types.push_back((i + 1) % interval != 0 ? kLinear : kFull);
  return types;
}

TEST(Qwen3NextConfig, ParsesTheHubConfigIntoThePreset) {
  const ModelConfig c = ParseOk(kQwen3Next80B);
  EXPECT_EQ(c.model_type, "qwen3_next");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.intermediate_size, 5120);
  EXPECT_EQ(c.num_hidden_layers, 48);
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.max_position_embeddings, 262144);
  EXPECT_EQ(c.rope_theta, 1e7);
  EXPECT_EQ(c.rope_scaling, RopeScaling());
  EXPECT_EQ(c.partial_rotary_factor, 0.25);
  EXPECT_EQ(RotaryDim(c), 64);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 32);
  EXPECT_EQ(c.linear_key_head_dim, 128);
  EXPECT_EQ(c.linear_value_head_dim, 128);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.num_experts, 512);
  EXPECT_EQ(c.num_experts_per_tok, 10);
  EXPECT_EQ(c.moe_intermediate_size, 512);
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.router_aux_loss_coef, 0.001);
  // Layers 3, 7, ..., 47 full attention, the others Gated DeltaNet; every MLP sparse.
  EXPECT_EQ(c.layer_types, Pattern(48, 4));
  for (int64_t layer = 0; layer < 48; ++layer) {
    EXPECT_EQ(IsLinearAttentionLayer(c, layer), layer % 4 != 3) << layer;
    EXPECT_TRUE(IsSparseLayer(c, layer)) << layer;
  }
  EXPECT_FALSE(IsLinearAttentionLayer(c, 48));
  EXPECT_FALSE(IsLinearAttentionLayer(c, -1));
  EXPECT_TRUE(IsMoe(c));
  EXPECT_TRUE(HasQkNorm(c));
  EXPECT_FALSE(HasOProjBias(c));
  EXPECT_TRUE(HasZeroCentredNorms(c));
  EXPECT_TRUE(HasGatedAttention(c));
  EXPECT_TRUE(HasSharedExpert(c));
  EXPECT_EQ(c, *ModelPreset("qwen3-next-80b-a3b"));
  EXPECT_EQ(c, *ModelPreset("Qwen/Qwen3-Next-80B-A3B"));

  // The benchmark model: 4 such layers (three linear, one full) of 128 experts.
  ModelConfig small = *ModelPreset("qwen3-next-small");
  EXPECT_EQ(small.num_hidden_layers, 4);
  EXPECT_THAT(small.layer_types, ElementsAre(kLinear, kLinear, kLinear, kFull));
  EXPECT_EQ(small.num_experts, 128);
  EXPECT_TRUE(ValidateModelConfig(small).ok());
  small.num_hidden_layers = 48;
  small.layer_types = Pattern(48, 4);
  small.num_experts = 512;
  EXPECT_EQ(small, c);

  // The other families say no to every Qwen3-Next trait.
  for (const char* name : {"qwen3-8b", "qwen3-30b-a3b", "llama-3.2-1b", "qwen2.5-1.5b"}) {
    const ModelConfig other = *ModelPreset(name);
    EXPECT_FALSE(HasZeroCentredNorms(other) || HasGatedAttention(other) || HasSharedExpert(other))
        << name;
    EXPECT_FALSE(IsLinearAttentionLayer(other, 0)) << name;
    EXPECT_EQ(RotaryDim(other), other.head_dim) << name;
  }
}

// transformers' Qwen3NextConfig defaults (checked against transformers 5 with
// Qwen3NextConfig.from_dict of the same file).
TEST(Qwen3NextConfig, AbsentFieldsTakeTransformersDefaults) {
  const ModelConfig c = ParseOk(R"({"model_type": "qwen3_next", "hidden_size": 64,
      "num_hidden_layers": 6, "num_attention_heads": 4, "mlp_only_layers": null,
      "layer_types": null, "num_local_experts": 7})");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.intermediate_size, 5632);  // not required, as for qwen3_moe
  EXPECT_EQ(c.num_key_value_heads, 2);   // Qwen3NextConfig's, not num_attention_heads
  EXPECT_EQ(c.head_dim, 256);            // not 64 / 4
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rope_scaling, RopeScaling());
  EXPECT_EQ(c.partial_rotary_factor, 0.25);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.torch_dtype, "float32");
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.linear_key_head_dim, 128);
  EXPECT_EQ(c.linear_value_head_dim, 128);
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 32);
  EXPECT_EQ(c.decoder_sparse_step, 1);
  EXPECT_EQ(c.moe_intermediate_size, 512);
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_EQ(c.num_experts_per_tok, 10);
  EXPECT_EQ(c.num_experts, 512);  // num_local_experts means nothing to Qwen3NextConfig
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.router_aux_loss_coef, 0.001);
  EXPECT_FALSE(c.output_router_logits);
  EXPECT_TRUE(c.mlp_only_layers.empty());
  EXPECT_EQ(c.layer_types, Pattern(6, 4));  // full_attention_interval 4
}

TEST(Qwen3NextConfig, LayerTypesAreGivenOrFollowTheInterval) {
  // Given: any mix, whatever full_attention_interval says.
  EXPECT_THAT(ParseOk(Small(R"({"full_attention_interval": 2, "layer_types": ["full_attention",
                  "linear_attention", "linear_attention", "full_attention"]})"))
                  .layer_types,
              ElementsAre(kFull, kLinear, kLinear, kFull));
  EXPECT_THAT(ParseOk(Small(R"({"layer_types": ["linear_attention", "linear_attention",
                  "linear_attention", "linear_attention"]})"))
                  .layer_types,
              ElementsAre(kLinear, kLinear, kLinear, kLinear));
  // Absent: layer i is linear iff (i + 1) % interval != 0.
  EXPECT_THAT(
      ParseOk(Small(R"({"num_hidden_layers": 5, "full_attention_interval": 2})")).layer_types,
      ElementsAre(kLinear, kFull, kLinear, kFull, kLinear));
  EXPECT_THAT(ParseOk(Small(R"({"full_attention_interval": 1})")).layer_types,
              ElementsAre(kFull, kFull, kFull, kFull));
  EXPECT_THAT(ParseOk(Small(R"({"full_attention_interval": 9})")).layer_types,
              ElementsAre(kLinear, kLinear, kLinear, kLinear));
  EXPECT_THAT(ParseOk(Small()).layer_types, ElementsAre(kLinear, kLinear, kLinear, kFull));

  // Without a linear layer the linear sizes are not needed.
  const ModelConfig full = ParseOk(Small(R"({"full_attention_interval": 1,
      "linear_num_key_heads": 0, "linear_num_value_heads": 0, "linear_key_head_dim": 0,
      "linear_value_head_dim": 0, "linear_conv_kernel_dim": 0})"));
  EXPECT_FALSE(IsLinearAttentionLayer(full, 0));
  EXPECT_EQ(full.linear_num_key_heads, 0);
}

TEST(Qwen3NextConfig, PartialRotaryFactorIsReadWhereTransformersReadsIt) {
  auto partial = [](const std::string& edit) { return ParseOk(Small(edit)).partial_rotary_factor; };
  EXPECT_EQ(partial("{}"), 0.25);  // Qwen3NextConfig's default
  EXPECT_EQ(partial(R"({"partial_rotary_factor": 0.5})"), 0.5);
  EXPECT_EQ(partial(R"({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
      "partial_rotary_factor": 0.5}})"),
            0.5);
  // transformers setdefault()s the top-level value into the rope object: the object's wins.
  EXPECT_EQ(partial(R"({"partial_rotary_factor": 0.75, "rope_parameters": {"rope_type": "default",
      "rope_theta": 1e6, "partial_rotary_factor": 0.5}})"),
            0.5);
  EXPECT_EQ(partial(R"({"partial_rotary_factor": 0.75, "rope_scaling": {"rope_type": "default",
      "partial_rotary_factor": 0.5}})"),
            0.5);
  // A rope object without it takes the top-level one; a non-empty rope_scaling is the rope
  // object, whatever rope_parameters says.
  EXPECT_EQ(partial(R"({"partial_rotary_factor": 0.5, "rope_parameters": {"rope_type": "default",
      "rope_theta": 1e6}})"),
            0.5);
  EXPECT_EQ(partial(R"({"partial_rotary_factor": 0.5, "rope_scaling": {"rope_type": "linear",
      "factor": 2.0}, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.0}})"),
            0.5);
  EXPECT_EQ(partial(R"({"rope_scaling": {}, "rope_parameters": {"rope_type": "default",
      "partial_rotary_factor": 0.75}})"),
            0.75);

  // transformers truncates head_dim x factor.
  EXPECT_EQ(RotaryDim(ParseOk(Small(R"({"partial_rotary_factor": 0.3, "head_dim": 20})"))), 6);
  EXPECT_EQ(RotaryDim(ParseOk(Small(R"({"partial_rotary_factor": 0.2, "head_dim": 12})"))), 2);
  EXPECT_EQ(RotaryDim(ParseOk(Small(R"({"partial_rotary_factor": 1})"))), 16);
}

TEST(Qwen3NextConfig, ExpertsMayBeAbsentAndFollowTheSparseStep) {
  // No experts: every MLP dense (transformers allows it); the expert sizes are then unused.
  const ModelConfig dense = ParseOk(Small(R"({"num_experts": 0, "num_experts_per_tok": 10,
      "shared_expert_intermediate_size": 0})"));
  EXPECT_EQ(dense.num_experts, 0);
  EXPECT_EQ(dense.num_experts_per_tok, 10);
  for (int64_t layer = 0; layer < 4; ++layer) EXPECT_FALSE(IsSparseLayer(dense, layer)) << layer;

  const ModelConfig mixed = ParseOk(Small(R"({"decoder_sparse_step": 2, "mlp_only_layers": [3]})"));
  std::vector<bool> sparse;
  for (int64_t layer = 0; layer < 4; ++layer) sparse.push_back(IsSparseLayer(mixed, layer));
  EXPECT_THAT(sparse, ElementsAre(false, true, false, false));
}

TEST(Qwen3NextConfig, RefusesWhatItCannotBuildNamingTheField) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  const auto kUnsupported = absl::StatusCode::kUnimplemented;
  const std::vector<testing::RefusedConfig> cases = {
      {"sliding_layer",
       R"({"layer_types": ["linear_attention", "full_attention", "sliding_attention",
           "full_attention"]})",
       kUnsupported,
       "field 'layer_types': layer 2 is \"sliding_attention\": only 'linear_attention' and "
       "'full_attention' are supported"},
      {"short_layer_types", R"({"layer_types": ["linear_attention", "full_attention",
           "full_attention"]})",
       kInvalid, "field 'layer_types': 3 entries for 4 layers"},
      {"layer_types_string", R"({"layer_types": "linear_attention"})", kInvalid,
       "field 'layer_types': must be an array"},
      {"layer_type_number", R"({"layer_types": [1, 1, 1, 1]})", kInvalid,
       "field 'layer_types': layer 0 is 1, not a string"},
      {"interval_zero", R"({"full_attention_interval": 0})", kInvalid,
       "field 'full_attention_interval': 0 is not positive"},
      {"interval_string", R"({"full_attention_interval": "4"})", kInvalid,
       "field 'full_attention_interval': must be an integer"},
      {"value_heads", R"({"linear_num_value_heads": 6})", kInvalid,
       "field 'linear_num_value_heads': 6 is not a multiple of linear_num_key_heads = 4"},
      {"key_heads", R"({"linear_num_key_heads": 0})", kInvalid,
       "field 'linear_num_key_heads': 0 is not positive"},
      {"kernel", R"({"linear_conv_kernel_dim": 0})", kInvalid,
       "field 'linear_conv_kernel_dim': 0 is not positive"},
      {"value_head_dim", R"({"linear_value_head_dim": -8})", kInvalid,
       "field 'linear_value_head_dim': -8 is not positive"},
      {"odd_rotary", R"({"partial_rotary_factor": 0.1875})", kInvalid,
       "field 'partial_rotary_factor': 0.1875 of head_dim = 16 rotates 3 dimensions; RoPE needs "
       "an even number"},
      {"no_rotary", R"({"partial_rotary_factor": 0.05})", kInvalid,
       "field 'partial_rotary_factor': 0.05 of head_dim = 16 rotates 0 dimensions"},
      {"odd_rotary_in_rope", R"({"rope_parameters": {"rope_type": "default",
           "partial_rotary_factor": 0.1875}})",
       kInvalid, "field 'partial_rotary_factor': 0.1875 of head_dim = 16 rotates 3"},
      {"zero_factor", R"({"partial_rotary_factor": 0})", kInvalid,
       "field 'partial_rotary_factor': 0 is not in (0, 1]"},
      {"big_factor", R"({"partial_rotary_factor": 1.5})", kInvalid,
       "field 'partial_rotary_factor': 1.5 is not in (0, 1]"},
      {"factor_string", R"({"rope_scaling": {"rope_type": "default",
           "partial_rotary_factor": "0.5"}})",
       kInvalid, "field 'rope_scaling.partial_rotary_factor': must be a number"},
      {"shared_expert", R"({"shared_expert_intermediate_size": 0})", kInvalid,
       "field 'shared_expert_intermediate_size': 0 is not positive"},
      {"negative_experts", R"({"num_experts": -1})", kInvalid,
       "field 'num_experts': -1 is not positive"},
      {"top_k", R"({"num_experts_per_tok": 5})", kInvalid,
       "field 'num_experts_per_tok': 5 is more than num_experts = 4"},
      {"no_experts_negative_width", R"({"num_experts": 0, "moe_intermediate_size": -1})", kInvalid,
       "field 'moe_intermediate_size': -1 is not positive"},
      {"sparse_step", R"({"decoder_sparse_step": 0})", kInvalid,
       "field 'decoder_sparse_step': 0 is not positive"},
      {"dense_layers", R"({"mlp_only_layers": [4]})", kInvalid,
       "field 'mlp_only_layers': layer 4 is not in [0, num_hidden_layers = 4)"},
      {"gqa", R"({"num_key_value_heads": 3})", kInvalid,
       "field 'num_key_value_heads': 3 does not divide num_attention_heads = 4"},
      {"kv_default", R"({"num_attention_heads": 3, "num_key_value_heads": null})", kInvalid,
       "field 'num_key_value_heads': 2 does not divide num_attention_heads = 3"},
      {"gelu", R"({"hidden_act": "gelu"})", kUnsupported, "field 'hidden_act'"},
      {"dropout", R"({"attention_dropout": 0.1})", kUnsupported, "field 'attention_dropout'"},
      {"dynamic", R"({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})", kUnsupported,
       "field 'rope_scaling': rope type 'dynamic' is not supported"},
  };
  testing::ExpectRefused(Json::parse(Small()), cases);

  // A hand-built config: one layer type per layer, and Qwen3-Next's fields only on Qwen3-Next.
  auto refused = [](const ModelConfig& config, absl::StatusCode code, const std::string& what) {
    const absl::Status status = ValidateModelConfig(config);
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(what));
  };
  ModelConfig next = *ModelPreset("qwen3-next-small");
  next.layer_types.clear();
  refused(next, kInvalid, "field 'layer_types': 0 entries for 4 layers");
  ModelConfig qwen3 = *ModelPreset("qwen3-0.6b");
  qwen3.layer_types.assign(28, kFull);
  refused(qwen3, kInvalid, "field 'layer_types': must be empty: Qwen3 has only full-attention");
  ModelConfig moe = *ModelPreset("qwen3-moe-small");
  moe.linear_num_key_heads = 16;
  refused(moe, kInvalid, "field 'linear_num_key_heads': is a linear-attention field; Qwen3-MoE");
  moe = *ModelPreset("qwen3-moe-small");
  moe.linear_conv_kernel_dim = 4;
  refused(moe, kInvalid, "field 'linear_conv_kernel_dim'");
  moe = *ModelPreset("qwen3-moe-small");
  moe.shared_expert_intermediate_size = 512;
  refused(moe, kInvalid,
          "field 'shared_expert_intermediate_size': is a shared-expert field; Qwen3-MoE has no");
  ModelConfig llama = *ModelPreset("llama-3.2-1b");
  llama.partial_rotary_factor = 0.5;
  refused(llama, kUnsupported, "field 'partial_rotary_factor': 0.5 is not supported");

  // The other families' config.json may carry Qwen3-Next's fields: transformers ignores them.
  const ModelConfig ignored = ParseOk(R"({"model_type": "qwen3", "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      "linear_num_key_heads": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
      "shared_expert_intermediate_size": 512})");
  EXPECT_EQ(ignored.linear_num_key_heads, 0);
  EXPECT_EQ(ignored.linear_conv_kernel_dim, 0);
  EXPECT_EQ(ignored.shared_expert_intermediate_size, 0);
  EXPECT_TRUE(ignored.layer_types.empty());
  EXPECT_EQ(ignored.partial_rotary_factor, 1.0);
}

// Configs that exercise every field Qwen3-Next writes.
std::vector<ModelConfig> NextConfigs() {
  std::vector<ModelConfig> configs = {*ModelPreset("qwen3-next-80b-a3b"),
                                      *ModelPreset("qwen3-next-small")};
  ModelConfig odd = *ModelPreset("qwen3-next-small");
  odd.num_hidden_layers = 5;
  odd.layer_types = {kFull, kLinear, kFull, kLinear, kLinear};  // no interval gives these
  odd.attention_bias = true;
  odd.partial_rotary_factor = 0.5;
  odd.rope_scaling = {.type = RopeType::kLinear, .factor = 2.5};
  odd.rope_theta = 12345.678901234567;
  odd.rms_norm_eps = 1.0 / 3.0 * 1e-5;
  odd.linear_num_key_heads = 3;
  odd.linear_num_value_heads = 9;
  odd.linear_key_head_dim = 7;
  odd.linear_value_head_dim = 19;
  odd.linear_conv_kernel_dim = 3;
  odd.shared_expert_intermediate_size = 733;
  odd.decoder_sparse_step = 2;
  odd.mlp_only_layers = {3};
  odd.norm_topk_prob = false;
  odd.output_router_logits = true;
  odd.torch_dtype = "float64";
  configs.push_back(odd);
  ModelConfig dense = *ModelPreset("qwen3-next-small");
  dense.num_experts = 0;  // every MLP dense
  dense.layer_types = {kLinear, kLinear, kLinear, kLinear};
  dense.tie_word_embeddings = true;
  dense.rope_scaling = {
      .type = RopeType::kYarn, .factor = 4.0, .original_max_position_embeddings = 65536};
  configs.push_back(dense);
  ModelConfig full = *ModelPreset("qwen3-next-small");
  full.layer_types = {kFull, kFull, kFull, kFull};
  full.partial_rotary_factor = 1.0;
  configs.push_back(full);
  return configs;
}

TEST(Qwen3NextConfig, WrittenConfigsRoundTripInTransformers5sLayout) {
  for (const ModelConfig& config : NextConfigs()) {
    const std::string text = ModelConfigToJson(config);
    SCOPED_TRACE(text);
    ASSERT_TRUE(ValidateModelConfig(config).ok()) << ValidateModelConfig(config);
    const absl::StatusOr<ModelConfig> back = ParseModelConfig(text);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, config);

    const Json json = Json::parse(text);
    EXPECT_EQ(json["architectures"], Json::array({"Qwen3NextForCausalLM"}));
    EXPECT_EQ(json["model_type"], "qwen3_next");
    EXPECT_EQ(json["hidden_act"], "silu");
    EXPECT_EQ(json["attention_bias"], config.attention_bias);
    ASSERT_TRUE(json["layer_types"].is_array());
    ASSERT_EQ(json["layer_types"].size(), config.layer_types.size());
    for (size_t i = 0; i < config.layer_types.size(); ++i) {
      EXPECT_EQ(json["layer_types"][i],
                config.layer_types[i] == kLinear ? "linear_attention" : "full_attention");
    }
    EXPECT_EQ(json["linear_num_key_heads"], config.linear_num_key_heads);
    EXPECT_EQ(json["linear_num_value_heads"], config.linear_num_value_heads);
    EXPECT_EQ(json["linear_key_head_dim"], config.linear_key_head_dim);
    EXPECT_EQ(json["linear_value_head_dim"], config.linear_value_head_dim);
    EXPECT_EQ(json["linear_conv_kernel_dim"], config.linear_conv_kernel_dim);
    EXPECT_EQ(json["shared_expert_intermediate_size"], config.shared_expert_intermediate_size);
    EXPECT_EQ(json["num_experts"], config.num_experts);
    EXPECT_EQ(json["mlp_only_layers"], config.mlp_only_layers);
    // partial_rotary_factor at the top level and in rope_parameters (with rope_theta), as
    // transformers 5 writes it; rope_scaling and rope_theta for older readers.
    EXPECT_EQ(json["partial_rotary_factor"], config.partial_rotary_factor);
    EXPECT_EQ(json["rope_parameters"]["partial_rotary_factor"], config.partial_rotary_factor);
    EXPECT_EQ(json["rope_parameters"]["rope_theta"], config.rope_theta);
    EXPECT_EQ(json["rope_parameters"]["rope_type"],
              std::string(RopeTypeName(config.rope_scaling.type)));
    EXPECT_EQ(json["rope_theta"], config.rope_theta);
    EXPECT_EQ(json["rope_scaling"].is_null(), config.rope_scaling.type == RopeType::kDefault);
    for (const char* absent :
         {"use_sliding_window", "sliding_window", "num_local_experts", "mlp_bias"}) {
      EXPECT_FALSE(json.contains(absent)) << absent;
    }
  }
  // The interval too, where one gives the layers (for readers that derive them from it alone).
  const std::vector<ModelConfig> configs = NextConfigs();
  const std::vector<int64_t> intervals = {4, 4, 0, 5, 1};
  for (size_t i = 0; i < configs.size(); ++i) {
    const Json json = Json::parse(ModelConfigToJson(configs[i]));
    if (intervals[i] == 0) {
      EXPECT_FALSE(json.contains("full_attention_interval")) << i;
    } else {
      EXPECT_EQ(json["full_attention_interval"], intervals[i]) << i;
    }
  }
  EXPECT_EQ(Json::parse(ModelConfigToJson(configs[2]))["rope_parameters"],
            Json::parse(R"({"rope_type": "linear", "factor": 2.5,
                "rope_theta": 12345.678901234567, "partial_rotary_factor": 0.5})"));
}

TEST(Qwen3NextConfig, SavingOverTheHubConfigKeepsWhatTheStructDoesNotModel) {
  const std::string dir = testing::FreshTestDir("qwen3_next_config");
  std::ofstream(dir + "/hub.json") << kQwen3Next80B;
  const ModelConfig preset = *ModelPreset("qwen3-next-80b-a3b");
  ASSERT_TRUE(SaveModelConfig(preset, dir + "/same", dir + "/hub.json").ok());
  std::ifstream same_in(dir + "/same/config.json");
  const Json same = Json::parse(same_in);
  EXPECT_EQ(same["bos_token_id"], 151643);  // kept from the base
  EXPECT_EQ(same["eos_token_id"], 151645);
  EXPECT_EQ(same["full_attention_interval"], 4);
  EXPECT_EQ(same["layer_types"].size(), 48u);
  EXPECT_EQ(*LoadModelConfig(dir + "/same"), preset);

  // Layers that no interval gives: the base's interval goes, so it cannot contradict them.
  ModelConfig changed = preset;
  changed.layer_types[0] = kFull;
  changed.partial_rotary_factor = 0.5;
  ASSERT_TRUE(SaveModelConfig(changed, dir + "/changed", dir + "/hub.json").ok());
  std::ifstream changed_in(dir + "/changed/config.json");
  const Json saved = Json::parse(changed_in);
  EXPECT_FALSE(saved.contains("full_attention_interval"));
  EXPECT_EQ(saved["eos_token_id"], 151645);
  EXPECT_EQ(saved["partial_rotary_factor"], 0.5);
  EXPECT_EQ(*LoadModelConfig(dir + "/changed"), changed);

  // transformers 5's own file (save_pretrained of Qwen3NextConfig): rope_parameters holds the
  // partial factor, and is rewritten with it.
  std::ofstream(dir + "/v5.json") << R"({"model_type": "qwen3_next", "hidden_size": 64,
      "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 16, "eos_token_id": 7,
      "dtype": "bfloat16", "layer_types": ["linear_attention", "linear_attention",
      "linear_attention", "full_attention"], "rope_parameters": {"partial_rotary_factor": 0.25,
      "rope_theta": 10000.0, "rope_type": "default"}})";
  ModelConfig small = *LoadModelConfig(dir + "/v5.json");
  EXPECT_EQ(small.partial_rotary_factor, 0.25);
  small.partial_rotary_factor = 0.5;
  small.rope_theta = 20000.0;
  small.torch_dtype = "float32";
  ASSERT_TRUE(SaveModelConfig(small, dir + "/small", dir + "/v5.json").ok());
  std::ifstream small_in(dir + "/small/config.json");
  const Json small_saved = Json::parse(small_in);
  EXPECT_EQ(small_saved["rope_parameters"], Json::parse(R"({"rope_type": "default",
      "rope_theta": 20000.0, "partial_rotary_factor": 0.5})"));
  EXPECT_EQ(small_saved["dtype"], "float32");
  EXPECT_EQ(small_saved["eos_token_id"], 7);
  EXPECT_EQ(*LoadModelConfig(dir + "/small"), small);

  // Without a base.
  const std::vector<ModelConfig> configs = NextConfigs();
  for (size_t i = 0; i < configs.size(); ++i) {
    const std::string out = dir + "/written_" + std::to_string(i);
    ASSERT_TRUE(SaveModelConfig(configs[i], out).ok());
    EXPECT_EQ(*LoadModelConfig(out), configs[i]);
  }
}

}  // namespace
}  // namespace dta

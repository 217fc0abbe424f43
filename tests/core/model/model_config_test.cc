#include "core/model/model_config.h"
#include "core/model/config_json.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/core/checkpoint/test_dir.h"
#include "tests/core/model/refused_configs.h"

namespace dta {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string TestDir() { return testing::FreshTestDir("model_config"); }

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Qwen/Qwen3-0.6B's config.json as the Hub ships it.
constexpr char kQwen3_0_6B[] = R"({
  "architectures": [
    "Qwen3ForCausalLM"
  ],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "initializer_range": 0.02,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}
)";

TEST(ModelConfig, ParsesTheHuggingFaceQwen3_0_6BConfig) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(kQwen3_0_6B);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->vocab_size, 151936);
  EXPECT_EQ(config->hidden_size, 1024);
  EXPECT_EQ(config->intermediate_size, 3072);
  EXPECT_EQ(config->num_hidden_layers, 28);
  EXPECT_EQ(config->num_attention_heads, 16);
  EXPECT_EQ(config->num_key_value_heads, 8);
  EXPECT_EQ(config->head_dim, 128);
  EXPECT_EQ(config->rms_norm_eps, 1e-6);
  EXPECT_EQ(config->rope_theta, 1e6);
  EXPECT_TRUE(config->tie_word_embeddings);
  EXPECT_EQ(config->max_position_embeddings, 40960);
  EXPECT_EQ(config->torch_dtype, "bfloat16");
  EXPECT_FALSE(config->attention_bias);
  EXPECT_EQ(*config, *ModelPreset("qwen3-0.6b"));
}

TEST(ModelConfig, ParsesTheNewerTransformersSpelling) {
  // transformers >= 4.56 writes "dtype", v5 "rope_parameters" and "layer_types".
  const std::string json = R"({
    "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "dtype": "float32",
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "layer_types": ["full_attention", "full_attention"], "sliding_window": 4096,
    "use_sliding_window": false, "rope_scaling": null
  })";
  absl::StatusOr<ModelConfig> config = ParseModelConfig(json);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->torch_dtype, "float32");
  EXPECT_EQ(config->rope_theta, 500000.0);
  EXPECT_EQ(config->head_dim, 16);
}

TEST(ModelConfig, AbsentFieldsTakeTransformersDefaults) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(
      R"({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": null})");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->vocab_size, 151936);
  EXPECT_EQ(config->num_key_value_heads, 4);  // = num_attention_heads
  EXPECT_EQ(config->head_dim, 128);           // transformers' Qwen3Config default, not 64 / 4
  EXPECT_EQ(config->rms_norm_eps, 1e-6);
  EXPECT_EQ(config->rope_theta, 10000.0);
  EXPECT_FALSE(config->tie_word_embeddings);
  EXPECT_EQ(config->max_position_embeddings, 32768);
  EXPECT_EQ(config->torch_dtype, "float32");
}

TEST(ModelConfig, PresetsHaveTheReleasedShapes) {
  // The other families' presets: family_test.
  EXPECT_THAT(ModelPresetNames(), ::testing::IsSupersetOf({"qwen3-0.6b", "qwen3-1.7b", "qwen3-4b",
                                                           "qwen3-8b", "qwen3-14b", "qwen3-32b"}));
  struct Expected {
    std::string name;
    int64_t hidden, intermediate, layers, heads, kv_heads;
    bool tie;
  };
  const std::vector<Expected> expected = {
      {"qwen3-0.6b", 1024, 3072, 28, 16, 8, true},  {"qwen3-1.7b", 2048, 6144, 28, 16, 8, true},
      {"qwen3-4b", 2560, 9728, 36, 32, 8, true},    {"qwen3-8b", 4096, 12288, 36, 32, 8, false},
      {"qwen3-14b", 5120, 17408, 40, 40, 8, false}, {"qwen3-32b", 5120, 25600, 64, 64, 8, false},
  };
  for (const Expected& e : expected) {
    absl::StatusOr<ModelConfig> config = ModelPreset(e.name);
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_EQ(config->vocab_size, 151936) << e.name;
    EXPECT_EQ(config->hidden_size, e.hidden) << e.name;
    EXPECT_EQ(config->intermediate_size, e.intermediate) << e.name;
    EXPECT_EQ(config->num_hidden_layers, e.layers) << e.name;
    EXPECT_EQ(config->num_attention_heads, e.heads) << e.name;
    EXPECT_EQ(config->num_key_value_heads, e.kv_heads) << e.name;
    EXPECT_EQ(config->head_dim, 128) << e.name;
    EXPECT_EQ(config->tie_word_embeddings, e.tie) << e.name;
    EXPECT_EQ(config->rope_theta, 1e6) << e.name;
    EXPECT_EQ(config->rms_norm_eps, 1e-6) << e.name;
    EXPECT_EQ(config->max_position_embeddings, 40960) << e.name;
    EXPECT_EQ(config->torch_dtype, "bfloat16") << e.name;
    EXPECT_EQ(config->model_type, "qwen3") << e.name;
    EXPECT_EQ(config->rope_scaling, RopeScaling()) << e.name;
    EXPECT_TRUE(ValidateModelConfig(*config).ok()) << e.name;
  }
  absl::StatusOr<ModelConfig> by_hub_name = ModelPreset("Qwen/Qwen3-8B");
  ASSERT_TRUE(by_hub_name.ok()) << by_hub_name.status();
  EXPECT_EQ(*by_hub_name, *ModelPreset("qwen3-8b"));
  absl::StatusOr<ModelConfig> unknown = ModelPreset("qwen3-30b");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(unknown.status().message()),
              AllOf(HasSubstr("'qwen3-30b'"), HasSubstr("qwen3-0.6b, qwen3-1.7b")));
}

TEST(ModelConfig, FromNameTakesAPresetOrAFile) {
  EXPECT_EQ(*ModelConfigFromName("Qwen/Qwen3-8B"), *ModelPreset("qwen3-8b"));
  const std::string dir = testing::FreshTestDir("model_config_from_name");
  ModelConfig small = *ModelPreset("qwen3-0.6b");
  small.num_hidden_layers = 3;
  ASSERT_TRUE(SaveModelConfig(small, dir).ok());
  const absl::StatusOr<ModelConfig> loaded = ModelConfigFromName(dir + "/config.json");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, small);
  const absl::StatusOr<ModelConfig> missing = ModelConfigFromName(dir + "/absent.json");
  EXPECT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("absent.json"));
}

TEST(ModelConfig, JsonRoundTripIsExactAndLooksLikeHuggingFace) {
  for (const std::string& name : ModelPresetNames()) {
    const ModelConfig preset = *ModelPreset(name);
    const std::string text = ModelConfigToJson(preset);
    absl::StatusOr<ModelConfig> back = ParseModelConfig(text);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, preset) << name;
  }
  ModelConfig odd = *ModelPreset("qwen3-0.6b");
  odd.rms_norm_eps = 1.0 / 3.0 * 1e-5;
  odd.rope_theta = 12345.678901234567;
  odd.torch_dtype = "float32";
  odd.num_key_value_heads = 16;
  absl::StatusOr<ModelConfig> back = ParseModelConfig(ModelConfigToJson(odd));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, odd);

  const std::string text = ModelConfigToJson(*ModelPreset("qwen3-8b"));
  EXPECT_EQ(text.back(), '\n');
  EXPECT_THAT(text, HasSubstr("\n  \"architectures\": [\n    \"Qwen3ForCausalLM\"\n  ],\n"));
  const nlohmann::json json = nlohmann::json::parse(text);
  EXPECT_EQ(json["model_type"], "qwen3");
  EXPECT_EQ(json["hidden_act"], "silu");
  EXPECT_TRUE(json["rope_scaling"].is_null());
  EXPECT_TRUE(json["sliding_window"].is_null());
  EXPECT_EQ(json["use_sliding_window"], false);
  EXPECT_EQ(json["max_window_layers"], 36);
  EXPECT_EQ(json["tie_word_embeddings"], false);
  EXPECT_EQ(json["torch_dtype"], "bfloat16");
  EXPECT_EQ(json["rms_norm_eps"], 1e-6);
  EXPECT_EQ(json["rope_theta"], 1e6);
}

TEST(ModelConfig, SaveAndLoad) {
  const std::string dir = TestDir() + "/model";  // created by Save
  const ModelConfig config = *ModelPreset("qwen3-1.7b");
  ASSERT_TRUE(SaveModelConfig(config, dir).ok());
  for (const std::string& path : {dir, dir + "/config.json"}) {
    absl::StatusOr<ModelConfig> loaded = LoadModelConfig(path);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(*loaded, config);
  }

  WriteFile(dir + "/config.json", kQwen3_0_6B);
  absl::StatusOr<ModelConfig> shipped = LoadModelConfig(dir);
  ASSERT_TRUE(shipped.ok()) << shipped.status();
  EXPECT_EQ(*shipped, *ModelPreset("qwen3-0.6b"));

  ModelConfig bad = config;
  bad.num_key_value_heads = 5;
  const absl::Status status = SaveModelConfig(bad, dir);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("field 'num_key_value_heads'"));
  EXPECT_EQ(*LoadModelConfig(dir), *ModelPreset("qwen3-0.6b"));  // untouched

  EXPECT_EQ(SaveModelConfig(config, dir + "/config.json/sub").code(),
            absl::StatusCode::kUnavailable);
}

TEST(ModelConfig, SavingOverABaseKeepsTheFieldsTheStructDoesNotModel) {
  const std::string dir = TestDir();
  WriteFile(dir + "/base.json", kQwen3_0_6B);
  ModelConfig config = *ModelPreset("qwen3-0.6b");
  config.torch_dtype = "float32";  // a published model may change its storage type
  ASSERT_TRUE(SaveModelConfig(config, dir + "/out", dir + "/base.json").ok());
  std::ifstream in(dir + "/out/config.json");
  const nlohmann::json saved = nlohmann::json::parse(in);
  EXPECT_EQ(saved["bos_token_id"], 151643);  // kept from the base, as engines read them
  EXPECT_EQ(saved["eos_token_id"], 151645);
  EXPECT_EQ(saved["torch_dtype"], "float32");  // the struct's fields win
  EXPECT_EQ(*LoadModelConfig(dir + "/out"), config);

  // The newer spellings are rewritten too, so they cannot contradict the struct.
  WriteFile(dir + "/newer.json", R"({
    "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "dtype": "bfloat16",
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "eos_token_id": 7})");
  ModelConfig small = *ParseModelConfig(R"({"hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rope_theta": 20000.0, "torch_dtype": "float64"})");
  ASSERT_TRUE(SaveModelConfig(small, dir + "/small", dir + "/newer.json").ok());
  std::ifstream small_in(dir + "/small/config.json");
  const nlohmann::json small_saved = nlohmann::json::parse(small_in);
  EXPECT_EQ(small_saved["dtype"], "float64");
  EXPECT_EQ(small_saved["rope_parameters"]["rope_theta"], 20000.0);
  EXPECT_EQ(small_saved["eos_token_id"], 7);
  EXPECT_EQ(*LoadModelConfig(dir + "/small"), small);

  // A base that would change what the file says (here: sliding-window layers) is ignored.
  WriteFile(dir + "/sliding.json",
            R"({"layer_types": ["sliding_attention", "full_attention"], "eos_token_id": 9})");
  ASSERT_TRUE(SaveModelConfig(small, dir + "/plain", dir + "/sliding.json").ok());
  std::ifstream plain_in(dir + "/plain/config.json");
  EXPECT_FALSE(nlohmann::json::parse(plain_in).contains("eos_token_id"));
  EXPECT_EQ(*LoadModelConfig(dir + "/plain"), small);

  WriteFile(dir + "/array.json", "[1, 2]");
  const absl::Status not_object = SaveModelConfig(small, dir + "/x", dir + "/array.json");
  EXPECT_EQ(not_object.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(not_object.message()), HasSubstr(dir + "/array.json"));
  EXPECT_EQ(SaveModelConfig(small, dir + "/x", dir + "/missing.json").code(),
            absl::StatusCode::kUnavailable);
}

TEST(ModelConfig, LoadingACheckpointDirectorySaysWhereItsModelIs) {
  const std::string dir = TestDir();
  ASSERT_TRUE(SaveModelConfig(*ModelPreset("qwen3-0.6b"), dir + "/model").ok());
  absl::StatusOr<ModelConfig> missing = LoadModelConfig(dir);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("a dta checkpoint: its model is in " + dir + "/model"));
}

TEST(ModelConfig, LoadErrorsNameTheFile) {
  const std::string dir = TestDir();
  absl::StatusOr<ModelConfig> missing = LoadModelConfig(dir);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr(dir + "/config.json"));

  WriteFile(dir + "/config.json", R"({"hidden_size": 64})");
  absl::StatusOr<ModelConfig> bad = LoadModelConfig(dir + "/config.json");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(bad.status().message()),
      AllOf(HasSubstr(dir + "/config.json: "), HasSubstr("field 'intermediate_size': missing")));
}

TEST(ModelConfig, RejectsBadAndUnsupportedConfigsNamingTheField) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  const auto kUnsupported = absl::StatusCode::kUnimplemented;
  // Edits of the 0.6B config.
  const std::vector<testing::RefusedConfig> cases = {
      {"missing_hidden", R"({"hidden_size": null})", kInvalid, "field 'hidden_size': missing"},
      {"missing_layers", R"({"num_hidden_layers": null})", kInvalid,
       "field 'num_hidden_layers': missing"},
      {"string_size", R"({"hidden_size": "1024"})", kInvalid,
       "field 'hidden_size': must be an integer"},
      {"float_size", R"({"intermediate_size": 3072.5})", kInvalid,
       "field 'intermediate_size': must be an integer"},
      {"zero_heads", R"({"num_attention_heads": 0})", kInvalid,
       "field 'num_attention_heads': 0 is not positive"},
      {"negative_vocab", R"({"vocab_size": -1})", kInvalid,
       "field 'vocab_size': -1 is not positive"},
      {"huge", R"({"vocab_size": 18446744073709551615})", kInvalid,
       "field 'vocab_size': 18446744073709551615 is too large"},
      {"zero_head_dim", R"({"head_dim": 0})", kInvalid, "field 'head_dim'"},
      {"gqa", R"({"num_key_value_heads": 3})", kInvalid,
       "field 'num_key_value_heads': 3 does not divide num_attention_heads = 16"},
      {"eps", R"({"rms_norm_eps": 0})", kInvalid, "field 'rms_norm_eps'"},
      {"eps_string", R"({"rms_norm_eps": "1e-6"})", kInvalid,
       "field 'rms_norm_eps': must be a number"},
      {"theta", R"({"rope_theta": -1})", kInvalid, "field 'rope_theta'"},
      {"tie_string", R"({"tie_word_embeddings": "true"})", kInvalid,
       "field 'tie_word_embeddings': must be true or false"},
      {"dtype", R"({"torch_dtype": "int8"})", kInvalid,
       "field 'torch_dtype': 'int8' is not one of"},
      {"layer_count", R"({"layer_types": ["full_attention"]})", kInvalid,
       "field 'layer_types': 1 entries for 28 layers"},
      {"mistral", R"({"model_type": "mistral"})", kUnsupported,
       "field 'model_type': 'mistral' is not supported (supported: llama, qwen2, qwen3, "
       "qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next)"},
      {"linear_layer",
       R"({"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]})",
       kUnsupported, "field 'layer_types': layer 0 is \"linear_attention\""},
      {"partial_rotary", R"({"partial_rotary_factor": 0.5})", kUnsupported,
       "field 'partial_rotary_factor': 0.5 is not supported"},
      {"dynamic", R"({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})", kUnsupported,
       "field 'rope_scaling': rope type 'dynamic' is not supported"},
      {"old_longrope", R"({"rope_scaling": {"type": "longrope", "factor": 2.0}})", kUnsupported,
       "field 'rope_scaling'"},
      {"rope_parameters", R"({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6}})",
       kInvalid, "field 'rope_parameters.factor': missing"},
      {"sliding", R"({"use_sliding_window": true})", kUnsupported,
       "field 'use_sliding_window': sliding-window attention is not supported"},
      {"sliding_layer",
       R"({"num_hidden_layers": 2, "layer_types": ["full_attention", "sliding_attention"]})",
       kUnsupported, "field 'layer_types': layer 1 is \"sliding_attention\""},
      {"bias", R"({"attention_bias": true})", kUnsupported,
       "field 'attention_bias': attention biases are not supported"},
      {"gelu", R"({"hidden_act": "gelu"})", kUnsupported,
       "field 'hidden_act': 'gelu' is not supported"},
      {"dropout", R"({"attention_dropout": 0.1})", kUnsupported,
       "field 'attention_dropout': 0.1 is not supported"},
  };
  const nlohmann::json base = nlohmann::json::parse(kQwen3_0_6B);
  testing::ExpectRefused(base, cases);

  EXPECT_THAT(std::string(ParseModelConfig("{\"hidden_size\": ").status().message()),
              HasSubstr("malformed JSON"));
  EXPECT_THAT(std::string(ParseModelConfig("[1]").status().message()),
              HasSubstr("must be a JSON object"));
  // An explicit null for a required field counts as missing.
  nlohmann::json null_hidden = base;
  null_hidden["hidden_size"] = nullptr;
  EXPECT_THAT(std::string(ParseModelConfig(null_hidden.dump()).status().message()),
              HasSubstr("field 'hidden_size': missing"));
}

}  // namespace
}  // namespace dta

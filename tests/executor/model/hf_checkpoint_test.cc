// Qwen3 checkpoints: bit-exact round trips (float32, float64, bf16 export, shards, tied
// embeddings), dtype conversion on load, and clear errors for missing, misshapen, unexpected,
// mistyped tensors and a missing config; Qwen3.5's vision-language checkpoints read as their
// language model. Parity with transformers is tests/python/test_hf_parity.py (and
// test_hf_parity_next.py for the vision-language layout).
#include "executor/model/hf_checkpoint.h"
#include "core/model/config_json.h"

#include <c10/util/Exception.h>

#include <stdlib.h>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/checkpoint/safetensors.h"
#include "core/model/model_config.h"
#include "executor/device/safetensors_tensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/executor_cases.h"

namespace dta {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// A fresh directory per test (so test cases may run in parallel), removed afterwards.
//
// Careful: libtorch.so exports its own copies of std::filesystem functions, which take precedence
// in binaries linking it, and its std::filesystem::remove_all crashes (a call through a null
// pointer) on a directory. Directories here are flat, so they are emptied with remove instead.
class TestDirectory {
 public:
  TestDirectory() {
    const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string pattern =
        (fs::path(::testing::TempDir()) / absl::StrCat("hf_checkpoint_", info->name(), "_XXXXXX"))
            .string();
    if (::mkdtemp(pattern.data()) == nullptr) ADD_FAILURE() << "mkdtemp " << pattern << " failed";
    path_ = pattern;
  }
  ~TestDirectory() {
    std::error_code error;
    std::vector<fs::path> files;
    for (const fs::directory_entry& entry : fs::directory_iterator(path_, error))
      files.push_back(entry.path());
    for (const fs::path& file : files) fs::remove(file, error);
    fs::remove(path_, error);
  }
  TestDirectory(const TestDirectory&) = delete;
  TestDirectory& operator=(const TestDirectory&) = delete;
  operator const std::string&() const { return path_; }

 private:
  std::string path_;
};

ModelConfig TinyConfig(bool tied = false) {
  ModelConfig c;
  c.vocab_size = 23;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = tied;
  c.max_position_embeddings = 512;
  c.torch_dtype = "float32";
  return c;
}

Decoder RandomModel(at::ScalarType dtype, bool tied = false, uint64_t seed = 7) {
  Decoder model(TinyConfig(tied), at::TensorOptions().dtype(dtype));
  model.InitRandom(seed, /*std=*/0.1);
  return model;
}

// The model's parameters, detached copies.
NamedTensors Parameters(const Decoder& model) {
  NamedTensors out;
  for (const auto& [name, p] : model.named_parameters()) out.emplace_back(name, p.detach().clone());
  return out;
}

// Writes a one-file checkpoint of exactly these tensors and this config.
void WriteCheckpoint(const std::string& dir, const NamedTensors& tensors,
                     const ModelConfig& config) {
  SaveNamedTensors(tensors, (fs::path(dir) / "model.safetensors").string());
  ASSERT_TRUE(SaveModelConfig(config, dir).ok());
}

// The message of the c10::Error that `f` throws ("" and a test failure if it throws none).
std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  ADD_FAILURE() << "expected a c10::Error";
  return "";
}

void ExpectSameParameters(const Decoder& a, const Decoder& b) {
  ASSERT_EQ(a.named_parameters().size(), b.named_parameters().size());
  for (size_t i = 0; i < a.named_parameters().size(); ++i) {
    const auto& [name_a, pa] = a.named_parameters()[i];
    const auto& [name_b, pb] = b.named_parameters()[i];
    EXPECT_EQ(name_a, name_b);
    EXPECT_EQ(pa.scalar_type(), pb.scalar_type()) << name_a;
    EXPECT_TRUE(at::equal(pa, pb)) << name_a;
  }
}

void ExpectRoundTrip(at::ScalarType dtype) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  const Decoder model = RandomModel(dtype);
  SaveHfModel(model, dir);
  EXPECT_TRUE(fs::exists(fs::path(dir) / "model.safetensors"));
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors.index.json"));
  const Decoder loaded = LoadHfModel(dir, at::TensorOptions().dtype(dtype));
  ModelConfig expected = model.config();
  expected.torch_dtype = dtype == at::kDouble ? "float64" : "float32";
  EXPECT_EQ(loaded.config(), expected);
  ExpectSameParameters(model, loaded);
  for (const auto& [name, p] : loaded.named_parameters()) EXPECT_TRUE(p.requires_grad()) << name;
}

TEST(HfCheckpointTest, RoundTripFloat32IsBitExact) { ExpectRoundTrip(at::kFloat); }

TEST(HfCheckpointTest, RoundTripFloat64IsBitExact) { ExpectRoundTrip(at::kDouble); }

// Llama with q/k/v/o biases and llama3 rope scaling, Qwen2 with q/k/v biases and YaRN: the biases
// are saved under their Hugging Face names, config.json names the family, and everything loads back
// bit for bit (sharded too).
TEST(HfCheckpointTest, FamiliesRoundTripWithTheirBiases) {
  for (const std::string family : {"llama", "qwen2"}) {
    SCOPED_TRACE(family);
    ModelConfig config = TinyConfig(/*tied=*/family == "qwen2");
    config.model_type = family;
    config.attention_bias = true;
    config.rope_scaling = family == "llama" ? RopeScaling{.type = RopeType::kLlama3,
                                                          .factor = 8.0,
                                                          .original_max_position_embeddings = 64,
                                                          .low_freq_factor = 1.0,
                                                          .high_freq_factor = 4.0}
                                            : RopeScaling{.type = RopeType::kYarn,
                                                          .factor = 4.0,
                                                          .original_max_position_embeddings = 128,
                                                          .beta_fast = 16.0,
                                                          .mscale = 1.0,
                                                          .mscale_all_dim = 0.5};
    for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
      Decoder model(config, at::TensorOptions().dtype(dtype));
      model.InitRandom(5, 0.1);
      for (const int64_t shard_bytes : {int64_t{5} << 30, int64_t{4096}}) {
        const TestDirectory dir_holder;
        const std::string& dir = dir_holder;
        SaveHfModel(model, dir, std::nullopt, shard_bytes);
        absl::StatusOr<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::Open(dir);
        ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
        const std::set<std::string> names(checkpoint->names().begin(), checkpoint->names().end());
        EXPECT_TRUE(names.count("model.layers.1.self_attn.q_proj.bias"));
        EXPECT_TRUE(names.count("model.layers.1.self_attn.k_proj.bias"));
        EXPECT_TRUE(names.count("model.layers.1.self_attn.v_proj.bias"));
        EXPECT_EQ(names.count("model.layers.1.self_attn.o_proj.bias"), family == "llama" ? 1u : 0u);
        EXPECT_FALSE(names.count("model.layers.1.self_attn.q_norm.weight"));
        const Decoder loaded = LoadHfModel(dir, at::TensorOptions().dtype(dtype));
        ModelConfig expected = config;
        expected.torch_dtype = dtype == at::kDouble ? "float64" : "float32";
        EXPECT_EQ(loaded.config(), expected);
        ExpectSameParameters(model, loaded);
      }
    }
  }
}

TEST(HfCheckpointTest, Bf16ExportStoresBf16AndLoadsIntoAnyDtype) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  const Decoder model = RandomModel(at::kFloat);
  SaveHfModel(model, dir, at::kBFloat16);
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->torch_dtype, "bfloat16");
  absl::StatusOr<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ(checkpoint->names().size(), model.named_parameters().size());
  for (const std::string& name : checkpoint->names())
    EXPECT_EQ(checkpoint->Find(name)->dtype, DType::kBF16) << name;
  // The parameter is the only thing bf16 rounds: half the bytes of float32.
  int64_t numel = 0;
  for (const auto& [name, p] : model.named_parameters()) numel += p.numel();
  EXPECT_EQ(checkpoint->total_bytes(), 2 * numel);

  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kDouble}) {
    const Decoder loaded = LoadHfModel(dir, at::TensorOptions().dtype(dtype));
    for (size_t i = 0; i < model.named_parameters().size(); ++i) {
      const auto& [name, p] = model.named_parameters()[i];
      const at::Tensor& q = loaded.named_parameters()[i].second;
      EXPECT_EQ(q.scalar_type(), dtype);
      // bf16 -> float32/float64 is exact, so this is bit-exact too.
      EXPECT_TRUE(at::equal(q, p.detach().to(at::kBFloat16).to(dtype))) << name;
    }
  }
}

TEST(HfCheckpointTest, LoadConvertsHalfAndDoubleSources) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  const Decoder model = RandomModel(at::kFloat);
  // Mixed storage dtypes in one file: the loader converts each tensor on its own.
  NamedTensors tensors = Parameters(model);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (i % 2 == 0)
      tensors[i].second = tensors[i].second.to(at::kHalf);
    else
      tensors[i].second = tensors[i].second.to(at::kDouble);
  }
  WriteCheckpoint(dir, tensors, model.config());
  const Decoder loaded = LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat));
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_TRUE(at::equal(loaded.named_parameters()[i].second, tensors[i].second.to(at::kFloat)))
        << tensors[i].first;
  }
}

TEST(HfCheckpointTest, ShardedSaveAndLoad) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  const Decoder model = RandomModel(at::kFloat);
  // Fills the directory with a one-file save first: the sharded save must replace it.
  SaveHfModel(model, dir);
  SaveHfModel(model, dir, std::nullopt, /*max_shard_bytes=*/4096);
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors"));
  EXPECT_TRUE(fs::exists(fs::path(dir) / "model.safetensors.index.json"));
  absl::StatusOr<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_GT(checkpoint->files().size(), 3u);
  for (const SafetensorsFile& file : checkpoint->files()) {
    EXPECT_THAT(file.path(), HasSubstr("-of-"));
  }
  ExpectSameParameters(model, LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat)));
}

TEST(HfCheckpointTest, TiedEmbeddingsSaveNoHeadAndLoadTied) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  const Decoder model = RandomModel(at::kFloat, /*tied=*/true);
  SaveHfModel(model, dir);
  absl::StatusOr<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ(checkpoint->Find("lm_head.weight"), nullptr);
  const Decoder loaded = LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat));
  EXPECT_TRUE(loaded.config().tie_word_embeddings);
  ExpectSameParameters(model, loaded);
  // The head is the embedding: the same logits through Logprobs.
  const at::Tensor hidden = at::randn({3, 16});
  const at::Tensor targets = at::tensor({0, 5, 22}, at::kLong);
  EXPECT_TRUE(at::equal(model.Logprobs(hidden, targets), loaded.Logprobs(hidden, targets)));
}

TEST(HfCheckpointTest, TiedEmbeddingsAcceptAStoredHeadEqualToTheEmbedding) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  const Decoder model = RandomModel(at::kFloat, /*tied=*/true);
  NamedTensors tensors = Parameters(model);
  // Stored in another dtype than the embedding: compared by value.
  tensors.emplace_back("lm_head.weight",
                       model.parameter("model.embed_tokens.weight").detach().to(at::kDouble));
  WriteCheckpoint(dir, tensors, model.config());
  ExpectSameParameters(model, LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat)));
}

TEST(HfCheckpointTest, TiedEmbeddingsRefuseAStoredHeadThatDiffers) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  const Decoder model = RandomModel(at::kFloat, /*tied=*/true);
  NamedTensors tensors = Parameters(model);
  tensors.emplace_back("lm_head.weight", model.parameter("model.embed_tokens.weight").detach() + 1);
  WriteCheckpoint(dir, tensors, model.config());
  EXPECT_THAT(ErrorOf([&] { LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat)); }),
              AllOf(HasSubstr("model.safetensors"), HasSubstr("'lm_head.weight' differs"),
                    HasSubstr("tie_word_embeddings")));
}

TEST(HfCheckpointTest, InvFreqBuffersAreIgnored) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  const Decoder model = RandomModel(at::kFloat);
  NamedTensors tensors = Parameters(model);
  tensors.emplace_back("model.rotary_emb.inv_freq", at::ones({4}));
  tensors.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", at::ones({4}));
  WriteCheckpoint(dir, tensors, model.config());
  ExpectSameParameters(model, LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat)));
}

TEST(HfCheckpointTest, MissingTensorIsNamed) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  const Decoder model = RandomModel(at::kFloat);
  NamedTensors tensors = Parameters(model);
  std::erase_if(tensors,
                [](const auto& t) { return t.first == "model.layers.1.mlp.up_proj.weight"; });
  WriteCheckpoint(dir, tensors, model.config());
  EXPECT_THAT(ErrorOf([&] { LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat)); }),
              AllOf(HasSubstr(dir), HasSubstr("model.layers.1.mlp.up_proj.weight")));
}

TEST(HfCheckpointTest, MissingHeadOfAnUntiedModelIsNamed) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  const Decoder model = RandomModel(at::kFloat, /*tied=*/true);
  ModelConfig untied = model.config();
  untied.tie_word_embeddings = false;
  WriteCheckpoint(dir, Parameters(model), untied);
  EXPECT_THAT(ErrorOf([&] { LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat)); }),
              HasSubstr("lm_head.weight"));
}

TEST(HfCheckpointTest, WrongShapeNamesTensorFileAndBothShapes) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  const Decoder model = RandomModel(at::kFloat);
  NamedTensors tensors = Parameters(model);
  for (auto& [name, t] : tensors) {
    if (name == "model.layers.0.self_attn.k_proj.weight") t = at::zeros({8, 16});  // want [16, 16]
  }
  WriteCheckpoint(dir, tensors, model.config());
  EXPECT_THAT(
      ErrorOf([&] { LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat)); }),
      AllOf(HasSubstr("model.safetensors"), HasSubstr("model.layers.0.self_attn.k_proj.weight"),
            HasSubstr("[8, 16]"), HasSubstr("[16, 16]")));
}

TEST(HfCheckpointTest, UnexpectedTensorsAreNamed) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  const Decoder model = RandomModel(at::kFloat);
  NamedTensors tensors = Parameters(model);
  tensors.emplace_back("model.layers.0.self_attn.q_proj.bias", at::zeros({32}));
  tensors.emplace_back("model.layers.2.mlp.up_proj.weight", at::zeros({24, 16}));
  WriteCheckpoint(dir, tensors, model.config());
  EXPECT_THAT(
      ErrorOf([&] { LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat)); }),
      AllOf(HasSubstr("2 unexpected"), HasSubstr("'model.layers.0.self_attn.q_proj.bias'"),
            HasSubstr("'model.layers.2.mlp.up_proj.weight'"), HasSubstr("model.safetensors")));
}

// A small model of `family`'s (testing::WithFamily: for Qwen3.5 a Gated DeltaNet layer and a
// gated attention layer, dense or with experts in both).
ModelConfig FamilyConfig(const std::string& family) {
  return testing::WithFamily(TinyConfig(), family);
}

// `model` written as the Hub's Qwen3.5 checkpoints are: a vision-language model's config.json
// (model_type `wrapper`, the decoder's config in text_config), the decoder's "model.*" tensors
// under "model.language_model.*" (lm_head.weight as it is), a vision tower and a multi-token
// prediction head beside them, and `extra` tensors.
void WriteVisionLanguageCheckpoint(const std::string& dir, const Decoder& model,
                                   const std::string& wrapper, const NamedTensors& extra = {}) {
  const TestDirectory decoder;
  SaveHfModel(model, decoder);
  absl::StatusOr<SafetensorsCheckpoint> saved = SafetensorsCheckpoint::Open(decoder);
  ASSERT_TRUE(saved.ok()) << saved.status();
  NamedTensors tensors = extra;
  for (const std::string& name : saved->names()) {
    const std::string stored =
        name.starts_with("model.") ? "model.language_model." + name.substr(6) : name;
    tensors.emplace_back(stored, TensorFromView(*saved->Find(name), at::kFloat));
  }
  tensors.emplace_back("model.visual.blocks.0.attn.qkv.weight", at::ones({6, 2}));
  tensors.emplace_back("mtp.layers.0.mlp.up_proj.weight", at::ones({2, 2}));
  SaveNamedTensors(tensors, (fs::path(dir) / "model.safetensors").string());
  std::ofstream(fs::path(dir) / "config.json")
      << absl::StrCat(R"({"model_type": ")", wrapper,
                      R"(", "architectures": ["Qwen3_5ForConditionalGeneration"],
                      "vision_config": {"depth": 1}, "text_config": )",
                      ModelConfigToJson(model.config()), "}");
}

// Qwen3.5's vision-language checkpoints load as their language model, whose tensors they hold
// under "model.language_model."; the vision tower and the multi-token prediction head are skipped
// (as transformers' Qwen3_5ForCausalLM does). Saved again, the model is the decoder alone.
TEST(HfCheckpointTest, Qwen35VisionLanguageCheckpointsLoadTheirLanguageModel) {
  for (const bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "qwen3_5_moe" : "qwen3_5");
    Decoder model(FamilyConfig(moe ? "qwen3_5_moe_text" : "qwen3_5_text"),
                  at::TensorOptions().dtype(at::kFloat));
    model.InitRandom(3, 0.1);
    const TestDirectory dir;
    WriteVisionLanguageCheckpoint(dir, model, moe ? "qwen3_5_moe" : "qwen3_5");
    const Decoder loaded = LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat));
    EXPECT_EQ(loaded.config(), model.config());
    ExpectSameParameters(model, loaded);

    const TestDirectory again;
    SaveHfModel(loaded, again);
    absl::StatusOr<SafetensorsCheckpoint> saved = SafetensorsCheckpoint::Open(again);
    ASSERT_TRUE(saved.ok()) << saved.status();
    for (const std::string& name : saved->names()) {
      EXPECT_TRUE(name.starts_with("model.layers.") || name.starts_with("model.embed_tokens.") ||
                  name == "model.norm.weight" || name == "lm_head.weight")
          << name;
    }
    EXPECT_EQ(LoadModelConfig(again)->model_type, model.config().model_type);
  }
}

TEST(HfCheckpointTest, Qwen35TensorsStoredUnderBothNamesAreRefused) {
  Decoder model(FamilyConfig("qwen3_5_text"), at::TensorOptions().dtype(at::kFloat));
  model.InitRandom(3, 0.1);
  const TestDirectory dir;
  WriteVisionLanguageCheckpoint(dir, model, "qwen3_5", {{"model.norm.weight", at::ones({16})}});
  EXPECT_THAT(ErrorOf([&] { LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat)); }),
              AllOf(HasSubstr("'model.norm.weight' is stored twice"),
                    HasSubstr("'model.language_model.norm.weight'")));
}

// Qwen3-Next's checkpoints on the Hub hold a multi-token prediction head, which
// Qwen3NextForCausalLM skips; a vision tower it would not.
TEST(HfCheckpointTest, Qwen3NextSkipsItsMultiTokenPredictionHead) {
  ModelConfig config = FamilyConfig("qwen3_next");
  config.num_experts = 0;  // every MLP dense: the model's names are its tensors' (Parameters)
  Decoder model(config, at::TensorOptions().dtype(at::kFloat));
  model.InitRandom(3, 0.1);
  NamedTensors tensors = Parameters(model);
  tensors.emplace_back("mtp.fc.weight", at::ones({2, 2}));
  const TestDirectory dir;
  WriteCheckpoint(dir, tensors, model.config());
  ExpectSameParameters(model, LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat)));
  tensors.emplace_back("model.visual.patch_embed.proj.weight", at::ones({2, 2}));
  const TestDirectory with_vision;
  WriteCheckpoint(with_vision, tensors, model.config());
  EXPECT_THAT(ErrorOf([&] { LoadHfModel(with_vision, at::TensorOptions().dtype(at::kFloat)); }),
              AllOf(HasSubstr("1 unexpected"), HasSubstr("'model.visual.patch_embed.proj.weight'"),
                    HasSubstr("Qwen3-Next")));
}

TEST(HfCheckpointTest, TiedConfigOverAnUntiedCheckpointIsRefused) {
  // An untied model saved, then loaded with a config that ties: lm_head must equal the embedding.
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  const Decoder model = RandomModel(at::kFloat);
  SaveHfModel(model, dir);
  ModelConfig tied = model.config();
  tied.tie_word_embeddings = true;
  ASSERT_TRUE(SaveModelConfig(tied, dir).ok());
  EXPECT_THAT(ErrorOf([&] { LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat)); }),
              HasSubstr("'lm_head.weight' differs"));
}

TEST(HfCheckpointTest, NonFloatStorageIsRefusedNamingTheTensor) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  const Decoder model = RandomModel(at::kFloat);
  NamedTensors tensors = Parameters(model);
  for (auto& [name, t] : tensors) {
    if (name == "model.norm.weight") t = t.to(at::kInt);
  }
  WriteCheckpoint(dir, tensors, model.config());
  EXPECT_THAT(
      ErrorOf([&] { LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat)); }),
      AllOf(HasSubstr("model.safetensors"), HasSubstr("'model.norm.weight'"), HasSubstr("I32")));
}

TEST(HfCheckpointTest, MissingConfigNamesTheFile) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  SaveHfModel(RandomModel(at::kFloat), dir);
  fs::remove(fs::path(dir) / "config.json");
  EXPECT_THAT(ErrorOf([&] { LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat)); }),
              AllOf(HasSubstr(dir), HasSubstr("config.json")));
}

TEST(HfCheckpointTest, MissingWeightsNameTheDirectory) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  ASSERT_TRUE(SaveModelConfig(TinyConfig(), dir).ok());
  const std::string message =
      ErrorOf([&] { LoadHfModel(dir, at::TensorOptions().dtype(at::kFloat)); });
  EXPECT_THAT(message, AllOf(HasSubstr(dir), HasSubstr("model.safetensors")));
}

TEST(HfCheckpointTest, SaveRefusesNonFloatDtype) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  EXPECT_THAT(ErrorOf([&] { SaveHfModel(RandomModel(at::kFloat), dir, at::kLong); }),
              AllOf(HasSubstr(dir), HasSubstr("cannot store weights")));
}

TEST(HfCheckpointTest, SaveNamedTensorsKeepsDtypesShapesAndBytes) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  const std::string path = (fs::path(dir) / "grads.safetensors").string();
  const NamedTensors tensors = {
      {"a.grad", at::randn({3, 4}, at::kDouble)},
      {"b.grad", at::randn({5}, at::kFloat).to(at::kBFloat16)},
      {"c", at::arange(6, at::kLong).view({2, 3}).t()},  // not contiguous
      {"d", at::tensor({1, 0, 1}).to(at::kBool)},
      {"e", at::randn({2, 2}, at::kHalf)},
      {"empty", at::zeros({0, 3})},
  };
  SaveNamedTensors(tensors, path);
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata().at("format"), "pt");
  ASSERT_EQ(file->tensors().size(), tensors.size());
  const std::vector<DType> dtypes = {DType::kF64,  DType::kBF16, DType::kI64,
                                     DType::kBool, DType::kF16,  DType::kF32};
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    const TensorView* view = file->Find(name);
    ASSERT_NE(view, nullptr) << name;
    EXPECT_EQ(view->dtype, dtypes[i]) << name;
    EXPECT_EQ(view->shape, std::vector<int64_t>(t.sizes().begin(), t.sizes().end())) << name;
    const at::Tensor c = t.contiguous();
    ASSERT_EQ(view->nbytes(), static_cast<int64_t>(c.nbytes())) << name;
    if (c.nbytes() > 0) {
      EXPECT_EQ(std::memcmp(view->data.data(), c.const_data_ptr(), c.nbytes()), 0) << name;
    }
  }
}

TEST(HfCheckpointTest, SaveNamedTensorsRefusesUnsupportedDtypeAndDuplicates) {
  const TestDirectory dir_holder;
  const std::string& dir = dir_holder;
  const std::string path = (fs::path(dir) / "bad.safetensors").string();
  EXPECT_THAT(ErrorOf([&] {
                SaveNamedTensors({{"z", at::zeros({2}, at::kComplexFloat)}}, path);
              }),
              AllOf(HasSubstr(path), HasSubstr("'z'")));
  EXPECT_THAT(ErrorOf([&] {
                SaveNamedTensors({{"x", at::zeros({2})}, {"x", at::zeros({2})}}, path);
              }),
              AllOf(HasSubstr("x"), HasSubstr("duplicate")));
  EXPECT_FALSE(fs::exists(path));
}

}  // namespace
}  // namespace dta

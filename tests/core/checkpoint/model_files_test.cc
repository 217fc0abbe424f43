#include "core/checkpoint/model_files.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/core/checkpoint/test_dir.h"

namespace dta {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<std::string> Listing(const std::string& dir) {
  std::vector<std::string> names;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(ModelFiles, CopiesTheTokenizerAndGenerationConfigAndNothingElse) {
  const std::string dir = testing::FreshTestDir("model_files");
  const std::string source = dir + "/source", out = dir + "/out";
  fs::create_directories(source);
  fs::create_directories(out);
  WriteFile(source + "/tokenizer.json", R"({"model": {"type": "BPE"}})");
  WriteFile(source + "/tokenizer_config.json", R"({"eos_token": "<|im_end|>"})");
  WriteFile(source + "/merges.txt", "a b\n");
  WriteFile(source + "/chat_template.jinja", "{{ messages }}");
  WriteFile(source + "/generation_config.json", R"({"eos_token_id": [1, 2], "top_p": 0.8})");
  // Not the engines' business: weights, their index, docs, the training state.
  for (const char* other : {"model.safetensors", "model.safetensors.index.json", "README.md",
                            "optimizer.safetensors", "config.json"}) {
    WriteFile(source + "/" + other, "x");
  }
  absl::StatusOr<std::vector<std::string>> copied = CopyModelCompanionFiles(source, out);
  ASSERT_TRUE(copied.ok()) << copied.status();
  EXPECT_THAT(*copied, ElementsAre("chat_template.jinja", "generation_config.json", "merges.txt",
                                   "tokenizer.json", "tokenizer_config.json"));
  EXPECT_EQ(Listing(out), *copied);
  for (const std::string& name : *copied) {
    EXPECT_EQ(ReadFile(out + "/" + name), ReadFile(source + "/" + name)) << name;
  }
}

TEST(ModelFiles, WithoutAGenerationConfigOneIsDerivedFromTheModelConfig) {
  const std::string dir = testing::FreshTestDir("model_files");
  const std::string source = dir + "/source", out = dir + "/out";
  fs::create_directories(source);
  fs::create_directories(out);
  WriteFile(source + "/config.json",
            R"({"bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": null})");
  absl::StatusOr<std::vector<std::string>> copied = CopyModelCompanionFiles(source, out);
  ASSERT_TRUE(copied.ok()) << copied.status();
  EXPECT_THAT(*copied, ElementsAre("generation_config.json"));
  EXPECT_EQ(
      nlohmann::json::parse(ReadFile(out + "/generation_config.json")),
      nlohmann::json(
          {{"_from_model_config", true}, {"bos_token_id", 151643}, {"eos_token_id", 151645}}));

  // No source at all (random weights).
  const std::string bare = dir + "/bare";
  fs::create_directories(bare);
  copied = CopyModelCompanionFiles("", bare);
  ASSERT_TRUE(copied.ok()) << copied.status();
  EXPECT_EQ(nlohmann::json::parse(ReadFile(bare + "/generation_config.json")),
            nlohmann::json({{"_from_model_config", true}}));
}

TEST(ModelFiles, ErrorsNameTheDirectoryOrFile) {
  const std::string dir = testing::FreshTestDir("model_files");
  absl::StatusOr<std::vector<std::string>> missing = CopyModelCompanionFiles(dir + "/nope", dir);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr(dir + "/nope"));

  WriteFile(dir + "/tokenizer.json", "{}");
  absl::StatusOr<std::vector<std::string>> unwritable =
      CopyModelCompanionFiles(dir, dir + "/no/such/dir");
  EXPECT_EQ(unwritable.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(unwritable.status().message()),
              HasSubstr(dir + "/no/such/dir/tokenizer.json"));
}

}  // namespace
}  // namespace dta

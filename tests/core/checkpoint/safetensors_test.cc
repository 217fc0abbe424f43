#include "core/checkpoint/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/core/checkpoint/test_dir.h"

namespace dta {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string TestDir() { return testing::FreshTestDir("safetensors"); }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// The 8-byte little-endian header length.
std::string LengthPrefix(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out;
}

// A file from its header and data buffer.
std::string RawFile(const std::string& header, const std::string& data) {
  return LengthPrefix(header.size()) + header + data;
}

absl::Span<const uint8_t> Bytes(const std::string& s) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

std::string AsString(absl::Span<const uint8_t> data) {
  return std::string(reinterpret_cast<const char*>(data.data()), data.size());
}

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

TEST(SafetensorsDType, NamesSizesAndParsing) {
  const std::vector<std::tuple<DType, std::string, int64_t>> expected = {
      {DType::kF64, "F64", 8}, {DType::kF32, "F32", 4},        {DType::kBF16, "BF16", 2},
      {DType::kF16, "F16", 2}, {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kF8E5M2, "F8_E5M2", 1},
      {DType::kI64, "I64", 8}, {DType::kI32, "I32", 4},        {DType::kI16, "I16", 2},
      {DType::kI8, "I8", 1},   {DType::kU64, "U64", 8},        {DType::kU32, "U32", 4},
      {DType::kU16, "U16", 2}, {DType::kU8, "U8", 1},          {DType::kBool, "BOOL", 1},
  };
  for (const auto& [dtype, name, size] : expected) {
    EXPECT_EQ(DTypeName(dtype), name);
    EXPECT_EQ(DTypeSize(dtype), size) << name;
    absl::StatusOr<DType> parsed = DTypeFromName(name);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, dtype);
  }
  EXPECT_THAT(std::string(DTypeFromName("F4").status().message()), HasSubstr("'F4'"));
  EXPECT_FALSE(DTypeFromName("f32").ok());
}

TEST(SafetensorsFile, RoundTripOfEveryDTypeIsBitExact) {
  const std::string path = TestDir() + "/all.safetensors";
  const std::vector<std::pair<DType, std::vector<int64_t>>> specs = {
      {DType::kF64, {3}},    {DType::kF32, {2, 3}}, {DType::kBF16, {5}}, {DType::kF16, {1, 1, 3}},
      {DType::kF8E4M3, {7}}, {DType::kF8E5M2, {2}}, {DType::kI64, {2}},  {DType::kI32, {}},
      {DType::kI16, {3, 1}}, {DType::kI8, {9}},     {DType::kU64, {1}},  {DType::kU32, {4}},
      {DType::kU16, {0, 4}}, {DType::kU8, {11}},    {DType::kBool, {6}},
  };
  std::vector<std::string> storage;
  std::vector<TensorToWrite> tensors;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& [dtype, shape] = specs[i];
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    storage.push_back(RandomBytes(numel * DTypeSize(dtype), i));
    if (dtype == DType::kBool) {
      for (char& c : storage.back()) c &= 1;
    }
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    tensors.push_back({absl::StrCat("t", i, ".", std::string(DTypeName(specs[i].first))),
                       specs[i].first, specs[i].second, Bytes(storage[i])});
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"step", "17"}};
  ASSERT_TRUE(WriteSafetensors(path, tensors, metadata).ok());

  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->path(), path);
  EXPECT_EQ(file->metadata(), metadata);
  ASSERT_EQ(file->tensors().size(), tensors.size());
  for (size_t i = 1; i < file->tensors().size(); ++i) {
    EXPECT_LT(file->tensors()[i - 1].name, file->tensors()[i].name);
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorView* view = file->Find(tensors[i].name);
    ASSERT_NE(view, nullptr) << tensors[i].name;
    EXPECT_EQ(view->name, tensors[i].name);
    EXPECT_EQ(view->dtype, tensors[i].dtype) << view->name;
    EXPECT_EQ(view->shape, tensors[i].shape) << view->name;
    EXPECT_EQ(view->numel() * DTypeSize(view->dtype), view->nbytes()) << view->name;
    EXPECT_EQ(AsString(view->data), storage[i]) << view->name;
    // Laid out largest element first: every tensor is aligned to its element size.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(view->data.data()) % DTypeSize(view->dtype), 0u)
        << view->name;
  }
  EXPECT_EQ(file->Find("t7.I32")->numel(), 1);   // 0-d
  EXPECT_EQ(file->Find("t12.U16")->numel(), 0);  // empty
  EXPECT_EQ(file->Find("t12.U16")->nbytes(), 0);
  EXPECT_EQ(file->Find("nope"), nullptr);

  // The header length is a multiple of 8 and the header ends in spaces, not NULs.
  const std::string raw = ReadFile(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(raw[i]);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_TRUE(nlohmann::json::accept(raw.substr(8, n)));
}

TEST(SafetensorsFile, WritesTheReferenceLayoutByteForByte) {
  const std::string path = TestDir() + "/small.safetensors";
  const float floats[] = {1.0f, -2.0f};
  const uint8_t bytes[] = {7, 8, 9};
  const TensorToWrite tensors[] = {
      {"a", DType::kU8, {3}, absl::Span<const uint8_t>(bytes, 3)},
      {"b",
       DType::kF32,
       {2},
       absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(floats), 8)},
  };
  ASSERT_TRUE(WriteSafetensors(path, tensors, {{"format", "pt"}}).ok());
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("a":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}})";
  const std::string padded = header + std::string((8 - header.size() % 8) % 8, ' ');
  EXPECT_EQ(ReadFile(path), RawFile(padded, std::string(reinterpret_cast<const char*>(floats), 8) +
                                                "\x07\x08\x09"));
}

TEST(SafetensorsFile, EmptyFileAndScalar) {
  const std::string dir = TestDir();
  ASSERT_TRUE(WriteSafetensors(dir + "/empty.safetensors", {}).ok());
  EXPECT_EQ(ReadFile(dir + "/empty.safetensors"), RawFile("{}      ", ""));
  absl::StatusOr<SafetensorsFile> empty = SafetensorsFile::Open(dir + "/empty.safetensors");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->tensors().empty());
  EXPECT_TRUE(empty->metadata().empty());

  const double pi = 3.141592653589793;
  const TensorToWrite scalar[] = {
      {"pi", DType::kF64, {}, absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(&pi), 8)}};
  ASSERT_TRUE(WriteSafetensors(dir + "/scalar.safetensors", scalar).ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(dir + "/scalar.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  const TensorView* view = file->Find("pi");
  ASSERT_NE(view, nullptr);
  EXPECT_TRUE(view->shape.empty());
  double back;
  std::memcpy(&back, view->data.data(), 8);
  EXPECT_EQ(back, pi);
}

TEST(SafetensorsFile, ViewsSurviveMoves) {
  const std::string path = TestDir() + "/move.safetensors";
  const std::string data = RandomBytes(64, 3);
  const TensorToWrite tensors[] = {{"w", DType::kF32, {4, 4}, Bytes(data)}};
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
  absl::StatusOr<SafetensorsFile> opened = SafetensorsFile::Open(path);
  ASSERT_TRUE(opened.ok()) << opened.status();
  SafetensorsFile file = *std::move(opened);
  std::vector<SafetensorsFile> files;
  files.push_back(std::move(file));
  SafetensorsFile moved = std::move(files[0]);
  files.clear();
  ASSERT_NE(moved.Find("w"), nullptr);
  EXPECT_EQ(AsString(moved.Find("w")->data), data);
}

TEST(SafetensorsFile, WriteRejectsBadTensors) {
  const std::string dir = TestDir();
  const std::string path = dir + "/bad.safetensors";
  const std::string four(4, 'x');
  struct Case {
    std::vector<TensorToWrite> tensors;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{{"w", DType::kF32, {2}, Bytes(four)}},
       "tensor 'w': 4 bytes of data for shape [2] of F32 (8 bytes)"},
      {{{"w", DType::kU8, {-4}, Bytes(four)}}, "tensor 'w': shape [-4] has a negative dimension"},
      {{{"w", DType::kU8, {4}, Bytes(four)}, {"w", DType::kU8, {4}, Bytes(four)}},
       "tensor 'w': duplicate name"},
      {{{"__metadata__", DType::kU8, {4}, Bytes(four)}}, "reserved"},
  };
  for (const Case& c : cases) {
    const absl::Status status = WriteSafetensors(path, c.tensors);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.expected;
    EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr(path), HasSubstr(c.expected)));
  }
  EXPECT_FALSE(fs::exists(path));

  const std::string unwritable = dir + "/no/such/dir/x.safetensors";
  const TensorToWrite ok[] = {{"w", DType::kU8, {4}, Bytes(four)}};
  const absl::Status status = WriteSafetensors(unwritable, ok);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(status.message()), HasSubstr(unwritable));
}

struct CorruptCase {
  std::string name;
  std::string bytes;
  std::string tensor;    // expected in the message when not empty
  std::string expected;  // substring of the message
};

TEST(SafetensorsFile, RejectsCorruptFilesNamingFileAndTensor) {
  const std::string dir = TestDir();
  const std::string f32x1 = R"({"dtype":"F32","shape":[1],"data_offsets":)";
  const std::vector<CorruptCase> cases = {
      {"short", "abc", "", "only 3 bytes, too short"},
      {"past_end", LengthPrefix(100) + "{}", "",
       "header length 100 runs past the end of the 10-byte file"},
      {"not_json", RawFile("{\"w\": ", ""), "", "header is not valid JSON"},
      {"not_object", RawFile("[1, 2]", ""), "", "header is not a JSON object"},
      {"duplicate",
       RawFile(absl::StrCat(R"({"w":)", f32x1, R"([0,4]},"w":)", f32x1, "[0,4]}}"),
               std::string(4, 'x')),
       "", "header key 'w' appears more than once"},
      {"metadata_not_object", RawFile(R"({"__metadata__": [1]})", ""), "",
       "'__metadata__' is not a JSON object"},
      {"metadata_not_string", RawFile(R"({"__metadata__": {"step": 3}})", ""), "",
       "'__metadata__' entry 'step' is not a string"},
      {"entry_not_object", RawFile(R"({"w": 3})", ""), "w", "entry is not a JSON object"},
      {"extra_field",
       RawFile(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"strides":[1]}})", "xxxx"),
       "w", "unexpected field 'strides'"},
      {"missing_dtype", RawFile(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", "xxxx"), "w",
       "missing 'dtype'"},
      {"missing_offsets", RawFile(R"({"w":{"dtype":"F32","shape":[1]}})", "xxxx"), "w",
       "missing 'data_offsets'"},
      {"unknown_dtype", RawFile(R"({"w":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}})", "xxxx"),
       "w", "unknown or unsupported dtype 'Q4'"},
      {"dtype_not_string", RawFile(R"({"w":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})", "xxxx"),
       "w", "'dtype' is not a string"},
      {"negative_dim", RawFile(R"({"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})", ""),
       "w", "'shape' dimension 0 = -1 is not a non-negative integer"},
      {"fractional_dim",
       RawFile(R"({"w":{"dtype":"U8","shape":[2, 1.5],"data_offsets":[0,3]}})", "xxx"), "w",
       "'shape' dimension 1 = 1.5 is not a non-negative integer"},
      {"shape_not_array", RawFile(R"({"w":{"dtype":"U8","shape":3,"data_offsets":[0,3]}})", "xxx"),
       "w", "'shape' is not an array"},
      {"offsets_arity", RawFile(absl::StrCat(R"({"w":)", f32x1, "[0]}}"), "xxxx"), "w",
       "'data_offsets' = [0] is not [begin, end]"},
      {"offsets_negative", RawFile(absl::StrCat(R"({"w":)", f32x1, "[-4,0]}}"), "xxxx"), "w",
       "'data_offsets' = [-4,0] is not [begin, end]"},
      {"offsets_reversed", RawFile(absl::StrCat(R"({"w":)", f32x1, "[4,0]}}"), "xxxx"), "w",
       "data_offsets [4, 0] are not within the 4-byte data buffer"},
      {"offsets_past_end", RawFile(absl::StrCat(R"({"w":)", f32x1, "[0,8]}}"), "xxxx"), "w",
       "data_offsets [0, 8] are not within the 4-byte data buffer"},
      {"size_mismatch",
       RawFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "xxxx"), "w",
       "data_offsets [0, 4] hold 4 bytes but shape [2] of F32 needs 8 bytes"},
      {"numel_overflow",
       RawFile(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})",
               "xxxx"),
       "w", "needs more than 2^63 bytes"},
      {"gap",
       RawFile(absl::StrCat(R"({"a":)", f32x1, R"([0,4]},"b":)", f32x1, "[8,12]}}"),
               std::string(12, 'x')),
       "b", "data_offsets start at 8, leaving a gap of 4 bytes after tensor 'a'"},
      {"gap_at_start", RawFile(absl::StrCat(R"({"a":)", f32x1, "[4,8]}}"), std::string(8, 'x')),
       "a", "leaving a gap of 4 bytes after the start of the data buffer"},
      {"overlap",
       RawFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
               R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
               std::string(8, 'x')),
       "b", "data_offsets [4, 8] overlap tensor 'a', which ends at 8"},
      {"trailing", RawFile(absl::StrCat(R"({"a":)", f32x1, "[0,4]}}"), std::string(6, 'x')), "",
       "the data buffer has 2 bytes after the last tensor"},
      {"invalid_utf8", RawFile("{\"\xff\": 1}", ""), "", "header is not valid JSON"},
  };
  for (const CorruptCase& c : cases) {
    const std::string path = absl::StrCat(dir, "/", c.name, ".safetensors");
    WriteFile(path, c.bytes);
    const absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok()) << c.name;
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(std::string(file.status().message()), AllOf(HasSubstr(path), HasSubstr(c.expected)))
        << c.name;
    if (!c.tensor.empty()) {
      EXPECT_THAT(std::string(file.status().message()),
                  HasSubstr(absl::StrCat("tensor '", c.tensor, "'")))
          << c.name;
    }
  }
}

TEST(SafetensorsFile, RejectsAHugeHeaderLengthAndMissingFiles) {
  const std::string dir = TestDir();
  // A sparse file big enough to hold the declared header, which is over the 100 MB limit.
  const std::string path = dir + "/huge.safetensors";
  const uint64_t n = 100'000'008;
  WriteFile(path, LengthPrefix(n));
  fs::resize_file(path, 8 + n);
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(file.status().message()),
              AllOf(HasSubstr(path), HasSubstr("exceeds the limit")));
  fs::remove(path);

  file = SafetensorsFile::Open(dir + "/absent.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(file.status().message()), HasSubstr("absent.safetensors"));

  file = SafetensorsFile::Open(dir);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(file.status().message()), HasSubstr("not a regular file"));
}

// Tensors of 40, 24, 16, 64 and 8 bytes.
struct Model {
  std::vector<std::string> storage;
  std::vector<TensorToWrite> tensors;

  Model() {
    const std::vector<std::tuple<std::string, DType, std::vector<int64_t>>> specs = {
        {"model.embed_tokens.weight", DType::kF32, {2, 5}},
        {"model.layers.0.mlp.up_proj.weight", DType::kBF16, {3, 4}},
        {"model.layers.0.input_layernorm.weight", DType::kF64, {2}},
        {"model.layers.1.mlp.up_proj.weight", DType::kF32, {4, 4}},
        {"model.norm.weight", DType::kF32, {2}},
    };
    storage.reserve(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) {
      const auto& [name, dtype, shape] = specs[i];
      int64_t numel = 1;
      for (int64_t d : shape) numel *= d;
      storage.push_back(RandomBytes(numel * DTypeSize(dtype), 100 + i));
      tensors.push_back({name, dtype, shape, Bytes(storage.back())});
    }
  }
};

void ExpectSameTensors(const SafetensorsCheckpoint& checkpoint, const Model& model) {
  std::vector<std::string> names;
  for (const TensorToWrite& tensor : model.tensors) names.push_back(tensor.name);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(checkpoint.names(), names);
  int64_t total = 0;
  for (const TensorToWrite& tensor : model.tensors) {
    const TensorView* view = checkpoint.Find(tensor.name);
    ASSERT_NE(view, nullptr) << tensor.name;
    EXPECT_EQ(view->dtype, tensor.dtype);
    EXPECT_EQ(view->shape, tensor.shape);
    EXPECT_EQ(AsString(view->data), AsString(tensor.data)) << tensor.name;
    total += tensor.data.size();
  }
  EXPECT_EQ(checkpoint.total_bytes(), total);
  EXPECT_EQ(checkpoint.Find("lm_head.weight"), nullptr);
}

TEST(SafetensorsCheckpoint, SingleFileRoundTrip) {
  const std::string dir = TestDir() + "/ckpt";  // created by the writer
  const Model model;
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, model.tensors).ok());
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors.index.json"));

  absl::StatusOr<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  ExpectSameTensors(*checkpoint, model);
  ASSERT_EQ(checkpoint->files().size(), 1u);
  EXPECT_EQ(checkpoint->files()[0].metadata().at("format"), "pt");

  // Get checks shapes and names the file and tensor.
  absl::StatusOr<const TensorView*> norm = checkpoint->Get("model.norm.weight", {2});
  ASSERT_TRUE(norm.ok()) << norm.status();
  EXPECT_EQ((*norm)->name, "model.norm.weight");
  absl::StatusOr<const TensorView*> wrong = checkpoint->Get("model.norm.weight", {3});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong.status().message()),
              AllOf(HasSubstr(dir + "/model.safetensors"), HasSubstr("tensor 'model.norm.weight'"),
                    HasSubstr("shape [2], expected [3]")));
  absl::StatusOr<const TensorView*> missing = checkpoint->Get("lm_head.weight", {2, 5});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              AllOf(HasSubstr(dir), HasSubstr("'lm_head.weight'")));

  // The file itself may be opened as a checkpoint too.
  absl::StatusOr<SafetensorsCheckpoint> by_file =
      SafetensorsCheckpoint::Open(dir + "/model.safetensors");
  ASSERT_TRUE(by_file.ok()) << by_file.status();
  ExpectSameTensors(*by_file, model);
}

TEST(SafetensorsCheckpoint, ShardedRoundTrip) {
  const std::string dir = TestDir();
  const Model model;
  // 40 | 24+16 | 64 (over the limit: a shard of its own) | 8.
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, model.tensors, /*max_shard_bytes=*/48).ok());
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  for (int k = 1; k <= 4; ++k) {
    EXPECT_TRUE(fs::exists(absl::StrCat(dir, "/model-0000", k, "-of-00004.safetensors"))) << k;
  }
  const nlohmann::json index =
      nlohmann::json::parse(ReadFile(dir + "/model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], 152);
  EXPECT_EQ(
      index["weight_map"],
      nlohmann::json({{"model.embed_tokens.weight", "model-00001-of-00004.safetensors"},
                      {"model.layers.0.mlp.up_proj.weight", "model-00002-of-00004.safetensors"},
                      {"model.layers.0.input_layernorm.weight", "model-00002-of-00004.safetensors"},
                      {"model.layers.1.mlp.up_proj.weight", "model-00003-of-00004.safetensors"},
                      {"model.norm.weight", "model-00004-of-00004.safetensors"}}));

  absl::StatusOr<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  ExpectSameTensors(*checkpoint, model);
  EXPECT_EQ(checkpoint->files().size(), 4u);
  EXPECT_EQ(checkpoint->FileOf("model.layers.0.input_layernorm.weight")->path(),
            dir + "/model-00002-of-00004.safetensors");
  EXPECT_EQ(checkpoint->FileOf("nope"), nullptr);
  absl::StatusOr<const TensorView*> wrong = checkpoint->Get("model.norm.weight", {1, 2});
  EXPECT_THAT(std::string(wrong.status().message()),
              HasSubstr("model-00004-of-00004.safetensors: tensor 'model.norm.weight'"));

  // The index file may be named directly.
  absl::StatusOr<SafetensorsCheckpoint> by_index =
      SafetensorsCheckpoint::Open(dir + "/model.safetensors.index.json");
  ASSERT_TRUE(by_index.ok()) << by_index.status();
  ExpectSameTensors(*by_index, model);

  // Moving the checkpoint keeps every view valid.
  SafetensorsCheckpoint moved = *std::move(checkpoint);
  ExpectSameTensors(moved, model);
}

TEST(SafetensorsCheckpoint, RewritingRemovesTheOtherLayoutAndStaleShards) {
  const std::string dir = TestDir();
  const Model model;
  WriteFile(dir + "/config.json", "{}");  // unrelated files stay
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, model.tensors).ok());
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, model.tensors, 48).ok());
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, model.tensors, 80).ok());  // 40+24+16 | 64+8
  std::vector<std::string> files;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    files.push_back(entry.path().filename().string());
  }
  std::sort(files.begin(), files.end());
  EXPECT_THAT(files,
              ElementsAre("config.json", "model-00001-of-00002.safetensors",
                          "model-00002-of-00002.safetensors", "model.safetensors.index.json"));
  absl::StatusOr<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  ExpectSameTensors(*checkpoint, model);

  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, model.tensors).ok());
  files.clear();
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    files.push_back(entry.path().filename().string());
  }
  std::sort(files.begin(), files.end());
  EXPECT_THAT(files, ElementsAre("config.json", "model.safetensors"));
}

TEST(SafetensorsCheckpoint, OneFileMayCarryAnIndexForTheEnginesLoaders) {
  const std::string dir = TestDir();
  const Model model;
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, model.tensors, 48).ok());  // sharded first
  ASSERT_TRUE(
      WriteSafetensorsCheckpoint(dir, model.tensors, int64_t{5} << 30, /*index_one_file=*/true)
          .ok());
  std::vector<std::string> files;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    files.push_back(entry.path().filename().string());
  }
  std::sort(files.begin(), files.end());
  EXPECT_THAT(files, ElementsAre("model.safetensors", "model.safetensors.index.json"));
  const nlohmann::json index =
      nlohmann::json::parse(ReadFile(dir + "/model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], 152);
  ASSERT_EQ(index["weight_map"].size(), model.tensors.size());
  for (const TensorToWrite& tensor : model.tensors) {
    EXPECT_EQ(index["weight_map"][tensor.name], "model.safetensors") << tensor.name;
  }
  for (const std::string& path : {dir, dir + "/model.safetensors.index.json"}) {
    absl::StatusOr<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::Open(path);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
    ExpectSameTensors(*checkpoint, model);
  }
  // Sharding still works with the option, and a plain save drops the index again.
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, model.tensors, 48, true).ok());
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, model.tensors).ok());
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors.index.json"));
}

TEST(SafetensorsCheckpoint, WriteRejectsBadArguments) {
  const std::string dir = TestDir();
  const Model model;
  EXPECT_EQ(WriteSafetensorsCheckpoint(dir, model.tensors, 0).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<TensorToWrite> duplicated = model.tensors;
  duplicated.push_back(model.tensors[0]);
  const absl::Status status = WriteSafetensorsCheckpoint(dir, duplicated, 48);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("tensor 'model.embed_tokens.weight': duplicate name"));
  EXPECT_TRUE(fs::is_empty(dir));  // nothing written
}

TEST(SafetensorsCheckpoint, RejectsBrokenDirectoriesNamingTheFile) {
  const std::string root = TestDir();
  const Model model;

  absl::StatusOr<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::Open(root + "/absent");
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kNotFound);
  checkpoint = SafetensorsCheckpoint::Open(root);
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(checkpoint.status().message()),
              HasSubstr("neither model.safetensors nor"));

  // A good sharded checkpoint, then one defect at a time in a copy.
  const std::string good = root + "/good";
  ASSERT_TRUE(WriteSafetensorsCheckpoint(good, model.tensors, 48).ok());
  const std::string shard1 = "model-00001-of-00004.safetensors";
  const std::string shard2 = "model-00002-of-00004.safetensors";
  struct Case {
    std::string name;
    std::string index;                               // replaces the index when not empty
    std::function<void(const std::string&)> damage;  // applied to the copy
    absl::StatusCode code;
    std::vector<std::string> expected;  // substrings; the file named is relative to the copy
  };
  nlohmann::json index = nlohmann::json::parse(ReadFile(good + "/model.safetensors.index.json"));
  auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json copy = index;
    edit(copy);
    return copy.dump();
  };
  const std::vector<Case> cases = {
      {"not_json",
       "{",
       nullptr,
       absl::StatusCode::kInvalidArgument,
       {"model.safetensors.index.json", "not valid JSON"}},
      {"no_weight_map",
       R"({"metadata": {}})",
       nullptr,
       absl::StatusCode::kInvalidArgument,
       {"model.safetensors.index.json", "no 'weight_map' object"}},
      {"not_a_string",
       with([](nlohmann::json& j) { j["weight_map"]["model.norm.weight"] = 4; }),
       nullptr,
       absl::StatusCode::kInvalidArgument,
       {"model.safetensors.index.json", "'model.norm.weight' maps to 4"}},
      {"outside",
       with([](nlohmann::json& j) { j["weight_map"]["model.norm.weight"] = "../x.safetensors"; }),
       nullptr,
       absl::StatusCode::kInvalidArgument,
       {"not a file name in the same directory"}},
      {"missing_in_shard",
       with([&](nlohmann::json& j) { j["weight_map"]["lm_head.weight"] = shard1; }),
       nullptr,
       absl::StatusCode::kInvalidArgument,
       {"model.safetensors.index.json",
        "tensor 'lm_head.weight' maps to '" + shard1 + "', which does not contain it"}},
      {"not_in_map",
       with([](nlohmann::json& j) {
         j["weight_map"].erase("model.layers.0.input_layernorm.weight");
       }),
       nullptr,
       absl::StatusCode::kInvalidArgument,
       {shard2 + ": tensor 'model.layers.0.input_layernorm.weight': not in the weight_map"}},
      {"assigned_elsewhere",
       "",  // model.norm.weight in shards 1 and 4, mapped to 4
       [&](const std::string& d) {
         const TensorToWrite both[] = {model.tensors[0], model.tensors[4]};
         ASSERT_TRUE(WriteSafetensors(d + "/" + shard1, both).ok());
       },
       absl::StatusCode::kInvalidArgument,
       {shard1 + ": tensor 'model.norm.weight'",
        "assigns it to 'model-00004-of-00004.safetensors'"}},
      {"shard_missing",
       "",
       [&](const std::string& d) { fs::remove(d + "/" + shard2); },
       absl::StatusCode::kNotFound,
       {shard2}},
      {"shard_corrupt",
       "",
       [&](const std::string& d) { WriteFile(d + "/" + shard2, "abc"); },
       absl::StatusCode::kInvalidArgument,
       {shard2, "too short"}},
  };
  for (const Case& c : cases) {
    const std::string dir = root + "/" + c.name;
    fs::copy(good, dir);
    if (!c.index.empty()) WriteFile(dir + "/model.safetensors.index.json", c.index);
    if (c.damage) c.damage(dir);
    checkpoint = SafetensorsCheckpoint::Open(dir);
    ASSERT_FALSE(checkpoint.ok()) << c.name;
    EXPECT_EQ(checkpoint.status().code(), c.code) << c.name << ": " << checkpoint.status();
    const std::string message(checkpoint.status().message());
    EXPECT_THAT(message, HasSubstr(dir)) << c.name;
    for (const std::string& expected : c.expected) {
      EXPECT_THAT(message, HasSubstr(expected)) << c.name;
    }
  }
}

}  // namespace
}  // namespace dta

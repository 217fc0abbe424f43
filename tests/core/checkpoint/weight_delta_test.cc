#include "core/checkpoint/weight_delta.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
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

std::string TestDir() { return testing::FreshTestDir("weight_delta"); }

absl::Span<const uint8_t> Bytes(const std::vector<uint16_t>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * 2};
}

absl::Span<uint8_t> MutableBytes(std::vector<uint16_t>& v) {
  return {reinterpret_cast<uint8_t*>(v.data()), v.size() * 2};
}

std::vector<uint16_t> RandomBf16(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint16_t> out(n);
  for (uint16_t& x : out) x = static_cast<uint16_t>(rng());
  return out;
}

// `base` with each element's bits changed with probability `fraction`.
std::vector<uint16_t> Perturb(const std::vector<uint16_t>& base, double fraction, uint32_t seed) {
  std::mt19937 rng(seed);
  std::bernoulli_distribution flip(fraction);
  std::vector<uint16_t> out = base;
  for (uint16_t& x : out) {
    if (flip(rng)) x ^= static_cast<uint16_t>(1 + rng() % 0xffff);
  }
  return out;
}

int64_t Differences(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

// Encodes base -> target, applies it to a copy of base, and checks the copy is target bitwise.
TensorDelta RoundTrip(const std::vector<uint16_t>& base, const std::vector<uint16_t>& target) {
  absl::StatusOr<TensorDelta> delta = EncodeTensorDelta(Bytes(base), Bytes(target), 2);
  EXPECT_TRUE(delta.ok()) << delta.status();
  if (!delta.ok()) return {};
  EXPECT_EQ(delta->numel, static_cast<int64_t>(base.size()));
  EXPECT_EQ(delta->changed, Differences(base, target));
  EXPECT_LE(delta->nbytes(), static_cast<int64_t>(base.size()) * 2);
  std::vector<uint16_t> applied = base;
  EXPECT_TRUE(
      ApplyTensorDelta(delta->encoding, delta->positions, delta->values, 2, MutableBytes(applied))
          .ok());
  EXPECT_EQ(applied, target);
  return *std::move(delta);
}

TEST(EncodeTensorDelta, RoundTripsEveryFractionAndOddSizes) {
  for (size_t n : {1, 3, 7, 19, 733, 65537}) {
    for (double fraction : {0.0, 0.001, 0.01, 0.1, 0.3, 0.6, 1.0}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " fraction=" << fraction);
      const std::vector<uint16_t> base = RandomBf16(n, static_cast<uint32_t>(n));
      RoundTrip(base, Perturb(base, fraction, static_cast<uint32_t>(n * 7 + fraction * 1000)));
    }
  }
}

TEST(EncodeTensorDelta, ChoosesTheSmallestEncoding) {
  const std::vector<uint16_t> base = RandomBf16(100000, 1);
  EXPECT_EQ(RoundTrip(base, base).encoding, DeltaEncoding::kUnchanged);
  EXPECT_EQ(RoundTrip(base, base).nbytes(), 0);
  // 1%: about one byte of gap and two of value per change.
  const TensorDelta sparse = RoundTrip(base, Perturb(base, 0.01, 2));
  EXPECT_EQ(sparse.encoding, DeltaEncoding::kSparse);
  EXPECT_LT(sparse.nbytes(), 4 * sparse.changed);
  EXPECT_EQ(RoundTrip(base, Perturb(base, 0.4, 3)).encoding, DeltaEncoding::kBitmap);
  EXPECT_EQ(RoundTrip(base, Perturb(base, 0.97, 4)).encoding, DeltaEncoding::kDense);
}

TEST(EncodeTensorDelta, SparsePositionsAreLeb128Gaps) {
  std::vector<uint16_t> base(100000, 0x3f80);  // bf16 1.0
  std::vector<uint16_t> target = base;
  for (int64_t i : {0, 1, 200, 99999}) target[i] = 0x4000;
  const TensorDelta delta = RoundTrip(base, target);
  ASSERT_EQ(delta.encoding, DeltaEncoding::kSparse);
  // Gaps 0, 0, 198 and 99798 = 0b110_0001011_1010110.
  EXPECT_THAT(delta.positions, ElementsAre(0x00, 0x00, 0xc6, 0x01, 0xd6, 0x8b, 0x06));
  EXPECT_EQ(delta.values.size(), 8u);
}

TEST(EncodeTensorDelta, ComparesBitPatterns) {
  // NaNs with the same payload are unchanged, with another payload changed; -0.0 differs from 0.0.
  const std::vector<uint16_t> base = {0x7fc0, 0x7fc0, 0x0000, 0x8000, 0xff80, 0x3f80, 0x3f80};
  const std::vector<uint16_t> target = {0x7fc0, 0x7fc1, 0x8000, 0x8000, 0xff80, 0x3f80, 0x3f80};
  const TensorDelta delta = RoundTrip(base, target);
  EXPECT_EQ(delta.changed, 2);
}

TEST(EncodeTensorDelta, EveryElementSize) {
  std::mt19937 rng(5);
  for (int64_t element_size : {1, 4, 8}) {
    SCOPED_TRACE(element_size);
    std::vector<uint8_t> base(element_size * 733);
    for (uint8_t& b : base) b = static_cast<uint8_t>(rng());
    std::vector<uint8_t> target = base;
    for (int64_t i : {0, 5, 6, 700, 732}) target[i * element_size + element_size - 1] ^= 0x80;
    absl::StatusOr<TensorDelta> delta = EncodeTensorDelta(base, target, element_size);
    ASSERT_TRUE(delta.ok()) << delta.status();
    EXPECT_EQ(delta->changed, 5);
    std::vector<uint8_t> applied = base;
    ASSERT_TRUE(ApplyTensorDelta(delta->encoding, delta->positions, delta->values, element_size,
                                 absl::MakeSpan(applied))
                    .ok());
    EXPECT_EQ(applied, target);
  }
}

TEST(EncodeTensorDelta, RefusesMismatchedInputs) {
  const std::vector<uint16_t> a = RandomBf16(4, 1);
  const std::vector<uint16_t> b = RandomBf16(5, 1);
  EXPECT_EQ(EncodeTensorDelta(Bytes(a), Bytes(b), 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EncodeTensorDelta(Bytes(a), Bytes(a), 3).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EncodeTensorDelta(Bytes(a), Bytes(a), 16).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ApplyTensorDelta, RefusesDeltasThatDoNotFitAndLeavesTheTensor) {
  std::vector<uint16_t> tensor = RandomBf16(10, 1);
  const std::vector<uint16_t> before = tensor;
  const std::vector<uint16_t> one = {0x4000};
  const std::vector<uint16_t> two = {0x4000, 0x4000};
  struct Case {
    DeltaEncoding encoding;
    std::vector<uint8_t> positions;
    std::vector<uint16_t> values;
    std::string error;
  };
  const std::vector<Case> cases = {
      {DeltaEncoding::kSparse, {0x80}, one, "do not decode"},        // truncated varint
      {DeltaEncoding::kSparse, {0x0a}, one, "do not decode"},        // index 10 of 10
      {DeltaEncoding::kSparse, {0x02, 0x07}, two, "do not decode"},  // index 3 + 8
      {DeltaEncoding::kSparse, {0x01}, two, "1 positions but 2 values"},
      {DeltaEncoding::kBitmap, {0x01}, one, "a bitmap of 1 bytes"},
      {DeltaEncoding::kBitmap, {0x01, 0x04}, two, "past the tensor's end"},
      {DeltaEncoding::kBitmap, {0x03, 0x00}, one, "2 positions but 1 values"},
      {DeltaEncoding::kDense, {}, two, "not 10"},
      {DeltaEncoding::kUnchanged, {}, one, "has data"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.error);
    const absl::Status status =
        ApplyTensorDelta(c.encoding, c.positions, Bytes(c.values), 2, MutableBytes(tensor));
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr(c.error));
    EXPECT_EQ(tensor, before);
  }
}

// Weights as a safetensors checkpoint: named bf16 tensors plus one f32 tensor.
struct Weights {
  std::map<std::string, std::vector<uint16_t>> bf16;
  std::vector<uint16_t> f32;  // as pairs of uint16, shape [f32.size() / 2]

  void Write(const std::string& directory, int64_t max_shard_bytes) const {
    std::vector<TensorToWrite> tensors;
    for (const auto& [name, data] : bf16) {
      tensors.push_back({.name = name,
                         .dtype = DType::kBF16,
                         .shape = {static_cast<int64_t>(data.size())},
                         .data = Bytes(data)});
    }
    tensors.push_back({.name = "scale",
                       .dtype = DType::kF32,
                       .shape = {static_cast<int64_t>(f32.size() / 2)},
                       .data = Bytes(f32)});
    ASSERT_TRUE(WriteSafetensorsCheckpoint(directory, tensors, max_shard_bytes).ok());
  }

  std::map<std::string, MutableTensorView> Views() {
    std::map<std::string, MutableTensorView> views;
    for (auto& [name, data] : bf16) {
      views[name] = {.dtype = DType::kBF16,
                     .shape = {static_cast<int64_t>(data.size())},
                     .data = MutableBytes(data)};
    }
    views["scale"] = {.dtype = DType::kF32,
                      .shape = {static_cast<int64_t>(f32.size() / 2)},
                      .data = MutableBytes(f32)};
    return views;
  }
};

Weights MakeWeights() {
  Weights w;
  w.bf16["a.weight"] = RandomBf16(20000, 1);
  w.bf16["b.weight"] = RandomBf16(733, 2);
  w.bf16["c.bias"] = RandomBf16(19, 3);
  w.bf16["d.weight"] = RandomBf16(5000, 4);
  w.f32 = RandomBf16(2 * 64, 5);
  return w;
}

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

TEST(WeightDelta, WritesAndAppliesBetweenCheckpoints) {
  const std::string dir = TestDir();
  const Weights base = MakeWeights();
  Weights target = base;
  target.bf16["a.weight"] = Perturb(base.bf16.at("a.weight"), 0.01, 10);  // sparse
  target.bf16["b.weight"] = Perturb(base.bf16.at("b.weight"), 0.5, 11);   // bitmap
  target.bf16["c.bias"] = Perturb(base.bf16.at("c.bias"), 1.0, 12);       // dense
  target.f32 = Perturb(base.f32, 0.02, 13);  // sparse; "d.weight" unchanged
  base.Write(dir + "/base", int64_t{1} << 30);
  target.Write(dir + "/target", 20000);  // sharded
  absl::StatusOr<SafetensorsCheckpoint> before = SafetensorsCheckpoint::Open(dir + "/base");
  absl::StatusOr<SafetensorsCheckpoint> after = SafetensorsCheckpoint::Open(dir + "/target");
  ASSERT_TRUE(before.ok() && after.ok());

  absl::StatusOr<WeightDeltaSummary> summary = WriteWeightDelta(
      *before, *after, dir + "/target/delta-from-7", {.base_step = 7, .step = 8, .threads = 3});
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->index_path, dir + "/target/delta-from-7.json");
  EXPECT_EQ(summary->data_path, dir + "/target/delta-from-7.safetensors");
  EXPECT_EQ(summary->tensors, 5);
  EXPECT_EQ(summary->changed_tensors, 4);
  EXPECT_EQ(summary->elements, 20000 + 733 + 19 + 5000 + 64);
  EXPECT_EQ(summary->full_bytes, 2 * (summary->elements - 64) + 4 * 64);
  EXPECT_LT(summary->delta_bytes, summary->full_bytes / 10);

  const nlohmann::json index = ReadJson(summary->index_path);
  EXPECT_EQ(index["format"], "dta-weight-delta");
  EXPECT_EQ(index["version"], 1);
  EXPECT_EQ(index["data"], "delta-from-7.safetensors");
  EXPECT_EQ(index["base_step"], 7);
  EXPECT_EQ(index["step"], 8);
  EXPECT_EQ(index["changed_elements"], summary->changed_elements);
  EXPECT_EQ(index["delta_bytes"], summary->delta_bytes);
  EXPECT_EQ(index["tensors"]["a.weight"]["encoding"], "sparse");
  EXPECT_EQ(index["tensors"]["b.weight"]["encoding"], "bitmap");
  EXPECT_EQ(index["tensors"]["c.bias"]["encoding"], "dense");
  EXPECT_EQ(index["tensors"]["d.weight"]["encoding"], "unchanged");
  EXPECT_EQ(index["tensors"]["d.weight"]["changed"], 0);
  EXPECT_EQ(index["tensors"]["scale"]["dtype"], "F32");
  EXPECT_EQ(index["tensors"]["a.weight"]["shape"], nlohmann::json({20000}));
  EXPECT_EQ(index["tensors"]["a.weight"]["changed"],
            Differences(base.bf16.at("a.weight"), target.bf16.at("a.weight")));

  absl::StatusOr<SafetensorsFile> data = SafetensorsFile::Open(summary->data_path);
  ASSERT_TRUE(data.ok());
  std::vector<std::string> names;
  for (const TensorView& t : data->tensors()) names.push_back(t.name);
  EXPECT_THAT(names,
              ElementsAre("a.weight/positions", "a.weight/values", "b.weight/positions",
                          "b.weight/values", "c.bias/values", "scale/positions", "scale/values"));
  EXPECT_EQ(data->metadata().at("base_step"), "7");
  // The engines' loaders read the files the index names; the delta is not one of them.
  const nlohmann::json model_index = ReadJson(dir + "/target/model.safetensors.index.json");
  for (const auto& [tensor, file] : model_index["weight_map"].items()) {
    EXPECT_NE(file, "delta-from-7.safetensors");
  }

  Weights applied = base;
  ASSERT_TRUE(ApplyWeightDelta(summary->index_path, applied.Views()).ok());
  EXPECT_EQ(applied.bf16, target.bf16);
  EXPECT_EQ(applied.f32, target.f32);
}

TEST(WeightDelta, RefusesWeightSetsOfAnotherLayout) {
  const std::string dir = TestDir();
  const Weights base = MakeWeights();
  Weights renamed = base;
  renamed.bf16["e.weight"] = renamed.bf16.at("d.weight");
  renamed.bf16.erase("d.weight");
  Weights reshaped = base;
  reshaped.bf16["c.bias"].push_back(0);
  base.Write(dir + "/base", int64_t{1} << 30);
  renamed.Write(dir + "/renamed", int64_t{1} << 30);
  reshaped.Write(dir + "/reshaped", int64_t{1} << 30);
  absl::StatusOr<SafetensorsCheckpoint> a = SafetensorsCheckpoint::Open(dir + "/base");
  absl::StatusOr<SafetensorsCheckpoint> b = SafetensorsCheckpoint::Open(dir + "/renamed");
  absl::StatusOr<SafetensorsCheckpoint> c = SafetensorsCheckpoint::Open(dir + "/reshaped");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  absl::StatusOr<WeightDeltaSummary> renamed_delta = WriteWeightDelta(*a, *b, dir + "/d1");
  EXPECT_EQ(renamed_delta.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(renamed_delta.status().message(), HasSubstr("\"d.weight\" is in only one"));
  absl::StatusOr<WeightDeltaSummary> reshaped_delta = WriteWeightDelta(*a, *c, dir + "/d2");
  EXPECT_EQ(reshaped_delta.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(reshaped_delta.status().message(), HasSubstr("BF16 [19] in the base but BF16 [20]"));
  EXPECT_FALSE(fs::exists(dir + "/d1.json"));
  EXPECT_FALSE(fs::exists(dir + "/d2.json"));
}

TEST(WeightDelta, ApplyChecksEveryTensorBeforeChangingAny) {
  const std::string dir = TestDir();
  const Weights base = MakeWeights();
  Weights target = base;
  for (auto& [name, data] : target.bf16) data = Perturb(data, 0.1, 20);
  base.Write(dir + "/base", int64_t{1} << 30);
  target.Write(dir + "/target", int64_t{1} << 30);
  absl::StatusOr<SafetensorsCheckpoint> before = SafetensorsCheckpoint::Open(dir + "/base");
  absl::StatusOr<SafetensorsCheckpoint> after = SafetensorsCheckpoint::Open(dir + "/target");
  ASSERT_TRUE(before.ok() && after.ok());
  absl::StatusOr<WeightDeltaSummary> summary = WriteWeightDelta(*before, *after, dir + "/delta");
  ASSERT_TRUE(summary.ok()) << summary.status();

  Weights applied = base;
  std::map<std::string, MutableTensorView> views = applied.Views();
  views.erase("d.weight");  // the last to be applied
  absl::Status missing = ApplyWeightDelta(summary->index_path, views);
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.message(), HasSubstr("\"d.weight\": missing"));
  views = applied.Views();
  views["d.weight"].shape = {50, 100};
  absl::Status reshaped = ApplyWeightDelta(summary->index_path, views);
  EXPECT_THAT(reshaped.message(), HasSubstr("the delta is for BF16 [5000], the weights hold "
                                            "BF16 [50, 100]"));
  EXPECT_EQ(applied.bf16, base.bf16);

  EXPECT_EQ(ApplyWeightDelta(dir + "/nothing.json", applied.Views()).code(),
            absl::StatusCode::kUnavailable);
  for (const char* bad : {R"({"format": "something else"})", R"({"format": 7})", "[1, 2]", "{"}) {
    std::ofstream(dir + "/bad.json") << bad;
    EXPECT_EQ(ApplyWeightDelta(dir + "/bad.json", applied.Views()).code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(applied.bf16, base.bf16);
}

}  // namespace
}  // namespace dta

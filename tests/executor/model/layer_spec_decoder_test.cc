// The decoder allocates exactly what the layer spec (core/model/layer_spec.h) lists: for every
// preset, every family's tiny test model and the test-only family, the same parameters in the same
// order, with the spec's names, whole shapes and tensor-parallel splits, each this rank's part
// (a segmented split's: the rank's slice of every segment); and a checkpoint maps the spec's
// names.
#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include <memory>
#include <string>
#include <vector>

#include "core/model/family.h"
#include "core/model/layer_spec.h"
#include "executor/model/decoder.h"
#include "gtest/gtest.h"
#include "tests/testing/executor_cases.h"
#include "tests/testing/test_family.h"

namespace dta {
namespace {

ModelConfig TinyConfig() {
  ModelConfig c;
  c.vocab_size = 19;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  return c;
}

void ExpectDecoderHoldsTheSpec(const ModelConfig& config, const std::string& what,
                               at::Device device = at::kCPU) {
  const Decoder model(config, at::TensorOptions().dtype(at::kBFloat16).device(device));
  const std::vector<ParameterSpec> specs = BuildModelSpec(config).Parameters();
  ASSERT_EQ(model.named_parameters().size(), specs.size()) << what;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& [name, parameter] = model.named_parameters()[i];
    const ParameterSplit& split = model.parameter_splits()[i];
    EXPECT_EQ(name, specs[i].name) << what;
    EXPECT_EQ(split.full_shape, specs[i].shape) << what << ": " << name;
    EXPECT_EQ(parameter.sizes().vec(), specs[i].shape) << what << ": " << name;
    EXPECT_EQ(split.dim, specs[i].split.dim) << what << ": " << name;
    EXPECT_EQ(split.segments, specs[i].SplitSegments()) << what << ": " << name;
    EXPECT_TRUE(parameter.requires_grad()) << name;
  }
}

TEST(LayerSpecDecoder, EveryPresetsDecoderHoldsItsSpec) {
  for (const std::string& preset : ModelPresetNames()) {
    // On the meta device: the presets' shapes without their memory. Scaled RoPE's tables have no
    // meta kernels; RoPE holds no parameters, so the default rope stands in.
    ModelConfig config = *ModelPreset(preset);
    config.rope_scaling = {};
    ExpectDecoderHoldsTheSpec(config, preset, at::kMeta);
  }
}

TEST(LayerSpecDecoder, EveryFamilysTestModelAndTheTestFamilyHoldTheirSpecs) {
  RegisterTestFamily();
  for (const std::string& family : ModelFamilyTypes()) {
    ModelConfig config = testing::WithFamily(TinyConfig(), family);
    ExpectDecoderHoldsTheSpec(config, family);
    config.tie_word_embeddings = !config.tie_word_embeddings;
    ExpectDecoderHoldsTheSpec(config, family + " (embeddings tied the other way)");
  }
}

// gate_proj and up_proj stay one tensor (one GEMM for both), as the spec lists them side by side.
TEST(LayerSpecDecoder, DenseGateAndUpShareOneTensor) {
  const Decoder model(TinyConfig(), at::TensorOptions().dtype(at::kDouble));
  const at::Tensor gate = model.parameter("model.layers.0.mlp.gate_proj.weight");
  const at::Tensor up = model.parameter("model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(up.data_ptr<double>(), gate.data_ptr<double>() + gate.numel());
}

// Rank `rank` of `size` tensor-parallel ranks, for what a rank holds: its collectives are never
// called (a decoder's constructor and LocalPart run none).
class RankOf final : public TensorParallelGroup {
 public:
  RankOf(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void AllReduce(at::Tensor&, TensorParallelReduce) const override { Unexpected(); }
  std::unique_ptr<PendingCollective> StartAllReduce(at::Tensor&,
                                                    TensorParallelReduce) const override {
    Unexpected();
    return nullptr;
  }
  at::Tensor AllGather(const at::Tensor&) const override {
    Unexpected();
    return {};
  }

 private:
  static void Unexpected() { ADD_FAILURE() << "RankOf runs no collectives"; }
  int rank_, size_;
};

// Qwen3-Next's Gated DeltaNet on 2 ranks (2 key heads of 4 serving 4 value heads of 3): conv1d's
// channels [q 8 | k 8 | v 12] are split by key heads in each segment, so rank r holds q rows
// [4r, 4r + 4), k rows 8 + [4r, 4r + 4) and v rows 16 + [6r, 6r + 6), concatenated in that order;
// the projections grouped per key head are one contiguous part.
TEST(LayerSpecDecoder, ARanksPartOfASegmentedSplitIsItsSliceOfEverySegment) {
  const ModelConfig config = testing::WithFamily(TinyConfig(), "qwen3_next");
  const std::string conv1d = "model.layers.0.linear_attn.conv1d.weight";
  const std::string qkvz = "model.layers.0.linear_attn.in_proj_qkvz.weight";
  std::vector<int64_t> held(28, 0);
  for (int r = 0; r < 2; ++r) {
    const Decoder model(config, at::TensorOptions().dtype(at::kDouble),
                        std::make_shared<RankOf>(r, 2));
    EXPECT_EQ(model.linear_shape().key_heads, 1);
    EXPECT_EQ(model.linear_shape().value_heads, 2);
    EXPECT_EQ(model.linear_shape().conv_dim(), 14);
    for (size_t i = 0; i < model.named_parameters().size(); ++i) {
      const auto& [name, parameter] = model.named_parameters()[i];
      const ParameterSplit& split = model.parameter_splits()[i];
      const at::Tensor whole =
          at::arange(c10::multiply_integers(split.full_shape), at::kDouble).view(split.full_shape);
      const at::Tensor part = model.LocalPart(i, whole);
      EXPECT_EQ(part.sizes(), parameter.sizes()) << name;
      if (name == conv1d) {
        EXPECT_EQ(split.segments, (std::vector<int64_t>{8, 8, 12}));
        ASSERT_EQ(split.ranges.size(), 3u);
        EXPECT_TRUE((split.ranges[0] == IndexRange{4 * r, 4 * r + 4}));
        EXPECT_TRUE((split.ranges[1] == IndexRange{8 + 4 * r, 8 + 4 * r + 4}));
        EXPECT_TRUE((split.ranges[2] == IndexRange{16 + 6 * r, 16 + 6 * r + 6}));
        EXPECT_TRUE(
            at::equal(part, at::cat({whole.narrow(0, 4 * r, 4), whole.narrow(0, 8 + 4 * r, 4),
                                     whole.narrow(0, 16 + 6 * r, 6)})));
        for (const IndexRange& range : split.ranges) {
          for (int64_t row = range.begin; row < range.end; ++row) ++held[row];
        }
      }
      if (name == qkvz) {
        // Each key head's q, k, v and z rows: 4 + 4 + 2 x 3 + 2 x 3.
        ASSERT_EQ(split.ranges.size(), 1u);
        EXPECT_TRUE((split.ranges[0] == IndexRange{20 * r, 20 * r + 20}));
        EXPECT_TRUE(at::equal(part, whole.narrow(0, 20 * r, 20)));
      }
    }
  }
  // Between them the ranks hold every channel once.
  EXPECT_EQ(held, std::vector<int64_t>(28, 1));
}

}  // namespace
}  // namespace dta

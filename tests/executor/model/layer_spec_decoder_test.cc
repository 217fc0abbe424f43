// The decoder allocates exactly what the layer spec (core/model/layer_spec.h) lists: for every
// preset, every family's tiny test model and the test-only family, the same parameters in the same
// order, with the spec's names, whole shapes and tensor-parallel split dimensions, each this rank's
// part; and a checkpoint maps the spec's names.
#include <ATen/ATen.h>

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

}  // namespace
}  // namespace dta

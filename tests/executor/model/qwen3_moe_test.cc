// Qwen3-MoE's sparse block (executor/model/ops/moe.h's SparseMoe) beyond the parity and
// equivalence tests: routing decides which tokens an expert touches (each token exactly
// num_experts_per_tok of them), and the stacked experts are saved and loaded as the Hub's
// per-expert tensors.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "core/base/remove_tree.h"
#include "core/checkpoint/safetensors.h"
#include "core/model/config_json.h"
#include "core/model/model_config.h"
#include "executor/model/decoder.h"
#include "executor/model/hf_checkpoint.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

const at::TensorOptions kFloat64 = at::TensorOptions().dtype(at::kDouble);

ModelConfig MoeConfig(int64_t layers, bool norm_topk) {
  ModelConfig c;
  c.model_type = "qwen3_moe";
  c.vocab_size = 31;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.num_experts = 7;
  c.num_experts_per_tok = 3;
  c.moe_intermediate_size = 5;
  c.norm_topk_prob = norm_topk;
  c.router_aux_loss_coef = 0.001;
  return c;
}

at::Tensor Hidden(const Decoder& model, const at::Tensor& tokens) {
  torch::autograd::AutoGradMode no_grad(false);
  return model.Forward({.tokens = tokens, .positions = at::arange(tokens.size(0), at::kLong)})
      .hidden;
}

// One layer: an expert's weights reach only the final hidden states of the tokens routed to it
// (attention comes before the MoE block), and every token reaches exactly top-k experts.
TEST(Qwen3Moe, PerturbingOneExpertChangesOnlyTheTokensRoutedToIt) {
  for (const bool norm_topk : {false, true}) {
    Decoder model(MoeConfig(1, norm_topk), kFloat64);
    model.InitRandom(3, 0.3);
    const int64_t t = 19;
    at::manual_seed(1);  // fixed tokens: no expert gets them all, which the checks below rely on
    const at::Tensor tokens = at::randint(31, {t}, at::TensorOptions().dtype(at::kLong));
    const at::Tensor base = Hidden(model, tokens);
    at::Tensor down = model.parameter("model.layers.0.mlp.experts.down_proj");
    std::vector<int64_t> experts_of_token(t, 0);
    for (int64_t e = 0; e < 7; ++e) {
      const at::Tensor saved = down[e].clone();
      {
        torch::autograd::AutoGradMode no_grad(false);
        down[e].add_(at::randn_like(saved));
      }
      const at::Tensor changed = (Hidden(model, tokens) - base).abs().amax(-1).gt(0);
      {
        torch::autograd::AutoGradMode no_grad(false);
        down[e].copy_(saved);
      }
      EXPECT_GT(changed.sum().item<int64_t>(), 0) << "expert " << e << " has no tokens";
      EXPECT_LT(changed.sum().item<int64_t>(), t) << "expert " << e << " has every token";
      for (int64_t i = 0; i < t; ++i) experts_of_token[i] += changed[i].item<bool>();
    }
    EXPECT_THAT(experts_of_token, ::testing::Each(3)) << "norm_topk " << norm_topk;
    EXPECT_TRUE(at::equal(Hidden(model, tokens), base));
    // The router moves every token: its weights scale each one's experts.
    at::Tensor router = model.parameter("model.layers.0.mlp.gate.weight");
    {
      torch::autograd::AutoGradMode no_grad(false);
      router.mul_(1.5);
    }
    const at::Tensor moved = (Hidden(model, tokens) - base).abs().amax(-1).gt(0);
    EXPECT_EQ(moved.sum().item<int64_t>(), t);
  }
}

// mlp_only_layers and decoder_sparse_step pick the sparse layers, which hold a router and stacked
// experts instead of gate_proj / up_proj / down_proj.
TEST(Qwen3Moe, SparseLayersHoldStackedExperts) {
  ModelConfig c = MoeConfig(4, true);
  c.decoder_sparse_step = 2;
  c.mlp_only_layers = {3};
  const Decoder model(c, kFloat64);
  EXPECT_EQ(model.parameter("model.layers.1.mlp.experts.gate_proj").sizes(),
            at::IntArrayRef({7, 5, 16}));
  EXPECT_EQ(model.parameter("model.layers.1.mlp.experts.up_proj").sizes(),
            at::IntArrayRef({7, 5, 16}));
  EXPECT_EQ(model.parameter("model.layers.1.mlp.experts.down_proj").sizes(),
            at::IntArrayRef({7, 16, 5}));
  EXPECT_EQ(model.parameter("model.layers.1.mlp.gate.weight").sizes(), at::IntArrayRef({7, 16}));
  for (const int layer : {0, 2, 3}) {
    const std::string p = "model.layers." + std::to_string(layer) + ".mlp.";
    EXPECT_EQ(model.parameter(p + "gate_proj.weight").sizes(), at::IntArrayRef({24, 16}));
    EXPECT_THROW(model.parameter(p + "gate.weight"), c10::Error);
  }
}

// Saved as one tensor per expert (the Hub's names, which transformers loads) and loaded back into
// the stacks; a missing expert is an error naming it.
TEST(Qwen3Moe, CheckpointsHoldOneTensorPerExpert) {
  const std::string dir =
      (std::filesystem::path(::testing::TempDir()) / "qwen3_moe_checkpoint").string();
  RemoveTree(dir);  // not std::filesystem::remove_all, which resolves into libtorch's copy
  ModelConfig c = MoeConfig(2, true);
  c.mlp_only_layers = {0};
  Decoder model(c, kFloat64);
  model.InitRandom(5);
  SaveHfModel(model, dir);
  absl::StatusOr<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const std::set<std::string> names(checkpoint->names().begin(), checkpoint->names().end());
  for (int e = 0; e < 7; ++e) {
    for (const char* projection : {"gate_proj", "up_proj", "down_proj"}) {
      EXPECT_TRUE(names.count("model.layers.1.mlp.experts." + std::to_string(e) + "." + projection +
                              ".weight"))
          << e << " " << projection;
    }
  }
  EXPECT_TRUE(names.count("model.layers.1.mlp.gate.weight"));
  EXPECT_TRUE(names.count("model.layers.0.mlp.gate_proj.weight"));
  EXPECT_FALSE(names.count("model.layers.1.mlp.experts.gate_proj"));
  EXPECT_EQ(names.size(), model.named_parameters().size() + 3 * (7 - 1));

  const Decoder loaded = LoadHfModel(dir, kFloat64);
  ASSERT_EQ(loaded.named_parameters().size(), model.named_parameters().size());
  for (size_t i = 0; i < model.named_parameters().size(); ++i) {
    EXPECT_TRUE(at::equal(loaded.named_parameters()[i].second, model.named_parameters()[i].second))
        << model.named_parameters()[i].first;
  }

  // Without expert 6's up_proj the checkpoint does not describe the model.
  ModelConfig fewer = c;
  fewer.num_experts = 6;
  fewer.num_experts_per_tok = 2;
  Decoder smaller(fewer, kFloat64);
  const std::string small_dir = dir + "-fewer";
  RemoveTree(small_dir);
  SaveHfModel(smaller, small_dir);
  ASSERT_TRUE(SaveModelConfig(c, small_dir).ok());  // claims 7 experts
  EXPECT_THAT(
      [&] { LoadHfModel(small_dir, kFloat64); },
      ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("model.layers.1.mlp.experts.6.")));
}

}  // namespace
}  // namespace dta

// Tensor parallelism against one process: with the model's heads, MLP and vocabulary split across
// 2 or 4 ranks (Gloo, ranks as threads, float64), every method computes the single-process loss,
// log-probabilities and every parameter's gradient (each rank's part of it) to relative error
// 1e-10, on random trees with duplicates, prefix rollouts, one-token segments, deep chains and wide
// branches, for every loss, several block sizes, packing and a graph budget, for Qwen3 and for the
// families with attention biases (Llama's q/k/v/o: o_proj's bias whole on every rank; Qwen2's
// q/k/v: split with their rows) and scaled RoPE without q/k norms, for Qwen3-MoE and for
// Qwen3-Next (Gated DeltaNet split by key heads, conv1d by segments; gated attention; the shared
// expert with its whole gate) and Qwen3.5 (in_proj_qkv by segments like conv1d, in_proj_z, _b and
// _a by value heads). With data parallelism on top (DP x TP = 2 x 2) and every optimizer
// layout, the parameters after several clipped AdamW steps equal one process's.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "executor/distributed/parallel_groups.h"
#include "executor/distributed/tensor_parallel_group.h"
#include "executor/distributed/training_optimizer.h"
#include "executor/engine/executor.h"
#include "executor/model/hf_checkpoint.h"
#include "tests/core/tree/random_trees.h"
#include "tests/testing/executor_cases.h"
#include "tests/testing/gloo_ranks.h"
#include "tests/testing/optimizer_cases.h"
#include "tests/testing/scratch_directory.h"

namespace dta {
namespace {

constexpr double kTolerance = 1e-10;
const at::TensorOptions kFloat64 = at::TensorOptions().dtype(at::kDouble);

// Four KV heads (TP up to 4), and a vocabulary and MLP width that no TP size divides evenly.
ModelConfig TensorParallelConfig(bool tied) {
  ModelConfig c;
  c.vocab_size = 19;
  c.hidden_size = 16;
  c.intermediate_size = 26;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.head_dim = 8;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = tied;
  return c;
}

// The same shape as another family (testing::WithFamily: attention biases, no q/k norms, scaled
// RoPE).
// "qwen3_moe-unnormalised": Qwen3-MoE without norm_topk_prob, layer 0 dense (mlp_only_layers).
// "qwen3_next": layer 0 Gated DeltaNet with a dense MLP, layer 1 gated attention with experts and
// a shared expert of width 5 (which no TP size of 2 or 4 divides evenly); 4 key heads (TP up to
// 4) each serving 2 value heads. "qwen3_5_text" and "qwen3_5_moe_text" alike (dense MLPs; experts
// in both layers), with Qwen3.5's separate Gated DeltaNet projections.
ModelConfig FamilyConfig(const std::string& family, bool tied) {
  if (family == "qwen3_moe-unnormalised") {
    ModelConfig c = testing::WithFamily(TensorParallelConfig(tied), "qwen3_moe");
    c.norm_topk_prob = false;
    c.mlp_only_layers = {0};
    return c;
  }
  ModelConfig c = testing::WithFamily(TensorParallelConfig(tied), family);
  if (c.linear_num_key_heads > 0) {
    c.linear_num_key_heads = 4;
    c.linear_num_value_heads = 8;
  }
  return c;
}

// Every method on `tp` ranks equals the same method in one process.
void ExpectTensorParallelExact(int tp, bool tied, uint64_t seed, size_t loss_index,
                               const std::string& family = "qwen3") {
  const ModelConfig config = FamilyConfig(family, tied);
  // Trees over four tokens, spread over the vocabulary so that every rank's slice is used.
  auto sequences = testing::RandomRollouts(seed, {.max_rollouts = 8, .max_length = 10, .vocab = 4});
  for (auto& tokens : sequences) {
    for (TokenId& token : tokens) token *= 6;
  }
  const std::vector<Rollout> rollouts = testing::MakeRollouts(sequences, seed);
  int64_t longest = 0;
  for (const Rollout& r : rollouts) longest = std::max<int64_t>(longest, r.tokens.size());
  const auto losses = testing::Losses();
  const auto& [loss_name, loss] = losses.at(loss_index);
  const auto methods = testing::ExactnessMethods(longest);

  Decoder whole(config, kFloat64);
  whole.InitRandom(7, 0.3);
  std::vector<testing::MethodRun> references;
  for (const auto& [name, options] : methods) {
    references.push_back(testing::RunMethod(whole, rollouts, loss, options));
  }

  testing::RunRanks(tp, [&](ProcessGroup& group) {
    auto ranks = std::make_shared<TensorParallelOverProcessGroup>(group);
    Decoder model(config, kFloat64, ranks);
    model.InitRandom(7, 0.3);
    EXPECT_EQ(model.local_kv_heads(), config.num_key_value_heads / tp);
    if (model.has_linear_layers()) {
      EXPECT_EQ(model.linear_shape().key_heads, config.linear_num_key_heads / tp);
      EXPECT_EQ(model.linear_shape().value_heads, config.linear_num_value_heads / tp);
    }
    const auto& named = model.named_parameters();
    ASSERT_EQ(named.size(), whole.named_parameters().size());
    for (size_t i = 0; i < named.size(); ++i) {
      // The seed means the same model at every TP size; gathered, the parts are the whole.
      EXPECT_TRUE(at::equal(model.GatherParameter(i), whole.named_parameters()[i].second))
          << named[i].first;
    }
    for (size_t m = 0; m < methods.size(); ++m) {
      SCOPED_TRACE(family + " TP " + std::to_string(tp) + " rank " + std::to_string(group.rank()) +
                   (tied ? " tied" : "") + " seed " + std::to_string(seed) + " " + loss_name + " " +
                   methods[m].first);
      const testing::MethodRun run = testing::RunMethod(model, rollouts, loss, methods[m].second);
      const testing::MethodRun& reference = references[m];
      EXPECT_NEAR(run.result.loss, reference.result.loss,
                  kTolerance * std::max(1.0, std::abs(reference.result.loss)));
      ASSERT_EQ(run.result.logprobs.size(), reference.result.logprobs.size());
      for (size_t r = 0; r < rollouts.size(); ++r) {
        EXPECT_LE(testing::RelativeError(run.result.logprobs[r], reference.result.logprobs[r]),
                  kTolerance)
            << "rollout " << r;
      }
      for (size_t i = 0; i < named.size(); ++i) {
        const at::Tensor expected = model.LocalPart(i, reference.grads[i]);
        EXPECT_GT(expected.norm().item<double>(), 0.0) << named[i].first;
        EXPECT_LE(testing::RelativeError(run.grads[i], expected), kTolerance) << named[i].first;
      }
    }
  });
}

// Qwen3-MoE: the experts' intermediate rows split unevenly (6 over 4 ranks), the router whole;
// renormalised top-k routing in every layer, or plain top-k beside a dense layer.
TEST(TensorParallel, MixtureOfExperts) {
  ExpectTensorParallelExact(2, /*tied=*/false, /*seed=*/11, /*loss_index=*/1, "qwen3_moe");
  ExpectTensorParallelExact(4, /*tied=*/true, /*seed=*/22, /*loss_index=*/5, "qwen3_moe");
  ExpectTensorParallelExact(2, /*tied=*/true, /*seed=*/23, /*loss_index=*/0,
                            "qwen3_moe-unnormalised");
  ExpectTensorParallelExact(4, /*tied=*/false, /*seed=*/24, /*loss_index=*/3,
                            "qwen3_moe-unnormalised");
}

// Qwen3-Next: Gated DeltaNet on each rank's key heads (its conv1d part three segments), gated
// attention with q/k/v/o biases and q/k norms, the experts and the shared expert, whose gate (like
// the router) is whole on every rank; the gated norm's and q/k norms' gradients completed across
// the ranks.
TEST(TensorParallel, Qwen3Next) {
  ExpectTensorParallelExact(2, /*tied=*/false, /*seed=*/31, /*loss_index=*/1, "qwen3_next");
  ExpectTensorParallelExact(4, /*tied=*/true, /*seed=*/32, /*loss_index=*/5, "qwen3_next");
}

// Qwen3.5: in_proj_qkv split like conv1d (three segments by key heads), in_proj_z, in_proj_b and
// in_proj_a by value heads; dense MLPs, or experts with a shared expert in every layer (the
// Gated DeltaNet layer's too).
TEST(TensorParallel, Qwen35) {
  ExpectTensorParallelExact(2, /*tied=*/true, /*seed=*/33, /*loss_index=*/2, "qwen3_5_text");
  ExpectTensorParallelExact(4, /*tied=*/false, /*seed=*/34, /*loss_index=*/4, "qwen3_5_moe_text");
}

// Rank r's parts of Qwen3.5's projections on 4 ranks: one key head's q and k rows (4 + 4) and its
// 2 value heads' v rows (2 x 3) of in_proj_qkv, concatenated as conv1d's; those value heads' rows
// of in_proj_z (2 x 3), in_proj_b and in_proj_a (2); gathered, the whole again (bitwise).
TEST(TensorParallel, Qwen35SplitsItsSeparateProjectionsByHeads) {
  const ModelConfig config = FamilyConfig("qwen3_5_moe_text", false);
  testing::RunRanks(4, [&](ProcessGroup& group) {
    Decoder model(config, kFloat64, std::make_shared<TensorParallelOverProcessGroup>(group));
    const int r = group.rank();
    const std::string linear = "model.layers.0.linear_attn.";
    EXPECT_EQ(model.parameter(linear + "in_proj_qkv.weight").sizes(),
              at::IntArrayRef({4 + 4 + 2 * 3, 16}));
    EXPECT_EQ(model.parameter(linear + "in_proj_z.weight").sizes(), at::IntArrayRef({6, 16}));
    EXPECT_EQ(model.parameter(linear + "in_proj_b.weight").sizes(), at::IntArrayRef({2, 16}));
    EXPECT_EQ(model.parameter(linear + "in_proj_a.weight").sizes(), at::IntArrayRef({2, 16}));
    const auto& named = model.named_parameters();
    for (size_t i = 0; i < named.size(); ++i) {
      const std::string& name = named[i].first;
      at::Tensor whole;
      at::Tensor expected;
      if (name == linear + "in_proj_qkv.weight") {
        whole = at::arange(56 * 16, kFloat64).view({56, 16}).sin();
        expected = at::cat({whole.narrow(0, 4 * r, 4), whole.narrow(0, 16 + 4 * r, 4),
                            whole.narrow(0, 32 + 6 * r, 6)});
      } else if (name == linear + "in_proj_z.weight") {
        whole = at::arange(24 * 16, kFloat64).view({24, 16}).sin();
        expected = whole.narrow(0, 6 * r, 6);
      } else if (name == linear + "in_proj_a.weight") {
        whole = at::arange(8 * 16, kFloat64).view({8, 16}).sin();
        expected = whole.narrow(0, 2 * r, 2);
      } else {
        continue;
      }
      const at::Tensor part = model.LocalPart(i, whole);
      EXPECT_TRUE(at::equal(part, expected)) << name;
      {
        at::NoGradGuard no_grad;
        named[i].second.copy_(part);
      }
      EXPECT_TRUE(at::equal(model.GatherParameter(i), whole)) << name;
    }
  });
}

// Rank r's parts of a Qwen3-Next model on 4 ranks: one key head (4 + 4 channels) and its 2 value
// heads (2 x 3), the shared expert's rows SplitRange(5, r, 4); the gates, routers and norms whole.
TEST(TensorParallel, Qwen3NextSplitsByKeyHeadsAndItsGatesAreWhole) {
  const ModelConfig config = FamilyConfig("qwen3_next", false);
  testing::RunRanks(4, [&](ProcessGroup& group) {
    Decoder model(config, kFloat64, std::make_shared<TensorParallelOverProcessGroup>(group));
    const int r = group.rank();
    const int64_t shared = SplitRange(5, r, 4).size();
    const std::string linear = "model.layers.0.linear_attn.";
    EXPECT_EQ(model.parameter(linear + "in_proj_qkvz.weight").sizes(),
              at::IntArrayRef({4 + 4 + 2 * 2 * 3, 16}));
    EXPECT_EQ(model.parameter(linear + "in_proj_ba.weight").sizes(), at::IntArrayRef({4, 16}));
    EXPECT_EQ(model.parameter(linear + "conv1d.weight").sizes(), at::IntArrayRef({14, 1, 3}));
    EXPECT_EQ(model.parameter(linear + "dt_bias").sizes(), at::IntArrayRef({2}));
    EXPECT_EQ(model.parameter(linear + "A_log").sizes(), at::IntArrayRef({2}));
    EXPECT_EQ(model.parameter(linear + "norm.weight").sizes(), at::IntArrayRef({3}));
    EXPECT_EQ(model.parameter(linear + "out_proj.weight").sizes(), at::IntArrayRef({16, 6}));
    // Gated attention: 2 heads' queries and gates.
    EXPECT_EQ(model.parameter("model.layers.1.self_attn.q_proj.weight").size(0), 2 * 2 * 8);
    EXPECT_EQ(model.parameter("model.layers.1.mlp.shared_expert.gate_proj.weight").size(0), shared);
    EXPECT_EQ(model.parameter("model.layers.1.mlp.shared_expert.down_proj.weight").size(1), shared);
    const TensorParallelNorm scope = model.gradient_norm_scope();
    for (size_t i = 0; i < model.named_parameters().size(); ++i) {
      const std::string& name = model.named_parameters()[i].first;
      const bool whole = name.ends_with("norm.weight") || name.ends_with("layernorm.weight") ||
                         name.ends_with("shared_expert_gate.weight") ||
                         name.ends_with("mlp.gate.weight") || name.ends_with("o_proj.bias");
      EXPECT_EQ(scope.replicated[i], whole) << name;
    }
    // conv1d's channels [q 16 | k 16 | v 24]: the part is its slice of each; gathered, the whole
    // again (bitwise).
    const auto& named = model.named_parameters();
    for (size_t i = 0; i < named.size(); ++i) {
      if (named[i].first != linear + "conv1d.weight") continue;
      const at::Tensor whole = at::arange(56 * 3, kFloat64).view({56, 1, 3}).sin();
      const at::Tensor part = model.LocalPart(i, whole);
      EXPECT_TRUE(
          at::equal(part, at::cat({whole.narrow(0, 4 * r, 4), whole.narrow(0, 16 + 4 * r, 4),
                                   whole.narrow(0, 32 + 6 * r, 6)})));
      {
        at::NoGradGuard no_grad;
        named[i].second.copy_(part);
      }
      EXPECT_TRUE(at::equal(model.GatherParameter(i), whole));
    }
  });
}

TEST(TensorParallel, ExpertsSplitTheirIntermediateRowsAndTheRouterIsWhole) {
  const ModelConfig config = FamilyConfig("qwen3_moe-unnormalised", false);
  testing::RunRanks(4, [&](ProcessGroup& group) {
    Decoder model(config, kFloat64, std::make_shared<TensorParallelOverProcessGroup>(group));
    const int64_t rows = SplitRange(6, group.rank(), 4).size();
    EXPECT_EQ(model.parameter("model.layers.1.mlp.experts.gate_proj").sizes(),
              at::IntArrayRef({5, rows, 16}));
    EXPECT_EQ(model.parameter("model.layers.1.mlp.experts.up_proj").sizes(),
              at::IntArrayRef({5, rows, 16}));
    EXPECT_EQ(model.parameter("model.layers.1.mlp.experts.down_proj").sizes(),
              at::IntArrayRef({5, 16, rows}));
    EXPECT_EQ(model.parameter("model.layers.1.mlp.gate.weight").sizes(), at::IntArrayRef({5, 16}));
    // Layer 0 is dense (mlp_only_layers).
    EXPECT_EQ(model.parameter("model.layers.0.mlp.down_proj.weight").size(1),
              SplitRange(26, group.rank(), 4).size());
    const TensorParallelNorm scope = model.gradient_norm_scope();
    for (size_t i = 0; i < model.named_parameters().size(); ++i) {
      const std::string& name = model.named_parameters()[i].first;
      if (name.ends_with("mlp.gate.weight")) {
        EXPECT_TRUE(scope.replicated[i]) << name;
      }
      if (name.find("mlp.experts.") != std::string::npos) {
        EXPECT_FALSE(scope.replicated[i]) << name;
      }
    }
  });
}

// Every loss of testing::Losses() (0 sft, 1 ppo, 2 dual clip, 3 decoupled, 4 gspo, 5 entropy and
// KL) on one TP size or the other.
TEST(TensorParallel, TwoRanksEveryMethod) {
  ExpectTensorParallelExact(2, /*tied=*/false, /*seed=*/0, /*loss_index=*/0);
  ExpectTensorParallelExact(2, /*tied=*/false, /*seed=*/2, /*loss_index=*/3);
  ExpectTensorParallelExact(2, /*tied=*/false, /*seed=*/3, /*loss_index=*/5);
}

TEST(TensorParallel, FourRanksEveryMethod) {
  ExpectTensorParallelExact(4, /*tied=*/false, /*seed=*/4, /*loss_index=*/1);
  ExpectTensorParallelExact(4, /*tied=*/false, /*seed=*/5, /*loss_index=*/2);
  ExpectTensorParallelExact(4, /*tied=*/false, /*seed=*/10, /*loss_index=*/4);
}

TEST(TensorParallel, TiedEmbeddings) {
  ExpectTensorParallelExact(2, /*tied=*/true, /*seed=*/7, /*loss_index=*/5);
  ExpectTensorParallelExact(4, /*tied=*/true, /*seed=*/8, /*loss_index=*/3);
}

// Llama (q/k/v/o biases, llama3 rope) and Qwen2 (q/k/v biases, YaRN): every rank's part of every
// bias gradient equals the single process's.
TEST(TensorParallel, FamiliesWithBiases) {
  ExpectTensorParallelExact(2, /*tied=*/false, /*seed=*/11, /*loss_index=*/1, "llama");
  ExpectTensorParallelExact(4, /*tied=*/true, /*seed=*/12, /*loss_index=*/5, "llama");
  ExpectTensorParallelExact(2, /*tied=*/true, /*seed=*/13, /*loss_index=*/3, "qwen2");
  ExpectTensorParallelExact(4, /*tied=*/false, /*seed=*/14, /*loss_index=*/0, "qwen2");
}

// DP x TP = 2 x 2 with each optimizer layout: after three clipped AdamW steps on a batch split
// between the replicas, every rank's parameter parts equal one process's parameters.
void ExpectDataTimesTensorParallelSteps(const ModelConfig& config) {
  constexpr int kTp = 2, kDp = 2, kSteps = 3;
  auto sequences = testing::RandomRollouts(3, {.max_rollouts = 8, .max_length = 10, .vocab = 4});
  for (auto& tokens : sequences) {
    for (TokenId& token : tokens) token *= 6;
  }
  std::vector<Rollout> rollouts = testing::MakeRollouts(sequences, 3);
  ASSERT_GE(rollouts.size(), 2u);
  ASSERT_GT(MakeBatchContext(rollouts).total_loss_tokens, 0);
  testing::SetBatchAdvantages(rollouts);
  const BatchLossContext batch = MakeBatchContext(rollouts);
  const LossOptions loss{.kind = LossKind::kPpo, .entropy_coef = 0.01};
  const AdamWOptions adamw{.lr = 1e-2, .weight_decay = 0.1, .max_grad_norm = 1e-3};
  const ExecutorOptions dta{.method = Method::kDta, .block_size = 3};

  Decoder whole(config, kFloat64);
  whole.InitRandom(7, 0.3);
  testing::TrainOneProcess(whole, rollouts, loss, dta, batch, adamw, kSteps);

  for (const TrainingLayout& layout : testing::OptimizerLayouts(kTp, kDp)) {
    SCOPED_TRACE(testing::OptimizerLayoutName(layout));
    testing::RunRanks(kTp * kDp, [&](ProcessGroup& world) {
      const ParallelGroups groups(world, kTp, testing::LoopbackOptions());
      EXPECT_EQ(groups.tensor_parallel_rank(), world.rank() % kTp);
      EXPECT_EQ(groups.data_parallel().size(), kDp);
      Decoder model(config, kFloat64, groups.tensor_parallel_collectives());
      model.InitRandom(7, 0.3);
      TrainingOptimizer optimizer(model.named_parameters(), &groups.data_parallel(), layout, adamw,
                                  int64_t{1} << 10, model.gradient_norm_scope());
      // Replica d trains every other rollout.
      const int d = groups.data_parallel_rank();
      std::vector<Rollout> mine;
      for (size_t r = d; r < rollouts.size(); r += kDp) mine.push_back(rollouts[r]);
      for (int step = 0; step < kSteps; ++step) {
        optimizer.ZeroGrad();
        ComputeGradients(model, mine, loss, dta, batch);
        optimizer.SyncGradients();
        optimizer.Step();
      }
      testing::ExpectPartsOf(model, whole, kTolerance, world.rank());
    });
  }
}

TEST(TensorParallel, DataTimesTensorParallelOptimizerSteps) {
  ExpectDataTimesTensorParallelSteps(TensorParallelConfig(false));
}

TEST(TensorParallel, DataTimesTensorParallelOptimizerStepsOfQwen3Next) {
  ExpectDataTimesTensorParallelSteps(FamilyConfig("qwen3_next", false));
}

using testing::ScratchDirectory;

// A whole checkpoint of a model of `config` loaded on `tp` ranks is each rank's part of it, and
// saved from there it is the whole model again, bitwise (Hugging Face names and shapes). on_rank
// runs on every rank after the save, with the rank's model.
void ExpectCheckpointsAreWhole(
    const ModelConfig& config, int tp, const ScratchDirectory& scratch,
    const std::function<void(ProcessGroup&, const Decoder&)>& on_rank = nullptr) {
  Decoder whole(config, kFloat64);
  whole.InitRandom(11, 0.3);
  SaveHfModel(whole, scratch / "whole");
  testing::RunRanks(tp, [&](ProcessGroup& group) {
    auto ranks = std::make_shared<TensorParallelOverProcessGroup>(group);
    Decoder model = LoadHfModel(scratch / "whole", kFloat64, ranks);
    for (size_t i = 0; i < model.named_parameters().size(); ++i) {
      EXPECT_TRUE(at::equal(model.named_parameters()[i].second,
                            model.LocalPart(i, whole.named_parameters()[i].second)))
          << model.named_parameters()[i].first;
    }
    SaveHfModel(model, scratch / "from-tp");
    if (on_rank) on_rank(group, model);
  });
  const Decoder reloaded = LoadHfModel(scratch / "from-tp", kFloat64);
  for (size_t i = 0; i < reloaded.named_parameters().size(); ++i) {
    EXPECT_TRUE(
        at::equal(reloaded.named_parameters()[i].second, whole.named_parameters()[i].second))
        << reloaded.named_parameters()[i].first;
  }
}

// Checkpoints: a model saved under TP is the whole model, a whole checkpoint loads into every TP
// size, and optimizer state resumes only with the TP size it was saved with (refused otherwise,
// naming what was found).
TEST(TensorParallel, CheckpointsAreWholeAndOptimizerStateKeepsItsSize) {
  const ScratchDirectory scratch("dta-tp-checkpoint");
  ExpectCheckpointsAreWhole(
      TensorParallelConfig(false), 2, scratch, [&](ProcessGroup& group, const Decoder& model) {
        const TrainingLayout layout{.tensor_parallel = 2};
        TrainingOptimizer optimizer(model.named_parameters(), nullptr, layout, {}, int64_t{1} << 20,
                                    model.gradient_norm_scope());
        optimizer.SaveState(scratch / "state");
        group.Barrier();
        EXPECT_TRUE(optimizer.HasState(scratch / "state"));
        optimizer.LoadState(scratch / "state");
      });
  EXPECT_TRUE(std::filesystem::is_directory(scratch / "state/tp-00-of-02"));
  EXPECT_TRUE(std::filesystem::is_directory(scratch / "state/tp-01-of-02"));
  const Decoder whole(TensorParallelConfig(false), kFloat64);
  TrainingOptimizer without_tp(whole.named_parameters(), nullptr, TrainingLayout{}, {});
  EXPECT_THAT([&] { without_tp.LoadState(scratch / "state"); },
              ::testing::ThrowsMessage<c10::Error>(
                  ::testing::HasSubstr("saved with tensor parallelism (tp-0")));
}

// Qwen3-Next on 4 ranks: conv1d's segments narrowed on load and interleaved back on save.
TEST(TensorParallel, Qwen3NextCheckpointsAreWhole) {
  ExpectCheckpointsAreWhole(FamilyConfig("qwen3_next", false), 4,
                            ScratchDirectory("dta-tp-next-checkpoint"));
}

// Qwen3.5 on 4 ranks: in_proj_qkv's segments too.
TEST(TensorParallel, Qwen35CheckpointsAreWhole) {
  ExpectCheckpointsAreWhole(FamilyConfig("qwen3_5_moe_text", false), 4,
                            ScratchDirectory("dta-tp-qwen3_5-checkpoint"));
}

TEST(TensorParallel, SplitsFollowHeadsMlpAndVocabulary) {
  const ModelConfig config = TensorParallelConfig(false);
  testing::RunRanks(4, [&](ProcessGroup& group) {
    Decoder model(config, kFloat64, std::make_shared<TensorParallelOverProcessGroup>(group));
    const int r = group.rank();
    EXPECT_EQ(model.local_heads(), 2);
    EXPECT_EQ(model.local_kv_heads(), 1);
    EXPECT_EQ(model.parameter("model.layers.0.self_attn.q_proj.weight").size(0), 2 * 8);
    EXPECT_EQ(model.parameter("model.layers.0.self_attn.o_proj.weight").size(1), 2 * 8);
    EXPECT_EQ(model.parameter("model.layers.0.mlp.down_proj.weight").size(1),
              SplitRange(26, r, 4).size());
    EXPECT_EQ(model.parameter("lm_head.weight").size(0), SplitRange(19, r, 4).size());
    EXPECT_EQ(model.parameter("model.norm.weight").size(0), 16);
  });
}

TEST(TensorParallel, ColumnParallelBiasesSplitAndOProjsIsWhole) {
  const ModelConfig config = FamilyConfig("llama", false);
  testing::RunRanks(4, [&](ProcessGroup& group) {
    Decoder model(config, kFloat64, std::make_shared<TensorParallelOverProcessGroup>(group));
    EXPECT_EQ(model.parameter("model.layers.0.self_attn.q_proj.bias").size(0), 2 * 8);
    EXPECT_EQ(model.parameter("model.layers.0.self_attn.k_proj.bias").size(0), 1 * 8);
    EXPECT_EQ(model.parameter("model.layers.0.self_attn.v_proj.bias").size(0), 1 * 8);
    EXPECT_EQ(model.parameter("model.layers.0.self_attn.o_proj.bias").size(0), 16);
    const TensorParallelNorm scope = model.gradient_norm_scope();
    for (size_t i = 0; i < model.named_parameters().size(); ++i) {
      const std::string& name = model.named_parameters()[i].first;
      if (name.ends_with("o_proj.bias")) {
        EXPECT_TRUE(scope.replicated[i]) << name;
      } else if (name.ends_with("q_proj.bias")) {
        EXPECT_FALSE(scope.replicated[i]) << name;
      }
    }
  });
}

TEST(TensorParallel, RefusesSizesThatDoNotDivideTheKvHeads) {
  testing::RunRanks(3, [&](ProcessGroup& group) {
    EXPECT_THAT(
        [&] {
          Decoder model(TensorParallelConfig(false), kFloat64,
                        std::make_shared<TensorParallelOverProcessGroup>(group));
        },
        ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("multiple of 3 KV heads")));
  });
}

TEST(TensorParallel, RefusesSizesThatDoNotDivideTheLinearAttentionKeyHeads) {
  ModelConfig config = FamilyConfig("qwen3_next", false);
  config.linear_num_key_heads = 2;
  config.linear_num_value_heads = 6;
  testing::RunRanks(4, [&](ProcessGroup& group) {
    EXPECT_THAT(
        [&] {
          Decoder model(config, kFloat64, std::make_shared<TensorParallelOverProcessGroup>(group));
        },
        ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr(
            "tensor parallelism over 4 ranks needs a multiple of 4 linear-attention key heads; "
            "the model has 2 key heads (serving 6 value heads")));
  });
}

TEST(TensorParallel, GraphBytesPerTokenDivideWithTheSplitParts) {
  const ModelConfig c = TensorParallelConfig(false);
  const int64_t one = GraphBytesPerToken(c, at::kBFloat16, 1);
  const int64_t two = GraphBytesPerToken(c, at::kBFloat16, 2);
  // The residual stream stays whole: 2 x hidden x 4 bytes per layer.
  const int64_t residual = c.num_hidden_layers * 2 * c.hidden_size * 4;
  EXPECT_EQ(one - residual, 2 * (two - residual));
}

// A sparse layer keeps its k experts' gate and up (this rank's slice of their width) instead of the
// dense MLP's, plus the routing: the softmax over the experts and k weights, and 4 k int64 indices.
TEST(TensorParallel, GraphBytesPerTokenOfSparseLayers) {
  const ModelConfig qwen3 = FamilyConfig("qwen3", false);
  const ModelConfig moe = FamilyConfig("qwen3_moe", false);
  const ModelConfig mixed = FamilyConfig("qwen3_moe-unnormalised", false);  // layer 0 dense
  for (int tp : {1, 2, 4}) {
    const int64_t dense = 2 * ((26 + tp - 1) / tp) * 2;
    const int64_t sparse = 2 * 2 * ((6 + tp - 1) / tp) * 2 + (5 + 2) * 4 + 4 * 2 * 8;
    EXPECT_EQ(GraphBytesPerToken(moe, at::kBFloat16, tp),
              GraphBytesPerToken(qwen3, at::kBFloat16, tp) + 2 * (sparse - dense))
        << "TP " << tp;
    EXPECT_EQ(GraphBytesPerToken(mixed, at::kBFloat16, tp),
              GraphBytesPerToken(qwen3, at::kBFloat16, tp) + sparse - dense)
        << "TP " << tp;
  }
}

// Without q/k norms RoPE keeps nothing: q and k before it are not saved.
TEST(TensorParallel, GraphBytesPerTokenWithoutQkNormsKeepsNoPreNormQk) {
  const ModelConfig qwen3 = FamilyConfig("qwen3", false);
  for (const std::string family : {"llama", "qwen2"}) {
    const ModelConfig other = FamilyConfig(family, false);
    for (int tp : {1, 2, 4}) {
      const int64_t q = qwen3.num_attention_heads / tp * qwen3.head_dim;
      const int64_t kv = qwen3.num_key_value_heads / tp * qwen3.head_dim;
      EXPECT_EQ(GraphBytesPerToken(qwen3, at::kBFloat16, tp) -
                    GraphBytesPerToken(other, at::kBFloat16, tp),
                qwen3.num_hidden_layers * (q + kv) * 2)
          << family << " TP " << tp;
    }
  }
}

// Rank 0 of a two-rank group whose collectives change nothing (the numbers are one rank's partial
// sums: only the order of work is checked). It records, for every all-reduce started, whether any
// parameter's gradient changed before the all-reduce was waited for.
class OverlapRecordingGroup final : public TensorParallelGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  void AllReduce(at::Tensor&, TensorParallelReduce) const override { ++blocking; }
  at::Tensor AllGather(const at::Tensor& tensor) const override {
    return at::cat({tensor, tensor});
  }
  std::unique_ptr<PendingCollective> StartAllReduce(at::Tensor&,
                                                    TensorParallelReduce) const override {
    class Pending final : public PendingCollective {
     public:
      explicit Pending(const OverlapRecordingGroup& group)
          : group_(group), before_(group.GradientTotal()) {}
      void Wait() override {
        if (waited_) return;
        waited_ = true;
        group_.overlapped.push_back(group_.GradientTotal() != before_);
      }
      ~Pending() override { Wait(); }

     private:
      const OverlapRecordingGroup& group_;
      double before_;
      bool waited_ = false;
    };
    return std::make_unique<Pending>(*this);
  }

  double GradientTotal() const {
    double total = 0;
    for (const auto& [name, parameter] : model->named_parameters()) {
      if (parameter.grad().defined()) total += parameter.grad().abs().sum().item<double>();
    }
    return total;
  }

  const Decoder* model = nullptr;
  mutable int blocking = 0;
  mutable std::vector<bool> overlapped;
};

// Backward starts each column-parallel projection's input-gradient sum (q/k/v, gate/up) and each
// slice of the log-probability head's hidden-state gradient, computes weight gradients, and only
// then waits: the collectives overlap that work instead of stalling it.
// What each rank measures alone (the free memory the automatic chunks are sized from) becomes the
// least over the ranks on every rank, so that all plan the same schedule; values past 2^53 stay
// exact (int64, not a float).
TEST(TensorParallel, LeastOverRanksIsTheSameOnEveryRank) {
  const int64_t big = (int64_t{1} << 53) + 1;
  testing::RunRanks(4, [&](ProcessGroup& group) {
    const TensorParallelOverProcessGroup ranks(group);
    const int r = group.rank();
    EXPECT_EQ(LeastOverRanks(&ranks, 100 - 10 * r, at::kCPU), 70);
    EXPECT_EQ(LeastOverRanks(&ranks, r == 2 ? big : big + 7, at::kCPU), big);
    EXPECT_EQ(LeastOverRanks(&ranks, r == 1 ? -5 : 3, at::kCPU), -5);
  });
  EXPECT_EQ(LeastOverRanks(nullptr, 42, at::kCPU), 42);
}

TEST(TensorParallel, BackwardComputesWeightGradientsWhileInputGradientsAreSummed) {
  const ModelConfig config = TensorParallelConfig(false);
  auto group = std::make_shared<OverlapRecordingGroup>();
  Decoder model(config, kFloat64, group);
  group->model = &model;
  model.InitRandom(/*seed=*/3);
  const int64_t n = 12;
  const at::Tensor ids = at::arange(n, at::kLong).remainder(config.vocab_size);
  const ChunkOutput out = model.Forward({.tokens = ids, .positions = at::arange(n, at::kLong)});
  const at::Tensor logprobs = model.Logprobs(out.hidden.slice(0, 0, n - 1), ids.slice(0, 1, n));
  group->overlapped.clear();
  logprobs.sum().backward();
  // Two column-parallel projections per layer, one slice of log-probability rows.
  const int64_t expected = 2 * config.num_hidden_layers + 1;
  ASSERT_EQ(static_cast<int64_t>(group->overlapped.size()), expected);
  for (size_t i = 0; i < group->overlapped.size(); ++i) {
    EXPECT_TRUE(group->overlapped[i]) << "all-reduce " << i << " of backward overlapped nothing";
  }
}

}  // namespace
}  // namespace dta

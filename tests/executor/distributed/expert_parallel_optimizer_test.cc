// Training under expert parallelism end to end in float64 (ranks as threads over Gloo): EP x DP
// (EP 2 inside DP 4, so every expert lives on two ranks; EP 4, on one) and EP x TP (TP 2, EP 2),
// with each optimizer layout (replicated, ZeRO-1 sharded, sharded and offloaded). Every replica
// trains its own share of one batch with dta (different trees, so the engine's lockstep pads), with
// the router's load-balancing loss; after three clipped AdamW steps (one global norm over the dense
// parameters and the experts) every rank's parameters equal one process's (1e-10). The state
// saved under EP resumes bit for bit and is refused by a run with another expert-parallel size;
// the model saved under EP is the whole model's files.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "executor/distributed/parallel_groups.h"
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
constexpr int kSteps = 3;
const at::TensorOptions kFloat64 = at::TensorOptions().dtype(at::kDouble);

struct Layout {
  int tensor_parallel, expert_parallel, world;
};

class ExpertParallelOptimizer : public ::testing::TestWithParam<Layout> {};

// body(world, groups) on every rank of `shape`, its TP, EP and EDP groups built.
void OnEveryRank(const Layout& shape,
                 const std::function<void(ProcessGroup&, const ParallelGroups&)>& body) {
  testing::RunRanks(shape.world, [&](ProcessGroup& world) {
    const ParallelGroups groups(world, shape.tensor_parallel, shape.expert_parallel,
                                testing::LoopbackOptions());
    body(world, groups);
  });
}

// This rank's part of the test model (the same weights at every layout).
Decoder Model(const ModelConfig& config, const ParallelGroups& groups) {
  Decoder model(config, kFloat64, groups.tensor_parallel_collectives(),
                groups.expert_parallel_collectives());
  model.InitRandom(7, 0.3);
  return model;
}

// The optimizer of `model` on this rank of `groups` under `layout`.
std::unique_ptr<TrainingOptimizer> MakeOptimizer(const Decoder& model, const ParallelGroups& groups,
                                                 const TrainingLayout& layout,
                                                 const AdamWOptions& adamw) {
  ExpertParameters experts{.expert_data_parallel = &groups.expert_data_parallel(),
                           .expert_parallel_rank = groups.expert_parallel_rank(),
                           .expert_parallel_size = groups.expert_parallel_size()};
  for (const ParameterSplit& split : model.parameter_splits())
    experts.expert.push_back(split.expert_parallel());
  return std::make_unique<TrainingOptimizer>(
      model.named_parameters(), &groups.data_parallel(), layout, adamw, int64_t{1} << 10,
      model.gradient_norm_scope(), OffloadUpdate::kOnDevice, std::move(experts));
}

TEST_P(ExpertParallelOptimizer, ClippedAdamWStepsEqualOneProcess) {
  const Layout shape = GetParam();
  const ModelConfig config = testing::WithFamily(testing::TinyConfig(), "qwen3_moe");
  auto sequences = testing::RandomRollouts(5, {.max_rollouts = 12, .max_length = 10, .vocab = 4});
  for (auto& tokens : sequences) {
    for (TokenId& token : tokens) token = static_cast<TokenId>((5 * token + 1) % 19);
  }
  std::vector<Rollout> rollouts = testing::MakeRollouts(sequences, 5);
  for (Rollout& r : rollouts) r.group = "g";
  testing::SetBatchAdvantages(rollouts);
  const BatchLossContext batch = MakeBatchContext(rollouts);
  const LossOptions loss{.kind = LossKind::kPpo, .router_aux_loss_coef = 0.5};
  const AdamWOptions adamw{.lr = 1e-2, .weight_decay = 0.1, .max_grad_norm = 1e-3};
  const ExecutorOptions dta{.method = Method::kDta, .block_size = 3, .graph_budget = 4};

  Decoder whole(config, kFloat64);
  whole.InitRandom(7, 0.3);
  testing::TrainOneProcess(whole, rollouts, loss, dta, batch, adamw, kSteps);

  const int dp = shape.world / shape.tensor_parallel;
  for (const TrainingLayout& layout : testing::OptimizerLayouts(shape.tensor_parallel, dp)) {
    SCOPED_TRACE(testing::OptimizerLayoutName(layout));
    const testing::ScratchDirectory scratch("dta-ep-optimizer");
    OnEveryRank(shape, [&](ProcessGroup& world, const ParallelGroups& groups) {
      Decoder model = Model(config, groups);
      std::unique_ptr<TrainingOptimizer> optimizer = MakeOptimizer(model, groups, layout, adamw);
      // Replica d trains every dp-th rollout: a share of its own shape.
      const int d = groups.data_parallel_rank();
      std::vector<Rollout> mine;
      for (size_t r = d; r < rollouts.size(); r += dp) mine.push_back(rollouts[r]);
      StepStats stats;
      for (int step = 0; step < kSteps; ++step) {
        optimizer->ZeroGrad();
        ComputeGradients(model, mine, loss, dta, batch);
        optimizer->SyncGradients();
        stats = optimizer->Step();
      }
      EXPECT_EQ(stats.step, kSteps);
      EXPECT_LT(stats.clip_coef, 1.0);
      testing::ExpectPartsOf(model, whole, kTolerance, world.rank());

      // The state resumes: a second optimizer loaded from it takes the same fourth step.
      const std::string state = scratch / "optimizer";
      optimizer->SaveState(state);
      world.Barrier();
      EXPECT_TRUE(optimizer->HasState(state));
      Decoder copy = Model(config, groups);
      for (size_t i = 0; i < model.named_parameters().size(); ++i)
        copy.named_parameters()[i].second.detach().copy_(model.named_parameters()[i].second);
      std::unique_ptr<TrainingOptimizer> resumed = MakeOptimizer(copy, groups, layout, adamw);
      resumed->LoadState(state);
      EXPECT_EQ(resumed->step(), kSteps);
      for (const auto& [m, o] : {std::pair<Decoder*, TrainingOptimizer*>{&model, optimizer.get()},
                                 std::pair<Decoder*, TrainingOptimizer*>{&copy, resumed.get()}}) {
        o->ZeroGrad();
        ComputeGradients(*m, mine, loss, dta, batch);
        o->SyncGradients();
        o->Step();
      }
      for (size_t i = 0; i < model.named_parameters().size(); ++i) {
        EXPECT_TRUE(
            at::equal(copy.named_parameters()[i].second, model.named_parameters()[i].second))
            << model.named_parameters()[i].first << " on rank " << world.rank();
      }

      // Without expert parallelism the experts' state is refused, naming both sizes.
      if (shape.tensor_parallel == 1) {
        Decoder whole_here(config, kFloat64);
        TrainingOptimizer plain(whole_here.named_parameters(), &groups.data_parallel(), layout,
                                adamw);
        try {
          plain.LoadState(state);
          ADD_FAILURE() << "loaded expert-parallel state without expert parallelism";
        } catch (const c10::Error& e) {
          EXPECT_THAT(e.what_without_backtrace(),
                      ::testing::HasSubstr("resumes only with the expert-parallel size"));
        }
      }
    });
  }
}

// Saving under expert (and tensor) parallelism writes the files one process writes for the whole
// model, byte for byte, and loading them gives every rank its part.
TEST_P(ExpertParallelOptimizer, CheckpointsAreTheWholeModel) {
  const Layout shape = GetParam();
  const ModelConfig config = testing::WithFamily(testing::TinyConfig(), "qwen3_moe");
  const testing::ScratchDirectory scratch("dta-ep-checkpoint");
  Decoder whole(config, kFloat64);
  whole.InitRandom(7, 0.3);
  SaveHfModel(whole, scratch / "whole");
  OnEveryRank(shape, [&](ProcessGroup& world, const ParallelGroups& groups) {
    const Decoder model = Model(config, groups);
    // The ranks of one expert-parallel group of replicas save (every rank of it calls).
    const std::string saved = scratch / "parallel";
    if (groups.expert_data_parallel_rank() == 0) SaveHfModel(model, saved);
    world.Barrier();
    const Decoder loaded = LoadHfModel(saved, kFloat64, groups.tensor_parallel_collectives(),
                                       groups.expert_parallel_collectives());
    testing::ExpectPartsOf(loaded, whole, 0.0, world.rank());
  });
  for (const auto& entry : std::filesystem::directory_iterator(scratch / "whole")) {
    const std::string name = entry.path().filename().string();
    EXPECT_EQ(testing::ReadFileBytes(scratch / ("parallel/" + name)),
              testing::ReadFileBytes(entry.path().string()))
        << name;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ExpertParallelOptimizer,
    ::testing::Values(Layout{.tensor_parallel = 1, .expert_parallel = 2, .world = 4},
                      Layout{.tensor_parallel = 1, .expert_parallel = 4, .world = 4},
                      Layout{.tensor_parallel = 2, .expert_parallel = 2, .world = 4}),
    [](const ::testing::TestParamInfo<Layout>& info) {
      return "tp" + std::to_string(info.param.tensor_parallel) + "_ep" +
             std::to_string(info.param.expert_parallel) + "_world" +
             std::to_string(info.param.world);
    });

}  // namespace
}  // namespace dta

// RunTrainerSteps against a scripted TrainerSession: committed steps train exactly like calling
// the executor and the optimizer by hand (float64, bitwise), reports carry the right numbers, an
// ABORT or an ABORTED fetch asks for a restart without stepping, failures are reported FAILED
// before the loop gives up, and checkpoints follow save_every, max_steps and requests.
#include "apps/trainer/trainer_loop.h"

#include <c10/util/Exception.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "apps/trainer/checkpoints.h"
#include "apps/trainer/trainer_metrics.h"
#include "core/base/remove_tree.h"
#include "core/loss/batch_context.h"
#include "executor/model/hf_checkpoint.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/executor_cases.h"
#include "tests/testing/fake_trainer_session.h"
#include "tests/testing/gloo_ranks.h"

namespace dta {
namespace {

Decoder TinyModel() {
  Decoder model(testing::TinyConfig(/*vocab=*/23), at::TensorOptions().dtype(at::kDouble));
  model.InitRandom(/*seed=*/7, /*std=*/0.2);
  return model;
}

// A partition of `n` rollouts sharing a prefix, with per-token advantages (as the dispatcher
// sends them) and the batch's normalisers over this partition alone (one rank).
StepPartition MakePartition(int64_t step, int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  StepPartition partition;
  partition.step = step;
  partition.policy_version = step;
  std::vector<TokenId> prefix;
  for (int t = 0; t < 5; ++t) prefix.push_back(static_cast<TokenId>(rng() % 23));
  for (int i = 0; i < n; ++i) {
    Rollout r;
    r.id = "s" + std::to_string(step) + "-r" + std::to_string(i);
    r.group = "g";
    r.tokens = prefix;
    const int suffix = 1 + static_cast<int>(rng() % 6);
    for (int t = 0; t < suffix; ++t) r.tokens.push_back(static_cast<TokenId>(rng() % 23));
    for (size_t t = 0; t < r.tokens.size(); ++t) {
      r.loss_mask.push_back(t > 0 ? 1 : 0);
      r.logprobs.push_back(-3.1f + 0.01f * static_cast<float>(rng() % 20));
      r.advantages.push_back(0.1f * static_cast<float>(static_cast<int>(rng() % 11) - 5));
    }
    partition.rollouts.push_back(std::move(r));
  }
  const BatchLossContext context = MakeBatchContext(partition.rollouts);
  partition.total_loss_tokens = context.total_loss_tokens;
  partition.num_rollouts = context.num_rollouts;
  return partition;
}

using testing::FakeSession;

class TrainerLoopTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern =
        (std::filesystem::path(::testing::TempDir()) / "dta_trainer_loop_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr) << pattern;
    dir_ = pattern;
  }
  void TearDown() override { RemoveTree(dir_); }

  TrainerLoopOptions Options(int64_t max_steps) const {
    TrainerLoopOptions options;
    options.executor.block_size = 3;  // several chunks per rollout
    options.checkpoint_dir = dir_.string();
    options.max_steps = max_steps;
    options.log_prefix = "trainer_loop_test";
    return options;
  }

  std::filesystem::path dir_;
};

std::vector<at::Tensor> Parameters(const Decoder& model) {
  std::vector<at::Tensor> out;
  for (const auto& [name, p] : model.named_parameters()) out.push_back(p.detach().clone());
  return out;
}

void ExpectSameParameters(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "parameter " << i;
}

// What the loop must do for each committed step, written out by hand.
std::vector<at::Tensor> TrainByHand(const std::vector<StepPartition>& steps,
                                    const TrainerLoopOptions& options) {
  Decoder model = TinyModel();
  AdamW optimizer(model.named_parameters(), AdamWOptions{.lr = 1e-2});
  for (const StepPartition& partition : steps) {
    optimizer.ZeroGrad();
    ComputeGradients(
        model, partition.rollouts, options.loss, options.executor,
        {.total_loss_tokens = partition.total_loss_tokens, .num_rollouts = partition.num_rollouts});
    optimizer.Step();
  }
  return Parameters(model);
}

TEST_F(TrainerLoopTest, CommittedStepsTrainLikeTheExecutorByHand) {
  const std::vector<StepPartition> steps = {MakePartition(0, 3, 1), MakePartition(1, 1, 2),
                                            MakePartition(2, 4, 3)};
  FakeSession session;
  for (const StepPartition& p : steps) session.partitions.push_back(p);
  TrainerLoopOptions options = Options(/*max_steps=*/3);
  options.save_every = 2;
  Decoder model = TinyModel();
  TrainingOptimizer optimizer(model.named_parameters(), nullptr, {}, AdamWOptions{.lr = 1e-2});
  int syncs = 0;
  EXPECT_EQ(RunTrainerSteps(
                session, model, optimizer, [&] { ++syncs; }, 0, options),
            3);

  ExpectSameParameters(Parameters(model), TrainByHand(steps, options));
  EXPECT_EQ(syncs, 3);
  EXPECT_EQ(session.fetched, (std::vector<int64_t>{0, 1, 2}));
  EXPECT_TRUE(session.failed.empty());
  ASSERT_EQ(session.prepared.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    const PreparedStep& report = session.prepared[i];
    EXPECT_EQ(report.step, i);
    int64_t tokens = 0;
    for (const Rollout& r : steps[i].rollouts) tokens += static_cast<int64_t>(r.tokens.size());
    EXPECT_EQ(report.rollout_tokens, tokens);
    EXPECT_GT(report.forwarded_tokens, 0);
    EXPECT_TRUE(std::isfinite(report.loss));
    EXPECT_NE(report.loss, 0.0);
  }
  // Saved after step 2 (save_every) and after the last step: a report names the newest checkpoint
  // the weights can be restored from.
  EXPECT_EQ(session.prepared[0].checkpoint_step, 0);
  EXPECT_EQ(session.prepared[1].checkpoint_step, 0);
  EXPECT_EQ(session.prepared[2].checkpoint_step, 2);
  const std::optional<CheckpointInfo> latest = LatestCheckpoint(dir_.string());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 3);
  EXPECT_TRUE(std::filesystem::exists(dir_ / "step-00000002"));  // kept: keep_checkpoints = 2

  // A restarted trainer resumes from the checkpoint with the same weights.
  Decoder restored = TinyModel();
  TrainingOptimizer restored_optimizer(restored.named_parameters(), nullptr, {},
                                       AdamWOptions{.lr = 1e-2});
  LoadCheckpoint(*latest, restored_optimizer);
  ExpectSameParameters(Parameters(restored), Parameters(model));
}

std::vector<std::string> Listing(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// A checkpoint's model/ is exactly what a rollout engine loads (bf16 weights with their index,
// config.json, generation_config.json, the source model's tokenizer files, nothing else); the
// optimizer sits beside it in optimizer/, and resumes the float64 parameters exactly although the
// published weights are bf16; latest.json names both; a checkpoint saved before the split (state
// files beside the weights) still resumes.
TEST_F(TrainerLoopTest, ACheckpointPublishesExactlyWhatInferenceEnginesLoad) {
  namespace fs = std::filesystem;
  const fs::path source = dir_ / "source";
  SaveHfModel(TinyModel(), source.string());
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "README.md"}) {
    std::ofstream(source / name) << "{\"from\": \"" << name << "\"}";
  }
  const std::vector<StepPartition> steps = {MakePartition(0, 3, 1), MakePartition(1, 2, 2)};
  FakeSession session;
  for (const StepPartition& p : steps) session.partitions.push_back(p);
  TrainerLoopOptions options = Options(/*max_steps=*/2);
  options.checkpoint_dir = (dir_ / "ckpt").string();
  options.model_export.source_directory = source.string();
  Decoder model = TinyModel();
  TrainingOptimizer optimizer(model.named_parameters(), nullptr, {}, AdamWOptions{.lr = 1e-2});
  ASSERT_EQ(RunTrainerSteps(
                session, model, optimizer, [] {}, 0, options),
            2);

  const std::optional<CheckpointInfo> latest = LatestCheckpoint(options.checkpoint_dir);
  ASSERT_TRUE(latest.has_value());
  const fs::path step = latest->path;
  EXPECT_THAT(Listing(step), ::testing::ElementsAre("model", "optimizer", "trainer.json"));
  EXPECT_THAT(Listing(step / "model"),
              ::testing::ElementsAre("config.json", "generation_config.json", "model.safetensors",
                                     "model.safetensors.index.json", "tokenizer.json",
                                     "tokenizer_config.json"));
  EXPECT_THAT(Listing(step / "optimizer"),
              ::testing::ElementsAre(TrainingOptimizer::kReplicatedFile));
  std::ifstream latest_file(dir_ / "ckpt" / "latest.json");
  const nlohmann::json pointer = nlohmann::json::parse(latest_file);
  EXPECT_EQ(pointer["step"], 2);
  EXPECT_EQ(pointer["path"], step.string());
  EXPECT_EQ(pointer["model_path"], (step / "model").string());

  // The published weights are the trained ones, rounded to bf16.
  const Decoder published =
      LoadHfModel((step / "model").string(), at::TensorOptions().dtype(at::kDouble));
  ASSERT_EQ(published.named_parameters().size(), model.named_parameters().size());
  for (size_t i = 0; i < model.named_parameters().size(); ++i) {
    const at::Tensor want =
        model.named_parameters()[i].second.detach().to(at::kBFloat16).to(at::kDouble);
    EXPECT_TRUE(at::equal(published.named_parameters()[i].second.detach(), want))
        << model.named_parameters()[i].first;
  }
  EXPECT_EQ(published.config().torch_dtype, "bfloat16");

  // Resuming restores the float64 parameters exactly, from the new layout and from the old one.
  const fs::path old_layout = dir_ / "old" / "step-00000002";
  fs::create_directories(old_layout);
  fs::copy(step / "optimizer" / TrainingOptimizer::kReplicatedFile,
           old_layout / TrainingOptimizer::kReplicatedFile);
  fs::copy(step / "trainer.json", old_layout / "trainer.json");
  for (const fs::path& checkpoint : {step, old_layout}) {
    Decoder restored = TinyModel();
    TrainingOptimizer restored_optimizer(restored.named_parameters(), nullptr, {},
                                         AdamWOptions{.lr = 1e-2});
    LoadCheckpoint({.step = 2, .path = checkpoint.string()}, restored_optimizer);
    ExpectSameParameters(Parameters(restored), Parameters(model));
  }
}

// The offloaded optimizer (ShardedAdamW over one rank, state in host memory) trains what AdamW
// trains, saves its slice file in the checkpoint and resumes from it.
TEST_F(TrainerLoopTest, AnOffloadedOptimizerTrainsAndResumesLikeTheReplicatedOne) {
  const std::vector<StepPartition> steps = {MakePartition(0, 3, 1), MakePartition(1, 1, 2)};
  FakeSession session;
  for (const StepPartition& p : steps) session.partitions.push_back(p);
  const TrainerLoopOptions options = Options(/*max_steps=*/2);
  Decoder model = TinyModel();
  TrainingOptimizer optimizer(model.named_parameters(), nullptr, {.offload_optimizer = true},
                              AdamWOptions{.lr = 1e-2});
  ASSERT_TRUE(optimizer.sharded());
  EXPECT_EQ(RunTrainerSteps(
                session, model, optimizer, [&] { optimizer.SyncGradients(); }, 0, options),
            2);
  const std::vector<at::Tensor> got = Parameters(model);
  const std::vector<at::Tensor> want = TrainByHand(steps, options);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const double scale = std::max(1.0, want[i].abs().max().item<double>());
    EXPECT_LT((got[i] - want[i]).abs().max().item<double>() / scale, 1e-12) << "parameter " << i;
  }
  const std::optional<CheckpointInfo> latest = LatestCheckpoint(dir_.string());
  ASSERT_TRUE(latest.has_value());
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(latest->path) / "optimizer" /
                                      "optimizer-00000-of-00001.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(latest->path) / "optimizer" /
                                       TrainingOptimizer::kReplicatedFile));
  Decoder restored = TinyModel();
  TrainingOptimizer restored_optimizer(restored.named_parameters(), nullptr,
                                       {.offload_optimizer = true}, AdamWOptions{.lr = 1e-2});
  LoadCheckpoint(*latest, restored_optimizer);
  EXPECT_EQ(restored_optimizer.step(), 2);
  ExpectSameParameters(Parameters(restored), Parameters(model));
  // A replicated optimizer cannot read it, and says how to resume it.
  TrainingOptimizer replicated(TinyModel().named_parameters(), nullptr, {}, AdamWOptions{});
  try {
    LoadCheckpoint(*latest, replicated);
    ADD_FAILURE() << "a replicated optimizer loaded a sharded checkpoint";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr("--offload_optimizer=true"));
  }
}

TEST_F(TrainerLoopTest, ResumesFromItsStepAndStopsAtMaxSteps) {
  FakeSession session;
  session.partitions.push_back(MakePartition(5, 2, 4));
  Decoder model = TinyModel();
  TrainingOptimizer optimizer(model.named_parameters(), nullptr, {}, AdamWOptions{.lr = 1e-2});
  EXPECT_EQ(RunTrainerSteps(
                session, model, optimizer, [] {}, 5, Options(/*max_steps=*/6)),
            6);
  EXPECT_EQ(session.fetched, (std::vector<int64_t>{5}));
  EXPECT_EQ(session.prepared.at(0).checkpoint_step, 5);
  EXPECT_EQ(LatestCheckpoint(dir_.string())->step, 6);
  // Already there: nothing is fetched.
  EXPECT_EQ(RunTrainerSteps(
                session, model, optimizer, [] {}, 6, Options(/*max_steps=*/6)),
            6);
  EXPECT_EQ(session.fetched.size(), 1u);
}

TEST_F(TrainerLoopTest, AnEmptyPartitionStillSynchronisesAndReports) {
  StepPartition empty;
  empty.step = 0;
  empty.num_rollouts = 4;  // the other ranks' rollouts
  empty.total_loss_tokens = 20;
  FakeSession session;
  session.partitions.push_back(empty);
  Decoder model = TinyModel();
  const std::vector<at::Tensor> before = Parameters(model);
  TrainingOptimizer optimizer(model.named_parameters(), nullptr, {},
                              AdamWOptions{.lr = 1e-2, .weight_decay = 0});
  int syncs = 0;
  RunTrainerSteps(
      session, model, optimizer, [&] { ++syncs; }, 0, Options(1));
  EXPECT_EQ(syncs, 1);
  ASSERT_EQ(session.prepared.size(), 1u);
  EXPECT_EQ(session.prepared[0].rollout_tokens, 0);
  EXPECT_EQ(session.prepared[0].loss, 0.0);
  ExpectSameParameters(Parameters(model), before);  // zero gradients, no weight decay
}

TEST_F(TrainerLoopTest, AnAbortedStepAsksForARestartWithoutStepping) {
  const std::vector<StepPartition> steps = {MakePartition(0, 2, 5), MakePartition(1, 2, 6)};
  FakeSession session;
  for (const StepPartition& p : steps) session.partitions.push_back(p);
  session.decisions.push_back(StepDecision::kCommit);
  session.decisions.push_back(StepDecision::kAbort);
  Decoder model = TinyModel();
  TrainingOptimizer optimizer(model.named_parameters(), nullptr, {}, AdamWOptions{.lr = 1e-2});
  const TrainerLoopOptions options = Options(0);
  try {
    RunTrainerSteps(
        session, model, optimizer, [] {}, 0, options);
    FAIL() << "an ABORT decision must ask for a restart";
  } catch (const TrainerRestart& restart) {
    EXPECT_NE(restart.why.find("step 1 aborted"), std::string::npos) << restart.why;
  }
  EXPECT_EQ(optimizer.step(), 1);
  ExpectSameParameters(Parameters(model), TrainByHand({steps[0]}, options));
}

TEST_F(TrainerLoopTest, AnAbortedGenerationAsksForARestartAndOtherErrorsDoNot) {
  Decoder model = TinyModel();
  TrainingOptimizer optimizer(model.named_parameters(), nullptr, {}, AdamWOptions{.lr = 1e-2});
  FakeSession aborted;
  aborted.partitions.push_back(absl::AbortedError("generation 1 is over"));
  EXPECT_THROW(RunTrainerSteps(
                   aborted, model, optimizer, [] {}, 0, Options(0)),
               TrainerRestart);

  FakeSession unavailable;
  unavailable.partitions.push_back(absl::UnavailableError("dispatcher gone"));
  try {
    RunTrainerSteps(
        unavailable, model, optimizer, [] {}, 0, Options(0));
    FAIL() << "a failed fetch must throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("fetch: UNAVAILABLE"), std::string::npos) << e.what();
  }

  FakeSession report_aborted;
  report_aborted.partitions.push_back(MakePartition(0, 1, 7));
  report_aborted.decisions.push_back(absl::AbortedError("a rank failed"));
  EXPECT_THROW(RunTrainerSteps(
                   report_aborted, model, optimizer, [] {}, 0, Options(0)),
               TrainerRestart);
  EXPECT_EQ(optimizer.step(), 0);
}

TEST_F(TrainerLoopTest, AGradientFailureIsReportedFirst) {
  StepPartition bad = MakePartition(0, 2, 8);
  bad.rollouts[1].tokens[2] = 23;  // outside the vocabulary: the executor refuses it
  FakeSession session;
  session.partitions.push_back(bad);
  Decoder model = TinyModel();
  TrainingOptimizer optimizer(model.named_parameters(), nullptr, {}, AdamWOptions{.lr = 1e-2});
  int syncs = 0;
  try {
    RunTrainerSteps(
        session, model, optimizer, [&] { ++syncs; }, 0, Options(0));
    FAIL() << "a token outside the vocabulary must fail the step";
  } catch (const TrainerRestart&) {
    FAIL() << "restarting cannot help a batch the executor refuses";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("step 0"), std::string::npos) << e.what();
  }
  ASSERT_EQ(session.failed.size(), 1u);
  EXPECT_EQ(session.failed[0].first, 0);
  EXPECT_FALSE(session.failed[0].second.empty());
  EXPECT_EQ(syncs, 0);
  EXPECT_TRUE(session.prepared.empty());
}

// A committed step whose gradients are not finite (poisoned here in the synchronisation): with
// kSkip the loop updates nothing, reports it and goes on, so the weights are those of training the
// other steps alone; with kRaise (the default) it stops at that step, naming the parameter.
TEST_F(TrainerLoopTest, ANonFiniteGradientSkipsTheStepOrStopsTheLoop) {
  const std::vector<StepPartition> steps = {MakePartition(0, 3, 1), MakePartition(1, 2, 2),
                                            MakePartition(2, 4, 3)};
  for (const NonFiniteGradients mode : {NonFiniteGradients::kSkip, NonFiniteGradients::kRaise}) {
    FakeSession session;
    for (const StepPartition& p : steps) session.partitions.push_back(p);
    TrainerLoopOptions options = Options(/*max_steps=*/3);
    options.nonfinite_gradients = mode;
    std::vector<StepReport> reports;
    options.on_step = [&](const StepReport& report) { reports.push_back(report); };
    Decoder model = TinyModel();
    TrainingOptimizer optimizer(model.named_parameters(), nullptr, {}, AdamWOptions{.lr = 1e-2});
    int syncs = 0;
    const auto poison_step_1 = [&] {
      if (syncs++ != 1) return;
      at::NoGradGuard no_grad;
      model.named_parameters()[2].second.mutable_grad()[0].fill_(std::nan(""));
    };
    if (mode == NonFiniteGradients::kRaise) {
      try {
        RunTrainerSteps(session, model, optimizer, poison_step_1, 0, options);
        FAIL() << "a NaN gradient must stop the loop by default";
      } catch (const std::exception& e) {
        EXPECT_NE(std::string(e.what()).find("is not finite"), std::string::npos) << e.what();
      }
      EXPECT_EQ(optimizer.step(), 1);
      EXPECT_EQ(reports.size(), 1u);
      continue;
    }
    EXPECT_EQ(RunTrainerSteps(session, model, optimizer, poison_step_1, 0, options), 3);
    ASSERT_EQ(reports.size(), 3u);
    EXPECT_FALSE(reports[0].skipped);
    EXPECT_TRUE(reports[1].skipped);
    EXPECT_TRUE(std::isnan(reports[1].grad_norm));
    EXPECT_FALSE(reports[2].skipped);
    EXPECT_EQ(optimizer.step(), 2);
    EXPECT_EQ(session.prepared.size(), 3u);  // every step committed: the batch is consumed
    ExpectSameParameters(Parameters(model), TrainByHand({steps[0], steps[2]}, options));
  }
}

TEST_F(TrainerLoopTest, ASynchronisationFailureIsReportedAndAsksForARestart) {
  FakeSession session;
  session.partitions.push_back(MakePartition(0, 2, 9));
  Decoder model = TinyModel();
  TrainingOptimizer optimizer(model.named_parameters(), nullptr, {}, AdamWOptions{.lr = 1e-2});
  EXPECT_THROW(
      RunTrainerSteps(
          session, model, optimizer, [] { TORCH_CHECK(false, "peer 1 is gone"); }, 0, Options(0)),
      TrainerRestart);
  ASSERT_EQ(session.failed.size(), 1u);
  EXPECT_NE(session.failed[0].second.find("peer 1 is gone"), std::string::npos);
  EXPECT_TRUE(session.prepared.empty());
  EXPECT_EQ(optimizer.step(), 0);
}

// A checkpoint requested on one rank (SIGUSR1 reaches whichever process it was sent to) is saved
// by every rank together after the step in progress: the ranks agree on it through the world.
TEST_F(TrainerLoopTest, ARequestOnAnyRankSavesACheckpointOnEveryRank) {
  for (const int requesting : {1, 0}) {
    RemoveTree(dir_);
    std::vector<std::vector<PreparedStep>> prepared(2);
    testing::RunRanks(2, [&](ProcessGroup& world) {
      FakeSession session;
      session.partitions.push_back(MakePartition(0, 2, 10 + world.rank()));
      session.partitions.push_back(MakePartition(1, 2, 20 + world.rank()));
      Decoder model = TinyModel();
      TrainingOptimizer optimizer(model.named_parameters(), &world, {}, AdamWOptions{.lr = 1e-2});
      TrainerLoopOptions options = Options(/*max_steps=*/0);
      options.save_every = 1000;
      options.ranks = {.world = &world, .expert_data_parallel_rank = world.rank()};
      std::atomic<bool> requested{world.rank() == requesting};
      // Two steps, then the session runs out (DEADLINE_EXCEEDED ends the loop with an error).
      EXPECT_THROW(RunTrainerSteps(
                       session, model, optimizer, [&] { optimizer.SyncGradients(); }, 0, options,
                       &requested),
                   std::runtime_error);
      EXPECT_FALSE(requested.load()) << "rank " << world.rank();
      prepared[world.rank()] = session.prepared;
    });
    const std::optional<CheckpointInfo> latest = LatestCheckpoint(dir_.string());
    ASSERT_TRUE(latest.has_value()) << "requested on rank " << requesting;
    EXPECT_EQ(latest->step, 1);  // after the step in progress when asked
    EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(latest->path) / "optimizer" /
                                        TrainingOptimizer::kReplicatedFile));
    EXPECT_TRUE(
        std::filesystem::exists(std::filesystem::path(latest->path) / "model" / "config.json"));
    for (int rank = 0; rank < 2; ++rank) {
      ASSERT_EQ(prepared[rank].size(), 2u) << "rank " << rank;
      EXPECT_EQ(prepared[rank][1].checkpoint_step, 1) << "rank " << rank;
    }
  }
}

// Without a request nothing is saved between --save_every's.
TEST_F(TrainerLoopTest, NoRequestSavesNothingBetweenSaveEverys) {
  FakeSession session;
  session.partitions.push_back(MakePartition(0, 2, 10));
  session.partitions.push_back(MakePartition(1, 2, 11));
  Decoder model = TinyModel();
  TrainingOptimizer optimizer(model.named_parameters(), nullptr, {}, AdamWOptions{.lr = 1e-2});
  TrainerLoopOptions options = Options(/*max_steps=*/0);
  options.save_every = 1000;
  std::atomic<bool> requested{false};
  EXPECT_THROW(RunTrainerSteps(
                   session, model, optimizer, [] {}, 0, options, &requested),
               std::runtime_error);
  EXPECT_FALSE(LatestCheckpoint(dir_.string()).has_value());
  EXPECT_EQ(session.prepared.at(1).checkpoint_step, 0);
}

// A mixture-of-experts loss with a router load-balancing term reports it beside the loss (event
// files and /metrics); a loss without one shows no such scalar rather than a misleading 0.
TEST(TrainerMetrics, TheRouterAuxLossIsReportedWhenTheLossHasOne) {
  StepReport report{.step = 4, .loss = 1.5, .router_aux_loss = 0.375};
  const Scalars with = StepScalars(report);
  EXPECT_THAT(with, ::testing::Contains(std::pair<std::string, double>("router_aux_loss", 0.375)));
  TrainerMetrics metrics(/*rank=*/2, /*attempt=*/0);
  metrics.Record(report);
  EXPECT_THAT(metrics.Prometheus(),
              ::testing::HasSubstr("dta_trainer_router_aux_loss{rank=\"2\"} 0.375"));
  report.router_aux_loss.reset();
  for (const auto& [name, value] : StepScalars(report)) EXPECT_NE(name, "router_aux_loss");
}

// Routing replay that unshared tokens (rollouts routed differently on shared tokens) says how many.
TEST(TrainerMetrics, TokensUnsharedByRoutingReplayAreReportedWhenThereAreAny) {
  StepReport report{.step = 1, .loss = 0.5, .replay_split_tokens = 12};
  EXPECT_THAT(StepScalars(report),
              ::testing::Contains(std::pair<std::string, double>("replay_split_tokens", 12)));
  report.replay_split_tokens = 0;
  for (const auto& [name, value] : StepScalars(report)) EXPECT_NE(name, "replay_split_tokens");
}

}  // namespace
}  // namespace dta

// End to end on loopback, with the real binaries: dta-dispatcher, dta-trainer ranks on Gloo, and
// dta-send as the rollout worker. The contract: whatever the number of trainers and whatever
// process is killed (kill -9), the final parameters equal those of one trainer training the same
// batches without interruption (float64, relative error <= 1e-10), and every acknowledged
// trajectory is trained exactly once.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/checkpoint/safetensors.h"
#include "core/io/rollout_jsonl.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/event_records.h"
#include "tests/testing/free_port.h"
#include "tests/testing/http_get.h"
#include "tests/testing/process.h"

namespace dta {
namespace {

namespace fs = std::filesystem;
using testing::Process;

constexpr int kSteps = 4;
constexpr int kBatch = 6;
constexpr int kRestarted = 75;  // dta-trainer's "restart me"

// A small GRPO batch with shared prompts: 4 prompts x 6 samples, two turns on some.
std::vector<Rollout> MakeRollouts() {
  std::mt19937 rng(7);
  std::vector<Rollout> rollouts;
  for (int prompt = 0; prompt < 4; ++prompt) {
    for (int sample = 0; sample < 6; ++sample) {
      Rollout r;
      r.id = "p" + std::to_string(prompt) + "-s" + std::to_string(sample);
      r.group = "p" + std::to_string(prompt);
      const int length = 9 + static_cast<int>(rng() % 7);
      for (int t = 0; t < length; ++t) {
        r.tokens.push_back(t < 5 ? static_cast<TokenId>(prompt * 5 + t)
                                 : static_cast<TokenId>(rng() % 29));
        r.loss_mask.push_back(t >= 5);
        r.logprobs.push_back(t >= 5 ? -3.3f + 0.1f * static_cast<float>(rng() % 7) : 0.0f);
      }
      r.reward = static_cast<double>(rng() % 5) / 4.0;
      rollouts.push_back(std::move(r));
    }
  }
  return rollouts;
}

class TrainerDaemonTest : public ::testing::Test {
 protected:
  TrainerDaemonTest() {
    root_ = fs::path(::testing::TempDir()) /
            (std::string("trainer_daemon_") +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
    std::ofstream(root_ / "config.json")
        << R"({"vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
      "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false})";
    EXPECT_TRUE(WriteRolloutsJsonl((root_ / "rollouts.jsonl").string(), MakeRollouts()).ok());
    // The trainers' credential, given to every dispatcher and trainer of the test.
    std::ofstream(root_ / "trainer.token") << "trainer-secret\n";
    fs::permissions(root_ / "trainer.token", fs::perms::owner_read | fs::perms::owner_write);
  }
  ~TrainerDaemonTest() override {
    if (!HasFailure()) fs::remove_all(root_);
  }

  // One training run of its own: a dispatcher, its log and the trainers' checkpoints.
  struct Run {
    fs::path dir;
    std::string address;
    std::vector<std::string> dispatcher_flags;  // beyond the log, the address and the batch
    std::unique_ptr<Process> dispatcher;
  };

  Run NewRun(const std::string& name, std::vector<std::string> dispatcher_flags = {}) {
    Run run;
    run.dispatcher_flags = std::move(dispatcher_flags);
    run.dir = root_ / name;
    fs::create_directories(run.dir);
    run.address = "127.0.0.1:" + std::to_string(testing::FreeLoopbackPort());
    StartDispatcher(run);
    return run;
  }

  // The run every faulty one must match: one trainer, no interruption.
  Run TrainedReference() {
    Run reference = NewRun("reference");
    Send(reference);
    Train(reference, 1);
    return reference;
  }

  static void StartDispatcher(Run& run) {
    std::vector<std::string> command = {
        (testing::BinaryDirectory() / "dta-dispatcher").string(),
        "--wal=" + (run.dir / "dispatcher.wal").string(),
        "--listen=" + run.address,
        "--batch_rollouts=" + std::to_string(kBatch),
        "--vocab_size=32",
        "--trainer_token_file=" + (run.dir.parent_path() / "trainer.token").string()};
    command.insert(command.end(), run.dispatcher_flags.begin(), run.dispatcher_flags.end());
    run.dispatcher = std::make_unique<Process>(command, (run.dir / "dispatcher.log").string());
  }

  void Send(const Run& run) {
    Process send({(testing::BinaryDirectory() / "dta-send").string(), "--dispatcher=" + run.address,
                  "--rollouts=" + (root_ / "rollouts.jsonl").string(), "--retry_s=60"},
                 (run.dir / "send.log").string());
    ASSERT_EQ(send.Wait(std::chrono::seconds(90)), 0) << send.Log();
  }

  // dta-trainer and its flags. `save_every`: checkpoints every this many steps (and after the
  // last).
  std::vector<std::string> TrainerCommand(const Run& run, int slow_step_ms,
                                          const std::string& checkpoints = "ckpt",
                                          int save_every = 1) {
    return {(testing::BinaryDirectory() / "dta-trainer").string(),
            "--dispatcher=" + run.address,
            "--token_file=" + (root_ / "trainer.token").string(),
            "--checkpoint_dir=" + (run.dir / checkpoints).string(),
            "--config=" + (root_ / "config.json").string(),
            "--dtype=float64",
            "--checkpoint_dtype=model",  // compared in float64
            "--method=dta",
            "--block_size=4",
            "--loss=grpo",
            "--lr=1e-2",
            "--max_grad_norm=0",
            "--max_steps=" + std::to_string(kSteps),
            "--save_every=" + std::to_string(save_every),
            "--timeout_s=20",
            "--slow_step_ms=" + std::to_string(slow_step_ms)};
  }

  std::unique_ptr<Process> StartTrainer(const Run& run, int rank, int world, int master_port,
                                        int slow_step_ms, const std::string& checkpoints = "ckpt",
                                        int save_every = 1,
                                        const std::vector<std::string>& extra_flags = {}) {
    std::vector<std::string> command = TrainerCommand(run, slow_step_ms, checkpoints, save_every);
    command.insert(command.end(), extra_flags.begin(), extra_flags.end());
    // As torchrun --nnodes=world/ranks_per_node_ exports it (one node when ranks_per_node_ is 0).
    const int per_node = ranks_per_node_ > 0 ? ranks_per_node_ : world;
    return std::make_unique<Process>(
        command, (run.dir / ("trainer" + std::to_string(rank) + ".log")).string(),
        std::vector<std::string>{
            "RANK=" + std::to_string(rank), "WORLD_SIZE=" + std::to_string(world),
            "LOCAL_RANK=" + std::to_string(rank % per_node),
            "LOCAL_WORLD_SIZE=" + std::to_string(per_node), "MASTER_ADDR=127.0.0.1",
            "MASTER_PORT=" + std::to_string(master_port)});
  }

  // A fault for Train: kill -9 of rank `victim` during step 2 (after step 1 is logged, while the
  // step sleeps before its gradient synchronisation).
  static std::function<bool(Run&, std::vector<std::unique_ptr<Process>>&)> KillDuringStepTwo(
      int victim) {
    return [victim](Run&, std::vector<std::unique_ptr<Process>>& trainers) {
      if (trainers[victim]->Log().find("step 1:") == std::string::npos) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      trainers[victim]->Kill(SIGKILL);
      return true;
    };
  }

  // Runs `world` trainers as a launcher would (torchrun --max-restarts): when one exits asking to
  // be restarted (or is killed), the others are stopped and all are started again. `fault` is
  // called while they run, with the group's processes, and may kill one. Returns the restarts.
  int Train(
      Run& run, int world, int slow_step_ms = 0,
      const std::function<bool(Run&, std::vector<std::unique_ptr<Process>>&)>& fault = nullptr,
      const std::vector<std::string>& extra_flags = {}) {
    int restarts = 0;
    bool faulted = false;
    while (true) {
      const int master_port = testing::FreeLoopbackPort();
      std::vector<std::unique_ptr<Process>> trainers;
      for (int rank = 0; rank < world; ++rank)
        trainers.push_back(
            StartTrainer(run, rank, world, master_port, slow_step_ms, "ckpt", 1, extra_flags));
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(240);
      bool restart = false;
      while (true) {
        if (fault && !faulted) faulted = fault(run, trainers);
        int done = 0;
        for (size_t rank = 0; rank < trainers.size(); ++rank) {
          const int status = trainers[rank]->Wait(std::chrono::milliseconds(0));
          if (status == 0) ++done;
          if (status > 0) {  // 75, or killed
            restart = true;
            std::printf("rank %zu exited with status %d: restarting the group\n", rank, status);
          }
        }
        if (done == world || restart) break;
        if (std::chrono::steady_clock::now() > give_up) {
          ADD_FAILURE() << "trainers did not finish; rank 0:\n" << trainers[0]->Log();
          return restarts;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      if (!restart) return restarts;
      for (auto& trainer : trainers) trainer->Kill(SIGKILL);  // the launcher stops the group
      for (auto& trainer : trainers) trainer->Wait(std::chrono::seconds(10));
      if (++restarts > 5) {
        ADD_FAILURE() << "too many restarts; rank 0:\n" << trainers[0]->Log();
        return restarts;
      }
    }
  }

  // The final model of a run, as float64 values per tensor name.
  static std::map<std::string, std::vector<double>> FinalModel(const Run& run) {
    char step[32];
    std::snprintf(step, sizeof(step), "step-%08d", kSteps);
    absl::StatusOr<SafetensorsCheckpoint> checkpoint =
        SafetensorsCheckpoint::Open((run.dir / "ckpt" / step / "model").string());
    EXPECT_TRUE(checkpoint.ok()) << checkpoint.status();
    std::map<std::string, std::vector<double>> model;
    if (!checkpoint.ok()) return model;
    for (const std::string& name : checkpoint->names()) {
      const TensorView* view = checkpoint->Find(name);
      EXPECT_EQ(view->dtype, DType::kF64) << name;
      std::vector<double>& values = model[name];
      values.resize(view->numel());
      std::memcpy(values.data(), view->data.data(), view->data.size());
    }
    return model;
  }

  static void ExpectSameModel(const Run& run, const Run& reference) {
    const auto model = FinalModel(run);
    const auto expected = FinalModel(reference);
    ASSERT_EQ(model.size(), expected.size());
    ASSERT_FALSE(model.empty());
    for (const auto& [name, values] : expected) {
      const std::vector<double>& got = model.at(name);
      ASSERT_EQ(got.size(), values.size()) << name;
      double diff = 0, norm = 0;
      for (size_t i = 0; i < values.size(); ++i) {
        diff += (got[i] - values[i]) * (got[i] - values[i]);
        norm += values[i] * values[i];
      }
      EXPECT_LE(std::sqrt(diff), 1e-10 * std::sqrt(norm)) << name;
    }
  }

  // Every rollout was trained exactly once: kSteps x kBatch of them, each in one committed step.
  static void ExpectEveryRolloutTrainedOnce(const Run& run) {
    const std::string log = run.dispatcher->Log();
    int steps = 0;
    for (size_t at = log.find("rollouts, "); at != std::string::npos;
         at = log.find("rollouts, ", at + 1))
      ++steps;
    EXPECT_GE(steps, kSteps) << log;
  }

  fs::path root_;
  // Ranks per simulated node (LOCAL_WORLD_SIZE); 0: all on one node.
  int ranks_per_node_ = 0;
};

// Two ranks train what one trains, with AdamW's state sharded across them (ZeRO-1, the default
// with several ranks: each rank saves its slice into the checkpoints) and replicated.
TEST_F(TrainerDaemonTest, TwoRanksOnGlooTrainLikeOne) {
  Run reference = NewRun("one-rank");
  Send(reference);
  EXPECT_EQ(Train(reference, 1), 0);
  for (const bool sharded : {true, false}) {
    Run two = NewRun(sharded ? "two-ranks-sharded" : "two-ranks-replicated");
    Send(two);
    EXPECT_EQ(
        Train(two, 2, 0, nullptr, {sharded ? "--shard_optimizer=auto" : "--shard_optimizer=false"}),
        0);
    ExpectSameModel(two, reference);
    ExpectEveryRolloutTrainedOnce(two);
    const std::string log = Process::ReadLog(two.dir / "trainer0.log");
    EXPECT_EQ(log.find("optimizer sharded") != std::string::npos, sharded) << log;
    const fs::path last = two.dir / "ckpt" / "step-00000004" / "optimizer";
    EXPECT_EQ(fs::exists(last / "optimizer-00001-of-00002.safetensors"), sharded);
    EXPECT_EQ(fs::exists(last / "optimizer.safetensors"), !sharded);
  }
  // The comparison is not vacuous: every step had a gradient (lr 1e-2 moves the weights far more
  // than the tolerance).
  const std::string log = Process::ReadLog(reference.dir / "trainer0.log");
  int steps_with_gradient = 0;
  for (size_t at = log.find("grad norm "); at != std::string::npos;
       at = log.find("grad norm ", at + 1)) {
    steps_with_gradient += std::stod(log.substr(at + 10)) > 1e-6 ? 1 : 0;
  }
  EXPECT_EQ(steps_with_gradient, kSteps) << log;
}

// Tensor parallelism under the dispatcher: each replica's TP rank 0 registers as one of world / TP
// dispatcher ranks and relays every partition and decision to its TP peer; TP 2 alone and TP 2 x
// DP 2 as two "nodes" of two ranks (optimizer sharded across the replicas) train what one rank
// trains, and every rank saves its own part of the optimizer (tp-RR-of-TT/) beside the gathered
// weights.
TEST_F(TrainerDaemonTest, TensorParallelReplicasTrainLikeOne) {
  Run reference = NewRun("one-rank");
  Send(reference);
  EXPECT_EQ(Train(reference, 1), 0);
  ranks_per_node_ = 2;
  for (const int world : {2, 4}) {
    Run run = NewRun("tp2-world" + std::to_string(world));
    Send(run);
    EXPECT_EQ(Train(run, world, 0, nullptr, {"--tensor_parallel=2"}), 0);
    ExpectSameModel(run, reference);
    ExpectEveryRolloutTrainedOnce(run);
    const std::string leader = Process::ReadLog(run.dir / "trainer0.log");
    EXPECT_NE(leader.find("registered as rank 0 of " + std::to_string(world / 2)),
              std::string::npos)
        << leader;
    const std::string follower = Process::ReadLog(run.dir / "trainer1.log");
    EXPECT_NE(follower.find("follows TP rank 0 of replica 0"), std::string::npos) << follower;
    EXPECT_EQ(follower.find("registered"), std::string::npos) << follower;
    const fs::path last = run.dir / "ckpt" / "step-00000004" / "optimizer";
    for (const char* part : {"tp-00-of-02", "tp-01-of-02"}) {
      EXPECT_EQ(fs::exists(last / part / "optimizer-00001-of-00002.safetensors"), world == 4)
          << part;
      EXPECT_EQ(fs::exists(last / part / "optimizer.safetensors"), world == 2) << part;
    }
  }
}

// Expert parallelism under the dispatcher: a mixture-of-experts model's experts spread over two
// replicas (EP 2 on two ranks, EP 2 x EDP 2 on two "nodes" of two), whose different partitions run
// in lockstep, train what one rank trains, each EP rank saving its experts' optimizer state under
// experts/; a kill -9 of an EP rank mid-step restarts the group from the last checkpoint to the
// same weights.
TEST_F(TrainerDaemonTest, ExpertParallelReplicasTrainLikeOneAndSurviveKillNine) {
  std::ofstream(root_ / "config.json")
      << R"({"model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 16,
      "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
      "tie_word_embeddings": false, "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 8, "norm_topk_prob": true})";
  Run reference = NewRun("one-rank");
  Send(reference);
  EXPECT_EQ(Train(reference, 1), 0);
  ranks_per_node_ = 2;
  for (const int world : {2, 4}) {
    Run run = NewRun("ep2-world" + std::to_string(world));
    Send(run);
    EXPECT_EQ(Train(run, world, 0, nullptr, {"--expert_parallel=2"}), 0);
    ExpectSameModel(run, reference);
    ExpectEveryRolloutTrainedOnce(run);
    const fs::path last = run.dir / "ckpt" / "step-00000004" / "optimizer" / "experts";
    EXPECT_TRUE(fs::is_directory(last / "ep-00-of-02")) << last;
    EXPECT_TRUE(fs::is_directory(last / "ep-01-of-02")) << last;
  }
  Run faulty = NewRun("ep2-kill");
  Send(faulty);
  const int restarts =
      Train(faulty, 2, /*slow_step_ms=*/800, KillDuringStepTwo(1), {"--expert_parallel=2"});
  EXPECT_GE(restarts, 1);
  ExpectSameModel(faulty, reference);
  ExpectEveryRolloutTrainedOnce(faulty);
}

// A kill -9 mid-step under TP 2 x DP 2, of the second replica's TP follower and then of its leader
// (which holds the replica's dispatcher session): the group restarts from the last checkpoint and
// ends with the weights of an uninterrupted run.
TEST_F(TrainerDaemonTest, KillNineUnderTensorAndDataParallelismRetrainsNothingTwice) {
  Run reference = TrainedReference();
  ranks_per_node_ = 2;  // two nodes, one replica each
  for (const int victim : {3, 2}) {
    Run faulty = NewRun("kill-rank" + std::to_string(victim));
    Send(faulty);
    const int restarts =
        Train(faulty, 4, /*slow_step_ms=*/800, KillDuringStepTwo(victim), {"--tensor_parallel=2"});
    EXPECT_GE(restarts, 1) << "rank " << victim;
    ExpectSameModel(faulty, reference);
    ExpectEveryRolloutTrainedOnce(faulty);
  }
}

TEST_F(TrainerDaemonTest, KillNineOfATrainerMidStepRetrainsNothingTwice) {
  Run reference = TrainedReference();
  Run faulty = NewRun("kill-trainer");
  Send(faulty);
  // Kill rank 1 during step 2: after step 1 is logged, while the step sleeps before its all-reduce.
  const int restarts = Train(faulty, 2, /*slow_step_ms=*/800, KillDuringStepTwo(1));
  EXPECT_GE(restarts, 1);
  ExpectSameModel(faulty, reference);
  ExpectEveryRolloutTrainedOnce(faulty);
}

// Waits until `process`'s log holds `line`; false if it exits first or `timeout` passes.
bool WaitForLine(Process& process, const std::string& line, std::chrono::seconds timeout) {
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  while (process.Log().find(line) == std::string::npos) {
    if (process.Wait(std::chrono::milliseconds(50)) != -1 ||
        std::chrono::steady_clock::now() > give_up) {
      return process.Log().find(line) != std::string::npos;
    }
  }
  return true;
}

// After a launcher restart the dispatcher may still list a dead rank of the last attempt (here:
// a rank 0 that registered and was killed before its rank 1 started). The next attempt's rank 1
// registers first, beside the dead rank 0, into a generation that the live rank 0's registration
// then ends. The ranks agree on one generation before the first step (each registers again), so
// the group trains without a restart, exactly what one trainer trains.
TEST_F(TrainerDaemonTest, ARankRegisteringBesideADeadRankOfTheLastAttemptTrainsWithTheGroup) {
  Run reference = TrainedReference();
  Run run = NewRun("dead-rank-listed");
  Send(run);
  {
    std::unique_ptr<Process> dead = StartTrainer(run, 0, 2, testing::FreeLoopbackPort(), 0);
    ASSERT_TRUE(WaitForLine(*dead, "registered as rank 0 of 2", std::chrono::seconds(60)))
        << dead->Log();
    dead->Kill(SIGKILL);
    dead->Wait(std::chrono::seconds(10));
  }
  const int master_port = testing::FreeLoopbackPort();
  std::unique_ptr<Process> rank1 = StartTrainer(run, 1, 2, master_port, 0);
  ASSERT_TRUE(WaitForLine(*rank1, "registered as rank 1 of 2", std::chrono::seconds(60)))
      << rank1->Log();
  std::unique_ptr<Process> rank0 = StartTrainer(run, 0, 2, master_port, 0);
  EXPECT_EQ(rank1->Wait(std::chrono::seconds(120)), 0) << rank1->Log();
  EXPECT_EQ(rank0->Wait(std::chrono::seconds(120)), 0) << rank0->Log();
  EXPECT_NE(rank1->Log().find("registered into different generations: again"), std::string::npos)
      << "the race this test is about did not happen:\n"
      << rank1->Log();
  ExpectSameModel(run, reference);
  ExpectEveryRolloutTrainedOnce(run);
}

// The pid of `rank`'s process in the launcher's attempt `attempt`, from its "started" line.
std::optional<pid_t> TrainerPid(const std::string& log, int rank, int world, int attempt) {
  const std::string prefix =
      "dta-trainer rank " + std::to_string(rank) + "/" + std::to_string(world) + ": started, pid ";
  for (size_t at = log.find(prefix); at != std::string::npos; at = log.find(prefix, at + 1)) {
    int pid = 0, seen_attempt = -1;
    if (std::sscanf(log.c_str() + at + prefix.size(), "%d, attempt %d", &pid, &seen_attempt) == 2 &&
        seen_attempt == attempt)
      return pid;
  }
  return std::nullopt;
}

// torchrun itself (elastic, --max_restarts=3) restarts the group after each of three kill -9s in a
// row: a rank mid-step, the other rank just after it registered, a rank mid-step again. Each
// attempt re-forms the group through the agent's store (which keeps the killed attempt's keys) and
// the run ends with the weights of an uninterrupted one.
TEST_F(TrainerDaemonTest, TorchrunRestartsTheGroupAfterThreeKillsInARow) {
  Run reference = TrainedReference();
  Run faulty = NewRun("torchrun");
  Send(faulty);
  std::vector<std::string> command = {
      DTA_PYTHON,
      "-m",
      "torch.distributed.run",
      "--no-python",
      "--nproc_per_node=2",
      "--max_restarts=3",
      "--master_port=" + std::to_string(testing::FreeLoopbackPort())};
  for (const std::string& arg : TrainerCommand(faulty, /*slow_step_ms=*/800))
    command.push_back(arg);
  Process torchrun(command, (faulty.dir / "torchrun.log").string());

  // Each kill: {attempt, rank, what that attempt's log must show after its start first}.
  struct Kill {
    int attempt;
    int rank;
    std::string after;
  };
  const std::vector<Kill> kills = {
      {0, 1, "rank 1/2: step 1:"}, {1, 0, "rank 0/2: registered"}, {2, 1, "rank 1/2: step 2:"}};
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(300);
  size_t next = 0;
  int status = -1;
  while ((status = torchrun.Wait(std::chrono::milliseconds(50))) == -1) {
    if (std::chrono::steady_clock::now() > give_up) {
      torchrun.Kill(SIGTERM);  // torchrun stops its workers
      torchrun.Wait(std::chrono::seconds(30));
      FAIL() << "torchrun did not finish; kills done: " << next << "\n" << torchrun.Log();
    }
    if (next == kills.size()) continue;
    const Kill& fault = kills[next];
    const std::string log = torchrun.Log();
    const std::optional<pid_t> pid = TrainerPid(log, fault.rank, 2, fault.attempt);
    if (!pid) continue;
    const size_t started = log.find("pid " + std::to_string(*pid) + ",");
    if (log.find(fault.after, started) == std::string::npos) continue;
    // Mid-step: the step sleeps 800 ms before its all-reduce.
    if (fault.after.find("step") != std::string::npos)
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ::kill(*pid, SIGKILL);
    ++next;
  }
  ASSERT_EQ(status, 0) << torchrun.Log();
  EXPECT_EQ(next, kills.size()) << torchrun.Log();
  EXPECT_TRUE(TrainerPid(torchrun.Log(), 0, 2, 3).has_value()) << torchrun.Log();
  ExpectSameModel(faulty, reference);
  ExpectEveryRolloutTrainedOnce(faulty);
}

TEST_F(TrainerDaemonTest, KillNineOfTheDispatcherLosesAndRepeatsNothing) {
  Run reference = TrainedReference();
  // Its log is compacted whenever half of it is dead (after every released step, and when it
  // starts), so the restarts replay compacted logs.
  Run faulty = NewRun("kill-dispatcher", {"--wal_compact_mb=1e-6"});
  Send(faulty);
  // Between acknowledgements: kill and restart it, then send everything again (resends of what was
  // acknowledged are recognised).
  faulty.dispatcher->Kill(SIGKILL);
  faulty.dispatcher->Wait(std::chrono::seconds(10));
  StartDispatcher(faulty);
  Send(faulty);
  EXPECT_NE(faulty.dispatcher->Log().find("24 trajectories pending"), std::string::npos)
      << faulty.dispatcher->Log();
  // And during training, after step 1 was committed.
  Train(faulty, 2, /*slow_step_ms=*/300,
        [](Run& run, std::vector<std::unique_ptr<Process>>& trainers) {
          if (trainers[0]->Log().find("step 1:") == std::string::npos) return false;
          run.dispatcher->Kill(SIGKILL);
          run.dispatcher->Wait(std::chrono::seconds(10));
          StartDispatcher(run);
          return true;
        });
  ExpectSameModel(faulty, reference);
  ExpectEveryRolloutTrainedOnce(faulty);
  EXPECT_NE(faulty.dispatcher->Log().find("log compacted"), std::string::npos)
      << faulty.dispatcher->Log();
}

// A trainer whose loss needs what the dispatcher does not require (here reference log-probabilities
// for a KL penalty) is refused when it registers and exits 2 naming the dispatcher flag, before any
// batch could fail on every retry.
TEST_F(TrainerDaemonTest, ATrainerThatCannotTrainWhatIsAcceptedIsRefused) {
  Run run = NewRun("refused");
  std::unique_ptr<Process> trainer =
      StartTrainer(run, 0, 1, testing::FreeLoopbackPort(), 0, "ckpt", 1, {"--kl_coef=0.1"});
  EXPECT_EQ(trainer->Wait(std::chrono::seconds(60)), 2) << trainer->Log();
  EXPECT_NE(trainer->Log().find("start dta-dispatcher with --require_ref_logprobs"),
            std::string::npos)
      << trainer->Log();
}

// A trainer must present the trainer credential: without it (or with another) it is refused at
// registration, exits 2 naming the flag, and nothing is trained.
TEST_F(TrainerDaemonTest, ATrainerWithoutTheTrainerTokenIsRefused) {
  Run run = NewRun("no_token");
  std::ofstream(root_ / "other.token") << "not-the-trainer-secret\n";
  fs::permissions(root_ / "other.token", fs::perms::owner_read | fs::perms::owner_write);
  for (const std::string& token : {std::string(""), (root_ / "other.token").string()}) {
    std::unique_ptr<Process> trainer = StartTrainer(run, 0, 1, testing::FreeLoopbackPort(), 0,
                                                    "ckpt", 1, {"--token_file=" + token});
    EXPECT_EQ(trainer->Wait(std::chrono::seconds(60)), 2) << trainer->Log();
    EXPECT_THAT(trainer->Log(), ::testing::HasSubstr("needs the trainer credential"));
    if (token.empty()) {
      EXPECT_THAT(trainer->Log(), ::testing::HasSubstr("pass --token_file"));
    }
  }
  EXPECT_FALSE(fs::exists(run.dir / "ckpt" / "latest.json"));
}

// Files of the trainer's that another local user could plant or read: a token file open to group
// or others (0644 and 0640 alike), and a checkpoint directory others can write or that another user
// created, are refused before anything is read from them or trained (exit 2, naming the file and
// its mode or owner).
TEST_F(TrainerDaemonTest, LooseCredentialsAndForeignCheckpointDirectoriesAreRefused) {
  Run run = NewRun("loose_files");
  for (const fs::perms mode : {fs::perms::group_read, fs::perms::others_read}) {
    const fs::path token = run.dir / "loose.token";
    std::ofstream(token) << "trainer-secret\n";
    fs::permissions(token, fs::perms::owner_read | fs::perms::owner_write | mode);
    std::unique_ptr<Process> trainer = StartTrainer(run, 0, 1, testing::FreeLoopbackPort(), 0,
                                                    "ckpt", 1, {"--token_file=" + token.string()});
    EXPECT_EQ(trainer->Wait(std::chrono::seconds(60)), 2) << trainer->Log();
    EXPECT_THAT(trainer->Log(), ::testing::AllOf(::testing::HasSubstr("--token_file: "),
                                                 ::testing::HasSubstr(token.string()),
                                                 ::testing::HasSubstr("open to group or others")));
  }
  fs::create_directories(run.dir / "shared");
  fs::permissions(run.dir / "shared", fs::perms::all);
  std::unique_ptr<Process> shared =
      StartTrainer(run, 0, 1, testing::FreeLoopbackPort(), 0, "shared");
  EXPECT_EQ(shared->Wait(std::chrono::seconds(60)), 2) << shared->Log();
  EXPECT_THAT(shared->Log(), ::testing::AllOf(::testing::HasSubstr("--checkpoint_dir: "),
                                              ::testing::HasSubstr("writable by group or others"),
                                              ::testing::HasSubstr("mode 0777")));
  if (geteuid() == 0) {  // a directory another user made first (root can make one to test with)
    fs::create_directories(run.dir / "planted");
    ASSERT_EQ(chown((run.dir / "planted").c_str(), 65534, 65534), 0);
    std::unique_ptr<Process> planted =
        StartTrainer(run, 0, 1, testing::FreeLoopbackPort(), 0, "planted");
    EXPECT_EQ(planted->Wait(std::chrono::seconds(60)), 2) << planted->Log();
    EXPECT_THAT(planted->Log(), ::testing::HasSubstr("is owned by uid 65534"));
  }
  for (const char* name : {"ckpt", "shared", "planted"}) {  // nothing trained, nothing published
    EXPECT_FALSE(fs::exists(run.dir / name / "latest.json"));
  }
}

// A checkpoint that cannot be written (a file-size limit here; a full disk fails the same way) ends
// the trainer with status 1 and a message naming the file and the reason, instead of a silent kill
// by SIGXFSZ; a restart on the still-limited disk says the same again.
TEST_F(TrainerDaemonTest, ACheckpointThatCannotBeWrittenIsReported) {
  Run run = NewRun("file_size_limit");
  Send(run);
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::vector<std::string> command = {"/usr/bin/prlimit", "--fsize=16384", "--"};
    for (const std::string& arg : TrainerCommand(run, 0)) command.push_back(arg);
    Process trainer(command, (run.dir / ("trainer-" + std::to_string(attempt) + ".log")).string());
    EXPECT_EQ(trainer.Wait(std::chrono::seconds(120)), 1) << trainer.Log();
    EXPECT_THAT(trainer.Log(), ::testing::AllOf(::testing::HasSubstr("File too large"),
                                                ::testing::HasSubstr((run.dir / "ckpt").string())));
  }
  EXPECT_FALSE(fs::exists(run.dir / "ckpt" / "latest.json"));
}

// --metrics_listen and --tensorboard_dir on the trainer: a scrape mid-run shows the rank's running
// totals and last step (RL diagnostics included); the rank's event file holds one event per step.
TEST_F(TrainerDaemonTest, TheTrainerServesMetricsAndWritesEventFiles) {
  Run run = NewRun("metrics");
  Send(run);
  const fs::path board = run.dir / "board";
  std::unique_ptr<Process> trainer =
      StartTrainer(run, 0, 1, testing::FreeLoopbackPort(), /*slow_step_ms=*/400, "ckpt", 1,
                   {"--metrics_listen=127.0.0.1:0", "--tensorboard_dir=" + board.string()});
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (trainer->Log().find("step 1:") == std::string::npos) {
    ASSERT_LT(std::chrono::steady_clock::now(), give_up) << trainer->Log();
    ASSERT_EQ(trainer->Wait(std::chrono::milliseconds(20)), -1) << trainer->Log();
  }
  const std::string log = trainer->Log();
  const size_t at = log.find("metrics on http://");
  ASSERT_NE(at, std::string::npos) << log;
  const std::string url = log.substr(at + 11, log.find('\n', at) - at - 11);
  const auto [status, body] = testing::HttpGet(url);
  ASSERT_EQ(status, 200) << url;
  EXPECT_THAT(body, ::testing::HasSubstr("# TYPE dta_trainer_steps_total counter\n"));
  EXPECT_THAT(body, ::testing::ContainsRegex("dta_trainer_steps_total\\{rank=\"0\"\\} [234]\n"));
  for (const char* gauge :
       {"dta_trainer_loss{rank=\"0\"}", "dta_trainer_grad_norm{rank=\"0\"}",
        "dta_trainer_rl_clip_fraction{rank=\"0\"}", "dta_trainer_attempt{rank=\"0\"} 0\n"}) {
    EXPECT_THAT(body, ::testing::HasSubstr(gauge));
  }
  ASSERT_EQ(trainer->Wait(std::chrono::seconds(120)), 0) << trainer->Log();
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(board / "rank-0")) files.push_back(entry.path());
  ASSERT_EQ(files.size(), 1u);
  const std::vector<std::string> records = testing::EventRecords(files[0].string());
  ASSERT_EQ(records.size(), 1u + kSteps);  // the version, then one event per step
  for (const char* tag : {"loss", "grad_norm", "rollout_tokens_per_second", "rl/approx_kl"})
    EXPECT_NE(records.back().find(tag), std::string::npos) << tag;
}

// An engine that accepts reload requests and never answers (here: a socket that listens and never
// accepts) must not hold the trainer: its steps keep their pace, and after the last one it exits 0
// within one --notify_timeout_s, saying which reload it gave up on (it used to wait forever).
TEST_F(TrainerDaemonTest, AHungEngineNeverHoldsTheTrainer) {
  const int hung = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(hung, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  ASSERT_EQ(bind(hung, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(listen(hung, 64), 0);
  ASSERT_EQ(getsockname(hung, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const std::string engine = "sglang=http://127.0.0.1:" + std::to_string(ntohs(address.sin_port));

  Run run = NewRun("hung_engine");
  Send(run);
  constexpr int kNotifyTimeoutS = 3;
  std::unique_ptr<Process> trainer = StartTrainer(
      run, 0, 1, testing::FreeLoopbackPort(), 0, "ckpt", 1,
      {"--notify_engines=" + engine, "--notify_timeout_s=" + std::to_string(kNotifyTimeoutS),
       "--notify_attempts=3"});
  using Clock = std::chrono::steady_clock;
  const auto give_up = Clock::now() + std::chrono::seconds(120);
  auto wait_for = [&](const std::string& line) {
    while (trainer->Log().find(line) == std::string::npos) {
      if (Clock::now() > give_up || trainer->Wait(std::chrono::milliseconds(20)) != -1) break;
    }
    return Clock::now();
  };
  const Clock::time_point first = wait_for("step 1:");
  const Clock::time_point last = wait_for("step " + std::to_string(kSteps) + ":");
  const int status = trainer->Wait(std::chrono::seconds(60));
  const double exit_seconds = std::chrono::duration<double>(Clock::now() - last).count();
  close(hung);
  ASSERT_EQ(status, 0) << trainer->Log();
  // Every step publishes a checkpoint the hung engine never loads: none of them waits for it.
  EXPECT_LT(std::chrono::duration<double>(last - first).count(), kNotifyTimeoutS * (kSteps - 1))
      << trainer->Log();
  // At most one bounded attempt at exit (it used to retry the hung request --notify_attempts
  // times).
  EXPECT_LT(exit_seconds, 2 * kNotifyTimeoutS + 2) << trainer->Log();
  EXPECT_THAT(trainer->Log(), ::testing::HasSubstr("gave up at shutdown on telling the sglang "
                                                   "engine at http://127.0.0.1:"));
  EXPECT_TRUE(fs::exists(run.dir / "ckpt" / "latest.json"));
}

// Ranks that load different checkpoints (one sees a shared directory late) must not train together:
// both notice and ask to be restarted, before any step.
// SIGUSR1 asks rank 0 for a checkpoint between --save_every's: it saves one after the step in
// progress commits, and trains on.
TEST_F(TrainerDaemonTest, SigusrOneSavesACheckpointOnRequest) {
  Run run = NewRun("on_request");
  Send(run);
  std::unique_ptr<Process> trainer = StartTrainer(
      run, 0, 1, testing::FreeLoopbackPort(), /*slow_step_ms=*/400, "ckpt", /*save_every=*/1000);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (trainer->Log().find("step 0:") == std::string::npos &&
         std::chrono::steady_clock::now() < give_up) {
    ASSERT_EQ(trainer->Wait(std::chrono::milliseconds(20)), -1) << trainer->Log();
  }
  trainer->Kill(SIGUSR1);
  ASSERT_EQ(trainer->Wait(std::chrono::seconds(120)), 0) << trainer->Log();
  EXPECT_NE(trainer->Log().find("as requested"), std::string::npos) << trainer->Log();
  // The requested checkpoint (after step 1, 2 or 3, as the signal met the steps) and the last one.
  std::vector<std::string> saved;
  for (const auto& entry : fs::directory_iterator(run.dir / "ckpt")) {
    if (entry.is_directory()) saved.push_back(entry.path().filename().string());
  }
  std::sort(saved.begin(), saved.end());
  ASSERT_EQ(saved.size(), 2u) << trainer->Log();
  EXPECT_LT(saved[0], "step-00000004");
  EXPECT_EQ(saved[1], "step-00000004");
}

TEST_F(TrainerDaemonTest, RanksResumingFromDifferentCheckpointsRestart) {
  Run run = NewRun("mismatch");
  Send(run);
  EXPECT_EQ(Train(run, 1), 0);  // leaves checkpoints of steps 3 and 4 in ckpt/
  fs::create_directories(run.dir / "empty");
  const int master_port = testing::FreeLoopbackPort();
  std::unique_ptr<Process> ahead = StartTrainer(run, 0, 2, master_port, 0, "ckpt");
  std::unique_ptr<Process> behind = StartTrainer(run, 1, 2, master_port, 0, "empty");
  EXPECT_EQ(ahead->Wait(std::chrono::seconds(60)), kRestarted) << ahead->Log();
  EXPECT_EQ(behind->Wait(std::chrono::seconds(60)), kRestarted) << behind->Log();
  EXPECT_NE(ahead->Log().find("resumed from different checkpoints"), std::string::npos)
      << ahead->Log();
}

}  // namespace
}  // namespace dta

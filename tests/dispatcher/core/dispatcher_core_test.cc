#include "dispatcher/core/dispatcher_core.h"

#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dispatcher/wire/trajectory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;

v1::Trajectory Make(int i, int32_t version = -1) {
  v1::Trajectory t;
  t.set_id("t" + std::to_string(i));
  t.set_group_id("g" + std::to_string(i % 3));
  // A shared prompt and a few branches, so the split has something to share.
  for (int32_t token : {1, 2, 3, 4 + i % 4, 10 + i}) t.add_tokens(token);
  for (int k = 0; k < 5; ++k) t.add_loss_mask(k >= 3);
  for (int k = 0; k < 5; ++k) t.add_logprobs(-0.5f * k);
  for (int k = 0; k < 5; ++k) t.add_versions(k >= 3 ? version : -1);
  t.set_reward(0.1 * i);
  (*t.mutable_metadata())["source"] = "test";
  return t;
}

class DispatcherCoreTest : public ::testing::Test {
 protected:
  DispatcherCoreTest() {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           (std::string("dispatcher_core_") +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  ~DispatcherCoreTest() override { std::filesystem::remove_all(dir_); }

  DispatcherOptions Options(int64_t batch = 4) {
    DispatcherOptions options;
    options.wal_path = (dir_ / "log.wal").string();
    options.wal_sync = false;
    options.limits.vocab_size = 100;
    options.batch = {.rollouts = batch};
    options.log = [this](const std::string& line) { log_.push_back(line); };
    return options;
  }

  std::unique_ptr<DispatcherCore> Open(const DispatcherOptions& options) {
    absl::StatusOr<std::unique_ptr<DispatcherCore>> core = DispatcherCore::Open(options);
    EXPECT_TRUE(core.ok()) << core.status();
    return core.ok() ? *std::move(core) : nullptr;
  }

  static void Accept(DispatcherCore& core, const v1::Trajectory& t) {
    absl::StatusOr<v1::IngestResponse> response = core.Ingest(t);
    ASSERT_TRUE(response.ok()) << response.status();
    ASSERT_EQ(response->outcome(), v1::IngestResponse::ACCEPTED) << response->reason();
  }

  static int64_t Register(DispatcherCore& core, int rank, int world, const std::string& id,
                          int64_t resume = 0) {
    v1::RegisterTrainerRequest request;
    request.set_rank(rank);
    request.set_world_size(world);
    request.set_trainer_id(id);
    request.set_resume_step(resume);
    absl::StatusOr<v1::RegisterTrainerResponse> response = core.RegisterTrainer(request);
    EXPECT_TRUE(response.ok()) << response.status();
    return response.ok() ? response->generation() : -1;
  }

  static absl::StatusOr<v1::Partition> Fetch(DispatcherCore& core, int rank, int64_t step,
                                             int64_t generation) {
    v1::FetchPartitionRequest request;
    request.set_rank(rank);
    request.set_step(step);
    request.set_generation(generation);
    return core.FetchPartition(request);
  }

  static v1::ReportStepResponse::Decision Report(
      DispatcherCore& core, int rank, int64_t step, int64_t generation,
      v1::StepReport::Phase phase = v1::StepReport::PREPARED, int64_t checkpoint = 0) {
    v1::StepReport report;
    report.set_rank(rank);
    report.set_step(step);
    report.set_generation(generation);
    report.set_phase(phase);
    report.set_loss(0.25);
    report.set_seconds(0.5);
    report.set_checkpoint_step(checkpoint);
    absl::StatusOr<v1::ReportStepResponse> response = core.ReportStep(report);
    EXPECT_TRUE(response.ok()) << response.status();
    return response.ok() ? response->decision() : v1::ReportStepResponse::DECISION_UNSPECIFIED;
  }

  // The ids of every rank's partition of `step`, in rank order.
  static std::vector<std::string> FetchAll(DispatcherCore& core, int world, int64_t step,
                                           int64_t generation, bool* replay = nullptr) {
    std::vector<std::string> ids;
    for (int rank = 0; rank < world; ++rank) {
      absl::StatusOr<v1::Partition> partition = Fetch(core, rank, step, generation);
      EXPECT_TRUE(partition.ok()) << partition.status();
      if (!partition.ok()) return ids;
      if (replay != nullptr) *replay = partition->replay();
      for (const v1::Trajectory& t : partition->trajectories()) ids.push_back(t.id());
    }
    return ids;
  }

  static void CommitStep(DispatcherCore& core, int world, int64_t step, int64_t generation) {
    for (int rank = 0; rank < world; ++rank) {
      EXPECT_EQ(Report(core, rank, step, generation), rank + 1 < world
                                                          ? v1::ReportStepResponse::PENDING
                                                          : v1::ReportStepResponse::COMMIT);
    }
    for (int rank = 0; rank < world; ++rank) {
      EXPECT_EQ(Report(core, rank, step, generation), v1::ReportStepResponse::COMMIT);
    }
  }

  std::filesystem::path dir_;
  std::vector<std::string> log_;
};

TEST_F(DispatcherCoreTest, AcceptsRejectsAndDeduplicates) {
  auto core = Open(Options());
  Accept(*core, Make(0));
  absl::StatusOr<v1::IngestResponse> again = core->Ingest(Make(0));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->outcome(), v1::IngestResponse::ACCEPTED);
  EXPECT_TRUE(again->already_accepted());
  v1::Trajectory other = Make(0);
  other.set_reward(7);
  absl::StatusOr<v1::IngestResponse> conflict = core->Ingest(other);
  ASSERT_TRUE(conflict.ok());
  EXPECT_EQ(conflict->outcome(), v1::IngestResponse::REJECTED);
  EXPECT_EQ(conflict->field(), "id");
  v1::Trajectory bad = Make(1);
  bad.set_tokens(4, 100);
  absl::StatusOr<v1::IngestResponse> rejected = core->Ingest(bad);
  ASSERT_TRUE(rejected.ok());
  EXPECT_EQ(rejected->outcome(), v1::IngestResponse::REJECTED);
  EXPECT_EQ(rejected->field(), "tokens");
  EXPECT_THAT(rejected->reason(), HasSubstr("token 4 = 100"));
  const v1::GetStatisticsResponse stats = core->GetStatistics();
  EXPECT_EQ(stats.accepted(), 1);
  EXPECT_EQ(stats.already_accepted(), 1);
  EXPECT_EQ(stats.rejected(), 2);
  EXPECT_EQ(stats.rejected_by_field().at("tokens"), 1);
  EXPECT_EQ(stats.rejected_by_field().at("id"), 1);
  EXPECT_EQ(core->GetStatus().pending_trajectories(), 1);
}

TEST_F(DispatcherCoreTest, TwoRanksTrainEachBatchOnceWithWholeBatchAdvantages) {
  auto core = Open(Options(/*batch=*/5));
  for (int i = 0; i < 12; ++i) Accept(*core, Make(i));
  const int64_t generation = Register(*core, 0, 2, "a");
  // Incomplete generation: wait.
  EXPECT_EQ(Fetch(*core, 0, 0, generation).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Register(*core, 1, 2, "b"), generation);
  std::set<std::string> trained;
  for (int64_t step = 0; step < 2; ++step) {
    absl::StatusOr<v1::Partition> p0 = Fetch(*core, 0, step, generation);
    absl::StatusOr<v1::Partition> p1 = Fetch(*core, 1, step, generation);
    ASSERT_TRUE(p0.ok() && p1.ok());
    EXPECT_EQ(p0->num_rollouts(), 5);
    EXPECT_EQ(p0->total_loss_tokens(), 10);  // 2 trained tokens x 5
    EXPECT_EQ(p0->policy_version(), step);
    EXPECT_EQ(p0->trajectories_size() + p1->trajectories_size(), 5);
    for (const v1::Partition* p : {&*p0, &*p1}) {
      for (const v1::Trajectory& t : p->trajectories()) {
        EXPECT_TRUE(trained.insert(t.id()).second) << t.id() << " trained twice";
        EXPECT_EQ(t.advantages_size(), t.tokens_size());  // computed over the whole batch
        EXPECT_EQ(t.metadata().at("source"), "test");
      }
    }
    CommitStep(*core, 2, step, generation);
  }
  // Two steps took the 10 oldest; 2 wait; the third batch is not ready.
  EXPECT_EQ(trained.size(), 10u);
  EXPECT_FALSE(trained.contains("t10"));
  EXPECT_THAT(std::string(Fetch(*core, 0, 2, generation).status().message()),
              HasSubstr("waiting for trajectories"));
  EXPECT_EQ(core->GetStatus().committed_steps(), 2);
  EXPECT_EQ(core->GetStatus().policy_version(), 2);
  const v1::GetStatisticsResponse stats = core->GetStatistics();
  EXPECT_EQ(stats.trained_rollouts(), 10);
  ASSERT_EQ(stats.recent_steps_size(), 2);
  EXPECT_EQ(stats.recent_steps(1).rollouts(), 5);
  EXPECT_DOUBLE_EQ(stats.recent_steps(1).loss(), 0.5);
  EXPECT_GT(stats.recent_steps(1).compression(), 1.0);
  EXPECT_THAT(log_.back(), HasSubstr("step 1: 5 rollouts"));
}

// The dispatcher dies with a step fetched but not committed: after a restart the step has the
// same batch, the acknowledged trajectories are all there, and the old generation is refused.
TEST_F(DispatcherCoreTest, RestartKeepsEveryAcknowledgedTrajectoryAndThePlannedBatch) {
  std::vector<std::string> first_batch;
  int64_t old_generation = 0;
  {
    auto core = Open(Options(3));
    for (int i = 0; i < 7; ++i) Accept(*core, Make(i));
    old_generation = Register(*core, 0, 1, "a");
    FetchAll(*core, 1, 0, old_generation);
    CommitStep(*core, 1, 0, old_generation);
    first_batch = FetchAll(*core, 1, 1, old_generation);  // step 1 planned, never committed
  }
  auto core = Open(Options(3));
  EXPECT_EQ(core->GetStatus().committed_steps(), 1);
  EXPECT_EQ(core->GetStatus().pending_trajectories(), 1);  // 7 - 3 committed - 3 planned
  EXPECT_EQ(Report(*core, 0, 1, old_generation), v1::ReportStepResponse::ABORT);
  EXPECT_EQ(Fetch(*core, 0, 1, old_generation).status().code(), absl::StatusCode::kAborted);
  const int64_t generation = Register(*core, 0, 1, "a2", /*resume=*/1);
  EXPECT_NE(generation, old_generation);
  EXPECT_EQ(FetchAll(*core, 1, 1, generation), first_batch);
  CommitStep(*core, 1, 1, generation);
  // Identical resends are acknowledged without being stored twice, also after training.
  absl::StatusOr<v1::IngestResponse> resend = core->Ingest(Make(0));
  ASSERT_TRUE(resend.ok());
  EXPECT_TRUE(resend->already_accepted());
  EXPECT_EQ(core->GetStatistics().trained_rollouts(), 6);
}

// A rank fails mid-step: every rank is told ABORT, and the step is served again, re-split over the
// trainers present (here one), with exactly the same batch.
TEST_F(DispatcherCoreTest, FailedRankAbandonsTheStepEverywhereAndItIsResplit) {
  auto core = Open(Options(6));
  for (int i = 0; i < 6; ++i) Accept(*core, Make(i));
  const int64_t g2 = Register(*core, 0, 2, "a");
  Register(*core, 1, 2, "b");
  std::vector<std::string> batch = FetchAll(*core, 2, 0, g2);
  EXPECT_EQ(Report(*core, 0, 0, g2), v1::ReportStepResponse::PENDING);
  EXPECT_EQ(Report(*core, 1, 0, g2, v1::StepReport::FAILED), v1::ReportStepResponse::ABORT);
  EXPECT_EQ(Report(*core, 0, 0, g2), v1::ReportStepResponse::ABORT);  // rank 0 must not step
  EXPECT_EQ(core->GetStatus().committed_steps(), 0);
  const int64_t g1 = Register(*core, 0, 1, "a");
  EXPECT_NE(g1, g2);
  std::vector<std::string> again = FetchAll(*core, 1, 0, g1);
  std::sort(batch.begin(), batch.end());
  std::sort(again.begin(), again.end());
  EXPECT_EQ(again, batch);
  CommitStep(*core, 1, 0, g1);
  EXPECT_EQ(core->GetStatistics().aborted_steps(), 1);
}

// A rank that neither prepares nor fails (hung, or cut off) while the others have prepared: after
// prepare_timeout the step is abandoned for everyone and served again to the trainers that
// register.
TEST_F(DispatcherCoreTest, ARankThatNeverReportsIsAbandonedAfterThePrepareTimeout) {
  DispatcherOptions options = Options(6);
  options.prepare_timeout = absl::Seconds(2);
  auto core = Open(options);
  for (int i = 0; i < 6; ++i) Accept(*core, Make(i));
  const int64_t g2 = Register(*core, 0, 2, "a");
  Register(*core, 1, 2, "b");
  std::vector<std::string> batch = FetchAll(*core, 2, 0, g2);
  const absl::Time first = absl::Now();
  EXPECT_EQ(Report(*core, 0, 0, g2), v1::ReportStepResponse::PENDING);
  // Asking again does not restart the clock.
  while (absl::Now() - first < absl::Seconds(1)) {
    EXPECT_EQ(Report(*core, 0, 0, g2), v1::ReportStepResponse::PENDING);
    absl::SleepFor(absl::Milliseconds(100));
  }
  absl::SleepFor(first + absl::Milliseconds(2100) - absl::Now());
  EXPECT_EQ(Report(*core, 0, 0, g2), v1::ReportStepResponse::ABORT);
  EXPECT_THAT(log_, Contains(HasSubstr("step 0 abandoned: rank 1 did not report within 2s")));
  EXPECT_EQ(Report(*core, 1, 0, g2), v1::ReportStepResponse::ABORT);  // the late rank must not step
  EXPECT_EQ(core->GetStatistics().aborted_steps(), 1);
  const int64_t g = Register(*core, 0, 2, "a2");
  Register(*core, 1, 2, "b2");
  std::vector<std::string> again = FetchAll(*core, 2, 0, g);
  EXPECT_EQ(again, batch);
  CommitStep(*core, 2, 0, g);
  EXPECT_EQ(core->GetStatus().committed_steps(), 1);
}

// A trainer group restarted from a checkpoint replays the committed steps in order, then goes on.
TEST_F(DispatcherCoreTest, TrainersResumingFromACheckpointReplayCommittedSteps) {
  auto core = Open(Options(2));
  for (int i = 0; i < 6; ++i) Accept(*core, Make(i));
  int64_t generation = Register(*core, 0, 1, "a");
  std::vector<std::vector<std::string>> batches;
  for (int64_t step = 0; step < 2; ++step) {
    batches.push_back(FetchAll(*core, 1, step, generation));
    CommitStep(*core, 1, step, generation);
  }
  generation = Register(*core, 0, 1, "a-restarted", /*resume=*/0);
  for (int64_t step = 0; step < 2; ++step) {
    bool replay = false;
    EXPECT_EQ(FetchAll(*core, 1, step, generation, &replay), batches[step]);
    EXPECT_TRUE(replay);
    EXPECT_EQ(Report(*core, 0, step, generation), v1::ReportStepResponse::COMMIT);
  }
  bool replay = true;
  EXPECT_EQ(FetchAll(*core, 1, 2, generation, &replay).size(), 2u);
  EXPECT_FALSE(replay);
  EXPECT_EQ(core->GetStatus().committed_steps(), 2);
  // Resuming past the committed steps is impossible.
  v1::RegisterTrainerRequest ahead;
  ahead.set_world_size(1);
  ahead.set_trainer_id("x");
  ahead.set_resume_step(5);
  EXPECT_EQ(core->RegisterTrainer(ahead).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(DispatcherCoreTest, CheckpointsReleaseStepsForReplay) {
  auto core = Open(Options(2));
  for (int i = 0; i < 6; ++i) Accept(*core, Make(i));
  const int64_t generation = Register(*core, 0, 1, "a");
  FetchAll(*core, 1, 0, generation);
  CommitStep(*core, 1, 0, generation);
  FetchAll(*core, 1, 1, generation);
  EXPECT_EQ(Report(*core, 0, 1, generation, v1::StepReport::PREPARED, /*checkpoint=*/1),
            v1::ReportStepResponse::COMMIT);
  EXPECT_EQ(Fetch(*core, 0, 0, generation).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Fetch(*core, 0, 1, generation).ok());
  // The release is durable.
  core.reset();
  core = Open(Options(2));
  const int64_t g = Register(*core, 0, 1, "b", 1);
  EXPECT_EQ(Fetch(*core, 0, 0, g).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(FetchAll(*core, 1, 1, g).size(), 2u);
}

TEST_F(DispatcherCoreTest, StaleTrajectoriesAreDroppedAndCounted) {
  DispatcherOptions options = Options(2);
  options.batch.max_staleness = 1;
  options.initial_policy_version = 5;
  auto core = Open(options);
  Accept(*core, Make(0, /*version=*/3));  // lag 2 at version 5: stale
  Accept(*core, Make(1, 4));
  Accept(*core, Make(2, 5));
  const int64_t generation = Register(*core, 0, 1, "a");
  std::vector<std::string> batch = FetchAll(*core, 1, 0, generation);
  EXPECT_EQ(batch, (std::vector<std::string>{"t1", "t2"}));
  EXPECT_EQ(core->GetStatistics().dropped_stale(), 1);
  EXPECT_THAT(log_.back(), HasSubstr("dropped 1 trajectories"));
  CommitStep(*core, 1, 0, generation);
  EXPECT_EQ(core->GetStatistics().recent_steps(0).dropped_stale(), 1);
}

TEST_F(DispatcherCoreTest, BackpressureBoundsPendingTrajectories) {
  DispatcherOptions options = Options(2);
  options.max_pending_trajectories = 3;
  auto core = Open(options);
  for (int i = 0; i < 3; ++i) Accept(*core, Make(i));
  EXPECT_FALSE(core->HasRoom());
  EXPECT_FALSE(core->AwaitRoom(absl::Now() + absl::Milliseconds(10)));
  std::atomic<bool> room{false};
  std::thread waiter([&] { room = core->AwaitRoom(absl::Now() + absl::Seconds(30)); });
  const int64_t generation = Register(*core, 0, 1, "a");
  FetchAll(*core, 1, 0, generation);  // planning takes 2 out of the pending pool
  waiter.join();
  EXPECT_TRUE(room);
  EXPECT_TRUE(core->HasRoom());
}

// The limit is hard in Ingest itself (not only in when the service reads): a full pool stores
// nothing more and says so (RESOURCE_EXHAUSTED); a resend of what is already pending is still
// answered as already accepted.
TEST_F(DispatcherCoreTest, AFullPendingPoolStoresNothingMore) {
  DispatcherOptions options = Options(2);
  options.max_pending_trajectories = 2;
  auto core = Open(options);
  for (int i = 0; i < 2; ++i) Accept(*core, Make(i));
  absl::StatusOr<v1::IngestResponse> full = core->Ingest(Make(2));
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.status().message(), HasSubstr("the pending pool is full (2"));
  absl::StatusOr<v1::IngestResponse> resend = core->Ingest(Make(1));
  ASSERT_TRUE(resend.ok());
  EXPECT_TRUE(resend->already_accepted());
  EXPECT_EQ(core->GetStatus().pending_trajectories(), 2);
  EXPECT_EQ(core->GetStatistics().accepted(), 2);
  const int64_t generation = Register(*core, 0, 1, "a");
  FetchAll(*core, 1, 0, generation);
  Accept(*core, Make(2));
}

// A trajectory whose log record would exceed the log's limit is REJECTED naming its size (a
// resend could never succeed, so it is not an error the client would retry), and nothing of it is
// stored.
TEST_F(DispatcherCoreTest, ATrajectoryOverTheLogsRecordLimitIsRejectedNamingItsSize) {
  DispatcherOptions options = Options();
  options.wal_max_record_bytes = 4096;
  options.limits.max_tokens = 1 << 20;
  auto core = Open(options);
  v1::Trajectory big = Make(0);
  for (int k = 0; k < 2000; ++k) {
    big.add_tokens(5);
    big.add_loss_mask(1);
    big.add_logprobs(-1.0f);
    big.add_versions(-1);
  }
  absl::StatusOr<v1::IngestResponse> answer = core->Ingest(big);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->outcome(), v1::IngestResponse::REJECTED);
  EXPECT_EQ(answer->field(), "tokens");
  EXPECT_THAT(answer->reason(),
              ::testing::MatchesRegex(".*takes [0-9]+ bytes in the log, over its limit of 4096 "
                                      "bytes per record \\(2005 tokens\\).*"));
  EXPECT_EQ(core->GetStatus().pending_trajectories(), 0);
  Accept(*core, Make(1));  // an ordinary one still goes in
}

TEST_F(DispatcherCoreTest, ConcurrentIngestionOfTheSameIdsStoresEachOnce) {
  DispatcherOptions options = Options(1000);
  options.wal_sync = true;
  auto core = Open(options);
  std::vector<std::thread> threads;
  std::atomic<int> fresh{0};
  for (int thread = 0; thread < 8; ++thread) {
    threads.emplace_back([&] {
      for (int i = 0; i < 25; ++i) {
        absl::StatusOr<v1::IngestResponse> response = core->Ingest(Make(i));
        ASSERT_TRUE(response.ok());
        ASSERT_EQ(response->outcome(), v1::IngestResponse::ACCEPTED);
        if (!response->already_accepted()) ++fresh;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(fresh, 25);
  EXPECT_EQ(core->GetStatus().pending_trajectories(), 25);
  core.reset();
  EXPECT_EQ(Open(Options(1000))->GetStatus().pending_trajectories(), 25);
}

// The log fails (here: the file may not grow): the trajectory is not acknowledged, the dispatcher
// says it is unhealthy (its binary then exits for its supervisor), and a restart has every
// trajectory that was acknowledged.
TEST_F(DispatcherCoreTest, ALogFailureIsReportedAndNothingUnstoredIsAcknowledged) {
  {
    auto core = Open(Options());
    Accept(*core, Make(0));
    rlimit old_limit;
    ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old_limit), 0);
    rlimit limit = old_limit;
    limit.rlim_cur = std::filesystem::file_size(dir_ / "log.wal") + 10;
    sighandler_t old_handler = signal(SIGXFSZ, SIG_IGN);
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &limit), 0);
    absl::StatusOr<v1::IngestResponse> refused = core->Ingest(Make(1));
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old_limit), 0);
    signal(SIGXFSZ, old_handler);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_FALSE(core->Health().ok());
    EXPECT_FALSE(core->GetStatus().serving());
    EXPECT_EQ(core->Ingest(Make(2)).status().code(),
              absl::StatusCode::kUnavailable);  // stays failed
    EXPECT_THAT(log_.back(), HasSubstr("the write-ahead log failed"));
  }
  auto core = Open(Options());
  EXPECT_TRUE(core->Health().ok());
  EXPECT_EQ(core->GetStatus().pending_trajectories(), 1);
  Accept(*core, Make(1));  // the refused one can be sent again
}

// A trainer that cannot train everything the dispatcher accepts is refused at registration, with
// the flag that reconciles them, before it could be given a batch it fails on every retry.
TEST_F(DispatcherCoreTest, TrainersThatCannotTrainWhatIsAcceptedAreRefused) {
  DispatcherOptions options = Options();  // vocabulary 100, rewards required, no ref_logprobs
  auto core = Open(options);
  auto registration = [](int64_t vocab, bool ref, bool advantages) {
    v1::RegisterTrainerRequest request;
    request.set_world_size(1);
    request.set_trainer_id("host:1");
    request.set_vocab_size(vocab);
    request.set_needs_ref_logprobs(ref);
    request.set_needs_advantages(advantages);
    return request;
  };
  struct Case {
    v1::RegisterTrainerRequest request;
    const char* words;
  };
  for (const Case& c : {Case{registration(64, false, true),
                             "vocabulary of 64 tokens, but the dispatcher accepts "
                             "token ids below 100: start dta-dispatcher with "
                             "--vocab_size=64"},
                        Case{registration(100, true, true), "needs ref_logprobs"},
                        Case{registration(0, true, false), "--require_ref_logprobs"}}) {
    const absl::StatusOr<v1::RegisterTrainerResponse> refused = core->RegisterTrainer(c.request);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << c.words;
    EXPECT_THAT(refused.status().message(), HasSubstr(c.words));
    EXPECT_THAT(refused.status().message(), HasSubstr("trainer 'host:1' (rank 0)"));
  }
  EXPECT_EQ(core->GetStatus().world_size(), 0);  // nothing registered
  EXPECT_TRUE(core->RegisterTrainer(registration(100, false, true)).ok());
  EXPECT_TRUE(
      core->RegisterTrainer(registration(151936, false, false)).ok());  // a larger model is fine
  core.reset();

  options.limits.require_reward_or_advantages = false;  // --sft
  options.limits.require_ref_logprobs = true;
  options.limits.vocab_size = 0;  // unchecked
  core = Open(options);
  EXPECT_THAT(core->RegisterTrainer(registration(0, true, true)).status().message(),
              HasSubstr("(--sft)"));
  EXPECT_THAT(core->RegisterTrainer(registration(100, true, false)).status().message(),
              HasSubstr("accepts any token id"));
  EXPECT_TRUE(core->RegisterTrainer(registration(0, true, false)).ok());
}

// Routing replay through the service: trajectories carrying routed experts are checked against the
// model given (--routed_experts_model), kept through a restart, served to the trainers as sent, and
// a resend with other routing is not the same trajectory. Trainers must route as that model does.
TEST_F(DispatcherCoreTest, RoutedExpertsAreKeptThroughARestartAndTrainersMustRouteAlike) {
  const RoutingShape routing{
      .num_hidden_layers = 2, .sparse_layers = {1}, .top_k = 2, .num_experts = 300};
  DispatcherOptions options = Options(2);
  options.limits.routing = routing;
  const auto routed = [](int i, int32_t first) {
    v1::Trajectory t = Make(i);
    Rollout rollout = RolloutFromTrajectory(t);
    // Rows of both decoder layers for all but the last token; layer 0 (dense) unused.
    rollout.routed_experts = RoutedExperts{.layers = 2, .top_k = 2, .ids = {}};
    for (int row = 0; row < 4; ++row) {
      for (const int32_t id : {0, 0, first + row, 299 - row})
        rollout.routed_experts->ids.push_back(id);
    }
    v1::Trajectory out = TrajectoryFromRollout(rollout);
    *out.mutable_metadata() = t.metadata();
    return out;
  };
  {
    auto core = Open(options);
    Accept(*core, routed(0, 1));
    Accept(*core, Make(1));  // replay is optional per trajectory
    absl::StatusOr<v1::IngestResponse> bad = core->Ingest(routed(2, 293));  // row 3: 296 twice
    ASSERT_TRUE(bad.ok());
    EXPECT_EQ(bad->outcome(), v1::IngestResponse::REJECTED);
    EXPECT_EQ(bad->field(), "routed_experts");
    EXPECT_THAT(bad->reason(), HasSubstr("row 3, layer 1: [296, 296] names an expert twice"));
    bad = core->Ingest(routed(0, 2));  // t0 again, routed otherwise
    ASSERT_TRUE(bad.ok());
    EXPECT_EQ(bad->outcome(), v1::IngestResponse::REJECTED) << "a different t0 was taken as t0";
  }
  auto core = Open(options);
  v1::RegisterTrainerRequest trainer;
  trainer.set_world_size(1);
  trainer.set_trainer_id("moe");
  trainer.set_num_hidden_layers(2);
  trainer.add_sparse_layers(1);
  trainer.set_experts_per_token(2);
  trainer.set_num_experts(256);
  EXPECT_THAT(
      core->RegisterTrainer(trainer).status().message(),
      HasSubstr("its model routes top 2 of 256 experts at 1 of 2 layers, but the "
                "dispatcher checks routed experts against a model that routes top 2 of 300"));
  trainer.set_num_experts(300);
  const absl::StatusOr<v1::RegisterTrainerResponse> registered = core->RegisterTrainer(trainer);
  ASSERT_TRUE(registered.ok()) << registered.status();
  const absl::StatusOr<v1::Partition> partition = Fetch(*core, 0, 0, registered->generation());
  ASSERT_TRUE(partition.ok()) << partition.status();
  ASSERT_EQ(partition->trajectories_size(), 2);
  for (const v1::Trajectory& t : partition->trajectories()) {
    const Rollout rollout = RolloutFromTrajectory(t);
    if (t.id() == "t0") {
      ASSERT_TRUE(rollout.routed_experts.has_value());
      EXPECT_EQ(*rollout.routed_experts, *RolloutFromTrajectory(routed(0, 1)).routed_experts);
      EXPECT_EQ(t.routed_experts().id_type(), v1::RoutedExperts::UINT16);
    } else {
      EXPECT_FALSE(rollout.routed_experts.has_value());
    }
  }
  // A dense trainer cannot train what this dispatcher accepts.
  v1::RegisterTrainerRequest dense;
  dense.set_world_size(1);
  dense.set_trainer_id("dense");
  EXPECT_THAT(core->RegisterTrainer(dense).status().message(),
              HasSubstr("its model routes no experts (dense)"));
}

// What a dispatcher's state looks like from outside: status, the counters a restart rebuilds, and
// every rank's partition of the next step (trajectories, advantages, normalisers).
std::string Digest(DispatcherCore& core, int world) {
  const v1::GetStatusResponse status = core.GetStatus();
  const v1::GetStatisticsResponse statistics = core.GetStatistics();
  std::string digest = absl::StrCat(
      "committed ", status.committed_steps(), " policy ", status.policy_version(), " pending ",
      status.pending_trajectories(), " accepted ", statistics.accepted(), " dropped ",
      statistics.dropped_stale(), " trained ", statistics.trained_rollouts(), "\n");
  for (const v1::StepStatistics& step : statistics.recent_steps())
    absl::StrAppend(&digest, step.DebugString());
  v1::RegisterTrainerRequest request;
  request.set_world_size(world);
  request.set_resume_step(status.committed_steps());
  int64_t generation = 0;
  for (int rank = 0; rank < world; ++rank) {
    request.set_rank(rank);
    request.set_trainer_id(absl::StrCat("digest-", rank));
    generation = core.RegisterTrainer(request)->generation();
  }
  for (int rank = 0; rank < world; ++rank) {
    v1::FetchPartitionRequest fetch;
    fetch.set_rank(rank);
    fetch.set_step(status.committed_steps());
    fetch.set_generation(generation);
    absl::StatusOr<v1::Partition> partition = core.FetchPartition(fetch);
    if (!partition.ok()) {
      absl::StrAppend(&digest, "rank ", rank, ": ", partition.status().ToString(), "\n");
      continue;
    }
    partition->clear_generation();
    absl::StrAppend(&digest, "rank ", rank, ": ", partition->DebugString());
  }
  return digest;
}

class CompactionTest : public DispatcherCoreTest {
 protected:
  DispatcherOptions CompactingOptions(int64_t compact_bytes) {
    DispatcherOptions options = Options(3);
    options.batch.max_staleness = 2;
    options.wal_compact_bytes = compact_bytes;
    return options;
  }

  // Trajectory i, generated by the policy of when it arrives (four arrive per step, three are
  // trained), or by the first one: those end up too stale and are dropped. Its metadata makes it
  // weigh in the log as real trajectories do against an id.
  static v1::Trajectory Generated(int i) {
    v1::Trajectory t = Make(i, i % 4 == 3 ? 0 : i / 4);
    (*t.mutable_metadata())["notes"] = std::string(1000, 'n');
    return t;
  }

  // Steps with two ranks; rank 1's checkpoint lags a step behind rank 0's, so releases trail
  // commits.
  void Run(DispatcherCore& core, int first, int last) {
    int64_t generation = Register(core, 0, 2, "a");
    generation = Register(core, 1, 2, "b");
    for (int i = first; i < last; ++i) {
      Accept(core, Generated(i));
      if (i % 4 != 3 || i + 1 == last) continue;  // the last arrivals make the step left planned
      const int64_t step = core.GetStatus().committed_steps();
      FetchAll(core, 2, step, generation);
      EXPECT_EQ(Report(core, 0, step, generation, v1::StepReport::PREPARED, step),
                v1::ReportStepResponse::PENDING);
      EXPECT_EQ(Report(core, 1, step, generation, v1::StepReport::PREPARED,
                       std::max<int64_t>(step - 1, 0)),
                v1::ReportStepResponse::COMMIT);
      // A resend of something long trained, and of something just accepted.
      EXPECT_TRUE(core.Ingest(Generated(first))->already_accepted());
      EXPECT_TRUE(core.Ingest(Generated(i))->already_accepted());
    }
    // The next step is planned and prepared by one rank, not committed.
    const int64_t step = core.GetStatus().committed_steps();
    FetchAll(core, 2, step, generation);
    EXPECT_EQ(Report(core, 0, step, generation), v1::ReportStepResponse::PENDING);
  }

  std::filesystem::path Log(const std::string& name) const { return dir_ / name; }
};

TEST_F(CompactionTest, ACompactedLogRebuildsTheSameStateAsTheWholeLog) {
  DispatcherOptions whole = CompactingOptions(0);
  whole.wal_path = Log("whole.wal").string();
  DispatcherOptions compacted = CompactingOptions(1);  // whenever at least half of it is dead
  compacted.wal_path = Log("compacted.wal").string();
  {
    auto a = Open(whole);
    auto b = Open(compacted);
    Run(*a, 0, 40);
    Run(*b, 0, 40);
    EXPECT_EQ(a->GetStatistics().wal_compactions(), 0);
    EXPECT_GE(b->GetStatistics().wal_compactions(), 2);
    EXPECT_GT(b->GetStatistics().retired_ids(), 10);
    EXPECT_GT(b->GetStatistics().dropped_stale(), 0);
    EXPECT_LT(std::filesystem::file_size(compacted.wal_path),
              std::filesystem::file_size(whole.wal_path) / 2);
  }
  // After restarts: the same state, the same next partitions, the same answers to resends.
  for (int restart = 0; restart < 2; ++restart) {
    auto a = Open(whole);
    auto b = Open(compacted);
    const std::string digest = Digest(*a, 2);
    EXPECT_EQ(Digest(*b, 2), digest);
    EXPECT_THAT(digest, HasSubstr("trajectories {"));  // there is a next step to compare
    for (int i = 0; i < 40; ++i) {
      for (DispatcherCore* core : {a.get(), b.get()}) {
        absl::StatusOr<v1::IngestResponse> again = core->Ingest(Generated(i));
        ASSERT_TRUE(again.ok());
        EXPECT_TRUE(again->already_accepted()) << i;
        v1::Trajectory changed = Generated(i);
        changed.set_reward(-1);
        absl::StatusOr<v1::IngestResponse> conflict = core->Ingest(changed);
        ASSERT_TRUE(conflict.ok());
        EXPECT_EQ(conflict->outcome(), v1::IngestResponse::REJECTED) << i;
        EXPECT_EQ(conflict->field(), "id");
      }
    }
    // Both go on alike, the compacting one compacting again.
    Run(*a, 40 + 20 * restart, 60 + 20 * restart);
    Run(*b, 40 + 20 * restart, 60 + 20 * restart);
    EXPECT_EQ(Digest(*b, 2), Digest(*a, 2));
  }
  // The starts are counted through compactions: generations stay unique.
  EXPECT_EQ(Open(compacted)->GetStatus().generation() >> 32,
            Open(whole)->GetStatus().generation() >> 32);
}

TEST_F(CompactionTest, ALargeLogIsCompactedWhenOpened) {
  DispatcherOptions options = CompactingOptions(0);
  std::string before;
  {
    auto core = Open(options);
    Run(*core, 0, 30);
  }
  const uintmax_t whole_bytes = std::filesystem::file_size(options.wal_path);
  before = Digest(*Open(options), 2);
  options.wal_compact_bytes = 1;
  auto core = Open(options);
  EXPECT_EQ(core->GetStatistics().wal_compactions(), 1);
  EXPECT_LT(std::filesystem::file_size(options.wal_path), whole_bytes);
  EXPECT_THAT(log_, Contains(HasSubstr("log compacted")));
  EXPECT_EQ(Digest(*core, 2), before);
}

// Ingestion goes on from several threads while steps commit and compactions rewrite the log:
// every acknowledged trajectory is in the rewritten log exactly once.
TEST_F(CompactionTest, TrajectoriesAcknowledgedDuringACompactionAreKept) {
  DispatcherOptions options = CompactingOptions(1);
  options.batch = {.rollouts = 4};
  options.max_pending_trajectories = 1 << 20;
  std::atomic<int> acknowledged{0};
  {
    auto core = Open(options);
    std::vector<std::thread> producers;
    for (int thread = 0; thread < 4; ++thread) {
      producers.emplace_back([&, thread] {
        for (int i = 0; i < 20; ++i) {
          absl::StatusOr<v1::IngestResponse> response = core->Ingest(Make(20 * thread + i));
          ASSERT_TRUE(response.ok()) << response.status();
          ASSERT_EQ(response->outcome(), v1::IngestResponse::ACCEPTED);
          ++acknowledged;
        }
      });
    }
    const int64_t generation = Register(*core, 0, 1, "a");
    int64_t step = 0;
    while (step < 18) {
      absl::StatusOr<v1::Partition> partition = Fetch(*core, 0, step, generation);
      if (!partition.ok()) {
        ASSERT_EQ(partition.status().code(), absl::StatusCode::kUnavailable) << partition.status();
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      EXPECT_EQ(Report(*core, 0, step, generation, v1::StepReport::PREPARED, step + 1),
                v1::ReportStepResponse::COMMIT);
      ++step;
    }
    for (std::thread& t : producers) t.join();
    EXPECT_GE(core->GetStatistics().wal_compactions(), 2);
  }
  auto core = Open(options);
  const v1::GetStatisticsResponse statistics = core->GetStatistics();
  EXPECT_EQ(acknowledged, 80);
  EXPECT_EQ(statistics.accepted(), 80);
  EXPECT_EQ(statistics.trained_rollouts(), 72);
  EXPECT_EQ(statistics.retired_ids(), 72);
  EXPECT_EQ(core->GetStatus().pending_trajectories(), 8);
  for (int i = 0; i < 80; ++i) EXPECT_TRUE(core->Ingest(Make(i))->already_accepted()) << i;
}

// A failed compaction (here its temp file cannot be created) leaves the log usable and is not
// retried on every commit, only once the log has doubled.
TEST_F(CompactionTest, AFailedCompactionWaitsForTheLogToDouble) {
  DispatcherOptions options = CompactingOptions(1);
  auto core = Open(options);
  Run(*core, 0, 8);
  const int64_t compactions = core->GetStatistics().wal_compactions();
  std::filesystem::create_directory(options.wal_path + ".tmp");  // open(O_CREAT) of it fails
  Run(*core, 8, 40);
  auto failures = [this] {
    return std::count_if(log_.begin(), log_.end(), [](const std::string& line) {
      return line.find("compaction failed") != std::string::npos;
    });
  };
  EXPECT_EQ(core->GetStatistics().wal_compactions(), compactions);
  EXPECT_GE(failures(), 1);
  EXPECT_LE(failures(), 2);  // the log doubles at most once in these steps
  EXPECT_THAT(log_, Contains(HasSubstr("next try at")));
  EXPECT_TRUE(core->Health().ok());
  std::filesystem::remove(options.wal_path + ".tmp");
  Run(*core, 40, 80);
  EXPECT_GT(core->GetStatistics().wal_compactions(), compactions);
  const std::string digest = Digest(*core, 2);
  core.reset();
  EXPECT_EQ(Digest(*Open(options), 2), digest);
}

// Resends are recognised by content, not by bytes: fields the dispatcher does not know (a newer
// client's) neither break the identity nor survive into the log, before and after compaction, and
// a log whose records still carry them (written before the canonical form) replays the same.
TEST_F(CompactionTest, UnknownFieldsDoNotChangeATrajectorysIdentity) {
  auto with_unknown = [](int i) {
    v1::Trajectory t = Generated(i);
    t.GetReflection()->MutableUnknownFields(&t)->AddVarint(99, 12345);
    return t;
  };
  DispatcherOptions options = CompactingOptions(0);
  {
    // A log as an earlier version wrote it: the bytes as received.
    absl::StatusOr<std::unique_ptr<WriteAheadLog>> wal =
        WriteAheadLog::Open({.path = options.wal_path, .sync = false},
                            [](const WalRecord&) { return absl::OkStatus(); });
    ASSERT_TRUE(wal.ok());
    ASSERT_TRUE((*wal)->Append(2, with_unknown(0).SerializeAsString()).ok());
  }
  options.wal_compact_bytes = 1;
  auto core = Open(options);
  Accept(*core, with_unknown(1));
  Accept(*core, Generated(2));
  for (int i : {0, 1}) {
    EXPECT_TRUE(core->Ingest(with_unknown(i))->already_accepted()) << i;
    EXPECT_TRUE(core->Ingest(Generated(i))->already_accepted()) << i;
  }
  // Train the three and release them (a checkpoint after the step): the log is compacted down to
  // their ids and fingerprints.
  const int64_t generation = Register(*core, 0, 1, "a");
  EXPECT_EQ(FetchAll(*core, 1, 0, generation).size(), 3u);
  EXPECT_EQ(Report(*core, 0, 0, generation, v1::StepReport::PREPARED, /*checkpoint=*/1),
            v1::ReportStepResponse::COMMIT);
  EXPECT_GE(core->GetStatistics().wal_compactions(), 1);
  EXPECT_EQ(core->GetStatistics().retired_ids(), 3);
  core.reset();
  core = Open(options);
  EXPECT_EQ(core->GetStatistics().retired_ids(), 3);
  for (int i : {0, 1, 2}) {
    EXPECT_TRUE(core->Ingest(with_unknown(i))->already_accepted()) << i;
    v1::Trajectory changed = Generated(i);
    changed.mutable_logprobs()->Set(1, -9);
    EXPECT_EQ(core->Ingest(changed)->outcome(), v1::IngestResponse::REJECTED) << i;
  }
}

// A restart with stricter limits than some unreleased trajectories were accepted under (here RL
// after SFT: no rewards) would plan batches no trainer can train: it is refused, naming one.
TEST_F(CompactionTest, StricterLimitsThanUnreleasedTrajectoriesAreRefusedAtStart) {
  DispatcherOptions options = CompactingOptions(0);
  options.limits.require_reward_or_advantages = false;
  {
    auto core = Open(options);
    for (int i = 0; i < 3; ++i) {
      v1::Trajectory t = Generated(i);
      if (i == 1) t.clear_reward();
      Accept(*core, t);
    }
  }
  options.limits.require_reward_or_advantages = true;
  absl::StatusOr<std::unique_ptr<DispatcherCore>> refused = DispatcherCore::Open(options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("1 trajectories that may still be trained"));
  EXPECT_THAT(refused.status().message(), HasSubstr("'t1': field 'reward': missing"));
  options.limits.vocab_size = 8;  // and a smaller vocabulary: every one of them
  refused = DispatcherCore::Open(options);
  EXPECT_THAT(refused.status().message(), HasSubstr("3 trajectories"));
  EXPECT_THAT(refused.status().message(), HasSubstr("'t0': field 'tokens'"));  // the oldest
  options.limits.vocab_size = 100;
  options.limits.require_reward_or_advantages = false;
  EXPECT_TRUE(DispatcherCore::Open(options).ok());
}

TEST_F(CompactionTest, ASnapshotAfterOtherRecordsIsDataLoss) {
  DispatcherOptions options = CompactingOptions(0);
  {
    auto core = Open(options);
    Run(*core, 0, 12);
  }
  {
    absl::StatusOr<std::unique_ptr<WriteAheadLog>> wal =
        WriteAheadLog::Open({.path = options.wal_path, .sync = false},
                            [](const WalRecord&) { return absl::OkStatus(); });
    ASSERT_TRUE(wal.ok());
    v1::SnapshotRecord snapshot;
    snapshot.set_committed_steps(1);
    ASSERT_TRUE((*wal)->Append(6, snapshot.SerializeAsString()).ok());
  }
  absl::StatusOr<std::unique_ptr<DispatcherCore>> core = DispatcherCore::Open(options);
  EXPECT_EQ(core.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(core.status().message(), HasSubstr("a snapshot record after other records"));
}

TEST_F(DispatcherCoreTest, ErrorsForBadCalls) {
  EXPECT_EQ(DispatcherCore::Open({}).status().code(), absl::StatusCode::kInvalidArgument);
  DispatcherOptions no_batch = Options();
  no_batch.batch = {};
  EXPECT_EQ(DispatcherCore::Open(no_batch).status().code(), absl::StatusCode::kInvalidArgument);
  auto core = Open(Options());
  v1::RegisterTrainerRequest outside;
  outside.set_rank(2);
  outside.set_world_size(2);
  outside.set_trainer_id("x");
  EXPECT_EQ(core->RegisterTrainer(outside).status().code(), absl::StatusCode::kInvalidArgument);
  const int64_t generation = Register(*core, 0, 1, "a");
  EXPECT_EQ(Fetch(*core, 0, 3, generation).status().code(), absl::StatusCode::kFailedPrecondition);
  v1::StepReport unfetched;
  unfetched.set_generation(generation);
  unfetched.set_phase(v1::StepReport::PREPARED);
  EXPECT_EQ(core->ReportStep(unfetched).status().code(), absl::StatusCode::kFailedPrecondition);
  unfetched.set_phase(v1::StepReport::PHASE_UNSPECIFIED);
  EXPECT_EQ(core->ReportStep(unfetched).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dta

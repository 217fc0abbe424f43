// A tensor-parallel replica's relayed sessions: every follower hears exactly what the dispatcher
// answered the leader (partitions bit for bit, decisions with their policy version, errors with
// their code), the store is left empty, and a follower that hears nothing, or loses the store,
// says so instead of hanging.
#include "apps/trainer/replica_session.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/fake_trainer_session.h"

namespace dta {
namespace {

using testing::FakeSession;

// A partition whose rollouts use every field the wire carries.
StepPartition FullPartition(int64_t step) {
  StepPartition partition;
  partition.step = step;
  partition.replay = step % 2 == 1;
  partition.policy_version = 40 + step;
  partition.total_loss_tokens = 17.5;
  partition.num_rollouts = 5;
  partition.tree_tokens = 123;
  for (int i = 0; i < 3; ++i) {
    Rollout r;
    r.id = "step" + std::to_string(step) + "-r" + std::to_string(i);
    r.group = "g" + std::to_string(i % 2);
    r.tokens = {3, 1, 4, static_cast<TokenId>(i)};
    r.loss_mask = {0, 1, 1, 1};
    r.logprobs = {0.0f, -1.25f, -0.5f, -3.0f};
    r.versions = {-1, 7, 7, 8};
    if (i != 1) r.reward = 0.25 * i;
    r.advantages = {0.0f, 0.5f, -0.75f, 1.0f / 3.0f};
    r.ref_logprobs = {0.0f, -1.0f, -0.625f, -2.5f};
    partition.rollouts.push_back(std::move(r));
  }
  return partition;
}

TEST(StepPartitionWire, RoundTripsEveryFieldAndRefusesGarbage) {
  const StepPartition partition = FullPartition(3);
  absl::StatusOr<StepPartition> parsed = ParseStepPartition(SerializeStepPartition(partition));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, partition);
  const absl::StatusOr<StepPartition> garbage = ParseStepPartition("\xff\xff\xff not a partition");
  EXPECT_EQ(garbage.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(garbage.status().message().find("dta.v1.Partition"), std::string::npos);
}

// What one session answered, step by step, for comparing the leader's with its followers'.
struct Heard {
  std::vector<absl::StatusOr<StepPartition>> partitions;
  std::vector<absl::StatusOr<StepDecision>> decisions;
  std::vector<int64_t> policy_versions;
};

// Steps 0..2 as the loop drives a session (fetch, then report), until a fetch fails.
Heard Drive(TrainerSession& session) {
  Heard heard;
  for (int64_t step = 0;; ++step) {
    heard.partitions.push_back(session.Fetch(step));
    if (!heard.partitions.back().ok()) return heard;
    int64_t version = -1;
    heard.decisions.push_back(session.Prepared({.step = step, .loss = 1.5}, &version));
    heard.policy_versions.push_back(version);
  }
}

TEST(ReplicaSession, EveryFollowerHearsWhatTheLeaderHeard) {
  constexpr int kFollowers = 3;
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto fake = std::make_unique<FakeSession>();
  FakeSession* dispatcher = fake.get();
  dispatcher->partitions = {FullPartition(0), FullPartition(1), FullPartition(2),
                            absl::AbortedError("generation 4 is over")};
  dispatcher->decisions = {StepDecision::kCommit, StepDecision::kAbort,
                           absl::UnavailableError("the dispatcher is unreachable")};
  std::vector<Heard> followers(kFollowers);
  std::vector<std::thread> threads;
  for (int f = 0; f < kFollowers; ++f) {
    threads.emplace_back([&, f] {
      std::unique_ptr<TrainerSession> session =
          FollowLeader(store, kFollowers, std::chrono::seconds(30));
      followers[f] = Drive(*session);
    });
  }
  std::unique_ptr<TrainerSession> leader = RelayToFollowers(std::move(fake), store);
  const Heard heard = Drive(*leader);
  for (std::thread& t : threads) t.join();

  ASSERT_EQ(heard.partitions.size(), 4u);
  EXPECT_EQ(heard.partitions[3].status().code(), absl::StatusCode::kAborted);
  ASSERT_EQ(heard.decisions.size(), 3u);
  EXPECT_EQ(heard.policy_versions[0], 100);    // the fake's version for step 0
  ASSERT_EQ(dispatcher->prepared.size(), 3u);  // only the leader reports
  for (int f = 0; f < kFollowers; ++f) {
    const Heard& got = followers[f];
    ASSERT_EQ(got.partitions.size(), heard.partitions.size()) << "follower " << f;
    for (size_t i = 0; i < heard.partitions.size(); ++i) {
      ASSERT_EQ(got.partitions[i].status(), heard.partitions[i].status()) << f << " step " << i;
      if (heard.partitions[i].ok()) {
        EXPECT_EQ(*got.partitions[i], *heard.partitions[i]) << f << " step " << i;
      }
    }
    ASSERT_EQ(got.decisions.size(), heard.decisions.size()) << "follower " << f;
    for (size_t i = 0; i < heard.decisions.size(); ++i) {
      ASSERT_EQ(got.decisions[i].status(), heard.decisions[i].status()) << f << " step " << i;
      if (heard.decisions[i].ok()) {
        EXPECT_EQ(*got.decisions[i], *heard.decisions[i]) << f << " step " << i;
        EXPECT_EQ(got.policy_versions[i], heard.policy_versions[i]) << f << " step " << i;
      }
    }
  }
  // The last reader of each message deleted it.
  EXPECT_EQ(store->getNumKeys(), 0);
}

TEST(ReplicaSession, AFollowerThatHearsNothingGivesUpAfterItsWait) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::unique_ptr<TrainerSession> follower = FollowLeader(store, 1, std::chrono::milliseconds(200));
  const auto start = std::chrono::steady_clock::now();
  const absl::StatusOr<StepPartition> partition = follower->Fetch(5);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(200));
  EXPECT_EQ(partition.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(partition.status().message().find("relay/5/partition"), std::string::npos)
      << partition.status();
}

// A store that fails every call once broken, as a TCPStore does when its host is gone.
class BreakableStore : public c10d::HashStore {
 public:
  std::atomic<bool> broken{false};
  bool check(const std::vector<std::string>& keys) override {
    TORCH_CHECK(!broken, "connection reset by peer");
    return HashStore::check(keys);
  }
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    TORCH_CHECK(!broken, "connection reset by peer");
    HashStore::set(key, value);
  }
};

TEST(ReplicaSession, ALostStoreAsksForARestart) {
  auto store = c10::make_intrusive<BreakableStore>();
  store->broken = true;
  std::unique_ptr<TrainerSession> follower = FollowLeader(store, 1, std::chrono::seconds(30));
  const absl::StatusOr<StepPartition> heard = follower->Fetch(0);
  EXPECT_EQ(heard.status().code(), absl::StatusCode::kAborted);
  EXPECT_NE(heard.status().message().find("connection reset by peer"), std::string::npos);

  auto fake = std::make_unique<FakeSession>();
  fake->partitions = {FullPartition(0)};
  std::unique_ptr<TrainerSession> leader = RelayToFollowers(std::move(fake), store);
  const absl::StatusOr<StepPartition> fetched = leader->Fetch(0);
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kAborted);
  EXPECT_NE(fetched.status().message().find("tensor-parallel peers"), std::string::npos);
}

}  // namespace
}  // namespace dta

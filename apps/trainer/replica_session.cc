#include "apps/trainer/replica_session.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace dta {
namespace {

std::string PartitionKey(int64_t step) { return absl::StrCat("relay/", step, "/partition"); }
std::string DecisionKey(int64_t step) { return absl::StrCat("relay/", step, "/decision"); }

// A relayed answer: 'O' + payload when the leader's call succeeded, else 'S' + one byte of its
// absl::StatusCode + the status' message (so the followers fail, or restart, as the leader does).
struct Message {
  absl::Status status;
  std::string payload;
};

std::vector<uint8_t> Encode(const absl::Status& status, const std::string& payload) {
  std::vector<uint8_t> bytes;
  if (status.ok()) {
    bytes.reserve(1 + payload.size());
    bytes.push_back('O');
    bytes.insert(bytes.end(), payload.begin(), payload.end());
  } else {
    bytes = {'S', static_cast<uint8_t>(status.code())};
    bytes.insert(bytes.end(), status.message().begin(), status.message().end());
  }
  return bytes;
}

Message Decode(const std::vector<uint8_t>& bytes) {
  if (!bytes.empty() && bytes[0] == 'O') {
    return {absl::OkStatus(), std::string(bytes.begin() + 1, bytes.end())};
  }
  if (bytes.size() >= 2 && bytes[0] == 'S') {
    return {absl::Status(static_cast<absl::StatusCode>(bytes[1]),
                         std::string(bytes.begin() + 2, bytes.end())),
            ""};
  }
  return {absl::InternalError(absl::StrCat("a relayed message of ", bytes.size(),
                                           " bytes is not one the leader writes")),
          ""};
}

// A decision's payload: 'C' (commit) or 'A' (abort), then the policy version.
std::string EncodeDecision(StepDecision decision, int64_t policy_version) {
  return absl::StrCat(decision == StepDecision::kCommit ? "C" : "A", policy_version);
}

class RelayingSession final : public TrainerSession {
 public:
  RelayingSession(std::unique_ptr<TrainerSession> session, c10::intrusive_ptr<c10d::Store> store)
      : session_(std::move(session)), store_(std::move(store)) {}

  int64_t generation() const override { return session_->generation(); }
  int64_t committed_steps() const override { return session_->committed_steps(); }

  absl::StatusOr<StepPartition> Fetch(int64_t step) override {
    absl::StatusOr<StepPartition> partition = session_->Fetch(step);
    // A failure to relay ends the replica's generation: its followers can no longer follow.
    const absl::Status relayed = Publish(PartitionKey(step), partition.status(),
                                         partition.ok() ? SerializeStepPartition(*partition) : "");
    if (!relayed.ok()) return relayed;
    return partition;
  }

  absl::StatusOr<StepDecision> Prepared(const PreparedStep& step,
                                        int64_t* policy_version) override {
    int64_t version = 0;
    absl::StatusOr<StepDecision> decision = session_->Prepared(step, &version);
    const absl::Status relayed = Publish(DecisionKey(step.step), decision.status(),
                                         decision.ok() ? EncodeDecision(*decision, version) : "");
    if (!relayed.ok()) return relayed;
    if (policy_version != nullptr) *policy_version = version;
    return decision;
  }

  void Failed(int64_t step, const std::string& error) override { session_->Failed(step, error); }

 private:
  absl::Status Publish(const std::string& key, const absl::Status& status,
                       const std::string& payload) {
    try {
      store_->set(key, Encode(status, payload));
      return absl::OkStatus();
    } catch (const c10::Error& e) {
      return absl::AbortedError(absl::StrCat(
          "relaying ", key, " to the tensor-parallel peers: ", e.what_without_backtrace()));
    }
  }

  std::unique_ptr<TrainerSession> session_;
  c10::intrusive_ptr<c10d::Store> store_;
};

class FollowingSession final : public TrainerSession {
 public:
  FollowingSession(c10::intrusive_ptr<c10d::Store> store, int followers,
                   std::chrono::milliseconds wait)
      : store_(std::move(store)), followers_(followers), wait_(wait) {}

  int64_t generation() const override { return 0; }
  int64_t committed_steps() const override { return 0; }

  absl::StatusOr<StepPartition> Fetch(int64_t step) override {
    Message message = Receive(PartitionKey(step));
    if (!message.status.ok()) return message.status;
    return ParseStepPartition(message.payload);
  }

  absl::StatusOr<StepDecision> Prepared(const PreparedStep& step,
                                        int64_t* policy_version) override {
    Message message = Receive(DecisionKey(step.step));
    if (!message.status.ok()) return message.status;
    const std::string& payload = message.payload;
    int64_t version = 0;
    if (payload.empty() || (payload[0] != 'C' && payload[0] != 'A') ||
        !absl::SimpleAtoi(payload.substr(1), &version)) {
      return absl::InternalError(
          absl::StrCat("step ", step.step, ": a relayed decision '", payload, "' is malformed"));
    }
    if (policy_version != nullptr) *policy_version = version;
    return payload[0] == 'C' ? StepDecision::kCommit : StepDecision::kAbort;
  }

  void Failed(int64_t step, const std::string& error) override {
    std::fprintf(stderr,
                 "step %lld failed on a tensor-parallel follower (its leader reports to the "
                 "dispatcher): %s\n",
                 static_cast<long long>(step), error.c_str());
  }

 private:
  // Waits for `key`, reads it, and deletes it once every follower has read it.
  Message Receive(const std::string& key) {
    const auto deadline = std::chrono::steady_clock::now() + wait_;
    // Short polls first (a step's answer usually comes at once); at most 20 ms apart while the
    // leader waits for rollouts, which bounds the store's load.
    std::chrono::microseconds pause(100);
    try {
      while (!store_->check({key})) {
        if (std::chrono::steady_clock::now() > deadline) {
          return {absl::DeadlineExceededError(
                      absl::StrCat("no word from the tensor-parallel leader on ", key, " in ",
                                   wait_.count() / 1000, " s")),
                  ""};
        }
        std::this_thread::sleep_for(pause);
        pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(20));
      }
      Message message = Decode(store_->get(key));
      if (store_->add(key + "/read", 1) == followers_) {
        store_->deleteKey(key);
        store_->deleteKey(key + "/read");
      }
      return message;
    } catch (const c10::Error& e) {
      return {absl::AbortedError(absl::StrCat(
                  "the tensor-parallel leader's store is unreachable (its host is gone?): ",
                  e.what_without_backtrace())),
              ""};
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  const int followers_;
  const std::chrono::milliseconds wait_;
};

}  // namespace

std::unique_ptr<TrainerSession> RelayToFollowers(std::unique_ptr<TrainerSession> session,
                                                 c10::intrusive_ptr<c10d::Store> store) {
  return std::make_unique<RelayingSession>(std::move(session), std::move(store));
}

std::unique_ptr<TrainerSession> FollowLeader(c10::intrusive_ptr<c10d::Store> store, int followers,
                                             std::chrono::milliseconds wait) {
  TORCH_CHECK(followers >= 1, "FollowLeader: followers must be >= 1, got ", followers);
  return std::make_unique<FollowingSession>(std::move(store), followers, wait);
}

}  // namespace dta

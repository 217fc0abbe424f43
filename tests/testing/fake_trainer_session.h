// A scripted TrainerSession for tests of what drives one (the trainer's loop, the tensor-parallel
// relay): serves the partitions and decisions queued in it and records what it is told.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "dispatcher/client/trainer_session.h"

namespace dta::testing {

class FakeSession : public TrainerSession {
 public:
  std::deque<absl::StatusOr<StepPartition>> partitions;
  // Each decision's policy version is 100 + the step; an empty queue commits.
  std::deque<absl::StatusOr<StepDecision>> decisions;
  std::vector<int64_t> fetched;
  std::vector<PreparedStep> prepared;
  std::vector<std::pair<int64_t, std::string>> failed;

  int64_t generation() const override { return 1; }
  int64_t committed_steps() const override { return 0; }
  absl::StatusOr<StepPartition> Fetch(int64_t step) override {
    fetched.push_back(step);
    if (partitions.empty()) return absl::DeadlineExceededError("the test ran out of partitions");
    absl::StatusOr<StepPartition> next = std::move(partitions.front());
    partitions.pop_front();
    return next;
  }
  absl::StatusOr<StepDecision> Prepared(const PreparedStep& step,
                                        int64_t* policy_version) override {
    prepared.push_back(step);
    if (policy_version != nullptr) *policy_version = 100 + step.step;
    if (decisions.empty()) return StepDecision::kCommit;
    // The decision by value (not the StatusOr moved): GCC 12 at -O3 warns that a moved
    // StatusOr<enum> may be uninitialized.
    const absl::Status status = decisions.front().status();
    const StepDecision next = status.ok() ? *decisions.front() : StepDecision::kCommit;
    decisions.pop_front();
    if (!status.ok()) return status;
    return next;
  }
  void Failed(int64_t step, const std::string& error) override { failed.emplace_back(step, error); }
};

}  // namespace dta::testing

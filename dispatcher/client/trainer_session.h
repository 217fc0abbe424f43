// A trainer's conversation with the dispatcher, in plain C++ types: what dta-trainer (compiled
// against LibTorch, whose bundled Protobuf headers clash with the system's) calls. The gRPC and
// Protobuf work happens in trainer_session.cc.
//
// Thread safety: one call at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/io/rollout.h"
#include "dispatcher/client/client_options.h"

namespace dta {

struct TrainerIdentity {
  int32_t rank = 0;
  int32_t world_size = 1;
  std::string device;       // e.g. "cuda:0"
  int64_t resume_step = 0;  // committed steps the trainer's weights include
  std::string trainer_id;   // unique per process, e.g. "host:pid:start"
  // What every trajectory must satisfy for this trainer (see RegisterTrainerRequest).
  int64_t vocab_size = 0;  // the model's vocabulary; 0: not checked
  bool needs_ref_logprobs = false;
  bool needs_advantages = false;
  // The routing its mixture-of-experts model replays (num_experts 0: a dense model).
  RoutingShape routing;
};

// One rank's part of a step (dta.v1.Partition).
struct StepPartition {
  int64_t step = 0;
  bool replay = false;
  int64_t policy_version = 0;
  std::vector<Rollout> rollouts;  // lexicographic order, advantages over the whole batch
  double total_loss_tokens = 0;   // the whole batch's normalisers
  int64_t num_rollouts = 0;
  int64_t tree_tokens = 0;

  friend bool operator==(const StepPartition&, const StepPartition&) = default;
};

// A partition as bytes, in the dispatcher's own wire form (dta.v1.Partition): how a replica's
// tensor-parallel leader relays it to the ranks that share it (apps/trainer/replica_session.h).
// ParseStepPartition(SerializeStepPartition(p)) == p; INVALID_ARGUMENT for bytes that are not a
// partition.
std::string SerializeStepPartition(const StepPartition& partition);
absl::StatusOr<StepPartition> ParseStepPartition(std::string_view bytes);

struct PreparedStep {
  int64_t step = 0;
  double loss = 0;
  int64_t rollout_tokens = 0;
  int64_t forwarded_tokens = 0;
  int64_t tree_tokens = 0;
  double seconds = 0;
  int64_t peak_memory_bytes = 0;
  int64_t checkpoint_step = 0;
};

enum class StepDecision { kCommit, kAbort };

class TrainerSession {
 public:
  // Registers with the dispatcher (retrying while it is unreachable).
  static absl::StatusOr<std::unique_ptr<TrainerSession>> Register(const ClientOptions& options,
                                                                  const TrainerIdentity& identity);
  virtual ~TrainerSession() = default;

  virtual int64_t generation() const = 0;
  virtual int64_t committed_steps() const = 0;
  // The step's partition, waiting for it. ABORTED: the generation is over.
  virtual absl::StatusOr<StepPartition> Fetch(int64_t step) = 0;
  // PREPARED, then the decision (waiting for the other ranks).
  virtual absl::StatusOr<StepDecision> Prepared(const PreparedStep& step,
                                                int64_t* policy_version) = 0;
  // FAILED: the step is abandoned on every rank. Best effort.
  virtual void Failed(int64_t step, const std::string& error) = 0;
};

}  // namespace dta

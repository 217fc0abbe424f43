#include "dispatcher/core/dispatcher_core.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/base/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

// xxHash (Debian's libxxhash-dev), header-only: XXH3's output is stable across versions and
// machines, which the fingerprints a compacted log stores need.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <bit>

namespace dta {
namespace {

// Log record types. Never renumber: logs outlive the code that wrote them.
enum RecordType : uint8_t {
  kOpenRecord = 1,        // a dispatcher started on this log (empty payload)
  kTrajectoryRecord = 2,  // v1::Trajectory
  kPlanRecord = 3,        // v1::StepPlanRecord
  kCommitRecord = 4,      // v1::StepCommitRecord
  kCheckpointRecord = 5,  // v1::CheckpointRecord
  kSnapshotRecord = 6,    // v1::SnapshotRecord: the first record of a compacted log
  kRetiredRecord = 7,     // v1::RetiredRecord
};

// Ids per retired record of a compacted log (a few MB each).
constexpr int kRetiredIdsPerRecord = 1 << 16;
// What a retired id costs a compacted log, about: the id, its fingerprint, a tag and a length.
constexpr int64_t kRetiredIdOverhead = 12;

// Generations are incarnation * 2^32 + a counter, so that a restarted dispatcher never hands out
// a generation an earlier incarnation used.
constexpr int kGenerationBits = 32;

// Deterministic bytes (map fields sorted), so equal trajectories get equal bytes.
std::string DeterministicBytes(const google::protobuf::Message& message) {
  std::string bytes;
  google::protobuf::io::StringOutputStream raw(&bytes);
  google::protobuf::io::CodedOutputStream out(&raw);
  out.SetSerializationDeterministic(true);
  message.SerializeToCodedStream(&out);
  out.Trim();
  return bytes;
}

// XXH3-64 over length-prefixed fields (so no two field sequences hash the same bytes).
class FieldHasher {
 public:
  FieldHasher() : state_(XXH3_createState()) { XXH3_64bits_reset(state_); }
  FieldHasher(const FieldHasher&) = delete;
  FieldHasher& operator=(const FieldHasher&) = delete;
  ~FieldHasher() { XXH3_freeState(state_); }

  void Bytes(const void* data, size_t n) {
    const uint64_t length = n;
    XXH3_64bits_update(state_, &length, sizeof(length));
    XXH3_64bits_update(state_, data, n);
  }
  template <typename T>
  void Values(const std::vector<T>& values) {
    Bytes(values.data(), values.size() * sizeof(T));
  }
  void Text(const std::string& text) { Bytes(text.data(), text.size()); }
  uint64_t Digest() const { return XXH3_64bits_digest(state_); }

 private:
  XXH3_state_t* state_;
};

// A trajectory's identity for resends: its fields in a fixed layout of our own (each field's
// length, then its values as little-endian machine words), so that it depends neither on
// protobuf's serializer nor on fields the dispatcher ignores (unknown ones), and a compacted log's
// retired fingerprints stay valid across versions.
uint64_t Fingerprint(const Rollout& rollout, const std::map<std::string, std::string>& metadata) {
  static_assert(std::endian::native == std::endian::little,
                "the fingerprint layout is little-endian");
  FieldHasher h;
  h.Text(rollout.id);
  h.Text(rollout.group);
  h.Values(rollout.tokens);
  h.Values(rollout.loss_mask);
  h.Values(rollout.logprobs);
  h.Values(rollout.versions);
  const double reward = rollout.reward.value_or(0.0);
  h.Bytes(&reward, rollout.reward.has_value() ? sizeof(reward) : 0);
  h.Values(rollout.advantages);
  h.Values(rollout.ref_logprobs);
  // Only when present, so that the fingerprints of trajectories without them (and those a
  // compacted log retired) are what they were before routed experts existed.
  if (rollout.routed_experts) {
    const std::vector<int32_t> shape = {rollout.routed_experts->layers,
                                        rollout.routed_experts->top_k};
    h.Values(shape);
    h.Values(rollout.routed_experts->ids);
  }
  for (const auto& [key, value] : metadata) {
    h.Text(key);
    h.Text(value);
  }
  return h.Digest();
}

// What the log stores for a received trajectory: its deterministic serialization without fields
// the dispatcher does not know (a newer client's). Copies the message only when it has some.
std::string KnownFieldBytes(const v1::Trajectory& trajectory) {
  if (trajectory.GetReflection()->GetUnknownFields(trajectory).empty())
    return DeterministicBytes(trajectory);
  v1::Trajectory known = trajectory;
  known.DiscardUnknownFields();
  return DeterministicBytes(known);
}

// The same for a stored one (a compaction rewrites it from what the dispatcher kept).
std::string StoredBytes(const Rollout& rollout,
                        const std::map<std::string, std::string>& metadata) {
  v1::Trajectory trajectory = TrajectoryFromRollout(rollout);
  trajectory.mutable_metadata()->insert(metadata.begin(), metadata.end());
  return DeterministicBytes(trajectory);
}

template <typename Message>
absl::Status ParseRecord(const WalRecord& record, const std::string& path, const char* what,
                         Message& message) {
  if (message.ParseFromArray(record.payload.data(), static_cast<int>(record.payload.size()))) {
    return absl::OkStatus();
  }
  return absl::DataLossError(absl::StrCat(path, ": a ", what, " record does not parse"));
}

v1::IngestResponse Accepted(const std::string& id, bool already_accepted) {
  v1::IngestResponse response;
  response.set_id(id);
  response.set_outcome(v1::IngestResponse::ACCEPTED);
  response.set_already_accepted(already_accepted);
  return response;
}

v1::IngestResponse Rejected(const std::string& id, const std::string& field,
                            const std::string& reason) {
  v1::IngestResponse response;
  response.set_id(id);
  response.set_outcome(v1::IngestResponse::REJECTED);
  response.set_field(field);
  response.set_reason(reason);
  return response;
}

std::string DescribeRouting(const RoutingShape& routing) {
  if (routing.num_experts == 0 || routing.sparse_layers.empty()) return "no experts (dense)";
  return absl::StrCat("top ", routing.top_k, " of ", routing.num_experts, " experts at ",
                      routing.sparse_layers.size(), " of ", routing.num_hidden_layers, " layers");
}

// A trainer that cannot train everything the dispatcher accepts would fail a planned batch on
// every retry: it is refused at registration, with the flag that reconciles the two.
absl::Status CheckTrainerNeeds(const v1::RegisterTrainerRequest& trainer,
                               const TrajectoryLimits& limits) {
  const std::string who =
      absl::StrCat("trainer '", trainer.trainer_id(), "' (rank ", trainer.rank(), ")");
  if (trainer.vocab_size() > 0 &&
      (limits.vocab_size <= 0 || limits.vocab_size > trainer.vocab_size())) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, ": its model has a vocabulary of ", trainer.vocab_size(),
                     " tokens, but the dispatcher accepts ",
                     limits.vocab_size <= 0 ? std::string("any token id")
                                            : absl::StrCat("token ids below ", limits.vocab_size),
                     ": start dta-dispatcher with --vocab_size=", trainer.vocab_size()));
  }
  if (trainer.needs_ref_logprobs() && !limits.require_ref_logprobs) {
    return absl::FailedPreconditionError(
        absl::StrCat(who,
                     ": its loss has a KL penalty (--kl_coef) and needs ref_logprobs, which the "
                     "dispatcher does not "
                     "require: start dta-dispatcher with --require_ref_logprobs"));
  }
  // Routed experts are checked against the model the dispatcher was told of: it must be the
  // trainer's (a dense trainer's shape has no experts).
  const RoutingShape routing{
      .num_hidden_layers = trainer.num_hidden_layers(),
      .sparse_layers = {trainer.sparse_layers().begin(), trainer.sparse_layers().end()},
      .top_k = trainer.experts_per_token(),
      .num_experts = trainer.num_experts()};
  if (limits.routing && *limits.routing != routing) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, ": its model routes ", DescribeRouting(routing),
                     ", but the dispatcher checks routed experts against a model that routes ",
                     DescribeRouting(*limits.routing),
                     ": start dta-dispatcher with the trainers' model as --routed_experts_model"));
  }
  if (trainer.needs_advantages() && !limits.require_reward_or_advantages) {
    return absl::FailedPreconditionError(
        absl::StrCat(who,
                     ": its loss needs a reward or advantages per trajectory, which the dispatcher "
                     "does not require "
                     "(--sft): start dta-dispatcher without --sft, or train with --loss=sft"));
  }
  return absl::OkStatus();
}

std::string HumanCount(double n) {
  if (n >= 1e9) return absl::StrFormat("%.2fG", n / 1e9);
  if (n >= 1e6) return absl::StrFormat("%.2fM", n / 1e6);
  if (n >= 1e4) return absl::StrFormat("%.1fK", n / 1e3);
  return absl::StrFormat("%.0f", n);
}

}  // namespace

DispatcherCore::DispatcherCore(DispatcherOptions options) : options_(std::move(options)) {}

DispatcherCore::~DispatcherCore() = default;

absl::StatusOr<std::unique_ptr<DispatcherCore>> DispatcherCore::Open(DispatcherOptions options) {
  if (options.wal_path.empty())
    return absl::InvalidArgumentError("dispatcher: 'wal_path' is required");
  RETURN_IF_ERROR(ValidateBatchOptions(options.batch));
  if (options.max_pending_trajectories < 1 ||
      options.max_pending_trajectories < options.batch.rollouts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dispatcher: 'max_pending_trajectories' (", options.max_pending_trajectories,
        ") must be >= 1 and hold a batch of 'rollouts' (", options.batch.rollouts, ")"));
  }
  std::unique_ptr<DispatcherCore> core(new DispatcherCore(std::move(options)));
  absl::MutexLock lock(&core->mu_);
  absl::StatusOr<std::unique_ptr<WriteAheadLog>> wal =
      WriteAheadLog::Open({.path = core->options_.wal_path,
                           .sync = core->options_.wal_sync,
                           .max_record_bytes = core->options_.wal_max_record_bytes},
                          [&core](const WalRecord& record)
                              ABSL_NO_THREAD_SAFETY_ANALYSIS { return core->Replay(record); });
  if (!wal.ok()) return wal.status();
  RETURN_IF_ERROR(core->CheckUnreleased());
  core->wal_ = *std::move(wal);
  RETURN_IF_ERROR(core->wal_->Append(kOpenRecord, ""));
  core->incarnation_ += 1;
  core->generation_ = core->incarnation_ << kGenerationBits;
  core->Log(absl::StrFormat(
      "dispatcher: log %s: %d records replayed (%d torn bytes dropped); %d steps committed, %d "
      "trajectories "
      "pending, start #%d",
      core->options_.wal_path, core->wal_->records_replayed(), core->wal_->truncated_tail_bytes(),
      core->committed_, core->pending_.size(), core->incarnation_));
  core->MaybeCompact();
  return core;
}

absl::Status DispatcherCore::Replay(const WalRecord& record) {
  const std::string& path = options_.wal_path;
  switch (record.type) {
    case kOpenRecord:
      incarnation_ += 1;
      return absl::OkStatus();
    case kTrajectoryRecord: {
      v1::Trajectory trajectory;
      RETURN_IF_ERROR(ParseRecord(record, path, "trajectory", trajectory));
      if (trajectories_.contains(trajectory.id()) || retired_.contains(trajectory.id())) {
        return absl::DataLossError(
            absl::StrCat(path, ": trajectory '", trajectory.id(), "' is stored twice"));
      }
      std::map<std::string, std::string> metadata(trajectory.metadata().begin(),
                                                  trajectory.metadata().end());
      const std::string id = trajectory.id();
      Rollout rollout = RolloutFromTrajectory(trajectory);
      const uint64_t fingerprint = Fingerprint(rollout, metadata);
      AddPending(id, std::move(rollout), std::move(metadata), fingerprint,
                 static_cast<int64_t>(record.payload.size()));
      return absl::OkStatus();
    }
    case kPlanRecord: {
      v1::StepPlanRecord plan;
      RETURN_IF_ERROR(ParseRecord(record, path, "step plan", plan));
      return ApplyPlan(plan);
    }
    case kCommitRecord: {
      v1::StepCommitRecord commit;
      RETURN_IF_ERROR(ParseRecord(record, path, "step commit", commit));
      if (commit.step() != committed_ || !plans_.contains(commit.step())) {
        return absl::DataLossError(absl::StrCat(path, ": commit of step ", commit.step(), " after ",
                                                committed_, " committed steps"));
      }
      ApplyCommit(commit);
      return absl::OkStatus();
    }
    case kCheckpointRecord: {
      v1::CheckpointRecord checkpoint;
      RETURN_IF_ERROR(ParseRecord(record, path, "checkpoint", checkpoint));
      if (checkpoint.step() > committed_) {
        return absl::DataLossError(absl::StrCat(path, ": checkpoint at step ", checkpoint.step(),
                                                " after ", committed_, " committed steps"));
      }
      ApplyCheckpoint(checkpoint.step());
      return absl::OkStatus();
    }
    case kSnapshotRecord: {
      v1::SnapshotRecord snapshot;
      RETURN_IF_ERROR(ParseRecord(record, path, "snapshot", snapshot));
      return ApplySnapshot(snapshot);
    }
    case kRetiredRecord: {
      v1::RetiredRecord retired;
      RETURN_IF_ERROR(ParseRecord(record, path, "retired", retired));
      if (retired.ids_size() != retired.fingerprints_size()) {
        return absl::DataLossError(absl::StrCat(path, ": a retired record has ", retired.ids_size(),
                                                " ids and ", retired.fingerprints_size(),
                                                " fingerprints"));
      }
      for (int i = 0; i < retired.ids_size(); ++i) {
        const std::string& id = retired.ids(i);
        if (trajectories_.contains(id) || !retired_.emplace(id, retired.fingerprints(i)).second) {
          return absl::DataLossError(absl::StrCat(path, ": trajectory '", id, "' is stored twice"));
        }
        live_log_bytes_ += static_cast<int64_t>(id.size()) + kRetiredIdOverhead;
      }
      return absl::OkStatus();
    }
    default:
      return absl::DataLossError(absl::StrCat(path, ": unknown record type ", record.type));
  }
}

absl::Status DispatcherCore::ApplySnapshot(const v1::SnapshotRecord& record) {
  // Only a compaction writes one, as the log's first record.
  if (incarnation_ != 0 || committed_ != 0 || !trajectories_.empty() || !retired_.empty() ||
      !plans_.empty()) {
    return absl::DataLossError(
        absl::StrCat(options_.wal_path, ": a snapshot record after other records"));
  }
  if (record.starts() < 0 || record.committed_steps() < 0) {
    return absl::DataLossError(
        absl::StrCat(options_.wal_path, ": a snapshot record with negative counts"));
  }
  incarnation_ = record.starts();
  committed_ = record.committed_steps();
  released_before_ = record.committed_steps();
  statistics_ = record.statistics();
  statistics_.set_committed_steps(committed_);
  return absl::OkStatus();
}

void DispatcherCore::AddPending(const std::string& id, Rollout rollout,
                                std::map<std::string, std::string> metadata, uint64_t fingerprint,
                                int64_t log_bytes) {
  Stored& stored = trajectories_[id];
  stored.state = State::kPending;
  stored.fingerprint = fingerprint;
  stored.sequence = next_sequence_++;
  stored.log_bytes = log_bytes;
  stored.rollout = std::move(rollout);
  stored.metadata = std::move(metadata);
  pending_.emplace(stored.sequence, id);
  pending_count_.store(static_cast<int64_t>(pending_.size()), std::memory_order_relaxed);
  live_log_bytes_ += kWalHeaderBytes + log_bytes;
  statistics_.set_accepted(statistics_.accepted() + 1);
  Changed();
}

absl::Status DispatcherCore::ApplyPlan(const v1::StepPlanRecord& record) {
  if (record.step() != (plans_.empty() ? committed_ : plans_.rbegin()->first + 1)) {
    return absl::DataLossError(absl::StrCat(options_.wal_path, ": plan of step ", record.step(),
                                            " after ", committed_, " committed steps and ",
                                            plans_.size(), " plans"));
  }
  Plan plan;
  plan.record = record;
  auto take = [&](const std::string& id, State state)
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    auto it = trajectories_.find(id);
    if (it == trajectories_.end() || it->second.state != State::kPending) {
      return absl::DataLossError(absl::StrCat(options_.wal_path, ": step ", record.step(),
                                              " plans trajectory '", id,
                                              "', which is not pending"));
    }
    it->second.state = state;
    pending_.erase(it->second.sequence);
    pending_count_.store(static_cast<int64_t>(pending_.size()), std::memory_order_relaxed);
    if (state == State::kPlanned)
      plan.rollout_tokens += static_cast<int64_t>(it->second.rollout->tokens.size());
    return absl::OkStatus();
  };
  for (const std::string& id : record.ids()) {
    RETURN_IF_ERROR(take(id, State::kPlanned));
  }
  // A dropped trajectory is kept (not trained) until its step is released: a compaction rewrites
  // the step's plan, which names it.
  for (const std::string& id : record.stale_ids()) {
    RETURN_IF_ERROR(take(id, State::kDropped));
  }
  statistics_.set_dropped_stale(statistics_.dropped_stale() + record.stale_ids_size());
  live_log_bytes_ += kWalHeaderBytes + static_cast<int64_t>(record.ByteSizeLong());
  plans_[record.step()] = std::move(plan);
  Changed();
  return absl::OkStatus();
}

void DispatcherCore::ApplyCommit(const v1::StepCommitRecord& record) {
  Plan& plan = plans_.at(record.step());
  for (const std::string& id : plan.record.ids()) trajectories_[id].state = State::kTrained;
  plan.commit = record;
  committed_ = record.step() + 1;
  prepared_.clear();
  statistics_.set_committed_steps(committed_);
  statistics_.set_trained_rollouts(statistics_.trained_rollouts() + plan.record.ids_size());
  *statistics_.add_recent_steps() = record.statistics();
  if (statistics_.recent_steps_size() > options_.recent_steps) {
    statistics_.mutable_recent_steps()->DeleteSubrange(
        0, statistics_.recent_steps_size() - options_.recent_steps);
  }
  live_log_bytes_ += kWalHeaderBytes + static_cast<int64_t>(record.ByteSizeLong());
  Changed();
}

void DispatcherCore::ApplyCheckpoint(int64_t step) {
  // Steps before `step` are in every trainer's checkpoint: they are never served again, and of
  // their trajectories only the ids and fingerprints are kept (to recognise resends).
  auto retire = [this](const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = trajectories_.find(id);
    live_log_bytes_ -= kWalHeaderBytes + it->second.log_bytes;
    live_log_bytes_ += static_cast<int64_t>(id.size()) + kRetiredIdOverhead;
    retired_.emplace(id, it->second.fingerprint);
    trajectories_.erase(it);
  };
  auto it = plans_.begin();
  for (; it != plans_.end() && it->first < step; ++it) {
    for (const std::string& id : it->second.record.ids()) retire(id);
    for (const std::string& id : it->second.record.stale_ids()) retire(id);
    live_log_bytes_ -= 2 * kWalHeaderBytes +
                       static_cast<int64_t>(it->second.record.ByteSizeLong()) +
                       static_cast<int64_t>(it->second.commit->ByteSizeLong());
  }
  plans_.erase(plans_.begin(), it);
  released_before_ = std::max(released_before_, step);
}

absl::StatusOr<v1::IngestResponse> DispatcherCore::Ingest(const v1::Trajectory& trajectory) {
  const std::string& id = trajectory.id();
  absl::StatusOr<Rollout> rollout = CheckTrajectory(trajectory, options_.limits);
  if (!rollout.ok()) {
    absl::MutexLock lock(&mu_);
    const std::string field = FieldOfError(rollout.status());
    CountRejection(field);
    return Rejected(id, field, std::string(rollout.status().message()));
  }
  std::map<std::string, std::string> metadata(trajectory.metadata().begin(),
                                              trajectory.metadata().end());
  const std::string bytes = KnownFieldBytes(trajectory);
  if (const uint32_t limit = options_.wal_max_record_bytes; bytes.size() > limit) {
    // Refused for good, not UNAVAILABLE: resending the same trajectory can never succeed.
    absl::MutexLock lock(&mu_);
    CountRejection("tokens");
    return Rejected(id, "tokens",
                    absl::StrCat("field 'tokens': the trajectory takes ", bytes.size(),
                                 " bytes in the log, over its limit of ", limit,
                                 " bytes per record (", rollout->tokens.size(), " tokens)"));
  }
  const uint64_t fingerprint = Fingerprint(*rollout, metadata);
  {
    absl::MutexLock lock(&mu_);
    // Wait while a compaction runs, and while the same id on another stream is being stored (for
    // its outcome).
    auto settled = [this, &id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (compacting_) return false;
      auto it = trajectories_.find(id);
      return it == trajectories_.end() || it->second.state != State::kAppending;
    };
    mu_.Await(absl::Condition(&settled));
    std::optional<uint64_t> known;
    if (auto it = trajectories_.find(id); it != trajectories_.end()) known = it->second.fingerprint;
    if (auto it = retired_.find(id); it != retired_.end()) known = it->second;
    if (known.has_value()) {
      if (*known != fingerprint) {
        CountRejection("id");
        return Rejected(
            id, "id",
            absl::StrCat("field 'id': '", id, "' was accepted before with other content"));
      }
      statistics_.set_already_accepted(statistics_.already_accepted() + 1);
      return Accepted(id, /*already_accepted=*/true);
    }
    // The pending pool's limit is hard: appends in flight count, and nothing is taken beyond it
    // (the caller waits for room and asks again).
    if (static_cast<int64_t>(pending_.size()) + appending_ >= options_.max_pending_trajectories) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the pending pool is full (", options_.max_pending_trajectories,
                       " trajectories wait for a batch): '", id,
                       "' was not stored; ask again when there is room"));
    }
    trajectories_[id].state = State::kAppending;  // reserve the id while the log syncs
    ++appending_;
  }
  // Concurrent ingests share the log's sync (group commit): the state lock is not held here.
  const absl::Status stored = wal_->Append(kTrajectoryRecord, bytes);
  absl::MutexLock lock(&mu_);
  --appending_;
  if (!stored.ok()) {
    NoteLogFailure(stored);
    trajectories_.erase(id);
    return absl::UnavailableError(
        absl::StrCat("trajectory '", id, "' not stored: ", stored.message()));
  }
  AddPending(id, *std::move(rollout), std::move(metadata), fingerprint,
             static_cast<int64_t>(bytes.size()));
  return Accepted(id, /*already_accepted=*/false);
}

void DispatcherCore::CountRejection(const std::string& field) {
  statistics_.set_rejected(statistics_.rejected() + 1);
  (*statistics_.mutable_rejected_by_field())[field] += 1;
}

bool DispatcherCore::HasRoom() const {
  return pending_count_.load(std::memory_order_relaxed) < options_.max_pending_trajectories;
}

bool DispatcherCore::AwaitRoom(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return static_cast<int64_t>(pending_.size()) + appending_ < options_.max_pending_trajectories;
  };
  return mu_.AwaitWithDeadline(absl::Condition(&room), deadline);
}

uint64_t DispatcherCore::change_count() const {
  absl::MutexLock lock(&mu_);
  return change_count_;
}

void DispatcherCore::AwaitChange(uint64_t seen, absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto changed = [this, seen]()
                     ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return change_count_ != seen; };
  mu_.AwaitWithDeadline(absl::Condition(&changed), deadline);
}

void DispatcherCore::NewGeneration(const std::string& why) {
  generation_ += 1;
  members_.clear();
  prepared_.clear();
  Log(absl::StrFormat("dispatcher: generation %d: %s",
                      generation_ & ((int64_t{1} << kGenerationBits) - 1), why));
  Changed();
}

bool DispatcherCore::GenerationComplete() const {
  return world_size_ > 0 && static_cast<int32_t>(members_.size()) == world_size_;
}

absl::StatusOr<v1::RegisterTrainerResponse> DispatcherCore::RegisterTrainer(
    const v1::RegisterTrainerRequest& request) {
  if (request.world_size() < 1 || request.rank() < 0 || request.rank() >= request.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", request.rank(), " is outside world size ", request.world_size()));
  }
  if (request.trainer_id().empty()) return absl::InvalidArgumentError("field 'trainer_id': empty");
  RETURN_IF_ERROR(CheckTrainerNeeds(request, options_.limits));
  absl::MutexLock lock(&mu_);
  if (request.resume_step() < 0 || request.resume_step() > committed_) {
    return absl::FailedPreconditionError(
        absl::StrCat("trainer '", request.trainer_id(), "' resumes after ", request.resume_step(),
                     " steps, but ", committed_, " are committed"));
  }
  if (request.world_size() != world_size_) {
    NewGeneration(absl::StrCat("world size ", world_size_, " -> ", request.world_size()));
    world_size_ = request.world_size();
  } else {
    auto member = members_.find(request.rank());
    if (member != members_.end() && member->second != request.trainer_id()) {
      NewGeneration(
          absl::StrCat("rank ", request.rank(), " is now trainer '", request.trainer_id(), "'"));
    }
  }
  members_[request.rank()] = request.trainer_id();
  if (GenerationComplete()) {
    Log(absl::StrFormat("dispatcher: generation %d complete: %d trainers",
                        generation_ & ((int64_t{1} << kGenerationBits) - 1), world_size_));
  }
  Changed();
  v1::RegisterTrainerResponse response;
  response.set_generation(generation_);
  response.set_next_step(request.resume_step());
  response.set_committed_steps(committed_);
  response.set_policy_version(options_.initial_policy_version + committed_);
  return response;
}

absl::Status DispatcherCore::EnsurePlan(int64_t step) {
  if (plans_.contains(step)) return absl::OkStatus();
  std::vector<const Rollout*> pending;
  std::vector<const std::string*> ids;
  pending.reserve(pending_.size());
  for (const auto& [sequence, id] : pending_) {
    pending.push_back(&*trajectories_.at(id).rollout);
    ids.push_back(&id);
  }
  const int64_t policy_version = options_.initial_policy_version + step;
  const BatchSelection selection = SelectBatch(pending, policy_version, options_.batch);
  if (!selection.ready) {
    return absl::UnavailableError(absl::StrCat(
        "step ", step, ": waiting for trajectories (", selection.fresh_rollouts, " rollouts, ",
        selection.fresh_tokens, " tokens pending; a batch is ",
        options_.batch.rollouts > 0 ? absl::StrCat(options_.batch.rollouts, " rollouts")
                                    : absl::StrCat(options_.batch.tokens, " tokens"),
        ")"));
  }
  // A logged plan is served until it commits: check first that its advantages can be computed,
  // so that nothing untrainable is ever made durable (the trajectory checks should make this
  // impossible).
  std::vector<const Rollout*> batch;
  for (int64_t i : selection.batch) batch.push_back(pending[i]);
  if (options_.limits.require_reward_or_advantages) {
    if (absl::StatusOr<std::vector<float>> advantages =
            GroupRewardAdvantages(batch, options_.batch.advantages);
        !advantages.ok()) {
      return absl::InternalError(absl::StrCat(
          "step ", step, ": the batch cannot be trained: ", advantages.status().message()));
    }
  }
  v1::StepPlanRecord record;
  record.set_step(step);
  record.set_policy_version(policy_version);
  for (int64_t i : selection.batch) record.add_ids(*ids[i]);
  for (int64_t i : selection.stale) record.add_stale_ids(*ids[i]);
  // Logged before any trainer sees it: the batch of a step never changes.
  if (absl::Status status = wal_->Append(kPlanRecord, DeterministicBytes(record)); !status.ok()) {
    NoteLogFailure(status);
    return absl::UnavailableError(
        absl::StrCat("step ", step, ": plan not stored: ", status.message()));
  }
  if (!selection.stale.empty()) {
    Log(absl::StrFormat(
        "dispatcher: step %d: dropped %d trajectories older than %d versions (e.g. '%s')", step,
        selection.stale.size(), options_.batch.max_staleness, *ids[selection.stale.front()]));
  }
  return ApplyPlan(record);
}

absl::StatusOr<const PartitionPlan*> DispatcherCore::Split(int64_t step) {
  const auto key = std::make_pair(step, world_size_);
  auto cached = splits_.find(key);
  if (cached != splits_.end()) return &cached->second;
  std::vector<const Rollout*> batch;
  for (const std::string& id : plans_.at(step).record.ids())
    batch.push_back(&*trajectories_.at(id).rollout);
  absl::StatusOr<PartitionPlan> plan =
      PlanPartitions(batch, world_size_, options_.limits.require_reward_or_advantages,
                     options_.batch.advantages, options_.batch.balance);
  if (!plan.ok()) return plan.status();
  // Only the splits of steps that may still be served are kept.
  splits_.erase(splits_.begin(), splits_.lower_bound(std::make_pair(released_before_, 0)));
  return &splits_.emplace(key, *std::move(plan)).first->second;
}

absl::StatusOr<v1::Partition> DispatcherCore::FetchPartition(
    const v1::FetchPartitionRequest& request) {
  absl::MutexLock lock(&mu_);
  const int64_t step = request.step();
  if (request.generation() != generation_) {
    return absl::AbortedError(absl::StrCat("generation ", request.generation(), " is over (now ",
                                           generation_, "): register again"));
  }
  if (!GenerationComplete()) {
    return absl::UnavailableError(absl::StrCat("waiting for trainers: ", members_.size(), " of ",
                                               world_size_, " registered"));
  }
  if (request.rank() < 0 || request.rank() >= world_size_ || !members_.contains(request.rank())) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", request.rank(), " is not in the generation"));
  }
  if (step > committed_ || step < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " is not next: ", committed_, " steps are committed"));
  }
  if (step < released_before_) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " was released after a checkpoint at step ", released_before_,
                     ": resume from a checkpoint at or after it"));
  }
  RETURN_IF_ERROR(EnsurePlan(step));
  absl::StatusOr<const PartitionPlan*> split = Split(step);
  if (!split.ok()) return split.status();
  const PartitionPlan& plan = **split;
  const Plan& batch = plans_.at(step);
  v1::Partition partition;
  partition.set_step(step);
  partition.set_rank(request.rank());
  partition.set_world_size(world_size_);
  partition.set_generation(generation_);
  partition.set_total_loss_tokens(plan.context.total_loss_tokens);
  partition.set_num_rollouts(plan.context.num_rollouts);
  partition.set_policy_version(batch.record.policy_version());
  partition.set_replay(step < committed_);
  partition.set_tree_tokens(plan.partition.tree_tokens[request.rank()]);
  int64_t rollout_tokens = 0;
  for (int64_t i : plan.ranks[request.rank()]) {
    const Stored& stored = trajectories_.at(batch.record.ids(static_cast<int>(i)));
    v1::Trajectory* trajectory = partition.add_trajectories();
    *trajectory = TrajectoryFromRollout(*stored.rollout);
    if (!plan.advantages.empty() && stored.rollout->advantages.empty()) {
      trajectory->mutable_advantages()->Resize(static_cast<int>(stored.rollout->tokens.size()),
                                               plan.advantages[i]);
    }
    trajectory->mutable_metadata()->insert(stored.metadata.begin(), stored.metadata.end());
    rollout_tokens += trajectory->tokens_size();
  }
  partition.set_rollout_tokens(rollout_tokens);
  return partition;
}

absl::StatusOr<v1::ReportStepResponse> DispatcherCore::ReportStep(const v1::StepReport& report) {
  absl::MutexLock lock(&mu_);
  v1::ReportStepResponse response;
  const int64_t step = report.step();
  if (report.phase() == v1::StepReport::PHASE_UNSPECIFIED) {
    return absl::InvalidArgumentError("field 'phase': unspecified");
  }
  if (report.generation() != generation_) {
    response.set_decision(v1::ReportStepResponse::ABORT);
    return response;
  }
  if (report.phase() == v1::StepReport::FAILED) {
    statistics_.set_aborted_steps(statistics_.aborted_steps() + 1);
    NewGeneration(absl::StrCat("step ", step, " abandoned: rank ", report.rank(),
                               " failed: ", report.error()));
    response.set_decision(v1::ReportStepResponse::ABORT);
    return response;
  }
  if (step < committed_) {  // already durable (a replay, or a rank asking again after the commit)
    response.set_decision(v1::ReportStepResponse::COMMIT);
    response.set_policy_version(options_.initial_policy_version + step + 1);
    return response;
  }
  if (step > committed_ || !plans_.contains(step) ||
      !splits_.contains(std::make_pair(step, world_size_))) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", report.rank(), " reports step ",
                                                      step, ", which it has not fetched (",
                                                      committed_, " steps are committed)"));
  }
  if (!members_.contains(report.rank())) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", report.rank(), " is not in the generation"));
  }
  if (prepared_.empty()) first_prepared_ = absl::Now();  // a rank asking again does not restart it
  prepared_[report.rank()] = report;
  checkpoints_[report.rank()] = report.checkpoint_step();
  if (static_cast<int32_t>(prepared_.size()) < world_size_) {
    if (absl::Now() - first_prepared_ >= options_.prepare_timeout) {
      std::vector<int32_t> missing;
      for (int32_t rank = 0; rank < world_size_; ++rank) {
        if (!prepared_.contains(rank)) missing.push_back(rank);
      }
      statistics_.set_aborted_steps(statistics_.aborted_steps() + 1);
      NewGeneration(absl::StrCat("step ", step, " abandoned: rank ",
                                 absl::StrJoin(missing, ", rank "), " did not report within ",
                                 absl::FormatDuration(options_.prepare_timeout),
                                 " of the first PREPARED"));
      response.set_decision(v1::ReportStepResponse::ABORT);
      return response;
    }
    response.set_decision(v1::ReportStepResponse::PENDING);
    return response;
  }
  // Every rank prepared: commit durably, then tell them.
  const PartitionPlan& split = splits_.at(std::make_pair(step, world_size_));
  const Plan& plan = plans_.at(step);
  v1::StepCommitRecord commit;
  commit.set_step(step);
  commit.set_generation(generation_);
  v1::StepStatistics* stats = commit.mutable_statistics();
  stats->set_step(step);
  stats->set_rollouts(plan.record.ids_size());
  stats->set_rollout_tokens(plan.rollout_tokens);
  stats->set_tree_tokens(split.partition.combined_tree_tokens);
  stats->set_compression(split.partition.combined_tree_tokens > 0
                             ? static_cast<double>(plan.rollout_tokens) /
                                   split.partition.combined_tree_tokens
                             : 0);
  stats->set_imbalance(split.partition.imbalance);
  stats->set_extra_tokens(split.partition.extra_tokens);
  stats->set_dropped_stale(plan.record.stale_ids_size());
  double seconds = 0;
  double loss = 0;
  for (const auto& [rank, prepared] : prepared_) {
    seconds = std::max(seconds, prepared.seconds());
    loss += prepared.loss();
  }
  stats->set_seconds(seconds);
  stats->set_loss(loss);
  stats->set_tokens_per_second(seconds > 0 ? plan.rollout_tokens / seconds : 0);
  if (absl::Status status = wal_->Append(kCommitRecord, DeterministicBytes(commit)); !status.ok()) {
    NoteLogFailure(status);
    return absl::UnavailableError(
        absl::StrCat("step ", step, ": commit not stored: ", status.message()));
  }
  ApplyCommit(commit);
  Log(absl::StrFormat(
      "step %d: %d rollouts, %s tokens, C=%.2f, imbalance %.3f, extra %s tokens, %.2f s, %s "
      "tokens/s, "
      "loss %.6g%s",
      step, stats->rollouts(), HumanCount(stats->rollout_tokens()), stats->compression(),
      stats->imbalance(), HumanCount(stats->extra_tokens()), stats->seconds(),
      HumanCount(stats->tokens_per_second()), stats->loss(),
      stats->dropped_stale() > 0 ? absl::StrCat(", ", stats->dropped_stale(), " stale dropped")
                                 : ""));
  // Trajectories every rank's checkpoint holds are not needed for replay any more.
  int64_t checkpoint = committed_;
  for (int32_t rank = 0; rank < world_size_; ++rank) {
    auto it = checkpoints_.find(rank);
    checkpoint = std::min(checkpoint, it == checkpoints_.end() ? 0 : it->second);
  }
  if (checkpoint > released_before_) {
    v1::CheckpointRecord record;
    record.set_step(checkpoint);
    if (absl::Status status = wal_->Append(kCheckpointRecord, DeterministicBytes(record));
        status.ok()) {
      ApplyCheckpoint(checkpoint);
    } else {
      NoteLogFailure(status);
    }
  }
  response.set_decision(v1::ReportStepResponse::COMMIT);
  response.set_policy_version(options_.initial_policy_version + committed_);
  // Released steps may have left the log mostly dead. (The step is durable already: a failed
  // compaction changes nothing for it.)
  MaybeCompact();
  return response;
}

absl::Status DispatcherCore::CheckUnreleased() const {
  int64_t refused = 0;
  std::pair<int64_t, std::string> first;  // the oldest refused: sequence, why
  for (const auto& [id, stored] : trajectories_) {
    if (stored.state == State::kDropped || !stored.rollout.has_value()) continue;  // never trained
    v1::Trajectory trajectory = TrajectoryFromRollout(*stored.rollout);
    trajectory.mutable_metadata()->insert(stored.metadata.begin(), stored.metadata.end());
    const absl::StatusOr<Rollout> checked = CheckTrajectory(trajectory, options_.limits);
    if (checked.ok()) continue;
    if (refused++ == 0 || stored.sequence < first.first) {
      first = {stored.sequence, absl::StrCat("'", id, "': ", checked.status().message())};
    }
  }
  if (refused == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      options_.wal_path, ": ", refused,
      " trajectories that may still be trained (pending, or in steps no checkpoint "
      "covers yet) were accepted under other limits and break these, e.g. ",
      first.second,
      ": restart with the limits they were accepted under (--vocab_size, --max_tokens, --sft, "
      "--require_ref_logprobs) until they are trained"));
}

void DispatcherCore::MaybeCompact() {
  if (options_.wal_compact_bytes <= 0 || compacting_ || !log_failure_.ok()) return;
  const int64_t file_bytes = wal_->file_bytes();
  if (file_bytes < std::max(options_.wal_compact_bytes, next_compaction_bytes_) ||
      file_bytes < 2 * live_log_bytes_) {
    return;
  }
  const absl::Time start = absl::Now();
  const absl::Status status = Compact();
  if (!status.ok()) {
    // A failed rewrite leaves the old log in place and usable, unless it failed after the rename.
    // Whatever failed (a full disk, say) would likely fail again: wait until the log doubles.
    if (status.code() == absl::StatusCode::kDataLoss) NoteLogFailure(status);
    next_compaction_bytes_ = 2 * file_bytes;
    Log(absl::StrCat("dispatcher: log compaction failed, the log is kept as it was (next try at ",
                     HumanCount(next_compaction_bytes_), " bytes): ", status.ToString()));
    return;
  }
  next_compaction_bytes_ = 0;
  Log(absl::StrFormat(
      "dispatcher: log compacted: %s -> %s bytes (%d trajectories kept, %d retired ids) in %.2f s",
      HumanCount(file_bytes), HumanCount(wal_->file_bytes()), trajectories_.size(), retired_.size(),
      absl::ToDoubleSeconds(absl::Now() - start)));
}

absl::Status DispatcherCore::Compact() {
  compacting_ = true;  // Ingest waits before reserving an id
  auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return appending_ == 0; };
  mu_.Await(absl::Condition(&drained));
  // From here until the rewrite is done nothing else appends: trajectory appends wait for
  // compacting_, plans, commits and checkpoints for mu_. So the records below rebuild exactly the
  // current state, and no acknowledged record can be appended to the old file and lost.

  // Replaying the rewritten records counts them again: the snapshot carries the counters without
  // their part.
  std::vector<std::pair<int64_t, const Stored*>> kept;  // acceptance order
  kept.reserve(trajectories_.size());
  for (const auto& [id, stored] : trajectories_) kept.emplace_back(stored.sequence, &stored);
  std::sort(kept.begin(), kept.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  v1::SnapshotRecord snapshot;
  snapshot.set_starts(incarnation_);
  snapshot.set_committed_steps(released_before_);
  v1::GetStatisticsResponse& base = *snapshot.mutable_statistics();
  int64_t dropped = 0;
  int64_t trained = 0;
  for (const auto& [step, plan] : plans_) {
    dropped += plan.record.stale_ids_size();
    if (plan.commit.has_value()) trained += plan.record.ids_size();
  }
  base.set_accepted(statistics_.accepted() - static_cast<int64_t>(kept.size()));
  base.set_dropped_stale(statistics_.dropped_stale() - dropped);
  base.set_trained_rollouts(statistics_.trained_rollouts() - trained);
  for (const v1::StepStatistics& step : statistics_.recent_steps()) {
    if (step.step() < released_before_) *base.add_recent_steps() = step;
  }

  // The records, produced one at a time: snapshot, retired ids, trajectories, plans, commits.
  enum class Part { kSnapshot, kRetired, kTrajectories, kPlans, kCommits, kDone };
  Part part = Part::kSnapshot;
  auto retired = retired_.begin();
  size_t trajectory = 0;
  auto plan = plans_.begin();
  auto next = [&](WalRecord& record, std::string& scratch)
                  ABSL_NO_THREAD_SAFETY_ANALYSIS -> absl::StatusOr<bool> {
    while (true) {
      switch (part) {
        case Part::kSnapshot:
          scratch = DeterministicBytes(snapshot);
          record = {kSnapshotRecord, scratch};
          part = Part::kRetired;
          return true;
        case Part::kRetired:
          if (retired != retired_.end()) {
            v1::RetiredRecord chunk;
            for (int i = 0; i < kRetiredIdsPerRecord && retired != retired_.end(); ++i, ++retired) {
              chunk.add_ids(retired->first);
              chunk.add_fingerprints(retired->second);
            }
            scratch = DeterministicBytes(chunk);
            record = {kRetiredRecord, scratch};
            return true;
          }
          part = Part::kTrajectories;
          break;
        case Part::kTrajectories:
          if (trajectory < kept.size()) {
            const Stored& stored = *kept[trajectory++].second;
            scratch = StoredBytes(*stored.rollout, stored.metadata);
            record = {kTrajectoryRecord, scratch};
            return true;
          }
          part = Part::kPlans;
          plan = plans_.begin();
          break;
        case Part::kPlans:
          if (plan != plans_.end()) {
            scratch = DeterministicBytes((plan++)->second.record);
            record = {kPlanRecord, scratch};
            return true;
          }
          part = Part::kCommits;
          plan = plans_.begin();
          break;
        case Part::kCommits:
          if (plan != plans_.end() && plan->second.commit.has_value()) {
            scratch = DeterministicBytes(*(plan++)->second.commit);
            record = {kCommitRecord, scratch};
            return true;
          }
          part = Part::kDone;
          break;
        case Part::kDone:
          return false;
      }
    }
  };
  const absl::Status status = wal_->RewriteFrom(next);
  compacting_ = false;
  Changed();
  if (status.ok()) ++compactions_;
  return status;
}

void DispatcherCore::NoteLogFailure(const absl::Status& status) {
  if (status.ok() || status.code() == absl::StatusCode::kInvalidArgument || !log_failure_.ok())
    return;
  log_failure_ = status;
  Log(absl::StrCat("dispatcher: the write-ahead log failed, nothing more can be acknowledged: ",
                   status.ToString()));
  Changed();
}

absl::Status DispatcherCore::Health() const {
  absl::MutexLock lock(&mu_);
  return log_failure_;
}

v1::GetStatusResponse DispatcherCore::GetStatus() const {
  absl::MutexLock lock(&mu_);
  v1::GetStatusResponse status;
  status.set_serving(log_failure_.ok());
  status.set_committed_steps(committed_);
  status.set_policy_version(options_.initial_policy_version + committed_);
  status.set_generation(generation_);
  status.set_registered_trainers(static_cast<int32_t>(members_.size()));
  status.set_world_size(world_size_);
  status.set_pending_trajectories(static_cast<int64_t>(pending_.size()));
  return status;
}

v1::GetStatisticsResponse DispatcherCore::GetStatistics() const {
  absl::MutexLock lock(&mu_);
  v1::GetStatisticsResponse statistics = statistics_;
  statistics.set_wal_bytes(wal_->file_bytes());
  statistics.set_wal_syncs(wal_->syncs_performed());
  statistics.set_wal_compactions(compactions_);
  statistics.set_retired_ids(static_cast<int64_t>(retired_.size()));
  return statistics;
}

void DispatcherCore::Log(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

}  // namespace dta

// The dispatcher's state machine, without the network: ingestion, durability, batching, the split
// across trainers, and the two-phase step commit. dispatcher/service wraps it in gRPC; tests drive
// it directly.
//
// Life of a trajectory:
//   Ingest     checked (CheckTrajectory, duplicate ids), appended to the write-ahead log and
//              synced, then acknowledged: from here on it is trained exactly once or dropped as
//              too stale (counted), whatever process dies.
//   plan       the first trainer to fetch step s fixes the step's batch (SelectBatch) and logs it
//              (a PLAN record): a step's batch never changes once a trainer may have seen it.
//   fetch      each rank gets its part (PlanPartitions: whole-batch advantages and normalisers, the
//              DFS-contiguous split over the current generation's world size).
//   commit     each rank reports PREPARED once its gradients are all-reduced; when every rank has,
//              a COMMIT record is logged and every rank is told to step its optimizer. A rank that
//              fails reports FAILED: the step is abandoned on every rank (they are told ABORT, and
//              the generation changes) and served again, re-split over the trainers present.
//
// Trainers and generations: a generation is a set of trainers {rank -> trainer_id} of one world
// size. A trainer registering with a new trainer_id for a rank the generation already has (a
// restarted process), or with another world size, starts a new generation; calls carrying an old
// generation are refused (ABORTED / ABORT) so that the survivors re-register and rebuild their
// process group. Generations are unique across dispatcher restarts (the log counts the restarts).
//
// Replay: trainers that resume from a checkpoint holding c committed steps fetch step c next; steps
// before the committed count are served again from their PLAN records (`replay` set), so a trainer
// group restarted from a checkpoint retrains exactly the committed batches, in order.
//
// Compaction: the log would grow forever, so once a checkpoint has released steps and the log is
// mostly dead records (wal_compact_bytes), it is rewritten (atomically, by WriteAheadLog's
// RewriteFrom) as a snapshot of the counters and committed steps, the ids and fingerprints of
// released trajectories (so resends are still recognised), the unreleased trajectories in
// acceptance order, and the plans and commits of unreleased steps: replaying it gives the same
// state as replaying the whole log. Ingestion pauses while it runs. Ids are kept forever: a
// trajectory is never trained twice, however late it is resent.
//
// Thread safety: every method may be called from any thread. Ingest blocks for the log's sync
// (concurrent calls share one sync); the other calls log while holding the state lock only when a
// step is planned or committed (once per step).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "dispatcher/batch/batch_plan.h"
#include "dispatcher/wal/wal.h"
#include "dispatcher/wire/trajectory.h"
#include "proto/dta/v1/dispatcher.pb.h"
#include "proto/dta/v1/log.pb.h"

namespace dta {

struct DispatcherOptions {
  // The write-ahead log (created if missing, replayed if present). Required.
  std::string wal_path;
  // Sync the log before acknowledging (false only for tests and benchmarks).
  bool wal_sync = true;
  // Compaction: once the log is at least this large and at least twice what it must keep (the
  // trajectories not yet released by a checkpoint, the plans and commits of their steps, the ids
  // of released ones), it is rewritten down to that (see "Compaction" above). 0: never.
  int64_t wal_compact_bytes = int64_t{1} << 30;
  // The largest log record: a trajectory that would take more is REJECTED at validation (naming
  // its size), never half-stored or refused as a failure the client would retry.
  uint32_t wal_max_record_bytes = WalOptions{}.max_record_bytes;
  // What a trajectory must satisfy. With require_reward_or_advantages (the default), the dispatcher
  // computes GRPO advantages over each whole batch and sends them with every partition.
  TrajectoryLimits limits;
  // How a step's batch is taken. Default: 64 rollouts.
  BatchOptions batch{.rollouts = 64};
  // Backpressure: accepted trajectories not yet in a batch, at most (the service stops reading
  // its streams while the count is reached; each stream may still have one in flight).
  int64_t max_pending_trajectories = 1 << 16;
  // A step some ranks prepared is abandoned (every rank told ABORT, a new generation, the step
  // served again) when another rank has not reported this long after the first did: it hung, died
  // without its launcher restarting the group, or lost the dispatcher. The ranks prepare right
  // after one all-reduce, so this only has to cover a report's round trip. Infinite: never.
  absl::Duration prepare_timeout = absl::Minutes(5);
  // Policy version of the weights before the first step.
  int64_t initial_policy_version = 0;
  // Steps kept for GetStatistics.
  int32_t recent_steps = 64;
  // Progress lines (one per step, one per generation change); default: standard error.
  std::function<void(const std::string&)> log;
};

class DispatcherCore {
 public:
  // Opens (and replays) the log. INVALID_ARGUMENT for bad options; DATA_LOSS if the log is corrupt
  // before its tail; the log's errors otherwise.
  static absl::StatusOr<std::unique_ptr<DispatcherCore>> Open(DispatcherOptions options);

  DispatcherCore(const DispatcherCore&) = delete;
  DispatcherCore& operator=(const DispatcherCore&) = delete;
  ~DispatcherCore();

  // ACCEPTED once durable (already_accepted for an identical resend), or REJECTED with the field
  // and the reason (bad content, a record over the log's limit, an id used by another
  // trajectory). A non-OK status means nothing was stored or acknowledged: RESOURCE_EXHAUSTED when
  // max_pending_trajectories are pending or being stored (a hard limit: wait for room, e.g.
  // AwaitRoom, and call again), UNAVAILABLE when the log failed.
  absl::StatusOr<v1::IngestResponse> Ingest(const v1::Trajectory& trajectory);

  // False while max_pending_trajectories are waiting for a batch. Never blocks (no lock); a hint
  // (Ingest enforces the limit).
  bool HasRoom() const;
  // Blocks until there is room for one more (pending and in-flight appends below the limit) or
  // the deadline; returns whether there is.
  bool AwaitRoom(absl::Time deadline) const;

  // A counter that changes whenever a fetch or a report might get another answer (trajectories,
  // trainers, commits); AwaitChange blocks until it differs from `seen` or the deadline.
  uint64_t change_count() const;
  void AwaitChange(uint64_t seen, absl::Time deadline) const;

  // INVALID_ARGUMENT for a rank outside [0, world_size); FAILED_PRECONDITION if the trainer's
  // weights include more steps than are committed.
  absl::StatusOr<v1::RegisterTrainerResponse> RegisterTrainer(
      const v1::RegisterTrainerRequest& request);

  // This rank's part of the step. UNAVAILABLE while the generation is incomplete or the batch is
  // not ready (retry); ABORTED if the generation changed (register again); FAILED_PRECONDITION for
  // a step ahead of the committed ones, or one whose trajectories were released after a checkpoint.
  absl::StatusOr<v1::Partition> FetchPartition(const v1::FetchPartitionRequest& request);

  // PENDING, COMMIT or ABORT (see the class comment). FAILED_PRECONDITION for a step that was not
  // fetched or is ahead; INVALID_ARGUMENT for a report without a phase.
  absl::StatusOr<v1::ReportStepResponse> ReportStep(const v1::StepReport& report);

  // OK, or the log's first write or sync failure: from then on nothing can be acknowledged,
  // planned or committed, and the process should exit so that its supervisor restarts it (the
  // next start truncates what was never acknowledged). GetStatus reports serving = false.
  absl::Status Health() const;

  v1::GetStatusResponse GetStatus() const;
  v1::GetStatisticsResponse GetStatistics() const;

 private:
  enum class State { kAppending, kPending, kPlanned, kTrained, kDropped };
  // A trajectory until a checkpoint releases its step; then only its fingerprint is kept
  // (retired_).
  struct Stored {
    State state = State::kAppending;
    uint64_t fingerprint = 0;        // of the canonical serialization: equal content, equal print
    int64_t sequence = 0;            // acceptance order
    int64_t log_bytes = 0;           // of its log record
    std::optional<Rollout> rollout;  // set unless kAppending
    std::map<std::string, std::string> metadata;
  };
  struct Plan {
    v1::StepPlanRecord record;
    int64_t rollout_tokens = 0;
    std::optional<v1::StepCommitRecord> commit;  // once committed
  };

  explicit DispatcherCore(DispatcherOptions options);
  absl::Status Replay(const WalRecord& record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddPending(const std::string& id, Rollout rollout,
                  std::map<std::string, std::string> metadata, uint64_t fingerprint,
                  int64_t log_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ApplyPlan(const v1::StepPlanRecord& record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyCommit(const v1::StepCommitRecord& record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyCheckpoint(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ApplySnapshot(const v1::SnapshotRecord& record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK if every trajectory that may still be trained satisfies the current limits (they may have
  // been looser when it was accepted); else FAILED_PRECONDITION naming one.
  absl::Status CheckUnreleased() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Compacts the log if it is large and mostly dead (options_.wal_compact_bytes).
  void MaybeCompact() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rewrites the log as the records that rebuild the current state; waits for ingests in flight
  // (releasing mu_ meanwhile) and holds new ones back until done.
  absl::Status Compact() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Plans step committed_ if it has no plan yet. UNAVAILABLE when the batch is not ready.
  absl::Status EnsurePlan(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<const PartitionPlan*> Split(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NewGeneration(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool GenerationComplete() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Changed() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { ++change_count_; }
  void CountRejection(const std::string& field) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Remembers the first failure of the log (a bad record size is the caller's error, not the
  // log's).
  void NoteLogFailure(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Log(const std::string& line) const;

  const DispatcherOptions options_;
  std::unique_ptr<WriteAheadLog> wal_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Stored> trajectories_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint64_t> retired_
      ABSL_GUARDED_BY(mu_);  // released id -> fingerprint
  int64_t appending_ ABSL_GUARDED_BY(mu_) =
      0;  // ingests between reserving an id and its log append
  bool compacting_ ABSL_GUARDED_BY(mu_) = false;
  int64_t live_log_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // estimate of what a compacted log would hold
  int64_t compactions_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t next_compaction_bytes_ ABSL_GUARDED_BY(mu_) =
      0;  // after a failed one: not before this size
  std::map<int64_t, std::string> pending_ ABSL_GUARDED_BY(mu_);  // sequence -> id, oldest first
  std::atomic<int64_t> pending_count_{0};  // pending_.size(), for HasRoom without the lock
  int64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int64_t, Plan> plans_ ABSL_GUARDED_BY(mu_);  // step -> its batch
  int64_t committed_ ABSL_GUARDED_BY(mu_) = 0;          // committed steps
  int64_t released_before_ ABSL_GUARDED_BY(mu_) = 0;    // steps whose rollouts were released
  uint64_t change_count_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status log_failure_ ABSL_GUARDED_BY(mu_);

  // The current generation and the split of the step in flight for it.
  int64_t incarnation_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int32_t world_size_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int32_t, std::string> members_ ABSL_GUARDED_BY(mu_);  // rank -> trainer_id
  std::map<std::pair<int64_t, int32_t>, PartitionPlan> splits_ ABSL_GUARDED_BY(mu_);
  std::map<int32_t, v1::StepReport> prepared_ ABSL_GUARDED_BY(mu_);  // for step committed_
  absl::Time first_prepared_ ABSL_GUARDED_BY(mu_);                   // when prepared_ got its first
  std::map<int32_t, int64_t> checkpoints_ ABSL_GUARDED_BY(mu_);      // rank -> checkpoint step

  // Statistics.
  v1::GetStatisticsResponse statistics_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dta

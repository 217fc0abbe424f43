// What the dispatcher decides for one training step, as pure functions of the pending
// trajectories (so that a restarted dispatcher, replaying its log, decides the same):
//
//   SelectBatch    which pending trajectories form the step's batch, oldest first, and which are
//                  too stale to train (AReaL's max staleness: policy version lag).
//   PlanPartitions what needs the whole batch, then the split: GRPO group advantages and the loss
//                  normalisers over the whole batch; the lexicographic, DFS-contiguous,
//                  load-balanced split across trainers (AReaL-DTA Algorithm 4, core/partition).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/io/rollout.h"
#include "core/loss/batch_context.h"
#include "core/partition/partition.h"

namespace dta {

struct BatchOptions {
  // A batch is this many rollouts; 0 sizes batches by `tokens` instead. Exactly one of the two
  // must be positive.
  int64_t rollouts = 0;
  // A batch is the oldest rollouts whose tokens reach at least this many (the rollout that crosses
  // the threshold is included).
  int64_t tokens = 0;
  // Trajectories whose oldest generated token (versions >= 0) lags the current policy version by
  // more than this are dropped, counted and logged; -1 (the default) keeps everything. Trajectories
  // without versions are never stale.
  int64_t max_staleness = -1;
  // How rewards become advantages (GRPO group normalisation by default).
  AdvantageOptions advantages;
  // What the split across the trainers balances (tree tokens by default).
  BalanceCost balance;
};

// INVALID_ARGUMENT naming the field if the options are inconsistent.
absl::Status ValidateBatchOptions(const BatchOptions& options);

// Policy version lag of a trajectory: policy_version minus its oldest generated token's version,
// or 0 without versions.
int64_t Staleness(const Rollout& rollout, int64_t policy_version);

struct BatchSelection {
  bool ready = false;          // enough fresh trajectories for a batch
  std::vector<int64_t> batch;  // ready: positions in `pending` of the batch, in pending order
  std::vector<int64_t> stale;  // ready: positions of the stale trajectories met on the way
  int64_t fresh_rollouts = 0;  // what is there (the progress towards a batch when not ready)
  int64_t fresh_tokens = 0;
};

// Scans `pending` (oldest first) and takes a batch as BatchOptions says; the stale trajectories
// before the batch's last member are reported for dropping. Nothing is decided when not ready.
BatchSelection SelectBatch(absl::Span<const Rollout* const> pending, int64_t policy_version,
                           const BatchOptions& options);

struct PartitionPlan {
  // ranks[k]: positions in the batch of rank k's rollouts, in lexicographic order.
  std::vector<std::vector<int64_t>> ranks;
  // advantages[i]: rollout i's GRPO group advantage over the whole batch, for every one of its
  // tokens, unless it carries per-token advantages of its own (empty when not needed). See
  // PlannedAdvantages.
  std::vector<float> advantages;
  BatchLossContext context;  // the whole batch's normalisers
  Partition partition;       // costs, imbalance and extra tokens of the split
};

// Advantages (when `with_advantages`), normalisers and the split into `world_size` groups
// balancing `balance`. INVALID_ARGUMENT naming the rollout if advantages cannot be computed, or
// naming the cost if it is invalid; world_size >= 1.
absl::StatusOr<PartitionPlan> PlanPartitions(absl::Span<const Rollout* const> batch, int world_size,
                                             bool with_advantages,
                                             const AdvantageOptions& advantages,
                                             const BalanceCost& balance = {});

// The per-token advantages batch rollout `i` (`rollout`) is trained with under `plan`: its own
// when it has them, else its group advantage on every token, else (a plan without advantages:
// SFT) none.
std::vector<float> PlannedAdvantages(const PartitionPlan& plan, int64_t i, const Rollout& rollout);

// One rank's share of a batch that every rank holds whole (dta-train --distributed, dta.Trainer):
// its rollouts in lexicographic order, each with its PlannedAdvantages, and their positions in the
// batch. Train them under plan.context.
struct RankShare {
  std::vector<Rollout> rollouts;
  std::vector<int64_t> positions;  // rollouts[j] is batch[positions[j]]
};
RankShare ShareOfRank(const PartitionPlan& plan, int rank, absl::Span<const Rollout> batch);

}  // namespace dta

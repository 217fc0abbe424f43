// A tensor-parallel replica's conversation with the dispatcher. The dispatcher plans one partition
// per data-parallel replica (K = world size / TP of them), and every TP rank of a replica trains
// that partition. Only the replica's TP rank 0, its leader, holds a dispatcher session (registered
// as rank d of K); RelayToFollowers wraps it and publishes what the dispatcher answers (each step's
// partition, the decision on it, or the end of the generation) in the replica's store, where each
// other TP rank's FollowLeader session reads it. The dispatcher's two-phase commit is unchanged:
// the leader reports PREPARED only once its own gradients are complete, which needs its TP peers'
// (the layers' collectives), and every rank steps only on the COMMIT the leader relays.
//
//   std::unique_ptr<TrainerSession> session =
//       tp_rank == 0 ? RelayToFollowers(*std::move(registered), tp_group.store())
//                    : FollowLeader(tp_group.store(), tp_size - 1, wait);
//
// The store holds a message only until every follower has read it (the last reader deletes it),
// so its memory does not grow with the steps. A follower has no dispatcher session of its own: its
// Failed() only logs, and its failure ends its process, which makes the launcher restart the group.
//
// Thread safety: one call at a time per session.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>

#include "dispatcher/client/trainer_session.h"

namespace dta {

// The leader's session: `session`'s answers, each also published in `store`. A failure to publish
// is returned as ABORTED (the followers can no longer follow: the group must restart).
std::unique_ptr<TrainerSession> RelayToFollowers(std::unique_ptr<TrainerSession> session,
                                                 c10::intrusive_ptr<c10d::Store> store);

// A follower's session: the leader's answers, read from `store` (shared with `followers` - 1 other
// followers), each waited for up to `wait` (DEADLINE_EXCEEDED after). ABORTED when the store
// cannot be reached (the leader's host is gone: the group must restart). generation() and
// committed_steps() are the dispatcher's, which a follower never hears: both return 0.
std::unique_ptr<TrainerSession> FollowLeader(c10::intrusive_ptr<c10d::Store> store, int followers,
                                             std::chrono::milliseconds wait);

}  // namespace dta

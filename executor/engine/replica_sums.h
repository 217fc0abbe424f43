// The whole batch's GradientResult on every data-parallel replica: each replica's loss, token
// counts and loss diagnostics summed (the ratio extremes: max and min) in one all-reduce.
#pragma once

#include "executor/distributed/process_group.h"
#include "executor/engine/executor.h"

namespace dta {

// `result` is replica `replica`'s (of `replicas`, the ranks of `data_parallel`); afterwards it is
// the batch's: loss, rollout_tokens, forwarded_tokens, router_aux_loss, replay_split_tokens and
// diagnostics. Logprobs
// stay this replica's. Every replica calls it.
void SumOverReplicas(ProcessGroup& data_parallel, int replica, int replicas,
                     GradientResult& result);

}  // namespace dta

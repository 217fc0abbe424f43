// The flags that say what the DFS-contiguous split balances across data-parallel ranks
// (core/partition/partition.h BalanceCost), shared by the programs that split batches:
// dta-dispatcher (for the trainers it serves) and dta-train --distributed.
#pragma once

#include "absl/status/statusor.h"
#include "core/partition/partition.h"

namespace dta {

// --balance_per_token and --balance_per_key (defaults 1 and 0: tree tokens). INVALID_ARGUMENT
// naming the flags when a weight is negative or both are 0.
absl::StatusOr<BalanceCost> BalanceCostFromFlags();

}  // namespace dta

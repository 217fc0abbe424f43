#include "apps/balance/balance_flags.h"

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(int64_t, balance_per_token, 1,
          "the split across data-parallel ranks balances per_token x tree tokens + per_key x the "
          "keys they attend to (a token at depth d attends to d + 1); the defaults balance tree "
          "tokens; bench/balance_by_time.py fits both on a GPU (picoseconds) to balance time");
ABSL_FLAG(int64_t, balance_per_key, 0, "see --balance_per_token");

namespace dta {

absl::StatusOr<BalanceCost> BalanceCostFromFlags() {
  const BalanceCost cost{.per_token = absl::GetFlag(FLAGS_balance_per_token),
                         .per_key = absl::GetFlag(FLAGS_balance_per_key)};
  if (absl::Status valid = cost.Validate(); !valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--balance_per_token / --balance_per_key: ", valid.message()));
  }
  return cost;
}

}  // namespace dta

#include "executor/engine/replica_sums.h"

#include <algorithm>
#include <array>
#include <limits>
#include <vector>

namespace dta {

void SumOverReplicas(ProcessGroup& data_parallel, int replica, int replicas,
                     GradientResult& result) {
  // The sums, then each replica's ratio extremes in slots of its own (a sum of one-hot vectors
  // gathers them).
  std::vector<double> values = {result.loss, static_cast<double>(result.rollout_tokens),
                                static_cast<double>(result.forwarded_tokens),
                                result.router_aux_loss,
                                static_cast<double>(result.replay_split_tokens)};
  const std::array<double, LossDiagnostics::kSums> diagnostics = result.diagnostics.Sums();
  values.insert(values.end(), diagnostics.begin(), diagnostics.end());
  const size_t extremes = values.size();
  values.resize(extremes + 2 * static_cast<size_t>(replicas), 0.0);
  values[extremes + 2 * replica] = result.diagnostics.ratio_max;
  values[extremes + 2 * replica + 1] = result.diagnostics.ratio_min;
  const std::vector<double> sums = data_parallel.AllReduceScalars(values);
  result.loss = sums[0];
  result.rollout_tokens = static_cast<int64_t>(sums[1]);
  result.forwarded_tokens = static_cast<int64_t>(sums[2]);
  result.router_aux_loss = sums[3];  // each replica's is over the global rollout count already
  result.replay_split_tokens = static_cast<int64_t>(sums[4]);
  std::array<double, LossDiagnostics::kSums> summed;
  std::copy_n(sums.begin() + 5, LossDiagnostics::kSums, summed.begin());
  double ratio_max = -std::numeric_limits<double>::infinity();
  double ratio_min = std::numeric_limits<double>::infinity();
  for (int k = 0; k < replicas; ++k) {
    ratio_max = std::max(ratio_max, sums[extremes + 2 * k]);
    ratio_min = std::min(ratio_min, sums[extremes + 2 * k + 1]);
  }
  result.diagnostics = LossDiagnostics::FromSums(summed, ratio_max, ratio_min);
}

}  // namespace dta

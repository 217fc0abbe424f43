// The dispatcher's metrics, from what GetStatus and GetStatistics answer: Prometheus text for
// /metrics (queue depth, ingestion and rejection counters by field, steps, the log, the trainers,
// and the last step's compression, imbalance and throughput; with the service's IngestMemory, what
// the Ingest streams hold) and a committed step's TensorBoard scalars.
#pragma once

#include "core/metrics/tensorboard_writer.h"
#include "proto/dta/v1/dispatcher.pb.h"

namespace dta {

struct IngestMemory;  // dispatcher_service.h

// `ingest` may be null (no dta_dispatcher_held_* and dta_dispatcher_ingest_* metrics).
std::string DispatcherPrometheus(const v1::GetStatusResponse& status,
                                 const v1::GetStatisticsResponse& statistics,
                                 const IngestMemory* ingest = nullptr);

// rollouts, rollout_tokens, tree_tokens, compression, imbalance, extra_tokens, seconds,
// tokens_per_second, loss, dropped_stale of one step, and the queue depth when it is written.
Scalars StepStatisticsScalars(const v1::StepStatistics& step, int64_t pending_trajectories);

}  // namespace dta

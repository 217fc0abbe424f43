// The metrics flags dta-dispatcher and dta-trainer share:
//   --metrics_listen      serve Prometheus's /metrics at this host:port (off when empty)
//   --metrics_token_file  the bearer token scrapers present (needed off loopback)
//   --tensorboard_dir     write TensorBoard event files (scalars per step) into this directory
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "apps/metrics/metrics_server.h"
#include "core/metrics/tensorboard_writer.h"

ABSL_DECLARE_FLAG(std::string, metrics_listen);
ABSL_DECLARE_FLAG(std::string, metrics_token_file);
ABSL_DECLARE_FLAG(std::string, tensorboard_dir);

namespace dta {

// The /metrics server of --metrics_listen serving `render()`, or nullptr when the flag is empty.
// `port_offset`: as MetricsServer::Start. Errors name the flag. Prints where it listens on stderr,
// after `who`.
absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServerFromFlags(
    const std::string& who, std::function<std::string()> render, int port_offset = 0);

// A writer into --tensorboard_dir (joined with `subdirectory` when not empty), or nullptr when the
// flag is empty. Errors name the flag.
absl::StatusOr<std::unique_ptr<TensorBoardWriter>> TensorBoardFromFlags(
    const std::string& subdirectory = "");

}  // namespace dta

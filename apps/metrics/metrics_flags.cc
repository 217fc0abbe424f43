#include "apps/metrics/metrics_flags.h"

#include <cstdio>
#include <filesystem>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "core/base/private_files.h"
#include "dispatcher/client/client_options.h"

ABSL_FLAG(std::string, metrics_listen, "",
          "serve Prometheus metrics at http://HOST:PORT/metrics (e.g. 127.0.0.1:9400; port 0 picks "
          "one); empty: off");
ABSL_FLAG(std::string, metrics_token_file, "",
          "the bearer token Prometheus must present for /metrics (required off loopback)");
ABSL_FLAG(std::string, tensorboard_dir, "",
          "write TensorBoard event files (one scalar event per step) into this directory");

namespace dta {

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServerFromFlags(
    const std::string& who, std::function<std::string()> render, int port_offset) {
  const std::string address = absl::GetFlag(FLAGS_metrics_listen);
  if (address.empty()) return nullptr;
  std::string token;
  if (const std::string path = absl::GetFlag(FLAGS_metrics_token_file); !path.empty()) {
    absl::StatusOr<std::string> read = ReadPrivateFile(path);
    if (!read.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics_token_file: ", read.status().message()));
    }
    token = *std::move(read);
  }
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start(address, std::move(token), std::move(render), port_offset);
  if (!server.ok()) {
    return absl::Status(server.status().code(),
                        absl::StrCat("--metrics_listen: ", server.status().message()));
  }
  const std::string& host = (*server)->host();
  const bool v6 = host.find(':') != std::string::npos;
  std::fprintf(stderr, "%s: metrics on http://%s%s%s:%d/metrics\n", who.c_str(), v6 ? "[" : "",
               host.c_str(), v6 ? "]" : "", (*server)->port());
  return server;
}

absl::StatusOr<std::unique_ptr<TensorBoardWriter>> TensorBoardFromFlags(
    const std::string& subdirectory) {
  const std::string directory = absl::GetFlag(FLAGS_tensorboard_dir);
  if (directory.empty()) return nullptr;
  const std::string path =
      subdirectory.empty() ? directory : (std::filesystem::path(directory) / subdirectory).string();
  absl::StatusOr<std::unique_ptr<TensorBoardWriter>> writer = TensorBoardWriter::Open(path);
  if (!writer.ok()) {
    return absl::Status(writer.status().code(),
                        absl::StrCat("--tensorboard_dir: ", writer.status().message()));
  }
  return writer;
}

}  // namespace dta

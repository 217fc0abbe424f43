// dta-send: sends a rollout file (JSON Lines, core/io/rollout_jsonl.h) to the dispatcher, as a
// rollout worker would, and waits until every trajectory is acknowledged or rejected.
//
//   dta-send --dispatcher=127.0.0.1:50051 --rollouts=batch.jsonl [--token_file=F] [--streams=4]
//
// Prints one line per rejected trajectory (its id, the field and the reason) and a summary.
// Exit status: 0 if all were accepted, 3 if some were rejected, 2 on bad flags or an unreadable
// file, 1 if the dispatcher could not be reached.
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/time/clock.h"
#include "core/base/exit_codes.h"
#include "core/base/private_files.h"
#include "core/cli/usage.h"
#include "core/io/rollout_jsonl.h"
#include "dispatcher/client/dispatcher_client.h"
#include "dispatcher/wire/trajectory.h"

ABSL_FLAG(std::string, dispatcher, "127.0.0.1:50051", "the dispatcher's host:port");
ABSL_FLAG(std::string, rollouts, "", "rollout file (JSON Lines); required");
ABSL_FLAG(std::string, token_file, "",
          "file holding the rollout token (dta-dispatcher's --rollout_token_file)");
ABSL_FLAG(int32_t, streams, 1,
          "concurrent streams (each sends a contiguous share of the file, in order)");
ABSL_FLAG(int32_t, retry_s, 600,
          "how long to keep retrying while the dispatcher is unreachable, seconds");

int main(int argc, char** argv) {
  dta::SetProgramUsage("dta-send --dispatcher=HOST:PORT --rollouts=FILE.jsonl");
  dta::ParseCommandLine(argc, argv);
  const std::string path = absl::GetFlag(FLAGS_rollouts);
  const int streams = absl::GetFlag(FLAGS_streams);
  if (path.empty() || streams < 1) {
    std::fprintf(stderr, "dta-send: give --rollouts and --streams >= 1\n");
    return dta::kExitBadInput;
  }
  absl::StatusOr<std::vector<dta::Rollout>> rollouts = dta::ReadRolloutsJsonl(path);
  if (!rollouts.ok()) {
    std::fprintf(stderr, "dta-send: %s\n", std::string(rollouts.status().message()).c_str());
    return dta::kExitBadInput;
  }
  dta::ClientOptions options;
  options.address = absl::GetFlag(FLAGS_dispatcher);
  options.retry_for = absl::Seconds(absl::GetFlag(FLAGS_retry_s));
  if (const std::string token_path = absl::GetFlag(FLAGS_token_file); !token_path.empty()) {
    absl::StatusOr<std::string> token = dta::ReadPrivateFile(token_path);
    if (!token.ok()) {
      std::fprintf(stderr, "dta-send: --token_file: %s\n",
                   std::string(token.status().message()).c_str());
      return dta::kExitBadInput;
    }
    options.token = *std::move(token);
  }
  std::vector<dta::v1::Trajectory> trajectories;
  trajectories.reserve(rollouts->size());
  for (const dta::Rollout& r : *rollouts) trajectories.push_back(dta::TrajectoryFromRollout(r));

  const absl::Time start = absl::Now();
  std::vector<absl::StatusOr<std::vector<dta::v1::IngestResponse>>> answers(streams);
  std::vector<std::thread> threads;
  const size_t n = trajectories.size();
  for (int s = 0; s < streams; ++s) {
    threads.emplace_back([&, s] {
      dta::RolloutSender sender(options);
      const size_t begin = n * s / streams, end = n * (s + 1) / streams;
      answers[s] = sender.Send(absl::MakeConstSpan(trajectories).subspan(begin, end - begin));
    });
  }
  for (std::thread& t : threads) t.join();
  int64_t accepted = 0, already = 0, rejected = 0;
  for (const auto& stream : answers) {
    if (!stream.ok()) {
      std::fprintf(stderr, "dta-send: %s\n", stream.status().ToString().c_str());
      return dta::kExitError;
    }
    for (const dta::v1::IngestResponse& answer : *stream) {
      if (answer.outcome() == dta::v1::IngestResponse::ACCEPTED) {
        ++accepted;
        already += answer.already_accepted() ? 1 : 0;
      } else {
        ++rejected;
        std::printf("rejected '%s': %s\n", answer.id().c_str(), answer.reason().c_str());
      }
    }
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  std::printf("%s: %lld accepted (%lld already), %lld rejected, %.2f s, %.0f trajectories/s\n",
              path.c_str(), static_cast<long long>(accepted), static_cast<long long>(already),
              static_cast<long long>(rejected), seconds, n / std::max(seconds, 1e-9));
  return rejected > 0 ? 3 : 0;
}

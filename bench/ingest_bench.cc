// dta-ingest-bench: ingestion throughput and acknowledgement latency of a running dta-dispatcher
// over gRPC, as rollout workers see them (scripts/ingest_bench.sh starts the dispatcher and runs
// both of the measurements).
//
//   dta-ingest-bench --dispatcher=127.0.0.1:50051 --streams=16 --seconds=10 --tokens=4096
//       [--rate=TOKENS_PER_S]
//
// Each stream sends trajectories of --tokens tokens shaped like an RL rollout (token ids, loss
// mask, behaviour log-probabilities, per-token policy versions, a reward), keeping up to --window
// of them unacknowledged. Without --rate the streams send as fast as acknowledgements allow
// (throughput); with --rate they send on a fixed schedule adding up to that many tokens per second
// (latency at a given load: a trajectory's latency runs from its scheduled send time to its
// acknowledgement, so falling behind the schedule counts). Prints rollout tokens per second
// acknowledged and the latency percentiles.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/exit_codes.h"
#include "core/cli/usage.h"
#include "dispatcher/client/client_options.h"
#include "dispatcher/client/dispatcher_client.h"
#include "proto/dta/v1/dispatcher.grpc.pb.h"

ABSL_FLAG(std::string, dispatcher, "127.0.0.1:50051", "the dispatcher's host:port");
ABSL_FLAG(std::string, token_file, "", "file holding the dispatcher's shared token");
ABSL_FLAG(int32_t, streams, 16, "concurrent Ingest streams");
ABSL_FLAG(double, seconds, 10, "how long to send");
ABSL_FLAG(int32_t, tokens, 4096, "tokens per trajectory");
ABSL_FLAG(int32_t, window, 8, "unacknowledged trajectories per stream at most");
ABSL_FLAG(double, rate, 0,
          "tokens per second over all streams on a fixed schedule; 0: as fast as possible");
ABSL_FLAG(int32_t, vocab_size, 151936, "token ids are drawn below this");
ABSL_FLAG(std::string, id_prefix, "bench",
          "trajectory ids are PREFIX-STREAM-N (use a fresh prefix per run)");

namespace dta {
namespace {

using Clock = std::chrono::steady_clock;

struct StreamResult {
  std::vector<double> latency_ms;
  int64_t accepted = 0;
  int64_t rejected = 0;
  std::string error;
};

v1::Trajectory Template(int tokens, int vocab, std::mt19937& rng) {
  v1::Trajectory t;
  t.set_group_id("g");
  const int prompt = tokens / 4;
  for (int i = 0; i < tokens; ++i) {
    t.add_tokens(static_cast<int32_t>(rng() % vocab));
    t.add_loss_mask(i >= prompt);
    t.add_logprobs(i >= prompt ? -0.5f - static_cast<float>(rng() % 1000) / 500.0f : 0.0f);
    t.add_versions(i >= prompt ? 0 : -1);
  }
  t.set_reward(static_cast<double>(rng() % 2));
  return t;
}

// One stream: a writer on the schedule (or as fast as the window allows) and this thread reading
// the answers, which come in order.
StreamResult RunStream(v1::Dispatcher::Stub& stub, const std::string& token, int stream,
                       Clock::time_point start, Clock::time_point stop, double interval_s) {
  StreamResult result;
  std::mt19937 rng(stream + 1);
  v1::IngestRequest request;
  *request.mutable_trajectory() =
      Template(absl::GetFlag(FLAGS_tokens), absl::GetFlag(FLAGS_vocab_size), rng);
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  auto call = stub.Ingest(&context);

  const int window = absl::GetFlag(FLAGS_window);
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Clock::time_point> in_flight;  // scheduled send times of unanswered trajectories
  bool reader_done = false;  // the stream ended: nothing will make room in the window any more
  bool writer_done = false;
  std::thread writer([&] {
    const std::string prefix = absl::StrCat(absl::GetFlag(FLAGS_id_prefix), "-", stream, "-");
    for (int64_t n = 0;; ++n) {
      Clock::time_point scheduled = Clock::now();
      if (interval_s > 0) {
        // Streams are staggered so that their sends spread over each interval.
        scheduled = start + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(interval_s * (n + stream / 1000.0)));
        std::this_thread::sleep_until(scheduled);
      }
      if (scheduled >= stop) break;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return reader_done || static_cast<int>(in_flight.size()) < window; });
        if (reader_done) break;
        in_flight.push_back(scheduled);
      }
      request.mutable_trajectory()->set_id(absl::StrCat(prefix, n));
      if (!call->Write(request)) break;
    }
    call->WritesDone();
    std::lock_guard lock(mu);
    writer_done = true;
  });
  v1::IngestResponse answer;
  while (call->Read(&answer)) {
    const Clock::time_point now = Clock::now();
    Clock::time_point sent;
    {
      std::lock_guard lock(mu);
      sent = in_flight.front();
      in_flight.pop_front();
    }
    cv.notify_all();
    if (answer.outcome() == v1::IngestResponse::ACCEPTED) {
      ++result.accepted;
      result.latency_ms.push_back(std::chrono::duration<double, std::milli>(now - sent).count());
    } else {
      ++result.rejected;
      if (result.error.empty()) result.error = answer.reason();
    }
  }
  bool writer_running = false;
  {
    std::lock_guard lock(mu);
    reader_done = true;
    writer_running = !writer_done;
  }
  cv.notify_all();
  // The stream ended before the writer did (the dispatcher went away): a Write blocked on it
  // returns.
  if (writer_running) context.TryCancel();
  writer.join();
  const grpc::Status status = call->Finish();
  if (!status.ok()) result.error = absl::StrCat("stream ", stream, ": ", status.error_message());
  return result;
}

double Percentile(std::vector<double>& values, double p) {
  if (values.empty()) return 0;
  const size_t k =
      std::min(values.size() - 1, static_cast<size_t>(p * static_cast<double>(values.size())));
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(k), values.end());
  return values[k];
}

int Main() {
  ClientOptions options;
  options.address = absl::GetFlag(FLAGS_dispatcher);
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    absl::StatusOr<std::string> token = ReadCredentialFile(path, /*trim=*/true);
    if (!token.ok()) {
      std::fprintf(stderr, "dta-ingest-bench: --token_file: %s\n",
                   std::string(token.status().message()).c_str());
      return dta::kExitBadInput;
    }
    options.token = *std::move(token);
  }
  const int streams = absl::GetFlag(FLAGS_streams);
  const int tokens = absl::GetFlag(FLAGS_tokens);
  const double rate = absl::GetFlag(FLAGS_rate);
  if (streams < 1 || tokens < 2 || absl::GetFlag(FLAGS_window) < 1 || rate < 0) {
    std::fprintf(
        stderr,
        "dta-ingest-bench: need --streams >= 1, --tokens >= 2, --window >= 1, --rate >= 0\n");
    return dta::kExitBadInput;
  }
  // Each stream its own channel, as separate rollout workers would have.
  std::vector<std::unique_ptr<v1::Dispatcher::Stub>> stubs;
  for (int s = 0; s < streams; ++s) {
    grpc::ChannelArguments arguments;
    arguments.SetInt("grpc.channel_id", s);  // distinct channels, not one shared subchannel
    stubs.push_back(v1::Dispatcher::NewStub(
        grpc::CreateCustomChannel(options.address, grpc::InsecureChannelCredentials(), arguments)));
  }
  const double interval_s = rate > 0 ? static_cast<double>(tokens) * streams / rate : 0;
  const Clock::time_point start = Clock::now() + std::chrono::milliseconds(100);
  const Clock::time_point stop =
      start + std::chrono::duration_cast<Clock::duration>(
                  std::chrono::duration<double>(absl::GetFlag(FLAGS_seconds)));
  std::vector<StreamResult> results(streams);
  std::vector<std::thread> threads;
  for (int s = 0; s < streams; ++s) {
    threads.emplace_back(
        [&, s] { results[s] = RunStream(*stubs[s], options.token, s, start, stop, interval_s); });
  }
  for (std::thread& t : threads) t.join();
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();

  std::vector<double> latency;
  int64_t accepted = 0;
  int64_t rejected = 0;
  int errors = 0;
  for (const StreamResult& r : results) {
    latency.insert(latency.end(), r.latency_ms.begin(), r.latency_ms.end());
    accepted += r.accepted;
    rejected += r.rejected;
    if (!r.error.empty()) {
      std::fprintf(stderr, "dta-ingest-bench: %s\n", r.error.c_str());
      ++errors;
    }
  }
  const double token_rate = static_cast<double>(accepted) * tokens / elapsed;
  std::printf("%s streams=%d tokens/trajectory=%d window=%d target=%s\n", options.address.c_str(),
              streams, tokens, absl::GetFlag(FLAGS_window),
              rate > 0 ? absl::StrFormat("%.0f tokens/s", rate).c_str() : "max");
  std::printf(
      "acknowledged %lld trajectories (%lld rejected) in %.2f s: %.0f trajectories/s, %.3fM "
      "rollout tokens/s\n",
      static_cast<long long>(accepted), static_cast<long long>(rejected), elapsed,
      accepted / elapsed, token_rate / 1e6);
  const double p50 = Percentile(latency, 0.50);
  const double p90 = Percentile(latency, 0.90);
  const double p99 = Percentile(latency, 0.99);
  const double max = latency.empty() ? 0 : *std::max_element(latency.begin(), latency.end());
  std::printf("acknowledgement latency ms: p50 %.2f  p90 %.2f  p99 %.2f  max %.2f\n", p50, p90, p99,
              max);
  return errors > 0 || rejected > 0 ? 1 : 0;
}

}  // namespace
}  // namespace dta

int main(int argc, char** argv) {
  dta::SetProgramUsage(
      "dta-ingest-bench --dispatcher=HOST:PORT [--streams=N] [--rate=TOKENS_PER_S]");
  dta::ParseCommandLine(argc, argv);
  return dta::Main();
}

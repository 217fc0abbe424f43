// dta-dispatcher: receives rollouts from rollout workers and serves balanced partitions of each
// step's batch to the trainers (see proto/dta/v1/dispatcher.proto and docs/usage.md).
//
//   dta-dispatcher --wal=/var/lib/dta/dispatcher.wal --batch_rollouts=256 --vocab_size=151936
//                  [--listen=127.0.0.1:50051] [--max_staleness=4] [--tls_cert=F --tls_key=F
//                  --rollout_token_file=F] [--trainer_token_file=F]
//
// Roles: rollout workers call Ingest (with --rollout_token_file's token when it is given; open on
// loopback otherwise), trainers the step RPCs with the trainer token, always: from
// --trainer_token_file, or from <wal>.trainer-token, created (mode 0600) when missing. The start-up
// line names the file to give dta-trainer --token_file.
//
// Every accepted trajectory is in the write-ahead log before it is acknowledged; restarting with
// the same --wal resumes where the last process stopped, whatever killed it (a power loss included:
// an acknowledgement comes after fdatasync, so only unacknowledged trajectories can be lost).
// SIGINT / SIGTERM stop it gracefully. Exit status: 0 after a clean stop, 2 on bad flags, 1 if the
// log cannot be opened, the address bound, or the log fails while serving (a full disk, a
// file-size limit: restart it; the log recovers what was acknowledged).
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/server_credentials.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "apps/advantages/advantage_flags.h"
#include "apps/balance/balance_flags.h"
#include "apps/metrics/metrics_flags.h"
#include "core/base/exit_codes.h"
#include "core/base/private_files.h"
#include "core/cli/usage.h"
#include "core/io/routed_experts.h"
#include "core/model/config_json.h"
#include "dispatcher/client/client_options.h"
#include "dispatcher/core/dispatcher_core.h"
#include "dispatcher/service/dispatcher_metrics.h"
#include "dispatcher/service/dispatcher_service.h"

ABSL_FLAG(std::string, wal, "",
          "write-ahead log file (created if missing, replayed if present); required");
ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "address to listen on (host:port)");
ABSL_FLAG(int64_t, batch_rollouts, 0, "rollouts per step (give this or --batch_tokens)");
ABSL_FLAG(int64_t, batch_tokens, 0,
          "rollout tokens per step (the batch closes at the rollout that reaches it)");
ABSL_FLAG(int64_t, max_staleness, -1,
          "drop trajectories whose policy version lags by more than this (-1: keep all)");
ABSL_FLAG(bool, sft, false, "supervised data: trajectories need no reward or advantages");
ABSL_FLAG(bool, require_ref_logprobs, false,
          "trajectories must carry ref_logprobs (trainers with --kl_coef)");
ABSL_FLAG(std::string, routed_experts_model, "",
          "routing replay: the trainers' mixture-of-experts model (a preset or a config.json), "
          "which trajectories' routed_experts must fit; without it they are refused");
ABSL_FLAG(bool, require_routed_experts, false,
          "trajectories must carry routed_experts (needs --routed_experts_model)");
ABSL_FLAG(int64_t, vocab_size, 0,
          "token ids must be below this (the model's vocabulary); required");
ABSL_FLAG(int64_t, max_tokens, 1 << 17, "the most tokens in one trajectory");
ABSL_FLAG(int64_t, max_pending, 1 << 16,
          "accepted trajectories waiting for a batch before ingestion pauses");
ABSL_FLAG(int64_t, initial_policy_version, 0,
          "policy version of the weights before the first step");
ABSL_FLAG(int32_t, max_message_mb, 256, "largest gRPC message, in MiB, either way");
ABSL_FLAG(int64_t, max_held_mb, 1024,
          "the most MiB of received trajectories not yet stored (all streams together); a stream "
          "whose trajectory would go past it ends RESOURCE_EXHAUSTED (the client backs off)");
ABSL_FLAG(int32_t, max_ingest_streams, 1024,
          "the most Ingest streams open at once (each may hold up to --max_message_mb in gRPC's "
          "buffers); a stream past it ends RESOURCE_EXHAUSTED at once (the client backs off)");
ABSL_FLAG(int32_t, worker_threads, 32, "threads for blocking work (log syncs, long polls)");
ABSL_FLAG(double, prepare_timeout_s, 300,
          "abandon a step when a rank has not reported this long after another prepared it (a hung "
          "rank)");
ABSL_FLAG(bool, wal_sync, true, "fdatasync the log before acknowledging (off only for benchmarks)");
ABSL_FLAG(double, wal_compact_mb, 1024,
          "rewrite the log down to what it must keep once it is this large and at least twice "
          "that; 0: never");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: serve TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key for --tls_cert");
ABSL_FLAG(std::string, rollout_token_file, "",
          "file holding the token rollout workers present to send trajectories (empty: Ingest is "
          "open, loopback only)");
ABSL_FLAG(std::string, trainer_token_file, "",
          "file holding the token trainers present (empty: <wal>.trainer-token, created with mode "
          "0600 when missing)");
ABSL_FLAG(std::string, token_file, "",
          "gone: rollout workers and trainers have separate credentials (--rollout_token_file, "
          "--trainer_token_file)");
ABSL_FLAG(bool, insecure_remote, false,
          "allow a non-loopback --listen without TLS and a rollout token (testing only)");

namespace dta {
namespace {

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "dta-dispatcher: %s\n", message.c_str());
  return code;
}

int Run() {
  // SIGINT and SIGTERM are blocked before any thread starts (threads inherit the mask), and a
  // watcher thread waits for them: Shutdown is not async-signal-safe.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A file-size limit (ulimit -f) would kill the process mid-write with SIGXFSZ; ignored, the write
  // fails with EFBIG instead, and the log's failure ends the dispatcher with status 1 as any other
  // (nothing unacknowledged was claimed stored).
  std::signal(SIGXFSZ, SIG_IGN);
  DispatcherOptions options;
  options.wal_path = absl::GetFlag(FLAGS_wal);
  if (options.wal_path.empty()) return Fail(kExitBadInput, "--wal is required");
  // The log holds every trajectory: one that exists must be this user's and closed to others (the
  // log refuses it too; checked here first so that nothing is created beside a planted log).
  if (absl::Status owned = CheckPrivateFile(options.wal_path);
      !owned.ok() && !absl::IsNotFound(owned)) {
    return Fail(kExitBadInput, absl::StrCat("--wal: ", owned.message()));
  }
  options.wal_sync = absl::GetFlag(FLAGS_wal_sync);
  const double prepare_timeout_s = absl::GetFlag(FLAGS_prepare_timeout_s);
  if (!(prepare_timeout_s > 0)) return Fail(kExitBadInput, "--prepare_timeout_s must be positive");
  options.prepare_timeout = absl::Seconds(prepare_timeout_s);
  const double compact_mb = absl::GetFlag(FLAGS_wal_compact_mb);
  if (!(compact_mb >= 0) || compact_mb > 1e9)
    return Fail(kExitBadInput, "--wal_compact_mb must be in [0, 1e9]");
  options.wal_compact_bytes = static_cast<int64_t>(compact_mb * (1 << 20));
  options.batch = {.rollouts = absl::GetFlag(FLAGS_batch_rollouts),
                   .tokens = absl::GetFlag(FLAGS_batch_tokens),
                   .max_staleness = absl::GetFlag(FLAGS_max_staleness)};
  if (absl::Status status = ValidateBatchOptions(options.batch); !status.ok()) {
    return Fail(kExitBadInput,
                "give exactly one of --batch_rollouts and --batch_tokens (positive)");
  }
  absl::StatusOr<AdvantageOptions> advantages = AdvantageOptionsFromFlags();
  if (!advantages.ok()) return Fail(kExitBadInput, std::string(advantages.status().message()));
  options.batch.advantages = *advantages;
  absl::StatusOr<BalanceCost> balance = BalanceCostFromFlags();
  if (!balance.ok()) return Fail(kExitBadInput, std::string(balance.status().message()));
  options.batch.balance = *balance;
  options.limits.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  if (options.limits.vocab_size <= 0) {
    return Fail(kExitBadInput,
                "--vocab_size is required: token ids must be checked before they are acknowledged");
  }
  options.limits.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  options.limits.require_reward_or_advantages = !absl::GetFlag(FLAGS_sft);
  options.limits.require_ref_logprobs = absl::GetFlag(FLAGS_require_ref_logprobs);
  if (const std::string model = absl::GetFlag(FLAGS_routed_experts_model); !model.empty()) {
    const absl::StatusOr<ModelConfig> config = ModelConfigFromName(model);
    if (!config.ok()) {
      return Fail(kExitBadInput,
                  absl::StrCat("--routed_experts_model=", model, ": ", config.status().message()));
    }
    options.limits.routing = RoutingShapeOf(*config);
    if (options.limits.routing->sparse_layers.empty()) {
      return Fail(kExitBadInput,
                  absl::StrCat("--routed_experts_model=", model, " (", config->model_type,
                               ") has no mixture-of-experts layers"));
    }
  }
  options.limits.require_routed_experts = absl::GetFlag(FLAGS_require_routed_experts);
  if (options.limits.require_routed_experts && !options.limits.routing) {
    return Fail(kExitBadInput, "--require_routed_experts needs --routed_experts_model");
  }
  options.max_pending_trajectories = absl::GetFlag(FLAGS_max_pending);
  options.initial_policy_version = absl::GetFlag(FLAGS_initial_policy_version);

  const std::string address = absl::GetFlag(FLAGS_listen);
  const std::string cert_path = absl::GetFlag(FLAGS_tls_cert);
  const std::string key_path = absl::GetFlag(FLAGS_tls_key);
  if (!absl::GetFlag(FLAGS_token_file).empty()) {
    return Fail(kExitBadInput,
                "--token_file is gone: rollout workers and trainers have separate credentials; "
                "give --rollout_token_file (and --trainer_token_file, or use the one created "
                "beside the log)");
  }
  if (cert_path.empty() != key_path.empty())
    return Fail(kExitBadInput, "--tls_cert and --tls_key go together");
  DispatcherServiceOptions service_options;
  service_options.worker_threads = absl::GetFlag(FLAGS_worker_threads);
  const int64_t held_mb = absl::GetFlag(FLAGS_max_held_mb);
  if (held_mb < 1 || held_mb > (1 << 20))
    return Fail(kExitBadInput, "--max_held_mb must be in [1, 1048576]");
  service_options.max_held_bytes = held_mb << 20;
  service_options.max_ingest_streams = absl::GetFlag(FLAGS_max_ingest_streams);
  if (service_options.max_ingest_streams < 1)
    return Fail(kExitBadInput, "--max_ingest_streams must be >= 1");
  if (const std::string path = absl::GetFlag(FLAGS_rollout_token_file); !path.empty()) {
    absl::StatusOr<std::string> token = ReadPrivateFile(path);
    if (!token.ok())
      return Fail(kExitBadInput, absl::StrCat("--rollout_token_file: ", token.status().message()));
    service_options.rollout_token = *std::move(token);
  }
  // The trainers' credential: the file given, or one created beside the log (kept across restarts).
  const bool given = !absl::GetFlag(FLAGS_trainer_token_file).empty();
  const std::string trainer_token_path =
      given ? absl::GetFlag(FLAGS_trainer_token_file) : options.wal_path + ".trainer-token";
  absl::StatusOr<std::string> trainer_token =
      given ? ReadPrivateFile(trainer_token_path) : ReadOrCreateTokenFile(trainer_token_path);
  if (!trainer_token.ok()) {
    return Fail(kExitBadInput, absl::StrCat(given ? "--trainer_token_file: " : "trainer token: ",
                                            trainer_token.status().message()));
  }
  service_options.trainer_token = *std::move(trainer_token);
  if (service_options.rollout_token == service_options.trainer_token) {
    return Fail(kExitBadInput,
                "--rollout_token_file and the trainer token hold the same token: each role needs "
                "its own credential");
  }
  if (!IsLoopbackAddress(address) && (cert_path.empty() || service_options.rollout_token.empty()) &&
      !absl::GetFlag(FLAGS_insecure_remote)) {
    return Fail(kExitBadInput, "--listen=" + address +
                                   " is not loopback: give --tls_cert, --tls_key and "
                                   "--rollout_token_file");
  }
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (!cert_path.empty()) {
    grpc::SslServerCredentialsOptions ssl;
    grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
    absl::StatusOr<std::string> key = ReadPrivateFile(key_path, /*trim=*/false);
    if (!key.ok()) return Fail(kExitBadInput, absl::StrCat("--tls_key: ", key.status().message()));
    absl::StatusOr<std::string> cert = ReadCredentialFile(cert_path, /*trim=*/false);
    if (!cert.ok())
      return Fail(kExitBadInput, absl::StrCat("--tls_cert: ", cert.status().message()));
    pair.private_key = *std::move(key);
    pair.cert_chain = *std::move(cert);
    ssl.pem_key_cert_pairs.push_back(std::move(pair));
    credentials = grpc::SslServerCredentials(ssl);
  }

  absl::StatusOr<std::unique_ptr<DispatcherCore>> core = DispatcherCore::Open(options);
  if (!core.ok()) return Fail(1, absl::StrCat("cannot open the log: ", core.status().ToString()));
  DispatcherService service(core->get(), service_options);
  // Metrics: /metrics renders the core's status and statistics on each scrape; the event files
  // get each step committed from now on (the watcher below looks once a second).
  DispatcherCore& dispatcher = **core;
  absl::StatusOr<std::unique_ptr<MetricsServer>> metrics_server =
      MetricsServerFromFlags("dta-dispatcher", [&dispatcher, &service] {
        const IngestMemory ingest = service.ingest_memory();
        return DispatcherPrometheus(dispatcher.GetStatus(), dispatcher.GetStatistics(), &ingest);
      });
  if (!metrics_server.ok())
    return Fail(kExitBadInput, std::string(metrics_server.status().message()));
  absl::StatusOr<std::unique_ptr<TensorBoardWriter>> tensorboard = TensorBoardFromFlags();
  if (!tensorboard.ok()) return Fail(kExitBadInput, std::string(tensorboard.status().message()));
  int64_t last_written_step = -1;  // steps replayed from the log were written by an earlier run
  const v1::GetStatisticsResponse at_start = dispatcher.GetStatistics();  // outlives the loop
  for (const v1::StepStatistics& step : at_start.recent_steps())
    last_written_step = std::max(last_written_step, step.step());
  const auto write_new_steps = [&] {
    if (*tensorboard == nullptr) return;
    const v1::GetStatisticsResponse statistics = dispatcher.GetStatistics();
    const int64_t pending = dispatcher.GetStatus().pending_trajectories();
    for (const v1::StepStatistics& step : statistics.recent_steps()) {
      if (step.step() <= last_written_step) continue;
      last_written_step = step.step();
      if (absl::Status written =
              (*tensorboard)->Write(step.step(), StepStatisticsScalars(step, pending));
          !written.ok()) {
        // Metrics never stop the service: a full disk costs the event file, not trajectories.
        std::fprintf(stderr, "dta-dispatcher: TensorBoard off: %s\n", written.ToString().c_str());
        tensorboard->reset();
        return;
      }
    }
  };

  const int max_message = absl::GetFlag(FLAGS_max_message_mb) << 20;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(address, credentials, &port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(max_message);
  builder.SetMaxSendMessageSize(max_message);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) return Fail(1, "cannot listen on " + address);
  std::fprintf(stderr, "dta-dispatcher: listening on %s (port %d)\n", address.c_str(), port);
  std::fprintf(stderr,
               "dta-dispatcher: trainers present the token in %s (dta-trainer --token_file)\n",
               trainer_token_path.c_str());

  // Stops on SIGINT / SIGTERM (status 0), or when the log has failed (status 1: nothing more can be
  // acknowledged, and a restart recovers what was).
  int exit_code = 0;
  std::thread watcher([&] {
    const timespec second{1, 0};
    while (true) {
      write_new_steps();
      const int signal = sigtimedwait(&signals, nullptr, &second);
      if (signal > 0) {
        std::fprintf(stderr, "dta-dispatcher: signal %d, stopping\n", signal);
        break;
      }
      if (absl::Status health = (*core)->Health(); !health.ok()) {
        std::fprintf(stderr, "dta-dispatcher: stopping, restart me: %s\n",
                     health.ToString().c_str());
        exit_code = 1;
        break;
      }
    }
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  });
  server->Wait();
  watcher.join();
  std::fprintf(stderr, "dta-dispatcher: stopped\n");
  return exit_code;
}

}  // namespace
}  // namespace dta

int main(int argc, char** argv) {
  dta::SetProgramUsage("Receives rollouts and serves balanced partitions to dta trainers.");
  dta::ParseCommandLine(argc, argv);
  return dta::Run();
}

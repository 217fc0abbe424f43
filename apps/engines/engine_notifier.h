// Tells rollout engines to reload the weights of each checkpoint the trainer publishes, through the
// engines' own HTTP endpoints for loading weights from disk:
//
//   sglang      POST <url>/update_weights_from_disk  {"model_path": P, "weight_version": "V"}
//               (SGLang's server; answers {"success": bool, "message": ...})
//   vllm        POST <url>/collective_rpc  {"method": "reload_weights",
//                                           "kwargs": {"weights_path": P}}
//               (vLLM's server started with VLLM_SERVER_DEV_MODE=1; answers {"results": [...]} or
//               nothing, and a 5xx when a worker fails)
//   areal-vllm  POST <url>/areal_update_weights  {"model_path": P}
//               (AReaL's vLLM server, areal.engine.vllm_ext.areal_vllm_server; answers
//               {"success": bool, "message": ...})
//
// P is the checkpoint's model/ directory (what the engines load), V the policy version its weights
// produce. Each request carries "Content-Type: application/json" and, with a token, "Authorization:
// Bearer <token>" (SGLang's --api-key / --admin-api-key).
//
// A reload succeeded when the answer is 2xx and, for sglang and areal-vllm, a JSON object whose
// "success" is not false; for vllm a 2xx alone (collective_rpc answers 5xx when a worker raised).
// Anything else is a failure: no connection, no answer within `timeout`, a non-2xx status, an
// answer longer than `max_answer_bytes` (never buffered beyond that), an answer that is not a JSON
// object where one is expected, "success": false. A request is made up to `attempts` times,
// `retry_delay` apart, until one succeeds; the last failure is reported on stderr with the engine,
// the HTTP status and a short excerpt of the answer; training goes on and latest.json still names
// the checkpoint. Only a success is reported as "reloaded".
//
// Each engine has its own worker thread and a queue of depth one: while one checkpoint is being
// announced to an engine, later ones coalesce (only the newest is sent to it next), so a slow or
// hung engine delays only itself, never a training step nor another engine, and is never asked for
// weights older than the newest published (keep at least two checkpoints, --keep_checkpoints, so
// the one being loaded is not removed under it).
//
//   ASSIGN_OR_RETURN(std::vector<EngineEndpoint> engines,
//                    ParseEngineEndpoints("sglang=http://10.0.0.5:30000"));
//   EngineNotifier notifier({.engines = engines});
//   notifier.Publish("/ckpt/step-00000007/model", /*policy_version=*/7);
//   ...
//   // Leaving the scope waits at most `timeout` (one attempt's bound) for reloads in flight.
//
// Thread safety: Publish and Shutdown may be called from any thread; Publish never blocks on an
// engine. Shutdown, or the destructor, waits at most until its deadline (the destructor: `timeout`
// from its start), then reports on stderr, per engine, what was not announced.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dta {

enum class EngineKind { kSglang, kVllm, kArealVllm };

struct EngineEndpoint {
  EngineKind kind = EngineKind::kSglang;
  std::string url;  // http(s)://host:port, without a trailing slash
};

// "KIND=URL[,KIND=URL...]" with KIND sglang, vllm or areal-vllm and URL http:// or https://
// (a trailing slash is dropped). INVALID_ARGUMENT naming the entry otherwise; empty: none.
absl::StatusOr<std::vector<EngineEndpoint>> ParseEngineEndpoints(std::string_view spec);

// The request an engine documents for loading `model_path`: the URL and the JSON body.
struct EngineRequest {
  std::string url;
  std::string body;
};
EngineRequest ReloadRequest(const EngineEndpoint& engine, const std::string& model_path,
                            int64_t policy_version);

// How one checkpoint's announcement to one engine ended. `status` is OK when the engine reloaded;
// CANCELLED when shutdown came first (the engine was not told, or did not answer in time);
// UNAVAILABLE for every other failure (its message names the URL, the HTTP status or libcurl's
// error, an excerpt of the answer and the attempts made).
struct EngineOutcome {
  EngineEndpoint engine;
  std::string model_path;
  int64_t policy_version = 0;
  absl::Status status;
};

struct EngineNotifierOptions {
  std::vector<EngineEndpoint> engines;
  std::string bearer_token;  // empty: no Authorization header
  int attempts = 3;          // per engine and checkpoint; values below 1 count as 1
  std::chrono::milliseconds retry_delay{1000};
  // One request's bound, the engine's load of the weights included: an engine that accepts the
  // connection and never answers costs this much per attempt. Also the most the destructor waits.
  std::chrono::milliseconds timeout{std::chrono::seconds(30)};
  // Bound on opening the connection (within `timeout`).
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(5)};
  // An answer longer than this is a failure; no more than this is ever held in memory.
  size_t max_answer_bytes = 64 << 10;
  // Called with each announcement's outcome (after its last attempt), on the engine's worker
  // thread: calls for different engines may run concurrently, and a slow callback delays that
  // engine. Empty: outcomes are only logged.
  std::function<void(const EngineOutcome&)> on_outcome;
  // Outcomes are reported on stderr, each line starting with this.
  std::string log_prefix = "dta-trainer";
};

class EngineNotifier {
 public:
  // Starts one worker thread per engine (none without engines).
  explicit EngineNotifier(EngineNotifierOptions options);
  EngineNotifier(const EngineNotifier&) = delete;
  EngineNotifier& operator=(const EngineNotifier&) = delete;
  // Shutdown(now + options.timeout) unless Shutdown ran already.
  ~EngineNotifier();

  // Queues an announcement of `model_path` to every engine, replacing, per engine, one still
  // waiting. Returns at once. No-op without engines and after Shutdown.
  void Publish(const std::string& model_path, int64_t policy_version);

  // Stops the workers and returns when they have stopped, shortly after `deadline` at the latest:
  // an attempt in flight runs until it ends or `deadline` comes (the transfer is then aborted); a
  // checkpoint still waiting gets one attempt, cut at `deadline`; nothing is retried. Each
  // announcement cut short is reported on stderr ("gave up at shutdown", naming the engine and the
  // checkpoint) and to on_outcome as CANCELLED. Later calls wait for the first to finish and do
  // nothing else.
  void Shutdown(std::chrono::steady_clock::time_point deadline);

 private:
  class Worker;  // one engine's thread and queue

  const EngineNotifierOptions options_;
  std::vector<std::unique_ptr<Worker>> workers_;  // fixed after construction
  std::once_flag shut_down_;
};

}  // namespace dta

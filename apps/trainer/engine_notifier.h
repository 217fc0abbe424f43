// Tells rollout engines to reload the weights of each checkpoint the trainer publishes, through the
// engines' own HTTP endpoints for loading weights from disk:
//
//   sglang      POST <url>/update_weights_from_disk  {"model_path": P, "weight_version": "V"}
//               (SGLang's server; success: a 2xx answer whose "success" is not false)
//   vllm        POST <url>/collective_rpc  {"method": "reload_weights",
//                                           "kwargs": {"weights_path": P}}
//               (vLLM's server started with VLLM_SERVER_DEV_MODE=1; success: a 2xx answer)
//   areal-vllm  POST <url>/areal_update_weights  {"model_path": P}
//               (AReaL's vLLM server, areal.engine.vllm_ext.areal_vllm_server)
//
// P is the checkpoint's model/ directory (what the engines load), V the policy version its weights
// produce. Each request carries "Content-Type: application/json" and, with a token, "Authorization:
// Bearer <token>" (SGLang's --api-key / --admin-api-key).
//
// Notifications run on a background thread, so a training step never waits for an engine. A failed
// request (no connection, a timeout, a non-2xx answer, SGLang's "success": false) is retried
// `attempts` times, then reported on stderr; training goes on and latest.json still names the
// checkpoint. While one checkpoint is being announced, later ones coalesce: only the newest is sent
// next, so a slow engine is never asked for weights older than the newest published (keep at least
// two checkpoints, --keep_checkpoints, so the one being loaded is not removed under the engine).
//
//   ASSIGN_OR_RETURN(std::vector<EngineEndpoint> engines,
//                    ParseEngineEndpoints("sglang=http://10.0.0.5:30000"));
//   EngineNotifier notifier({.engines = engines});
//   notifier.Publish("/ckpt/step-00000007/model", /*policy_version=*/7);
//
// Thread safety: Publish may be called from any thread; the destructor waits for the newest
// checkpoint to be announced (bounded by attempts x timeout).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
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

struct EngineNotifierOptions {
  std::vector<EngineEndpoint> engines;
  std::string bearer_token;  // empty: no Authorization header
  int attempts = 3;          // >= 1
  std::chrono::milliseconds retry_delay{1000};
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};  // per request (engines load)
  // Outcomes are reported on stderr, each line starting with this.
  std::string log_prefix = "dta-trainer";
};

class EngineNotifier {
 public:
  explicit EngineNotifier(EngineNotifierOptions options);
  EngineNotifier(const EngineNotifier&) = delete;
  EngineNotifier& operator=(const EngineNotifier&) = delete;
  ~EngineNotifier();

  // Queues an announcement of `model_path` (replacing one still waiting). No-op without engines.
  void Publish(const std::string& model_path, int64_t policy_version);

 private:
  struct Pending {
    std::string model_path;
    int64_t policy_version = 0;
  };
  void Run();
  absl::Status Announce(const EngineEndpoint& engine, const Pending& pending) const;
  void Log(const std::string& line) const;

  const EngineNotifierOptions options_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::optional<Pending> waiting_;  // guarded by mutex_
  bool stopping_ = false;           // guarded by mutex_
  std::thread worker_;
};

}  // namespace dta

#include "apps/engines/engine_notifier.h"

#include <curl/curl.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace dta {
namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

// libcurl's process-wide start, once, before the first worker's handle.
absl::Status CurlReady() {
  static const CURLcode initialized = curl_global_init(CURL_GLOBAL_DEFAULT);
  if (initialized != CURLE_OK) {
    return absl::InternalError(
        absl::StrCat("libcurl cannot start: ", curl_easy_strerror(initialized)));
  }
  return absl::OkStatus();
}

// An answer's body, cut at `limit`: the write callback refuses the bytes past it, which ends the
// transfer (CURLE_WRITE_ERROR) rather than buffering whatever an engine sends.
struct BodySink {
  std::string body;
  size_t limit = 0;
  bool overflowed = false;
};

size_t AppendBody(char* data, size_t size, size_t count, void* out) {
  auto* sink = static_cast<BodySink*>(out);
  const size_t bytes = size * count;
  const size_t room = sink->limit - sink->body.size();
  if (bytes > room) {
    sink->body.append(data, room);  // kept for the excerpt
    sink->overflowed = true;
    return 0;
  }
  sink->body.append(data, bytes);
  return bytes;
}

const char* KindName(EngineKind kind) {
  switch (kind) {
    case EngineKind::kSglang:
      return "sglang";
    case EngineKind::kVllm:
      return "vllm";
    case EngineKind::kArealVllm:
      return "areal-vllm";
  }
  return "?";
}

// The first bytes of an answer on one line, for an error message.
std::string Excerpt(std::string_view body) {
  if (body.empty()) return "(empty answer)";
  constexpr size_t kShown = 200;
  std::string excerpt(body.substr(0, kShown));
  for (char& c : excerpt) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  }
  if (body.size() > kShown) excerpt += "...";
  return excerpt;
}

// Whether a complete answer says the engine reloaded (the header gives each kind's protocol).
absl::Status CheckAnswer(EngineKind kind, const std::string& url, long status,
                         const std::string& body) {
  const std::string where = absl::StrCat(url, ": HTTP ", status, ": ");
  if (status < 200 || status >= 300) {
    return absl::UnavailableError(absl::StrCat(where, Excerpt(body)));
  }
  // collective_rpc answers 2xx only once every worker ran reload_weights (a worker's exception is
  // a 5xx); its body holds the workers' return values, which say nothing about success.
  if (kind == EngineKind::kVllm) return absl::OkStatus();
  const Json json = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object()) {
    return absl::UnavailableError(
        absl::StrCat(where, "the answer is not a JSON object: ", Excerpt(body)));
  }
  const auto success = json.find("success");
  if (success == json.end()) return absl::OkStatus();
  if (!success->is_boolean()) {
    return absl::UnavailableError(
        absl::StrCat(where, "\"success\" is not true or false: ", Excerpt(body)));
  }
  if (!success->get<bool>()) {
    return absl::UnavailableError(absl::StrCat(where, "the engine refused: ", Excerpt(body)));
  }
  return absl::OkStatus();
}

// Milliseconds from now until `until` for curl_multi_poll, at most `cap`, at least 0.
int PollMs(Clock::time_point until, std::chrono::milliseconds cap) {
  const Clock::time_point now = Clock::now();
  if (until <= now) return 0;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - now);
  return static_cast<int>(std::min(left, cap).count());
}

}  // namespace

absl::StatusOr<std::vector<EngineEndpoint>> ParseEngineEndpoints(std::string_view spec) {
  std::vector<EngineEndpoint> engines;
  if (spec.empty()) return engines;
  int index = 0;
  for (absl::string_view entry : absl::StrSplit(absl::string_view(spec.data(), spec.size()), ',')) {
    ++index;
    const std::string where = absl::StrCat("engine ", index, " '", entry, "'");
    const size_t equals = entry.find('=');
    if (equals == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected KIND=URL (KIND sglang, vllm or areal-vllm)"));
    }
    const absl::string_view kind = entry.substr(0, equals);
    absl::string_view url = entry.substr(equals + 1);
    EngineEndpoint engine;
    if (kind == "sglang") {
      engine.kind = EngineKind::kSglang;
    } else if (kind == "vllm") {
      engine.kind = EngineKind::kVllm;
    } else if (kind == "areal-vllm") {
      engine.kind = EngineKind::kArealVllm;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": unknown kind '", kind, "' (sglang, vllm or areal-vllm)"));
    }
    absl::string_view host = url;
    if (!absl::ConsumePrefix(&host, "http://") && !absl::ConsumePrefix(&host, "https://")) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the URL must start with http:// or https://"));
    }
    absl::ConsumeSuffix(&url, "/");
    if (absl::ConsumeSuffix(&host, "/"); host.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the URL names no host"));
    }
    engine.url = std::string(url);
    engines.push_back(std::move(engine));
  }
  return engines;
}

EngineRequest ReloadRequest(const EngineEndpoint& engine, const std::string& model_path,
                            int64_t policy_version) {
  switch (engine.kind) {
    case EngineKind::kSglang:
      return {absl::StrCat(engine.url, "/update_weights_from_disk"),
              Json{{"model_path", model_path}, {"weight_version", std::to_string(policy_version)}}
                  .dump()};
    case EngineKind::kVllm:
      return {
          absl::StrCat(engine.url, "/collective_rpc"),
          Json{{"method", "reload_weights"}, {"kwargs", {{"weights_path", model_path}}}}.dump()};
    case EngineKind::kArealVllm:
      return {absl::StrCat(engine.url, "/areal_update_weights"),
              Json{{"model_path", model_path}}.dump()};
  }
  return {};
}

// One engine's worker: a thread, a queue of depth one, and a libcurl multi handle whose transfers
// a Stop from another thread wakes (curl_multi_wakeup), so that shutdown cuts a hung request at
// once rather than at its timeout.
class EngineNotifier::Worker {
 public:
  Worker(EngineEndpoint engine, const EngineNotifierOptions& options)
      : engine_(std::move(engine)),
        options_(options),
        multi_(CurlReady().ok() ? curl_multi_init() : nullptr),
        thread_([this] { Run(); }) {}
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ~Worker() {
    Stop(Clock::now());
    Join();
    if (multi_ != nullptr) curl_multi_cleanup(multi_);
  }

  void Publish(std::string model_path, int64_t policy_version) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
      waiting_ = Pending{std::move(model_path), policy_version};
    }
    changed_.notify_all();
  }

  // Asks the thread to finish by `deadline` (the first call's deadline holds).
  void Stop(Clock::time_point deadline) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
      deadline_ = deadline;
    }
    changed_.notify_all();
    if (multi_ != nullptr) curl_multi_wakeup(multi_);  // thread-safe; wakes the current poll
  }

  void Join() {
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct Pending {
    std::string model_path;
    int64_t policy_version = 0;
  };

  void Run() {
    while (true) {
      Pending pending;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [this] { return waiting_.has_value() || stopping_; });
        if (!waiting_.has_value()) return;  // stopping with nothing left to say
        pending = *std::move(waiting_);
        waiting_.reset();
      }
      Report(pending, Announce(pending));
    }
  }

  // Up to `attempts` attempts, `retry_delay` apart; none after the first once shutting down.
  absl::Status Announce(const Pending& pending) {
    const EngineRequest request =
        ReloadRequest(engine_, pending.model_path, pending.policy_version);
    const int attempts = std::max(1, options_.attempts);
    absl::Status last;
    int made = 0;
    while (made < attempts) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (made > 0) {
          changed_.wait_until(lock, Clock::now() + options_.retry_delay,
                              [this] { return stopping_; });
          if (stopping_) break;
        }
        if (stopping_ && Clock::now() >= deadline_) {
          return absl::CancelledError("shutdown came before the request was sent");
        }
      }
      ++made;
      last = Attempt(request);
      if (last.ok() || absl::IsCancelled(last)) return last;
    }
    return absl::Status(last.code(), absl::StrCat(last.message(), " (after ", made,
                                                  made == 1 ? " attempt)" : " attempts)"));
  }

  // One POST, cut at `timeout` (libcurl's own) or at the shutdown deadline (CANCELLED), and its
  // answer checked.
  absl::Status Attempt(const EngineRequest& request) {
    if (multi_ == nullptr) {
      if (absl::Status ready = CurlReady(); !ready.ok()) return ready;
      return absl::InternalError("libcurl cannot make a multi handle");
    }
    std::unique_ptr<CURL, decltype(&curl_easy_cleanup)> curl(curl_easy_init(), curl_easy_cleanup);
    if (curl == nullptr) return absl::InternalError("libcurl cannot make a handle");
    curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
    headers = curl_slist_append(headers, "Expect:");  // no 100-continue round trip
    if (!options_.bearer_token.empty()) {
      headers = curl_slist_append(
          headers, absl::StrCat("Authorization: Bearer ", options_.bearer_token).c_str());
    }
    std::unique_ptr<curl_slist, decltype(&curl_slist_free_all)> header_list(headers,
                                                                            curl_slist_free_all);
    const long timeout_ms = std::max<long>(1, options_.timeout.count());
    const long connect_ms =
        std::max<long>(1, std::min<long>(options_.connect_timeout.count(), timeout_ms));
    BodySink sink{.limit = options_.max_answer_bytes};
    char error[CURL_ERROR_SIZE] = "";
    CURL* handle = curl.get();
    curl_easy_setopt(handle, CURLOPT_URL, request.url.c_str());
    curl_easy_setopt(handle, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(handle, CURLOPT_NOSIGNAL, 1L);  // timeouts without signals: a worker thread
    curl_easy_setopt(handle, CURLOPT_POST, 1L);
    curl_easy_setopt(handle, CURLOPT_POSTFIELDS, request.body.data());
    curl_easy_setopt(handle, CURLOPT_POSTFIELDSIZE_LARGE,
                     static_cast<curl_off_t>(request.body.size()));
    curl_easy_setopt(handle, CURLOPT_HTTPHEADER, header_list.get());
    curl_easy_setopt(handle, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(handle, CURLOPT_CONNECTTIMEOUT_MS, connect_ms);
    curl_easy_setopt(handle, CURLOPT_WRITEFUNCTION, AppendBody);
    curl_easy_setopt(handle, CURLOPT_WRITEDATA, &sink);
    curl_easy_setopt(handle, CURLOPT_ERRORBUFFER, error);
    if (const CURLMcode added = curl_multi_add_handle(multi_, handle); added != CURLM_OK) {
      return absl::InternalError(
          absl::StrCat("libcurl cannot start a transfer: ", curl_multi_strerror(added)));
    }
    const std::unique_ptr<CURL, std::function<void(CURL*)>> in_multi(
        handle, [this](CURL* h) { curl_multi_remove_handle(multi_, h); });
    while (true) {
      int running = 0;
      if (const CURLMcode performed = curl_multi_perform(multi_, &running); performed != CURLM_OK) {
        return absl::InternalError(
            absl::StrCat(request.url, ": libcurl: ", curl_multi_strerror(performed)));
      }
      if (running == 0) break;
      Clock::time_point deadline;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        deadline = stopping_ ? deadline_ : Clock::time_point::max();
      }
      if (Clock::now() >= deadline) {
        return absl::CancelledError(absl::StrCat(request.url, ": no answer before shutdown"));
      }
      // Stop's wakeup ends the poll early; the cap only bounds how stale `deadline` can get.
      curl_multi_poll(multi_, nullptr, 0, PollMs(deadline, std::chrono::seconds(1)), nullptr);
    }
    CURLcode code = CURLE_OK;
    bool done = false;
    int queued = 0;
    while (CURLMsg* message = curl_multi_info_read(multi_, &queued)) {
      if (message->msg == CURLMSG_DONE && message->easy_handle == handle) {
        code = message->data.result;
        done = true;
      }
    }
    if (!done) return absl::InternalError(absl::StrCat(request.url, ": libcurl lost the transfer"));
    long status = 0;
    curl_easy_getinfo(handle, CURLINFO_RESPONSE_CODE, &status);
    if (sink.overflowed) {
      return absl::UnavailableError(absl::StrCat(request.url, ": HTTP ", status,
                                                 ": the answer is longer than ", sink.limit,
                                                 " bytes: ", Excerpt(sink.body)));
    }
    if (code != CURLE_OK) {
      return absl::UnavailableError(
          absl::StrCat(request.url, ": ", error[0] != '\0' ? error : curl_easy_strerror(code)));
    }
    return CheckAnswer(engine_.kind, request.url, status, sink.body);
  }

  void Report(const Pending& pending, const absl::Status& status) const {
    const std::string engine =
        absl::StrCat("the ", KindName(engine_.kind), " engine at ", engine_.url);
    const std::string what =
        absl::StrCat(pending.model_path, " (policy version ", pending.policy_version, ")");
    std::string line;
    if (status.ok()) {
      line = absl::StrCat(engine, " reloaded policy version ", pending.policy_version, " from ",
                          pending.model_path);
    } else if (absl::IsCancelled(status)) {
      line = absl::StrCat("gave up at shutdown on telling ", engine, " to reload ", what, ": ",
                          status.message());
    } else {
      line = absl::StrCat("could not tell ", engine, " to reload ", what, ": ", status.message());
    }
    std::fprintf(stderr, "%s: %s\n", options_.log_prefix.c_str(), line.c_str());
    if (options_.on_outcome) {
      options_.on_outcome({engine_, pending.model_path, pending.policy_version, status});
    }
  }

  const EngineEndpoint engine_;
  const EngineNotifierOptions& options_;  // the notifier's, which outlives its workers
  CURLM* const multi_;                    // null when libcurl cannot start (each attempt says so)
  std::mutex mutex_;
  std::condition_variable changed_;
  std::optional<Pending> waiting_;                         // guarded by mutex_
  bool stopping_ = false;                                  // guarded by mutex_
  Clock::time_point deadline_ = Clock::time_point::max();  // guarded by mutex_; set by Stop
  std::thread thread_;  // last, so that it starts after the members it uses
};

EngineNotifier::EngineNotifier(EngineNotifierOptions options) : options_(std::move(options)) {
  workers_.reserve(options_.engines.size());
  for (const EngineEndpoint& engine : options_.engines) {
    workers_.push_back(std::make_unique<Worker>(engine, options_));
  }
}

EngineNotifier::~EngineNotifier() { Shutdown(Clock::now() + options_.timeout); }

void EngineNotifier::Publish(const std::string& model_path, int64_t policy_version) {
  for (const std::unique_ptr<Worker>& worker : workers_)
    worker->Publish(model_path, policy_version);
}

void EngineNotifier::Shutdown(std::chrono::steady_clock::time_point deadline) {
  std::call_once(shut_down_, [&] {
    for (const std::unique_ptr<Worker>& worker : workers_) worker->Stop(deadline);
    for (const std::unique_ptr<Worker>& worker : workers_) worker->Join();
  });
}

}  // namespace dta

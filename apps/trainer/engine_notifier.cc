#include "apps/trainer/engine_notifier.h"

#include <curl/curl.h>

#include <cstdio>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace dta {
namespace {

using Json = nlohmann::json;

struct HttpAnswer {
  long status = 0;
  std::string body;
};

size_t AppendBody(char* data, size_t size, size_t count, void* out) {
  static_cast<std::string*>(out)->append(data, size * count);
  return size * count;
}

// One JSON POST through libcurl; an error status when no HTTP answer came back.
absl::StatusOr<HttpAnswer> PostJson(const std::string& url, const std::string& body,
                                    const std::string& bearer_token,
                                    std::chrono::milliseconds timeout) {
  static const CURLcode initialized = curl_global_init(CURL_GLOBAL_DEFAULT);
  if (initialized != CURLE_OK) {
    return absl::InternalError(
        absl::StrCat("libcurl cannot start: ", curl_easy_strerror(initialized)));
  }
  std::unique_ptr<CURL, decltype(&curl_easy_cleanup)> curl(curl_easy_init(), curl_easy_cleanup);
  if (curl == nullptr) return absl::InternalError("libcurl cannot make a handle");
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  if (!bearer_token.empty()) {
    headers =
        curl_slist_append(headers, absl::StrCat("Authorization: Bearer ", bearer_token).c_str());
  }
  std::unique_ptr<curl_slist, decltype(&curl_slist_free_all)> header_list(headers,
                                                                          curl_slist_free_all);
  HttpAnswer answer;
  char error[CURL_ERROR_SIZE] = "";
  CURL* handle = curl.get();
  curl_easy_setopt(handle, CURLOPT_URL, url.c_str());
  curl_easy_setopt(handle, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(handle, CURLOPT_NOSIGNAL, 1L);  // timeouts without signals: a worker thread
  curl_easy_setopt(handle, CURLOPT_POST, 1L);
  curl_easy_setopt(handle, CURLOPT_POSTFIELDS, body.data());
  curl_easy_setopt(handle, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
  curl_easy_setopt(handle, CURLOPT_HTTPHEADER, header_list.get());
  curl_easy_setopt(handle, CURLOPT_TIMEOUT_MS, static_cast<long>(timeout.count()));
  curl_easy_setopt(handle, CURLOPT_WRITEFUNCTION, AppendBody);
  curl_easy_setopt(handle, CURLOPT_WRITEDATA, &answer.body);
  curl_easy_setopt(handle, CURLOPT_ERRORBUFFER, error);
  const CURLcode code = curl_easy_perform(handle);
  if (code != CURLE_OK) {
    return absl::UnavailableError(
        absl::StrCat(url, ": ", error[0] != '\0' ? error : curl_easy_strerror(code)));
  }
  curl_easy_getinfo(handle, CURLINFO_RESPONSE_CODE, &answer.status);
  return answer;
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

// The first bytes of an answer, for an error message.
std::string Excerpt(const std::string& body) {
  constexpr size_t kShown = 300;
  return body.size() <= kShown ? body : absl::StrCat(body.substr(0, kShown), "...");
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

EngineNotifier::EngineNotifier(EngineNotifierOptions options) : options_(std::move(options)) {
  if (!options_.engines.empty()) worker_ = std::thread([this] { Run(); });
}

EngineNotifier::~EngineNotifier() {
  if (!worker_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  worker_.join();  // after the newest waiting checkpoint is announced
}

void EngineNotifier::Publish(const std::string& model_path, int64_t policy_version) {
  if (options_.engines.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    waiting_ = Pending{model_path, policy_version};
  }
  changed_.notify_all();
}

void EngineNotifier::Run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [this] { return waiting_.has_value() || stopping_; });
    if (!waiting_.has_value()) return;  // stopping with nothing left to say
    const Pending pending = *std::move(waiting_);
    waiting_.reset();
    lock.unlock();
    for (const EngineEndpoint& engine : options_.engines) {
      const absl::Status status = Announce(engine, pending);
      Log(status.ok()
              ? absl::StrCat("the ", KindName(engine.kind), " engine at ", engine.url,
                             " reloaded policy version ", pending.policy_version, " from ",
                             pending.model_path)
              : absl::StrCat("could not tell the ", KindName(engine.kind), " engine at ",
                             engine.url, " to reload ", pending.model_path, " (policy version ",
                             pending.policy_version, "): ", status.message()));
    }
    lock.lock();
  }
}

absl::Status EngineNotifier::Announce(const EngineEndpoint& engine, const Pending& pending) const {
  const EngineRequest request = ReloadRequest(engine, pending.model_path, pending.policy_version);
  absl::Status last;
  for (int attempt = 1; attempt <= std::max(1, options_.attempts); ++attempt) {
    if (attempt > 1) std::this_thread::sleep_for(options_.retry_delay);
    absl::StatusOr<HttpAnswer> answer =
        PostJson(request.url, request.body, options_.bearer_token, options_.timeout);
    if (!answer.ok()) {
      last = answer.status();
      continue;
    }
    if (answer->status < 200 || answer->status >= 300) {
      last = absl::UnavailableError(
          absl::StrCat(request.url, ": HTTP ", answer->status, ": ", Excerpt(answer->body)));
      continue;
    }
    if (engine.kind == EngineKind::kSglang) {
      const Json json = Json::parse(answer->body, nullptr, /*allow_exceptions=*/false);
      if (json.is_object() && json.contains("success") && json["success"] == false) {
        last = absl::UnavailableError(
            absl::StrCat(request.url, ": the engine refused: ", Excerpt(answer->body)));
        continue;
      }
    }
    return absl::OkStatus();
  }
  return absl::Status(last.code(), absl::StrCat(last.message(), " (after ",
                                                std::max(1, options_.attempts), " attempts)"));
}

void EngineNotifier::Log(const std::string& line) const {
  std::fprintf(stderr, "%s: %s\n", options_.log_prefix.c_str(), line.c_str());
}

}  // namespace dta

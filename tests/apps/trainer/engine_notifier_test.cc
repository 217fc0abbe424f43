// EngineNotifier against engines played by tiny HTTP servers on 127.0.0.1: healthy engines of each
// kind reload; bad answers (non-2xx, not JSON where JSON is expected, "success": false, longer than
// the bound) are failures, never "reloaded"; a hung engine (accepts, never answers) neither blocks
// Publish, nor holds shutdown past one attempt's bound, nor keeps another engine from reloading.
#include "apps/engines/engine_notifier.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace dta {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using ::testing::HasSubstr;
using ::testing::Not;

// A whole HTTP/1.1 answer that closes the connection.
std::string HttpAnswer(int status, const std::string& body) {
  return absl::StrCat("HTTP/1.1 ", status,
                      " X\r\nContent-Type: application/json\r\nContent-Length: ", body.size(),
                      "\r\nConnection: close\r\n\r\n", body);
}

struct SeenRequest {
  std::string path;
  std::string body;
};

// An engine on 127.0.0.1, served by one thread: it reads each request and writes what `answer`
// returns for it, or, given nullopt, keeps the connection open unanswered until the server is
// destroyed (a hung engine). Destroy it after the notifier, so that the notifier sees the hang.
class FakeEngine {
 public:
  using Answer = std::function<std::optional<std::string>(const SeenRequest&)>;

  explicit FakeEngine(Answer answer) : answer_(std::move(answer)) {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t size = sizeof(address);
    if (listener_ < 0 || bind(listener_, reinterpret_cast<sockaddr*>(&address), size) != 0 ||
        listen(listener_, 16) != 0 ||
        getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &size) != 0 ||
        pipe(stop_) != 0) {
      ADD_FAILURE() << "cannot listen on 127.0.0.1";
      return;
    }
    url_ = absl::StrCat("http://127.0.0.1:", ntohs(address.sin_port));
    thread_ = std::thread([this] { Serve(); });
  }
  FakeEngine(const FakeEngine&) = delete;
  FakeEngine& operator=(const FakeEngine&) = delete;
  ~FakeEngine() {
    if (thread_.joinable()) {
      (void)!write(stop_[1], "x", 1);
      thread_.join();
    }
    for (int held : held_) close(held);
    for (int fd : {listener_, stop_[0], stop_[1]}) {
      if (fd >= 0) close(fd);
    }
  }

  const std::string& url() const { return url_; }

  // Whether `count` requests arrived within `timeout`.
  bool WaitForRequests(size_t count, milliseconds timeout = milliseconds(5000)) {
    std::unique_lock<std::mutex> lock(mutex_);
    return arrived_.wait_for(lock, timeout, [&] { return seen_.size() >= count; });
  }
  std::vector<SeenRequest> seen() {
    std::lock_guard<std::mutex> lock(mutex_);
    return seen_;
  }

 private:
  void Serve() {
    while (true) {
      pollfd fds[2] = {{listener_, POLLIN, 0}, {stop_[0], POLLIN, 0}};
      if (poll(fds, 2, -1) < 0 || (fds[1].revents & POLLIN) != 0) return;
      const int connection = accept(listener_, nullptr, nullptr);
      if (connection < 0) continue;
      timeval bound{.tv_sec = 2, .tv_usec = 0};  // a request is sent at once; never wait long
      setsockopt(connection, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof(bound));
      std::optional<SeenRequest> request = Read(connection);
      if (!request.has_value()) {
        close(connection);
        continue;
      }
      const std::optional<std::string> answer = answer_(*request);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        seen_.push_back(*std::move(request));
      }
      arrived_.notify_all();
      if (!answer.has_value()) {
        held_.push_back(connection);
        continue;
      }
      // The client may hang up early (an answer over its bound): MSG_NOSIGNAL, stop on error.
      for (size_t sent = 0; sent < answer->size();) {
        const ssize_t n =
            send(connection, answer->data() + sent, answer->size() - sent, MSG_NOSIGNAL);
        if (n <= 0) break;
        sent += n;
      }
      close(connection);
    }
  }

  // The request line's path and the body (by Content-Length); nullopt on a short read.
  static std::optional<SeenRequest> Read(int connection) {
    std::string data;
    char buffer[4096];
    size_t head_end = std::string::npos;
    size_t length = 0;
    while (true) {
      if (head_end == std::string::npos && (head_end = data.find("\r\n\r\n")) != data.npos) {
        for (absl::string_view line : absl::StrSplit(data.substr(0, head_end), "\r\n")) {
          const std::string lower = absl::AsciiStrToLower(line);
          if (absl::StartsWith(lower, "content-length:")) {
            (void)absl::SimpleAtoi(absl::StripAsciiWhitespace(lower.substr(15)), &length);
          }
        }
      }
      if (head_end != std::string::npos && data.size() >= head_end + 4 + length) break;
      const ssize_t n = recv(connection, buffer, sizeof(buffer), 0);
      if (n <= 0) return std::nullopt;
      data.append(buffer, n);
    }
    const std::vector<std::string> request_line =
        absl::StrSplit(data.substr(0, data.find("\r\n")), ' ');
    return SeenRequest{request_line.size() > 1 ? request_line[1] : "",
                       data.substr(head_end + 4, length)};
  }

  const Answer answer_;
  std::string url_;
  int listener_ = -1;
  int stop_[2] = {-1, -1};
  std::thread thread_;
  std::vector<int> held_;  // hung connections (the serving thread's)
  std::mutex mutex_;
  std::condition_variable arrived_;
  std::vector<SeenRequest> seen_;  // guarded by mutex_
};

FakeEngine::Answer Always(int status, std::string body) {
  return [status, body](const SeenRequest&) { return HttpAnswer(status, body); };
}
FakeEngine::Answer Never() {
  return [](const SeenRequest&) { return std::nullopt; };
}

// The outcomes a notifier reports, for waiting on.
class Outcomes {
 public:
  std::function<void(const EngineOutcome&)> Callback() {
    return [this](const EngineOutcome& outcome) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        outcomes_.push_back(outcome);
      }
      changed_.notify_all();
    };
  }

  // The outcome for `url` and `policy_version`, waiting up to `timeout` for it.
  std::optional<EngineOutcome> WaitFor(const std::string& url, int64_t policy_version,
                                       milliseconds timeout = milliseconds(5000)) {
    std::unique_lock<std::mutex> lock(mutex_);
    std::optional<EngineOutcome> found;
    changed_.wait_for(lock, timeout, [&] {
      for (const EngineOutcome& outcome : outcomes_) {
        if (outcome.engine.url == url && outcome.policy_version == policy_version) {
          found = outcome;
          return true;
        }
      }
      return false;
    });
    return found;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<EngineOutcome> outcomes_;  // guarded by mutex_
};

std::string ModelPath(int64_t version) { return absl::StrCat("/ckpt/step-", version, "/model"); }

milliseconds Since(Clock::time_point start) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - start);
}

TEST(EngineNotifier, HealthyEnginesOfEachKindReload) {
  FakeEngine sglang(Always(200, R"({"success": true, "message": "ok", "num_paused_requests": 0})"));
  FakeEngine vllm(Always(200, ""));  // collective_rpc: 2xx, whatever the body
  FakeEngine areal(Always(200, R"({"success": true, "message": "TP rank: 0 success\n"})"));
  Outcomes outcomes;
  testing::internal::CaptureStderr();
  {
    EngineNotifier notifier({.engines = {{EngineKind::kSglang, sglang.url()},
                                         {EngineKind::kVllm, vllm.url()},
                                         {EngineKind::kArealVllm, areal.url()}},
                             .on_outcome = outcomes.Callback()});
    notifier.Publish(ModelPath(7), 7);
    for (const FakeEngine* engine : {&sglang, &vllm, &areal}) {
      const std::optional<EngineOutcome> outcome = outcomes.WaitFor(engine->url(), 7);
      ASSERT_TRUE(outcome.has_value()) << engine->url();
      EXPECT_TRUE(outcome->status.ok()) << outcome->status;
      EXPECT_EQ(outcome->model_path, ModelPath(7));
    }
  }
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, HasSubstr(absl::StrCat("the sglang engine at ", sglang.url(),
                                          " reloaded policy version 7 from /ckpt/step-7/model")));
  ASSERT_EQ(sglang.seen().size(), 1);
  EXPECT_EQ(sglang.seen()[0].path, "/update_weights_from_disk");
  EXPECT_EQ(nlohmann::json::parse(sglang.seen()[0].body),
            nlohmann::json({{"model_path", ModelPath(7)}, {"weight_version", "7"}}));
  ASSERT_EQ(vllm.seen().size(), 1);
  EXPECT_EQ(vllm.seen()[0].path, "/collective_rpc");
  ASSERT_EQ(areal.seen().size(), 1);
  EXPECT_EQ(areal.seen()[0].path, "/areal_update_weights");
}

TEST(EngineNotifier, BadAnswersAreFailuresNotReloads) {
  struct Case {
    EngineKind kind;
    FakeEngine::Answer answer;
    std::string expected;  // in the failure's message
  };
  const std::string huge =
      absl::StrCat(R"({"success": true, "pad": ")", std::string(1 << 20, 'x'), R"("})");
  std::vector<Case> cases = {
      {EngineKind::kSglang, Always(200, "<html>proxy</html>"),
       "HTTP 200: the answer is not a JSON object: <html>proxy</html>"},
      {EngineKind::kSglang, Always(200, ""), "HTTP 200: the answer is not a JSON object"},
      {EngineKind::kSglang, Always(200, R"({"success": false, "message": "no such path"})"),
       "HTTP 200: the engine refused: {\"success\": false"},
      {EngineKind::kSglang, Always(400, R"({"success": false, "message": "no such path"})"),
       "HTTP 400: {\"success\": false"},
      {EngineKind::kSglang, Always(200, huge), "HTTP 200: the answer is longer than 65536 bytes"},
      {EngineKind::kArealVllm, Always(200, R"({"success": false, "message": "TP rank: 0 failed"})"),
       "the engine refused"},
      {EngineKind::kArealVllm, Always(200, "OK"), "not a JSON object"},
      {EngineKind::kVllm, Always(500, "Internal Server Error"), "HTTP 500: Internal Server Error"},
      {EngineKind::kVllm, Always(200, huge), "the answer is longer than 65536 bytes"},
  };
  std::vector<std::unique_ptr<FakeEngine>> engines;
  EngineNotifierOptions options{.attempts = 2, .retry_delay = milliseconds(10)};
  for (const Case& c : cases) {
    engines.push_back(std::make_unique<FakeEngine>(c.answer));
    options.engines.push_back({c.kind, engines.back()->url()});
  }
  Outcomes outcomes;
  options.on_outcome = outcomes.Callback();
  testing::internal::CaptureStderr();
  {
    EngineNotifier notifier(options);
    notifier.Publish(ModelPath(3), 3);
    for (size_t i = 0; i < cases.size(); ++i) {
      const std::optional<EngineOutcome> outcome = outcomes.WaitFor(engines[i]->url(), 3);
      ASSERT_TRUE(outcome.has_value()) << "case " << i;
      EXPECT_EQ(outcome->status.code(), absl::StatusCode::kUnavailable) << "case " << i;
      EXPECT_THAT(outcome->status.message(), HasSubstr(cases[i].expected)) << "case " << i;
      EXPECT_THAT(outcome->status.message(), HasSubstr("(after 2 attempts)")) << "case " << i;
      EXPECT_EQ(engines[i]->seen().size(), 2) << "case " << i;
    }
  }
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, Not(HasSubstr("reloaded")));
  EXPECT_THAT(log, Not(HasSubstr(std::string(1000, 'x'))));  // excerpts stay short
  for (const std::unique_ptr<FakeEngine>& engine : engines) {
    EXPECT_THAT(log, HasSubstr(absl::StrCat("engine at ", engine->url(),
                                            " to reload /ckpt/step-3/model (policy version 3)")));
  }
}

// A hung engine, a long request timeout and an explicit Shutdown: Publish never waits, and
// Shutdown aborts the transfer in flight at its deadline, not at the request's timeout.
TEST(EngineNotifier, HungEngineNeverHoldsPublishAndShutdownAbortsAtTheDeadline) {
  FakeEngine hung(Never());
  Outcomes outcomes;
  EngineNotifier notifier({.engines = {{EngineKind::kSglang, hung.url()}},
                           .timeout = std::chrono::seconds(60),
                           .on_outcome = outcomes.Callback()});
  notifier.Publish(ModelPath(1), 1);
  ASSERT_TRUE(hung.WaitForRequests(1));
  Clock::time_point start = Clock::now();
  for (int version = 2; version <= 50; ++version) notifier.Publish(ModelPath(version), version);
  EXPECT_LT(Since(start), milliseconds(500));

  testing::internal::CaptureStderr();
  start = Clock::now();
  notifier.Shutdown(Clock::now() + milliseconds(200));
  EXPECT_LT(Since(start), milliseconds(1500));
  const std::string log = testing::internal::GetCapturedStderr();

  const std::optional<EngineOutcome> in_flight = outcomes.WaitFor(hung.url(), 1, milliseconds(0));
  ASSERT_TRUE(in_flight.has_value());
  EXPECT_EQ(in_flight->status.code(), absl::StatusCode::kCancelled) << in_flight->status;
  const std::optional<EngineOutcome> newest = outcomes.WaitFor(hung.url(), 50, milliseconds(0));
  ASSERT_TRUE(newest.has_value());
  EXPECT_EQ(newest->status.code(), absl::StatusCode::kCancelled) << newest->status;
  EXPECT_THAT(log, HasSubstr(absl::StrCat("gave up at shutdown on telling the sglang engine at ",
                                          hung.url(), " to reload /ckpt/step-50/model")));
  EXPECT_THAT(log, Not(HasSubstr("reloaded")));

  start = Clock::now();
  notifier.Publish(ModelPath(51), 51);  // ignored after Shutdown
  EXPECT_LT(Since(start), milliseconds(500));
  EXPECT_EQ(hung.seen().size(), 1);
}

// The destructor (every exit of dta-trainer) waits about one attempt's bound, not attempts x
// timeout, even with a newer checkpoint still waiting behind the hung one.
TEST(EngineNotifier, DestructorWaitsAtMostOneAttemptForAHungEngine) {
  FakeEngine hung(Never());
  Outcomes outcomes;
  auto notifier = std::make_unique<EngineNotifier>(
      EngineNotifierOptions{.engines = {{EngineKind::kVllm, hung.url()}},
                            .attempts = 3,
                            .retry_delay = milliseconds(10),
                            .timeout = milliseconds(1000),
                            .on_outcome = outcomes.Callback()});
  notifier->Publish(ModelPath(1), 1);
  ASSERT_TRUE(hung.WaitForRequests(1));
  notifier->Publish(ModelPath(2), 2);
  const Clock::time_point start = Clock::now();
  testing::internal::CaptureStderr();
  notifier.reset();
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_LT(Since(start), milliseconds(2500));  // one attempt: 1 s (the old notifier took >= 6 s)
  const std::optional<EngineOutcome> first = outcomes.WaitFor(hung.url(), 1, milliseconds(0));
  ASSERT_TRUE(first.has_value());
  EXPECT_FALSE(first->status.ok());
  const std::optional<EngineOutcome> second = outcomes.WaitFor(hung.url(), 2, milliseconds(0));
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->status.code(), absl::StatusCode::kCancelled) << second->status;
  EXPECT_THAT(log, HasSubstr(absl::StrCat("gave up at shutdown on telling the vllm engine at ",
                                          hung.url(), " to reload /ckpt/step-2/model")));
}

TEST(EngineNotifier, HungEngineDoesNotStarveAHealthyOne) {
  FakeEngine hung(Never());
  FakeEngine healthy(Always(200, R"({"success": true})"));
  Outcomes outcomes;
  EngineNotifier notifier({.engines = {{EngineKind::kSglang, hung.url()},      // first, as it would
                                       {EngineKind::kSglang, healthy.url()}},  // block the rest
                           .timeout = std::chrono::seconds(60),
                           .on_outcome = outcomes.Callback()});
  for (int version = 1; version <= 5; ++version) {
    notifier.Publish(ModelPath(version), version);
    const std::optional<EngineOutcome> outcome =
        outcomes.WaitFor(healthy.url(), version, milliseconds(3000));
    ASSERT_TRUE(outcome.has_value()) << "policy version " << version;
    EXPECT_TRUE(outcome->status.ok()) << outcome->status;
  }
  const std::vector<SeenRequest> seen = healthy.seen();
  ASSERT_EQ(seen.size(), 5);
  for (int version = 1; version <= 5; ++version) {
    EXPECT_EQ(nlohmann::json::parse(seen[version - 1].body)["model_path"], ModelPath(version));
  }
  ASSERT_TRUE(hung.WaitForRequests(1));
  EXPECT_EQ(hung.seen().size(), 1);  // still on the first
  testing::internal::CaptureStderr();
  notifier.Shutdown(Clock::now() + milliseconds(100));
  testing::internal::GetCapturedStderr();
}

}  // namespace
}  // namespace dta

#include "apps/metrics/metrics_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <fstream>
#include <future>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#include "tests/testing/http_get.h"

namespace dta {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string Url(const MetricsServer& server, const std::string& path = "/metrics") {
  return "http://127.0.0.1:" + std::to_string(server.port()) + path;
}

// This process's resident memory (the server runs in it).
long RssBytes() {
  long pages = 0, resident = 0;
  std::ifstream("/proc/self/statm") >> pages >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// The status code of an HTTP answer; 0 when `answer` is not one.
int StatusOf(const std::string& answer) {
  if (answer.size() < 12 || answer.compare(0, 9, "HTTP/1.1 ") != 0) return 0;
  return std::stoi(answer.substr(9, 3));
}

// A TCP connection to the server, for requests curl will not make. Every call is bounded in time.
class RawClient {
 public:
  explicit RawClient(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    // A send the server never reads returns after this long (EAGAIN) rather than blocking.
    const timeval send_timeout{5, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof(send_timeout));
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  }
  ~RawClient() { ::close(fd_); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool connected() const { return connected_; }

  // Sends all of `data`; false once the server has closed or reset the connection (or stopped
  // reading for 5 s).
  bool Send(std::string_view data) {
    while (!data.empty()) {
      const ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      data.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }

  // Whether the server has sent something, or closed, within `wait`.
  bool Readable(milliseconds wait) {
    pollfd ready{fd_, POLLIN, 0};
    return ::poll(&ready, 1, static_cast<int>(wait.count())) > 0;
  }

  // What the server sends until it closes (or resets) the connection, for at most `wait`;
  // closed() tells whether it did close.
  std::string ReadAll(milliseconds wait = milliseconds(3000)) {
    const Clock::time_point deadline = Clock::now() + wait;
    std::string text;
    char buffer[4096];
    for (;;) {
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      if (left.count() <= 0 || !Readable(left)) return text;
      const ssize_t n = ::recv(fd_, buffer, sizeof(buffer), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        closed_ = true;
        return text;
      }
      text.append(buffer, static_cast<size_t>(n));
    }
  }
  bool closed() const { return closed_; }

 private:
  int fd_ = -1;
  bool connected_ = false;
  bool closed_ = false;
};

// The answer to `request` sent whole on a new connection.
std::string Exchange(const MetricsServer& server, std::string_view request) {
  RawClient client(server.port());
  if (!client.connected() || !client.Send(request)) return "";
  return client.ReadAll();
}

TEST(MetricsServer, RendersOnEveryScrapeAndServesNothingElse) {
  std::atomic<int> scrapes{0};
  auto server = MetricsServer::Start(
      "127.0.0.1:0", "", [&scrapes] { return "dta_scrapes " + std::to_string(++scrapes) + "\n"; });
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_GT((*server)->port(), 0);
  EXPECT_EQ(testing::HttpGet(Url(**server)), std::make_pair(200L, std::string("dta_scrapes 1\n")));
  EXPECT_EQ(testing::HttpGet(Url(**server)), std::make_pair(200L, std::string("dta_scrapes 2\n")));
  EXPECT_EQ(testing::HttpGet(Url(**server, "/")).first, 404);
  EXPECT_EQ(testing::HttpGet(Url(**server, "/metrics/../wal")).first, 404);
  EXPECT_EQ(scrapes.load(), 2);
}

TEST(MetricsServer, ATokenGuardsTheEndpoint) {
  auto server = MetricsServer::Start("127.0.0.1:0", "secret", [] { return std::string("x 1\n"); });
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(testing::HttpGet(Url(**server)).first, 401);
  EXPECT_EQ(testing::HttpGet(Url(**server), "secreT").first, 401);
  EXPECT_EQ(testing::HttpGet(Url(**server), "secret-and-more").first, 401);
  EXPECT_EQ(testing::HttpGet(Url(**server), "secret"), std::make_pair(200L, std::string("x 1\n")));
}

TEST(MetricsServer, RefusesBadAddressesAndOpenRemoteOnes) {
  const auto render = [] { return std::string(); };
  for (const char* address : {"", "9400", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:70000",
                              "[::1:9400", "0.0.0.0:0", ":9400", "127.0.0.1.example:0"}) {
    auto server = MetricsServer::Start(address, "", render);
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << address;
  }
  auto taken = MetricsServer::Start("127.0.0.1:0", "", render);
  ASSERT_TRUE(taken.ok()) << taken.status();
  auto again = MetricsServer::Start("127.0.0.1:" + std::to_string((*taken)->port()), "", render);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
  // Any address with a token (here one every interface listens on).
  auto remote = MetricsServer::Start("0.0.0.0:0", "secret", render);
  ASSERT_TRUE(remote.ok()) << remote.status();
  EXPECT_EQ(testing::HttpGet(Url(**remote), "secret").first, 200);
}

TEST(MetricsServer, StopsRightAfterStarting) {
  for (int i = 0; i < 20; ++i) {
    auto server = MetricsServer::Start("127.0.0.1:0", "", [] { return std::string(); });
    ASSERT_TRUE(server.ok()) << server.status();
  }
}

TEST(MetricsServer, AnswersEachKindOfRequestAsDocumented) {
  auto server = MetricsServer::Start("127.0.0.1:0", "", [] { return std::string("x 1\n"); });
  ASSERT_TRUE(server.ok()) << server.status();
  const std::pair<std::string_view, int> cases[] = {
      {"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n", 200},
      {"GET /metrics HTTP/1.0\r\n\r\n", 200},
      {"GET /metrics?x=1 HTTP/1.1\nHost: a\n\n", 200},  // bare LF line ends, a query
      {"GET /metrics HTTP/1.1\r\nContent-Length: 00\r\n\r\n", 200},
      {"GET /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", 413},
      {"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 413},
      {"POST /metrics HTTP/1.1\r\n\r\n", 405},
      {"HEAD /metrics HTTP/1.1\r\n\r\n", 405},
      {"GET /metricsx HTTP/1.1\r\n\r\n", 404},
      {"GET /metrics HTTP/2.0\r\n\r\n", 400},
      {"GET  /metrics HTTP/1.1\r\n\r\n", 400},
      {"GET /metrics\r\n\r\n", 400},
      {"GET /metrics HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400},
      {"GET /metrics HTTP/1.1\r\nHost : a\r\n\r\n", 400},
      {"GET /metrics HTTP/1.1\r\nHost: a\r\n b\r\n\r\n", 400},  // a folded line
      {"GET /metrics HTTP/1.1\r\nno colon\r\n\r\n", 400},
  };
  for (const auto& [request, status] : cases) {
    const std::string answer = Exchange(**server, request);
    EXPECT_EQ(StatusOf(answer), status) << request << "\n=> " << answer;
    EXPECT_NE(answer.find("\r\nConnection: close\r\n"), std::string::npos) << answer;
  }
}

// The 256 MiB body (on a POST, and on a GET, which has a handler): answered from the
// headers, the body never buffered.
TEST(MetricsServer, RefusesABodyWithoutBufferingIt) {
  auto server = MetricsServer::Start("127.0.0.1:0", "", [] { return std::string("x 1\n"); });
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string chunk(64 << 10, 'b');
  for (const std::string method : {"POST", "GET"}) {
    const long rss_before = RssBytes();
    const Clock::time_point start = Clock::now();
    RawClient client((*server)->port());
    ASSERT_TRUE(client.connected());
    bool open = client.Send(method + " /metrics HTTP/1.1\r\nContent-Length: 268435456\r\n\r\n");
    size_t sent = 0;
    // Stops when the server closes the connection (or, were the body read, at 256 MiB or 5 s).
    while (open && sent < (size_t{256} << 20) && Clock::now() - start < std::chrono::seconds(5)) {
      open = client.Send(chunk);
      if (open) sent += chunk.size();
    }
    const std::string answer = client.ReadAll();
    EXPECT_EQ(StatusOf(answer), 413) << method << "\n=> " << answer;
    EXPECT_TRUE(client.closed()) << method;
    // What the socket buffers and the server's bounded drain take; far from 256 MiB.
    EXPECT_LT(sent, size_t{32} << 20) << method;
    EXPECT_LT(RssBytes() - rss_before, 8 << 20) << method;
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(4)) << method;
  }
}

// Endless header lines, and one endless request line: cut off at the cap, memory flat.
TEST(MetricsServer, CutsOffEndlessHeaders) {
  auto server = MetricsServer::Start("127.0.0.1:0", "", [] { return std::string("x 1\n"); });
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string header_line = "X-Padding: " + std::string(1000, 'h') + "\r\n";
  const std::string no_line_end(64 << 10, 'a');
  for (const auto& [first, repeated] :
       {std::make_pair(std::string("GET /metrics HTTP/1.1\r\n"), header_line),
        std::make_pair(std::string("GET /"), no_line_end)}) {
    const long rss_before = RssBytes();
    const Clock::time_point start = Clock::now();
    RawClient client((*server)->port());
    ASSERT_TRUE(client.connected());
    bool open = client.Send(first);
    size_t sent = 0;
    while (open && sent < (size_t{64} << 20) && Clock::now() - start < std::chrono::seconds(5)) {
      open = client.Send(repeated);
      if (open) sent += repeated.size();
    }
    const std::string answer = client.ReadAll();
    EXPECT_EQ(StatusOf(answer), 431) << answer;
    EXPECT_TRUE(client.closed());
    EXPECT_LT(sent, size_t{32} << 20);
    EXPECT_LT(RssBytes() - rss_before, 8 << 20);
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(4));
  }
}

// The token is checked from the headers alone: the announced body is never sent, never waited for.
TEST(MetricsServer, AnswersUnauthorizedBeforeReadingABody) {
  auto server = MetricsServer::Start("127.0.0.1:0", "secret", [] { return std::string("x 1\n"); });
  ASSERT_TRUE(server.ok()) << server.status();
  for (const std::string_view request :
       {"POST /metrics HTTP/1.1\r\nContent-Length: 1048576\r\nExpect: 100-continue\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nAuthorization: Bearer wrong\r\nContent-Length: 9\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"}) {
    const Clock::time_point start = Clock::now();
    const std::string answer = Exchange(**server, request);
    EXPECT_EQ(StatusOf(answer), 401) << request << "\n=> " << answer;
    EXPECT_NE(answer.find("\r\nWWW-Authenticate: Bearer\r\n"), std::string::npos) << answer;
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(2)) << request;
  }
  // With the token, a body is still refused unread.
  EXPECT_EQ(StatusOf(Exchange(**server,
                              "GET /metrics HTTP/1.1\r\nAuthorization: Bearer secret\r\n"
                              "Content-Length: 9\r\n\r\n")),
            413);
  EXPECT_EQ(StatusOf(Exchange(**server,
                              "GET /metrics HTTP/1.1\r\nAuthorization: Bearer secret\r\n"
                              "Authorization: Bearer secret\r\n\r\n")),
            400);
}

// A client sending a byte every 50 ms (never idle long enough for a per-read timeout) holds its
// connection only until the whole-request deadline, and a scrape meanwhile is served at once.
TEST(MetricsServer, ASlowClientNeitherDelaysScrapesNorStaysForever) {
  MetricsServerOptions options;
  options.request_timeout = absl::Seconds(2);
  auto server = MetricsServer::Start(
      "127.0.0.1:0", "", [] { return std::string("x 1\n"); }, 0, options);
  ASSERT_TRUE(server.ok()) << server.status();
  std::promise<void> trickling;
  Clock::time_point slow_start, slow_closed = Clock::time_point::max();
  std::string slow_answer;
  std::thread slow([&] {
    RawClient client((*server)->port());
    slow_start = Clock::now();
    const std::string request = "GET /metrics HTTP/1.1\r\nX-Slow: " + std::string(4096, 's');
    bool signalled = false;
    for (size_t i = 0; i < request.size() && Clock::now() - slow_start < std::chrono::seconds(5);
         ++i) {
      if (!client.Send(request.substr(i, 1))) break;
      if (!signalled) {
        trickling.set_value();
        signalled = true;
      }
      if (client.Readable(milliseconds(50))) break;  // the server answered or closed
    }
    if (!signalled) trickling.set_value();
    slow_answer = client.ReadAll(milliseconds(1000));
    if (client.closed()) slow_closed = Clock::now();
  });
  trickling.get_future().wait();
  const auto scrape = testing::HttpGet(Url(**server));
  const Clock::time_point scraped = Clock::now();
  slow.join();
  EXPECT_EQ(scrape, std::make_pair(200L, std::string("x 1\n")));
  EXPECT_LT(scraped, slow_closed) << "the scrape waited for the slow client";
  EXPECT_EQ(StatusOf(slow_answer), 408) << slow_answer;
  ASSERT_NE(slow_closed, Clock::time_point::max()) << "the slow client was never disconnected";
  EXPECT_GE(slow_closed - slow_start, std::chrono::milliseconds(1900));
  EXPECT_LT(slow_closed - slow_start, std::chrono::seconds(4));
}

TEST(MetricsServer, ClosesConnectionsPastTheCap) {
  MetricsServerOptions options;
  options.max_connections = 2;
  auto server = MetricsServer::Start(
      "127.0.0.1:0", "", [] { return std::string("x 1\n"); }, 0, options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto idle1 = std::make_unique<RawClient>((*server)->port());
  RawClient idle2((*server)->port());
  ASSERT_TRUE(idle1->connected() && idle2.connected());
  RawClient third((*server)->port());
  const std::string answer = third.ReadAll();
  EXPECT_TRUE(third.closed()) << "not closed past the cap";
  EXPECT_EQ(StatusOf(answer), 503) << answer;
  EXPECT_FALSE(idle2.Readable(milliseconds(0)));  // the two within the cap are still served
  // A slot frees when its client leaves (its thread ends a moment later).
  idle1.reset();
  std::pair<long, std::string> scrape;
  for (const Clock::time_point give_up = Clock::now() + std::chrono::seconds(3);
       scrape.first != 200 && Clock::now() < give_up;) {
    scrape = testing::HttpGet(Url(**server));
    if (scrape.first != 200) std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ(scrape, std::make_pair(200L, std::string("x 1\n")));
}

TEST(MetricsServer, StopsAtOnceWithAStuckClient) {
  MetricsServerOptions options;
  options.request_timeout = absl::Seconds(60);
  auto server = MetricsServer::Start(
      "127.0.0.1:0", "", [] { return std::string("x 1\n"); }, 0, options);
  ASSERT_TRUE(server.ok()) << server.status();
  RawClient stuck((*server)->port());
  ASSERT_TRUE(stuck.Send("GET /metr"));
  // The stuck connection neither delays a scrape (made after it, so it has been accepted) nor the
  // stop: neither waits for its 60 s.
  const Clock::time_point start = Clock::now();
  EXPECT_EQ(testing::HttpGet(Url(**server)).first, 200);
  server->reset();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(2));
  EXPECT_EQ(stuck.ReadAll(), "");
  EXPECT_TRUE(stuck.closed());
}

TEST(MetricsServer, RefusesOptionsOutOfRange) {
  const auto render = [] { return std::string(); };
  MetricsServerOptions options;
  options.request_timeout = absl::ZeroDuration();
  EXPECT_EQ(MetricsServer::Start("127.0.0.1:0", "", render, 0, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = {};
  options.response_timeout = -absl::Seconds(1);
  EXPECT_EQ(MetricsServer::Start("127.0.0.1:0", "", render, 0, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = {};
  options.max_header_bytes = 10;
  EXPECT_EQ(MetricsServer::Start("127.0.0.1:0", "", render, 0, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = {};
  options.max_connections = 0;
  EXPECT_EQ(MetricsServer::Start("127.0.0.1:0", "", render, 0, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dta

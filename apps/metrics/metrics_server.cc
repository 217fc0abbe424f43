#include "apps/metrics/metrics_server.h"

// Our own small server rather than cpp-httplib (Debian 12 ships 0.11.4, compiled into a shared
// library): it keeps every header line of a request, however many (its per-line cap applies only
// after a whole line is in memory), reads a refused body to its end, has per-read timeouts only,
// and queues connections behind a slow one. None of that can be configured away.

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <exception>
#include <list>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/base/absl_string_view.h"
#include "core/base/secret_equals.h"
#include "core/base/unique_fd.h"
#include "core/metrics/prometheus_text.h"
#include "dispatcher/client/client_options.h"

namespace dta {
namespace {

using Clock = std::chrono::steady_clock;

// After answering, up to this much of what a client still sends (a body it was told not to send)
// is read and dropped, for at most kLingerTime, before the socket is closed: closing a socket with
// unread data resets the connection, which can destroy the answer before the client has read it.
// (Go's net/http drains 256 KiB likewise.) The drain goes through a small fixed buffer.
constexpr size_t kMaxDrainBytes = 256 * 1024;
constexpr auto kLingerTime = std::chrono::seconds(1);
constexpr int kListenBacklog = 64;
// Pause after accept() (or poll()) fails for want of descriptors or memory: the listening socket
// stays readable, so retrying at once would spin.
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);

// Without the spaces and tabs around it (a header value's optional whitespace).
std::string_view TrimWhitespace(std::string_view value) {
  const size_t first = value.find_first_not_of(" \t");
  if (first == std::string_view::npos) return {};
  return value.substr(first, value.find_last_not_of(" \t") - first + 1);
}

std::string ErrnoText(int error) { return std::generic_category().message(error); }

// Deadlines are taken on the steady clock; a duration beyond a year counts as a year, so that
// adding it to now() cannot overflow.
Clock::duration ToClock(absl::Duration duration) {
  return std::chrono::duration_cast<Clock::duration>(
      absl::ToChronoNanoseconds(std::min(duration, absl::Hours(24 * 365))));
}

enum class Wait { kReady, kTimedOut, kStopped };

// Waits until `fd` is ready for `events` (an error or a hang-up counts: the read or write that
// follows reports it), `deadline` passes, or `stop_fd` is readable (the server is stopping; a
// failing poll counts as that too, so the connection is closed).
Wait WaitFor(int fd, short events, int stop_fd, Clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return Wait::kTimedOut;
    pollfd fds[2] = {{fd, events, 0}, {stop_fd, POLLIN, 0}};
    const int timeout_ms = static_cast<int>(std::min<int64_t>(left.count(), INT_MAX));
    if (::poll(fds, 2, timeout_ms) < 0) {
      if (errno == EINTR) continue;
      return Wait::kStopped;
    }
    if (fds[1].revents != 0) return Wait::kStopped;
    if (fds[0].revents != 0) return Wait::kReady;
  }
}

enum class Head { kComplete, kTooLarge, kTimedOut, kGone };

// Reads a request's line and headers into `buffer` (its size is the cap) up to and including the
// empty line that ends them (CRLF, or the bare LF RFC 9112 lets a server accept), and sets
// `length` to that many bytes. Bytes after it (a body) may be in the buffer; nothing more is read.
// kGone: the client closed or failed first, or the server is stopping.
Head ReadHead(int fd, int stop_fd, Clock::time_point deadline, std::vector<char>& buffer,
              size_t& length) {
  size_t filled = 0;
  for (;;) {
    const ssize_t n = ::recv(fd, buffer.data() + filled, buffer.size() - filled, 0);
    if (n > 0) {
      // A line end seen before this read was already tested unless its empty line could be cut:
      // start at most two bytes back ("\n\r" then "\n").
      size_t at = filled >= 2 ? filled - 2 : 0;
      filled += static_cast<size_t>(n);
      const std::string_view seen(buffer.data(), filled);
      for (at = seen.find('\n', at); at != std::string_view::npos; at = seen.find('\n', at + 1)) {
        if (at + 1 < filled && seen[at + 1] == '\n') {
          length = at + 2;
          return Head::kComplete;
        }
        if (at + 2 < filled && seen[at + 1] == '\r' && seen[at + 2] == '\n') {
          length = at + 3;
          return Head::kComplete;
        }
      }
      if (filled == buffer.size()) return Head::kTooLarge;
      continue;
    }
    if (n == 0) return Head::kGone;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return Head::kGone;
    switch (WaitFor(fd, POLLIN, stop_fd, deadline)) {
      case Wait::kReady:
        break;
      case Wait::kTimedOut:
        return Head::kTimedOut;
      case Wait::kStopped:
        return Head::kGone;
    }
  }
}

// Sends all of `data` before `deadline`; false when the client is gone, too slow, or the server is
// stopping. Never raises SIGPIPE.
bool SendAll(int fd, std::string_view data, int stop_fd, Clock::time_point deadline) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) &&
        WaitFor(fd, POLLOUT, stop_fd, deadline) == Wait::kReady) {
      continue;
    }
    return false;
  }
  return true;
}

// Reads and drops what the client still sends (see kMaxDrainBytes) until it closes.
void Drain(int fd, int stop_fd) {
  const Clock::time_point deadline = Clock::now() + kLingerTime;
  char sink[4096];
  size_t drained = 0;
  while (drained < kMaxDrainBytes) {
    const ssize_t n = ::recv(fd, sink, sizeof(sink), 0);
    if (n > 0) {
      drained += static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return;
    if (WaitFor(fd, POLLIN, stop_fd, deadline) != Wait::kReady) return;
  }
}

struct Reply {
  int status = 200;
  std::string body;
  std::string_view content_type = "text/plain; charset=utf-8";
  std::string_view headers;  // more header lines, each ending in CRLF
};

Reply Plain(int status, std::string body, std::string_view headers = {}) {
  Reply reply;
  reply.status = status;
  reply.body = std::move(body);
  reply.headers = headers;
  return reply;
}

std::string_view Reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 413:
      return "Content Too Large";
    case 431:
      return "Request Header Fields Too Large";
    case 503:
      return "Service Unavailable";
    default:
      return "Internal Server Error";
  }
}

std::string StatusLineAndHeaders(const Reply& reply) {
  std::string head = absl::StrCat("HTTP/1.1 ", reply.status, " ");
  head.append(Reason(reply.status));
  head.append("\r\nContent-Type: ");
  head.append(reply.content_type);
  absl::StrAppend(&head, "\r\nContent-Length: ", reply.body.size(), "\r\nConnection: close\r\n");
  head.append(reply.headers);
  head.append("\r\n");
  return head;
}

// One line of a header block, without its line end; advances `at` past it.
std::string_view NextLine(std::string_view head, size_t& at) {
  if (at >= head.size()) return {};
  const size_t end = std::min(head.find('\n', at), head.size());
  std::string_view line = head.substr(at, end - at);
  at = end + 1;
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return line;
}

// host:port or [v6]:port into the host to bind (brackets dropped) and the port.
bool SplitAddress(const std::string& address, std::string& host, int& port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  host = address.substr(0, colon);
  if (host.front() == '[') {
    if (host.size() < 3 || host.back() != ']') return false;
    host = host.substr(1, host.size() - 2);
  }
  return absl::SimpleAtoi(address.substr(colon + 1), &port) && port >= 0 && port <= 65535;
}

// A listening socket on the first of `host`'s addresses that binds.
absl::StatusOr<UniqueFd> Listen(const std::string& host, int port, const std::string& address) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int resolved = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (resolved != 0 || found == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", address, " for metrics: ", ::gai_strerror(resolved)));
  }
  const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owned(found, &::freeaddrinfo);
  int error = 0;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    UniqueFd fd(
        ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
    if (fd.get() < 0) {
      error = errno;
      continue;
    }
    // SO_REUSEADDR only, never SO_REUSEPORT, which would let a second process (say two trainer
    // ranks given the same port) share the port and split the scrapes silently.
    const int yes = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) == 0 &&
        ::listen(fd.get(), kListenBacklog) == 0) {
      return fd;
    }
    error = errno;
  }
  return absl::UnavailableError(
      absl::StrCat("cannot listen on ", address, " for metrics: ", ErrnoText(error)));
}

int BoundPort(int fd) {
  sockaddr_storage bound{};
  socklen_t size = sizeof(bound);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &size) != 0) return -1;
  if (bound.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  if (bound.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
  return -1;
}

}  // namespace

struct MetricsServer::State {
  MetricsServerOptions options;
  std::string token;
  UniqueFd listen_fd;
  // An eventfd written once by the destructor and never read: readable from then on, it wakes
  // every poll of every server thread.
  UniqueFd stop_fd;
  std::atomic<bool> stopping{false};
  absl::Mutex render_mu;
  std::function<std::string()> render ABSL_GUARDED_BY(render_mu);
  std::thread acceptor;

  // Accepts until stopped; each connection gets its own thread (at most options.max_connections).
  // Joins them all before returning.
  void AcceptLoop();
  // Waits kAcceptBackoff, or less when the server is stopping.
  void Backoff() {
    pollfd stop = {stop_fd.get(), POLLIN, 0};
    ::poll(&stop, 1, static_cast<int>(kAcceptBackoff.count()));
  }
  // Reads one request from `fd`, answers it and closes the connection.
  void Serve(UniqueFd fd);
  // The answer to a complete header block, checked in the order the header comment gives.
  Reply Answer(std::string_view head);
};

Reply MetricsServer::State::Answer(std::string_view head) {
  size_t at = 0;
  const std::string_view request_line = NextLine(head, at);
  const size_t space1 = request_line.find(' ');
  const size_t space2 =
      space1 == std::string_view::npos ? space1 : request_line.find(' ', space1 + 1);
  if (space1 == 0 || space2 == std::string_view::npos || space2 == space1 + 1 ||
      request_line.find(' ', space2 + 1) != std::string_view::npos) {
    return Plain(400, "malformed request line\n");
  }
  const std::string_view method = request_line.substr(0, space1);
  const std::string_view target = request_line.substr(space1 + 1, space2 - space1 - 1);
  const std::string_view version = request_line.substr(space2 + 1);
  if (version != "HTTP/1.1" && version != "HTTP/1.0") {
    return Plain(400, "only HTTP/1.1 and HTTP/1.0 are served\n");
  }
  std::string_view authorization;
  bool has_authorization = false;
  bool has_body = false;
  for (std::string_view line = NextLine(head, at); !line.empty(); line = NextLine(head, at)) {
    if (line.front() == ' ' || line.front() == '\t') {
      return Plain(400, "folded header lines are not accepted\n");
    }
    const size_t colon = line.find(':');
    if (colon == 0 || colon == std::string_view::npos ||
        line.substr(0, colon).find_first_of(" \t") != std::string_view::npos) {
      return Plain(400, "malformed header line\n");
    }
    const std::string_view name = line.substr(0, colon);
    const std::string_view value = TrimWhitespace(line.substr(colon + 1));
    if (absl::EqualsIgnoreCase(AsAbsl(name), "Authorization")) {
      if (has_authorization) return Plain(400, "more than one Authorization header\n");
      has_authorization = true;
      authorization = value;
    } else if (absl::EqualsIgnoreCase(AsAbsl(name), "Content-Length")) {
      if (value.empty() || value.find_first_not_of("0123456789") != std::string_view::npos) {
        return Plain(400, "Content-Length is not a number\n");
      }
      has_body = has_body || value.find_first_not_of('0') != std::string_view::npos;
    } else if (absl::EqualsIgnoreCase(AsAbsl(name), "Transfer-Encoding")) {
      has_body = true;
    }
  }
  if (!token.empty()) {
    constexpr std::string_view kBearer = "Bearer ";
    if (!authorization.starts_with(kBearer) ||
        !SecretEquals(authorization.substr(kBearer.size()), token)) {
      return Plain(401, "missing or wrong bearer token\n", "WWW-Authenticate: Bearer\r\n");
    }
  }
  if (has_body) return Plain(413, "requests with a body are not accepted\n");
  if (method != "GET") return Plain(405, "only GET is served\n", "Allow: GET\r\n");
  if (target.substr(0, target.find('?')) != "/metrics") return Plain(404, "only /metrics\n");
  Reply reply;
  reply.content_type = kPrometheusContentType;
  absl::MutexLock lock(&render_mu);
  // A connection that waited here while the server began stopping does not render.
  if (stopping.load(std::memory_order_acquire)) return Plain(503, "stopping\n");
  try {
    reply.body = render();
  } catch (const std::exception& e) {
    return Plain(500, absl::StrCat("rendering the metrics failed: ", e.what(), "\n"));
  } catch (...) {
    return Plain(500, "rendering the metrics failed\n");
  }
  return reply;
}

void MetricsServer::State::Serve(UniqueFd fd) {
  const int stop = stop_fd.get();
  const Clock::time_point request_deadline = Clock::now() + ToClock(options.request_timeout);
  Reply reply;
  {
    std::vector<char> buffer(options.max_header_bytes);
    size_t length = 0;
    switch (ReadHead(fd.get(), stop, request_deadline, buffer, length)) {
      case Head::kComplete:
        reply = Answer(std::string_view(buffer.data(), length));
        break;
      case Head::kTooLarge:
        reply = Plain(431, absl::StrCat("the request line and headers exceed ",
                                        options.max_header_bytes, " bytes\n"));
        break;
      case Head::kTimedOut:
        reply = Plain(408, absl::StrCat("the request was not complete within ",
                                        absl::FormatDuration(options.request_timeout), "\n"));
        break;
      case Head::kGone:
        return;
    }
  }
  const Clock::time_point response_deadline = Clock::now() + ToClock(options.response_timeout);
  if (SendAll(fd.get(), StatusLineAndHeaders(reply), stop, response_deadline) &&
      SendAll(fd.get(), reply.body, stop, response_deadline)) {
    ::shutdown(fd.get(), SHUT_WR);
    Drain(fd.get(), stop);
  }
}

void MetricsServer::State::AcceptLoop() {
  struct Connection {
    std::thread thread;
    std::atomic<bool> done{false};
  };
  std::list<Connection> connections;  // a list: each thread holds a reference to its element
  const auto reap = [&connections] {
    for (auto it = connections.begin(); it != connections.end();) {
      if (it->done.load(std::memory_order_acquire)) {
        it->thread.join();
        it = connections.erase(it);
      } else {
        ++it;
      }
    }
  };
  const size_t max_connections = static_cast<size_t>(options.max_connections);
  bool stopped = false;
  while (!stopped) {
    pollfd fds[2] = {{listen_fd.get(), POLLIN, 0}, {stop_fd.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno != EINTR) Backoff();
      stopped = stopping.load(std::memory_order_acquire);
      continue;
    }
    if (fds[1].revents != 0) break;
    reap();
    // Accepts what is queued, checking for a stop between connections (a flood never ends).
    while (!stopping.load(std::memory_order_acquire)) {
      UniqueFd fd(::accept4(listen_fd.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (fd.get() < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
          Backoff();
          stopped = stopping.load(std::memory_order_acquire);
        }
        break;
      }
      if (connections.size() >= max_connections) reap();
      if (connections.size() >= max_connections) {
        // One attempt that never waits, so the client may learn why; then closed.
        constexpr std::string_view kBusy =
            "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        (void)::send(fd.get(), kBusy.data(), kBusy.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        continue;
      }
      Connection& connection = connections.emplace_back();
      try {
        connection.thread = std::thread([this, &connection, fd = std::move(fd)]() mutable {
          Serve(std::move(fd));
          connection.done.store(true, std::memory_order_release);
        });
      } catch (const std::system_error&) {
        connections.pop_back();  // no thread to spare: the connection (in the lambda) is closed
      }
    }
  }
  for (Connection& connection : connections) connection.thread.join();
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& given_address, std::string bearer_token, std::function<std::string()> render,
    int port_offset, MetricsServerOptions options) {
  std::string host;
  int port = 0;
  if (!SplitAddress(given_address, host, port)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", given_address, "' is not host:port"));
  }
  std::string address = given_address;
  if (port > 0 && port_offset != 0) {
    port += port_offset;
    address = absl::StrCat(given_address.substr(0, given_address.rfind(':')), ":", port);
  }
  if (bearer_token.empty() && !IsLoopbackAddress(address)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address ", address,
                     " is not loopback: give a token file for its scrapers (bearer token)"));
  }
  if (options.request_timeout <= absl::ZeroDuration() ||
      options.response_timeout <= absl::ZeroDuration() || options.max_header_bytes < 64 ||
      options.max_connections < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics server options out of range: request_timeout ",
                     absl::FormatDuration(options.request_timeout), ", response_timeout ",
                     absl::FormatDuration(options.response_timeout),
                     " (both must be positive), max_header_bytes ", options.max_header_bytes,
                     " (at least 64), max_connections ", options.max_connections, " (at least 1)"));
  }
  auto state = std::make_unique<State>();
  absl::StatusOr<UniqueFd> listening = Listen(host, port, address);
  if (!listening.ok()) return listening.status();
  state->listen_fd = *std::move(listening);
  const int bound = BoundPort(state->listen_fd.get());
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address,
                                               " for metrics: getsockname: ", ErrnoText(errno)));
  }
  state->stop_fd = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (state->stop_fd.get() < 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics server on ", address, ": eventfd: ", ErrnoText(errno)));
  }
  state->options = options;
  state->token = std::move(bearer_token);
  {
    absl::MutexLock lock(&state->render_mu);
    state->render = std::move(render);
  }
  try {
    state->acceptor = std::thread(&State::AcceptLoop, state.get());
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("metrics server on ", address, ": no thread: ", e.what()));
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->state_ = std::move(state);
  server->host_ = host;
  server->port_ = bound;
  return server;
}

MetricsServer::~MetricsServer() {
  if (state_ == nullptr || !state_->acceptor.joinable()) return;
  state_->stopping.store(true, std::memory_order_release);
  const uint64_t one = 1;
  while (::write(state_->stop_fd.get(), &one, sizeof(one)) < 0 && errno == EINTR) {
  }
  state_->acceptor.join();
}

}  // namespace dta

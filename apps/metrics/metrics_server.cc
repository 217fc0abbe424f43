#include "apps/metrics/metrics_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <chrono>
#include <string_view>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/base/secret_equals.h"
#include "core/metrics/prometheus_text.h"
#include "dispatcher/client/client_options.h"

namespace dta {
namespace {

// host:port or [v6]:port into the host httplib binds (brackets dropped) and the port.
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

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& given_address, std::string bearer_token, std::function<std::string()> render,
    int port_offset) {
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
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->server_ = std::make_unique<httplib::Server>();
  httplib::Server& http = *server->server_;
  http.new_task_queue = [] { return new httplib::ThreadPool(1); };
  // SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, which would let a second process
  // (say two trainer ranks given the same port) share the port and split the scrapes silently.
  http.set_socket_options([](int socket) {
    const int yes = 1;
    setsockopt(socket, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  http.Get("/metrics", [token = std::move(bearer_token), render = std::move(render)](
                           const httplib::Request& request, httplib::Response& response) {
    if (!token.empty()) {
      const std::string authorization = request.get_header_value("Authorization");
      constexpr std::string_view kBearer = "Bearer ";
      if (!authorization.starts_with(kBearer) ||
          !SecretEquals(std::string_view(authorization).substr(kBearer.size()), token)) {
        response.status = 401;
        response.set_header("WWW-Authenticate", "Bearer");
        response.set_content("missing or wrong bearer token\n", "text/plain");
        return;
      }
    }
    response.set_content(render(), std::string(kPrometheusContentType));
  });
  const int bound =
      port == 0 ? http.bind_to_any_port(host) : (http.bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address, " for metrics"));
  }
  server->host_ = host;
  server->port_ = bound;
  server->thread_ = std::thread([&http] { http.listen_after_bind(); });
  return server;
}

MetricsServer::~MetricsServer() {
  // httplib's stop() only stops a server already listening: wait for the thread to get there.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (thread_.joinable() && !server_->is_running() && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace dta

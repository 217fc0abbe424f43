// Serves Prometheus's GET /metrics over HTTP from a callback that renders the exposition on each
// scrape (on the server's one thread). Read-only, and nothing else is served (404).
//
// Security: the endpoint shows counts, never trajectories or tokens; still, an address that is not
// loopback needs a bearer token (Prometheus's `authorization: {credentials_file: ...}`), checked in
// constant time (401 otherwise). There is no TLS: put a proxy in front for that.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace httplib {
class Server;
}

namespace dta {

class MetricsServer {
 public:
  // Listens on `address` (host:port or [v6]:port; port 0 picks a free one) and serves `render()`.
  // `port_offset` is added to a non-zero port (a trainer's LOCAL_RANK: the ranks of one host listen
  // on consecutive ports). INVALID_ARGUMENT for an unparsable address, or one that is not loopback
  // without a token; UNAVAILABLE naming the address when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& address,
                                                              std::string bearer_token,
                                                              std::function<std::string()> render,
                                                              int port_offset = 0);
  ~MetricsServer();  // stops serving, waits for a scrape in progress
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // Where it listens: the host as given (brackets dropped) and the bound port.
  const std::string& host() const { return host_; }
  int port() const { return port_; }

 private:
  MetricsServer() = default;

  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::string host_;
  int port_ = 0;
};

}  // namespace dta

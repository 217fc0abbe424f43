// Serves Prometheus's GET /metrics over HTTP/1.1 from a callback that renders the exposition on
// each scrape. Read-only, and nothing else is served (404).
//
// Security: the endpoint shows counts, never trajectories or tokens; still, an address that is not
// loopback needs a bearer token (Prometheus's `authorization: {credentials_file: ...}`), checked in
// constant time (401 otherwise). There is no TLS: put a proxy in front for that.
//
// Any client may connect, so what one can make the server hold is bounded:
// - The request line and headers are read into one buffer of `max_header_bytes`; a request whose
//   header block does not end within it gets 431. Nothing past the header block is read before
//   the answer is sent; after it, what the client still sends is read and dropped (at most
//   256 KiB, at most 1 s, through a small fixed buffer) so that closing the socket does not reset
//   the connection before the client has read the answer.
// - The token is checked as soon as the headers are in (after only a malformed request's 400):
//   401 before anything else.
// - A request announcing a body (a Content-Length other than 0, or any Transfer-Encoding) gets 413
//   without its body being read; a method other than GET gets 405; a target other than /metrics
//   (a query is ignored) gets 404.
// - A whole-request deadline (`request_timeout`, from the connection's accept to the end of its
//   headers, not per read) cuts off a client that sends slowly (408); sending the answer has its
//   own (`response_timeout`) for a client that stops reading.
// - One request per connection (every answer says `Connection: close`); each connection is served
//   on its own thread, at most `max_connections` at once: one more is answered 503 (best effort,
//   never waiting) and closed as soon as it is accepted. A slow or stuck client never delays the
//   scrapes of others.
// So the server holds at most `max_connections` x (`max_header_bytes` + one rendered exposition +
// a thread's stack), whatever its clients do.
//
// Thread safety: `render` is called on the server's threads, one call at a time (never
// concurrently with itself); it must be safe to call from a thread other than the creator's. An
// exception from it answers 500.
//
// Usage:
//   auto server = MetricsServer::Start("0.0.0.0:9400", token, [&] { return Render(state); });
//   if (!server.ok()) return server.status();
//   ... (*server)->port() ...
//   server->reset();  // or let it go out of scope: stops, waits for a scrape in progress
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace dta {

struct MetricsServerOptions {
  // From accepting a connection to the end of its request's headers, in all (not per read): a
  // client sending a byte now and then is answered 408 and closed when it passes.
  absl::Duration request_timeout = absl::Seconds(5);
  // Sending one answer, in all: a client that stops reading is closed when it passes.
  absl::Duration response_timeout = absl::Seconds(10);
  // The request line and headers together, line ends included; a larger header block gets 431.
  size_t max_header_bytes = 8192;
  // Connections served at once; one more is closed as soon as it is accepted.
  int max_connections = 32;
};

class MetricsServer {
 public:
  // Listens on `address` (host:port or [v6]:port; port 0 picks a free one) and serves `render()`.
  // `port_offset` is added to a non-zero port (a trainer's LOCAL_RANK: the ranks of one host listen
  // on consecutive ports). INVALID_ARGUMENT for an unparsable address, one that is not loopback
  // without a token, or options out of range (a timeout not positive, `max_header_bytes` below 64,
  // `max_connections` below 1); UNAVAILABLE naming the address when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& address,
                                                              std::string bearer_token,
                                                              std::function<std::string()> render,
                                                              int port_offset = 0,
                                                              MetricsServerOptions options = {});
  // Stops accepting, closes every connection not rendering, and waits for a render in progress
  // and every server thread.
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // Where it listens: the host as given (brackets dropped) and the bound port.
  const std::string& host() const { return host_; }
  int port() const { return port_; }

 private:
  struct State;  // the sockets, the options, the token, `render`; shared with the threads

  MetricsServer() = default;

  std::unique_ptr<State> state_;
  std::string host_;
  int port_ = 0;
};

}  // namespace dta

// Where and how to reach the dispatcher; free of gRPC and Protobuf headers, so that code compiled
// against LibTorch (which ships its own, older Protobuf headers) can include it.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace dta {

struct ClientOptions {
  // host:port of the dispatcher.
  std::string address = "127.0.0.1:50051";
  // The shared token (sent as "authorization: Bearer <token>"); empty: none.
  std::string token;
  // TLS: PEM root certificates to trust; empty: plaintext (loopback).
  std::string tls_root_certificates;
  // Deadline of one call (long polls answer before it).
  absl::Duration call_timeout = absl::Seconds(30);
  // How long retryable failures are retried before the error is returned.
  absl::Duration retry_for = absl::Minutes(10);
};

// The contents of a token, key or certificate file; `trim` strips surrounding whitespace (tokens).
// NOT_FOUND naming the path if it cannot be read; INVALID_ARGUMENT if it is empty.
absl::StatusOr<std::string> ReadCredentialFile(const std::string& path, bool trim);

}  // namespace dta

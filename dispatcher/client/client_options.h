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
  // This client's credential (sent as "authorization: Bearer <token>"): the rollout token for
  // rollout workers, the trainer token for trainers; empty: none.
  std::string token;
  // TLS: PEM root certificates to trust; empty: plaintext (loopback).
  std::string tls_root_certificates;
  // Deadline of one call (long polls answer before it).
  absl::Duration call_timeout = absl::Seconds(30);
  // How long retryable failures are retried before the error is returned.
  absl::Duration retry_for = absl::Minutes(10);
};

// The contents of a public credential file (TLS certificates); `trim` strips surrounding
// whitespace. Secrets (tokens, private keys) are read with ReadPrivateFile
// (core/base/private_files.h), which also checks the file's owner and mode. NOT_FOUND naming the
// path if it cannot be read; INVALID_ARGUMENT if it is empty.
absl::StatusOr<std::string> ReadCredentialFile(const std::string& path, bool trim);

// Whether a listening address (host:port, [v6]:port or unix:path) is reachable from this machine
// only: a unix socket, or a host every address of which resolves (getaddrinfo) into 127.0.0.0/8
// or ::1. A name that merely starts with "127." is not; an empty host (every interface), a name
// that does not resolve or an unparsable address is not either.
bool IsLoopbackAddress(const std::string& address);

// The token in `path`, created first when the file does not exist: 32 random bytes from the
// kernel as 64 hex digits, in a new file of mode 0600 (CreatePrivateFile: O_EXCL, in a directory
// only its owner can write). An existing file is read only when it is this user's and closed to
// others (ReadPrivateFile). FAILED_PRECONDITION naming the path, its owner and mode otherwise, or
// naming the directory when it is writable by others (e.g. /tmp itself); INTERNAL naming the path
// when it cannot be created.
absl::StatusOr<std::string> ReadOrCreateTokenFile(const std::string& path);

}  // namespace dta

#include "dispatcher/client/client_options.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "core/base/private_files.h"

namespace dta {

absl::StatusOr<std::string> ReadCredentialFile(const std::string& path, bool trim) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  std::string contents = buffer.str();
  if (trim) contents = std::string(absl::StripAsciiWhitespace(contents));
  if (contents.empty()) return absl::InvalidArgumentError(absl::StrCat(path, " is empty"));
  return contents;
}

bool IsLoopbackAddress(const std::string& address) {
  if (absl::StartsWith(address, "unix:")) return true;
  std::string host;
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == std::string::npos) return false;
    host = address.substr(1, close - 1);
  } else {
    const size_t colon = address.rfind(':');
    host = colon == std::string::npos ? address : address.substr(0, colon);
  }
  if (host.empty()) return false;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) return false;
  bool loopback = true;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const uint32_t ip = ntohl(reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr.s_addr);
      loopback = loopback && (ip >> 24) == 127;
    } else if (a->ai_family == AF_INET6) {
      const in6_addr& ip = reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr;
      const bool mapped_loopback = IN6_IS_ADDR_V4MAPPED(&ip) && ip.s6_addr[12] == 127;
      loopback = loopback && (IN6_IS_ADDR_LOOPBACK(&ip) || mapped_loopback);
    } else {
      loopback = false;
    }
  }
  ::freeaddrinfo(found);
  return loopback;
}

absl::StatusOr<std::string> ReadOrCreateTokenFile(const std::string& path) {
  unsigned char bytes[32];
  for (size_t got = 0; got < sizeof(bytes);) {
    const ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::InternalError(
          absl::StrCat("cannot draw a token for ", path, ": ", std::strerror(errno)));
    }
    got += static_cast<size_t>(n);
  }
  std::string token;
  for (unsigned char b : bytes) absl::StrAppend(&token, absl::Hex(b, absl::kZeroPad2));
  const absl::Status created = CreatePrivateFile(path, token + "\n");
  if (created.ok()) return token;
  // A file that was there first (ours from an earlier start, or one planted by someone else) is
  // used only when it passes the private-file rule.
  if (absl::IsAlreadyExists(created)) return ReadPrivateFile(path);
  return created;
}

}  // namespace dta

#include "dispatcher/client/client_options.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

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
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd >= 0) {
    unsigned char bytes[32];
    ssize_t got = 0;
    while (got < static_cast<ssize_t>(sizeof(bytes))) {
      const ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        ::close(fd);
        ::unlink(path.c_str());
        return absl::InternalError(
            absl::StrCat("cannot draw a token for ", path, ": ", std::strerror(errno)));
      }
      got += n;
    }
    std::string token;
    for (unsigned char b : bytes) absl::StrAppend(&token, absl::Hex(b, absl::kZeroPad2));
    const std::string line = token + "\n";
    const bool written = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
    const bool synced = ::fsync(fd) == 0;
    ::close(fd);
    if (!written || !synced) {
      ::unlink(path.c_str());
      return absl::InternalError(absl::StrCat("cannot write the token file ", path));
    }
    return token;
  }
  if (errno != EEXIST) {
    return absl::InternalError(
        absl::StrCat("cannot create the token file ", path, ": ", std::strerror(errno)));
  }
  struct stat info {};
  if (::stat(path.c_str(), &info) == 0 && (info.st_mode & 077) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is readable or writable by other users (mode ",
                     absl::StrFormat("%04o", info.st_mode & 0777),
                     "): a credential must be private (chmod 600)"));
  }
  return ReadCredentialFile(path, /*trim=*/true);
}

}  // namespace dta

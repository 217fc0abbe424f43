#include "core/checkpoint/atomic_file.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace dta {
namespace {

std::string ErrnoText() { return std::strerror(errno); }

}  // namespace

absl::Status WriteFileAtomically(const std::string& path,
                                 absl::Span<const absl::Span<const uint8_t>> pieces) {
  const std::string temp = absl::StrCat(path, ".tmp-", ::getpid());
  std::FILE* file = std::fopen(temp.c_str(), "wb");
  if (file == nullptr) {
    return absl::UnavailableError(
        absl::StrCat(path, ": cannot create ", temp, " (", ErrnoText(), ")"));
  }
  bool ok = true;
  for (absl::Span<const uint8_t> piece : pieces) {
    if (!piece.empty() && std::fwrite(piece.data(), 1, piece.size(), file) != piece.size()) {
      ok = false;
      break;
    }
  }
  ok = ok && std::fflush(file) == 0 && ::fsync(::fileno(file)) == 0;
  const std::string error = ok ? "" : ErrnoText();
  ok = std::fclose(file) == 0 && ok;
  if (ok && std::rename(temp.c_str(), path.c_str()) != 0) {
    const std::string rename_error = ErrnoText();
    std::remove(temp.c_str());
    return absl::UnavailableError(
        absl::StrCat(path, ": cannot rename ", temp, " to it (", rename_error, ")"));
  }
  if (!ok) {
    std::remove(temp.c_str());
    return absl::UnavailableError(
        absl::StrCat(path, ": cannot write (", error.empty() ? ErrnoText() : error, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  if (!in) return absl::UnavailableError(absl::StrCat(path, ": cannot read"));
  return buffer.str();
}

absl::Status WriteTextAtomically(const std::string& path, std::string_view text) {
  const absl::Span<const uint8_t> pieces[] = {
      absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size())};
  return WriteFileAtomically(path, pieces);
}

}  // namespace dta

#include "dispatcher/client/client_options.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
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

}  // namespace dta

#include "core/base/field_error.h"

#include "absl/strings/str_cat.h"

namespace dta {
namespace {

// Debian's Abseil is built with its own string_view type, so std::string_view needs converting.
absl::string_view AsAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

}  // namespace

absl::Status FieldError(std::string_view field, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("field '", AsAbsl(field), "': ", AsAbsl(what)));
}

std::string FieldOfError(const absl::Status& status) {
  constexpr absl::string_view kPrefix = "field '";
  const absl::string_view message = status.message();
  if (message.substr(0, kPrefix.size()) != kPrefix) return "";
  const size_t end = message.find('\'', kPrefix.size());
  if (end == absl::string_view::npos) return "";
  return std::string(message.substr(kPrefix.size(), end - kPrefix.size()));
}

}  // namespace dta

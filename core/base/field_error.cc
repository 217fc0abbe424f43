#include "core/base/field_error.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/base/absl_string_view.h"

namespace dta {

absl::Status FieldError(std::string_view field, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("field '", AsAbsl(field), "': ", AsAbsl(what)));
}

absl::Status UnsupportedFieldError(std::string_view field, std::string_view what) {
  return absl::UnimplementedError(absl::StrCat("field '", AsAbsl(field), "': ", AsAbsl(what)));
}

absl::Status CheckPositiveFinite(std::string_view field, double value) {
  if (value > 0 && std::isfinite(value)) return absl::OkStatus();
  return FieldError(field, absl::StrCat(value, " is not positive and finite"));
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

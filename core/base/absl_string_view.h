// std::string_view as absl::string_view. Abseil 20220623 (Debian 12) has its own string_view
// class, not an alias of std's, so StrCat and friends take one only through this conversion.
#pragma once

#include <string_view>

#include "absl/strings/string_view.h"

namespace dta {

inline absl::string_view AsAbsl(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

}  // namespace dta

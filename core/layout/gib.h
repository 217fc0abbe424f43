// Byte counts as people read them in messages: "2.4 GiB".
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dta {

// "2.4": bytes in GiB, one decimal.
inline std::string GiBNumber(int64_t bytes) {
  return absl::StrFormat("%.1f",
                         static_cast<double>(bytes) / static_cast<double>(int64_t{1} << 30));
}

// "2.4 GiB".
inline std::string GiB(int64_t bytes) { return absl::StrCat(GiBNumber(bytes), " GiB"); }

}  // namespace dta

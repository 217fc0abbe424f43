// Comparing secrets (tokens) in time independent of where they differ, so that an answer's timing
// does not reveal a token's prefix.
#pragma once

#include <string_view>

namespace dta {

inline bool SecretEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ |= static_cast<unsigned char>(a[i] ^ b[i]);
  return differ == 0;
}

}  // namespace dta

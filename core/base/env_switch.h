// The environment switches dta reads (DTA_FUSED_LAYERS, DTA_HOPPER_ATTENTION, ...): on unless the
// variable is exactly "0"; opt-in ones (a path that is not the default yet) off unless it is "1".
// Used for before/after measurements in one build and to rule a kernel out when debugging; each
// caller documents whether it reads its switch once or at every call.
#pragma once

#include <cstdlib>
#include <cstring>

namespace dta {

// False when the environment variable `name` is "0", true when it is unset or anything else.
inline bool EnvSwitchOn(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr || std::strcmp(value, "0") != 0;
}

// True only when the environment variable `name` is exactly "1".
inline bool EnvSwitchOptIn(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::strcmp(value, "1") == 0;
}

}  // namespace dta

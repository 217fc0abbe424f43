// An environment variable set for a scope, restored on exit (the previous value, or unset when
// there was none): tests and benchmarks that run one build both ways of a switch (env_switch.h).
// Not thread safe (setenv): set switches before the work that reads them starts.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace dta {

class ScopedEnv {
 public:
  // `value` null: unset for the scope.
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    if (old != nullptr) old_ = old;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace dta

// A progress line for long work (a training step of many thousand tokens), with rate and ETA:
//
//   dta-train: step 3: 412.3K/1.02M tokens (40%), 51.2K tokens/s, ETA 12 s
//
// Quiet when the output is not a terminal (logs and pipes get the step's own summary line), unless
// asked to print anyway: then complete lines, less often. Nothing is printed for work that ends
// within the first `delay`, so short steps stay silent.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace dta {

enum class ProgressMode {
  kAuto,    // on a terminal: one line rewritten in place, every half second
  kAlways,  // also into files and pipes: a complete line every 10 s
  kNever,
};

// "auto", "always" or "never"; INVALID_ARGUMENT naming the choices otherwise.
absl::StatusOr<ProgressMode> ParseProgressMode(std::string_view name);

class ProgressLine {
 public:
  // `now` (seconds, monotonic) is for tests; by default the steady clock.
  ProgressLine(std::string prefix, std::string unit, ProgressMode mode, std::FILE* out = stderr,
               std::function<double()> now = nullptr);
  ~ProgressLine() { Finish(); }
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  // Work done so far of `total` (done <= total); prints when due.
  void Update(int64_t done, int64_t total);
  // Clears a rewritten line, so that what follows starts clean. Idempotent.
  void Finish();

  // "412.3K/1.02M tokens (40%), 51.2K tokens/s, ETA 12 s" (what a line shows after the prefix).
  static std::string Describe(int64_t done, int64_t total, double seconds, std::string_view unit);

 private:
  const std::string prefix_;
  const std::string unit_;
  std::FILE* const out_;
  const std::function<double()> now_;
  bool rewrite_ = false;  // a terminal: \r and clear
  bool enabled_ = false;
  double start_ = 0;
  double delay_ = 0;
  double interval_ = 0;
  double last_print_ = -1;
  bool line_open_ = false;  // a rewritten line is on screen
};

}  // namespace dta

#include "core/progress/progress_line.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dta {
namespace {

double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// 2.5, 999, 1.2K, 51.2K, 1.02M, 3.4G: three significant digits.
std::string Compact(double value) {
  const char* suffixes[] = {"", "K", "M", "G", "T"};
  int power = 0;
  while (std::abs(value) >= 999.5 && power < 4) {
    value /= 1000;
    ++power;
  }
  return absl::StrCat(absl::StrFormat("%.3g", value), suffixes[power]);
}

std::string Duration(double seconds) {
  if (seconds < 90) return absl::StrFormat("%.0f s", seconds);
  if (seconds < 90 * 60) return absl::StrFormat("%.0f min", seconds / 60);
  return absl::StrFormat("%.1f h", seconds / 3600);
}

}  // namespace

absl::StatusOr<ProgressMode> ParseProgressMode(std::string_view name) {
  if (name == "auto") return ProgressMode::kAuto;
  if (name == "always") return ProgressMode::kAlways;
  if (name == "never") return ProgressMode::kNever;
  return absl::InvalidArgumentError(
      absl::StrCat("progress must be auto, always or never, got '", std::string(name), "'"));
}

ProgressLine::ProgressLine(std::string prefix, std::string unit, ProgressMode mode, std::FILE* out,
                           std::function<double()> now)
    : prefix_(std::move(prefix)),
      unit_(std::move(unit)),
      out_(out),
      now_(now ? std::move(now) : SteadySeconds) {
  const bool terminal = out_ != nullptr && isatty(fileno(out_)) != 0;
  rewrite_ = terminal && mode != ProgressMode::kNever;
  enabled_ = rewrite_ || mode == ProgressMode::kAlways;
  delay_ = rewrite_ ? 2.0 : 10.0;
  interval_ = rewrite_ ? 0.5 : 10.0;
  start_ = now_();
}

std::string ProgressLine::Describe(int64_t done, int64_t total, double seconds,
                                   std::string_view unit) {
  const double fraction = total > 0 ? static_cast<double>(done) / total : 1.0;
  std::string text = absl::StrCat(Compact(done), "/", Compact(total), " ", std::string(unit), " (",
                                  absl::StrFormat("%.0f", 100 * fraction), "%)");
  if (seconds > 0 && done > 0) {
    const double rate = done / seconds;
    absl::StrAppend(&text, ", ", Compact(rate), " ", std::string(unit), "/s, ETA ",
                    Duration((total - done) / rate));
  }
  return text;
}

void ProgressLine::Update(int64_t done, int64_t total) {
  if (!enabled_) return;
  const double now = now_();
  const double elapsed = now - start_;
  if (elapsed < delay_ || (last_print_ >= 0 && now - last_print_ < interval_)) return;
  last_print_ = now;
  const std::string line = absl::StrCat(prefix_, ": ", Describe(done, total, elapsed, unit_));
  if (rewrite_) {
    std::fprintf(out_, "\r\033[K%s", line.c_str());  // carriage return, clear to the line's end
    line_open_ = true;
  } else {
    std::fprintf(out_, "%s\n", line.c_str());
  }
  std::fflush(out_);
}

void ProgressLine::Finish() {
  if (!line_open_) return;
  std::fprintf(out_, "\r\033[K");
  std::fflush(out_);
  line_open_ = false;
}

}  // namespace dta

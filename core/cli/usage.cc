#include "core/cli/usage.h"

#include <string>

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"

namespace dta {
namespace {

// Abseil's own flags (--flagfile, --fromenv, ...) are defined in absl/flags/*.cc.
bool IsOurFlagFile(absl::string_view file) { return !absl::StrContains(file, "absl/"); }

}  // namespace

void SetProgramUsage(std::string_view usage) {
  absl::FlagsUsageConfig config;
  config.contains_help_flags = IsOurFlagFile;
  config.contains_helpshort_flags = IsOurFlagFile;
  absl::SetFlagsUsageConfig(config);
  absl::SetProgramUsageMessage(absl::string_view(usage.data(), usage.size()));
}

}  // namespace dta

#include "core/cli/usage.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/base/exit_codes.h"

ABSL_FLAG(std::string, dump_flags, "",
          "write the flags this run sets (those not at their defaults) to this file, one per line: "
          "given back as the flagfile, it replays the run");

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

std::string NonDefaultFlags() {
  std::vector<std::string> lines;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!IsOurFlagFile(flag->Filename()) || name == "dump_flags") continue;
    const std::string value = flag->CurrentValue();
    if (value != flag->DefaultValue()) lines.push_back(absl::StrCat("--", name, "=", value, "\n"));
  }
  std::sort(lines.begin(), lines.end());
  std::string out;
  for (const std::string& line : lines) out += line;
  return out;
}

std::vector<char*> ParseCommandLine(int argc, char** argv) {
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  const std::string path = absl::GetFlag(FLAGS_dump_flags);
  if (!path.empty()) {
    std::ofstream file(path, std::ios::trunc);
    file << NonDefaultFlags();
    file.close();
    if (!file) {
      std::fprintf(stderr, "--dump_flags: cannot write %s\n", path.c_str());
      std::exit(kExitBadInput);
    }
  }
  return positional;
}

}  // namespace dta

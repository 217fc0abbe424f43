#include "core/cli/usage.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/base/exit_codes.h"

ABSL_FLAG(std::string, dump_flags, "",
          "write the flags this run sets (those not at their defaults) to this file, one per line: "
          "given back as the flagfile, it replays the run");

namespace dta {
namespace {

// Abseil's own flags (--flagfile, --fromenv, ...) are defined in absl/flags/*.cc.
bool IsOurFlagFile(absl::string_view file) { return !absl::StrContains(file, "absl/"); }

// Deep enough for any real layering of configurations, shallow enough to stop at once.
constexpr int kMaxFlagFileDepth = 32;

// The value of `arg` when it is --flagfile=V or -flagfile=V; `next` is the following argument,
// used (and `consumed_next` set) for the "--flagfile V" form. Empty when `arg` is another flag.
std::optional<std::string> FlagFileValue(absl::string_view arg, const char* next,
                                         bool& consumed_next) {
  consumed_next = false;
  if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) return std::nullopt;
  if (arg == "flagfile" && next != nullptr) {
    consumed_next = true;
    return std::string(next);
  }
  if (!absl::ConsumePrefix(&arg, "flagfile=")) return std::nullopt;
  return std::string(arg);
}

// Checks each file of a --flagfile value, then the flag files it names. `chain` holds the files
// being read, outermost first.
absl::Status CheckFlagFileList(const std::string& value, std::vector<std::string>& chain) {
  for (absl::string_view name : absl::StrSplit(value, ',', absl::SkipEmpty())) {
    const std::string file(name);
    std::error_code error;
    const std::filesystem::path canonical = std::filesystem::weakly_canonical(file, error);
    const std::string key = error ? file : canonical.string();
    const std::string where =
        chain.empty() ? "--flagfile" : absl::StrCat("--flagfile in ", chain.back());
    if (std::find(chain.begin(), chain.end(), key) != chain.end()) {
      std::vector<std::string> cycle(std::find(chain.begin(), chain.end(), key), chain.end());
      cycle.push_back(key);
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", file, " includes itself (", absl::StrJoin(cycle, " -> "), ")"));
    }
    if (chain.size() >= kMaxFlagFileDepth) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": ", file, ": flag files nest more than ", kMaxFlagFileDepth, " deep"));
    }
    const std::filesystem::file_status status = std::filesystem::status(file, error);
    if (error || !std::filesystem::exists(status)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": cannot read ", file, ": ",
                                                     error ? error.message() : "no such file"));
    }
    if (!std::filesystem::is_regular_file(status)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", file, " is not a regular file (a directory?)"));
    }
    std::ifstream in(file);
    if (!in) return absl::InvalidArgumentError(absl::StrCat(where, ": cannot read ", file));
    chain.push_back(key);
    std::string line;
    while (std::getline(in, line)) {
      absl::string_view flag = absl::StripAsciiWhitespace(line);
      bool unused = false;
      if (std::optional<std::string> nested = FlagFileValue(flag, nullptr, unused)) {
        if (absl::Status s = CheckFlagFileList(*nested, chain); !s.ok()) return s;
      }
    }
    chain.pop_back();
  }
  return absl::OkStatus();
}

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

absl::Status CheckFlagFiles(int argc, const char* const* argv) {
  for (int i = 1; i < argc; ++i) {
    if (absl::string_view(argv[i]) == "--") break;  // positional arguments follow
    bool consumed_next = false;
    const std::optional<std::string> value =
        FlagFileValue(argv[i], i + 1 < argc ? argv[i + 1] : nullptr, consumed_next);
    if (consumed_next) ++i;
    if (!value.has_value()) continue;
    std::vector<std::string> chain;
    if (absl::Status s = CheckFlagFileList(*value, chain); !s.ok()) return s;
  }
  return absl::OkStatus();
}

std::vector<char*> ParseCommandLine(int argc, char** argv) {
  if (absl::Status flag_files = CheckFlagFiles(argc, argv); !flag_files.ok()) {
    std::fprintf(stderr, "%s\n", std::string(flag_files.message()).c_str());
    std::exit(kExitBadInput);
  }
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

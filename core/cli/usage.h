// Command-line usage for every dta binary: the usage line and a --help that lists the binary's
// own flags. Abseil's default --help lists only flags defined in a file named after the binary
// (e.g. dta-train.cc), which none of ours is, so it printed "No flags matched"; here every flag
// defined outside Abseil is listed (a binary links only the flags it uses).
//
// A run's configuration is a file: --dump_flags=FILE writes every flag the run sets (all that
// differ from their defaults, Abseil's own excepted) as a flag file, one --name=value a line, and
// --flagfile=FILE (Abseil's) replays it; later flags on the command line override the file's.
//
//   int main(int argc, char** argv) {
//     dta::SetProgramUsage("dta-train --rollouts=FILE --config=PRESET ...");
//     std::vector<char*> positional = dta::ParseCommandLine(argc, argv);
//
// Call SetProgramUsage once, before ParseCommandLine.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace dta {

void SetProgramUsage(std::string_view usage);

// CheckFlagFiles, absl::ParseCommandLine, then --dump_flags: the file is written (replaced) before
// the program runs. A flag file CheckFlagFiles refuses, or a --dump_flags file that cannot be
// written, ends the program with status 2 (bad input), naming it. Returns the positional arguments
// (argv[0] first).
std::vector<char*> ParseCommandLine(int argc, char** argv);

// The flag files the command line names (--flagfile=A[,B...], also inside flag files), checked
// before Abseil reads them, which it does without these checks: a file that cannot be read or is
// not a regular file (a directory would be skipped silently and the run start on defaults), and a
// file that includes itself, directly or through others (Abseil would read it forever).
// INVALID_ARGUMENT naming the file (and the chain of inclusions for a cycle); OK otherwise.
absl::Status CheckFlagFiles(int argc, const char* const* argv);

// The flag file of the flags that differ from their defaults, sorted by name (what --dump_flags
// writes).
std::string NonDefaultFlags();

}  // namespace dta

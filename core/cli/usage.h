// Command-line usage for every dta binary: the usage line and a --help that lists the binary's
// own flags. Abseil's default --help lists only flags defined in a file named after the binary
// (e.g. dta-train.cc), which none of ours is, so it printed "No flags matched"; here every flag
// defined outside Abseil is listed (a binary links only the flags it uses).
//
//   int main(int argc, char** argv) {
//     dta::SetProgramUsage("dta-train --rollouts=FILE --config=PRESET ...");
//     absl::ParseCommandLine(argc, argv);
//
// Call once, before absl::ParseCommandLine.
#pragma once

#include <string_view>

namespace dta {

void SetProgramUsage(std::string_view usage);

}  // namespace dta

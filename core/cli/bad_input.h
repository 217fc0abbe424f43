// Input the user must fix (a flag, a file, a config): thrown by the binaries' flag helpers and
// caught in main, which prints the message and exits kExitBadInput (2, core/base/exit_codes.h).
#pragma once

#include <string>

namespace dta {

struct BadInput {
  std::string message;  // names what is wrong: the flag, the file, the field
};

}  // namespace dta

// The exit statuses every dta binary uses, so that launchers and scripts can tell a bad command
// line from a fault worth a restart.
#pragma once

namespace dta {

inline constexpr int kExitOk = 0;
// Any other failure (an I/O error, a bug, a lost log).
inline constexpr int kExitError = 1;
// Bad input: a flag, a rollout file, a config. Retrying the same command cannot help.
inline constexpr int kExitBadInput = 2;
// EX_TEMPFAIL: restart the process (group), e.g. a trainer whose peer died; torchrun restarts it.
inline constexpr int kExitRestart = 75;

}  // namespace dta

// Files and directories that hold a secret or a process's state (credentials, the dispatcher's
// write-ahead log, a trainer's checkpoints), so that another local user can neither read them nor
// plant them in a shared directory such as /tmp before the process starts.
//
// One rule for all of them:
// - a file the process did not create is used only when it is a regular file (not a symbolic
//   link) owned by the process's effective user and neither readable nor writable by group or
//   others (mode 0600 or 0400);
// - a file the process creates is created with O_EXCL (a file that appears meanwhile is refused or
//   checked by the first rule, never opened as it is) and mode 0600, in a directory that only its
//   owner can write (owned by the process's user or root, no write bit for group or others, so
//   /tmp itself is refused: use a private directory under it);
// - a directory of state that others read (checkpoints, which rollout engines load) must be owned
//   by the process's user and not writable by group or others.
// Errors are FAILED_PRECONDITION (the operator must fix the file: chown, chmod, another path) and
// name the path, its owner and its mode; I/O failures are INTERNAL or NOT_FOUND naming the path.
//
//   ASSIGN_OR_RETURN(std::string token, ReadPrivateFile("/run/dta/trainer.token"));
//
// Thread safety: the functions are thread-safe (they share no state).
#pragma once

#include <sys/types.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dta {

// Whose files count as the process's own: its effective user unless a test says otherwise.
struct OwnerRule {
  uid_t user = static_cast<uid_t>(-1);  // -1: geteuid()
};

// The contents of the private file `path` (stripped of surrounding whitespace when `trim`, as for
// tokens), read from one descriptor opened without following a symbolic link, whose owner and mode
// are checked on that descriptor (no window between the check and the read). NOT_FOUND when it
// cannot be opened; FAILED_PRECONDITION when it is not a regular file, is owned by another user or
// is open to group or others; INVALID_ARGUMENT when it is empty.
absl::StatusOr<std::string> ReadPrivateFile(const std::string& path, bool trim = true,
                                            OwnerRule owner = {});

// Creates `path` (O_EXCL, mode 0600) holding `contents`, synced to disk. ALREADY_EXISTS when a
// file of that name exists (the caller decides whether to read it with ReadPrivateFile);
// FAILED_PRECONDITION when its directory can be written by others than its owner, or belongs to
// another user than the process's or root; INTERNAL naming the path on an I/O failure (nothing is
// left behind).
absl::Status CreatePrivateFile(const std::string& path, const std::string& contents,
                               OwnerRule owner = {});

// OK when the existing file `path` may be used as the process's own: a regular file owned by the
// process's user, closed to group and others. FAILED_PRECONDITION otherwise (naming owner and
// mode); NOT_FOUND when it does not exist.
absl::Status CheckPrivateFile(const std::string& path, OwnerRule owner = {});

// CheckPrivateFile on an open descriptor of `path` (no window between the check and its use).
absl::Status CheckPrivateDescriptor(int fd, const std::string& path, OwnerRule owner = {});

// OK when the existing directory `path` may hold the process's state: a directory (not a symbolic
// link) owned by the process's user and not writable by group or others. FAILED_PRECONDITION
// otherwise (naming owner and mode); NOT_FOUND when it does not exist.
absl::Status CheckOwnedDirectory(const std::string& path, OwnerRule owner = {});

// Creates the directory `path` (and missing parents, each with mode 0755 less the umask) when it
// is missing, then checks it with CheckOwnedDirectory: a directory that another user created
// before the process, or that is writable by others, is refused. INTERNAL naming the path when it
// cannot be created.
absl::Status MakeOwnedDirectory(const std::string& path, OwnerRule owner = {});

}  // namespace dta

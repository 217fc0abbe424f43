#include "core/base/private_files.h"

#include <fcntl.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "core/base/status_macros.h"
#include "core/base/unique_fd.h"

namespace dta {
namespace {

uid_t UserOf(OwnerRule owner) {
  return owner.user == static_cast<uid_t>(-1) ? ::geteuid() : owner.user;
}

// "uid 1001 (alice)", or "uid 1001" for a user without a name.
std::string DescribeUser(uid_t uid) {
  std::vector<char> buffer(4096);
  passwd entry{};
  passwd* found = nullptr;
  if (::getpwuid_r(uid, &entry, buffer.data(), buffer.size(), &found) == 0 && found != nullptr) {
    return absl::StrCat("uid ", uid, " (", found->pw_name, ")");
  }
  return absl::StrCat("uid ", uid);
}

std::string DescribeMode(mode_t mode) { return absl::StrFormat("%04o", mode & 07777); }

absl::Status ErrnoError(int error, absl::string_view action, const std::string& path) {
  if (error == ENOENT)
    return absl::NotFoundError(
        absl::StrCat("cannot ", action, " ", path, ": ", std::strerror(error)));
  return absl::InternalError(
      absl::StrCat("cannot ", action, " ", path, ": ", std::strerror(error)));
}

// The rule for a file the process did not create, on its stat.
absl::Status CheckFileInfo(const std::string& path, const struct stat& info, uid_t user) {
  if (!S_ISREG(info.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is not a regular file (mode ", DescribeMode(info.st_mode), ")"));
  }
  if (info.st_uid != user) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is owned by ", DescribeUser(info.st_uid), ", not by this process's user ",
        DescribeUser(user), " (mode ", DescribeMode(info.st_mode),
        "): a file another user created in its place is never trusted; remove it, or use a "
        "path in a directory only you can write"));
  }
  if ((info.st_mode & 077) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is open to group or others (mode ", DescribeMode(info.st_mode),
                     ", owner ", DescribeUser(info.st_uid),
                     "): it must be readable and writable by its owner only (chmod 600)"));
  }
  return absl::OkStatus();
}

absl::Status CheckDirectoryInfo(const std::string& path, const struct stat& info, uid_t user,
                                bool root_may_own) {
  if (!S_ISDIR(info.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is not a directory (mode ", DescribeMode(info.st_mode), ")"));
  }
  if (info.st_uid != user && !(root_may_own && info.st_uid == 0)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the directory ", path, " is owned by ", DescribeUser(info.st_uid),
        ", not by this process's user ", DescribeUser(user), " (mode ", DescribeMode(info.st_mode),
        "): its owner could replace what is in it; use a directory of your own"));
  }
  if ((info.st_mode & 022) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the directory ", path, " is writable by group or others (mode ",
        DescribeMode(info.st_mode), ", owner ", DescribeUser(info.st_uid),
        "): they could plant or replace files in it; use a directory only its owner can write "
        "(chmod go-w, or e.g. mktemp -d)"));
  }
  return absl::OkStatus();
}

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

absl::StatusOr<std::string> ReadPrivateFile(const std::string& path, bool trim, OwnerRule owner) {
  const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0) {
    if (errno == ELOOP) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " is a symbolic link: give the file it points to"));
    }
    return absl::NotFoundError(absl::StrCat("cannot read ", path, ": ", std::strerror(errno)));
  }
  RETURN_IF_ERROR(CheckPrivateDescriptor(fd.get(), path, owner));
  std::string contents;
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError(errno, "read", path);
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
  }
  if (trim) contents = std::string(absl::StripAsciiWhitespace(contents));
  if (contents.empty()) return absl::InvalidArgumentError(absl::StrCat(path, " is empty"));
  return contents;
}

absl::Status CreatePrivateFile(const std::string& path, const std::string& contents,
                               OwnerRule owner) {
  const std::string directory = DirectoryOf(path);
  struct stat info {};
  if (::stat(directory.c_str(), &info) != 0) return ErrnoError(errno, "stat", directory);
  if (absl::Status s = CheckDirectoryInfo(directory, info, UserOf(owner), /*root_may_own=*/true);
      !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("will not create ", path, ": ", s.message()));
  }
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (fd.get() < 0) {
    if (errno == EEXIST) return absl::AlreadyExistsError(absl::StrCat(path, " exists"));
    return ErrnoError(errno, "create", path);
  }
  int error = 0;
  for (size_t written = 0; written < contents.size() && error == 0;) {
    const ssize_t n = ::write(fd.get(), contents.data() + written, contents.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) error = n < 0 ? errno : EIO;
    if (n > 0) written += static_cast<size_t>(n);
  }
  if (error == 0 && ::fsync(fd.get()) != 0) error = errno;
  fd.Reset();
  if (error != 0) {
    ::unlink(path.c_str());
    return ErrnoError(error, "write", path);
  }
  return absl::OkStatus();
}

absl::Status CheckPrivateFile(const std::string& path, OwnerRule owner) {
  struct stat info {};
  if (::lstat(path.c_str(), &info) != 0) return ErrnoError(errno, "stat", path);
  if (S_ISLNK(info.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is a symbolic link: give the file it points to"));
  }
  return CheckFileInfo(path, info, UserOf(owner));
}

absl::Status CheckPrivateDescriptor(int fd, const std::string& path, OwnerRule owner) {
  struct stat info {};
  if (::fstat(fd, &info) != 0) return ErrnoError(errno, "stat", path);
  return CheckFileInfo(path, info, UserOf(owner));
}

absl::Status CheckOwnedDirectory(const std::string& path, OwnerRule owner) {
  struct stat info {};
  if (::lstat(path.c_str(), &info) != 0) return ErrnoError(errno, "stat", path);
  if (S_ISLNK(info.st_mode)) {
    // A link is judged by its target, and the link itself must be the user's own.
    if (info.st_uid != UserOf(owner)) {
      return absl::FailedPreconditionError(
          absl::StrCat("the directory ", path, " is a symbolic link owned by ",
                       DescribeUser(info.st_uid), ": use a directory of your own"));
    }
    if (::stat(path.c_str(), &info) != 0) return ErrnoError(errno, "stat", path);
  }
  return CheckDirectoryInfo(path, info, UserOf(owner), /*root_may_own=*/false);
}

absl::Status MakeOwnedDirectory(const std::string& path, OwnerRule owner) {
  if (path.empty()) return absl::InvalidArgumentError("the directory's path is empty");
  for (size_t end = path.find('/', 1);; end = path.find('/', end + 1)) {
    const std::string prefix = path.substr(0, end);
    if (!prefix.empty() && ::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoError(errno, "create the directory", prefix);
    }
    if (end == std::string::npos) break;
  }
  return CheckOwnedDirectory(path, owner);
}

}  // namespace dta

// A temporary directory for a test, named after the test and the process, removed with its
// contents when the object goes (and before, if a crashed run left one); and a file's bytes.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "core/base/remove_tree.h"

namespace dta::testing {

class ScratchDirectory {
 public:
  explicit ScratchDirectory(const std::string& name)
      : path_(std::filesystem::temp_directory_path() / (name + "-" + std::to_string(::getpid()))) {
    RemoveTree(path_.string());
  }
  ~ScratchDirectory() { RemoveTree(path_.string()); }
  ScratchDirectory(const ScratchDirectory&) = delete;
  ScratchDirectory& operator=(const ScratchDirectory&) = delete;

  std::string operator/(const std::string& child) const { return (path_ / child).string(); }
  std::string path() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// The bytes of the file at `path` (empty when it cannot be read).
inline std::string ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace dta::testing

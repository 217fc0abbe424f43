// Deletes a directory tree. std::filesystem::remove_all is avoided on purpose: in processes that
// link LibTorch, libtorch.so exports its own (older) copy of it, which the dynamic linker binds our
// calls to, and which crashes on a directory. RemoveTree walks the tree with nftw, depth first.
#pragma once

#include <string>

namespace dta {

// Removes `path` and everything under it, best effort: what cannot be removed stays (harmlessly,
// callers write to fresh names). Symbolic links are removed, never followed.
void RemoveTree(const std::string& path);

}  // namespace dta

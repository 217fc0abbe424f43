#include "core/base/remove_tree.h"

#include <ftw.h>

#include <cstdio>

namespace dta {

void RemoveTree(const std::string& path) {
  nftw(
      path.c_str(),
      [](const char* file, const struct stat*, int, struct FTW*) {
        ::remove(file);  // keep going: what cannot be removed stays
        return 0;
      },
      16, FTW_DEPTH | FTW_PHYS);
}

}  // namespace dta

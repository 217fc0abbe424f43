// The one translation unit that includes ProcessGroupGloo.hpp.
//
// That header includes five Gloo headers, which the torch wheel does not ship (torch links Gloo
// into libtorch_cpu and installs none of its headers). Unless DTA_GLOO_INCLUDE_DIR points at a
// Gloo source tree, gloo_decls/ stands in for them: declarations only, of exactly the names
// ProcessGroupGloo.hpp uses. This is sound because
//   - every Gloo type the header stores is held through a std::shared_ptr or std::unique_ptr, so
//     the size and layout of ProcessGroupGloo and of its Options (the objects this file allocates)
//     do not depend on Gloo's definitions;
//   - everything else (the constructors, the device factories, the vtables, GlooStore) is compiled
//     into libtorch_cpu against the real Gloo: this file calls only exported functions, and
//     virtual functions through those vtables, and defines nothing of Gloo's. A stand-in member
//     that were ever used here would fail to link rather than misbehave.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdlib>
#include <string>
#include <string_view>

#include "executor/distributed/c10d_backends.h"

#ifndef USE_C10D_GLOO
#error "dta::distributed needs a LibTorch built with Gloo (USE_C10D_GLOO)"
#endif

namespace dta::internal {

c10::intrusive_ptr<c10d::Backend> MakeGlooBackend(const c10::intrusive_ptr<c10d::Store>& store,
                                                  int rank, int size,
                                                  const ProcessGroupOptions& options) {
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
  gloo_options->threads = options.gloo_threads;
  const bool lazy_init = c10d::getDefaultGlooLazyInit();  // TORCH_GLOO_LAZY_INIT, as torch reads it
  if (!options.gloo_hostname.empty()) {
    gloo_options->devices.push_back(
        c10d::ProcessGroupGloo::createDeviceForHostname(options.gloo_hostname, lazy_init));
  } else if (const char* ifnames = std::getenv("GLOO_SOCKET_IFNAME"); ifnames && *ifnames) {
    std::string_view rest(ifnames);
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      const std::string_view name = rest.substr(0, comma);
      if (!name.empty()) {
        gloo_options->devices.push_back(
            c10d::ProcessGroupGloo::createDeviceForInterface(std::string(name), lazy_init));
      }
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    }
  }
  if (gloo_options->devices.empty()) {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice(lazy_init));
  }
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, gloo_options);
}

}  // namespace dta::internal

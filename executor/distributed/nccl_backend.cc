// The one translation unit that includes ProcessGroupNCCL.hpp, which needs CUDA's and NCCL's
// headers. CMake defines DTA_HAVE_NCCL=1 when LibTorch was built with NCCL (USE_C10D_NCCL) and
// nccl.h is found, preferring the wheel's own nvidia/nccl/include: ProcessGroupNCCL::Options
// embeds an ncclConfig_t whose size depends on the NCCL version, so the header must be the one
// LibTorch was built against (2.28 for torch 2.11+cu130).
#include <c10/util/Exception.h>
#include <c10/util/env.h>

#include <chrono>
#include <optional>
#include <string>

#include "executor/distributed/c10d_backends.h"

#if DTA_HAVE_NCCL
#ifndef USE_C10D_NCCL
#error "DTA_HAVE_NCCL needs a LibTorch built with NCCL (USE_C10D_NCCL)"
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace dta::internal {

#if DTA_HAVE_NCCL

bool HaveNccl() { return true; }

c10::intrusive_ptr<c10d::Backend> MakeNcclBackend(const c10::intrusive_ptr<c10d::Store>& store,
                                                  int rank, int size, at::Device device,
                                                  const ProcessGroupOptions& options) {
  auto nccl_options = c10d::ProcessGroupNCCL::Options::create(options.nccl_high_priority_stream);
  nccl_options->timeout = options.timeout;
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> backend;
  if (!options.peers_may_fail) {
    backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, nccl_options);
  } else {
    // A blocking ncclCommInitRank waits forever for a peer that never joins; a non-blocking one is
    // polled by torch, up to TORCH_NCCL_NONBLOCKING_TIMEOUT (30 minutes unless set).
    nccl_options->config.blocking = 0;
    const auto seconds = std::chrono::ceil<std::chrono::seconds>(options.timeout).count();
    c10::utils::set_env("TORCH_NCCL_NONBLOCKING_TIMEOUT", std::to_string(seconds).c_str(),
                        /*overwrite=*/false);
    // The watchdog's default (SkipCleanUp) ends the process at a timed-out collective; the
    // constructor reads the mode from the environment, so it is set around this one construction.
    constexpr const char* kErrorHandling = "TORCH_NCCL_ASYNC_ERROR_HANDLING";
    // What the next groups would have read: the variable, its older name, or torch's default (3).
    const std::string previous =
        c10::utils::get_env(kErrorHandling)
            .value_or(c10::utils::get_env("NCCL_ASYNC_ERROR_HANDLING").value_or("3"));
    c10::utils::set_env(kErrorHandling, "2");  // CleanUpOnly: abort the communicators, go on
    try {
      backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, nccl_options);
    } catch (...) {
      c10::utils::set_env(kErrorHandling, previous.c_str());
      throw;
    }
    c10::utils::set_env(kErrorHandling, previous.c_str());
  }
  // Binding the device lets NCCL use it for barriers and communicator splits instead of guessing
  // from the rank; the communicator itself is still created at the first collective.
  backend->setBoundDeviceId(device);
  return backend;
}

#else  // !DTA_HAVE_NCCL

bool HaveNccl() { return false; }

c10::intrusive_ptr<c10d::Backend> MakeNcclBackend(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                                  at::Device, const ProcessGroupOptions&) {
  TORCH_CHECK(false, "dta::distributed was built without NCCL");
}

#endif  // DTA_HAVE_NCCL

}  // namespace dta::internal

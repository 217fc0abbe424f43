// The one translation unit that includes ProcessGroupNCCL.hpp, which needs CUDA's and NCCL's
// headers. CMake defines DTA_HAVE_NCCL=1 when LibTorch was built with NCCL (USE_C10D_NCCL) and
// nccl.h is found, preferring the wheel's own nvidia/nccl/include: ProcessGroupNCCL::Options
// embeds an ncclConfig_t whose size depends on the NCCL version, so the header must be the one
// LibTorch was built against (2.28 for torch 2.11+cu130).
#include <c10/util/Exception.h>

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
  auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, nccl_options);
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

// Internal to dta::distributed: constructs the c10d backends. Each lives in its own translation
// unit because of what its torch header drags in: ProcessGroupGloo.hpp names Gloo's headers, which
// the torch wheel does not ship (gloo_backend.cc says how that is handled), and
// ProcessGroupNCCL.hpp needs CUDA's and NCCL's (nccl_backend.cc, compiled in only when CMake finds
// them).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "executor/distributed/process_group.h"

namespace dta::internal {

// A c10d::ProcessGroupGloo over `store` (already prefixed), connected to every other rank when it
// returns. Throws c10::Error (or what c10d throws) when the rendezvous fails or times out.
c10::intrusive_ptr<c10d::Backend> MakeGlooBackend(const c10::intrusive_ptr<c10d::Store>& store,
                                                  int rank, int size,
                                                  const ProcessGroupOptions& options);

// Whether this build can make NCCL backends (false: MakeNcclBackend throws).
bool HaveNccl();

// A c10d::ProcessGroupNCCL over `store`, bound to `device` (CUDA, with an index). Throws
// c10::Error (e.g. when there is no GPU).
c10::intrusive_ptr<c10d::Backend> MakeNcclBackend(const c10::intrusive_ptr<c10d::Store>& store,
                                                  int rank, int size, at::Device device,
                                                  const ProcessGroupOptions& options);

}  // namespace dta::internal

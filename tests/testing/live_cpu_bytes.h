// The bytes of CPU tensors allocated and not freed while a guard installs it, on this thread
// (PyTorch's CPU allocator reports to the profiler's thread-local state): what a graph or a stack
// keeps alive, for tests of memory.
//
//   const auto live = std::make_shared<testing::LiveCpuBytes>();
//   {
//     c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, live);
//     ... live->live() ...
//   }
#pragma once

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <atomic>
#include <cstdint>

namespace dta::testing {

class LiveCpuBytes final : public c10::MemoryReportingInfoBase {
 public:
  bool memoryProfilingEnabled() const override { return true; }
  void reportMemoryUsage(void* /*ptr*/, int64_t alloc_size, size_t /*total_allocated*/,
                         size_t /*total_reserved*/, c10::Device device) override {
    if (device.is_cpu()) live_ += alloc_size;
  }
  int64_t live() const { return live_; }

 private:
  std::atomic<int64_t> live_{0};
};

}  // namespace dta::testing

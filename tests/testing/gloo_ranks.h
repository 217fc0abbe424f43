// Ranks as threads of one test process: each gets its own Gloo ProcessGroup over one shared
// c10d::HashStore on loopback (or, RunRanksOnGpus, an NCCL group on its own GPU). For tests of
// everything distributed.
#pragma once

#include <c10/cuda/CUDAGuard.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <functional>
#include <latch>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "executor/distributed/process_group.h"

namespace dta::testing {

inline constexpr std::chrono::milliseconds kRankTimeout = std::chrono::seconds(30);

// c10d's process-wide flight recorder (torch 2.11) inserts into a map outside its lock when a
// group records its first collective, so groups on several threads racing to their first
// collective can corrupt it (seen as a segfault about once in 40 runs). Ranks as threads need it
// off; it is read once, at its first use, so this runs before any group exists (static init).
[[maybe_unused]] inline const bool kFlightRecorderOff =
    setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/1) == 0;

inline ProcessGroupOptions LoopbackOptions() {
  ProcessGroupOptions options;
  options.timeout = kRankTimeout;
  options.gloo_hostname = "127.0.0.1";
  return options;
}

// The message of a c10::Error without its backtrace, else what().
inline std::string ErrorText(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return error->what_without_backtrace();
  }
  return e.what();
}

// Runs body(group) on `world` threads, rank r on thread r, its group on device_of(r). A rank's
// exception (or a failure to create its group) is reported as a test failure naming the rank.
// Every rank's group is created before any body runs: a rank whose body makes no collective would
// otherwise destroy its group, closing its sockets, while a peer still finishes connecting to it
// (Gloo's connectFullMesh then fails with "Connection closed by peer").
inline void RunRanksOn(int world, const std::function<at::Device(int)>& device_of,
                       const std::function<void(ProcessGroup&)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  std::latch created(world);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      bool arrived = false;
      try {
        const at::Device device = device_of(r);
        std::optional<c10::cuda::CUDAGuard> guard;
        if (device.is_cuda()) guard.emplace(device);
        absl::StatusOr<std::unique_ptr<ProcessGroup>> group =
            ProcessGroup::CreateWithStore(store, r, world, device, LoopbackOptions());
        arrived = true;
        created.arrive_and_wait();
        if (!group.ok()) {
          errors[r] = group.status().ToString();
          return;
        }
        EXPECT_EQ((*group)->rank(), r);
        EXPECT_EQ((*group)->size(), world);
        EXPECT_EQ((*group)->backend_name(), device.is_cuda() ? "nccl" : "gloo");
        body(**group);
      } catch (const std::exception& e) {
        errors[r] = ErrorText(e);
        if (!arrived) created.arrive_and_wait();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r << " of " << world;
}

// Gloo on the CPU.
inline void RunRanks(int world, const std::function<void(ProcessGroup&)>& body) {
  RunRanksOn(
      world, [](int) { return at::Device(at::kCPU); }, body);
}

// NCCL, rank r on CUDA device r (current on its thread); the caller checks there are enough.
inline void RunRanksOnGpus(int world, const std::function<void(ProcessGroup&)>& body) {
  RunRanksOn(
      world, [](int r) { return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(r)); }, body);
}

}  // namespace dta::testing

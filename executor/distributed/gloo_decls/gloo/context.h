// Declaration-only stand-in for Gloo's gloo/context.h (executor/distributed/gloo_backend.cc says
// why). Only what torch/csrc/distributed/c10d/ProcessGroupGloo.hpp names is declared, and nothing
// here is defined: the objects themselves are created and used inside libtorch_cpu.
#pragma once

#include <chrono>

namespace gloo {

class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);  // named by an inline setter, never called
};

}  // namespace gloo

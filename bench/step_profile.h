// One benchmark step under PyTorch's Kineto profiler, summarised per event name: on a GPU the
// device's activity (kernels, copies, fills), whose times add up to the GPU's busy time where no
// two streams overlap; on the CPU the operators' inclusive times (an operator's time includes the
// ones it calls). What `hf_baseline.py --profile` gives through Python, for dta-bench's models,
// which need no optimizer state on the host.
//
// Example:
//   const StepProfile p = ProfileStep([&] { RunOneStep(); }, device);
//   std::ofstream("profile.md") << ProfileMarkdown(p, "dta on qwen3-next-8l", /*top=*/40);
//
// Thread safety: one profile per process at a time (the profiler is process-wide).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dta::bench {

struct ProfileRow {
  std::string name;
  int64_t calls = 0;
  double ms = 0;
};

struct StepProfile {
  bool device_events = false;    // true: GPU activity; false: CPU operators
  double wall_ms = 0;            // the step, device synchronisations included
  double total_ms = 0;           // the rows' sum
  int64_t events = 0;            // the rows' calls
  std::vector<ProfileRow> rows;  // most time first
  // On a GPU: the same time by the operator that launched it (its innermost ATen or custom
  // operator, with its inputs' shapes), most time first: which call a kernel's time belongs to.
  std::vector<ProfileRow> launchers;
};

// Runs `step` (which synchronises with the device before it returns) under the profiler.
StepProfile ProfileStep(const std::function<void()>& step, const at::Device& device);

// A Markdown section: the totals, then the `top` rows with the most time (names cut to 150
// characters), then on a GPU the `top` launching operators with the most time.
std::string ProfileMarkdown(const StepProfile& profile, const std::string& title, int top);

}  // namespace dta::bench

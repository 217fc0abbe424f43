#include "bench/step_profile.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <unordered_map>

#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"

namespace dta::bench {

StepProfile ProfileStep(const std::function<void()>& step, const at::Device& device) {
  namespace impl = torch::profiler::impl;
  namespace profiler = torch::autograd::profiler;
  const bool gpu = device.is_cuda();
  std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
  if (gpu) activities.insert(impl::ActivityType::CUDA);
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO);
  profiler::prepareProfiler(config, activities);
  profiler::enableProfiler(config, activities);
  const auto start = std::chrono::steady_clock::now();
  step();
  const auto end = std::chrono::steady_clock::now();
  const std::unique_ptr<profiler::ProfilerResult> result = profiler::disableProfiler();

  StepProfile profile;
  profile.device_events = gpu;
  profile.wall_ms = std::chrono::duration<double, std::milli>(end - start).count();
  const c10::DeviceType wanted = gpu ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  std::unordered_map<std::string, size_t> row_of;
  for (const profiler::KinetoEvent& event : result->events()) {
    if (event.deviceType() != wanted) continue;
    const std::string name = event.name();
    auto [it, added] = row_of.try_emplace(name, profile.rows.size());
    if (added) profile.rows.push_back({.name = name});
    ProfileRow& row = profile.rows[it->second];
    const double ms = static_cast<double>(event.durationNs()) / 1e6;
    row.calls += 1;
    row.ms += ms;
    profile.total_ms += ms;
    profile.events += 1;
  }
  std::stable_sort(profile.rows.begin(), profile.rows.end(),
                   [](const ProfileRow& a, const ProfileRow& b) { return a.ms > b.ms; });
  return profile;
}

std::string ProfileMarkdown(const StepProfile& profile, const std::string& title, int top) {
  std::string md = absl::StrFormat("## Profile: %s\n\n", title);
  if (profile.device_events) {
    md += absl::StrFormat(
        "One step under the Kineto profiler: %.1f ms wall, %d GPU activities (kernels, copies, "
        "fills) taking %.1f ms of GPU time (%.0f%% of the wall time where streams do not "
        "overlap).\n\n",
        profile.wall_ms, profile.events, profile.total_ms,
        profile.wall_ms > 0 ? 100 * profile.total_ms / profile.wall_ms : 0);
  } else {
    md += absl::StrFormat(
        "One step under the Kineto profiler: %.1f ms wall, %d CPU operator calls; times are "
        "inclusive (an operator's includes the operators it calls), so they do not add up.\n\n",
        profile.wall_ms, profile.events);
  }
  md += "| ms | share | calls | name |\n| ---: | ---: | ---: | --- |\n";
  const double whole = profile.device_events ? profile.total_ms : profile.wall_ms;
  const int rows = std::min<int>(top, static_cast<int>(profile.rows.size()));
  for (int i = 0; i < rows; ++i) {
    const ProfileRow& row = profile.rows[i];
    std::string name = row.name.size() > 150 ? row.name.substr(0, 150) + "..." : row.name;
    name = absl::StrReplaceAll(name, {{"|", "\\|"}, {"\n", " "}});
    md += absl::StrFormat("| %.2f | %.1f%% | %d | `%s` |\n", row.ms,
                          whole > 0 ? 100 * row.ms / whole : 0, row.calls, name);
  }
  return md + "\n";
}

}  // namespace dta::bench

#include "bench/step_profile.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <unordered_map>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

namespace dta::bench {

namespace {

// "[[4096, 2048], [2048]]": an operator event's input shapes (scalars and lists as []).
std::string ShapesText(const torch::autograd::profiler::KinetoEvent& event) {
  if (!event.hasShapes()) return "";
  std::vector<std::string> shapes;
  for (const std::vector<int64_t>& shape : event.shapes()) {
    shapes.push_back("[" + absl::StrJoin(shape, ", ") + "]");
  }
  return "[" + absl::StrJoin(shapes, ", ") + "]";
}

void AddTo(std::vector<ProfileRow>& rows, std::unordered_map<std::string, size_t>& row_of,
           const std::string& name, double ms) {
  auto [it, added] = row_of.try_emplace(name, rows.size());
  if (added) rows.push_back({.name = name});
  rows[it->second].calls += 1;
  rows[it->second].ms += ms;
}

std::string RowsMarkdown(const std::vector<ProfileRow>& all, double whole, int top) {
  std::string md = "| ms | share | calls | name |\n| ---: | ---: | ---: | --- |\n";
  const int rows = std::min<int>(top, static_cast<int>(all.size()));
  for (int i = 0; i < rows; ++i) {
    const ProfileRow& row = all[i];
    std::string name = row.name.size() > 150 ? row.name.substr(0, 150) + "..." : row.name;
    name = absl::StrReplaceAll(name, {{"|", "\\|"}, {"\n", " "}});
    md += absl::StrFormat("| %.2f | %.1f%% | %d | `%s` |\n", row.ms,
                          whole > 0 ? 100 * row.ms / whole : 0, row.calls, name);
  }
  return md + "\n";
}

}  // namespace

StepProfile ProfileStep(const std::function<void()>& step, const at::Device& device) {
  namespace impl = torch::profiler::impl;
  namespace profiler = torch::autograd::profiler;
  const bool gpu = device.is_cuda();
  std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
  if (gpu) activities.insert(impl::ActivityType::CUDA);
  // Input shapes name the launching operator's call (which of many aten::add_ it was).
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO, /*report_input_shapes=*/gpu);
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
  // A device event's linked correlation id is that of the CPU operator that launched it (what
  // torch.profiler's key_averages uses to charge kernels to operators).
  std::unordered_map<uint64_t, std::string> launcher_of;
  if (gpu) {
    for (const profiler::KinetoEvent& event : result->events()) {
      if (event.deviceType() != c10::DeviceType::CPU || event.correlationId() == 0) continue;
      launcher_of[event.correlationId()] = event.name() + " " + ShapesText(event);
    }
  }
  std::unordered_map<std::string, size_t> row_of;
  std::unordered_map<std::string, size_t> launcher_row_of;
  for (const profiler::KinetoEvent& event : result->events()) {
    if (event.deviceType() != wanted) continue;
    const double ms = static_cast<double>(event.durationNs()) / 1e6;
    AddTo(profile.rows, row_of, event.name(), ms);
    if (gpu) {
      const auto launcher = launcher_of.find(event.linkedCorrelationId());
      AddTo(profile.launchers, launcher_row_of,
            launcher == launcher_of.end() ? "(no operator) " + event.name() : launcher->second, ms);
    }
    profile.total_ms += ms;
    profile.events += 1;
  }
  for (std::vector<ProfileRow>* rows : {&profile.rows, &profile.launchers}) {
    std::stable_sort(rows->begin(), rows->end(),
                     [](const ProfileRow& a, const ProfileRow& b) { return a.ms > b.ms; });
  }
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
  const double whole = profile.device_events ? profile.total_ms : profile.wall_ms;
  md += RowsMarkdown(profile.rows, whole, top);
  if (!profile.launchers.empty()) {
    md +=
        "The same GPU time by the operator that launched it (innermost operator, input "
        "shapes):\n\n" +
        RowsMarkdown(profile.launchers, whole, top);
  }
  return md;
}

}  // namespace dta::bench

// Prometheus's text exposition format (version 0.0.4), what a scrape of /metrics returns:
//
//   # HELP dta_dispatcher_pending_trajectories Trajectories accepted and not yet trained.
//   # TYPE dta_dispatcher_pending_trajectories gauge
//   dta_dispatcher_pending_trajectories 12
//   dta_dispatcher_rejected_total{field="tokens"} 3
//
// Samples of one metric are grouped under one HELP/TYPE header whatever order they are added in;
// names and label names are checked (a bad one is a programming error: std::invalid_argument),
// label values and help texts escaped, values written exactly (shortest round-trip form, NaN,
// +Inf, -Inf).
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dta {

enum class MetricType { kGauge, kCounter };

using MetricLabels = std::vector<std::pair<std::string, std::string>>;

class PrometheusText {
 public:
  // A counter's name ends in "_total" (Prometheus's convention; checked).
  void Add(MetricType type, std::string_view name, std::string_view help, double value,
           const MetricLabels& labels = {});
  void Gauge(std::string_view name, std::string_view help, double value,
             const MetricLabels& labels = {}) {
    Add(MetricType::kGauge, name, help, value, labels);
  }
  void Counter(std::string_view name, std::string_view help, double value,
               const MetricLabels& labels = {}) {
    Add(MetricType::kCounter, name, help, value, labels);
  }

  // The exposition, metrics in the order first added, each ending in a newline.
  std::string Render() const;

 private:
  struct Family {
    std::string name;
    std::string help;
    MetricType type;
    std::vector<std::string> samples;  // "name{labels} value"
  };
  std::vector<Family> families_;
};

// The content type a scrape's response carries.
inline constexpr std::string_view kPrometheusContentType =
    "text/plain; version=0.0.4; charset=utf-8";

}  // namespace dta

#include "core/metrics/prometheus_text.h"

#include <charconv>
#include <cmath>
#include <stdexcept>

#include "absl/strings/str_cat.h"

namespace dta {
namespace {

bool IsNameStart(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
}

bool IsValidName(std::string_view name, bool allow_colon) {
  if (name.empty() || !IsNameStart(name[0]) || (!allow_colon && name[0] == ':')) return false;
  for (const char c : name) {
    if (!(IsNameStart(c) || (c >= '0' && c <= '9')) || (!allow_colon && c == ':')) return false;
  }
  return true;
}

// Help text escapes backslash and newline; label values also the double quote.
std::string Escape(std::string_view text, bool quote) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (quote && c == '"') {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buffer[32];
  const auto [end, error] = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, end);
}

}  // namespace

void PrometheusText::Add(MetricType type, std::string_view name, std::string_view help,
                         double value, const MetricLabels& labels) {
  if (!IsValidName(name, /*allow_colon=*/true)) {
    throw std::invalid_argument("'" + std::string(name) + "' is not a Prometheus metric name");
  }
  if (type == MetricType::kCounter && !name.ends_with("_total")) {
    throw std::invalid_argument("counter '" + std::string(name) + "' must end in _total");
  }
  std::string sample(name);
  if (!labels.empty()) {
    sample += '{';
    for (size_t i = 0; i < labels.size(); ++i) {
      const auto& [label, label_value] = labels[i];
      if (!IsValidName(label, /*allow_colon=*/false) || label.starts_with("__")) {
        throw std::invalid_argument("'" + label + "' is not a Prometheus label name");
      }
      sample += (i > 0 ? "," : "") + label + "=\"" + Escape(label_value, true) + "\"";
    }
    sample += '}';
  }
  sample += ' ';
  sample += FormatValue(value);
  for (Family& family : families_) {
    if (family.name != name) continue;
    if (family.type != type) {
      throw std::invalid_argument("'" + std::string(name) + "' added as a gauge and a counter");
    }
    family.samples.push_back(std::move(sample));
    return;
  }
  families_.push_back({std::string(name), std::string(help), type, {std::move(sample)}});
}

std::string PrometheusText::Render() const {
  std::string out;
  for (const Family& family : families_) {
    absl::StrAppend(&out, "# HELP ", family.name, " ", Escape(family.help, false), "\n", "# TYPE ",
                    family.name, family.type == MetricType::kCounter ? " counter\n" : " gauge\n");
    for (const std::string& sample : family.samples) absl::StrAppend(&out, sample, "\n");
  }
  return out;
}

}  // namespace dta

#include "core/metrics/prometheus_text.h"

#include <gtest/gtest.h>

#include <limits>
#include <stdexcept>

namespace dta {
namespace {

TEST(PrometheusText, GroupsSamplesUnderOneHeaderPerMetric) {
  PrometheusText text;
  text.Counter("dta_rejected_total", "Trajectories rejected.", 3, {{"field", "tokens"}});
  text.Gauge("dta_pending", "Pending trajectories.", 12);
  text.Counter("dta_rejected_total", "Trajectories rejected.", 1, {{"field", "reward"}});
  EXPECT_EQ(text.Render(),
            "# HELP dta_rejected_total Trajectories rejected.\n"
            "# TYPE dta_rejected_total counter\n"
            "dta_rejected_total{field=\"tokens\"} 3\n"
            "dta_rejected_total{field=\"reward\"} 1\n"
            "# HELP dta_pending Pending trajectories.\n"
            "# TYPE dta_pending gauge\n"
            "dta_pending 12\n");
}

TEST(PrometheusText, WritesValuesExactly) {
  PrometheusText text;
  text.Gauge("a", "", 0.1);
  text.Gauge("b", "", 123456789012345.0);
  text.Gauge("c", "", std::numeric_limits<double>::quiet_NaN());
  text.Gauge("d", "", std::numeric_limits<double>::infinity());
  text.Gauge("e", "", -std::numeric_limits<double>::infinity());
  text.Gauge("f", "", -2.5e-7);
  const std::string rendered = text.Render();
  for (const char* line : {"\na 0.1\n", "\nb 123456789012345\n", "\nc NaN\n", "\nd +Inf\n",
                           "\ne -Inf\n", "\nf -2.5e-07\n"}) {
    EXPECT_NE(rendered.find(line), std::string::npos) << line << " in\n" << rendered;
  }
}

TEST(PrometheusText, EscapesHelpAndLabelValues) {
  PrometheusText text;
  text.Gauge("m", "line one\nback\\slash \"quoted\"", 1, {{"id", "a\"b\\c\nd"}, {"rank", "0"}});
  EXPECT_EQ(text.Render(),
            "# HELP m line one\\nback\\\\slash \"quoted\"\n"
            "# TYPE m gauge\n"
            "m{id=\"a\\\"b\\\\c\\nd\",rank=\"0\"} 1\n");
}

TEST(PrometheusText, RefusesBadNamesAndMixedTypes) {
  PrometheusText text;
  EXPECT_THROW(text.Gauge("", "", 1), std::invalid_argument);
  EXPECT_THROW(text.Gauge("9lives", "", 1), std::invalid_argument);
  EXPECT_THROW(text.Gauge("has-dash", "", 1), std::invalid_argument);
  EXPECT_THROW(text.Counter("steps", "", 1), std::invalid_argument);  // not *_total
  EXPECT_THROW(text.Gauge("m", "", 1, {{"__reserved", "x"}}), std::invalid_argument);
  EXPECT_THROW(text.Gauge("m", "", 1, {{"a:b", "x"}}), std::invalid_argument);
  text.Gauge("x_total", "", 1);
  EXPECT_THROW(text.Counter("x_total", "", 1), std::invalid_argument);
  EXPECT_NO_THROW(text.Gauge("ns:metric_1", "", 1));
}

}  // namespace
}  // namespace dta

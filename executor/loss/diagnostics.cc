#include "executor/loss/diagnostics.h"

#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace dta {

std::array<double, LossDiagnostics::kSums> LossDiagnostics::Sums() const {
  return {loss_tokens,   clipped_tokens,   dual_clipped_tokens, approx_kl,
          ratio,         entropy,          entropy_tokens,      rejected_tokens,
          behave_weight, behave_approx_kl, behave_tokens};
}

LossDiagnostics LossDiagnostics::FromSums(const std::array<double, kSums>& s, double ratio_max,
                                          double ratio_min) {
  LossDiagnostics d;
  d.loss_tokens = s[0];
  d.clipped_tokens = s[1];
  d.dual_clipped_tokens = s[2];
  d.approx_kl = s[3];
  d.ratio = s[4];
  d.entropy = s[5];
  d.entropy_tokens = s[6];
  d.rejected_tokens = s[7];
  d.behave_weight = s[8];
  d.behave_approx_kl = s[9];
  d.behave_tokens = s[10];
  d.ratio_max = ratio_max;
  d.ratio_min = ratio_min;
  return d;
}

std::vector<std::pair<std::string, double>> LossDiagnostics::Applicable() const {
  std::vector<std::pair<std::string, double>> named;
  if (ratio_max >= ratio_min) {
    named.insert(named.end(), {{"clip_fraction", clip_fraction()},
                               {"dual_clip_fraction", dual_clip_fraction()},
                               {"approx_kl", approx_kl_mean()},
                               {"ratio_mean", ratio_mean()},
                               {"ratio_max", ratio_max},
                               {"ratio_min", ratio_min}});
  }
  if (entropy_tokens > 0) named.emplace_back("entropy", entropy_mean());
  if (behave_tokens > 0 || rejected_tokens > 0) {
    named.insert(named.end(), {{"rejected_fraction", rejected_fraction()},
                               {"behave_imp_weight", behave_weight_mean()},
                               {"behave_approx_kl", behave_approx_kl_mean()}});
  }
  return named;
}

std::string LossDiagnostics::Summary() const {
  std::vector<std::string> parts;
  if (ratio_max >= ratio_min) {  // a ratio was taken on some token
    parts.push_back(absl::StrFormat("clip %.3g, approx kl %.3g, ratio %.3g-%.3g", clip_fraction(),
                                    approx_kl_mean(), ratio_min, ratio_max));
  }
  if (entropy_tokens > 0) parts.push_back(absl::StrFormat("entropy %.3g", entropy_mean()));
  if (behave_tokens > 0 || rejected_tokens > 0) {
    parts.push_back(absl::StrFormat("rejected %.3g, behave weight %.3g", rejected_fraction(),
                                    behave_weight_mean()));
  }
  return absl::StrJoin(parts, ", ");
}

void DiagnosticsAccumulator::Add(const at::Tensor& sums, const at::Tensor& ratio_max,
                                 const at::Tensor& ratio_min) {
  const at::Tensor s = sums.to(at::kDouble);
  sums_ = sums_.defined() ? sums_ + s : s;
  if (!ratio_max.defined()) return;
  const at::Tensor e = at::stack({ratio_max, -ratio_min}).to(at::kDouble);
  extremes_ = extremes_.defined() ? at::maximum(extremes_, e) : e;
}

void DiagnosticsAccumulator::Merge(const DiagnosticsAccumulator& other) {
  if (other.sums_.defined()) sums_ = sums_.defined() ? sums_ + other.sums_ : other.sums_;
  if (other.extremes_.defined()) {
    extremes_ = extremes_.defined() ? at::maximum(extremes_, other.extremes_) : other.extremes_;
  }
}

LossDiagnostics DiagnosticsAccumulator::Read() const {
  const double inf = std::numeric_limits<double>::infinity();
  std::array<double, LossDiagnostics::kSums> sums{};
  if (!sums_.defined()) return LossDiagnostics::FromSums(sums, -inf, inf);
  // One copy to the host for both.
  const at::Tensor host =
      (extremes_.defined() ? at::cat({sums_, extremes_}) : sums_).cpu().contiguous();
  const double* values = host.data_ptr<double>();
  for (int i = 0; i < LossDiagnostics::kSums; ++i) sums[i] = values[i];
  if (!extremes_.defined()) return LossDiagnostics::FromSums(sums, -inf, inf);
  return LossDiagnostics::FromSums(sums, values[LossDiagnostics::kSums],
                                   -values[LossDiagnostics::kSums + 1]);
}

}  // namespace dta

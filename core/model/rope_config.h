// RoPE's scaling as config.json states it (rope_scaling, or transformers 5's rope_parameters) and
// the numbers derived from it: one struct for the four rope types dta supports. The inverse
// frequencies themselves are computed in executor/model (rope.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace dta {

// transformers' rope_type: how RoPE's inverse frequencies are scaled.
enum class RopeType {
  kDefault,  // inv_freq = 1 / rope_theta^(2i / head_dim)
  kLinear,   // inv_freq / factor
  kLlama3,   // Llama 3.1: low frequencies / factor, high ones kept, a smooth band between
  kYarn,     // YaRN: a ramp between interpolated and extrapolated frequencies; cos and sin scaled
};

// "default", "linear", "llama3", "yarn".
std::string_view RopeTypeName(RopeType type);

// config.json's rope_scaling (older transformers) or rope_parameters (transformers 5), less
// rope_theta (ModelConfig::rope_theta). Each type reads only its own fields; the others keep these
// defaults, so that two configs of one model compare equal.
struct RopeScaling {
  RopeType type = RopeType::kDefault;
  double factor = 1.0;                           // linear, llama3, yarn
  int64_t original_max_position_embeddings = 0;  // llama3, yarn (the pretraining context)
  double low_freq_factor = 1.0;                  // llama3
  double high_freq_factor = 4.0;                 // llama3
  double beta_fast = 32.0;                       // yarn (transformers: 32 when absent or 0)
  double beta_slow = 1.0;                        // yarn (transformers: 1 when absent or 0)
  // yarn, as config.json gives them (absent: nullopt); RopeAttentionFactor combines them.
  std::optional<double> attention_factor = std::nullopt;
  std::optional<double> mscale = std::nullopt;
  std::optional<double> mscale_all_dim = std::nullopt;
  bool truncate = true;  // yarn: floor/ceil the correction range

  bool operator==(const RopeScaling&) const = default;
};

// What cos and sin are multiplied by: YaRN's attention factor (the explicit attention_factor, else
// (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1) when both are non-zero, else
// 0.1 ln(factor) + 1, each term 1 for factor <= 1), as transformers' _compute_yarn_parameters;
// 1 for every other type.
double RopeAttentionFactor(const RopeScaling& rope);

// config.json's rope_scaling value, on one line: "null" for the default rope, else an object with
// rope_type and the type's fields.
std::string RopeScalingToJson(const RopeScaling& rope);

// The type named `name` ("default", "linear", "llama3", "yarn"), or nullopt.
std::optional<RopeType> RopeTypeFromName(std::string_view name);

// Whether the type scales against the pretraining context (original_max_position_embeddings):
// llama3 and yarn.
bool RopeUsesOriginalContext(RopeType type);

// OK if the rope's numbers are in range: factor, attention_factor and the betas positive and
// finite, high_freq_factor > low_freq_factor > 0, original_max_position_embeddings positive for
// llama3 and yarn, the mscales finite. INVALID_ARGUMENT naming the field ("rope_scaling.factor")
// otherwise.
absl::Status ValidateRopeScaling(const RopeScaling& rope);

}  // namespace dta

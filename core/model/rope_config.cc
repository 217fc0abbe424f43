#include "core/model/rope_config.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/field_error.h"
#include "core/base/status_macros.h"
#include "nlohmann/json.hpp"

namespace dta {
namespace {

using Json = nlohmann::json;

constexpr std::pair<RopeType, const char*> kRopeTypes[] = {
    {RopeType::kDefault, "default"},
    {RopeType::kLinear, "linear"},
    {RopeType::kLlama3, "llama3"},
    {RopeType::kYarn, "yarn"},
};

// The rope object of config.json (rope_scaling; rope_parameters adds rope_theta), or null for the
// default rope.
Json RopeJson(const RopeScaling& rope) {
  if (rope.type == RopeType::kDefault) return nullptr;
  Json json = {{"rope_type", std::string(RopeTypeName(rope.type))}, {"factor", rope.factor}};
  if (RopeUsesOriginalContext(rope.type)) {
    json["original_max_position_embeddings"] = rope.original_max_position_embeddings;
  }
  if (rope.type == RopeType::kLlama3) {
    json["low_freq_factor"] = rope.low_freq_factor;
    json["high_freq_factor"] = rope.high_freq_factor;
  }
  if (rope.type == RopeType::kYarn) {
    // Only where they differ from transformers' defaults, which an absent field means.
    if (rope.beta_fast != 32.0) json["beta_fast"] = rope.beta_fast;
    if (rope.beta_slow != 1.0) json["beta_slow"] = rope.beta_slow;
    if (rope.attention_factor) json["attention_factor"] = *rope.attention_factor;
    if (rope.mscale) json["mscale"] = *rope.mscale;
    if (rope.mscale_all_dim) json["mscale_all_dim"] = *rope.mscale_all_dim;
    if (!rope.truncate) json["truncate"] = false;
  }
  return json;
}

}  // namespace

std::string_view RopeTypeName(RopeType type) {
  for (const auto& [value, name] : kRopeTypes) {
    if (value == type) return name;
  }
  return "unknown";
}

std::optional<RopeType> RopeTypeFromName(std::string_view name) {
  for (const auto& [value, type_name] : kRopeTypes) {
    if (name == type_name) return value;
  }
  return std::nullopt;
}

bool RopeUsesOriginalContext(RopeType type) {
  return type == RopeType::kLlama3 || type == RopeType::kYarn;
}

double RopeAttentionFactor(const RopeScaling& rope) {
  if (rope.type != RopeType::kYarn) return 1.0;
  if (rope.attention_factor) return *rope.attention_factor;
  // transformers' get_mscale, and its truthiness test of mscale and mscale_all_dim.
  auto mscale = [&](double m) {
    return rope.factor <= 1 ? 1.0 : 0.1 * m * std::log(rope.factor) + 1.0;
  };
  if (rope.mscale.value_or(0) != 0 && rope.mscale_all_dim.value_or(0) != 0) {
    return mscale(*rope.mscale) / mscale(*rope.mscale_all_dim);
  }
  return mscale(1.0);
}

std::string RopeScalingToJson(const RopeScaling& rope) { return RopeJson(rope).dump(); }

absl::Status ValidateRopeScaling(const RopeScaling& rope) {
  if (rope.type == RopeType::kDefault) return absl::OkStatus();
  RETURN_IF_ERROR(CheckPositiveFinite("rope_scaling.factor", rope.factor));
  if (RopeUsesOriginalContext(rope.type) && rope.original_max_position_embeddings <= 0) {
    return FieldError("rope_scaling.original_max_position_embeddings",
                      absl::StrCat(rope.original_max_position_embeddings, " is not positive"));
  }
  if (rope.type == RopeType::kLlama3) {
    RETURN_IF_ERROR(CheckPositiveFinite("rope_scaling.low_freq_factor", rope.low_freq_factor));
    if (!(rope.high_freq_factor > rope.low_freq_factor) || !std::isfinite(rope.high_freq_factor)) {
      return FieldError(
          "rope_scaling.high_freq_factor",
          absl::StrCat(rope.high_freq_factor, " must be finite and greater than low_freq_factor = ",
                       rope.low_freq_factor));
    }
  }
  if (rope.type == RopeType::kYarn) {
    RETURN_IF_ERROR(CheckPositiveFinite("rope_scaling.beta_fast", rope.beta_fast));
    RETURN_IF_ERROR(CheckPositiveFinite("rope_scaling.beta_slow", rope.beta_slow));
    if (rope.attention_factor) {
      RETURN_IF_ERROR(CheckPositiveFinite("rope_scaling.attention_factor", *rope.attention_factor));
    }
    for (const auto& [name, value] :
         {std::pair{"rope_scaling.mscale", rope.mscale},
          std::pair{"rope_scaling.mscale_all_dim", rope.mscale_all_dim}}) {
      if (value && !std::isfinite(*value)) {
        return FieldError(name, absl::StrCat(*value, " is not finite"));
      }
    }
    RETURN_IF_ERROR(CheckPositiveFinite("rope attention factor", RopeAttentionFactor(rope)));
  }
  return absl::OkStatus();
}

}  // namespace dta

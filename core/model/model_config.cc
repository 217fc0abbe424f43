#include "core/model/model_config.h"

#include <cmath>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "core/base/absl_string_view.h"
#include "core/base/field_error.h"
#include "core/base/status_macros.h"

namespace dta {
namespace {

// The mixture-of-experts fields: in range for the MoE families, at the struct's defaults
// elsewhere. qwen3_next may have no experts at all (every MLP dense, as transformers allows); the
// other sizes then only need to be non-negative.
absl::Status ValidateMoe(const ModelConfig& config, const ModelFamily& family) {
  const ModelConfig dense;
  if (!family.shared_expert &&
      config.shared_expert_intermediate_size != dense.shared_expert_intermediate_size) {
    return FieldError(
        "shared_expert_intermediate_size",
        absl::StrCat("is a shared-expert field; ", AsAbsl(family.name), " has no shared expert"));
  }
  if (!family.moe) {
    const std::pair<const char*, bool> fields[] = {
        {"num_experts", config.num_experts != dense.num_experts},
        {"num_experts_per_tok", config.num_experts_per_tok != dense.num_experts_per_tok},
        {"moe_intermediate_size", config.moe_intermediate_size != dense.moe_intermediate_size},
        {"norm_topk_prob", config.norm_topk_prob != dense.norm_topk_prob},
        {"decoder_sparse_step", config.decoder_sparse_step != dense.decoder_sparse_step},
        {"mlp_only_layers", config.mlp_only_layers != dense.mlp_only_layers},
        {"router_aux_loss_coef", config.router_aux_loss_coef != dense.router_aux_loss_coef},
        {"output_router_logits", config.output_router_logits != dense.output_router_logits},
    };
    for (const auto& [field, set] : fields) {
      if (set) {
        return FieldError(field, absl::StrCat("is a mixture-of-experts field; ",
                                              AsAbsl(family.name), " has no experts"));
      }
    }
    return absl::OkStatus();
  }
  if (family.every_layer_sparse) {
    const std::pair<const char*, bool> fixed[] = {
        {"intermediate_size", config.intermediate_size != 0},
        {"decoder_sparse_step", config.decoder_sparse_step != 1},
        {"mlp_only_layers", !config.mlp_only_layers.empty()},
        {"norm_topk_prob", !config.norm_topk_prob},
    };
    for (const auto& [field, set] : fixed) {
      if (set) {
        return FieldError(field, absl::StrCat(AsAbsl(family.name),
                                              " has a renormalised sparse block in every layer "
                                              "(intermediate_size 0, decoder_sparse_step 1, no "
                                              "mlp_only_layers, norm_topk_prob true)"));
      }
    }
  }
  // Without experts (allowed where there is a shared expert and may be dense layers: qwen3_next)
  // the expert sizes are unused.
  const bool experts = config.num_experts > 0 || !family.shared_expert || family.every_layer_sparse;
  const std::pair<const char*, int64_t> sizes[] = {
      {"num_experts", config.num_experts},
      {"num_experts_per_tok", config.num_experts_per_tok},
      {"moe_intermediate_size", config.moe_intermediate_size},
      {"shared_expert_intermediate_size",
       family.shared_expert ? config.shared_expert_intermediate_size : 1},
  };
  for (const auto& [field, value] : sizes) {
    if (value < 0 || (experts && value <= 0)) {
      return FieldError(field, absl::StrCat(value, " is not positive"));
    }
  }
  if (config.decoder_sparse_step <= 0) {
    return FieldError("decoder_sparse_step",
                      absl::StrCat(config.decoder_sparse_step, " is not positive"));
  }
  if (experts && config.num_experts_per_tok > config.num_experts) {
    return FieldError("num_experts_per_tok",
                      absl::StrCat(config.num_experts_per_tok,
                                   " is more than num_experts = ", config.num_experts));
  }
  for (size_t i = 0; i < config.mlp_only_layers.size(); ++i) {
    const int64_t layer = config.mlp_only_layers[i];
    if (layer < 0 || layer >= config.num_hidden_layers) {
      return FieldError("mlp_only_layers",
                        absl::StrCat("layer ", layer, " is not in [0, num_hidden_layers = ",
                                     config.num_hidden_layers, ")"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (config.mlp_only_layers[j] == layer) {
        return FieldError("mlp_only_layers", absl::StrCat("layer ", layer, " is listed twice"));
      }
    }
  }
  if (!(config.router_aux_loss_coef >= 0) || !std::isfinite(config.router_aux_loss_coef)) {
    return FieldError("router_aux_loss_coef",
                      absl::StrCat(config.router_aux_loss_coef, " is not finite and >= 0"));
  }
  return absl::OkStatus();
}

// Qwen3-Next's hybrid layers and partial rotary: in range for the families with the traits, at
// the struct's defaults elsewhere.
absl::Status ValidateHybrid(const ModelConfig& config, const ModelFamily& family) {
  const ModelConfig plain;
  const std::pair<const char*, int64_t> linear_sizes[] = {
      {"linear_num_key_heads", config.linear_num_key_heads},
      {"linear_num_value_heads", config.linear_num_value_heads},
      {"linear_key_head_dim", config.linear_key_head_dim},
      {"linear_value_head_dim", config.linear_value_head_dim},
      {"linear_conv_kernel_dim", config.linear_conv_kernel_dim},
  };
  if (!family.linear_attention) {
    if (!config.layer_types.empty()) {
      return FieldError("layer_types", absl::StrCat("must be empty: ", AsAbsl(family.name),
                                                    " has only full-attention layers"));
    }
    for (const auto& [field, value] : linear_sizes) {
      if (value != 0) {
        return FieldError(field, absl::StrCat("is a linear-attention field; ", AsAbsl(family.name),
                                              " has no linear attention"));
      }
    }
  } else {
    if (static_cast<int64_t>(config.layer_types.size()) != config.num_hidden_layers) {
      return FieldError("layer_types", absl::StrCat(config.layer_types.size(), " entries for ",
                                                    config.num_hidden_layers, " layers"));
    }
    bool any_linear = false;
    for (const LayerType type : config.layer_types) {
      any_linear = any_linear || type == LayerType::kLinearAttention;
    }
    for (const auto& [field, value] : linear_sizes) {
      if (value < 0 || (any_linear && value <= 0)) {
        return FieldError(field, absl::StrCat(value, " is not positive"));
      }
    }
    if (any_linear && config.linear_num_value_heads % config.linear_num_key_heads != 0) {
      return FieldError("linear_num_value_heads",
                        absl::StrCat(config.linear_num_value_heads,
                                     " is not a multiple of linear_num_key_heads = ",
                                     config.linear_num_key_heads));
    }
  }
  if (!family.partial_rotary) {
    if (config.partial_rotary_factor != plain.partial_rotary_factor) {
      return UnsupportedFieldError("partial_rotary_factor",
                                   absl::StrCat(config.partial_rotary_factor,
                                                " is not supported (only 1: RoPE on whole heads)"));
    }
    return absl::OkStatus();
  }
  if (!(config.partial_rotary_factor > 0 && config.partial_rotary_factor <= 1)) {
    return FieldError("partial_rotary_factor",
                      absl::StrCat(config.partial_rotary_factor, " is not in (0, 1]"));
  }
  const int64_t rotary = RotaryDim(config);
  if (rotary < 2 || rotary % 2 != 0) {
    return FieldError(
        "partial_rotary_factor",
        absl::StrCat(config.partial_rotary_factor, " of head_dim = ", config.head_dim, " rotates ",
                     rotary, " dimensions; RoPE needs an even number, at least 2"));
  }
  return absl::OkStatus();
}

}  // namespace

namespace {
// The family's boolean trait; false for a model_type without a family.
bool FamilyTrait(const ModelConfig& config, bool ModelFamily::*trait) {
  const ModelFamily* family = FindModelFamily(config.model_type);
  return family != nullptr && family->*trait;
}
}  // namespace

bool HasQkNorm(const ModelConfig& config) {
  const ModelFamily* family = FindModelFamily(config.model_type);
  return family == nullptr || family->qk_norm;
}

bool HasOProjBias(const ModelConfig& config) {
  const ModelFamily* family = FindModelFamily(config.model_type);
  return family != nullptr && family->attention_bias == AttentionBiasRule::kFromConfig &&
         config.attention_bias;
}

bool IsMoe(const ModelConfig& config) { return FamilyTrait(config, &ModelFamily::moe); }

bool IsSparseLayer(const ModelConfig& config, int64_t layer) {
  if (!IsMoe(config) || config.num_experts <= 0 || config.decoder_sparse_step <= 0) return false;
  for (const int64_t dense : config.mlp_only_layers) {
    if (dense == layer) return false;
  }
  return (layer + 1) % config.decoder_sparse_step == 0;
}

bool IsLinearAttentionLayer(const ModelConfig& config, int64_t layer) {
  return layer >= 0 && layer < static_cast<int64_t>(config.layer_types.size()) &&
         config.layer_types[layer] == LayerType::kLinearAttention;
}

int64_t RotaryDim(const ModelConfig& config) {
  // transformers: int(head_dim * partial_rotary_factor), a truncation.
  return static_cast<int64_t>(static_cast<double>(config.head_dim) * config.partial_rotary_factor);
}

bool HasZeroCentredNorms(const ModelConfig& config) {
  return FamilyTrait(config, &ModelFamily::zero_centred_norms);
}
bool HasGatedAttention(const ModelConfig& config) {
  return FamilyTrait(config, &ModelFamily::gated_attention);
}
bool HasSharedExpert(const ModelConfig& config) {
  return FamilyTrait(config, &ModelFamily::shared_expert);
}
bool HasSeparateLinearProjections(const ModelConfig& config) {
  return FamilyTrait(config, &ModelFamily::separate_linear_projections);
}

absl::Status ValidateModelConfig(const ModelConfig& config) {
  const ModelFamily* family = FindModelFamily(config.model_type);
  if (family == nullptr) {
    return UnsupportedFieldError(
        "model_type", absl::StrCat("'", config.model_type, "' is not supported (supported: ",
                                   absl::StrJoin(ModelFamilyTypes(), ", "), ")"));
  }
  const std::pair<const char*, int64_t> sizes[] = {
      {"vocab_size", config.vocab_size},
      {"hidden_size", config.hidden_size},
      // A family without dense MLPs has none (ValidateMoe requires 0).
      {"intermediate_size", family->every_layer_sparse ? 1 : config.intermediate_size},
      {"num_hidden_layers", config.num_hidden_layers},
      {"num_attention_heads", config.num_attention_heads},
      {"num_key_value_heads", config.num_key_value_heads},
      {"head_dim", config.head_dim},
      {"max_position_embeddings", config.max_position_embeddings},
  };
  for (const auto& [field, value] : sizes) {
    if (value <= 0) return FieldError(field, absl::StrCat(value, " is not positive"));
  }
  if (config.num_attention_heads % config.num_key_value_heads != 0) {
    return FieldError("num_key_value_heads", absl::StrCat(config.num_key_value_heads,
                                                          " does not divide num_attention_heads = ",
                                                          config.num_attention_heads));
  }
  if (family->hidden_divisible_by_heads && config.hidden_size % config.num_attention_heads != 0) {
    return FieldError("hidden_size", absl::StrCat(config.hidden_size,
                                                  " is not a multiple of num_attention_heads = ",
                                                  config.num_attention_heads, " (transformers' ",
                                                  AsAbsl(family->name), " refuses it)"));
  }
  RETURN_IF_ERROR(CheckPositiveFinite("rms_norm_eps", config.rms_norm_eps));
  RETURN_IF_ERROR(CheckPositiveFinite("rope_theta", config.rope_theta));
  RETURN_IF_ERROR(ValidateRopeScaling(config.rope_scaling));
  const std::string& dtype = config.torch_dtype;
  if (dtype != "bfloat16" && dtype != "float16" && dtype != "float32" && dtype != "float64") {
    return FieldError(
        "torch_dtype",
        absl::StrCat("'", dtype, "' is not one of bfloat16, float16, float32, float64"));
  }
  switch (family->attention_bias) {
    case AttentionBiasRule::kNone:
      if (config.attention_bias) {
        return UnsupportedFieldError("attention_bias",
                                     absl::StrCat("attention biases are not supported for ",
                                                  AsAbsl(family->name), " (its models have none)"));
      }
      break;
    case AttentionBiasRule::kQkvAlways:
      if (!config.attention_bias) {
        return FieldError("attention_bias", absl::StrCat("must be true: ", AsAbsl(family->name),
                                                         " always has q/k/v biases"));
      }
      break;
    case AttentionBiasRule::kFromConfig:
      break;
  }
  RETURN_IF_ERROR(ValidateMoe(config, *family));
  return ValidateHybrid(config, *family);
}

absl::StatusOr<ModelConfig> ModelPreset(std::string_view name) {
  const std::string lower = absl::AsciiStrToLower(AsAbsl(name));
  absl::string_view key = lower;
  if (!absl::ConsumePrefix(&key, "qwen/")) absl::ConsumePrefix(&key, "meta-llama/");
  for (const ModelFamily* family : ModelFamilies()) {
    for (const ModelPresetShape& preset : family->presets) {
      if (key != preset.name) continue;
      ModelConfig config;
      config.model_type = std::string(family->model_type);
      config.vocab_size = preset.vocab;
      config.hidden_size = preset.hidden;
      config.intermediate_size = preset.intermediate;
      config.num_hidden_layers = preset.layers;
      config.num_attention_heads = preset.heads;
      config.num_key_value_heads = preset.kv_heads;
      config.head_dim = preset.head_dim;
      config.rms_norm_eps = preset.rms_norm_eps;
      config.rope_theta = preset.rope_theta;
      config.rope_scaling = preset.rope;
      config.tie_word_embeddings = preset.tie;
      config.max_position_embeddings = preset.max_position_embeddings;
      config.torch_dtype = "bfloat16";
      config.attention_bias = family->attention_bias == AttentionBiasRule::kQkvAlways;
      if (preset.experts > 0) {
        config.num_experts = preset.experts;
        config.num_experts_per_tok = preset.experts_per_token;
        config.moe_intermediate_size = preset.moe_intermediate;
        config.norm_topk_prob = true;
        config.router_aux_loss_coef = 0.001;
        config.shared_expert_intermediate_size = preset.shared_expert;
      }
      if (preset.full_attention_interval > 0) {
        for (int64_t i = 0; i < preset.layers; ++i) {
          config.layer_types.push_back((i + 1) % preset.full_attention_interval != 0
                                           ? LayerType::kLinearAttention
                                           : LayerType::kFullAttention);
        }
        config.linear_num_key_heads = preset.linear_key_heads;
        config.linear_num_value_heads = preset.linear_value_heads;
        config.linear_key_head_dim = preset.linear_head_dim;
        config.linear_value_head_dim = preset.linear_head_dim;
        config.linear_conv_kernel_dim = preset.linear_conv_kernel;
      }
      config.partial_rotary_factor = preset.partial_rotary_factor;
      return config;
    }
  }
  return absl::NotFoundError(absl::StrCat("unknown preset '", AsAbsl(name), "' (known: ",
                                          absl::StrJoin(ModelPresetNames(), ", "), ")"));
}

std::vector<std::string> ModelPresetNames() {
  std::vector<std::string> names;
  for (const ModelFamily* family : ModelFamilies()) {
    for (const ModelPresetShape& preset : family->presets) names.emplace_back(preset.name);
  }
  return names;
}

}  // namespace dta

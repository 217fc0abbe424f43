#include "core/checkpoint/model_family.h"

namespace dta {
namespace {

// Sorted by model_type. Defaults from transformers 5's ModelConfig, Qwen2Config, LlamaConfig and
// Qwen3MoeConfig and Qwen3NextConfig.
constexpr ModelFamily kFamilies[] = {
    {.model_type = "llama",
     .architecture = "LlamaForCausalLM",
     .name = "Llama",
     .qk_norm = false,
     .attention_bias = AttentionBiasRule::kFromConfig,
     .default_vocab_size = 32000,
     .default_head_dim = 0,
     .default_max_position_embeddings = 2048,
     .sliding_window_fields = false,
     .mlp_bias_field = true,
     .hidden_divisible_by_heads = true,
     .moe = false},
    {.model_type = "qwen2",
     .architecture = "Qwen2ForCausalLM",
     .name = "Qwen2/Qwen2.5",
     .qk_norm = false,
     .attention_bias = AttentionBiasRule::kQkvAlways,
     .default_vocab_size = 151936,
     .default_head_dim = 0,
     .default_max_position_embeddings = 32768,
     .sliding_window_fields = true,
     .mlp_bias_field = false,
     .hidden_divisible_by_heads = false,
     .moe = false},
    {.model_type = "qwen3",
     .architecture = "Qwen3ForCausalLM",
     .name = "Qwen3",
     .qk_norm = true,
     .attention_bias = AttentionBiasRule::kNone,
     .default_vocab_size = 151936,
     .default_head_dim = 128,
     .default_max_position_embeddings = 32768,
     .sliding_window_fields = true,
     .mlp_bias_field = false,
     .hidden_divisible_by_heads = false,
     .moe = false},
    {.model_type = "qwen3_moe",
     .architecture = "Qwen3MoeForCausalLM",
     .name = "Qwen3-MoE",
     .qk_norm = true,
     .attention_bias = AttentionBiasRule::kNone,
     .default_vocab_size = 151936,
     .default_head_dim = 0,
     .default_max_position_embeddings = 32768,
     .sliding_window_fields = true,
     .mlp_bias_field = false,
     .hidden_divisible_by_heads = false,
     .moe = true},
    {.model_type = "qwen3_next",
     .architecture = "Qwen3NextForCausalLM",
     .name = "Qwen3-Next",
     .qk_norm = true,
     .attention_bias = AttentionBiasRule::kFromConfig,
     .default_vocab_size = 151936,
     .default_head_dim = 256,
     .default_max_position_embeddings = 32768,
     .sliding_window_fields = false,
     .mlp_bias_field = false,
     .hidden_divisible_by_heads = false,
     .moe = true,
     .zero_centred_norms = true,
     .gated_attention = true,
     .shared_expert = true,
     .linear_attention = true,
     .partial_rotary = true,
     .default_partial_rotary_factor = 0.25},
};

}  // namespace

const ModelFamily* FindModelFamily(std::string_view model_type) {
  for (const ModelFamily& family : kFamilies) {
    if (family.model_type == model_type) return &family;
  }
  return nullptr;
}

std::vector<std::string> ModelFamilyTypes() {
  std::vector<std::string> types;
  for (const ModelFamily& family : kFamilies) types.emplace_back(family.model_type);
  return types;
}

std::string DescribeModelFamilies() {
  std::string out;
  for (const ModelFamily& family : kFamilies) {
    if (!out.empty()) out += ", ";
    out += std::string(family.model_type) + " (" + std::string(family.name) + ")";
  }
  return out;
}

}  // namespace dta

// The model families dta builds, keyed by config.json's "model_type": what each family's decoder
// has beyond the shared dense architecture (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP,
// optional tied embeddings), which transformers defaults apply to absent config.json fields, which
// config.json fields it reads and writes, and its named presets. Each family is one file under
// core/model/families/ (its transformers class, traits and presets) and one line of the registry
// (family.cc); the config parser, the writer, the layer spec (layer_spec.h) and the decoder read
// the traits instead of comparing model_type strings. DescribeModelFamilies() lists them.
//
// A family built from existing blocks (a new combination of the traits below) needs nothing else:
// tests/core/model/test_family.h registers one at run time and runs it through the float64
// equivalence suites.
//
// Thread safety: every function may be called from any thread; RegisterModelFamily must not race
// with a config that names the family being registered.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "core/model/rope_config.h"

namespace dta {

// How a family's attention projections carry biases (ModelConfig::attention_bias then says
// whether q_proj, k_proj and v_proj have them).
enum class AttentionBiasRule {
  kNone,        // none: attention_bias true is refused (UNIMPLEMENTED)
  kQkvAlways,   // q/k/v always, o_proj never; config.json's attention_bias is not read
  kFromConfig,  // config.json's attention_bias (default false) for q/k/v and o_proj alike
};

// A named model shape (ModelPreset), as in the model's config.json on the Hugging Face Hub, or a
// benchmark shape built from a released model's layers. torch_dtype bfloat16.
struct ModelPresetShape {
  const char* name;  // lower case, e.g. "qwen3-8b"
  int64_t vocab, hidden, intermediate, layers, heads, kv_heads, head_dim;
  bool tie;
  double rope_theta, rms_norm_eps;
  int64_t max_position_embeddings;
  RopeScaling rope;
  // MoE families: experts, top-k, each expert's width (every layer sparse, top-k renormalised,
  // router_aux_loss_coef 0.001).
  int64_t experts = 0, experts_per_token = 0, moe_intermediate = 0;
  // Shared-expert families: its width. Linear-attention families: the Gated DeltaNet layers' sizes
  // (linear_* fields, one head dim for keys and values); every full_attention_interval-th layer
  // full attention, the others linear. Partial-rotary families: RoPE's share of each head.
  int64_t shared_expert = 0;
  int64_t linear_key_heads = 0, linear_value_heads = 0, linear_head_dim = 0, linear_conv_kernel = 0;
  int64_t full_attention_interval = 0;
  double partial_rotary_factor = 1.0;
};

// transformers' defaults of a MoE family's config for fields absent from config.json.
struct MoeDefaults {
  int64_t intermediate_size = 0;  // the dense layers' width (not required in config.json)
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;  // shared-expert families
  bool norm_topk_prob = false;
  double router_aux_loss_coef = 0.001;
};

// transformers' defaults of a linear-attention family's Gated DeltaNet sizes.
struct LinearAttentionDefaults {
  int64_t num_key_heads = 0, num_value_heads = 0, key_head_dim = 0, value_head_dim = 0,
          conv_kernel_dim = 0;
};

struct ModelFamily {
  std::string_view model_type;    // config.json's "model_type"
  std::string_view architecture;  // config.json's "architectures" entry
  std::string_view name;          // for messages, e.g. "Qwen2/Qwen2.5"
  bool qk_norm;                   // per-head RMSNorm of q and k (q_norm, k_norm) before RoPE
  AttentionBiasRule attention_bias;
  // transformers' defaults (its <Family>Config) for fields absent from config.json. head_dim 0:
  // hidden_size / num_attention_heads (integer division, as transformers).
  int64_t default_vocab_size;
  int64_t default_head_dim;
  int64_t default_max_position_embeddings;
  // Sliding-window fields (use_sliding_window, sliding_window, max_window_layers, layer_types):
  // read (a sliding layer is refused) and written. Families without them ignore them, as
  // transformers does.
  bool sliding_window_fields;
  // mlp_bias and pretraining_tp: read (mlp_bias true is refused) and written.
  bool mlp_bias_field;
  // transformers refuses a hidden_size that num_attention_heads does not divide (even with an
  // explicit head_dim).
  bool hidden_divisible_by_heads;
  // Sparse mixture-of-experts fields (num_experts, num_experts_per_tok, moe_intermediate_size,
  // norm_topk_prob, decoder_sparse_step, mlp_only_layers, router_aux_loss_coef,
  // output_router_logits): read and written. Families without them must leave them at the
  // struct's defaults.
  bool moe;
  // RMSNorms scale by (1 + weight), weights stored zero-centred (every norm of the decoder but the
  // linear layers' gated norm; Qwen3NextRMSNorm).
  bool zero_centred_norms = false;
  // q_proj yields each head's query and an output gate, interleaved per head [q_h, gate_h]; the
  // attention output is multiplied by sigmoid(gate) before o_proj (Qwen3NextAttention).
  bool gated_attention = false;
  // Sparse blocks add a shared SwiGLU expert of shared_expert_intermediate_size, scaled by
  // sigmoid(shared_expert_gate(x)) (Qwen3NextSparseMoeBlock).
  bool shared_expert = false;
  // layer_types may name "linear_attention" layers (Gated DeltaNet, the linear_* fields), read
  // and written with those fields; full_attention_interval when layer_types is absent.
  bool linear_attention = false;
  // partial_rotary_factor (top level, or in rope_parameters / rope_scaling) is read and written;
  // the other families refuse a value other than 1.
  bool partial_rotary = false;
  // transformers' default partial_rotary_factor for the family (0.25 for qwen3_next).
  double default_partial_rotary_factor = 1.0;
  // An absent num_key_value_heads: this, or num_attention_heads when 0.
  int64_t default_num_key_value_heads = 0;
  // config.json's num_local_experts is read as num_experts (transformers' attribute_map).
  bool num_local_experts_alias = false;
  // Gated DeltaNet's input projections are in_proj_qkv (rows [q | k | v], as conv1d's channels),
  // in_proj_z, in_proj_b and in_proj_a (Qwen3_5GatedDeltaNet), not Qwen3-Next's in_proj_qkvz and
  // in_proj_ba grouped per key head.
  bool separate_linear_projections = false;
  // Every layer's MLP is a sparse block whose top-k weights are renormalised
  // (Qwen3_5MoeSparseMoeBlock): config.json's intermediate_size, decoder_sparse_step,
  // mlp_only_layers and norm_topk_prob are neither read nor written (transformers' config has
  // none), and the config must keep intermediate_size 0, step 1, no dense layers and
  // norm_topk_prob true.
  bool every_layer_sparse = false;
  // The model_type of the vision-language model around the family's decoder ("qwen3_5" for
  // qwen3_5_text), or empty. Its config.json is read through its text_config, and the
  // "model.language_model." tensors of its checkpoints are the decoder's "model." ones, as
  // transformers' Qwen3_5ForCausalLM loads them (the vision tower is not loaded: see
  // ignored_checkpoint_prefixes).
  std::string_view multimodal_model_type = {};
  // Checkpoint tensors the family's transformers class skips on loading (its
  // _keys_to_ignore_on_load_unexpected), by name prefix: "mtp." (the multi-token prediction
  // head), and "model.visual." for the vision-language checkpoints.
  std::span<const std::string_view> ignored_checkpoint_prefixes = {};
  MoeDefaults moe_defaults = {};                   // MoE families
  LinearAttentionDefaults linear_defaults = {};    // linear-attention families
  std::span<const ModelPresetShape> presets = {};  // ModelPreset's names of the family
};

// The family of `model_type`, or nullptr when dta has none.
const ModelFamily* FindModelFamily(std::string_view model_type);

// The family whose multimodal_model_type is `model_type` (a vision-language wrapper's), or
// nullptr.
const ModelFamily* FindModelFamilyByMultimodalType(std::string_view model_type);

// Every registered family, in registry order (the order of ModelPresetNames).
std::vector<const ModelFamily*> ModelFamilies();

// Every supported model_type, sorted: "llama", "qwen2", "qwen3", "qwen3_5_moe_text",
// "qwen3_5_text", "qwen3_moe", "qwen3_next".
std::vector<std::string> ModelFamilyTypes();

// Every family for help texts, sorted by model_type: "llama (Llama), qwen2 (Qwen2/Qwen2.5), ...".
std::string DescribeModelFamilies();

// Adds a family at run time (tests, out-of-tree families built from existing blocks). `family`
// must outlive every use. ALREADY_EXISTS if its model_type or a preset name is taken.
absl::Status RegisterModelFamily(const ModelFamily* family);

}  // namespace dta

// The model families dta builds, keyed by config.json's "model_type": what each family's decoder
// has beyond the shared dense architecture (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP,
// optional tied embeddings), which transformers defaults apply to absent config.json fields, and
// which config.json fields each family writes. One table (model_family.cc) instead of model_type
// comparisons spread over the parser, the writer and the model.
//
//   qwen3  Qwen3ForCausalLM: per-head q/k RMSNorm before RoPE; no attention biases.
//   qwen2  Qwen2ForCausalLM (Qwen2, Qwen2.5): biases on q_proj, k_proj and v_proj (not o_proj),
//          always (its config.json has no attention_bias); no q/k norm.
//   llama  LlamaForCausalLM (Llama 3, 3.1, 3.2): attention_bias (default false) puts biases on
//          q_proj, k_proj, v_proj and o_proj, as transformers' LlamaAttention; mlp_bias must be
//          false; no q/k norm; head_dim defaults to hidden_size / num_attention_heads.
//   qwen3_moe  Qwen3MoeForCausalLM (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms,
//          no biases) with sparse mixture-of-experts MLPs (a router and num_experts SwiGLU experts,
//          top-k routing) in the layers ModelConfig's IsSparseLayer picks, dense SwiGLU MLPs of
//          intermediate_size in the others; head_dim defaults to hidden_size / heads.
//   qwen3_next  Qwen3NextForCausalLM (Qwen3-Next-80B-A3B): Gated DeltaNet linear-attention layers
//          interleaved with gated full attention (layer_types), zero-centred RMSNorms (1 + w),
//          partial RoPE, q/k norms, attention biases from config.json (q/k/v and o_proj), and
//          Qwen3-MoE's sparse blocks (where IsSparseLayer says, none when num_experts is 0) plus a
//          shared expert with a sigmoid gate.
//
// Thread safety: the table is immutable; every function may be called from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dta {

// How a family's attention projections carry biases (ModelConfig::attention_bias then says
// whether q_proj, k_proj and v_proj have them).
enum class AttentionBiasRule {
  kNone,        // none: attention_bias true is refused (UNIMPLEMENTED)
  kQkvAlways,   // q/k/v always, o_proj never; config.json's attention_bias is not read
  kFromConfig,  // config.json's attention_bias (default false) for q/k/v and o_proj alike
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
  // Qwen3-Next's hybrid architecture (qwen3_next), each a separate trait:
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
};

// The family of `model_type` ("qwen3", "qwen2", "llama", "qwen3_moe", "qwen3_next"), or nullptr
// when dta has none.
const ModelFamily* FindModelFamily(std::string_view model_type);

// Every supported model_type, sorted: "llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_next".
std::vector<std::string> ModelFamilyTypes();

// Every family for help texts, sorted by model_type: "llama (Llama), qwen2 (Qwen2/Qwen2.5), ...".
std::string DescribeModelFamilies();

}  // namespace dta

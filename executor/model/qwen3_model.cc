#include "executor/model/qwen3_model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>

namespace dta {
namespace {

// Norms, RoPE tables, softmax and log-softmax run in at least float32, as in Hugging Face.
at::ScalarType ComputeType(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

// log p(target) (and entropy) of each row of hidden @ weight^T, over the vocabulary. Neither pass
// keeps a [rows x vocab] tensor beyond one slice: backward recomputes each slice's logits.
class SlicedLogprobs : public torch::autograd::Function<SlicedLogprobs> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                                                const at::Tensor& weight, const at::Tensor& targets,
                                                int64_t slice_rows, bool want_entropy) {
    const at::ScalarType ct = ComputeType(hidden.scalar_type());
    const int64_t rows = hidden.size(0);
    at::Tensor logprobs = at::empty({rows}, hidden.options().dtype(ct));
    at::Tensor entropy = at::zeros({rows}, hidden.options().dtype(ct));
    for (int64_t begin = 0; begin < rows; begin += slice_rows) {
      const int64_t end = std::min(rows, begin + slice_rows);
      const at::Tensor logits = at::matmul(hidden.slice(0, begin, end), weight.t()).to(ct);
      const at::Tensor lse = at::logsumexp(logits, -1);
      logprobs.slice(0, begin, end).copy_(logits.gather(1, targets.slice(0, begin, end).unsqueeze(1)).squeeze(1) - lse);
      if (want_entropy) {
        const at::Tensor probs = at::exp(logits - lse.unsqueeze(1));
        entropy.slice(0, begin, end).copy_(lse - (probs * logits).sum(-1));
      }
    }
    ctx->save_for_backward({hidden, weight, targets});
    ctx->saved_data["slice_rows"] = slice_rows;
    ctx->saved_data["want_entropy"] = want_entropy;
    return {logprobs, entropy};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& hidden = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& targets = saved[2];
    const int64_t slice_rows = ctx->saved_data["slice_rows"].toInt();
    const bool want_entropy = ctx->saved_data["want_entropy"].toBool();
    const at::ScalarType ct = ComputeType(hidden.scalar_type());
    at::Tensor grad_hidden = at::zeros_like(hidden);
    at::Tensor grad_weight = at::zeros(weight.sizes(), weight.options().dtype(ct));
    const int64_t rows = hidden.size(0);
    for (int64_t begin = 0; begin < rows; begin += slice_rows) {
      const int64_t end = std::min(rows, begin + slice_rows);
      const at::Tensor h = hidden.slice(0, begin, end);
      const at::Tensor logits = at::matmul(h, weight.t()).to(ct);
      const at::Tensor probs = at::softmax(logits, -1);
      // d logp(y) / d z = onehot(y) - p;  d entropy / d z = -p (z - E_p[z]).
      const at::Tensor g_logprob = grads[0].slice(0, begin, end).to(ct);
      at::Tensor grad_logits = -probs * g_logprob.unsqueeze(1);
      grad_logits.scatter_add_(1, targets.slice(0, begin, end).unsqueeze(1), g_logprob.unsqueeze(1));
      if (want_entropy && grads[1].defined()) {
        const at::Tensor g_entropy = grads[1].slice(0, begin, end).to(ct);
        const at::Tensor mean_logit = (probs * logits).sum(-1, /*keepdim=*/true);
        grad_logits -= probs * (logits - mean_logit) * g_entropy.unsqueeze(1);
      }
      grad_hidden.slice(0, begin, end).copy_(at::matmul(grad_logits, weight.to(ct)).to(hidden.scalar_type()));
      grad_weight.add_(at::matmul(grad_logits.t(), h.to(ct)));
    }
    return {grad_hidden, grad_weight.to(weight.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

Qwen3Model::Qwen3Model(const Qwen3Config& config, at::TensorOptions options)
    : config_(config), options_(options) {
  TORCH_CHECK(config.num_attention_heads % config.num_key_value_heads == 0,
              "num_attention_heads must be a multiple of num_key_value_heads");
  TORCH_CHECK(config.head_dim % 2 == 0, "head_dim must be even for RoPE");
  const int64_t hidden = config.hidden_size;
  const int64_t q_dim = config.num_attention_heads * config.head_dim;
  const int64_t kv_dim = config.num_key_value_heads * config.head_dim;
  embed_ = Add("model.embed_tokens.weight", {config.vocab_size, hidden});
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer layer;
    layer.input_norm = Add(p + "input_layernorm.weight", {hidden});
    layer.q_proj = Add(p + "self_attn.q_proj.weight", {q_dim, hidden});
    layer.k_proj = Add(p + "self_attn.k_proj.weight", {kv_dim, hidden});
    layer.v_proj = Add(p + "self_attn.v_proj.weight", {kv_dim, hidden});
    layer.o_proj = Add(p + "self_attn.o_proj.weight", {hidden, q_dim});
    layer.q_norm = Add(p + "self_attn.q_norm.weight", {config.head_dim});
    layer.k_norm = Add(p + "self_attn.k_norm.weight", {config.head_dim});
    layer.post_norm = Add(p + "post_attention_layernorm.weight", {hidden});
    layer.gate_proj = Add(p + "mlp.gate_proj.weight", {config.intermediate_size, hidden});
    layer.up_proj = Add(p + "mlp.up_proj.weight", {config.intermediate_size, hidden});
    layer.down_proj = Add(p + "mlp.down_proj.weight", {hidden, config.intermediate_size});
    layers_.push_back(std::move(layer));
  }
  final_norm_ = Add("model.norm.weight", {hidden});
  lm_head_ = config.tie_word_embeddings ? embed_ : Add("lm_head.weight", {config.vocab_size, hidden});
}

at::Tensor Qwen3Model::Add(const std::string& name, at::IntArrayRef shape) {
  at::Tensor parameter = at::zeros(shape, options_).requires_grad_(true);
  named_.emplace_back(name, parameter);
  return parameter;
}

at::Tensor Qwen3Model::parameter(const std::string& name) const {
  for (const auto& [n, p] : named_) {
    if (n == name) return p;
  }
  TORCH_CHECK(false, "Qwen3 has no parameter named '", name, "'");
}

void Qwen3Model::InitRandom(uint64_t seed, double std) {
  // Drawn on the CPU in float64 and then converted, so a seed means the same weights on every
  // device and dtype.
  at::Generator generator = at::detail::createCPUGenerator(seed);
  const at::TensorOptions cpu = at::TensorOptions().dtype(at::kDouble);
  torch::autograd::AutoGradMode no_grad(false);
  for (auto& [name, parameter] : named_) {
    const bool is_norm = parameter.dim() == 1;
    at::Tensor values = at::normal(0.0, is_norm ? std / 4 : std, parameter.sizes(), generator, cpu);
    if (is_norm) values += 1.0;
    parameter.copy_(values);
  }
}

at::Tensor Qwen3Model::RmsNorm(const at::Tensor& x, const at::Tensor& weight) const {
  const at::Tensor xc = x.to(ComputeType(x.scalar_type()));
  const at::Tensor normed = xc * at::rsqrt(xc.pow(2).mean(-1, /*keepdim=*/true) + config_.rms_norm_eps);
  return weight * normed.to(x.scalar_type());
}

std::pair<at::Tensor, at::Tensor> Qwen3Model::Rope(const at::Tensor& positions) const {
  const at::ScalarType ct = ComputeType(options_.dtype().toScalarType());
  const at::TensorOptions o = positions.options().dtype(ct);
  const at::Tensor exponents = at::arange(0, config_.head_dim, 2, o) / static_cast<double>(config_.head_dim);
  const at::Tensor inv_freq = 1.0 / at::pow(config_.rope_theta, exponents);
  const at::Tensor freqs = positions.to(ct).unsqueeze(1) * inv_freq.unsqueeze(0);
  const at::Tensor angles = at::cat({freqs, freqs}, -1);
  const at::ScalarType dtype = options_.dtype().toScalarType();
  return {angles.cos().to(dtype), angles.sin().to(dtype)};
}

at::Tensor Qwen3Model::Attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& key_end, int64_t prefix) const {
  const int64_t t = q.size(0);
  // Query i sees the whole prefix and chunk key j iff j <= i < key_end[j]: O(T) integers become a
  // [T, P + T] boolean mask for PyTorch's fused attention (the CUDA path uses kernels/ instead).
  const at::Tensor i = at::arange(t, key_end.options()).unsqueeze(1);
  const at::Tensor j = at::arange(t, key_end.options()).unsqueeze(0);
  const at::Tensor visible = (j <= i) & (i < key_end.unsqueeze(0));
  const at::Tensor mask = prefix > 0 ? at::cat({at::ones({t, prefix}, visible.options()), visible}, 1) : visible;
  const double scale = 1.0 / std::sqrt(static_cast<double>(config_.head_dim));
  const at::Tensor out = at::scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                                          v.transpose(0, 1).unsqueeze(0), mask, 0.0,
                                                          /*is_causal=*/false, scale, /*enable_gqa=*/true);
  return out.squeeze(0).transpose(0, 1).reshape({t, -1});  // [T, heads * head_dim]
}

ChunkContext Qwen3Model::MakeContext(const ChunkInput& input) const {
  const int64_t t = input.tokens.size(0);
  TORCH_CHECK(input.tokens.dim() == 1 && input.positions.sizes() == input.tokens.sizes(),
              "tokens and positions must be [T] tensors of the same length");
  const size_t num_layers = layers_.size();
  const bool has_prefix = !input.prefix_keys.empty();
  TORCH_CHECK(!has_prefix || (input.prefix_keys.size() == num_layers && input.prefix_values.size() == num_layers),
              "prefix K/V must have one entry per layer");
  ChunkContext context;
  context.key_end =
      input.key_end.defined() ? input.key_end : at::full({t}, t, input.tokens.options().dtype(at::kLong));
  const auto [cos, sin] = Rope(input.positions);
  context.cos = cos.unsqueeze(1);
  context.sin = sin.unsqueeze(1);
  return context;
}

at::Tensor Qwen3Model::Embed(const at::Tensor& tokens) const { return embed_.index_select(0, tokens); }

LayerOutput Qwen3Model::ForwardLayer(int64_t l, const at::Tensor& h, const ChunkContext& context,
                                     const at::Tensor& prefix_keys, const at::Tensor& prefix_values) const {
  const int64_t t = h.size(0);
  const Layer& layer = layers_[l];
  const int64_t heads = config_.num_attention_heads;
  const int64_t kv_heads = config_.num_key_value_heads;
  const int64_t dim = config_.head_dim;
  const at::Tensor x = RmsNorm(h, layer.input_norm);
  at::Tensor q = RmsNorm(at::matmul(x, layer.q_proj.t()).view({t, heads, dim}), layer.q_norm);
  at::Tensor k = RmsNorm(at::matmul(x, layer.k_proj.t()).view({t, kv_heads, dim}), layer.k_norm);
  const at::Tensor v = at::matmul(x, layer.v_proj.t()).view({t, kv_heads, dim});
  q = q * context.cos + RotateHalf(q) * context.sin;
  k = k * context.cos + RotateHalf(k) * context.sin;
  const bool has_prefix = prefix_keys.defined();
  const at::Tensor keys = has_prefix ? at::cat({prefix_keys, k}, 0) : k;
  const at::Tensor values = has_prefix ? at::cat({prefix_values, v}, 0) : v;
  LayerOutput out;
  out.hidden = h + at::matmul(Attention(q, keys, values, context.key_end, has_prefix ? prefix_keys.size(0) : 0),
                              layer.o_proj.t());
  const at::Tensor y = RmsNorm(out.hidden, layer.post_norm);
  out.hidden = out.hidden + at::matmul(at::silu(at::matmul(y, layer.gate_proj.t())) * at::matmul(y, layer.up_proj.t()),
                                       layer.down_proj.t());
  out.keys = k;
  out.values = v;
  return out;
}

at::Tensor Qwen3Model::FinalNorm(const at::Tensor& h) const { return RmsNorm(h, final_norm_); }

ChunkOutput Qwen3Model::Forward(const ChunkInput& input) const {
  const ChunkContext context = MakeContext(input);
  const bool has_prefix = !input.prefix_keys.empty();
  ChunkOutput out;
  at::Tensor h = Embed(input.tokens);
  for (int64_t l = 0; l < static_cast<int64_t>(layers_.size()); ++l) {
    LayerOutput layer = ForwardLayer(l, h, context, has_prefix ? input.prefix_keys[l] : at::Tensor(),
                                     has_prefix ? input.prefix_values[l] : at::Tensor());
    h = std::move(layer.hidden);
    out.keys.push_back(std::move(layer.keys));
    out.values.push_back(std::move(layer.values));
  }
  out.hidden = FinalNorm(h);
  return out;
}

at::Tensor Qwen3Model::Logprobs(const at::Tensor& hidden, const at::Tensor& targets, at::Tensor* entropy,
                                int64_t slice_rows) const {
  TORCH_CHECK(hidden.dim() == 2 && targets.dim() == 1 && hidden.size(0) == targets.size(0),
              "Logprobs takes hidden [N, hidden_size] and targets [N]");
  TORCH_CHECK(slice_rows > 0, "slice_rows must be positive");
  auto outputs = SlicedLogprobs::apply(hidden, lm_head_, targets, slice_rows, entropy != nullptr);
  if (entropy) *entropy = outputs[1];
  return outputs[0];
}

}  // namespace dta

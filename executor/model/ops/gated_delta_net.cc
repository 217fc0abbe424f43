#include "executor/model/ops/gated_delta_net.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <vector>

#include "executor/model/ops/gather_rows.h"
#include "kernels/chunk_state_recurrence.h"
#include "kernels/gated_delta_chunk.h"
#include "kernels/head_norms.h"
#include "kernels/tree_causal_conv.h"

namespace dta {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::ScalarType ComputeType(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void CheckRuleShapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes(),
              "gated delta rule: q and k must be [T, Hk, Dk]", ", got ", q.sizes(), " and ",
              k.sizes());
  const int64_t t = q.size(0), h = v.dim() == 3 ? v.size(1) : -1;
  TORCH_CHECK(v.dim() == 3 && v.size(0) == t && q.size(1) >= 1 && h % q.size(1) == 0,
              "gated delta rule: v must be [T, H, Dv] with H a multiple of q's ", q.size(1),
              " key heads, got ", v.sizes());
  TORCH_CHECK(g.sizes() == at::IntArrayRef({t, h}) && beta.sizes() == g.sizes(),
              "gated delta rule: g and beta must be [T, H], got ", g.sizes(), " and ",
              beta.sizes());
  TORCH_CHECK(!state.defined() || state.sizes() == at::IntArrayRef({h, q.size(2), v.size(2)}),
              "gated delta rule: the state must be [H, Dk, Dv], got ", state.sizes());
}

at::Tensor InitialState(const at::Tensor& state, const at::Tensor& v, int64_t key_dim,
                        at::ScalarType type) {
  if (state.defined()) return state.to(type);
  return at::zeros({v.size(1), key_dim, v.size(2)}, v.options().dtype(type));
}

// The value heads each key head serves; CHECKs that they are a whole number.
int64_t ValueHeadsPerKeyHead(const GatedDeltaNetShape& shape) {
  TORCH_CHECK(shape.key_heads > 0 && shape.value_heads % shape.key_heads == 0,
              "linear attention: value heads (", shape.value_heads,
              ") must be a multiple of key heads (", shape.key_heads, ")");
  return shape.value_heads / shape.key_heads;
}

// q and k's L2 norm per head, x / sqrt(sum x^2 + eps) along the last dimension
// (flash-linear-attention's l2norm, as transformers), x [T, Hk, Dk] in any floating dtype, y in
// the compute type (kernels/head_norms.h: one kernel each way on the GPU). Keeps x (a view of the
// convolution's output) and the rstd; x's gradient comes back in x's dtype.
class L2NormFunction : public torch::autograd::Function<L2NormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, double eps) {
    kernels::HeadNormResult n = kernels::L2NormForward(x, eps);
    ctx->save_for_backward({x, n.rstd});
    return n.y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    return {kernels::L2NormBackward(grads[0], saved[0], saved[1]), at::Tensor()};
  }
};

at::Tensor L2Normalize(const at::Tensor& x, double eps = 1e-6) {
  if (!at::GradMode::is_enabled() || !x.requires_grad()) return kernels::L2NormForward(x, eps).y;
  return L2NormFunction::apply(x, eps);
}

// The gated RMSNorm per value head, y = (norm(x) * weight * silu(z)).to(out_type)
// (kernels/head_norms.h). Keeps x, z and the rstd.
class GatedRmsNormFunction : public torch::autograd::Function<GatedRmsNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& z, double eps, at::ScalarType out_type) {
    kernels::HeadNormResult n = kernels::GatedRmsNormForward(x, weight, z, eps, out_type);
    ctx->save_for_backward({x, weight, z, n.rstd});
    return n.y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    at::Tensor weight_grad = at::zeros_like(saved[1]);
    kernels::GatedRmsNormGrads found = kernels::GatedRmsNormBackward(
        grads[0], saved[0], saved[1], saved[2], saved[3], weight_grad);
    variable_list out(5);
    if (ctx->needs_input_grad(0)) out[0] = std::move(found.dx);
    if (ctx->needs_input_grad(1)) out[1] = std::move(weight_grad);
    if (ctx->needs_input_grad(2)) out[2] = std::move(found.dz);
    return out;
  }
};

at::Tensor GatedRmsNorm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& z,
                        double eps, at::ScalarType out_type) {
  bool needs_grad = false;
  for (const at::Tensor* t : {&x, &weight, &z}) needs_grad |= t->requires_grad();
  if (!at::GradMode::is_enabled() || !needs_grad)
    return kernels::GatedRmsNormForward(x, weight, z, eps, out_type).y;
  return GatedRmsNormFunction::apply(x, weight, z, eps, out_type);
}

}  // namespace

at::Tensor GradientInto(const at::Tensor& constant, const at::Tensor& accumulator) {
  if (!constant.defined() || !accumulator.defined() || !at::GradMode::is_enabled()) return constant;
  TORCH_CHECK(constant.sizes() == accumulator.sizes(), "gradient accumulator of shape ",
              accumulator.sizes(), " for a constant of shape ", constant.sizes());
  at::Tensor leaf = constant.detach().variable_data();
  leaf.requires_grad_(true);
  // The hook runs when backward reaches the leaf; the accumulator outlives the graph (the
  // executor's stack), so capturing it by value (a shared handle) is safe.
  leaf.register_hook([accumulator](const at::Tensor& grad) { accumulator.add_(grad); });
  return leaf;
}

std::vector<TokenRun> ChainRuns(TokenParents parents, int64_t tokens) {
  std::vector<TokenRun> runs;
  if (tokens == 0) return runs;
  if (parents.empty()) return {TokenRun{.begin = 0, .end = tokens, .parent_run = -1}};
  TORCH_CHECK(static_cast<int64_t>(parents.size()) == tokens, "token parents: ", parents.size(),
              " parents for ", tokens, " tokens");
  // A token with a child other than the next token ends its run (the child starts from its state).
  std::vector<bool> branches(tokens, false);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t p = parents[t];
    TORCH_CHECK(p >= -1 && p < t, "token parents: token ", t, " has parent ", p,
                " (must be -1 or an earlier token)");
    if (p >= 0 && p != t - 1) branches[p] = true;
  }
  std::vector<int64_t> run_of(tokens, -1);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t p = parents[t];
    const bool continues = t > 0 && p == t - 1 && !branches[t - 1];
    if (!continues) {
      runs.push_back({.begin = t, .end = t, .parent_run = p >= 0 ? run_of[p] : -1});
    }
    runs.back().end = t + 1;
    run_of[t] = static_cast<int64_t>(runs.size()) - 1;
  }
  // A branch point is its run's last token, so a child's parent run ends exactly at the parent.
  for (const TokenRun& run : runs) {
    if (run.parent_run >= 0) {
      TORCH_CHECK(runs[run.parent_run].end - 1 == parents[run.begin], "token parents: internal");
    }
  }
  return runs;
}

at::Tensor ConvAncestorIndex(TokenParents parents, int64_t tokens, int64_t context_rows,
                             int64_t kernel, at::Device device) {
  TORCH_CHECK(kernel >= 1, "convolution kernel must be >= 1, got ", kernel);
  TORCH_CHECK(parents.empty() || static_cast<int64_t>(parents.size()) == tokens,
              "token parents: ", parents.size(), " parents for ", tokens, " tokens");
  std::vector<int64_t> index(tokens * kernel, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    // Walk up from t: chunk tokens, then the context's rows from its last one, then zeros.
    int64_t node = t;          // a chunk token while >= 0
    int64_t context_row = -1;  // past the chunk root: the context row read next (< 0: zeros)
    for (int64_t i = kernel - 1; i >= 0; --i) {
      if (node >= 0) {
        index[t * kernel + i] = 1 + context_rows + node;
        const int64_t parent = parents.empty() ? node - 1 : parents[node];
        TORCH_CHECK(parent >= -1 && parent < node, "token parents: token ", node, " has parent ",
                    parent, " (must be -1 or an earlier token)");
        if (parent < 0) context_row = context_rows - 1;
        node = parent;
      } else {
        index[t * kernel + i] = context_row >= 0 ? 1 + context_row : 0;
        if (context_row >= 0) --context_row;
      }
    }
  }
  return at::tensor(index, at::TensorOptions().dtype(at::kLong)).view({tokens, kernel}).to(device);
}

namespace {

// The convolution as plain differentiable operations (checked by TreeCausalConv).
at::Tensor ConvolveRows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& context,
                        const at::Tensor& index) {
  const int64_t t = x.size(0), channels = x.size(1), kernel = weight.size(1);
  const at::ScalarType type = ComputeType(x);
  std::vector<at::Tensor> rows = {at::zeros({1, channels}, x.options().dtype(type))};
  if (context.defined() && context.size(0) > 0) rows.push_back(context.to(type));
  rows.push_back(x.to(type));
  const at::Tensor table = at::cat(rows);
  // Each row is read by up to `kernel` taps (more at a branch point): GatherRows sums their
  // gradients in a fixed order.
  const at::Tensor taps = GatherRows(table, index.reshape({-1})).view({t, kernel, channels});
  const at::Tensor summed = (taps * weight.to(type).t().unsqueeze(0)).sum(1);
  return at::silu(summed).to(x.scalar_type());
}

// The convolution's value: one CUDA kernel where it runs (kernels/tree_causal_conv.h), else the
// plain operations. context: [P, C], P >= 0.
at::Tensor Convolve(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& context,
                    const at::Tensor& index) {
  if (kernels::TreeCausalConvKernelRuns(x, weight, context, index))
    return kernels::TreeCausalConvForward(x, weight, context, index);
  return ConvolveRows(x, weight, context, index);
}

// Keeps only the convolution's inputs for backward, not its graph: the gathered taps and the
// pre-activation are (kernel + 1) float32 values per channel and token, 160 KB a token at
// Qwen3-Next-80B's linear layers, where x is 16 KB in bf16. Backward recomputes them with the
// same operations and runs their backward, so the gradients are those of the plain operations bit
// for bit, for one more gather and product per token.
class RecomputedConvFunction : public torch::autograd::Function<RecomputedConvFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& context, const at::Tensor& index) {
    ctx->save_for_backward({x, weight, context, index});
    return Convolve(x, weight, context, index);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    if (kernels::TreeCausalConvKernelRuns(saved[0], saved[1], saved[2], saved[3])) {
      kernels::TreeCausalConvGrads found = kernels::TreeCausalConvBackward(
          grads[0].to(saved[0].scalar_type()).contiguous(), saved[0], saved[1], saved[2], saved[3]);
      variable_list out(4);
      if (ctx->needs_input_grad(0)) out[0] = std::move(found.x);
      if (ctx->needs_input_grad(1)) out[1] = std::move(found.weight);
      if (ctx->needs_input_grad(2)) out[2] = std::move(found.context);
      return out;
    }
    variable_list inputs = {saved[0].detach(), saved[1].detach(), saved[2].detach()};
    variable_list wanted;  // the inputs whose gradient autograd asks for
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!ctx->needs_input_grad(i)) continue;
      inputs[i].requires_grad_(true);
      wanted.push_back(inputs[i]);
    }
    variable_list out(4);
    if (wanted.empty()) return out;
    at::Tensor recomputed;
    {
      torch::autograd::AutoGradMode enable_grad(true);
      recomputed = ConvolveRows(inputs[0], inputs[1], inputs[2], saved[3]);
    }
    const variable_list found = torch::autograd::grad({recomputed}, wanted, {grads[0]});
    for (size_t i = 0, w = 0; i < inputs.size(); ++i) {
      if (inputs[i].requires_grad()) out[i] = found[w++];
    }
    return out;
  }
};

}  // namespace

at::Tensor TreeCausalConv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& context,
                          const at::Tensor& index) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(0) == x.size(1),
              "causal convolution: x must be [T, C] and weight [C, kernel], got ", x.sizes(),
              " and ", weight.sizes());
  const int64_t t = x.size(0), channels = x.size(1), kernel = weight.size(1);
  TORCH_CHECK(index.sizes() == at::IntArrayRef({t, kernel}),
              "causal convolution: index must be [T, kernel], got ", index.sizes());
  const bool has_context = context.defined() && context.size(0) > 0;
  TORCH_CHECK(!has_context || (context.dim() == 2 && context.size(1) == channels),
              "causal convolution: context must be [P, C], got ",
              context.defined() ? context.sizes() : at::IntArrayRef());
  bool needs_grad = false;
  for (const at::Tensor* input : {&x, &weight, &context})
    needs_grad |= input->defined() && input->requires_grad();
  // An empty context rather than an undefined one: autograd functions take defined tensors.
  const at::Tensor rows_above = has_context ? context : at::empty({0, channels}, x.options());
  if (!at::GradMode::is_enabled() || !needs_grad) return Convolve(x, weight, rows_above, index);
  return RecomputedConvFunction::apply(x, weight, rows_above, index);
}

GatedDeltaOutput ChunkedGatedDeltaRule(const at::Tensor& q_in, const at::Tensor& k_in,
                                       const at::Tensor& v_in, const at::Tensor& g_in,
                                       const at::Tensor& beta_in, const at::Tensor& initial_state,
                                       int64_t chunk_size) {
  CheckRuleShapes(q_in, k_in, v_in, g_in, beta_in, initial_state);
  TORCH_CHECK(chunk_size >= 1, "chunk_size must be >= 1, got ", chunk_size);
  const at::ScalarType type = ComputeType(q_in);
  const int64_t length = q_in.size(0), key_dim = q_in.size(2);
  at::Tensor state = InitialState(initial_state, v_in, key_dim, type);
  if (length == 0) return {at::zeros_like(v_in, v_in.options().dtype(type)), state};

  // Everything independent across chunks, for all chunks at once (kernels/gated_delta_chunk.h: one
  // CUDA kernel forward where it runs, else batched ATen ops); the last chunk padded with zero
  // tokens (a zero key and beta leave the state unchanged; a zero log decay multiplies it by 1).
  const kernels::ChunkTerms terms = kernels::GatedDeltaChunkTerms(
      q_in.to(type), k_in.to(type), v_in.to(type), g_in.to(type), beta_in.to(type), chunk_size);

  // Across chunks, the state recurrence: h_i, the state at chunk i's start, and
  // v_new_i = new_values_i - k_cumdecay_i h_i (one CUDA kernel each way on the GPU;
  // kernels/chunk_state_recurrence.h); each chunk's output q_decayed_i h_i + intra_i v_new_i, for
  // all chunks in two batched matmuls. One autograd function, which keeps neither h nor v_new for
  // backward: it runs the recurrence again.
  const kernels::ChunkOutput scan =
      kernels::ChunkStateOutput(terms.k_cumdecay, terms.new_values, terms.k_decayed,
                                terms.chunk_decay, state, terms.q_decayed, terms.intra);
  const int64_t heads = v_in.size(1), chunks = terms.intra.size(1);
  const at::Tensor out = scan.out.view({heads, chunks * chunk_size, v_in.size(2)})
                             .narrow(1, 0, length)
                             .transpose(0, 1);
  return {out, scan.final_state};
}

GatedDeltaOutput RecurrentGatedDeltaRule(const at::Tensor& q_in, const at::Tensor& k_in,
                                         const at::Tensor& v_in, const at::Tensor& g_in,
                                         const at::Tensor& beta_in,
                                         const at::Tensor& initial_state) {
  CheckRuleShapes(q_in, k_in, v_in, g_in, beta_in, initial_state);
  const at::ScalarType type = ComputeType(q_in);
  const int64_t length = q_in.size(0), key_dim = q_in.size(2);
  at::Tensor state = InitialState(initial_state, v_in, key_dim, type);
  // Each key head serves H / Hk consecutive value heads.
  const int64_t group = v_in.size(1) / q_in.size(1);
  const at::Tensor q =
      q_in.to(type).repeat_interleave(group, 1) * (1.0 / std::sqrt(static_cast<double>(key_dim)));
  const at::Tensor k = k_in.to(type).repeat_interleave(group, 1), v = v_in.to(type),
                   g = g_in.to(type), beta = beta_in.to(type);
  std::vector<at::Tensor> outs;
  for (int64_t t = 0; t < length; ++t) {
    const at::Tensor k_t = k[t];  // [H, Dk]
    state = state * g[t].exp().view({-1, 1, 1});
    const at::Tensor remembered = (state * k_t.unsqueeze(-1)).sum(1);      // [H, Dv]
    const at::Tensor delta = (v[t] - remembered) * beta[t].unsqueeze(-1);  // [H, Dv]
    state = state + k_t.unsqueeze(-1) * delta.unsqueeze(1);
    outs.push_back((state * q[t].unsqueeze(-1)).sum(1));
  }
  const at::Tensor out = length == 0 ? at::zeros_like(v) : at::stack(outs);
  return {out, state};
}

std::vector<TokenRun> CutChain(int64_t tokens, absl::Span<const int64_t> points) {
  std::vector<TokenRun> runs;
  int64_t begin = 0;
  for (const int64_t p : points) {
    TORCH_CHECK(p > begin && p < tokens, "CutChain: cut points must be increasing inside (0, ",
                tokens, "), got ", p, " after ", begin);
    runs.push_back({.begin = begin, .end = p, .parent_run = static_cast<int64_t>(runs.size()) - 1});
    begin = p;
  }
  if (tokens > 0)
    runs.push_back(
        {.begin = begin, .end = tokens, .parent_run = static_cast<int64_t>(runs.size()) - 1});
  return runs;
}

namespace {

// Each run's depth in the tree of runs (0: starts from the initial state); parents come first.
std::vector<std::vector<size_t>> RunsByDepth(const std::vector<TokenRun>& runs) {
  std::vector<size_t> depth(runs.size(), 0);
  std::vector<std::vector<size_t>> levels;
  for (size_t i = 0; i < runs.size(); ++i) {
    const int64_t parent = runs[i].parent_run;
    TORCH_CHECK(parent < static_cast<int64_t>(i), "token runs: run ", i, " has parent run ", parent,
                " (must be -1 or an earlier run)");
    depth[i] = parent < 0 ? 0 : depth[parent] + 1;
    if (depth[i] == levels.size()) levels.emplace_back();
    levels[depth[i]].push_back(i);
  }
  return levels;
}

}  // namespace

GatedDeltaOutput TreeGatedDeltaRule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& g, const at::Tensor& beta,
                                    const std::vector<TokenRun>& runs,
                                    const at::Tensor& initial_state, int64_t chunk_size) {
  if (runs.size() == 1 && runs[0].begin == 0 && runs[0].end == q.size(0)) {
    GatedDeltaOutput whole = ChunkedGatedDeltaRule(q, k, v, g, beta, initial_state, chunk_size);
    whole.run_states = {whole.final_state};
    return whole;
  }
  const at::ScalarType type = ComputeType(q);
  if (runs.empty()) {
    return {at::zeros_like(v, v.options().dtype(type)),
            InitialState(initial_state, v, q.size(2), type)};
  }
  CheckRuleShapes(q, k, v, g, beta, initial_state);
  TORCH_CHECK(chunk_size >= 1, "chunk_size must be >= 1, got ", chunk_size);
  // Each run's inputs as one split of each tensor when the runs tile the tokens in order (as
  // ChainRuns and CutChain make them): split's backward concatenates the runs' gradients once,
  // where a narrow per run would materialise a zero [T, H, D] gradient per run and add them up.
  std::vector<int64_t> run_sizes;
  bool tiles = true;
  for (size_t i = 0; i < runs.size(); ++i) {
    run_sizes.push_back(runs[i].end - runs[i].begin);
    tiles &= runs[i].begin == (i == 0 ? 0 : runs[i - 1].end);
  }
  tiles &= runs.back().end == q.size(0);
  // In the inputs' own dtypes: each level's padded concatenation is cast to the compute type once
  // (v arrives in the model's dtype), not copied twice.
  auto parts_of = [&](const at::Tensor& x) {
    if (tiles) return x.split_with_sizes(run_sizes);
    std::vector<at::Tensor> parts;
    for (const TokenRun& run : runs) parts.push_back(x.narrow(0, run.begin, run.end - run.begin));
    return parts;
  };
  const std::vector<std::vector<at::Tensor>> inputs = {parts_of(q), parts_of(k), parts_of(v),
                                                       parts_of(g), parts_of(beta)};
  const at::Tensor start = InitialState(initial_state, v, q.size(2), type);
  // The zero tokens runs are padded with: one tensor per input, narrowed (a pad is < chunk_size).
  std::vector<at::Tensor> zeros;
  for (const std::vector<at::Tensor>& parts : inputs) {
    std::vector<int64_t> shape = parts.front().sizes().vec();
    shape[0] = chunk_size - 1;
    zeros.push_back(at::zeros(shape, parts.front().options()));
  }

  // The runs of one depth are independent: one chunked rule over all of them, each run padded to
  // whole chunks with zero tokens (a zero key and beta leave the state unchanged) and scanned from
  // its parent's final state as a segment of the state recurrence (kernels/chunk_state_
  // recurrence.h), so a level's runs share each launch. The depths run in order.
  const int64_t heads = v.size(1), value_dim = v.size(2);
  std::vector<at::Tensor> outs(runs.size()), finals(runs.size());
  for (const std::vector<size_t>& level : RunsByDepth(runs)) {
    std::vector<std::vector<at::Tensor>> padded(inputs.size());
    std::vector<int64_t> offsets = {0}, out_sizes;
    std::vector<at::Tensor> starts;
    for (const size_t r : level) {
      const int64_t n = run_sizes[r];
      const int64_t chunks = (n + chunk_size - 1) / chunk_size, pad = chunks * chunk_size - n;
      for (size_t i = 0; i < inputs.size(); ++i) {
        padded[i].push_back(inputs[i][r]);
        if (pad > 0) padded[i].push_back(zeros[i].narrow(0, 0, pad));
      }
      offsets.push_back(offsets.back() + chunks);
      out_sizes.insert(out_sizes.end(), {n, pad});
      starts.push_back(runs[r].parent_run >= 0 ? finals[runs[r].parent_run] : start);
    }
    std::vector<at::Tensor> joined;
    for (const std::vector<at::Tensor>& pieces : padded) joined.push_back(at::cat(pieces).to(type));
    const kernels::ChunkTerms terms = kernels::GatedDeltaChunkTerms(
        joined[0], joined[1], joined[2], joined[3], joined[4], chunk_size);
    const kernels::ChunkOutput scan = kernels::ChunkStateOutput(
        terms.k_cumdecay, terms.new_values, terms.k_decayed, terms.chunk_decay, at::stack(starts),
        terms.q_decayed, terms.intra, {.segment_chunks = offsets});
    const std::vector<at::Tensor> run_outs =
        scan.out.view({heads, offsets.back() * chunk_size, value_dim})
            .split_with_sizes(out_sizes, 1);
    const std::vector<at::Tensor> run_finals = scan.final_state.unbind(0);
    for (size_t j = 0; j < level.size(); ++j) {
      outs[level[j]] = run_outs[2 * j].transpose(0, 1);
      finals[level[j]] = run_finals[j];
    }
  }
  at::Tensor last = finals.back();
  return {.out = at::cat(outs), .final_state = std::move(last), .run_states = std::move(finals)};
}

LinearProjections UngroupedProjections(const GatedDeltaNetShape& shape, const at::Tensor& qkvz,
                                       const at::Tensor& ba) {
  const int64_t t = qkvz.size(0);
  const int64_t kh = shape.key_heads, vh = shape.value_heads, dk = shape.key_head_dim,
                dv = shape.value_head_dim;
  const int64_t group = ValueHeadsPerKeyHead(shape);
  TORCH_CHECK(qkvz.dim() == 2 && qkvz.size(1) == 2 * shape.key_dim() + 2 * shape.value_dim(),
              "linear attention: qkvz must be [T, ", 2 * shape.key_dim() + 2 * shape.value_dim(),
              "], got ", qkvz.sizes());
  TORCH_CHECK(ba.dim() == 2 && ba.size(0) == t && ba.size(1) == 2 * vh,
              "linear attention: ba must be [", t, ", ", 2 * vh, "], got ", ba.sizes());
  // Per key head: [q, k, v (group heads), z (group heads)] and [b (group), a (group)].
  const std::vector<at::Tensor> parts = qkvz.view({t, kh, 2 * dk + 2 * group * dv})
                                            .split_with_sizes({dk, dk, group * dv, group * dv}, -1);
  const std::vector<at::Tensor> gates =
      ba.view({t, kh, 2 * group}).split_with_sizes({group, group}, -1);
  return {.qkv = at::cat({parts[0].reshape({t, kh * dk}), parts[1].reshape({t, kh * dk}),
                          parts[2].reshape({t, vh * dv})},
                         -1),
          .z = parts[3].reshape({t, vh * dv}),
          .b = gates[0].reshape({t, vh}),
          .a = gates[1].reshape({t, vh})};
}

LinearMixerOutput GatedDeltaNetMix(const GatedDeltaNetWeights& w, const GatedDeltaNetShape& shape,
                                   const at::Tensor& qkvz, const at::Tensor& ba,
                                   const at::Tensor& conv_index, const std::vector<TokenRun>& runs,
                                   const LinearContext& context) {
  return GatedDeltaNetMix(w, shape, UngroupedProjections(shape, qkvz, ba), conv_index, runs,
                          context);
}

LinearMixerOutput GatedDeltaNetMix(const GatedDeltaNetWeights& w, const GatedDeltaNetShape& shape,
                                   const LinearProjections& projected, const at::Tensor& conv_index,
                                   const std::vector<TokenRun>& runs,
                                   const LinearContext& context) {
  const at::Tensor& mixed = projected.qkv;
  const int64_t t = mixed.size(0);
  const int64_t kh = shape.key_heads, vh = shape.value_heads, dk = shape.key_head_dim,
                dv = shape.value_head_dim;
  ValueHeadsPerKeyHead(shape);  // CHECKs that the value heads group by key head
  TORCH_CHECK(mixed.dim() == 2 && mixed.size(1) == shape.conv_dim(),
              "linear attention: qkv must be [T, ", shape.conv_dim(), "], got ", mixed.sizes());
  TORCH_CHECK(projected.z.sizes() == at::IntArrayRef({t, vh * dv}) &&
                  projected.b.sizes() == at::IntArrayRef({t, vh}) &&
                  projected.a.sizes() == projected.b.sizes(),
              "linear attention: z, b and a must be [", t, ", ", vh * dv, "], [", t, ", ", vh,
              "] and [", t, ", ", vh, "], got ", projected.z.sizes(), ", ", projected.b.sizes(),
              " and ", projected.a.sizes());
  const at::ScalarType type = ComputeType(mixed);
  const at::Tensor z = projected.z.reshape({t, vh, dv});

  // The convolution's inputs, q k v: cached per token for later chunks.
  const at::Tensor conv_context = GradientInto(context.conv_inputs, context.grad_conv_inputs);
  const at::Tensor convolved = TreeCausalConv(
      mixed, w.conv1d.view({shape.conv_dim(), shape.conv_kernel}), conv_context, conv_index);
  const std::vector<at::Tensor> qkv =
      convolved.split_with_sizes({shape.key_dim(), shape.key_dim(), shape.value_dim()}, -1);
  // Per key head: each serves H / Hk consecutive value heads inside the rule (no [T, H, Dk]
  // copies of q and k).
  const at::Tensor q = L2Normalize(qkv[0].reshape({t, kh, dk}));
  const at::Tensor k = L2Normalize(qkv[1].reshape({t, kh, dk}));
  const at::Tensor v = qkv[2].reshape({t, vh, dv});
  const at::Tensor beta = at::sigmoid(projected.b.to(type));
  const at::Tensor g =
      -w.a_log.to(type).exp() * at::softplus(projected.a.to(type) + w.dt_bias.to(type));

  const at::Tensor state = GradientInto(context.state, context.grad_state);
  GatedDeltaOutput rule = TreeGatedDeltaRule(q, k, v, g, beta, runs, state);

  // The gated RMSNorm per value head: norm(o) * weight * silu(z), rounded once to the projections'
  // dtype. o made contiguous here, once (a single run's output is a transposed view), so that the
  // norm keeps the copy its kernels read instead of copying again in backward.
  const at::Tensor gated =
      GatedRmsNorm(rule.out.contiguous(), w.norm.to(type), z, shape.eps, mixed.scalar_type());
  return {.out = gated.reshape({t, vh * dv}),
          .conv_inputs = mixed,
          .final_state = rule.final_state,
          .run_states = std::move(rule.run_states)};
}

LinearMixerOutput GatedDeltaNetForward(const GatedDeltaNetWeights& w,
                                       const GatedDeltaNetShape& shape, const at::Tensor& x,
                                       const at::Tensor& conv_index,
                                       const std::vector<TokenRun>& runs,
                                       const LinearContext& context) {
  const LinearProjections projected =
      w.in_proj_qkvz.defined()
          ? UngroupedProjections(shape, at::linear(x, w.in_proj_qkvz), at::linear(x, w.in_proj_ba))
          : LinearProjections{.qkv = at::linear(x, w.in_proj_qkv),
                              .z = at::linear(x, w.in_proj_z),
                              .b = at::linear(x, w.in_proj_b),
                              .a = at::linear(x, w.in_proj_a)};
  LinearMixerOutput out = GatedDeltaNetMix(w, shape, projected, conv_index, runs, context);
  out.out = at::linear(out.out, w.out_proj);
  return out;
}

}  // namespace dta

#include "executor/model/decoder.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "core/base/parallel_for.h"
#include "executor/model/ops/embedding.h"
#include "executor/model/ops/logprobs.h"
#include "executor/model/ops/norms.h"
#include "executor/model/ops/numerics.h"
#include "executor/model/ops/rope.h"

namespace dta {
namespace {

LayerPrefix PrefixOfLayer(const PrefixKv& prefix, int64_t l) {
  if (prefix.empty()) return {};
  LayerPrefix layer{
      .keys = prefix.keys[l], .values = prefix.values[l], .grad_keys = {}, .grad_values = {}};
  if (!prefix.grad_keys.empty()) {
    layer.grad_keys = prefix.grad_keys[l];
    layer.grad_values = prefix.grad_values[l];
  }
  if (!prefix.states.empty()) layer.state = prefix.states[l];
  if (!prefix.grad_states.empty()) layer.grad_state = prefix.grad_states[l];
  return layer;
}

}  // namespace

Decoder::Decoder(const ModelConfig& config, at::TensorOptions options,
                 std::shared_ptr<const TensorParallelGroup> tensor_parallel,
                 std::shared_ptr<const ExpertParallelGroup> expert_parallel)
    : config_(config),
      options_(options),
      tensor_parallel_(std::move(tensor_parallel)),
      expert_parallel_(std::move(expert_parallel)) {
  const absl::Status valid = ValidateModelConfig(config);
  TORCH_CHECK(valid.ok(), "Decoder: ", std::string(valid.message()));
  TORCH_CHECK(config.head_dim % 2 == 0, "head_dim must be even for RoPE");
  const ModelSpec spec = BuildModelSpec(config);
  const int tp = tensor_parallel_size();
  const int rank = tensor_parallel_ ? tensor_parallel_->rank() : 0;
  TORCH_CHECK(tp == 1 || spec.tensor_parallel(), "tensor parallelism is not supported for ",
              config.model_type, " models yet; run it with a tensor-parallel size of 1");
  // Whole heads per rank, and each rank's query heads share its own KV heads (grouped-query
  // attention maps query head h to KV head h / (heads / kv_heads)).
  TORCH_CHECK(config.num_key_value_heads % tp == 0, "tensor parallelism over ", tp,
              " ranks needs a multiple of ", tp, " KV heads; the model has ",
              config.num_key_value_heads, " (use a tensor-parallel size that divides it)");
  bool any_linear = false;
  for (const LayerSpec& layer_spec : spec.layers) any_linear |= layer_spec.linear_attention();
  // Whole key heads per rank, each with its group of value heads.
  TORCH_CHECK(!any_linear || config.linear_num_key_heads % tp == 0, "tensor parallelism over ", tp,
              " ranks needs a multiple of ", tp, " linear-attention key heads; the model has ",
              config.linear_num_key_heads, " key heads (serving ", config.linear_num_value_heads,
              " value heads; use a tensor-parallel size that divides the key heads)");
  heads_ = SplitRange(config.num_attention_heads, rank, tp);
  kv_heads_ = SplitRange(config.num_key_value_heads, rank, tp);
  intermediate_ = SplitRange(config.intermediate_size, rank, tp);
  moe_intermediate_ = SplitRange(config.moe_intermediate_size, rank, tp);
  if (expert_parallel_size() > 1) {
    TORCH_CHECK(config.num_experts >= expert_parallel_size(), "expert parallelism over ",
                expert_parallel_size(), " ranks needs at least as many experts; the model has ",
                config.num_experts);
    experts_ = ExpertRange(config.num_experts, expert_parallel_->rank(), expert_parallel_size());
  }
  vocab_ = SplitRange(config.vocab_size, rank, tp);

  // Every parameter as the layer spec lists it, this rank's part of each.
  embed_ = Add(spec.embedding);
  if (any_linear) {
    linear_layers_.assign(config.num_hidden_layers, false);
    linear_shape_ = {.key_heads = config.linear_num_key_heads / tp,
                     .value_heads = config.linear_num_value_heads / tp,
                     .key_head_dim = config.linear_key_head_dim,
                     .value_head_dim = config.linear_value_head_dim,
                     .conv_kernel = config.linear_conv_kernel_dim,
                     .eps = config.rms_norm_eps};
  }
  int64_t sparse_layers = 0;
  for (const LayerSpec& layer_spec : spec.layers) {
    Layer layer;
    if (IsSparseLayer(config, layer_spec.index)) layer.sparse_index = sparse_layers++;
    const std::vector<ParameterSpec>& parameters = layer_spec.parameters;
    for (size_t i = 0; i < parameters.size(); ++i) {
      if (parameters[i].role == ParameterRole::kGateProj) {
        // gate_proj and up_proj as one tensor (AddStacked).
        TORCH_CHECK(i + 1 < parameters.size() && parameters[i + 1].role == ParameterRole::kUpProj,
                    "Decoder: ", parameters[i].name, " must be followed by its up_proj");
        const std::vector<at::Tensor> gate_up = AddStacked(parameters[i], parameters[i + 1]);
        layer.mlp.gate_proj = gate_up[0];
        layer.mlp.up_proj = gate_up[1];
        ++i;
        continue;
      }
      *Slot(layer, parameters[i].role) = Add(parameters[i]);
    }
    if (layer_spec.linear_attention()) linear_layers_[layer_spec.index] = true;
    layers_.push_back(std::move(layer));
  }
  final_norm_ = Add(spec.final_norm);
  lm_head_ = spec.tied_embeddings ? embed_ : Add(spec.lm_head);
  if (tp > 1) {
    // The norm weights each rank sees through its own heads only, per layer: q_norm and k_norm
    // [2, head_dim], or the gated norm [value_head_dim]; none (0 elements) otherwise.
    auto partial_shape = [&](const LayerSpec& layer) -> std::vector<int64_t> {
      if (layer.linear_attention()) return {config.linear_value_head_dim};
      if (layer.qk_norm) return {2, config.head_dim};
      return {0};
    };
    std::vector<std::vector<int64_t>> shapes;
    int64_t total = 0;
    for (const LayerSpec& layer_spec : spec.layers) {
      shapes.push_back(partial_shape(layer_spec));
      total += c10::multiply_integers(shapes.back());
    }
    if (total > 0) {
      const at::ScalarType type = AccumulatorType(options.dtype().toScalarType());
      partial_norm_grads_ = at::zeros({total}, options.dtype(type));
      int64_t offset = 0;
      for (const std::vector<int64_t>& shape : shapes) {
        const int64_t n = c10::multiply_integers(shape);
        layer_partial_norm_grads_.push_back(
            n > 0 ? partial_norm_grads_.narrow(0, offset, n).view(shape) : at::Tensor());
        offset += n;
      }
    }
  }
  inv_freq_ = RopeInverseFrequencies(
      config, options.dtype(ComputeType(options.dtype().toScalarType())).requires_grad(false));
}

at::Tensor* Decoder::Slot(Layer& layer, ParameterRole role) {
  switch (role) {
    case ParameterRole::kInputNorm:
      return &layer.input_norm;
    case ParameterRole::kPostNorm:
      return &layer.post_norm;
    case ParameterRole::kQProj:
      return &layer.attention.q_proj;
    case ParameterRole::kQBias:
      return &layer.attention.q_bias;
    case ParameterRole::kKProj:
      return &layer.attention.k_proj;
    case ParameterRole::kKBias:
      return &layer.attention.k_bias;
    case ParameterRole::kVProj:
      return &layer.attention.v_proj;
    case ParameterRole::kVBias:
      return &layer.attention.v_bias;
    case ParameterRole::kOProj:
      return &layer.attention.o_proj;
    case ParameterRole::kOBias:
      return &layer.attention.o_bias;
    case ParameterRole::kQNorm:
      return &layer.attention.q_norm;
    case ParameterRole::kKNorm:
      return &layer.attention.k_norm;
    case ParameterRole::kLinearInProjQkvz:
      return &layer.linear.in_proj_qkvz;
    case ParameterRole::kLinearInProjBa:
      return &layer.linear.in_proj_ba;
    case ParameterRole::kLinearInProjQkv:
      return &layer.linear.in_proj_qkv;
    case ParameterRole::kLinearInProjZ:
      return &layer.linear.in_proj_z;
    case ParameterRole::kLinearInProjB:
      return &layer.linear.in_proj_b;
    case ParameterRole::kLinearInProjA:
      return &layer.linear.in_proj_a;
    case ParameterRole::kLinearConv1d:
      return &layer.linear.conv1d;
    case ParameterRole::kLinearDtBias:
      return &layer.linear.dt_bias;
    case ParameterRole::kLinearALog:
      return &layer.linear.a_log;
    case ParameterRole::kLinearNorm:
      return &layer.linear.norm;
    case ParameterRole::kLinearOutProj:
      return &layer.linear.out_proj;
    case ParameterRole::kGateProj:
      return &layer.mlp.gate_proj;
    case ParameterRole::kUpProj:
      return &layer.mlp.up_proj;
    case ParameterRole::kDownProj:
      return &layer.mlp.down_proj;
    case ParameterRole::kRouter:
      return &layer.mlp.router;
    case ParameterRole::kExpertsGate:
      return &layer.mlp.experts_gate;
    case ParameterRole::kExpertsUp:
      return &layer.mlp.experts_up;
    case ParameterRole::kExpertsDown:
      return &layer.mlp.experts_down;
    case ParameterRole::kSharedGate:
      return &layer.mlp.shared_gate;
    case ParameterRole::kSharedUp:
      return &layer.mlp.shared_up;
    case ParameterRole::kSharedDown:
      return &layer.mlp.shared_down;
    case ParameterRole::kSharedExpertGate:
      return &layer.mlp.shared_expert_gate;
    case ParameterRole::kEmbedding:
    case ParameterRole::kFinalNorm:
    case ParameterRole::kLmHead:
      break;
  }
  TORCH_CHECK(false, "Decoder: a layer has no parameter of role ", static_cast<int>(role));
}

std::vector<IndexRange> ParameterSplit::RangesOf(int rank, int ranks) const {
  if (replicated()) return {};
  // Whole units per rank (heads, rows, vocabulary entries) of every segment, each segment / units
  // wide.
  const IndexRange mine = SplitRange(units, rank, ranks);
  std::vector<IndexRange> result;
  int64_t start = 0;
  for (const int64_t size : segments) {
    const int64_t width = size / units;
    result.push_back({start + mine.begin * width, start + mine.end * width});
    start += size;
  }
  return result;
}

at::Tensor ParameterSplit::Narrow(const at::Tensor& full) const {
  if (replicated()) return full;
  if (ranges.size() == 1) return full.narrow(dim, ranges[0].begin, ranges[0].size());
  std::vector<at::Tensor> parts;
  for (const IndexRange& range : ranges)
    parts.push_back(full.narrow(dim, range.begin, range.size()));
  return at::cat(parts, dim);
}

ParameterSplit Decoder::SplitOf(const ParameterSpec& spec) const {
  ParameterSplit split{.dim = spec.split.dim,
                       .full_shape = spec.shape,
                       .units = spec.split.units,
                       .segments = spec.SplitSegments()};
  if (!split.replicated()) {
    int64_t total = 0;
    for (const int64_t size : split.segments) {
      TORCH_CHECK(size % split.units == 0, "Decoder: ", spec.name, "'s segment of ", size,
                  " is not ", split.units, " equal units");
      total += size;
    }
    TORCH_CHECK(total == spec.shape[split.dim], "Decoder: ", spec.name, "'s segments sum to ",
                total, ", not its dimension ", split.dim, " of ", spec.shape[split.dim]);
    split.ranges =
        split.RangesOf(tensor_parallel_ ? tensor_parallel_->rank() : 0, tensor_parallel_size());
  }
  if (spec.per_expert()) split.experts = experts_;
  return split;
}

at::Tensor Decoder::Add(const ParameterSpec& spec) {
  ParameterSplit split = SplitOf(spec);
  std::vector<int64_t> shape = spec.shape;
  if (!split.replicated()) {
    shape[split.dim] = 0;
    for (const IndexRange& range : split.ranges) shape[split.dim] += range.size();
  }
  if (split.expert_parallel()) shape[0] = split.experts.size();
  at::Tensor parameter = at::zeros(shape, options_).requires_grad_(true);
  named_.emplace_back(spec.name, parameter);
  splits_.push_back(std::move(split));
  return parameter;
}

std::vector<at::Tensor> Decoder::AddStacked(const ParameterSpec& first,
                                            const ParameterSpec& second) {
  TORCH_CHECK(first.shape.size() == 2 && first.shape == second.shape && first.split.dim == 0 &&
                  first.split == second.split && first.split.segments.empty(),
              "Decoder: ", first.name, " and ", second.name,
              " must be [rows, cols] matrices split alike by rows to be stacked");
  const IndexRange range = SplitOf(first).ranges.at(0);
  at::Tensor stack = at::zeros({2 * range.size(), first.shape[1]}, options_);
  std::vector<at::Tensor> parts;
  for (const ParameterSpec* spec : {&first, &second}) {
    // A view of the stack that is a leaf of its own (the stack itself needs no gradient).
    at::Tensor parameter =
        stack.narrow(0, static_cast<int64_t>(parts.size()) * range.size(), range.size())
            .requires_grad_(true);
    named_.emplace_back(spec->name, parameter);
    splits_.push_back(SplitOf(*spec));
    parts.push_back(std::move(parameter));
  }
  return parts;
}

at::Tensor Decoder::parameter(const std::string& name) const {
  for (const auto& [n, p] : named_) {
    if (n == name) return p;
  }
  TORCH_CHECK(false, "the model has no parameter named '", name, "'");
}

TensorParallelNorm Decoder::gradient_norm_scope() const {
  TensorParallelNorm scope{.group = tensor_parallel_size() > 1 ? tensor_parallel() : nullptr,
                           .replicated = {}};
  for (const ParameterSplit& split : splits_) scope.replicated.push_back(split.replicated());
  return scope;
}

at::Tensor Decoder::LocalPart(size_t index, const at::Tensor& full) const {
  TORCH_CHECK(index < named_.size(), "Decoder::LocalPart: no parameter ", index);
  const ParameterSplit& split = splits_[index];
  TORCH_CHECK(full.sizes() == at::IntArrayRef(split.full_shape), "Decoder::LocalPart: '",
              named_[index].first, "' has shape ", at::IntArrayRef(split.full_shape), ", not ",
              full.sizes());
  const at::Tensor experts =
      split.expert_parallel() ? full.narrow(0, split.experts.begin, split.experts.size()) : full;
  return split.Narrow(experts);
}

namespace {

// The whole of a tensor of `full` rows split along dimension 0 over `ranks` ranks, rank r holding
// the rows ranges_of(r) concatenated (as `rows` on this rank), from every rank's part: `gather`
// collects the parts padded to the largest, concatenated along dimension 0, and each range goes
// back to its place.
at::Tensor GatherSplitRows(const at::Tensor& rows, int64_t full, int ranks,
                           const std::function<std::vector<IndexRange>(int)>& ranges_of,
                           const std::function<at::Tensor(const at::Tensor&)>& gather) {
  std::vector<std::vector<IndexRange>> parts;
  int64_t most = 0;
  for (int r = 0; r < ranks; ++r) {
    parts.push_back(ranges_of(r));
    int64_t size = 0;
    for (const IndexRange& range : parts.back()) size += range.size();
    most = std::max(most, size);
  }
  std::vector<int64_t> shape = rows.sizes().vec();
  shape[0] = most;
  at::Tensor padded = at::zeros(shape, rows.options());
  padded.slice(0, 0, rows.size(0)).copy_(rows);
  const at::Tensor gathered = gather(padded);
  shape[0] = full;
  at::Tensor whole = at::empty(shape, rows.options());
  for (int r = 0; r < ranks; ++r) {
    int64_t offset = r * most;
    for (const IndexRange& range : parts[r]) {
      whole.slice(0, range.begin, range.end)
          .copy_(gathered.slice(0, offset, offset + range.size()));
      offset += range.size();
    }
  }
  return whole;
}

}  // namespace

at::Tensor Decoder::GatherParameter(size_t index) const {
  TORCH_CHECK(index < named_.size(), "Decoder::GatherParameter: no parameter ", index);
  const ParameterSplit& split = splits_[index];
  at::Tensor whole = named_[index].second.detach();
  // Over the tensor-parallel ranks, then (the experts) over the expert-parallel ranks.
  if (!split.replicated() && tensor_parallel_size() > 1) {
    whole = GatherSplitRows(
        whole.movedim(split.dim, 0), split.full_shape[split.dim], tensor_parallel_size(),
        [&](int r) { return split.RangesOf(r, tensor_parallel_size()); },
        [&](const at::Tensor& t) { return tensor_parallel_->AllGather(t); });
    if (split.dim != 0) whole = whole.movedim(0, split.dim).contiguous();
  }
  if (split.expert_parallel()) {
    const int ranks = expert_parallel_size();
    whole = GatherSplitRows(
        whole, split.full_shape[0], ranks,
        [&](int r) { return std::vector<IndexRange>{ExpertRange(split.full_shape[0], r, ranks)}; },
        [&](const at::Tensor& t) {
          return expert_parallel_->AllGather(t.contiguous()).flatten(0, 1);
        });
  }
  return whole;
}

void Decoder::ReduceTensorParallelGradients() const {
  if (!partial_norm_grads_.defined()) return;
  torch::autograd::AutoGradMode no_grad(false);
  at::Tensor sums = partial_norm_grads_;
  tensor_parallel_->AllReduce(sums, TensorParallelReduce::kSum);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const at::Tensor& sum = layer_partial_norm_grads_[l];
    if (!sum.defined()) continue;
    if (is_linear_layer(l)) {
      GradAccumulator(layers_[l].linear.norm).add_(sum);
    } else {
      GradAccumulator(layers_[l].attention.q_norm).add_(sum[0]);
      GradAccumulator(layers_[l].attention.k_norm).add_(sum[1]);
    }
  }
  partial_norm_grads_.zero_();
}

void Decoder::InitRandom(uint64_t seed, double std) {
  // Drawn whole on the CPU in float64 and then converted and split, so a seed means the same
  // weights on every device, dtype and tensor-parallel size. Each parameter is drawn in pieces of
  // kPiece elements, each from its own generator seeded by (seed, parameter, piece): the pieces
  // are drawn on every host thread (one generator drew Qwen3-8B in minutes), and the values do not
  // depend on how many threads there are.
  constexpr int64_t kPiece = int64_t{1} << 20;
  auto piece_seed = [seed](uint64_t parameter, uint64_t piece) {  // splitmix64 of the three
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * ((parameter << 32) + piece + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  const at::TensorOptions cpu = at::TensorOptions().dtype(at::kDouble);
  torch::autograd::AutoGradMode no_grad(false);
  for (size_t i = 0; i < named_.size(); ++i) {
    at::Tensor& parameter = named_[i].second;
    const std::string& name = named_[i].first;
    // Vectors other than biases (norm weights, dt_bias, A_log) are drawn narrow around an offset.
    const bool is_norm = parameter.dim() == 1 && !name.ends_with(".bias");
    double offset = is_norm ? 1.0 : 0.0;
    if (name.ends_with(".A_log")) {
      offset = -2.0;  // exp(A_log) ~ 0.14: a decay of about 0.85 per token with dt_bias ~ 1
    } else if (is_norm && HasZeroCentredNorms(config_) &&
               !name.ends_with("linear_attn.norm.weight")) {
      offset = 0.0;  // scales by 1 + w
    }
    const at::Tensor values = at::empty(splits_[i].full_shape, cpu);
    const at::Tensor flat = values.view(-1);
    const int64_t n = flat.numel();
    ParallelFor((n + kPiece - 1) / kPiece, 1, at::get_num_threads(),
                [&](int64_t begin, int64_t end) {
                  for (int64_t p = begin; p < end; ++p) {
                    at::Generator generator = at::detail::createCPUGenerator(piece_seed(i, p));
                    flat.narrow(0, p * kPiece, std::min(kPiece, n - p * kPiece))
                        .normal_(0.0, is_norm ? std / 4 : std, generator);
                  }
                });
    if (offset != 0.0) values.add_(offset);
    // Rounded on the host first, so that fewer bytes cross to the device.
    parameter.copy_(LocalPart(i, values).to(parameter.scalar_type()));
  }
}

std::pair<at::Tensor, at::Tensor> Decoder::Rope(const at::Tensor& positions) const {
  return RopeTables(inv_freq_.to(positions.device()), positions,
                    RopeAttentionFactor(config_.rope_scaling));
}

ChunkContext Decoder::MakeContext(const ChunkInput& input) const {
  const int64_t t = input.tokens.size(0);
  TORCH_CHECK(input.tokens.dim() == 1 && input.positions.sizes() == input.tokens.sizes(),
              "tokens and positions must be [T] tensors of the same length");
  const size_t num_layers = layers_.size();
  const PrefixKv& prefix = input.prefix;
  TORCH_CHECK(
      prefix.empty() || (prefix.keys.size() == num_layers && prefix.values.size() == num_layers),
      "prefix K/V must have one entry per layer");
  TORCH_CHECK(prefix.grad_keys.size() == prefix.grad_values.size() &&
                  (prefix.grad_keys.empty() || prefix.grad_keys.size() == num_layers),
              "prefix gradient accumulators must have one entry per layer, or none");
  ChunkContext context;
  context.chain = !input.key_end.defined();
  context.key_end = input.key_end.defined()
                        ? input.key_end
                        : at::full({t}, t, input.tokens.options().dtype(at::kLong));
  const auto [cos, sin] = Rope(input.positions);
  context.cos = cos.unsqueeze(1);
  context.sin = sin.unsqueeze(1);
  context.router_statistics = input.router_statistics;
  if (input.routed_experts.defined()) {
    int64_t sparse = 0;
    for (const Layer& layer : layers_) sparse += layer.sparse_index >= 0;
    TORCH_CHECK(input.routed_experts.scalar_type() == at::kInt &&
                    input.routed_experts.sizes() ==
                        at::IntArrayRef({t, sparse, config_.num_experts_per_tok}),
                "routed_experts must be [T, sparse layers, top_k] = [", t, ", ", sparse, ", ",
                config_.num_experts_per_tok, "] int32, got ", input.routed_experts.sizes(), " ",
                input.routed_experts.scalar_type());
    context.routed_experts = input.routed_experts;
  }
  if (has_linear_layers()) {
    TORCH_CHECK(context.chain || static_cast<int64_t>(input.parents.size()) == t,
                "a tree chunk (key_end given) of a model with linear-attention layers needs each "
                "token's parent (ChunkInput::parents): ",
                input.parents.size(), " for ", t, " tokens");
    TORCH_CHECK(prefix.empty() || prefix.states.size() == num_layers,
                "a prefix of a model with linear-attention layers needs its recurrent states "
                "(PrefixKv::states, one entry per layer)");
    // The convolution reads at most conv_kernel - 1 rows of the path before the chunk. Layer 0's
    // keys have P rows (attention) or at least min(P, conv_kernel - 1) (linear: PrefixKv).
    const int64_t prefix_rows = prefix.empty() ? 0 : prefix.keys[0].size(0);
    context.conv_context_rows = std::min(prefix_rows, linear_shape_.conv_kernel - 1);
    const TokenParents parents = context.chain ? TokenParents() : TokenParents(input.parents);
    if (input.state_points.empty()) {
      context.runs = ChainRuns(parents, t);
    } else {
      TORCH_CHECK(context.chain, "state points are for chain chunks only");
      context.runs = CutChain(t, input.state_points);
      for (size_t i = 0; i < input.state_points.size(); ++i) context.point_runs.push_back(i);
    }
    context.conv_index = ConvAncestorIndex(parents, t, context.conv_context_rows,
                                           linear_shape_.conv_kernel, input.tokens.device());
  }
  return context;
}

at::Tensor Decoder::Embed(const at::Tensor& tokens) const {
  return Embedding::apply(embed_, tokens, GroupHandle(tensor_parallel()), vocab_.begin);
}

BlockShared Decoder::SharedWithBlocks(int64_t l) const {
  return {.config = &config_,
          .group = GroupHandle(tensor_parallel()),
          .local_heads = local_heads(),
          .local_kv_heads = local_kv_heads(),
          .sparse_layer = layers_[l].sparse_index,
          .expert_group = ExpertGroupHandle(expert_parallel_.get()),
          .linear_shape = &linear_shape_,
          .partial_norm_grads =
              layer_partial_norm_grads_.empty() ? at::Tensor() : layer_partial_norm_grads_[l],
          .fresh_gradients = FreshGradients::Handle(fresh_gradients_)};
}

int64_t Decoder::UncreatedGradientBytes() const {
  int64_t bytes = 0;
  for (const auto& [name, parameter] : named_) {
    if (parameter.grad().defined()) continue;
    bytes += parameter.numel() *
             static_cast<int64_t>(c10::elementSize(AccumulatorType(parameter.scalar_type())));
  }
  return bytes;
}

void Decoder::StartFreshGradients(FreshGradients* fresh) const {
  fresh_gradients_ = fresh;
  if (fresh == nullptr) return;
  std::vector<const at::Tensor*> experts;
  for (const Layer& layer : layers_) {
    if (layer.sparse_index < 0) continue;
    for (const at::Tensor* stack :
         {&layer.mlp.experts_gate, &layer.mlp.experts_up, &layer.mlp.experts_down}) {
      experts.push_back(stack);
    }
  }
  std::vector<at::Tensor> zeroed;
  for (const auto& [name, parameter] : named_) {
    const at::Tensor& grad = parameter.grad();
    if (!grad.defined()) continue;
    const bool expert_stack = std::any_of(
        experts.begin(), experts.end(), [&](const at::Tensor* p) { return p->is_same(parameter); });
    if (expert_stack) {
      fresh->Mark(grad);
    } else {
      zeroed.push_back(grad);
    }
  }
  at::NoGradGuard no_grad;
  if (!zeroed.empty()) at::_foreach_zero_(zeroed);  // none before a model's first backward
}

LayerOutput Decoder::ForwardLayer(int64_t l, const at::Tensor& h, const ChunkContext& context,
                                  const LayerPrefix& prefix) const {
  const Layer& layer = layers_[l];
  const BlockShared shared = SharedWithBlocks(l);
  LayerOutput out =
      is_linear_layer(l)
          ? GatedDeltaNetBlock(h, layer.input_norm, layer.linear, context, prefix, shared)
          : AttentionBlock(h, layer.input_norm, layer.attention, context, prefix, shared);
  MlpBlock(out.hidden, layer.post_norm, layer.mlp, context, shared, out);
  return out;
}

at::Tensor Decoder::ForwardSparseLayersOnEmpty(int64_t layer) const {
  at::Tensor h = at::zeros({0, config_.hidden_size},
                           options_.dtype(ComputeType(options_.dtype().toScalarType())));
  const ChunkContext context;
  for (int64_t l = 0; l < static_cast<int64_t>(layers_.size()); ++l) {
    if (layers_[l].sparse_index < 0 || (layer >= 0 && l != layer)) continue;
    LayerOutput out;
    MlpBlock(h, layers_[l].post_norm, layers_[l].mlp, context, SharedWithBlocks(l), out);
    h = std::move(out.hidden);
  }
  return h;
}

// In the compute dtype: Logprobs rounds it once to lm_head's dtype, and its gradient stays wide.
at::Tensor Decoder::FinalNorm(const at::Tensor& h) const {
  const NormScale scale = NormScaleOf(final_norm_, HasZeroCentredNorms(config_));
  return RmsNorm(h, scale.weight, config_.rms_norm_eps,
                 ComputeType(options_.dtype().toScalarType()), scale.accumulator);
}

ChunkOutput Decoder::Forward(const ChunkInput& input) const {
  const ChunkContext context = MakeContext(input);
  ChunkOutput out;
  at::Tensor h = Embed(input.tokens);
  out.point_states.resize(context.point_runs.size());
  for (int64_t l = 0; l < static_cast<int64_t>(layers_.size()); ++l) {
    LayerOutput layer = ForwardLayer(l, h, context, PrefixOfLayer(input.prefix, l));
    h = std::move(layer.hidden);
    out.keys.push_back(std::move(layer.keys));
    out.values.push_back(std::move(layer.values));
    if (has_linear_layers()) out.states.push_back(std::move(layer.state));
    if (layer.router_probs.defined()) {
      out.router_probs =
          out.router_probs.defined() ? out.router_probs + layer.router_probs : layer.router_probs;
      out.router_counts = out.router_counts.defined() ? out.router_counts + layer.router_counts
                                                      : layer.router_counts;
    }
    // Attention layers have no states (an empty layer.point_states).
    for (size_t i = 0; i < out.point_states.size(); ++i) {
      out.point_states[i].push_back(layer.point_states.empty() ? at::Tensor()
                                                               : layer.point_states[i]);
    }
  }
  out.hidden = FinalNorm(h);
  return out;
}

at::Tensor Decoder::Logprobs(const at::Tensor& hidden, const at::Tensor& targets,
                             at::Tensor* entropy, const LogprobOptions& options) const {
  TORCH_CHECK(hidden.dim() == 2 && targets.dim() == 1 && hidden.size(0) == targets.size(0),
              "Logprobs takes hidden [N, hidden_size] and targets [N]");
  TORCH_CHECK(options.slice_rows > 0, "slice_rows must be positive");
  TORCH_CHECK(options.temperature > 0 && std::isfinite(options.temperature),
              "the temperature must be positive and finite, got ", options.temperature);
  auto outputs = SlicedLogprobs::apply(hidden, lm_head_, targets, options.slice_rows,
                                       1.0 / options.temperature, entropy != nullptr,
                                       GroupHandle(tensor_parallel()), vocab_.begin);
  if (entropy) *entropy = outputs[1];
  return outputs[0];
}

}  // namespace dta

// AReaL-DTA push/pop execution: the schedule of executor/tree/schedule.h run over a stack that
// holds the current root-to-leaf path.
//
// Per path position the stack keeps, for every layer, K and V (the cache later chunks attend to)
// and their gradient accumulators dK and dV (filled by descendants' backward passes); the final
// hidden state and its accumulator (the hidden state at p - 1 predicts token p, possibly in a
// child chunk); the token's log-probability (and entropy) and d loss / d log-probability summed
// over every rollout through it. A chunk's backward takes its ancestors' K/V and the previous
// hidden state as leaves of its graph (KV-cache anchors): their gradients go into the
// accumulators below the chunk, and its own outputs are seeded with the accumulators of its
// positions. Live activations are bounded by one chunk; the stack by one root-to-leaf path.
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>


#include "executor/engine/methods.h"
#include "executor/engine/packed_layout.h"
#include "executor/tree/leaf_order.h"
#include "executor/tree/prefix_tree.h"

namespace dta::engine {
namespace {

// The path state, preallocated for the longest rollout and written in place.
struct PathStack {
  std::vector<at::Tensor> keys, values, grad_keys, grad_values;  // per layer [max_len, kv_heads, head_dim]
  at::Tensor hidden, grad_hidden;                                // [max_len, hidden_size]
  at::Tensor logprobs, grad_logprobs;                            // [max_len]
  at::Tensor entropy, grad_entropy;                              // [max_len] when the loss needs entropy

  PathStack(const Qwen3Model& model, int64_t max_len, bool with_entropy) {
    const Qwen3Config& c = model.config();
    const at::TensorOptions o = model.options();
    const at::TensorOptions f = o.dtype(o.dtype() == at::kDouble ? at::kDouble : at::kFloat);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      for (auto* list : {&keys, &values, &grad_keys, &grad_values}) {
        list->push_back(at::zeros({max_len, c.num_key_value_heads, c.head_dim}, o));
      }
    }
    hidden = at::zeros({max_len, c.hidden_size}, o);
    grad_hidden = at::zeros({max_len, c.hidden_size}, o);
    logprobs = at::zeros({max_len}, f);
    grad_logprobs = at::zeros({max_len}, f);
    if (with_entropy) {
      entropy = at::zeros({max_len}, f);
      grad_entropy = at::zeros({max_len}, f);
    }
  }
};

// One forward over path positions [begin, end), with its graph when built with grad mode on.
struct Chunk {
  int64_t begin = 0, end = 0;
  std::vector<at::Tensor> prefix_keys, prefix_values;  // leaves: views of the stack below begin
  at::Tensor previous_hidden;                          // leaf [1, hidden] (begin > 0)
  ChunkOutput out;
  at::Tensor logprobs, entropy;  // [end - begin]
};

Chunk ForwardChunk(const Qwen3Model& model, const PathStack& stack, const at::Tensor& tokens, int64_t begin,
                   int64_t end, bool with_graph, bool with_entropy, int64_t slice_rows) {
  torch::autograd::AutoGradMode grad_mode(with_graph);
  Chunk chunk;
  chunk.begin = begin;
  chunk.end = end;
  // variable_data(): same storage, but a version counter of its own, so pushing later positions
  // into the stack (in place) does not invalidate this graph's saved anchors.
  auto anchor = [&](const at::Tensor& t) { return with_graph ? t.variable_data().requires_grad_(true) : t; };
  if (begin > 0) {
    for (size_t l = 0; l < stack.keys.size(); ++l) {
      chunk.prefix_keys.push_back(anchor(stack.keys[l].slice(0, 0, begin)));
      chunk.prefix_values.push_back(anchor(stack.values[l].slice(0, 0, begin)));
    }
    chunk.previous_hidden = anchor(stack.hidden.slice(0, begin - 1, begin));
  }
  const at::Tensor ids = tokens.slice(0, begin, end);
  chunk.out = model.Forward({.tokens = ids,
                             .positions = at::arange(begin, end, ids.options()),
                             .prefix_keys = chunk.prefix_keys,
                             .prefix_values = chunk.prefix_values});
  // Token p is predicted by the hidden state at p - 1: the stack's for the chunk's first token.
  const int64_t t = end - begin;
  const at::Tensor rows = begin > 0 ? at::cat({chunk.previous_hidden, chunk.out.hidden.slice(0, 0, t - 1)})
                                    : chunk.out.hidden.slice(0, 0, t - 1);
  const at::Tensor targets = begin > 0 ? ids : ids.slice(0, 1, t);
  at::Tensor entropy;
  chunk.logprobs = model.Logprobs(rows, targets, with_entropy ? &entropy : nullptr, slice_rows);
  if (begin == 0) {
    // Position 0 has no prediction: a constant 0.
    const at::Tensor zero = at::zeros({1}, chunk.logprobs.options());
    chunk.logprobs = at::cat({zero, chunk.logprobs});
    if (with_entropy) entropy = at::cat({zero, entropy});
  }
  chunk.entropy = entropy;
  return chunk;
}

void Push(PathStack& stack, const Chunk& chunk) {
  torch::autograd::AutoGradMode no_grad(false);
  const int64_t b = chunk.begin, e = chunk.end;
  for (size_t l = 0; l < stack.keys.size(); ++l) {
    stack.keys[l].slice(0, b, e).copy_(chunk.out.keys[l]);
    stack.values[l].slice(0, b, e).copy_(chunk.out.values[l]);
  }
  stack.hidden.slice(0, b, e).copy_(chunk.out.hidden);
  stack.logprobs.slice(0, b, e).copy_(chunk.logprobs);
  if (chunk.entropy.defined()) stack.entropy.slice(0, b, e).copy_(chunk.entropy);
}

// Backpropagates a chunk with its accumulated gradients, then moves the gradients of its anchors
// into the accumulators below it.
void Backward(PathStack& stack, Chunk& chunk) {
  const int64_t b = chunk.begin, e = chunk.end;
  std::vector<at::Tensor> outputs = {chunk.logprobs, chunk.out.hidden};
  std::vector<at::Tensor> grads = {stack.grad_logprobs.slice(0, b, e), stack.grad_hidden.slice(0, b, e)};
  if (chunk.entropy.defined()) {
    outputs.push_back(chunk.entropy);
    grads.push_back(stack.grad_entropy.slice(0, b, e));
  }
  for (size_t l = 0; l < stack.keys.size(); ++l) {
    outputs.push_back(chunk.out.keys[l]);
    grads.push_back(stack.grad_keys[l].slice(0, b, e));
    outputs.push_back(chunk.out.values[l]);
    grads.push_back(stack.grad_values[l].slice(0, b, e));
  }
  torch::autograd::backward(outputs, grads);
  torch::autograd::AutoGradMode no_grad(false);
  for (size_t l = 0; l < chunk.prefix_keys.size(); ++l) {
    if (chunk.prefix_keys[l].grad().defined()) stack.grad_keys[l].slice(0, 0, b).add_(chunk.prefix_keys[l].grad());
    if (chunk.prefix_values[l].grad().defined()) {
      stack.grad_values[l].slice(0, 0, b).add_(chunk.prefix_values[l].grad());
    }
  }
  if (chunk.previous_hidden.defined() && chunk.previous_hidden.grad().defined()) {
    stack.grad_hidden.slice(0, b - 1, b).add_(chunk.previous_hidden.grad());
  }
}

void Pop(PathStack& stack, int64_t begin, int64_t end) {
  // Accumulators are zeroed so the positions can be reused by the next path.
  for (size_t l = 0; l < stack.keys.size(); ++l) {
    stack.grad_keys[l].slice(0, begin, end).zero_();
    stack.grad_values[l].slice(0, begin, end).zero_();
  }
  stack.grad_hidden.slice(0, begin, end).zero_();
  stack.grad_logprobs.slice(0, begin, end).zero_();
  if (stack.grad_entropy.defined()) stack.grad_entropy.slice(0, begin, end).zero_();
}


// A kPacked step: rollouts order[first, last) share the stack's positions [0, depth) and nothing
// above it with anyone else. Their tokens above `depth` are forwarded at once with a tree mask on
// top of the stack's K/V, their losses attached, and everything backpropagated; the stack's
// accumulators below `depth` receive the gradients of its K/V, of the hidden state at depth - 1,
// and of the log-probabilities (and entropies) the rollouts read from it.
double RunPackedStep(const Qwen3Model& model, PathStack& stack, absl::Span<const Rollout> rollouts,
                     absl::Span<const RolloutIndex> group, int64_t depth, const LossPlan& plan, int64_t slice_rows,
                     std::vector<at::Tensor>& logprobs_out) {
  torch::autograd::AutoGradMode grad_mode(true);
  // The group's suffixes above `depth` as their own little tree (rollouts ending at `depth` have
  // no suffix).
  PrefixTreeBuilder builder;
  std::vector<RolloutIndex> suffix_index(group.size(), -1);
  for (size_t k = 0; k < group.size(); ++k) {
    const std::vector<TokenId>& tokens = rollouts[group[k]].tokens;
    if (static_cast<int64_t>(tokens.size()) == depth) continue;
    suffix_index[k] = builder.num_rollouts();
    TORCH_CHECK(builder.AddRollout(absl::MakeConstSpan(tokens).subspan(depth)).ok(), rollouts[group[k]].id);
  }
  const PrefixTree suffixes = std::move(builder).Build();
  const PackedLayout layout = MakePackedLayout(suffixes, depth);

  // Anchors: the stack below `depth`, with version counters of their own (see ForwardChunk).
  std::vector<at::Tensor> prefix_keys, prefix_values;
  at::Tensor previous_hidden;
  if (depth > 0) {
    for (size_t l = 0; l < stack.keys.size(); ++l) {
      prefix_keys.push_back(stack.keys[l].slice(0, 0, depth).variable_data().requires_grad_(true));
      prefix_values.push_back(stack.values[l].slice(0, 0, depth).variable_data().requires_grad_(true));
    }
    previous_hidden = stack.hidden.slice(0, depth - 1, depth).variable_data().requires_grad_(true);
  }
  const bool with_entropy = plan.needs_entropy();
  const PackedOutput packed =
      ForwardPacked(model, layout, prefix_keys, prefix_values, previous_hidden, with_entropy, slice_rows);
  // What the rollouts read from the stack below `depth`, as leaves whose gradients are collected.
  const at::Tensor stack_logprobs = stack.logprobs.slice(0, 0, depth).clone().requires_grad_(true);
  const at::Tensor stack_entropy =
      with_entropy ? stack.entropy.slice(0, 0, depth).clone().requires_grad_(true) : at::Tensor();

  at::Tensor total;
  for (size_t k = 0; k < group.size(); ++k) {
    at::Tensor logprobs = stack_logprobs;
    at::Tensor entropy = stack_entropy;
    if (suffix_index[k] >= 0) {
      const at::Tensor path = IndexTensor(layout.paths[suffix_index[k]], model.options().device());
      logprobs = at::cat({stack_logprobs, packed.logprobs.index_select(0, path)});
      if (with_entropy) entropy = at::cat({stack_entropy, packed.entropy.index_select(0, path)});
    }
    logprobs_out[group[k]] = logprobs.detach().clone();
    const at::Tensor loss = plan.Loss(group[k], logprobs, entropy);
    total = total.defined() ? total + loss : loss;
  }
  total.backward();

  torch::autograd::AutoGradMode no_grad(false);
  auto collect = [](const at::Tensor& leaf, at::Tensor accumulator) {
    if (leaf.defined() && leaf.grad().defined()) accumulator.add_(leaf.grad());
  };
  for (size_t l = 0; l < prefix_keys.size(); ++l) {
    collect(prefix_keys[l], stack.grad_keys[l].slice(0, 0, depth));
    collect(prefix_values[l], stack.grad_values[l].slice(0, 0, depth));
  }
  if (depth > 0) collect(previous_hidden, stack.grad_hidden.slice(0, depth - 1, depth));
  collect(stack_logprobs, stack.grad_logprobs.slice(0, 0, depth));
  if (with_entropy) collect(stack_entropy, stack.grad_entropy.slice(0, 0, depth));
  return total.item<double>();
}

}  // namespace

GradientResult RunDta(const Qwen3Model& model, absl::Span<const Rollout> rollouts, const LossPlan* plan,
                      const ExecutorOptions& options) {
  const bool training = plan != nullptr;
  const bool with_entropy = training && plan->needs_entropy();
  const PrefixTree tree = BuildTree(rollouts);
  const std::vector<RolloutIndex> order =
      options.order == LeafOrderKind::kLexicographic ? LexicographicOrder(tree) : BackwardDfsOrder(tree);
  absl::StatusOr<Schedule> schedule =
      BuildSchedule(tree, order,
                    {.block_size = options.block_size, .graph_budget = options.graph_budget, .pack = options.pack,
                     .training = training});
  TORCH_CHECK(schedule.ok(), std::string(schedule.status().message()));

  int64_t max_len = 0;
  for (const Rollout& rollout : rollouts) max_len = std::max<int64_t>(max_len, rollout.tokens.size());
  PathStack stack(model, max_len, with_entropy);
  std::vector<at::Tensor> token_tensors(rollouts.size());
  auto tokens_of = [&](RolloutIndex r) -> const at::Tensor& {
    if (!token_tensors[r].defined()) token_tensors[r] = TokenTensor(rollouts[r], model.options());
    return token_tensors[r];
  };

  GradientResult result;
  result.logprobs.resize(rollouts.size());
  for (const Rollout& rollout : rollouts) result.rollout_tokens += rollout.tokens.size();
  std::vector<Chunk> kept;  // chunks whose graphs are alive, bottom to top
  for (const Step& step : schedule->steps) {
    switch (step.kind) {
      case StepKind::kForward: {
        Chunk chunk = ForwardChunk(model, stack, tokens_of(step.rollout), step.begin, step.end, step.with_graph,
                                   with_entropy, options.logprob_slice_rows);
        Push(stack, chunk);
        result.forwarded_tokens += step.size();
        if (step.with_graph) kept.push_back(std::move(chunk));
        break;
      }
      case StepKind::kAttachLoss: {
        const int64_t length = step.end;
        result.logprobs[step.rollout] = stack.logprobs.slice(0, 0, length).clone();
        if (!training) break;
        const at::Tensor entropy = with_entropy ? stack.entropy.slice(0, 0, length).clone() : at::Tensor();
        const RolloutLossGrad g = plan->LossAndGrad(step.rollout, result.logprobs[step.rollout], entropy);
        stack.grad_logprobs.slice(0, 0, length).add_(g.dlogprobs);
        if (with_entropy) stack.grad_entropy.slice(0, 0, length).add_(g.dentropy);
        result.loss += g.loss;
        break;
      }
      case StepKind::kBackward: {
        if (step.reuses_graph) {
          TORCH_CHECK(!kept.empty() && kept.back().begin == step.begin && kept.back().end == step.end,
                      "schedule: no graph to reuse");
          Backward(stack, kept.back());
          kept.pop_back();
        } else {
          Chunk chunk = ForwardChunk(model, stack, tokens_of(step.rollout), step.begin, step.end,
                                     /*with_graph=*/true, with_entropy, options.logprob_slice_rows);
          result.forwarded_tokens += step.size();
          Backward(stack, chunk);
        }
        break;
      }
      case StepKind::kPop:
        Pop(stack, step.begin, step.end);
        break;
      case StepKind::kPacked: {
        TORCH_CHECK(training, "schedule: packed step in a forward-only pass");
        result.loss += RunPackedStep(model, stack, rollouts,
                                     absl::MakeConstSpan(schedule->order).subspan(step.first, step.last - step.first),
                                     step.begin, *plan, options.logprob_slice_rows, result.logprobs);
        result.forwarded_tokens += step.packed_tokens;
        break;
      }
    }
  }
  return result;
}

}  // namespace dta::engine

// AReaL-DTA push/pop execution: the schedule of core/tree/schedule.h run over a stack that
// holds the current root-to-leaf path.
//
// Per path position the stack keeps, for every layer, K and V (the cache later chunks attend to)
// and their gradient accumulators dK and dV (filled by descendants' backward passes); the final
// hidden state and its accumulator (the hidden state at p - 1 predicts token p, possibly in a
// child chunk); the token's log-probability (and entropy) and d loss / d log-probability summed
// over every rollout through it. Accumulators are float32 (float64 for float64 models) whatever
// the model dtype. A chunk attends to its ancestors' K/V as views of the stack (never copied),
// and its attention backward adds their gradients straight into the accumulators below the
// chunk; the previous hidden state is a leaf of its graph (a KV-cache anchor). Its own outputs are
// seeded with the accumulators of its positions. Live activations are bounded by one chunk; the
// stack by one root-to-leaf path.
//
// Linear-attention layers (Qwen3-Next's Gated DeltaNet) route state instead (Tree Training's state
// routing): at every chunk end the stack keeps the layers' recurrent states and their last
// conv_kernel - 1 convolution inputs (all a causal convolution reads before a chunk), with
// accumulators; nothing per position. A chunk starts from the states and rows at its begin, its
// backward adds d loss / d state and d loss / d rows into their accumulators (summing over every
// child that started there), and its own final states and rows are seeded with the accumulators
// at its end.
//
// The router's load-balancing loss (LossOptions::router_aux_loss_coef) of a rollout needs the
// routing of all its tokens, known once its last token is forwarded; by then every chunk holding
// its tokens is still to be backpropagated (a token's chunk runs backward only after every rollout
// through it is done). So per position the stack keeps the routing (expert counts and router
// probabilities, summed over the sparse layers) and the gradient of the probabilities summed over
// the rollouts through it, each rollout adding its row when its loss is attached; a chunk's
// backward seeds its probabilities with those rows.
//
// Nothing in the loop reads a value back from the device but, under expert parallelism, each
// sparse layer's forward (its all-to-all's row counts): the schedule, the packed layouts and the
// token ids are fixed on the host before the first kernel, and the loss stays a device scalar
// until the end. Under expert parallelism the schedule's model calls run in lockstep with the
// other ranks' (lockstep.h).
#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <numeric>
#include <thread>

#include "absl/strings/numbers.h"
#include "core/base/env_switch.h"
#include "core/layout/chunk_capacity.h"
#include "core/layout/gib.h"
#include "core/tree/leaf_order.h"
#include "core/tree/prefix_tree.h"
#include "core/tree/sharing_groups.h"
#include "executor/device/host_to_device.h"
#include "executor/device/memory.h"
#include "executor/engine/lockstep.h"
#include "executor/engine/methods.h"
#include "executor/engine/packed_layout.h"
#include "executor/model/ops/gather_rows.h"
#include "kernels/batched_copy.h"
#include "kernels/chunk_attention.h"

namespace dta::engine {
namespace {

// The path state, preallocated for the longest rollout and written in place.
struct PathStack {
  // Per layer [max_len, kv_heads, head_dim], this rank's KV heads under tensor parallelism;
  // undefined at linear-attention layers (their rows are kept at the boundaries).
  std::vector<at::Tensor> keys, values, grad_keys, grad_values;
  at::Tensor hidden, grad_hidden;      // [max_len, hidden_size], float32
  at::Tensor logprobs, grad_logprobs;  // [max_len]
  at::Tensor entropy, grad_entropy;    // [max_len] when the loss needs entropy
  // Linear-attention layers' recurrent states are not kept per position but where chunks start:
  // at every forward chunk's end and at the positions inside it where later steps start
  // (StatePoints: a backward chunk recomputed inside a forward chunk without a graph, a packed
  // step). With them, the convolution inputs of the path's last min(p, conv_rows) positions before
  // p, [rows, conv_dim] (copies, in the model dtype), and their accumulators. Per layer, undefined
  // at attention layers.
  struct Boundary {
    std::vector<at::Tensor> states, grad_states;
    std::vector<at::Tensor> conv, grad_conv;
  };
  std::map<int64_t, Boundary> boundaries;  // by path position p: the states after token p - 1
  bool training = false;
  bool linear = false;  // the model has linear-attention layers
  // conv_kernel - 1 with linear layers: the rows before a chunk that its convolution reads.
  int64_t conv_rows = 0;
  // With the router-balance loss, [max_len, num_experts] in the compute type: per position the
  // routing of its token (ChunkOutput::router_counts, router_probs' values) and the gradient of
  // its router probabilities; undefined otherwise.
  at::Tensor router_counts, router_probs, grad_router_probs;
  bool router_statistics() const { return router_counts.defined(); }

  PathStack(const Decoder& model, int64_t max_len, bool with_entropy, bool training, bool balance)
      : training(training),
        linear(model.has_linear_layers()),
        conv_rows(linear ? model.linear_shape().conv_kernel - 1 : 0) {
    const ModelConfig& c = model.config();
    const at::TensorOptions o = model.options();
    const at::TensorOptions f = o.dtype(o.dtype() == at::kDouble ? at::kDouble : at::kFloat);
    const int64_t kv_heads = model.local_kv_heads();
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      if (model.is_linear_layer(l)) {
        for (auto* list : {&keys, &values, &grad_keys, &grad_values}) list->emplace_back();
        continue;
      }
      for (auto* list : {&keys, &values})
        list->push_back(at::zeros({max_len, kv_heads, c.head_dim}, o));
      for (auto* list : {&grad_keys, &grad_values}) {
        list->push_back(at::zeros({max_len, kv_heads, c.head_dim}, f));
      }
    }
    hidden = at::zeros({max_len, c.hidden_size}, f);  // FinalNorm's output, in the compute dtype
    grad_hidden = at::zeros({max_len, c.hidden_size}, f);
    logprobs = at::zeros({max_len}, f);
    grad_logprobs = at::zeros({max_len}, f);
    if (with_entropy) {
      entropy = at::zeros({max_len}, f);
      grad_entropy = at::zeros({max_len}, f);
    }
    if (balance) {
      for (at::Tensor* t : {&router_counts, &router_probs, &grad_router_probs})
        *t = at::zeros({max_len, c.num_experts}, f);
    }
  }

  // The states a chunk starting at `depth` (> 0) continues from.
  const Boundary& BoundaryAt(int64_t depth) const {
    const auto it = boundaries.find(depth);
    TORCH_CHECK(it != boundaries.end(), "internal: no recurrent state at path position ", depth,
                " (a chunk starts where none ended)");
    return it->second;
  }
};

// Positions [0, depth) of the stack as a chunk's prefix; with their accumulators when the chunk
// will be backpropagated.
PrefixKv StackPrefix(const PathStack& stack, int64_t depth, bool with_grad) {
  PrefixKv prefix;
  if (depth == 0) return prefix;
  auto rows = [&](const at::Tensor& t) { return t.defined() ? t.slice(0, 0, depth) : t; };
  const PathStack::Boundary* boundary = stack.linear ? &stack.BoundaryAt(depth) : nullptr;
  for (size_t l = 0; l < stack.keys.size(); ++l) {
    // A linear layer's keys: the last convolution inputs before `depth` (the decoder reads
    // min(depth, conv_kernel - 1) rows, all the boundary holds).
    const bool linear = !stack.keys[l].defined();
    prefix.keys.push_back(linear ? boundary->conv[l] : rows(stack.keys[l]));
    prefix.values.push_back(rows(stack.values[l]));
    if (with_grad) {
      prefix.grad_keys.push_back(linear ? boundary->grad_conv[l] : rows(stack.grad_keys[l]));
      prefix.grad_values.push_back(rows(stack.grad_values[l]));
    }
  }
  if (boundary != nullptr) {
    prefix.states = boundary->states;
    if (with_grad) prefix.grad_states = boundary->grad_states;
  }
  return prefix;
}

// The hidden state at depth - 1 as a leaf of a new graph (it predicts the token at depth).
// variable_data(): same storage, but a version counter of its own, so pushing later positions into
// the stack (in place) does not invalidate the graph that saved it.
at::Tensor HiddenAnchor(const PathStack& stack, int64_t depth, bool with_graph) {
  if (depth == 0) return at::Tensor();
  const at::Tensor row = stack.hidden.slice(0, depth - 1, depth);
  return with_graph ? row.variable_data().requires_grad_(true) : row;
}

// Adds a leaf's gradient (if it got one) into an accumulator.
void Collect(const at::Tensor& leaf, at::Tensor accumulator) {
  if (leaf.defined() && leaf.grad().defined()) accumulator.add_(leaf.grad());
}

// One forward over path positions [begin, end), with its graph when built with grad mode on.
struct Chunk {
  int64_t begin = 0, end = 0;
  at::Tensor previous_hidden;  // leaf [1, hidden] (begin > 0)
  ChunkOutput out;
  // Path positions inside (begin, end) whose recurrent states out.point_states holds.
  std::vector<int64_t> state_points;
  at::Tensor logprobs, entropy;  // [end - begin]
};

// Positions [begin, end) of a rollout whose token ids are `tokens` (and routing replay rows
// `routed`, possibly undefined), whose log-probabilities are read where `read` (its flags for
// positions max(begin, 1) .. end - 1, or empty: everywhere) says.
Chunk ForwardChunk(const Decoder& model, const PathStack& stack, const at::Tensor& tokens,
                   const at::Tensor& routed, int64_t begin, int64_t end, bool with_graph,
                   bool with_entropy, absl::Span<const uint8_t> read, const LogprobOptions& logprob,
                   std::vector<int64_t> state_points = {}) {
  torch::autograd::AutoGradMode grad_mode(with_graph);
  Chunk chunk;
  chunk.begin = begin;
  chunk.end = end;
  chunk.previous_hidden = HiddenAnchor(stack, begin, with_graph);
  const at::Tensor ids = tokens.slice(0, begin, end);
  std::vector<int64_t> offsets;  // path positions to offsets in the chunk
  for (const int64_t p : state_points) offsets.push_back(p - begin);
  chunk.out = model.Forward({.tokens = ids,
                             .positions = at::arange(begin, end, ids.options()),
                             .state_points = std::move(offsets),
                             .prefix = StackPrefix(stack, begin, with_graph),
                             .router_statistics = stack.router_statistics(),
                             .routed_experts = routed});
  chunk.state_points = std::move(state_points);
  // Token p is predicted by the hidden state at p - 1: the stack's for the chunk's first token.
  const int64_t t = end - begin;
  const at::Tensor rows =
      begin > 0 ? at::cat({chunk.previous_hidden, chunk.out.hidden.slice(0, 0, t - 1)})
                : chunk.out.hidden.slice(0, 0, t - 1);
  const at::Tensor targets = begin > 0 ? ids : ids.slice(0, 1, t);
  at::Tensor entropy;
  chunk.logprobs =
      LogprobsOfReadRows(model, rows, targets, read, with_entropy ? &entropy : nullptr, logprob);
  if (begin == 0) {
    // Position 0 has no prediction: a constant 0.
    const at::Tensor zero = at::zeros({1}, chunk.logprobs.options());
    chunk.logprobs = at::cat({zero, chunk.logprobs});
    if (with_entropy) entropy = at::cat({zero, entropy});
  }
  chunk.entropy = entropy;
  return chunk;
}

// Linear layer l's convolution inputs of the last min(p, conv_rows) positions before path
// position p, b < p <= e for the chunk [b, e): the chunk's own rows, after the rows before b that
// the boundary at b keeps. A copy, so that the chunk's output is not kept alive.
at::Tensor ConvRowsBefore(const PathStack& stack, const Chunk& chunk, size_t l, int64_t p) {
  const int64_t first = std::max<int64_t>(0, p - stack.conv_rows);
  const int64_t b = chunk.begin;
  const at::Tensor own = chunk.out.keys[l].detach().slice(0, std::max(first, b) - b, p - b);
  if (first >= b) return own.clone();
  // The boundary at b keeps rows [b - below.size(0), b), a superset of [first, b).
  const at::Tensor& below = stack.BoundaryAt(b).conv[l];
  return at::cat({below.slice(0, below.size(0) - (b - first)), own});
}

void Push(PathStack& stack, const Chunk& chunk) {
  torch::autograd::AutoGradMode no_grad(false);
  const int64_t b = chunk.begin, e = chunk.end;
  // Every layer's K/V (or convolution inputs), the hidden state, log-probabilities, entropy and
  // routing onto the stack in one batch of copies (kernels/batched_copy.h: one launch on a GPU).
  std::vector<at::Tensor> from, to;
  auto push = [&](const at::Tensor& value, const at::Tensor& stacked) {
    from.push_back(value);
    to.push_back(stacked.slice(0, b, e));
  };
  for (size_t l = 0; l < stack.keys.size(); ++l) {
    if (!stack.keys[l].defined()) continue;  // a linear layer: its rows go to the boundaries
    push(chunk.out.keys[l], stack.keys[l]);
    push(chunk.out.values[l], stack.values[l]);
  }
  push(chunk.out.hidden, stack.hidden);
  push(chunk.logprobs, stack.logprobs);
  if (chunk.entropy.defined()) push(chunk.entropy, stack.entropy);
  if (stack.router_statistics()) {
    push(chunk.out.router_counts, stack.router_counts);
    push(chunk.out.router_probs, stack.router_probs);
  }
  kernels::CopyAll(from, to);
  // The invariant that lets linear layers keep no rows per position: every chunk starts at a
  // boundary (the end of a chunk pushed before, or a state point inside one), and a causal
  // convolution of kernel K reads only the K - 1 inputs before its first token; the recurrent
  // state carries the rest. So a boundary keeps the last K - 1 rows before it (fewer near the
  // root; rows of earlier chunks when this one is shorter), read from the boundary at the chunk's
  // begin. Backward hands the gradients of these rows back (see Backward).
  auto keep = [&](int64_t position, const std::vector<at::Tensor>& states) {
    PathStack::Boundary boundary;
    for (size_t l = 0; l < states.size(); ++l) {
      const at::Tensor& state = states[l];
      const bool linear = state.defined();
      boundary.states.push_back(linear ? state.detach() : state);
      boundary.grad_states.push_back(stack.training && linear ? at::zeros_like(state)
                                                              : at::Tensor());
      const at::Tensor conv = linear ? ConvRowsBefore(stack, chunk, l, position) : at::Tensor();
      boundary.conv.push_back(conv);
      boundary.grad_conv.push_back(stack.training && linear
                                       ? at::zeros(conv.sizes(), stack.hidden.options())
                                       : at::Tensor());
    }
    stack.boundaries[position] = std::move(boundary);
  };
  if (!chunk.out.states.empty()) keep(e, chunk.out.states);
  for (size_t i = 0; i < chunk.state_points.size(); ++i)
    keep(chunk.state_points[i], chunk.out.point_states[i]);
}

// Backpropagates a chunk with its accumulated gradients (its attention adds the prefix K/V
// gradients into the accumulators below it), then moves the previous hidden state's gradient
// into its accumulator.
void Backward(PathStack& stack, Chunk& chunk) {
  const int64_t b = chunk.begin, e = chunk.end;
  std::vector<at::Tensor> outputs, grads;
  // Accumulators in another dtype than their output (float32 ones for bfloat16 K/V) are cast
  // into one buffer per dtype, in one batch.
  std::vector<size_t> cast_index;
  std::vector<at::Tensor> cast_from;
  auto seed = [&](const at::Tensor& output, const at::Tensor& accumulator) {
    outputs.push_back(output);
    grads.push_back(accumulator);
    if (accumulator.scalar_type() != output.scalar_type()) {
      cast_index.push_back(grads.size() - 1);
      cast_from.push_back(accumulator);
    }
  };
  seed(chunk.logprobs, stack.grad_logprobs.slice(0, b, e));
  seed(chunk.out.hidden, stack.grad_hidden.slice(0, b, e));
  if (chunk.entropy.defined()) seed(chunk.entropy, stack.grad_entropy.slice(0, b, e));
  if (stack.router_statistics())
    seed(chunk.out.router_probs, stack.grad_router_probs.slice(0, b, e));
  for (size_t l = 0; l < stack.keys.size(); ++l) {
    if (!stack.keys[l].defined()) continue;  // a linear layer (below)
    seed(chunk.out.keys[l], stack.grad_keys[l].slice(0, b, e));
    seed(chunk.out.values[l], stack.grad_values[l].slice(0, b, e));
  }
  // Linear layers: the gradients of the convolution inputs kept at the boundaries in (b, e] (what
  // the chunks starting there sent back, and what chunks above passed down). The chunk's own rows
  // seed its output; rows before b belong to the chunks below and pass on to the boundary at b
  // (after the backward, which may add to it too), whose rows include them.
  struct Carry {
    at::Tensor from, to;
  };
  std::vector<Carry> carries;
  {
    torch::autograd::AutoGradMode grad_mode(true);  // the output's slices are graph roots
    for (auto it = stack.boundaries.upper_bound(b); it != stack.boundaries.end() && it->first <= e;
         ++it) {
      const int64_t p = it->first;
      for (size_t l = 0; l < it->second.grad_conv.size(); ++l) {
        const at::Tensor& grad = it->second.grad_conv[l];
        if (!grad.defined()) continue;
        const int64_t first = p - grad.size(0);  // the path position of its first row
        const int64_t below = std::max<int64_t>(0, b - first);  // rows before the chunk
        if (below > 0) {
          const at::Tensor& to = stack.BoundaryAt(b).grad_conv[l];  // rows [b - size, b)
          carries.push_back({grad.slice(0, 0, below), to.slice(0, to.size(0) - (b - first))});
        }
        if (below < grad.size(0))
          seed(chunk.out.keys[l].slice(0, first + below - b, p - b), grad.slice(0, below));
      }
    }
  }
  // The recurrent states after the chunk: what the chunks starting at its end sent back.
  auto seed_states = [&](int64_t position, const std::vector<at::Tensor>& states) {
    const auto it = stack.boundaries.find(position);
    if (it == stack.boundaries.end()) return;
    for (size_t l = 0; l < states.size(); ++l) {
      if (states[l].defined() && it->second.grad_states[l].defined())
        seed(states[l], it->second.grad_states[l]);
    }
  };
  seed_states(e, chunk.out.states);
  // State points are kept only in chunks forwarded without a graph (StatePoints: a chunk whose
  // graph is kept is backpropagated whole, so nothing starts inside it).
  TORCH_CHECK(chunk.state_points.empty(),
              "internal: a backpropagated chunk has recurrent states kept inside it");
  if (!cast_index.empty()) {
    torch::autograd::AutoGradMode no_grad(false);
    std::vector<at::Tensor> cast_to(cast_index.size());
    std::map<at::ScalarType, std::vector<size_t>> by_dtype;
    for (size_t i = 0; i < cast_index.size(); ++i)
      by_dtype[outputs[cast_index[i]].scalar_type()].push_back(i);
    for (const auto& [dtype, members] : by_dtype) {
      int64_t total = 0;
      for (size_t i : members) total += cast_from[i].numel();
      const at::Tensor buffer = at::empty({total}, cast_from[members[0]].options().dtype(dtype));
      int64_t offset = 0;
      for (size_t i : members) {
        const int64_t n = cast_from[i].numel();
        cast_to[i] = buffer.slice(0, offset, offset + n).view(cast_from[i].sizes());
        offset += n;
      }
    }
    kernels::CopyAll(cast_from, cast_to);
    for (size_t i = 0; i < cast_index.size(); ++i) grads[cast_index[i]] = cast_to[i];
  }
  torch::autograd::backward(outputs, grads);
  torch::autograd::AutoGradMode no_grad(false);
  for (const Carry& carry : carries) carry.to.add_(carry.from);
  if (b > 0) Collect(chunk.previous_hidden, stack.grad_hidden.slice(0, b - 1, b));
}

void Pop(PathStack& stack, int64_t begin, int64_t end) {
  // Accumulators are zeroed so the positions can be reused by the next path (in one batch).
  std::vector<at::Tensor> rows;
  for (size_t l = 0; l < stack.keys.size(); ++l) {
    if (!stack.grad_keys[l].defined()) continue;  // a linear layer: its rows leave with boundaries
    rows.push_back(stack.grad_keys[l].slice(0, begin, end));
    rows.push_back(stack.grad_values[l].slice(0, begin, end));
  }
  rows.push_back(stack.grad_hidden.slice(0, begin, end));
  rows.push_back(stack.grad_logprobs.slice(0, begin, end));
  if (stack.grad_entropy.defined()) rows.push_back(stack.grad_entropy.slice(0, begin, end));
  if (stack.router_statistics()) rows.push_back(stack.grad_router_probs.slice(0, begin, end));
  kernels::ZeroAll(rows);
  // The states after positions begin .. end - 1 leave the path with them.
  stack.boundaries.erase(stack.boundaries.upper_bound(begin), stack.boundaries.upper_bound(end));
}

// Rollout r's router-balance row w_r c_r (LossPlan::RouterBalanceRow) added to the gradient of
// the router probabilities at its positions [0, length) of the stack; returns the term's value.
at::Tensor AttachRouterBalance(PathStack& stack, const LossPlan& plan, RolloutIndex r,
                               int64_t length) {
  const at::Tensor row = plan.RouterBalanceRow(r, stack.router_counts.slice(0, 0, length).sum(0));
  stack.grad_router_probs.slice(0, 0, length).add_(row);
  return (stack.router_probs.slice(0, 0, length).sum(0) * row).sum();
}

// Host threads a packed step computes its rollouts' losses on: DTA_LOSS_THREADS (read at every
// packed step; 1 computes them on the calling thread), 4 by default.
int LossThreads() {
  const char* value = std::getenv("DTA_LOSS_THREADS");
  if (value == nullptr) return 4;
  int threads = 0;
  TORCH_CHECK(absl::SimpleAtoi(value, &threads) && threads >= 1,
              "DTA_LOSS_THREADS must be a positive integer, got '", value, "'");
  return threads;
}

// work(0) .. work(n - 1) on up to `threads` host threads, this one included, each taking the next
// index. The work runs with this thread's autograd, dispatch and profiler state
// (at::ThreadLocalState) on the current stream of `device`, so its kernels queue where this
// thread's do. Rethrows the first exception once every thread is done.
void RunOnHostThreads(int64_t n, int threads, const at::Device& device,
                      const std::function<void(int64_t)>& work) {
  threads = static_cast<int>(
      std::min<int64_t>({static_cast<int64_t>(threads), n,
                         static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()))}));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) work(i);
    return;
  }
  const at::ThreadLocalState state;
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
  std::atomic<int64_t> next{0};
  auto loop = [&] {
    for (int64_t i = next++; i < n; i = next++) work(i);
  };
  std::vector<std::future<void>> helpers;
  for (int t = 1; t < threads; ++t) {
    helpers.push_back(std::async(std::launch::async, [&] {
      const at::ThreadLocalStateGuard state_guard(state);
      const c10::StreamGuard stream_guard(stream);
      loop();
    }));
  }
  std::exception_ptr error;
  try {
    loop();
  } catch (...) {
    error = std::current_exception();
  }
  for (std::future<void>& helper : helpers) {
    try {
      helper.get();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

// A kPacked step: rollouts order[first, last) share the stack's positions [0, depth) and nothing
// above it with anyone else. Their tokens above `depth` are forwarded at once with a tree mask on
// top of the stack's K/V, their losses attached, and everything backpropagated; the stack's
// accumulators below `depth` receive the gradients of its K/V, of the hidden state at depth - 1,
// and of the log-probabilities (and entropies) the rollouts read from it.
at::Tensor RunPackedStep(const Decoder& model, PathStack& stack, const RoutingReplay& replay,
                         absl::Span<const RolloutIndex> group, int64_t depth, const LossPlan& plan,
                         const LogprobPositions& read, const LogprobOptions& logprob,
                         std::vector<at::Tensor>& logprobs_out, at::Tensor& balance_out) {
  torch::autograd::AutoGradMode grad_mode(true);
  // The group's suffixes above `depth` as their own little tree (rollouts ending at `depth` have
  // no suffix).
  PrefixTreeBuilder builder;
  std::vector<RolloutIndex> suffix_index(group.size(), -1);
  std::vector<RolloutIndex> suffix_rollouts;  // the batch's index of each suffix
  for (size_t k = 0; k < group.size(); ++k) {
    const absl::Span<const TokenId> keys = replay.keys(group[k]);
    if (static_cast<int64_t>(keys.size()) == depth) continue;
    suffix_index[k] = builder.num_rollouts();
    suffix_rollouts.push_back(group[k]);
    TORCH_CHECK(builder.AddRollout(keys.subspan(depth)).ok(), replay.rollout(group[k]).id);
  }
  const PrefixTree suffixes = std::move(builder).Build();
  const PackedLayout layout = MakePackedLayout(suffixes, depth, replay, suffix_rollouts, read);

  const at::Tensor previous_hidden = HiddenAnchor(stack, depth, /*with_graph=*/true);
  const bool with_entropy = plan.needs_entropy();
  const bool balance = stack.router_statistics();
  const PackedOutput packed =
      ForwardPacked(model, layout, replay, StackPrefix(stack, depth, /*with_grad=*/true),
                    previous_hidden, with_entropy, logprob, /*checkpointing=*/false, balance);
  // Each rollout's loss and its gradient come first, with no graph through the model: their small
  // operations run on the host while the GPU runs the packed forward, and the backward's autograd
  // walk holds only the model's graph (with the losses in it, the GPU waited on the host's walk of
  // their nodes: 35 ms of a Qwen3-1.7B step at B = 32K). A rollout's gradient below `depth` goes
  // into the stack's accumulators (the chunks below backpropagate it), the rest into the packed
  // tokens' seeds.
  const at::Tensor stack_logprobs = stack.logprobs.slice(0, 0, depth);
  const at::Tensor stack_entropy = with_entropy ? stack.entropy.slice(0, 0, depth) : at::Tensor();
  const at::Tensor packed_logprobs = packed.logprobs.detach();
  const at::Tensor packed_entropy = with_entropy ? packed.entropy.detach() : at::Tensor();

  // The router-balance term: each rollout's counts are the stack's below `depth` plus its packed
  // tokens'; its row goes into the stack's gradient below `depth` and into router_grad above.
  at::Tensor stack_counts, stack_probs, router_grad, balance_below;
  if (balance) {
    stack_counts = stack.router_counts.slice(0, 0, depth).sum(0);
    stack_probs = stack.router_probs.slice(0, 0, depth).sum(0);
    router_grad = at::zeros_like(packed.router_counts);
  }
  // Per rollout its log-probabilities, loss and gradient: a packed step holds many rollouts (54 in
  // one step at Qwen3-1.7B's B = 32K), whose losses one by one on one thread took the host longer
  // than the packed forward takes the GPU. A loss summing token terms is computed for all of them
  // at once; the others rollout by rollout, on several host threads for the built-in ones.
  struct RolloutPart {
    at::Tensor path;  // its packed tokens; undefined when it ends at `depth`
    RolloutLossGrad grad;
    DiagnosticsAccumulator diagnostics;
  };
  std::vector<RolloutPart> parts(group.size());
  at::Tensor total;
  // DTA_BATCHED_LOSSES=0 computes them rollout by rollout (for before/after measurements).
  const bool batched = plan.sums_token_terms() && EnvSwitchOn("DTA_BATCHED_LOSSES");
  const bool threaded = !batched && plan.computes_on_any_thread();
  if (batched) {
    // Every rollout's log-probabilities in one gather, its positions [0, depth) from the stack and
    // the rest from its packed tokens (row depth + p of the two concatenated), and every loss at
    // once: a few operations on the host in all.
    std::vector<int64_t> rows, offsets = {0};
    size_t total_rows = group.size() * static_cast<size_t>(depth);
    for (const std::vector<int64_t>& path : layout.paths) total_rows += path.size();
    rows.reserve(total_rows);
    for (size_t k = 0; k < group.size(); ++k) {
      for (int64_t p = 0; p < depth; ++p) rows.push_back(p);
      if (suffix_index[k] >= 0) {
        for (const int64_t p : layout.paths[suffix_index[k]]) rows.push_back(depth + p);
      }
      offsets.push_back(static_cast<int64_t>(rows.size()));
    }
    const at::Tensor gather = CopyToDevice(absl::MakeConstSpan(rows),
                                           at::TensorOptions().device(model.options().device()));
    const at::Tensor logprobs = at::cat({stack_logprobs, packed_logprobs}).index_select(0, gather);
    const at::Tensor entropy =
        with_entropy ? at::cat({stack_entropy, packed_entropy}).index_select(0, gather)
                     : at::Tensor();
    const at::Tensor packed_rows = gather - depth;  // a packed token's row, above `depth`
    const RolloutLossGrad g = plan.LossAndGradOfRollouts(group, logprobs, entropy);
    total = g.loss;
    for (size_t k = 0; k < group.size(); ++k) {
      const int64_t begin = offsets[k], end = offsets[k + 1];
      if (suffix_index[k] >= 0) parts[k].path = packed_rows.slice(0, begin + depth, end);
      logprobs_out[group[k]] = logprobs.slice(0, begin, end);
      parts[k].grad.dlogprobs = g.dlogprobs.slice(0, begin, end);
      if (with_entropy) parts[k].grad.dentropy = g.dentropy.slice(0, begin, end);
    }
  } else {
    RunOnHostThreads(
        static_cast<int64_t>(group.size()), threaded ? LossThreads() : 1, model.options().device(),
        [&](int64_t k) {
          RolloutPart& part = parts[k];
          at::Tensor logprobs = stack_logprobs;
          at::Tensor entropy = stack_entropy;
          if (suffix_index[k] >= 0) {
            part.path = IndexTensor(layout.paths[suffix_index[k]], model.options().device());
            logprobs = at::cat({stack_logprobs, packed_logprobs.index_select(0, part.path)});
            if (with_entropy) {
              entropy = at::cat({stack_entropy, packed_entropy.index_select(0, part.path)});
            }
          }
          logprobs_out[group[k]] = part.path.defined() ? logprobs : logprobs.clone();
          part.grad = threaded ? plan.LossAndGrad(group[k], logprobs, entropy, part.diagnostics)
                               : plan.LossAndGrad(group[k], logprobs, entropy);
        });
  }
  // The rest in rollout order: the same sums on every run.
  std::vector<at::Tensor> paths, path_grads, path_entropy_grads;
  for (size_t k = 0; k < group.size(); ++k) {
    const at::Tensor& path = parts[k].path;
    const RolloutLossGrad& g = parts[k].grad;
    if (threaded) plan.AddDiagnostics(parts[k].diagnostics);
    if (balance) {
      at::Tensor counts = stack_counts;
      if (path.defined()) counts = counts + packed.router_counts.index_select(0, path).sum(0);
      const at::Tensor row = plan.RouterBalanceRow(group[k], counts);
      stack.grad_router_probs.slice(0, 0, depth).add_(row);
      if (path.defined()) router_grad.index_add_(0, path, row.expand({path.size(0), row.size(0)}));
      // The part below `depth`: the stack's chunks backpropagate it.
      const at::Tensor below = (stack_probs * row).sum();
      balance_below = balance_below.defined() ? balance_below + below : below;
    }
    stack.grad_logprobs.slice(0, 0, depth).add_(g.dlogprobs.slice(0, 0, depth));
    if (with_entropy) stack.grad_entropy.slice(0, 0, depth).add_(g.dentropy.slice(0, 0, depth));
    if (path.defined()) {
      paths.push_back(path);
      path_grads.push_back(g.dlogprobs.slice(0, depth));
      if (with_entropy) path_entropy_grads.push_back(g.dentropy.slice(0, depth));
    }
    if (g.loss.defined()) total = total.defined() ? total + g.loss : g.loss;
  }
  // The packed tokens' seeds: every rollout's gradient summed at its tokens, in rollout order
  // (AddRowsInto: the same bits on every run).
  std::vector<at::Tensor> outputs = {packed.logprobs};
  std::vector<at::Tensor> seeds = {at::zeros_like(packed_logprobs)};
  const at::Tensor index = paths.empty() ? at::Tensor() : at::cat(paths);
  if (index.defined()) AddRowsInto(seeds[0], index, at::cat(path_grads));
  if (with_entropy) {
    outputs.push_back(packed.entropy);
    seeds.push_back(at::zeros_like(packed_entropy));
    if (index.defined()) AddRowsInto(seeds.back(), index, at::cat(path_entropy_grads));
  }
  if (balance) {
    // The term above `depth` is linear in the packed tokens' probabilities: router_grad seeds them.
    outputs.push_back(packed.router_probs);
    seeds.push_back(router_grad);
    const at::Tensor value = balance_below + (packed.router_probs.detach() * router_grad).sum();
    balance_out = balance_out.defined() ? balance_out + value : value;
    total = total + value;
  }
  torch::autograd::backward(outputs, seeds);

  torch::autograd::AutoGradMode no_grad(false);
  if (depth > 0) Collect(previous_hidden, stack.grad_hidden.slice(0, depth - 1, depth));
  return total;
}

// Per step of the schedule, the path positions strictly inside a kForward step where a later step
// starts on the stack that step wrote (a backward chunk recomputed inside a forward chunk that
// kept no graph, a forward or packed step above a pop into it): the recurrent states of
// linear-attention layers must be kept there (attention reads any position's K/V instead).
// The stack is simulated as the forward steps' ranges it holds, bottom to top.
std::vector<std::vector<int64_t>> StatePoints(const Schedule& schedule) {
  std::vector<std::vector<int64_t>> points(schedule.steps.size());
  struct Held {
    int64_t begin, end;  // the forward step's range (end: as forwarded, before any pop)
    size_t step;
  };
  std::vector<Held> held;
  int64_t height = 0;
  auto need = [&](int64_t position) {
    if (position == 0) return;
    // The forward step holding position - 1 (the state is after it).
    for (auto it = held.rbegin(); it != held.rend(); ++it) {
      if (it->begin < position && position <= it->end) {
        if (position < it->end) points[it->step].push_back(position);
        return;
      }
    }
  };
  for (size_t i = 0; i < schedule.steps.size(); ++i) {
    const Step& step = schedule.steps[i];
    switch (step.kind) {
      case StepKind::kForward:
        need(step.begin);
        while (!held.empty() && held.back().begin >= step.begin) held.pop_back();
        held.push_back({step.begin, step.end, i});
        height = step.end;
        break;
      case StepKind::kBackward:
        if (!step.reuses_graph) need(step.begin);
        break;
      case StepKind::kPacked:
        need(step.begin);
        break;
      case StepKind::kPop:
        height = std::min(height, step.begin);
        while (!held.empty() && held.back().begin >= height) held.pop_back();
        break;
      case StepKind::kAttachLoss:
        break;
    }
  }
  for (std::vector<int64_t>& p : points) {
    std::sort(p.begin(), p.end());
    p.erase(std::unique(p.begin(), p.end()), p.end());
  }
  return points;
}

// B and the graph budget in tokens: the options, with the automatic ones resolved from the device
// memory free now (see ExecutorOptions::block_size and graph_budget).
struct ChunkPlan {
  int64_t block_size = 0;
  int64_t graph_budget = 0;
};

// ExecutorOptions::memory_budget: the largest B and graph budget whose estimate fits in what the
// budget leaves above the memory allocated now (the path stack included) and the gradients the
// step will create, and in the memory free.
ChunkPlan FitChunksInBudget(const Decoder& model, const ExecutorOptions& options, int64_t longest) {
  const at::Device device = model.options().device();
  const int64_t gradients = model.UncreatedGradientBytes();
  const int64_t allocated = AllocatedDeviceMemory(device) + gradients;
  // Every tensor-parallel rank plans with the least any has, so that all plan the same schedule.
  const int64_t available = LeastOverRanks(
      model.tensor_parallel(),
      std::min(options.memory_budget - allocated, FreeDeviceMemory(device) - gradients), device);
  ExecutorMemoryOptions memory = ExecutorMemoryOf(options, longest);
  memory.expert_parallel = model.expert_parallel_size();
  const absl::StatusOr<ChunkCapacity> fit = FitChunksInMemory(
      model.config(), memory, available, model.tensor_parallel_size(),
      static_cast<int32_t>(c10::elementSize(model.options().dtype().toScalarType())));
  TORCH_CHECK(fit.ok(), "memory_budget of ", GiB(options.memory_budget), " with ", GiB(allocated),
              " already allocated (weights, gradients, optimizer state, the path stack): ",
              fit.status().message());
  return {.block_size = fit->block_size, .graph_budget = fit->graph_budget};
}

ChunkPlan ResolveChunkPlan(const Decoder& model, const ExecutorOptions& options, int64_t longest,
                           bool training) {
  const bool auto_block = options.block_size == kAutoBlockSize;
  const bool auto_budget = options.graph_budget == kAutoGraphBudget;
  TORCH_CHECK(auto_block || options.block_size >= 1,
              "block_size must be >= 1 or kAutoBlockSize, got ", options.block_size);
  TORCH_CHECK(auto_budget || options.graph_budget >= 0,
              "graph_budget must be >= 0 or kAutoGraphBudget, got ", options.graph_budget);
  TORCH_CHECK(options.memory_budget >= 0, "memory_budget must be >= 0 bytes, got ",
              options.memory_budget);
  ChunkPlan plan{.block_size = options.block_size,
                 .graph_budget = auto_budget ? 0 : options.graph_budget};
  if (!training) plan.graph_budget = 0;
  const at::Device device = model.options().device();
  if (!device.is_cuda() || !training) {
    if (auto_block) plan.block_size = std::max<int64_t>(longest, 1);
    return plan;
  }
  if (options.memory_budget > 0) return FitChunksInBudget(model, options, longest);
  if (!auto_block && !auto_budget) return plan;
  const int64_t per_token =
      GraphBytesPerToken(model.config(), model.options().dtype().toScalarType(),
                         model.tensor_parallel_size(), model.expert_parallel_size());
  // The gradients backward will create come out of the memory free now first (a model's first
  // step: float32 gradients are twice a bfloat16 model's weights).
  // The least any tensor-parallel rank has, so that all plan the same schedule.
  const int64_t free_bytes = LeastOverRanks(
      model.tensor_parallel(), FreeDeviceMemory(device) - model.UncreatedGradientBytes(), device);
  const int64_t fit =
      static_cast<int64_t>(0.8 * static_cast<double>(std::max<int64_t>(free_bytes, 0))) / per_token;
  if (auto_block) {
    // Chunks of at least kLeastAutomaticBlock tokens (a device that cannot hold them will say
    // so), at most MostAutomaticBlock (the longest rollout, or more with packing).
    const int64_t most = MostAutomaticBlock(model.config(), longest, options.pack);
    plan.block_size =
        std::clamp<int64_t>(fit - plan.graph_budget, std::min(kLeastAutomaticBlock, longest), most);
  }
  if (auto_budget) plan.graph_budget = std::max<int64_t>(0, fit - plan.block_size);
  return plan;
}

// One push/pop pass: the schedule of one tree, over some of the batch's rollouts (batch_index maps
// the tree's rollout indices to the batch's).
struct Pass {
  std::vector<RolloutIndex> batch_index;
  Schedule schedule;
  std::vector<RolloutIndex> batch_order;  // schedule.order in the batch's indices
};

// A pass over `tree`, whose rollout r is the batch's batch_index[r].
Pass PlanPass(const PrefixTree& tree, std::vector<RolloutIndex> batch_index,
              const ExecutorOptions& options, const ChunkPlan& chunks, bool training) {
  const std::vector<RolloutIndex> order = options.order == LeafOrderKind::kLexicographic
                                              ? LexicographicOrder(tree)
                                              : BackwardDfsOrder(tree);
  absl::StatusOr<Schedule> schedule = BuildSchedule(tree, order,
                                                    {.block_size = chunks.block_size,
                                                     .graph_budget = chunks.graph_budget,
                                                     .pack = options.pack,
                                                     .training = training});
  TORCH_CHECK(schedule.ok(), std::string(schedule.status().message()));
  Pass pass{.batch_index = std::move(batch_index), .schedule = *std::move(schedule)};
  for (RolloutIndex r : pass.schedule.order) pass.batch_order.push_back(pass.batch_index[r]);
  return pass;
}

// The batch's passes: one over its whole tree, or one per sharing group (core/tree/
// sharing_groups.h) when a short prefix before long chains is cheaper recomputed than shared.
std::vector<Pass> PlanPasses(const RoutingReplay& keys, const ExecutorOptions& options,
                             const ChunkPlan& chunks, bool training) {
  const PrefixTree whole = BuildTree(keys);
  const std::vector<std::vector<RolloutIndex>> groups =
      SharingGroups(whole, {.max_unshared_fraction = options.unshared_prefix_fraction,
                            .min_suffix = kernels::kMinSplitChain});
  std::vector<Pass> passes;
  if (groups.size() <= 1) {
    std::vector<RolloutIndex> identity(keys.num_rollouts());
    std::iota(identity.begin(), identity.end(), RolloutIndex{0});
    passes.push_back(PlanPass(whole, std::move(identity), options, chunks, training));
    return passes;
  }
  for (const std::vector<RolloutIndex>& group : groups)
    passes.push_back(PlanPass(BuildTree(keys, group), group, options, chunks, training));
  return passes;
}

// Whether the automatic chunks may take a larger B than ResolveChunkPlan's (GrowPackingBlock): both
// B and the graph budget automatic, sized from the memory free (not a memory budget), packing, a
// training step on a GPU.
bool GrowsPackingBlock(const Decoder& model, const ExecutorOptions& options, bool training) {
  return training && options.pack && options.block_size == kAutoBlockSize &&
         options.graph_budget == kAutoGraphBudget && options.memory_budget == 0 &&
         model.options().device().is_cuda();
}

// The largest B = chunks.block_size * 2^k whose passes recompute no more tokens, the graph budget
// taking what B leaves of the graph tokens the memory holds (LargestBlockRecomputingNoMore: fewer,
// larger packed steps and chunks); `passes` are replaced by that B's.
void GrowPackingBlock(const RoutingReplay& replay, const ExecutorOptions& options,
                      ChunkPlan& chunks, std::vector<Pass>& passes) {
  int64_t tokens = 0;
  for (const Pass& pass : passes) tokens += pass.schedule.tree_tokens;
  std::map<int64_t, std::vector<Pass>> planned;  // by B (the budget follows from it)
  planned.emplace(chunks.block_size, std::move(passes));
  const ScheduleOptions grown = LargestBlockRecomputingNoMore(
      {.block_size = chunks.block_size,
       .graph_budget = chunks.graph_budget,
       .pack = true,
       .training = true},
      tokens, [&](const ScheduleOptions& candidate) {
        auto it = planned.find(candidate.block_size);
        if (it == planned.end()) {
          const ChunkPlan plan{.block_size = candidate.block_size,
                               .graph_budget = candidate.graph_budget};
          it = planned.emplace(candidate.block_size, PlanPasses(replay, options, plan, true)).first;
        }
        int64_t recomputed = 0;
        for (const Pass& pass : it->second) recomputed += pass.schedule.recomputed;
        return recomputed;
      });
  chunks = {.block_size = grown.block_size, .graph_budget = grown.graph_budget};
  passes = std::move(planned.at(grown.block_size));
}

// The profiler's name for the host work of one kind of step (a user scope: torch.profiler and
// bench/step_gaps.py attribute the GPU's idle time to the step the host was in).
const char* StepScope(StepKind kind) {
  switch (kind) {
    case StepKind::kForward:
      return "dta::forward";
    case StepKind::kAttachLoss:
      return "dta::attach_loss";
    case StepKind::kBackward:
      return "dta::backward";
    case StepKind::kPop:
      return "dta::pop";
    case StepKind::kPacked:
      return "dta::packed";
  }
  return "dta::step";
}

}  // namespace

GradientResult RunDta(const Decoder& model, absl::Span<const Rollout> rollouts,
                      const RoutingReplay& replay, const LossPlan* plan,
                      const LogprobPositions& read, const ExecutorOptions& options) {
  const bool training = plan != nullptr;
  const bool with_entropy = training && plan->needs_entropy();
  int64_t max_len = 0;
  for (const Rollout& rollout : rollouts)
    max_len = std::max<int64_t>(max_len, rollout.tokens.size());
  const bool balance = training && plan->balances_routers();
  // The host's planning, up to the first step (the profiler's scope, see StepScope).
  at::RecordFunction plan_scope(at::RecordScope::USER_SCOPE);
  if (plan_scope.isActive()) plan_scope.before("dta::plan");
  PathStack stack(model, max_len, with_entropy, training, balance);
  ChunkPlan chunks = ResolveChunkPlan(model, options, max_len, training);
  // A rank of an expert-parallel group may have no rollouts: it only serves the others' tokens.
  std::vector<Pass> passes =
      rollouts.empty() ? std::vector<Pass>() : PlanPasses(replay, options, chunks, training);
  if (!passes.empty() && GrowsPackingBlock(model, options, training)) {
    GrowPackingBlock(replay, options, chunks, passes);
  }

  const std::vector<at::Tensor> token_tensors = TokenTensors(rollouts, model.options());
  at::Tensor loss = at::zeros({}, stack.logprobs.options());
  at::Tensor balance_total;  // the router-balance terms, part of `loss`

  GradientResult result;
  result.block_size = chunks.block_size;
  result.graph_budget = chunks.graph_budget;
  result.logprobs.resize(rollouts.size());
  for (const Rollout& rollout : rollouts) result.rollout_tokens += rollout.tokens.size();
  int64_t total_work = 0;  // what forwarded_tokens will be
  if (options.progress) {
    for (const Pass& pass : passes) {
      for (const Step& step : pass.schedule.steps) {
        if (step.kind == StepKind::kForward ||
            (step.kind == StepKind::kBackward && !step.reuses_graph))
          total_work += step.size();
        if (step.kind == StepKind::kPacked) total_work += step.packed_tokens;
      }
    }
  }
  // Every pass's steps in order; linear-attention models keep recurrent states at StatePoints.
  struct PlannedStep {
    size_t pass, step;
  };
  std::vector<PlannedStep> steps;
  std::vector<std::vector<std::vector<int64_t>>> state_points(passes.size());
  for (size_t p = 0; p < passes.size(); ++p) {
    if (stack.linear) state_points[p] = StatePoints(passes[p].schedule);
    for (size_t s = 0; s < passes[p].schedule.steps.size(); ++s) steps.push_back({p, s});
  }
  plan_scope.end();
  std::vector<Chunk> kept;  // chunks whose graphs are alive, bottom to top
  auto run_step = [&](const PlannedStep& planned) {
    const Pass& pass = passes[planned.pass];
    const Step& step = pass.schedule.steps[planned.step];
    auto batch_of = [&](RolloutIndex r) { return pass.batch_index[r]; };
    auto tokens_of = [&](RolloutIndex r) -> const at::Tensor& {
      return token_tensors[batch_of(r)];
    };
    // The replayed routing of the step's positions (undefined without replay).
    auto routed = [&] {
      return replay.Rows(batch_of(step.rollout), step.begin, step.end, model.options().device());
    };
    // Which of the step's predicted positions (all but path position 0) have their
    // log-probabilities read.
    auto read_of_step = [&] {
      return read.Of(batch_of(step.rollout), std::max<int64_t>(step.begin, 1), step.end);
    };
    const int64_t forwarded_before = result.forwarded_tokens;
    RECORD_USER_SCOPE(StepScope(step.kind));
    switch (step.kind) {
      case StepKind::kForward: {
        Chunk chunk = ForwardChunk(
            model, stack, tokens_of(step.rollout), routed(), step.begin, step.end, step.with_graph,
            with_entropy, read_of_step(), LogprobOptionsOf(options),
            stack.linear ? state_points[planned.pass][planned.step] : std::vector<int64_t>());
        Push(stack, chunk);
        result.forwarded_tokens += step.size();
        if (step.with_graph) kept.push_back(std::move(chunk));
        break;
      }
      case StepKind::kAttachLoss: {
        const int64_t length = step.end;
        const RolloutIndex r = batch_of(step.rollout);
        result.logprobs[r] = stack.logprobs.slice(0, 0, length).clone();
        if (!training) break;
        const at::Tensor entropy =
            with_entropy ? stack.entropy.slice(0, 0, length).clone() : at::Tensor();
        const RolloutLossGrad g = plan->LossAndGrad(r, result.logprobs[r], entropy);
        stack.grad_logprobs.slice(0, 0, length).add_(g.dlogprobs);
        if (with_entropy) stack.grad_entropy.slice(0, 0, length).add_(g.dentropy);
        loss += g.loss;
        if (balance) {
          const at::Tensor term = AttachRouterBalance(stack, *plan, r, length);
          balance_total = balance_total.defined() ? balance_total + term : term;
          loss += term;
        }
        break;
      }
      case StepKind::kBackward: {
        if (step.reuses_graph) {
          TORCH_CHECK(
              !kept.empty() && kept.back().begin == step.begin && kept.back().end == step.end,
              "schedule: no graph to reuse");
          Backward(stack, kept.back());
          kept.pop_back();
        } else {
          Chunk chunk = ForwardChunk(model, stack, tokens_of(step.rollout), routed(), step.begin,
                                     step.end, /*with_graph=*/true, with_entropy, read_of_step(),
                                     LogprobOptionsOf(options));
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
        loss += RunPackedStep(
            model, stack, replay,
            absl::MakeConstSpan(pass.batch_order).subspan(step.first, step.last - step.first),
            step.begin, *plan, read, LogprobOptionsOf(options), result.logprobs, balance_total);
        result.forwarded_tokens += step.packed_tokens;
        break;
      }
    }
    if (options.progress && result.forwarded_tokens != forwarded_before)
      options.progress(result.forwarded_tokens, total_work);
  };

  // The model calls, in lockstep with the other expert-parallel ranks (lockstep.h): per call the
  // last step it runs (it runs the steps after the previous call's too: attaching losses, pops). A
  // graph kept and backpropagated with no model call between is one forward and backward.
  std::vector<ModelCall> word;
  std::vector<size_t> last_step;
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& step = passes[steps[i].pass].schedule.steps[steps[i].step];
    if (step.kind == StepKind::kBackward && step.reuses_graph && !word.empty() &&
        word.back().kind == CallKind::kKeep) {
      word.back() = ForwardBackwardCall(step.size());
      last_step.back() = i;
      continue;
    }
    switch (step.kind) {
      case StepKind::kForward:
        word.push_back(step.with_graph ? KeepCall(step.size()) : ForwardCall(step.size()));
        break;
      case StepKind::kBackward:
        word.push_back(step.reuses_graph ? BackwardKeptCall(step.size())
                                         : ForwardBackwardCall(step.size()));
        break;
      case StepKind::kPacked:
        word.push_back(ForwardBackwardCall(step.packed_tokens));
        break;
      case StepKind::kAttachLoss:
      case StepKind::kPop:
        continue;
    }
    last_step.push_back(i);
  }
  size_t next = 0;
  Lockstep(model, std::move(word)).Run([&](int64_t call) {
    while (next <= last_step[call]) run_step(steps[next++]);
  });
  while (next < steps.size()) run_step(steps[next++]);
  RECORD_USER_SCOPE("dta::loss_readback");
  result.loss = loss.item<double>();  // the one read-back, after the last kernel is queued
  if (balance_total.defined())
    result.router_aux_loss = balance_total.item<double>() / plan->router_aux_loss_coef();
  return result;
}

}  // namespace dta::engine

// Internal to executor/engine: a prefix tree's unique tokens laid out for one packed forward.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/ATen.h>

#include "core/tree/prefix_tree.h"
#include "executor/engine/checkpointing.h"
#include "executor/engine/methods.h"
#include "executor/engine/routing_replay.h"
#include "executor/model/decoder.h"

namespace dta::engine {

// Tree Training's DFS serialization of a tree whose root sits at path position `offset` (0 for a
// whole batch, the shared depth for a packed step on top of a stack).
struct PackedLayout {
  std::vector<int64_t> tokens;     // serialized token ids
  std::vector<int64_t> positions;  // original position ids: offset + depth in the tree
  // Key t is visible to queries t .. key_end[t] - 1: the rest of its node and its subtree.
  std::vector<int64_t> key_end;
  // The serialized token whose hidden state predicts token t: the previous token on its path, or
  // -1 for the first token of a root child (predicted from whatever precedes the tree).
  // Also each token's parent, along which linear-attention layers route their state.
  std::vector<int64_t> previous;
  // paths[r][p]: the serialized index of position offset + p of rollout r.
  std::vector<std::vector<int64_t>> paths;
  // With routing replay: per serialized token, a batch rollout through it and its position there
  // (where its routing is read; every rollout through a token has the same). Empty otherwise.
  std::vector<RolloutIndex> source_rollout;
  std::vector<int64_t> source_position;
  // Per serialized token, whether its log-probability is read (LogprobPositions); empty: every
  // token's is.
  std::vector<uint8_t> read;
};

// The layout of `tree`, built over replay.keys of the batch's rollouts batch_index[0],
// batch_index[1], ... (the tree's rollout r is the batch's batch_index[r]), whose log-probabilities
// are read at `read`.
PackedLayout MakePackedLayout(const PrefixTree& tree, int64_t offset, const RoutingReplay& replay,
                              absl::Span<const RolloutIndex> batch_index,
                              const LogprobPositions& read);

// An int64 tensor of `values` on `device`, uploaded without a host synchronisation.
at::Tensor IndexTensor(const std::vector<int64_t>& values, const at::Device& device);

struct PackedOutput {
  at::Tensor token_ids;  // [n] the serialized tokens, on the model's device
  at::Tensor logprobs;   // [n] per serialized token
  at::Tensor entropy;    // [n] when asked for, else undefined
  // With router statistics: ChunkOutput's router_probs and router_counts [n, num_experts]
  // (router_probs without a graph under checkpointing).
  at::Tensor router_probs, router_counts;
  // With checkpointing: what BackwardThroughLayers needs once the loss has been backpropagated.
  std::optional<ChunkInput> input;
  ChunkContext context;
  LayerCheckpoints checkpoints;
};

// One tree-masked forward of the layout's tokens on top of `prefix` (or none) and the
// log-probability of every token the layout reads (0 at the others): predicted by the previous
// packed token's hidden state, or, for the first token of a root child, by `previous_hidden` ([1,
// hidden]). With `previous_hidden` undefined the tree starts at position 0 and those tokens hold 0.
// With `checkpointing` (no prefix), the decoder keeps only its layer inputs (see checkpointing.h):
// after backpropagating the loss, call BackwardThroughLayers(model, *out.input, out.context,
// out.checkpoints). With `router_statistics`, the sparse layers' routing too
// (ChunkInput::router_statistics). With routing replay the tokens are routed as the layout's
// sources were.
PackedOutput ForwardPacked(const Decoder& model, const PackedLayout& layout,
                           const RoutingReplay& replay, const PrefixKv& prefix,
                           const at::Tensor& previous_hidden, bool with_entropy,
                           const LogprobOptions& logprob, bool checkpointing = false,
                           bool router_statistics = false);

}  // namespace dta::engine

// Internal to executor/engine: a prefix tree's unique tokens laid out for one packed forward.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include "executor/model/qwen3_model.h"
#include "executor/tree/prefix_tree.h"

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
  std::vector<int64_t> previous;
  // paths[r][p]: the serialized index of position offset + p of rollout r.
  std::vector<std::vector<int64_t>> paths;
};

PackedLayout MakePackedLayout(const PrefixTree& tree, int64_t offset);

// An int64 tensor of `values` on `device`.
at::Tensor IndexTensor(const std::vector<int64_t>& values, const at::Device& device);

struct PackedOutput {
  at::Tensor token_ids;  // [n] the serialized tokens, on the model's device
  at::Tensor logprobs;   // [n] per serialized token
  at::Tensor entropy;    // [n] when asked for, else undefined
};

// One tree-masked forward of the layout's tokens on top of `prefix_keys`/`prefix_values` (one per
// layer, or empty) and every token's log-probability: predicted by the previous packed token's
// hidden state, or, for the first token of a root child, by `previous_hidden` ([1, hidden]).
// With `previous_hidden` undefined the tree starts at position 0 and those tokens hold 0.
PackedOutput ForwardPacked(const Qwen3Model& model, const PackedLayout& layout,
                           const std::vector<at::Tensor>& prefix_keys, const std::vector<at::Tensor>& prefix_values,
                           const at::Tensor& previous_hidden, bool with_entropy, int64_t slice_rows);

}  // namespace dta::engine

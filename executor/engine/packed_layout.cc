#include "executor/engine/packed_layout.h"

#include "executor/device/host_to_device.h"
#include "executor/model/ops/gather_rows.h"

namespace dta::engine {

PackedLayout MakePackedLayout(const PrefixTree& tree, int64_t offset, const RoutingReplay& replay,
                              absl::Span<const RolloutIndex> batch_index,
                              const LogprobPositions& read) {
  TORCH_CHECK(static_cast<RolloutIndex>(batch_index.size()) == tree.num_rollouts(),
              "internal: a packed layout needs each of the tree's rollouts' batch index");
  const int64_t n = tree.num_tree_tokens();
  PackedLayout layout;
  layout.tokens.resize(n);
  layout.positions.resize(n);
  layout.key_end.resize(n);
  layout.previous.resize(n);
  for (NodeId v = 1; v < tree.num_nodes(); ++v) {
    const int64_t first = tree.token_offset(v);
    const NodeId parent = tree.parent(v);
    const int64_t subtree_end = tree.token_offset(tree.subtree_end(v));
    for (int64_t o = 0; o < tree.length(v); ++o) {
      layout.tokens[first + o] = replay.token(tree.serialized_tokens()[first + o]);
      layout.positions[first + o] = offset + tree.depth(v) + o;
      layout.key_end[first + o] = subtree_end;
      layout.previous[first + o] =
          o > 0 ? first + o - 1
                : (parent == kRootNode ? -1 : tree.token_offset(parent) + tree.length(parent) - 1);
    }
  }
  layout.paths.resize(tree.num_rollouts());
  for (RolloutIndex r = 0; r < tree.num_rollouts(); ++r) {
    std::vector<int64_t>& path = layout.paths[r];
    path.resize(tree.rollout_length(r));
    for (NodeId v = tree.end_node(r); v != kRootNode; v = tree.parent(v)) {
      for (int64_t o = 0; o < tree.length(v); ++o)
        path[tree.depth(v) + o] = tree.token_offset(v) + o;
    }
  }
  if (!read.all()) {
    layout.read.assign(n, 0);
    for (RolloutIndex r = 0; r < tree.num_rollouts(); ++r) {
      const std::vector<int64_t>& path = layout.paths[r];
      const absl::Span<const uint8_t> flags =
          read.Of(batch_index[r], offset, offset + static_cast<int64_t>(path.size()));
      for (size_t p = 0; p < path.size(); ++p) layout.read[path[p]] |= flags[p];
    }
  }
  if (replay.active()) {
    layout.source_rollout.resize(n);
    layout.source_position.resize(n);
    for (RolloutIndex r = 0; r < tree.num_rollouts(); ++r) {
      for (size_t p = 0; p < layout.paths[r].size(); ++p) {
        layout.source_rollout[layout.paths[r][p]] = batch_index[r];
        layout.source_position[layout.paths[r][p]] = offset + static_cast<int64_t>(p);
      }
    }
  }
  return layout;
}

at::Tensor IndexTensor(const std::vector<int64_t>& values, const at::Device& device) {
  return CopyToDevice(absl::MakeConstSpan(values), at::TensorOptions().device(device));
}

PackedOutput ForwardPacked(const Decoder& model, const PackedLayout& layout,
                           const RoutingReplay& replay, const PrefixKv& prefix,
                           const at::Tensor& previous_hidden, bool with_entropy,
                           const LogprobOptions& logprob, bool checkpointing,
                           bool router_statistics) {
  const at::Device device = model.options().device();
  PackedOutput result;
  result.token_ids = IndexTensor(layout.tokens, device);
  const ChunkInput input{
      .tokens = result.token_ids,
      .positions = IndexTensor(layout.positions, device),
      .key_end = IndexTensor(layout.key_end, device),
      .parents = layout.previous,
      .prefix = prefix,
      .router_statistics = router_statistics,
      .routed_experts = replay.Rows(layout.source_rollout, layout.source_position, device)};
  at::Tensor hidden;
  if (checkpointing) {
    result.input = input;
    result.context = model.MakeContext(input);
    result.checkpoints = ForwardKeepingLayerInputs(model, input, result.context);
    hidden = model.FinalNorm(result.checkpoints.last);
    result.router_probs = result.checkpoints.router_probs;
    result.router_counts = result.checkpoints.router_counts;
  } else {
    ChunkOutput out = model.Forward(input);
    hidden = std::move(out.hidden);
    result.router_probs = std::move(out.router_probs);
    result.router_counts = std::move(out.router_counts);
  }
  // With a previous hidden state, row 0 is it and row t + 1 is packed token t's.
  const bool has_previous = previous_hidden.defined();
  const at::Tensor rows = has_previous ? at::cat({previous_hidden, hidden}) : hidden;
  std::vector<int64_t> predicted, predictor;
  for (size_t t = 0; t < layout.tokens.size(); ++t) {
    if (layout.previous[t] < 0 && !has_previous) continue;      // position 0: no prediction
    if (!layout.read.empty() && layout.read[t] == 0) continue;  // no loss reads it
    predicted.push_back(static_cast<int64_t>(t));
    predictor.push_back(has_previous ? layout.previous[t] + 1 : layout.previous[t]);
  }
  const at::Tensor predicted_ids = IndexTensor(predicted, device);
  at::Tensor entropy_values;
  // A branch point's row predicts each of its children: GatherRows sums their gradients in a
  // fixed order.
  const at::Tensor values = model.Logprobs(GatherRows(rows, IndexTensor(predictor, device)),
                                           result.token_ids.index_select(0, predicted_ids),
                                           with_entropy ? &entropy_values : nullptr, logprob);
  const at::Tensor zeros =
      at::zeros({static_cast<int64_t>(layout.tokens.size())}, values.options());
  result.logprobs = zeros.index_put({predicted_ids}, values);
  if (with_entropy) result.entropy = zeros.index_put({predicted_ids}, entropy_values);
  return result;
}

}  // namespace dta::engine

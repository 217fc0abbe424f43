// Internal to executor/engine: routing replay over one batch (docs/architecture.md, "Routing
// replay"). Rollouts that carry the experts their inference engine routed each token to
// (Rollout::routed_experts) are routed the same way by every method: each forward call gets its
// tokens' rows as ChunkInput::routed_experts.
//
// A shared token is computed once, so every rollout through it must replay the same routing. The
// prefix trees are therefore built over keys: each (token, routing at the sparse layers) pair is
// interned to one int32, and rollouts share a prefix only while their tokens and their routings
// both agree. Where routings disagree the tree splits; split_tokens() counts what that costs. A
// batch without routed experts keys by the token ids themselves.
//
// Example:
//   const RoutingReplay replay(model.config(), rollouts);
//   PrefixTreeBuilder builder;
//   for (RolloutIndex r = 0; r < n; ++r) builder.AddRollout(replay.keys(r));
//   ChunkInput input{.tokens = ..., .routed_experts = replay.Rows(r, begin, end, device)};
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "core/io/rollout.h"
#include "core/model/model_config.h"

namespace dta::engine {

class RoutingReplay {
 public:
  // Checks each rollout's routed experts against the model (ValidateRoutedExperts), TORCH_CHECK
  // naming the rollout, and interns the keys. `rollouts` must outlive this object.
  RoutingReplay(const ModelConfig& config, absl::Span<const Rollout> rollouts);

  RolloutIndex num_rollouts() const { return static_cast<RolloutIndex>(rollouts_.size()); }
  const Rollout& rollout(RolloutIndex r) const { return rollouts_[r]; }
  // Some rollout of the batch carries routed experts.
  bool active() const { return active_; }
  // Rollout r's keys, what its prefix tree is built over: its tokens when inactive.
  absl::Span<const TokenId> keys(RolloutIndex r) const;
  // The token id of a key.
  TokenId token(TokenId key) const { return active_ ? key_tokens_[key] : key; }
  // Unique tokens that the keys' tree holds beyond the tokens' tree: what disagreeing routings of
  // shared prefixes cost (0 when inactive).
  int64_t split_tokens() const { return split_tokens_; }

  // The routing of positions [begin, end) of rollout r, as the model's sparse layers read it:
  // [end - begin, sparse layers, top_k] int32 on `device`, kNotRecorded where the token routes
  // itself. Undefined when inactive.
  at::Tensor Rows(RolloutIndex r, int64_t begin, int64_t end, const at::Device& device) const;
  // The same for positions (rollouts[i], positions[i]): [n, sparse layers, top_k].
  at::Tensor Rows(absl::Span<const RolloutIndex> rollouts, absl::Span<const int64_t> positions,
                  const at::Device& device) const;

 private:
  // Rollout r's routing of its token at `position` at the sparse layers, into `out` (S x k ids).
  void CopyRow(RolloutIndex r, int64_t position, int32_t* out) const;
  // Rollout r's row at `position`, or null where it routes itself at every sparse layer.
  const int32_t* RecordedRow(RolloutIndex r, int64_t position) const;

  absl::Span<const Rollout> rollouts_;
  RoutingShape shape_;
  bool active_ = false;
  // Per rollout: where its rows keep the sparse layers (empty without routed experts).
  std::vector<std::vector<int32_t>> row_layers_;
  std::vector<std::vector<TokenId>> keys_;  // per rollout, when active
  std::vector<TokenId> key_tokens_;         // per key, when active
  int64_t split_tokens_ = 0;
};

}  // namespace dta::engine

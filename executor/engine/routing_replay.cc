#include "executor/engine/routing_replay.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "executor/device/host_to_device.h"

namespace dta::engine {
namespace {

// A token and its routing at the sparse layers, as the key interning compares them: by value.
struct RoutedToken {
  TokenId token = 0;
  const int32_t* row = nullptr;  // the token's row of ids; null where it routes itself
  const std::vector<int32_t>* layers = nullptr;  // where the row keeps the sparse layers
  int32_t top_k = 0;

  const int32_t* layer(size_t s) const { return row + int64_t{(*layers)[s]} * top_k; }

  template <typename H>
  friend H AbslHashValue(H h, const RoutedToken& t) {
    h = H::combine(std::move(h), t.token, t.row != nullptr);
    if (t.row == nullptr) return h;
    for (size_t s = 0; s < t.layers->size(); ++s)
      h = H::combine_contiguous(std::move(h), t.layer(s), static_cast<size_t>(t.top_k));
    return h;
  }
  friend bool operator==(const RoutedToken& a, const RoutedToken& b) {
    if (a.token != b.token || (a.row == nullptr) != (b.row == nullptr)) return false;
    if (a.row == nullptr) return true;
    for (size_t s = 0; s < a.layers->size(); ++s) {
      if (!std::equal(a.layer(s), a.layer(s) + a.top_k, b.layer(s))) return false;
    }
    return true;
  }
};

int64_t TreeTokens(absl::Span<const Rollout> rollouts,
                   const std::function<absl::Span<const TokenId>(RolloutIndex)>& sequence) {
  PrefixTreeBuilder builder;
  for (RolloutIndex r = 0; r < static_cast<RolloutIndex>(rollouts.size()); ++r)
    TORCH_CHECK(builder.AddRollout(sequence(r)).ok(), "rollout '", rollouts[r].id, "'");
  return builder.num_tree_tokens();
}

}  // namespace

RoutingReplay::RoutingReplay(const ModelConfig& config, absl::Span<const Rollout> rollouts)
    : rollouts_(rollouts), shape_(RoutingShapeOf(config)) {
  row_layers_.resize(rollouts.size());
  for (size_t r = 0; r < rollouts.size(); ++r) {
    const Rollout& rollout = rollouts[r];
    if (!rollout.routed_experts) continue;
    TORCH_CHECK(!shape_.sparse_layers.empty(), "rollout '", rollout.id,
                "': field 'routed_experts': the model (", config.model_type,
                ") has no mixture-of-experts layers to replay them in");
    const RoutedExperts& routed = *rollout.routed_experts;
    const absl::Status status =
        ValidateRoutedExperts(routed, static_cast<int64_t>(rollout.tokens.size()), shape_);
    TORCH_CHECK(status.ok(), "rollout '", rollout.id, "': ", std::string(status.message()));
    row_layers_[r] = *SparseLayersInRow(routed, shape_);
    active_ = true;
  }
  if (!active_) return;

  absl::flat_hash_map<RoutedToken, TokenId> interned;
  keys_.resize(rollouts.size());
  for (size_t r = 0; r < rollouts.size(); ++r) {
    const std::vector<TokenId>& tokens = rollouts[r].tokens;
    std::vector<TokenId>& keys = keys_[r];
    keys.resize(tokens.size());
    for (size_t p = 0; p < tokens.size(); ++p) {
      const RoutedToken routed{.token = tokens[p],
                               .row = RecordedRow(static_cast<RolloutIndex>(r), p),
                               .layers = &row_layers_[r],
                               .top_k = shape_.top_k};
      const auto [it, inserted] = interned.try_emplace(routed, key_tokens_.size());
      if (inserted) {
        TORCH_CHECK(key_tokens_.size() < static_cast<size_t>(std::numeric_limits<TokenId>::max()),
                    "routing replay: more than 2^31 - 1 distinct (token, routing) pairs");
        key_tokens_.push_back(tokens[p]);
      }
      keys[p] = it->second;
    }
  }
  split_tokens_ = TreeTokens(rollouts, [&](RolloutIndex r) { return keys(r); }) -
                  TreeTokens(rollouts, [&](RolloutIndex r) {
                    return absl::MakeConstSpan(rollouts_[r].tokens);
                  });
}

absl::Span<const TokenId> RoutingReplay::keys(RolloutIndex r) const {
  return active_ ? absl::MakeConstSpan(keys_[r]) : absl::MakeConstSpan(rollouts_[r].tokens);
}

const int32_t* RoutingReplay::RecordedRow(RolloutIndex r, int64_t position) const {
  const std::optional<RoutedExperts>& routed = rollouts_[r].routed_experts;
  if (!routed || position >= routed->rows()) return nullptr;
  const int32_t* row = routed->ids.data() + position * routed->layers * routed->top_k;
  for (const int32_t layer : row_layers_[r]) {
    // A (row, layer) is recorded whole or not at all (ValidateRoutedExperts).
    if (row[int64_t{layer} * routed->top_k] != kNotRecorded) return row;
  }
  return nullptr;
}

void RoutingReplay::CopyRow(RolloutIndex r, int64_t position, int32_t* out) const {
  const int64_t k = shape_.top_k;
  const int64_t row_size = static_cast<int64_t>(shape_.sparse_layers.size()) * k;
  const int32_t* row = RecordedRow(r, position);
  if (row == nullptr) {
    std::fill(out, out + row_size, kNotRecorded);
    return;
  }
  const std::vector<int32_t>& layers = row_layers_[r];
  for (size_t s = 0; s < layers.size(); ++s)
    std::copy(row + layers[s] * k, row + (layers[s] + 1) * k, out + s * k);
}

at::Tensor RoutingReplay::Rows(absl::Span<const RolloutIndex> rollouts,
                               absl::Span<const int64_t> positions,
                               const at::Device& device) const {
  if (!active_) return at::Tensor();
  TORCH_CHECK(rollouts.size() == positions.size(), "internal: rollouts and positions differ");
  const int64_t sparse = static_cast<int64_t>(shape_.sparse_layers.size());
  const int64_t n = static_cast<int64_t>(positions.size());
  at::Tensor host = at::empty({n, sparse, shape_.top_k}, at::TensorOptions().dtype(at::kInt));
  int32_t* out = host.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i)
    CopyRow(rollouts[i], positions[i], out + i * sparse * shape_.top_k);
  return CopyToDevice(host, at::TensorOptions().dtype(at::kInt).device(device));
}

at::Tensor RoutingReplay::Rows(RolloutIndex r, int64_t begin, int64_t end,
                               const at::Device& device) const {
  if (!active_) return at::Tensor();
  std::vector<RolloutIndex> rollouts(end - begin, r);
  std::vector<int64_t> positions(end - begin);
  for (int64_t p = begin; p < end; ++p) positions[p - begin] = p;
  return Rows(rollouts, positions, device);
}

}  // namespace dta::engine

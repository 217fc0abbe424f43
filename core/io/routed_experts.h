// The experts an inference engine routed each token to, per mixture-of-experts layer: what a
// rollout carries for routing replay (docs/expert_parallelism.md, "Routing replay"), so that
// training routes every token as the engine did. SGLang (--enable-return-routed-experts,
// meta_info["routed_experts"]) and vLLM return it as little-endian int32 [rows, layers, top_k] in
// base64, rows = the rollout's tokens less the last sampled one (never forwarded), layers = every
// decoder layer (dense layers' rows unused).
//
// Example:
//   absl::StatusOr<RoutedExperts> routed =
//       DecodeRoutedExperts(meta_info_base64, /*layers=*/48, /*top_k=*/8);
//   RETURN_IF_ERROR(ValidateRoutedExperts(*routed, rollout.tokens.size(), model_shape));
//
// Thread safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/model/model_config.h"

namespace dta {

// A token-layer whose experts the engine did not record: the trainer's router picks them.
inline constexpr int32_t kNotRecorded = -1;

struct RoutedExperts {
  int32_t layers = 0;  // per row
  int32_t top_k = 0;   // per row and layer
  // [rows][layers][top_k], row-major: row t holds token t's experts at every layer, in the engine's
  // order; a (row, layer) of kNotRecorded ids routes itself.
  std::vector<int32_t> ids;

  int64_t rows() const;
  int32_t at(int64_t row, int32_t layer, int32_t slot) const;
  bool operator==(const RoutedExperts&) const = default;
};

// SGLang's and vLLM's payload: base64 of little-endian int32 [rows, layers, top_k].
// INVALID_ARGUMENT naming the field "routed_experts" if it is not base64, or its bytes are not a
// whole number of [layers, top_k] int32 rows (layers and top_k must be positive).
absl::StatusOr<RoutedExperts> DecodeRoutedExperts(std::string_view base64, int32_t layers,
                                                  int32_t top_k);

// The same payload for `routed` (what DecodeRoutedExperts reads back).
std::string EncodeRoutedExperts(const RoutedExperts& routed);

// What a model asks of the routed experts it replays.
struct RoutingShape {
  int32_t num_hidden_layers = 0;
  std::vector<int32_t> sparse_layers;  // the decoder layers with routed experts, increasing
  int32_t top_k = 0;                   // experts per token
  int64_t num_experts = 0;             // per sparse layer

  bool operator==(const RoutingShape&) const = default;
};

// The routing `config` replays: its sparse layers (IsSparseLayer), top-k and experts.
RoutingShape RoutingShapeOf(const ModelConfig& config);

// OK if `routed` fits a rollout of `tokens` tokens, whatever the model: layers and top_k positive,
// rows = tokens or tokens - 1, every id >= kNotRecorded, and each (row, layer) recorded whole or
// not at all (an engine's unused dense-layer rows hold experts, not holes). Otherwise
// INVALID_ARGUMENT "field 'routed_experts': ..." naming the row and layer at fault.
absl::Status ValidateRoutedExperts(const RoutedExperts& routed, int64_t tokens);

// Where in a row the sparse layers' experts sit: model.sparse_layers when a row holds every decoder
// layer (SGLang's and vLLM's payload; dense layers' entries are unused), 0 .. S - 1 when it holds
// the S sparse layers only. INVALID_ARGUMENT if routed.layers is neither or top_k is not the
// model's.
absl::StatusOr<std::vector<int32_t>> SparseLayersInRow(const RoutedExperts& routed,
                                                       const RoutingShape& model);

// The model-free checks and, at each sparse layer of each row, either k distinct ids in
// [0, num_experts) or all kNotRecorded; errors name the row, the decoder layer (whatever the row's
// form) and the ids.
absl::Status ValidateRoutedExperts(const RoutedExperts& routed, int64_t tokens,
                                   const RoutingShape& model);

}  // namespace dta

#include "core/io/routed_experts.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/base/absl_string_view.h"
#include "core/base/field_error.h"

namespace dta {
namespace {

constexpr std::string_view kField = "routed_experts";

absl::Status CheckShape(int32_t layers, int32_t top_k) {
  if (layers <= 0 || top_k <= 0) {
    return FieldError(
        kField, absl::StrCat("layers (", layers, ") and top_k (", top_k, ") must be positive"));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t RoutedExperts::rows() const {
  const int64_t per_row = static_cast<int64_t>(layers) * top_k;
  return per_row > 0 ? static_cast<int64_t>(ids.size()) / per_row : 0;
}

int32_t RoutedExperts::at(int64_t row, int32_t layer, int32_t slot) const {
  return ids[(row * layers + layer) * top_k + slot];
}

absl::StatusOr<RoutedExperts> DecodeRoutedExperts(std::string_view base64, int32_t layers,
                                                  int32_t top_k) {
  if (absl::Status shape = CheckShape(layers, top_k); !shape.ok()) return shape;
  std::string bytes;
  if (!absl::Base64Unescape(AsAbsl(base64), &bytes)) {
    return FieldError(kField, "is not base64");
  }
  const size_t row_bytes = static_cast<size_t>(layers) * top_k * 4;
  if (bytes.size() % row_bytes != 0) {
    return FieldError(
        kField, absl::StrCat(bytes.size(), " bytes are not whole rows of ", layers, " layers x ",
                             top_k, " int32 experts (", row_bytes, " bytes)"));
  }
  RoutedExperts routed{.layers = layers, .top_k = top_k, .ids = {}};
  routed.ids.resize(bytes.size() / 4);
  for (size_t i = 0; i < routed.ids.size(); ++i) {
    const auto byte = [&](size_t k) {
      return static_cast<uint32_t>(static_cast<uint8_t>(bytes[4 * i + k]));
    };
    routed.ids[i] = static_cast<int32_t>(byte(0) | byte(1) << 8 | byte(2) << 16 | byte(3) << 24);
  }
  return routed;
}

std::string EncodeRoutedExperts(const RoutedExperts& routed) {
  std::string bytes(routed.ids.size() * 4, '\0');
  for (size_t i = 0; i < routed.ids.size(); ++i) {
    const uint32_t id = static_cast<uint32_t>(routed.ids[i]);
    for (size_t k = 0; k < 4; ++k) bytes[4 * i + k] = static_cast<char>((id >> (8 * k)) & 0xff);
  }
  return absl::Base64Escape(bytes);
}

RoutingShape RoutingShapeOf(const ModelConfig& config) {
  RoutingShape shape{.num_hidden_layers = static_cast<int32_t>(config.num_hidden_layers),
                     .sparse_layers = {},
                     .top_k = static_cast<int32_t>(config.num_experts_per_tok),
                     .num_experts = config.num_experts};
  for (int32_t l = 0; l < shape.num_hidden_layers; ++l)
    if (IsSparseLayer(config, l)) shape.sparse_layers.push_back(l);
  return shape;
}

absl::Status ValidateRoutedExperts(const RoutedExperts& routed, int64_t tokens) {
  if (absl::Status shape = CheckShape(routed.layers, routed.top_k); !shape.ok()) return shape;
  const int64_t per_row = static_cast<int64_t>(routed.layers) * routed.top_k;
  if (static_cast<int64_t>(routed.ids.size()) % per_row != 0) {
    return FieldError(kField, absl::StrCat(routed.ids.size(), " ids are not whole rows of ",
                                           routed.layers, " layers x ", routed.top_k));
  }
  const int64_t rows = routed.rows();
  if (rows != tokens && rows != tokens - 1) {
    return FieldError(kField, absl::StrCat(rows, " rows for ", tokens, " tokens (", tokens, " or ",
                                           tokens - 1, " expected)"));
  }
  for (size_t first = 0; first < routed.ids.size(); first += routed.top_k) {
    const int64_t row = static_cast<int64_t>(first) / per_row;
    const int64_t layer = static_cast<int64_t>(first) % per_row / routed.top_k;
    const auto begin = routed.ids.begin() + static_cast<std::ptrdiff_t>(first);
    const auto end = begin + routed.top_k;
    for (auto id = begin; id != end; ++id) {
      if (*id < kNotRecorded) {
        return FieldError(
            kField, absl::StrCat("row ", row, ", layer ", layer, ": expert ", *id,
                                 " is neither an expert nor ", kNotRecorded, " (not recorded)"));
      }
    }
    const int64_t unrecorded = std::count(begin, end, kNotRecorded);
    if (unrecorded > 0 && unrecorded < routed.top_k) {
      return FieldError(
          kField, absl::StrCat("row ", row, ", layer ", layer, ": [",
                               absl::StrJoin(begin, end, ", "), "] is recorded only in part"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> SparseLayersInRow(const RoutedExperts& routed,
                                                       const RoutingShape& model) {
  if (routed.top_k != model.top_k) {
    return FieldError(kField, absl::StrCat("top_k is ", routed.top_k,
                                           " but the model routes each "
                                           "token to ",
                                           model.top_k, " experts"));
  }
  const int32_t sparse = static_cast<int32_t>(model.sparse_layers.size());
  if (routed.layers == model.num_hidden_layers) return model.sparse_layers;
  if (routed.layers == sparse) {
    std::vector<int32_t> all(sparse);
    for (int32_t s = 0; s < sparse; ++s) all[s] = s;
    return all;
  }
  return FieldError(kField, absl::StrCat(routed.layers, " layers per row, but the model has ",
                                         model.num_hidden_layers, " decoder layers, ", sparse,
                                         " of them with routed experts (a row holds either)"));
}

absl::Status ValidateRoutedExperts(const RoutedExperts& routed, int64_t tokens,
                                   const RoutingShape& model) {
  if (absl::Status free = ValidateRoutedExperts(routed, tokens); !free.ok()) return free;
  absl::StatusOr<std::vector<int32_t>> layers = SparseLayersInRow(routed, model);
  if (!layers.ok()) return layers.status();
  std::vector<int32_t> experts(routed.top_k);
  for (int64_t row = 0; row < routed.rows(); ++row) {
    for (size_t s = 0; s < layers->size(); ++s) {
      for (int32_t slot = 0; slot < routed.top_k; ++slot)
        experts[slot] = routed.at(row, (*layers)[s], slot);
      const auto where = [&] {  // names the decoder layer
        return absl::StrCat("row ", row, ", layer ", model.sparse_layers[s], ": [",
                            absl::StrJoin(experts, ", "), "]");
      };
      const int64_t unrecorded = std::count(experts.begin(), experts.end(), kNotRecorded);
      if (unrecorded == routed.top_k) continue;
      if (unrecorded > 0) {
        return FieldError(kField, absl::StrCat(where(), " is recorded only in part"));
      }
      for (const int32_t id : experts) {
        if (id < 0 || id >= model.num_experts) {
          return FieldError(kField, absl::StrCat(where(), ": expert ", id, " is not in [0, ",
                                                 model.num_experts, ")"));
        }
      }
      std::vector<int32_t> sorted = experts;
      std::sort(sorted.begin(), sorted.end());
      if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
        return FieldError(kField, absl::StrCat(where(), " names an expert twice"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace dta

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

absl::Status ValidateRoutedExperts(const RoutedExperts& routed, int64_t tokens,
                                   int64_t num_experts) {
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
  std::vector<int32_t> experts(routed.top_k);
  for (int64_t row = 0; row < rows; ++row) {
    for (int32_t layer = 0; layer < routed.layers; ++layer) {
      for (int32_t slot = 0; slot < routed.top_k; ++slot)
        experts[slot] = routed.at(row, layer, slot);
      const auto where = [&] {
        return absl::StrCat("row ", row, ", layer ", layer, ": [", absl::StrJoin(experts, ", "),
                            "]");
      };
      const int64_t unrecorded = std::count(experts.begin(), experts.end(), kNotRecorded);
      if (unrecorded == routed.top_k) continue;
      if (unrecorded > 0) {
        return FieldError(kField, absl::StrCat(where(), " is recorded only in part"));
      }
      for (const int32_t id : experts) {
        if (id < 0 || (num_experts > 0 && id >= num_experts)) {
          return FieldError(kField, absl::StrCat(where(), ": expert ", id, " is not in [0, ",
                                                 num_experts > 0 ? absl::StrCat(num_experts)
                                                                 : std::string("experts"),
                                                 ")"));
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

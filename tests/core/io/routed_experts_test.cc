// The experts an engine routed each token to (core/io/routed_experts.h): SGLang's and vLLM's
// base64 int32 payload read and written back, and every rule a replayable rollout keeps, each
// refusal naming the row, the layer and the ids.
#include "core/io/routed_experts.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

using ::testing::HasSubstr;

// What SGLang's tokenizer manager sends: the int32 array's little-endian bytes in base64.
std::string SglangPayload(const std::vector<int32_t>& ids) {
  std::string bytes;
  for (const int32_t id : ids) {
    const uint32_t u = static_cast<uint32_t>(id);
    for (int k = 0; k < 4; ++k) bytes.push_back(static_cast<char>((u >> (8 * k)) & 0xff));
  }
  return absl::Base64Escape(bytes);
}

// 3 rows of 2 layers x top-2: row 1's layer 0 not recorded.
const std::vector<int32_t> kIds = {0, 5, 3, 1, -1, -1, 7, 2, 4, 6, 1, 0};

TEST(RoutedExperts, ReadsTheEnginesPayloadAndWritesItBack) {
  const absl::StatusOr<RoutedExperts> routed = DecodeRoutedExperts(SglangPayload(kIds), 2, 2);
  ASSERT_TRUE(routed.ok()) << routed.status();
  EXPECT_EQ(routed->ids, kIds);
  EXPECT_EQ(routed->rows(), 3);
  EXPECT_EQ(routed->at(2, 1, 0), 1);
  EXPECT_EQ(routed->at(1, 0, 1), kNotRecorded);
  EXPECT_EQ(EncodeRoutedExperts(*routed), SglangPayload(kIds));
  EXPECT_EQ(*DecodeRoutedExperts(EncodeRoutedExperts(*routed), 2, 2), *routed);
  // Ids past 2^24 and negative ones survive the byte order.
  const RoutedExperts wide{.layers = 1, .top_k = 2, .ids = {70000000, -1}};
  EXPECT_EQ(*DecodeRoutedExperts(EncodeRoutedExperts(wide), 1, 2), wide);
}

TEST(RoutedExperts, AMalformedPayloadIsRefused) {
  EXPECT_THAT(DecodeRoutedExperts("not base64!", 2, 2).status().message(),
              HasSubstr("field 'routed_experts': is not base64"));
  EXPECT_THAT(DecodeRoutedExperts(SglangPayload({1, 2, 3}), 2, 2).status().message(),
              HasSubstr("12 bytes are not whole rows of 2 layers x 2 int32 experts (16 bytes)"));
  EXPECT_THAT(DecodeRoutedExperts(SglangPayload(kIds), 0, 2).status().message(),
              HasSubstr("layers (0) and top_k (2) must be positive"));
}

// A model of 3 decoder layers, layers 0 and 2 sparse, 8 experts, top 2.
RoutingShape Model(int64_t experts = 8) {
  return {.num_hidden_layers = 3, .sparse_layers = {0, 2}, .top_k = 2, .num_experts = experts};
}

TEST(RoutedExperts, RowsAreTheTokensOrAllButTheLast) {
  const RoutedExperts routed{.layers = 2, .top_k = 2, .ids = kIds};
  EXPECT_TRUE(ValidateRoutedExperts(routed, 4).ok());  // the last sampled token has no row
  EXPECT_TRUE(ValidateRoutedExperts(routed, 3).ok());
  EXPECT_THAT(ValidateRoutedExperts(routed, 5).message(),
              HasSubstr("3 rows for 5 tokens (5 or 4 expected)"));
  RoutedExperts negative = routed;
  negative.ids[5] = -2;
  EXPECT_THAT(ValidateRoutedExperts(negative, 4).message(),
              HasSubstr("row 1, layer 0: expert -2 is neither an expert nor -1 (not recorded)"));
  RoutedExperts part = routed;
  part.ids[11] = -1;  // row 2, layer 1: [1, -1]
  EXPECT_THAT(ValidateRoutedExperts(part, 4).message(),
              HasSubstr("row 2, layer 1: [1, -1] is recorded only in part"));
}

TEST(RoutedExperts, ARowHoldsEveryDecoderLayerOrTheSparseOnes) {
  const RoutedExperts sparse_only{.layers = 2, .top_k = 2, .ids = kIds};
  EXPECT_EQ(*SparseLayersInRow(sparse_only, Model()), (std::vector<int32_t>{0, 1}));
  const RoutedExperts every{.layers = 3, .top_k = 2, .ids = {}};
  EXPECT_EQ(*SparseLayersInRow(every, Model()), (std::vector<int32_t>{0, 2}));
  EXPECT_THAT(SparseLayersInRow({.layers = 4, .top_k = 2, .ids = {}}, Model()).status().message(),
              HasSubstr("4 layers per row, but the model has 3 decoder layers, 2 of them with "
                        "routed experts"));
  EXPECT_THAT(SparseLayersInRow({.layers = 2, .top_k = 1, .ids = {}}, Model()).status().message(),
              HasSubstr("top_k is 1 but the model routes each token to 2 experts"));
}

TEST(RoutedExperts, EveryRecordedRowNamesKDistinctExpertsOfTheModel) {
  RoutedExperts routed{.layers = 2, .top_k = 2, .ids = kIds};
  EXPECT_TRUE(ValidateRoutedExperts(routed, 4, Model()).ok());
  EXPECT_THAT(ValidateRoutedExperts(routed, 4, Model(7)).message(),
              // Row layer 1 is decoder layer 2, which the message names.
              HasSubstr("row 1, layer 2: [7, 2]: expert 7 is not in [0, 7)"));
  routed.ids[9] = 4;
  EXPECT_THAT(ValidateRoutedExperts(routed, 4, Model()).message(),
              HasSubstr("field 'routed_experts': row 2, layer 0: [4, 4] names an expert twice"));
  routed.ids[9] = -1;
  EXPECT_THAT(ValidateRoutedExperts(routed, 4, Model()).message(),
              HasSubstr("row 2, layer 0: [4, -1] is recorded only in part"));
}

// Rows of every decoder layer: the dense layer's entries are the engine's unused buffer, not
// checked; the sparse layers' are.
TEST(RoutedExperts, OnlyTheSparseLayersOfAFullRowAreChecked) {
  RoutedExperts routed{.layers = 3, .top_k = 2, .ids = {1, 2, 0, 0, 3, 4}};
  EXPECT_TRUE(ValidateRoutedExperts(routed, 1, Model()).ok());
  routed.ids[5] = 3;
  EXPECT_THAT(ValidateRoutedExperts(routed, 1, Model()).message(),
              HasSubstr("row 0, layer 2: [3, 3] names an expert twice"));
}

}  // namespace
}  // namespace dta

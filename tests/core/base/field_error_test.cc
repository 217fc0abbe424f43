#include "core/base/field_error.h"

#include "gtest/gtest.h"

namespace dta {
namespace {

TEST(FieldError, IsInvalidArgumentNamingTheField) {
  const absl::Status status = FieldError("loss_mask", "5 values for 6 tokens");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "field 'loss_mask': 5 values for 6 tokens");
  EXPECT_EQ(FieldOfError(status), "loss_mask");
}

TEST(FieldError, FieldOfErrorNeedsTheFieldPrefix) {
  EXPECT_EQ(FieldOfError(absl::InvalidArgumentError("field 'tokens': empty")), "tokens");
  EXPECT_EQ(FieldOfError(absl::UnimplementedError("field 'rope_scaling': yarn")), "rope_scaling");
  EXPECT_EQ(FieldOfError(absl::InvalidArgumentError("tokens: empty")), "");
  EXPECT_EQ(FieldOfError(absl::InvalidArgumentError("field 'unterminated")), "");
  EXPECT_EQ(FieldOfError(absl::InvalidArgumentError("line 3: field 'id': empty")), "");
  EXPECT_EQ(FieldOfError(absl::OkStatus()), "");
}

}  // namespace
}  // namespace dta

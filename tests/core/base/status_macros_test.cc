#include "core/base/status_macros.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace dta {
namespace {

absl::Status FailsWith(absl::StatusCode code) { return absl::Status(code, "inner"); }

absl::Status ReturnsFirstError(int* reached) {
  RETURN_IF_ERROR(absl::OkStatus());
  ++*reached;
  RETURN_IF_ERROR(FailsWith(absl::StatusCode::kDataLoss));
  ++*reached;
  return absl::OkStatus();
}

TEST(StatusMacros, ReturnIfErrorReturnsTheFirstErrorUnchanged) {
  int reached = 0;
  const absl::Status status = ReturnsFirstError(&reached);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(status.message(), "inner");
  EXPECT_EQ(reached, 1);
}

absl::StatusOr<std::unique_ptr<int>> MakeInt(int value) {
  if (value < 0) return absl::InvalidArgumentError("negative");
  return std::make_unique<int>(value);
}

// Declares, assigns to an existing lvalue and moves a move-only value; two uses on one function
// must not collide.
absl::StatusOr<int> SumOfTwo(int a, int b) {
  ASSIGN_OR_RETURN(std::unique_ptr<int> first, MakeInt(a));
  std::unique_ptr<int> second;
  ASSIGN_OR_RETURN(second, MakeInt(b));
  return *first + *second;
}

TEST(StatusMacros, AssignOrReturnAssignsOrReturns) {
  EXPECT_EQ(*SumOfTwo(3, 4), 7);
  const absl::StatusOr<int> first_bad = SumOfTwo(-1, 4);
  EXPECT_EQ(first_bad.status().code(), absl::StatusCode::kInvalidArgument);
  const absl::StatusOr<int> second_bad = SumOfTwo(1, -4);
  EXPECT_EQ(second_bad.status().message(), "negative");
}

// The macros expand to single statements usable in an unbraced if.
absl::Status InUnbracedIf(bool fail) {
  if (fail) RETURN_IF_ERROR(FailsWith(absl::StatusCode::kAborted));
  return absl::OkStatus();
}

TEST(StatusMacros, ReturnIfErrorIsOneStatement) {
  EXPECT_TRUE(InUnbracedIf(false).ok());
  EXPECT_EQ(InUnbracedIf(true).code(), absl::StatusCode::kAborted);
}

}  // namespace
}  // namespace dta

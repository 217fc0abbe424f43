// RETURN_IF_ERROR and ASSIGN_OR_RETURN for absl::Status / absl::StatusOr (Debian's Abseil 20220623
// has neither; the names are Abseil's, so code keeps reading the same once it does).
//
//   RETURN_IF_ERROR(file.Sync());                  // returns the status when it is not OK
//   ASSIGN_OR_RETURN(Rollout rollout, Parse(line));  // declares rollout, or returns the status
//   ASSIGN_OR_RETURN(plan.partition, Partition(rollouts, k));  // assigns to an existing lvalue
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define RETURN_IF_ERROR(expr)                                     \
  do {                                                            \
    if (::absl::Status dta_status_ = (expr); !dta_status_.ok()) { \
      return dta_status_;                                         \
    }                                                             \
  } while (false)

#define DTA_STATUS_CONCAT_INNER_(a, b) a##b
#define DTA_STATUS_CONCAT_(a, b) DTA_STATUS_CONCAT_INNER_(a, b)

#define ASSIGN_OR_RETURN(lhs, expr) \
  DTA_ASSIGN_OR_RETURN_IMPL_(DTA_STATUS_CONCAT_(dta_statusor_, __LINE__), lhs, expr)

#define DTA_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)    \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = *std::move(statusor)

// Errors that name the field of a record at fault (a rollout, a trajectory, a config.json):
// INVALID_ARGUMENT with a message starting "field '<name>': ", which FieldOfError reads back, so
// a service can count rejections per field and a reader can add where the record came from.
//
//   return FieldError("loss_mask", "5 values for 6 tokens");  // field 'loss_mask': 5 values ...
//   FieldOfError(status) == "loss_mask"
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace dta {

// INVALID_ARGUMENT "field '<field>': <what>".
absl::Status FieldError(std::string_view field, std::string_view what);

// UNIMPLEMENTED "field '<field>': <what>": a valid value that dta does not support (yet).
absl::Status UnsupportedFieldError(std::string_view field, std::string_view what);

// OK if `value` is positive and finite, else FieldError "<value> is not positive and finite".
absl::Status CheckPositiveFinite(std::string_view field, double value);

// The field a FieldError names (any status code), e.g. "loss_mask"; empty when the message does
// not start with "field '<name>'".
std::string FieldOfError(const absl::Status& status);

}  // namespace dta

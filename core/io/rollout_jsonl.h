// Rollouts as JSON Lines: one trajectory per line.
//
//   {"id": "task3-s5-turn2", "group": "task3", "tokens": [151644, 8948, ...],
//    "loss_mask": [0, 0, ..., 1], "logprobs": [0, 0, ..., -0.31],
//    "versions": [-1, ..., 7], "reward": 1.0}
//
// Required: id (string or integer), group (string or integer), tokens, loss_mask (0/1 or
// booleans), logprobs. Optional: versions, reward, advantages, ref_logprobs, routed_experts,
// metadata (any JSON, ignored). routed_experts is SGLang's and vLLM's payload with its shape,
//   "routed_experts": {"layers": 48, "top_k": 8, "dtype": "int32", "base64": "..."}
// or, for small hand-written files, "ids": [[[3, 17, ...], ...], ...] ([rows][layers][top_k], -1
// where not recorded); the writer emits base64. Any other field is an error, so a misspelt optional
// field is never silently dropped. Blank lines are skipped. See rollout.h for what each field means
// and the rules it must obey.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/io/rollout.h"

namespace dta {

struct RolloutReadOptions {
  // Token ids must be below this; 0 (the default) checks only that they are non-negative.
  int64_t vocab_size = 0;
};

// Reads and validates every rollout of a file. On the first bad line: INVALID_ARGUMENT whose
// message names the file, the 1-based line, the rollout id when known and the field, e.g.
// "data.jsonl:17: rollout 'a3': field 'logprobs': 9 values for 10 tokens". Duplicate ids are
// an error naming both lines. NOT_FOUND if the file cannot be opened.
absl::StatusOr<std::vector<Rollout>> ReadRolloutsJsonl(const std::string& path,
                                                       const RolloutReadOptions& options = {});

// Parses and validates one JSON object (no location in the message: the caller adds it).
absl::StatusOr<Rollout> ParseRolloutJson(std::string_view json,
                                         const RolloutReadOptions& options = {});

// One line of JSON (without the newline); floats are written in their shortest exact form, so
// reading the line back gives the same rollout bit for bit.
std::string RolloutToJson(const Rollout& rollout);

// Writes all rollouts, one per line, replacing the file. UNAVAILABLE if it cannot be written.
absl::Status WriteRolloutsJsonl(const std::string& path, absl::Span<const Rollout> rollouts);

}  // namespace dta

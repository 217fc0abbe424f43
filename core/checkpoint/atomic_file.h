// Whole files for the checkpoint code: read at once, and replaced atomically (written to a
// temporary file beside the target, flushed to disk with fsync, then renamed over it, so a reader
// or a crash sees the old file or the new one, never a part of either). The safetensors,
// config.json and generation_config.json writers share it.
//
//   RETURN_IF_ERROR(WriteTextAtomically("/ckpt/step-1/model/config.json", json));
//
// Errors: UNAVAILABLE naming the file (and the temporary file) with the system's reason; the
// temporary file is removed.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace dta {

// Writes the concatenation of `pieces` to `path`.
absl::Status WriteFileAtomically(const std::string& path,
                                 absl::Span<const absl::Span<const uint8_t>> pieces);

// Writes `text` to `path`.
absl::Status WriteTextAtomically(const std::string& path, std::string_view text);

// The contents of `path`; UNAVAILABLE naming it if it cannot be read.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

}  // namespace dta

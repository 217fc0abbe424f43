// Weight deltas: the elements that changed between two published weight sets, so that a rollout
// engine holding step N-1's weights reaches step N's by reading a small file instead of the whole
// model (verl's delta sync). Elements are compared as bit patterns (a bf16 element is its uint16),
// so the result is exact, and NaNs, infinities and -0.0 need no special case.
//
// A delta is two files beside each other, <stem>.safetensors and <stem>.json. For each tensor with
// at least one changed element, the safetensors file holds
//   "<name>/values"     the changed elements' new bit patterns, in increasing index order, in the
//                       tensor's own dtype, shape [changed] (every element when dense)
//   "<name>/positions"  U8, which elements changed (sparse and bitmap only):
//       sparse: the gaps between consecutive changed flat indices, as unsigned LEB128 varints
//               (gap = index - previous index - 1, the first gap being the first index)
//       bitmap: ceil(numel / 8) bytes, element i changed iff bit (i % 8) of byte (i / 8) is set
// and each tensor gets whichever of sparse, bitmap and dense (all elements, no positions) is
// smallest. The JSON index names every tensor of the weights, unchanged ones too:
//   {"format": "dta-weight-delta", "version": 1, "data": "<stem>.safetensors",
//    "base_step": 41, "step": 42, "elements": E, "changed_elements": C,
//    "delta_bytes": D, "full_bytes": F,
//    "tensors": {"<name>": {"dtype": "BF16", "shape": [..], "changed": c,
//                           "encoding": "unchanged" | "sparse" | "bitmap" | "dense"}}}
// delta_bytes is the size of the tensors' data in the safetensors file; full_bytes that of the
// whole weights. bindings/python/dta/weight_delta.py applies it to torch tensors.
//
//   ASSIGN_OR_RETURN(SafetensorsCheckpoint base, SafetensorsCheckpoint::Open(".../step-41/model"));
//   ASSIGN_OR_RETURN(SafetensorsCheckpoint next, SafetensorsCheckpoint::Open(".../step-42/model"));
//   ASSIGN_OR_RETURN(WeightDeltaSummary summary,
//                    WriteWeightDelta(base, next, ".../step-42/model/delta-from-00000041",
//                                     {.base_step = 41, .step = 42}));
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/checkpoint/safetensors.h"

namespace dta {

enum class DeltaEncoding { kUnchanged, kSparse, kBitmap, kDense };

// "unchanged", "sparse", "bitmap", "dense".
std::string_view DeltaEncodingName(DeltaEncoding encoding);
// The inverse; INVALID_ARGUMENT naming the string if it is not one of them.
absl::StatusOr<DeltaEncoding> DeltaEncodingFromName(std::string_view name);

// One tensor's changed elements.
struct TensorDelta {
  DeltaEncoding encoding = DeltaEncoding::kUnchanged;
  int64_t numel = 0;
  int64_t changed = 0;             // elements whose bits differ
  std::vector<uint8_t> positions;  // sparse: LEB128 gaps; bitmap: the bitmap; else empty
  std::vector<uint8_t> values;     // the changed elements' new bytes in index order (dense: all)

  int64_t nbytes() const { return static_cast<int64_t>(positions.size() + values.size()); }
};

// Compares `base` and `target` element by element (`element_size` bytes each: 1, 2, 4 or 8) and
// encodes the changes as the smallest of sparse, bitmap and dense (kUnchanged when none changed).
// INVALID_ARGUMENT if the element size is not one of those, or the spans differ in size or are not
// a whole number of elements.
absl::StatusOr<TensorDelta> EncodeTensorDelta(absl::Span<const uint8_t> base,
                                              absl::Span<const uint8_t> target,
                                              int64_t element_size);

// Overwrites the changed elements of `tensor` (numel * element_size bytes, as the delta was
// encoded from). INVALID_ARGUMENT, leaving `tensor` unchanged, if the delta does not fit it:
// positions that do not decode, run past the tensor or disagree with the number of values, a
// bitmap of the wrong size or with bits set past the end, dense values of the wrong size.
absl::Status ApplyTensorDelta(DeltaEncoding encoding, absl::Span<const uint8_t> positions,
                              absl::Span<const uint8_t> values, int64_t element_size,
                              absl::Span<uint8_t> tensor);

struct WeightDeltaOptions {
  // Recorded in the index for receivers to check (the step whose weights the delta applies to,
  // and the step it produces); -1: not recorded.
  int64_t base_step = -1;
  int64_t step = -1;
  // Threads comparing tensors (each tensor on one thread).
  int threads = 1;
};

struct WeightDeltaSummary {
  std::string index_path;  // <stem>.json
  std::string data_path;   // <stem>.safetensors
  int64_t tensors = 0;
  int64_t changed_tensors = 0;
  int64_t elements = 0;
  int64_t changed_elements = 0;
  int64_t delta_bytes = 0;  // encoded data (positions and values)
  int64_t full_bytes = 0;   // the whole target weights' data
};

// Writes the delta from `base` to `target` as <stem>.safetensors and <stem>.json, each replaced
// atomically, the index last (a reader that finds the index finds its data). The encoded tensors
// are held in memory until written: at most the target's size. INVALID_ARGUMENT naming the tensor
// if the two do not hold the same tensor names with the same dtypes and shapes; UNAVAILABLE
// naming the file if it cannot be written.
absl::StatusOr<WeightDeltaSummary> WriteWeightDelta(const SafetensorsCheckpoint& base,
                                                    const SafetensorsCheckpoint& target,
                                                    const std::string& stem,
                                                    const WeightDeltaOptions& options = {});

// A tensor a delta is applied to: bytes owned by the caller.
struct MutableTensorView {
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  absl::Span<uint8_t> data;  // numel * DTypeSize(dtype) bytes
};

// Applies the delta whose index is `index_path` to `tensors` in place. Every tensor the index
// names must be there with its dtype and shape (others are left alone), and all are checked before
// any is changed: INVALID_ARGUMENT naming the tensor if one is missing or differs, or if the index
// or its data is malformed (naming the file); NOT_FOUND / UNAVAILABLE if a file is missing or
// cannot be read.
absl::Status ApplyWeightDelta(const std::string& index_path,
                              const std::map<std::string, MutableTensorView>& tensors);

}  // namespace dta

// Safetensors files and checkpoint directories, without LibTorch.
//
// A safetensors file is an 8-byte little-endian length N, N bytes of JSON header, then the data
// buffer:
//
//   {"__metadata__": {"format": "pt"},
//    "model.norm.weight": {"dtype": "BF16", "shape": [1024], "data_offsets": [0, 2048]}, ...}
//
// data_offsets are [begin, end) byte offsets into the data buffer; tensors are little-endian and
// row-major. A checkpoint directory holds either one model.safetensors or the shards named by
// model.safetensors.index.json ({"metadata": {...}, "weight_map": {tensor: shard file}}), as
// Hugging Face writes them.
//
// Readers memory-map the files and hand out views of the raw bytes; converting them to a
// framework's tensors (and dtypes) is the caller's business. A file must not be truncated or
// rewritten in place while it is open (the writers below replace files by renaming, which is
// safe: an open mapping keeps the old contents).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace dta {

// The element types of the safetensors format (the 4- and 6-bit float types are not supported).
enum class DType {
  kF64,
  kF32,
  kBF16,
  kF16,
  kF8E4M3,
  kF8E5M2,
  kI64,
  kI32,
  kI16,
  kI8,
  kU64,
  kU32,
  kU16,
  kU8,
  kBool,
};

// The name the format uses: "F64", "F32", "BF16", "F16", "F8_E4M3", "F8_E5M2", "I64", "I32",
// "I16", "I8", "U64", "U32", "U16", "U8", "BOOL".
std::string_view DTypeName(DType dtype);
// Bytes per element (BOOL is one byte).
int64_t DTypeSize(DType dtype);
// The inverse of DTypeName; INVALID_ARGUMENT naming the string if it is not one of them.
absl::StatusOr<DType> DTypeFromName(std::string_view name);

// One tensor of an open file. `data` points into the file's mapping and stays valid as long as
// the SafetensorsFile (or SafetensorsCheckpoint) that produced it, even when that is moved.
// The data is only as aligned as the file makes it: files written by WriteSafetensors align every
// tensor to its element size (relative to a page-aligned mapping), others may not.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // [] for a scalar
  absl::Span<const uint8_t> data;

  int64_t numel() const;  // product of shape; 1 for a scalar, 0 when any dimension is 0
  int64_t nbytes() const { return static_cast<int64_t>(data.size()); }
};

// "[2, 3]", for messages.
std::string ShapeToString(absl::Span<const int64_t> shape);

// A whole safetensors file, memory-mapped read-only and validated. Movable, not copyable.
class SafetensorsFile {
 public:
  // Maps and validates the file. NOT_FOUND if it does not exist, UNAVAILABLE if it cannot be
  // read or mapped, INVALID_ARGUMENT (naming the file and, where there is one, the tensor) if:
  // it is shorter than 8 bytes; the header length runs past the end of the file or exceeds
  // 100 MB; the header is not a JSON object; a key appears twice; "__metadata__" is not an
  // object of strings; a tensor entry is not an object with exactly "dtype", "shape" and
  // "data_offsets"; the dtype is unknown; a dimension is negative or not an integer;
  // data_offsets is not [begin, end] with begin <= end <= the data size; end - begin differs from
  // numel * dtype size; or the tensors do not tile the data buffer exactly (a gap, an overlap, or
  // bytes after the last tensor: the reference implementation rejects these too).
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // Every tensor, sorted by name.
  const std::vector<TensorView>& tensors() const { return tensors_; }
  // nullptr if there is no tensor of that name.
  const TensorView* Find(std::string_view name) const;
  // The "__metadata__" entries (empty if the header has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  struct Mapping;
  SafetensorsFile() = default;

  std::string path_;
  std::unique_ptr<Mapping> mapping_;
  std::vector<TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint: a directory with model.safetensors, or with model.safetensors.index.json and the
// shards it names (model.safetensors wins when both exist, as in Hugging Face's loader). Movable,
// not copyable; views stay valid while it lives.
class SafetensorsCheckpoint {
 public:
  // `path` is the directory, or a .safetensors file, or an index .json file. NOT_FOUND if the
  // directory holds neither file. Besides every SafetensorsFile::Open error (which names the
  // shard), INVALID_ARGUMENT naming the index file when it is not JSON, has no "weight_map"
  // object, maps a tensor to something other than a plain file name in the same directory, or
  // disagrees with the shards: a mapped tensor missing from its shard, or a shard holding a
  // tensor that the weight_map does not assign to it.
  static absl::StatusOr<SafetensorsCheckpoint> Open(const std::string& path);

  SafetensorsCheckpoint(SafetensorsCheckpoint&&) = default;
  SafetensorsCheckpoint& operator=(SafetensorsCheckpoint&&) = default;
  SafetensorsCheckpoint(const SafetensorsCheckpoint&) = delete;
  SafetensorsCheckpoint& operator=(const SafetensorsCheckpoint&) = delete;

  // Every tensor name across the shards, sorted.
  const std::vector<std::string>& names() const { return names_; }
  // nullptr if there is no tensor of that name.
  const TensorView* Find(std::string_view name) const;
  // The tensor, checked to have exactly `shape`: NOT_FOUND naming the checkpoint and the tensor
  // if it is missing, INVALID_ARGUMENT naming the file, the tensor and both shapes if not.
  absl::StatusOr<const TensorView*> Get(std::string_view name,
                                        absl::Span<const int64_t> shape) const;
  // The file holding the tensor, or nullptr.
  const SafetensorsFile* FileOf(std::string_view name) const;
  // The opened files (one, or one per shard in file-name order).
  const std::vector<SafetensorsFile>& files() const { return files_; }
  // Sum of the tensors' data sizes.
  int64_t total_bytes() const { return total_bytes_; }

 private:
  SafetensorsCheckpoint() = default;

  std::string path_;
  std::vector<SafetensorsFile> files_;
  std::vector<std::string> names_;                             // sorted
  std::vector<std::pair<size_t, const TensorView*>> entries_;  // file index and view, as names_
  int64_t total_bytes_ = 0;
};

// A tensor to write; `data` holds numel * DTypeSize(dtype) little-endian row-major bytes.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  absl::Span<const uint8_t> data;
};

// Writes one file, replacing `path` atomically (a temporary file renamed over it). The header is
// compact JSON padded with spaces to a multiple of 8 bytes, as the reference implementation
// writes it, and the tensors are laid out by element size, largest first, then by name, so every
// tensor is aligned to its element size. INVALID_ARGUMENT (naming the tensor) if a data size is
// not numel * dtype size, a dimension is negative, a name repeats or is "__metadata__";
// UNAVAILABLE (naming the file) if it cannot be written.
absl::Status WriteSafetensors(const std::string& path, absl::Span<const TensorToWrite> tensors,
                              const std::map<std::string, std::string>& metadata = {});

// Writes a checkpoint directory (created if missing) that Hugging Face can load: one
// model.safetensors when the data totals at most `max_shard_bytes`, else shards
// model-0000k-of-0000n.safetensors plus model.safetensors.index.json (metadata.total_size and a
// sorted weight_map). Tensors go into shards in the given order, a new shard starting when the
// next tensor would overflow the current one (a tensor larger than the limit gets a shard of its
// own). Every file carries the metadata {"format": "pt"}. Files of the other layout and stale
// shards left by an earlier save are removed. With `index_one_file`, a single model.safetensors
// gets an index too (every tensor mapped to it): SGLang's and vLLM's loaders glob *.safetensors and
// load only the files an index names, so a published model carries one whatever its size. Errors
// as WriteSafetensors, and INVALID_ARGUMENT if max_shard_bytes is not positive.
absl::Status WriteSafetensorsCheckpoint(const std::string& directory,
                                        absl::Span<const TensorToWrite> tensors,
                                        int64_t max_shard_bytes = int64_t{5} << 30,
                                        bool index_one_file = false);

}  // namespace dta

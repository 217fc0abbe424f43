#include "core/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/base/absl_string_view.h"
#include "core/base/status_macros.h"
#include "core/checkpoint/atomic_file.h"
#include "nlohmann/json.hpp"

namespace dta {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// The reference implementation refuses headers above this size.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

constexpr char kSingleFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  int64_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kF64, "F64", 8}, {DType::kF32, "F32", 4},        {DType::kBF16, "BF16", 2},
    {DType::kF16, "F16", 2}, {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kF8E5M2, "F8_E5M2", 1},
    {DType::kI64, "I64", 8}, {DType::kI32, "I32", 4},        {DType::kI16, "I16", 2},
    {DType::kI8, "I8", 1},   {DType::kU64, "U64", 8},        {DType::kU32, "U32", 4},
    {DType::kU16, "U16", 2}, {DType::kU8, "U8", 1},          {DType::kBool, "BOOL", 1},
};

const DTypeInfo& Info(DType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  return kDTypes[0];  // unreachable for a valid enum value
}

std::string ErrnoText() { return std::strerror(errno); }

// The product of the dimensions and that times `element_size`, or false on a negative dimension
// or overflow.
bool CountBytes(absl::Span<const int64_t> shape, int64_t element_size, int64_t* numel,
                int64_t* bytes) {
  int64_t n = 1;
  for (int64_t dim : shape) {
    if (dim < 0 || __builtin_mul_overflow(n, dim, &n)) return false;
  }
  *numel = n;
  return !__builtin_mul_overflow(n, element_size, bytes);
}

std::string TensorPrefix(const std::string& path, std::string_view name) {
  return absl::StrCat(path, ": tensor '", AsAbsl(name), "': ");
}

absl::Status TensorError(const std::string& path, std::string_view name, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(TensorPrefix(path, name), AsAbsl(what)));
}

absl::Status FileError(const std::string& path, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", AsAbsl(what)));
}

// A non-negative integer below 2^63 in `value`, else an error message.
bool AsNonNegative(const Json& value, int64_t* out) {
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  if (value.is_number_integer()) {
    const int64_t i = value.get<int64_t>();
    if (i < 0) return false;
    *out = i;
    return true;
  }
  return false;
}

// One tensor entry of a header: its view is filled in (without data) and its offsets returned.
absl::Status ParseTensorEntry(const std::string& path, const std::string& name, const Json& entry,
                              TensorView& view, int64_t* begin, int64_t* end) {
  view.name = name;
  if (!entry.is_object()) return TensorError(path, name, "entry is not a JSON object");
  for (const auto& [key, value] : entry.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return TensorError(
          path, name,
          absl::StrCat("unexpected field '", key, "' (expected dtype, shape, data_offsets)"));
    }
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(key)) return TensorError(path, name, absl::StrCat("missing '", key, "'"));
  }

  const Json& dtype = entry["dtype"];
  if (!dtype.is_string()) return TensorError(path, name, "'dtype' is not a string");
  absl::StatusOr<DType> parsed = DTypeFromName(dtype.get_ref<const std::string&>());
  if (!parsed.ok()) return TensorError(path, name, std::string(parsed.status().message()));
  view.dtype = *parsed;

  const Json& shape = entry["shape"];
  if (!shape.is_array()) return TensorError(path, name, "'shape' is not an array");
  for (size_t i = 0; i < shape.size(); ++i) {
    int64_t dim;
    if (!AsNonNegative(shape[i], &dim)) {
      return TensorError(path, name,
                         absl::StrCat("'shape' dimension ", i, " = ", shape[i].dump(),
                                      " is not a non-negative integer"));
    }
    view.shape.push_back(dim);
  }

  const Json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !AsNonNegative(offsets[0], begin) ||
      !AsNonNegative(offsets[1], end)) {
    return TensorError(path, name,
                       absl::StrCat("'data_offsets' = ", offsets.dump(),
                                    " is not [begin, end] of non-negative integers"));
  }
  return absl::OkStatus();
}

absl::Span<const uint8_t> Bytes(std::string_view s) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// Every tensor well-formed, no name twice.
absl::Status ValidateTensorsToWrite(const std::string& path,
                                    absl::Span<const TensorToWrite> tensors) {
  std::set<std::string_view> names;
  for (const TensorToWrite& tensor : tensors) {
    if (tensor.name == "__metadata__") {
      return TensorError(path, tensor.name, "the name is reserved for the header's metadata");
    }
    if (!names.insert(tensor.name).second) return TensorError(path, tensor.name, "duplicate name");
    int64_t numel, bytes;
    if (!CountBytes(tensor.shape, DTypeSize(tensor.dtype), &numel, &bytes)) {
      return TensorError(path, tensor.name,
                         absl::StrCat("shape ", ShapeToString(tensor.shape),
                                      " has a negative dimension or too many elements"));
    }
    if (bytes != static_cast<int64_t>(tensor.data.size())) {
      return TensorError(
          path, tensor.name,
          absl::StrCat(tensor.data.size(), " bytes of data for shape ", ShapeToString(tensor.shape),
                       " of ", AsAbsl(DTypeName(tensor.dtype)), " (", bytes, " bytes)"));
    }
  }
  return absl::OkStatus();
}

// model-00001-of-00002.safetensors and the like.
bool IsShardName(std::string_view name) {
  constexpr std::string_view kExample = "model-00001-of-00002.safetensors";
  if (name.size() != kExample.size()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const bool digit_expected = (i >= 6 && i < 11) || (i >= 15 && i < 20);
    if (digit_expected ? !(name[i] >= '0' && name[i] <= '9') : name[i] != kExample[i]) return false;
  }
  return true;
}

// Removes the file if it exists; errors are UNAVAILABLE.
absl::Status RemoveIfPresent(const fs::path& path) {
  std::error_code error;
  fs::remove(path, error);
  if (error) {
    return absl::UnavailableError(
        absl::StrCat(path.string(), ": cannot remove (", error.message(), ")"));
  }
  return absl::OkStatus();
}

// Removes the shard files in `directory` that are not in `keep`.
absl::Status RemoveStaleShards(const fs::path& directory, const std::set<std::string>& keep) {
  std::error_code error;
  std::vector<fs::path> stale;
  for (const fs::directory_entry& entry : fs::directory_iterator(directory, error)) {
    const std::string name = entry.path().filename().string();
    if (IsShardName(name) && !keep.count(name)) stale.push_back(entry.path());
  }
  if (error) {
    return absl::UnavailableError(
        absl::StrCat(directory.string(), ": cannot list (", error.message(), ")"));
  }
  for (const fs::path& path : stale) {
    RETURN_IF_ERROR(RemoveIfPresent(path));
  }
  return absl::OkStatus();
}

}  // namespace

std::string_view DTypeName(DType dtype) { return Info(dtype).name; }

int64_t DTypeSize(DType dtype) { return Info(dtype).size; }

absl::StatusOr<DType> DTypeFromName(std::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown or unsupported dtype '", AsAbsl(name), "'"));
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t dim : shape) n *= dim;
  return n;
}

std::string ShapeToString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

struct SafetensorsFile::Mapping {
  void* address = nullptr;
  size_t size = 0;

  Mapping(void* address, size_t size) : address(address), size(size) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (address != nullptr) ::munmap(address, size);
  }
  const uint8_t* bytes() const { return static_cast<const uint8_t*>(address); }
};

SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::UnavailableError(absl::StrCat(path, ": cannot open (", ErrnoText(), ")"));
  }
  struct stat info;
  if (::fstat(fd, &info) != 0) {
    const std::string error = ErrnoText();
    ::close(fd);
    return absl::UnavailableError(absl::StrCat(path, ": cannot stat (", error, ")"));
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    return FileError(path, "not a regular file");
  }
  const uint64_t file_size = static_cast<uint64_t>(info.st_size);
  if (file_size < 8) {
    ::close(fd);
    return FileError(path, absl::StrCat("only ", file_size,
                                        " bytes, too short for a safetensors file (the header "
                                        "length alone takes 8)"));
  }
  void* address = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  const std::string map_error = address == MAP_FAILED ? ErrnoText() : "";
  ::close(fd);
  if (address == MAP_FAILED) {
    return absl::UnavailableError(absl::StrCat(path, ": cannot mmap (", map_error, ")"));
  }

  SafetensorsFile file;
  file.path_ = path;
  file.mapping_ = std::make_unique<Mapping>(address, file_size);
  const uint8_t* bytes = file.mapping_->bytes();

  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | bytes[i];
  if (header_size > file_size - 8) {
    return FileError(path, absl::StrCat("header length ", header_size, " runs past the end of the ",
                                        file_size, "-byte file"));
  }
  if (header_size > kMaxHeaderBytes) {
    return FileError(path, absl::StrCat("header length ", header_size, " exceeds the limit of ",
                                        kMaxHeaderBytes, " bytes"));
  }
  const char* header_begin = reinterpret_cast<const char*>(bytes + 8);
  const uint8_t* buffer = bytes + 8 + header_size;
  const int64_t buffer_size = static_cast<int64_t>(file_size - 8 - header_size);

  // Parse, noting keys that appear twice at the top level (the JSON library keeps only the last).
  std::string duplicate;
  std::set<std::string> keys;
  Json header;
  try {
    header =
        Json::parse(header_begin, header_begin + header_size,
                    [&](int depth, Json::parse_event_t event, Json& parsed) {
                      if (event == Json::parse_event_t::key && depth == 1 && parsed.is_string() &&
                          !keys.insert(parsed.get<std::string>()).second && duplicate.empty()) {
                        duplicate = parsed.get<std::string>();
                      }
                      return true;
                    });
  } catch (const Json::exception& e) {
    return FileError(path, absl::StrCat("header is not valid JSON: ", e.what()));
  }
  if (!header.is_object()) return FileError(path, "header is not a JSON object");
  if (!duplicate.empty()) {
    return FileError(path, absl::StrCat("header key '", duplicate, "' appears more than once"));
  }

  struct Extent {
    int64_t begin, end;
    size_t tensor;
  };
  std::vector<Extent> extents;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return FileError(path, "'__metadata__' is not a JSON object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          return FileError(path, absl::StrCat("'__metadata__' entry '", key, "' is not a string"));
        }
        file.metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    TensorView view;
    int64_t begin = 0, end = 0;
    if (absl::Status status = ParseTensorEntry(path, name, entry, view, &begin, &end);
        !status.ok()) {
      return status;
    }
    if (begin > end || end > buffer_size) {
      return TensorError(path, name,
                         absl::StrCat("data_offsets [", begin, ", ", end, "] are not within the ",
                                      buffer_size, "-byte data buffer"));
    }
    int64_t numel = 0, expected = 0;
    const bool fits = CountBytes(view.shape, DTypeSize(view.dtype), &numel, &expected);
    if (!fits || expected != end - begin) {
      return TensorError(path, name,
                         absl::StrCat("data_offsets [", begin, ", ", end, "] hold ", end - begin,
                                      " bytes but shape ", ShapeToString(view.shape), " of ",
                                      AsAbsl(DTypeName(view.dtype)), " needs ",
                                      fits ? absl::StrCat(expected) : "more than 2^63", " bytes"));
    }
    view.data = absl::Span<const uint8_t>(buffer + begin, static_cast<size_t>(end - begin));
    extents.push_back({begin, end, file.tensors_.size()});
    file.tensors_.push_back(std::move(view));
  }

  // The tensors must tile the buffer: each starts where the previous ends, the last ends at the
  // end.
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  int64_t position = 0;
  const std::string* previous = nullptr;
  for (const Extent& extent : extents) {
    const std::string& name = file.tensors_[extent.tensor].name;
    if (extent.begin > position) {
      return TensorError(path, name,
                         absl::StrCat("data_offsets start at ", extent.begin, ", leaving a gap of ",
                                      extent.begin - position, " bytes after ",
                                      previous ? absl::StrCat("tensor '", *previous, "'")
                                               : std::string("the start of the data buffer")));
    }
    if (extent.begin < position) {
      return TensorError(
          path, name,
          absl::StrCat("data_offsets [", extent.begin, ", ", extent.end, "] overlap tensor '",
                       *previous, "', which ends at ", position));
    }
    position = extent.end;
    previous = &name;
  }
  if (position != buffer_size) {
    return FileError(path, absl::StrCat("the data buffer has ", buffer_size - position,
                                        " bytes after the last tensor (", buffer_size,
                                        " bytes, tensors end at ", position, ")"));
  }

  std::sort(file.tensors_.begin(), file.tensors_.end(),
            [](const TensorView& a, const TensorView& b) { return a.name < b.name; });
  return file;
}

const TensorView* SafetensorsFile::Find(std::string_view name) const {
  auto it = std::lower_bound(
      tensors_.begin(), tensors_.end(), name,
      [](const TensorView& view, std::string_view key) { return view.name < key; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsCheckpoint

absl::StatusOr<SafetensorsCheckpoint> SafetensorsCheckpoint::Open(const std::string& path) {
  std::error_code error;
  const fs::file_status status = fs::status(path, error);
  if (!fs::exists(status))
    return absl::NotFoundError(absl::StrCat(path, ": no such file or directory"));

  fs::path single, index;
  if (fs::is_directory(status)) {
    if (fs::exists(fs::path(path) / kSingleFile)) {
      single = fs::path(path) / kSingleFile;
    } else if (fs::exists(fs::path(path) / kIndexFile)) {
      index = fs::path(path) / kIndexFile;
    } else {
      return absl::NotFoundError(
          absl::StrCat(path, ": holds neither ", kSingleFile, " nor ", kIndexFile));
    }
  } else if (std::string_view(path).size() >= 5 &&
             std::string_view(path).substr(path.size() - 5) == ".json") {
    index = path;
  } else {
    single = path;
  }

  SafetensorsCheckpoint checkpoint;
  checkpoint.path_ = path;
  if (!single.empty()) {
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(single.string());
    if (!file.ok()) return file.status();
    checkpoint.files_.push_back(*std::move(file));
    for (const TensorView& view : checkpoint.files_[0].tensors()) {
      checkpoint.names_.push_back(view.name);
      checkpoint.entries_.push_back({0, &view});
      checkpoint.total_bytes_ += view.nbytes();
    }
    return checkpoint;
  }

  const std::string index_path = index.string();
  std::ifstream stream(index_path, std::ios::binary);
  if (!stream) return absl::UnavailableError(absl::StrCat(index_path, ": cannot open"));
  std::stringstream text;
  text << stream.rdbuf();
  Json json;
  try {
    json = Json::parse(text.str());
  } catch (const Json::exception& e) {
    return FileError(index_path, absl::StrCat("not valid JSON: ", e.what()));
  }
  if (!json.is_object() || !json.contains("weight_map") || !json["weight_map"].is_object()) {
    return FileError(index_path, "has no 'weight_map' object");
  }
  const Json& weight_map = json["weight_map"];
  std::map<std::string, std::vector<std::string>> by_shard;
  for (const auto& [name, shard] : weight_map.items()) {
    if (!shard.is_string()) {
      return FileError(index_path, absl::StrCat("weight_map: tensor '", name, "' maps to ",
                                                shard.dump(), ", not a file name"));
    }
    const std::string& file = shard.get_ref<const std::string&>();
    if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos) {
      return FileError(index_path, absl::StrCat("weight_map: tensor '", name, "' maps to '", file,
                                                "', not a file name in the same directory"));
    }
    by_shard[file].push_back(name);
  }

  const fs::path directory = index.parent_path();
  for (const auto& [shard, names] : by_shard) {
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open((directory / shard).string());
    if (!file.ok()) return file.status();
    for (const std::string& name : names) {
      if (file->Find(name) == nullptr) {
        return FileError(index_path, absl::StrCat("weight_map: tensor '", name, "' maps to '",
                                                  shard, "', which does not contain it"));
      }
    }
    for (const TensorView& view : file->tensors()) {
      if (!weight_map.contains(view.name)) {
        return TensorError(file->path(), view.name,
                           absl::StrCat("not in the weight_map of ", index_path));
      }
      const std::string& owner = weight_map[view.name].get_ref<const std::string&>();
      if (owner != shard) {
        return TensorError(
            file->path(), view.name,
            absl::StrCat("the weight_map of ", index_path, " assigns it to '", owner, "'"));
      }
    }
    checkpoint.files_.push_back(*std::move(file));
  }
  // weight_map iterates in name order; find each tensor's file.
  std::map<std::string, size_t> file_of_shard;
  {
    size_t i = 0;
    for (const auto& entry : by_shard) file_of_shard[entry.first] = i++;
  }
  for (const auto& [name, shard] : weight_map.items()) {
    const size_t i = file_of_shard[shard.get<std::string>()];
    const TensorView* view = checkpoint.files_[i].Find(name);
    checkpoint.names_.push_back(name);
    checkpoint.entries_.push_back({i, view});
    checkpoint.total_bytes_ += view->nbytes();
  }
  return checkpoint;
}

const TensorView* SafetensorsCheckpoint::Find(std::string_view name) const {
  auto it = std::lower_bound(names_.begin(), names_.end(), name,
                             [](const std::string& a, std::string_view b) { return a < b; });
  if (it == names_.end() || *it != name) return nullptr;
  return entries_[it - names_.begin()].second;
}

const SafetensorsFile* SafetensorsCheckpoint::FileOf(std::string_view name) const {
  auto it = std::lower_bound(names_.begin(), names_.end(), name,
                             [](const std::string& a, std::string_view b) { return a < b; });
  if (it == names_.end() || *it != name) return nullptr;
  return &files_[entries_[it - names_.begin()].first];
}

absl::StatusOr<const TensorView*> SafetensorsCheckpoint::Get(
    std::string_view name, absl::Span<const int64_t> shape) const {
  const TensorView* view = Find(name);
  if (view == nullptr) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor '", AsAbsl(name), "'"));
  }
  if (absl::Span<const int64_t>(view->shape) != shape) {
    return TensorError(
        FileOf(name)->path(), name,
        absl::StrCat("shape ", ShapeToString(view->shape), ", expected ", ShapeToString(shape)));
  }
  return view;
}

// ---------------------------------------------------------------------------------------------
// Writing

absl::Status WriteSafetensors(const std::string& path, absl::Span<const TensorToWrite> tensors,
                              const std::map<std::string, std::string>& metadata) {
  RETURN_IF_ERROR(ValidateTensorsToWrite(path, tensors));

  // Largest elements first, then by name: with the header padded to 8 bytes, every tensor is
  // aligned to its element size.
  std::vector<const TensorToWrite*> order;
  order.reserve(tensors.size());
  for (const TensorToWrite& tensor : tensors) order.push_back(&tensor);
  std::sort(order.begin(), order.end(), [](const TensorToWrite* a, const TensorToWrite* b) {
    const int64_t size_a = DTypeSize(a->dtype), size_b = DTypeSize(b->dtype);
    if (size_a != size_b) return size_a > size_b;
    return a->name < b->name;
  });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json entries = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) entries[key] = value;
    header["__metadata__"] = std::move(entries);
  }
  int64_t offset = 0;
  for (const TensorToWrite* tensor : order) {
    const int64_t end = offset + static_cast<int64_t>(tensor->data.size());
    header[tensor->name] = {{"dtype", std::string(DTypeName(tensor->dtype))},
                            {"shape", tensor->shape},
                            {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text;
  try {
    text = header.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::strict);
  } catch (const nlohmann::ordered_json::exception& e) {
    return FileError(
        path, absl::StrCat("a tensor name or metadata string is not valid UTF-8 (", e.what(), ")"));
  }
  text.append((8 - text.size() % 8) % 8, ' ');

  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * i));
  std::vector<absl::Span<const uint8_t>> pieces = {absl::Span<const uint8_t>(length, 8),
                                                   Bytes(text)};
  for (const TensorToWrite* tensor : order) pieces.push_back(tensor->data);
  return WriteFileAtomically(path, pieces);
}

absl::Status WriteSafetensorsCheckpoint(const std::string& directory,
                                        absl::Span<const TensorToWrite> tensors,
                                        int64_t max_shard_bytes, bool index_one_file) {
  if (max_shard_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(directory, ": max_shard_bytes = ", max_shard_bytes, " is not positive"));
  }
  RETURN_IF_ERROR(ValidateTensorsToWrite(directory, tensors));
  std::error_code error;
  fs::create_directories(directory, error);
  if (error) {
    return absl::UnavailableError(
        absl::StrCat(directory, ": cannot create (", error.message(), ")"));
  }
  const fs::path dir(directory);
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};

  int64_t total = 0;
  for (const TensorToWrite& tensor : tensors) total += static_cast<int64_t>(tensor.data.size());

  // Greedy packing in the given order (everything in one file when it fits).
  std::vector<std::vector<TensorToWrite>> shards;
  int64_t shard_bytes = 0;
  for (const TensorToWrite& tensor : tensors) {
    const int64_t bytes = static_cast<int64_t>(tensor.data.size());
    if (shards.empty() || (!shards.back().empty() && shard_bytes + bytes > max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(tensor);
    shard_bytes += bytes;
  }
  if (shards.empty()) shards.emplace_back();  // a model without tensors is still one file
  const bool one_file = total <= max_shard_bytes;

  Json weight_map = Json::object();
  std::set<std::string> shard_names;
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string name =
        one_file ? kSingleFile
                 : absl::StrFormat("model-%05d-of-%05d.safetensors", static_cast<int>(k + 1),
                                   static_cast<int>(shards.size()));
    if (absl::Status status = WriteSafetensors((dir / name).string(), shards[k], metadata);
        !status.ok()) {
      return status;
    }
    for (const TensorToWrite& tensor : shards[k]) weight_map[tensor.name] = name;
    shard_names.insert(name);
  }
  if (one_file && !index_one_file) {
    RETURN_IF_ERROR(RemoveIfPresent(dir / kIndexFile));
    return RemoveStaleShards(dir, {});
  }
  Json index = {{"metadata", {{"total_size", total}}}, {"weight_map", std::move(weight_map)}};
  std::string text;
  try {
    text = index.dump(2, ' ', false, Json::error_handler_t::strict) + "\n";
  } catch (const Json::exception& e) {
    return FileError((dir / kIndexFile).string(), e.what());
  }
  RETURN_IF_ERROR(WriteTextAtomically((dir / kIndexFile).string(), text));
  if (!one_file) RETURN_IF_ERROR(RemoveIfPresent(dir / kSingleFile));
  return RemoveStaleShards(dir, shard_names);  // model.safetensors is no shard name
}

}  // namespace dta

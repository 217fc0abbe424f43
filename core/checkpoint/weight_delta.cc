#include "core/checkpoint/weight_delta.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/absl_string_view.h"
#include "core/base/parallel_for.h"
#include "core/base/status_macros.h"
#include "core/checkpoint/atomic_file.h"
#include "nlohmann/json.hpp"

namespace dta {
namespace {

constexpr char kFormat[] = "dta-weight-delta";
constexpr int kVersion = 1;
constexpr char kValuesSuffix[] = "/values";
constexpr char kPositionsSuffix[] = "/positions";

int VarintSize(uint64_t value) {
  int size = 1;
  while (value >= 0x80) {
    value >>= 7;
    ++size;
  }
  return size;
}

void AppendVarint(uint64_t value, std::vector<uint8_t>& out) {
  while (value >= 0x80) {
    out.push_back(static_cast<uint8_t>(value | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<uint8_t>(value));
}

// Calls fn(i) for each element index i, in increasing order, whose bytes differ. Whole 8-byte
// words are compared first: in a step's update most words are unchanged.
template <typename Fn>
void ForEachChanged(const uint8_t* base, const uint8_t* target, int64_t numel, int64_t element_size,
                    const Fn& fn) {
  const int64_t per_word = 8 / element_size;
  const int64_t words = numel / per_word;
  for (int64_t w = 0; w < words; ++w) {
    uint64_t a;
    uint64_t b;
    std::memcpy(&a, base + w * 8, 8);
    std::memcpy(&b, target + w * 8, 8);
    if (a == b) continue;
    for (int64_t i = w * per_word; i < (w + 1) * per_word; ++i) {
      if (std::memcmp(base + i * element_size, target + i * element_size, element_size) != 0) {
        fn(i);
      }
    }
  }
  for (int64_t i = words * per_word; i < numel; ++i) {
    if (std::memcmp(base + i * element_size, target + i * element_size, element_size) != 0) fn(i);
  }
}

bool ValidElementSize(int64_t element_size) {
  return element_size == 1 || element_size == 2 || element_size == 4 || element_size == 8;
}

// Decodes sparse positions, calling fn(index) for each; false if they are malformed or an index
// reaches `numel`.
template <typename Fn>
bool ForEachSparseIndex(absl::Span<const uint8_t> positions, int64_t numel, const Fn& fn) {
  int64_t next = 0;  // the smallest index the next gap can give
  size_t at = 0;
  while (at < positions.size()) {
    uint64_t gap = 0;
    int shift = 0;
    while (true) {
      if (at == positions.size() || shift > 63) return false;
      const uint8_t byte = positions[at++];
      gap |= static_cast<uint64_t>(byte & 0x7f) << shift;
      shift += 7;
      if ((byte & 0x80) == 0) break;
    }
    if (gap >= static_cast<uint64_t>(numel - next)) return false;
    const int64_t index = next + static_cast<int64_t>(gap);
    fn(index);
    next = index + 1;
  }
  return true;
}

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("weight delta: ", what));
}

// Checks that the encoded tensor fits a tensor of `numel` elements.
absl::Status CheckTensorDelta(DeltaEncoding encoding, absl::Span<const uint8_t> positions,
                              absl::Span<const uint8_t> values, int64_t element_size,
                              int64_t numel) {
  if (!ValidElementSize(element_size)) {
    return Invalid(absl::StrCat("element size ", element_size, " is not 1, 2, 4 or 8"));
  }
  if (values.size() % element_size != 0) {
    return Invalid(absl::StrCat(values.size(), " value bytes are not whole elements"));
  }
  const int64_t value_count = static_cast<int64_t>(values.size()) / element_size;
  int64_t count = 0;
  switch (encoding) {
    case DeltaEncoding::kUnchanged:
      if (!positions.empty() || !values.empty()) return Invalid("an unchanged tensor has data");
      return absl::OkStatus();
    case DeltaEncoding::kDense:
      if (!positions.empty() || value_count != numel) {
        return Invalid(absl::StrCat("dense values hold ", value_count, " elements, not ", numel));
      }
      return absl::OkStatus();
    case DeltaEncoding::kSparse:
      if (!ForEachSparseIndex(positions, numel, [&](int64_t) { ++count; })) {
        return Invalid(absl::StrCat("sparse positions do not decode to indices below ", numel));
      }
      break;
    case DeltaEncoding::kBitmap: {
      if (static_cast<int64_t>(positions.size()) != (numel + 7) / 8) {
        return Invalid(
            absl::StrCat("a bitmap of ", positions.size(), " bytes for ", numel, " elements"));
      }
      for (const uint8_t byte : positions) count += std::popcount(byte);
      if (numel % 8 != 0 && (positions.back() >> (numel % 8)) != 0) {
        return Invalid("a bitmap has bits set past the tensor's end");
      }
      break;
    }
  }
  if (count != value_count) {
    return Invalid(absl::StrCat(count, " positions but ", value_count, " values"));
  }
  return absl::OkStatus();
}

// Applies a checked delta.
void ApplyChecked(DeltaEncoding encoding, absl::Span<const uint8_t> positions,
                  absl::Span<const uint8_t> values, int64_t element_size,
                  absl::Span<uint8_t> tensor) {
  const uint8_t* value = values.data();
  auto put = [&](int64_t index) {
    std::memcpy(tensor.data() + index * element_size, value, element_size);
    value += element_size;
  };
  const int64_t numel = static_cast<int64_t>(tensor.size()) / element_size;
  switch (encoding) {
    case DeltaEncoding::kUnchanged:
      return;
    case DeltaEncoding::kDense:
      if (!values.empty()) std::memcpy(tensor.data(), values.data(), values.size());
      return;
    case DeltaEncoding::kSparse:
      ForEachSparseIndex(positions, numel, put);
      return;
    case DeltaEncoding::kBitmap:
      for (int64_t byte = 0; byte < static_cast<int64_t>(positions.size()); ++byte) {
        for (uint8_t bits = positions[byte]; bits != 0; bits &= bits - 1) {
          put(byte * 8 + std::countr_zero(bits));
        }
      }
      return;
  }
}

nlohmann::json ShapeJson(absl::Span<const int64_t> shape) {
  return nlohmann::json(std::vector<int64_t>(shape.begin(), shape.end()));
}

}  // namespace

std::string_view DeltaEncodingName(DeltaEncoding encoding) {
  switch (encoding) {
    case DeltaEncoding::kUnchanged:
      return "unchanged";
    case DeltaEncoding::kSparse:
      return "sparse";
    case DeltaEncoding::kBitmap:
      return "bitmap";
    case DeltaEncoding::kDense:
      return "dense";
  }
  return "unknown";
}

absl::StatusOr<DeltaEncoding> DeltaEncodingFromName(std::string_view name) {
  for (DeltaEncoding encoding : {DeltaEncoding::kUnchanged, DeltaEncoding::kSparse,
                                 DeltaEncoding::kBitmap, DeltaEncoding::kDense}) {
    if (DeltaEncodingName(encoding) == name) return encoding;
  }
  return Invalid(absl::StrCat("unknown encoding \"", AsAbsl(name), "\""));
}

absl::StatusOr<TensorDelta> EncodeTensorDelta(absl::Span<const uint8_t> base,
                                              absl::Span<const uint8_t> target,
                                              int64_t element_size) {
  if (!ValidElementSize(element_size)) {
    return Invalid(absl::StrCat("element size ", element_size, " is not 1, 2, 4 or 8"));
  }
  if (base.size() != target.size() || target.size() % element_size != 0) {
    return Invalid(absl::StrCat("tensors of ", base.size(), " and ", target.size(),
                                " bytes do not compare as elements of ", element_size));
  }
  TensorDelta delta;
  delta.numel = static_cast<int64_t>(target.size()) / element_size;
  // Sizes first, so the chosen encoding is written once without holding the indices.
  int64_t sparse_bytes = 0;
  int64_t previous = -1;
  ForEachChanged(base.data(), target.data(), delta.numel, element_size, [&](int64_t i) {
    ++delta.changed;
    sparse_bytes += VarintSize(static_cast<uint64_t>(i - previous - 1));
    previous = i;
  });
  if (delta.changed == 0) return delta;
  const int64_t bitmap_bytes = (delta.numel + 7) / 8;
  const int64_t dense_extra = (delta.numel - delta.changed) * element_size;
  if (dense_extra <= std::min(sparse_bytes, bitmap_bytes)) {
    delta.encoding = DeltaEncoding::kDense;
    delta.values.assign(target.begin(), target.end());
    return delta;
  }
  delta.values.reserve(delta.changed * element_size);
  auto take = [&](int64_t i) {
    delta.values.insert(delta.values.end(), target.begin() + i * element_size,
                        target.begin() + (i + 1) * element_size);
  };
  if (sparse_bytes <= bitmap_bytes) {
    delta.encoding = DeltaEncoding::kSparse;
    delta.positions.reserve(sparse_bytes);
    previous = -1;
    ForEachChanged(base.data(), target.data(), delta.numel, element_size, [&](int64_t i) {
      AppendVarint(static_cast<uint64_t>(i - previous - 1), delta.positions);
      previous = i;
      take(i);
    });
  } else {
    delta.encoding = DeltaEncoding::kBitmap;
    delta.positions.assign(bitmap_bytes, 0);
    ForEachChanged(base.data(), target.data(), delta.numel, element_size, [&](int64_t i) {
      delta.positions[i / 8] |= static_cast<uint8_t>(1u << (i % 8));
      take(i);
    });
  }
  return delta;
}

absl::Status ApplyTensorDelta(DeltaEncoding encoding, absl::Span<const uint8_t> positions,
                              absl::Span<const uint8_t> values, int64_t element_size,
                              absl::Span<uint8_t> tensor) {
  if (!ValidElementSize(element_size) || tensor.size() % element_size != 0) {
    return Invalid(
        absl::StrCat("a tensor of ", tensor.size(), " bytes is not elements of ", element_size));
  }
  RETURN_IF_ERROR(CheckTensorDelta(encoding, positions, values, element_size,
                                   static_cast<int64_t>(tensor.size()) / element_size));
  ApplyChecked(encoding, positions, values, element_size, tensor);
  return absl::OkStatus();
}

absl::StatusOr<WeightDeltaSummary> WriteWeightDelta(const SafetensorsCheckpoint& base,
                                                    const SafetensorsCheckpoint& target,
                                                    const std::string& stem,
                                                    const WeightDeltaOptions& options) {
  const std::vector<std::string>& names = target.names();
  if (base.names() != names) {
    std::vector<std::string> differ;
    std::set_symmetric_difference(base.names().begin(), base.names().end(), names.begin(),
                                  names.end(), std::back_inserter(differ));
    return Invalid(
        absl::StrCat("tensor \"", differ.front(), "\" is in only one of the two weight sets"));
  }
  std::vector<const TensorView*> views(names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    const TensorView* before = base.Find(names[i]);
    views[i] = target.Find(names[i]);
    if (before->dtype != views[i]->dtype || before->shape != views[i]->shape) {
      return Invalid(absl::StrCat("tensor \"", names[i], "\" is ", AsAbsl(DTypeName(before->dtype)),
                                  " ", ShapeToString(before->shape), " in the base but ",
                                  AsAbsl(DTypeName(views[i]->dtype)), " ",
                                  ShapeToString(views[i]->shape), " in the target"));
    }
  }
  std::vector<TensorDelta> deltas(names.size());
  std::vector<absl::Status> errors(names.size());
  ParallelFor(static_cast<int64_t>(names.size()), 1, options.threads,
              [&](int64_t begin, int64_t end) {
                for (int64_t i = begin; i < end; ++i) {
                  absl::StatusOr<TensorDelta> delta = EncodeTensorDelta(
                      base.Find(names[i])->data, views[i]->data, DTypeSize(views[i]->dtype));
                  if (delta.ok()) {
                    deltas[i] = *std::move(delta);
                  } else {
                    errors[i] = delta.status();
                  }
                }
              });

  WeightDeltaSummary summary{.index_path = stem + ".json", .data_path = stem + ".safetensors"};
  nlohmann::json tensors = nlohmann::json::object();
  std::vector<TensorToWrite> to_write;
  for (size_t i = 0; i < names.size(); ++i) {
    if (!errors[i].ok()) {
      return Invalid(absl::StrCat("tensor \"", names[i], "\": ", errors[i].message()));
    }
    const TensorView& view = *views[i];
    const TensorDelta& delta = deltas[i];
    ++summary.tensors;
    summary.elements += delta.numel;
    summary.full_bytes += view.nbytes();
    tensors[names[i]] = {{"dtype", DTypeName(view.dtype)},
                         {"shape", ShapeJson(view.shape)},
                         {"changed", delta.changed},
                         {"encoding", DeltaEncodingName(delta.encoding)}};
    if (delta.encoding == DeltaEncoding::kUnchanged) continue;
    ++summary.changed_tensors;
    summary.changed_elements += delta.changed;
    summary.delta_bytes += delta.nbytes();
    to_write.push_back(
        {.name = names[i] + kValuesSuffix,
         .dtype = view.dtype,
         .shape = {static_cast<int64_t>(delta.values.size()) / DTypeSize(view.dtype)},
         .data = delta.values});
    if (!delta.positions.empty()) {
      to_write.push_back({.name = names[i] + kPositionsSuffix,
                          .dtype = DType::kU8,
                          .shape = {static_cast<int64_t>(delta.positions.size())},
                          .data = delta.positions});
    }
  }
  std::map<std::string, std::string> metadata = {{"format", kFormat}};
  if (options.base_step >= 0) metadata["base_step"] = absl::StrCat(options.base_step);
  if (options.step >= 0) metadata["step"] = absl::StrCat(options.step);
  RETURN_IF_ERROR(WriteSafetensors(summary.data_path, to_write, metadata));

  nlohmann::json index = {{"format", kFormat},
                          {"version", kVersion},
                          {"data", std::filesystem::path(summary.data_path).filename().string()},
                          {"elements", summary.elements},
                          {"changed_elements", summary.changed_elements},
                          {"delta_bytes", summary.delta_bytes},
                          {"full_bytes", summary.full_bytes},
                          {"tensors", std::move(tensors)}};
  if (options.base_step >= 0) index["base_step"] = options.base_step;
  if (options.step >= 0) index["step"] = options.step;
  RETURN_IF_ERROR(WriteTextAtomically(summary.index_path, index.dump(1) + "\n"));
  return summary;
}

absl::Status ApplyWeightDelta(const std::string& index_path,
                              const std::map<std::string, MutableTensorView>& tensors) {
  ASSIGN_OR_RETURN(const std::string text, ReadWholeFile(index_path));
  const nlohmann::json index = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  auto malformed = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": ", why));
  };
  if (!index.is_object() || !index.contains("format") || index["format"] != kFormat) {
    return malformed(absl::StrCat("not a ", kFormat, " index"));
  }
  if (!index.contains("version") || index["version"] != kVersion) {
    return malformed(absl::StrCat("not version ", kVersion));
  }
  if (!index.contains("data") || !index["data"].is_string() || !index.contains("tensors") ||
      !index["tensors"].is_object()) {
    return malformed("no \"data\" file name or \"tensors\" object");
  }
  const std::string data_name = index["data"].get<std::string>();
  if (data_name.find('/') != std::string::npos) {
    return malformed("\"data\" is not a file name in the index's directory");
  }
  ASSIGN_OR_RETURN(SafetensorsFile data,
                   SafetensorsFile::Open(
                       (std::filesystem::path(index_path).parent_path() / data_name).string()));

  struct Pending {
    DeltaEncoding encoding;
    absl::Span<const uint8_t> positions;
    absl::Span<const uint8_t> values;
    int64_t element_size;
    absl::Span<uint8_t> tensor;
  };
  std::vector<Pending> pending;
  for (const auto& item : index["tensors"].items()) {
    // Named, not a structured binding: lambdas may not capture those before C++20's clang 16.
    const std::string& name = item.key();
    const nlohmann::json& entry = item.value();
    auto about = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor \"", name, "\": ", why));
    };
    if (!entry.is_object() || !entry.contains("dtype") || !entry["dtype"].is_string() ||
        !entry.contains("shape") || !entry["shape"].is_array() || !entry.contains("encoding") ||
        !entry["encoding"].is_string()) {
      return about("not an object with \"dtype\", \"shape\" and \"encoding\"");
    }
    absl::StatusOr<DType> dtype = DTypeFromName(entry["dtype"].get<std::string>());
    absl::StatusOr<DeltaEncoding> encoding =
        DeltaEncodingFromName(entry["encoding"].get<std::string>());
    if (!dtype.ok()) return about(dtype.status().message());
    if (!encoding.ok()) return about(encoding.status().message());
    std::vector<int64_t> shape;
    for (const nlohmann::json& dim : entry["shape"]) {
      if (!dim.is_number_integer()) return about("a dimension is not an integer");
      shape.push_back(dim.get<int64_t>());
    }
    auto it = tensors.find(name);
    if (it == tensors.end()) return about("missing from the weights it is applied to");
    const MutableTensorView& tensor = it->second;
    if (tensor.dtype != *dtype || tensor.shape != shape) {
      return about(absl::StrCat("the delta is for ", AsAbsl(DTypeName(*dtype)), " ",
                                ShapeToString(shape), ", the weights hold ",
                                AsAbsl(DTypeName(tensor.dtype)), " ", ShapeToString(tensor.shape)));
    }
    const int64_t element_size = DTypeSize(*dtype);
    const TensorView probe{.shape = shape};
    if (static_cast<int64_t>(tensor.data.size()) != probe.numel() * element_size) {
      return about(absl::StrCat("the weights hold ", tensor.data.size(), " bytes, not ",
                                probe.numel() * element_size));
    }
    const TensorView* values = data.Find(name + kValuesSuffix);
    const TensorView* positions = data.Find(name + kPositionsSuffix);
    if (values != nullptr && values->dtype != *dtype) return about("values of another dtype");
    if (positions != nullptr && positions->dtype != DType::kU8) return about("positions not U8");
    Pending next{.encoding = *encoding,
                 .positions = positions != nullptr ? positions->data : absl::Span<const uint8_t>(),
                 .values = values != nullptr ? values->data : absl::Span<const uint8_t>(),
                 .element_size = element_size,
                 .tensor = tensor.data};
    if (absl::Status fits = CheckTensorDelta(next.encoding, next.positions, next.values,
                                             element_size, probe.numel());
        !fits.ok()) {
      return about(fits.message());
    }
    pending.push_back(next);
  }
  for (const Pending& p : pending) {
    ApplyChecked(p.encoding, p.positions, p.values, p.element_size, p.tensor);
  }
  return absl::OkStatus();
}

}  // namespace dta

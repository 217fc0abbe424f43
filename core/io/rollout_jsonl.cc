#include "core/io/rollout_jsonl.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <type_traits>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/base/absl_string_view.h"
#include "core/base/field_error.h"
#include "core/base/status_macros.h"
#include "nlohmann/json.hpp"
#include "simdjson.h"

namespace dta {
namespace {

using simdjson::dom::element;
using simdjson::dom::element_type;

absl::StatusOr<std::string> ParseName(std::string_view field, element value) {
  switch (value.type()) {
    case element_type::STRING:
      return std::string(std::string_view(value.get_string().value_unsafe()));
    case element_type::INT64:
      return absl::StrCat(value.get_int64().value_unsafe());
    case element_type::UINT64:
      return absl::StrCat(value.get_uint64().value_unsafe());
    default:
      return FieldError(field, "must be a string or an integer");
  }
}

absl::StatusOr<simdjson::dom::array> ParseArray(std::string_view field, element value) {
  simdjson::dom::array array;
  if (value.get_array().get(array) != simdjson::SUCCESS)
    return FieldError(field, "must be an array");
  return array;
}

// Integers within [lo, hi], as T.
template <typename T>
absl::Status ParseIntegers(std::string_view field, element value, int64_t lo, int64_t hi,
                           std::vector<T>& out) {
  absl::StatusOr<simdjson::dom::array> array = ParseArray(field, value);
  if (!array.ok()) return array.status();
  out.reserve(array->size());
  size_t i = 0;
  for (element item : *array) {
    int64_t number;
    if (item.type() == element_type::BOOL) {
      number = item.get_bool().value_unsafe() ? 1 : 0;
    } else if (item.get_int64().get(number) != simdjson::SUCCESS) {
      return FieldError(field, absl::StrCat("value ", i, " is not an integer"));
    }
    if (number < lo || number > hi) {
      return FieldError(
          field, absl::StrCat("value ", i, " = ", number, " is outside [", lo, ", ", hi, "]"));
    }
    out.push_back(static_cast<T>(number));
    ++i;
  }
  return absl::OkStatus();
}

absl::Status ParseFloats(std::string_view field, element value, std::vector<float>& out) {
  absl::StatusOr<simdjson::dom::array> array = ParseArray(field, value);
  if (!array.ok()) return array.status();
  out.reserve(array->size());
  size_t i = 0;
  for (element item : *array) {
    double number;
    if (item.get_double().get(number) != simdjson::SUCCESS) {
      return FieldError(field, absl::StrCat("value ", i, " is not a number"));
    }
    const float narrow = static_cast<float>(number);
    if (!std::isfinite(narrow)) {
      return FieldError(field,
                        absl::StrCat("value ", i, " = ", number, " is not finite in float32"));
    }
    out.push_back(narrow);
    ++i;
  }
  return absl::OkStatus();
}

// A positive int32 member `name` of the routed_experts object.
absl::StatusOr<int32_t> ParsePositive(simdjson::dom::object object, std::string_view name) {
  element value;
  int64_t number;
  if (object.at_key(name).get(value) != simdjson::SUCCESS)
    return FieldError("routed_experts", absl::StrCat("'", AsAbsl(name), "' is missing"));
  if (value.get_int64().get(number) != simdjson::SUCCESS || number <= 0 ||
      number > std::numeric_limits<int32_t>::max()) {
    return FieldError("routed_experts",
                      absl::StrCat("'", AsAbsl(name), "' must be a positive integer"));
  }
  return static_cast<int32_t>(number);
}

// {"layers": L, "top_k": k, "dtype": "int32", "base64": "..."} (SGLang's and vLLM's payload) or
// {"layers": L, "top_k": k, "ids": [[[...] x L] per row]} with kNotRecorded (-1) for holes.
absl::StatusOr<RoutedExperts> ParseRoutedExperts(element value) {
  constexpr std::string_view kField = "routed_experts";
  simdjson::dom::object object;
  if (value.get_object().get(object) != simdjson::SUCCESS) {
    return FieldError(kField, "must be an object {\"layers\", \"top_k\", \"base64\" or \"ids\"}");
  }
  for (auto [key, member] : object) {
    if (key != "layers" && key != "top_k" && key != "dtype" && key != "base64" && key != "ids") {
      return FieldError(kField, absl::StrCat("unknown member '", AsAbsl(key),
                                             "' (expected layers, top_k, dtype, base64, ids)"));
    }
  }
  ASSIGN_OR_RETURN(const int32_t layers, ParsePositive(object, "layers"));
  ASSIGN_OR_RETURN(const int32_t top_k, ParsePositive(object, "top_k"));
  element payload;
  if (object.at_key("base64").get(payload) == simdjson::SUCCESS) {
    element dtype;
    if (object.at_key("dtype").get(dtype) == simdjson::SUCCESS) {
      std::string_view name;
      if (dtype.get_string().get(name) != simdjson::SUCCESS || name != "int32") {
        return FieldError(kField, "'dtype' must be \"int32\" (the engines' little-endian ids)");
      }
    }
    std::string_view text;
    if (payload.get_string().get(text) != simdjson::SUCCESS)
      return FieldError(kField, "'base64' must be a string");
    return DecodeRoutedExperts(text, layers, top_k);
  }
  if (object.at_key("ids").get(payload) != simdjson::SUCCESS)
    return FieldError(kField, "needs 'base64' or 'ids'");
  RoutedExperts routed{.layers = layers, .top_k = top_k, .ids = {}};
  simdjson::dom::array rows;
  if (payload.get_array().get(rows) != simdjson::SUCCESS)
    return FieldError(kField, "'ids' must be an array of rows");
  int64_t row = 0;
  for (element row_value : rows) {
    simdjson::dom::array row_layers;
    if (row_value.get_array().get(row_layers) != simdjson::SUCCESS ||
        static_cast<int64_t>(row_layers.size()) != layers) {
      return FieldError(kField, absl::StrCat("ids row ", row, " must be an array of ", layers,
                                             " layers of ", top_k, " ids"));
    }
    int32_t layer = 0;
    for (element layer_value : row_layers) {
      std::vector<int32_t> experts;
      const absl::Status status = ParseIntegers(kField, layer_value, kNotRecorded,
                                                std::numeric_limits<int32_t>::max(), experts);
      if (!status.ok() || static_cast<int32_t>(experts.size()) != top_k) {
        return FieldError(kField, absl::StrCat("ids row ", row, ", layer ", layer, " must be ",
                                               top_k, " integers >= ", kNotRecorded));
      }
      routed.ids.insert(routed.ids.end(), experts.begin(), experts.end());
      ++layer;
    }
    ++row;
  }
  return routed;
}

// Parses an object already in simdjson's DOM. `id` is set as soon as it is known so that errors
// in later fields can name the rollout.
absl::Status ParseObject(element doc, const RolloutReadOptions& options, Rollout& rollout) {
  simdjson::dom::object object;
  if (doc.get_object().get(object) != simdjson::SUCCESS) {
    return absl::InvalidArgumentError("a rollout must be a JSON object");
  }
  // The id first, whatever its position, so every later error can name the rollout.
  element id;
  if (object.at_key("id").get(id) != simdjson::SUCCESS) return FieldError("id", "missing");
  ASSIGN_OR_RETURN(rollout.id, ParseName("id", id));

  bool has_group = false, has_tokens = false, has_mask = false, has_logprobs = false;
  for (auto [key, value] : object) {
    absl::Status status;
    if (key == "id") {
      continue;
    } else if (key == "group") {
      absl::StatusOr<std::string> group = ParseName(key, value);
      if (!group.ok()) return group.status();
      rollout.group = *std::move(group);
      has_group = true;
    } else if (key == "tokens") {
      status = ParseIntegers(key, value, 0, std::numeric_limits<TokenId>::max(), rollout.tokens);
      has_tokens = true;
    } else if (key == "loss_mask") {
      status = ParseIntegers(key, value, 0, 1, rollout.loss_mask);
      has_mask = true;
    } else if (key == "logprobs") {
      status = ParseFloats(key, value, rollout.logprobs);
      has_logprobs = true;
    } else if (key == "versions") {
      status = ParseIntegers(key, value, -1, std::numeric_limits<int32_t>::max(), rollout.versions);
    } else if (key == "advantages") {
      status = ParseFloats(key, value, rollout.advantages);
    } else if (key == "ref_logprobs") {
      status = ParseFloats(key, value, rollout.ref_logprobs);
    } else if (key == "reward") {
      double reward;
      if (value.get_double().get(reward) != simdjson::SUCCESS)
        return FieldError(key, "must be a number");
      rollout.reward = reward;
    } else if (key == "routed_experts") {
      absl::StatusOr<RoutedExperts> routed = ParseRoutedExperts(value);
      if (!routed.ok()) return routed.status();
      rollout.routed_experts = *std::move(routed);
    } else if (key == "metadata") {
      continue;
    } else {
      return FieldError(key,
                        "unknown field (expected id, group, tokens, loss_mask, logprobs, versions, "
                        "reward, advantages, ref_logprobs, routed_experts, metadata)");
    }
    if (!status.ok()) return status;
  }
  if (!has_group) return FieldError("group", "missing");
  if (!has_tokens) return FieldError("tokens", "missing");
  if (!has_mask) return FieldError("loss_mask", "missing");
  if (!has_logprobs) return FieldError("logprobs", "missing");
  return ValidateRollout(rollout, options.vocab_size);
}

absl::Status ParseWithParser(simdjson::dom::parser& parser, const char* data, size_t size,
                             bool padded, const RolloutReadOptions& options, Rollout& rollout) {
  element doc;
  if (auto error = parser.parse(data, size, /*realloc_if_needed=*/!padded).get(doc); error) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed JSON: ", simdjson::error_message(error)));
  }
  return ParseObject(doc, options, rollout);
}

// A number in its shortest exact form. A floating-point value whose shortest form is a long
// integer (to_chars prefers fixed notation when it is no longer, e.g. -2^70 as
// -1180591620717411303424) gets ".0", so that JSON readers do not take it for an integer literal,
// which they may refuse beyond 64 bits.
template <typename T>
void AppendNumber(std::string& out, T value) {
  char buffer[48];
  const auto [end, ec] = std::to_chars(buffer, buffer + sizeof(buffer), value);
  out.append(buffer, end);
  if constexpr (std::is_floating_point_v<T>) {
    if (std::string_view(buffer, end - buffer).find_first_of(".e") == std::string_view::npos)
      out.append(".0");
  }
}

template <typename T>
void AppendArray(std::string& out, std::string_view key, const std::vector<T>& values) {
  absl::StrAppend(&out, ",\"", AsAbsl(key), "\":[");
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out.push_back(',');
    AppendNumber(out, values[i]);
  }
  out.push_back(']');
}

std::string_view LineAt(std::string_view text, size_t begin, size_t* next) {
  size_t end = text.find('\n', begin);
  if (end == std::string_view::npos) end = text.size();
  *next = end + 1;
  std::string_view line = text.substr(begin, end - begin);
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return line;
}

bool IsBlank(std::string_view line) {
  return line.find_first_not_of(" \t\r") == std::string_view::npos;
}

}  // namespace

absl::StatusOr<Rollout> ParseRolloutJson(std::string_view json, const RolloutReadOptions& options) {
  simdjson::dom::parser parser;
  Rollout rollout;
  absl::Status status =
      ParseWithParser(parser, json.data(), json.size(), /*padded=*/false, options, rollout);
  if (!status.ok()) {
    if (rollout.id.empty()) return status;
    return absl::InvalidArgumentError(
        absl::StrCat("rollout '", rollout.id, "': ", status.message()));
  }
  return rollout;
}

absl::StatusOr<std::vector<Rollout>> ReadRolloutsJsonl(const std::string& path,
                                                       const RolloutReadOptions& options) {
  simdjson::padded_string text;
  if (auto error = simdjson::padded_string::load(path).get(text); error) {
    return absl::NotFoundError(
        absl::StrCat(path, ": cannot read (", simdjson::error_message(error), ")"));
  }
  const std::string_view view(text.data(), text.size());
  std::vector<Rollout> rollouts;
  absl::flat_hash_map<std::string, int64_t> line_of_id;
  simdjson::dom::parser parser;
  int64_t line_number = 0;
  for (size_t begin = 0, next = 0; begin < view.size(); begin = next) {
    const std::string_view line = LineAt(view, begin, &next);
    ++line_number;
    if (IsBlank(line)) continue;
    Rollout rollout;
    // The whole file is padded, so a line can be parsed in place: simdjson may read past its end
    // but stays inside the buffer.
    absl::Status status =
        ParseWithParser(parser, line.data(), line.size(), /*padded=*/true, options, rollout);
    if (!status.ok()) {
      const std::string who =
          rollout.id.empty() ? "" : absl::StrCat(" rollout '", rollout.id, "':");
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", line_number, ":", who, " ", status.message()));
    }
    auto [it, inserted] = line_of_id.emplace(rollout.id, line_number);
    if (!inserted) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", line_number, ": rollout '", rollout.id,
                       "': field 'id': duplicate of line ", it->second));
    }
    rollouts.push_back(std::move(rollout));
  }
  return rollouts;
}

std::string RolloutToJson(const Rollout& rollout) {
  std::string out;
  out.reserve(rollout.tokens.size() * 24 + 64);
  absl::StrAppend(&out, "{\"id\":", nlohmann::json(rollout.id).dump(),
                  ",\"group\":", nlohmann::json(rollout.group).dump());
  AppendArray(out, "tokens", rollout.tokens);
  AppendArray(out, "loss_mask", rollout.loss_mask);
  AppendArray(out, "logprobs", rollout.logprobs);
  if (!rollout.versions.empty()) AppendArray(out, "versions", rollout.versions);
  if (rollout.reward) {
    out.append(",\"reward\":");
    AppendNumber(out, *rollout.reward);
  }
  if (!rollout.advantages.empty()) AppendArray(out, "advantages", rollout.advantages);
  if (!rollout.ref_logprobs.empty()) AppendArray(out, "ref_logprobs", rollout.ref_logprobs);
  if (rollout.routed_experts) {
    const RoutedExperts& routed = *rollout.routed_experts;
    absl::StrAppend(&out, ",\"routed_experts\":{\"layers\":", routed.layers,
                    ",\"top_k\":", routed.top_k, ",\"dtype\":\"int32\",\"base64\":\"",
                    EncodeRoutedExperts(routed), "\"}");
  }
  out.push_back('}');
  return out;
}

absl::Status WriteRolloutsJsonl(const std::string& path, absl::Span<const Rollout> rollouts) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) return absl::UnavailableError(absl::StrCat(path, ": cannot open for writing"));
  for (const Rollout& rollout : rollouts) {
    const std::string line = RolloutToJson(rollout);
    file.write(line.data(), static_cast<std::streamsize>(line.size()));
    file.put('\n');
  }
  file.close();
  if (!file) return absl::UnavailableError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace dta

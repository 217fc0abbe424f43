// dta.Trajectory -> Rollout through the CPython C API where the values are plain Python objects
// (bindings/python/rollout_conversion.h), and Rollout -> dta.Trajectory.
#include "bindings/python/rollout_conversion.h"

#include "bindings/python/bindings.h"
#include "core/io/rollout_jsonl.h"
#include "core/io/routed_experts.h"

#include <ATen/ATen.h>
#include <Python.h>
#include <c10/core/ScalarType.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace dta::python {
namespace {

// dta.trajectory's limits: token ids and versions below 2^31, per-token floats finite in float32
// (below FLT_MAX plus half an ulp, the smallest magnitude that rounds to infinity).
constexpr int64_t kTokenLimit = int64_t{1} << 31;
constexpr double kFloat32Overflow = 3.4028235677973366e38;
// Ints in float fields are checked exactly only below 2^53 (where a double holds them).
constexpr int64_t kExactDoubleInt = int64_t{1} << 53;

// The value of an exact Python int (not a bool, whose type is a subclass), if it fits int64.
std::optional<int64_t> PlainInt(PyObject* item) {
  if (!PyLong_CheckExact(item)) return std::nullopt;
  int overflow = 0;
  const long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
  if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return std::nullopt;
  }
  return value;
}

// The value of an exact Python float, or of an exact int below 2^53 in magnitude.
std::optional<double> PlainNumber(PyObject* item) {
  if (PyFloat_CheckExact(item)) return PyFloat_AS_DOUBLE(item);
  const std::optional<int64_t> i = PlainInt(item);
  if (i && *i > -kExactDoubleInt && *i < kExactDoubleInt) return static_cast<double>(*i);
  return std::nullopt;
}

// 0 or 1 from False, True, 0 or 1 (the loss mask's plain values).
std::optional<uint8_t> PlainBit(PyObject* item) {
  if (item == Py_False) return 0;
  if (item == Py_True) return 1;
  const std::optional<int64_t> i = PlainInt(item);
  if (i && (*i == 0 || *i == 1)) return static_cast<uint8_t>(*i);
  return std::nullopt;
}

// Reads `values` when it is an exact list whose length is n (or 0 where `optional`) and every item
// gives a value through `plain` (which applies the field's rule): into *out when out is not null.
// False at the first item that does not (out is then partly written).
template <class T, class Plain>
bool ReadPlainList(py::handle values, Py_ssize_t n, bool optional, Plain&& plain,
                   std::vector<T>* out) {
  PyObject* list = values.ptr();
  if (!PyList_CheckExact(list)) return false;
  const Py_ssize_t size = PyList_GET_SIZE(list);
  if (size != n && !(optional && size == 0)) return false;
  if (out != nullptr) out->resize(static_cast<size_t>(size));
  for (Py_ssize_t i = 0; i < size; ++i) {
    const std::optional<T> v = plain(PyList_GET_ITEM(list, i));
    if (!v) return false;
    if (out != nullptr) (*out)[static_cast<size_t>(i)] = *v;
  }
  return true;
}

// A float from a plain float or int that is finite in float32, rounded as pybind11's float cast
// rounds (double -> float).
std::optional<float> FiniteFloat32(PyObject* item) {
  const std::optional<double> v = PlainNumber(item);
  if (!v || !std::isfinite(*v) || std::fabs(*v) >= kFloat32Overflow) return std::nullopt;
  return static_cast<float>(*v);
}

// routed_experts: [rows][layers][top_k] ids as int32 (the caller checks the values). A tensor
// is copied once, to the CPU and int32 together (exact for the values validate passes).
RoutedExperts RoutedExpertsOfTensor(const at::Tensor& tensor) {
  TORCH_CHECK(tensor.dim() == 3, "routed_experts must be a 3-D tensor, got shape ", tensor.sizes());
  RoutedExperts routed{.layers = static_cast<int32_t>(tensor.size(1)),
                       .top_k = static_cast<int32_t>(tensor.size(2)),
                       .ids = std::vector<int32_t>(static_cast<size_t>(tensor.numel()))};
  if (!routed.ids.empty()) {
    at::from_blob(routed.ids.data(), tensor.sizes(), at::TensorOptions().dtype(at::kInt))
        .copy_(tensor);
  }
  return routed;
}

// Reads `value` when it is exact nested lists [rows][layers][top_k] of plain ints in
// [kNotRecorded, 2^31) (rows > 0, every row and layer as long as the first).
std::optional<RoutedExperts> PlainRoutedLists(PyObject* value) {
  if (!PyList_CheckExact(value) || PyList_GET_SIZE(value) == 0) return std::nullopt;
  PyObject* first_row = PyList_GET_ITEM(value, 0);
  if (!PyList_CheckExact(first_row) || PyList_GET_SIZE(first_row) == 0) return std::nullopt;
  PyObject* first_layer = PyList_GET_ITEM(first_row, 0);
  if (!PyList_CheckExact(first_layer) || PyList_GET_SIZE(first_layer) == 0) return std::nullopt;
  const Py_ssize_t rows = PyList_GET_SIZE(value);
  const Py_ssize_t layers = PyList_GET_SIZE(first_row);
  const Py_ssize_t top_k = PyList_GET_SIZE(first_layer);
  if (layers > INT32_MAX || top_k > INT32_MAX) return std::nullopt;
  RoutedExperts routed{
      .layers = static_cast<int32_t>(layers), .top_k = static_cast<int32_t>(top_k), .ids = {}};
  routed.ids.reserve(static_cast<size_t>(rows * layers * top_k));
  for (Py_ssize_t r = 0; r < rows; ++r) {
    PyObject* row = PyList_GET_ITEM(value, r);
    if (!PyList_CheckExact(row) || PyList_GET_SIZE(row) != layers) return std::nullopt;
    for (Py_ssize_t l = 0; l < layers; ++l) {
      PyObject* ids = PyList_GET_ITEM(row, l);
      if (!PyList_CheckExact(ids) || PyList_GET_SIZE(ids) != top_k) return std::nullopt;
      for (Py_ssize_t k = 0; k < top_k; ++k) {
        const std::optional<int64_t> id = PlainInt(PyList_GET_ITEM(ids, k));
        if (!id || *id < kNotRecorded || *id >= kTokenLimit) return std::nullopt;
        routed.ids.push_back(static_cast<int32_t>(*id));
      }
    }
  }
  return routed;
}

// Reads t.routed_experts when it is None, exact nested lists of plain ints, or a 3-D torch tensor
// of a signed integer dtype, keeping every rule dta.Trajectory.validate applies to it for a
// rollout of `tokens` tokens: into *out (nullopt for None).
bool PlainRoutedExperts(py::handle value, int64_t tokens, std::optional<RoutedExperts>* out) {
  if (value.is_none()) {
    *out = std::nullopt;
    return true;
  }
  if (THPVariable_Check(value.ptr())) {
    const at::Tensor tensor = THPVariable_Unpack(value.ptr()).detach();
    const at::ScalarType type = tensor.scalar_type();
    if (tensor.dim() != 3 ||
        (type != at::kChar && type != at::kShort && type != at::kInt && type != at::kLong)) {
      return false;  // validate names the shape or dtype, or checks an unsigned one
    }
    // int64 ids beyond int32 would wrap in the copy.
    if (type == at::kLong && tensor.numel() > 0 &&
        (tensor.lt(kNotRecorded).any().item<bool>() || tensor.ge(kTokenLimit).any().item<bool>())) {
      return false;
    }
    *out = RoutedExpertsOfTensor(tensor);
  } else {
    *out = PlainRoutedLists(value.ptr());
    if (!*out) return false;
  }
  return ValidateRoutedExperts(**out, tokens).ok();
}

// When t's type is exactly `cls` and its fields are plain Python values (str, list, int, float,
// bool, None, dict) that keep every rule of dta.Trajectory.validate(vocab_size) (vocab_size <= 0:
// no upper bound on token ids): true, with t as a Rollout in *out when out is not null. One pass
// over each list checks and converts every item.
bool PlainRollout(py::handle t, py::handle cls, int64_t vocab_size, Rollout* out) {
  if (Py_TYPE(t.ptr()) != reinterpret_cast<PyTypeObject*>(cls.ptr())) return false;
  const py::object id = t.attr("id");
  if (!PyUnicode_CheckExact(id.ptr()) || PyUnicode_GET_LENGTH(id.ptr()) == 0) return false;
  const py::object group = t.attr("group");
  if (!PyUnicode_CheckExact(group.ptr())) return false;
  const py::object tokens = t.attr("tokens");
  if (!PyList_CheckExact(tokens.ptr())) return false;
  const Py_ssize_t n = PyList_GET_SIZE(tokens.ptr());
  if (n == 0) return false;
  const int64_t limit = vocab_size > 0 ? vocab_size : kTokenLimit;
  const auto token = [limit](PyObject* item) -> std::optional<TokenId> {
    const std::optional<int64_t> v = PlainInt(item);
    if (!v || *v < 0 || *v >= limit) return std::nullopt;
    return static_cast<TokenId>(*v);
  };
  const auto version = [](PyObject* item) -> std::optional<int32_t> {
    const std::optional<int64_t> v = PlainInt(item);
    if (!v || *v < -1 || *v >= kTokenLimit) return std::nullopt;
    return static_cast<int32_t>(*v);
  };
  const py::object mask = t.attr("loss_mask");
  if (!ReadPlainList<TokenId>(tokens, n, false, token, out ? &out->tokens : nullptr) ||
      !ReadPlainList<uint8_t>(mask, n, false, PlainBit, out ? &out->loss_mask : nullptr) ||
      *PlainBit(PyList_GET_ITEM(mask.ptr(), 0)) != 0 ||
      !ReadPlainList<float>(t.attr("logprobs"), n, false, FiniteFloat32,
                            out ? &out->logprobs : nullptr) ||
      !ReadPlainList<float>(t.attr("advantages"), n, true, FiniteFloat32,
                            out ? &out->advantages : nullptr) ||
      !ReadPlainList<float>(t.attr("ref_logprobs"), n, true, FiniteFloat32,
                            out ? &out->ref_logprobs : nullptr) ||
      !ReadPlainList<int32_t>(t.attr("versions"), n, true, version,
                              out ? &out->versions : nullptr)) {
    return false;
  }
  const py::object reward = t.attr("reward");
  std::optional<double> reward_value;
  if (!reward.is_none()) {
    reward_value = PlainNumber(reward.ptr());
    if (!reward_value || !std::isfinite(*reward_value) ||
        std::fabs(*reward_value) > kMaxAbsReward) {
      return false;
    }
  }
  const py::object metadata = t.attr("metadata");
  if (!PyDict_CheckExact(metadata.ptr())) return false;
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  Py_ssize_t at = 0;
  while (PyDict_Next(metadata.ptr(), &at, &key, &value)) {
    if (!PyUnicode_CheckExact(key) || !PyUnicode_CheckExact(value)) return false;
  }
  std::optional<RoutedExperts> routed;
  if (!PlainRoutedExperts(t.attr("routed_experts"), n, &routed)) return false;
  if (out != nullptr) {
    out->id = id.cast<std::string>();
    out->group = group.cast<std::string>();
    out->reward = reward_value;
    out->routed_experts = std::move(routed);
  }
  return true;
}

// A list's items as T through `plain` when every item is a plain value it takes; else nullopt.
template <class T, class Plain>
std::optional<std::vector<T>> PlainValues(py::handle values, Plain&& plain) {
  if (!PyList_CheckExact(values.ptr())) return std::nullopt;
  std::vector<T> out;
  if (!ReadPlainList<T>(values, PyList_GET_SIZE(values.ptr()), false, plain, &out)) {
    return std::nullopt;
  }
  return out;
}

// A torch tensor's values as T, else nullopt. One copy, to the CPU and T's dtype together (copy_
// rounds a float64 to float as static_cast does), so a GPU tensor makes one transfer and no Python
// object per value. dta.Trajectory.validate has checked its shape, dtype and values.
template <class T>
std::optional<std::vector<T>> TensorValues(py::handle values) {
  if (!THPVariable_Check(values.ptr())) return std::nullopt;
  const at::Tensor tensor = THPVariable_Unpack(values.ptr()).detach();
  TORCH_CHECK(tensor.dim() == 1, "a per-token field must be a 1-D tensor, got shape ",
              tensor.sizes());
  std::vector<T> out(static_cast<size_t>(tensor.numel()));
  if (!out.empty()) {
    at::from_blob(out.data(), {tensor.numel()},
                  at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value))
        .copy_(tensor);
  }
  return out;
}

// values as std::vector<T>: the plain path, a tensor's one copy, else pybind11's cast (which
// raises on what it cannot convert, as it always did here).
template <class T, class Plain>
std::vector<T> Values(py::handle values, Plain&& plain) {
  std::optional<std::vector<T>> out = PlainValues<T>(values, plain);
  if (!out) out = TensorValues<T>(values);
  return out ? std::move(*out) : values.cast<std::vector<T>>();
}

// An int32 from a plain int in int32's range (pybind11's cast raises outside it).
std::optional<int32_t> PlainInt32(PyObject* item) {
  const std::optional<int64_t> v = PlainInt(item);
  if (!v || *v < INT32_MIN || *v > INT32_MAX) return std::nullopt;
  return static_cast<int32_t>(*v);
}

// A float from a plain float or int, rounded as pybind11's float cast rounds (double -> float).
std::optional<float> PlainFloat(PyObject* item) {
  const std::optional<double> v = PlainNumber(item);
  if (!v) return std::nullopt;
  return static_cast<float>(*v);
}

Rollout ToRollout(py::handle t) {
  Rollout r;
  r.id = t.attr("id").cast<std::string>();
  r.group = t.attr("group").cast<std::string>();
  r.tokens = Values<TokenId>(t.attr("tokens"), PlainInt32);
  r.loss_mask = Values<uint8_t>(t.attr("loss_mask"), PlainBit);
  r.logprobs = Values<float>(t.attr("logprobs"), PlainFloat);
  r.versions = Values<int32_t>(t.attr("versions"), PlainInt32);
  r.reward = t.attr("reward").cast<std::optional<double>>();
  r.advantages = Values<float>(t.attr("advantages"), PlainFloat);
  r.ref_logprobs = Values<float>(t.attr("ref_logprobs"), PlainFloat);
  const py::object routed = t.attr("routed_experts");
  if (!routed.is_none()) {
    // Nested lists and numpy arrays become one tensor through torch (no Python object per id).
    const py::object tensor = THPVariable_Check(routed.ptr())
                                  ? routed
                                  : py::module_::import("torch").attr("as_tensor")(routed);
    r.routed_experts = RoutedExpertsOfTensor(THPVariable_Unpack(tensor.ptr()).detach());
  }
  return r;
}

// r as a `cls` (dta.Trajectory): lists of Python numbers, routed_experts an int32 tensor
// [rows, layers, top_k]; metadata empty (a Rollout has none).
py::object ToTrajectory(const Rollout& r, py::handle cls) {
  py::dict fields;
  fields["id"] = r.id;
  fields["group"] = r.group;
  fields["tokens"] = r.tokens;
  fields["loss_mask"] = std::vector<int>(r.loss_mask.begin(), r.loss_mask.end());
  fields["logprobs"] = r.logprobs;
  fields["versions"] = r.versions;
  fields["reward"] = r.reward;
  fields["advantages"] = r.advantages;
  fields["ref_logprobs"] = r.ref_logprobs;
  if (r.routed_experts) {
    const RoutedExperts& routed = *r.routed_experts;
    at::Tensor ids = at::empty({routed.rows(), routed.layers, routed.top_k}, at::kInt);
    std::copy(routed.ids.begin(), routed.ids.end(), ids.data_ptr<int32_t>());
    fields["routed_experts"] = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(ids)));
  }
  return cls(**fields);
}

py::list ToTrajectories(const std::vector<Rollout>& rollouts, py::handle cls) {
  py::list out;
  for (const Rollout& r : rollouts) out.append(ToTrajectory(r, cls));
  return out;
}

}  // namespace

ConvertedBatch ConvertedBatch::FromTrajectories(const py::sequence& trajectories,
                                                int64_t vocab_size, py::handle cls) {
  ConvertedBatch batch;
  const size_t size = trajectories.size();
  batch.rollouts_.resize(size);
  batch.pending_.assign(size, false);
  for (size_t i = 0; i < size; ++i) {
    const py::object t = trajectories[i];
    if (!PlainRollout(t, cls, vocab_size, &batch.rollouts_[i])) {
      batch.rollouts_[i] = Rollout();
      batch.pending_[i] = true;
      batch.unchecked_.push_back(static_cast<int64_t>(i));
    }
  }
  return batch;
}

void ConvertedBatch::Convert(int64_t index, py::handle trajectory) {
  if (index < 0 || index >= static_cast<int64_t>(rollouts_.size()) ||
      !pending_[static_cast<size_t>(index)]) {
    throw py::index_error("ConvertedBatch.convert: " + std::to_string(index) +
                          " is not an unchecked trajectory of the batch");
  }
  rollouts_[static_cast<size_t>(index)] = ToRollout(trajectory);
  pending_[static_cast<size_t>(index)] = false;
}

const std::vector<Rollout>& ConvertedBatch::rollouts() const {
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (pending_[i]) {
      throw std::logic_error("trajectory " + std::to_string(i) +
                             " was neither checked nor validated and converted");
    }
  }
  return rollouts_;
}

bool ConvertedBatch::HasTrainedToken() const {
  for (const Rollout& r : rollouts()) {
    for (const uint8_t bit : r.loss_mask) {
      if (bit != 0) return true;
    }
  }
  return false;
}

int64_t FirstUncheckedTrajectory(const py::sequence& trajectories, int64_t start,
                                 int64_t vocab_size, py::handle cls) {
  const int64_t size = static_cast<int64_t>(trajectories.size());
  for (int64_t i = std::max<int64_t>(start, 0); i < size; ++i) {
    const py::object t = trajectories[static_cast<size_t>(i)];
    if (!PlainRollout(t, cls, vocab_size, nullptr)) return i;
  }
  return size;
}

void RegisterRolloutConversion(py::module_& m) {
  m.def("first_unchecked_trajectory", &FirstUncheckedTrajectory, py::arg("trajectories"),
        py::arg("start"), py::arg("vocab_size"), py::arg("cls"),
        "The index of the first trajectory in trajectories[start:] made of other than plain "
        "Python values or breaking a rule of dta.Trajectory.validate, else len(trajectories).");
  py::class_<ConvertedBatch>(m, "ConvertedBatch",
                             "A batch converted for the executor in one pass that also checks it; "
                             "`unchecked` lists the trajectories to validate in Python and then "
                             "`convert`.")
      .def_property_readonly("unchecked", &ConvertedBatch::unchecked)
      .def("convert", &ConvertedBatch::Convert, py::arg("index"), py::arg("trajectory"))
      .def("has_trained_token", &ConvertedBatch::HasTrainedToken)
      .def(
          "to_trajectories",
          [](const ConvertedBatch& batch, py::handle cls) {
            return ToTrajectories(batch.rollouts(), cls);
          },
          py::arg("cls"),
          "The converted rollouts back as `cls` objects (dta.Trajectory; metadata is not "
          "converted).")
      .def(
          "write_jsonl",
          [](const ConvertedBatch& batch, const std::string& path) {
            const absl::Status status = WriteRolloutsJsonl(path, batch.rollouts());
            if (!status.ok()) throw std::runtime_error(std::string(status.message()));
          },
          py::arg("path"), "Writes the converted rollouts with the C++ JSON Lines writer.")
      .def("__len__", &ConvertedBatch::size);
  m.def(
      "read_rollouts_jsonl",
      [](const std::string& path, int64_t vocab_size, py::handle cls) {
        const absl::StatusOr<std::vector<Rollout>> rollouts =
            ReadRolloutsJsonl(path, {.vocab_size = vocab_size});
        if (!rollouts.ok()) throw py::value_error(std::string(rollouts.status().message()));
        return ToTrajectories(*rollouts, cls);
      },
      py::arg("path"), py::arg("vocab_size"), py::arg("cls"),
      "The rollouts of a JSON Lines file read by the C++ reader (the dta-* tools'), as `cls` "
      "objects (dta.Trajectory; metadata is not read).");
  m.def("convert_checked", &ConvertedBatch::FromTrajectories, py::arg("trajectories"),
        py::arg("vocab_size"), py::arg("cls"),
        "The batch as a ConvertedBatch: each trajectory of exactly type `cls` made of plain Python "
        "values that keeps dta.Trajectory.validate's rules is checked and converted in one pass; "
        "the others are listed in `unchecked`.");
}

}  // namespace dta::python

// dta.Trajectory objects into C++ Rollouts, checked in the same pass where they are plain Python
// values, so that dta.Trainer skips its Python validation for them (rollout_conversion.cc). The
// module functions there also turn Rollouts back into dta.Trajectory objects
// (ConvertedBatch.to_trajectories, read_rollouts_jsonl), for tests and tools.
//
// Through the Python API a 338K-token batch (tau2 at scale 0.25) spent 74 ms outside the
// executor's call on an H200 machine, mostly in the Python validation: 44 ms, passing over each
// list three times (type, min, max). This check passes once (14 ms; bench/python_overhead.py),
// and the conversion reads plain lists' items straight through the C API instead of casting
// item by item; 21 ms outside the call remain (2026-11-28, docs/benchmarks.md).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

#include "core/io/rollout.h"

namespace dta::python {

// A batch of dta.Trajectory objects as the executor's Rollouts, made by one pass over each list
// that both checks and converts: a trajectory of exactly type `cls` whose fields are plain Python
// values (str, list, int, float, bool, None, dict; routed_experts also a tensor of a signed integer
// dtype, copied once to the CPU as int32) keeping every rule of
// dta.Trajectory.validate(vocab_size) is converted at once; any other (numpy values, torch tensors,
// subclasses, a broken rule) is listed in unchecked() and stays pending until dta.Trainer has
// validated it in Python (which names a broken rule) and calls Convert (a tensor field: one copy to
// the CPU in the field's type; routed_experts of lists or numpy: one torch.as_tensor; other values:
// pybind11's casts). rollouts() refuses a batch with a pending trajectory, so none reaches the
// executor unchecked.
//
// Through the Python API a 338K-token batch (tau2 at scale 0.25) was checked in one pass and
// converted in a second; now it is read once.
class ConvertedBatch {
 public:
  static ConvertedBatch FromTrajectories(const pybind11::sequence& trajectories, int64_t vocab_size,
                                         pybind11::handle cls);
  // Converts the pending trajectory at `index` (IndexError if it is not pending), which
  // dta.Trajectory.validate has passed.
  void Convert(int64_t index, pybind11::handle trajectory);
  // Every rollout, in order; std::logic_error while one is pending.
  const std::vector<Rollout>& rollouts() const;
  const std::vector<int64_t>& unchecked() const { return unchecked_; }
  size_t size() const { return rollouts_.size(); }
  // Whether any rollout trains a token (rollouts()' refusal applies).
  bool HasTrainedToken() const;

 private:
  std::vector<Rollout> rollouts_;
  std::vector<int64_t> unchecked_;
  std::vector<bool> pending_;
};

// The index of the first trajectory in trajectories[start:] that this check does not pass, or
// len(trajectories) when all pass. A trajectory passes when its type is exactly `cls`, its fields
// are plain Python values (str, list, int, float, bool, None, dict; routed_experts also a tensor
// of a signed integer dtype) and they keep every rule of
// dta.Trajectory.validate(vocab_size) (vocab_size <= 0: no upper bound on token ids). Failing
// says nothing about validity: dta.Trainer runs the Python validation on that trajectory, which
// accepts what this check does not cover (numpy values, subclasses) and names a broken rule.
int64_t FirstUncheckedTrajectory(const pybind11::sequence& trajectories, int64_t start,
                                 int64_t vocab_size, pybind11::handle cls);

}  // namespace dta::python

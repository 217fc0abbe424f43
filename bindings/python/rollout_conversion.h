// dta.Trajectory objects into C++ Rollouts, and the check that lets dta.Trainer skip its Python
// validation for trajectories made of plain Python values (rollout_conversion.cc).
//
// Through the Python API a 338K-token batch (tau2 at scale 0.25) spent 74 ms outside the
// executor's call on an H200 machine, mostly in the Python validation: 44 ms, passing over each
// list three times (type, min, max). This check passes once (14 ms; bench/python_overhead.py),
// and the conversion reads plain lists' items straight through the C API instead of casting
// item by item; 21 ms outside the call remain (session 18, docs/benchmarks.md).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

#include "core/io/rollout.h"

namespace dta::python {

// One Rollout per dta.Trajectory, in order. Lists of exact Python ints / floats / bools are read
// item by item through the C API; anything else (tuples, numpy arrays or scalars) goes through
// pybind11's casts, whose failures (a value outside int32, a string) raise TypeError.
std::vector<Rollout> ToRollouts(const pybind11::sequence& trajectories);

// The index of the first trajectory in trajectories[start:] that this check does not pass, or
// len(trajectories) when all pass. A trajectory passes when its type is exactly `cls`, its fields
// are plain Python values (str, list, int, float, bool, None, dict) and they keep every rule of
// dta.Trajectory.validate(vocab_size) (vocab_size <= 0: no upper bound on token ids). Failing
// says nothing about validity: dta.Trainer runs the Python validation on that trajectory, which
// accepts what this check does not cover (numpy values, subclasses) and names a broken rule.
int64_t FirstUncheckedTrajectory(const pybind11::sequence& trajectories, int64_t start,
                                 int64_t vocab_size, pybind11::handle cls);

}  // namespace dta::python

// The pieces of the extension module dta._core (module.cc), one per file.
#pragma once

#include <pybind11/pybind11.h>

namespace dta::python {

// _core.PrefixTree and _core.tree_stats (tree_bindings.cc).
void RegisterTree(pybind11::module_& m);
// _core.Trainer and its options (trainer_bindings.cc).
void RegisterTrainer(pybind11::module_& m);
// _core.first_unchecked_trajectory, convert_checked, ConvertedBatch and read_rollouts_jsonl
// (rollout_conversion.cc).
void RegisterRolloutConversion(pybind11::module_& m);

}  // namespace dta::python

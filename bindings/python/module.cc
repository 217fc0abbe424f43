// dta._core: the executor for the Python package (bindings/python/dta wraps it with typed classes).
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include "bindings/python/bindings.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "dta's executor: prefix trees and training (use the dta package, not this module)";
  // TORCH_CHECK failures carry a C++ backtrace in what(); Python gets the message.
  pybind11::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });
  dta::python::RegisterTree(m);
  dta::python::RegisterTrainer(m);
  dta::python::RegisterRolloutConversion(m);
}

# Finds the CUTLASS / CuTe headers for the Hopper kernels (kernels/hopper/): the include folder of
# the pinned nvidia-cutlass wheel (scripts/requirements-headers.txt), either unpacked into .deps/cutlass by
# scripts/device_deps.sh (the GPU machines have no package index) or installed in DTA_PYTHON's
# environment. Set DTA_CUTLASS_INCLUDE_DIR to a folder holding cute/tensor.hpp to override.
#
# Result: DTA_CUTLASS_FOUND (ON when DTA_CUTLASS_INCLUDE_DIR holds cute/tensor.hpp) and
# DTA_CUTLASS_INCLUDE_DIR (cache PATH).
set(_dta_cutlass_hints ${PROJECT_SOURCE_DIR}/.deps/cutlass/include)
if(DTA_PYTHON)
  # find_spec locates the package without importing it (the import pulls in more than we need).
  execute_process(
    COMMAND ${DTA_PYTHON} -c
      "import importlib.util as u; s = u.find_spec('cutlass_library'); print(list(s.submodule_search_locations)[0] if s else '', end='')"
    OUTPUT_VARIABLE _dta_cutlass_package
    ERROR_QUIET)
  if(_dta_cutlass_package)
    list(APPEND _dta_cutlass_hints ${_dta_cutlass_package}/source/include)
  endif()
endif()
find_path(DTA_CUTLASS_INCLUDE_DIR NAMES cute/tensor.hpp
          HINTS ${_dta_cutlass_hints} NO_DEFAULT_PATH
          DOC "CUTLASS/CuTe include folder (nvidia-cutlass==4.2.0.0's cutlass_library/source/include)")
set(DTA_CUTLASS_FOUND OFF)
if(DTA_CUTLASS_INCLUDE_DIR AND EXISTS "${DTA_CUTLASS_INCLUDE_DIR}/cute/tensor.hpp")
  set(DTA_CUTLASS_FOUND ON)
  message(STATUS "dta: CUTLASS headers in ${DTA_CUTLASS_INCLUDE_DIR}")
else()
  message(STATUS "dta: CUTLASS headers not found (pip install nvidia-cutlass==4.2.0.0 into "
                 "DTA_PYTHON's environment, run scripts/device_deps.sh, or set "
                 "DTA_CUTLASS_INCLUDE_DIR): building without the Hopper tree-attention kernel")
endif()

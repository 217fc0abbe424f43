# Finds LibTorch inside the Python venv's torch package (torch.utils.cmake_prefix_path), so the
# C++ executor links exactly the torch the Python side uses. Sets DTA_HAVE_TORCH.
set(DTA_HAVE_TORCH OFF)
if(DTA_PYTHON)
  execute_process(
    COMMAND ${DTA_PYTHON} -c "import torch; print(torch.utils.cmake_prefix_path, end='')"
    OUTPUT_VARIABLE DTA_TORCH_PREFIX RESULT_VARIABLE DTA_TORCH_RC ERROR_QUIET)
  if(DTA_TORCH_RC EQUAL 0)
    list(APPEND CMAKE_PREFIX_PATH ${DTA_TORCH_PREFIX})
    # Without a GPU, torch would try to detect one to pick architectures; name Hopper instead.
    if(NOT TORCH_CUDA_ARCH_LIST)
      set(TORCH_CUDA_ARCH_LIST "9.0")
    endif()
    find_package(Torch CONFIG QUIET)
    if(Torch_FOUND)
      set(DTA_HAVE_TORCH ON)
      message(STATUS "dta: LibTorch ${Torch_VERSION} from ${DTA_TORCH_PREFIX}")
    endif()
  endif()
endif()
if(NOT DTA_HAVE_TORCH)
  message(STATUS "dta: LibTorch not found (run scripts/setup.sh); torch targets are skipped")
endif()

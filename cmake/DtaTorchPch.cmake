# Precompiled LibTorch headers for every C++ target that links LibTorch.
#
# Parsing ATen's and autograd's headers is about half of a LibTorch translation unit's compile time
# (16 of 30 s for executor/engine/dta.cc, 13 of 40 s for a test); a fresh build has ~140 such
# units on CI's two cores. One precompiled header is built per kind of object code, as GCC only
# uses a precompiled header built with the same -fpic/-fpie: one for libraries (the donor
# dta_torch_pch_library) and one for executables (dta_torch_pch_executable); every other LibTorch
# target reuses its kind's. Targets with their own code-generation options (the Python module's
# hidden visibility) keep parsing the headers themselves. GCC also refuses a precompiled header
# when a macro its headers test differs: every LibTorch unit compiles with -pthread (which only
# defines _REENTRANT), as the ones linking gRPC's threads already did.
#
# Call dta_precompile_torch_headers() once, after every add_subdirectory.

set(DTA_TORCH_PCH_HEADERS
    <ATen/ATen.h>
    <torch/csrc/autograd/autograd.h>
    <torch/csrc/autograd/custom_function.h>)

# Whether `target` links LibTorch, directly or through the libraries it links.
function(_dta_links_torch target out)
  set(seen "")
  set(queue ${target})
  set(found OFF)
  while(queue AND NOT found)
    list(POP_FRONT queue current)
    if(current IN_LIST seen)
      continue()
    endif()
    list(APPEND seen ${current})
    if(current STREQUAL "torch" OR current STREQUAL "torch_library")
      set(found ON)
      break()
    endif()
    if(NOT TARGET ${current})
      continue()
    endif()
    get_target_property(aliased ${current} ALIASED_TARGET)
    if(aliased)
      list(APPEND queue ${aliased})
      continue()
    endif()
    get_target_property(type ${current} TYPE)
    set(links "")
    if(NOT type STREQUAL "INTERFACE_LIBRARY")
      get_target_property(direct ${current} LINK_LIBRARIES)
      if(direct)
        list(APPEND links ${direct})
      endif()
    endif()
    get_target_property(interface ${current} INTERFACE_LINK_LIBRARIES)
    if(interface)
      list(APPEND links ${interface})
    endif()
    foreach(link IN LISTS links)
      # Generator expressions ($<LINK_ONLY:...>, $<BUILD_INTERFACE:...>) name no target here.
      if(NOT link MATCHES "^\\$<")
        list(APPEND queue ${link})
      endif()
    endforeach()
  endwhile()
  set(${out} ${found} PARENT_SCOPE)
endfunction()

function(_dta_targets_under directory out)
  get_property(targets DIRECTORY ${directory} PROPERTY BUILDSYSTEM_TARGETS)
  get_property(subdirectories DIRECTORY ${directory} PROPERTY SUBDIRECTORIES)
  foreach(subdirectory IN LISTS subdirectories)
    _dta_targets_under(${subdirectory} more)
    list(APPEND targets ${more})
  endforeach()
  set(${out} ${targets} PARENT_SCOPE)
endfunction()

function(dta_precompile_torch_headers)
  if(NOT DTA_HAVE_TORCH OR DTA_NO_PCH)
    return()
  endif()
  _dta_targets_under(${PROJECT_SOURCE_DIR} targets)

  # The donors: built with the flags of their kind, as any other target of it.
  set(donor_source ${PROJECT_BINARY_DIR}/dta_torch_pch_main.cc)
  file(WRITE ${donor_source} "int main() { return 0; }\n")
  add_library(dta_torch_pch_library STATIC ${donor_source})
  add_executable(dta_torch_pch_executable ${donor_source})
  foreach(donor dta_torch_pch_library dta_torch_pch_executable)
    target_include_directories(${donor} PRIVATE ${PROJECT_SOURCE_DIR})
    target_link_libraries(${donor} PRIVATE ${TORCH_LIBRARIES})
    target_compile_options(${donor} PRIVATE ${DTA_WARNINGS} -pthread)
    target_precompile_headers(${donor} PRIVATE ${DTA_TORCH_PCH_HEADERS})
  endforeach()

  foreach(target IN LISTS targets)
    get_target_property(type ${target} TYPE)
    if(NOT type MATCHES "^(STATIC_LIBRARY|SHARED_LIBRARY|OBJECT_LIBRARY|EXECUTABLE)$")
      continue()
    endif()
    get_target_property(sources ${target} SOURCES)
    list(FILTER sources INCLUDE REGEX "\\.cc$")
    get_target_property(visibility ${target} CXX_VISIBILITY_PRESET)
    if(NOT sources OR visibility)
      continue()
    endif()
    _dta_links_torch(${target} links_torch)
    if(NOT links_torch)
      continue()
    endif()
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-pthread>)
    if(type STREQUAL "EXECUTABLE")
      target_precompile_headers(${target} REUSE_FROM dta_torch_pch_executable)
    else()
      target_precompile_headers(${target} REUSE_FROM dta_torch_pch_library)
    endif()
  endforeach()
endfunction()

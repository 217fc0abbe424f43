# Small Bazel-like helpers so every folder's CMakeLists.txt reads the same way.
#
#   dta_cc_library(NAME tree SRCS a.cc HDRS a.h DEPS absl::status)   -> target dta_tree, alias dta::tree
#   dta_cc_binary(NAME dta-tree SRCS main.cc DEPS dta::tree)
#   dta_cc_test(NAME prefix_tree_test SRCS prefix_tree_test.cc DEPS dta::tree)

include(DtaGTestBatches)

# -Wno-missing-field-initializers: GCC before 14 warns about every member a C++20 designated
# initializer leaves to its default member initializer, which is how options structs are written
# here (GCC bug 96868).
set(DTA_WARNINGS -Wall -Wextra -Wno-unused-parameter -Wno-sign-compare -Wno-missing-field-initializers)
# GCC 12 at -O3 (Release) reports -Wrestrict overlaps inside std::string's operator+ that cannot
# happen (GCC bug 105651, fixed in 13).
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
  list(APPEND DTA_WARNINGS -Wno-restrict)
endif()

function(dta_cc_library)
  cmake_parse_arguments(DTA "" "NAME" "SRCS;HDRS;DEPS" ${ARGN})
  add_library(dta_${DTA_NAME} ${DTA_SRCS} ${DTA_HDRS})
  add_library(dta::${DTA_NAME} ALIAS dta_${DTA_NAME})
  target_include_directories(dta_${DTA_NAME} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(dta_${DTA_NAME} PUBLIC ${DTA_DEPS})
  target_compile_options(dta_${DTA_NAME} PRIVATE ${DTA_WARNINGS})
endfunction()

function(dta_cc_binary)
  cmake_parse_arguments(DTA "" "NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${DTA_NAME} ${DTA_SRCS})
  target_include_directories(${DTA_NAME} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${DTA_NAME} PRIVATE ${DTA_DEPS})
  target_compile_options(${DTA_NAME} PRIVATE ${DTA_WARNINGS})
  set_target_properties(${DTA_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
endfunction()

function(dta_cc_test)
  cmake_parse_arguments(DTA "" "NAME" "SRCS;DEPS;LABELS" ${ARGN})
  add_executable(${DTA_NAME} ${DTA_SRCS})
  target_include_directories(${DTA_NAME} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${DTA_NAME} PRIVATE ${DTA_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  target_compile_options(${DTA_NAME} PRIVATE ${DTA_WARNINGS})
  set_target_properties(${DTA_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
  # One CTest entry per few cases of a suite (cmake/DtaGTestBatches.cmake): a LibTorch process
  # takes a second to start.
  dta_add_gtest_batches(TARGET ${DTA_NAME} LABELS ${DTA_LABELS})
endfunction()

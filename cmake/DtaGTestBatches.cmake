# CTest entries for a GoogleTest binary: its cases in batches of a few, one process per batch.
#
#   dta_add_gtest_batches(TARGET equivalence_test LABELS end-to-end)
#
# A process of a LibTorch test binary spends about a second before its first case registering
# LibTorch's operators; with one CTest entry per case (gtest_discover_tests) the ~700 LibTorch cases
# paid that 700 times, a quarter of CI's CTest time on two cores. Each entry here runs up to
# DTA_GTEST_BATCH cases of one suite (`--gtest_filter=Suite.A:Suite.B:...`), named after the suite
# and its batch ("LossTest", "Families/FamilyEquivalence[3/14]"); --output-on-failure shows which
# case failed. As with gtest_discover_tests' PRE_TEST mode, the cases are listed
# (--gtest_list_tests) when CTest starts, and again only after the binary changed.
set(DTA_GTEST_BATCH 6 CACHE STRING "GoogleTest cases per CTest entry (one process each)")

function(dta_add_gtest_batches)
  cmake_parse_arguments(ARG "" "TARGET" "LABELS" ${ARGN})
  set(prefix "${CMAKE_CURRENT_BINARY_DIR}/${ARG_TARGET}")
  # The listing allows minutes: a LibTorch binary starting on a loaded 2-core machine can take
  # longer than CMake's default 5 s, which failed the whole CTest run before any test ran.
  file(GENERATE OUTPUT "${prefix}_include.cmake" CONTENT
"set(executable [==[$<TARGET_FILE:${ARG_TARGET}>]==])
set(batches [==[${prefix}_batches.cmake]==])
if(EXISTS \"\${executable}\")
  if(NOT EXISTS \"\${batches}\" OR NOT \"\${batches}\" IS_NEWER_THAN \"\${executable}\" OR
     NOT \"\${batches}\" IS_NEWER_THAN \"\${CMAKE_CURRENT_LIST_FILE}\" OR
     NOT \"\${batches}\" IS_NEWER_THAN [==[${PROJECT_SOURCE_DIR}/cmake/DtaGTestBatchesList.cmake]==])
    include([==[${PROJECT_SOURCE_DIR}/cmake/DtaGTestBatchesList.cmake]==])
    dta_write_gtest_batches(
      EXECUTABLE \"\${executable}\"
      WORKING_DIRECTORY [==[${PROJECT_SOURCE_DIR}]==]
      LABELS [==[${ARG_LABELS}]==]
      BATCH [==[${DTA_GTEST_BATCH}]==]
      TEST_DISCOVERY_TIMEOUT [==[300]==]
      OUTPUT \"\${batches}\")
  endif()
  include(\"\${batches}\")
else()
  add_test(${ARG_TARGET}_NOT_BUILT ${ARG_TARGET}_NOT_BUILT)
endif()
")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${prefix}_include.cmake")
endfunction()

# Run by CTest (cmake/DtaGTestBatches.cmake): lists a GoogleTest binary's cases and writes a CTest
# script with one entry per batch of at most BATCH cases of one suite.
function(dta_write_gtest_batches)
  cmake_parse_arguments(ARG "" "EXECUTABLE;WORKING_DIRECTORY;LABELS;BATCH;TEST_DISCOVERY_TIMEOUT;OUTPUT"
                        "" ${ARGN})
  execute_process(
    COMMAND "${ARG_EXECUTABLE}" --gtest_list_tests
    WORKING_DIRECTORY "${ARG_WORKING_DIRECTORY}"
    TIMEOUT ${ARG_TEST_DISCOVERY_TIMEOUT}
    OUTPUT_VARIABLE listing
    ERROR_VARIABLE errors
    RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "${ARG_EXECUTABLE} --gtest_list_tests failed (${status}):\n${listing}\n${errors}")
  endif()
  # A CMake list splits on ';' except inside brackets: neither may reach it from the listing's
  # comments (GetParam() = ...), which are dropped below anyway.
  string(REPLACE ";" "<semicolon>" listing "${listing}")
  string(REPLACE "[" "<open>" listing "${listing}")
  string(REPLACE "]" "<close>" listing "${listing}")
  string(REPLACE "\n" ";" lines "${listing}")

  # Suites in listing order, each with its cases.
  set(suites "")
  set(suite "")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE " *#.*$" "" line "${line}")
    if(line MATCHES "^([^ ].*)\\.$")
      set(suite "${CMAKE_MATCH_1}")
      string(MAKE_C_IDENTIFIER "${suite}" key)
      list(APPEND suites "${suite}")
      set(cases_${key} "")
    elseif(line MATCHES "^  ([^ ]+)$" AND NOT suite STREQUAL "")
      set(case "${CMAKE_MATCH_1}")
      # --gtest_filter reads '-' as the start of negative patterns and '*', '?' as wildcards: such a
      # name would run other cases or none.
      if(case MATCHES "[-*?:]" OR suite MATCHES "[-*?:]")
        message(FATAL_ERROR "${ARG_EXECUTABLE}: the test ${suite}.${case} has a character "
                            "--gtest_filter treats specially (- * ? :): rename it")
      endif()
      list(APPEND cases_${key} "${case}")
    endif()
  endforeach()

  set(script "")
  set(total 0)
  foreach(suite IN LISTS suites)
    string(MAKE_C_IDENTIFIER "${suite}" key)
    list(LENGTH cases_${key} count)
    if(count EQUAL 0)
      continue()
    endif()
    math(EXPR total "${total} + ${count}")
    math(EXPR batches "(${count} + ${ARG_BATCH} - 1) / ${ARG_BATCH}")
    foreach(batch RANGE 1 ${batches})
      math(EXPR first "(${batch} - 1) * ${ARG_BATCH}")
      list(SUBLIST cases_${key} ${first} ${ARG_BATCH} cases)
      list(TRANSFORM cases PREPEND "${suite}.")
      list(JOIN cases ":" filter)
      if(batches EQUAL 1)
        set(name "${suite}")
      else()
        set(name "${suite}[${batch}/${batches}]")
      endif()
      string(APPEND script
             "add_test([==[${name}]==] [==[${ARG_EXECUTABLE}]==] [==[--gtest_filter=${filter}]==])\n"
             "set_tests_properties([==[${name}]==] PROPERTIES WORKING_DIRECTORY [==[${ARG_WORKING_DIRECTORY}]==]"
             # A filter that matched nothing would pass.
             " FAIL_REGULAR_EXPRESSION [==[Running 0 tests from]==]")
      if(NOT "${ARG_LABELS}" STREQUAL "")
        string(APPEND script " LABELS [==[${ARG_LABELS}]==]")
      endif()
      string(APPEND script ")\n")
    endforeach()
  endforeach()
  if(total EQUAL 0)
    message(FATAL_ERROR "${ARG_EXECUTABLE} --gtest_list_tests listed no test:\n${listing}")
  endif()
  file(WRITE "${ARG_OUTPUT}" "${script}")
endfunction()

# run_test.cmake - ctest's cmake_consumer test: installs the build into a
# scratch prefix, then configures, builds and runs tests/cmake_consumer
# against it. cmake -DBUILD_DIR= -DWORK_DIR= -DCONSUMER_SOURCE= -DGENERATOR=
#                   -DC_COMPILER= -P run_test.cmake
foreach(v BUILD_DIR WORK_DIR CONSUMER_SOURCE GENERATOR C_COMPILER)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "run_test.cmake: ${v} is not set")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}")
  endif()
  message(STATUS "ok: ${ARGN}")
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

set(prefix "${WORK_DIR}/prefix")
file(REMOVE_RECURSE "${WORK_DIR}")
run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}")

# Only the hand-written headers are installed, never cgo's libtsock.h.
file(GLOB headers RELATIVE "${prefix}/include" "${prefix}/include/*")
list(SORT headers)
if(NOT headers STREQUAL "tsock.h;tsock.hpp")
  message(FATAL_ERROR "installed headers: ${headers}")
endif()

run(${CMAKE_COMMAND} -S "${CONSUMER_SOURCE}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
    "-DCMAKE_PREFIX_PATH=${prefix}" "-DCMAKE_C_COMPILER=${C_COMPILER}")
run(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
run("${WORK_DIR}/build/consumer_reader")
run("${WORK_DIR}/build/consumer_tsock")
message(STATUS "${last_output}")
file(REMOVE_RECURSE "${WORK_DIR}")

# cmake -P tests/cmake/cuda_option.cmake: FUSEDMOE_ENABLE_CUDA's spellings
# (cmake/FusedmoeCudaOption.cmake). With -DVALUE=X it prints what X becomes
# (or fails as the configure would); without, it checks every case through a
# child cmake -P of itself.
include(${CMAKE_CURRENT_LIST_DIR}/../../cmake/FusedmoeCudaOption.cmake)
if(DEFINED VALUE)
  fusedmoe_cuda_option("${VALUE}" mode)
  message("mode=${mode}")
  return()
endif()
set(cases
    "AUTO=AUTO" "auto=AUTO" "Auto=AUTO"
    "ON=ON" "on=ON" "TRUE=ON" "true=ON" "YES=ON" "yes=ON" "Y=ON" "y=ON" "1=ON"
    "OFF=OFF" "off=OFF" "Off=OFF" "FALSE=OFF" "false=OFF" "NO=OFF" "no=OFF" "N=OFF" "n=OFF"
    "0=OFF")
set(failures 0)
foreach(c ${cases})
  string(REPLACE "=" ";" pair "${c}")
  list(GET pair 0 value)
  list(GET pair 1 want)
  execute_process(COMMAND ${CMAKE_COMMAND} -DVALUE=${value} -P ${CMAKE_CURRENT_LIST_FILE}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 OR NOT err MATCHES "mode=${want}\n")
    message("FAIL ${value}: expected mode=${want}, got exit ${rc}: ${err}")
    math(EXPR failures "${failures} + 1")
  endif()
endforeach()
foreach(value bogus 2 ONN "" "of f")
  execute_process(COMMAND ${CMAKE_COMMAND} "-DVALUE=${value}" -P ${CMAKE_CURRENT_LIST_FILE}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REPLACE "\n" " " flat "${err}")
  string(REGEX REPLACE " +" " " flat "${flat}")
  if(rc EQUAL 0 OR NOT flat MATCHES "FUSEDMOE_ENABLE_CUDA: expected AUTO, ON or OFF \\(or another CMake boolean: TRUE/FALSE, YES/NO, Y/N, 1/0; any case\\), got \"${value}\" \\(pip install . sets it from the FUSEDMOE_CUDA environment variable\\)")
    message("FAIL \"${value}\": expected a FATAL_ERROR naming FUSEDMOE_ENABLE_CUDA, got exit ${rc}: ${err}")
    math(EXPR failures "${failures} + 1")
  endif()
endforeach()
if(failures GREATER 0)
  message(FATAL_ERROR "${failures} case(s) failed")
endif()
message("ok: FUSEDMOE_ENABLE_CUDA spellings")

# fusedmoe_cuda_option(VALUE OUT): FUSEDMOE_ENABLE_CUDA's value (pip install .
# sets it from the FUSEDMOE_CUDA environment variable, pyproject.toml) as AUTO,
# ON or OFF in OUT. Taken in any case: AUTO, or one of CMake's boolean
# spellings ON/OFF, TRUE/FALSE, YES/NO, Y/N, 1/0; anything else is a
# FATAL_ERROR naming the variable (it was taken as AUTO: "off" built CUDA).
function(fusedmoe_cuda_option value out)
  string(TOUPPER "${value}" v)
  if(v STREQUAL "AUTO")
    set(r AUTO)
  elseif(v MATCHES "^(ON|TRUE|YES|Y|1)$")
    set(r ON)
  elseif(v MATCHES "^(OFF|FALSE|NO|N|0)$")
    set(r OFF)
  else()
    message(FATAL_ERROR
      "FUSEDMOE_ENABLE_CUDA: expected AUTO, ON or OFF (or another CMake boolean: TRUE/FALSE, "
      "YES/NO, Y/N, 1/0; any case), got \"${value}\" (pip install . sets it from the "
      "FUSEDMOE_CUDA environment variable)")
  endif()
  set(${out} ${r} PARENT_SCOPE)
endfunction()

# CUTLASS/CuTe headers, pinned to the version the project's set-up provides (requirements/build.txt:
# nvidia-cutlass==4.2.0.0, whose wheel ships the headers under cutlass_library/source/include).
# Search order: -DOPENVC_CUTLASS_INCLUDE=..., $OPENVC_CUTLASS_INCLUDE, third_party/cutlass/include (where
# scripts/setup.sh unpacks the wheel's headers, scripts/cutlass_headers.py), then an installed wheel found
# through the Python interpreter (`pip install .`'s isolated build environment, pyproject's build requires).
set(OPENVC_CUTLASS_VERSION "4.2.0")
if(NOT OPENVC_CUTLASS_INCLUDE AND DEFINED ENV{OPENVC_CUTLASS_INCLUDE})
  set(OPENVC_CUTLASS_INCLUDE "$ENV{OPENVC_CUTLASS_INCLUDE}")
endif()
if(NOT OPENVC_CUTLASS_INCLUDE AND EXISTS "${PROJECT_SOURCE_DIR}/third_party/cutlass/include/cute")
  set(OPENVC_CUTLASS_INCLUDE "${PROJECT_SOURCE_DIR}/third_party/cutlass/include")
endif()
if(NOT OPENVC_CUTLASS_INCLUDE)
  find_package(Python3 COMPONENTS Interpreter REQUIRED)
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c
      "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
    OUTPUT_VARIABLE _cutlass_inc OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc ERROR_QUIET)
  if(_rc EQUAL 0 AND EXISTS "${_cutlass_inc}/cute")
    set(OPENVC_CUTLASS_INCLUDE "${_cutlass_inc}")
  endif()
endif()
if(NOT OPENVC_CUTLASS_INCLUDE OR NOT EXISTS "${OPENVC_CUTLASS_INCLUDE}/cutlass/version.h")
  message(FATAL_ERROR "CUTLASS headers not found: run `python3 scripts/cutlass_headers.py` (unpacks the "
                      "nvidia-cutlass==4.2.0.0 wheel's headers into third_party/cutlass/include; scripts/setup.sh "
                      "runs it) or pass -DOPENVC_CUTLASS_INCLUDE=<dir>")
endif()
file(STRINGS "${OPENVC_CUTLASS_INCLUDE}/cutlass/version.h" _ver REGEX "#define CUTLASS_(MAJOR|MINOR|PATCH) ")
string(REGEX REPLACE ".*CUTLASS_MAJOR ([0-9]+).*CUTLASS_MINOR ([0-9]+).*CUTLASS_PATCH ([0-9]+).*" "\\1.\\2.\\3" _found "${_ver}")
if(NOT _found VERSION_EQUAL OPENVC_CUTLASS_VERSION)
  message(FATAL_ERROR "CUTLASS ${_found} found at ${OPENVC_CUTLASS_INCLUDE}; openvc pins ${OPENVC_CUTLASS_VERSION}")
endif()
message(STATUS "CUTLASS ${_found}: ${OPENVC_CUTLASS_INCLUDE}")
add_library(openvc_cutlass INTERFACE)
target_include_directories(openvc_cutlass SYSTEM INTERFACE "${OPENVC_CUTLASS_INCLUDE}")

# Third-party libraries, all from Debian/Ubuntu packages (installed by scripts/setup.sh).
find_package(Threads REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(fmt REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(yaml-cpp REQUIRED)
# yaml-cpp 0.8 (Ubuntu 24.04) exports yaml-cpp::yaml-cpp; 0.7 (Debian 12) exports plain yaml-cpp.
if(TARGET yaml-cpp::yaml-cpp)
  set(LATHE_YAML_TARGET yaml-cpp::yaml-cpp)
else()
  set(LATHE_YAML_TARGET yaml-cpp)
endif()
# MPI (Debian's OpenMPI): the CPU data plane of the parallel runtime (src/comm/). Optional, so that a machine without
# its headers still builds; a parallel launch is then refused with a message that names the missing package.
find_package(MPI COMPONENTS C QUIET)
if(MPI_C_FOUND)
  message(STATUS "lathe: MPI ${MPI_C_VERSION} (parallel runs on the CPU)")
else()
  message(STATUS "lathe: no MPI found (install libopenmpi-dev): parallel runs over MPI are disabled")
endif()
find_package(PkgConfig REQUIRED)
pkg_check_modules(OPENBLAS REQUIRED IMPORTED_TARGET openblas)

# CLI11 ships only headers (and, in some versions, no CMake package): find the header.
find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
add_library(lathe_cli11 INTERFACE)
target_include_directories(lathe_cli11 SYSTEM INTERFACE ${CLI11_INCLUDE_DIR})

if(LATHE_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(LATHE_BUILD_BENCH)
  find_package(benchmark QUIET)
endif()

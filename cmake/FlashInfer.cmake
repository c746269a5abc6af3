# FlashInfer 0.7.4's headers (and the CCCL they need) for the CUDA attention backend. They are not
# in the repository: scripts/fetch_flashinfer.sh (run by scripts/bootstrap.sh when a CUDA toolkit
# is present) unpacks them from the pinned PyPI wheel into .cache/flashinfer-0.7.4/.
#
# Included from pdsim_resolve_gpu_options (cmake/PdsimOptions.cmake) after CUDA is enabled. Sets
#   PDSIM_FLASHINFER_ENABLED   ON when CUDA is on and the headers are there
#   PDSIM_FLASHINFER_VERSION   the pinned version
#   _pdsim_flashinfer_reason   why it is OFF, for the configure summary
# and, when enabled, the INTERFACE target pdsim_flashinfer_headers: FlashInfer's include directory
# with the wheel's CCCL (libcudacxx, cub, thrust) FIRST on the include path. CUDA 13.0's bundled
# CCCL (3.0) lacks cuda::fast_mod_div, which FlashInfer 0.7.4 uses; the wheel ships CCCL 3.6.
# Only the FlashInfer adapter's translation units link it (privately), so the rest of pdsim keeps
# the toolkit's CCCL.
set(PDSIM_FLASHINFER_VERSION "0.7.4")
set(PDSIM_WITH_FLASHINFER "AUTO" CACHE STRING
    "Build the FlashInfer attention kernels (AUTO|ON|OFF; needs CUDA and the fetched headers)")
set_property(CACHE PDSIM_WITH_FLASHINFER PROPERTY STRINGS AUTO ON OFF)
set(PDSIM_FLASHINFER_DIR "${PROJECT_SOURCE_DIR}/.cache/flashinfer-${PDSIM_FLASHINFER_VERSION}"
    CACHE PATH "FlashInfer headers unpacked by scripts/fetch_flashinfer.sh")

set(PDSIM_FLASHINFER_ENABLED OFF)
set(_pdsim_flashinfer_reason "")
set(_pdsim_fi_required
  "include/flashinfer/attention/decode.cuh"
  "include/flashinfer/attention/prefill.cuh"
  "include/flashinfer/page.cuh"
  "cccl/libcudacxx/include/cuda/cmath"
  "cccl/cub/cub/cub.cuh"
  "cccl/thrust/thrust/version.h")
set(_pdsim_fi_missing "")
foreach(_f IN LISTS _pdsim_fi_required)
  if(NOT EXISTS "${PDSIM_FLASHINFER_DIR}/${_f}")
    list(APPEND _pdsim_fi_missing "${_f}")
  endif()
endforeach()

if(PDSIM_WITH_FLASHINFER STREQUAL "OFF")
  set(_pdsim_flashinfer_reason " (disabled)")
elseif(NOT PDSIM_CUDA_ENABLED)
  if(PDSIM_WITH_FLASHINFER STREQUAL "ON")
    message(FATAL_ERROR "PDSIM_WITH_FLASHINFER=ON needs CUDA")
  endif()
  set(_pdsim_flashinfer_reason " (needs CUDA)")
elseif(_pdsim_fi_missing)
  if(PDSIM_WITH_FLASHINFER STREQUAL "ON")
    message(FATAL_ERROR "PDSIM_WITH_FLASHINFER=ON but ${PDSIM_FLASHINFER_DIR} lacks "
                        "${_pdsim_fi_missing}: run scripts/bootstrap.sh "
                        "(or scripts/fetch_flashinfer.sh)")
  endif()
  set(_pdsim_flashinfer_reason " (not fetched: run scripts/bootstrap.sh)")
else()
  if(NOT TARGET pdsim_flashinfer_headers)
    add_library(pdsim_flashinfer_headers INTERFACE)
    # Plain -I (not -isystem), so these come before the toolkit's own CCCL.
    target_include_directories(pdsim_flashinfer_headers INTERFACE
      "${PDSIM_FLASHINFER_DIR}/cccl/libcudacxx/include"
      "${PDSIM_FLASHINFER_DIR}/cccl/cub"
      "${PDSIM_FLASHINFER_DIR}/cccl/thrust"
      "${PDSIM_FLASHINFER_DIR}/include")
    # FlashInfer's own build flags for these kernels: constexpr host helpers used in device code,
    # fast math (its tested configuration).
    target_compile_options(pdsim_flashinfer_headers INTERFACE
      $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -use_fast_math>)
  endif()
  set(PDSIM_FLASHINFER_ENABLED ON)
endif()
unset(_pdsim_fi_required)
unset(_pdsim_fi_missing)

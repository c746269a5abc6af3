// Built-in registration of attention backends and device runtimes. This is the one place that
// knows which optional parts were compiled in (PDSIM_HAVE_CUDA is a private definition of this
// file, never seen by a public header; PDSIM_HAVE_FLASHINFER comes with pdsim_flashinfer, and
// PDSIM_CUDA_ATTENTION_UNAVAILABLE, set by backends/CMakeLists.txt when it is not built, says why).
#include <memory>
#include <utility>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/attention/cpu_backend.h"
#include "backends/attention/cpu_ref_backend.h"
#include "backends/pd/step_counter.h"
#include "backends/runtime/device.h"

#if defined(PDSIM_HAVE_CUDA)
#include "backends/cuda/cuda_runtime_api.h"
#include "backends/cuda/device_step_counter.h"
#endif
#if defined(PDSIM_HAVE_FLASHINFER)
#include "backends/cuda/cuda_attention_backend.h"
#endif

namespace pdsim::attn {

void register_builtin_attention_backends() {
    register_attention_backend(
        "cpu_ref", [](const AttentionConfig& c) -> StatusOr<std::unique_ptr<AttentionBackend>> {
            return std::unique_ptr<AttentionBackend>(std::make_unique<CpuRefBackend>(c));
        });
    register_attention_backend(
        "cpu", [](const AttentionConfig& c) -> StatusOr<std::unique_ptr<AttentionBackend>> {
            return make_cpu_backend(c);
        });
#if defined(PDSIM_HAVE_FLASHINFER)
    register_attention_backend("cuda", &cuda::CudaAttentionBackend::create);
#else
    // Registered anyway, so that asking for it says why it is missing rather than "unknown".
    register_attention_backend(
        "cuda", [](const AttentionConfig&) -> StatusOr<std::unique_ptr<AttentionBackend>> {
#if defined(PDSIM_CUDA_ATTENTION_UNAVAILABLE)
            return PDSIM_ERROR(StatusCode::kUnavailable,
                               "attention backend 'cuda' was not built: {}",
                               PDSIM_CUDA_ATTENTION_UNAVAILABLE);
#else
            return PDSIM_ERROR(StatusCode::kUnavailable, "attention backend 'cuda' was not built");
#endif
        });
#endif
}

}  // namespace pdsim::attn

namespace pdsim::runtime {

// Called once, lazily, by the device runtime registry (device.cpp).
void register_builtin_device_runtimes() {
#if defined(PDSIM_HAVE_CUDA)
    register_device_runtime(cuda::make_cuda_runtime());
#endif
}

}  // namespace pdsim::runtime

namespace pdsim::pd {

// The optional StepCounter implementations, installed by its registry on first use
// (step_counter.cpp; the CPU one is always there).
std::vector<std::pair<runtime::DeviceKind, StepCounterImplFactory>> builtin_step_counter_impls() {
    std::vector<std::pair<runtime::DeviceKind, StepCounterImplFactory>> impls;
#if defined(PDSIM_HAVE_CUDA)
    impls.emplace_back(runtime::DeviceKind::kCuda, &cuda::make_device_step_counter_impl);
#endif
    return impls;
}

}  // namespace pdsim::pd

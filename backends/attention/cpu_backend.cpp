// TEMPORARY scaffold: replaced by the real tiled kernels before this lands.
#include "backends/attention/cpu_backend.h"

#include "backends/attention/cpu_kernel_common.h"
#include "backends/attention/cpu_ref_backend.h"

namespace pdsim::attn {
StatusOr<std::unique_ptr<AttentionBackend>> make_cpu_backend(const AttentionConfig& config) {
    return std::unique_ptr<AttentionBackend>(std::make_unique<CpuRefBackend>(config));
}
}  // namespace pdsim::attn

// FlashInfer paged causal extend, head dim 64 (see flashinfer_extend_impl.cuh).
#include "backends/cuda/flashinfer_extend_impl.cuh"

namespace pdsim::attn::cuda::detail {
template std::string launch_paged_extend<64>(const PagedKernelArgs& args, void* stream);
}  // namespace pdsim::attn::cuda::detail

// FlashInfer paged causal extend, head dim 128 (see flashinfer_extend_impl.cuh).
#include "backends/cuda/flashinfer_extend_impl.cuh"

namespace pdsim::attn::cuda::detail {
template std::string launch_paged_extend<128>(const PagedKernelArgs& args, void* stream);
}  // namespace pdsim::attn::cuda::detail

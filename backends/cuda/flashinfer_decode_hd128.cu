// FlashInfer paged decode, head dim 128 (see flashinfer_decode_impl.cuh).
#include "backends/cuda/flashinfer_decode_impl.cuh"

namespace pdsim::attn::cuda::detail {
template std::string launch_paged_decode<128>(const PagedKernelArgs& args, void* stream);
}  // namespace pdsim::attn::cuda::detail

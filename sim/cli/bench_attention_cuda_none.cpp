// `pdsim bench attention --backend cuda` in a build without CUDA or FlashInfer: it says so.
// PDSIM_BENCH_CUDA_UNAVAILABLE (sim/CMakeLists.txt) says which is missing.
#include "sim/cli/bench_attention_cuda.h"

#ifndef PDSIM_BENCH_CUDA_UNAVAILABLE
#define PDSIM_BENCH_CUDA_UNAVAILABLE "built without CUDA and FlashInfer"
#endif

namespace pdsim::cli {

Status run_bench_attention_cuda(const CudaBenchOptions& /*o*/) {
    return Status(StatusCode::kInvalidArgument,
                  "--backend cuda: pdsim was " PDSIM_BENCH_CUDA_UNAVAILABLE
                  ", so the cuda attention bench is not in this binary (bench attention "
                  "--backend cpu|cpu_ref runs here)");
}

}  // namespace pdsim::cli

// The host-side plan of the testbed's GPU ranks (`--backend cuda`, docs/testbed.md "GPU rank"):
// which GPU a rank computes on, how the GPU model is sized for a run, how much device memory a
// rank needs, and what resolve() asks about this host's GPUs (GpuProbe, which tests replace with
// a fake). Plain C++ with no CUDA call of its own, built in every configuration; the rank's GPU
// objects are sim/testbed/gpu_rank.h.
//
// Thread-safety: pure functions; system_gpu_probe() is safe from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "backends/cuda/cuda_synthetic_model_plan.h"
#include "backends/model/model_config.h"
#include "common/status.h"
#include "topology/topology.h"

namespace pdsim::testbed {

// The attention backend name that makes a rank a GPU rank.
inline constexpr std::string_view kCudaBackend = "cuda";

// One GPU as this process sees it.
struct GpuInfo {
    int device = 0;           // CUDA ordinal
    std::string name;         // cudaGetDeviceProperties' name, e.g. "NVIDIA H200"
    int64_t total_bytes = 0;  // device memory
    int64_t free_bytes = 0;   // free when asked
};

// What resolve() asks about this host's GPUs.
class GpuProbe {
public:
    virtual ~GpuProbe() = default;
    // "" when this build can run --backend cuda; else why not, starting "this pdsim was built
    // without CUDA" (or without the pieces a GPU rank needs, e.g. the FlashInfer attention).
    [[nodiscard]] virtual std::string build_problem() const = 0;
    // How many GPUs this process sees: >= 1, or kUnavailable "no device: <why>".
    [[nodiscard]] virtual StatusOr<int> device_count() const = 0;
    // Name and memory of `device` (0 <= device < device_count()). Asking for the free memory
    // creates the device's CUDA context in this process.
    [[nodiscard]] virtual StatusOr<GpuInfo> device_info(int device) const = 0;
};

// The real probe: the CUDA runtime's answers in a CUDA build (gpu_rank_cuda.cpp); in a build
// without CUDA (gpu_rank_stub.cpp) build_problem() says so and the others are kUnavailable.
[[nodiscard]] const GpuProbe& system_gpu_probe();

// Which CUDA device a rank computes on. When the rank's topology device is a GPU (the topology
// maps ranks to GPUs), its ordinal on its node (topo::RankInfo::device_index: the device's
// `index`, else its position in the node's list); otherwise (a `cpu` device) the rank's index
// among the ranks of this host (`local_index`: the rank itself when every rank is a thread of one
// process, mpirun's local rank otherwise) modulo the GPUs this process sees.
struct GpuChoice {
    int device = 0;
    bool from_topology = false;  // the ordinal of the rank's topology GPU
    std::string how;             // "topology device node0.gpu0" / "local rank 3 % 2 GPUs"
};
// kInvalidArgument naming the topology device when its ordinal is not one of the `visible_gpus`
// GPUs this process sees. Preconditions: visible_gpus >= 1, local_index >= 0.
[[nodiscard]] StatusOr<GpuChoice> choose_gpu(const topo::Topology& topology,
                                             const topo::RankInfo& rank, int local_index,
                                             int visible_gpus, std::string_view topology_label);

// What sizes the GPU model of a run (every buffer is allocated once, at create()).
struct GpuModelSizing {
    int max_batch_tokens = 2048;  // --max-batch-tokens
    int max_decode_batch = 64;    // --max-decode-batch
    int64_t requests = 1;         // requests of the run (an extend forward has at most this many)
    int64_t max_sequence = 1;     // the longest input + output of the run's requests
};
// The GPU model's options for `device`: max_tokens = max(max_batch_tokens, max_decode_batch);
// max_bs = max(max_decode_batch, min(max_batch_tokens, requests)) (an extend forward holds at
// most one chunk of each request, a decode forward at most max_decode_batch requests);
// max_positions = max_sequence rounded up to a multiple of 64 (the RoPE table's rows).
[[nodiscard]] model::cuda::CudaModelOptions gpu_model_options(const GpuModelSizing& sizing,
                                                              int device);
// The decode CUDA graph buckets of a run: 1, 2, 4, ... up to max_decode_batch (decode forwards
// never hold more requests).
[[nodiscard]] std::vector<int> gpu_decode_buckets(int max_decode_batch);

// Device memory one GPU rank needs besides what CUDA itself takes: its KV pool, the GPU model's
// weights and workspace, and kGpuHeadroomBytes for the attention backend's and cuBLASLt's
// workspaces, the decode graphs and the pinned staging (measured small; a round margin).
inline constexpr int64_t kGpuHeadroomBytes = int64_t{1} << 30;
// Added to a TP > 1 rank's headroom with the NCCL TP exchange (--tp-exchange nccl): NCCL's
// buffers for its group's connections (NCCL_BUFFSIZE, 4 MiB by default, per channel and peer,
// allocated at the first gather, after the KV pool), an allowance, not a measurement.
inline constexpr int64_t kNcclTpExchangeBytes = int64_t{512} << 20;
struct GpuMemoryNeed {
    int64_t kv_pool_bytes = 0;
    int64_t weight_bytes = 0;
    int64_t workspace_bytes = 0;
    int64_t headroom_bytes = kGpuHeadroomBytes;
    [[nodiscard]] int64_t total() const {
        return kv_pool_bytes + weight_bytes + workspace_bytes + headroom_bytes;
    }
};
// What one rank of a TP group of `tp_size` needs. Precondition:
// model::cuda::check_cuda_model_config(model, tp_size, options) passed.
[[nodiscard]] GpuMemoryNeed gpu_memory_need(const model::ModelConfig& model,
                                            const model::cuda::CudaModelOptions& options,
                                            int64_t kv_pool_bytes, int tp_size = 1);

}  // namespace pdsim::testbed

#include "sim/testbed/gpu_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace pdsim::testbed {

StatusOr<GpuChoice> choose_gpu(const topo::Topology& topology, const topo::RankInfo& rank,
                               int local_index, int visible_gpus, std::string_view topology_label) {
    const topo::Device* device = topology.find_device(rank.device);
    GpuChoice choice;
    if (device != nullptr && !device->is_cpu()) {
        if (rank.device_index < 0 || rank.device_index >= visible_gpus) {
            return invalid_argument_error(fmt::format(
                "{}: rank {} runs on {} device {} (CUDA ordinal {}), but this process sees {} "
                "GPU{} (ordinals 0..{}); fix the device's `index` or CUDA_VISIBLE_DEVICES",
                topology_label, rank.rank, device->type, device->id, rank.device_index,
                visible_gpus, visible_gpus == 1 ? "" : "s", visible_gpus - 1));
        }
        choice.device = rank.device_index;
        choice.from_topology = true;
        choice.how = fmt::format("topology device {}", device->id);
        return choice;
    }
    choice.device = local_index % std::max(1, visible_gpus);
    choice.from_topology = false;
    choice.how = fmt::format("local rank {} % {} GPU{}", local_index, visible_gpus,
                             visible_gpus == 1 ? "" : "s");
    return choice;
}

model::cuda::CudaModelOptions gpu_model_options(const GpuModelSizing& s, int device) {
    model::cuda::CudaModelOptions o;
    o.device = device;
    o.max_tokens = std::max(s.max_batch_tokens, s.max_decode_batch);
    const int64_t extend_requests = std::min<int64_t>(s.max_batch_tokens, s.requests);
    o.max_bs = static_cast<int>(std::max<int64_t>(s.max_decode_batch, extend_requests));
    constexpr int64_t kRopeRows = 64;
    const int64_t positions = (std::max<int64_t>(1, s.max_sequence) + kRopeRows - 1) / kRopeRows;
    o.max_positions =
        static_cast<int>(std::min<int64_t>(positions * kRopeRows, std::numeric_limits<int>::max()));
    return o;
}

std::vector<int> gpu_decode_buckets(int max_decode_batch) {
    return model::cuda::default_decode_buckets(max_decode_batch);
}

GpuMemoryNeed gpu_memory_need(const model::ModelConfig& model,
                              const model::cuda::CudaModelOptions& options, int64_t kv_pool_bytes,
                              int tp_size) {
    GpuMemoryNeed need;
    need.kv_pool_bytes = kv_pool_bytes;
    need.weight_bytes = model::cuda::estimate_weight_memory(model, tp_size).total;
    need.workspace_bytes =
        static_cast<int64_t>(model::cuda::plan_workspace(model, options, tp_size).total_bytes);
    return need;
}

}  // namespace pdsim::testbed

// The GPU rank and the GPU probe of a CUDA build (gpu_rank.h, gpu_plan.h); gpu_rank_stub.cpp
// stands in without CUDA. Plain C++: the CUDA calls are behind backends/cuda's plain headers.
#include <fmt/format.h>

#include "backends/cuda/cuda_device_info.h"
#include "backends/cuda/cuda_synthetic_model.h"
#include "backends/cuda/device_memory_ops.h"
#include "backends/runtime/device.h"
#include "common/logging.h"
#include "sim/testbed/gpu_rank.h"

namespace pdsim::testbed {

namespace {

class SystemGpuProbe final : public GpuProbe {
public:
    [[nodiscard]] std::string build_problem() const override {
#if defined(PDSIM_HAVE_FLASHINFER)
        return {};
#else
        return "this pdsim was built without the cuda attention backend (FlashInfer was not "
               "fetched: run scripts/bootstrap.sh and rebuild)";
#endif
    }
    [[nodiscard]] StatusOr<int> device_count() const override {
        PDSIM_ASSIGN_OR_RETURN(runtime::DeviceRuntime * rt,
                               runtime::device_runtime(runtime::DeviceKind::kCuda));
        if (rt->device_count() == 0) {
            // The runtime's reason: "no device: <why>" (no source location: no call failed here).
            return Status(StatusCode::kUnavailable, rt->unavailable_reason());
        }
        return rt->device_count();
    }
    [[nodiscard]] StatusOr<GpuInfo> device_info(int device) const override {
        PDSIM_ASSIGN_OR_RETURN(runtime::cuda::CudaDeviceInfo d,
                               runtime::cuda::query_cuda_device(device));
        return GpuInfo{.device = d.index,
                       .name = std::move(d.name),
                       .total_bytes = d.total_bytes,
                       .free_bytes = d.free_bytes};
    }
};

// Members in construction order: the stream first, so that it is destroyed last.
class CudaGpuRank final : public GpuRank {
public:
    CudaGpuRank(GpuRankOptions options, GpuInfo info, std::unique_ptr<runtime::Stream> stream)
        : options_(std::move(options)), info_(std::move(info)), stream_(std::move(stream)) {}
    ~CudaGpuRank() override {
        // The model's destructor waits (bounded) for its last forward, then frees its buffers;
        // the stream's destructor then drains and destroys the CUDA stream.
        model_.reset();
    }

    Status init(const model::ModelConfig& config) {
        PDSIM_ASSIGN_OR_RETURN(
            model_, model::cuda::CudaSyntheticModel::create(config, options_.tp, options_.model,
                                                            options_.device_tp));
        return {};
    }

    [[nodiscard]] runtime::Stream& stream() override { return *stream_; }
    [[nodiscard]] model::Model& model() override { return *model_; }
    [[nodiscard]] const GpuInfo& info() const override { return info_; }

    [[nodiscard]] Status begin_phase(attn::AttentionBackend& backend, kv::KVPool& pool) override {
        if (&backend.stream() != stream_.get()) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "GpuRank: the phase's backend computes on stream {}, the rank's "
                               "stream is {}",
                               backend.stream().name(), stream_->name());
        }
        model_->set_layer_timing(true);
        model_->set_decode_graphs_enabled(false);
        if (!options_.decode_graphs) {
            graphs_state_ = "off (--decode-graphs off)";
            return {};
        }
        if (model_->tp_size() > 1) {
            graphs_state_ = options_.device_tp == nullptr
                                ? fmt::format("off (tp {}: the TP exchange is a host round trip)",
                                              model_->tp_size())
                                : fmt::format(
                                      "off (tp {}: graphs with the {} TP exchange are not "
                                      "built)",
                                      model_->tp_size(), options_.device_tp->name());
            return {};
        }
        model::cuda::DecodeGraphOptions go;
        go.buckets = options_.graph_buckets;
        if (Status st = model_->capture_decode_graphs(backend, pool, go); !st.ok()) {
            graphs_state_ = "off: capture failed: " + st.to_string();
            PDSIM_LOG_WARN(
                "GPU cuda:{} ({}): decode CUDA graphs not captured, decode runs "
                "eagerly: {}",
                info_.device, info_.name, st.to_string());
            // A capture that failed on the GPU itself leaves the stream's error behind.
            return stream_->synchronize(options_.sync_timeout);
        }
        model_->set_decode_graphs_enabled(true);
        graphs_state_ = fmt::format("on (buckets {})", fmt::join(model_->decode_buckets(), ","));
        PDSIM_LOG_INFO("GPU cuda:{} ({}): decode graphs {}", info_.device, info_.name,
                       graphs_state_);
        return {};
    }
    [[nodiscard]] std::string decode_graphs_state() const override { return graphs_state_; }

    void end_phase() override {
        // Nothing may still run on the phase's pool and backend once they go; a stream error is
        // the phase's (its server synchronizes after every forward and reported it there).
        stream_->synchronize(options_.sync_timeout).ignore_error();
        // The graphs hold the phase's backend and pool: never replay them again (the next
        // begin_phase() captures new ones, which replaces these).
        model_->set_decode_graphs_enabled(false);
        model_->set_skip_graph_metadata_refresh(false);
    }

    [[nodiscard]] Status enqueue_fill(void* dst, int byte, size_t bytes) override {
        return runtime::cuda::enqueue_device_fill(*stream_, dst, byte, bytes);
    }
    void set_stale_graph_metadata(bool stale) override {
        model_->set_skip_graph_metadata_refresh(stale);
    }

    [[nodiscard]] StatusOr<GpuForwardTiming> last_forward_timing() const override {
        return model_->last_forward_timing();
    }
    [[nodiscard]] int last_forward_bucket() const override { return model_->last_forward_bucket(); }

private:
    GpuRankOptions options_;
    GpuInfo info_;
    std::unique_ptr<runtime::Stream> stream_;
    std::unique_ptr<model::cuda::CudaSyntheticModel> model_;
    std::string graphs_state_ = "off (no phase yet)";
};

}  // namespace

const GpuProbe& system_gpu_probe() {
    static const SystemGpuProbe probe;
    return probe;
}

StatusOr<std::unique_ptr<GpuRank>> GpuRank::create(const model::ModelConfig& config,
                                                   const GpuRankOptions& options) {
    const GpuProbe& probe = system_gpu_probe();
    if (std::string why = probe.build_problem(); !why.empty()) {
        return Status(StatusCode::kUnavailable, why);
    }
    PDSIM_RETURN_IF_ERROR(probe.device_count().status());
    PDSIM_ASSIGN_OR_RETURN(GpuInfo info, probe.device_info(options.model.device));
    PDSIM_ASSIGN_OR_RETURN(runtime::DeviceRuntime * rt,
                           runtime::device_runtime(runtime::DeviceKind::kCuda));
    PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<runtime::Stream> stream,
                           rt->create_stream(options.model.device, options.stream_name));
    auto rank = std::make_unique<CudaGpuRank>(options, std::move(info), std::move(stream));
    PDSIM_RETURN_IF_ERROR(rank->init(config));
    return std::unique_ptr<GpuRank>(std::move(rank));
}

}  // namespace pdsim::testbed

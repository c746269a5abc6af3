// The GPU rank and the GPU probe of a build without CUDA (gpu_rank.h, gpu_plan.h): every answer
// says so. gpu_rank_cuda.cpp is the real one.
#include "sim/testbed/gpu_rank.h"

namespace pdsim::testbed {

namespace {

constexpr const char* kNoCuda =
    "this pdsim was built without CUDA (configure with a CUDA toolkit "
    "and -DPDSIM_WITH_CUDA=ON)";

class NoCudaProbe final : public GpuProbe {
public:
    [[nodiscard]] std::string build_problem() const override { return kNoCuda; }
    [[nodiscard]] StatusOr<int> device_count() const override {
        return Status(StatusCode::kUnavailable, kNoCuda);
    }
    [[nodiscard]] StatusOr<GpuInfo> device_info(int /*device*/) const override {
        return Status(StatusCode::kUnavailable, kNoCuda);
    }
};

}  // namespace

const GpuProbe& system_gpu_probe() {
    static const NoCudaProbe probe;
    return probe;
}

StatusOr<std::unique_ptr<GpuRank>> GpuRank::create(const model::ModelConfig& /*config*/,
                                                   const GpuRankOptions& /*options*/) {
    return Status(StatusCode::kUnavailable, kNoCuda);
}

}  // namespace pdsim::testbed

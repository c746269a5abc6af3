#include "backends/attention/cpu_backend.h"

#include "backends/attention/cpu_kernel_common.h"
#include "backends/attention/cpu_kernels.h"

namespace pdsim::attn {

namespace {

class CpuBackend final : public AttentionBackend {
public:
    explicit CpuBackend(const AttentionConfig& config)
        : AttentionBackend(config),
          kernels_(std::make_shared<cpu::CpuAttentionKernels>(config.num_threads)) {}

    [[nodiscard]] std::string name() const override { return "cpu"; }
    [[nodiscard]] BackendCapabilities capabilities() const override {
        return cpu::cpu_capabilities();
    }
    [[nodiscard]] bool support_kv_cache_prewrite(std::optional<ForwardMode>) const override {
        return true;
    }

protected:
    [[nodiscard]] Status forward_decode(const ForwardArgs& args) override { return enqueue(args); }
    [[nodiscard]] Status forward_extend(const ForwardArgs& args) override { return enqueue(args); }

private:
    // The stream task reads the metadata when it runs (a graph replay sees the current batch),
    // checks it against the forward's mode and bs (graph buffers may hold fewer requests than
    // captured), the pool and the views' rows, writes the new KV unless it was pre-written, then
    // attends (bf16 activations through fp32 copies). It holds
    // the kernels by shared_ptr, so queued or captured work outlives the backend safely.
    [[nodiscard]] Status enqueue(const ForwardArgs& args) {
        return stream().enqueue([args, kernels = kernels_] {
            const BatchView view = args.meta->view();
            if (view.mode != args.mode && !(is_idle(args.mode) && view.bs == 0)) {
                return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                                   "forward mode {} but the metadata describes a {} batch",
                                   forward_mode_name(args.mode), forward_mode_name(view.mode));
            }
            if (view.graph ? view.bs > args.bs : view.bs != args.bs) {
                return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                                   "forward bs {} but the metadata has bs {}", args.bs, view.bs);
            }
            PDSIM_RETURN_IF_ERROR(cpu::validate_view(view, *args.pool, args.layer));
            PDSIM_RETURN_IF_ERROR(cpu::check_rows(args, view));
            if (args.save_kv_cache) PDSIM_RETURN_IF_ERROR(cpu::write_kv(args, view));
            cpu::with_fp32_activations(args, view.num_tokens, [&](const ForwardArgs& f) {
                kernels->run(cpu::make_problem(f, view));
            });
            return Status();
        });
    }

    std::shared_ptr<cpu::CpuAttentionKernels> kernels_;
};

}  // namespace

StatusOr<std::unique_ptr<AttentionBackend>> make_cpu_backend(const AttentionConfig& config) {
    return std::unique_ptr<AttentionBackend>(std::make_unique<CpuBackend>(config));
}

}  // namespace pdsim::attn

// cpu_ref: the oracle attention backend. Plain loops, fp64 accumulation, no tiling, no threads:
// slow and obviously correct. Every other backend is tested against it. Accepts what
// cpu::cpu_capabilities() declares: fp32 or bf16 activations (bf16 q is widened to fp32, the
// output rounded to bf16), fp32 or bf16 KV, host memory, and sliding-window attention (the query at
// position p attends keys [max(0, p - W + 1), p] for LayerSpec::sliding_window W > 0).
#pragma once

#include "backends/attention/attention_backend.h"

namespace pdsim::attn {

class CpuRefBackend final : public AttentionBackend {
public:
    explicit CpuRefBackend(const AttentionConfig& config) : AttentionBackend(config) {}
    [[nodiscard]] std::string name() const override { return "cpu_ref"; }
    [[nodiscard]] BackendCapabilities capabilities() const override;
    [[nodiscard]] bool support_kv_cache_prewrite(std::optional<ForwardMode>) const override {
        return true;
    }

    // The kernel itself, runnable inline (the oracle for tests): attention of every query of `view`
    // over the paged KV of args.pool (windowed by args.layer.sliding_window when > 0), written to
    // args.out. No KV write, no validation; q and out must be fp32 host views of at least
    // view.num_tokens rows.
    static void attend(const ForwardArgs& args, const BatchView& view);

protected:
    [[nodiscard]] Status forward_decode(const ForwardArgs& args) override;
    [[nodiscard]] Status forward_extend(const ForwardArgs& args) override;

private:
    [[nodiscard]] Status enqueue(const ForwardArgs& args);
};

}  // namespace pdsim::attn

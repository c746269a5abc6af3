// cpu_ref: the oracle attention backend. Plain loops, fp64 accumulation, no tiling, no threads:
// slow and obviously correct. Every other backend is tested against it.
#pragma once

#include "backends/attention/attention_backend.h"

namespace pdsim::attn {

class CpuRefBackend final : public AttentionBackend {
public:
    explicit CpuRefBackend(const AttentionConfig& config) : AttentionBackend(config) {}
    [[nodiscard]] std::string name() const override { return "cpu_ref"; }
    [[nodiscard]] bool support_kv_cache_prewrite(std::optional<ForwardMode>) const override { return true; }

    // The kernel itself, runnable inline (the oracle for tests): attention of every query of `view`
    // over the paged KV of args.pool, written to args.out. No KV write, no validation.
    static void attend(const ForwardArgs& args, const BatchView& view);

protected:
    [[nodiscard]] Status forward_decode(const ForwardArgs& args) override;
    [[nodiscard]] Status forward_extend(const ForwardArgs& args) override;

private:
    [[nodiscard]] Status enqueue(const ForwardArgs& args);
};

}  // namespace pdsim::attn

// Cost models: how long one forward of one instance takes, for the discrete-event simulator.
//
// An instance (a prefill, decode or colocated group of `tp` ranks) runs one forward at a time:
//   extend (prefill): a batch of requests, each adding `new_tokens` to `cached_tokens` already in
//     its KV cache (an earlier chunk, or a prefix-cache hit); causal attention over both.
//   decode: `batch_size` requests each adding one token, attending `kv_tokens` KV tokens in all
//     (the sum of their context lengths, the new tokens included).
// Both return the whole model's time (every layer, the TP collectives, the LM head); layers are
// uniform, so layer l of an extend forward that starts at t is written at
// t + (l + 1) * extend_s / num_layers. Times are seconds; functions are pure and deterministic.
//
// Kinds (make_cost_model):
//   roofline    from the GPU spec table: per layer max(FLOPs / (peak * mfu), bytes / (HBM * mbu))
//               for the GEMMs and attention at the instance's TP, plus the TP all-reduces over
//               the instance's TP link (ring: 2 (tp-1)/tp * bytes / bw + 2 (tp-1) * latency).
//   calibrated  fitted to measurements of the testbed's own backends on the machine that ran
//               `pdsim calibrate` (a cost file, cost.json); only for `cpu` devices.
// Thread-safety: a CostModel is immutable after creation; calls may come from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backends/model/model_config.h"
#include "common/status.h"

namespace pdsim::cost {

struct ExtendItem {
    int64_t new_tokens = 0;
    int64_t cached_tokens = 0;
};

// What an instance is made of, from the topology and the model.
struct InstanceSpec {
    model::ModelConfig model;
    int tp = 1;
    std::string device = "cpu";  // "cpu" or a GPU spec name (topo::gpu_spec)
    double tp_link_gbps = 0;     // bottleneck GB/s between the instance's devices (tp > 1)
    double tp_link_latency_us = 0;
    int kv_dtype_bytes = 2;  // 2 (bf16) on GPUs; the CPU testbed's pools are fp32 (4)
    int threads = 0;         // CPU: compute threads per rank (calibrated fits are per
                             // thread count; 0: the cost file's default)
};

// Variation of a forward's time around the model's mean, as measured on the CPU testbed (pdsim
// calibrate --from-timeline): a forward takes mean x slow x fast, both with mean 1.
//   slow: per instance, log-normal (coefficient of variation slow_cv), redrawn every
//     slow_period_s of simulated time: the testbed's forwards run slow or fast for tens of
//     milliseconds at a time (its host's other load, frequency), which is what spreads one
//     request's TPOT from the next;
//   fast: per forward, from the measured distribution when fast_quantiles is given (its quantile
//     function at probabilities 0, 1/K, ..., 1, linearly interpolated: a tight body and the rare
//     descheduled forward that is twice as long), else log-normal with fast_cv.
// All zero / empty: deterministic.
struct CostNoise {
    double fast_cv = 0;
    std::vector<double> fast_quantiles;
    double slow_cv = 0;
    double slow_period_s = 0;
    [[nodiscard]] bool any() const {
        return fast_cv > 0 || fast_quantiles.size() >= 2 || (slow_cv > 0 && slow_period_s > 0);
    }
};

// How an instance's forwards slow down after it idled (measured by `pdsim calibrate`, fit key
// "wake"): once an instance has run no forward for at least min_idle_s, the next forwards run
// slower, the slowdown fading as they run (caches and TLBs refilled, the core's clock raised; on a
// VM also the halted vCPU woken). A forward of modelled duration d that starts after t seconds of
// modelled forward time since that wake takes d + lost_s * (exp(-t / tau_s) - exp(-(t + d) /
// tau_s)): lost_s in all over the warm-up, most of it in the first forwards. None: lost_s 0.
struct CostWake {
    double min_idle_s = 0;
    double lost_s = 0;
    double tau_s = 0;
    [[nodiscard]] bool any() const { return lost_s > 0 && tau_s > 0; }
    // The extra seconds of a forward of `duration_s` starting `since_wake_s` after the wake.
    [[nodiscard]] double extra_s(double since_wake_s, double duration_s) const;
};

class CostModel {
public:
    virtual ~CostModel() = default;
    // "roofline H100 tp8 (mfu 0.50, mbu 0.80)", "calibrated cost.json tp1 threads 1": for reports.
    [[nodiscard]] virtual std::string describe() const = 0;
    [[nodiscard]] virtual double extend_s(std::span<const ExtendItem> batch) const = 0;
    [[nodiscard]] virtual double decode_s(int64_t batch_size, int64_t kv_tokens) const = 0;
    // CPU instances only: how much slower a forward runs while another instance's forward runs on
    // the same node, beyond the share of cores that the simulator's contention model gives it
    // (shared caches and memory bandwidth, the testbed's transfer and polling threads, TP ranks
    // that wait for a descheduled peer): the forward progresses at share / (1 + interference).
    // Measured by `pdsim calibrate --from-timeline`; 0 where unknown.
    [[nodiscard]] virtual double interference(bool decode) const {
        (void)decode;
        return 0.0;
    }
    // CPU instances only: the measured variation of extend (decode) forwards; none by default.
    [[nodiscard]] virtual CostNoise noise(bool decode) const {
        (void)decode;
        return {};
    }
    // CPU instances only: the slowdown after an idle period; none by default.
    [[nodiscard]] virtual CostWake wake() const { return {}; }
};

// A measured transport between two ranks of the testbed: one message of `bytes` takes
// latency_us + bytes / (gbps * 1e9) seconds.
struct LinkCost {
    double gbps = 0;
    double latency_us = 0;
};

// The machine-speed probe's level (common/speed_probe.h): the median CPU ms of the probe `kernel`
// in the testbed ranks of one run, or of `pdsim calibrate`'s serve probe runs.
struct SpeedLevel {
    std::string kernel;
    double cpu_ms_p50 = 0;
};

// A testbed report's level (`ranks[].stats.speed_probe`, pdsim testbed --speed-probe-ms): the
// median of its ranks' cpu_ms_p50, ranks without samples left out; with `instance`, only the
// ranks of that instance (`ranks[].instance`). nullopt when no rank sampled, or when the ranks
// name different kernels. Never throws on a malformed report (its fields are then ignored).
[[nodiscard]] std::optional<SpeedLevel> report_speed_level(const nlohmann::json& report,
                                                           std::string_view instance = {});

// How long work that reaches an idle CPU instance waits before its forward starts while another
// instance's forward runs on the instance's cores: the router's message, the scheduler and the TP
// peers each wait for the kernel to give them a core. `pdsim calibrate --topology` measures it in
// the topology's own layout (cost file key "core_wait", {"dispatch_ms": ...}).
struct CoreWait {
    double dispatch_s = 0;
};

// The wait between an instance's own decode forwards on a shared core: a decode forward that ends
// while n other instances compute on the instance's cores is followed, with chance `chance`, by a
// wait of `wait_s` before the next forward starts; otherwise the next starts at once. On the
// testbed the decode thread blocked between forwards and the kernel gave the core to a computing
// rank for about one scheduler slice, then ran the next forward faster (it was owed the time);
// `wait_s` is what such a step took beyond the others, slice and faster forward together, as the
// simulator's fair core share already gives the forward its average. `pdsim calibrate --topology`
// measures it from its probe runs' decode forwards (cost file key "step_wait", {"decode":
// [{"competitors": n, "chance", "wait_ms", "slice_ms", "gaps"}, ...]}; docs/cost-models.md
// section 3).
struct StepWaitChance {
    double chance = 0;  // in [0, 1]
    double wait_s = 0;  // >= 0
};
struct StepWait {
    // [n - 1]: with n other instances computing on its cores; the last entry serves any larger n.
    // Empty: no wait.
    std::vector<StepWaitChance> decode;
};

// The cost file written by `pdsim calibrate` (schema in docs/cost-models.md). Loading validates it;
// errors name the file and the field (exit 2 at the CLI).
class CostFile {
public:
    // Reads a regular file of at most 16 MiB (common/input_file.h: a FIFO or /dev/zero is refused
    // at once); a JSON syntax error is "<file>:<line>: not valid JSON: ..." with a bounded excerpt.
    [[nodiscard]] static StatusOr<CostFile> load(const std::string& path);
    [[nodiscard]] static StatusOr<CostFile> from_json(const nlohmann::json& j,
                                                      const std::string& source);
    [[nodiscard]] const nlohmann::json& json() const { return json_; }
    [[nodiscard]] const std::string& source() const { return source_; }
    // The measured KV transport (`mpi`, `tcp`, `local`), when the file has it.
    [[nodiscard]] std::optional<LinkCost> transport(const std::string& name) const;
    // The speed probe's level while the fits were measured (`speed_probe`, written by calibrate's
    // serve probe), when the file has it.
    [[nodiscard]] std::optional<SpeedLevel> speed_probe() const;
    // The wait for a shared core (`core_wait`), when the file has it.
    [[nodiscard]] std::optional<CoreWait> core_wait() const;
    // The wait between decode forwards on a shared core (`step_wait`), when the file has it.
    [[nodiscard]] std::optional<StepWait> step_wait() const;

private:
    nlohmann::json json_;
    std::string source_;
};

struct RooflineOptions {
    double mfu = 0.5;              // achieved fraction of peak FLOP/s in GEMMs and attention
    double mbu = 0.8;              // achieved fraction of HBM bandwidth
    double fixed_overhead_us = 0;  // per forward (launch, scheduling)
};

// A decorator for a machine that runs slower (factor > 1) or faster than when `base` was
// measured: every extend forward takes `extend_factor` times as long, every decode forward
// `decode_factor` times, and so do the (decode) wake-up's lost time and decay. Interference and
// noise are relative to the forward time and pass through unchanged. The two factors differ where
// the machine's drift reaches one kind of forward and not the other (`pdsim simulate
// --speed-scale auto` scales decodes only: docs/simulator.md section 4).
// Precondition: both factors > 0 and finite.
class ScaledCostModel final : public CostModel {
public:
    // Every forward by `factor`.
    ScaledCostModel(std::shared_ptr<const CostModel> base, double factor)
        : ScaledCostModel(std::move(base), factor, factor) {}
    ScaledCostModel(std::shared_ptr<const CostModel> base, double extend_factor,
                    double decode_factor);
    [[nodiscard]] std::string describe() const override;
    [[nodiscard]] double extend_s(std::span<const ExtendItem> batch) const override;
    [[nodiscard]] double decode_s(int64_t batch_size, int64_t kv_tokens) const override;
    [[nodiscard]] double interference(bool decode) const override {
        return base_->interference(decode);
    }
    [[nodiscard]] CostNoise noise(bool decode) const override { return base_->noise(decode); }
    [[nodiscard]] CostWake wake() const override;
    [[nodiscard]] double extend_factor() const { return extend_factor_; }
    [[nodiscard]] double decode_factor() const { return decode_factor_; }

private:
    std::shared_ptr<const CostModel> base_;
    double extend_factor_;
    double decode_factor_;
};

// kind: "roofline" (needs a GPU device) or "calibrated" (needs `file`, a cpu device, and a fit
// for the model and TP size; a model with sliding-window or recurrent layers is refused, as cost
// files are fitted on full-attention models only). kInvalidArgument naming what is missing
// otherwise.
[[nodiscard]] StatusOr<std::unique_ptr<CostModel>> make_cost_model(
    const std::string& kind, const InstanceSpec& spec, const CostFile* file = nullptr,
    const RooflineOptions& roofline = {});

}  // namespace pdsim::cost

// What the simulator reports: the transfer summary, the per-request transfer figures, the
// Perfetto timeline's tracks and slices, and the metrics::Report (testbed keys, plus
// extra.simulator and extra.config) built at the end of a run.
//
// Thread-safety: none (the simulator's thread). Ownership: SimTimeline writes into a Timeline it
// does not own. Costs: O(1) per request and per forward, except build_report (O(requests)).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "sim/des/kv_groups.h"
#include "sim/des/simulator.h"

namespace pdsim::des {

// How an instance serves requests in a run (the topology's role, or colocated).
enum class InstanceRole : uint8_t { kPrefill, kDecode, kColocated };
[[nodiscard]] const char* instance_role_name(InstanceRole role);  // "prefill" | ...

// One request's KV transfer figures (docs/simulator.md), all in seconds.
struct KvTransferFigures {
    double exposed_s = 0;        // after the prompt's last extend forward ended
    double transfer_s = 0;       // from its first flow's start (0 when it had none)
    double layer_latency_s = 0;  // mean over layers of (landed - ready)
};
// The figures of a transfer that completed at `now_s`: its first flow started at first_flow_s
// (< 0: none), the last extend forward ran [last_forward_start_s, last_forward_end_s), the route's
// latency is route_latency_s. Layers land uniformly over the tail after the forward (and, without
// layerwise, a layer waits for the rest of the forward). Precondition: num_layers >= 1.
[[nodiscard]] KvTransferFigures kv_transfer_figures(double now_s, double first_flow_s,
                                                    double last_forward_start_s,
                                                    double last_forward_end_s,
                                                    double route_latency_s, int num_layers,
                                                    bool layerwise);

// The report's transfer summary: bytes, the rate while some flow was active, the per-layer
// latency percentiles and the exposed fraction of the transfer time.
class TransferSummary {
public:
    // A flow starts / ends at now_s; the time with at least one flow active is the busy time.
    void flow_started(double now_s) {
        if (active_flows_++ == 0) busy_since_s_ = now_s;
    }
    void flow_done(double now_s) {
        if (--active_flows_ == 0) busy_s_ += now_s - busy_since_s_;
    }
    // A request's transfer completed: its bytes and figures.
    void add_request(double bytes, const KvTransferFigures& figures) {
        layer_latency_us_.push_back(figures.layer_latency_s * 1e6);
        bytes_ += bytes;
        exposed_s_ += figures.exposed_s;
        transfer_s_ += figures.transfer_s;
    }
    // The same request's bytes by layer group (kv_groups.h), after the route's share.
    void add_groups(double full, double sliding, double state) {
        groups_.full += full;
        groups_.sliding += sliding;
        groups_.state += state;
    }
    // Writes the summary (consumes the latency sample).
    void fill(metrics::TransferSummary* out);
    [[nodiscard]] const KvGroupBytes& groups() const { return groups_; }

private:
    KvGroupBytes groups_;
    double bytes_ = 0, exposed_s_ = 0, transfer_s_ = 0;
    int64_t active_flows_ = 0;
    double busy_since_s_ = 0, busy_s_ = 0;
    std::vector<double> layer_latency_us_;
};

// The run's timeline (SimConfig::timeline): process base + i per instance (thread 0: forwards,
// 1: sampled KV transfers on prefill instances) and base + instance count for the sampled
// requests' lifecycles. Every call is a no-op without a timeline.
class SimTimeline {
public:
    explicit SimTimeline(const SimConfig& config);
    [[nodiscard]] bool enabled() const { return timeline_ != nullptr; }
    // Names the processes and threads.
    void name_tracks(const topo::Topology& topology, SimMode mode,
                     std::span<const InstanceRole> roles);
    // A forward slice of `instance`, until timeline_max_forwards slices were written.
    void forward(int instance, bool extend, double start_s, double duration_s, size_t batch_size,
                 int64_t tokens) {
        if (timeline_ != nullptr)
            write_forward(instance, extend, start_s, duration_s, batch_size, tokens);
    }
    // Request `trace_index` (its position in the trace) became terminal: its lifecycle, when
    // sampled.
    void request(size_t trace_index, const metrics::RequestRecord& record) {
        if (sampled(trace_index)) write_request(record);
    }
    // Its KV transfer from `prefill_instance` completed (rec's transfer fields are set), when
    // sampled.
    void transfer(size_t trace_index, int prefill_instance, const metrics::RequestRecord& record,
                  double first_flow_s, const KvTransferFigures& figures) {
        if (sampled(trace_index)) write_transfer(prefill_instance, record, first_flow_s, figures);
    }

private:
    void write_forward(int instance, bool extend, double start_s, double duration_s,
                       size_t batch_size, int64_t tokens);
    void write_request(const metrics::RequestRecord& record);
    void write_transfer(int prefill_instance, const metrics::RequestRecord& record,
                        double first_flow_s, const KvTransferFigures& figures);
    [[nodiscard]] bool sampled(size_t trace_index) const {
        return timeline_ != nullptr && sample_ > 0 &&
               trace_index % static_cast<uint64_t>(sample_) == 0;
    }
    metrics::Timeline* timeline_;
    int pid_base_;
    int requests_pid_ = 0;  // set by name_tracks
    int64_t sample_;
    int64_t max_forwards_;
    int64_t forwards_ = 0;
};

// What the report says about one instance.
struct InstanceSummary {
    std::string id;                // the topology's
    std::string cost_description;  // CostModel::describe()
    int64_t kv_pages = 0, evicted_blocks = 0, cached_blocks = 0;
    KvFootprint footprint;  // what a request holds there (pages per group)
};

// The context lengths at which the report counts the requests that fit an instance's KV pool.
inline constexpr int64_t kKvFitLengths[] = {1024, 4096, 16384, 65536};

// The run's report: request metrics from `records` (one per request), the transfer summary,
// extra.simulator (stats, cost models once each in instance order, the transfer's bytes by layer
// group, per-instance KV: pages, page bytes and layers, a request's sliding and state pages, and
// how many requests of each kKvFitLengths context fit) and extra.config (the options that shaped
// the run; cost_noise: whether some instance drew noise; prefix_cache: false for a hybrid model,
// which runs without one).
[[nodiscard]] metrics::Report build_report(const SimConfig& config,
                                           const std::vector<metrics::RequestRecord>& records,
                                           const SimStats& stats, TransferSummary& transfer,
                                           std::span<const InstanceSummary> instances,
                                           std::span<const double> contended_node_cores,
                                           bool cost_noise);

}  // namespace pdsim::des

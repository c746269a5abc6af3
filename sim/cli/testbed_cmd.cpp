// pdsim testbed: multi-rank prefill/decode serving on real attention backends with layerwise KV
// transfer (sim/testbed/testbed.h). Run it under mpirun with one rank per topology rank, or
// without mpirun to run every rank as a thread of one process.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>

#include "sim/cli/cli_util.h"
#include "sim/cli/command.h"
#include "sim/testbed/testbed.h"
#include "transfer/fault/fault_transport.h"

namespace pdsim::cli {

namespace {

using L = testbed::TestbedLimits;

// A non-empty --transport-fault spec that transfer::parse_fault_spec accepts.
CLI::Validator fault_spec() {
    return CLI::Validator(
        [](std::string& text) -> std::string {
            if (text.find_first_not_of(" \t") == std::string::npos) return "empty spec";
            StatusOr<transfer::FaultSpec> spec = transfer::parse_fault_spec(text);
            if (!spec.ok()) return spec.status().message();
            return {};
        },
        "fault spec");
}

// How long a rank other than 0 waits before it exits after a failed set-up: rank 0 has printed
// the error and exits at once, and mpirun, which aborts the job at the first non-zero exit, could
// otherwise drop rank 0's message still on its way.
constexpr auto kNonZeroRankExitDelay = std::chrono::milliseconds(500);

struct Flags {
    testbed::TestbedOptions o;
    std::string mode = "both";
    std::string layerwise = "on";
    std::string fault = "none";
    std::string decode_graphs = "on";
    std::string device_gate = "on";
    std::string stream_sync = "caller";
};

Status run(Flags& f) {
    testbed::TestbedOptions o = f.o;
    PDSIM_ASSIGN_OR_RETURN(o.mode, testbed::parse_mode(f.mode));
    PDSIM_ASSIGN_OR_RETURN(o.fault, testbed::parse_fault(f.fault));
    if (f.layerwise == "on") {
        o.layerwise = true;
    } else if (f.layerwise == "off") {
        o.layerwise = false;
    } else {
        return Status(StatusCode::kInvalidArgument,
                      "--layerwise " + f.layerwise + ": expected on or off");
    }
    if (f.decode_graphs == "on" || f.decode_graphs == "off") {
        o.decode_graphs = f.decode_graphs == "on";
    } else {
        return Status(StatusCode::kInvalidArgument,
                      "--decode-graphs " + f.decode_graphs + ": expected on or off");
    }
    if (f.device_gate == "on" || f.device_gate == "off") {
        o.device_gate = f.device_gate == "on";
    } else {
        return Status(StatusCode::kInvalidArgument,
                      "--device-gate " + f.device_gate + ": expected on or off");
    }
    o.stream_caller_runs = f.stream_sync == "caller";  // checked while parsing
    testbed::RunInfo info;
    Status st = testbed::run_testbed(o, &info);
    if (!st.ok() && (info.rank != 0 || info.error_printed)) {
        // Only rank 0 prints, and it already has; every rank exits with the same status, rank 0
        // first.
        std::fflush(stdout);
        std::fflush(stderr);
        if (info.rank != 0) std::this_thread::sleep_for(kNonZeroRankExitDelay);
        std::exit(exit_code_for(st));
    }
    return st;
}

// The topology, the model and the requests to replay.
void add_workload_flags(CLI::App* sub, testbed::TestbedOptions& o) {
    sub->add_option("--topology", o.topology,
                    "topology file, or a shipped one by name, e.g. cpu-1p2d (default: cpu-1p1d)")
        ->check(non_empty());
    sub->add_option("--model", o.model,
                    "built-in model (tiny, llama3-8b, ...), a shipped model file by name, or a "
                    "model YAML/JSON file (default: the topology's model)")
        ->check(non_empty());
    sub->add_option("--layers", o.layers, "override the model's number of layers")
        ->check(int_in(1, L::kMaxLayers));
    sub->add_option("--trace", o.trace,
                    "trace file: Mooncake .jsonl or Azure .csv (default: a sample of the "
                    "shipped traces/mooncake_conversation.jsonl)")
        ->check(non_empty());
    sub->add_option("--trace-format", o.trace_format, "auto|mooncake|azure")
        ->check(CLI::IsMember({"auto", "mooncake", "azure"}))
        ->capture_default_str();
    sub->add_option("--synthetic", o.synthetic, "N synthetic requests instead of a trace")
        ->check(int_in(1, L::kMaxSynthetic));
    sub->add_option("--max-requests", o.max_requests, "replay the first N requests")
        ->check(int_in(1, L::kMaxRequestCount));
    sub->add_option("--sample", o.sample,
                    "replay a uniform random sample of N requests (order kept)")
        ->check(int_in(1, L::kMaxRequestCount));
    sub->add_option("--seed", o.seed, "seed for sampling and prompt tokens")->capture_default_str();
    sub->add_option(
           "--time-scale", o.time_scale,
           "multiply arrival times by X (default: auto, compressing the trace so the prefill "
           "ranks stay busy)")
        ->check(real_in(0, L::kMaxTimeScale, /*lo_open=*/true));
    sub->add_option("--max-input-len", o.max_input_len, "cap prompt lengths (0: none)")
        ->check(int_in(0, L::kMaxLengthCap))
        ->capture_default_str();
    sub->add_option("--max-output-len", o.max_output_len, "cap output lengths (0: none)")
        ->check(int_in(0, L::kMaxLengthCap))
        ->capture_default_str();
}

// How the ranks run: transport, backend, mode, injected faults.
void add_run_flags(CLI::App* sub, Flags& f) {
    testbed::TestbedOptions& o = f.o;
    sub->add_option("--transport", o.transport,
                    "KV transport (the engine's control messages, and the KV of CPU ranks): "
                    "mpi|tcp|local (default: mpi under mpirun, local without)")
        ->check(non_empty());
    sub->add_option("--data-transport", o.data_transport,
                    "the KV bytes' own transport: auto (GPU ranks: cuda_ipc when prefill and "
                    "decode share a node, else nccl; CPU ranks: none), none (--transport carries "
                    "them), cuda_ipc (one-sided writes into the decode rank's GPU pool; every "
                    "prefill and decode rank on one node), nccl (ncclSend/ncclRecv; a GPU each) "
                    "or local_writes (CPU ranks as threads, without mpirun: one-sided writes into "
                    "the decode rank's host pool, the engine's write plane that GPU ranks run "
                    "over cuda_ipc)")
        ->check(CLI::IsMember({"auto", "none", "cuda_ipc", "nccl", "local_writes"}))
        ->capture_default_str();
    sub->add_option("--backend", o.backend,
                    "attention backend: cpu|cpu_ref (CPU ranks), or cuda (GPU ranks: the GPU "
                    "model on each rank's GPU, any TP size; KV over --data-transport)")
        ->check(non_empty())
        ->capture_default_str();
    sub->add_option("--mode", f.mode, "disagg|colocated|both")->capture_default_str();
    sub->add_option("--decode-graphs", f.decode_graphs,
                    "--backend cuda: on: decode forwards replay CUDA graphs (captured per batch "
                    "size bucket 1, 2, 4, ... --max-decode-batch); off: eager")
        ->capture_default_str();
    sub->add_option("--tp-exchange", o.tp_exchange,
                    "--backend cuda: how the ranks of a TP > 1 instance exchange their "
                    "projection partials: nccl (an NCCL all-gather on each rank's compute stream; "
                    "a GPU each), host (through the host: MPI under mpirun, in-process without; "
                    "runs anywhere, several ranks on one GPU included) or auto (nccl where every "
                    "TP > 1 instance has a GPU per rank and pdsim has NCCL, else host)")
        ->check(CLI::IsMember({"auto", "host", "nccl"}))
        ->capture_default_str();
    sub->add_option("--device-gate", f.device_gate,
                    "--backend cuda: on: each layer's KV transfer is enqueued ahead of its step, "
                    "on a comm stream that waits for the StepCounter record on the device (no "
                    "host thread between the record and the copy); off: posted by the host once "
                    "it sees the record")
        ->capture_default_str();
    sub->add_option("--layerwise", f.layerwise,
                    "on: send each layer once its step is recorded; off: after the "
                    "forward (the no-overlap baseline)")
        ->capture_default_str();
    sub->add_option("--stream-sync", f.stream_sync,
                    "CPU ranks: caller: a forward's synchronize runs the compute stream's queued "
                    "work on the rank's thread (no hand-off, as a GPU host's cheap wait); worker: "
                    "it sleeps while the stream's worker thread runs it (two thread wake-ups per "
                    "forward, milliseconds on a core shared with other ranks)")
        ->check(CLI::IsMember({"caller", "worker"}))
        ->capture_default_str();
    sub->add_option("--fault", f.fault,
                    "inject an ordering bug on the prefill side: record-before-write, "
                    "skip-record, double-record, stale-graph-metadata, "
                    "free-before-transfer, late-write")
        ->check(non_empty())
        ->capture_default_str();
}

// Batching, KV pool, SLOs, timeouts, threads, shaping and transport faults.
void add_limit_flags(CLI::App* sub, testbed::TestbedOptions& o) {
    sub->add_option("--chunk-size", o.chunk_size, "prefill tokens of one request per forward")
        ->check(int_in(1, L::kMaxBatchTokens))
        ->capture_default_str();
    sub->add_option("--max-batch-tokens", o.max_batch_tokens, "tokens per prefill forward")
        ->check(int_in(1, L::kMaxBatchTokens))
        ->capture_default_str();
    sub->add_option("--max-decode-batch", o.max_decode_batch, "requests per decode forward")
        ->check(int_in(1, L::kMaxDecodeBatch))
        ->capture_default_str();
    sub->add_option("--page-size", o.page_size, "KV page size in tokens")
        ->check(int_in(1, L::kMaxPageSize))
        ->capture_default_str();
    sub->add_option("--kv-pool-mb", o.kv_pool_mb, "KV pool per rank, MiB")
        ->check(int_in(1, L::kMaxKvPoolMb))
        ->capture_default_str();
    sub->add_option("--slo-ttft-ms", o.slo_ttft_ms, "TTFT SLO for goodput/attainment (0: none)")
        ->check(real_in(0, L::kMaxSloMs));
    sub->add_option("--slo-tpot-ms", o.slo_tpot_ms, "TPOT SLO for goodput/attainment (0: none)")
        ->check(real_in(0, L::kMaxSloMs));
    sub->add_option("--speed-probe-ms", o.speed_probe_ms,
                    "CPU ranks: time a fixed 8 MiB matrix-vector product every N ms while "
                    "serving (about 1 ms of CPU each; ranks[].stats.speed_probe), so that `pdsim "
                    "simulate --like` can put this run and the cost file's calibration on one "
                    "machine speed (0: off)")
        ->check(int_in(0, L::kMaxSpeedProbeMs))
        ->capture_default_str();
    sub->add_option("--request-timeout-s", o.request_timeout_s,
                    "a request that makes no progress for this long fails (waiting in a queue "
                    "is not lack of progress)")
        ->check(real_in(0, L::kMaxRequestTimeoutS, /*lo_open=*/true))
        ->capture_default_str();
    sub->add_option("--heartbeat-timeout-s", o.heartbeat_timeout_s,
                    "a rank silent this long (heartbeats go once a second) is dead or hung: the "
                    "requests its instance holds fail, the rest of the run goes on (0: off)")
        ->check(real_in(0, L::kMaxHeartbeatTimeoutS))
        ->capture_default_str();
    sub->add_option("--max-inflight-per-instance", o.max_inflight_per_instance,
                    "router backpressure: requests in flight per instance, the rest wait in the "
                    "router's queue in arrival order (0: auto, from the KV pool and batch limits)")
        ->check(int_in(0, L::kMaxInflightPerInstance))
        ->capture_default_str();
    sub->add_option("--threads", o.threads,
                    "compute threads per rank (default: cores / ranks on the node)")
        ->check(int_in(1, L::kMaxThreads));
    sub->add_option(
           "--shaping", o.shaping,
           "throttle the KV transport: off, topology (the topology's shaping section, time_scale "
           "auto measured), or GBPS[:LATENCY_US] for the CPU-side link")
        ->check(non_empty())
        ->capture_default_str();
    sub->add_option("--transport-fault", o.transport_fault,
                    "wrap the KV transport in the fault transport, e.g. disconnect:after=20")
        ->check(fault_spec());
    sub->add_option("--tcp-interface", o.tcp_interface,
                    "--transport tcp across hosts: each rank listens on this interface's IPv4 "
                    "address (as NCCL_SOCKET_IFNAME names it, e.g. eth0); default loopback")
        ->check(non_empty());
    sub->add_option("--transport-fault-rank", o.transport_fault_rank,
                    "apply --transport-fault on this rank only")
        ->check(int_in(0, int64_t{1} << 20));
}

}  // namespace

void add_testbed_command(CLI::App& app, CommandSet& commands) {
    auto f = std::make_shared<Flags>();
    testbed::TestbedOptions& o = f->o;
    CLI::App* sub = app.add_subcommand(
        "testbed",
        "Run prefill and decode ranks (mpirun, one process per topology rank; or without mpirun,\n"
        "every rank a thread) on the synthetic model over paged KV, with layerwise KV transfer,\n"
        "replaying a real trace. With no options: topology cpu-1p1d, model tiny, 16 requests of\n"
        "the Mooncake conversation trace, --mode both. Exit 0 when every request completed with\n"
        "no ordering violation (and, with --mode both, outputs match); 2 on bad input; else 1.");
    add_workload_flags(sub, o);
    add_run_flags(sub, *f);
    add_limit_flags(sub, o);
    sub->add_option("--report", o.report_path, "write the report JSON here")->check(output_file());
    sub->add_option("--timeline", o.timeline_path,
                    "write a Chrome/Perfetto trace-event timeline here")
        ->check(output_file());
    sub->add_option("--requests", o.requests_path, "write the per-request CSV here")
        ->check(output_file());
    sub->add_flag("--progress", o.progress, "print a progress line on stderr");
    sub->add_flag("--quiet", o.quiet, "no summary table");
    commands.add(sub, [f] { return run(*f); });
}

}  // namespace pdsim::cli

// pdsim testbed: multi-rank prefill/decode serving on real attention backends with layerwise KV
// transfer (sim/testbed/testbed.h). Run it under mpirun with one rank per topology rank, or
// without mpirun to run every rank as a thread of one process.
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "sim/cli/command.h"
#include "sim/testbed/testbed.h"

namespace pdsim::cli {

namespace {

struct Flags {
    testbed::TestbedOptions o;
    std::string mode = "both";
    std::string layerwise = "on";
    std::string fault = "none";
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
    testbed::RunInfo info;
    Status st = testbed::run_testbed(o, &info);
    if (!st.ok() && (info.rank != 0 || info.error_printed)) {
        // Only rank 0 prints, and it already has; every rank exits with the same status.
        std::fflush(stdout);
        std::fflush(stderr);
        std::exit(exit_code_for(st));
    }
    return st;
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
    sub->add_option("--topology", o.topology,
                    "topology file, or a shipped one by name, e.g. cpu-1p2d (default: cpu-1p1d)");
    sub->add_option("--model", o.model,
                    "built-in model (tiny, llama3-8b, ...), a shipped model file by name, or a "
                    "model YAML/JSON file (default: the topology's model)");
    sub->add_option("--layers", o.layers, "override the model's number of layers");
    sub->add_option("--trace", o.trace,
                    "trace file: Mooncake .jsonl or Azure .csv (default: a sample of the "
                    "shipped traces/mooncake_conversation.jsonl)");
    sub->add_option("--trace-format", o.trace_format, "auto|mooncake|azure")->capture_default_str();
    sub->add_option("--synthetic", o.synthetic, "N synthetic requests instead of a trace");
    sub->add_option("--max-requests", o.max_requests, "replay the first N requests");
    sub->add_option("--sample", o.sample,
                    "replay a uniform random sample of N requests (order kept)");
    sub->add_option("--seed", o.seed, "seed for sampling and prompt tokens")->capture_default_str();
    sub->add_option(
        "--time-scale", o.time_scale,
        "multiply arrival times by X (default: auto, compressing the trace so the prefill "
        "ranks stay busy)");
    sub->add_option("--max-input-len", o.max_input_len, "cap prompt lengths (0: none)")
        ->capture_default_str();
    sub->add_option("--max-output-len", o.max_output_len, "cap output lengths (0: none)")
        ->capture_default_str();
    sub->add_option("--transport", o.transport,
                    "KV transport: mpi|tcp|local (default: mpi under mpirun, local "
                    "without)");
    sub->add_option("--backend", o.backend, "attention backend: cpu|cpu_ref")
        ->capture_default_str();
    sub->add_option("--mode", f->mode, "disagg|colocated|both")->capture_default_str();
    sub->add_option("--layerwise", f->layerwise,
                    "on: send each layer once its step is recorded; off: after the "
                    "forward (the no-overlap baseline)")
        ->capture_default_str();
    sub->add_option("--fault", f->fault,
                    "inject an ordering bug on the prefill side: record-before-write, "
                    "skip-record, double-record, stale-graph-metadata, "
                    "free-before-transfer, late-write")
        ->capture_default_str();
    sub->add_option("--chunk-size", o.chunk_size, "prefill tokens of one request per forward")
        ->capture_default_str();
    sub->add_option("--max-batch-tokens", o.max_batch_tokens, "tokens per prefill forward")
        ->capture_default_str();
    sub->add_option("--max-decode-batch", o.max_decode_batch, "requests per decode forward")
        ->capture_default_str();
    sub->add_option("--page-size", o.page_size, "KV page size in tokens")->capture_default_str();
    sub->add_option("--kv-pool-mb", o.kv_pool_mb, "KV pool per rank, MiB")->capture_default_str();
    sub->add_option("--slo-ttft-ms", o.slo_ttft_ms, "TTFT SLO for goodput/attainment (0: none)");
    sub->add_option("--slo-tpot-ms", o.slo_tpot_ms, "TPOT SLO for goodput/attainment (0: none)");
    sub->add_option("--request-timeout-s", o.request_timeout_s,
                    "a request not finished this long after its arrival fails")
        ->capture_default_str();
    sub->add_option("--threads", o.threads,
                    "compute threads per rank (default: cores / ranks on the node)");
    sub->add_option(
           "--shaping", o.shaping,
           "throttle the KV transport: off, topology (the topology's shaping section, time_scale "
           "auto measured), or GBPS[:LATENCY_US] for the CPU-side link")
        ->capture_default_str();
    sub->add_option("--transport-fault", o.transport_fault,
                    "wrap the KV transport in the fault transport, e.g. disconnect:after=20");
    sub->add_option("--transport-fault-rank", o.transport_fault_rank,
                    "apply --transport-fault on this rank only");
    sub->add_option("--report", o.report_path, "write the report JSON here");
    sub->add_option("--timeline", o.timeline_path,
                    "write a Chrome/Perfetto trace-event timeline here");
    sub->add_option("--requests", o.requests_path, "write the per-request CSV here");
    sub->add_flag("--progress", o.progress, "print a progress line on stderr");
    sub->add_flag("--quiet", o.quiet, "no summary table");
    commands.add(sub, [f] { return run(*f); });
}

}  // namespace pdsim::cli

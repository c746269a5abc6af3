#include "sim/cli/command.h"

namespace pdsim::cli {

void add_bench_commands(CLI::App& app, CommandSet& commands) {
    CLI::App* bench =
        app.add_subcommand("bench",
                           "Benchmarks, each measured against an in-run baseline on the same "
                           "machine and reported as a\n"
                           "ratio (attention: STREAM-style copy and OpenBLAS sgemm).");
    // (0, 1): an unknown token is reported by name; a missing one by CommandSet::run_selected.
    bench->require_subcommand(0, 1);
    add_bench_attention_command(*bench, commands);
    add_bench_transfer_command(*bench, commands);
    add_bench_simulate_command(*bench, commands);
}

}  // namespace pdsim::cli

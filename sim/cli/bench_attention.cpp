// TEMPORARY scaffold: replaced by the real attention benchmark before this lands.
#include "sim/cli/command.h"

namespace pdsim::cli {
void add_bench_commands(CLI::App& app, CommandSet& commands) {
    CLI::App* bench = app.add_subcommand("bench", "Benchmarks against in-run baselines");
    bench->require_subcommand(1);
    CLI::App* a = bench->add_subcommand("attention", "CPU attention vs STREAM copy and sgemm");
    commands.add(a, [] { return Status(StatusCode::kUnimplemented, "bench attention"); });
}
}  // namespace pdsim::cli

// TEMPORARY scaffold: replaced by the real attention benchmark before this lands.
#include "sim/cli/command.h"

namespace pdsim::cli {
void add_bench_attention_command(CLI::App& bench, CommandSet& commands) {
    CLI::App* a = bench.add_subcommand("attention", "CPU attention vs STREAM copy and sgemm");
    commands.add(a, [] { return Status(StatusCode::kUnimplemented, "bench attention"); });
}
}  // namespace pdsim::cli

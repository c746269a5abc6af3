// The pdsim command line: each subcommand registers itself on the CLI11 app with a run function.
// Exit codes: 0 success, 2 bad input (flags, files, fields: StatusCode::kInvalidArgument or
// kNotFound), 1 any other failure.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <vector>

#include "common/status.h"

namespace pdsim::cli {

using RunFn = std::function<Status()>;

class CommandSet {
public:
    // Registers `sub` (already added to the app) with the function to run when it is selected.
    void add(CLI::App* sub, RunFn run) { commands_.push_back({sub, std::move(run)}); }
    // Runs the selected subcommand (deepest parsed one); kInvalidArgument if none was given.
    [[nodiscard]] Status run_selected() const;

private:
    struct Entry {
        CLI::App* app;
        RunFn run;
    };
    std::vector<Entry> commands_;
};

[[nodiscard]] int exit_code_for(const Status& status);

void add_attn_dump_command(CLI::App& app, CommandSet& commands);
// `pdsim topology validate|show|hostfile F` (sim/cli/topology_cmd.cpp).
void add_topology_command(CLI::App& app, CommandSet& commands);
// `pdsim bench <what>`: creates the `bench` parent and adds each benchmark under it.
void add_bench_commands(CLI::App& app, CommandSet& commands);
void add_bench_attention_command(CLI::App& bench, CommandSet& commands);
void add_bench_transfer_command(CLI::App& bench, CommandSet& commands);
// `pdsim bench simulate`: simulator speed on the full Mooncake trace (sim/cli/simulate_cmd.cpp).
void add_bench_simulate_command(CLI::App& bench, CommandSet& commands);
// `pdsim testbed [...]`: the multi-rank PD serving testbed (sim/cli/testbed_cmd.cpp).
void add_testbed_command(CLI::App& app, CommandSet& commands);
// `pdsim recover-report JOURNAL`: a killed testbed run's report from its journal
// (sim/cli/recover_report_cmd.cpp).
void add_recover_report_command(CLI::App& app, CommandSet& commands);
// `pdsim simulate [...]`: the discrete-event simulator (sim/cli/simulate_cmd.cpp).
void add_simulate_command(CLI::App& app, CommandSet& commands);
// `pdsim calibrate [...]`: measures the CPU testbed, writes a cost file
// (sim/cli/calibrate_cmd.cpp).
void add_calibrate_command(CLI::App& app, CommandSet& commands);
// `pdsim cost-check [...]`: a cost file against a testbed timeline's forwards
// (sim/cli/cost_check_cmd.cpp).
void add_cost_check_command(CLI::App& app, CommandSet& commands);
// `pdsim search [...]`: placement search over a GPU budget (sim/cli/search_cmd.cpp).
void add_search_command(CLI::App& app, CommandSet& commands);

}  // namespace pdsim::cli

// pdsim: simulator and testbed for disaggregated prefill/decode LLM serving.
#include <cstdio>
#include <iostream>

#include "common/logging.h"
#include "sim/cli/command.h"

int main(int argc, char** argv) {
    CLI::App app{
        "pdsim: a simulator and testbed for disaggregated prefill/decode (PD) LLM serving.\n"
        "Real attention backends over paged KV caches, a layerwise KV transfer engine, and a\n"
        "discrete-event simulator. Run `pdsim <command> --help` for a command's options.",
        "pdsim"};
    app.set_version_flag("--version", std::string("pdsim ") + PDSIM_VERSION);
    // (0, 1): an unknown token is reported by name; a missing one by CommandSet::run_selected.
    app.require_subcommand(0, 1);
    app.fallthrough(false);
    std::string log_level = "info";
    app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off")
        ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}))
        ->capture_default_str();

    pdsim::cli::CommandSet commands;
    pdsim::cli::add_attn_dump_command(app, commands);
    pdsim::cli::add_topology_command(app, commands);
    pdsim::cli::add_bench_commands(app, commands);
    pdsim::cli::add_testbed_command(app, commands);
    pdsim::cli::add_recover_report_command(app, commands);
    pdsim::cli::add_simulate_command(app, commands);
    pdsim::cli::add_calibrate_command(app, commands);
    pdsim::cli::add_cost_check_command(app, commands);
    pdsim::cli::add_search_command(app, commands);

    try {
        app.parse(argc, argv);
    } catch (const CLI::CallForHelp& e) {
        return app.exit(e);
    } catch (const CLI::CallForAllHelp& e) {
        return app.exit(e);
    } catch (const CLI::CallForVersion& e) {
        return app.exit(e);
    } catch (const CLI::ValidationError& e) {
        // A flag's value out of its range (sim/cli/cli_util.h): one line naming the flag.
        std::fprintf(stderr, "pdsim: error: INVALID_ARGUMENT: %s\n", e.what());
        return 2;
    } catch (const CLI::ParseError& e) {
        (void)app.exit(e);  // prints the message and a hint
        return 2;
    }
    pdsim::init_logging(log_level);
    pdsim::Status st;
    try {
        st = commands.run_selected();
    } catch (const std::exception& e) {
        std::fprintf(stderr, "pdsim: error: %s\n", e.what());
        return 1;
    }
    if (!st.ok()) {
        std::fprintf(stderr, "pdsim: error: %s\n", st.to_string().c_str());
        return pdsim::cli::exit_code_for(st);
    }
    return 0;
}

// pdsim topology validate|show|hostfile F: check a topology file, print its summary, or write an
// OpenMPI hostfile and rankfile for it. Bad files exit 2 with "<file>:<line>: <path>: <what>".
#include <fmt/format.h>

#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>

#include "backends/model/model_config.h"
#include "sim/cli/cli_util.h"
#include "sim/cli/command.h"
#include "topology/loader.h"
#include "topology/report.h"

namespace pdsim::cli {

namespace {

struct TopologyOptions {
    std::string file;
    std::string model;  // built-in name or model file; overrides the topology's model
    std::string out_dir = ".";
    int cpus = 0;
};

StatusOr<topo::Topology> load(const TopologyOptions& o, topo::ModelShape* model_storage) {
    topo::LoadOptions lo;
    if (!o.model.empty()) {
        PDSIM_ASSIGN_OR_RETURN(model::ModelConfig config, model::resolve_model(o.model));
        PDSIM_RETURN_IF_ERROR(model::validate_model(config));
        *model_storage = model::to_model_shape(config);
        lo.model = model_storage;
    }
    return topo::load_topology(o.file, lo);
}

Status run_validate(const TopologyOptions& o) {
    topo::ModelShape model;
    PDSIM_ASSIGN_OR_RETURN(topo::Topology t, load(o, &model));
    std::printf("OK %s: %s\n", o.file.c_str(), topo::one_line_summary(t).c_str());
    return ok_status();
}

Status run_show(const TopologyOptions& o) {
    topo::ModelShape model;
    PDSIM_ASSIGN_OR_RETURN(topo::Topology t, load(o, &model));
    std::fputs(topo::summary_text(t).c_str(), stdout);
    return ok_status();
}

Status write_text(const std::filesystem::path& path, const std::string& text) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    out.close();
    if (!out)
        return Status(StatusCode::kInvalidArgument, fmt::format("{}: cannot write", path.string()));
    return ok_status();
}

Status run_hostfile(const TopologyOptions& o) {
    topo::ModelShape model;
    PDSIM_ASSIGN_OR_RETURN(topo::Topology t, load(o, &model));
    std::error_code ec;
    std::filesystem::create_directories(o.out_dir, ec);
    if (ec) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("--out-dir {}: {}", o.out_dir, ec.message()));
    }
    const int cpus = o.cpus > 0 ? o.cpus : static_cast<int>(std::thread::hardware_concurrency());
    // The topology's name, made safe as a file name.
    std::string stem = t.name.empty() ? std::string("topology") : t.name;
    for (char& c : stem) {
        if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.')
            c = '_';
    }
    if (stem.front() == '.') stem.front() = '_';
    const std::filesystem::path dir(o.out_dir);
    const std::filesystem::path hostfile = dir / (stem + ".hostfile");
    const std::filesystem::path rankfile = dir / (stem + ".rankfile");
    PDSIM_RETURN_IF_ERROR(write_text(hostfile, topo::hostfile_text(t)));
    PDSIM_RETURN_IF_ERROR(write_text(rankfile, topo::rankfile_text(t, cpus)));
    std::printf("hostfile %s\nrankfile %s\n", hostfile.string().c_str(), rankfile.string().c_str());
    std::printf("run: mpirun -np %d --hostfile %s --rankfile %s pdsim testbed --topology %s\n",
                t.num_ranks(), hostfile.string().c_str(), rankfile.string().c_str(),
                o.file.c_str());
    return ok_status();
}

CLI::App* add_sub(CLI::App& parent, CommandSet& commands, const char* name, const char* help,
                  Status (*fn)(const TopologyOptions&), bool with_out) {
    auto o = std::make_shared<TopologyOptions>();
    CLI::App* sub = parent.add_subcommand(name, help);
    sub->add_option("file", o->file, "topology file (.yaml, .yml or .json)")->required();
    sub->add_option("--model", o->model,
                    "validate TP against this model instead of the file's: a built-in name "
                    "(tiny, llama3-8b, llama3-70b, deepseek-v3, ...) or a model YAML/JSON file")
        ->check(non_empty());
    if (with_out) {
        sub->add_option("--out-dir", o->out_dir,
                        "where to write <name>.hostfile and <name>.rankfile")
            ->check(non_empty())
            ->capture_default_str();
        sub->add_option("--cpus", o->cpus,
                        "cores per node for nodes whose topology gives no `cpus` (default: this "
                        "machine's)")
            ->check(int_in(1, 4096));
    }
    commands.add(sub, [o, fn] { return fn(*o); });
    return sub;
}

}  // namespace

void add_topology_command(CLI::App& app, CommandSet& commands) {
    CLI::App* topo = app.add_subcommand(
        "topology",
        "Cluster topologies (YAML/JSON; see topology/README.md): validate a file, show its\n"
        "summary (instances, rank map, prefill->decode bottlenecks), or write an OpenMPI\n"
        "hostfile and rankfile for it.");
    topo->require_subcommand(0, 1);
    add_sub(*topo, commands, "validate", "Check a topology file; print OK and a one-line summary",
            run_validate, false);
    add_sub(*topo, commands, "show", "Print a topology's summary table", run_show, false);
    add_sub(*topo, commands, "hostfile", "Write an OpenMPI hostfile and rankfile for a topology",
            run_hostfile, true);
}

}  // namespace pdsim::cli

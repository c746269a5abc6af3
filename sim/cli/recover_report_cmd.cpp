// `pdsim recover-report JOURNAL`: the report of a testbed run whose rank 0 died before it wrote
// one, from the journal the run left beside it (sim/testbed/result_journal.h). The testbed starts
// it as its report keeper (--keeper-fd, hidden); a user runs it by hand on a journal.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "sim/cli/command.h"
#include "sim/testbed/result_journal.h"

namespace pdsim::cli {

namespace {

struct Flags {
    std::string journal;
    int keeper_fd = -1;
};

Status run(const Flags& f) {
    if (f.keeper_fd >= 0) {
        const int code = testbed::ResultJournal::keep(f.journal, f.keeper_fd);
        std::fflush(stderr);
        std::_Exit(code);  // nothing of the run's process to tear down
    }
    StatusOr<std::string> counts = testbed::ResultJournal::recover(
        f.journal, "written by pdsim recover-report from the journal " + f.journal,
        /*rank0_died=*/false);
    if (!counts.ok() && counts.status().code() == StatusCode::kAlreadyExists) {
        std::printf("%s: the run wrote its report (the journal says so): left as it is\n",
                    f.journal.c_str());
        return {};
    }
    PDSIM_RETURN_IF_ERROR(counts.status());
    std::printf("%s: wrote the report it names: %s\n", f.journal.c_str(), counts->c_str());
    return {};
}

}  // namespace

void add_recover_report_command(CLI::App& app, CommandSet& commands) {
    auto f = std::make_shared<Flags>();
    CLI::App* sub = app.add_subcommand(
        "recover-report",
        "Write the report (and the --requests CSV) of a `pdsim testbed` run that ended before it\n"
        "wrote one, from the journal the run kept beside it (REPORT.journal.jsonl: one line per\n"
        "finished request). The run's own report keeper does this when rank 0 is killed (SIGKILL,\n"
        "the OOM killer); run it by hand where no keeper could. Requests the journal does not\n"
        "hold count as lost, named. Exit 0 written (or the run's report stands), 2 for a file\n"
        "that is not a journal (file:line), 1 when writing fails.");
    sub->add_option("journal", f->journal, "the journal, REPORT.journal.jsonl")
        ->required()
        ->check(CLI::ExistingFile);
    sub->add_option("--keeper-fd", f->keeper_fd,
                    "(the testbed's own use) wait for the run's end on this descriptor first")
        ->group("");
    commands.add(sub, [f] { return run(*f); });
}

}  // namespace pdsim::cli

#include "sim/cli/command.h"

namespace pdsim::cli {

Status CommandSet::run_selected() const {
    // The deepest parsed subcommand wins (`bench attention` over `bench`).
    const Entry* best = nullptr;
    int best_depth = -1;
    for (const Entry& e : commands_) {
        if (!e.app->parsed()) continue;
        int depth = 0;
        for (const CLI::App* p = e.app->get_parent(); p != nullptr; p = p->get_parent()) ++depth;
        if (depth > best_depth) {
            best = &e;
            best_depth = depth;
        }
    }
    if (best == nullptr)
        return Status(StatusCode::kInvalidArgument, "no command given (see pdsim --help)");
    return best->run();
}

int exit_code_for(const Status& status) {
    if (status.ok()) return 0;
    if (status.code() == StatusCode::kInvalidArgument || status.code() == StatusCode::kNotFound)
        return 2;
    return 1;
}

}  // namespace pdsim::cli

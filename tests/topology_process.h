// Test helper: run a shell command, capturing its exit status, stdout and stderr.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace pdsim::test {

struct RunResult {
    int rc = -1;
    std::string out;
    std::string err;
};

inline std::string shell_quote(const std::string& s) {
    std::string q = "'";
    for (char c : s) {
        if (c == '\'') {
            q += "'\\''";
        } else {
            q += c;
        }
    }
    return q + "'";
}

inline std::string slurp(const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

inline RunResult run_command(const std::string& cmd) {
    static int counter = 0;
    const auto base = std::filesystem::temp_directory_path() /
                      ("pdsim_run_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    const std::string out = base.string() + ".out", err = base.string() + ".err";
    const int status =
        std::system((cmd + " >" + shell_quote(out) + " 2>" + shell_quote(err)).c_str());
    RunResult r;
    r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(out);
    r.err = slurp(err);
    std::filesystem::remove(out);
    std::filesystem::remove(err);
    return r;
}

}  // namespace pdsim::test

// Runs the real pdsim binary (PDSIM_BINARY) from a test: exit code, stdout and stderr. Every run
// is bounded by coreutils `timeout`, so a hung binary fails the test instead of hanging it.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace pdsim::test {

struct CmdResult {
    int rc = -1;  // exit status; 128 + signal when killed; 124 when `timeout` fired
    std::string out, err;
    [[nodiscard]] std::string describe() const {
        return "exit " + std::to_string(rc) + "\n--- stdout ---\n" + out + "--- stderr ---\n" + err;
    }
};

inline std::string shell_quote(const std::string& s) {
    std::string q = "'";
    for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
}

// A fresh directory under the system temp dir, removed on destruction.
class TempDir {
public:
    explicit TempDir(const std::string& tag) {
        static std::atomic<int> counter{0};
        path_ =
            std::filesystem::temp_directory_path() /
            ("pdsim_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
        std::filesystem::remove_all(path_);
        std::filesystem::create_directories(path_);
    }
    ~TempDir() {
        std::error_code ec;
        std::filesystem::remove_all(path_, ec);
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    [[nodiscard]] const std::filesystem::path& path() const { return path_; }
    [[nodiscard]] std::string str(const std::string& sub = "") const {
        return (path_ / sub).string();
    }

private:
    std::filesystem::path path_;
};

inline std::string slurp(const std::filesystem::path& p) {
    std::ifstream f(p, std::ios::binary);
    std::ostringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

// Runs `<program> <args...>` (`program`: shell words, already quoted) with a time limit, stdin
// from /dev/null; `wall_s` (not null) gets how long it ran.
inline CmdResult run_command(const std::string& program, const std::vector<std::string>& args,
                             int timeout_s, double* wall_s = nullptr) {
    TempDir io("cmd");
    std::string cmd = "timeout -k 5 " + std::to_string(timeout_s) + " " + program;
    for (const auto& a : args) cmd += " " + shell_quote(a);
    cmd += " >" + shell_quote(io.str("out")) + " 2>" + shell_quote(io.str("err")) + " </dev/null";
    CmdResult r;
    const auto t0 = std::chrono::steady_clock::now();
    const int st = std::system(cmd.c_str());
    if (wall_s != nullptr) {
        *wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    if (st != -1 && WIFEXITED(st)) {
        r.rc = WEXITSTATUS(st);
    } else if (st != -1 && WIFSIGNALED(st)) {
        r.rc = 128 + WTERMSIG(st);
    }
    r.out = slurp(io.path() / "out");
    r.err = slurp(io.path() / "err");
    return r;
}

// Runs `pdsim <args...>` with a time limit.
inline CmdResult run_pdsim(const std::vector<std::string>& args, int timeout_s = 300) {
    return run_command(shell_quote(PDSIM_BINARY), args, timeout_s);
}

}  // namespace pdsim::test

#include "sim/testbed/result_journal.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/input_file.h"
#include "common/text.h"
#include "sim/testbed/comm.h"
#include "sim/testbed/phase_report.h"
#include "sim/testbed/server.h"

extern char** environ;

namespace pdsim::testbed {

namespace {

using json = nlohmann::json;

// The phase charged when none has begun: a colocated run's, else the disaggregated one (the
// main phase of a disagg or mode-both report).
Phase mode_phase(Mode mode) {
    return mode == Mode::kColocated ? Phase::kColocated : Phase::kDisagg;
}

double unix_now_s() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
}

// The armed journal's pipe (write end) for the signal handler; -1 when none is armed.
std::atomic<int> g_signal_fd{-1};
std::atomic<bool> g_armed{false};
int g_pipe_read = -1;
struct sigaction g_old_term {};
struct sigaction g_old_int {};

extern "C" void on_stop_signal(int sig) {
    const int fd = g_signal_fd.load();
    if (fd < 0) return;
    const unsigned char b = static_cast<unsigned char>(sig);
    const int saved = errno;
    [[maybe_unused]] const ssize_t n = ::write(fd, &b, 1);
    errno = saved;
}

const char* signal_name(int sig) {
    switch (sig) {
        case SIGTERM:
            return "SIGTERM";
        case SIGINT:
            return "SIGINT";
        default:
            return "a signal";
    }
}

}  // namespace

ResultJournal::ResultJournal(const ResolvedConfig* cfg) : cfg_(cfg) {
    if (cfg == nullptr) return;
    const TestbedOptions& o = cfg->options;
    head_.submitted = static_cast<int64_t>(cfg->requests.size());
    mode_ = o.mode;
    head_.mode = std::string(mode_name(o.mode));
    head_.pid = static_cast<int64_t>(::getpid());
    head_.topology = cfg->topology.name;
    head_.model = cfg->model.name;
    head_.rank0_instance =
        cfg->topology.instances.empty() ? std::string() : cfg->topology.instances[0].id;
    head_.slo_ttft_ms = o.slo_ttft_ms;
    head_.slo_tpot_ms = o.slo_tpot_ms;
    head_.report_path = o.report_path;
    head_.requests_path = o.requests_path;
    std::error_code ec;
    head_.cwd = std::filesystem::current_path(ec).string();
    head_.started_unix_s = unix_now_s();
}

double ResultJournal::elapsed_s() const {
    return recovered_ ? unix_now_s() - head_.started_unix_s : (now_us() - t_start_us_) / 1e6;
}

std::string ResultJournal::in_run_dir(const std::string& path) const {
    if (!recovered_ || path.empty() || path.front() == '/' || head_.cwd.empty()) return path;
    return (std::filesystem::path(head_.cwd) / path).string();
}

void ResultJournal::append_line(const json& line) {
    if (file_ == nullptr) return;
    std::fprintf(file_, "%s\n", text::dump_json(line).c_str());
    std::fflush(file_);
}

StatusOr<std::unique_ptr<ResultJournal>> ResultJournal::open(const ResolvedConfig& cfg) {
    std::unique_ptr<ResultJournal> j(new ResultJournal(&cfg));
    j->t_start_us_ = now_us();
    const std::string& report = cfg.options.report_path;
    if (!report.empty()) {
        j->path_ = report + ".journal.jsonl";
        j->file_ = std::fopen(j->path_.c_str(), "w");
        if (j->file_ == nullptr) {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("--report {}: cannot create its journal {}: {}", report,
                                      j->path_, std::strerror(errno)));
        }
        j->head_.config = testbed_config_json(cfg);  // only the header needs it
        j->append_line(journal::head_line(j->head_, describe(cfg.options)));
    }
    return j;
}

std::unique_ptr<ResultJournal> ResultJournal::standby(const ResolvedConfig& cfg, int rank,
                                                      std::function<bool()> rank0_dead) {
    std::unique_ptr<ResultJournal> j(new ResultJournal(&cfg));
    j->t_start_us_ = now_us();
    if (!cfg.options.report_path.empty()) j->path_ = cfg.options.report_path + ".journal.jsonl";
    j->standby_ = true;
    j->rank_ = rank;
    j->rank0_dead_ = std::move(rank0_dead);
    return j;
}

Status ResultJournal::load_file(bool read_header) {
    // A run that ended normally removed it.
    if (::access(path_.c_str(), F_OK) != 0 && errno == ENOENT) {
        return PDSIM_ERROR(StatusCode::kNotFound, "rank 0's journal {}: {}", path_,
                           std::strerror(errno));
    }
    PDSIM_ASSIGN_OR_RETURN(const std::string text,
                           files::read_input_file(path_, files::kMaxTraceFileBytes));
    PDSIM_ASSIGN_OR_RETURN(journal::Contents contents, journal::parse(text, path_));
    file_ends_cut_ = !text.empty() && text.back() != '\n';
    if (contents.report_written) {
        return PDSIM_ERROR(StatusCode::kAlreadyExists, "rank 0 wrote the report");
    }
    if (read_header) {
        PDSIM_ASSIGN_OR_RETURN(mode_, parse_mode(contents.head.mode));
        head_ = std::move(contents.head);
    }
    stopping_cause_ = contents.stopping;
    auto phase_of = [](const std::string& name) {
        return name == phase_name(Phase::kColocated) ? Phase::kColocated : Phase::kDisagg;
    };
    for (const journal::Record& r : contents.records) record(phase_of(r.phase), r.record);
    std::lock_guard<std::mutex> lock(mu_);
    for (const journal::DeadRank& d : contents.dead_ranks) {
        log_of(phase_of(d.phase))
            .dead_ranks.push_back({.rank = d.rank,
                                   .instance = d.instance,
                                   .detected_at_s = d.detected_at_s,
                                   .silent_s = d.silent_s});
    }
    return {};
}

StatusOr<std::string> ResultJournal::recover(const std::string& journal_path,
                                             const std::string& cause, bool rank0_died) {
    std::unique_ptr<ResultJournal> j(new ResultJournal(nullptr));
    j->path_ = journal_path;
    j->recovered_ = true;
    PDSIM_RETURN_IF_ERROR(j->load_file(/*read_header=*/true));
    std::string lock;
    if (rank0_died) {
        std::lock_guard<std::mutex> guard(j->mu_);
        j->add_rank0_dead(/*silent_s=*/-1);
        lock = j->in_run_dir(j->head_.report_path) + ".recover";
        const int fd = ::open(lock.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
        if (fd < 0) {
            return PDSIM_ERROR(StatusCode::kAlreadyExists, "{} exists: another process writes {}",
                               lock, j->head_.report_path);
        }
        ::close(fd);
    }
    const std::string full_cause =
        j->stopping_cause_.empty() ? cause : j->stopping_cause_ + "; then " + cause;
    StatusOr<std::string> counts = j->write_partial(full_cause);
    if (counts.ok()) {
        // The report stands: a standby rank or a later recover-report leaves it.
        // After a line the death cut, on a line of its own.
        j->file_ = std::fopen(journal_path.c_str(), "a");
        if (j->file_ != nullptr && j->file_ends_cut_) std::fputc('\n', j->file_);
        j->append_line(journal::report_written_line());
        if (j->file_ != nullptr) std::fclose(j->file_);
        j->file_ = nullptr;
    }
    if (!lock.empty()) std::remove(lock.c_str());
    return counts;
}

int ResultJournal::keep(const std::string& journal_path, int fd) {
    std::signal(SIGPIPE, SIG_IGN);  // the run's stderr may be gone by the time it prints
    const pid_t parent = ::getppid();
    for (;;) {
        struct pollfd p {
            .fd = fd, .events = POLLIN, .revents = 0
        };
        const int n = ::poll(&p, 1, 2000);
        if (n < 0 && errno == EINTR) continue;
        if (n == 0) {
            if (::getppid() != parent) break;  // reparented: the run's process is gone
            continue;
        }
        if (n < 0) break;
        unsigned char byte = 0;
        const ssize_t got = ::read(fd, &byte, 1);
        if (got < 0 && errno == EINTR) continue;
        if (got == 1) return 0;  // stood down: the run ended through its own code
        break;                   // end of file: the run's process died
    }
    const std::string cause = fmt::format(
        "rank 0 (prefill leader, router, report writer) died before it wrote the report (killed "
        "by SIGKILL, as mpirun sends 1 s after its SIGTERM, or by the OOM killer, or a crash); "
        "its report keeper wrote this report from the journal {}",
        journal_path);
    StatusOr<std::string> counts = recover(journal_path, cause, /*rank0_died=*/true);
    if (!counts.ok()) {
        const StatusCode code = counts.status().code();
        // The run wrote its report, removed its journal (a normal end) or another writer has it.
        if (code == StatusCode::kAlreadyExists || code == StatusCode::kNotFound) return 0;
        std::fprintf(stderr, "pdsim: report keeper: %s\n", counts.status().to_string().c_str());
        return 1;
    }
    std::fprintf(stderr,
                 "pdsim: report keeper: rank 0 died before it wrote the report: wrote it from the "
                 "journal %s: %s\n",
                 journal_path.c_str(), counts->c_str());
    return 0;
}

Status ResultJournal::start_keeper() {
    if (file_ == nullptr || keeper_pid_ > 0) return {};
    // A socket pair, not a pipe: the stand-down's send cannot raise SIGPIPE in this process when
    // the keeper is already gone (MSG_NOSIGNAL).
    int fds[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
        return PDSIM_ERROR(StatusCode::kInternal, "report keeper: socketpair: {}",
                           std::strerror(errno));
    }
    // The keeper's end at fd >= 10, so that its dup2 onto fd 3 always clears FD_CLOEXEC.
    const int read_end = ::fcntl(fds[0], F_DUPFD_CLOEXEC, 10);
    ::close(fds[0]);
    if (read_end < 0) {
        ::close(fds[1]);
        return PDSIM_ERROR(StatusCode::kInternal, "report keeper: fcntl: {}", std::strerror(errno));
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&actions, read_end, 3);
    // None of this process's other descriptors (MPI's and the transports' sockets: a peer must see
    // them close when this process dies).
    posix_spawn_file_actions_addclosefrom_np(&actions, 4);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    // A session of its own: mpirun's signals to this process's group do not reach it.
    posix_spawnattr_setflags(&attr,
                             POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    sigset_t none;
    sigemptyset(&none);
    posix_spawnattr_setsigmask(&attr, &none);
    sigset_t defaults;
    sigemptyset(&defaults);
    sigaddset(&defaults, SIGTERM);
    sigaddset(&defaults, SIGINT);
    sigaddset(&defaults, SIGPIPE);
    posix_spawnattr_setsigdefault(&attr, &defaults);
    std::string arg0 = "pdsim", arg1 = "recover-report", arg2 = path_, arg3 = "--keeper-fd",
                arg4 = "3";
    char* argv[] = {arg0.data(), arg1.data(), arg2.data(), arg3.data(), arg4.data(), nullptr};
    pid_t pid = -1;
    const int rc = ::posix_spawn(&pid, "/proc/self/exe", &actions, &attr, argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    ::close(read_end);
    if (rc != 0) {
        ::close(fds[1]);
        return PDSIM_ERROR(StatusCode::kInternal, "report keeper: posix_spawn: {}",
                           std::strerror(rc));
    }
    keeper_pid_ = static_cast<int>(pid);
    keeper_fd_ = fds[1];
    return {};
}

void ResultJournal::recover_or_exit(int sig) {
    if (path_.empty() || !rank0_dead_ || !rank0_dead_()) std::_Exit(128 + sig);
    const std::string lock = head_.report_path + ".recover";
    const int fd = ::open(lock.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
    if (fd < 0) std::_Exit(128 + sig);  // another rank writes it
    ::close(fd);
    Status loaded = load_file();
    if (loaded.code() == StatusCode::kAlreadyExists || loaded.code() == StatusCode::kNotFound) {
        // Rank 0 wrote its report (a partial one marks the journal; a full one removes it)
        // before it ended: it stands.
        std::remove(lock.c_str());
        std::_Exit(128 + sig);
    }
    const std::string cause = fmt::format(
        "rank 0 (prefill leader, router, report writer) died; rank {} wrote this report from "
        "rank 0's journal {} when mpirun stopped the job ({})",
        rank_, path_, signal_name(sig));
    std::string line;
    if (loaded.ok()) {
        {
            std::lock_guard<std::mutex> guard(mu_);
            add_rank0_dead(/*silent_s=*/0);
        }
        StatusOr<std::string> counts = write_partial(cause);
        line = counts.ok() ? fmt::format("wrote {}: {}", head_.report_path, *counts)
                           : counts.status().to_string();
    } else {
        line = loaded.to_string();
    }
    std::remove(lock.c_str());
    std::fprintf(stderr, "pdsim: rank %d: rank 0 died: %s\n", rank_, line.c_str());
    std::fflush(stderr);
    std::_Exit(128 + sig);
}

ResultJournal::~ResultJournal() {
    disarm();
    if (keeper_fd_ >= 0) {
        // Stand the keeper down: this process ends through its own code, which wrote a report
        // or decided not to.
        const unsigned char stop = 'q';
        [[maybe_unused]] const ssize_t n = ::send(keeper_fd_, &stop, 1, MSG_NOSIGNAL);
        ::close(keeper_fd_);
        keeper_fd_ = -1;
    }
    if (keeper_pid_ > 0) {
        // Reap it (it exits at once when stood down); give up after 2 s rather than hang.
        for (int i = 0; i < 200; ++i) {
            const pid_t done = ::waitpid(keeper_pid_, nullptr, WNOHANG);
            if (done == keeper_pid_ || (done < 0 && errno != EINTR)) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        keeper_pid_ = -1;
    }
    if (file_ != nullptr) std::fclose(file_);
}

void ResultJournal::begin_phase(Phase phase) {
    std::lock_guard<std::mutex> lock(mu_);
    phases_.push_back({.phase = phase,
                       .records = {},
                       .seen = std::vector<bool>(static_cast<size_t>(head_.submitted))});
}

Phase ResultJournal::last_phase() const {
    return phases_.empty() ? mode_phase(mode_) : phases_.back().phase;
}

void ResultJournal::add_rank0_dead(double silent_s) {
    log_of(last_phase())
        .dead_ranks.push_back({.rank = 0,
                               .instance = head_.rank0_instance,
                               .detected_at_s = elapsed_s(),
                               .silent_s = silent_s});
}

ResultJournal::PhaseLog& ResultJournal::log_of(Phase phase) {
    if (phases_.empty() || phases_.back().phase != phase) {
        phases_.push_back({.phase = phase,
                           .records = {},
                           .seen = std::vector<bool>(static_cast<size_t>(head_.submitted))});
    }
    return phases_.back();
}

void ResultJournal::record_dead_rank(Phase phase, int rank, const std::string& instance,
                                     double silent_s) {
    std::lock_guard<std::mutex> lock(mu_);
    const double at_s = elapsed_s();
    log_of(phase).dead_ranks.push_back(
        {.rank = rank, .instance = instance, .detected_at_s = at_s, .silent_s = silent_s});
    append_line(journal::dead_rank_line({.phase = std::string(phase_name(phase)),
                                         .rank = rank,
                                         .instance = instance,
                                         .detected_at_s = at_s,
                                         .silent_s = silent_s}));
}

void ResultJournal::heard_from(int rank) {
    if (rank <= 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    const auto r = static_cast<size_t>(rank);
    if (last_heard_us_.size() <= r) last_heard_us_.resize(r + 1, 0);
    last_heard_us_[r] = now_us();
}

void ResultJournal::record(Phase phase, const metrics::RequestRecord& r) {
    std::lock_guard<std::mutex> lock(mu_);
    PhaseLog& log = log_of(phase);
    const auto id = static_cast<size_t>(r.id);
    if (r.id < 0 || id >= log.seen.size() || log.seen[id]) return;
    log.seen[id] = true;
    log.records.push_back(r);
    append_line(journal::record_line({.phase = std::string(phase_name(phase)), .record = r}));
}

StatusOr<std::string> ResultJournal::write_partial(const std::string& cause) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t submitted = head_.submitted;
    const double at_s = elapsed_s();
    auto phase_report = [&](const PhaseLog& log) {
        metrics::Report r;
        metrics::summarize_requests(log.records, metrics::Slo{head_.slo_ttft_ms, head_.slo_tpot_ms},
                                    &r);
        r.mode = std::string(phase_name(log.phase));
        r.topology = head_.topology;
        r.model = head_.model;
        r.requests_submitted = submitted;
        const int64_t lost = submitted - r.requests_completed - r.requests_failed;
        json named = json::array();
        for (size_t i = 0; i < log.seen.size() && named.size() < kMaxLostNamed; ++i) {
            if (!log.seen[i]) named.push_back(i);
        }
        r.requests_lost = lost;
        r.extra["lost_requests"] = std::move(named);
        r.extra["incomplete"] = {{"cause", text::sanitize_utf8(cause)}, {"at_s", at_s}};
        json silent = json::array();
        for (size_t rank = 1; rank < last_heard_us_.size(); ++rank) {
            const double quiet_s = (now_us() - last_heard_us_[rank]) / 1e6;
            if (last_heard_us_[rank] > 0 && quiet_s > 2.0) {
                silent.push_back({{"rank", rank}, {"silent_s", quiet_s}});
            }
        }
        if (!silent.empty()) r.extra["silent_ranks"] = std::move(silent);
        if (!log.dead_ranks.empty()) {
            json dead = json::array();
            for (const auto& d : log.dead_ranks) {
                dead.push_back({{"rank", d.rank},
                                {"instance", text::sanitize_utf8(d.instance)},
                                {"detected_at_s", d.detected_at_s},
                                {"silent_s", d.silent_s}});
            }
            r.extra["dead_ranks"] = std::move(dead);
        }
        return r;
    };
    metrics::Report report;
    std::vector<metrics::RequestRecord> csv;
    const PhaseLog* dis = nullptr;
    const PhaseLog* col = nullptr;
    for (const PhaseLog& log : phases_) (log.phase == Phase::kDisagg ? dis : col) = &log;
    PhaseLog none{.phase = mode_phase(mode_),
                  .records = {},
                  .seen = std::vector<bool>(static_cast<size_t>(submitted))};
    if (dis == nullptr && col == nullptr) (none.phase == Phase::kDisagg ? dis : col) = &none;
    if (dis != nullptr) {
        report = phase_report(*dis);
        csv = dis->records;
        if (col != nullptr)
            report.colocated = std::make_shared<metrics::Report>(phase_report(*col));
    } else {
        report = phase_report(*col);
        csv = col->records;
    }
    // A mode-both run stopped in its colocated phase never started the disaggregated one.
    if (mode_ == Mode::kBoth && dis == nullptr) {
        metrics::Report colocated = report;
        report = phase_report(none);
        report.colocated = std::make_shared<metrics::Report>(std::move(colocated));
    }
    // Live, the configuration as it is now (a run may measure some of it after the journal
    // opened); read back, as the header holds it.
    report.extra["config"] = cfg_ != nullptr ? testbed_config_json(*cfg_) : head_.config;
    report_written_ = true;
    if (!head_.report_path.empty()) {
        PDSIM_RETURN_IF_ERROR(metrics::write_report(in_run_dir(head_.report_path), report));
    }
    if (!head_.requests_path.empty()) {
        PDSIM_RETURN_IF_ERROR(metrics::write_requests_csv(in_run_dir(head_.requests_path), csv));
    }
    // The report stands: a standby rank or the keeper that outlives this one must not replace it.
    append_line(journal::report_written_line());
    return fmt::format("{} completed, {} failed, {} lost of {}", report.requests_completed,
                       report.requests_failed, report.requests_lost, submitted);
}

void ResultJournal::add_temp_dir(const std::string& dir) {
    std::lock_guard<std::mutex> lock(mu_);
    temp_dirs_.push_back(dir);
}

void ResultJournal::forget_temp_dir(const std::string& dir) {
    std::lock_guard<std::mutex> lock(mu_);
    std::erase(temp_dirs_, dir);
}

void ResultJournal::finish_normally() {
    std::lock_guard<std::mutex> lock(mu_);
    report_written_ = true;
    if (file_ != nullptr) {
        std::fclose(file_);
        file_ = nullptr;
        std::remove(path_.c_str());
    }
}

Status ResultJournal::arm_signals() {
    bool expected = false;
    if (!g_armed.compare_exchange_strong(expected, true)) {
        return PDSIM_ERROR(StatusCode::kInternal, "another result journal is armed");
    }
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) {
        g_armed = false;
        return PDSIM_ERROR(StatusCode::kInternal, "result journal: pipe: {}", std::strerror(errno));
    }
    g_pipe_read = fds[0];
    g_signal_fd = fds[1];
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    ::sigaction(SIGTERM, &sa, &g_old_term);
    ::sigaction(SIGINT, &sa, &g_old_int);
    armed_ = true;
    watcher_ = std::thread([this] { watch(); });
    return {};
}

void ResultJournal::watch() {
    unsigned char sig = 0;
    for (;;) {
        const ssize_t n = ::read(g_pipe_read, &sig, 1);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0 || sig == 0) return;  // disarm()
        break;
    }
    if (standby_) recover_or_exit(sig);
    std::string cause = fmt::format("stopped by {}", signal_name(sig));
    std::function<SignalFindings()> probe;
    {
        std::lock_guard<std::mutex> lock(mu_);
        probe = signal_probe_;
    }
    const SignalFindings found = probe ? probe() : SignalFindings{};
    if (found.self_stalled_s > 0) {
        cause += fmt::format(
            ": rank 0 itself did not run for {:.1f} s before the signal (stopped, e.g. by SIGSTOP, "
            "or starved), and the other ranks ended the job when its pulses stopped",
            found.self_stalled_s);
    }
    {
        const std::vector<int>& gone = found.gone_ranks;
        if (!gone.empty()) {
            std::lock_guard<std::mutex> lock(mu_);
            const Phase last = last_phase();
            const topo::RankMap map = cfg_ != nullptr ? cfg_->topology.rank_map() : topo::RankMap();
            std::string names;
            for (int rank : gone) {
                const std::string instance =
                    cfg_ != nullptr && rank >= 0 && rank < map.world_size()
                        ? cfg_->topology.instances[static_cast<size_t>(map.at(rank).instance)].id
                        : std::string();
                log_of(last).dead_ranks.push_back({.rank = rank,
                                                   .instance = instance,
                                                   .detected_at_s = elapsed_s(),
                                                   .silent_s = -1});
                names += fmt::format("{}rank {} ({})", names.empty() ? "" : ", ", rank, instance);
            }
            cause += fmt::format(": the process of {} is gone from this host (killed or crashed)",
                                 names);
        }
    }
    bool written = false;
    {
        std::lock_guard<std::mutex> lock(mu_);
        written = report_written_;
    }
    if (written) {
        // The run wrote its report already (an error's partial one, with its cause, or the full
        // one): keep it.
        std::fprintf(stderr, "pdsim: %s after the report was written (it stands)\n", cause.c_str());
        std::fflush(stderr);
        std::_Exit(128 + sig);
    }
    {
        // Should this process be killed while it writes (mpirun's SIGKILL comes 1 s after its
        // SIGTERM), the keeper's report keeps the cause.
        std::lock_guard<std::mutex> lock(mu_);
        append_line(journal::stopping_line(cause));
    }
    StatusOr<std::string> counts = write_partial(cause);
    {
        std::lock_guard<std::mutex> lock(mu_);
        for (const std::string& dir : temp_dirs_) {
            std::error_code ec;
            std::filesystem::remove_all(dir, ec);
        }
    }
    const std::string where =
        head_.report_path.empty() ? std::string("no --report given") : "wrote " + head_.report_path;
    std::fprintf(
        stderr, "pdsim: %s: %s (%s)\n", cause.c_str(),
        counts.ok() ? (where + ": " + *counts).c_str() : counts.status().to_string().c_str(),
        path_.empty() ? "no journal" : ("journal " + path_).c_str());
    std::fflush(stderr);
    std::fflush(stdout);
    std::_Exit(128 + sig);
}

void ResultJournal::set_signal_probe(std::function<SignalFindings()> probe) {
    std::lock_guard<std::mutex> lock(mu_);
    signal_probe_ = std::move(probe);
}

void ResultJournal::disarm() {
    if (!armed_) return;
    armed_ = false;
    ::sigaction(SIGTERM, &g_old_term, nullptr);
    ::sigaction(SIGINT, &g_old_int, nullptr);
    const int wfd = g_signal_fd.exchange(-1);
    const unsigned char stop = 0;
    [[maybe_unused]] const ssize_t n = ::write(wfd, &stop, 1);
    if (watcher_.joinable()) watcher_.join();
    ::close(wfd);
    ::close(g_pipe_read);
    g_pipe_read = -1;
    g_armed = false;
}

}  // namespace pdsim::testbed

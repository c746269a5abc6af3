#include "sim/testbed/result_journal.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/text.h"
#include "sim/testbed/comm.h"
#include "sim/testbed/phase_report.h"
#include "sim/testbed/server.h"

namespace pdsim::testbed {

namespace {

using json = nlohmann::json;

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

json record_json(Phase phase, const metrics::RequestRecord& r) {
    return {{"phase", phase_name(phase)},
            {"id", r.id},
            {"ok", r.ok},
            {"error", text::sanitize_utf8(r.error)},
            {"arrival_ms", r.arrival_ms},
            {"first_token_ms", r.first_token_ms},
            {"finish_ms", r.finish_ms},
            {"input_len", r.input_len},
            {"output_len", r.output_len},
            {"generated", r.generated},
            {"prefill_instance", r.prefill_instance},
            {"decode_instance", r.decode_instance},
            {"queue_ms", r.queue_ms},
            {"prefill_start_ms", r.prefill_start_ms}};
}

}  // namespace

StatusOr<std::unique_ptr<ResultJournal>> ResultJournal::open(const ResolvedConfig& cfg) {
    std::unique_ptr<ResultJournal> j(new ResultJournal(cfg));
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
        const json head = {{"journal", "pdsim testbed"},
                           {"requests_submitted", cfg.requests.size()},
                           {"config", text::sanitize_utf8(describe(cfg.options))}};
        std::fprintf(j->file_, "%s\n", text::dump_json(head).c_str());
        std::fflush(j->file_);
    }
    return j;
}

std::unique_ptr<ResultJournal> ResultJournal::standby(const ResolvedConfig& cfg, int rank,
                                                      std::function<bool()> rank0_dead) {
    std::unique_ptr<ResultJournal> j(new ResultJournal(cfg));
    j->t_start_us_ = now_us();
    if (!cfg.options.report_path.empty()) j->path_ = cfg.options.report_path + ".journal.jsonl";
    j->standby_ = true;
    j->rank_ = rank;
    j->rank0_dead_ = std::move(rank0_dead);
    return j;
}

Status ResultJournal::load_file() {
    std::ifstream in(path_);
    if (!in) {
        return PDSIM_ERROR(StatusCode::kNotFound, "rank 0's journal {}: {}", path_,
                           std::strerror(errno));
    }
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
        const json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (!j.is_object()) continue;  // a line cut by the death
        if (j.contains("report_written")) {
            return PDSIM_ERROR(StatusCode::kAlreadyExists, "rank 0 wrote the report");
        }
        const std::string phase = j.value("phase", "");
        metrics::RequestRecord r;
        r.id = j.value("id", int64_t{-1});
        r.ok = j.value("ok", false);
        r.error = j.value("error", "");
        r.arrival_ms = j.value("arrival_ms", 0.0);
        r.first_token_ms = j.value("first_token_ms", -1.0);
        r.finish_ms = j.value("finish_ms", -1.0);
        r.input_len = j.value("input_len", 0);
        r.output_len = j.value("output_len", 0);
        r.generated = j.value("generated", 0);
        r.prefill_instance = j.value("prefill_instance", -1);
        r.decode_instance = j.value("decode_instance", -1);
        r.queue_ms = j.value("queue_ms", -1.0);
        r.prefill_start_ms = j.value("prefill_start_ms", -1.0);
        record(phase == phase_name(Phase::kColocated) ? Phase::kColocated : Phase::kDisagg, r);
    }
    return {};
}

void ResultJournal::recover_or_exit(int sig) {
    if (path_.empty() || !rank0_dead_ || !rank0_dead_()) std::_Exit(128 + sig);
    const std::string lock = cfg_.options.report_path + ".recover";
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
            const Phase last =
                phases_.empty()
                    ? (cfg_.options.mode == Mode::kColocated ? Phase::kColocated : Phase::kDisagg)
                    : phases_.back().phase;
            const std::string instance =
                cfg_.topology.instances.empty() ? std::string() : cfg_.topology.instances[0].id;
            log_of(last).dead_ranks.push_back({.rank = 0,
                                               .instance = instance,
                                               .detected_at_s = (now_us() - t_start_us_) / 1e6,
                                               .silent_s = 0});
        }
        StatusOr<std::string> counts = write_partial(cause);
        line = counts.ok() ? fmt::format("wrote {}: {}", cfg_.options.report_path, *counts)
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
    if (file_ != nullptr) std::fclose(file_);
}

void ResultJournal::begin_phase(Phase phase) {
    std::lock_guard<std::mutex> lock(mu_);
    phases_.push_back(
        {.phase = phase, .records = {}, .seen = std::vector<bool>(cfg_.requests.size())});
}

ResultJournal::PhaseLog& ResultJournal::log_of(Phase phase) {
    if (phases_.empty() || phases_.back().phase != phase) {
        phases_.push_back(
            {.phase = phase, .records = {}, .seen = std::vector<bool>(cfg_.requests.size())});
    }
    return phases_.back();
}

void ResultJournal::record_dead_rank(Phase phase, int rank, const std::string& instance,
                                     double silent_s) {
    std::lock_guard<std::mutex> lock(mu_);
    log_of(phase).dead_ranks.push_back({.rank = rank,
                                        .instance = instance,
                                        .detected_at_s = (now_us() - t_start_us_) / 1e6,
                                        .silent_s = silent_s});
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
    if (file_ != nullptr) {
        std::fprintf(file_, "%s\n", text::dump_json(record_json(phase, r)).c_str());
        std::fflush(file_);
    }
}

StatusOr<std::string> ResultJournal::write_partial(const std::string& cause) {
    std::lock_guard<std::mutex> lock(mu_);
    const TestbedOptions& o = cfg_.options;
    const auto submitted = static_cast<int64_t>(cfg_.requests.size());
    const double at_s = (now_us() - t_start_us_) / 1e6;
    auto phase_report = [&](const PhaseLog& log) {
        metrics::Report r;
        metrics::summarize_requests(log.records, metrics::Slo{o.slo_ttft_ms, o.slo_tpot_ms}, &r);
        r.mode = std::string(phase_name(log.phase));
        r.topology = cfg_.topology.name;
        r.model = cfg_.model.name;
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
    PhaseLog none{.phase = o.mode == Mode::kColocated ? Phase::kColocated : Phase::kDisagg,
                  .records = {},
                  .seen = std::vector<bool>(cfg_.requests.size())};
    if (dis == nullptr && col == nullptr) (o.mode == Mode::kColocated ? col : dis) = &none;
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
    if (o.mode == Mode::kBoth && dis == nullptr) {
        metrics::Report colocated = report;
        report = phase_report(none);
        report.colocated = std::make_shared<metrics::Report>(std::move(colocated));
    }
    report.extra["config"] = testbed_config_json(cfg_);
    report_written_ = true;
    if (!o.report_path.empty()) PDSIM_RETURN_IF_ERROR(metrics::write_report(o.report_path, report));
    if (!o.requests_path.empty()) {
        PDSIM_RETURN_IF_ERROR(metrics::write_requests_csv(o.requests_path, csv));
    }
    if (file_ != nullptr) {
        // The report stands: a standby rank that outlives this one must not replace it.
        std::fprintf(file_, "%s\n", text::dump_json(json{{"report_written", true}}).c_str());
        std::fflush(file_);
    }
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
            const Phase last =
                phases_.empty()
                    ? (cfg_.options.mode == Mode::kColocated ? Phase::kColocated : Phase::kDisagg)
                    : phases_.back().phase;
            const topo::RankMap map = cfg_.topology.rank_map();
            std::string names;
            for (int rank : gone) {
                const std::string instance =
                    rank >= 0 && rank < map.world_size()
                        ? cfg_.topology.instances[static_cast<size_t>(map.at(rank).instance)].id
                        : std::string();
                log_of(last).dead_ranks.push_back({.rank = rank,
                                                   .instance = instance,
                                                   .detected_at_s = (now_us() - t_start_us_) / 1e6,
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
    StatusOr<std::string> counts = write_partial(cause);
    {
        std::lock_guard<std::mutex> lock(mu_);
        for (const std::string& dir : temp_dirs_) {
            std::error_code ec;
            std::filesystem::remove_all(dir, ec);
        }
    }
    const std::string where = cfg_.options.report_path.empty()
                                  ? std::string("no --report given")
                                  : "wrote " + cfg_.options.report_path;
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

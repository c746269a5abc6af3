// ResultJournal: rank 0's record of every request that reached an end, kept so that a run that
// stops early still leaves a report that adds up (docs/testbed.md "When a run stops early").
//
// The router calls record() as each request becomes terminal (completed or failed); the journal
// keeps a copy and appends it as one JSON line to `<report>.journal.jsonl` (flushed per line, so a
// SIGKILL of rank 0 itself still leaves the finished requests on disk). When the run cannot end
// normally (a phase fails, a peer dies, a wait times out, SIGTERM or SIGINT arrives, as mpirun
// sends when another rank died), write_partial() writes the report (and the --requests CSV) from
// what it holds: requests_submitted is the run's request count, requests_completed and
// requests_failed what was recorded, and requests_lost the rest, named in `lost_requests` (first
// kMaxLostNamed ids) and each phase's `incomplete` object says why and when the run stopped. So
// requests_completed + requests_failed + requests_lost == requests_submitted in every report.
// On a normal end finish_normally() removes the journal file (the full report supersedes it).
//
// The keeper: start_keeper() spawns a small process (`pdsim recover-report JOURNAL --keeper-fd 3`,
// in a session of its own, so that signals mpirun sends this process's group miss it) that waits
// for this process to end (on a socket only this process holds the other end of). A process
// that never ran its destructor nor wrote a report (killed by
// SIGKILL: mpirun sends one odls_base_sigkill_timeout, 1 s by default, after its SIGTERM, and a
// loaded host can outlast that while the watcher writes; the OOM killer; a crash) leaves the
// report to the keeper, which writes it from the journal file (recover()). The journal file's
// header holds what the report needs of the configuration (journal_format.h), so `pdsim
// recover-report` writes the same report from the file alone, in the keeper or by hand.
//
// Signals: arm_signals() installs SIGTERM and SIGINT handlers (async-signal-safe: they write the
// signal number to a pipe) and starts a watcher thread; on a signal the watcher writes the
// partial report, prints one line to stderr and ends the process with 128 + the signal number
// (std::_Exit: the other threads may hold locks, so nothing else runs but the removal of the temp
// directories registered with add_temp_dir). disarm() (also the
// destructor) restores the previous handlers and joins the watcher. One journal may be armed per
// process at a time.
//
// Thread-safety: record(), record_dead_rank(), write_partial() and the watcher are safe to run
// concurrently (one mutex); start_keeper() / arm_signals() / disarm() / the destructor from one
// thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "sim/metrics/report.h"
#include "sim/testbed/journal_format.h"
#include "sim/testbed/options.h"

namespace pdsim::testbed {

enum class Phase;

inline constexpr size_t kMaxLostNamed = 1000;

class ResultJournal {
public:
    // `cfg` outlives the journal. The journal file is `<report_path>.journal.jsonl` when the run
    // writes a report (else the journal is in memory only). kInvalidArgument naming --report when
    // the file cannot be created (checked before any phase runs).
    [[nodiscard]] static StatusOr<std::unique_ptr<ResultJournal>> open(const ResolvedConfig& cfg);
    ~ResultJournal();
    ResultJournal(const ResultJournal&) = delete;
    ResultJournal& operator=(const ResultJournal&) = delete;

    // Rank 0, when the journal has a file: starts the keeper (see the file comment). Call it
    // before arm_signals(), while no other thread uses the journal. The destructor stands the
    // keeper down (it exits without writing) and reaps it. Errors: kInternal when the keeper
    // cannot be spawned (the run can go on without it).
    [[nodiscard]] Status start_keeper();

    // `pdsim recover-report`: reads the journal file at `journal_path` and writes the report (and
    // the --requests CSV) it names from what it holds, with `cause` in each phase's `incomplete`
    // (the cause rank 0's watcher had started from, when it wrote one, goes before it). When
    // `rank0_died` (the keeper), rank 0 is named in `dead_ranks` and the writer takes
    // `<report>.recover` first (O_EXCL, as a standby rank does; one writer per run). Returns the
    // counts line. Errors: kNotFound no such file (a run that ended
    // normally removed it); kInvalidArgument `file:line` of a line that is not a journal's (a cut
    // last line, as a death leaves, is skipped); kAlreadyExists the journal says the run wrote its
    // report, or another writer holds the lock; a write error.
    [[nodiscard]] static StatusOr<std::string> recover(const std::string& journal_path,
                                                       const std::string& cause, bool rank0_died);
    // The keeper's body (`pdsim recover-report --keeper-fd FD`): waits until `fd` reads a byte
    // (stood down: returns 0) or its end closes, or the parent is gone (checked every 2 s); then,
    // unless the run wrote its report or removed its journal, recover() with the cause that rank 0
    // died before it wrote the report, printing one line to stderr. Returns the exit status.
    [[nodiscard]] static int keep(const std::string& journal_path, int fd);

    // A phase starts: its submitted count is the run's request count.
    void begin_phase(Phase phase);
    // Request `record.id` of `phase` reached its end (ok or failed). Idempotent per (phase, id).
    void record(Phase phase, const metrics::RequestRecord& record);

    // The router found `rank` (of instance `instance`) silent for `silent_s` seconds past the
    // heartbeat timeout: dead or hung. Listed in the phase's report as `dead_ranks`
    // ([{rank, instance, detected_at_s, silent_s}], detected_at_s from the journal's opening).
    void record_dead_rank(Phase phase, int rank, const std::string& instance, double silent_s);

    // A heartbeat of `rank` arrived (the router, once a second per rank). A partial report lists
    // the ranks silent for more than 2 s when it was written as `silent_ranks`
    // ([{rank, silent_s}]): when mpirun ends the job because a host went away, the rank that
    // went quiet is the one to look at.
    void heard_from(int rank);

    // Writes the report (when the run has --report) and the --requests CSV from what was
    // recorded, with `cause` (why the run stopped: an error, "SIGTERM") in each phase's
    // `incomplete`; returns the counts line printed for the user ("3 completed, 0 failed, 7 lost
    // of 10"), and appends {"report_written": true} to the journal file (a standby rank then
    // leaves the report alone). Errors: writing the files failed.
    [[nodiscard]] StatusOr<std::string> write_partial(const std::string& cause);
    // The run ended normally and wrote its own report: removes the journal file.
    void finish_normally();

    // A stand-in on a rank but 0 under mpirun, for the one death rank 0 cannot report: its own.
    // It records nothing and creates no file. Armed (arm_signals), a SIGTERM or SIGINT asks
    // `rank0_dead` (called on the watcher thread); when rank 0 is gone (mpirun terminates every
    // other rank once one was killed) and this rank is the first to create `<report>.recover`
    // (O_EXCL: one writer per run), it reads rank 0's journal file (it must be on this host),
    // writes the partial report and CSV from it with the cause "rank 0 ... died" and rank 0 in
    // `dead_ranks`, removes the lock, prints one line and exits 128 + the signal. Otherwise it
    // exits 128 + the signal at once (a live rank 0 writes the report itself; a journal that
    // says its report was written, or none, means rank 0 wrote it before it ended). `rank` is this
    // rank, for the messages.
    [[nodiscard]] static std::unique_ptr<ResultJournal> standby(const ResolvedConfig& cfg, int rank,
                                                                std::function<bool()> rank0_dead);

    // What rank 0 can find out about the job's end when mpirun stops it.
    struct SignalFindings {
        // Ranks whose process this host can tell is gone (killed or crashed: mpirun then
        // terminates the others, rank 0 included).
        std::vector<int> gone_ranks;
        // How long this process did not run just before the signal (stopped by SIGSTOP, or
        // starved), seconds; 0: it ran. A rank 0 that stops running is ended by the other ranks
        // (they stop hearing its pulse) and gets SIGCONT and SIGTERM from mpirun.
        double self_stalled_s = 0;
    };
    // Rank 0 under mpirun: on a SIGTERM or SIGINT, before the partial report is written, `probe`
    // (called on the watcher thread; it must not block) says what it finds. Each gone rank is
    // listed in the report's `dead_ranks` (silent_s -1: found gone at the signal, not by the
    // heartbeat); the cause names the gone ranks and a stall of rank 0 itself. Thread-safe: may
    // be set after arm_signals().
    void set_signal_probe(std::function<SignalFindings()> probe);

    // See the file comment. kInternal when another journal is armed or the pipe cannot be made.
    [[nodiscard]] Status arm_signals();
    void disarm();
    // A temporary directory of the run (a tcp bootstrap directory) that a signal's end removes
    // too (a normal end removes it itself, then calls forget_temp_dir).
    void add_temp_dir(const std::string& dir);
    void forget_temp_dir(const std::string& dir);

    [[nodiscard]] const std::string& journal_path() const { return path_; }

private:
    struct PhaseLog {
        Phase phase;
        std::vector<metrics::RequestRecord> records;  // terminal ones, in record() order
        std::vector<bool> seen;                       // per request id
        struct DeadRank {
            int rank;
            std::string instance;
            double detected_at_s;
            double silent_s;
        };
        std::vector<DeadRank> dead_ranks;
    };
    PhaseLog& log_of(Phase phase);  // mu_ held
    // The phase a death falls in: the last one begun, else the mode's own (mu_ held).
    [[nodiscard]] Phase last_phase() const;
    // Notes rank 0 (the journal's writer) dead in last_phase() (mu_ held).
    void add_rank0_dead(double silent_s);
    // `cfg` null: a journal read back from its file (recover()), its head from the header.
    explicit ResultJournal(const ResolvedConfig* cfg);
    [[nodiscard]] double elapsed_s() const;
    // Appends one line to the journal file (mu_ held; no file: nothing).
    void append_line(const nlohmann::json& line);
    void watch();
    // standby(): on a signal, the report from rank 0's journal file if rank 0 died; never returns.
    [[noreturn]] void recover_or_exit(int sig);
    // Replays the journal file at path_ into this (in-memory) journal: records, dead ranks and
    // the watcher's cause (stopping_cause_). Errors: kNotFound unreadable file; kAlreadyExists the
    // journal says the report was written; kInvalidArgument file:line (journal::parse). With
    // `read_header`, the header fills head_ and mode_. Sets file_ends_cut_.
    [[nodiscard]] Status load_file(bool read_header = false);
    // A path of the run as given, against the run's directory when read back from a file
    // (recover-report may run elsewhere); unchanged otherwise.
    [[nodiscard]] std::string in_run_dir(const std::string& path) const;

    const ResolvedConfig* cfg_;  // null: read back from a file
    journal::Head head_;
    Mode mode_ = Mode::kBoth;     // head_.mode
    bool recovered_ = false;      // read back from a file: elapsed_s() from the wall clock
    std::string stopping_cause_;  // the watcher's cause, read back from the file
    bool file_ends_cut_ = false;  // load_file: the file's last line has no newline (cut)
    std::mutex mu_;
    std::string path_;  // "" when there is no --report
    std::FILE* file_ = nullptr;
    std::vector<PhaseLog> phases_;
    std::vector<std::string> temp_dirs_;
    std::vector<double> last_heard_us_;  // per rank > 0; 0: not heard from yet
    double t_start_us_ = 0;
    bool report_written_ = false;  // partial or full: a signal then keeps it (and its cause)
    // standby() only.
    bool standby_ = false;
    int rank_ = 0;
    std::function<bool()> rank0_dead_;
    std::function<SignalFindings()> signal_probe_;  // mu_
    // Signals.
    bool armed_ = false;
    std::thread watcher_;
    // The keeper (start_keeper): its pid and this end of its socket pair; -1 none.
    int keeper_pid_ = -1;
    int keeper_fd_ = -1;
};

}  // namespace pdsim::testbed

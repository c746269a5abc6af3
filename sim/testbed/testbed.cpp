#include "sim/testbed/testbed.h"

#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "backends/attention/attention_backend.h"
#include "backends/attention/hybrid_backend.h"
#include "backends/kv/kv_pool.h"
#include "backends/model/synthetic_model.h"
#include "backends/runtime/cpu_stream.h"
#include "common/logging.h"
#include "common/mpi_check.h"
#include "common/net_interface.h"
#include "common/thread_info.h"
#include "sim/metrics/report.h"
#include "sim/metrics/timeline.h"
#include "sim/testbed/comm.h"
#include "sim/testbed/gpu_rank.h"
#include "sim/testbed/phase_report.h"
#include "sim/testbed/prompt.h"
#include "sim/testbed/protocol.h"
#include "sim/testbed/router.h"
#include "sim/testbed/server.h"
#include "sim/testbed/shaped_transport.h"
#include "topology/gpu_spec.h"
#include "topology/shaping.h"
#include "transfer/fault/fault_transport.h"
#include "transfer/local/local_transport.h"
#include "transfer/nccl/gpu_transports.h"
#include "transfer/nccl/nccl_tp_comm.h"
#include "transfer/tcp/tcp_transport.h"
#include "transfer/transport.h"

namespace pdsim::testbed {

namespace {

using json = nlohmann::json;
using std::chrono::milliseconds;

struct Launcher {
    int world = 1;
    int rank = 0;
    int local_size = 1;
    int local_rank = 0;
};

int env_int(const char* name, int dflt) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? std::atoi(v) : dflt;
}

Launcher detect_launcher() {
    Launcher l;
    if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr) {
        l.world = env_int("OMPI_COMM_WORLD_SIZE", 1);
        l.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
        l.local_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", l.world);
        l.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    } else if (std::getenv("PMI_SIZE") != nullptr) {
        l.world = env_int("PMI_SIZE", 1);
        l.rank = env_int("PMI_RANK", 0);
        l.local_size = env_int("MPI_LOCALNRANKS", l.world);
        l.local_rank = env_int("MPI_LOCALRANKID", 0);
    }
    return l;
}

// Whether this process may run on fewer than all of the host's cores (mpirun bound it).
bool bound_to_some_cores(int host_cores) {
#ifdef __linux__
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return false;
    return CPU_COUNT(&set) < host_cores;
#else
    (void)host_cores;
    return false;
#endif
}

// What every rank thread of this process shares.
struct Shared {
    const ResolvedConfig* cfg = nullptr;
    bool local = false;                              // ranks are threads
    int local_ranks = 1;                             // ranks on this host
    std::unique_ptr<LocalHub> hub;                   // local
    std::vector<std::unique_ptr<LocalTpGroup>> tp;   // local, per instance
    std::shared_ptr<transfer::LocalWorld> kv_world;  // local
    // local: the data transport's own world (--data-transport local_writes; a rank attaches one
    // endpoint per world, and its control transport is in kv_world).
    std::shared_ptr<transfer::LocalWorld> data_world;
    // KV transport shaping (decided by rank 0 at start; identical on every rank).
    std::mutex shape_mu;
    bool shape = false;
    topo::LinkShaping shaping;
    json shaping_info;
    bool error_printed = false;  // rank 0
    // A data transport that meets through a rendezvous (nccl) with the ranks as threads: the
    // directory its ranks meet in (made by the first rank that asks; removed with this).
    std::mutex data_mu;
    std::string data_rendezvous_dir;
    ResultJournal* journal = nullptr;  // rank 0's (result_journal.h); null on other ranks

    Shared() = default;
    Shared(const Shared&) = delete;
    Shared& operator=(const Shared&) = delete;
    ~Shared() {
        if (data_rendezvous_dir.empty()) return;
        std::error_code ec;
        std::filesystem::remove_all(data_rendezvous_dir, ec);
    }
};

StatusOr<std::unique_ptr<transfer::Transport>> make_kv_transport(Shared& sh, Mailbox& mbox,
                                                                 int rank, std::string* tcp_dir) {
    const TestbedOptions& o = sh.cfg->options;
    transfer::TransportOptions to;
    to.rank = rank;
    to.world_size = mbox.size();
    to.set(transfer::LocalOptions{.world = sh.kv_world});
    to.connect_timeout = milliseconds(30'000);
    PDSIM_ASSIGN_OR_RETURN(const transfer::TransportDescriptor descriptor,
                           transfer::find_transport(o.transport));
    // A transport whose ranks meet through a rendezvous gets a directory (and a session token),
    // and with --tcp-interface the address it listens on.
    if (descriptor.caps.setup == transfer::TransportSetup::kRendezvous) {
        transfer::TcpOptions tcp;
        if (!o.tcp_interface.empty()) {
            StatusOr<std::string> addr = net::interface_ipv4(o.tcp_interface);
            if (!addr.ok()) {
                return addr.status().with_context(fmt::format("rank {}: --tcp-interface", rank));
            }
            tcp.bind_address = *addr;
        }
        // Rendezvous through a fresh directory (one host), unless PDSIM_TCP_ENDPOINTS or
        // PDSIM_TCP_BOOTSTRAP_DIR says where the ranks meet (several hosts). The session token is
        // PDSIM_SESSION_TOKEN when set (on every rank: mpirun -x), else a fresh random one that
        // rank 0 sends to every rank over the control plane, in every case.
        const bool env_rendezvous = std::getenv("PDSIM_TCP_ENDPOINTS") != nullptr ||
                                    std::getenv("PDSIM_TCP_BOOTSTRAP_DIR") != nullptr;
        const char* env_token = std::getenv("PDSIM_SESSION_TOKEN");
        const bool given_token = env_token != nullptr && *env_token != '\0';
        if (rank == 0) {
            std::string dir;
            if (!env_rendezvous) {
                dir = (std::filesystem::temp_directory_path() / "pdsim-tcp-XXXXXX").string();
                if (::mkdtemp(dir.data()) == nullptr) {
                    return PDSIM_ERROR(StatusCode::kUnavailable,
                                       "tcp: cannot create a bootstrap directory");
                }
                *tcp_dir = dir;
            }
            std::string token;
            if (!given_token) {
                std::random_device rd;
                for (int i = 0; i < 4; ++i) token += fmt::format("{:08x}", rd());
            }
            for (int r = 1; r < mbox.size(); ++r) {
                PDSIM_RETURN_IF_ERROR(
                    mbox.send(r, Channel::kCollect,
                              encode_message(TcpBootstrapMsg{.dir = dir, .token = token})));
            }
            tcp.bootstrap_dir = std::move(dir);
            tcp.session_token = std::move(token);
        } else {
            PDSIM_ASSIGN_OR_RETURN(auto m, mbox.recv_kind(Channel::kCollect, TcpBootstrapMsg::kKind,
                                                          std::chrono::seconds(60)));
            if (!m)
                return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                                   "tcp: no bootstrap message from rank 0 within 60 s");
            PDSIM_ASSIGN_OR_RETURN(TcpBootstrapMsg boot, decode_message<TcpBootstrapMsg>(m->body));
            if (boot.token.empty() && !given_token) {
                return PDSIM_ERROR(StatusCode::kInvalidArgument,
                                   "tcp: PDSIM_SESSION_TOKEN is set on rank 0 but not on rank {}: "
                                   "pass it to every rank (mpirun -x PDSIM_SESSION_TOKEN)",
                                   rank);
            }
            tcp.bootstrap_dir = std::move(boot.dir);
            tcp.session_token = std::move(boot.token);
        }
        to.set(std::move(tcp));
    }
    std::string name = o.transport;
    if (!o.transport_fault.empty() &&
        (o.transport_fault_rank < 0 || o.transport_fault_rank == rank)) {
        to.set(transfer::FaultOptions{.spec = o.transport_fault, .inner = name});
        name = "fault";
    }
    auto t = transfer::create_transport(name, to);
    if (!t.ok()) {
        const Status& st = t.status();
        // kUnavailable from a rendezvous transport is its peers not turning up (a failure of this
        // run); from the others (not built, no device) it means the choice cannot work here.
        const bool rendezvous =
            name == o.transport && descriptor.caps.setup == transfer::TransportSetup::kRendezvous;
        if (st.code() == StatusCode::kUnavailable && !rendezvous) {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("--transport {}: {}", o.transport, st.message()));
        }
        return st.with_context(fmt::format("--transport {}", o.transport));
    }
    // The shaping throttles the transport that carries the KV: this one, unless a data transport
    // does (GPU ranks: make_data_transport shapes it instead).
    const bool carries_kv = o.data_transport.empty() || o.data_transport == kDataTransportNone;
    std::lock_guard<std::mutex> lock(sh.shape_mu);
    if (sh.shape && carries_kv) return make_shaped_transport(std::move(*t), sh.shaping);
    return t;
}

// The rank's KV data transport (--data-transport, resolved): null for none; else the named
// transport, on the rank's GPU (`gpu`; a GPU transport's device), numbering the ranks as the
// control transport does, throttled by the run's shaping when it has one (its one-sided writes
// held as sends are). A transport that cannot work here (not built, no device) is the option's
// fault: kInvalidArgument naming it.
StatusOr<std::unique_ptr<transfer::Transport>> make_data_transport(Shared& sh, int rank, int world,
                                                                   const GpuRank* gpu) {
    const ResolvedConfig& cfg = *sh.cfg;
    const std::string& name = cfg.options.data_transport;
    if (name.empty() || name == kDataTransportNone) return std::unique_ptr<transfer::Transport>();
    transfer::TransportOptions to;
    to.rank = rank;
    to.world_size = world;
    to.connect_timeout = milliseconds(60'000);
    transfer::GpuTransportOptions gto{.device_index = gpu != nullptr ? gpu->info().device : 0};
    PDSIM_ASSIGN_OR_RETURN(const transfer::TransportDescriptor descriptor,
                           transfer::find_transport(name));
    if (sh.local && descriptor.caps.setup == transfer::TransportSetup::kRendezvous) {
        // Threads of this process: they meet in a fresh directory (under mpirun, over MPI).
        std::lock_guard<std::mutex> lock(sh.data_mu);
        if (sh.data_rendezvous_dir.empty()) {
            std::string tmpl =
                (std::filesystem::temp_directory_path() / "pdsim-data-XXXXXX").string();
            if (::mkdtemp(tmpl.data()) == nullptr) {
                return PDSIM_ERROR(StatusCode::kUnavailable,
                                   "--data-transport {}: cannot create a rendezvous directory in "
                                   "{}",
                                   name, std::filesystem::temp_directory_path().string());
            }
            sh.data_rendezvous_dir = tmpl;
            if (sh.journal != nullptr) sh.journal->add_temp_dir(tmpl);
        }
        gto.rendezvous_dir = sh.data_rendezvous_dir;
    }
    to.set(std::move(gto));
    // Threads sharing an in-process world (local_writes: resolve() allowed it without mpirun).
    if (descriptor.caps.setup == transfer::TransportSetup::kSharedWorld) {
        to.set(transfer::LocalOptions{.world = sh.data_world});
    }
    auto t = transfer::create_transport(name, to);
    if (!t.ok()) {
        const Status& st = t.status();
        return Status(
            st.code() == StatusCode::kUnavailable ? StatusCode::kInvalidArgument : st.code(),
            fmt::format("--data-transport {}: {}", name, st.message()));
    }
    std::lock_guard<std::mutex> lock(sh.shape_mu);
    if (sh.shape) return make_shaped_transport(std::move(*t), sh.shaping);
    return std::move(*t);
}

// Seconds of one prefill layer of `tokens` tokens on this CPU (best of two forwards).
StatusOr<double> measure_cpu_layer_s(const ResolvedConfig& cfg, model::SyntheticModel& model,
                                     int threads, int tokens) {
    const model::ModelConfig& m = cfg.model;
    const int tp = model.tp_size();
    runtime::CpuStream stream("measure");
    attn::AttentionConfig ac;
    ac.num_q_heads = m.num_q_heads / tp;
    ac.num_kv_heads = m.num_kv_heads / tp;
    ac.head_dim = m.head_dim;
    ac.stream = &stream;
    ac.num_threads = threads;
    PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<attn::AttentionBackend> backend,
                           attn::create_attention_backend(cfg.options.backend, ac));
    std::unique_ptr<kv::StatePool> states;
    if (model.num_recurrent_layers() > 0) {
        // A hybrid model: its composite backend and a one-request state pool (the server
        // attaches its own pool again when its phase starts).
        PDSIM_ASSIGN_OR_RETURN(backend, attn::HybridBackend::create(
                                            std::move(backend), attn::make_cpu_recurrent_mixer()));
        PDSIM_ASSIGN_OR_RETURN(states, kv::StatePool::create(model.state_pool_config(2)));
        PDSIM_RETURN_IF_ERROR(model.attach_state_pool(states.get()));
    }
    if (m.count_layers(model::LayerKind::kSlidingWindow) > 0) {
        // One pool for every layer here: no window pool (a server attaches its own).
        PDSIM_RETURN_IF_ERROR(model.attach_window_pool(nullptr));
    }
    const int ps = cfg.options.page_size;
    kv::MHAPoolConfig pc;
    pc.num_layers = m.num_layers;
    pc.page_size = ps;
    pc.num_kv_heads = ac.num_kv_heads;
    pc.head_dim = m.head_dim;
    pc.num_pages = (tokens + ps - 1) / ps + 1;
    PDSIM_ASSIGN_OR_RETURN(auto pool, kv::MHATokenToKVPool::create(pc));
    model::StepBatch b;
    b.tokens = make_prompt(0, tokens, {}, m.vocab, 7);
    for (int t = 0; t < tokens; ++t) b.out_cache_loc.push_back(ps + t);  // pages 1.. in order
    b.seq_lens = {tokens};
    b.extend_lens = {tokens};
    b.state_slots = {1};
    b.page_table_stride = pc.num_pages - 1;
    for (int p = 1; p < pc.num_pages; ++p) b.page_table.push_back(p);
    std::vector<int32_t> next(1);
    double best = 1e30;
    for (int rep = 0; rep < 2; ++rep) {
        const double t0 = now_us();
        PDSIM_RETURN_IF_ERROR(model.forward(b, *backend, *pool, next.data()));
        PDSIM_RETURN_IF_ERROR(stream.synchronize());
        best = std::min(best, (now_us() - t0) / 1e6);
    }
    if (states != nullptr) PDSIM_RETURN_IF_ERROR(model.attach_state_pool(nullptr));
    return best / m.num_layers;
}

// The same layer on `gpu` by the roofline (bf16 weights and KV).
double gpu_layer_s(const model::ModelConfig& m, const topo::GpuSpec& gpu, int tokens) {
    const double H = m.hidden, D = m.head_dim, HQ = m.num_q_heads, HKV = m.num_kv_heads,
                 I = m.intermediate;
    const double T = tokens;
    const double params = H * (HQ + 2 * HKV) * D + HQ * D * H + 3 * H * I;
    const double flops = 2 * T * params + 4 * HQ * D * T * (T + 1) / 2;
    const double bytes = 2 * params + 2 * T * 2 * HKV * D + 2 * 2 * T * H;
    return topo::roofline_time_s(gpu, flops, bytes);
}

// Rank 0 decides the KV link shaping (measuring time_scale when the topology says auto) and tells
// every rank.
Status decide_shaping(Shared& sh, RankContext& ctx) {
    const ResolvedConfig& cfg = *sh.cfg;
    if (!cfg.shape) return {};
    double ts = cfg.shape_time_scale;
    json info;
    if (ctx.rank == 0) {
        if (ts <= 0) {
            const int tokens = std::min(512, cfg.options.max_batch_tokens);
            if (ctx.cpu_model == nullptr) {
                return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                                   "--shaping: measuring the CPU layer time needs CPU ranks");
            }
            PDSIM_ASSIGN_OR_RETURN(double cpu_s,
                                   measure_cpu_layer_s(cfg, *ctx.cpu_model, ctx.threads, tokens));
            const double gpu_s = gpu_layer_s(cfg.model, *topo::gpu_spec(cfg.shape_gpu), tokens);
            PDSIM_ASSIGN_OR_RETURN(ts, topo::time_scale_from(cpu_s, gpu_s));
            info = {{"measured_cpu_layer_ms", cpu_s * 1e3},
                    {"gpu_layer_ms", gpu_s * 1e3},
                    {"tokens", tokens},
                    {"gpu", cfg.shape_gpu}};
        }
        for (int r = 1; r < ctx.world; ++r) {
            PDSIM_RETURN_IF_ERROR(
                ctx.mbox->send(r, Channel::kCollect, encode_message(ShapeMsg{.time_scale = ts})));
        }
    } else {
        PDSIM_ASSIGN_OR_RETURN(auto m, ctx.mbox->recv_kind(Channel::kCollect, ShapeMsg::kKind,
                                                           std::chrono::seconds(300)));
        if (!m)
            return PDSIM_ERROR(StatusCode::kDeadlineExceeded, "no shaping decision from rank 0");
        PDSIM_ASSIGN_OR_RETURN(ShapeMsg shape, decode_message<ShapeMsg>(m->body));
        ts = shape.time_scale;
    }
    std::lock_guard<std::mutex> lock(sh.shape_mu);
    sh.shape = true;
    sh.shaping = topo::shaping_for(cfg.shape_gbps, cfg.shape_latency_us, ts);
    if (ctx.rank == 0) {
        info["time_scale"] = ts;
        info["link_gbps"] = cfg.shape_gbps;
        info["link_latency_us"] = cfg.shape_latency_us;
        info["shaped_bytes_per_s"] = sh.shaping.bytes_per_s;
        info["shaped_latency_us"] = sh.shaping.latency_us;
        info["source"] = cfg.options.shaping;
        sh.shaping_info = info;
    }
    return {};
}

// ---- one rank ----

std::string this_host() {
    char name[256] = {};
    if (::gethostname(name, sizeof(name) - 1) != 0) return {};
    return name;
}

// Rank 0's process, as rank 0 broadcast it at start (run_mpi_rank; pid 0: not known).
std::atomic<int> g_rank0_pid{0};
std::mutex g_rank0_mu;
std::string g_rank0_host;  // g_rank0_mu

// Every rank's pid and host, as gathered at start (run_mpi_rank; empty before).
constexpr int kHostBytes = 256;
std::vector<int> g_rank_pids;           // g_rank0_mu
std::vector<std::string> g_rank_hosts;  // g_rank0_mu

// Whether process `pid` is gone (or a zombie). Only meaningful for a process of this host.
bool process_gone(int pid) {
    std::ifstream stat(fmt::format("/proc/{}/stat", pid));
    if (!stat) return true;
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const size_t paren = text.rfind(')');
    return paren != std::string::npos && paren + 2 < text.size() && text[paren + 2] == 'Z';
}

// The journal's keeper (result_journal.h): the report of a run whose rank 0 is killed before it
// writes one. A run goes on without it, with a warning.
void start_report_keeper(ResultJournal& journal) {
    const Status st = journal.start_keeper();
    if (!st.ok()) {
        PDSIM_LOG_WARN(
            "no report keeper: {} (a SIGKILL of this process would leave only the "
            "journal {}; `pdsim recover-report` writes the report from it)",
            st.to_string(), journal.journal_path());
    }
}

// Whether rank 0's process, on this host, is gone (or a zombie): ResultJournal::standby's test.
// False when its pid is not known yet or it runs on another host.
bool rank0_died() {
    const int pid = g_rank0_pid.load();
    if (pid <= 0) return false;
    {
        std::lock_guard<std::mutex> lock(g_rank0_mu);
        if (g_rank0_host != this_host()) return false;
    }
    return process_gone(pid);
}

// Rank 0's pulse thread (Heartbeat with pulse_to): when it last woke, and the longest gap between
// two of its wakes (due every second) in the last 30 s, with when it ended; steady-clock us.
std::atomic<double> g_pulse_last_us{0};
std::atomic<double> g_pulse_gap_s{0};
std::atomic<double> g_pulse_gap_at_us{0};

// How long rank 0 did not run before now: the pulse thread's gaps past its one-second period,
// the last one it saw (within 30 s) or the one it is in (it may not have woken since a SIGCONT).
double rank0_stalled_s() {
    const double now = static_cast<double>(std::chrono::duration_cast<std::chrono::microseconds>(
                                               std::chrono::steady_clock::now().time_since_epoch())
                                               .count());
    const double last = g_pulse_last_us.load();
    if (last <= 0) return 0;
    double stalled = (now - last) / 1e6 - 1.0;
    if (now - g_pulse_gap_at_us.load() < 30e6)
        stalled = std::max(stalled, g_pulse_gap_s.load() - 1.0);
    return stalled > 1.5 ? stalled : 0;
}

// The ranks but this one whose process on this host is gone: rank 0's probe when mpirun stops
// it (ResultJournal::set_signal_probe).
std::vector<int> rank_processes_gone() {
    const std::string here = this_host();
    const int self = static_cast<int>(::getpid());
    std::vector<int> gone;
    std::lock_guard<std::mutex> lock(g_rank0_mu);
    for (size_t r = 0; r < g_rank_pids.size() && r < g_rank_hosts.size(); ++r) {
        const int pid = g_rank_pids[r];
        if (pid <= 0 || pid == self || g_rank_hosts[r] != here) continue;
        if (process_gone(pid)) gone.push_back(static_cast<int>(r));
    }
    return gone;
}

// Heartbeats (router.h "Liveness"), once a second on Channel::kHeartbeat while the object
// lives. A rank but 0 sends its own (with its progress count) to rank 0's router and, when given
// `on_rank0_silent`, watches rank 0's: once it heard one, `silent_s` seconds without any is
// reported to the callback (once; it runs on the heartbeat thread and may end the process).
// Rank 0 sends a pulse to every other rank (`pulse_to`) and watches nothing: its router watches
// the others. Rank 0's pulse lives from before its phase's run until its results are collected,
// so it outlives every other rank's watch of the same phase.
class Heartbeat {
public:
    struct Options {
        const std::atomic<uint64_t>* progress = nullptr;  // may be null
        std::vector<int> pulse_to;                        // rank 0: the ranks to pulse
        double silent_s = 0;                              // 0: no watch of rank 0
        std::function<void(double silent_s)> on_rank0_silent;
    };
    Heartbeat(Mailbox& mbox, Options opts) : mbox_(mbox), opts_(std::move(opts)) {
        thread_ = std::thread([this] {
            set_thread_name("pdsim-heartbeat");
            using Clock = std::chrono::steady_clock;
            std::optional<Clock::time_point> heard_rank0;
            bool reported = false;
            std::unique_lock<std::mutex> lock(mu_);
            while (!stop_) {
                lock.unlock();
                if (!opts_.pulse_to.empty()) note_pulse_wake();
                if (opts_.pulse_to.empty()) {
                    nlohmann::json hb = {{"k", "hb"}};
                    if (opts_.progress != nullptr)
                        hb["p"] = opts_.progress->load(std::memory_order_relaxed);
                    mbox_.send(0, Channel::kHeartbeat, hb).ignore_error();
                } else {
                    for (int to : opts_.pulse_to) {
                        mbox_.send(to, Channel::kHeartbeat, nlohmann::json{{"k", "hb"}})
                            .ignore_error();
                    }
                }
                if (opts_.silent_s > 0 && opts_.on_rank0_silent && !reported) {
                    for (;;) {
                        StatusOr<std::optional<Message>> m =
                            mbox_.recv(Channel::kHeartbeat, std::chrono::microseconds(0));
                        if (!m.ok() || !*m) break;
                        if ((*m)->src == 0) heard_rank0 = Clock::now();
                    }
                    const double quiet =
                        heard_rank0
                            ? std::chrono::duration<double>(Clock::now() - *heard_rank0).count()
                            : 0;
                    if (quiet > opts_.silent_s) {
                        reported = true;
                        opts_.on_rank0_silent(quiet);
                    }
                }
                lock.lock();
                cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stop_; });
            }
        });
    }
    ~Heartbeat() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        thread_.join();
    }
    Heartbeat(const Heartbeat&) = delete;
    Heartbeat& operator=(const Heartbeat&) = delete;

private:
    // Rank 0: when the pulse thread woke, and a gap since its previous wake (rank0_stalled_s).
    static void note_pulse_wake() {
        const double now =
            static_cast<double>(std::chrono::duration_cast<std::chrono::microseconds>(
                                    std::chrono::steady_clock::now().time_since_epoch())
                                    .count());
        const double last = g_pulse_last_us.exchange(now);
        if (last > 0 && (now - last) / 1e6 > 2.5) {
            g_pulse_gap_s = (now - last) / 1e6;
            g_pulse_gap_at_us = now;
        }
    }

    Mailbox& mbox_;
    const Options opts_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool stop_ = false;
    std::thread thread_;
};

// A rank but 0 under mpirun whose watch found rank 0 (the router, the report's writer) silent:
// nothing can end the run but this rank, and no report can be written but by rank 0; say where
// the finished requests are and end the job (MPI_Abort, with an _Exit behind it as in
// run_mpi_rank: under --enable-recovery MPI_Abort only waits to be killed).
void end_job_rank0_silent(const ResolvedConfig& cfg, int rank, double silent_s) {
    const std::string journal = cfg.options.report_path.empty()
                                    ? std::string("(no --report: no journal)")
                                    : cfg.options.report_path + ".journal.jsonl";
    std::fprintf(stderr,
                 "pdsim: error: rank %d: rank 0 (the router, which writes the report) silent for "
                 "%.0f s: dead or hung (--heartbeat-timeout-s); the requests that finished are in "
                 "%s on rank 0's host; ending the job\n",
                 rank, silent_s, journal.c_str());
    std::fflush(stdout);
    std::fflush(stderr);
    std::thread([] {
        std::this_thread::sleep_for(std::chrono::seconds(3));
        std::_Exit(1);
    }).detach();
    MPI_Abort(MPI_COMM_WORLD, 1);
}

// A phase's end, after finish() stopped its engines: rank 0 joins its router and collects every
// live rank's result into `pd` (the others send theirs), then every rank meets at the phase's end
// barrier. An error (the router's; a rank dead, hung or silent) ends the run. The caller closes
// the phase's transports and frees its pool whatever this returns.
Status end_phase(Mailbox& mbox, const RankContext& ctx, const TestbedOptions& o, Phase phase,
                 RankResult result, std::thread& router, const Status& router_st,
                 milliseconds collect_timeout, PhaseData& pd) {
    if (ctx.rank != 0) {
        PDSIM_RETURN_IF_ERROR(mbox.send(0, Channel::kCollect, encode_message(result)));
    } else {
        router.join();
        PDSIM_RETURN_IF_ERROR(router_st.with_context("router"));
        pd.results.assign(static_cast<size_t>(ctx.world), std::nullopt);
        pd.results[0] = std::move(result);
        const auto deadline = std::chrono::steady_clock::now() + collect_timeout;
        // Ranks the router found dead send nothing: not waited for.
        const int dead = static_cast<int>(pd.router.dead_ranks.size());
        for (int got = 1; got < ctx.world - dead;) {
            const auto left = std::chrono::duration_cast<std::chrono::microseconds>(
                deadline - std::chrono::steady_clock::now());
            if (left.count() <= 0) break;
            PDSIM_ASSIGN_OR_RETURN(auto m,
                                   mbox.recv_kind(Channel::kCollect, RankResult::kKind, left));
            if (!m) break;
            PDSIM_ASSIGN_OR_RETURN(RankResult res, decode_message<RankResult>(m->body));
            if (res.phase != phase_name(phase)) continue;
            pd.results[static_cast<size_t>(m->src)] = std::move(res);
            ++got;
        }
        // A rank that sent nothing is dead or hung: the barrier below would only wait for
        // it as long again.
        if (!pd.router.dead_ranks.empty()) {
            std::string ranks;
            for (int r : pd.router.dead_ranks) {
                ranks += fmt::format("{}{}", ranks.empty() ? "" : ", ", r);
            }
            Status stopped = PDSIM_ERROR(StatusCode::kUnavailable,
                                         "{} phase: rank {} went silent (dead or hung; no "
                                         "heartbeat for {} s): the requests its instance held "
                                         "failed, the others ran on",
                                         phase_name(phase), ranks, o.heartbeat_timeout_s);
            // The live ranks wait at the phase's end barrier: let them go now.
            std::vector<int> live;
            for (int r = 1; r < ctx.world; ++r) {
                if (std::ranges::find(pd.router.dead_ranks, r) == pd.router.dead_ranks.end())
                    live.push_back(r);
            }
            stop_barrier(mbox, fmt::format("end-{}", phase_name(phase)), live, stopped.message());
            return stopped;
        }
        std::string missing;
        for (size_t r = 1; r < pd.results.size(); ++r) {
            if (!pd.results[r]) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
        }
        if (!missing.empty()) {
            return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                               "{} phase: no results from rank {} within {} s of the phase's "
                               "end (dead or hung)",
                               phase_name(phase), missing, collect_timeout.count() / 1000);
        }
    }
    return barrier(mbox, fmt::format("end-{}", phase_name(phase)), collect_timeout);
}

Status run_phases(Shared& sh, RankContext& ctx, const std::vector<double>& offsets,
                  std::vector<PhaseData>* phases) {
    const ResolvedConfig& cfg = *sh.cfg;
    const TestbedOptions& o = cfg.options;
    Mailbox& mbox = *ctx.mbox;
    std::vector<Phase> order;
    if (o.mode != Mode::kDisagg) order.push_back(Phase::kColocated);
    if (o.mode != Mode::kColocated) order.push_back(Phase::kDisagg);
    const auto collect_timeout =
        milliseconds(static_cast<int64_t>(o.request_timeout_s * 1000) + 60'000);
    for (Phase phase : order) {
        // Set-up: the phase's transports and this rank's server; then every rank agrees that all
        // of them could, before any serves (one that could not, e.g. an engine refusing its KV
        // layout, stops every rank with its error instead of leaving the others to time out).
        std::unique_ptr<transfer::Transport> kv;    // control
        std::unique_ptr<transfer::Transport> data;  // the KV bytes' own (GPU ranks: cuda_ipc)
        std::string tcp_dir;
        Status setup = [&]() -> Status {
            if (phase != Phase::kDisagg) return {};
            PDSIM_ASSIGN_OR_RETURN(kv, make_kv_transport(sh, mbox, ctx.rank, &tcp_dir));
            if (!tcp_dir.empty() && sh.journal != nullptr) sh.journal->add_temp_dir(tcp_dir);
            PDSIM_ASSIGN_OR_RETURN(data, make_data_transport(sh, ctx.rank, ctx.world, ctx.gpu));
            return {};
        }();
        auto server = std::make_unique<PhaseServer>(ctx, phase, KvTransports{kv.get(), data.get()});
        if (setup.ok()) setup = server->setup();
        if (!setup.ok()) {
            PDSIM_LOG_ERROR("rank {}: {} phase set-up: {}", ctx.rank, phase_name(phase),
                            setup.to_string());
        }
        const Status agreed = agree(mbox, fmt::format("setup-{}", phase_name(phase)), setup,
                                    std::chrono::seconds(120));
        auto close_transports = [&] {
            if (data) data->close();
            if (kv) kv->close();
            data.reset();
            kv.reset();
            if (!tcp_dir.empty()) {
                std::error_code ec;
                std::filesystem::remove_all(tcp_dir, ec);
                if (sh.journal != nullptr) sh.journal->forget_temp_dir(tcp_dir);
            }
        };
        if (!agreed.ok()) {
            server.reset();  // stops the engines, then frees the phase's objects
            close_transports();
            return Status(agreed.code(), fmt::format("{} phase set-up failed on {}",
                                                     phase_name(phase), agreed.message()));
        }
        PhaseData pd;
        pd.phase = phase;
        Status router_st;
        std::thread router;
        if (ctx.rank == 0) {
            router = std::thread([&] {
                set_thread_name("pdsim-router");
                RouterConfig rc;
                rc.phase = phase;
                rc.config = &cfg;
                rc.mbox = &mbox;
                rc.offsets = offsets;
                rc.progress = o.progress;
                rc.label = std::string(phase_name(phase));
                rc.journal = sh.journal;
                router_st = run_router(rc, &pd.router);
                if (!router_st.ok()) {
                    // Never leave the instances waiting for an end.
                    for (size_t i = 0; i < cfg.topology.instances.size(); ++i) {
                        mbox.send(cfg.topology.rank_map().first_rank(static_cast<int>(i)),
                                  Channel::kInstance, encode_message(EndMsg{}))
                            .ignore_error();
                    }
                }
            });
        }
        // Rank 0's pulse lives until its results are collected (Heartbeat's comment).
        std::optional<Heartbeat> pulse;
        std::optional<Heartbeat> heartbeat;
        const bool watch_rank0 = !sh.local && o.heartbeat_timeout_s > 0;
        if (ctx.rank == 0 && watch_rank0) {
            Heartbeat::Options pulse_opts;
            for (int r = 1; r < ctx.world; ++r) pulse_opts.pulse_to.push_back(r);
            if (!pulse_opts.pulse_to.empty()) pulse.emplace(mbox, std::move(pulse_opts));
        } else if (ctx.rank != 0) {
            Heartbeat::Options hb_opts{.progress = ctx.progress};
            if (watch_rank0) {
                hb_opts.silent_s = o.heartbeat_timeout_s;
                hb_opts.on_rank0_silent = [&cfg, rank = ctx.rank](double silent_s) {
                    end_job_rank0_silent(cfg, rank, silent_s);
                };
            }
            heartbeat.emplace(mbox, std::move(hb_opts));
        }
        Status st = server->run();
        heartbeat.reset();
        if (!st.ok())
            PDSIM_LOG_ERROR("rank {}: {} phase: {}", ctx.rank, phase_name(phase), st.to_string());
        RankResult result = server->finish(st);
        // finish() stopped the engines: nothing moves KV any more. Close the data transport now,
        // which releases what it mapped of other processes' memory (cuda_ipc: the decode ranks'
        // pools, opened through CUDA IPC handles), and free this rank's own phase memory
        // (server.reset()) only after the end barrier, when every rank has done so: a process must
        // not free memory that another still maps (CUDA: undefined behaviour). Threads of one
        // process map nothing; the order costs them nothing.
        if (data) data->close();
        // Collect the results and meet at the end barrier; on every way out, the transports close
        // before the pool is freed (the engines' contract, kv_sender.h "Lifetime"): on CPU ranks
        // the control transport carries the KV bytes too, and mpi's close() still progresses the
        // sends a failed request left with MPI (it cannot withdraw them) for up to 2 s; they must
        // read live pages, not freed ones. (Before, an error return at the phase's end freed the
        // pool first: `server` is destroyed before the transports declared ahead of it.)
        const Status ended = end_phase(mbox, ctx, o, phase, std::move(result), router, router_st,
                                       collect_timeout, pd);
        close_transports();
        server.reset();
        PDSIM_RETURN_IF_ERROR(ended);
        if (ctx.rank == 0) phases->push_back(std::move(pd));
    }
    return {};
}

// Rank 0: builds the reports, writes the files, prints; returns the run's outcome.
Status finish(const ResolvedConfig& cfg, std::vector<PhaseData>& phases,
              const std::vector<double>& offsets, double t_origin, const json& shaping_info,
              ResultJournal* journal) {
    const TestbedOptions& o = cfg.options;
    metrics::Timeline tl;
    metrics::Timeline* tlp = o.timeline_path.empty() ? nullptr : &tl;
    for (auto& pd : phases) build_phase_report(cfg, pd, offsets, t_origin, tlp);
    metrics::Report report;
    PhaseData* dis = nullptr;
    PhaseData* col = nullptr;
    for (auto& pd : phases) (pd.phase == Phase::kDisagg ? dis : col) = &pd;
    std::vector<metrics::RequestRecord> csv;
    if (dis != nullptr) {
        report = dis->report;
        csv = dis->router.records;
        if (col != nullptr) {
            report.colocated = std::make_shared<metrics::Report>(col->report);
            bool match = true;
            int mismatches = 0;
            for (size_t i = 0; i < dis->router.records.size(); ++i) {
                const auto& a = dis->router.records[i];
                const auto& b = col->router.records[i];
                if (!a.ok || !b.ok || a.tokens != b.tokens) {
                    match = false;
                    if (++mismatches <= 5) {
                        report.failures.push_back(
                            fmt::format("request {}: outputs differ (disagg {} tokens{}, colocated "
                                        "{} tokens{})",
                                        i, a.tokens.size(), a.ok ? "" : " failed", b.tokens.size(),
                                        b.ok ? "" : " failed"));
                    }
                }
            }
            report.outputs_match = match;
            report.extra["outputs_mismatched_requests"] = mismatches;
        }
    } else {
        report = col->report;
        csv = col->router.records;
    }
    report.extra["config"] = testbed_config_json(cfg);
    if (!shaping_info.is_null()) report.extra["config"]["shaping"] = shaping_info;
    if (o.mode == Mode::kBoth) report.mode = "disagg";
    if (!o.report_path.empty()) PDSIM_RETURN_IF_ERROR(metrics::write_report(o.report_path, report));
    if (!o.requests_path.empty())
        PDSIM_RETURN_IF_ERROR(metrics::write_requests_csv(o.requests_path, csv));
    if (journal != nullptr) journal->finish_normally();
    if (tlp != nullptr) PDSIM_RETURN_IF_ERROR(tl.write(o.timeline_path));
    if (!o.quiet) {
        std::string s =
            fmt::format("pdsim testbed: {} ranks, {} requests of {} (time scale {:.4g}), {}\n",
                        cfg.topology.num_ranks(), cfg.requests.size(), cfg.workload_label,
                        o.time_scale, describe(o));
        s += metrics::summary_table(report);
        if (dis != nullptr) {
            s += fmt::format(
                "  transfer: {:.2f} MB, layer latency us p50/p90/p99 {:.0f}/{:.0f}/{:.0f}\n",
                static_cast<double>(report.transfer.bytes) / 1e6,
                report.transfer.layer_latency_us.p50, report.transfer.layer_latency_us.p90,
                report.transfer.layer_latency_us.p99);
            if (report.extra.contains("handoff_ms")) {
                const json& h = report.extra["handoff_ms"];
                s += fmt::format(
                    "  handoff (prefill end -> first token on decode) ms p50/p90/p99 "
                    "{:.1f}/{:.1f}/{:.1f}\n",
                    h.value("p50", 0.0), h.value("p90", 0.0), h.value("p99", 0.0));
            }
            if (report.extra.contains("kv_parity")) {
                const json& k = report.extra["kv_parity"];
                s += fmt::format("  KV digest parity (decode == prefill): {} checked, {} differ\n",
                                 k.value("checked", int64_t{0}),
                                 k.contains("mismatched") ? k["mismatched"].size() : size_t{0});
            }
            // A hybrid model's cache groups on each decode instance leader: what its requests
            // held at most of each pool (the sliding layers' rings against the full layers).
            for (const json& rank : report.extra.value("ranks", json::array())) {
                const json pools = rank.value("stats", json::object()).value("kv_pools", json());
                if (rank.value("role", "") != "decode" || rank.value("tp_rank", 0) != 0 ||
                    !pools.is_object() || !pools.contains("sliding")) {
                    continue;
                }
                std::string line;
                for (const char* group : {"full", "sliding", "states"}) {
                    if (!pools.contains(group)) continue;
                    line += fmt::format("{}{} {} of {}", line.empty() ? "" : ", ", group,
                                        pools[group].value("peak_pages", int64_t{0}),
                                        pools[group].value("pages", int64_t{0}));
                }
                s += fmt::format("  KV pools of decode rank {}, pages held at most: {}\n",
                                 rank.value("rank", -1), line);
            }
        }
        for (const auto& [path, what] :
             {std::pair{o.report_path, "report"}, std::pair{o.timeline_path, "timeline"},
              std::pair{o.requests_path, "requests"}}) {
            if (!path.empty()) s += fmt::format("  wrote {} {}\n", what, path);
        }
        std::fputs(s.c_str(), stdout);
        std::fflush(stdout);
    }
    // Outcome.
    int64_t failed = 0, violations = 0;
    for (auto& pd : phases) {
        failed += pd.report.requests_failed;
        violations += pd.report.ordering.violations;
    }
    std::vector<std::string> why;
    if (violations > 0) why.push_back(fmt::format("{} ordering violations", violations));
    if (failed > 0) why.push_back(fmt::format("{} failed requests", failed));
    if (report.outputs_match && !*report.outputs_match)
        why.push_back("disaggregated outputs differ from colocated");
    if (why.empty()) return {};
    std::string msg;
    for (const auto& w : why) msg += (msg.empty() ? "" : ", ") + w;
    return Status(
        StatusCode::kDataLoss,
        "testbed: " + msg + (o.report_path.empty() ? "" : " (see " + o.report_path + ")"));
}

int exit_code_of(const Status& st) {
    if (st.ok()) return 0;
    return st.code() == StatusCode::kInvalidArgument || st.code() == StatusCode::kNotFound ? 2 : 1;
}

constexpr std::string_view kOutcomePrefix = "outcome from rank 0: ";

Status status_for_code(int code, const std::string& msg) {
    if (code == 0) return {};
    return Status(code == 2 ? StatusCode::kInvalidArgument : StatusCode::kDataLoss,
                  std::string(kOutcomePrefix) + msg);
}

Status run_rank_impl(Shared& sh, int rank, std::unique_ptr<Mailbox> mbox, model::TpComm* tp);

// A peer is dead or hung (it missed a barrier, a collection, the outcome): under mpirun the job
// must end with MPI_Abort, since MPI_Finalize would wait for that peer.
bool peer_lost(const Status& st) {
    return st.code() == StatusCode::kDeadlineExceeded || st.code() == StatusCode::kUnavailable;
}

Status run_rank(Shared& sh, int rank, std::unique_ptr<Mailbox> mbox, model::TpComm* tp) {
    try {
        return run_rank_impl(sh, rank, std::move(mbox), tp);
    } catch (const std::exception& e) {
        // Rank 0 prints the run's outcome; another rank's own failure would otherwise go unseen.
        if (rank != 0) PDSIM_LOG_ERROR("rank {}: {}", rank, e.what());
        return PDSIM_ERROR(StatusCode::kInternal, "rank {}: {}", rank, e.what());
    }
}

Status run_rank_impl(Shared& sh, int rank, std::unique_ptr<Mailbox> mbox, model::TpComm* tp) {
    const ResolvedConfig& cfg = *sh.cfg;
    const TestbedOptions& o = cfg.options;
    const topo::RankMap map = cfg.topology.rank_map();
    RankContext ctx;
    ctx.rank = rank;
    ctx.world = mbox->size();
    ctx.config = &cfg;
    ctx.info = map.at(rank);
    const auto& inst = cfg.topology.instances[static_cast<size_t>(ctx.info.instance)];
    for (int i = 0; i < inst.tp; ++i)
        ctx.instance_ranks.push_back(map.first_rank(ctx.info.instance) + i);
    ctx.mbox = mbox.get();
    std::atomic<uint64_t> progress{0};
    ctx.progress = &progress;
    ctx.tp = inst.tp > 1 ? tp : nullptr;
    const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    ctx.threads = o.threads > 0 ? o.threads : std::max(1, hw / std::max(1, sh.local_ranks));
    const int max_tokens = std::max(o.max_batch_tokens, o.max_decode_batch);
    // The rank's model for every phase: the CPU model, or the GPU rank's stream and GPU model
    // (the GpuRank outlives every phase's server, which borrows its stream).
    std::unique_ptr<model::SyntheticModel> cpu_model;
    std::unique_ptr<model::DeviceTpComm> device_tp;  // --tp-exchange nccl; outlives `gpu`
    std::unique_ptr<GpuRank> gpu;
    std::vector<double> offsets(static_cast<size_t>(ctx.world), 0.0);
    const double t_origin = now_us();
    std::vector<PhaseData> phases;
    Status st = [&]() -> Status {
        if (cfg.gpu_ranks()) {
            const RankGpu* g = cfg.gpu_of(rank);
            if (g == nullptr) {
                return PDSIM_ERROR(StatusCode::kInternal, "rank {}: no GPU chosen for it", rank);
            }
            GpuRankOptions go;
            go.model = cfg.gpu_model;
            go.model.device = g->choice.device;
            go.stream_name = fmt::format("compute-r{}-cuda{}", rank, g->choice.device);
            go.tp = ctx.tp;
            if (ctx.tp != nullptr && o.tp_exchange == kTpExchangeNccl) {
                // Collective over the instance's TP group (rank 0's NCCL id travels through it),
                // so outside the one-at-a-time set-up lock below: every rank of the instance
                // must get here. Its watchdog aborts a gather pending past the request timeout.
                PDSIM_ASSIGN_OR_RETURN(
                    device_tp, transfer::make_nccl_tp_comm(
                                   *ctx.tp, {.device = g->choice.device,
                                             .connect_timeout = milliseconds(60'000),
                                             .op_timeout = milliseconds(
                                                 static_cast<int64_t>(o.request_timeout_s * 1000)),
                                             .name = fmt::format("pdsim-tp-{}", inst.id)}));
                PDSIM_LOG_INFO(
                    "rank {}: TP rank {} of {} of instance {}: NCCL TP exchange on cuda:{}", rank,
                    ctx.info.tp_rank, inst.tp, inst.id, g->choice.device);
            }
            go.device_tp = device_tp.get();
            go.decode_graphs = o.decode_graphs;
            go.graph_buckets = gpu_decode_buckets(o.max_decode_batch);
            go.sync_timeout = milliseconds(static_cast<int64_t>(o.request_timeout_s * 1000) + 5000);
            {
                std::lock_guard<std::mutex> one_at_a_time(gpu_setup_mutex());
                PDSIM_ASSIGN_OR_RETURN(gpu, GpuRank::create(cfg.model, go));
            }
            PDSIM_LOG_INFO("rank {}: GPU cuda:{} ({}; {})", rank, g->choice.device,
                           gpu->info().name, g->choice.how);
            ctx.gpu = gpu.get();
            ctx.model = &gpu->model();
        } else {
            PDSIM_ASSIGN_OR_RETURN(cpu_model,
                                   model::SyntheticModel::create(cfg.model, ctx.tp, max_tokens));
            ctx.cpu_model = cpu_model.get();
            ctx.model = cpu_model.get();
        }
        PDSIM_RETURN_IF_ERROR(decide_shaping(sh, ctx));
        if (!sh.local) {
            PDSIM_ASSIGN_OR_RETURN(std::vector<double> off,
                                   estimate_offsets(*mbox, 8, milliseconds(60'000)));
            if (rank == 0) offsets = off;
        }
        return run_phases(sh, ctx, offsets, &phases);
    }();
    if (!st.ok() && rank != 0) PDSIM_LOG_ERROR("rank {}: {}", rank, st.to_string());
    // Rank 0 decides; everyone returns the same outcome.
    if (rank == 0) {
        if (st.ok()) {
            st = finish(cfg, phases, offsets, t_origin, sh.shaping_info, sh.journal);
        } else if (sh.journal != nullptr) {
            // The run stopped early: the report of what finished, and what was lost.
            StatusOr<std::string> counts = sh.journal->write_partial(st.to_string());
            if (counts.ok()) {
                PDSIM_LOG_ERROR("the run stopped early; {}: {}",
                                o.report_path.empty() ? std::string("no --report given")
                                                      : "wrote " + o.report_path,
                                *counts);
            } else {
                PDSIM_LOG_ERROR("the run stopped early, and its partial report failed: {}",
                                counts.status().to_string());
            }
        }
        const int code = exit_code_of(st);
        if (!st.ok()) {
            // Print before releasing the other ranks: once one exits non-zero, mpirun kills us.
            std::fprintf(stderr, "pdsim: error: %s\n", st.to_string().c_str());
            std::fflush(stderr);
            sh.error_printed = true;
        }
        for (int r = 1; r < ctx.world; ++r) {
            mbox->send(r, Channel::kCollect,
                       encode_message(ExitMsg{
                           .code = code, .message = st.message(), .peer_lost = peer_lost(st)}))
                .ignore_error();
        }
        if (auto* m = dynamic_cast<MpiMailbox*>(mbox.get())) {
            // A dead peer's messages never drain: a short wait for the live ones only.
            m->drain(milliseconds(peer_lost(st) ? 1000 : 5000));
        }
        return st;
    }
    const auto wait = milliseconds(static_cast<int64_t>(o.request_timeout_s * 1000) * 2 + 120'000);
    auto m = mbox->recv_kind(Channel::kCollect, ExitMsg::kKind, wait);
    if (!m.ok()) return m.status();
    if (!m->has_value())
        return st.ok() ? Status(StatusCode::kDeadlineExceeded, "no outcome from rank 0") : st;
    PDSIM_ASSIGN_OR_RETURN(ExitMsg exit_msg, decode_message<ExitMsg>((*m)->body));
    if (exit_msg.peer_lost) {
        return Status(StatusCode::kUnavailable, std::string(kOutcomePrefix) + exit_msg.message);
    }
    return status_for_code(exit_msg.code, exit_msg.message);
}

// How long a TP collective may wait for its peers: the request timeout, plus slack.
milliseconds tp_timeout(const ResolvedConfig& cfg) {
    return milliseconds(static_cast<int64_t>(cfg.options.request_timeout_s * 1000) + 5000);
}

// One process per rank (launcher.world > 1). Every rank resolved the same options on its own;
// before any rank may exit they agree (one MPI_Allreduce) on whether all of them could read
// their input and whether mpirun's world fits the topology. When not, rank 0 prints the error,
// then all meet at a barrier and return it: once one rank exits non-zero mpirun kills the
// others, and a rank 0 still printing would lose its message.
Status run_mpi_ranks(const Launcher& launcher, StatusOr<ResolvedConfig> resolved, RunInfo* info) {
    const int local_ranks = std::max(1, launcher.local_size);
    if (resolved.ok()) {
        const ResolvedConfig& cfg = *resolved;
        // More ranks than cores on this host, free to run anywhere: the kernel places them
        // differently from run to run, and a TP rank that loses its core stalls its peers.
        const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
        if (launcher.local_rank == 0 && local_ranks > hw && !bound_to_some_cores(hw)) {
            PDSIM_LOG_WARN(
                "{} ranks on this host's {} cores and they are not bound: timings will vary from "
                "run to run; add `--map-by core --bind-to core:overload-allowed` to mpirun "
                "(docs/testbed.md, 'More ranks than cores')",
                local_ranks, hw);
        }
        if (std::getenv("PDSIM_NUM_THREADS") == nullptr) {
            const int per =
                cfg.options.threads > 0 ? cfg.options.threads : std::max(1, hw / local_ranks);
            ::setenv("PDSIM_NUM_THREADS", std::to_string(per).c_str(), 1);
        }
    }
    int initialized = 0;
    MPI_CHECK(MPI_Initialized(&initialized));
    int provided = 0;
    if (!initialized)
        MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    else
        MPI_CHECK(MPI_Query_thread(&provided));
    int world = 0, rank = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    info->rank = rank;

    Status st = resolved.status();
    if (st.ok() && provided < MPI_THREAD_MULTIPLE) {
        st = Status(StatusCode::kUnavailable,
                    "MPI does not provide MPI_THREAD_MULTIPLE (the testbed's TP "
                    "allgather runs on the compute stream's thread, or a GPU rank's "
                    "forward thread, beside the mailbox's)");
    } else if (st.ok() && world != resolved->topology.num_ranks()) {
        st = Status(StatusCode::kInvalidArgument,
                    fmt::format("mpirun -np {} but topology {} has {} ranks", world,
                                resolved->topology_label, resolved->topology.num_ranks()));
    }
    // Rank 0's journal (result_journal.h): its file is checked before the agreement.
    std::unique_ptr<ResultJournal> journal;
    if (st.ok() && rank == 0) {
        StatusOr<std::unique_ptr<ResultJournal>> j = ResultJournal::open(*resolved);
        if (j.ok()) {
            journal = std::move(*j);
            start_report_keeper(*journal);
            st = journal->arm_signals();
        } else {
            st = j.status();
        }
    } else if (st.ok() && !resolved->options.report_path.empty() &&
               resolved->options.heartbeat_timeout_s > 0) {
        // The stand-in that writes the report when rank 0 itself was killed (result_journal.h).
        journal = ResultJournal::standby(*resolved, rank, rank0_died);
        st = journal->arm_signals();
    }
    // The agreement: the lowest rank whose set-up failed (world if none).
    const int mine = st.ok() ? world : rank;
    int first_failed = world;
    MPI_Allreduce(&mine, &first_failed, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (first_failed < world) {
        // Rank 0's message stands for all when it failed too (the same options, read the same
        // way); else the ranks that failed print theirs.
        if (!st.ok() && rank != 0 && first_failed != 0)
            PDSIM_LOG_ERROR("rank {}: {}", rank, st.to_string());
        if (st.ok()) {
            // This rank read its input but another could not (a file missing on its host...).
            st =
                Status(StatusCode::kInvalidArgument,
                       fmt::format("rank {} could not set up (it logged its error)", first_failed));
        }
        if (rank == 0) {
            std::fprintf(stderr, "pdsim: error: %s\n", st.to_string().c_str());
            std::fflush(stderr);
            info->error_printed = true;
        }
        MPI_Barrier(MPI_COMM_WORLD);
        MPI_Finalize();
        return st;
    }

    // Every rank's process (pid and host), gathered: a rank on rank 0's host can then tell rank
    // 0's death (rank0_died()), and rank 0 the death of the ranks on its own host when mpirun
    // stops it (rank_processes_gone()).
    {
        const int pid = static_cast<int>(::getpid());
        std::array<char, kHostBytes> host{};
        const std::string name = this_host();
        std::copy_n(name.begin(), std::min(name.size(), host.size() - 1), host.begin());
        std::vector<int> pids(static_cast<size_t>(world));
        std::vector<char> hosts(static_cast<size_t>(world) * kHostBytes);
        MPI_CHECK(MPI_Allgather(&pid, 1, MPI_INT, pids.data(), 1, MPI_INT, MPI_COMM_WORLD));
        MPI_CHECK(MPI_Allgather(host.data(), kHostBytes, MPI_CHAR, hosts.data(), kHostBytes,
                                MPI_CHAR, MPI_COMM_WORLD));
        std::lock_guard<std::mutex> lock(g_rank0_mu);
        g_rank_pids = pids;
        g_rank_hosts.clear();
        for (int r = 0; r < world; ++r) {
            g_rank_hosts.emplace_back(hosts.data() + static_cast<size_t>(r) * kHostBytes);
        }
        g_rank0_host = g_rank_hosts[0];
        g_rank0_pid = pids[0];
    }
    if (rank == 0) {
        journal->set_signal_probe([] {
            return ResultJournal::SignalFindings{.gone_ranks = rank_processes_gone(),
                                                 .self_stalled_s = rank0_stalled_s()};
        });
    }

    ResolvedConfig& cfg = *resolved;
    Shared sh;
    sh.cfg = &cfg;
    sh.journal = rank == 0 ? journal.get() : nullptr;  // a follower's stand-in is not used
    sh.local = false;
    sh.local_ranks = local_ranks;
    {
        auto mbox = MpiMailbox::create();
        const topo::RankInfo ri = cfg.topology.rank_map().at(rank);
        auto tp = MpiTpComm::create(ri.instance, ri.tp_rank, tp_timeout(cfg));
        if (!mbox.ok()) {
            st = mbox.status();
        } else if (!tp.ok()) {
            st = tp.status();
        } else {
            st = run_rank(sh, rank, std::move(*mbox), tp->get());
        }
    }
    info->error_printed = sh.error_printed;
    if (peer_lost(st)) {
        // A peer is dead or hung (it missed a barrier, a collection, the outcome): MPI_Finalize
        // would wait for it forever. The report is written (rank 0) and the error printed; end the
        // job here.
        PDSIM_LOG_ERROR("rank {}: ending the job (MPI_Abort): a peer did not answer", rank);
        std::fflush(stdout);
        std::fflush(stderr);
        // Under mpirun --enable-recovery MPI_Abort only tells the daemon and then waits to be
        // killed, which recovery never does: this rank would sleep forever and mpirun with it.
        const int code = exit_code_of(st);
        std::thread([code] {
            std::this_thread::sleep_for(std::chrono::seconds(3));
            std::_Exit(code);
        }).detach();
        MPI_Abort(MPI_COMM_WORLD, code);
    }
    MPI_Finalize();
    return st;
}

}  // namespace

Status run_testbed(const TestbedOptions& options, RunInfo* info) {
    const Launcher launcher = detect_launcher();
    info->rank = launcher.rank;
    if (launcher.rank != 0) spdlog::set_level(spdlog::level::warn);
    StatusOr<ResolvedConfig> resolved =
        resolve(options, ResolveEnv{.world_size = launcher.world,
                                    .rank = launcher.rank,
                                    .local_rank = launcher.local_rank,
                                    .local_size = launcher.local_size});
    if (launcher.world > 1) return run_mpi_ranks(launcher, std::move(resolved), info);

    // Every rank a thread of this process.
    PDSIM_RETURN_IF_ERROR(resolved.status());
    ResolvedConfig& cfg = *resolved;
    PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<ResultJournal> journal, ResultJournal::open(cfg));
    start_report_keeper(*journal);
    PDSIM_RETURN_IF_ERROR(journal->arm_signals());
    Shared sh;
    sh.cfg = &cfg;
    sh.journal = journal.get();
    const int ranks = cfg.topology.num_ranks();
    sh.local = true;
    const topo::RankMap map = cfg.topology.rank_map();
    sh.local_ranks = ranks;
    sh.hub = std::make_unique<LocalHub>(ranks);
    for (const auto& inst : cfg.topology.instances) {
        sh.tp.push_back(std::make_unique<LocalTpGroup>(inst.tp, tp_timeout(cfg)));
    }
    sh.kv_world = transfer::make_local_world(ranks);
    sh.data_world = transfer::make_local_world(ranks);
    std::vector<Status> st(static_cast<size_t>(ranks));
    std::vector<std::thread> threads;
    for (int r = ranks - 1; r >= 0; --r) {
        auto body = [&, r] {
            const auto& ri = map.at(r);
            st[static_cast<size_t>(r)] =
                run_rank(sh, r, sh.hub->mailbox(r),
                         sh.tp[static_cast<size_t>(ri.instance)]->member(ri.tp_rank));
        };
        if (r == 0) {
            body();
        } else {
            threads.emplace_back(body);
        }
    }
    for (auto& t : threads) t.join();
    info->error_printed = sh.error_printed;
    return st[0];
}

}  // namespace pdsim::testbed

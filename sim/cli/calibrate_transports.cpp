// The KV transport measurements of `pdsim calibrate` (sim/cli/calibrate_cmd.cpp's comment,
// "Transports"): KV-sized messages, timed, fitted as time = latency + bytes / bandwidth.
#include <fmt/format.h>
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "common/mpi_check.h"
#include "common/stats.h"
#include "sim/cli/calibrate.h"
#include "sim/cost/calibrated.h"
#include "transfer/local/local_transport.h"
#include "transfer/tcp/tcp_transport.h"
#include "transfer/transport.h"

namespace pdsim::cli::calibration {

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

StatusOr<json> link_fit(const std::vector<size_t>& sizes, const std::vector<double>& secs) {
    std::vector<std::vector<double>> x;
    json pts = json::array();
    for (size_t i = 0; i < sizes.size(); ++i) {
        x.push_back({1.0, static_cast<double>(sizes[i])});
        pts.push_back({{"bytes", sizes[i]}, {"s", secs[i]}});
    }
    PDSIM_ASSIGN_OR_RETURN(cost::LinearFit f, cost::fit_nonnegative(x, secs));
    // A zero slope (latency-bound at every size) would mean infinite bandwidth: take the
    // largest message's throughput instead.
    const double gbps = f.coef[1] > 0 ? 1.0 / f.coef[1] / 1e9
                                      : static_cast<double>(sizes.back()) / secs.back() / 1e9;
    return json{{"gbps", gbps},
                {"latency_us", f.coef[0] * 1e6},
                {"r2", f.r2},
                {"max_rel_err", f.max_rel_err},
                {"points", pts}};
}

constexpr auto kWait = std::chrono::seconds(60);

}  // namespace

std::vector<size_t> message_sizes(const CalibrateOptions& o, const model::ModelConfig& m) {
    // One layer's K buffer for a run of pages (fp32 pool, TP 1), as the KV sender moves it.
    const size_t page = static_cast<size_t>(o.page_size) * m.num_kv_heads * m.head_dim * 4;
    std::vector<size_t> out;
    for (size_t pages :
         o.quick ? std::vector<size_t>{1, 16, 64} : std::vector<size_t>{1, 4, 16, 64, 256}) {
        out.push_back(page * pages);
    }
    return out;
}

int message_reps(const CalibrateOptions& o) {
    return o.quick ? 10 : 30;
}

bool measured_in_process(const std::string& name) {
    StatusOr<transfer::TransportDescriptor> found = transfer::find_transport(name);
    return !found.ok() || found->caps.setup != transfer::TransportSetup::kLauncher;
}

StatusOr<json> measure_in_process(const std::string& name, const std::vector<size_t>& sizes,
                                  int reps) {
    transfer::TransportOptions to;
    to.world_size = 2;
    to.connect_timeout = std::chrono::seconds(20);
    std::string dir;
    PDSIM_ASSIGN_OR_RETURN(const transfer::TransportDescriptor descriptor,
                           transfer::find_transport(name));
    if (descriptor.caps.setup == transfer::TransportSetup::kSharedWorld) {
        to.set(transfer::LocalOptions{.world = transfer::make_local_world(2)});
    } else {
        dir = (std::filesystem::temp_directory_path() /
               fmt::format("pdsim-calibrate-{}-{}", ::getpid(), name))
                  .string();
        std::error_code ec;
        std::filesystem::remove_all(dir, ec);
        to.set(transfer::TcpOptions{.bootstrap_dir = dir});
    }
    StatusOr<std::unique_ptr<transfer::Transport>> made[2] = {Status(StatusCode::kInternal, ""),
                                                              Status(StatusCode::kInternal, "")};
    std::thread other([&] {
        transfer::TransportOptions o1 = to;
        o1.rank = 1;
        made[1] = transfer::create_transport(name, o1);
    });
    made[0] = transfer::create_transport(name, to);
    other.join();
    auto cleanup = [&] {
        std::error_code ec;
        if (!dir.empty()) std::filesystem::remove_all(dir, ec);
    };
    for (auto& t : made) {
        if (!t.ok()) {
            cleanup();
            return t.status().with_context("calibrate transport " + name);
        }
    }
    transfer::Transport& tx = **made[0];
    transfer::Transport& rx = **made[1];
    std::vector<double> secs;
    Status st;
    for (size_t bytes : sizes) {
        std::vector<uint8_t> src(bytes, 0x5a), dst(bytes);
        std::vector<double> v;
        for (int i = 0; i < reps + 3 && st.ok(); ++i) {
            auto r = rx.post_recv(0, 1, dst.data(), bytes);
            if (!r.ok()) {
                st = r.status();
                break;
            }
            const auto t0 = Clock::now();
            auto s = tx.post_send(1, 1, src.data(), bytes);
            if (!s.ok()) {
                st = s.status();
                break;
            }
            st = rx.wait(*r, kWait);
            const double el = std::chrono::duration<double>(Clock::now() - t0).count();
            if (st.ok()) st = tx.wait(*s, kWait);
            if (i >= 3) v.push_back(el);
        }
        if (!st.ok()) break;
        secs.push_back(stats::median(v));
    }
    tx.close();
    rx.close();
    cleanup();
    PDSIM_RETURN_IF_ERROR(st.with_context("calibrate transport " + name));
    return link_fit(sizes, secs);
}

Launcher detect_launcher() {
    Launcher l;
    auto env_int = [](const char* n) {
        const char* v = std::getenv(n);
        return v != nullptr && *v != '\0' ? std::atoi(v) : -1;
    };
    if (env_int("OMPI_COMM_WORLD_SIZE") > 0) {
        l = {true, env_int("OMPI_COMM_WORLD_SIZE"), std::max(0, env_int("OMPI_COMM_WORLD_RANK"))};
    } else if (env_int("PMI_SIZE") > 0) {
        l = {true, env_int("PMI_SIZE"), std::max(0, env_int("PMI_RANK"))};
    }
    return l;
}

// Both ranks of `mpirun -np 2`: rank 0 ping-pongs each size with rank 1. Returns the fit on rank
// 0, null on rank 1.
StatusOr<json> measure_mpi(const std::vector<size_t>& sizes, int reps) {
    int initialized = 0;
    MPI_CHECK(MPI_Initialized(&initialized));
    if (!initialized) {
        int provided = 0;
        MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    }
    int rank = 0;
    MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
    std::vector<double> secs;
    Status st;
    {
        auto t = transfer::create_transport("mpi", transfer::TransportOptions{});
        if (!t.ok()) {
            st = t.status();
        } else {
            transfer::Transport& tr = **t;
            const int peer = 1 - rank;
            for (size_t bytes : sizes) {
                std::vector<uint8_t> src(bytes, 0x5a), dst(bytes);
                std::vector<double> v;
                for (int i = 0; i < reps + 3 && st.ok(); ++i) {
                    const auto t0 = Clock::now();
                    if (rank == 0) {
                        auto r = tr.post_recv(peer, 1, dst.data(), bytes);
                        auto s = tr.post_send(peer, 1, src.data(), bytes);
                        st = !s.ok() ? s.status() : tr.wait(*s, kWait);
                        if (st.ok()) st = !r.ok() ? r.status() : tr.wait(*r, kWait);
                    } else {
                        auto r = tr.post_recv(peer, 1, dst.data(), bytes);
                        st = !r.ok() ? r.status() : tr.wait(*r, kWait);
                        if (st.ok()) {
                            auto s = tr.post_send(peer, 1, src.data(), bytes);
                            st = !s.ok() ? s.status() : tr.wait(*s, kWait);
                        }
                    }
                    const double el = std::chrono::duration<double>(Clock::now() - t0).count();
                    if (i >= 3) v.push_back(el / 2);
                }
                if (!st.ok()) break;
                secs.push_back(stats::median(v));
            }
            MPI_Barrier(MPI_COMM_WORLD);
            tr.close();
        }
    }
    MPI_Finalize();
    PDSIM_RETURN_IF_ERROR(st.with_context("calibrate transport mpi"));
    if (rank != 0) return json();
    return link_fit(sizes, secs);
}

}  // namespace pdsim::cli::calibration

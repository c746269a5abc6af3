// The layerwise KV transfer engine in-process: threads as ranks over the `local` transport (and
// `tcp` for a subset), each rank with a real CpuStream + StepCounter + KV pool. A prefill
// "compute" writes KV layer by layer on its stream and records the step; every byte that lands on
// the decode side is compared with what the prefill side wrote (fill_kv) and with the prefill
// pages themselves.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <optional>
#include <random>
#include <thread>

#include "tests/host_backed_cuda_runtime.h"
#include "tests/status_matchers.h"
#include "tests/transfer_engine_harness.h"
#include "transfer/engine/control.h"
#include "transfer/engine/data_plane.h"
#include "transfer/fault/fault_transport.h"
#include "transfer/local/local_transport.h"
#include "transfer/tcp/tcp_transport.h"

namespace pdsim::transfer::testing {
namespace {

// ---------------------------------------------------------------------------------------------
// Building blocks

TEST(KvLayoutTest, HeadSliceConvention) {
    EXPECT_EQ(*kv_head_slice(8, 2, 1), (HeadSlice{.begin = 4, .count = 4}));
    EXPECT_EQ(*kv_head_slice(8, 1, 0), (HeadSlice{.begin = 0, .count = 8}));
    EXPECT_EQ(*kv_head_slice(2, 8, 5),
              (HeadSlice{.begin = 1, .count = 1}));  // replicated: ranks 4..7 hold head 1
    EXPECT_FALSE(kv_head_slice(6, 4, 0).ok());
    EXPECT_FALSE(kv_head_slice(4, 2, 2).ok());
}

KvLayoutSummary mha(int tp, int rank, int heads, int ps, size_t head_bytes = 32) {
    KvLayoutSummary s;
    s.kind = KvKind::kMHA;
    s.num_layers = 2;
    s.buffer_count = 2;
    s.page_size = ps;
    s.dtype_bytes = 4;
    s.tp_size = tp;
    s.tp_rank = rank;
    s.total_kv_heads = heads;
    auto slice = *kv_head_slice(heads, tp, rank);
    s.head_begin = slice.begin;
    s.local_heads = slice.count;
    s.head_bytes = {head_bytes, head_bytes};
    return s;
}

TEST(TransferPlanTest, FragmentsBetweenTpSizes) {
    // Prefill TP2 -> decode TP1: each prefill rank sends its half, decode scatters.
    auto f0 = make_fragment(mha(2, 0, 8, 16), mha(1, 0, 8, 16));
    auto f1 = make_fragment(mha(2, 1, 8, 16), mha(1, 0, 8, 16));
    ASSERT_TRUE(f0 && f1);
    EXPECT_EQ(f0->head_begin, 0);
    EXPECT_EQ(f1->head_begin, 4);
    EXPECT_EQ(f1->head_count, 4);
    EXPECT_TRUE(f1->src_contiguous[0]);
    EXPECT_FALSE(f1->dst_contiguous[0]);
    EXPECT_EQ(f1->dst_offset[0], 4u * 32);
    // Prefill TP1 -> decode TP2: the prefill rank gathers each decode rank's half.
    auto g1 = make_fragment(mha(1, 0, 8, 16), mha(2, 1, 8, 16));
    ASSERT_TRUE(g1);
    EXPECT_EQ(g1->head_begin, 4);
    EXPECT_FALSE(g1->src_contiguous[1]);
    EXPECT_TRUE(g1->dst_contiguous[1]);
    EXPECT_EQ(g1->src_offset[1], 4u * 32);
    // Replicated prefill heads (TP4, 2 heads) -> decode TP1: ranks 0 and 2 serve decode rank 0.
    EXPECT_TRUE(make_fragment(mha(4, 0, 2, 16), mha(1, 0, 2, 16)));
    EXPECT_FALSE(make_fragment(mha(4, 1, 2, 16), mha(1, 0, 2, 16)));
    EXPECT_TRUE(make_fragment(mha(4, 2, 2, 16), mha(1, 0, 2, 16)));
    // ... and decode TP2 rank 1 (head 1) is served by prefill rank 3 (its replica index 1).
    EXPECT_TRUE(make_fragment(mha(4, 3, 2, 16), mha(2, 1, 2, 16)));
    EXPECT_FALSE(make_fragment(mha(4, 2, 2, 16), mha(2, 1, 2, 16)));
}

TEST(TransferPlanTest, RunsAreContiguousOnBothSides) {
    // Prefill pages of 4 tokens, decode pages of 8 tokens.
    std::vector<int32_t> src = {1, 2, 3, 7, 8};  // 1-2-3 contiguous, then a jump
    std::vector<int32_t> dst = {5, 6, 9};        // 5-6 contiguous, then a jump
    auto runs = make_runs(src, 4, 0, dst, 8, 0, 20, 1000);
    // Tokens 0..11 are contiguous on both sides (src 4..15, dst 40..51); token 12 jumps on the
    // src side (page 7), token 16 jumps on the dst side (page 9).
    ASSERT_EQ(runs.size(), 3u);
    EXPECT_EQ(runs[0].token_begin, 0);
    EXPECT_EQ(runs[0].count, 12);
    EXPECT_EQ(runs[0].src_slot, 4);
    EXPECT_EQ(runs[0].dst_slot, 40);
    EXPECT_EQ(runs[1].token_begin, 12);
    EXPECT_EQ(runs[1].count, 4);
    EXPECT_EQ(runs[1].src_slot, 28);
    EXPECT_EQ(runs[2].token_begin, 16);
    EXPECT_EQ(runs[2].src_slot, 32);
    EXPECT_EQ(runs[2].dst_slot, 72);
    // The same runs from a chunk's page slice (the receiver's view).
    std::vector<int32_t> slice(src.begin() + 3, src.end());
    auto tail = make_runs(slice, 4, 3, dst, 8, 12, 20, 1000);
    ASSERT_EQ(tail.size(), 2u);
    EXPECT_EQ(tail[0].src_slot, 28);
    EXPECT_EQ(tail[1].dst_slot, 72);
    // Message cap.
    auto capped = make_runs(src, 4, 0, dst, 8, 0, 12, 5);
    ASSERT_EQ(capped.size(), 3u);
    EXPECT_EQ(capped[2].count, 2);
    // Middle chunks send only full prefill pages.
    EXPECT_EQ(sendable_end(37, 16, false), 32);
    EXPECT_EQ(sendable_end(37, 16, true), 37);
}

TEST(ControlWireTest, RoundTrips) {
    BootstrapMsg b;
    b.request_id = 77;
    b.decode_rank = 3;
    b.decode_tp_rank = 1;
    b.decode_tp_size = 2;
    b.data_tag = 99;
    b.num_tokens = 1234;
    b.max_message_bytes = 1 << 20;
    b.layout = mha(2, 1, 8, 64);
    b.dst_pages = {4, 5, 6};
    auto b2 = decode_bootstrap(encode(b));
    ASSERT_OK(b2);
    EXPECT_EQ(b2->layout, b.layout);
    EXPECT_EQ(b2->dst_pages, b.dst_pages);
    EXPECT_EQ(b2->data_tag, 99u);
    ChunkMsg c{5, 2, 32, 64, false, 2, {9, 10}};
    auto c2 = decode_chunk(encode(c));
    ASSERT_OK(c2);
    EXPECT_EQ(c2->src_pages, c.src_pages);
    EXPECT_EQ(c2->token_end, 64);
    CompletionMsg m;
    m.request_id = 5;
    m.num_layers = 2;
    m.buffer_count = 2;
    m.head_count = 3;
    m.has_checksums = true;
    m.checksums.assign(12, 42);
    Bytes enc = encode(m);
    EXPECT_LE(enc.size(), completion_capacity(2, 2, 3));
    EXPECT_OK(decode_completion(enc));
    // Truncated and garbled messages are kDataLoss, never a crash.
    Bytes cut(enc.begin(), enc.begin() + 20);
    EXPECT_EQ(decode_completion(cut).status().code(), StatusCode::kDataLoss);
    Bytes bad = encode(b);
    bad[0] ^= 0xff;
    EXPECT_EQ(peek_type(bad).status().code(), StatusCode::kDataLoss);
}

TEST(ChecksumTest, IndependentOfLayoutAndSplit) {
    // The same logical KV in pools with different page sizes and TP splits sums identically.
    ModelSpec m;
    m.kv_heads = 4;
    KvLayout a_layout;
    KvLayout b_layout;
    KvLayout c_layout;
    auto a = make_pool(m, InstanceSpec{.tp = 1, .page_size = 16, .num_pages = 16}, 0, &a_layout);
    auto b = make_pool(m, InstanceSpec{.tp = 1, .page_size = 64, .num_pages = 8}, 0, &b_layout);
    auto c = make_pool(m, InstanceSpec{.tp = 2, .page_size = 4, .num_pages = 64}, 1,
                       &c_layout);  // heads 2..3
    std::vector<int32_t> pa = {3, 1, 2, 7, 9};
    std::vector<int32_t> pb = {5, 2};
    std::vector<int32_t> pc;
    for (int i = 0; i < 20; ++i) pc.push_back(40 - i);
    const int64_t n = 70;
    for (int l = 0; l < m.layers; ++l) {
        write_layer(a_layout, pa, 9, 1, l, 0, n, 0);
        write_layer(b_layout, pb, 9, 1, l, 0, n, 0);
        write_layer(c_layout, pc, 9, 1, l, 0, n, 0);
    }
    for (int buf = 0; buf < 2; ++buf) {
        auto sa = kv_checksums(a_layout, pa, 2, buf, 0, n, 0, 4);
        auto sb = kv_checksums(b_layout, pb, 2, buf, 0, n, 0, 4);
        auto sc = kv_checksums(c_layout, pc, 2, buf, 0, n, 2, 2);
        EXPECT_EQ(sa, sb);
        EXPECT_EQ(sa[2], sc[0]);
        EXPECT_EQ(sa[3], sc[1]);
        // Split sums add up.
        auto s1 = kv_checksums(a_layout, pa, 2, buf, 0, 33, 0, 4);
        auto s2 = kv_checksums(a_layout, pa, 2, buf, 33, n, 0, 4);
        EXPECT_EQ(s1[1] + s2[1], sa[1]);
    }
    // One flipped byte changes it.
    auto before = kv_checksums(a_layout, pa, 0, 0, 0, n, 0, 4);
    a_layout.slot_addr(0, 0, token_slot(pa, 16, 40))[5] ^= std::byte{1};
    auto after = kv_checksums(a_layout, pa, 0, 0, 0, n, 0, 4);
    EXPECT_NE(before[0], after[0]);
}

TEST(PagePinsTest, RefusesToFreePinnedPages) {
    OrderingValidator v(0);
    PagePins pins(0, &v);
    kv::PageAllocator alloc(16);
    auto pages = *alloc.alloc(4);
    pins.pin(7, pages);
    Status st = pins.free_pages(alloc, pages);
    EXPECT_THAT(st, StatusIs(StatusCode::kFailedPrecondition, HasSubstr("request 7")))
        << st.to_string();
    EXPECT_TRUE(alloc.is_allocated(pages[0]));  // nothing freed
    EXPECT_EQ(v.violation_count(), 1u);
    pins.unpin_request(7);
    EXPECT_OK(pins.free_pages(alloc, pages));
    EXPECT_EQ(pins.pinned_pages(), 0u);
}

// ---------------------------------------------------------------------------------------------
// In-process clusters

class TempDir {
public:
    TempDir() {
        std::string tmpl =
            (std::filesystem::temp_directory_path() / "pdsim-engine-XXXXXX").string();
        char* p = mkdtemp(tmpl.data());
        EXPECT_NE(p, nullptr);
        path_ = tmpl;
    }
    ~TempDir() {
        std::error_code ec;
        std::filesystem::remove_all(path_, ec);
    }
    [[nodiscard]] const std::string& path() const { return path_; }

private:
    std::string path_;
};

// How the ranks of a cluster talk: the control transport, and the data transport (a second world
// of `data` transports) or none (the control transport carries the data, two-sided).
struct EngineMode {
    std::string name;     // the test name's suffix
    std::string control;  // "local" | "tcp"
    std::string data;     // "": none; "local_writes": the one-sided write mode; "local": a
                          // separate two-sided data transport; "local_device(_writes)": the
                          // same, claiming device memory
    // Every pool on the host-backed fake CUDA device (the engines' device path: their gathers,
    // scatters and checksums through InProcessDeviceOps on a comm stream of the fake runtime).
    bool device = false;
    // Device gating (kv_sender.h): the prefill compute streams on the fake GPU too, and a
    // stream-ordered data transport (StreamOrderedFake), so the sender gates its comm stream on
    // the StepCounter and posts ahead of the records.
    bool gated = false;
    [[nodiscard]] bool writes() const { return data.ends_with("_writes"); }
    [[nodiscard]] bool ordered() const { return data.find("_ordered") != std::string::npos; }
};
const EngineMode kTwoSided{"two_sided", "local", ""};
const EngineMode kWrites{"writes", "local", "local_writes"};
const EngineMode kTcpTwoSided{"two_sided", "tcp", ""};
const EngineMode kTcpWrites{"writes", "tcp", "local_writes"};
const EngineMode kTcpControlLocalData{"split_two_sided", "tcp", "local"};
const EngineMode kDeviceTwoSided{"device_two_sided", "local", "local_device", true};
const EngineMode kDeviceWrites{"device_writes", "local", "local_device_writes", true};
const EngineMode kGatedTwoSided{"gated_two_sided", "local", "local_device_gated", true, true};
const EngineMode kGatedWrites{"gated_writes", "local", "local_device_gated_writes", true, true};
// The ordered data plane (data_plane.h): NCCL's untagged in-order matching, faked over local
// (OrderedMatchingFake), on host and device layouts, and with device gating.
const EngineMode kOrdered{"ordered", "local", "local_ordered"};
const EngineMode kTcpControlOrderedData{"split_ordered", "tcp", "local_ordered"};
const EngineMode kDeviceOrdered{"device_ordered", "local", "local_device_ordered", true};
const EngineMode kGatedOrdered{"gated_ordered", "local", "local_device_gated_ordered", true, true};

// The fake GPU of the device modes (tests/host_backed_cuda_runtime.h).
constexpr runtime::Device kFakeGpu{runtime::DeviceKind::kCuda, 0};

std::string mode_name(const ::testing::TestParamInfo<EngineMode>& info) {
    return info.param.name;
}
void PrintTo(const EngineMode& mode, std::ostream* os) {
    *os << mode.name << " (control " << mode.control << ", data "
        << (mode.data.empty() ? std::string("the control transport") : mode.data) << ")";
}

struct ClusterRun {
    TempDir dir;
    // The cluster the ranks were built for (device modes: on the fake GPU), and the device ops of
    // a device mode (the compute streams' and, unless the test gave others, the engines').
    ClusterSpec spec;
    std::unique_ptr<InProcessDeviceOps> device_ops;
    std::vector<std::unique_ptr<Transport>> transports;       // control
    std::vector<std::unique_ptr<Transport>> data_transports;  // empty: none
    // Declared after the transports: the engines go first.
    std::vector<std::unique_ptr<PrefillRank>> prefill;  // by world rank (null for decode ranks)
    std::vector<std::unique_ptr<DecodeRank>> decode;
    std::vector<RankResult> results;

    // A dead rank: its transports closed.
    void close_transports(int rank) {
        transports[static_cast<size_t>(rank)]->close();
        if (!data_transports.empty()) data_transports[static_cast<size_t>(rank)]->close();
    }

    // The engines stop first (they use the transports), then the transports close (an ordered
    // plane's announced sends outlive their sender's shutdown and read the prefill pool when
    // received: closing fails them), then the ranks free their pools (kv_sender.h, "Lifetime").
    ~ClusterRun() {
        for (auto& p : prefill) {
            if (p) p->shutdown_engine();
        }
        for (auto& d : decode) {
            if (d) d->shutdown_engine();
        }
        for (auto& t : transports) {
            if (t) t->close();
        }
        for (auto& t : data_transports) {
            if (t) t->close();
        }
        prefill.clear();
        decode.clear();
        transports.clear();
        data_transports.clear();
    }
};

// `fault_spec(rank)`: non-empty wraps that rank's transport in the fault decorator.
std::vector<std::unique_ptr<Transport>> make_transports(
    const std::string& name, int n, const std::string& dir,
    const std::function<std::string(int)>& fault_spec = nullptr) {
    std::vector<std::unique_ptr<Transport>> out(static_cast<size_t>(n));
    auto world = make_local_world(n);
    register_test_transports();
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
            TransportOptions o;
            o.rank = r;
            o.world_size = n;
            o.set(LocalOptions{.world = world});
            o.edit<TcpOptions>().bootstrap_dir = dir;
            o.connect_timeout = 20s;
            std::string spec = fault_spec ? fault_spec(r) : std::string();
            o.edit<FaultOptions>().spec = spec;
            o.edit<FaultOptions>().inner = name;
            auto t = create_transport(spec.empty() ? name : std::string("fault"), o);
            EXPECT_OK(t);
            if (t.ok()) out[static_cast<size_t>(r)] = std::move(t).value();
        });
    }
    for (auto& t : threads) t.join();
    return out;
}

// The control (and data) transports of `n` ranks for `mode`; `fault_spec` / `data_fault_spec`
// wrap a rank's control / data transport in the fault decorator.
struct ModeTransports {
    std::vector<std::unique_ptr<Transport>> control;
    std::vector<std::unique_ptr<Transport>> data;  // empty: the control transport carries data

    [[nodiscard]] Transport& at(int rank) const { return *control[static_cast<size_t>(rank)]; }
    [[nodiscard]] Transport* data_at(int rank) const {
        return data.empty() ? nullptr : data[static_cast<size_t>(rank)].get();
    }
    // `o` with rank `rank`'s data transport.
    template <typename Opts>
    Opts for_rank(Opts o, int rank) const {
        o.data_transport = data_at(rank);
        return o;
    }
};

ModeTransports make_mode_transports(
    const EngineMode& mode, int n, const std::string& dir,
    const std::function<std::string(int)>& fault_spec = nullptr,
    const std::function<std::string(int)>& data_fault_spec = nullptr) {
    ModeTransports t;
    t.control = make_transports(mode.control, n, dir, fault_spec);
    if (!mode.data.empty()) t.data = make_transports(mode.data, n, dir, data_fault_spec);
    return t;
}

// Builds the cluster, runs every rank on its own thread, returns with all engines alive. Device
// modes: every pool on the fake GPU, the compute streams' checksums through run->device_ops,
// and the engines' ops those too unless `so` / `ro` carry others.
std::unique_ptr<ClusterRun> start_cluster(
    const ClusterSpec& spec, const EngineMode& mode,
    SenderOptions so = test_options(SenderOptions{}),
    ReceiverOptions ro = test_options(ReceiverOptions{}),
    const std::function<std::string(int)>& fault_spec = nullptr,
    const std::function<std::string(int)>& data_fault_spec = nullptr) {
    auto run = std::make_unique<ClusterRun>();
    run->spec = spec;
    if (mode.device) {
        runtime::testing::install_host_backed_cuda_runtime();
        run->device_ops = std::make_unique<InProcessDeviceOps>();
        run->spec.device = DeviceSpec{.memory = kFakeGpu,
                                      .compute_ops = run->device_ops.get(),
                                      .compute_on_device = mode.gated};
        if (so.kv_memory_ops_for_testing == nullptr) {
            so.kv_memory_ops_for_testing = run->device_ops.get();
        }
        if (ro.kv_memory_ops_for_testing == nullptr) {
            ro.kv_memory_ops_for_testing = run->device_ops.get();
        }
    }
    const ClusterSpec& c = run->spec;
    const int n = c.world_size();
    ModeTransports ts = make_mode_transports(mode, n, run->dir.path(), fault_spec, data_fault_spec);
    run->transports = std::move(ts.control);
    run->data_transports = std::move(ts.data);
    run->prefill.resize(static_cast<size_t>(n));
    run->decode.resize(static_cast<size_t>(n));
    run->results.resize(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
        if (!run->transports[static_cast<size_t>(r)]) return run;
        if (!run->data_transports.empty() && !run->data_transports[static_cast<size_t>(r)]) {
            return run;
        }
        auto role = c.role_of(r);
        Transport& t = *run->transports[static_cast<size_t>(r)];
        Transport* data = run->data_transports.empty()
                              ? nullptr
                              : run->data_transports[static_cast<size_t>(r)].get();
        if (role.is_prefill) {
            SenderOptions o = so;
            o.data_transport = data;
            run->prefill[static_cast<size_t>(r)] =
                std::make_unique<PrefillRank>(t, c, role.instance, role.tp_rank, o);
        } else {
            ReceiverOptions o = ro;
            o.data_transport = data;
            run->decode[static_cast<size_t>(r)] =
                std::make_unique<DecodeRank>(t, c, role.instance, role.tp_rank, o);
        }
        run->results[static_cast<size_t>(r)].rank = r;
    }
    return run;
}

void run_ranks(ClusterRun& run, const std::vector<RequestSpec>& reqs, const RunOptions& o) {
    std::vector<std::thread> threads;
    for (size_t r = 0; r < run.results.size(); ++r) {
        threads.emplace_back([&, r] {
            if (run.prefill[r]) run.prefill[r]->run(reqs, o, &run.results[r]);
            if (run.decode[r]) run.decode[r]->run(reqs, o, &run.results[r]);
        });
    }
    for (auto& t : threads) t.join();
}

// In-process only: every byte a decode rank holds equals the bytes at the matching slot of a
// prefill rank that holds that head.
void compare_with_prefill(ClusterRun& run, const ClusterSpec& c,
                          const std::vector<RequestSpec>& reqs) {
    for (size_t dr = 0; dr < run.decode.size(); ++dr) {
        DecodeRank* d = run.decode[dr].get();
        if (d == nullptr) continue;
        const auto drole = c.role_of(static_cast<int>(dr));
        const KvLayout& dl = d->layout();
        for (const RequestSpec& r : reqs) {
            if (r.decode_instance != drole.instance) continue;
            if (run.results[dr].statuses[r.id].state != RequestState::kSuccess) continue;
            size_t bad = 0;
            for (int h = dl.head_begin(); h < dl.head_begin() + dl.local_heads(); ++h) {
                // Any prefill rank of the instance that holds head h.
                PrefillRank* p = nullptr;
                for (int pr : c.prefill_ranks(r.prefill_instance)) {
                    PrefillRank* cand = run.prefill[static_cast<size_t>(pr)].get();
                    const KvLayout& pl = cand->layout();
                    if (h >= pl.head_begin() && h < pl.head_begin() + pl.local_heads()) {
                        p = cand;
                        break;
                    }
                }
                ASSERT_NE(p, nullptr);
                const KvLayout& pl = p->layout();
                for (int l = 0; l < dl.num_layers(); ++l) {
                    for (int b = 0; b < dl.buffer_count(); ++b) {
                        const size_t hb = dl.head_bytes(b);
                        for (int64_t t = 0; t < r.tokens; ++t) {
                            const std::byte* got =
                                dl.slot_addr(l, b, token_slot(d->pages(r.id), dl.page_size(), t)) +
                                static_cast<size_t>(h - dl.head_begin()) * hb;
                            const std::byte* want =
                                pl.slot_addr(l, b, token_slot(p->pages(r.id), pl.page_size(), t)) +
                                static_cast<size_t>(h - pl.head_begin()) * hb;
                            bad += std::memcmp(got, want, hb) != 0;
                        }
                    }
                }
            }
            EXPECT_EQ(bad, 0u) << "request " << r.id << " on decode rank " << dr;
        }
    }
}

struct Totals {
    uint64_t submitted = 0, completed = 0, failed = 0, violations = 0, checked = 0, bytes = 0;
};

Totals totals(const ClusterRun& run, bool prefill_side) {
    Totals t;
    for (const RankResult& r : run.results) {
        if (r.is_prefill != prefill_side) continue;
        t.submitted += r.stats.requests_submitted;
        t.completed += r.stats.requests_completed;
        t.failed += r.stats.requests_failed;
        t.violations += r.report.violations.size();
        t.checked += r.report.checked_layers;
        t.bytes += r.bytes_checked;
    }
    return t;
}

std::string all_violations(const ClusterRun& run) {
    OrderingReport merged;
    for (const RankResult& r : run.results) merged.merge(r.report);
    return merged.to_string(1000);
}

// A clean run: every request succeeded on every rank, all bytes match, no violations.
void expect_clean(ClusterRun& run, const ClusterSpec& c, const std::vector<RequestSpec>& reqs) {
    for (const RankResult& r : run.results) {
        for (const std::string& e : r.errors) ADD_FAILURE() << "rank " << r.rank << ": " << e;
        for (const auto& [id, st] : r.statuses) {
            EXPECT_EQ(st.state, RequestState::kSuccess)
                << "rank " << r.rank << " request " << id << ": " << st.reason;
        }
        EXPECT_EQ(r.stats.requests_completed, r.stats.requests_submitted) << "rank " << r.rank;
        EXPECT_TRUE(r.report.violations.empty())
            << "rank " << r.rank << ": " << r.report.to_string();
    }
    Totals d = totals(run, false);
    EXPECT_GT(d.checked, 0u);
    EXPECT_GT(d.bytes, 0u);
    compare_with_prefill(run, c, reqs);
    // The counters, in either data plane: a decode rank counts the bytes it holds (what verify()
    // walked) and one layer per (request, layer); what the prefill ranks sent is what landed.
    uint64_t sent = 0;
    uint64_t landed = 0;
    for (const RankResult& r : run.results) {
        if (r.is_prefill) {
            sent += r.stats.bytes;
            continue;
        }
        landed += r.stats.bytes;
        EXPECT_EQ(r.stats.bytes, r.bytes_checked) << "decode rank " << r.rank;
        EXPECT_EQ(r.stats.layers, r.statuses.size() * static_cast<uint64_t>(c.model.layers))
            << "decode rank " << r.rank;
        EXPECT_GE(r.stats.messages, r.stats.layers > 0 ? 1u : 0u) << "decode rank " << r.rank;
    }
    EXPECT_EQ(sent, landed);
}

ClusterSpec simple(int prefill_tp, int decode_tp, int p_ps = 16, int d_ps = 16, int pages = 512) {
    ClusterSpec c;
    c.prefill = {InstanceSpec{.tp = prefill_tp, .page_size = p_ps, .num_pages = pages}};
    c.decode = {InstanceSpec{.tp = decode_tp, .page_size = d_ps, .num_pages = pages}};
    return c;
}

// Pages every instance needs to hold all of `reqs` at once.
void size_pools(ClusterSpec& c, const std::vector<RequestSpec>& reqs) {
    for (size_t i = 0; i < c.prefill.size(); ++i) {
        int64_t need = 2;
        for (const auto& r : reqs) {
            if (r.prefill_instance == static_cast<int>(i)) {
                need += (r.tokens + c.prefill[i].page_size - 1) / c.prefill[i].page_size;
            }
        }
        c.prefill[i].num_pages = static_cast<int>(need);
    }
    for (size_t i = 0; i < c.decode.size(); ++i) {
        int64_t need = 2;
        for (const auto& r : reqs) {
            if (r.decode_instance == static_cast<int>(i)) {
                need += (r.tokens + c.decode[i].page_size - 1) / c.decode[i].page_size;
            }
        }
        c.decode[i].num_pages = static_cast<int>(need);
    }
}

// Runs `reqs` on cluster `c` in `mode` and expects a clean run.
void run_clean(ClusterSpec c, std::vector<RequestSpec> reqs, const EngineMode& mode,
               RunOptions o = RunOptions{}) {
    size_pools(c, reqs);
    auto run = start_cluster(c, mode);
    run_ranks(*run, reqs, o);
    expect_clean(*run, c, reqs);
    Totals p = totals(*run, true);
    Totals d = totals(*run, false);
    EXPECT_EQ(p.completed, p.submitted);
    EXPECT_EQ(d.completed, d.submitted);
}

std::vector<RequestSpec> fixed_requests(std::initializer_list<int64_t> lengths, int64_t chunk = 0) {
    std::vector<RequestSpec> out;
    uint64_t id = 100;
    for (int64_t n : lengths) out.push_back({.id = id++, .tokens = n, .chunk = chunk});
    return out;
}

// The suites below run every scenario in each mode they are instantiated with (the two-sided data
// plane over the control transport, the one-sided write mode over a second world, ...). Inside a
// test, run_clean / start_cluster / transports() use the test's mode.
class EngineModeTest : public ::testing::TestWithParam<EngineMode> {
protected:
    [[nodiscard]] const EngineMode& mode() const { return GetParam(); }
    void run_clean(ClusterSpec c, std::vector<RequestSpec> reqs, RunOptions o = RunOptions{}) {
        testing::run_clean(std::move(c), std::move(reqs), mode(), std::move(o));
    }
    std::unique_ptr<ClusterRun> start_cluster(
        const ClusterSpec& c, SenderOptions so = test_options(SenderOptions{}),
        ReceiverOptions ro = test_options(ReceiverOptions{}),
        const std::function<std::string(int)>& fault_spec = nullptr,
        const std::function<std::string(int)>& data_fault_spec = nullptr) {
        return testing::start_cluster(c, mode(), std::move(so), std::move(ro), fault_spec,
                                      data_fault_spec);
    }
    // `n` ranks' transports in this mode (no engines).
    ModeTransports transports(int n) { return make_mode_transports(mode(), n, dir_.path()); }

private:
    TempDir dir_;
};

class TransferEngineLocal : public EngineModeTest {};
INSTANTIATE_TEST_SUITE_P(, TransferEngineLocal, ::testing::Values(kTwoSided, kWrites, kOrdered),
                         mode_name);

TEST_P(TransferEngineLocal, OneToOne) {
    ClusterSpec c = simple(1, 1);
    auto reqs = fixed_requests({1, 15, 16, 17, 100, 333});
    auto run = start_cluster(c);
    run_ranks(*run, reqs, RunOptions{});
    expect_clean(*run, c, reqs);
    Totals p = totals(*run, true);
    EXPECT_EQ(p.submitted, reqs.size());
    EXPECT_EQ(p.completed, reqs.size());
}

TEST_P(TransferEngineLocal, OneToOneChunked) {
    // Chunks of 20 tokens with pages of 16: middle chunks hold back the partial page.
    run_clean(simple(1, 1), fixed_requests({1, 16, 20, 21, 47, 160, 333}, 20));
}

TEST_P(TransferEngineLocal, LayerIntervals) {
    RunOptions o;
    o.layer_interval = 3;  // 4 layers: intervals [0, 3) and [3, 4)
    run_clean(simple(1, 1), fixed_requests({5, 64, 200}), o);
}

TEST_P(TransferEngineLocal, OnePrefillTwoDecodeInstances) {
    ClusterSpec c = simple(1, 1);
    c.decode.push_back(InstanceSpec{.tp = 1, .page_size = 16, .num_pages = 512});
    auto reqs = fixed_requests({10, 40, 70, 100, 130, 160});
    for (size_t i = 0; i < reqs.size(); ++i) reqs[i].decode_instance = static_cast<int>(i % 2);
    run_clean(c, reqs);
}

TEST_P(TransferEngineLocal, TwoPrefillInstancesOneDecode) {
    ClusterSpec c = simple(1, 1);
    c.prefill.push_back(InstanceSpec{.tp = 1, .page_size = 16, .num_pages = 512});
    auto reqs = fixed_requests({10, 40, 70, 100, 130, 160});
    for (size_t i = 0; i < reqs.size(); ++i) reqs[i].prefill_instance = static_cast<int>(i % 2);
    run_clean(c, reqs);
}

TEST_P(TransferEngineLocal, PrefillTp2ToDecodeTp1) {
    // Each prefill rank sends its heads; the decode rank scatters them into [token][head][dim].
    run_clean(simple(2, 1), fixed_requests({1, 17, 100, 250}));
}

TEST_P(TransferEngineLocal, PrefillTp1ToDecodeTp2) {
    // The prefill rank gathers each decode rank's head slice.
    run_clean(simple(1, 2), fixed_requests({1, 17, 100, 250}));
}

TEST_P(TransferEngineLocal, PrefillTp2ToDecodeTp4AndBack) {
    run_clean(simple(2, 4), fixed_requests({3, 90}, 32));
    run_clean(simple(4, 2), fixed_requests({3, 90}, 32));
}

TEST_P(TransferEngineLocal, PartialFragmentsOnBothSides) {
    // 6 heads, prefill TP2 (3 heads each) -> decode TP3 (2 each): decode rank 1 takes head 2 from
    // prefill rank 0 and head 3 from prefill rank 1 (gather on the sender, scatter on the
    // receiver).
    ClusterSpec c = simple(2, 3, 16, 32);
    c.model.kv_heads = 6;
    run_clean(c, fixed_requests({1, 40, 200}, 48));
}

TEST_P(TransferEngineLocal, ReplicatedHeads) {
    // 4 KV heads over TP 8: each head is held by two prefill ranks; replicas share the sends.
    ClusterSpec c = simple(8, 2);
    run_clean(c, fixed_requests({7, 70}));
}

TEST_P(TransferEngineLocal, PageSize16To64) {
    run_clean(simple(1, 1, 16, 64), fixed_requests({1, 63, 64, 65, 300}, 50));
}

TEST_P(TransferEngineLocal, PageSize64To16) {
    run_clean(simple(1, 1, 64, 16), fixed_requests({1, 15, 64, 65, 300}, 100));
}

TEST_P(TransferEngineLocal, PageSizesAndTpTogether) {
    run_clean(simple(2, 1, 64, 16), fixed_requests({33, 200}));
    run_clean(simple(1, 2, 16, 64), fixed_requests({33, 200}, 48));
}

ClusterSpec mla(int prefill_tp, int decode_tp, int p_ps = 16, int d_ps = 16) {
    ClusterSpec c = simple(prefill_tp, decode_tp, p_ps, d_ps);
    c.model.kind = KvKind::kMLA;
    c.model.dtype = kv::KVDtype::kBF16;
    return c;
}

TEST_P(TransferEngineLocal, MlaOneToOne) {
    run_clean(mla(1, 1), fixed_requests({1, 50, 129}));
}

TEST_P(TransferEngineLocal, MlaReplicatedReceivers) {
    // One prefill rank, every decode TP rank receives the same latent buffer.
    run_clean(mla(1, 2, 64, 16), fixed_requests({1, 50, 129}, 40));
}

TEST_P(TransferEngineLocal, MlaOneSenderPerDecodeRank) {
    // Prefill TP2: only prefill rank 0 sends to decode rank 0; with decode TP2 each prefill rank
    // serves one decode rank.
    run_clean(mla(2, 1), fixed_requests({1, 50, 129}));
    run_clean(mla(2, 2, 16, 64), fixed_requests({1, 50, 129}));
}

TEST_P(TransferEngineLocal, RandomMixes) {
    // Lengths 1..8192 (skewed short; 1..2048 under TSan, whose cost is per byte), chunked and
    // not, many concurrent requests, scrambled decode pages, several cluster shapes.
    const int n = kSlow > 1 ? 6 : 24;
    const int64_t max_tokens = kSlow > 1 ? 2048 : 8192;
    struct Shape {
        int ptp, dtp, pps, dps, pinst, dinst;
        KvKind kind;
    };
    const std::vector<Shape> shapes = {
        {1, 1, 16, 16, 1, 1, KvKind::kMHA},
        {2, 1, 16, 64, 1, 2, KvKind::kMHA},
        {1, 2, 64, 16, 2, 1, KvKind::kMHA},
        {2, 2, 32, 16, 1, 1, KvKind::kMLA},
    };
    uint64_t seed = 11;
    for (const Shape& sh : shapes) {
        SCOPED_TRACE(::testing::Message()
                     << "shape P" << sh.ptp << " D" << sh.dtp << " pages " << sh.pps << "->"
                     << sh.dps << " mla " << (sh.kind == KvKind::kMLA));
        ClusterSpec c;
        c.model.kind = sh.kind;
        c.model.layers = 3;
        for (int i = 0; i < sh.pinst; ++i)
            c.prefill.push_back(InstanceSpec{.tp = sh.ptp, .page_size = sh.pps, .num_pages = 1});
        for (int i = 0; i < sh.dinst; ++i)
            c.decode.push_back(InstanceSpec{.tp = sh.dtp, .page_size = sh.dps, .num_pages = 1});
        auto reqs = random_requests(seed++, n, max_tokens, sh.pinst, sh.dinst, true);
        RunOptions o;
        o.seed = seed;
        o.batch = 6;
        run_clean(c, reqs, o);
    }
}

TEST_P(TransferEngineLocal, DecodeStartsALayerBeforeLaterLayersAreWritten) {
    ClusterSpec c = simple(1, 1);
    auto reqs = fixed_requests({300});
    size_pools(c, reqs);
    auto run = start_cluster(c);
    Gate hold;
    Gate submitted;
    RunOptions o;
    o.hold = &hold;
    o.hold_layer = 2;  // the prefill compute stops before writing layer 2
    o.after_submit = [&](int) { submitted.open(); };
    std::thread ranks([&] { run_ranks(*run, reqs, o); });
    ASSERT_TRUE(submitted.wait(30s));
    DecodeRank& d = *run->decode[1];
    PrefillRank& p = *run->prefill[0];
    // Layers 0 and 1 arrive while layer 2 is provably not written yet.
    Status l1 = d.receiver().wait_layer(100, 1, 30s);
    EXPECT_OK(l1);
    EXPECT_TRUE(d.receiver().layer_arrived(100, 0));
    EXPECT_FALSE(d.receiver().layer_arrived(100, 2));
    auto written = p.validator().wait_expected(100, 2, 0, 300, 0, 4, 0ms);
    EXPECT_EQ(written.status().code(), StatusCode::kDeadlineExceeded) << "layer 2 was written";
    EXPECT_FALSE(hold.is_open());
    hold.open();
    ranks.join();
    expect_clean(*run, c, reqs);
}

// ---------------------------------------------------------------------------------------------
// Failure paths

class TransferEngineFailure : public EngineModeTest {};
INSTANTIATE_TEST_SUITE_P(, TransferEngineFailure, ::testing::Values(kTwoSided, kWrites, kOrdered),
                         mode_name);

std::unique_ptr<kv::MHATokenToKVPool> small_pool(KvLayout* layout) {
    kv::MHAPoolConfig pc;
    pc.num_layers = 2;
    pc.num_pages = 16;
    pc.page_size = 16;
    pc.num_kv_heads = 2;
    pc.head_dim = 8;
    auto pool = std::move(kv::MHATokenToKVPool::create(pc)).value();
    *layout = *KvLayout::from_mha_pool(*pool, 1, 0, 2);
    return pool;
}

TEST_P(TransferEngineFailure, SilentPrefillPeerTimesOut) {
    // Rank 0 has a transport but no engine: it never acks, never heartbeats.
    auto ts = transports(2);
    KvLayout layout;
    auto pool = small_pool(&layout);
    ReceiverOptions ro = test_options(ReceiverOptions{});
    ro.peer_timeout = 300ms;
    ro.request_timeout = 60s;
    auto recv = KvReceiver::create(ts.at(1), layout, ts.for_rank(ro, 1));
    ASSERT_OK(recv);
    const auto t0 = Clock::now();
    ASSERT_OK((*recv)->submit(
        {.request_id = 5, .prefill_ranks = {0}, .dst_pages = {1, 2}, .num_tokens = 20}));
    auto st = (*recv)->wait_done(5, 30s);
    const auto took = Clock::now() - t0;
    ASSERT_OK(st);
    EXPECT_EQ(st->state, RequestState::kFailed);
    EXPECT_THAT(st->reason, HasSubstr("request 5"));
    EXPECT_THAT(st->reason, HasSubstr("prefill rank 0"));
    EXPECT_THAT(st->reason, HasSubstr("bootstrap ack"));
    EXPECT_GE(took, 300ms);
    EXPECT_LT(took, 300ms + 2s * kSlow) << "failed late";
    // wait_layer reports the failure instead of waiting.
    EXPECT_EQ((*recv)->wait_layer(5, 0, 10s).code(), StatusCode::kAborted);
    auto stats = (*recv)->stats();
    EXPECT_EQ(stats.requests_failed + stats.requests_completed, stats.requests_submitted);
    // Two-sided, its data tag may still match a message in flight; the write mode and the ordered
    // plane take none.
    EXPECT_EQ(stats.tags_quarantined, mode().writes() || mode().ordered() ? 0u : 1u);
    // The pages were pinned while the request could still receive, and are released once its
    // receives were withdrawn.
    EXPECT_TRUE(eventually([&] { return !(*recv)->status(5)->pages_in_use; }, 5s));
    EXPECT_EQ((*recv)->pins().pinned_pages(), 0u);
}

TEST_P(TransferEngineFailure, QueuedRequestIsNotTimedOutAStalledOneIs) {
    // The request timeout is "no progress for this long". The prefill side is alive
    // (heartbeats) but schedules the request only after several request timeouts (it waits in
    // the prefill queue): no fault. Once it started sending, a stall (the next chunk never
    // comes) is one, and the reason names what was awaited.
    auto ts = transports(2);
    KvLayout pl;
    KvLayout dl;
    auto ppool = small_pool(&pl);
    auto dpool = small_pool(&dl);
    runtime::CpuStream stream;
    pd::StepCounter counter(stream);
    auto send =
        KvSender::create(ts.at(0), pl, counter, ts.for_rank(test_options(SenderOptions{}), 0));
    ASSERT_OK(send);
    ReceiverOptions ro = test_options(ReceiverOptions{});
    // Long enough for a chunk header and its data on a loaded machine (TSan: 3.2 s), so that
    // what times out is the wait for the next chunk.
    ro.request_timeout = 400ms * kSlow;
    auto recv = KvReceiver::create(ts.at(1), dl, ts.for_rank(ro, 1));
    ASSERT_OK(recv);
    ASSERT_OK((*recv)->submit(
        {.request_id = 9, .prefill_ranks = {0}, .dst_pages = {1, 2}, .num_tokens = 20}));
    std::this_thread::sleep_for(3 * ro.request_timeout);
    auto queued = (*recv)->status(9);
    ASSERT_OK(queued);
    EXPECT_FALSE(is_terminal(queued->state))
        << "a request waiting in the prefill queue failed: " << queued->reason;
    // The prefill side starts it: a chunk whose layer 0 is computed and layer 1 never is -- its
    // data is announced and stays in flight (waiting between chunks would be no fault either).
    ASSERT_OK((*send)->add_request({.request_id = 9, .num_tokens = 20}));
    SendChunk c;
    c.request_id = 9;
    c.src_pages = {1, 2};
    c.token_end = 16;  // a middle chunk sends whole prefill pages only
    c.begin_step = counter.advance_step(2);
    c.is_last = false;
    ASSERT_OK((*send)->submit_chunk(c));
    ASSERT_OK(counter.record_cache());
    auto st = (*recv)->wait_done(9, 30s);
    ASSERT_OK(st);
    EXPECT_EQ(st->state, RequestState::kFailed);
    EXPECT_THAT(st->reason, HasSubstr("no progress for"));
    EXPECT_THAT(st->reason, HasSubstr("KV chunks from prefill rank 0"));
    // Nothing can write the pages any more once the prefill rank has the Abort (two-sided: the
    // receives are withdrawn; ordered: none is announced; writes: it answers with Quiesced), so
    // they are released -- well within the peer timeout (10 s).
    EXPECT_TRUE(eventually([&] { return !(*recv)->status(9)->pages_in_use; }, 5s * kSlow));
    EXPECT_FALSE((*recv)->pins().is_pinned(1) || (*recv)->pins().is_pinned(2));
}

TEST_P(TransferEngineFailure, AbortedRequestsPagesAreReleasedOnlyWhenNothingCanLand) {
    // The decode side aborts a request mid-transfer (the router cancelled it): one chunk landed,
    // the next one announced (its receives planned or posted, its sends not yet). The pages are
    // released once nothing can land in them any more -- two-sided: the posted receives are
    // cancelled; ordered: nothing unannounced is ever posted; writes: the prefill rank quiesces
    // -- and nothing of the request lands in them after that, when they were freed and reused.
    auto ts = transports(2);
    KvLayout pl;
    KvLayout dl;
    auto ppool = small_pool(&pl);
    auto dpool = small_pool(&dl);
    runtime::CpuStream stream;
    pd::StepCounter counter(stream);
    auto send =
        KvSender::create(ts.at(0), pl, counter, ts.for_rank(test_options(SenderOptions{}), 0));
    auto recv = KvReceiver::create(ts.at(1), dl, ts.for_rank(test_options(ReceiverOptions{}), 1));
    ASSERT_TRUE(send.ok() && recv.ok());
    auto dst = dpool->allocator().alloc(2);
    ASSERT_OK(dst);
    const std::vector<int32_t> src = {1, 2};
    ASSERT_OK((*recv)->submit(
        {.request_id = 12, .prefill_ranks = {0}, .dst_pages = *dst, .num_tokens = 20}));
    ASSERT_OK((*send)->add_request({.request_id = 12, .num_tokens = 20}));
    for (int chunk = 0; chunk < 2; ++chunk) {
        // [0, 16) and [16, 20): a middle chunk sends whole prefill pages only.
        const int64_t t0 = chunk * 16;
        const int64_t t1 = chunk == 0 ? 16 : 20;
        for (int l = 0; l < 2; ++l) write_layer(pl, src, 3, 12, l, t0, t1, 0);
        ASSERT_OK((*send)->submit_chunk({.request_id = 12,
                                         .src_pages = src,
                                         .token_begin = t0,
                                         .token_end = t1,
                                         .begin_step = counter.advance_step(2),
                                         .layer_interval = 1,
                                         .is_last = chunk == 1,
                                         .first_token = 5}));
        if (chunk == 0) {
            for (int l = 0; l < 2; ++l) ASSERT_OK(counter.record_cache());
            ASSERT_TRUE(eventually([&] { return (*recv)->status(12)->bytes > 0; }, 10s * kSlow))
                << "the first chunk never landed";
        }
    }
    std::this_thread::sleep_for(100ms * kSlow);  // the second chunk's header arrives
    ASSERT_OK((*recv)->abort(12, "cancelled by the router"));
    auto ds = (*recv)->wait_done(12, 30s);
    ASSERT_OK(ds);
    ASSERT_EQ(ds->state, RequestState::kFailed);
    EXPECT_THAT(ds->reason, HasSubstr("cancelled by the router"));
    // The testbed's rule: free only once pages_in_use turned false -- never refused then.
    ASSERT_TRUE(eventually([&] { return !(*recv)->status(12)->pages_in_use; }, 10s * kSlow));
    ASSERT_OK((*recv)->pins().free_pages(dpool->allocator(), *dst));
    ASSERT_OK(dpool->fill(0x77));  // freed and reused
    // The second chunk's steps come now: none of its bytes may land.
    for (int l = 0; l < 2; ++l) ASSERT_OK(counter.record_cache());
    auto ps = (*send)->wait(12, 30s);
    ASSERT_OK(ps);
    EXPECT_EQ(ps->state, RequestState::kFailed);
    EXPECT_TRUE(eventually([&] { return !(*send)->status(12)->pages_in_use; }, 10s * kSlow));
    std::this_thread::sleep_for(100ms * kSlow);
    for (int l = 0; l < 2; ++l) {
        for (int b = 0; b < dl.buffer_count(); ++b) {
            for (int64_t t = 0; t < 20; ++t) {
                const std::byte* p = dl.slot_addr(l, b, token_slot(*dst, 16, t));
                for (size_t i = 0; i < 2 * dl.head_bytes(b); ++i) {
                    ASSERT_EQ(p[i], std::byte{0x77})
                        << "layer " << l << " buffer " << b << " token " << t << ": a transfer "
                        << "landed in pages released after the abort";
                }
            }
        }
    }
}

TEST_P(TransferEngineFailure, StepNeverRecordedFailsBothSides) {
    // The prefill compute never records: the sender's StepCounter wait times out.
    auto ts = transports(2);
    KvLayout pl;
    KvLayout dl;
    auto ppool = small_pool(&pl);
    auto dpool = small_pool(&dl);
    runtime::CpuStream stream;
    pd::StepCounter counter(stream);
    SenderOptions so = test_options(SenderOptions{});
    so.request_timeout = 500ms;
    auto send = KvSender::create(ts.at(0), pl, counter, ts.for_rank(so, 0));
    auto recv = KvReceiver::create(ts.at(1), dl, ts.for_rank(test_options(ReceiverOptions{}), 1));
    ASSERT_TRUE(send.ok() && recv.ok());
    ASSERT_OK((*recv)->submit(
        {.request_id = 3, .prefill_ranks = {0}, .dst_pages = {4, 5}, .num_tokens = 20}));
    ASSERT_OK((*send)->add_request({.request_id = 3, .num_tokens = 20}));
    SendChunk c;
    c.request_id = 3;
    c.src_pages = {1, 2};
    c.token_end = 20;
    c.begin_step = counter.advance_step(2);
    c.is_last = true;
    ASSERT_OK((*send)->submit_chunk(c));
    auto ps = (*send)->wait(3, 30s);
    ASSERT_OK(ps);
    EXPECT_EQ(ps->state, RequestState::kFailed);
    EXPECT_THAT(ps->reason, HasSubstr("request 3"));
    EXPECT_THAT(ps->reason, HasSubstr("StepCounter"));
    auto ds = (*recv)->wait_done(3, 30s);
    ASSERT_OK(ds);
    EXPECT_EQ(ds->state, RequestState::kFailed);
    EXPECT_THAT(ds->reason, HasSubstr("aborted"));
    // The prefill pages are unpinned once no send can read them (the worker withdraws the task
    // within cancel_check of the failure).
    EXPECT_TRUE(eventually([&] { return !(*send)->status(3)->pages_in_use; }, 5s));
    EXPECT_EQ((*send)->pins().pinned_pages(), 0u);
}

TEST_P(TransferEngineFailure, SilentDecodePeerTimesOut) {
    // The decode engine bootstraps, then goes silent (stops without a word, transport open).
    auto ts = transports(2);
    KvLayout pl;
    KvLayout dl;
    auto ppool = small_pool(&pl);
    auto dpool = small_pool(&dl);
    runtime::CpuStream stream;
    pd::StepCounter counter(stream);
    SenderOptions so = test_options(SenderOptions{});
    so.peer_timeout = 300ms;
    auto send = KvSender::create(ts.at(0), pl, counter, ts.for_rank(so, 0));
    auto recv = KvReceiver::create(ts.at(1), dl, ts.for_rank(test_options(ReceiverOptions{}), 1));
    ASSERT_TRUE(send.ok() && recv.ok());
    ASSERT_OK((*recv)->submit(
        {.request_id = 4, .prefill_ranks = {0}, .dst_pages = {4, 5}, .num_tokens = 20}));
    ASSERT_OK((*send)->add_request({.request_id = 4, .num_tokens = 20}));
    // Wait for the handshake, then silence the decode rank.
    for (int i = 0; i < 1000; ++i) {
        if ((*recv)->status(4)->state == RequestState::kTransferring) break;
        std::this_thread::sleep_for(5ms);
    }
    ASSERT_EQ((*recv)->status(4)->state, RequestState::kTransferring);
    (*recv)->shutdown(ShutdownMode::kAbrupt);
    const auto t0 = Clock::now();
    SendChunk c;
    c.request_id = 4;
    c.src_pages = {1, 2};
    c.token_end = 20;
    c.begin_step = counter.advance_step(2);
    c.is_last = true;
    ASSERT_OK((*send)->submit_chunk(c));
    // Two-sided, the sends wait for receives that never come. One-sided writes need nothing
    // from the decode rank (its regions stay registered, as a hung process's would), so there
    // the sender is kept waiting on its steps instead: a request that still awaits anything
    // fails when an awaited decode rank goes silent.
    if (!mode().writes()) {
        for (int l = 0; l < 2; ++l) ASSERT_OK(counter.record_cache());
    }
    auto ps = (*send)->wait(4, 30s);
    ASSERT_OK(ps);
    EXPECT_EQ(ps->state, RequestState::kFailed);
    EXPECT_THAT(ps->reason, HasSubstr("decode rank 1 silent"));
    EXPECT_LT(Clock::now() - t0, 300ms + 2s * kSlow);
}

TEST_P(TransferEngineLocal, LateBootstrapAfterTheForwardFinished) {
    // The prefill side computes, records and submits everything before the decode side admits
    // the request: the held chunks go out when the bootstrap arrives, all steps already ready.
    auto ts = transports(2);
    ModelSpec m;
    KvLayout pl;
    KvLayout dl;
    auto ppool = make_pool(m, InstanceSpec{.tp = 1, .page_size = 16, .num_pages = 64}, 0, &pl);
    auto dpool = make_pool(m, InstanceSpec{.tp = 1, .page_size = 64, .num_pages = 16}, 0, &dl);
    runtime::CpuStream stream;
    pd::StepCounter counter(stream);
    OrderingValidator pv(0);
    OrderingValidator dv(1);
    SenderOptions so = test_options(SenderOptions{});
    so.validator = &pv;
    ReceiverOptions ro = test_options(ReceiverOptions{});
    ro.validator = &dv;
    auto send = KvSender::create(ts.at(0), pl, counter, ts.for_rank(so, 0));
    auto recv = KvReceiver::create(ts.at(1), dl, ts.for_rank(ro, 1));
    ASSERT_TRUE(send.ok() && recv.ok());
    const int64_t n = 150;
    std::vector<int32_t> src = {9, 3, 4, 5, 1, 2, 7, 8, 10, 11};
    ASSERT_OK((*send)->add_request({.request_id = 42, .num_tokens = n}));
    // Two chunks: [0, 70) and [70, 150).
    for (int chunk = 0; chunk < 2; ++chunk) {
        const int64_t t0 = chunk == 0 ? 0 : 70;
        const int64_t t1 = chunk == 0 ? 70 : n;
        SendChunk c;
        c.request_id = 42;
        c.src_pages = src;
        c.token_begin = t0;
        c.token_end = t1;
        c.begin_step = counter.advance_step(m.layers);
        c.is_last = chunk == 1;
        c.first_token = 1234;
        ASSERT_OK((*send)->submit_chunk(c));
        for (int l = 0; l < m.layers; ++l) {
            ASSERT_TRUE(runtime::enqueue_void(stream, [&, l, t0, t1] {
                            write_layer(pl, src, 5, 42, l, t0, t1, 0);
                        }).ok());
            ASSERT_OK(enqueue_layer_checksum(stream, pv, pl, 42, l, src, t0, t1));
            ASSERT_OK(counter.record_cache());
        }
    }
    ASSERT_OK(stream.synchronize());
    EXPECT_EQ((*send)->status(42)->state, RequestState::kBootstrapping);
    ASSERT_OK((*recv)->submit(
        {.request_id = 42, .prefill_ranks = {0}, .dst_pages = {3, 1, 2}, .num_tokens = n}));
    auto ds = (*recv)->wait_done(42, 30s);
    ASSERT_OK(ds);
    EXPECT_EQ(ds->state, RequestState::kSuccess) << ds->reason;
    EXPECT_EQ(ds->first_token, 1234);
    auto ps = (*send)->wait(42, 30s);
    ASSERT_OK(ps);
    EXPECT_EQ(ps->state, RequestState::kSuccess) << ps->reason;
    EXPECT_EQ(pv.violation_count() + dv.violation_count(), 0u) << dv.report().to_string();
    EXPECT_GT(dv.report().checked_layers, 0u);
    std::vector<int32_t> dst = {3, 1, 2};
    std::vector<std::byte> want(dl.head_bytes(0));
    for (int l = 0; l < m.layers; ++l) {
        for (int64_t t = 0; t < n; ++t) {
            for (int h = 0; h < m.kv_heads; ++h) {
                fill_kv(want.data(), want.size(), 5, 42, l, 1, h, t, 0);
                ASSERT_EQ(std::memcmp(dl.slot_addr(l, 1, token_slot(dst, 64, t)) +
                                          static_cast<size_t>(h) * want.size(),
                                      want.data(), want.size()),
                          0)
                    << "layer " << l << " token " << t << " head " << h;
            }
        }
    }
}

TEST_P(TransferEngineFailure, AddRequestAfterTheDecodeSideAbortedFailsAtOnce) {
    auto ts = transports(2);
    KvLayout pl;
    KvLayout dl;
    auto ppool = small_pool(&pl);
    auto dpool = small_pool(&dl);
    runtime::CpuStream stream;
    pd::StepCounter counter(stream);
    auto send =
        KvSender::create(ts.at(0), pl, counter, ts.for_rank(test_options(SenderOptions{}), 0));
    ReceiverOptions ro = test_options(ReceiverOptions{});
    auto recv = KvReceiver::create(ts.at(1), dl, ts.for_rank(ro, 1));
    ASSERT_TRUE(send.ok() && recv.ok());
    ASSERT_OK((*recv)->submit(
        {.request_id = 8, .prefill_ranks = {0}, .dst_pages = {1, 2}, .num_tokens = 20}));
    // The decode side gives up on it (e.g. the router cancelled it) while it waits in the
    // prefill queue.
    ASSERT_OK((*recv)->abort(8, "the test gave up on it"));
    auto ds = (*recv)->wait_done(8, 30s);
    ASSERT_OK(ds);
    ASSERT_EQ(ds->state, RequestState::kFailed);
    EXPECT_THAT(ds->reason, HasSubstr("the test gave up on it"));
    EXPECT_OK((*recv)->abort(8, "again")) << "aborting a terminal request is a no-op";
    EXPECT_EQ((*recv)->abort(99, "unknown").code(), StatusCode::kNotFound);
    // The Abort reaches the prefill rank before it schedules the request.
    std::this_thread::sleep_for(100ms * kSlow);
    ASSERT_OK((*send)->add_request({.request_id = 8, .num_tokens = 20}));
    auto ps = (*send)->wait(8, 5s);
    ASSERT_OK(ps);
    EXPECT_EQ(ps->state, RequestState::kFailed);
    EXPECT_THAT(ps->reason, HasSubstr("decode rank 1 aborted"));
    EXPECT_EQ((*send)
                  ->submit_chunk(SendChunk{.request_id = 8,
                                           .src_pages = {1, 2},
                                           .token_begin = 0,
                                           .token_end = 20,
                                           .begin_step = 0,
                                           .layer_interval = 1,
                                           .is_last = true})
                  .code(),
              StatusCode::kAborted);
}

// The prefill rank has the bootstrap (it acked it) but not the request yet (it waits in the
// prefill queue) when the decode rank dies or falls silent: the later add_request must fail the
// request at once, not wait for a bootstrap that already came and will not come again.
TEST_P(TransferEngineFailure, BootstrapWaitingForAddRequestFailsWhenItsDecodeRankDies) {
    for (const bool silent : {false, true}) {
        SCOPED_TRACE(silent ? "silent" : "closed");
        auto ts = transports(2);
        KvLayout pl;
        KvLayout dl;
        auto ppool = small_pool(&pl);
        auto dpool = small_pool(&dl);
        runtime::CpuStream stream;
        pd::StepCounter counter(stream);
        SenderOptions so = test_options(SenderOptions{});
        so.peer_timeout = 300ms;
        auto send = KvSender::create(ts.at(0), pl, counter, ts.for_rank(so, 0));
        auto recv =
            KvReceiver::create(ts.at(1), dl, ts.for_rank(test_options(ReceiverOptions{}), 1));
        ASSERT_TRUE(send.ok() && recv.ok());
        ASSERT_OK((*recv)->submit(
            {.request_id = 11, .prefill_ranks = {0}, .dst_pages = {1, 2}, .num_tokens = 20}));
        // The Ack goes out on receipt, before the request is added here.
        for (int i = 0; i < 1000; ++i) {
            if ((*recv)->status(11)->state == RequestState::kTransferring) break;
            std::this_thread::sleep_for(5ms);
        }
        ASSERT_EQ((*recv)->status(11)->state, RequestState::kTransferring);
        (*recv)->shutdown(ShutdownMode::kAbrupt);
        if (!silent) {
            ts.at(1).close();
            if (ts.data_at(1) != nullptr) ts.data_at(1)->close();
        }
        // The loss is noticed (the peer's transport error, or peer_timeout of silence) before
        // the request is added.
        std::this_thread::sleep_for(300ms + 500ms * kSlow);
        const auto t0 = Clock::now();
        ASSERT_OK((*send)->add_request({.request_id = 11, .num_tokens = 20}));
        auto ps = (*send)->wait(11, 5s * kSlow);
        ASSERT_OK(ps);
        EXPECT_EQ(ps->state, RequestState::kFailed);
        EXPECT_THAT(ps->reason, HasSubstr("decode rank 1"));
        EXPECT_THAT(ps->reason, HasSubstr("before this rank scheduled the request"));
        EXPECT_LT(Clock::now() - t0, 1s * kSlow) << "failed at once, not at a timeout";
        const EngineStats stats = (*send)->stats();
        EXPECT_EQ(stats.requests_failed, 1u);
        EXPECT_EQ(stats.requests_completed + stats.requests_failed, stats.requests_submitted);
        (*send)->shutdown(ShutdownMode::kAbrupt);
    }
}

// A request whose bootstrap never came waits for it with no timeout (the decode side's
// admission queue), but not once the control links to every other rank failed: no bootstrap
// can come then. It fails at once, and so does every later add_request.
TEST_P(TransferEngineFailure, RequestAwaitingItsBootstrapFailsWhenNoPeerIsLeft) {
    auto ts = transports(2);
    KvLayout pl;
    auto ppool = small_pool(&pl);
    runtime::CpuStream stream;
    pd::StepCounter counter(stream);
    SenderOptions so = test_options(SenderOptions{});
    so.request_timeout = 600s;  // far beyond the waits below: only the lost peer can end it
    auto send = KvSender::create(ts.at(0), pl, counter, ts.for_rank(so, 0));
    ASSERT_OK(send);
    ASSERT_OK((*send)->add_request({.request_id = 21, .num_tokens = 20}));
    std::this_thread::sleep_for(100ms);
    EXPECT_EQ((*send)->status(21)->state, RequestState::kBootstrapping);
    ts.at(1).close();  // rank 1 never bootstraps anything, then goes
    if (ts.data_at(1) != nullptr) ts.data_at(1)->close();
    auto ps = (*send)->wait(21, 10s * kSlow);
    ASSERT_OK(ps);
    EXPECT_EQ(ps->state, RequestState::kFailed);
    EXPECT_THAT(ps->reason, HasSubstr("request 21 awaiting the bootstrap"));
    EXPECT_THAT(ps->reason, HasSubstr("the control links to every other rank failed"));
    EXPECT_THAT(ps->reason, HasSubstr("rank 1"));
    const auto t0 = Clock::now();
    ASSERT_OK((*send)->add_request({.request_id = 22, .num_tokens = 20}));
    auto later = (*send)->wait(22, 5s * kSlow);
    ASSERT_OK(later);
    EXPECT_EQ(later->state, RequestState::kFailed);
    EXPECT_THAT(later->reason, HasSubstr("request 22: no decode rank can bootstrap it"));
    EXPECT_LT(Clock::now() - t0, 1s * kSlow) << "failed at once, not at a timeout";
    const EngineStats stats = (*send)->stats();
    EXPECT_EQ(stats.requests_failed, 2u);
    EXPECT_EQ(stats.requests_completed + stats.requests_failed, stats.requests_submitted);
    (*send)->shutdown(ShutdownMode::kAbrupt);
}

TEST_P(TransferEngineFailure, KilledDecodeRankFailsOnlyItsRequests) {
    // P0 serves D1 and D2; D2 dies (engine stops, transport closes) mid-transfer.
    ClusterSpec c = simple(1, 1);
    c.decode.push_back(InstanceSpec{.tp = 1, .page_size = 16, .num_pages = 512});
    auto reqs = fixed_requests({50, 60, 70, 80, 90, 100});
    for (size_t i = 0; i < reqs.size(); ++i) reqs[i].decode_instance = static_cast<int>(i % 2);
    auto run = start_cluster(c);
    Gate hold;
    std::atomic<int> submitted{0};
    Gate all_submitted;
    RunOptions o;
    o.hold = &hold;
    o.hold_layer = 1;
    o.batch = 6;
    o.after_submit = [&](int) {
        if (++submitted == 2) all_submitted.open();
    };
    std::thread ranks([&] { run_ranks(*run, reqs, o); });
    ASSERT_TRUE(all_submitted.wait(30s));
    DecodeRank& d2 = *run->decode[2];
    // Kill D2 once its requests are transferring (layer 0 may be in flight).
    for (const auto& r : reqs) {
        if (r.decode_instance != 1) continue;
        // Acked: the prefill rank has the bootstrap (attached, or waiting for add_request).
        for (int i = 0; i < 10'000; ++i) {
            auto st = d2.receiver().status(r.id);
            if (st.ok() && st->state != RequestState::kBootstrapping) break;
            std::this_thread::sleep_for(2ms);
        }
    }
    d2.receiver().shutdown(ShutdownMode::kAbrupt);
    run->close_transports(2);
    hold.open();
    ranks.join();
    const RankResult& p = run->results[0];
    for (const std::string& e : p.errors) ADD_FAILURE() << e;
    EXPECT_EQ(p.stats.requests_completed + p.stats.requests_failed, p.stats.requests_submitted);
    for (const auto& r : reqs) {
        const RequestStatus& st = p.statuses.at(r.id);
        if (r.decode_instance == 0) {
            EXPECT_EQ(st.state, RequestState::kSuccess) << r.id << ": " << st.reason;
        } else {
            EXPECT_EQ(st.state, RequestState::kFailed) << r.id;
            EXPECT_THAT(st.reason, HasSubstr("decode rank 2"));
        }
    }
    const RankResult& d1 = run->results[1];
    for (const std::string& e : d1.errors) ADD_FAILURE() << e;
    EXPECT_EQ(d1.stats.requests_completed, 3u);
    EXPECT_GT(d1.bytes_checked, 0u);
}

// ---------------------------------------------------------------------------------------------
// Ordering faults: each must surface as a violation or a Failed request, never pass silently.

class TransferEngineFaults : public EngineModeTest {};
INSTANTIATE_TEST_SUITE_P(, TransferEngineFaults, ::testing::Values(kTwoSided, kWrites, kOrdered),
                         mode_name);
// The same faults on device layouts: the compute stream's truth, the sender's reads, the
// after-send verification and the receiver's landed check all hash through the device ops.
INSTANTIATE_TEST_SUITE_P(Device, TransferEngineFaults,
                         ::testing::Values(kDeviceTwoSided, kDeviceWrites, kGatedTwoSided,
                                           kGatedWrites, kDeviceOrdered, kGatedOrdered),
                         mode_name);

struct FaultOutcome {
    size_t violations = 0;
    size_t failed = 0;
    std::string reasons;  // the failed requests' reasons, one per line
    std::string report;
    bool prefill_free_refused = false;
    bool decode_free_refused = false;
};

FaultOutcome run_fault(const EngineMode& mode, Fault::Kind kind, int layer = 1) {
    ClusterSpec c = simple(1, 1);
    auto reqs = fixed_requests({40, 77, 120});
    size_pools(c, reqs);
    c.prefill[0].num_pages += 16;  // room for the "reuse" fault's other owner
    SenderOptions so = test_options(SenderOptions{});
    ReceiverOptions ro = test_options(ReceiverOptions{});
    if (kind == Fault::kSkipRecord) {
        so.request_timeout = 800ms;
        ro.request_timeout = 3s;
    }
    auto run = start_cluster(c, mode, so, ro);
    RunOptions o;
    o.fault = {kind, 101, layer};
    if (mode.gated) o.fault_wait = 200ms * kSlow;  // RunOptions::fault_wait
    // The decode side's early free must come while the transfer is in flight: the first forward
    // writes no layer before it was tried (else a descheduled decode thread could let the whole
    // transfer finish first, and the free be legitimate; a CI run saw that).
    Gate freed;
    if (kind == Fault::kDecodeFreeEarly) {
        o.hold = &freed;
        o.hold_layer = 0;
        o.after_fault = &freed;
    }
    run_ranks(*run, reqs, o);
    FaultOutcome out;
    for (const RankResult& r : run->results) {
        for (const std::string& e : r.errors) {
            // Byte mismatches on the decode side are expected for some faults; anything else is
            // a harness problem.
            if (e.find("mismatches") == std::string::npos) ADD_FAILURE() << e;
        }
        EXPECT_EQ(r.stats.requests_completed + r.stats.requests_failed, r.stats.requests_submitted)
            << "rank " << r.rank;
        out.violations += r.report.violations.size();
        for (const auto& [id, st] : r.statuses) {
            if (st.state != RequestState::kFailed) continue;
            ++out.failed;
            out.reasons += fmt::format("rank {} request {}: {}\n", r.rank, id, st.reason);
        }
    }
    out.report = all_violations(*run);
    out.prefill_free_refused = run->prefill[0]->free_refused();
    out.decode_free_refused = run->decode[1]->free_refused();
    return out;
}

TEST_P(TransferEngineFaults, CleanRunHasNoViolations) {
    FaultOutcome o = run_fault(mode(), Fault::kNone);
    EXPECT_EQ(o.violations, 0u) << o.report;
    EXPECT_EQ(o.failed, 0u);
}

// The faulty forward's requests (100..102) read the faulty layer before it is written; the
// host path posts in step order, so the fault's request (101) is among them for sure, while
// device gating may hold 101's layer behind another request's (RunOptions::fault_wait): there
// it is some request of the forward.
std::string faulty_layer(const EngineMode& mode, int layer) {
    return mode.gated ? fmt::format("layer {} ", layer)
                      : fmt::format("request 101 layer {}", layer);
}

TEST_P(TransferEngineFaults, RecordBeforeWrite) {
    FaultOutcome o = run_fault(mode(), Fault::kRecordBeforeWrite);
    EXPECT_GT(o.violations, 0u);
    EXPECT_THAT(o.report, HasSubstr(faulty_layer(mode(), 1)));
    EXPECT_THAT(o.report, HasSubstr("sender read"));
}

TEST_P(TransferEngineFaults, SkipRecord) {
    FaultOutcome o = run_fault(mode(), Fault::kSkipRecord);
    EXPECT_GT(o.failed, 0u) << o.report;
}

// The first token's aux step is ready but the token was never written (on a CUDA stream the
// record is a kernel, which still runs after a failed host task skipped the token's copy): the
// sender fails the request, naming it, instead of sending the decode rank an invalid token.
TEST_P(TransferEngineFaults, FirstTokenNeverWrittenFailsItsRequest) {
    FaultOutcome o = run_fault(mode(), Fault::kLostFirstToken);
    EXPECT_EQ(o.violations, 0u) << o.report;
    EXPECT_GT(o.failed, 0u);
    EXPECT_THAT(o.reasons, HasSubstr("request 101: the first token is -1 once aux step"));
    EXPECT_THAT(o.reasons, ::testing::Not(HasSubstr("request 100")));
}

TEST_P(TransferEngineFaults, DoubleRecord) {
    FaultOutcome o = run_fault(mode(), Fault::kDoubleRecord);
    EXPECT_GT(o.violations, 0u);
    EXPECT_THAT(o.report, HasSubstr(faulty_layer(mode(), 2)));
}

TEST_P(TransferEngineFaults, LateWrite) {
    FaultOutcome o = run_fault(mode(), Fault::kLateWrite);
    EXPECT_GT(o.violations, 0u);
    EXPECT_THAT(o.report, HasSubstr("request 101 layer 1"));
}

TEST_P(TransferEngineFaults, FreeBeforeTransferIsRefused) {
    FaultOutcome o = run_fault(mode(), Fault::kFreeBeforeTransfer);
    EXPECT_TRUE(o.prefill_free_refused);
    EXPECT_GT(o.violations, 0u);
    EXPECT_THAT(o.report, HasSubstr("free-before-transfer"));
}

TEST_P(TransferEngineFaults, PagesReusedInFlight) {
    FaultOutcome o = run_fault(mode(), Fault::kReuseBeforeTransfer);
    EXPECT_GT(o.violations, 0u);
    EXPECT_THAT(o.report, HasSubstr("request 101 layer 0"));
}

TEST_P(TransferEngineFaults, DecodeFreesDestinationEarly) {
    FaultOutcome o = run_fault(mode(), Fault::kDecodeFreeEarly);
    EXPECT_TRUE(o.decode_free_refused);
    EXPECT_GT(o.violations, 0u);
}

// ---------------------------------------------------------------------------------------------
// Transport faults (the fault decorator): every request ends Success with every byte verified,
// or Failed -- never a Success with wrong bytes, never a hang.

struct TransportFaultCase {
    const char* spec;
    int rank;              // the rank whose transport is faulty (0: prefill, 1: decode)
    bool all_succeed;      // the fault is benign (order kept)
    bool must_show;        // the fault must surface (a Failed request or a violation)
    bool on_data = false;  // the data transport is faulty (write mode), not the control one
};

class TransferEngineTransportFaults : public EngineModeTest {};
INSTANTIATE_TEST_SUITE_P(, TransferEngineTransportFaults,
                         ::testing::Values(kTwoSided, kWrites, kOrdered), mode_name);

TEST_P(TransferEngineTransportFaults, NeverPassSilently) {
    // Two-sided, the control transport carries the data too. In the write mode a fault on the
    // control transport hits Chunk / LayerWritten / Completion messages: corruption (of page
    // lists the write mode does not use, say) and reordering (two LayerWritten) may be benign
    // there; a fault on the data transport hits the writes (a dropped write completes OK and
    // lands nothing: the landed-bytes check must catch it).
    const std::vector<TransportFaultCase> cases =
        mode().writes()
            ? std::vector<TransportFaultCase>{
                  {"delay:ms=2", 0, true, false},
                  {"delay:ms=1,jitter_ms=4,seed=3", 0, false, false},
                  {"drop:p=0.05,seed=3", 0, false, true},
                  {"corrupt:p=0.1,seed=5", 1, false, false},
                  {"reorder:p=0.3,seed=9,hold_ms=5", 0, false, false},
                  {"disconnect:after=60", 0, false, true},
                  {"delay:ms=2", 0, true, false, true},
                  {"delay:ms=1,jitter_ms=4,seed=3", 0, true, false, true},
                  {"drop:p=0.05,seed=3", 0, false, true, true},
                  {"disconnect:after=60", 0, false, true, true},
              }
            : std::vector<TransportFaultCase>{
                  {"delay:ms=2", 0, true, false},
                  {"delay:ms=1,jitter_ms=4,seed=3", 0, false, false},
                  {"drop:p=0.05,seed=3", 0, false, true},
                  {"corrupt:p=0.1,seed=5", 1, false, true},
                  {"reorder:p=0.3,seed=9,hold_ms=5", 0, false, true},
                  {"disconnect:after=60", 0, false, true},
              };
    for (const TransportFaultCase& fc : cases) {
        SCOPED_TRACE(::testing::Message() << "fault '" << fc.spec << "' on rank " << fc.rank
                                          << (fc.on_data ? " (data)" : " (control)"));
        ClusterSpec c = simple(1, 1, 16, 32);
        auto reqs = fixed_requests({30, 100, 250, 400}, 64);
        size_pools(c, reqs);
        SenderOptions so = test_options(SenderOptions{});
        ReceiverOptions ro = test_options(ReceiverOptions{});
        so.request_timeout = ro.request_timeout = std::chrono::milliseconds(2000 * kSlow);
        so.peer_timeout = ro.peer_timeout = std::chrono::milliseconds(1500 * kSlow);
        auto spec = [&](bool data) {
            return [&fc, data](int r) {
                return r == fc.rank && fc.on_data == data ? std::string(fc.spec) : std::string();
            };
        };
        auto run = start_cluster(c, so, ro, spec(false), spec(true));
        RunOptions o;
        o.batch = 2;
        run_ranks(*run, reqs, o);
        size_t failed = 0;
        size_t violations = 0;
        for (const RankResult& r : run->results) {
            for (const std::string& e : r.errors) {
                // A Success whose bytes are wrong would be reported here as "mismatches".
                ADD_FAILURE() << "rank " << r.rank << ": " << e;
            }
            EXPECT_EQ(r.stats.requests_completed + r.stats.requests_failed,
                      r.stats.requests_submitted)
                << "rank " << r.rank;
            EXPECT_EQ(r.statuses.size(), reqs.size()) << "rank " << r.rank;
            for (const auto& [id, st] : r.statuses) failed += st.state == RequestState::kFailed;
            violations += r.report.violations.size();
        }
        if (fc.all_succeed) {
            EXPECT_EQ(failed, 0u);
            EXPECT_EQ(violations, 0u) << all_violations(*run);
        }
        if (fc.must_show) {
            EXPECT_GT(failed + violations, 0u);
        }
        std::printf("  fault '%s' on rank %d (%s): %zu request-sides failed, %zu violations\n",
                    fc.spec, fc.rank, fc.on_data ? "data" : "control", failed, violations);
    }
}

// An ordered plane's announced send is never withdrawn, so it can complete after its sender shut
// down (here: when the data transport closes). Its callback must not reach the event hook then:
// the hook's owner may be gone (a CI run under TSan caught the harness's PrefillRank freed under
// such a late kLayerSent).
TEST(TransferEngineOrderedPlane, NoEventReachesTheHookAfterShutdownEvenFromALateSend) {
    ClusterSpec c = simple(1, 1);
    auto reqs = fixed_requests({64});
    size_pools(c, reqs);
    std::atomic<bool> shut{false};
    std::atomic<int> late_events{0};
    Gate posted;
    SenderOptions so = test_options(SenderOptions{});
    so.on_event = [&](const TransferEvent& e) {
        if (shut.load()) late_events.fetch_add(1);
        if (e.kind == TransferEvent::Kind::kLayerPosted) posted.open();
    };
    ReceiverOptions ro = test_options(ReceiverOptions{});
    ro.peer_timeout = std::chrono::milliseconds(1000 * kSlow);
    // Rank 0's control messages (its DataPosted announcements among them) are held for a minute:
    // the decode rank posts no receive, so the announced sends stay pending.
    auto run = testing::start_cluster(c, kOrdered, so, ro, [](int rank) {
        return rank == 0 ? std::string("delay:ms=60000") : std::string();
    });
    ASSERT_NE(run->prefill[0], nullptr);
    std::thread ranks([&] { run_ranks(*run, reqs, RunOptions{}); });
    ASSERT_TRUE(posted.wait(30s * kSlow));
    run->prefill[0]->sender().shutdown(ShutdownMode::kAbrupt);
    shut.store(true);
    // Fails the pending sends now: their completions run (on this thread) after the shutdown.
    run->data_transports[0]->close();
    ranks.join();
    EXPECT_EQ(late_events.load(), 0);
}

// ---------------------------------------------------------------------------------------------
// The same engine over the tcp transport (real loopback sockets): control and data over tcp, tcp
// control with one-sided writes over a local world, and tcp control with a separate two-sided
// local data transport.

class TransferEngineTcp : public EngineModeTest {};
INSTANTIATE_TEST_SUITE_P(, TransferEngineTcp,
                         ::testing::Values(kTcpTwoSided, kTcpWrites, kTcpControlLocalData,
                                           kTcpControlOrderedData),
                         mode_name);

TEST_P(TransferEngineTcp, OneToOneChunked) {
    run_clean(simple(1, 1), fixed_requests({1, 16, 21, 160, 333}, 20));
}

TEST_P(TransferEngineTcp, HeterogeneousTpAndPages) {
    run_clean(simple(2, 1, 64, 16), fixed_requests({33, 200}));
    run_clean(simple(1, 2, 16, 64), fixed_requests({33, 200}, 48));
    run_clean(mla(1, 2), fixed_requests({5, 120}));
}

TEST_P(TransferEngineTcp, RandomMix) {
    ClusterSpec c = simple(2, 2, 16, 32);
    c.decode.push_back(InstanceSpec{.tp = 1, .page_size = 64, .num_pages = 1});
    auto reqs = random_requests(99, kSlow > 1 ? 8 : 20, 8192, 1, 2, true);
    RunOptions o;
    o.batch = 5;
    run_clean(c, reqs, o);
}

// ---------------------------------------------------------------------------------------------
// The write mode only: page safety with writes in flight, peer death, device layouts, data
// planes that disagree, and what create() refuses.

// Holds every post_write until release(): a held write is in flight (cancel says so), as a copy
// queued on a GPU stream is; release() hands them to the inner transport in post order.
class HeldWrites final : public ForwardingTransport {
public:
    explicit HeldWrites(std::unique_ptr<Transport> inner) : ForwardingTransport(std::move(inner)) {}
    ~HeldWrites() override { close(); }

    StatusOr<RequestHandle> post_write(const RemoteRegion& dst, size_t dst_offset, const void* src,
                                       size_t bytes) override {
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (!released_) {
                auto op = std::make_shared<OpState>(OpKind::kWrite, dst.peer, 0, bytes);
                held_.push_back(Held{dst, dst_offset, src, bytes, op});
                return RequestHandle(op);
            }
        }
        return ForwardingTransport::post_write(dst, dst_offset, src, bytes);
    }
    Status cancel(const RequestHandle& handle) override {
        {
            std::lock_guard<std::mutex> lock(mu_);
            for (const Held& w : held_) {
                if (w.op == handle.state()) {
                    return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                                       "held write already in flight");
                }
            }
        }
        if (handle.done()) return {};
        return ForwardingTransport::cancel(handle);
    }
    StatusOr<bool> test(const RequestHandle& handle) override { return Transport::test(handle); }
    Status wait(const RequestHandle& handle, Timeout timeout) override {
        return Transport::wait(handle, timeout);
    }
    void close() override {
        std::vector<Held> now;
        {
            std::lock_guard<std::mutex> lock(mu_);
            released_ = true;
            now.swap(held_);
        }
        for (Held& w : now) {
            w.op->complete(Status(StatusCode::kUnavailable, "held writes: transport closed"), 0);
        }
        ForwardingTransport::close();
    }

    [[nodiscard]] size_t held() {
        std::lock_guard<std::mutex> lock(mu_);
        return held_.size();
    }
    void release() {
        std::vector<Held> now;
        {
            std::lock_guard<std::mutex> lock(mu_);
            released_ = true;
            now.swap(held_);
        }
        for (Held& w : now) {
            auto h = ForwardingTransport::post_write(w.dst, w.offset, w.src, w.bytes);
            if (!h.ok()) {
                w.op->complete(h.status(), 0);
                continue;
            }
            std::shared_ptr<OpState> op = w.op;
            h->on_complete([op](const Status& st, size_t n) { op->complete(st, n); });
        }
    }

private:
    struct Held {
        RemoteRegion dst;
        size_t offset;
        const void* src;
        size_t bytes;
        std::shared_ptr<OpState> op;
    };
    std::mutex mu_;
    bool released_ = false;
    std::vector<Held> held_;
};

// Prefill rank 0 and decode rank 1 in the write mode, rank 0's writes held (HeldWrites).
struct HeldPair {
    std::vector<std::unique_ptr<Transport>> control;
    std::vector<std::unique_ptr<Transport>> data;
    HeldWrites* held = nullptr;

    HeldPair() {
        control = make_transports("local", 2, "");
        data = make_transports("local_writes", 2, "");
        auto h = std::make_unique<HeldWrites>(std::move(data[0]));
        held = h.get();
        data[0] = std::move(h);
    }
};

// One request (id 7, 20 tokens, two layers) from prefill pages {1, 2} into `dst`, its KV written
// and recorded; returns once every write of it is held.
void start_held_request(HeldPair& ts, KvSender& send, KvReceiver& recv, const KvLayout& pl,
                        pd::StepCounter& counter, const std::vector<int32_t>& dst) {
    const std::vector<int32_t> src = {1, 2};
    ASSERT_OK(
        recv.submit({.request_id = 7, .prefill_ranks = {0}, .dst_pages = dst, .num_tokens = 20}));
    ASSERT_OK(send.add_request({.request_id = 7, .num_tokens = 20}));
    for (int l = 0; l < pl.num_layers(); ++l) write_layer(pl, src, 3, 7, l, 0, 20, 0);
    ASSERT_OK(send.submit_chunk({.request_id = 7,
                                 .src_pages = src,
                                 .token_begin = 0,
                                 .token_end = 20,
                                 .begin_step = counter.advance_step(pl.num_layers()),
                                 .layer_interval = 1,
                                 .is_last = true,
                                 .first_token = 5}));
    for (int l = 0; l < pl.num_layers(); ++l) ASSERT_OK(counter.record_cache());
    // 2 layers x 2 buffers x one run (the 20 tokens are contiguous on both sides).
    ASSERT_TRUE(eventually([&] { return ts.held->held() == 4; }, 10s * kSlow))
        << ts.held->held() << " writes held";
}

// How many (layer, buffer, token, head) of request 7 in `dst` hold the prefill side's bytes.
size_t landed_heads(const KvLayout& dl, const std::vector<int32_t>& dst) {
    size_t good = 0;
    std::vector<std::byte> want(dl.head_bytes(0));
    for (int l = 0; l < dl.num_layers(); ++l) {
        for (int b = 0; b < dl.buffer_count(); ++b) {
            for (int64_t t = 0; t < 20; ++t) {
                for (int h = 0; h < dl.local_heads(); ++h) {
                    fill_kv(want.data(), want.size(), 3, 7, l, b, h, t, 0);
                    const std::byte* got = dl.slot_addr(l, b, token_slot(dst, dl.page_size(), t)) +
                                           static_cast<size_t>(h) * want.size();
                    good += std::memcmp(got, want.data(), want.size()) == 0;
                }
            }
        }
    }
    return good;
}

TEST(TransferEngineWrite, FailedRequestKeepsPagesPinnedUntilTheSourceQuiesces) {
    register_test_transports();
    HeldPair ts;
    KvLayout pl;
    KvLayout dl;
    auto ppool = small_pool(&pl);
    auto dpool = small_pool(&dl);
    ASSERT_OK(dpool->fill(0x5A));
    runtime::CpuStream stream;
    pd::StepCounter counter(stream);
    SenderOptions so = test_options(SenderOptions{});
    so.data_transport = ts.data[0].get();
    ReceiverOptions ro = test_options(ReceiverOptions{});
    ro.data_transport = ts.data[1].get();
    ro.request_timeout = 300ms;
    auto send = KvSender::create(*ts.control[0], pl, counter, so);
    auto recv = KvReceiver::create(*ts.control[1], dl, ro);
    ASSERT_TRUE(send.ok() && recv.ok());
    auto dst = dpool->allocator().alloc(2);
    ASSERT_OK(dst);
    start_held_request(ts, **send, **recv, pl, counter, *dst);
    // The decode side gives up (no LayerWritten in time) and aborts; the prefill side fails the
    // request but cannot withdraw writes that are in flight.
    auto ds = (*recv)->wait_done(7, 30s);
    ASSERT_OK(ds);
    ASSERT_EQ(ds->state, RequestState::kFailed);
    EXPECT_THAT(ds->reason, HasSubstr("no progress for"));
    ASSERT_TRUE(
        eventually([&] { return (*send)->status(7)->state == RequestState::kFailed; }, 10s));
    std::this_thread::sleep_for(200ms * kSlow);  // room for a wrong early release
    EXPECT_TRUE((*recv)->status(7)->pages_in_use);
    EXPECT_THAT((*recv)->pins().free_pages(dpool->allocator(), *dst),
                StatusIs(StatusCode::kFailedPrecondition, HasSubstr("request 7")));
    EXPECT_TRUE((*send)->status(7)->pages_in_use);
    EXPECT_EQ(landed_heads(dl, *dst), 0u) << "nothing has landed yet";
    // The writes land now, after the request failed: freed and reused pages would be corrupted.
    ts.held->release();
    EXPECT_EQ(landed_heads(dl, *dst), 2u * 2u * 20u * 2u);
    // Only now does the prefill rank quiesce, and the decode rank let the pages go.
    EXPECT_TRUE(eventually([&] { return !(*recv)->status(7)->pages_in_use; }, 10s * kSlow));
    EXPECT_OK((*recv)->pins().free_pages(dpool->allocator(), *dst));
    EXPECT_TRUE(eventually([&] { return !(*send)->status(7)->pages_in_use; }, 10s * kSlow));
    EXPECT_EQ((*recv)->stats().tags_quarantined, 0u);
}

TEST(TransferEngineWrite, DeadSourceReleasesThePages) {
    // The prefill rank dies with its writes in flight (they never land): once its control link
    // reports it gone, nothing can write the pages any more.
    register_test_transports();
    HeldPair ts;
    KvLayout pl;
    KvLayout dl;
    auto ppool = small_pool(&pl);
    auto dpool = small_pool(&dl);
    ASSERT_OK(dpool->fill(0x5A));
    runtime::CpuStream stream;
    pd::StepCounter counter(stream);
    SenderOptions so = test_options(SenderOptions{});
    so.data_transport = ts.data[0].get();
    ReceiverOptions ro = test_options(ReceiverOptions{});
    ro.data_transport = ts.data[1].get();
    auto send = KvSender::create(*ts.control[0], pl, counter, so);
    auto recv = KvReceiver::create(*ts.control[1], dl, ro);
    ASSERT_TRUE(send.ok() && recv.ok());
    auto dst = dpool->allocator().alloc(2);
    ASSERT_OK(dst);
    start_held_request(ts, **send, **recv, pl, counter, *dst);
    EXPECT_TRUE((*recv)->status(7)->pages_in_use);
    (*send)->shutdown(ShutdownMode::kAbrupt);
    ts.control[0]->close();
    ts.data[0]->close();  // the held writes fail: they never land
    auto ds = (*recv)->wait_done(7, 30s);
    ASSERT_OK(ds);
    ASSERT_EQ(ds->state, RequestState::kFailed);
    EXPECT_THAT(ds->reason, HasSubstr("prefill rank 0 unreachable"));
    EXPECT_TRUE(eventually([&] { return !(*recv)->status(7)->pages_in_use; }, 10s * kSlow));
    EXPECT_OK((*recv)->pins().free_pages(dpool->allocator(), *dst));
    EXPECT_EQ(landed_heads(dl, *dst), 0u);
}

TEST(TransferEngineWrite, DataPlanesMustAgree) {
    // A decode rank that expects writes and a prefill rank that sends (and the other way round):
    // the prefill rank refuses the bootstrap, naming both planes; nothing hangs.
    register_test_transports();
    for (const bool decode_writes : {true, false}) {
        SCOPED_TRACE(decode_writes ? "decode writes, prefill sends"
                                   : "decode sends, prefill writes");
        auto control = make_transports("local", 2, "");
        auto data = make_transports("local_writes", 2, "");
        KvLayout pl;
        KvLayout dl;
        auto ppool = small_pool(&pl);
        auto dpool = small_pool(&dl);
        runtime::CpuStream stream;
        pd::StepCounter counter(stream);
        SenderOptions so = test_options(SenderOptions{});
        so.data_transport = decode_writes ? nullptr : data[0].get();
        ReceiverOptions ro = test_options(ReceiverOptions{});
        ro.data_transport = decode_writes ? data[1].get() : nullptr;
        auto send = KvSender::create(*control[0], pl, counter, so);
        auto recv = KvReceiver::create(*control[1], dl, ro);
        ASSERT_TRUE(send.ok() && recv.ok());
        ASSERT_OK((*send)->add_request({.request_id = 3, .num_tokens = 20}));
        ASSERT_OK((*recv)->submit(
            {.request_id = 3, .prefill_ranks = {0}, .dst_pages = {1, 2}, .num_tokens = 20}));
        auto ds = (*recv)->wait_done(3, 30s);
        ASSERT_OK(ds);
        EXPECT_EQ(ds->state, RequestState::kFailed);
        EXPECT_THAT(ds->reason, HasSubstr(decode_writes ? "uses the one-sided write data plane"
                                                        : "uses the two-sided data plane"));
        EXPECT_TRUE(eventually([&] { return !(*recv)->status(3)->pages_in_use; }, 10s * kSlow));
        auto ps = (*send)->wait(3, 30s);
        ASSERT_OK(ps);
        EXPECT_EQ(ps->state, RequestState::kFailed);
    }
}

// A device (here: host-backed fake CUDA) pool per rank, over a transport that claims device
// memory: without a validator and without a staging copy the write mode only does address
// arithmetic on it and never calls the KV memory ops.
TEST(TransferEngineWrite, DeviceLayoutsWithoutStaging) {
    register_test_transports();
    runtime::testing::install_host_backed_cuda_runtime();
    InProcessDeviceOps ops;
    // Prefill TP2 -> decode TP1 (4 heads): each prefill rank writes its two heads of every token
    // straight into the decode slots (one write per token: no gather, no scatter).
    auto control = make_transports("local", 3, "");
    auto data = make_transports("local_device_writes", 3, "");
    ModelSpec m;
    KvLayout pl[2];
    KvLayout dl;
    auto p0 =
        make_pool(m, InstanceSpec{.tp = 2, .page_size = 16, .num_pages = 16}, 0, &pl[0], kFakeGpu);
    auto p1 =
        make_pool(m, InstanceSpec{.tp = 2, .page_size = 16, .num_pages = 16}, 1, &pl[1], kFakeGpu);
    auto dpool =
        make_pool(m, InstanceSpec{.tp = 1, .page_size = 32, .num_pages = 16}, 0, &dl, kFakeGpu);
    ASSERT_FALSE(dl.is_host());
    ASSERT_EQ(pl[1].device(), kFakeGpu);
    ASSERT_OK(dpool->fill(0x5A));
    runtime::CpuStream streams[2] = {runtime::CpuStream("p0"), runtime::CpuStream("p1")};
    pd::StepCounter counters[2] = {pd::StepCounter(streams[0]), pd::StepCounter(streams[1])};
    std::unique_ptr<KvSender> senders[2];
    for (int r = 0; r < 2; ++r) {
        SenderOptions so = test_options(SenderOptions{});
        so.data_transport = data[static_cast<size_t>(r)].get();
        so.kv_memory_ops_for_testing = &ops;
        auto s = KvSender::create(*control[static_cast<size_t>(r)], pl[r], counters[r], so);
        ASSERT_OK(s);
        senders[r] = std::move(s).value();
    }
    ReceiverOptions ro = test_options(ReceiverOptions{});
    ro.data_transport = data[2].get();
    ro.kv_memory_ops_for_testing = &ops;
    auto recv = KvReceiver::create(*control[2], dl, ro);
    ASSERT_OK(recv);
    const int64_t n = 70;
    const std::vector<int32_t> src = {3, 1, 4, 2, 5};
    const std::vector<int32_t> dst = {2, 5, 3};
    ASSERT_OK((*recv)->submit(
        {.request_id = 11, .prefill_ranks = {0, 1}, .dst_pages = dst, .num_tokens = n}));
    for (int r = 0; r < 2; ++r) {
        ASSERT_OK(senders[r]->add_request({.request_id = 11, .num_tokens = n}));
        for (int l = 0; l < m.layers; ++l) write_layer(pl[r], src, 4, 11, l, 0, n, 0);
        ASSERT_OK(senders[r]->submit_chunk({.request_id = 11,
                                            .src_pages = src,
                                            .token_begin = 0,
                                            .token_end = n,
                                            .begin_step = counters[r].advance_step(m.layers),
                                            .layer_interval = 1,
                                            .is_last = true,
                                            .first_token = 77}));
        for (int l = 0; l < m.layers; ++l) ASSERT_OK(counters[r].record_cache());
    }
    auto ds = (*recv)->wait_done(11, 30s);
    ASSERT_OK(ds);
    ASSERT_EQ(ds->state, RequestState::kSuccess) << ds->reason;
    EXPECT_EQ(ds->first_token, 77);
    std::vector<std::byte> want(dl.head_bytes(0));
    size_t bad = 0;
    for (int l = 0; l < m.layers; ++l) {
        for (int b = 0; b < 2; ++b) {
            for (int64_t t = 0; t < n; ++t) {
                for (int h = 0; h < m.kv_heads; ++h) {
                    fill_kv(want.data(), want.size(), 4, 11, l, b, h, t, 0);
                    bad += std::memcmp(dl.slot_addr(l, b, token_slot(dst, 32, t)) +
                                           static_cast<size_t>(h) * want.size(),
                                       want.data(), want.size()) != 0;
                }
            }
        }
    }
    EXPECT_EQ(bad, 0u);
    const EngineStats st = (*recv)->stats();
    EXPECT_EQ(st.bytes, static_cast<uint64_t>(n) * m.layers * 2 * m.kv_heads * want.size());
    // One write per (source, layer, buffer, token): the decode slot holds both sources' heads.
    EXPECT_EQ(st.messages, 2u * static_cast<uint64_t>(m.layers) * 2u * static_cast<uint64_t>(n));
    EXPECT_EQ(st.staged_bytes, 0u);
    for (auto& s : senders) {
        auto ps = s->wait(11, 30s);
        ASSERT_OK(ps);
        EXPECT_EQ(ps->state, RequestState::kSuccess) << ps->reason;
        EXPECT_EQ(s->stats().staged_bytes, 0u);
    }
    // Zero-copy and no validator: nothing for the device ops to do.
    EXPECT_EQ(ops.gathers() + ops.scatters() + ops.checksums(), 0u);
    EXPECT_EQ(ops.staging_allocations() + ops.sums_allocations(), 0u);
}

// ---- arrival words (the write mode over a data transport with write signals) ----

// Tampers with post_signal (tests only): the nth signal is dropped (it completes OK and adds
// nothing) or added twice -- what a transport that lost or repeated a signal would leave in the
// decode rank's arrival words.
class SignalTamper final : public ForwardingTransport {
public:
    enum class Mode : uint8_t { kDrop, kTwice };
    SignalTamper(std::unique_ptr<Transport> inner, Mode mode, int nth)
        : ForwardingTransport(std::move(inner)), mode_(mode), nth_(nth) {}
    [[nodiscard]] StatusOr<RequestHandle> post_signal(const RemoteRegion& dst, size_t dst_offset,
                                                      uint64_t add) override {
        if (count_.fetch_add(1) == nth_) {
            if (mode_ == Mode::kDrop) {
                auto op = std::make_shared<OpState>(OpKind::kSignal, dst.peer, 0, 8);
                op->complete({}, 8);
                return RequestHandle(std::move(op));
            }
            PDSIM_RETURN_IF_ERROR(inner().post_signal(dst, dst_offset, add).status());
        }
        return inner().post_signal(dst, dst_offset, add);
    }

private:
    const Mode mode_;
    const int nth_;
    std::atomic<int> count_{0};
};

// Prefill TP 2 -> decode TP 1 over "local_writes" (signals included), host pools, a validator on
// the decode side; rank 0's data transport optionally wrapped by a SignalTamper.
struct ArrivalRig {
    ModelSpec m;
    std::vector<std::unique_ptr<Transport>> control;
    std::vector<std::unique_ptr<Transport>> data;
    KvLayout pl[2];
    KvLayout dl;
    std::unique_ptr<kv::KVPool> ppool[2];
    std::unique_ptr<kv::KVPool> dpool;
    runtime::CpuStream streams[2] = {runtime::CpuStream("p0"), runtime::CpuStream("p1")};
    pd::StepCounter counters[2] = {pd::StepCounter(streams[0]), pd::StepCounter(streams[1])};
    OrderingValidator validator{2};
    std::unique_ptr<KvSender> senders[2];
    std::unique_ptr<KvReceiver> recv;

    explicit ArrivalRig(int arrival_slots,
                        std::optional<std::pair<SignalTamper::Mode, int>> tamper = std::nullopt,
                        const std::string& data_name = "local_writes") {
        register_test_transports();
        control = make_transports("local", 3, "");
        data = make_transports(data_name, 3, "");
        if (tamper) {
            data[0] =
                std::make_unique<SignalTamper>(std::move(data[0]), tamper->first, tamper->second);
        }
        for (int r = 0; r < 2; ++r) {
            ppool[r] =
                make_pool(m, InstanceSpec{.tp = 2, .page_size = 16, .num_pages = 16}, r, &pl[r]);
            SenderOptions so = test_options(SenderOptions{});
            so.data_transport = data[static_cast<size_t>(r)].get();
            auto s = KvSender::create(*control[static_cast<size_t>(r)], pl[r], counters[r], so);
            EXPECT_OK(s);
            if (s.ok()) {
                senders[r] = std::move(s).value();
            }
        }
        dpool = make_pool(m, InstanceSpec{.tp = 1, .page_size = 32, .num_pages = 16}, 0, &dl);
        ReceiverOptions ro = test_options(ReceiverOptions{});
        ro.data_transport = data[2].get();
        ro.validator = &validator;
        ro.arrival_slots = arrival_slots;
        auto r = KvReceiver::create(*control[2], dl, ro);
        EXPECT_OK(r);
        if (r.ok()) {
            recv = std::move(r).value();
        }
    }
    ~ArrivalRig() {
        for (auto& s : senders) {
            if (s) s->shutdown();
        }
        if (recv) recv->shutdown();
        for (auto& t : control) t->close();
        for (auto& t : data) t->close();
    }
    // Request `id` of n tokens in two chunks, written and recorded on both prefill ranks; the
    // decode side's outcome.
    StatusOr<RequestStatus> run(uint64_t id, int64_t n) {
        const std::vector<int32_t> src = {3, 1, 4, 2, 5};
        const std::vector<int32_t> dst = {2, 5, 3};
        PDSIM_RETURN_IF_ERROR(recv->submit(
            {.request_id = id, .prefill_ranks = {0, 1}, .dst_pages = dst, .num_tokens = n}));
        for (int r = 0; r < 2; ++r) {
            PDSIM_RETURN_IF_ERROR(senders[r]->add_request({.request_id = id, .num_tokens = n}));
            const int64_t half = n / 2;
            for (const auto& [t0, t1] : {std::pair<int64_t, int64_t>{0, half}, {half, n}}) {
                for (int l = 0; l < m.layers; ++l) write_layer(pl[r], src, 4, id, l, t0, t1, 0);
                PDSIM_RETURN_IF_ERROR(
                    senders[r]->submit_chunk({.request_id = id,
                                              .src_pages = src,
                                              .token_begin = t0,
                                              .token_end = t1,
                                              .begin_step = counters[r].advance_step(m.layers),
                                              .layer_interval = 1,
                                              .is_last = t1 == n,
                                              .first_token = 7}));
                for (int l = 0; l < m.layers; ++l)
                    PDSIM_RETURN_IF_ERROR(counters[r].record_cache());
            }
        }
        return recv->wait_done(id, 30s);
    }
};

// Every request's arrival words reach their targets exactly (the receiver checks them before
// Success), a stream ordered behind them runs, and slots are reused: with 2 slots, 6 requests in
// turn, and the waits of the first request still hold after its slot served 2 more (the words
// only grow). A request of a plane without arrival words has no targets.
TEST(TransferEngineArrival, WordsCountEveryLandedByteAndOrderAStream) {
    ArrivalRig rig(/*arrival_slots=*/2);
    ASSERT_TRUE(rig.recv && rig.senders[0] && rig.senders[1]);
    runtime::CpuStream decode("decode");
    for (uint64_t id = 1; id <= 6; ++id) {
        auto ds = rig.run(id, 40);
        ASSERT_OK(ds);
        ASSERT_EQ(ds->state, RequestState::kSuccess) << ds->reason;
        ASSERT_OK(rig.recv->enqueue_arrival_wait(id, decode, 1s));
        std::atomic<bool> ran{false};
        ASSERT_OK(runtime::enqueue_void(decode, [&] { ran = true; }));
        ASSERT_OK(decode.synchronize(10s));
        EXPECT_TRUE(ran.load());
        if (id > 2) {
            ASSERT_OK(rig.recv->release(id));  // 1 and 2 stay
        }
    }
    ASSERT_OK(rig.recv->enqueue_arrival_wait(1, decode, 1s));
    ASSERT_OK(rig.recv->enqueue_arrival_wait(2, decode, 1s));
    EXPECT_OK(decode.synchronize(10s));
    EXPECT_EQ(rig.validator.violation_count(), 0u) << rig.validator.report().to_string();
    EXPECT_THAT(rig.recv->enqueue_arrival_wait(3, decode, 1s), StatusIs(StatusCode::kNotFound));
}

// No targets where there are no words: the two-sided plane, or arrival_slots 0.
TEST(TransferEngineArrival, NoWordsNoTargets) {
    for (const bool two_sided : {true, false}) {
        SCOPED_TRACE(two_sided ? "two-sided plane" : "arrival_slots 0");
        ArrivalRig rig(two_sided ? 16 : 0, std::nullopt, two_sided ? "local" : "local_writes");
        ASSERT_TRUE(rig.recv && rig.senders[0] && rig.senders[1]);
        auto ds = rig.run(9, 33);
        ASSERT_OK(ds);
        ASSERT_EQ(ds->state, RequestState::kSuccess) << ds->reason;
        runtime::CpuStream decode("decode");
        EXPECT_THAT(rig.recv->enqueue_arrival_wait(9, decode, 1s),
                    StatusIs(StatusCode::kFailedPrecondition, HasSubstr("no arrival targets")));
    }
}

// A request holds its slot from submit() on: with one slot, a second request in flight is
// refused, naming the arrival slots; once the first ended the slot serves again.
TEST(TransferEngineArrival, SlotsAreAdmissionCapacity) {
    ArrivalRig rig(/*arrival_slots=*/1);
    ASSERT_TRUE(rig.recv);
    ASSERT_OK(rig.recv->submit(
        {.request_id = 1, .prefill_ranks = {0, 1}, .dst_pages = {2}, .num_tokens = 10}));
    EXPECT_THAT(rig.recv->submit(
                    {.request_id = 2, .prefill_ranks = {0, 1}, .dst_pages = {3}, .num_tokens = 10}),
                StatusIs(StatusCode::kResourceExhausted, HasSubstr("all 1 arrival slots")));
    for (auto& sender : rig.senders)
        ASSERT_OK(sender->add_request({.request_id = 1, .num_tokens = 10}));
    ASSERT_OK(rig.recv->abort(1, "test"));
    // Its sources quiesce on the Abort (they wrote nothing): the slot is read and serves again.
    bool admitted = eventually(
        [&] {
            return rig.recv
                ->submit(
                    {.request_id = 3, .prefill_ranks = {0, 1}, .dst_pages = {3}, .num_tokens = 10})
                .ok();
        },
        20s * kSlow);
    EXPECT_TRUE(admitted);
    // Let request 3 end too (the rig's graceful shutdown would wait for its sources).
    for (auto& sender : rig.senders)
        ASSERT_OK(sender->add_request({.request_id = 3, .num_tokens = 10}));
    ASSERT_OK(rig.recv->abort(3, "test"));
    EXPECT_TRUE(eventually([&] { return !rig.recv->status(3)->pages_in_use; }, 20s * kSlow));
}

// A signal lost or added twice leaves a word off its target: the request fails naming the
// arrival words, and the validator has a violation per layer that is off -- the bytes themselves
// are all there (the checksums pass), only the data path's own count disagrees.
TEST(TransferEngineArrival, ALostOrRepeatedSignalIsCaught) {
    for (const auto mode : {SignalTamper::Mode::kDrop, SignalTamper::Mode::kTwice}) {
        SCOPED_TRACE(mode == SignalTamper::Mode::kDrop ? "dropped" : "twice");
        ArrivalRig rig(/*arrival_slots=*/4, std::make_pair(mode, 2));
        ASSERT_TRUE(rig.recv && rig.senders[0] && rig.senders[1]);
        auto ds = rig.run(5, 40);
        ASSERT_OK(ds);
        EXPECT_EQ(ds->state, RequestState::kFailed);
        EXPECT_THAT(ds->reason, HasSubstr("1 layers' arrival words disagree with the bytes"));
        EXPECT_EQ(rig.validator.violation_count(), 1u);
        EXPECT_THAT(rig.validator.report().to_string(), HasSubstr("bytes landed"));
        // The next request's words start from where this one left them: it succeeds.
        auto next = rig.run(6, 40);
        ASSERT_OK(next);
        EXPECT_EQ(next->state, RequestState::kSuccess) << next->reason;
    }
}

TEST(TransferEngineCreate, DataTransportsWithoutAUsablePlane) {
    register_test_transports();
    auto control = make_transports("local", 2, "");
    auto other = make_transports("local", 2, "");
    KvLayout layout;
    auto pool = small_pool(&layout);
    runtime::CpuStream stream;
    pd::StepCounter counter(stream);
    auto view = [&](int rank, const char* name, std::function<void(Capabilities&)> edit) {
        return std::make_unique<CapabilityView>(std::move(other[static_cast<size_t>(rank)]), name,
                                                edit);
    };
    auto try_both = [&](Transport& ctl, Transport* data, StatusCode code, const char* what) {
        SenderOptions so = test_options(SenderOptions{});
        so.data_transport = data;
        EXPECT_THAT(KvSender::create(ctl, layout, counter, so).status(),
                    StatusIs(code, HasSubstr(what)));
        ReceiverOptions ro = test_options(ReceiverOptions{});
        ro.data_transport = data;
        EXPECT_THAT(KvReceiver::create(ctl, layout, ro).status(), StatusIs(code, HasSubstr(what)));
    };
    // Neither two-sided nor one-sided.
    auto neither = view(0, "no_data_ops", [](Capabilities& c) {
        one_sided_only(c);
        c.one_sided_write = false;
    });
    try_both(*control[0], neither.get(), StatusCode::kUnimplemented,
             "data transport 'no_data_ops': it has neither two-sided operations nor one-sided "
             "writes");
    // Two-sided without tag matching (nccl's kind) is the ordered plane: accepted.
    auto untagged = view(1, "untagged", [](Capabilities& c) {
        c.tag_matching = false;
        c.one_sided_write = false;
    });
    {
        StatusOr<DataPlaneChoice> choice =
            choose_data_plane("KV sender", *control[1], untagged.get(), layout);
        ASSERT_OK(choice);
        EXPECT_EQ(choice->plane, DataPlane::kOrdered);
        EXPECT_EQ(data_plane_name(choice->plane), "ordered");
    }
    // The control transport must be two-sided and tag-matching.
    auto one_sided = make_transports("local_writes", 2, "");
    try_both(*one_sided[0], nullptr, StatusCode::kUnimplemented,
             "two-sided, tag-matching control transport; 'local_writes' is not");
    // The data transport must number the ranks as the control transport does.
    try_both(*control[0], one_sided[1].get(), StatusCode::kInvalidArgument,
             "data transport 'local_writes' is rank 1 of 2, the control transport 'local' rank 0");
}

TEST(TransferEngineCreate, LayoutMemoryMustBeReachable) {
    register_test_transports();
    auto control = make_transports("local", 2, "");
    auto host_writes = make_transports("local_writes", 2, "");
    auto device_writes = make_transports("local_device_writes", 2, "");
    runtime::CpuStream stream;
    pd::StepCounter counter(stream);
    // A layout that declares CUDA memory (address arithmetic only: nothing touches it here).
    const KvLayoutSummary s = mha(1, 0, 2, 16);
    std::vector<std::vector<std::byte>> storage(4, std::vector<std::byte>(8 * 16 * 2 * 32));
    std::vector<std::byte*> bases;
    for (auto& v : storage) bases.push_back(v.data());
    auto device_layout = KvLayout::create(s, 8, bases, kFakeGpu);
    ASSERT_OK(device_layout);
    EXPECT_FALSE(device_layout->is_host());
    OrderingValidator validator(0);
    auto try_both = [&](const KvLayout& layout, Transport* data, OrderingValidator* v,
                        StatusCode code, const char* what) {
        SenderOptions so = test_options(SenderOptions{});
        so.data_transport = data;
        so.validator = v;
        EXPECT_THAT(KvSender::create(*control[0], layout, counter, so).status(),
                    StatusIs(code, HasSubstr(what)));
        ReceiverOptions ro = test_options(ReceiverOptions{});
        ro.data_transport = data;
        ro.validator = v;
        EXPECT_THAT(KvReceiver::create(*control[0], layout, ro).status(),
                    StatusIs(code, HasSubstr(what)));
    };
    // A device layout and a host-only data transport (the control one, or a one-sided one).
    try_both(*device_layout, nullptr, nullptr, StatusCode::kInvalidArgument,
             "is in cuda memory (device 0), which data transport 'local' cannot reach");
    try_both(*device_layout, host_writes[0].get(), nullptr, StatusCode::kInvalidArgument,
             "which data transport 'local_writes' cannot reach (no device_memory capability)");
    // A device layout needs KV memory ops of its memory kind: made by make_kv_memory_ops (here
    // whatever it says: no GPU, or not built with CUDA), or injected.
    {
        SenderOptions so = test_options(SenderOptions{});
        so.data_transport = device_writes[0].get();
        so.validator = &validator;
        auto made = make_kv_memory_ops(device_layout->device());
        if (made.ok()) {
            EXPECT_OK(KvSender::create(*control[0], *device_layout, counter, so));
        } else {
            EXPECT_THAT(KvSender::create(*control[0], *device_layout, counter, so).status(),
                        StatusIs(made.status().code(), HasSubstr("its KV memory ops")));
        }
        HostKvMemoryOps host_ops;
        so.kv_memory_ops_for_testing = &host_ops;
        EXPECT_THAT(
            KvSender::create(*control[0], *device_layout, counter, so).status(),
            StatusIs(StatusCode::kInvalidArgument, HasSubstr("work on cpu memory; its KV layout")));
        ReceiverOptions ro = test_options(ReceiverOptions{});
        ro.data_transport = device_writes[0].get();
        ro.kv_memory_ops_for_testing = &host_ops;
        EXPECT_THAT(KvReceiver::create(*control[0], *device_layout, ro).status(),
                    StatusIs(StatusCode::kInvalidArgument, HasSubstr("KV receiver's KV memory")));
    }
    // ... with them it is accepted, with a validator (the ops hash) or without one.
    runtime::testing::install_host_backed_cuda_runtime();  // the comm stream's device
    InProcessDeviceOps device_ops;
    for (OrderingValidator* v : {&validator, static_cast<OrderingValidator*>(nullptr)}) {
        SenderOptions so = test_options(SenderOptions{});
        so.data_transport = device_writes[0].get();
        so.validator = v;
        so.kv_memory_ops_for_testing = &device_ops;
        EXPECT_OK(KvSender::create(*control[0], *device_layout, counter, so));
    }
    // A comm stream on another device than the layout's.
    {
        SenderOptions so = test_options(SenderOptions{});
        so.data_transport = device_writes[0].get();
        so.kv_memory_ops_for_testing = &device_ops;
        so.comm_stream_factory_for_testing =
            [](runtime::Device) -> StatusOr<std::unique_ptr<runtime::Stream>> {
            return std::unique_ptr<runtime::Stream>(std::make_unique<runtime::CpuStream>());
        };
        EXPECT_THAT(KvSender::create(*control[0], *device_layout, counter, so).status(),
                    StatusIs(StatusCode::kInvalidArgument,
                             HasSubstr("comm stream is not a stream of cuda:0")));
    }
    // A host layout and a transport that reaches device memory only.
    auto device_only = std::make_unique<CapabilityView>(std::move(host_writes[1]), "device_only",
                                                        [](Capabilities& c) {
                                                            c.host_memory = false;
                                                            c.device_memory = true;
                                                        });
    auto host_layout = KvLayout::create(s, 8, bases);
    ASSERT_OK(host_layout);
    ReceiverOptions ro = test_options(ReceiverOptions{});
    ro.data_transport = device_only.get();
    EXPECT_THAT(KvReceiver::create(*control[1], *host_layout, ro).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("no host_memory capability")));
}

// ---------------------------------------------------------------------------------------------
// Device layouts: every pool on the host-backed fake GPU; the engines' gathers, scatters and
// checksums (and the compute stream's) run through KV memory ops -- InProcessDeviceOps, an
// in-process stand-in for the CUDA ops (HostKvMemoryOps on the fake GPU's host memory) -- on comm
// streams the fake runtime makes. Every byte and every checksum is checked as on the host.

class TransferEngineDevice : public EngineModeTest {
protected:
    struct OpCalls {
        uint64_t gathers = 0;
        uint64_t scatters = 0;
        uint64_t checksums = 0;
    };
    // Runs `reqs` on `c` (pools sized), expects a clean run, returns the device ops' calls.
    OpCalls run_device_clean(ClusterSpec c, const std::vector<RequestSpec>& reqs,
                             RunOptions o = RunOptions{}) {
        size_pools(c, reqs);
        auto run = start_cluster(c);
        run_ranks(*run, reqs, o);
        expect_clean(*run, c, reqs);
        Totals p = totals(*run, true);
        EXPECT_EQ(p.completed, p.submitted);
        EXPECT_GE(p.submitted, reqs.size());
        return OpCalls{run->device_ops->gathers(), run->device_ops->scatters(),
                       run->device_ops->checksums()};
    }
};
INSTANTIATE_TEST_SUITE_P(, TransferEngineDevice,
                         ::testing::Values(kDeviceTwoSided, kDeviceWrites, kGatedTwoSided,
                                           kGatedWrites, kDeviceOrdered, kGatedOrdered),
                         mode_name);

TEST_P(TransferEngineDevice, OneToOneChunked) {
    // Whole slots on both sides: no gather, no scatter; the ops hash (the compute stream's truth,
    // the sender's reads, the after-send check, the receiver's landed check).
    // (Fewer and shorter requests under TSan, whose cost is per byte and per thread switch.)
    const OpCalls n = run_device_clean(
        simple(1, 1), kSlow > 1 ? fixed_requests({1, 21, 47, 90}, 20)
                                : fixed_requests({1, 16, 20, 21, 47, 160, 333}, 20));
    EXPECT_EQ(n.gathers, 0u);
    EXPECT_EQ(n.scatters, 0u);
    EXPECT_GT(n.checksums, 0u);
}

TEST_P(TransferEngineDevice, PrefillTp1ToDecodeTp2Gathers) {
    // Each decode rank takes half of every prefill slot into whole slots of its own: gathered on
    // the comm stream (both planes), sent or written from the staging copy.
    const OpCalls n = run_device_clean(simple(1, 2), fixed_requests({1, 17, 100, 250}));
    EXPECT_GT(n.gathers, 0u);
    EXPECT_EQ(n.scatters, 0u);
}

TEST_P(TransferEngineDevice, PrefillTp2ToDecodeTp1) {
    // Each prefill rank's heads are part of a decode slot: two-sided, received into staging and
    // scattered on the comm stream; the write mode writes each token into its slot (no copy).
    const OpCalls n = run_device_clean(simple(2, 1), fixed_requests({1, 17, 100, 250}, 64));
    EXPECT_EQ(n.gathers, 0u);
    if (mode().writes()) {
        EXPECT_EQ(n.scatters, 0u);
    } else {
        EXPECT_GT(n.scatters, 0u);
    }
}

TEST_P(TransferEngineDevice, PartialFragmentsTp2ToTp3) {
    // 6 heads, prefill TP2 -> decode TP3: decode ranks 0 and 2 take part of a prefill slot into a
    // whole slot (gather); decode rank 1 takes one head of each prefill rank (two-sided: gather
    // and scatter; write mode: per-token writes).
    ClusterSpec c = simple(2, 3, 16, 32);
    c.model.kv_heads = 6;
    const OpCalls n =
        run_device_clean(c, fixed_requests(kSlow > 1 ? std::initializer_list<int64_t>{1, 100}
                                                     : std::initializer_list<int64_t>{1, 40, 200},
                                           48));
    EXPECT_GT(n.gathers, 0u);
    if (mode().writes()) {
        EXPECT_EQ(n.scatters, 0u);
    } else {
        EXPECT_GT(n.scatters, 0u);
    }
}

TEST_P(TransferEngineDevice, PageSizeMismatch) {
    const int64_t longest = kSlow > 1 ? 130 : 300;
    run_device_clean(simple(1, 1, 16, 64), fixed_requests({1, 63, 64, 65, longest}, 50));
    run_device_clean(simple(2, 1, 64, 16), fixed_requests({1, 15, 65, longest}, 100));
}

TEST_P(TransferEngineDevice, Mla) {
    run_device_clean(mla(1, 2, 64, 16), fixed_requests({1, 50, 129}, 40));
    run_device_clean(mla(2, 1), fixed_requests({1, 50, 129}));
}

TEST_P(TransferEngineDevice, LayerIntervals) {
    RunOptions o;
    o.layer_interval = 3;  // 4 layers: one comm-stream pass for [0, 3), one for [3, 4)
    run_device_clean(simple(1, 2), fixed_requests({5, 64, 200}), o);
}

// Wrong device ops fail the run: the engine's results really come from them. The compute stream
// keeps clean ops (its truth), the engines get poisoned ones.
TEST_P(TransferEngineDevice, PoisonedOpsAreCaught) {
    struct Case {
        InProcessDeviceOps::Poison poison;
        ClusterSpec cluster;
        const char* finding;  // in the violations
    };
    std::vector<Case> cases = {
        {InProcessDeviceOps::Poison::kGather, simple(1, 2), "receiver landed"},
        {InProcessDeviceOps::Poison::kChecksums, simple(1, 1), "sender read"},
    };
    if (!mode().writes()) {
        cases.push_back({InProcessDeviceOps::Poison::kScatter, simple(2, 1), "receiver landed"});
    }
    for (Case& k : cases) {
        SCOPED_TRACE(::testing::Message() << "poison " << static_cast<int>(k.poison));
        auto reqs = fixed_requests({20, 77});
        size_pools(k.cluster, reqs);
        InProcessDeviceOps poisoned(k.poison);
        SenderOptions so = test_options(SenderOptions{});
        so.kv_memory_ops_for_testing = &poisoned;
        ReceiverOptions ro = test_options(ReceiverOptions{});
        ro.kv_memory_ops_for_testing = &poisoned;
        auto run = start_cluster(k.cluster, so, ro);
        RunOptions o;
        o.wait_layers = false;
        run_ranks(*run, reqs, o);
        size_t failed = 0;
        for (const RankResult& r : run->results) {
            if (r.is_prefill) continue;
            for (const auto& [id, st] : r.statuses) failed += st.state == RequestState::kFailed;
        }
        EXPECT_GT(failed, 0u) << "poisoned device ops went unnoticed";
        EXPECT_THAT(all_violations(*run), HasSubstr(k.finding));
        const uint64_t calls = k.poison == InProcessDeviceOps::Poison::kGather ? poisoned.gathers()
                               : k.poison == InProcessDeviceOps::Poison::kScatter
                                   ? poisoned.scatters()
                                   : poisoned.checksums();
        EXPECT_GT(calls, 0u);
    }
}

// Comm streams that stall: a bounded wait fails the request, naming the comm stream and what it
// awaited; the pages stay pinned while an op that writes them may still run.

// One prefill and two decode ranks' engines over device layouts (two-sided, "local_device").
struct DevicePair {
    std::vector<std::unique_ptr<Transport>> control;
    std::vector<std::unique_ptr<Transport>> data;
    DevicePair(int n) {
        register_test_transports();
        runtime::testing::install_host_backed_cuda_runtime();
        control = make_transports("local", n, "");
        data = make_transports("local_device", n, "");
    }
};

// A factory of comm streams of the fake GPU that hands the test the stream it made.
CommStreamFactory keep_stream(runtime::Stream** out) {
    return [out](runtime::Device device) -> StatusOr<std::unique_ptr<runtime::Stream>> {
        auto s = std::make_unique<runtime::testing::HostBackedCudaStream>(device.index, "stalled");
        *out = s.get();
        return std::unique_ptr<runtime::Stream>(std::move(s));
    };
}

// Holds `stream` until the gate opens (bounded).
void stall(runtime::Stream& stream, Gate& gate) {
    ASSERT_OK(stream.enqueue([&gate] {
        gate.wait(60s * kSlow);
        return Status();
    }));
}

TEST(TransferEngineDeviceStreams, StalledSenderCommStreamFailsTheRequest) {
    // Prefill TP1 -> decode TP2: the interval's gathers and checksums wait on the stalled stream.
    DevicePair ts(3);
    ModelSpec m;
    m.layers = 2;
    InProcessDeviceOps ops;
    KvLayout pl;
    KvLayout dl[2];
    auto ppool =
        make_pool(m, InstanceSpec{.tp = 1, .page_size = 16, .num_pages = 8}, 0, &pl, kFakeGpu);
    auto d0 =
        make_pool(m, InstanceSpec{.tp = 2, .page_size = 16, .num_pages = 8}, 0, &dl[0], kFakeGpu);
    auto d1 =
        make_pool(m, InstanceSpec{.tp = 2, .page_size = 16, .num_pages = 8}, 1, &dl[1], kFakeGpu);
    runtime::CpuStream compute;
    pd::StepCounter counter(compute);
    OrderingValidator pv(0);
    runtime::Stream* comm = nullptr;
    Gate gate;
    SenderOptions so = test_options(SenderOptions{});
    so.data_transport = ts.data[0].get();
    so.validator = &pv;
    so.request_timeout = 500ms * kSlow;
    so.kv_memory_ops_for_testing = &ops;
    so.comm_stream_factory_for_testing = keep_stream(&comm);
    auto send = KvSender::create(*ts.control[0], pl, counter, so);
    ASSERT_OK(send);
    ASSERT_NE(comm, nullptr);
    stall(*comm, gate);
    std::unique_ptr<KvReceiver> recvs[2];
    for (int d = 0; d < 2; ++d) {
        ReceiverOptions ro = test_options(ReceiverOptions{});
        ro.data_transport = ts.data[static_cast<size_t>(d + 1)].get();
        ro.kv_memory_ops_for_testing = &ops;
        auto r = KvReceiver::create(*ts.control[static_cast<size_t>(d + 1)], dl[d], ro);
        ASSERT_OK(r);
        recvs[d] = std::move(r).value();
        ASSERT_OK(recvs[d]->submit(
            {.request_id = 21, .prefill_ranks = {0}, .dst_pages = {1, 2}, .num_tokens = 20}));
    }
    const std::vector<int32_t> src = {3, 4};
    ASSERT_OK((*send)->add_request({.request_id = 21, .num_tokens = 20}));
    ASSERT_OK((*send)->submit_chunk({.request_id = 21,
                                     .src_pages = src,
                                     .token_begin = 0,
                                     .token_end = 20,
                                     .begin_step = counter.advance_step(m.layers),
                                     .layer_interval = 1,
                                     .is_last = true,
                                     .first_token = 5}));
    for (int l = 0; l < m.layers; ++l) {
        write_layer(pl, src, 9, 21, l, 0, 20, 0);
        ASSERT_OK(enqueue_layer_checksum(compute, pv, pl, 21, l, src, 0, 20, &ops));
        ASSERT_OK(counter.record_cache());
    }
    auto ps = (*send)->wait(21, 30s * kSlow);
    ASSERT_OK(ps);
    EXPECT_EQ(ps->state, RequestState::kFailed);
    EXPECT_THAT(
        ps->reason,
        ::testing::AllOf(HasSubstr("request 21"),
                         // The worker's own deadline and the request table's
                         // watchdog race; each names the stalled stream.
                         ::testing::AnyOf(HasSubstr("timed out"), HasSubstr("no progress for")),
                         HasSubstr("comm stream 'stalled'"), HasSubstr("layers 0..0")));
    for (auto& r : recvs) {
        auto ds = r->wait_done(21, 30s * kSlow);
        ASSERT_OK(ds);
        EXPECT_EQ(ds->state, RequestState::kFailed);
    }
    EXPECT_EQ(ops.gathers(), 2u) << "layer 0 for each decode rank, nothing after it";
    gate.open();
    ASSERT_OK(compute.synchronize());
}

TEST(TransferEngineDeviceStreams, StalledReceiverCommStreamKeepsThePagesPinned) {
    // Prefill TP2 -> decode TP1, two-sided: the decode rank scatters each prefill rank's heads on
    // its (stalled) comm stream. The request times out naming it, and its pages stay pinned until
    // the stream has passed the scatters that may still write them.
    DevicePair ts(3);
    ModelSpec m;
    m.layers = 2;
    InProcessDeviceOps ops;
    KvLayout pl[2];
    KvLayout dl;
    auto p0 =
        make_pool(m, InstanceSpec{.tp = 2, .page_size = 16, .num_pages = 8}, 0, &pl[0], kFakeGpu);
    auto p1 =
        make_pool(m, InstanceSpec{.tp = 2, .page_size = 16, .num_pages = 8}, 1, &pl[1], kFakeGpu);
    auto dpool =
        make_pool(m, InstanceSpec{.tp = 1, .page_size = 16, .num_pages = 8}, 0, &dl, kFakeGpu);
    runtime::CpuStream computes[2] = {runtime::CpuStream("p0"), runtime::CpuStream("p1")};
    pd::StepCounter counters[2] = {pd::StepCounter(computes[0]), pd::StepCounter(computes[1])};
    std::unique_ptr<KvSender> senders[2];
    for (int r = 0; r < 2; ++r) {
        SenderOptions so = test_options(SenderOptions{});
        so.data_transport = ts.data[static_cast<size_t>(r)].get();
        so.kv_memory_ops_for_testing = &ops;
        auto s = KvSender::create(*ts.control[static_cast<size_t>(r)], pl[r], counters[r], so);
        ASSERT_OK(s);
        senders[r] = std::move(s).value();
    }
    runtime::Stream* comm = nullptr;
    Gate gate;
    ReceiverOptions ro = test_options(ReceiverOptions{});
    ro.data_transport = ts.data[2].get();
    ro.request_timeout = 500ms * kSlow;
    ro.kv_memory_ops_for_testing = &ops;
    ro.comm_stream_factory_for_testing = keep_stream(&comm);
    auto recv = KvReceiver::create(*ts.control[2], dl, ro);
    ASSERT_OK(recv);
    ASSERT_NE(comm, nullptr);
    stall(*comm, gate);
    const std::vector<int32_t> dst = {1, 2};
    ASSERT_OK((*recv)->submit(
        {.request_id = 31, .prefill_ranks = {0, 1}, .dst_pages = dst, .num_tokens = 20}));
    const std::vector<int32_t> src = {5, 6};
    for (int r = 0; r < 2; ++r) {
        ASSERT_OK(senders[r]->add_request({.request_id = 31, .num_tokens = 20}));
        for (int l = 0; l < m.layers; ++l) write_layer(pl[r], src, 9, 31, l, 0, 20, 0);
        ASSERT_OK(senders[r]->submit_chunk({.request_id = 31,
                                            .src_pages = src,
                                            .token_begin = 0,
                                            .token_end = 20,
                                            .begin_step = counters[r].advance_step(m.layers),
                                            .layer_interval = 1,
                                            .is_last = true,
                                            .first_token = 5}));
        for (int l = 0; l < m.layers; ++l) ASSERT_OK(counters[r].record_cache());
    }
    auto ds = (*recv)->wait_done(31, 30s * kSlow);
    ASSERT_OK(ds);
    EXPECT_EQ(ds->state, RequestState::kFailed);
    EXPECT_THAT(
        ds->reason,
        ::testing::AllOf(HasSubstr("request 31"),
                         // The worker's own deadline and the request table's watchdog
                         // race; each names the stalled stream.
                         ::testing::AnyOf(HasSubstr("timed out"), HasSubstr("no progress for")),
                         HasSubstr("comm stream 'stalled'"), HasSubstr("scatters of")));
    std::this_thread::sleep_for(100ms * kSlow);  // room for a wrong early release
    EXPECT_TRUE((*recv)->status(31)->pages_in_use) << "a scatter may still write the pages";
    EXPECT_THAT((*recv)->pins().free_pages(dpool->allocator(), dst),
                StatusIs(StatusCode::kFailedPrecondition, HasSubstr("request 31")));
    gate.open();
    EXPECT_TRUE(eventually([&] { return !(*recv)->status(31)->pages_in_use; }, 10s * kSlow));
    EXPECT_GT(ops.scatters(), 0u);
}

// enqueue_layer_checksum on a device layout (the ops' checksums, then a host task recording
// them) records exactly what the host path records for the same bytes.
TEST(TransferEngineDeviceStreams, LayerChecksumOnADeviceLayoutMatchesTheHost) {
    runtime::testing::install_host_backed_cuda_runtime();
    ModelSpec m;
    m.kv_heads = 4;
    const InstanceSpec inst{.tp = 2, .page_size = 16, .num_pages = 16};
    KvLayout host;
    KvLayout device;
    auto hp = make_pool(m, inst, 1, &host);
    auto dp = make_pool(m, inst, 1, &device, kFakeGpu);
    ASSERT_FALSE(device.is_host());
    const std::vector<int32_t> pages = {7, 2, 9, 4, 11};
    const int64_t n = 70;
    for (int l = 0; l < m.layers; ++l) {
        write_layer(host, pages, 3, 5, l, 0, n, 0);
        write_layer(device, pages, 3, 5, l, 0, n, 0);
    }
    InProcessDeviceOps ops;
    runtime::testing::HostBackedCudaStream stream(0, "compute");
    OrderingValidator on_host(0);
    OrderingValidator on_device(0);
    for (int l = 0; l < m.layers; ++l) {
        // Two chunks, as a chunked prefill records them.
        ASSERT_OK(enqueue_layer_checksum(stream, on_host, host, 5, l, pages, 0, 30));
        ASSERT_OK(enqueue_layer_checksum(stream, on_host, host, 5, l, pages, 30, n));
        ASSERT_OK(enqueue_layer_checksum(stream, on_device, device, 5, l, pages, 0, 30, &ops));
        ASSERT_OK(enqueue_layer_checksum(stream, on_device, device, 5, l, pages, 30, n, &ops));
    }
    ASSERT_OK(stream.synchronize());
    EXPECT_EQ(ops.checksums(), 2u * static_cast<uint64_t>(m.layers));
    for (int l = 0; l < m.layers; ++l) {
        for (int b = 0; b < 2; ++b) {
            ASSERT_OK_AND_ASSIGN(auto want, on_host.wait_expected(5, l, b, n, 2, 2, 0ms));
            ASSERT_OK_AND_ASSIGN(auto got, on_device.wait_expected(5, l, b, n, 2, 2, 0ms));
            EXPECT_EQ(got, want) << "layer " << l << " buffer " << b;
            // An independent oracle: kv_checksums of the host pool.
            EXPECT_EQ(want, kv_checksums(host, pages, l, b, 0, n, 2, 2));
        }
    }
    EXPECT_EQ(on_device.violation_count(), 0u);
    // A device layout needs ops of its memory kind.
    EXPECT_THAT(enqueue_layer_checksum(stream, on_device, device, 6, 0, pages, 0, 10),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("ops: null")));
    HostKvMemoryOps host_ops;
    EXPECT_THAT(enqueue_layer_checksum(stream, on_device, device, 6, 0, pages, 0, 10, &host_ops),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("works on cpu memory")));
    ASSERT_OK(stream.synchronize());
}

// ---------------------------------------------------------------------------------------------
// Device gating: the sender gates its comm stream on the StepCounter and posts each interval as
// soon as its record is enqueued; the stream-ordered transport holds the operation until the comm
// stream passed the gate. Layer 1's write is held on the prefill compute stream: the sends of
// layers >= 1 must be posted before it is written (the fake counts posts whose event had not
// fired), and the bytes must still be right. The broken fake posts at once: the engine's checks
// must catch the unwritten bytes it sends.

class TransferEngineGating : public EngineModeTest {};
INSTANTIATE_TEST_SUITE_P(, TransferEngineGating,
                         ::testing::Values(kGatedTwoSided, kGatedWrites, kGatedOrdered), mode_name);

StreamOrderedFake& gated_transport(ClusterRun& run, int rank) {
    auto* fake =
        dynamic_cast<StreamOrderedFake*>(run.data_transports.at(static_cast<size_t>(rank)).get());
    EXPECT_NE(fake, nullptr);
    return *fake;
}

TEST_P(TransferEngineGating, PostsAheadOfTheRecordAndDeliversTheWrittenBytes) {
    ClusterSpec c = simple(1, 1);
    auto reqs = fixed_requests({120, 40});
    size_pools(c, reqs);
    auto run = testing::start_cluster(c, GetParam());
    Gate hold;
    RunOptions o;
    o.hold = &hold;
    o.hold_layer = 1;  // the prefill compute stops before writing layer 1
    std::thread ranks([&] { run_ranks(*run, reqs, o); });
    StreamOrderedFake& fake = gated_transport(*run, 0);
    // The sends of the held layers go out (held by the transport) before layer 1 is written.
    const auto until = Clock::now() + 30s;
    while (fake.posted_ahead() == 0 && Clock::now() < until) std::this_thread::sleep_for(1ms);
    EXPECT_GT(fake.posted_ahead(), 0) << "nothing was posted ahead of its record";
    auto written = run->prefill[0]->validator().wait_expected(reqs[0].id, 1, 0, reqs[0].tokens, 0,
                                                              c.model.kv_heads, 0ms);
    EXPECT_EQ(written.status().code(), StatusCode::kDeadlineExceeded) << "layer 1 was written";
    EXPECT_FALSE(run->decode[1]->receiver().layer_arrived(reqs[0].id, 1));
    hold.open();
    ranks.join();
    expect_clean(*run, c, reqs);
}

TEST_P(TransferEngineGating, AStreamOrderedTransportThatIgnoresTheEventIsCaught) {
    EngineMode broken = GetParam();
    broken.data += "_broken";
    ClusterSpec c = simple(1, 1);
    auto reqs = fixed_requests({120});
    size_pools(c, reqs);
    auto run = testing::start_cluster(c, broken);
    Gate hold;
    RunOptions o;
    o.hold = &hold;
    o.hold_layer = 1;
    o.wait = 20s;
    std::thread ranks([&] { run_ranks(*run, reqs, o); });
    StreamOrderedFake& fake = gated_transport(*run, 0);
    // Layer 1 lands at the decode rank while it is provably unwritten (the hold is closed).
    const auto until = Clock::now() + 30s * kSlow;
    while (!run->decode[1]->receiver().layer_arrived(reqs[0].id, 1) && Clock::now() < until) {
        std::this_thread::sleep_for(1ms);
    }
    EXPECT_GT(fake.posted_ahead(), 0);
    EXPECT_TRUE(run->decode[1]->receiver().layer_arrived(reqs[0].id, 1));
    hold.open();
    ranks.join();
    const Totals p = totals(*run, true);
    const Totals d = totals(*run, false);
    EXPECT_GT(p.violations + d.violations + d.failed, 0u)
        << "bytes sent before they were written went unnoticed";
}

// ---------------------------------------------------------------------------------------------
// The ordered data plane (data_plane.h) specifically. The suites above run every scenario in it
// too (the ordered, device_ordered, gated_ordered and split_ordered modes).

// Many requests between one prefill and one decode rank, chunked differently, batched so that
// their layers interleave on the pair's one stream, in several orders: every one matches.
TEST(TransferEngineOrdered, InterleavedRequestsToOneDecodeRankMatch) {
    for (const uint64_t seed : {1u, 2u, 3u}) {
        SCOPED_TRACE(::testing::Message() << "seed " << seed);
        std::vector<RequestSpec> reqs;
        std::mt19937_64 rng(seed);
        const int64_t lengths[] = {17, 300, 64, 129, 5, 250, 33, 96};
        uint64_t id = 10 * seed;
        for (int64_t n : lengths) {
            const int64_t chunk = rng() % 3 == 0 ? 0 : 16 * static_cast<int64_t>(1 + rng() % 4);
            reqs.push_back({.id = id++, .tokens = n, .chunk = chunk});
        }
        std::shuffle(reqs.begin(), reqs.end(), rng);
        ClusterSpec c = simple(1, 1, 16, 32);
        size_pools(c, reqs);
        auto run = start_cluster(c, kOrdered);
        RunOptions o;
        o.seed = seed;
        o.batch = 3;
        o.layer_interval = static_cast<int>(1 + seed % 2);
        run_ranks(*run, reqs, o);
        expect_clean(*run, c, reqs);
        for (const RankResult& r : run->results) {
            EXPECT_EQ(r.stats.messages_drained, 0u) << "rank " << r.rank;
        }
    }
}

// A transport that does not keep the announced order (it swaps the first two sends to each
// peer) is caught: the swapped messages land in each other's receives (a size mismatch is a
// kDataLoss of the receive, equal sizes put the bytes in the wrong place: the landed check).
TEST(TransferEngineOrdered, ATransportThatBreaksTheAnnouncedOrderIsCaught) {
    const EngineMode broken{"ordered_misordered", "local", "local_ordered_misordered"};
    ClusterSpec c = simple(1, 1);
    auto reqs = fixed_requests({40, 70});
    size_pools(c, reqs);
    SenderOptions so = test_options(SenderOptions{});
    ReceiverOptions ro = test_options(ReceiverOptions{});
    so.request_timeout = ro.request_timeout = std::chrono::milliseconds(5000 * kSlow);
    auto run = start_cluster(c, broken, so, ro);
    RunOptions o;
    o.wait = 20s * kSlow;
    run_ranks(*run, reqs, o);
    const Totals p = totals(*run, true);
    const Totals d = totals(*run, false);
    EXPECT_GT(p.violations + d.violations + d.failed, 0u)
        << "messages posted out of the announced order went unnoticed";
    // And with the order kept (the same scenario), everything is clean.
    run_clean(c, reqs, kOrdered);
}

// A hand-driven prefill rank (raw control and data transports, no engine) against a KvReceiver:
// announced messages of a request the receiver does not know, of one that failed there, and of
// one whose sizes disagree with the plan are all received (into scratch memory) and dropped, so
// the pair's stream stays in step and the next request completes; the disagreement fails its
// request with a data loss naming the request and the layer.
class RawOrderedPrefill {
public:
    RawOrderedPrefill(Transport& control, Transport& data) : control_(control), data_(data) {
        pool_ = small_pool(&layout_);
        for (int l = 0; l < layout_.num_layers(); ++l) {
            for (int b = 0; b < layout_.buffer_count(); ++b) {
                std::byte* base = layout_.base(l, b);
                const size_t n = static_cast<size_t>(layout_.num_pages()) * layout_.page_bytes(b);
                for (size_t i = 0; i < n; ++i) {
                    base[i] =
                        static_cast<std::byte>((i * 7 + static_cast<size_t>(l * 3 + b)) & 255);
                }
            }
        }
    }
    const KvLayout& layout() const { return layout_; }

    // The next control message from the decode rank (rank 1) that is not a heartbeat.
    Bytes next_control() {
        for (;;) {
            Bytes buf(size_t{1} << 20);
            auto h = control_.post_recv(1, kControlTag, buf.data(), buf.size());
            EXPECT_OK(h);
            if (!h.ok()) return {};
            EXPECT_OK(control_.wait(*h, 10s * kSlow));
            buf.resize(h->bytes());
            auto type = peek_type(buf);
            if (type.ok() && *type == MsgType::kHeartbeat) continue;
            return buf;
        }
    }
    void send_control(const Bytes& bytes) {
        auto h = control_.post_send(1, kControlTag, bytes.data(), bytes.size());
        ASSERT_OK(h);
        ASSERT_OK(control_.wait(*h, 10s * kSlow));
    }
    // Answers the Bootstrap of request `id` with an Ack (skipping the Aborts of requests that
    // failed on the decode side); returns the bootstrap.
    BootstrapMsg ack(uint64_t id) {
        Bytes msg = next_control();
        while (peek_type(msg).ok() && *peek_type(msg) == MsgType::kAbort) msg = next_control();
        StatusOr<BootstrapMsg> b = decode_bootstrap(msg);
        EXPECT_OK(b);
        if (!b.ok()) return {};
        EXPECT_EQ(b->request_id, id);
        EXPECT_EQ(b->data_tag, kOrderedDataTag);
        AckMsg a;
        a.request_id = id;
        a.max_message_bytes = b->max_message_bytes;
        a.layout = layout_.summary();
        send_control(encode(a));
        return *b;
    }
    // Sends the Chunk header of the whole request (one chunk), then per layer a DataPosted and
    // its sends (sizes edited by `edit` in the announcement only), then the Completion; waits for
    // every send.
    void transfer(const BootstrapMsg& b, const std::vector<int32_t>& src_pages,
                  const std::function<void(int layer, std::vector<uint64_t>&)>& edit = nullptr) {
        const int64_t n = b.num_tokens;
        const int ps = layout_.page_size();
        send_control(encode(ChunkMsg{b.request_id, 0, 0, n, true, 0, src_pages}));
        const Fragment f = *make_fragment(layout_.summary(), b.layout);
        const int64_t max_run = max_run_tokens(f, layout_.buffer_count(), b.max_message_bytes);
        const auto runs =
            make_runs(src_pages, ps, 0, b.dst_pages, b.layout.page_size, 0, n, max_run);
        std::vector<RequestHandle> sends;
        for (int l = 0; l < layout_.num_layers(); ++l) {
            DataPostedMsg m{b.request_id, 0, 0, l, l + 1, {}};
            std::vector<std::pair<const void*, size_t>> msgs;
            for (int buf = 0; buf < layout_.buffer_count(); ++buf) {
                for (const TokenRun& run : runs) {
                    msgs.emplace_back(layout_.slot_addr(l, buf, run.src_slot),
                                      message_bytes(f, buf, run));
                }
            }
            for (const auto& [ptr, bytes] : msgs) m.sizes.push_back(bytes);
            if (edit) edit(l, m.sizes);
            send_control(encode(m));
            // What is announced is what goes out (the edited sizes included).
            for (size_t i = 0; i < msgs.size(); ++i) {
                auto h = data_.post_send(1, 0, msgs[i].first, m.sizes[i]);
                ASSERT_OK(h);
                sends.push_back(*h);
            }
        }
        CompletionMsg c;
        c.request_id = b.request_id;
        c.has_first_token = true;
        c.first_token = 42;
        c.num_layers = layout_.num_layers();
        c.buffer_count = layout_.buffer_count();
        c.head_begin = f.head_begin;
        c.head_count = f.head_count;
        c.chunks = 1;
        send_control(encode(c));
        // The receiver matches every announced message, whatever became of the request.
        EXPECT_OK(wait_all(data_, sends, 10s * kSlow));
    }

private:
    Transport& control_;
    Transport& data_;
    KvLayout layout_;
    std::unique_ptr<kv::MHATokenToKVPool> pool_;
};

TEST(TransferEngineOrdered, AnnouncedMessagesAreAlwaysDrained) {
    register_test_transports();
    TempDir dir;
    ModeTransports ts = make_mode_transports(kOrdered, 2, dir.path());
    KvLayout dl;
    auto dpool = small_pool(&dl);
    ReceiverOptions ro = test_options(ReceiverOptions{});
    auto recv = KvReceiver::create(ts.at(1), dl, ts.for_rank(ro, 1));
    ASSERT_OK(recv);
    RawOrderedPrefill prefill(ts.at(0), *ts.data_at(0));
    const std::vector<int32_t> src_pages = {3, 5};
    const std::vector<int32_t> dst_pages = {7, 2};
    const int64_t tokens = 20;
    const int L = dl.num_layers();
    auto submit = [&](uint64_t id, std::chrono::milliseconds timeout) {
        ASSERT_OK((*recv)->submit({.request_id = id,
                                   .prefill_ranks = {0},
                                   .dst_pages = dst_pages,
                                   .num_tokens = tokens,
                                   .timeout = timeout}));
    };
    uint64_t drained = 0;
    auto expect_drained = [&](uint64_t more, const char* what) {
        drained += more;
        EXPECT_TRUE(
            eventually([&] { return (*recv)->stats().messages_drained == drained; }, 10s * kSlow))
            << what << ": " << (*recv)->stats().messages_drained << " drained, expected "
            << drained;
    };
    // Messages per layer: 2 buffers x the runs (dst pages 7, 2 are not consecutive: 2 runs).
    const uint64_t per_layer = 2 * 2;

    // 1. Request 1 fails on the decode side (aborted: the router gave up on it) after its
    // header; the prefill rank (which has not heard) announces and sends all of it anyway.
    // (A timeout does not fail it here: the clock measures a lack of progress, and it does not
    // run while the request waits for the prefill side to start sending.)
    submit(1, 60s);
    BootstrapMsg b1 = prefill.ack(1);
    ASSERT_OK((*recv)->abort(1, "test: aborted after its header"));
    EXPECT_TRUE(eventually([&] { return (*recv)->status(1)->state == RequestState::kFailed; },
                           10s * kSlow));
    prefill.transfer(b1, src_pages);
    expect_drained(per_layer * static_cast<uint64_t>(L), "the failed request");
    EXPECT_TRUE(eventually([&] { return !(*recv)->status(1)->pages_in_use; }, 10s * kSlow));

    // 2. A request the decode rank never heard of (request 1's bootstrap, replayed as 99).
    BootstrapMsg unknown = b1;
    unknown.request_id = 99;
    prefill.transfer(unknown, src_pages);
    expect_drained(per_layer * static_cast<uint64_t>(L), "the unknown request");

    // 3. Request 2 announces a wrong size for layer 1: it fails with a data loss naming the
    // request and the layer; the messages are received all the same.
    submit(2, 60s);
    BootstrapMsg b2 = prefill.ack(2);
    prefill.transfer(b2, src_pages, [](int layer, std::vector<uint64_t>& sizes) {
        if (layer == 1) sizes[1] += 16;
    });
    auto st2 = (*recv)->wait_done(2, 10s * kSlow);
    ASSERT_OK(st2);
    EXPECT_EQ(st2->state, RequestState::kFailed);
    EXPECT_THAT(st2->reason, HasSubstr("DATA_LOSS"));
    EXPECT_THAT(st2->reason, HasSubstr("request 2"));
    EXPECT_THAT(st2->reason, HasSubstr("layer 1"));
    expect_drained(per_layer, "the request whose sizes disagree (its layer 1)");

    // 4. The stream is still in step: request 3 lands every byte.
    submit(3, 60s);
    BootstrapMsg b3 = prefill.ack(3);
    prefill.transfer(b3, src_pages);
    auto st3 = (*recv)->wait_done(3, 10s * kSlow);
    ASSERT_OK(st3);
    EXPECT_EQ(st3->state, RequestState::kSuccess) << st3->reason;
    EXPECT_EQ(st3->first_token, 42);
    const KvLayout& pl = prefill.layout();
    size_t bad = 0;
    for (int l = 0; l < L; ++l) {
        for (int b = 0; b < dl.buffer_count(); ++b) {
            for (int64_t t = 0; t < tokens; ++t) {
                bad += std::memcmp(dl.slot_addr(l, b, token_slot(dst_pages, dl.page_size(), t)),
                                   pl.slot_addr(l, b, token_slot(src_pages, pl.page_size(), t)),
                                   dl.token_bytes(b)) != 0;
            }
        }
    }
    EXPECT_EQ(bad, 0u);
    EXPECT_EQ((*recv)->stats().messages_drained, drained);
}

}  // namespace
}  // namespace pdsim::transfer::testing

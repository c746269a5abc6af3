// The host-side logic of the disaggregated GPU testbed (docs/testbed.md "GPU rank"), on CPU
// streams (label unit; no GPU needed):
//  - PdAttentionBackend with page checksums (ChecksumSource::kPages, what a GPU rank runs): the
//    compute-side truth is transfer::enqueue_layer_checksum over the pages right after each
//    layer's write and before the layer's record. Checked against the activation checksums of a
//    CPU rank on the same forward (an independent path: fp32 pools store the activations' bytes),
//    and, at each record (an on_record callback on the stream), whether the layer's sums were
//    already there. The record-order faults change that order and the StepCounter's count; the
//    late-write fault overwrites exactly the batch's layer-0 K slots, one fill per run of
//    consecutive slots, after layer 0's record and before the last one. create()'s refusals.
//  - agree(): every rank gets the lowest failing rank's error, or OK; a missing rank times out.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/model/model_config.h"
#include "backends/model/synthetic_model.h"
#include "backends/runtime/cpu_stream.h"
#include "sim/testbed/comm.h"
#include "sim/testbed/kv_digest.h"
#include "sim/testbed/pd_backend.h"
#include "sim/testbed/rank_builder.h"
#include "tests/status_matchers.h"
#include "transfer/engine/kv_layout.h"
#include "transfer/engine/ordering_validator.h"

namespace pdsim::testbed {
namespace {

using std::chrono::milliseconds;
using ::testing::HasSubstr;

constexpr int kLayers = 3;
constexpr int kPageSize = 4;

model::ModelConfig small_model() {
    auto m = model::resolve_model("tiny");
    EXPECT_OK(m);
    model::ModelConfig cfg = *m;
    cfg.num_layers = kLayers;
    return cfg;
}

// Two requests of one extend forward: request 1 on pages 5 and 2 (its slots are two runs), request
// 2 on pages 3 and 4 (one run).
struct Request {
    uint64_t id;
    std::vector<int32_t> tokens;
    std::vector<int32_t> pages;
};
std::vector<Request> requests() {
    return {{1, {11, 12, 13, 14, 15, 16}, {5, 2}}, {2, {21, 22, 23, 24, 25}, {3, 4}}};
}

// What a record saw: the layer, and whether that layer's checksums were in the validator.
struct RecordSeen {
    int layer;
    bool sums_recorded;
};

struct Rig {
    model::ModelConfig cfg = small_model();
    RankParts parts;
    std::unique_ptr<PdAttentionBackend> backend;
    std::unique_ptr<model::SyntheticModel> model;
    std::mutex mu;
    std::vector<RecordSeen> records;           // under mu
    std::function<void(int layer)> at_record;  // also called at each record (stream thread)
};

// A prefill rank's parts (CPU stream, fp32 pool, StepCounter, validator) and backend with
// `checksums`, `fault` and `fill`. Every record is logged (Rig::records).
std::unique_ptr<Rig> make_rig(ChecksumSource checksums, Fault fault = Fault::kNone,
                              StreamFill fill = nullptr) {
    auto rig = std::make_unique<Rig>();
    RankBuildOptions ro;
    ro.model = &rig->cfg;
    ro.backend = "cpu_ref";
    ro.page_size = kPageSize;
    ro.num_pages = 8;
    ro.step_counter = true;
    ro.validator = true;
    auto parts = build_rank_parts(ro);
    EXPECT_OK(parts);
    if (!parts.ok()) return nullptr;
    rig->parts = std::move(*parts);
    PdBackendSide side;
    side.prefill = true;
    side.fault = fault;
    side.checksums = checksums;
    side.fill = std::move(fill);
    Rig* r = rig.get();
    side.on_record = [r](int layer, double) {
        const std::vector<Request> reqs = requests();
        bool all = true;
        for (const Request& q : reqs) {
            for (int buf = 0; buf < 2; ++buf) {
                all = all &&
                      r->parts.validator
                          ->wait_expected(q.id, layer, buf, static_cast<int64_t>(q.tokens.size()),
                                          0, r->cfg.num_kv_heads, milliseconds(0))
                          .ok();
            }
        }
        std::lock_guard<std::mutex> lock(r->mu);
        r->records.push_back({layer, all});
        if (r->at_record) r->at_record(layer);
    };
    auto backend = build_pd_backend(ro, rig->parts, side);
    EXPECT_OK(backend);
    if (!backend.ok()) return nullptr;
    rig->backend = std::move(*backend);
    auto model = model::SyntheticModel::create(rig->cfg, nullptr, 64);
    EXPECT_OK(model);
    if (!model.ok()) return nullptr;
    rig->model = std::move(*model);
    return rig;
}

// One extend forward of requests() as the testbed's prefill rank runs it.
Status run_forward(Rig& rig) {
    const std::vector<Request> reqs = requests();
    std::vector<ForwardEntry> entries;
    for (const Request& q : reqs) {
        entries.push_back({q.id, 0, static_cast<int64_t>(q.tokens.size()), q.tokens, q.pages});
    }
    auto segs = std::make_shared<Segments>();
    PDSIM_ASSIGN_OR_RETURN(
        const model::StepBatch b,
        build_step_batch(attn::ForwardMode::kExtend, entries, kPageSize, segs.get()));
    rig.backend->set_segments(segs);
    rig.parts.counter->advance_step(kLayers, 0);
    std::vector<int32_t> next(reqs.size(), -1);
    PDSIM_RETURN_IF_ERROR(rig.model->forward(b, *rig.backend, *rig.parts.pool, next.data()));
    return rig.parts.stream->synchronize(milliseconds(30'000));
}

std::vector<uint64_t> expected(Rig& rig, const Request& q, int layer, int buf) {
    auto sums =
        rig.parts.validator->wait_expected(q.id, layer, buf, static_cast<int64_t>(q.tokens.size()),
                                           0, rig.cfg.num_kv_heads, milliseconds(1000));
    EXPECT_OK(sums);
    return sums.ok() ? *sums : std::vector<uint64_t>();
}

// The checksums of what the pages hold now.
std::vector<uint64_t> in_pages(Rig& rig, const Request& q, int layer, int buf) {
    auto layout = transfer::KvLayout::from_mha_pool(*rig.parts.pool, 1, 0, rig.cfg.num_kv_heads);
    EXPECT_OK(layout);
    return transfer::kv_checksums(*layout, q.pages, layer, buf, 0,
                                  static_cast<int64_t>(q.tokens.size()), 0, rig.cfg.num_kv_heads);
}

TEST(PdBackendPages, SegmentsCarryTheirPageTables) {
    const std::vector<Request> reqs = requests();
    std::vector<ForwardEntry> entries;
    for (const Request& q : reqs) {
        entries.push_back({q.id, 2, static_cast<int64_t>(q.tokens.size()),
                           std::span<const int32_t>(q.tokens).subspan(2), q.pages});
    }
    Segments segs;
    auto built = build_step_batch(attn::ForwardMode::kExtend, entries, kPageSize, &segs);
    ASSERT_OK(built);
    const model::StepBatch& b = *built;
    EXPECT_EQ(b.tokens.size(), 7u);
    ASSERT_EQ(segs.size(), 2u);
    EXPECT_EQ(segs[0].pages, reqs[0].pages);
    EXPECT_EQ(segs[1].pages, reqs[1].pages);
    EXPECT_EQ(segs[1].t0, 2);
    EXPECT_EQ(segs[1].batch_offset, 4);  // request 1 computes tokens 2..5 first
}

// The pages' sums equal the activations' sums (fp32 pools hold the activations' bytes), one
// record per layer, each after its layer's sums were recorded.
TEST(PdBackendPages, ChecksumsFromThePagesBeforeEachRecord) {
    auto pages = make_rig(ChecksumSource::kPages);
    auto activations = make_rig(ChecksumSource::kActivations);
    ASSERT_NE(pages, nullptr);
    ASSERT_NE(activations, nullptr);
    ASSERT_OK(run_forward(*pages));
    ASSERT_OK(run_forward(*activations));
    for (const Request& q : requests()) {
        for (int layer = 0; layer < kLayers; ++layer) {
            for (int buf = 0; buf < 2; ++buf) {
                SCOPED_TRACE("request " + std::to_string(q.id) + " layer " + std::to_string(layer) +
                             " buf " + std::to_string(buf));
                const std::vector<uint64_t> truth = expected(*activations, q, layer, buf);
                ASSERT_EQ(truth.size(), static_cast<size_t>(pages->cfg.num_kv_heads));
                EXPECT_EQ(expected(*pages, q, layer, buf), truth);
                EXPECT_EQ(in_pages(*pages, q, layer, buf), truth);
            }
        }
    }
    EXPECT_EQ(pages->parts.counter->query_ready_cache_step(), kLayers);
    EXPECT_EQ(pages->parts.validator->violation_count(), 0u);
    std::lock_guard<std::mutex> lock(pages->mu);
    ASSERT_EQ(pages->records.size(), static_cast<size_t>(kLayers));
    for (int l = 0; l < kLayers; ++l) {
        EXPECT_EQ(pages->records[static_cast<size_t>(l)].layer, l);
        EXPECT_TRUE(pages->records[static_cast<size_t>(l)].sums_recorded) << "layer " << l;
    }
}

// The record-order faults on a page-checksum rank: what the StepCounter publishes, and where each
// record falls relative to its layer's checksum.
TEST(PdBackendPages, RecordOrderFaults) {
    struct Case {
        Fault fault;
        int published;            // steps after one forward
        std::vector<int> layers;  // the records, in order
        bool sums_before_record;  // at every record
    };
    const std::vector<Case> cases = {
        {Fault::kRecordBeforeWrite, kLayers, {0, 1, 2}, false},
        {Fault::kSkipRecord, kLayers - 1, {0, 1}, true},
        {Fault::kDoubleRecord, kLayers + 1, {0, 0, 1, 2}, true},
        {Fault::kFreeBeforeTransfer, kLayers, {0, 1, 2}, true},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(std::string(fault_name(c.fault)));
        auto rig = make_rig(ChecksumSource::kPages, c.fault);
        ASSERT_NE(rig, nullptr);
        ASSERT_OK(run_forward(*rig));
        EXPECT_EQ(rig->parts.counter->query_ready_cache_step(), c.published);
        std::lock_guard<std::mutex> lock(rig->mu);
        std::vector<int> layers;
        for (const RecordSeen& r : rig->records) {
            layers.push_back(r.layer);
            EXPECT_EQ(r.sums_recorded, c.sums_before_record) << "record of layer " << r.layer;
        }
        EXPECT_EQ(layers, c.layers);
    }
}

// late-write: the fill overwrites layer 0's K of every token of the batch (one fill per run of
// consecutive slots), after layer 0's record and before the last layer's; the truth recorded for
// layer 0 is the written KV's, so the pages no longer match it; nothing else changed.
TEST(PdBackendPages, LateWriteOverwritesLayerZeroKAfterItsRecord) {
    struct Fill {
        void* dst;
        int byte;
        size_t bytes;
    };
    auto fills = std::make_shared<std::vector<Fill>>();
    Rig* rig_ptr = nullptr;
    StreamFill fill = [&rig_ptr, fills](void* dst, int byte, size_t bytes) {
        fills->push_back({dst, byte, bytes});  // the enqueueing thread
        return rig_ptr->parts.stream->enqueue([dst, byte, bytes] {
            std::memset(dst, byte, bytes);
            return Status();
        });
    };
    auto rig = make_rig(ChecksumSource::kPages, Fault::kLateWrite, fill);
    auto activations = make_rig(ChecksumSource::kActivations);
    ASSERT_NE(rig, nullptr);
    ASSERT_NE(activations, nullptr);
    rig_ptr = rig.get();
    kv::MHATokenToKVPool& pool = *rig->parts.pool;
    const size_t token_bytes = pool.token_bytes(0, 0);
    auto* k0 = static_cast<std::byte*>(pool.data(0, 0));
    // Slot 20 (request 1, token 0) at each record: overwritten or not.
    auto overwritten = [&] {
        for (size_t i = 0; i < token_bytes; ++i) {
            if (k0[20 * token_bytes + i] != std::byte{kLateWriteByte}) return false;
        }
        return true;
    };
    std::vector<bool> at_record;  // stream thread, read after the forward synchronized
    rig->at_record = [&](int) { at_record.push_back(overwritten()); };
    ASSERT_OK(pool.fill(0));
    ASSERT_OK(run_forward(*rig));
    ASSERT_OK(run_forward(*activations));

    // Request 1: tokens 0-3 in page 5 (slots 20-23), 4-5 in page 2 (8-9); request 2: page 3 and
    // 4 (slots 12-16, one run).
    const std::vector<std::pair<int64_t, int64_t>> runs = {{20, 4}, {8, 2}, {12, 5}};
    ASSERT_EQ(fills->size(), runs.size());
    for (size_t i = 0; i < runs.size(); ++i) {
        EXPECT_EQ((*fills)[i].dst, k0 + runs[i].first * static_cast<int64_t>(token_bytes));
        EXPECT_EQ((*fills)[i].bytes, token_bytes * static_cast<size_t>(runs[i].second));
        EXPECT_EQ((*fills)[i].byte, kLateWriteByte);
    }
    EXPECT_EQ(at_record, (std::vector<bool>{false, false, true}));
    EXPECT_TRUE(overwritten());
    for (const Request& q : requests()) {
        SCOPED_TRACE("request " + std::to_string(q.id));
        EXPECT_EQ(expected(*rig, q, 0, 0), expected(*activations, q, 0, 0));
        EXPECT_NE(in_pages(*rig, q, 0, 0), expected(*rig, q, 0, 0));
        EXPECT_EQ(in_pages(*rig, q, 0, 1), expected(*rig, q, 0, 1));
        EXPECT_EQ(in_pages(*rig, q, 1, 0), expected(*rig, q, 1, 0));
        EXPECT_EQ(in_pages(*rig, q, kLayers - 1, 0), expected(*rig, q, kLayers - 1, 0));
    }
    EXPECT_EQ(rig->parts.counter->query_ready_cache_step(), kLayers);
}

// What create() needs for page checksums.
TEST(PdBackendPages, CreateRefusals) {
    const model::ModelConfig cfg = small_model();
    runtime::CpuStream stream("refusals");
    auto inner = [&] {
        attn::AttentionConfig ac;
        ac.num_q_heads = cfg.num_q_heads;
        ac.num_kv_heads = cfg.num_kv_heads;
        ac.head_dim = cfg.head_dim;
        ac.stream = &stream;
        auto b = attn::create_attention_backend("cpu_ref", ac);
        EXPECT_OK(b);
        return std::move(*b);
    };
    transfer::OrderingValidator validator(0);
    pd::StepCounter counter(stream);
    PdBackendOptions o;
    o.checksums = ChecksumSource::kPages;
    o.counter = &counter;
    o.validator = &validator;
    EXPECT_THAT(PdAttentionBackend::create(inner(), o).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("options.layout")));
    kv::MHAPoolConfig pc;
    pc.num_layers = cfg.num_layers;
    pc.num_kv_heads = cfg.num_kv_heads;
    pc.head_dim = cfg.head_dim;
    auto pool = kv::MHATokenToKVPool::create(pc);
    ASSERT_OK(pool);
    auto layout = transfer::KvLayout::from_mha_pool(**pool, 1, 0, cfg.num_kv_heads);
    ASSERT_OK(layout);
    o.layout = *layout;
    EXPECT_OK(PdAttentionBackend::create(inner(), o));
    o.fault = Fault::kLateWrite;
    EXPECT_THAT(PdAttentionBackend::create(inner(), o).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("options.fill")));
    o.fill = [](void*, int, size_t) { return Status(); };
    EXPECT_OK(PdAttentionBackend::create(inner(), o));
}

// ---- agree() ----

// Runs agree() on every rank of a local world (rank r's outcome `mine[r]`; a rank whose entry is
// skipped does not take part) and returns what each got.
std::vector<Status> agree_all(const std::vector<Status>& mine, const std::vector<bool>& take_part,
                              milliseconds timeout) {
    const int n = static_cast<int>(mine.size());
    LocalHub hub(n);
    std::vector<std::unique_ptr<Mailbox>> boxes;
    for (int r = 0; r < n; ++r) boxes.push_back(hub.mailbox(r));
    std::vector<Status> got(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
        if (!take_part[static_cast<size_t>(r)]) continue;
        threads.emplace_back([&, r] {
            got[static_cast<size_t>(r)] = agree(*boxes[static_cast<size_t>(r)], "setup-test",
                                                mine[static_cast<size_t>(r)], timeout);
        });
    }
    for (auto& t : threads) t.join();
    return got;
}

// The KV digest (kv_digest.h) of one request, taken over a TP-1 rank's pools equals the sum of
// two TP-2 ranks' digests over the same bytes (their head slices, other page sizes and page
// ids); one byte changed anywhere -- an attention layer's KV or a recurrent state -- changes it.
// The model: full, sliding, recurrent, full (hybrid-tiny), so the KV engine's layout holds the two
// full-attention layers and the state layout the one recurrent layer.
TEST(KvDigest, SplitsOverTpRanksAndSeesEveryByte) {
    const model::ModelConfig m = *model::resolve_model("hybrid-tiny");
    const int tokens = 37;
    struct RankPools {
        RankParts parts;
        std::vector<int32_t> pages;
        int32_t slot = 0;
        transfer::KvLayout kv, states;
    };
    auto make = [&](int tp, int tp_rank, int page_size, int32_t first_page, int32_t slot) {
        RankBuildOptions o;
        o.model = &m;
        o.tp_size = tp;
        o.tp_rank = tp_rank;
        o.page_size = page_size;
        o.num_pages = 16;
        o.state_slots = 4;
        RankPools r;
        r.parts = std::move(build_rank_parts(o).value());
        for (int p = 0; p * page_size < tokens; ++p) r.pages.push_back(first_page + p);
        r.slot = slot;
        r.kv = kv_engine_layout(*r.parts.pool, m, tp, tp_rank).value();
        r.states = state_layout(*r.parts.states, m, tp, tp_rank).value();
        return r;
    };
    RankPools whole = make(1, 0, 16, 1, 3);
    std::vector<RankPools> halves;
    halves.push_back(make(2, 0, 8, 5, 1));
    halves.push_back(make(2, 1, 8, 2, 2));
    EXPECT_EQ(whole.kv.num_layers(), 2);  // the KV engine's: the two full-attention layers
    EXPECT_EQ(whole.states.num_layers(), 1);
    // The same value for (layer, buffer, global head, token, element) on every rank.
    auto value = [](int l, int b, int head, int64_t t, size_t e) {
        return static_cast<float>((l * 7 + b * 3 + head * 11) % 13) +
               0.001f * static_cast<float>(t) + 1e-6f * static_cast<float>(e);
    };
    auto fill = [&](RankPools& r) {
        for (const transfer::KvLayout* layout : {&r.kv, &r.states}) {
            const bool state = layout == &r.states;
            const int64_t n = state ? 1 : tokens;
            std::vector<int32_t> table = state ? std::vector<int32_t>{r.slot} : r.pages;
            for (int l = 0; l < layout->num_layers(); ++l) {
                for (int b = 0; b < layout->buffer_count(); ++b) {
                    const size_t elems = layout->head_bytes(b) / sizeof(float);
                    for (int64_t t = 0; t < n; ++t) {
                        auto* slot = reinterpret_cast<float*>(layout->slot_addr(
                            l, b, transfer::token_slot(table, layout->page_size(), t)));
                        for (int h = 0; h < layout->local_heads(); ++h) {
                            for (size_t e = 0; e < elems; ++e) {
                                slot[static_cast<size_t>(h) * elems + e] =
                                    value(l + (state ? 100 : 0), b, layout->head_begin() + h, t, e);
                            }
                        }
                    }
                }
            }
        }
    };
    fill(whole);
    for (RankPools& h : halves) fill(h);
    auto digest = [&](const RankPools& r) {
        return request_kv_digest(r.kv, r.pages, tokens, &r.states, r.slot);
    };
    const uint64_t want = digest(whole);
    EXPECT_NE(want, 0u);
    EXPECT_EQ(digest(halves[0]) + digest(halves[1]), want);
    EXPECT_NE(digest(halves[0]), want);
    // One float of the sliding layer's V of the last token, on the second half.
    auto* v = reinterpret_cast<float*>(
        halves[1].kv.slot_addr(1, 1, transfer::token_slot(halves[1].pages, 8, tokens - 1)));
    v[0] += 1.0f;
    EXPECT_NE(digest(halves[0]) + digest(halves[1]), want);
    v[0] -= 1.0f;
    EXPECT_EQ(digest(halves[0]) + digest(halves[1]), want);
    // One float of the convolution state of the first half's slot.
    auto* conv = reinterpret_cast<float*>(halves[0].states.slot_addr(0, 1, halves[0].slot));
    conv[5] = -conv[5] - 1.0f;
    EXPECT_NE(digest(halves[0]) + digest(halves[1]), want);
}

TEST(PhaseAgreement, EveryRankGetsTheLowestFailure) {
    const std::vector<bool> all(4, true);
    for (const Status& st :
         agree_all({Status(), Status(), Status(), Status()}, all, milliseconds(10'000))) {
        EXPECT_OK(st);
    }
    const std::vector<Status> got = agree_all(
        {Status(), Status(), Status(StatusCode::kUnimplemented, "KV receiver: device layout"),
         Status(StatusCode::kInvalidArgument, "--data-transport cuda_ipc: no device")},
        all, milliseconds(10'000));
    for (const Status& st : got) {
        EXPECT_THAT(st, StatusIs(StatusCode::kUnimplemented,
                                 HasSubstr("rank 2: KV receiver: device layout")));
    }
    // Rank 0's own failure is the lowest.
    for (const Status& st : agree_all({Status(StatusCode::kUnavailable, "no device"), Status(),
                                       Status(StatusCode::kInternal, "x")},
                                      {true, true, true}, milliseconds(10'000))) {
        EXPECT_THAT(st, StatusIs(StatusCode::kUnavailable, HasSubstr("rank 0: no device")));
    }
}

TEST(PhaseAgreement, AMissingRankTimesOutEveryone) {
    const std::vector<Status> got =
        agree_all({Status(), Status(), Status()}, {true, true, false}, milliseconds(300));
    EXPECT_THAT(got[0], StatusIs(StatusCode::kDeadlineExceeded,
                                 HasSubstr("agreement setup-test: rank(s) 2 did not report")));
    EXPECT_THAT(got[1], StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("rank(s) 2")));
}

// The in-process TP group (the GPU model's exchange and the CPU model's gather, threads of one
// process): every member gets every contribution, rank-major, round after round.
TEST(LocalTpGroup, GathersRankMajorEveryRound) {
    LocalTpGroup group(3, milliseconds(5000));
    constexpr size_t kCount = 4;
    std::vector<std::vector<float>> out(3, std::vector<float>(3 * kCount, -1.f));
    std::vector<Status> status(3);
    for (int round = 0; round < 5; ++round) {
        std::vector<std::thread> threads;
        std::vector<std::vector<float>> mine(3);
        for (int r = 0; r < 3; ++r) {
            mine[static_cast<size_t>(r)].assign(kCount, static_cast<float>(10 * round + r));
            threads.emplace_back([&, r] {
                status[static_cast<size_t>(r)] =
                    group.member(r)->allgather(mine[static_cast<size_t>(r)].data(), kCount,
                                               out[static_cast<size_t>(r)].data());
            });
        }
        for (auto& t : threads) t.join();
        for (int r = 0; r < 3; ++r) {
            ASSERT_OK(status[static_cast<size_t>(r)]);
            for (size_t k = 0; k < 3 * kCount; ++k) {
                EXPECT_EQ(out[static_cast<size_t>(r)][k],
                          static_cast<float>(10 * round + k / kCount))
                    << "round " << round << " member " << r << " element " << k;
            }
        }
    }
}

// A member whose peer never comes times out, and the group is broken for good: the late peer and
// every later call fail at once (before, the late peer completed a round with the stale arrival
// and read its dead buffer).
TEST(LocalTpGroup, ATimeoutBreaksTheGroupForEveryMember) {
    LocalTpGroup group(2, milliseconds(100));
    float mine[2] = {1.f, 2.f}, out[4] = {};
    EXPECT_THAT(group.member(0)->allgather(mine, 2, out),
                StatusIs(StatusCode::kDeadlineExceeded,
                         HasSubstr("TP allgather (2 ranks) timed out after 100 ms on rank 0")));
    EXPECT_THAT(group.member(1)->allgather(mine, 2, out),
                StatusIs(StatusCode::kUnavailable, HasSubstr("the TP group broke earlier")));
    EXPECT_THAT(group.member(0)->allgather(mine, 2, out),
                StatusIs(StatusCode::kUnavailable, HasSubstr("timed out after 100 ms on rank 0")));
}

}  // namespace
}  // namespace pdsim::testbed

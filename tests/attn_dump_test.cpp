// `pdsim attn-dump`: runs the real binary, reads the .npy files back and recomputes the attention
// with an oracle written here from the documented layout only (docs/design.md "attn-dump"):
//   q, out      float32 [T, Hq, D]
//   k/v_cache   [P, page_size, Hkv, D], float32 or uint16 bf16 bits
//   page_table  int32 [B, max_pages]; seq_lens, q_lens int32 [B]
//   meta.json   mode, dtype, backend, scale, num_q_heads, num_kv_heads, head_dim, page_size
// Query tokens of sequence i are its last q_lens[i] positions, in order, attending causally; query
// head h reads KV head h / (Hq / Hkv). Metric: |out - oracle| <= tol * max(1, |oracle|), tol 1e-5
// (fp32) / 1e-2 (bf16). Also: bad flags exit 2 with a message naming the problem.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/npy.h"
#include "tests/cli_test_util.h"
#include "tests/status_matchers.h"

namespace pdsim::test {
namespace {

struct Dump {
    NpyArray q, out, k_cache, v_cache, page_table, seq_lens, q_lens;
    nlohmann::json meta;
};

::testing::AssertionResult load(const TempDir& dir, Dump* d) {
    struct Item {
        const char* file;
        NpyArray* dst;
    };
    for (Item it :
         {Item{"q.npy", &d->q}, Item{"out.npy", &d->out}, Item{"k_cache.npy", &d->k_cache},
          Item{"v_cache.npy", &d->v_cache}, Item{"page_table.npy", &d->page_table},
          Item{"seq_lens.npy", &d->seq_lens}, Item{"q_lens.npy", &d->q_lens}}) {
        auto a = read_npy(dir.str(it.file));
        if (!a.ok())
            return ::testing::AssertionFailure() << it.file << ": " << a.status().to_string();
        *it.dst = std::move(a).value();
    }
    std::ifstream f(dir.str("meta.json"));
    if (!f) return ::testing::AssertionFailure() << "meta.json missing";
    try {
        d->meta = nlohmann::json::parse(f);
    } catch (const std::exception& e) {
        return ::testing::AssertionFailure() << "meta.json: " << e.what();
    }
    return ::testing::AssertionSuccess();
}

float bf16_bits_to_float(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Checks the layout, then the attention, of one dump.
void check_dump(const Dump& d, const std::string& mode, const std::string& dtype,
                const std::string& backend) {
    // meta.json
    ASSERT_EQ(d.meta.value("mode", ""), mode);
    ASSERT_EQ(d.meta.value("dtype", ""), dtype);
    ASSERT_EQ(d.meta.value("backend", ""), backend);
    const int hq = d.meta.at("num_q_heads").get<int>();
    const int hkv = d.meta.at("num_kv_heads").get<int>();
    const int dim = d.meta.at("head_dim").get<int>();
    const int ps = d.meta.at("page_size").get<int>();
    const double scale = d.meta.at("scale").get<double>();
    ASSERT_GT(hkv, 0);
    ASSERT_EQ(hq % hkv, 0);
    EXPECT_NEAR(scale, 1.0 / std::sqrt(static_cast<double>(dim)), 1e-6);

    // Shapes and dtypes.
    ASSERT_EQ(d.q.descr, "<f4");
    ASSERT_EQ(d.out.descr, "<f4");
    ASSERT_EQ(d.k_cache.descr, dtype == "fp32" ? "<f4" : "<u2");
    ASSERT_EQ(d.v_cache.descr, d.k_cache.descr);
    ASSERT_EQ(d.page_table.descr, "<i4");
    ASSERT_EQ(d.seq_lens.descr, "<i4");
    ASSERT_EQ(d.q_lens.descr, "<i4");
    ASSERT_EQ(d.q.shape.size(), 3u);
    ASSERT_EQ(d.q.shape, d.out.shape);
    ASSERT_EQ(d.q.shape[1], hq);
    ASSERT_EQ(d.q.shape[2], dim);
    ASSERT_EQ(d.k_cache.shape.size(), 4u);
    ASSERT_EQ(d.k_cache.shape, d.v_cache.shape);
    ASSERT_EQ(d.k_cache.shape[1], ps);
    ASSERT_EQ(d.k_cache.shape[2], hkv);
    ASSERT_EQ(d.k_cache.shape[3], dim);
    ASSERT_EQ(d.page_table.shape.size(), 2u);
    const int bs = static_cast<int>(d.page_table.shape[0]);
    const int maxp = static_cast<int>(d.page_table.shape[1]);
    const int64_t num_pages = d.k_cache.shape[0];
    ASSERT_EQ(d.seq_lens.shape, std::vector<int64_t>{bs});
    ASSERT_EQ(d.q_lens.shape, std::vector<int64_t>{bs});

    const int32_t* pt = d.page_table.as<int32_t>();
    const int32_t* seq = d.seq_lens.as<int32_t>();
    const int32_t* ql = d.q_lens.as<int32_t>();
    int64_t total = 0;
    std::set<int32_t> used;
    bool non_contiguous = false;
    for (int i = 0; i < bs; ++i) {
        ASSERT_GE(ql[i], 1) << "request " << i;
        ASSERT_LE(ql[i], seq[i]) << "request " << i;
        if (mode == "decode") {
            ASSERT_EQ(ql[i], 1) << "request " << i;
        }
        total += ql[i];
        const int pages = (seq[i] + ps - 1) / ps;
        ASSERT_LE(pages, maxp) << "request " << i;
        for (int p = 0; p < pages; ++p) {
            const int32_t id = pt[i * maxp + p];
            ASSERT_GE(id, 1) << "request " << i << " page " << p << " (page 0 is the null page)";
            ASSERT_LT(id, num_pages) << "request " << i << " page " << p;
            EXPECT_TRUE(used.insert(id).second) << "page " << id << " used twice";
            if (p > 0 && id != pt[i * maxp + p - 1] + 1) non_contiguous = true;
        }
    }
    ASSERT_EQ(d.q.shape[0], total) << "tokens = sum(q_lens)";
    if (used.size() > 8) {
        EXPECT_TRUE(non_contiguous) << "page tables are expected to be shuffled";
    }

    // The oracle, fp64.
    const bool bf = dtype == "bf16";
    auto kv = [&](const NpyArray& cache, int64_t page, int slot, int h, int e) -> double {
        const size_t idx = ((static_cast<size_t>(page) * ps + slot) * hkv + h) * dim + e;
        return bf ? bf16_bits_to_float(cache.as<uint16_t>()[idx]) : cache.as<float>()[idx];
    };
    const float* q = d.q.as<float>();
    const float* out = d.out.as<float>();
    const double tol = bf ? 1e-2 : 1e-5;
    int token = 0, bad = 0;
    double worst = 0;
    std::vector<double> sc;
    for (int i = 0; i < bs; ++i) {
        for (int j = 0; j < ql[i]; ++j, ++token) {
            const int pos = seq[i] - ql[i] + j;
            for (int h = 0; h < hq; ++h) {
                const int kh = h / (hq / hkv);
                const float* qv = q + (static_cast<size_t>(token) * hq + h) * dim;
                sc.assign(static_cast<size_t>(pos) + 1, 0.0);
                double mx = -1e300;
                for (int t = 0; t <= pos; ++t) {
                    const int64_t page = pt[i * maxp + t / ps];
                    double dot = 0;
                    for (int e = 0; e < dim; ++e) dot += qv[e] * kv(d.k_cache, page, t % ps, kh, e);
                    sc[static_cast<size_t>(t)] = dot * scale;
                    mx = std::max(mx, sc[static_cast<size_t>(t)]);
                }
                double sum = 0;
                for (double& x : sc) sum += (x = std::exp(x - mx));
                for (int e = 0; e < dim; ++e) {
                    double acc = 0;
                    for (int t = 0; t <= pos; ++t) {
                        acc += sc[static_cast<size_t>(t)] *
                               kv(d.v_cache, pt[i * maxp + t / ps], t % ps, kh, e);
                    }
                    const double want = acc / sum;
                    const double got = out[(static_cast<size_t>(token) * hq + h) * dim + e];
                    const double err = std::fabs(got - want) / std::max(1.0, std::fabs(want));
                    if (!(err <= tol)) {
                        if (bad++ < 5) {
                            ADD_FAILURE() << "request " << i << " position " << pos << " of "
                                          << seq[i] << " head " << h << " elem " << e << ": out "
                                          << got << ", oracle " << want;
                        }
                    }
                    if (std::isfinite(err)) worst = std::max(worst, err);
                }
            }
        }
    }
    EXPECT_EQ(bad, 0) << "out.npy elements off the oracle (worst relative error " << worst << ")";
}

struct DumpCase {
    std::string mode, dtype;
    uint64_t seed;
    std::vector<std::string> extra;  // more flags
    std::string backend = "cpu";
};

class AttnDump : public ::testing::TestWithParam<DumpCase> {};

TEST_P(AttnDump, OutputMatchesIndependentOracle) {
    const DumpCase& c = GetParam();
    TempDir dir("attn_dump");
    std::vector<std::string> args{"attn-dump", "--out",  dir.str(),
                                  "--mode",    c.mode,   "--dtype",
                                  c.dtype,     "--seed", std::to_string(c.seed)};
    if (c.backend != "cpu") {
        args.push_back("--backend");
        args.push_back(c.backend);
    }
    args.insert(args.end(), c.extra.begin(), c.extra.end());
    CmdResult r = run_pdsim(args);
    ASSERT_EQ(r.rc, 0) << r.describe();
    Dump d;
    ASSERT_TRUE(load(dir, &d));
    check_dump(d, c.mode, c.dtype, c.backend);
}

std::vector<DumpCase> dump_cases() {
    std::vector<DumpCase> v;
    for (const char* mode : {"decode", "extend"}) {
        for (const char* dtype : {"fp32", "bf16"}) {
            for (uint64_t seed : {1, 7, 12345}) v.push_back({mode, dtype, seed, {}});
        }
    }
    v.push_back({"extend",
                 "fp32",
                 3,
                 {"--page-size", "1", "--q-heads", "4", "--kv-heads", "4", "--head-dim", "128",
                  "--batch", "5", "--max-seq-len", "100"}});
    v.push_back({"decode",
                 "bf16",
                 4,
                 {"--page-size", "64", "--q-heads", "16", "--kv-heads", "2", "--batch", "4",
                  "--max-seq-len", "2000"}});
    v.push_back({"extend",
                 "bf16",
                 5,
                 {"--page-size", "16", "--q-heads", "8", "--kv-heads", "1", "--head-dim", "128",
                  "--batch", "1", "--max-seq-len", "1"}});
    v.push_back({"extend", "fp32", 6, {}, "cpu_ref"});
    v.push_back({"decode", "bf16", 6, {}, "cpu_ref"});
    return v;
}

std::string case_name(const ::testing::TestParamInfo<DumpCase>& info) {
    return info.param.mode + "_" + info.param.dtype + "_seed" + std::to_string(info.param.seed) +
           (info.param.extra.empty() ? "" : "_shape" + std::to_string(info.index)) + "_" +
           info.param.backend;
}

INSTANTIATE_TEST_SUITE_P(Cases, AttnDump, ::testing::ValuesIn(dump_cases()), case_name);

TEST(AttnDumpCli, SameSeedSameCaseOtherSeedOtherCase) {
    TempDir a("attn_dump_a"), b("attn_dump_b"), c("attn_dump_c");
    for (const TempDir* d : {&a, &b}) {
        CmdResult r =
            run_pdsim({"attn-dump", "--out", d->str(), "--seed", "42", "--mode", "decode"});
        ASSERT_EQ(r.rc, 0) << r.describe();
    }
    CmdResult r = run_pdsim({"attn-dump", "--out", c.str(), "--seed", "43", "--mode", "decode"});
    ASSERT_EQ(r.rc, 0) << r.describe();
    for (const char* f : {"q.npy", "k_cache.npy", "page_table.npy", "seq_lens.npy", "out.npy"}) {
        EXPECT_EQ(slurp(a.path() / f), slurp(b.path() / f)) << f << ": same seed, different bytes";
    }
    EXPECT_NE(slurp(a.path() / "q.npy"), slurp(c.path() / "q.npy"))
        << "seeds 42 and 43 drew the same q";
}

// The oracle can fail: a dump with one output element nudged past the tolerance, or with a
// page-table entry pointing at an unused page, is rejected.
int failures_of(const Dump& d, const std::string& mode, const std::string& dtype) {
    ::testing::TestPartResultArray results;
    {
        ::testing::ScopedFakeTestPartResultReporter reporter(
            ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
        check_dump(d, mode, dtype, "cpu");
    }
    return results.size();
}

TEST(AttnDumpCli, OracleRejectsACorruptedDump) {
    for (const char* dtype : {"fp32", "bf16"}) {
        TempDir dir("attn_dump_corrupt");
        CmdResult r = run_pdsim(
            {"attn-dump", "--out", dir.str(), "--mode", "extend", "--dtype", dtype, "--seed", "9"});
        ASSERT_EQ(r.rc, 0) << r.describe();
        Dump d;
        ASSERT_TRUE(load(dir, &d));
        ASSERT_EQ(failures_of(d, "extend", dtype), 0) << "the untouched dump must pass";

        Dump nudged = d;
        const double tol = std::string(dtype) == "bf16" ? 1e-2 : 1e-5;
        auto* out = reinterpret_cast<float*>(nudged.out.data.data());
        const size_t idx = static_cast<size_t>(nudged.out.count() / 2);
        out[idx] += static_cast<float>(3 * tol * std::max(1.0f, std::fabs(out[idx])));
        EXPECT_GT(failures_of(nudged, "extend", dtype), 0)
            << dtype << ": a nudged output element passed";

        // Attention is invariant under permuting keys, so swapping a request's pages proves
        // nothing: point its first page at a spare page no request uses (attn-dump leaves a few).
        Dump swapped = d;
        auto* pt = reinterpret_cast<int32_t*>(swapped.page_table.data.data());
        const int ps = d.meta.at("page_size").get<int>();
        const int64_t maxp = d.page_table.shape[1];
        std::set<int32_t> used;
        for (int64_t i = 0; i < d.seq_lens.shape[0]; ++i) {
            for (int p = 0; p < (d.seq_lens.as<int32_t>()[i] + ps - 1) / ps; ++p)
                used.insert(pt[i * maxp + p]);
        }
        int32_t spare = 1;
        while (used.count(spare) != 0) ++spare;
        ASSERT_LT(spare, d.k_cache.shape[0]);
        pt[0] = spare;
        EXPECT_GT(failures_of(swapped, "extend", dtype), 0)
            << dtype << ": a dump with a wrong page passed";
    }
}

void expect_bad(const std::vector<std::string>& args, const std::vector<std::string>& must_mention,
                const TempDir* dir = nullptr) {
    CmdResult r = run_pdsim(args);
    std::string joined;
    for (const auto& a : args) joined += a + " ";
    EXPECT_EQ(r.rc, 2) << "pdsim " << joined << "\n" << r.describe();
    EXPECT_FALSE(r.err.empty()) << "pdsim " << joined << ": no message on stderr";
    for (const auto& m : must_mention) {
        EXPECT_THAT(r.err, HasSubstr(m))
            << "pdsim " << joined << ": stderr does not mention '" << m << "'\n"
            << r.err;
    }
    if (dir != nullptr) {
        EXPECT_FALSE(std::filesystem::exists(dir->path() / "out.npy"))
            << "pdsim " << joined << " wrote output";
    }
}

TEST(AttnDumpCli, BadFlagsExit2WithAMessage) {
    TempDir dir("attn_dump_bad");
    expect_bad({"attn-dump", "--out", dir.str(), "--mode", "foo"}, {"--mode", "foo"}, &dir);
    expect_bad({"attn-dump", "--mode", "decode"}, {"--out"});
    expect_bad({"attn-dump", "--out", dir.str(), "--q-heads", "6", "--kv-heads", "4"}, {"6", "4"},
               &dir);
    expect_bad({"attn-dump", "--out", dir.str(), "--dtype", "fp16"}, {"--dtype", "fp16"}, &dir);
    expect_bad({"attn-dump", "--out", dir.str(), "--backend", "no_such_backend"},
               {"no_such_backend"}, &dir);
    expect_bad({"attn-dump", "--out", dir.str(), "--seed", "banana"}, {"--seed"}, &dir);
    expect_bad({"attn-dump", "--out", dir.str(), "--batch", "0"}, {"--batch"}, &dir);
}

}  // namespace
}  // namespace pdsim::test

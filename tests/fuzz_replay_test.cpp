// The libFuzzer targets (fuzz/targets/) in the normal build: every seed (fuzz/seeds/<target>/,
// the repository's real inputs the fuzz script seeds from) and every crash regression
// (fuzz/regressions/<target>/) is fed through the same target function the fuzzer runs, so the
// inputs that once crashed a parser run everywhere, under every sanitizer build, without clang.
// A target's invariant failure traps (fuzz/fuzz_target.h): the test dies naming the file.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#define PDSIM_FUZZ_DECLARE(name) int pdsim_fuzz_##name(const uint8_t* data, size_t size);
PDSIM_FUZZ_DECLARE(topology_loader_fuzz)
PDSIM_FUZZ_DECLARE(trace_jsonl_fuzz)
PDSIM_FUZZ_DECLARE(trace_azure_fuzz)
PDSIM_FUZZ_DECLARE(model_file_fuzz)
PDSIM_FUZZ_DECLARE(cost_file_fuzz)
PDSIM_FUZZ_DECLARE(tcp_frame_fuzz)
PDSIM_FUZZ_DECLARE(control_codec_fuzz)
PDSIM_FUZZ_DECLARE(testbed_protocol_fuzz)
PDSIM_FUZZ_DECLARE(journal_fuzz)
#undef PDSIM_FUZZ_DECLARE

namespace {

namespace fs = std::filesystem;
using Target = int (*)(const uint8_t*, size_t);

struct Case {
    const char* name;
    Target target;
    // The repository's real inputs of the target's format (besides fuzz/seeds and regressions).
    std::vector<std::pair<std::string, std::string>> real;  // directory, extension
};

std::string read_file(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The first `lines` lines of a (large) trace.
std::string head(const fs::path& p, int lines) {
    std::ifstream in(p, std::ios::binary);
    std::string out, line;
    for (int i = 0; i < lines && std::getline(in, line); ++i) out += line + "\n";
    return out;
}

int replay(const Case& c) {
    const fs::path root(PDSIM_SOURCE_DIR);
    int fed = 0;
    auto feed = [&](const fs::path& p, const std::string& bytes) {
        SCOPED_TRACE(p.string());
        std::fprintf(stderr, "%s: %s\n", c.name, p.string().c_str());
        c.target(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
        ++fed;
    };
    for (const char* kind : {"seeds", "regressions"}) {
        const fs::path dir = root / "fuzz" / kind / c.name;
        if (!fs::is_directory(dir)) continue;
        for (const auto& e : fs::directory_iterator(dir)) feed(e.path(), read_file(e.path()));
    }
    for (const auto& [dir, ext] : c.real) {
        for (const auto& e : fs::directory_iterator(root / dir)) {
            if (e.path().extension() != ext) continue;
            const bool trace = ext == ".jsonl" || ext == ".csv";
            feed(e.path(), trace ? head(e.path(), 200) : read_file(e.path()));
        }
    }
    return fed;
}

class FuzzReplay : public ::testing::TestWithParam<Case> {};

TEST_P(FuzzReplay, SeedsAndRegressionsRunClean) {
    EXPECT_GT(replay(GetParam()), 0) << "no seed found for " << GetParam().name;
}

INSTANTIATE_TEST_SUITE_P(
    Targets, FuzzReplay,
    ::testing::Values(
        Case{"topology_loader_fuzz",
             pdsim_fuzz_topology_loader_fuzz,
             {{"topology/examples", ".yaml"}, {"tests/data/topology/bad", ".yaml"}}},
        Case{"trace_jsonl_fuzz", pdsim_fuzz_trace_jsonl_fuzz, {{"data/traces", ".jsonl"}}},
        Case{"trace_azure_fuzz", pdsim_fuzz_trace_azure_fuzz, {{"data/traces", ".csv"}}},
        Case{"model_file_fuzz", pdsim_fuzz_model_file_fuzz, {{"data/models", ".yaml"}}},
        Case{"cost_file_fuzz", pdsim_fuzz_cost_file_fuzz, {}},
        Case{"tcp_frame_fuzz", pdsim_fuzz_tcp_frame_fuzz, {}},
        Case{"control_codec_fuzz", pdsim_fuzz_control_codec_fuzz, {}},
        Case{"testbed_protocol_fuzz", pdsim_fuzz_testbed_protocol_fuzz, {}},
        Case{"journal_fuzz", pdsim_fuzz_journal_fuzz, {}}),
    [](const ::testing::TestParamInfo<Case>& param_info) {
        return std::string(param_info.param.name);
    });

}  // namespace

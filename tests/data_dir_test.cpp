// The shipped data (common/data_dir.h): the lookup order, $PDSIM_DATA_DIR's strictness, bare names
// for --topology / --model / --trace, and that every shipped file loads.
#include "common/data_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "backends/model/model_config.h"
#include "sim/workload/workload.h"
#include "tests/status_matchers.h"
#include "topology/loader.h"

namespace pdsim::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const fs::path kSource = PDSIM_SOURCE_DIR;

// Sets PDSIM_DATA_DIR for one test and restores the previous value.
class ScopedDataDir {
public:
    explicit ScopedDataDir(const char* value) {
        if (const char* old = std::getenv("PDSIM_DATA_DIR")) old_ = old;
        if (value != nullptr) {
            ::setenv("PDSIM_DATA_DIR", value, 1);
        } else {
            ::unsetenv("PDSIM_DATA_DIR");
        }
    }
    ~ScopedDataDir() {
        if (old_.empty()) {
            ::unsetenv("PDSIM_DATA_DIR");
        } else {
            ::setenv("PDSIM_DATA_DIR", old_.c_str(), 1);
        }
    }

private:
    std::string old_;
};

fs::path fresh_dir(const std::string& name) {
    fs::path d =
        fs::temp_directory_path() / fmt::format("pdsim-data-dir-test-{}-{}", name, ::getpid());
    fs::remove_all(d);
    fs::create_directories(d);
    return d;
}

TEST(DataDir, SourceTreeFirstThenInstallPrefix) {
    ScopedDataDir env(nullptr);
    auto path = data_search_path(DataKind::kTraces);
    ASSERT_GE(path.size(), 2u);
    EXPECT_EQ(path[0].path, (kSource / "data/traces").string());
    EXPECT_EQ(path[0].origin, "source tree");
    EXPECT_EQ(path[1].origin, "install prefix");
    EXPECT_THAT(path[1].path, HasSubstr("share/pdsim/traces"));
    EXPECT_EQ(data_search_path(DataKind::kTopologies)[0].path,
              (kSource / "topology/examples").string());
    EXPECT_EQ(data_search_path(DataKind::kModels)[0].path, (kSource / "data/models").string());

    auto traces = find_data_dir(DataKind::kTraces);
    ASSERT_OK(traces);
    EXPECT_EQ(*traces, (kSource / "data/traces").string());
    auto mooncake = find_data_file(DataKind::kTraces, "mooncake_conversation.jsonl");
    ASSERT_OK(mooncake);
    EXPECT_TRUE(fs::is_regular_file(*mooncake));
}

TEST(DataDir, EnvironmentOverridesAndIsStrict) {
    const fs::path root = fresh_dir("env");
    fs::create_directories(root / "traces");
    std::ofstream(root / "traces" / "mine.csv") << "TIMESTAMP,ContextTokens,GeneratedTokens\n";
    {
        ScopedDataDir env(root.c_str());
        auto traces = find_data_dir(DataKind::kTraces);
        ASSERT_OK(traces);
        EXPECT_EQ(*traces, (root / "traces").string());
        ASSERT_EQ(data_search_path(DataKind::kTraces).size(), 1u);
        EXPECT_EQ(data_search_path(DataKind::kTraces)[0].origin, "$PDSIM_DATA_DIR");

        // Set but without topologies/: an error naming the variable and the folder, not the
        // source tree's copy.
        auto topologies = find_data_dir(DataKind::kTopologies);
        ASSERT_FALSE(topologies.ok());
        EXPECT_EQ(topologies.status().code(), StatusCode::kInvalidArgument);
        EXPECT_THAT(topologies.status().message(), HasSubstr("PDSIM_DATA_DIR="));
        EXPECT_THAT(topologies.status().message(), HasSubstr("topologies/"));

        auto missing = find_data_file(DataKind::kTraces, "mooncake_conversation.jsonl");
        ASSERT_FALSE(missing.ok());
        EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
        EXPECT_THAT(missing.status().message(), HasSubstr("mooncake_conversation.jsonl"));
        EXPECT_EQ(resolve_data_file(DataKind::kTraces, "mine"),
                  (root / "traces/mine.csv").string());
    }
    {
        ScopedDataDir env((root / "no-such-dir").c_str());
        auto st = find_data_dir(DataKind::kTraces);
        ASSERT_FALSE(st.ok());
        EXPECT_EQ(st.status().code(), StatusCode::kInvalidArgument);
        EXPECT_THAT(st.status().message(), HasSubstr("not a directory"));
    }
    fs::remove_all(root);
}

TEST(DataDir, BareNamesResolveToShippedFiles) {
    ScopedDataDir env(nullptr);
    EXPECT_EQ(resolve_data_file(DataKind::kTopologies, "cpu-1p1d"),
              (kSource / "topology/examples/cpu-1p1d.yaml").string());
    EXPECT_EQ(resolve_data_file(DataKind::kTopologies, "cpu-1p1d.yaml"),
              (kSource / "topology/examples/cpu-1p1d.yaml").string());
    EXPECT_EQ(resolve_data_file(DataKind::kTraces, "azure_llm_code"),
              (kSource / "data/traces/azure_llm_code.csv").string());
    // A path (a '/'), an unknown name and the empty string come back unchanged.
    EXPECT_EQ(resolve_data_file(DataKind::kTopologies, "./cpu-1p1d"), "./cpu-1p1d");
    EXPECT_EQ(resolve_data_file(DataKind::kTopologies, "no-such-topology"), "no-such-topology");
    EXPECT_EQ(resolve_data_file(DataKind::kModels, ""), "");

    auto topo = topo::load_topology("cpu-1p2d");
    ASSERT_OK(topo);
    EXPECT_EQ(topo->name, "cpu-1p2d");
    auto missing = topo::load_topology("no-such-topology");
    ASSERT_FALSE(missing.ok());
    EXPECT_THAT(missing.status().message(), HasSubstr("no-such-topology"));

    auto trace =
        workload::load_trace("azure_llm_code", workload::TraceFormat::kAuto, {.max_requests = 10});
    ASSERT_OK(trace);
    EXPECT_EQ(trace->size(), 10u);

    auto model = model::resolve_model("llama3-8b-4l");
    ASSERT_OK(model);
    EXPECT_EQ(model->num_layers, 4);
    EXPECT_EQ(model->hidden, 4096);
    auto unknown = model::resolve_model("no-such-model");
    ASSERT_FALSE(unknown.ok());
    EXPECT_THAT(unknown.status().message(), HasSubstr("llama3-8b-4l"));  // lists shipped files
}

TEST(DataDir, EveryShippedFileLoads) {
    ScopedDataDir env(nullptr);
    int models = 0, topologies = 0, traces = 0;
    for (const auto& e : fs::directory_iterator(kSource / "data/models")) {
        if (e.path().extension() != ".yaml") continue;
        auto m = model::resolve_model(e.path().string());
        EXPECT_OK(m) << e.path() << ": " << m.status().to_string();
        ++models;
    }
    for (const auto& e : fs::directory_iterator(kSource / "topology/examples")) {
        auto t = topo::load_topology(e.path().string());
        EXPECT_OK(t) << e.path() << ": " << t.status().to_string();
        ++topologies;
    }
    for (const auto& e : fs::directory_iterator(kSource / "data/traces")) {
        const std::string ext = e.path().extension().string();
        if (ext != ".jsonl" && ext != ".csv") continue;
        auto t = workload::load_trace(e.path().string(), workload::TraceFormat::kAuto, {});
        ASSERT_OK(t) << e.path() << ": " << t.status().to_string();
        EXPECT_GT(t->size(), 1000u) << e.path();
        ++traces;
    }
    EXPECT_GE(models, 1);
    EXPECT_GE(topologies, 6);
    EXPECT_EQ(traces, 3);  // mooncake_conversation, azure_llm_code, azure_llm_conv
}

}  // namespace
}  // namespace pdsim::data

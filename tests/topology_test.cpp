// topology/: loader (YAML and JSON), error format, path queries with hand-checked bottlenecks,
// rank map, TP overlap, shaping math, GPU spec table, builders (and that the generated examples
// equal them), to_yaml round trips, and robustness of the parsers on hostile input.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>

#include "tests/status_matchers.h"
#include "topology/builders.h"
#include "topology/loader.h"
#include "topology/report.h"
#include "topology/shaping.h"
#include "topology/validate.h"

namespace pdsim::topo {
namespace {

namespace fs = std::filesystem;

const std::string kExamples = std::string(PDSIM_SOURCE_DIR) + "/topology/examples";

std::string read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

constexpr const char* kSmallYaml = R"(name: small
model: tiny
nodes:
  - id: node0
    hostname: localhost
    cpus: 4
    devices:
      - {id: node0.cpu0, type: cpu}
      - {id: node0.cpu1, type: cpu}
      - {id: node0.cpu2, type: cpu}
    switches:
      - {id: node0.shm, type: loopback}
links:
  - {a: node0.cpu0, b: node0.shm, type: loopback, gbps: 10, latency_us: 1}
  - {a: node0.cpu1, b: node0.shm, type: loopback, gbps: 20, latency_us: 2}
  - {a: node0.cpu2, b: node0.shm, type: loopback, gbps: 30, latency_us: 0.5}
instances:
  - {id: decode0, role: decode, tp: 1, devices: [node0.cpu2]}
  - id: prefill0
    role: prefill
    tp: 2
    devices: [node0.cpu0, node0.cpu1]
)";

constexpr const char* kSmallJson = R"({
  "name": "small",
  "model": "tiny",
  "nodes": [
    {"id": "node0", "hostname": "localhost", "cpus": 4,
     "devices": [{"id": "node0.cpu0", "type": "cpu"}, {"id": "node0.cpu1", "type": "cpu"},
                 {"id": "node0.cpu2", "type": "cpu"}],
     "switches": [{"id": "node0.shm", "type": "loopback"}]}
  ],
  "links": [
    {"a": "node0.cpu0", "b": "node0.shm", "type": "loopback", "gbps": 10, "latency_us": 1},
    {"a": "node0.cpu1", "b": "node0.shm", "type": "loopback", "gbps": 20.0, "latency_us": 2},
    {"a": "node0.cpu2", "b": "node0.shm", "type": "loopback", "gbps": 30, "latency_us": 0.5}
  ],
  "instances": [
    {"id": "decode0", "role": "decode", "tp": 1, "devices": ["node0.cpu2"]},
    {"id": "prefill0", "role": "prefill", "tp": 2, "devices": ["node0.cpu0", "node0.cpu1"]}
  ]
}
)";

// ---- GPU spec table and model shapes ----

TEST(GpuSpec, TableValuesAndAliases) {
    ASSERT_EQ(gpu_specs().size(), 5u);
    const GpuSpec* h100 = gpu_spec("H100");
    ASSERT_NE(h100, nullptr);
    EXPECT_EQ(h100->bf16_tflops, 989.0);
    EXPECT_EQ(h100->hbm_gbps, 3350.0);
    EXPECT_EQ(h100->hbm_gib, 80.0);
    EXPECT_EQ(h100->nvlink_gbps, 450.0);
    EXPECT_EQ(gpu_spec("h100-sxm"), h100);
    EXPECT_EQ(gpu_spec("H100 SXM5"), h100);
    EXPECT_EQ(gpu_spec("h100_sxm"), h100);
    EXPECT_EQ(gpu_spec("H300"), nullptr);
    EXPECT_EQ(gpu_spec(""), nullptr);
    EXPECT_EQ(gpu_spec("cpu"), nullptr);
    EXPECT_EQ(gpu_spec("A100")->nvlink_gbps, 300.0);
    EXPECT_EQ(gpu_spec("H200")->hbm_gbps, 4800.0);
    EXPECT_EQ(gpu_spec("B200")->bf16_tflops, 2250.0);
    EXPECT_EQ(gpu_spec("GB200")->nvlink_gbps, 900.0);
    for (const GpuSpec& g : gpu_specs()) {
        EXPECT_EQ(gpu_spec(g.name), &g);
        EXPECT_GT(g.bf16_tflops, 0);
        EXPECT_GT(g.hbm_gbps, 0);
        EXPECT_GT(g.hbm_gib, 0);
        EXPECT_GT(g.nvlink_gbps, g.pcie_gbps);
    }
}

TEST(GpuSpec, Roofline) {
    const GpuSpec& h = *gpu_spec("H100");
    // Compute-bound: 989e12 flops take 1 s; memory-bound: 3350e9 bytes take 1 s.
    EXPECT_DOUBLE_EQ(roofline_time_s(h, 989e12, 1.0), 1.0);
    EXPECT_DOUBLE_EQ(roofline_time_s(h, 1.0, 3350e9 * 2), 2.0);
}

TEST(ModelShape, BuiltinsAndTpRule) {
    const ModelShape* l8 = builtin_model_shape("llama3-8b");
    ASSERT_NE(l8, nullptr);
    EXPECT_EQ(l8->num_kv_heads, 8);
    EXPECT_EQ(check_tp(*l8, 8), "");
    EXPECT_EQ(check_tp(*l8, 4), "");
    EXPECT_EQ(check_tp(*l8, 3), "3 does not divide num_kv_heads 8");
    EXPECT_EQ(check_tp(*l8, 16), "16 does not divide num_kv_heads 8");
    EXPECT_NE(check_tp(*l8, 0), "");
    const ModelShape* ds = builtin_model_shape("deepseek-v3");
    ASSERT_NE(ds, nullptr);
    EXPECT_EQ(ds->attention, AttentionKind::kMla);
    EXPECT_EQ(check_tp(*ds, 16), "");  // the latent buffer is replicated
    EXPECT_EQ(check_tp(*ds, 3), "3 does not divide num_q_heads 128");
    EXPECT_EQ(ds->kv_bytes_per_token_layer(2), (512 + 64) * 2);
    EXPECT_EQ(l8->kv_bytes_per_token_layer(2), 2 * 8 * 128 * 2);
    EXPECT_EQ(builtin_model_shape("nope"), nullptr);
    ASSERT_NE(builtin_model_shape("tiny"), nullptr);
}

// ---- loader ----

TEST(Loader, ParsesYamlWithDefaultsAndLines) {
    auto t = parse_topology(kSmallYaml, "small.yaml");
    ASSERT_OK(t);
    EXPECT_EQ(t->name, "small");
    ASSERT_TRUE(t->model.has_value());
    EXPECT_EQ(t->model->name, "tiny");
    ASSERT_EQ(t->nodes.size(), 1u);
    EXPECT_EQ(t->nodes[0].hostname, "localhost");
    EXPECT_EQ(t->nodes[0].cpus, 4);
    EXPECT_EQ(t->nodes[0].devices.size(), 3u);
    EXPECT_EQ(t->nodes[0].devices[0].index, -1);
    EXPECT_TRUE(t->nodes[0].devices[0].is_cpu());
    ASSERT_EQ(t->links.size(), 3u);
    EXPECT_EQ(t->links[1].gbps, 20.0);
    EXPECT_EQ(t->links[2].latency_us, 0.5);
    ASSERT_EQ(t->instances.size(), 2u);
    EXPECT_EQ(t->instances[1].role, Role::kPrefill);
    EXPECT_EQ(t->instances[1].tp, 2);
    EXPECT_FALSE(t->world_size.has_value());
    EXPECT_FALSE(t->shaping.has_value());
    EXPECT_EQ(t->source.line_of("instances[1].tp"), 21);
    EXPECT_EQ(t->source.line_of("links[2].gbps"), 16);
    EXPECT_EQ(t->source.line_of("links[2]"), 16);
    EXPECT_EQ(t->source.where("instances[1].tp"), "small.yaml:21: instances[1].tp");
    // An unknown path falls back to its nearest known ancestor.
    EXPECT_EQ(t->source.line_of("instances[1].nothing"), 19);
}

TEST(Loader, JsonEqualsYamlAndKnowsLines) {
    auto y = parse_topology(kSmallYaml, "small.yaml");
    auto j = parse_topology(kSmallJson, "small.json");
    ASSERT_OK(y);
    ASSERT_OK(j);
    EXPECT_EQ(*y, *j);
    // Format detection by content too.
    auto j2 = parse_topology(kSmallJson, "<stdin>");
    ASSERT_OK(j2);
    EXPECT_EQ(*y, *j2);
    EXPECT_EQ(j->source.line_of("links[1].gbps"), 12);
    EXPECT_EQ(j->source.line_of("instances[1].tp"), 17);
}

TEST(Loader, ErrorFormatIsFileLinePathWhat) {
    std::string text = kSmallYaml;
    text.replace(text.find("tp: 2"), 5, "tp: 3");
    auto t = parse_topology(text, "dir/x.yaml", Format::kAuto);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(t.status().message(),
              "dir/x.yaml:22: instances[1].devices: lists 2 devices for tp 3 (one device per TP "
              "rank)");
}

TEST(Loader, JsonErrorsCarryPathAndLine) {
    std::string text = kSmallJson;
    text.replace(text.find("\"gbps\": 20.0"), 12, "\"gbps\": -20");
    auto t = parse_topology(text, "x.json");
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().message(), "x.json:12: links[1].gbps: must be positive, got -20");

    auto syntax = parse_topology("{\n  \"nodes\": [\n  ,]\n}\n", "s.json");
    ASSERT_FALSE(syntax.ok());
    EXPECT_EQ(syntax.status().message().rfind("s.json:3: JSON syntax error", 0), 0u)
        << syntax.status().message();

    auto dup = parse_topology("{\"nodes\": [{\"id\": \"a\", \"id\": \"b\"}]}", "d.json");
    ASSERT_FALSE(dup.ok());
    EXPECT_THAT(dup.status().message(), HasSubstr("nodes[0].id: duplicate key"));

    auto unknown = parse_topology("{\"nodes\": [], \"instancez\": []}", "u.json");
    ASSERT_FALSE(unknown.ok());
    EXPECT_THAT(unknown.status().message(), HasSubstr("u.json:1: instancez: unknown key"));
}

TEST(Loader, TypeErrors) {
    auto expect_error = [](const std::string& text, const std::string& what) {
        auto t = parse_topology(text, "t.yaml");
        ASSERT_FALSE(t.ok()) << text;
        EXPECT_THAT(t, StatusIs(StatusCode::kInvalidArgument, HasSubstr(what)))
            << t.status().message();
    };
    expect_error("[1, 2]", "t.yaml:1: (document): expected a mapping, got a list");
    expect_error("just a string", "(document): expected a mapping");
    expect_error("", "(document): empty document");
    expect_error("nodes: 3\ninstances: []\n", "t.yaml:1: nodes: expected a list");
    expect_error("nodes: [{id: [a], devices: []}]\ninstances: []\n",
                 "nodes[0].id: expected a string");
    expect_error("nodes: [{id: a, devices: [{id: d, type: cpu, index: -1}]}]\ninstances: []\n",
                 "nodes[0].devices[0].index: must be >= 0");
    expect_error("nodes: []\ninstances: []\nworld_size: 2.5\n", "world_size: expected an integer");
    expect_error("nodes: []\ninstances: []\nshaping: {gbps: 1e999, latency_us: 1}\n",
                 "shaping.gbps: 1e999 is out of range");
    expect_error("nodes: []\ninstances: []\n", "nodes: at least one node is required");
    expect_error("? [a, b]\n: 1\n", "mapping keys must be plain strings");
    expect_error("nodes: [\n", "YAML syntax error");
}

TEST(Loader, LoadTopologyNamesFromStemAndRejectsMissingFiles) {
    const fs::path dir = fs::temp_directory_path() / "pdsim_topology_test";
    fs::create_directories(dir);
    std::string text = kSmallYaml;
    text.erase(0, text.find('\n') + 1);  // drop `name:`
    { std::ofstream(dir / "unnamed.yaml") << text; }
    auto t = load_topology((dir / "unnamed.yaml").string());
    ASSERT_OK(t);
    EXPECT_EQ(t->name, "unnamed");
    auto missing = load_topology((dir / "nope.yaml").string());
    ASSERT_FALSE(missing.ok());
    EXPECT_THAT(missing, StatusIs(StatusCode::kInvalidArgument, HasSubstr("cannot open")));
    auto is_dir = load_topology(dir.string());
    ASSERT_FALSE(is_dir.ok());
}

TEST(Loader, ModelMappingWithBaseAndOverrides) {
    std::string text = kSmallYaml;
    text.replace(text.find("model: tiny"), 11,
                 "model: {base: llama3-8b, name: small8b, num_layers: 2, vocab: 99}");
    auto t = parse_topology(text, "m.yaml", Format::kYaml, {.validate = false});
    ASSERT_OK(t);
    EXPECT_EQ(t->model->name, "small8b");
    EXPECT_EQ(t->model->num_layers, 2);
    EXPECT_EQ(t->model->num_kv_heads, 8);
    EXPECT_EQ(t->model->vocab, 99);  // the synthetic model's fields are read too
    EXPECT_EQ(t->model->intermediate, builtin_model_shape("llama3-8b")->intermediate);
    // tp 2 divides llama3-8b's 8 KV heads.
    EXPECT_OK(validate(*t));

    text = kSmallYaml;
    text.replace(text.find("model: tiny"), 11,
                 "model: {name: mla, attention: mla, num_layers: 2, num_q_heads: 4, head_dim: 8, "
                 "kv_lora_rank: 16, rope_dim: 4}");
    t = parse_topology(text, "m.yaml");
    ASSERT_OK(t);
    EXPECT_EQ(t->model->num_kv_heads, 1);
    EXPECT_EQ(t->model->attention, AttentionKind::kMla);

    // Every field of a model file is read, none ignored; a bad one names its line.
    text = kSmallYaml;
    text.replace(text.find("model: tiny"), 11,
                 "model: {base: tiny, intermediate: 640, rope_theta: 500000.0, rms_eps: 0.001, "
                 "seed: 9, layer_kinds: [full, sliding, recurrent], sliding_window: 32, "
                 "state_heads: 4, state_head_dim: 32, conv_kernel: 3}");
    t = parse_topology(text, "m.yaml");
    ASSERT_OK(t);
    EXPECT_EQ(t->model->intermediate, 640);
    EXPECT_DOUBLE_EQ(t->model->rope_theta, 500000.0);
    EXPECT_FLOAT_EQ(t->model->rms_eps, 0.001f);
    EXPECT_EQ(t->model->seed, 9u);
    EXPECT_EQ(t->model->layer_kinds,
              (std::vector<LayerKind>{LayerKind::kFullAttention, LayerKind::kSlidingWindow,
                                      LayerKind::kRecurrent}));
    EXPECT_EQ(t->model->sliding_window, 32);
    EXPECT_EQ(t->model->state_heads, 4);
    EXPECT_EQ(t->model->state_head_dim, 32);
    EXPECT_EQ(t->model->conv_kernel, 3);
    // tiny has 4 layers: full, sliding, recurrent, full. A recurrent layer's state per request
    // and rank: 4 / tp heads x (32 * 32 + 2 taps x 3 x 32 channels) fp32.
    EXPECT_EQ(t->model->count_layers(LayerKind::kRecurrent), 1);
    EXPECT_EQ(t->model->count_layers(LayerKind::kFullAttention), 2);
    EXPECT_EQ(t->model->state_elems_per_request_layer(2), 2 * (1024 + 192));
    EXPECT_EQ(t->model->state_bytes_per_request(), 4 * (1024 + 192) * 4);
    EXPECT_EQ(check_tp(*t->model, 4), "");
    text = kSmallYaml;
    text.replace(text.find("model: tiny"), 11, "model: {base: tiny, layer_kinds: [full, local]}");
    EXPECT_THAT(
        parse_topology(text, "m.yaml"),
        StatusIs(StatusCode::kInvalidArgument,
                 HasSubstr("m.yaml:2: model.layer_kinds[1]: expected full, sliding or recurrent, "
                           "got \"local\"")));
    // TP must split the state heads too.
    ModelShape three_states = *t->model;
    three_states.state_heads = 3;
    EXPECT_EQ(check_tp(three_states, 2), "2 does not divide state_heads 3");
}

TEST(Validate, ModelOverride) {
    auto t = parse_topology(kSmallYaml, "small.yaml");
    ASSERT_OK(t);
    EXPECT_OK(validate(*t, builtin_model_shape("llama3-70b")));
    ModelShape odd{.name = "odd",
                   .num_layers = 2,
                   .num_q_heads = 3,
                   .num_kv_heads = 3,
                   .head_dim = 64,
                   .hidden = 0,
                   .attention = AttentionKind::kMha};
    Status st = validate(*t, &odd);
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.message(),
              "small.yaml:21: instances[1].tp: 2 does not divide num_kv_heads 3 (model odd)");
    // The override wins over the file's model: tiny (4 KV heads) accepts tp 2.
    LoadOptions lo;
    lo.model = &odd;
    EXPECT_FALSE(parse_topology(kSmallYaml, "small.yaml", Format::kAuto, lo).ok());
    ModelShape broken = odd;
    broken.num_layers = 0;
    st = validate(*t, &broken);
    ASSERT_FALSE(st.ok());
    EXPECT_THAT(st.message(), HasSubstr("--model odd: num_layers: must be positive"));
    // No model at all: the head rule is skipped.
    Topology no_model = *t;
    no_model.model.reset();
    EXPECT_OK(validate(no_model));
}

// ---- paths ----

TEST(Paths, DgxBottlenecksByHand) {
    ClusterOptions o;
    auto t = make_dgx("H100", 2, o);
    ASSERT_OK(t);
    // Same node: GPU -> NVSwitch -> GPU, 450 GB/s, 0.5 + 0.5 us.
    PathInfo p = t->path_info("n0.gpu0", "n0.gpu5");
    ASSERT_TRUE(p.found);
    ASSERT_EQ(p.links.size(), 2u);
    EXPECT_EQ(p.links[0]->type, LinkType::kNvlink);
    EXPECT_EQ(p.links[0]->a, "n0.gpu0");
    EXPECT_EQ(p.links[1]->a, "n0.gpu5");
    EXPECT_DOUBLE_EQ(p.bottleneck_gbps, 450.0);
    EXPECT_DOUBLE_EQ(p.latency_us, 1.0);
    // Across nodes: PCIe 64 -> NIC 50 -> IB 50 -> fabric -> IB 50 -> NIC -> PCIe 64: 50 GB/s,
    // 0.5 + 1 + 1 + 0.5 us.
    p = t->path_info("n0.gpu2", "n1.gpu7");
    ASSERT_TRUE(p.found);
    ASSERT_EQ(p.links.size(), 4u);
    EXPECT_EQ(p.links[0]->type, LinkType::kPcie);
    EXPECT_EQ(p.links[0]->b, "n0.nic2");
    EXPECT_EQ(p.links[1]->type, LinkType::kIb);
    EXPECT_EQ(p.links[2]->type, LinkType::kIb);
    EXPECT_EQ(p.links[3]->type, LinkType::kPcie);
    EXPECT_EQ(p.links[3]->a, "n1.gpu7");
    EXPECT_DOUBLE_EQ(p.bottleneck_gbps, 50.0);
    EXPECT_DOUBLE_EQ(p.latency_us, 3.0);
    EXPECT_DOUBLE_EQ(t->bottleneck_gbps("n0.gpu2", "n1.gpu7"), 50.0);
    EXPECT_DOUBLE_EQ(t->path_latency_us("n0.gpu2", "n1.gpu7"), 3.0);
    EXPECT_EQ(t->path("n0.gpu2", "n1.gpu7").size(), 4u);
    // Same device; unknown device.
    EXPECT_TRUE(std::isinf(t->bottleneck_gbps("n0.gpu1", "n0.gpu1")));
    EXPECT_TRUE(t->path("n0.gpu1", "n0.gpu1").empty());
    EXPECT_FALSE(t->path_info("n0.gpu1", "n9.gpu0").found);
    EXPECT_EQ(t->bottleneck_gbps("n0.gpu1", "n9.gpu0"), 0.0);
    // A100 DGX: 200 Gb/s NICs behind PCIe Gen4.
    auto a100 = make_dgx("A100", 2, o);
    ASSERT_OK(a100);
    EXPECT_DOUBLE_EQ(a100->bottleneck_gbps("n0.gpu0", "n1.gpu0"), 25.0);
    EXPECT_DOUBLE_EQ(a100->bottleneck_gbps("n0.gpu0", "n0.gpu1"), 300.0);
}

TEST(Paths, Nvl72SpansTraysOverNvlink) {
    ClusterOptions o;
    o.prefill_tp = 4;
    auto t = make_gb200_nvl72(2, o);
    ASSERT_OK(t);
    EXPECT_DOUBLE_EQ(t->bottleneck_gbps("t0.gpu0", "t17.gpu3"), 900.0);  // same rack
    EXPECT_DOUBLE_EQ(t->path_latency_us("t0.gpu0", "t17.gpu3"), 1.0);
    EXPECT_DOUBLE_EQ(t->bottleneck_gbps("t0.gpu0", "t18.gpu0"), 50.0);  // next rack: IB
    EXPECT_DOUBLE_EQ(t->path_latency_us("t0.gpu0", "t18.gpu0"), 3.0);
}

Topology hand_graph() {
    // a and b are joined three ways:
    //   via s1: 10 GB/s links, 1 us each (narrow, fast)
    //   via s2: 100 GB/s links, 5 us each (wide, slow)
    //   via s3: 100 GB/s links, 3 us each, through NIC n (ethernet, 40 GB/s port)
    // and c hangs off b only (devices do not forward, so a cannot reach c).
    Topology t;
    t.source.name = "hand";
    Node n;
    n.id = "h";
    n.hostname = "h";
    n.devices = {{"a", "H100", -1, ""}, {"b", "H100", -1, ""}, {"c", "H100", -1, ""}};
    n.nics = {{"n", LinkType::kEthernet, 40.0}};
    n.switches = {
        {"s1", LinkType::kNvlink}, {"s2", LinkType::kNvlink}, {"s3", LinkType::kEthernet}};
    t.nodes.push_back(n);
    t.links = {{"a", "s1", LinkType::kNvlink, 10, 1},    {"s1", "b", LinkType::kNvlink, 10, 1},
               {"a", "s2", LinkType::kNvlink, 100, 5},   {"s2", "b", LinkType::kNvlink, 100, 5},
               {"a", "n", LinkType::kPcie, 100, 3},      {"n", "s3", LinkType::kEthernet, 100, 3},
               {"s3", "b", LinkType::kEthernet, 100, 3}, {"b", "c", LinkType::kNvlink, 500, 1}};
    t.instances = {{"p", Role::kPrefill, 1, {"a"}, {}}, {"d", Role::kDecode, 1, {"b"}, {}}};
    return t;
}

TEST(Paths, WidestThenFastestThroughSwitchesAndNics) {
    Topology t = hand_graph();
    ASSERT_OK(validate(t));
    // Widest is s2 (100 GB/s); s3's path is capped at 40 by the NIC port.
    PathInfo p = t.path_info("a", "b");
    ASSERT_TRUE(p.found);
    EXPECT_DOUBLE_EQ(p.bottleneck_gbps, 100.0);
    EXPECT_DOUBLE_EQ(p.latency_us, 10.0);
    ASSERT_EQ(p.links.size(), 2u);
    EXPECT_EQ(p.links[0]->b, "s2");
    // Raise the NIC port to 100: now two 100 GB/s paths; s3's is 9 us < 10 us.
    t.nodes[0].nics[0].gbps = 100;
    p = t.path_info("a", "b");
    EXPECT_DOUBLE_EQ(p.bottleneck_gbps, 100.0);
    EXPECT_DOUBLE_EQ(p.latency_us, 9.0);
    EXPECT_EQ(p.links.size(), 3u);
    // Devices do not forward.
    EXPECT_FALSE(t.path_info("a", "c").found);
    EXPECT_TRUE(t.path_info("b", "c").found);
    // Reverse direction: the same path, reversed.
    p = t.path_info("b", "a");
    EXPECT_DOUBLE_EQ(p.latency_us, 9.0);
    EXPECT_EQ(p.links.front()->a, "s3");
}

// ---- rank map ----

TEST(RankMap, PrefillFirstThenDecodeInFileOrder) {
    auto t = parse_topology(kSmallYaml, "small.yaml");
    ASSERT_OK(t);
    const RankMap rm = t->rank_map();
    ASSERT_EQ(rm.world_size(), 3);
    EXPECT_EQ(rm.num_prefill_ranks(), 2);
    // decode0 is listed first but prefill ranks come first.
    EXPECT_EQ(rm.first_rank(1), 0);
    EXPECT_EQ(rm.first_rank(0), 2);
    EXPECT_EQ(rm.at(0).device, "node0.cpu0");
    EXPECT_EQ(rm.at(1).tp_rank, 1);
    EXPECT_EQ(rm.at(1).tp_size, 2);
    EXPECT_EQ(rm.at(1).instance, 1);
    EXPECT_EQ(rm.at(2).role, Role::kDecode);
    EXPECT_EQ(rm.at(2).device, "node0.cpu2");
    EXPECT_EQ(rm.at(2).node, 0);
    EXPECT_EQ(rm.at(2).device_index, 2);
    EXPECT_EQ(rm.ranks_on_node(0), (std::vector<int>{0, 1, 2}));
}

// Colocated instances (each serves whole requests): ranks in file order; no prefill or decode
// instance needed, none allowed alongside; the report says there is no KV path.
TEST(RankMap, ColocatedOnlyTopologiesRankInFileOrder) {
    std::string text = kSmallYaml;
    auto replace = [](std::string& s, const std::string& from, const std::string& to) {
        s.replace(s.find(from), from.size(), to);
    };
    replace(text, "{id: decode0, role: decode,", "{id: c1, role: colocated,");
    replace(text, "id: prefill0\n    role: prefill", "id: c0\n    role: colocated");
    auto t = parse_topology(text, "c.yaml");
    ASSERT_OK(t);
    const RankMap rm = t->rank_map();
    ASSERT_EQ(rm.world_size(), 3);
    EXPECT_EQ(rm.num_prefill_ranks(), 0);
    EXPECT_EQ(rm.first_rank(0), 0);  // c1, listed first, TP 1
    EXPECT_EQ(rm.first_rank(1), 1);  // c0, TP 2
    EXPECT_EQ(rm.at(0).role, Role::kColocated);
    EXPECT_EQ(rm.at(2).device, "node0.cpu1");
    EXPECT_EQ(role_name(Role::kColocated), "colocated");
    EXPECT_EQ(parse_role("colocated"), Role::kColocated);
    EXPECT_THAT(summary_text(*t), HasSubstr("ranks     3: colocated 0-2"));
    EXPECT_THAT(summary_text(*t), HasSubstr("prefill -> decode KV paths: none (colocated"));
    EXPECT_THAT(one_line_summary(*t), HasSubstr("2 instances (2 colocated)"));
    auto back = parse_topology(to_yaml(*t), "<roundtrip>", Format::kYaml);
    ASSERT_OK(back);
    EXPECT_EQ(*back, *t);

    // Mixed with a prefill or decode instance: refused, naming both.
    std::string mixed = kSmallYaml;
    replace(mixed, "{id: decode0, role: decode,", "{id: c1, role: colocated,");
    auto m = parse_topology(mixed, "m.yaml");
    ASSERT_FALSE(m.ok());
    EXPECT_THAT(m.status(), StatusIs(StatusCode::kInvalidArgument,
                                     HasSubstr("instances[1].role: prefill instance after "
                                               "colocated instance instances[0]")));
}

TEST(RankMap, DeclaredRanksAndWorldSizeAreChecked) {
    std::string text = kSmallYaml;
    text += "world_size: 3\n";
    auto replace = [](std::string& s, const std::string& from, const std::string& to) {
        s.replace(s.find(from), from.size(), to);
    };
    replace(text, "devices: [node0.cpu2]", "devices: [node0.cpu2], ranks: [2]");
    replace(text, "devices: [node0.cpu0, node0.cpu1]",
            "devices: [node0.cpu0, node0.cpu1]\n    ranks: [0, 1]");
    auto t = parse_topology(text, "r.yaml");
    ASSERT_OK(t);
    EXPECT_EQ(t->instances[1].ranks, (std::vector<int>{0, 1}));

    std::string bad = text;
    replace(bad, "ranks: [0, 1]", "ranks: [1, 2]");
    auto b = parse_topology(bad, "r.yaml");
    ASSERT_FALSE(b.ok());
    EXPECT_THAT(b.status().message(),
                HasSubstr("r.yaml:23: instances[1].ranks: [1, 2] does not match the "
                          "rank rule, which gives [0, 1]"));
}

TEST(RankMap, DgxH200ThreeToOne) {
    auto t = load_topology(kExamples + "/dgx-h200-4node-3p1d.yaml");
    ASSERT_OK(t);
    const RankMap rm = t->rank_map();
    ASSERT_EQ(rm.world_size(), 32);
    EXPECT_EQ(rm.num_prefill_ranks(), 24);
    EXPECT_EQ(rm.at(0).device, "n0.gpu0");
    EXPECT_EQ(rm.at(9).device, "n1.gpu1");
    EXPECT_EQ(rm.at(9).tp_rank, 1);
    EXPECT_EQ(rm.at(24).role, Role::kDecode);
    EXPECT_EQ(rm.at(24).node, 3);
    EXPECT_EQ(rm.at(31).device_index, 7);
    EXPECT_EQ(rm.ranks_on_node(2).front(), 16);
}

TEST(RankMap, TpOverlapPairs) {
    using P = std::vector<std::pair<int, int>>;
    EXPECT_EQ(tp_overlap_pairs(1, 1), (P{{0, 0}}));
    EXPECT_EQ(tp_overlap_pairs(2, 1), (P{{0, 0}, {1, 0}}));
    EXPECT_EQ(tp_overlap_pairs(1, 2), (P{{0, 0}, {0, 1}}));
    EXPECT_EQ(tp_overlap_pairs(3, 2), (P{{0, 0}, {1, 0}, {1, 1}, {2, 1}}));
    EXPECT_EQ(tp_overlap_pairs(8, 8).size(), 8u);
    const P p48 = tp_overlap_pairs(4, 8);
    ASSERT_EQ(p48.size(), 8u);
    EXPECT_EQ(p48[2], (std::pair<int, int>{1, 2}));
    EXPECT_TRUE(tp_overlap_pairs(0, 2).empty());
}

// ---- shaping ----

TEST(Shaping, ScalesBandwidthDownAndLatencyUp) {
    const Link ib{"x", "y", LinkType::kIb, 50.0, 3.0};
    const LinkShaping s = shaping_for(ib, 100.0);
    EXPECT_DOUBLE_EQ(s.bytes_per_s, 5e8);  // 50 GB/s / 100
    EXPECT_DOUBLE_EQ(s.latency_us, 300.0);
    EXPECT_DOUBLE_EQ(s.time_scale, 100.0);
    EXPECT_DOUBLE_EQ(s.source_gbps, 50.0);
    // 1 MB: 300 us + 1e6 / 5e8 s = 300 + 2000 us. On the GPU link: 3 + 20 us, 100x less.
    EXPECT_DOUBLE_EQ(s.transfer_time_us(1'000'000), 2300.0);
    const LinkShaping g = shaping_for(ib, 1.0);
    EXPECT_DOUBLE_EQ(g.transfer_time_us(1'000'000), 23.0);
    EXPECT_DOUBLE_EQ(s.transfer_time_us(1'000'000) / g.transfer_time_us(1'000'000), 100.0);
    // Bad scales fall back to 1; zero bandwidth is unlimited.
    EXPECT_DOUBLE_EQ(shaping_for(ib, 0.0).time_scale, 1.0);
    EXPECT_DOUBLE_EQ(shaping_for(ib, -3.0).bytes_per_s, 5e10);
    EXPECT_TRUE(shaping_for(0.0, 1.0, 2.0).unlimited());
}

TEST(Shaping, FromCpuTopologyAndPaths) {
    auto t = load_topology(kExamples + "/cpu-1p1d.yaml");
    ASSERT_OK(t);
    ASSERT_TRUE(t->shaping.has_value());
    EXPECT_EQ(t->shaping->time_scale, 0.0);  // auto
    EXPECT_DOUBLE_EQ(t->shaping->gbps, 50.0);
    EXPECT_DOUBLE_EQ(t->shaping->latency_us, 3.0);
    EXPECT_EQ(t->shaping->gpu, "H100");
    // auto needs a measured scale.
    auto none = shaping_for(*t);
    ASSERT_FALSE(none.ok());
    EXPECT_THAT(none.status().message(), HasSubstr("shaping.time_scale is auto"));
    auto s = shaping_for(*t, 40.0);
    ASSERT_OK(s);
    EXPECT_DOUBLE_EQ(s->bytes_per_s, 50e9 / 40.0);
    EXPECT_DOUBLE_EQ(s->latency_us, 120.0);
    // A fixed scale in the file wins over the measured one.
    t->shaping->time_scale = 10.0;
    s = shaping_for(*t, 40.0);
    ASSERT_OK(s);
    EXPECT_DOUBLE_EQ(s->latency_us, 30.0);
    // No shaping section: unlimited.
    t->shaping.reset();
    EXPECT_TRUE(shaping_for(*t)->unlimited());

    auto dgx = make_dgx("H100", 2, ClusterOptions{});
    ASSERT_OK(dgx);
    const LinkShaping p = shaping_for_path(*dgx, "n0.gpu0", "n1.gpu0", 10.0);
    EXPECT_DOUBLE_EQ(p.bytes_per_s, 5e9);
    EXPECT_DOUBLE_EQ(p.latency_us, 30.0);
    EXPECT_TRUE(shaping_for_path(*dgx, "n0.gpu0", "n0.gpu0", 10.0).unlimited());

    EXPECT_DOUBLE_EQ(*time_scale_from(0.02, 0.0001), 200.0);
    EXPECT_FALSE(time_scale_from(0.0, 1.0).ok());
}

// ---- builders ----

TEST(Builders, DgxPlacementAndErrors) {
    ClusterOptions o;
    o.prefill = 3;
    o.decode = 1;
    o.prefill_tp = 4;
    o.decode_tp = 8;
    o.model = "llama3-70b";
    auto t = make_dgx("B200", 3, o);
    ASSERT_OK(t);
    EXPECT_EQ(t->name, "dgx-b200-3node-3p1d-tp4-tp8");
    // prefill0 n0.gpu0-3, prefill1 n0.gpu4-7, prefill2 n1.gpu0-3; decode0 skips to n2.
    EXPECT_EQ(t->instances[2].devices.front(), "n1.gpu0");
    EXPECT_EQ(t->instances[3].devices.front(), "n2.gpu0");
    EXPECT_EQ(t->instances[3].devices.back(), "n2.gpu7");
    EXPECT_EQ(*t->world_size, 20);
    EXPECT_EQ(t->nodes.size(), 3u);
    EXPECT_EQ(t->links.size(), 3u * 24u);
    EXPECT_OK(validate(*t));
    o.decode = 2;  // needs a fourth node
    auto no_fit = make_dgx("B200", 3, o);
    ASSERT_FALSE(no_fit.ok());
    EXPECT_THAT(no_fit.status().message(), HasSubstr("do not fit"));
    EXPECT_FALSE(make_dgx("V100", 1, ClusterOptions{}).ok());
    EXPECT_FALSE(make_dgx("H100", 0, ClusterOptions{}).ok());
    o = ClusterOptions{};
    o.prefill_tp = 16;  // two whole nodes
    auto tp16 = make_dgx("H100", 3, o);
    ASSERT_OK(tp16);
    EXPECT_EQ(tp16->instances[0].devices.back(), "n1.gpu7");
    o.prefill_tp = 12;
    EXPECT_FALSE(make_dgx("H100", 4, o).ok());
    o = ClusterOptions{};
    o.hostnames = {"dgx-a", "dgx-b"};
    auto named = make_dgx("H100", 2, o);
    ASSERT_OK(named);
    EXPECT_EQ(named->nodes[1].hostname, "dgx-b");
    o.model = "llama9";
    EXPECT_FALSE(make_dgx("H100", 2, o).ok());
}

TEST(Builders, Gb200AndCpu) {
    ClusterOptions o;
    o.prefill = 8;
    o.decode = 4;
    o.prefill_tp = 4;
    o.decode_tp = 8;
    o.model = "deepseek-v3";
    auto t = make_gb200_nvl72(1, o);
    ASSERT_OK(t);
    EXPECT_EQ(t->nodes.size(), 18u);
    EXPECT_EQ(t->num_devices(), 72);
    EXPECT_EQ(t->num_ranks(), 64);
    EXPECT_EQ(t->instances[8].devices.front(), "t8.gpu0");  // decode0 after 32 prefill GPUs
    o.decode = 6;                                           // 32 + 48 > 72
    EXPECT_FALSE(make_gb200_nvl72(1, o).ok());

    CpuOptions c;
    c.prefill = 2;
    c.prefill_tp = 2;
    c.cpus = 8;
    auto cpu = make_cpu(c);
    ASSERT_OK(cpu);
    EXPECT_EQ(cpu->name, "cpu-2p1d-tp2-to-tp1");
    EXPECT_EQ(cpu->num_ranks(), 5);
    ASSERT_TRUE(cpu->shaping.has_value());
    EXPECT_DOUBLE_EQ(cpu->shaping->gbps, 50.0);
    c.emulate = "none";
    EXPECT_FALSE(make_cpu(c)->shaping.has_value());
    c.emulate = "dgx-h999-ib";
    EXPECT_FALSE(make_cpu(c).ok());

    GpuHostOptions g;
    g.gpus = 4;
    g.prefill_tp = g.decode_tp = 2;
    auto pd = make_gpu_host("H100", g);
    ASSERT_OK(pd);
    EXPECT_EQ(pd->name, "gpu-4xh100-1p1d-tp2");
    EXPECT_EQ(pd->instances[1].devices, (std::vector<std::string>{"node0.gpu2", "node0.gpu3"}));
    EXPECT_DOUBLE_EQ(pd->bottleneck_gbps("node0.gpu0", "node0.gpu3"), 64.0);
    g.prefill = g.decode = 0;
    g.colocated = 2;
    g.colocated_tp = 2;
    auto col = make_gpu_host("H100", g);
    ASSERT_OK(col);
    EXPECT_EQ(col->name, "gpu-4xh100-2c-tp2");
    EXPECT_EQ(col->instances[1].id, "colocated1");
    EXPECT_EQ(col->instances[1].role, Role::kColocated);
    g.colocated = 3;  // 6 GPUs
    EXPECT_THAT(make_gpu_host("H100", g).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("do not fit on 4 GPUs")));
    g.colocated = 1;
    g.prefill = 1;
    EXPECT_THAT(make_gpu_host("H100", g).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("disaggregated or colocated")));
    EXPECT_FALSE(make_gpu_host("H999", GpuHostOptions{}).ok());
}

// share_gpus: prefill and decode instances each from GPU 0; a GPU both use is shared, one only one
// role uses is not; the rank map puts both ranks of a pair on the same CUDA ordinal.
TEST(Builders, GpuHostSharedGpus) {
    GpuHostOptions g;
    g.gpus = 3;
    g.prefill = 2;
    g.decode = 1;
    g.share_gpus = true;
    auto t = make_gpu_host("H200", g);
    ASSERT_OK(t);
    EXPECT_EQ(t->name, "gpu-3xh200-2p1d-tp1-shared");
    ASSERT_EQ(t->instances.size(), 3u);
    EXPECT_EQ(t->instances[0].devices, (std::vector<std::string>{"node0.gpu0"}));
    EXPECT_EQ(t->instances[1].devices, (std::vector<std::string>{"node0.gpu1"}));
    EXPECT_EQ(t->instances[2].role, Role::kDecode);
    EXPECT_EQ(t->instances[2].devices, (std::vector<std::string>{"node0.gpu0"}));
    const auto& devices = t->nodes[0].devices;
    ASSERT_EQ(devices.size(), 3u);
    EXPECT_TRUE(devices[0].shared);
    EXPECT_FALSE(devices[1].shared);
    EXPECT_FALSE(devices[2].shared);
    const RankMap rm = t->rank_map();
    ASSERT_EQ(rm.world_size(), 3);
    EXPECT_EQ(rm.at(0).device_index, 0);
    EXPECT_EQ(rm.at(2).role, Role::kDecode);
    EXPECT_EQ(rm.at(2).device_index, 0);
    // A KV path inside one device has no link.
    EXPECT_TRUE(t->path_info("node0.gpu0", "node0.gpu0").links.empty());

    g.decode = 4;  // decode instances must fit on their own
    EXPECT_THAT(make_gpu_host("H200", g).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("do not fit on 3 GPUs")));

    // An instance wider than the host wraps around its GPUs: TP 2 on one GPU.
    GpuHostOptions tp2;
    tp2.gpus = 1;
    tp2.prefill_tp = 2;
    tp2.share_gpus = true;
    auto wrapped = make_gpu_host("H200", tp2);
    ASSERT_OK(wrapped);
    EXPECT_EQ(wrapped->instances[0].devices,
              (std::vector<std::string>{"node0.gpu0", "node0.gpu0"}));
    EXPECT_EQ(wrapped->instances[1].devices, (std::vector<std::string>{"node0.gpu0"}));
    EXPECT_TRUE(wrapped->nodes[0].devices[0].shared);
    tp2.prefill = 2;  // two of them would both wrap onto the same GPUs
    EXPECT_THAT(make_gpu_host("H200", tp2).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("must be its role's only one")));
    tp2.prefill = 1;
    tp2.share_gpus = false;  // without sharing it does not fit
    EXPECT_THAT(make_gpu_host("H200", tp2).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("do not fit on 1 GPUs")));
    g.decode = 1;
    g.prefill = g.decode = 0;
    g.colocated = 1;
    EXPECT_THAT(make_gpu_host("H200", g).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("share_gpus")));
}

// `shared: true` lets several instances list a device; without it the second is refused, with a
// hint; one instance never lists a device twice; the flag round-trips and is a strict boolean.
TEST(Validate, SharedDevices) {
    const std::string kTwoOnOne = R"(nodes:
  - id: node0
    devices:
      - {id: node0.gpu0, type: H200, index: 0SHARED}
    switches:
      - {id: node0.pcie, type: pcie}
links:
  - {a: node0.gpu0, b: node0.pcie, type: pcie, gbps: 64, latency_us: 0.5}
instances:
  - {id: prefill0, role: prefill, tp: 1, devices: [node0.gpu0]}
  - {id: decode0, role: decode, tp: 1, devices: [node0.gpu0]}
)";
    auto with = [&](const std::string& shared) {
        std::string text = kTwoOnOne;
        text.replace(text.find("SHARED"), 6, shared);
        return parse_topology(text, "two.yaml");
    };
    EXPECT_THAT(with("").status(),
                StatusIs(StatusCode::kInvalidArgument,
                         ::testing::AllOf(HasSubstr("two.yaml:11: instances[1].devices[0]"),
                                          HasSubstr("already used by instances[0]"),
                                          HasSubstr("shared: true"))));
    auto ok = with(", shared: true");
    ASSERT_OK(ok);
    EXPECT_TRUE(ok->nodes[0].devices[0].shared);
    const std::string yaml = to_yaml(*ok);
    EXPECT_THAT(yaml, HasSubstr("shared: true"));
    auto back = parse_topology(yaml, "<roundtrip>", Format::kYaml);
    ASSERT_OK(back);
    EXPECT_EQ(*back, *ok);
    // false is the default and is not written.
    auto unshared = with(", shared: false");
    EXPECT_THAT(unshared.status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("already used by instances[0]")));
    EXPECT_THAT(with(", shared: \"true\"").status(),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("nodes[0].devices[0].shared: expected true or false")));
    EXPECT_THAT(with(", shared: 1").status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("expected true or false")));

    // One instance's TP ranks on one device: only a shared device may be listed twice.
    auto tp2_on = [&](const std::string& shared) {
        std::string text = kTwoOnOne;
        text.replace(text.find("SHARED"), 6, shared);
        const std::string one = "tp: 1, devices: [node0.gpu0]}\n  - {id: decode0";
        text.replace(text.find(one), one.size(),
                     "tp: 2, devices: [node0.gpu0, node0.gpu0]}\n  - {id: decode0");
        return parse_topology(text, "tp2.yaml");
    };
    EXPECT_THAT(tp2_on("").status(),
                StatusIs(StatusCode::kInvalidArgument,
                         ::testing::AllOf(HasSubstr("tp2.yaml:10: instances[0].devices[1]"),
                                          HasSubstr("device \"node0.gpu0\" is listed twice"),
                                          HasSubstr("shared: true"))));
    auto tp2 = tp2_on(", shared: true");
    ASSERT_OK(tp2);
    const RankMap rm = tp2->rank_map();
    ASSERT_EQ(rm.world_size(), 3);
    for (int r = 0; r < 3; ++r) EXPECT_EQ(rm.at(r).device_index, 0) << "rank " << r;
    EXPECT_EQ(rm.at(1).tp_rank, 1);
}

TEST(Builders, EmulationPresets) {
    for (const std::string& name : emulation_preset_names()) {
        auto s = emulation_preset(name);
        ASSERT_OK(s) << name << ": " << s.status().to_string();
        EXPECT_GT(s->gbps, 0) << name;
        EXPECT_NE(gpu_spec(s->gpu), nullptr) << name;
    }
    EXPECT_DOUBLE_EQ(emulation_preset("dgx-h100-ib")->gbps, 50.0);
    EXPECT_DOUBLE_EQ(emulation_preset("dgx-h100-ib")->latency_us, 3.0);
    EXPECT_DOUBLE_EQ(emulation_preset("dgx-b200-nvlink")->gbps, 900.0);
    EXPECT_DOUBLE_EQ(emulation_preset("dgx-a100-ib")->gbps, 25.0);
    EXPECT_DOUBLE_EQ(emulation_preset("gb200-nvl72-ib")->latency_us, 3.0);
    EXPECT_FALSE(emulation_preset("dgx-gb200-ib").ok());
    EXPECT_FALSE(emulation_preset("x").ok());
}

// The examples come from scripts/topology/gen_topology.py; they must equal the C++ builders.
TEST(Builders, GeneratedExamplesEqualBuilders) {
    struct Case {
        std::string file;
        StatusOr<Topology> built;
    };
    ClusterOptions h100;
    h100.model = "llama3-70b";
    ClusterOptions h200 = h100;
    h200.prefill = 3;
    h200.name = "dgx-h200-4node-3p1d";
    ClusterOptions gb;
    gb.prefill = 8;
    gb.decode = 4;
    gb.prefill_tp = 4;
    gb.decode_tp = 8;
    gb.model = "deepseek-v3";
    gb.name = "gb200-nvl72-8p4d";
    CpuOptions c11;
    c11.name = "cpu-1p1d";
    CpuOptions c21;
    c21.prefill = 2;
    c21.prefill_tp = 2;
    CpuOptions c12;
    c12.decode = 2;
    GpuHostOptions g1c;
    g1c.colocated = 1;
    g1c.prefill = g1c.decode = 0;
    g1c.name = "gpu-1c";
    std::vector<Case> cases;
    cases.push_back({"dgx-h100-2node-1p1d-tp8.yaml", make_dgx("H100", 2, h100)});
    cases.push_back({"dgx-h200-4node-3p1d.yaml", make_dgx("H200", 4, h200)});
    cases.push_back({"gb200-nvl72-8p4d.yaml", make_gb200_nvl72(1, gb)});
    cases.push_back({"cpu-1p1d.yaml", make_cpu(c11)});
    cases.push_back({"cpu-2p1d-tp2-to-tp1.yaml", make_cpu(c21)});
    cases.push_back({"cpu-1p2d.yaml", make_cpu(c12)});
    cases.push_back({"gpu-1c.yaml", make_gpu_host("H200", g1c)});
    GpuHostOptions g1p1d;
    g1p1d.share_gpus = true;
    g1p1d.name = "gpu-1p1d";
    cases.push_back({"gpu-1p1d.yaml", make_gpu_host("H200", g1p1d)});
    GpuHostOptions g2g;
    g2g.gpus = 2;
    g2g.name = "gpu-2g-1p1d";
    cases.push_back({"gpu-2g-1p1d.yaml", make_gpu_host("H200", g2g)});
    GpuHostOptions gtp2;
    gtp2.share_gpus = true;
    gtp2.prefill_tp = 2;
    gtp2.model = "tiny";
    gtp2.name = "gpu-1p1d-tp2-to-tp1";
    cases.push_back({"gpu-1p1d-tp2-to-tp1.yaml", make_gpu_host("H200", gtp2)});
    GpuHostOptions g2tp2 = gtp2;
    g2tp2.gpus = 2;
    g2tp2.name = "gpu-2g-1p1d-tp2-to-tp1";
    cases.push_back({"gpu-2g-1p1d-tp2-to-tp1.yaml", make_gpu_host("H200", g2tp2)});
    for (const Case& c : cases) {
        SCOPED_TRACE(c.file);
        ASSERT_OK(c.built);
        auto loaded = load_topology(kExamples + "/" + c.file);
        ASSERT_OK(loaded);
        EXPECT_EQ(*loaded, *c.built) << to_yaml(*loaded) << "\n---\n" << to_yaml(*c.built);
    }
}

// ---- round trips, reports ----

TEST(RoundTrip, ToYamlParsesBackEqual) {
    int n = 0;
    for (const auto& e : fs::directory_iterator(kExamples)) {
        SCOPED_TRACE(e.path().string());
        auto t = load_topology(e.path().string());
        ASSERT_OK(t);
        const std::string y = to_yaml(*t);
        auto back = parse_topology(y, "<roundtrip>", Format::kYaml);
        ASSERT_OK(back) << back.status().to_string() << "\n" << y;
        EXPECT_EQ(*back, *t);
        ++n;
    }
    EXPECT_GE(n, 6);
    // Odd strings survive quoting; a custom model is written as a mapping.
    auto t = parse_topology(kSmallYaml, "small.yaml");
    ASSERT_OK(t);
    t->description = "has: colons, \"quotes\", # hashes\nand a newline";
    t->nodes[0].hostname = "123";
    t->nodes[0].devices[0].cores = "0-1";
    t->model = ModelShape{.name = "custom",
                          .num_layers = 3,
                          .num_q_heads = 8,
                          .num_kv_heads = 2,
                          .head_dim = 32,
                          .hidden = 0,
                          .attention = AttentionKind::kMha};
    t->world_size = 3;
    t->shaping = ShapingSpec{.emulate = "x",
                             .type = LinkType::kEthernet,
                             .gbps = 12.5,
                             .latency_us = 7,
                             .gpu = "B200",
                             .time_scale = 33};
    ASSERT_OK(validate(*t));
    auto back = parse_topology(to_yaml(*t), "<roundtrip>", Format::kYaml);
    ASSERT_OK(back) << back.status().to_string() << "\n" << to_yaml(*t);
    EXPECT_EQ(*back, *t);
}

TEST(Report, SummaryHostfileRankfile) {
    auto t = load_topology(kExamples + "/dgx-h100-2node-1p1d-tp8.yaml");
    ASSERT_OK(t);
    const std::string s = summary_text(*t);
    EXPECT_THAT(
        s, HasSubstr("prefill0  decode0  8->8  8      50.0  3.00        pcie > ib > ib > pcie"));
    EXPECT_THAT(s, HasSubstr("ranks     16: prefill 0-7, decode 8-15"));
    EXPECT_EQ(one_line_summary(*t),
              "dgx-h100-2node-1p1d-tp8: 2 nodes, 16 devices (16x H100), 2 instances (1 prefill, 1 "
              "decode), 16 ranks, model llama3-70b");
    const std::string h = hostfile_text(*t);
    EXPECT_THAT(h, HasSubstr("\nn0 slots=8\nn1 slots=8\n"));
    const std::string r = rankfile_text(*t);
    EXPECT_THAT(r, HasSubstr("rank 0=n0 slot=0-13\n"));
    EXPECT_THAT(r, HasSubstr("rank 15=n1 slot=98-111\n"));

    auto cpu = load_topology(kExamples + "/cpu-1p2d.yaml");
    ASSERT_OK(cpu);
    EXPECT_THAT(hostfile_text(*cpu), HasSubstr("localhost slots=3\n"));
    // No cpu count in the file: the fallback splits cores, or core d without one.
    EXPECT_THAT(rankfile_text(*cpu, 6), HasSubstr("rank 2=localhost slot=4-5\n"));
    EXPECT_THAT(rankfile_text(*cpu, 2), HasSubstr("rank 2=localhost slot=0\n"));
    EXPECT_THAT(rankfile_text(*cpu, 0), HasSubstr("rank 2=localhost slot=2\n"));
    EXPECT_THAT(summary_text(*cpu), HasSubstr("shaping   emulates dgx-h100"));
}

// ---- robustness ----

void expect_clean_error_or_ok(std::string_view text, Format f) {
    auto t = parse_topology(text, "<fuzz>", f);
    if (!t.ok()) {
        EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << t.status().to_string();
        EXPECT_EQ(t.status().message().rfind("<fuzz>", 0), 0u) << t.status().message();
    }
}

TEST(Robustness, DeepNestingAndAliasBombs) {
    for (Format f : {Format::kYaml, Format::kJson}) {
        expect_clean_error_or_ok(std::string(100000, '['), f);
        expect_clean_error_or_ok(std::string(5000, '[') + std::string(5000, ']'), f);
        expect_clean_error_or_ok(std::string(5000, '{'), f);
    }
    std::string deep = "nodes:\n";
    for (int i = 0; i < 200; ++i) deep += std::string(static_cast<size_t>(2 * i + 2), ' ') + "- \n";
    expect_clean_error_or_ok(deep, Format::kYaml);
    // A "billion laughs": nine levels of ten aliases each.
    std::string bomb = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
    for (int i = 1; i < 9; ++i) {
        bomb += fmt::format("a{}: &a{} [", i, i);
        for (int k = 0; k < 10; ++k) bomb += fmt::format("{}*a{}", k ? ", " : "", i - 1);
        bomb += "]\n";
    }
    auto t = parse_topology(bomb, "<fuzz>", Format::kYaml);
    ASSERT_FALSE(t.ok());
    EXPECT_THAT(t.status().message(), HasSubstr("too large"));
    expect_clean_error_or_ok("a: &a [*a]\n", Format::kYaml);
    expect_clean_error_or_ok(std::string("nodes: [\0\xff\xfe]\n", 14), Format::kYaml);
    expect_clean_error_or_ok(std::string("{\"nodes\": \"\xff\"}", 14), Format::kJson);
    expect_clean_error_or_ok("!!binary aGVsbG8=", Format::kYaml);
    expect_clean_error_or_ok("%YAML 1.2\n---\nnodes: []\n...\n---\nx: 1\n", Format::kYaml);
}

TEST(Robustness, MutatedExamplesNeverCrash) {
    std::vector<std::string> seeds{kSmallYaml, kSmallJson};
    for (const auto& e : fs::directory_iterator(kExamples)) {
        if (e.path().filename().string().starts_with("cpu"))
            seeds.push_back(read(e.path().string()));
    }
    std::mt19937_64 rng(12345);
    const std::string alphabet = "{}[]:,-#&*!|>'\"\n\t 0123456789.eE+abcxyz-_";
    int parsed = 0;
    for (int iter = 0; iter < 3000; ++iter) {
        std::string s = seeds[rng() % seeds.size()];
        const int edits = 1 + static_cast<int>(rng() % 4);
        for (int k = 0; k < edits && !s.empty(); ++k) {
            const size_t pos = rng() % s.size();
            switch (rng() % 4) {
                case 0:
                    s[pos] = alphabet[rng() % alphabet.size()];
                    break;
                case 1:
                    s.erase(pos, 1 + rng() % 8);
                    break;
                case 2:
                    s.insert(pos, 1, alphabet[rng() % alphabet.size()]);
                    break;
                default: {
                    const size_t from = rng() % s.size();
                    s.insert(pos, s.substr(from, 1 + rng() % 32));
                }
            }
        }
        for (Format f : {Format::kYaml, Format::kJson}) {
            auto t = parse_topology(s, "<fuzz>", f);
            if (t.ok()) {
                ++parsed;
                (void)summary_text(*t);
                (void)rankfile_text(*t, 3);
                auto back = parse_topology(to_yaml(*t), "<rt>", Format::kYaml);
                ASSERT_OK(back) << back.status().to_string() << "\n" << s;
                EXPECT_EQ(*back, *t) << s;
            } else {
                ASSERT_EQ(t.status().code(), StatusCode::kInvalidArgument);
            }
        }
    }
    EXPECT_GT(parsed, 0);
}

}  // namespace
}  // namespace pdsim::topo

// The testbed's messages (sim/testbed/protocol.h): every kind encodes to the wire form the ranks
// exchanged before the messages were typed (written out here by hand, key by key), decodes back
// to the same struct (also through CBOR, as the Mailbox sends it), and a missing, mistyped or
// out-of-range field is refused with the kind and the field named.
#include <gtest/gtest.h>

#include <string>

#include "sim/testbed/protocol.h"
#include "tests/status_matchers.h"

namespace pdsim::testbed {
namespace {

using json = nlohmann::json;
using Kind = transfer::TransferEvent::Kind;

template <class Msg>
void expect_round_trip(const Msg& msg, const json& wire) {
    SCOPED_TRACE(std::string(Msg::kKind));
    EXPECT_EQ(encode_message(msg), wire);
    StatusOr<Msg> back = decode_message<Msg>(wire);
    ASSERT_OK(back);
    EXPECT_TRUE(*back == msg);
    StatusOr<Msg> via_cbor = decode_message<Msg>(json::from_cbor(json::to_cbor(wire)));
    ASSERT_OK(via_cbor);
    EXPECT_TRUE(*via_cbor == msg);
}

// The decode error of `wire` as Msg: must fail with kInvalidArgument.
template <class Msg>
std::string decode_error(const json& wire) {
    StatusOr<Msg> got = decode_message<Msg>(wire);
    EXPECT_FALSE(got.ok()) << wire.dump();
    if (got.ok()) return {};
    EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
    return got.status().message();
}

SubmitMsg sample_submit() {
    SubmitMsg m;
    m.id = 7;
    m.input_len = 1200;
    m.output_len = 33;
    m.hash = {11, -2, 40000000000};
    m.prefill_instance = 1;
    m.decode_instance = 3;
    return m;
}

Plan sample_plan() {
    Plan p;
    p.mode = attn::ForwardMode::kDecode;
    PlanEntry a;
    a.id = 4;
    a.t0 = 0;
    a.t1 = 3;
    a.tokens = {5, 6, 7};
    a.pages = {9};
    a.first = true;
    a.last = false;
    a.input_len = 20;
    a.window_ring = {3, 1};
    PlanEntry b = a;
    b.window_ring.clear();
    b.id = 5;
    b.t0 = 19;
    b.t1 = 20;
    b.tokens = {8};
    b.pages = {1, 2};
    b.first = false;
    b.last = true;
    p.entries = {a, b};
    return p;
}

TEST(TestbedProtocol, RouterToLeaderMessages) {
    expect_round_trip(sample_submit(), json{{"k", "submit"},
                                            {"id", 7},
                                            {"in", 1200},
                                            {"out", 33},
                                            {"hash", {11, -2, 40000000000}},
                                            {"p", 1},
                                            {"d", 3}});
    expect_round_trip(CancelMsg{.id = 12}, json{{"k", "cancel"}, {"id", 12}});
    expect_round_trip(EndMsg{}, json{{"k", "end"}});
}

TEST(TestbedProtocol, LeaderToFollowerMessages) {
    const json entry_a = {{"id", 4},   {"t0", 0},    {"t1", 3}, {"tok", {5, 6, 7}}, {"pg", {9}},
                          {"f", true}, {"l", false}, {"n", 20}, {"ss", 0},          {"wr", {3, 1}}};
    const json entry_b = {{"id", 5},      {"t0", 19},           {"t1", 20},  {"tok", {8}},
                          {"pg", {1, 2}}, {"f", false},         {"l", true}, {"n", 20},
                          {"ss", 0},      {"wr", json::array()}};
    expect_round_trip(sample_plan(), json{{"k", "step"}, {"m", "d"}, {"e", {entry_a, entry_b}}});
    Plan extend = sample_plan();
    extend.mode = attn::ForwardMode::kExtend;
    extend.entries.clear();
    expect_round_trip(extend, json{{"k", "step"}, {"m", "e"}, {"e", json::array()}});
    expect_round_trip(AdmitMsg{.id = 3,
                               .pages = {4, 5},
                               .input_len = 17,
                               .prefill_ranks = {0, 1},
                               .state_slot = 6,
                               .window_ring = {7, 2}},
                      json{{"k", "admit"},
                           {"id", 3},
                           {"pg", {4, 5}},
                           {"n", 17},
                           {"pr", {0, 1}},
                           {"ss", 6},
                           {"wr", {7, 2}}});
    expect_round_trip(ReleaseMsg{.id = 99}, json{{"k", "release"}, {"id", 99}});
}

TEST(TestbedProtocol, FollowerReports) {
    SentReport sent;
    sent.id = 2;
    sent.ok = true;
    expect_round_trip(sent, json{{"k", "fsent"},
                                 {"id", 2},
                                 {"ok", true},
                                 {"err", ""},
                                 {"tok", -1},
                                 {"bytes", 0},
                                 {"idle", true},
                                 {"dg", 0}});
    ReadyReport ready;
    ready.id = 8;
    ready.ok = false;
    ready.error = "receiver submit: busy";
    ready.first_token = 41;
    ready.bytes = 1ULL << 40;
    ready.pages_idle = false;
    ready.kv_digest = 0xfedcba9876543210ULL;  // all 64 bits survive the wire
    expect_round_trip(ready, json{{"k", "fready"},
                                  {"id", 8},
                                  {"ok", false},
                                  {"err", "receiver submit: busy"},
                                  {"tok", 41},
                                  {"bytes", 1ULL << 40},
                                  {"idle", false},
                                  {"dg", 0xfedcba9876543210ULL}});
    expect_round_trip(PagesIdleMsg{.id = 8}, json{{"k", "fidle"}, {"id", 8}});
    // The two kinds share fields but not their kind.
    EXPECT_THAT(decode_error<SentReport>(encode_message(ready)), HasSubstr("'k'"));
}

TEST(TestbedProtocol, LeaderToRouterReports) {
    expect_round_trip(
        FirstTokenReport{.phase = "disagg", .id = 1, .t_us = 12.5, .prefill_start_us = 3.25},
        json{{"k", "first"}, {"ph", "disagg"}, {"id", 1}, {"t", 12.5}, {"ps", 3.25}});
    expect_round_trip(PrefillDoneReport{.phase = "disagg",
                                        .id = 2,
                                        .ok = false,
                                        .error = "send failed",
                                        .t_us = 100.0,
                                        .prefill_start_us = -1},
                      json{{"k", "pdone"},
                           {"ph", "disagg"},
                           {"id", 2},
                           {"ok", false},
                           {"err", "send failed"},
                           {"t", 100.0},
                           {"ps", -1.0},
                           {"dg", 0}});
    expect_round_trip(RequestDoneReport{.phase = "colocated",
                                        .id = 3,
                                        .ok = true,
                                        .error = "",
                                        .t_us = 50.0,
                                        .tokens = {1, 2},
                                        .token_t_us = {40.0, 50.0},
                                        .bytes = 4096,
                                        .kv_digest = 77},
                      json{{"k", "done"},
                           {"ph", "colocated"},
                           {"id", 3},
                           {"ok", true},
                           {"err", ""},
                           {"t", 50.0},
                           {"tokens", {1, 2}},
                           {"tt", {40.0, 50.0}},
                           {"bytes", 4096},
                           {"dg", 77}});
}

TEST(TestbedProtocol, CollectMessages) {
    expect_round_trip(TcpBootstrapMsg{.dir = "/tmp/pdsim-tcp-abc", .token = "00ff"},
                      json{{"k", "tcp"}, {"dir", "/tmp/pdsim-tcp-abc"}, {"tok", "00ff"}});
    expect_round_trip(ShapeMsg{.time_scale = 0.125}, json{{"k", "shape"}, {"ts", 0.125}});
    expect_round_trip(ExitMsg{.code = 2, .message = "bad flag"},
                      json{{"k", "exit"}, {"code", 2}, {"msg", "bad flag"}, {"peer_lost", false}});
}

RankResult sample_result() {
    RankResult r;
    r.rank = 3;
    r.phase = "disagg";
    r.timeline = {TimelineRecord{.tid = 1,
                                 .name = "L0 e",
                                 .category = "compute",
                                 .ts_us = 5,
                                 .dur_us = 2,
                                 .args = {{"batch", 4}}},
                  TimelineRecord{.tid = 2,
                                 .name = "record L0",
                                 .category = "record",
                                 .ts_us = 7,
                                 .dur_us = -1,
                                 .args = nullptr}};
    r.engine_events = {EngineEventRecord{.kind = Kind::kLayerPosted,
                                         .request = 9,
                                         .layer = 2,
                                         .peer = 1,
                                         .chunk = 3,
                                         .bytes = 512,
                                         .t_us = 77.5},
                       EngineEventRecord{.kind = Kind::kRequestFailed,
                                         .request = 10,
                                         .layer = -1,
                                         .peer = -1,
                                         .chunk = 0,
                                         .bytes = 0,
                                         .t_us = 80}};
    r.prefill_end_us = {{9, 70.0}, {12, 71.5}};
    r.ordering = OrderingResult{.checked_layers = 40, .violations = {"layer 3 before layer 2"}};
    r.stats = {{"forwards", 6}, {"receiver", {{"bytes", 1024}}}};
    r.error = "";
    return r;
}

TEST(TestbedProtocol, RankResultWithPositionalRecords) {
    const json wire = {
        {"k", "result"},
        {"rank", 3},
        {"phase", "disagg"},
        {"timeline",
         {json::array({1, "L0 e", "compute", 5.0, 2.0, {{"batch", 4}}}),
          json::array({2, "record L0", "record", 7.0, -1.0, nullptr})}},
        // [kind, request, layer, peer, chunk, bytes, t]: kind is TransferEvent::Kind's value.
        {"xfer",
         {json::array({static_cast<int>(Kind::kLayerPosted), 9, 2, 1, 3, 512, 77.5}),
          json::array({static_cast<int>(Kind::kRequestFailed), 10, -1, -1, 0, 0, 80.0})}},
        {"pend", {{"9", 70.0}, {"12", 71.5}}},
        {"ordering", {{"checked", 40}, {"violations", {"layer 3 before layer 2"}}}},
        {"stats", {{"forwards", 6}, {"receiver", {{"bytes", 1024}}}}},
        {"error", ""}};
    expect_round_trip(sample_result(), wire);
    // The positional kinds are the engine's enum, 1 for kLayerPosted and 5 for kRequestFailed.
    EXPECT_EQ(wire["xfer"][0][0], 1);
    EXPECT_EQ(wire["xfer"][1][0], 5);
}

TEST(TestbedProtocol, MissingFieldIsNamed) {
    json submit = encode_message(sample_submit());
    submit.erase("out");
    const std::string err = decode_error<SubmitMsg>(submit);
    EXPECT_THAT(err, HasSubstr("'submit'"));
    EXPECT_THAT(err, HasSubstr("field 'out': missing"));

    json plan = encode_message(sample_plan());
    plan["e"][1].erase("t0");
    const std::string nested = decode_error<Plan>(plan);
    EXPECT_THAT(nested, HasSubstr("'step'"));
    EXPECT_THAT(nested, HasSubstr("field 'e[1].t0': missing"));

    json result = encode_message(sample_result());
    result["xfer"][1].erase(6);  // t
    const std::string positional = decode_error<RankResult>(result);
    EXPECT_THAT(positional, HasSubstr("field 'xfer[1][6] (t)': missing"));

    json no_kind = encode_message(CancelMsg{.id = 1});
    no_kind.erase("k");
    EXPECT_THAT(decode_error<CancelMsg>(no_kind), HasSubstr("'k' is missing"));
    EXPECT_THAT(decode_error<CancelMsg>(json::array()), HasSubstr("expected an object"));
}

// Found by testbed_protocol_fuzz (fuzz/regressions/testbed_protocol_fuzz/): CBOR strings are not
// checked for UTF-8 on the way in, and quoting one in the error (json::dump) threw type_error 316
// out of decode_message, which terminated the rank. The error now quotes it with U+FFFD.
TEST(TestbedProtocol, AKindOrModeThatIsNotUtf8IsAnError) {
    const json kind = json::from_cbor(std::vector<uint8_t>{0xa1, 0x61, 'k', 0x62, 0x72, 0x98});
    EXPECT_THAT(decode_error<SubmitMsg>(kind), HasSubstr("field 'k' is \"r\xEF\xBF\xBD\""));
    json plan = encode_message(sample_plan());
    plan["m"] = std::string("\xC0");
    EXPECT_THAT(decode_error<Plan>(plan), HasSubstr("field 'm': expected \"e\" (extend)"));
}

// Found by testbed_protocol_fuzz: a CBOR array header declaring 2^63 elements made nlohmann's
// from_cbor throw out_of_range 408 although exceptions were off, out of the Mailbox's receive.
TEST(TestbedProtocol, CborWithAnExcessiveArraySizeIsDataLoss) {
    const std::vector<uint8_t> huge = {0x9b, 0x8c, 0x8c, 0x8c, 0x8c, 0x8c, 0x8c, 0x8c, 0x8c};
    EXPECT_THAT(decode_cbor(huge).status(),
                StatusIs(StatusCode::kDataLoss, HasSubstr("garbled CBOR (9 bytes)")));
    EXPECT_THAT(decode_cbor(std::vector<uint8_t>{0xa1}).status(),
                StatusIs(StatusCode::kDataLoss, HasSubstr("not one CBOR value")));
    ASSERT_OK_AND_ASSIGN(json body, decode_cbor(json::to_cbor(encode_message(EndMsg{}))));
    EXPECT_OK(decode_message<EndMsg>(body));
}

// Found by testbed_protocol_fuzz: 4,000 nested CBOR arrays overflowed the stack in nlohmann's
// recursive reader. Nesting is checked before parsing: kMaxCborDepth levels decode, one more is
// kDataLoss, whatever the container kind (definite or indefinite arrays, maps; tags).
TEST(TestbedProtocol, CborNestedTooDeepIsDataLoss) {
    auto nested = [](size_t depth, uint8_t open, bool needs_break) {
        std::vector<uint8_t> bytes(depth, open);
        if (open == 0xa1) {  // a map of one pair per level: key "", value the next level
            bytes.clear();
            for (size_t i = 0; i < depth; ++i) bytes.insert(bytes.end(), {0xa1, 0x60});
        }
        bytes.push_back(0x00);  // the innermost item
        if (needs_break) bytes.insert(bytes.end(), depth, 0xff);
        return bytes;
    };
    for (const auto& [open, needs_break] :
         std::vector<std::pair<uint8_t, bool>>{{0x81, false}, {0x9f, true}, {0xa1, false}}) {
        SCOPED_TRACE(fmt::format("container byte {:#04x}", open));
        EXPECT_OK(decode_cbor(nested(kMaxCborDepth, open, needs_break)).status());
        EXPECT_THAT(decode_cbor(nested(kMaxCborDepth + 1, open, needs_break)).status(),
                    StatusIs(StatusCode::kDataLoss, HasSubstr("nested deeper than 32 levels")));
        EXPECT_THAT(decode_cbor(nested(4000, open, needs_break)).status(),
                    StatusIs(StatusCode::kDataLoss, HasSubstr("nested deeper")));
    }
    // Tags (which from_cbor refuses anyway) count as levels before it sees them.
    EXPECT_THAT(decode_cbor(nested(4000, 0xc6, false)).status(),
                StatusIs(StatusCode::kDataLoss, HasSubstr("nested deeper")));
    // Siblings do not add up: 1,000 arrays side by side in one array are one level.
    std::vector<uint8_t> wide = {0x99, 0x03, 0xe8};  // array of 1000
    for (int i = 0; i < 1000; ++i) wide.insert(wide.end(), {0x81, 0x00});
    EXPECT_OK(decode_cbor(wide).status());
}

TEST(TestbedProtocol, MistypedFieldIsNamed) {
    json submit = encode_message(sample_submit());
    submit["in"] = "1200";
    std::string err = decode_error<SubmitMsg>(submit);
    EXPECT_THAT(err, HasSubstr("field 'in': expected an integer"));
    EXPECT_THAT(err, HasSubstr("got string"));

    submit = encode_message(sample_submit());
    submit["in"] = 12.5;  // a float is not an integer
    EXPECT_THAT(decode_error<SubmitMsg>(submit), HasSubstr("field 'in'"));

    submit = encode_message(sample_submit());
    submit["in"] = int64_t{1} << 40;  // out of int32_t's range
    err = decode_error<SubmitMsg>(submit);
    EXPECT_THAT(err, HasSubstr("field 'in': expected an integer in [-2147483648, 2147483647]"));

    submit = encode_message(sample_submit());
    submit["id"] = -1;  // ids are unsigned
    EXPECT_THAT(decode_error<SubmitMsg>(submit), HasSubstr("field 'id'"));

    submit = encode_message(sample_submit());
    submit["hash"][2] = "x";
    EXPECT_THAT(decode_error<SubmitMsg>(submit), HasSubstr("field 'hash[2]'"));

    json plan = encode_message(sample_plan());
    plan["m"] = "x";
    EXPECT_THAT(decode_error<Plan>(plan), HasSubstr("field 'm'"));
    plan = encode_message(sample_plan());
    plan["e"][0]["f"] = 1;
    EXPECT_THAT(decode_error<Plan>(plan), HasSubstr("field 'e[0].f': expected a boolean"));

    json done = encode_message(RequestDoneReport{.phase = "disagg", .id = 1, .ok = true});
    done["tt"] = 3.0;
    EXPECT_THAT(decode_error<RequestDoneReport>(done), HasSubstr("field 'tt': expected an array"));

    json result = encode_message(sample_result());
    result["xfer"][0][0] = 6;  // past kRequestFailed
    err = decode_error<RankResult>(result);
    EXPECT_THAT(err, HasSubstr("field 'xfer[0][0] (kind)': expected an engine event kind"));
    result = encode_message(sample_result());
    result["pend"]["x1"] = 3.0;
    EXPECT_THAT(decode_error<RankResult>(result), HasSubstr("field 'pend.x1'"));
    result = encode_message(sample_result());
    result["ordering"]["violations"] = {1};
    EXPECT_THAT(decode_error<RankResult>(result), HasSubstr("field 'ordering.violations[0]'"));

    json shape = encode_message(ShapeMsg{.time_scale = 1});
    shape["ts"] = true;
    EXPECT_THAT(decode_error<ShapeMsg>(shape), HasSubstr("'shape': field 'ts': expected a number"));
}

}  // namespace
}  // namespace pdsim::testbed

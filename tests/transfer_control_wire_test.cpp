// The transfer engine's control messages (transfer/engine/control.h) on the wire: every kind
// encodes to exactly the bytes below, decodes back to the same fields, and a truncated message is
// refused. The bytes are those the hand-written encoders of 7fa4a7f produced, with two changes
// since: version 2 (the header's third and fourth bytes, "0200") and the arrival words' fields
// appended to Bootstrap, Ack and Regions. The write mode's messages (Regions, LayerWritten,
// Quiesced) and the ordered plane's DataPosted came later: their bytes pin the encoding they were
// introduced with, under version 2. Running with
// PDSIM_PRINT_WIRE=1 prints the current encodings (how the golden bytes were taken).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "tests/status_matchers.h"
#include "transfer/engine/control.h"

namespace pdsim::transfer {
namespace {

// The bytes of each sample message below (version 2).
const std::string kGoldenBootstrap =
    "50444b5602000100887766554433221105000000010000000200000019000000e803000000000000"
    "00001000000000000003000000020000001000000002000000020000000100000008000000040000"
    "0004000000000100000000000008070605040302010300000007000000ffffffff2c010000250000"
    "00";
const std::string kGoldenAck =
    "50444b56020002002a000000000000000300000004000000000f0000006c61796f7574206d69736d"
    "61746368000001000000000001030000000100000010000000020000000200000001000000080000"
    "0004000000040000000001000000000000080706050403020101";
const std::string kGoldenChunk =
    "50444b56020003004d00000000000000020000000002000000000000000300000000000001200000"
    "00000000000300000028000000290000002a000000";
const std::string kGoldenAbort =
    "50444b56020004000900000000000000100000007065657220332074696d6564206f7574";
const std::string kGoldenHeartbeat = "50444b56020005000000000000000000";
const std::string kGoldenCompletion =
    "50444b560200060015cd5b07000000000100000001ff7c0000020000000200000004000000010000"
    "00030000000104000000010000000000000002000000000000000df0fecaefbeadde040000000000"
    "0000";

// The write mode's messages, as encoded when they were introduced.
const std::string kGoldenRegions =
    "50444b56020007000807060504030201060000000200000002000000040000000100000002000000"
    "000000000300000006000000a1b1b2d1d2d30300000002000000e1e2";
const std::string kGoldenLayerWritten =
    "50444b56020008001f0000000000000003000000040302013d000000e80300005544332211000000";
const std::string kGoldenQuiesced =
    "50444b56020009002c0000000000000001000000180000006465636f64652072616e6b2032206162"
    "6f72746564206974";
// The ordered data plane's DataPosted, as encoded when it was introduced.
const std::string kGoldenDataPosted =
    "50444b5602000a002d00000000000000020000000300000004000000060000000200000000010000"
    "000000000020000000000000";

std::string hex(const Bytes& bytes) {
    static const char* kDigits = "0123456789abcdef";
    std::string out;
    for (uint8_t b : bytes) {
        out.push_back(kDigits[b >> 4]);
        out.push_back(kDigits[b & 15]);
    }
    return out;
}

void check_bytes(const char* what, const Bytes& bytes, const std::string& golden) {
    if (std::getenv("PDSIM_PRINT_WIRE") != nullptr) {
        std::printf("%s %s\n", what, hex(bytes).c_str());
    }
    EXPECT_EQ(hex(bytes), golden) << what;
}

KvLayoutSummary sample_layout() {
    KvLayoutSummary s;
    s.kind = KvKind::kMHA;
    s.num_layers = 3;
    s.buffer_count = 2;
    s.page_size = 16;
    s.dtype_bytes = 2;
    s.tp_size = 2;
    s.tp_rank = 1;
    s.total_kv_heads = 8;
    s.head_begin = 4;
    s.local_heads = 4;
    s.head_bytes = {};
    s.head_bytes[0] = 256;
    s.head_bytes[1] = 0x0102030405060708ULL;
    return s;
}

void expect_layout_eq(const KvLayoutSummary& a, const KvLayoutSummary& b) {
    EXPECT_EQ(a.kind, b.kind);
    EXPECT_EQ(a.num_layers, b.num_layers);
    EXPECT_EQ(a.buffer_count, b.buffer_count);
    EXPECT_EQ(a.page_size, b.page_size);
    EXPECT_EQ(a.dtype_bytes, b.dtype_bytes);
    EXPECT_EQ(a.tp_size, b.tp_size);
    EXPECT_EQ(a.tp_rank, b.tp_rank);
    EXPECT_EQ(a.total_kv_heads, b.total_kv_heads);
    EXPECT_EQ(a.head_begin, b.head_begin);
    EXPECT_EQ(a.local_heads, b.local_heads);
    EXPECT_EQ(a.head_bytes, b.head_bytes);
}

// Every prefix of a valid message is refused as kDataLoss (none reads past the end).
void expect_truncations_refused(const Bytes& bytes,
                                const std::function<Status(std::span<const uint8_t>)>& decode) {
    for (size_t n = 0; n < bytes.size(); ++n) {
        Status st = decode(std::span<const uint8_t>(bytes.data(), n));
        EXPECT_EQ(st.code(), StatusCode::kDataLoss) << "prefix of " << n << " bytes";
    }
}

TEST(ControlWire, Bootstrap) {
    BootstrapMsg m;
    m.request_id = 0x1122334455667788ULL;
    m.decode_rank = 5;
    m.decode_tp_rank = 1;
    m.decode_tp_size = 2;
    m.data_tag = 16 + 9;
    m.num_tokens = 1000;
    m.max_message_bytes = 1 << 20;
    m.layout = sample_layout();
    m.dst_pages = {7, -1, 300};
    m.arrival_slot = 37;
    const Bytes bytes = encode(m);
    check_bytes("bootstrap", bytes, kGoldenBootstrap);
    StatusOr<BootstrapMsg> back = decode_bootstrap(bytes);
    ASSERT_OK(back);
    EXPECT_EQ(back->request_id, m.request_id);
    EXPECT_EQ(back->decode_rank, m.decode_rank);
    EXPECT_EQ(back->decode_tp_rank, m.decode_tp_rank);
    EXPECT_EQ(back->decode_tp_size, m.decode_tp_size);
    EXPECT_EQ(back->data_tag, m.data_tag);
    EXPECT_EQ(back->num_tokens, m.num_tokens);
    EXPECT_EQ(back->max_message_bytes, m.max_message_bytes);
    expect_layout_eq(back->layout, m.layout);
    EXPECT_EQ(back->dst_pages, m.dst_pages);
    EXPECT_EQ(back->arrival_slot, 37);
    expect_truncations_refused(bytes, [](auto b) { return decode_bootstrap(b).status(); });
}

TEST(ControlWire, Ack) {
    AckMsg m;
    m.request_id = 42;
    m.prefill_tp_rank = 3;
    m.prefill_tp_size = 4;
    m.ok = false;
    m.reason = "layout mismatch";
    m.max_message_bytes = 65536;
    m.layout = sample_layout();
    m.layout.kind = KvKind::kMLA;
    m.layout.buffer_count = 1;
    m.arrival_signals = true;
    const Bytes bytes = encode(m);
    check_bytes("ack", bytes, kGoldenAck);
    StatusOr<AckMsg> back = decode_ack(bytes);
    ASSERT_OK(back);
    EXPECT_EQ(back->request_id, m.request_id);
    EXPECT_EQ(back->prefill_tp_rank, m.prefill_tp_rank);
    EXPECT_EQ(back->prefill_tp_size, m.prefill_tp_size);
    EXPECT_EQ(back->ok, m.ok);
    EXPECT_EQ(back->reason, m.reason);
    EXPECT_EQ(back->max_message_bytes, m.max_message_bytes);
    expect_layout_eq(back->layout, m.layout);
    EXPECT_TRUE(back->arrival_signals);
    expect_truncations_refused(bytes, [](auto b) { return decode_ack(b).status(); });
}

TEST(ControlWire, Chunk) {
    ChunkMsg m;
    m.request_id = 77;
    m.chunk_index = 2;
    m.token_begin = 512;
    m.token_end = 768;
    m.is_last = true;
    m.src_first_page = 32;
    m.src_pages = {40, 41, 42};
    const Bytes bytes = encode(m);
    check_bytes("chunk", bytes, kGoldenChunk);
    StatusOr<ChunkMsg> back = decode_chunk(bytes);
    ASSERT_OK(back);
    EXPECT_EQ(back->request_id, m.request_id);
    EXPECT_EQ(back->chunk_index, m.chunk_index);
    EXPECT_EQ(back->token_begin, m.token_begin);
    EXPECT_EQ(back->token_end, m.token_end);
    EXPECT_EQ(back->is_last, m.is_last);
    EXPECT_EQ(back->src_first_page, m.src_first_page);
    EXPECT_EQ(back->src_pages, m.src_pages);
    expect_truncations_refused(bytes, [](auto b) { return decode_chunk(b).status(); });
}

TEST(ControlWire, Abort) {
    AbortMsg m;
    m.request_id = 9;
    m.reason = "peer 3 timed out";
    const Bytes bytes = encode(m);
    check_bytes("abort", bytes, kGoldenAbort);
    StatusOr<AbortMsg> back = decode_abort(bytes);
    ASSERT_OK(back);
    EXPECT_EQ(back->request_id, m.request_id);
    EXPECT_EQ(back->reason, m.reason);
    expect_truncations_refused(bytes, [](auto b) { return decode_abort(b).status(); });
}

TEST(ControlWire, Heartbeat) {
    const Bytes bytes = encode_heartbeat();
    check_bytes("heartbeat", bytes, kGoldenHeartbeat);
    StatusOr<MsgType> type = peek_type(bytes);
    ASSERT_OK(type);
    EXPECT_EQ(*type, MsgType::kHeartbeat);
}

TEST(ControlWire, Completion) {
    CompletionMsg m;
    m.request_id = 123456789;
    m.src_tp_rank = 1;
    m.has_first_token = true;
    m.first_token = 31999;
    m.num_layers = 2;
    m.buffer_count = 2;
    m.head_begin = 4;
    m.head_count = 1;
    m.chunks = 3;
    m.has_checksums = true;
    m.checksums = {1, 2, 0xdeadbeefcafef00dULL, 4};
    const Bytes bytes = encode(m);
    check_bytes("completion", bytes, kGoldenCompletion);
    EXPECT_LE(bytes.size(), completion_capacity(2, 2, 1));
    StatusOr<CompletionMsg> back = decode_completion(bytes);
    ASSERT_OK(back);
    EXPECT_EQ(back->request_id, m.request_id);
    EXPECT_EQ(back->src_tp_rank, m.src_tp_rank);
    EXPECT_EQ(back->has_first_token, m.has_first_token);
    EXPECT_EQ(back->first_token, m.first_token);
    EXPECT_EQ(back->num_layers, m.num_layers);
    EXPECT_EQ(back->buffer_count, m.buffer_count);
    EXPECT_EQ(back->head_begin, m.head_begin);
    EXPECT_EQ(back->head_count, m.head_count);
    EXPECT_EQ(back->chunks, m.chunks);
    EXPECT_EQ(back->has_checksums, m.has_checksums);
    EXPECT_EQ(back->checksums, m.checksums);
    expect_truncations_refused(bytes, [](auto b) { return decode_completion(b).status(); });
    // A checksum count that disagrees with the dimensions is refused.
    m.checksums.pop_back();
    EXPECT_EQ(decode_completion(encode(m)).status().code(), StatusCode::kDataLoss);
}

TEST(ControlWire, Regions) {
    RegionsMsg m;
    m.request_id = 0x0102030405060708ULL;
    m.decode_rank = 6;
    m.num_layers = 2;
    m.buffer_count = 2;
    const std::vector<std::vector<uint8_t>> descriptors = {
        {0xa1}, {0xb1, 0xb2}, {}, {0xd1, 0xd2, 0xd3}};
    for (const auto& d : descriptors) m.add(d);
    m.arrival_slots = 3;
    m.arrival_descriptor = {0xe1, 0xe2};
    const Bytes bytes = encode(m);
    check_bytes("regions", bytes, kGoldenRegions);
    StatusOr<RegionsMsg> back = decode_regions(bytes);
    ASSERT_OK(back);
    EXPECT_EQ(back->request_id, m.request_id);
    EXPECT_EQ(back->decode_rank, m.decode_rank);
    EXPECT_EQ(back->num_layers, m.num_layers);
    EXPECT_EQ(back->buffer_count, m.buffer_count);
    ASSERT_EQ(back->descriptor_bytes.size(), descriptors.size());
    for (size_t i = 0; i < descriptors.size(); ++i) {
        const std::span<const uint8_t> d = back->descriptor(i);
        EXPECT_EQ(std::vector<uint8_t>(d.begin(), d.end()), descriptors[i]) << "descriptor " << i;
    }
    EXPECT_EQ(back->arrival_slots, 3);
    EXPECT_EQ(back->arrival_descriptor, m.arrival_descriptor);
    expect_truncations_refused(bytes, [](auto b) { return decode_regions(b).status(); });
    // Descriptor sizes that disagree with the dimensions or with the bytes are refused.
    RegionsMsg short_count = m;
    short_count.num_layers = 3;
    EXPECT_THAT(decode_regions(encode(short_count)).status(),
                StatusIs(StatusCode::kDataLoss, HasSubstr("4 descriptors")));
    RegionsMsg bad_sizes = m;
    bad_sizes.descriptor_bytes[3] = 4;
    EXPECT_THAT(decode_regions(encode(bad_sizes)).status(),
                StatusIs(StatusCode::kDataLoss, HasSubstr("7 of 6 bytes")));
    // Arrival slots without their region's descriptor (or the other way round) are refused.
    RegionsMsg no_descriptor = m;
    no_descriptor.arrival_descriptor.clear();
    EXPECT_THAT(decode_regions(encode(no_descriptor)).status(),
                StatusIs(StatusCode::kDataLoss, HasSubstr("3 arrival slots with a 0-byte")));
    RegionsMsg no_slots = m;
    no_slots.arrival_slots = 0;
    EXPECT_THAT(decode_regions(encode(no_slots)).status(),
                StatusIs(StatusCode::kDataLoss, HasSubstr("0 arrival slots with a 2-byte")));
}

TEST(ControlWire, LayerWritten) {
    LayerWrittenMsg m;
    m.request_id = 31;
    m.src_tp_rank = 3;
    m.chunk_index = 0x01020304;
    m.layer = 61;
    m.writes = 1000;
    m.bytes = 0x1122334455ULL;
    const Bytes bytes = encode(m);
    check_bytes("layer_written", bytes, kGoldenLayerWritten);
    StatusOr<LayerWrittenMsg> back = decode_layer_written(bytes);
    ASSERT_OK(back);
    EXPECT_EQ(back->request_id, m.request_id);
    EXPECT_EQ(back->src_tp_rank, m.src_tp_rank);
    EXPECT_EQ(back->chunk_index, m.chunk_index);
    EXPECT_EQ(back->layer, m.layer);
    EXPECT_EQ(back->writes, m.writes);
    EXPECT_EQ(back->bytes, m.bytes);
    expect_truncations_refused(bytes, [](auto b) { return decode_layer_written(b).status(); });
}

TEST(ControlWire, Quiesced) {
    QuiescedMsg m;
    m.request_id = 44;
    m.src_tp_rank = 1;
    m.reason = "decode rank 2 aborted it";
    const Bytes bytes = encode(m);
    check_bytes("quiesced", bytes, kGoldenQuiesced);
    StatusOr<QuiescedMsg> back = decode_quiesced(bytes);
    ASSERT_OK(back);
    EXPECT_EQ(back->request_id, m.request_id);
    EXPECT_EQ(back->src_tp_rank, m.src_tp_rank);
    EXPECT_EQ(back->reason, m.reason);
    expect_truncations_refused(bytes, [](auto b) { return decode_quiesced(b).status(); });
    StatusOr<MsgType> type = peek_type(bytes);
    ASSERT_OK(type);
    EXPECT_EQ(*type, MsgType::kQuiesced);
    EXPECT_EQ(msg_type_name(*type), "quiesced");
}

TEST(ControlWire, DataPosted) {
    DataPostedMsg m;
    m.request_id = 45;
    m.src_tp_rank = 2;
    m.chunk_index = 3;
    m.layer_begin = 4;
    m.layer_end = 6;
    m.sizes = {0x100, 0x2000};
    const Bytes bytes = encode(m);
    check_bytes("data_posted", bytes, kGoldenDataPosted);
    StatusOr<DataPostedMsg> back = decode_data_posted(bytes);
    ASSERT_OK(back);
    EXPECT_EQ(back->request_id, m.request_id);
    EXPECT_EQ(back->src_tp_rank, m.src_tp_rank);
    EXPECT_EQ(back->chunk_index, m.chunk_index);
    EXPECT_EQ(back->layer_begin, m.layer_begin);
    EXPECT_EQ(back->layer_end, m.layer_end);
    EXPECT_EQ(back->sizes, m.sizes);
    expect_truncations_refused(bytes, [](auto b) { return decode_data_posted(b).status(); });
    StatusOr<MsgType> type = peek_type(bytes);
    ASSERT_OK(type);
    EXPECT_EQ(*type, MsgType::kDataPosted);
    EXPECT_EQ(msg_type_name(*type), "data_posted");
    // Frames that encode fine but announce nothing sensible are refused.
    DataPostedMsg empty_interval = m;
    empty_interval.layer_end = empty_interval.layer_begin;
    EXPECT_THAT(decode_data_posted(encode(empty_interval)).status(),
                StatusIs(StatusCode::kDataLoss, HasSubstr("announces layers [4, 4)")));
    DataPostedMsg negative = m;
    negative.layer_begin = -1;
    EXPECT_THAT(decode_data_posted(encode(negative)).status(),
                StatusIs(StatusCode::kDataLoss, HasSubstr("layers [-1, 6)")));
    DataPostedMsg no_sizes = m;
    no_sizes.sizes.clear();
    EXPECT_THAT(decode_data_posted(encode(no_sizes)).status(),
                StatusIs(StatusCode::kDataLoss, HasSubstr("with 0 message sizes")));
    DataPostedMsg zero_size = m;
    zero_size.sizes[1] = 0;
    EXPECT_THAT(decode_data_posted(encode(zero_size)).status(),
                StatusIs(StatusCode::kDataLoss, HasSubstr("none may be 0")));
    // A size count past the frame's end is a truncation.
    Bytes overlong = bytes;
    overlong[32] = 3;
    EXPECT_THAT(decode_data_posted(overlong).status(),
                StatusIs(StatusCode::kDataLoss, HasSubstr("truncated or malformed data_posted")));
}

TEST(ControlWire, WrongTypeIsRefused) {
    AbortMsg m;
    m.request_id = 1;
    EXPECT_EQ(decode_chunk(encode(m)).status().code(), StatusCode::kDataLoss);
    EXPECT_EQ(decode_abort(encode_heartbeat()).status().code(), StatusCode::kDataLoss);
    EXPECT_EQ(decode_layer_written(encode(QuiescedMsg{})).status().code(), StatusCode::kDataLoss);
    EXPECT_EQ(decode_data_posted(encode(QuiescedMsg{})).status().code(), StatusCode::kDataLoss);
    // A type past the last one is unknown.
    Bytes unknown = encode(QuiescedMsg{});
    unknown[6] = static_cast<uint8_t>(static_cast<uint16_t>(MsgType::kDataPosted) + 1);
    EXPECT_THAT(peek_type(unknown).status(),
                StatusIs(StatusCode::kDataLoss, HasSubstr("unknown control message type 11")));
}

}  // namespace
}  // namespace pdsim::transfer

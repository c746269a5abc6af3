// libFuzzer target: the KV transfer engine's control-message codec (transfer/engine/control.h)
// on arbitrary bytes: peek_type, then the decoder of that type (and, so that every decoder sees
// every input, the decoder named by the input's size). A message a decoder accepts must
// re-encode to bytes that decode again and re-encode to the same bytes (encode(decode(x)) is
// canonical: bools become 0/1, trailing bytes are dropped) and be no longer than the input.
#include <span>

#include "fuzz/fuzz_target.h"
#include "transfer/engine/control.h"

namespace {

using namespace pdsim::transfer;

template <class Decode>
void round_trip(std::span<const uint8_t> in, Decode decode) {
    auto m = decode(in);
    if (!m.ok()) return;
    const Bytes once = encode(*m);
    PDSIM_FUZZ_CHECK(once.size() <= in.size(), "the canonical form is no longer");
    auto again = decode(once);
    PDSIM_FUZZ_CHECK(again.ok(), "the canonical form decodes");
    PDSIM_FUZZ_CHECK(encode(*again) == once, "encode(decode(x)) is canonical");
}

void decode_as(MsgType type, std::span<const uint8_t> in) {
    switch (type) {
        case MsgType::kBootstrap:
            return round_trip(in, [](auto b) { return decode_bootstrap(b); });
        case MsgType::kAck:
            return round_trip(in, [](auto b) { return decode_ack(b); });
        case MsgType::kChunk:
            return round_trip(in, [](auto b) { return decode_chunk(b); });
        case MsgType::kAbort:
            return round_trip(in, [](auto b) { return decode_abort(b); });
        case MsgType::kHeartbeat:
            return;  // no body to decode
        case MsgType::kCompletion:
            return round_trip(in, [](auto b) { return decode_completion(b); });
        case MsgType::kRegions: {
            auto m = decode_regions(in);
            if (m.ok()) {
                for (size_t i = 0; i < m->descriptor_bytes.size(); ++i) (void)m->descriptor(i);
            }
            return round_trip(in, [](auto b) { return decode_regions(b); });
        }
        case MsgType::kLayerWritten:
            return round_trip(in, [](auto b) { return decode_layer_written(b); });
        case MsgType::kQuiesced:
            return round_trip(in, [](auto b) { return decode_quiesced(b); });
        case MsgType::kDataPosted:
            return round_trip(in, [](auto b) { return decode_data_posted(b); });
    }
}

}  // namespace

PDSIM_FUZZ_TARGET(control_codec_fuzz) {
    const std::span<const uint8_t> in(data, size);
    auto type = peek_type(in);
    if (type.ok()) decode_as(*type, in);
    // A decoder given a message of another type must refuse it, not misread it.
    decode_as(static_cast<MsgType>(1 + size % 10), in);
    return 0;
}

// libFuzzer target: the tcp transport's frame decoder (transfer/tcp/frame.h) on arbitrary bytes,
// read as a stream of frames the way a receiver reads them: a 24-byte header (decode_header, at
// a 1 MiB max_frame_bytes), then its payload, a hello's through decode_hello. Round trips: a
// decoded header encodes to the same bytes (with the ignored flags word zeroed), a decoded hello
// to the same payload, and make_frame rebuilds the frame.
#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

#include "fuzz/fuzz_target.h"
#include "transfer/tcp/frame.h"

PDSIM_FUZZ_TARGET(tcp_frame_fuzz) {
    using namespace pdsim::transfer::frame;
    constexpr uint64_t kMaxPayload = uint64_t{1} << 20;
    std::span<const uint8_t> in(data, size);
    while (in.size() >= kFrameHeaderBytes) {
        const auto header = in.first<kFrameHeaderBytes>();
        auto h = decode_header(header, kMaxPayload);
        if (!h.ok()) break;
        PDSIM_FUZZ_CHECK(h->length <= kMaxPayload, "the length is bounded");
        HeaderBytes canonical{};
        std::memcpy(canonical.data(), header.data(), kFrameHeaderBytes);
        std::fill(canonical.begin() + 12, canonical.begin() + 16, uint8_t{0});  // flags
        PDSIM_FUZZ_CHECK(encode_header(*h) == canonical, "a header round-trips");
        in = in.subspan(kFrameHeaderBytes);
        if (in.size() < h->length) break;  // a truncated frame: the receiver waits for more
        const auto payload = in.first(static_cast<size_t>(h->length));
        in = in.subspan(static_cast<size_t>(h->length));
        if (h->type == FrameType::kHello) {
            auto hello = decode_hello(payload);
            if (hello.ok()) {
                const std::vector<uint8_t> again = encode_hello(*hello);
                PDSIM_FUZZ_CHECK(
                    std::equal(again.begin(), again.end(), payload.begin(), payload.end()),
                    "a hello round-trips");
            }
        }
        const std::vector<uint8_t> frame = make_frame(h->type, h->tag, payload);
        PDSIM_FUZZ_CHECK(
            frame.size() == kFrameHeaderBytes + payload.size() &&
                std::equal(canonical.begin(), canonical.end(), frame.begin()) &&
                std::equal(payload.begin(), payload.end(), frame.begin() + kFrameHeaderBytes),
            "make_frame rebuilds the frame");
    }
    return 0;
}

#include "transfer/tcp/frame.h"

#include <cstring>

namespace pdsim::transfer::frame {

namespace {

template <typename T>
void put_le(uint8_t* p, T v) {
    for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

template <typename T>
T get_le(const uint8_t* p) {
    T v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<T>(p[i]) << (8 * i));
    return v;
}

}  // namespace

HeaderBytes encode_header(const FrameHeader& h) {
    HeaderBytes b{};
    put_le<uint32_t>(b.data(), kFrameMagic);
    put_le<uint16_t>(b.data() + 4, kFrameVersion);
    put_le<uint16_t>(b.data() + 6, static_cast<uint16_t>(h.type));
    put_le<uint32_t>(b.data() + 8, h.tag);
    put_le<uint32_t>(b.data() + 12, 0);
    put_le<uint64_t>(b.data() + 16, h.length);
    return b;
}

StatusOr<FrameHeader> decode_header(std::span<const uint8_t, kFrameHeaderBytes> in,
                                    uint64_t max_payload) {
    auto magic = get_le<uint32_t>(in.data());
    if (magic != kFrameMagic) {
        return Status(StatusCode::kDataLoss,
                      fmt::format("bad frame magic 0x{:08x} (expected 0x{:08x}): not a pdsim "
                                  "peer or a corrupt stream",
                                  magic, kFrameMagic));
    }
    auto version = get_le<uint16_t>(in.data() + 4);
    if (version != kFrameVersion) {
        return Status(StatusCode::kDataLoss, fmt::format("frame version {} (this build speaks {})",
                                                         version, kFrameVersion));
    }
    auto type = get_le<uint16_t>(in.data() + 6);
    if (type < static_cast<uint16_t>(FrameType::kHello) ||
        type > static_cast<uint16_t>(FrameType::kError)) {
        return Status(StatusCode::kDataLoss, fmt::format("unknown frame type {}", type));
    }
    FrameHeader h;
    h.type = static_cast<FrameType>(type);
    h.tag = get_le<uint32_t>(in.data() + 8);
    h.length = get_le<uint64_t>(in.data() + 16);
    uint64_t cap = h.type == FrameType::kData ? max_payload : kMaxControlPayload;
    if (h.length > cap) {
        return Status(StatusCode::kDataLoss,
                      fmt::format("frame of {} bytes exceeds max_frame_bytes {} (protocol error)",
                                  h.length, cap));
    }
    return h;
}

std::vector<uint8_t> encode_hello(const Hello& h) {
    std::vector<uint8_t> out(8 + h.token.size());
    put_le<uint32_t>(out.data(), static_cast<uint32_t>(h.world_size));
    put_le<uint32_t>(out.data() + 4, static_cast<uint32_t>(h.token.size()));
    if (!h.token.empty()) std::memcpy(out.data() + 8, h.token.data(), h.token.size());
    return out;
}

StatusOr<Hello> decode_hello(std::span<const uint8_t> payload) {
    if (payload.size() < 8) {
        return Status(StatusCode::kDataLoss,
                      fmt::format("hello of {} bytes is too short", payload.size()));
    }
    Hello h;
    h.world_size = static_cast<int>(get_le<uint32_t>(payload.data()));
    auto len = get_le<uint32_t>(payload.data() + 4);
    if (len != payload.size() - 8) {
        return Status(StatusCode::kDataLoss,
                      fmt::format("hello token length {} does not match the {}-byte payload", len,
                                  payload.size()));
    }
    h.token.assign(reinterpret_cast<const char*>(payload.data()) + 8, len);
    return h;
}

std::vector<uint8_t> make_frame(FrameType type, Tag tag, std::span<const uint8_t> payload) {
    HeaderBytes hb = encode_header(FrameHeader{type, tag, payload.size()});
    std::vector<uint8_t> out(kFrameHeaderBytes + payload.size());
    std::memcpy(out.data(), hb.data(), kFrameHeaderBytes);
    if (!payload.empty())
        std::memcpy(out.data() + kFrameHeaderBytes, payload.data(), payload.size());
    return out;
}

}  // namespace pdsim::transfer::frame

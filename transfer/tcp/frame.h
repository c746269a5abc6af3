// The wire format of the tcp transport.
//
// Every frame is a 24-byte header followed by `length` payload bytes. Header fields are
// little-endian:
//   offset 0  u32 magic   kFrameMagic ("PDSF")
//   offset 4  u16 version kFrameVersion
//   offset 6  u16 type    FrameType
//   offset 8  u32 tag     kData: the message tag; kHello/kHelloAck: the sender's rank
//   offset 12 u32 flags   0
//   offset 16 u64 length  payload bytes
// Connection setup: the higher rank connects to the lower one and sends kHello (payload:
// u32 world_size, u32 token length, token bytes); the acceptor answers kHelloAck (payload:
// u32 world_size) or kReject (payload: a UTF-8 reason) and closes. After setup, kData frames
// carry messages, kBye announces an orderly close, kError carries a reason before the sender
// drops the connection because of a protocol error.
// A header with a bad magic, version or type, or a length above the receiver's max_frame_bytes,
// is a protocol error (kDataLoss): the connection is failed.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "transfer/transport.h"

namespace pdsim::transfer::frame {

inline constexpr uint32_t kFrameMagic = 0x46534450;  // "PDSF" in memory order
inline constexpr uint16_t kFrameVersion = 1;
inline constexpr size_t kFrameHeaderBytes = 24;
inline constexpr size_t kMaxControlPayload = 4096;  // hello, ack, reject, error

enum class FrameType : uint16_t {
    kHello = 1,
    kHelloAck = 2,
    kReject = 3,
    kData = 4,
    kBye = 5,
    kError = 6,
};

struct FrameHeader {
    FrameType type = FrameType::kData;
    Tag tag = 0;
    uint64_t length = 0;
};

using HeaderBytes = std::array<uint8_t, kFrameHeaderBytes>;

[[nodiscard]] HeaderBytes encode_header(const FrameHeader& h);
// kDataLoss naming the problem for a malformed header or a length above max_payload.
[[nodiscard]] StatusOr<FrameHeader> decode_header(std::span<const uint8_t, kFrameHeaderBytes> in,
                                                  uint64_t max_payload);

struct Hello {
    int world_size = 0;
    std::string token;
};
[[nodiscard]] std::vector<uint8_t> encode_hello(const Hello& h);
[[nodiscard]] StatusOr<Hello> decode_hello(std::span<const uint8_t> payload);

// A complete frame (header + payload) in one buffer, for control frames and tests.
[[nodiscard]] std::vector<uint8_t> make_frame(FrameType type, Tag tag,
                                              std::span<const uint8_t> payload);

}  // namespace pdsim::transfer::frame

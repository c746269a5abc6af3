// The control messages' codec (transfer/engine/control.h): pure functions over bytes, in its
// own library (pdsim_control_codec) so that its tests need no transport.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>

#include "transfer/engine/control.h"

namespace pdsim::transfer {

std::string_view msg_type_name(MsgType type) {
    switch (type) {
        case MsgType::kBootstrap:
            return "bootstrap";
        case MsgType::kAck:
            return "ack";
        case MsgType::kChunk:
            return "chunk";
        case MsgType::kAbort:
            return "abort";
        case MsgType::kHeartbeat:
            return "heartbeat";
        case MsgType::kCompletion:
            return "completion";
        case MsgType::kRegions:
            return "regions";
        case MsgType::kLayerWritten:
            return "layer_written";
        case MsgType::kQuiesced:
            return "quiesced";
        case MsgType::kDataPosted:
            return "data_posted";
    }
    return "?";
}

namespace {

constexpr uint32_t kMagic = 0x564B4450;  // "PDKV"
// 2: the write plane's arrival words (Bootstrap.arrival_slot, Ack.arrival_signals,
// Regions.arrival_slots / arrival_descriptor). A peer of another version is refused.
constexpr uint16_t kVersion = 2;
constexpr size_t kHeaderBytes = 8;
constexpr uint32_t kMaxStringBytes = 1 << 16;

// The layout summary's fields, in wire order (Writer and Reader walk this one list).
template <class Self, class V>
void layout_fields(Self& s, V& v) {
    v(s.kind);
    v(s.num_layers);
    v(s.buffer_count);
    v(s.page_size);
    v(s.dtype_bytes);
    v(s.tp_size);
    v(s.tp_rank);
    v(s.total_kv_heads);
    v(s.head_begin);
    v(s.local_heads);
    v(s.head_bytes);
}

// The heartbeat's body: one unused word (request id 0).
struct HeartbeatMsg {
    static constexpr MsgType kType = MsgType::kHeartbeat;
    uint64_t request_id = 0;
    template <class Self, class V>
    static void fields(Self& m, V& v) {
        v(m.request_id);
    }
};

template <class T>
struct IsVector : std::false_type {};
template <class T>
struct IsVector<std::vector<T>> : std::true_type {};
template <class T>
struct IsArray : std::false_type {};
template <class T, size_t N>
struct IsArray<std::array<T, N>> : std::true_type {};

// Wire forms (host byte order): scalars as their bytes, bool as one byte (0 / 1), a string as a
// uint32 length and its bytes (at most kMaxStringBytes: longer strings are cut), a vector as a
// uint32 count and its elements, a fixed array as its elements, KvKind as one byte.
class Writer {
public:
    explicit Writer(MsgType type) {
        (*this)(kMagic);
        (*this)(kVersion);
        (*this)(static_cast<uint16_t>(type));
    }
    template <typename T>
    void operator()(const T& v) {
        if constexpr (std::is_same_v<T, bool>) {
            put<uint8_t>(v ? 1 : 0);
        } else if constexpr (std::is_same_v<T, std::string>) {
            const auto n = static_cast<uint32_t>(std::min<size_t>(v.size(), kMaxStringBytes));
            put(n);
            append(v.data(), n);
        } else if constexpr (IsVector<T>::value) {
            static_assert(std::is_trivially_copyable_v<typename T::value_type>);
            put(static_cast<uint32_t>(v.size()));
            append(v.data(), v.size() * sizeof(typename T::value_type));
        } else if constexpr (IsArray<T>::value) {
            for (const auto& x : v) (*this)(x);
        } else if constexpr (std::is_same_v<T, KvLayoutSummary>) {
            layout_fields(v, *this);
        } else if constexpr (std::is_same_v<T, KvKind>) {
            put(static_cast<uint8_t>(v));
        } else {
            put(v);
        }
    }
    Bytes take() { return std::move(out_); }

private:
    template <typename T>
    void put(T v) {
        static_assert(std::is_arithmetic_v<T>);
        append(&v, sizeof(T));
    }
    // Out of line: with the vector's growth and the copy inlined together, GCC 12 at -O3 reports
    // a false -Wstringop-overflow (an error under CI's -Werror).
    [[gnu::noinline]] void append(const void* data, size_t bytes) {
        if (bytes == 0) return;
        const size_t at = out_.size();
        out_.resize(at + bytes);
        std::memcpy(out_.data() + at, data, bytes);
    }
    Bytes out_;
};

// Reads what Writer wrote; any shortfall or invalid value makes finish() fail (the fields read
// after it are left default).
class Reader {
public:
    explicit Reader(std::span<const uint8_t> in) : in_(in), pos_(kHeaderBytes) {}
    template <typename T>
    void operator()(T& v) {
        if constexpr (std::is_same_v<T, bool>) {
            v = get<uint8_t>() != 0;
        } else if constexpr (std::is_same_v<T, std::string>) {
            const auto n = get<uint32_t>();
            if (!ok_ || n > kMaxStringBytes || in_.size() - pos_ < n) {
                ok_ = false;
                v.clear();
                return;
            }
            v.assign(reinterpret_cast<const char*>(in_.data() + pos_), n);
            pos_ += n;
        } else if constexpr (IsVector<T>::value) {
            using E = typename T::value_type;
            const auto n = get<uint32_t>();
            if (!ok_ || (in_.size() - pos_) / sizeof(E) < n) {
                ok_ = false;
                v.clear();
                return;
            }
            v.resize(n);
            // (An empty vector's data() may be null, which memcpy must not get even for 0 bytes.)
            if (n > 0) std::memcpy(v.data(), in_.data() + pos_, n * sizeof(E));
            pos_ += n * sizeof(E);
        } else if constexpr (IsArray<T>::value) {
            for (auto& x : v) (*this)(x);
        } else if constexpr (std::is_same_v<T, KvLayoutSummary>) {
            layout_fields(v, *this);
            if (v.buffer_count < 1 || v.buffer_count > kMaxKvBuffers || v.page_size < 1 ||
                v.num_layers < 1 || v.tp_size < 1 || v.local_heads < 1) {
                ok_ = false;
            }
        } else if constexpr (std::is_same_v<T, KvKind>) {
            const auto kind = get<uint8_t>();
            if (kind > 1) ok_ = false;
            v = static_cast<KvKind>(kind);
        } else {
            v = get<T>();
        }
    }
    [[nodiscard]] Status finish(MsgType type) const {
        if (!ok_) {
            return PDSIM_ERROR(StatusCode::kDataLoss,
                               "truncated or malformed {} message ({} bytes)", msg_type_name(type),
                               in_.size());
        }
        return {};
    }

private:
    template <typename T>
    T get() {
        static_assert(std::is_arithmetic_v<T>);
        T v{};
        if (!ok_ || in_.size() - pos_ < sizeof(T)) {
            ok_ = false;
            return v;
        }
        std::memcpy(&v, in_.data() + pos_, sizeof(T));
        pos_ += sizeof(T);
        return v;
    }
    std::span<const uint8_t> in_;
    size_t pos_;
    bool ok_ = true;
};

Status expect_type(std::span<const uint8_t> bytes, MsgType want) {
    PDSIM_ASSIGN_OR_RETURN(MsgType got, peek_type(bytes));
    if (got != want) {
        return PDSIM_ERROR(StatusCode::kDataLoss, "expected a {} message, got {}",
                           msg_type_name(want), msg_type_name(got));
    }
    return {};
}

// The one encoder and the one decoder: both walk Msg::fields.
template <class Msg>
Bytes encode_message(const Msg& m) {
    Writer w(Msg::kType);
    Msg::fields(m, w);
    return w.take();
}

template <class Msg>
StatusOr<Msg> decode_message(std::span<const uint8_t> bytes) {
    PDSIM_RETURN_IF_ERROR(expect_type(bytes, Msg::kType));
    Reader r(bytes);
    Msg m;
    Msg::fields(m, r);
    PDSIM_RETURN_IF_ERROR(r.finish(Msg::kType));
    return m;
}

}  // namespace

StatusOr<MsgType> peek_type(std::span<const uint8_t> bytes) {
    if (bytes.size() < kHeaderBytes) {
        return PDSIM_ERROR(StatusCode::kDataLoss, "control message of {} bytes", bytes.size());
    }
    uint32_t magic;
    uint16_t version;
    uint16_t type;
    std::memcpy(&magic, bytes.data(), 4);
    std::memcpy(&version, bytes.data() + 4, 2);
    std::memcpy(&type, bytes.data() + 6, 2);
    if (magic != kMagic) {
        return PDSIM_ERROR(StatusCode::kDataLoss, "bad control message magic {:#x}", magic);
    }
    if (version != kVersion) {
        return PDSIM_ERROR(StatusCode::kDataLoss, "control message version {} (expected {})",
                           version, kVersion);
    }
    if (type < 1 || type > static_cast<uint16_t>(MsgType::kDataPosted)) {
        return PDSIM_ERROR(StatusCode::kDataLoss, "unknown control message type {}", type);
    }
    return static_cast<MsgType>(type);
}

Bytes encode(const BootstrapMsg& m) {
    return encode_message(m);
}
Bytes encode(const AckMsg& m) {
    return encode_message(m);
}
Bytes encode(const ChunkMsg& m) {
    return encode_message(m);
}
Bytes encode(const AbortMsg& m) {
    return encode_message(m);
}
Bytes encode_heartbeat() {
    return encode_message(HeartbeatMsg{});
}
Bytes encode(const CompletionMsg& m) {
    return encode_message(m);
}
Bytes encode(const RegionsMsg& m) {
    return encode_message(m);
}
Bytes encode(const LayerWrittenMsg& m) {
    return encode_message(m);
}
Bytes encode(const QuiescedMsg& m) {
    return encode_message(m);
}
Bytes encode(const DataPostedMsg& m) {
    return encode_message(m);
}

StatusOr<BootstrapMsg> decode_bootstrap(std::span<const uint8_t> bytes) {
    return decode_message<BootstrapMsg>(bytes);
}
StatusOr<AckMsg> decode_ack(std::span<const uint8_t> bytes) {
    return decode_message<AckMsg>(bytes);
}
StatusOr<ChunkMsg> decode_chunk(std::span<const uint8_t> bytes) {
    return decode_message<ChunkMsg>(bytes);
}
StatusOr<AbortMsg> decode_abort(std::span<const uint8_t> bytes) {
    return decode_message<AbortMsg>(bytes);
}

size_t completion_capacity(int num_layers, int buffer_count, int head_count) {
    // Header + fixed fields + vector length + the sums.
    return kHeaderBytes + 8 + 4 + 1 + 4 + 4 * 4 + 4 + 1 + 4 +
           static_cast<size_t>(num_layers) * static_cast<size_t>(buffer_count) *
               static_cast<size_t>(head_count) * 8;
}

StatusOr<CompletionMsg> decode_completion(std::span<const uint8_t> bytes) {
    PDSIM_ASSIGN_OR_RETURN(CompletionMsg m, decode_message<CompletionMsg>(bytes));
    if (m.has_checksums &&
        m.checksums.size() != static_cast<size_t>(m.num_layers) *
                                  static_cast<size_t>(std::max(m.buffer_count, 0)) *
                                  static_cast<size_t>(std::max(m.head_count, 0))) {
        return PDSIM_ERROR(StatusCode::kDataLoss,
                           "completion of request {} carries {} checksums for {} layers x {} "
                           "buffers x {} heads",
                           m.request_id, m.checksums.size(), m.num_layers, m.buffer_count,
                           m.head_count);
    }
    return m;
}

void RegionsMsg::add(std::span<const uint8_t> descriptor) {
    descriptor_bytes.push_back(static_cast<uint32_t>(descriptor.size()));
    descriptors.insert(descriptors.end(), descriptor.begin(), descriptor.end());
}

std::span<const uint8_t> RegionsMsg::descriptor(size_t index) const {
    size_t at = 0;
    for (size_t i = 0; i < index; ++i) at += descriptor_bytes[i];
    return std::span<const uint8_t>(descriptors.data() + at, descriptor_bytes[index]);
}

StatusOr<RegionsMsg> decode_regions(std::span<const uint8_t> bytes) {
    PDSIM_ASSIGN_OR_RETURN(RegionsMsg m, decode_message<RegionsMsg>(bytes));
    uint64_t total = 0;
    for (uint32_t n : m.descriptor_bytes) total += n;
    if (m.num_layers < 1 || m.buffer_count < 1 || m.buffer_count > kMaxKvBuffers ||
        m.descriptor_bytes.size() !=
            static_cast<size_t>(m.num_layers) * static_cast<size_t>(m.buffer_count) ||
        total != m.descriptors.size() || m.arrival_slots < 0 ||
        (m.arrival_slots > 0) != !m.arrival_descriptor.empty()) {
        return PDSIM_ERROR(StatusCode::kDataLoss,
                           "regions message of decode rank {} carries {} descriptors ({} of {} "
                           "bytes) for {} layers x {} buffers, and {} arrival slots with a "
                           "{}-byte descriptor",
                           m.decode_rank, m.descriptor_bytes.size(), total, m.descriptors.size(),
                           m.num_layers, m.buffer_count, m.arrival_slots,
                           m.arrival_descriptor.size());
    }
    return m;
}
StatusOr<LayerWrittenMsg> decode_layer_written(std::span<const uint8_t> bytes) {
    return decode_message<LayerWrittenMsg>(bytes);
}
StatusOr<QuiescedMsg> decode_quiesced(std::span<const uint8_t> bytes) {
    return decode_message<QuiescedMsg>(bytes);
}
StatusOr<DataPostedMsg> decode_data_posted(std::span<const uint8_t> bytes) {
    PDSIM_ASSIGN_OR_RETURN(DataPostedMsg m, decode_message<DataPostedMsg>(bytes));
    if (m.layer_begin < 0 || m.layer_end <= m.layer_begin || m.sizes.empty() ||
        std::find(m.sizes.begin(), m.sizes.end(), uint64_t{0}) != m.sizes.end()) {
        return PDSIM_ERROR(StatusCode::kDataLoss,
                           "data-posted message of request {} (chunk {}) announces layers [{}, {}) "
                           "with {} message sizes (none may be 0)",
                           m.request_id, m.chunk_index, m.layer_begin, m.layer_end, m.sizes.size());
    }
    return m;
}

}  // namespace pdsim::transfer

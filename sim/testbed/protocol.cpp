#include "sim/testbed/protocol.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <concepts>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/text.h"

namespace pdsim::testbed {
namespace {

using json = nlohmann::json;

struct NullVisitor {
    template <class T>
    void operator()(const char*, T&) {}
};

// A struct with a field list (protocol.h): encoded as an object, or an array when kPositional.
template <class T>
concept WireStruct = requires(T& t, NullVisitor& v) {
    T::fields(t, v);
};

template <class T>
constexpr bool is_positional() {
    if constexpr (requires { T::kPositional; }) {
        return T::kPositional;
    } else {
        return false;
    }
}

template <class T>
struct IsVector : std::false_type {};
template <class T>
struct IsVector<std::vector<T>> : std::true_type {};

// ---- encoding ----

template <class T>
json to_wire(const T& value);

template <class T>
struct FieldWriter {
    json* out;
    template <class F>
    void operator()(const char* key, const F& field) {
        if constexpr (is_positional<T>()) {
            out->push_back(to_wire(field));
        } else {
            (*out)[key] = to_wire(field);
        }
    }
};

template <class T>
json to_wire(const T& value) {
    if constexpr (WireStruct<T>) {
        json out = is_positional<T>() ? json::array() : json::object();
        FieldWriter<T> writer{&out};
        T::fields(value, writer);
        return out;
    } else if constexpr (IsVector<T>::value) {
        json out = json::array();
        for (const auto& x : value) out.push_back(to_wire(x));
        return out;
    } else if constexpr (std::is_same_v<T, attn::ForwardMode>) {
        return attn::is_decode(value) ? "d" : "e";
    } else if constexpr (std::is_same_v<T, transfer::TransferEvent::Kind>) {
        return static_cast<int>(value);
    } else if constexpr (std::is_same_v<T, std::map<uint64_t, double>>) {
        json out = json::object();
        for (const auto& [key, x] : value) out[std::to_string(key)] = x;
        return out;
    } else {
        return json(value);
    }
}

// ---- decoding ----
// read_value returns "" on success, else what is wrong; *path gets the position inside the value
// (".name", "[i]") of the part that is wrong.

template <class T>
std::string read_value(const json& j, T* out, std::string* path);

template <class T>
std::string read_integer(const json& j, T* out) {
    constexpr auto kMin = std::numeric_limits<T>::min();
    constexpr auto kMax = std::numeric_limits<T>::max();
    const std::string range = fmt::format("an integer in [{}, {}]", kMin, kMax);
    if (j.is_number_unsigned()) {
        const auto u = j.get<uint64_t>();
        if (u > static_cast<uint64_t>(kMax)) return fmt::format("expected {}, got {}", range, u);
        *out = static_cast<T>(u);
        return {};
    }
    if (j.is_number_integer()) {
        const auto s = j.get<int64_t>();
        if constexpr (std::is_signed_v<T>) {
            if (s < static_cast<int64_t>(kMin) || s > static_cast<int64_t>(kMax)) {
                return fmt::format("expected {}, got {}", range, s);
            }
        } else {
            if (s < 0) return fmt::format("expected {}, got {}", range, s);
        }
        *out = static_cast<T>(s);
        return {};
    }
    return fmt::format("expected {}, got {}", range, j.type_name());
}

template <class T>
struct FieldReader {
    const json* in;
    std::string* path;
    std::string error;
    size_t index = 0;
    template <class F>
    void operator()(const char* key, F& field) {
        if (!error.empty()) return;
        std::string inner;
        if constexpr (is_positional<T>()) {
            const size_t i = index++;
            if (i >= in->size()) {
                error = "missing";
            } else {
                error = read_value((*in)[i], &field, &inner);
            }
            if (!error.empty()) *path = fmt::format("[{}] ({}){}", i, key, inner);
        } else {
            auto it = in->find(key);
            if (it == in->end()) {
                error = "missing";
            } else {
                error = read_value(*it, &field, &inner);
            }
            if (!error.empty()) *path = fmt::format(".{}{}", key, inner);
        }
    }
};

template <class T>
std::string read_value(const json& j, T* out, std::string* path) {
    if constexpr (WireStruct<T>) {
        if (is_positional<T>() ? !j.is_array() : !j.is_object()) {
            return fmt::format("expected an {}, got {}", is_positional<T>() ? "array" : "object",
                               j.type_name());
        }
        FieldReader<T> reader{&j, path, {}};
        T::fields(*out, reader);
        return reader.error;
    } else if constexpr (IsVector<T>::value) {
        if (!j.is_array()) return fmt::format("expected an array, got {}", j.type_name());
        out->clear();
        out->reserve(j.size());
        for (size_t i = 0; i < j.size(); ++i) {
            typename T::value_type x{};
            std::string inner;
            std::string error = read_value(j[i], &x, &inner);
            if (!error.empty()) {
                *path = fmt::format("[{}]{}", i, inner);
                return error;
            }
            out->push_back(std::move(x));
        }
        return {};
    } else if constexpr (std::is_same_v<T, attn::ForwardMode>) {
        if (j.is_string() && j.get_ref<const std::string&>() == "d") {
            *out = attn::ForwardMode::kDecode;
        } else if (j.is_string() && j.get_ref<const std::string&>() == "e") {
            *out = attn::ForwardMode::kExtend;
        } else {
            return fmt::format("expected \"e\" (extend) or \"d\" (decode), got {}",
                               text::excerpt(text::dump_json(j)));
        }
        return {};
    } else if constexpr (std::is_same_v<T, transfer::TransferEvent::Kind>) {
        int kind = 0;
        std::string error = read_integer(j, &kind);
        const int last = static_cast<int>(transfer::TransferEvent::Kind::kRequestFailed);
        if (error.empty() && (kind < 0 || kind > last)) {
            error = fmt::format("expected an engine event kind in [0, {}], got {}", last, kind);
        }
        if (error.empty()) *out = static_cast<transfer::TransferEvent::Kind>(kind);
        return error;
    } else if constexpr (std::is_same_v<T, std::map<uint64_t, double>>) {
        if (!j.is_object()) return fmt::format("expected an object, got {}", j.type_name());
        out->clear();
        for (const auto& [key, x] : j.items()) {
            uint64_t id = 0;
            const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
            if (ec != std::errc() || end != key.data() + key.size()) {
                *path = fmt::format(".{}", key);
                return "the key is not an unsigned integer";
            }
            if (!x.is_number()) {
                *path = fmt::format(".{}", key);
                return fmt::format("expected a number, got {}", x.type_name());
            }
            (*out)[id] = x.template get<double>();
        }
        return {};
    } else if constexpr (std::is_same_v<T, json>) {
        *out = j;
        return {};
    } else if constexpr (std::is_same_v<T, bool>) {
        if (!j.is_boolean()) return fmt::format("expected a boolean, got {}", j.type_name());
        *out = j.get<bool>();
        return {};
    } else if constexpr (std::is_same_v<T, std::string>) {
        if (!j.is_string()) return fmt::format("expected a string, got {}", j.type_name());
        *out = j.get<std::string>();
        return {};
    } else if constexpr (std::is_floating_point_v<T>) {
        if (!j.is_number()) return fmt::format("expected a number, got {}", j.type_name());
        *out = j.get<T>();
        return {};
    } else {
        static_assert(std::is_integral_v<T>, "no wire form for this field type");
        (void)path;
        return read_integer(j, out);
    }
}

// Whether the CBOR value in `bytes` nests arrays, maps, tags and indefinite strings at most
// `max_depth` deep. Iterative (nlohmann's reader recurses once per level: 4,000 nested arrays
// overflowed the stack, found by testbed_protocol_fuzz). Malformed input is not judged here
// (true): from_cbor rejects it; only the depth is.
bool cbor_depth_at_most(std::span<const uint8_t> bytes, size_t max_depth) {
    constexpr int64_t kIndefinite = -1;
    constexpr int64_t kMany = int64_t{1} << 60;  // a count larger than any input holds
    std::vector<int64_t> open;                   // items left in each open container
    size_t pos = 0;
    const size_t n = bytes.size();
    while (pos < n) {
        const uint8_t head = bytes[pos++];
        const int major = head >> 5;
        const int info = head & 31;
        bool completed = true;
        if (head == 0xff) {  // "break": ends the innermost indefinite container
            if (open.empty() || open.back() != kIndefinite) return true;
            open.pop_back();
        } else {
            uint64_t arg = static_cast<uint64_t>(info);
            const bool indefinite = info == 31;
            if (info >= 24 && info <= 27) {
                const size_t len = size_t{1} << (info - 24);
                if (n - pos < len) return true;
                arg = 0;
                for (size_t i = 0; i < len; ++i) arg = (arg << 8) | bytes[pos++];
            } else if (info > 27 && !indefinite) {
                return true;
            }
            const int64_t count =
                arg > static_cast<uint64_t>(kMany) ? kMany : static_cast<int64_t>(arg);
            switch (major) {
                case 2:
                case 3:  // byte / text string: its bytes, or chunks until a break
                    if (indefinite) {
                        open.push_back(kIndefinite);
                        completed = false;
                    } else {
                        if (static_cast<uint64_t>(n - pos) < arg) return true;
                        pos += static_cast<size_t>(arg);
                    }
                    break;
                case 4:
                case 5:  // array / map: count items (pairs for a map)
                    if (indefinite) {
                        open.push_back(kIndefinite);
                        completed = false;
                    } else if (count > 0) {
                        open.push_back(major == 5 ? std::min(kMany, 2 * count) : count);
                        completed = false;
                    }
                    break;
                case 6:  // tag: the next item is its content
                    open.push_back(1);
                    completed = false;
                    break;
                default:  // integers, simple values, floats: done
                    break;
            }
            if (open.size() > max_depth) return false;
        }
        // An item ended: count it in its container, closing the containers it completes.
        while (completed && !open.empty() && open.back() != kIndefinite) {
            if (--open.back() > 0) break;
            open.pop_back();
        }
        if (completed && open.empty()) return true;  // the top-level value ended
    }
    return true;
}

}  // namespace

StatusOr<json> decode_cbor(std::span<const uint8_t> bytes) {
    if (!cbor_depth_at_most(bytes, kMaxCborDepth)) {
        return Status(StatusCode::kDataLoss,
                      fmt::format("garbled CBOR ({} bytes): nested deeper than {} levels",
                                  bytes.size(), kMaxCborDepth));
    }
    json body;
    try {
        body = json::from_cbor(bytes.begin(), bytes.end(), /*strict=*/true,
                               /*allow_exceptions=*/false);
    } catch (const json::exception& e) {
        return Status(StatusCode::kDataLoss,
                      fmt::format("garbled CBOR ({} bytes): {}", bytes.size(), e.what()));
    }
    if (body.is_discarded()) {
        return Status(StatusCode::kDataLoss,
                      fmt::format("garbled CBOR ({} bytes): not one CBOR value", bytes.size()));
    }
    return body;
}

template <class Msg>
json encode_message(const Msg& msg) {
    json out = to_wire(msg);
    out["k"] = Msg::kKind;
    return out;
}

template <class Msg>
StatusOr<Msg> decode_message(const json& body) {
    if (!body.is_object()) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("testbed message '{}': expected an object, got {}", Msg::kKind,
                                  body.type_name()));
    }
    auto kind = body.find("k");
    if (kind == body.end() || !kind->is_string() ||
        kind->get_ref<const std::string&>() != Msg::kKind) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("testbed message '{}': field 'k' is {}", Msg::kKind,
                                  kind == body.end() ? std::string("missing")
                                                     : text::excerpt(text::dump_json(*kind))));
    }
    Msg msg;
    std::string path;
    const std::string error = read_value(body, &msg, &path);
    if (!error.empty()) {
        // path starts with '.': the top-level key.
        return Status(
            StatusCode::kInvalidArgument,
            fmt::format("testbed message '{}': field '{}': {}", Msg::kKind, path.substr(1), error));
    }
    return msg;
}

#define PDSIM_TESTBED_MESSAGE(Msg)                     \
    template json encode_message<Msg>(const Msg& msg); \
    template StatusOr<Msg> decode_message<Msg>(const json& body);
PDSIM_TESTBED_MESSAGE(SubmitMsg)
PDSIM_TESTBED_MESSAGE(CancelMsg)
PDSIM_TESTBED_MESSAGE(EndMsg)
PDSIM_TESTBED_MESSAGE(Plan)
PDSIM_TESTBED_MESSAGE(AdmitMsg)
PDSIM_TESTBED_MESSAGE(ReleaseMsg)
PDSIM_TESTBED_MESSAGE(EngineAbortMsg)
PDSIM_TESTBED_MESSAGE(SentReport)
PDSIM_TESTBED_MESSAGE(ReadyReport)
PDSIM_TESTBED_MESSAGE(PagesIdleMsg)
PDSIM_TESTBED_MESSAGE(FirstTokenReport)
PDSIM_TESTBED_MESSAGE(PrefillDoneReport)
PDSIM_TESTBED_MESSAGE(RequestDoneReport)
PDSIM_TESTBED_MESSAGE(TcpBootstrapMsg)
PDSIM_TESTBED_MESSAGE(ShapeMsg)
PDSIM_TESTBED_MESSAGE(ExitMsg)
PDSIM_TESTBED_MESSAGE(RankResult)
#undef PDSIM_TESTBED_MESSAGE

}  // namespace pdsim::testbed

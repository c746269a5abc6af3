#include "common/text.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace pdsim::text {

namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// The length of the well-formed UTF-8 sequence at s[i], or 0 when the bytes there are not one.
size_t sequence_length(std::string_view s, size_t i) {
    const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
    const unsigned char b0 = byte(i);
    if (b0 < 0x80) return 1;
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
    if (b0 >= 0xC2 && b0 <= 0xDF) {
        len = 2;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
        len = 3;
        if (b0 == 0xE0) lo = 0xA0;  // no overlong forms
        if (b0 == 0xED) hi = 0x9F;  // no surrogates
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
        len = 4;
        if (b0 == 0xF0) lo = 0x90;  // no overlong forms
        if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
    } else {
        return 0;
    }
    if (i + len > s.size()) return 0;
    if (byte(i + 1) < lo || byte(i + 1) > hi) return 0;
    for (size_t k = 2; k < len; ++k) {
        if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
    }
    return len;
}

}  // namespace

size_t valid_utf8_prefix(std::string_view s) {
    size_t i = 0;
    while (i < s.size()) {
        const size_t len = sequence_length(s, i);
        if (len == 0) return i;
        i += len;
    }
    return i;
}

std::string sanitize_utf8(std::string_view s) {
    const size_t valid = valid_utf8_prefix(s);
    if (valid == s.size()) return std::string(s);
    std::string out(s.substr(0, valid));
    for (size_t i = valid; i < s.size();) {
        const size_t len = sequence_length(s, i);
        if (len == 0) {
            out += kReplacement;
            ++i;
        } else {
            out.append(s.substr(i, len));
            i += len;
        }
    }
    return out;
}

std::string excerpt(std::string_view s, size_t max_bytes) {
    std::string out;
    size_t i = 0;
    while (i < s.size() && i < max_bytes) {
        const size_t len = sequence_length(s, i);
        if (len == 0) {
            out += kReplacement;
            ++i;
            continue;
        }
        if (i + len > max_bytes) break;  // do not cut a character in two
        const unsigned char c = static_cast<unsigned char>(s[i]);
        if (len == 1 && c == '\n') {
            out += "\\n";
        } else if (len == 1 && c == '\t') {
            out += "\\t";
        } else if (len == 1 && c == '\r') {
            out += "\\r";
        } else if (len == 1 && (c < 0x20 || c == 0x7F)) {
            out += fmt::format("\\x{:02x}", c);
        } else {
            out.append(s.substr(i, len));
        }
        i += len;
    }
    if (i < s.size()) out += "...";
    return out;
}

std::string dump_json(const nlohmann::json& j, int indent) {
    return j.dump(indent, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

}  // namespace pdsim::text

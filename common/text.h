// Text at the edges: UTF-8 checks for what pdsim reads, UTF-8 repair for what it writes, and
// bounded excerpts of user input for error messages.
//
// Inputs (topology, model and cost files) must be valid UTF-8: a reader calls valid_utf8_prefix()
// and reports "<file>:<line>: ... is not valid UTF-8". Outputs (report, timeline, CSV) are made
// valid with sanitize_utf8() or written with dump_json(), so that no content can make a writer
// fail after a long run.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

namespace pdsim::text {

// The most bytes of a user's input that an error message quotes.
inline constexpr size_t kMaxExcerptBytes = 80;

// The length of the longest prefix of `s` that is well-formed UTF-8 (RFC 3629: no overlong
// forms, no surrogates, nothing above U+10FFFF); s.size() when all of `s` is. A truncated
// sequence at the end counts as invalid.
[[nodiscard]] size_t valid_utf8_prefix(std::string_view s);

[[nodiscard]] inline bool is_valid_utf8(std::string_view s) {
    return valid_utf8_prefix(s) == s.size();
}

// `s` with every byte that does not belong to a well-formed UTF-8 sequence replaced by U+FFFD
// (EF BF BD). Valid input comes back unchanged.
[[nodiscard]] std::string sanitize_utf8(std::string_view s);

// At most `max_bytes` of `s` (cut at a character boundary) for an error message: invalid UTF-8
// becomes U+FFFD, control bytes (newline, tab, ...) become \n, \t, \xNN so the message stays one
// line; "..." is appended when `s` was cut. The excerpt is at most about 4 * max_bytes + 3 bytes.
[[nodiscard]] std::string excerpt(std::string_view s, size_t max_bytes = kMaxExcerptBytes);

// j.dump(indent) that never throws on content: strings and keys with invalid UTF-8 are written
// with U+FFFD in place of the bad bytes (nlohmann's error_handler_t::replace).
[[nodiscard]] std::string dump_json(const nlohmann::json& j, int indent = -1);

}  // namespace pdsim::text

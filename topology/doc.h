// Internal: a small document tree that both the YAML (yaml-cpp) and the JSON (nlohmann-json)
// readers produce, so one schema walker checks both formats the same way. Not a public API.
//
// The readers never throw: every yaml-cpp / nlohmann exception is caught and turned into a
// kInvalidArgument Status naming the source and, where known, the line. They bound the
// document: nesting depth <= kMaxDepth and <= kMaxNodes nodes after alias expansion.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace pdsim::topo::detail {

inline constexpr int kMaxDepth = 64;
inline constexpr size_t kMaxNodes = 1'000'000;

struct DocNode {
    enum class Kind { kNull, kScalar, kSeq, kMap };
    struct Entry;

    Kind kind = Kind::kNull;
    std::string scalar;          // kScalar: the text as written (numbers unconverted)
    bool quoted = false;         // kScalar: a quoted / tagged YAML scalar or a JSON string
    int line = 0;                // 1-based; 0 when unknown
    std::vector<DocNode> items;  // kSeq
    std::vector<Entry> entries;  // kMap, in document order; keys are unique

    [[nodiscard]] const DocNode* get(std::string_view key) const;
    [[nodiscard]] std::string_view kind_name() const;
};

struct DocNode::Entry {
    std::string key;
    int key_line = 0;
    DocNode value;
};

inline const DocNode* DocNode::get(std::string_view key) const {
    for (const Entry& e : entries) {
        if (e.key == key) return &e.value;
    }
    return nullptr;
}

inline std::string_view DocNode::kind_name() const {
    switch (kind) {
        case Kind::kNull:
            return "null";
        case Kind::kScalar:
            return quoted ? "a string" : "a scalar";
        case Kind::kSeq:
            return "a list";
        case Kind::kMap:
            return "a mapping";
    }
    return "?";
}

// `s` (its first 64 characters) in double quotes with quotes, backslashes and control bytes
// escaped: safe to put a user's string into an error message.
std::string quoted_for_message(std::string_view s);

StatusOr<DocNode> read_yaml_doc(std::string_view text, std::string_view source_name);
StatusOr<DocNode> read_json_doc(std::string_view text, std::string_view source_name);

}  // namespace pdsim::topo::detail

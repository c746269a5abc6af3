// The YAML and JSON readers of doc.h. This is the parsing edge: yaml-cpp and nlohmann-json
// exceptions stop here.
#include "topology/doc.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <iterator>
#include <nlohmann/json.hpp>
#include <unordered_set>
#include <vector>

#include "common/text.h"
#include "common/yaml_documents.h"

namespace pdsim::topo::detail {

namespace {

Status syntax_error(std::string_view source, int line, std::string_view what) {
    if (line > 0) {
        return Status(StatusCode::kInvalidArgument, fmt::format("{}:{}: {}", source, line, what));
    }
    return Status(StatusCode::kInvalidArgument, fmt::format("{}: {}", source, what));
}

int yaml_line(const YAML::Node& n) {
    const YAML::Mark m = n.Mark();
    return m.is_null() || m.line < 0 ? 0 : m.line + 1;
}

std::string invalid_utf8_message(std::string_view s) {
    return fmt::format("{} is not valid UTF-8 (bad byte at offset {})", quoted_for_message(s),
                       text::valid_utf8_prefix(s));
}

std::string child_path(const std::string& path, std::string_view key) {
    return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
}

// ---- YAML ----

class YamlConverter {
public:
    explicit YamlConverter(std::string_view source) : source_(source) {}

    Status convert(const YAML::Node& in, const std::string& path, int depth, DocNode* out) {
        if (depth > kMaxDepth) {
            return error(in, path, fmt::format("nesting is deeper than {} levels", kMaxDepth));
        }
        if (++count_ > kMaxNodes) {
            return error(in, path,
                         fmt::format("document too large (more than {} nodes once aliases are "
                                     "expanded)",
                                     kMaxNodes));
        }
        out->line = line_of(in);
        switch (in.Type()) {
            case YAML::NodeType::Undefined:
            case YAML::NodeType::Null:
                out->kind = DocNode::Kind::kNull;
                return ok_status();
            case YAML::NodeType::Scalar:
                out->kind = DocNode::Kind::kScalar;
                out->scalar = in.Scalar();
                if (!text::is_valid_utf8(out->scalar)) {
                    return error(in, path, invalid_utf8_message(out->scalar));
                }
                // Plain scalars carry the non-specific tag "?"; quoted ones "!"; explicit tags
                // (!!str) their own. Only plain scalars may be numbers.
                out->quoted = in.Tag() != "?";
                return ok_status();
            case YAML::NodeType::Sequence: {
                out->kind = DocNode::Kind::kSeq;
                size_t i = 0;
                for (const YAML::Node& item : in) {
                    DocNode child;
                    PDSIM_RETURN_IF_ERROR(
                        convert(item, fmt::format("{}[{}]", path, i++), depth + 1, &child));
                    out->items.push_back(std::move(child));
                }
                return ok_status();
            }
            case YAML::NodeType::Map: {
                out->kind = DocNode::Kind::kMap;
                std::unordered_set<std::string> seen;
                for (auto it = in.begin(); it != in.end(); ++it) {
                    // Copies: it-> yields a proxy that dies with the full expression.
                    const YAML::Node key = it->first;
                    const YAML::Node value = it->second;
                    if (!key.IsScalar()) {
                        return error(key, path, "mapping keys must be plain strings");
                    }
                    const std::string& k = key.Scalar();
                    if (!text::is_valid_utf8(k)) {
                        return error(key, path, "key " + invalid_utf8_message(k));
                    }
                    const std::string kp = child_path(path, k);
                    if (!seen.insert(k).second) return error(key, kp, "duplicate key");
                    DocNode::Entry e;
                    e.key = k;
                    e.key_line = line_of(key);
                    PDSIM_RETURN_IF_ERROR(convert(value, kp, depth + 1, &e.value));
                    if (e.value.line == 0) e.value.line = e.key_line;
                    out->entries.push_back(std::move(e));
                }
                return ok_status();
            }
        }
        return error(in, path, "unsupported YAML node");
    }

private:
    static int line_of(const YAML::Node& n) { return yaml_line(n); }

    Status error(const YAML::Node& n, const std::string& path, std::string_view what) const {
        const std::string shown = path.empty() ? "(document)" : path;
        return syntax_error(source_, line_of(n), fmt::format("{}: {}", shown, what));
    }

    std::string_view source_;
    size_t count_ = 0;
};

// ---- JSON ----

// A forward iterator over the text that remembers the furthest character the JSON lexer has
// read, so SAX events can be given the line they were read on.
class TrackingIterator {
public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = char;
    using difference_type = std::ptrdiff_t;
    using pointer = const char*;
    using reference = const char&;

    TrackingIterator() = default;
    TrackingIterator(const char* p, const char** furthest) : p_(p), furthest_(furthest) {}

    reference operator*() const {
        if (furthest_ != nullptr && p_ > *furthest_) *furthest_ = p_;
        return *p_;
    }
    TrackingIterator& operator++() {
        ++p_;
        return *this;
    }
    TrackingIterator operator++(int) {
        TrackingIterator old = *this;
        ++p_;
        return old;
    }
    friend bool operator==(const TrackingIterator& a, const TrackingIterator& b) {
        return a.p_ == b.p_;
    }

private:
    const char* p_ = nullptr;
    const char** furthest_ = nullptr;
};

class JsonBuilder {
public:
    using json = nlohmann::json;
    using number_integer_t = json::number_integer_t;
    using number_unsigned_t = json::number_unsigned_t;
    using number_float_t = json::number_float_t;
    using string_t = json::string_t;
    using binary_t = json::binary_t;

    JsonBuilder(std::string_view text, std::string_view source)
        : begin_(text.data()),
          end_(text.data() + text.size()),
          furthest_(text.data()),
          counted_(text.data()),
          source_(source) {}

    const char** furthest() { return &furthest_; }

    bool null() { return value(DocNode{}); }
    bool boolean(bool v) { return scalar(v ? "true" : "false", false); }
    bool number_integer(number_integer_t v) { return scalar(std::to_string(v), false); }
    bool number_unsigned(number_unsigned_t v) { return scalar(std::to_string(v), false); }
    bool number_float(number_float_t /*v*/, const string_t& s) { return scalar(s, false); }
    bool string(string_t& s) {
        if (!text::is_valid_utf8(s))
            return fail(fmt::format("{}: {}", path(), invalid_utf8_message(s)));
        return scalar(s, true);
    }
    bool binary(binary_t& /*b*/) { return fail("binary values are not supported"); }

    bool start_object(std::size_t /*n*/) { return open(DocNode::Kind::kMap); }
    bool start_array(std::size_t /*n*/) { return open(DocNode::Kind::kSeq); }
    bool end_object() { return close(); }
    bool end_array() { return close(); }

    bool key(string_t& k) {
        if (!text::is_valid_utf8(k))
            return fail(fmt::format("{}: key {}", path(), invalid_utf8_message(k)));
        Frame& f = stack_.back();
        if (!f.keys.insert(k).second) {
            f.pending_key = k;
            return fail(fmt::format("{}: duplicate key", path()));
        }
        f.pending_key = k;
        f.pending_key_line = line();
        return true;
    }

    bool parse_error(std::size_t position, const std::string& /*last_token*/,
                     const nlohmann::detail::exception& ex) {
        std::string what = ex.what();
        // Drop nlohmann's "[json.exception.parse_error.101] " prefix.
        if (!what.empty() && what.front() == '[') {
            if (size_t close_at = what.find("] "); close_at != std::string::npos) {
                what.erase(0, close_at + 2);
            }
        }
        if (status_.ok()) {
            const size_t at =
                std::min(position > 0 ? position - 1 : 0, static_cast<size_t>(end_ - begin_));
            status_ = syntax_error(source_, line_at(begin_ + at), "JSON syntax error: " + what);
        }
        return false;
    }

    [[nodiscard]] bool has_root() const { return has_root_; }
    DocNode take_root() { return std::move(root_); }
    [[nodiscard]] const Status& status() const { return status_; }

private:
    struct Frame {
        DocNode node;
        std::string pending_key;
        int pending_key_line = 0;
        std::unordered_set<std::string> keys;
    };

    int line() { return line_at(furthest_); }

    // 1-based line of the character at p (p only grows across calls, but handle both ways).
    int line_at(const char* p) {
        if (p < counted_) {
            counted_ = begin_;
            counted_line_ = 1;
        }
        for (; counted_ < p; ++counted_) {
            if (*counted_ == '\n') ++counted_line_;
        }
        return counted_line_;
    }

    std::string path() const {
        std::string p;
        for (const Frame& f : stack_) {
            if (f.node.kind == DocNode::Kind::kSeq) {
                p += fmt::format("[{}]", f.node.items.size());
            } else {
                p = child_path(p, f.pending_key);
            }
        }
        return p.empty() ? "(document)" : p;
    }

    bool fail(std::string what) {
        if (status_.ok()) status_ = syntax_error(source_, line(), what);
        return false;
    }

    bool scalar(std::string s, bool quoted) {
        DocNode n;
        n.kind = DocNode::Kind::kScalar;
        n.scalar = std::move(s);
        n.quoted = quoted;
        return value(std::move(n));
    }

    bool open(DocNode::Kind kind) {
        if (static_cast<int>(stack_.size()) >= kMaxDepth) {
            return fail(fmt::format("{}: nesting is deeper than {} levels", path(), kMaxDepth));
        }
        if (++count_ > kMaxNodes) return fail("document too large");
        Frame f;
        f.node.kind = kind;
        f.node.line = line();
        stack_.push_back(std::move(f));
        return true;
    }

    bool close() {
        DocNode n = std::move(stack_.back().node);
        stack_.pop_back();
        return attach(std::move(n));
    }

    bool value(DocNode n) {
        if (++count_ > kMaxNodes) return fail("document too large");
        n.line = line();
        return attach(std::move(n));
    }

    bool attach(DocNode n) {
        if (stack_.empty()) {
            root_ = std::move(n);
            has_root_ = true;
            return true;
        }
        Frame& f = stack_.back();
        if (f.node.kind == DocNode::Kind::kSeq) {
            f.node.items.push_back(std::move(n));
        } else {
            DocNode::Entry e;
            e.key = std::move(f.pending_key);
            e.key_line = f.pending_key_line;
            e.value = std::move(n);
            f.node.entries.push_back(std::move(e));
        }
        return true;
    }

    const char* begin_;
    const char* end_;
    const char* furthest_;
    const char* counted_;
    int counted_line_ = 1;
    std::string_view source_;
    std::vector<Frame> stack_;
    DocNode root_;
    bool has_root_ = false;
    size_t count_ = 0;
    Status status_;
};

}  // namespace

StatusOr<DocNode> read_yaml_doc(std::string_view text, std::string_view source_name) {
    try {
        const YAML::Node root = YAML::Load(std::string(text));
        // One document per file: a second one (after `---`) would otherwise be ignored silently.
        if (const auto second = yaml::second_document_line(std::string(text))) {
            return syntax_error(source_name, *second,
                                "a second YAML document starts here; a topology file holds one");
        }
        YamlConverter conv(source_name);
        DocNode out;
        PDSIM_RETURN_IF_ERROR(conv.convert(root, "", 0, &out));
        return out;
    } catch (const YAML::Exception& e) {
        const int line = e.mark.is_null() || e.mark.line < 0 ? 0 : e.mark.line + 1;
        return syntax_error(source_name, line, "YAML syntax error: " + e.msg);
    } catch (const std::exception& e) {
        return syntax_error(source_name, 0, std::string("cannot parse YAML: ") + e.what());
    } catch (...) {
        return syntax_error(source_name, 0, "cannot parse YAML");
    }
}

StatusOr<DocNode> read_json_doc(std::string_view text, std::string_view source_name) {
    try {
        JsonBuilder builder(text, source_name);
        const TrackingIterator first(text.data(), builder.furthest());
        const TrackingIterator last(text.data() + text.size(), builder.furthest());
        const bool ok =
            nlohmann::json::sax_parse(first, last, &builder, nlohmann::json::input_format_t::json,
                                      /*strict=*/true, /*ignore_comments=*/false);
        if (!builder.status().ok()) return builder.status();
        if (!ok || !builder.has_root()) return syntax_error(source_name, 0, "JSON syntax error");
        return builder.take_root();
    } catch (const std::exception& e) {
        return syntax_error(source_name, 0, std::string("cannot parse JSON: ") + e.what());
    } catch (...) {
        return syntax_error(source_name, 0, "cannot parse JSON");
    }
}

std::string quoted_for_message(std::string_view s) {
    std::string out = "\"";
    for (char c : s.substr(0, 64)) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += c;
        } else if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) {
            out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
        } else {
            out += c;
        }
    }
    if (s.size() > 64) out += "...";
    return out + "\"";
}

}  // namespace pdsim::topo::detail

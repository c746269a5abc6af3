#include "sim/cli/cli_util.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include "common/text.h"

namespace pdsim::cli {

StatusOr<std::vector<int>> parse_int_list(const std::string& flag, const std::string& text) {
    std::vector<int> out;
    std::stringstream ss(text);
    std::string item;
    while (std::getline(ss, item, ',')) {
        size_t used = 0;
        int v = 0;
        try {
            v = std::stoi(item, &used);
        } catch (const std::exception&) {
            used = 0;
        }
        if (item.empty() || used != item.size() || v < 1) {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("{}: '{}' is not a positive integer", flag, item));
        }
        if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
    }
    if (out.empty()) return Status(StatusCode::kInvalidArgument, flag + ": empty list");
    return out;
}

Status write_json_file(const std::string& flag, const std::string& path, const nlohmann::json& j,
                       int indent) {
    std::ofstream f(path, std::ios::trunc);
    if (!f) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("{} {}: cannot open for writing", flag, path));
    }
    f << text::dump_json(j, indent) << "\n";  // never throws on content
    f.close();
    if (!f) {
        return Status(StatusCode::kInvalidArgument, fmt::format("{} {}: write failed", flag, path));
    }
    return {};
}

Status check_writable(const std::string& flag, const std::string& path) {
    namespace fs = std::filesystem;
    const std::string name = flag.empty() ? excerpt(path) : flag + " " + excerpt(path);
    auto bad = [&](std::string_view why) {
        return invalid_argument_error(fmt::format("{}: {}", name, why));
    };
    if (path.empty()) return invalid_argument_error(flag + ": empty path");
    std::error_code ec;
    const fs::path p(path);
    if (fs::is_directory(p, ec)) return bad("is a directory");
    if (fs::exists(p, ec)) {
        if (::access(path.c_str(), W_OK) != 0) return bad("cannot open for writing");
        return {};
    }
    const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
    if (!fs::is_directory(dir, ec)) {
        return bad(fmt::format("directory {} does not exist", excerpt(dir.string())));
    }
    if (::access(dir.c_str(), W_OK | X_OK) != 0) {
        return bad(fmt::format("directory {} is not writable", excerpt(dir.string())));
    }
    return {};
}

Status check_kv_bytes(const std::string& flags, int64_t sequences, int64_t tokens, int64_t kv_heads,
                      int64_t head_dim, int64_t limit_bytes) {
    // In long double: the product of four flags' maxima overflows int64.
    const long double bytes =
        static_cast<long double>(sequences) * tokens * kv_heads * head_dim * 2 * 4;
    if (bytes > static_cast<long double>(limit_bytes)) {
        return invalid_argument_error(fmt::format("{}: a KV cache of {:.3g} GiB (limit {} GiB)",
                                                  flags, static_cast<double>(bytes / (1 << 30)),
                                                  limit_bytes >> 30));
    }
    return {};
}

namespace {

// The number `text` is, or nullopt when it is not one whole finite number.
std::optional<double> finite_number(const std::string& text) {
    if (text.empty() || std::isspace(static_cast<unsigned char>(text.front()))) return {};
    errno = 0;
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    if (end != text.c_str() + text.size() || errno == ERANGE || !std::isfinite(v)) return {};
    return v;
}

}  // namespace

CLI::Validator int_in(int64_t lo, int64_t hi) {
    return CLI::Validator(
        [lo, hi](std::string& text) -> std::string {
            errno = 0;
            char* end = nullptr;
            const long long v = text.empty() ? 0 : std::strtoll(text.c_str(), &end, 10);
            if (text.empty() || std::isspace(static_cast<unsigned char>(text.front())) ||
                end != text.c_str() + text.size() || errno == ERANGE) {
                return fmt::format("'{}' is not an integer", excerpt(text));
            }
            if (v < lo || v > hi) return fmt::format("{} is not in [{}, {}]", v, lo, hi);
            return {};
        },
        fmt::format("in [{}, {}]", lo, hi));
}

CLI::Validator real_in(double lo, double hi, bool lo_open) {
    return CLI::Validator(
        [lo, hi, lo_open](std::string& text) -> std::string {
            const std::optional<double> v = finite_number(text);
            if (!v) return fmt::format("'{}' is not a finite number", excerpt(text));
            if (*v < lo || *v > hi || (lo_open && *v == lo)) {
                return fmt::format("{} is not in {}{:g}, {:g}]", excerpt(text), lo_open ? "(" : "[",
                                   lo, hi);
            }
            return {};
        },
        fmt::format("in {}{:g}, {:g}]", lo_open ? "(" : "[", lo, hi));
}

CLI::Validator non_empty() {
    return CLI::Validator(
        [](std::string& text) -> std::string {
            if (text.find_first_not_of(" \t") == std::string::npos) return "empty value";
            return {};
        },
        "not empty");
}

CLI::Validator output_file() {
    return CLI::Validator(
        [](std::string& text) -> std::string {
            Status st = check_writable("", text);
            return st.ok() ? std::string() : std::string(st.message());
        },
        "writable file");
}

std::vector<std::string> split_paths(const std::string& text) {
    std::vector<std::string> out;
    std::stringstream ss(text);
    std::string item;
    while (std::getline(ss, item, ',')) {
        if (!item.empty()) out.push_back(item);
    }
    return out;
}

}  // namespace pdsim::cli

#include "sim/cli/cli_util.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
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
    const bool existed = std::filesystem::exists(path);
    std::ofstream probe(path, std::ios::app);
    if (!probe) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("{} {}: cannot open for writing", flag, path));
    }
    probe.close();
    std::error_code ec;
    if (!existed) std::filesystem::remove(path, ec);
    return {};
}

}  // namespace pdsim::cli

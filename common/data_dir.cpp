#include "common/data_dir.h"

#include <fmt/format.h>

#include <cstdlib>
#include <filesystem>

namespace pdsim::data {

namespace fs = std::filesystem;

namespace {

bool is_dir(const fs::path& p) {
    std::error_code ec;
    return fs::is_directory(p, ec);
}

bool is_file(const fs::path& p) {
    std::error_code ec;
    return fs::is_regular_file(p, ec);
}

// Where `kind` sits in the source tree.
fs::path source_subdir(DataKind kind) {
    switch (kind) {
        case DataKind::kTraces:
            return "data/traces";
        case DataKind::kTopologies:
            return "topology/examples";
        case DataKind::kModels:
            return "data/models";
    }
    return "data";
}

const char* data_dir_env() {
    const char* env = std::getenv("PDSIM_DATA_DIR");
    return env != nullptr && *env != '\0' ? env : nullptr;
}

}  // namespace

std::string_view data_kind_name(DataKind kind) {
    switch (kind) {
        case DataKind::kTraces:
            return "traces";
        case DataKind::kTopologies:
            return "topologies";
        case DataKind::kModels:
            return "models";
    }
    return "?";
}

std::vector<DataCandidate> data_search_path(DataKind kind) {
    const std::string sub(data_kind_name(kind));
    if (const char* env = data_dir_env()) {
        return {{(fs::path(env) / sub).lexically_normal().string(), "$PDSIM_DATA_DIR"}};
    }
    std::vector<DataCandidate> out;
#ifdef PDSIM_SOURCE_DIR
    out.push_back({(fs::path(PDSIM_SOURCE_DIR) / source_subdir(kind)).lexically_normal().string(),
                   "source tree"});
#endif
    std::error_code ec;
    const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    if (!ec) {
        out.push_back(
            {(exe.parent_path() / ".." / "share" / "pdsim" / sub).lexically_normal().string(),
             "install prefix"});
    }
#ifdef PDSIM_INSTALL_DATADIR
    const std::string configured =
        (fs::path(PDSIM_INSTALL_DATADIR) / sub).lexically_normal().string();
    if (out.empty() || out.back().path != configured) out.push_back({configured, "install prefix"});
#endif
    return out;
}

StatusOr<std::string> find_data_dir(DataKind kind) {
    const std::string sub(data_kind_name(kind));
    if (const char* env = data_dir_env()) {
        if (!is_dir(env)) {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("PDSIM_DATA_DIR={}: not a directory", env));
        }
        const fs::path p = fs::path(env) / sub;
        if (!is_dir(p)) {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("PDSIM_DATA_DIR={}: has no {}/ folder (expected the layout "
                                      "of share/pdsim: traces/, topologies/, models/)",
                                      env, sub));
        }
        return p.lexically_normal().string();
    }
    std::string looked;
    for (const DataCandidate& c : data_search_path(kind)) {
        if (is_dir(c.path)) return c.path;
        looked += fmt::format("\n  {} ({})", c.path, c.origin);
    }
    return Status(StatusCode::kNotFound,
                  fmt::format("pdsim's {} folder was not found; set PDSIM_DATA_DIR to a folder "
                              "holding {}/, or pass the file explicitly. Looked in:{}",
                              sub, sub, looked));
}

StatusOr<std::string> find_data_file(DataKind kind, std::string_view name) {
    PDSIM_ASSIGN_OR_RETURN(std::string dir, find_data_dir(kind));
    const fs::path p = fs::path(dir) / name;
    if (!is_file(p)) {
        return Status(StatusCode::kNotFound, fmt::format("{}: not found in {}", name, dir));
    }
    return p.string();
}

std::string resolve_data_file(DataKind kind, const std::string& text) {
    if (text.empty() || is_file(text) || text.find('/') != std::string::npos) return text;
    auto dir = find_data_dir(kind);
    if (!dir.ok()) return text;
    const std::vector<const char*> exts =
        kind == DataKind::kTraces ? std::vector<const char*>{"", ".jsonl", ".csv"}
                                  : std::vector<const char*>{"", ".yaml", ".yml", ".json"};
    for (const char* ext : exts) {
        const fs::path p = fs::path(*dir) / (text + ext);
        if (is_file(p)) return p.string();
    }
    return text;
}

}  // namespace pdsim::data

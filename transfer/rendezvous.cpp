#include "transfer/rendezvous.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

namespace pdsim::transfer {

namespace fs = std::filesystem;

FileRendezvous::FileRendezvous(std::string directory, std::string key)
    : directory_(std::move(directory)), key_(std::move(key)) {}

std::string FileRendezvous::path_of(int rank) const {
    return (fs::path(directory_) / ("rank-" + std::to_string(rank) + "." + key_)).string();
}

Status FileRendezvous::publish(int rank, std::string_view value) const {
    std::error_code ec;
    fs::create_directories(directory_, ec);
    if (ec) {
        return PDSIM_ERROR(StatusCode::kUnavailable, "rendezvous: cannot create directory {}: {}",
                           directory_, ec.message());
    }
    const fs::path final_path = path_of(rank);
    fs::path tmp = final_path;
    tmp += ".tmp";
    {
        std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
        out.write(value.data(), static_cast<std::streamsize>(value.size()));
        if (!out) {
            return PDSIM_ERROR(StatusCode::kUnavailable, "rendezvous: cannot write {}",
                               tmp.string());
        }
    }
    // rename() is atomic: readers see either no file or the whole value.
    fs::rename(tmp, final_path, ec);
    if (ec) {
        return PDSIM_ERROR(StatusCode::kUnavailable, "rendezvous: cannot publish {}: {}",
                           final_path.string(), ec.message());
    }
    return {};
}

std::optional<std::string> FileRendezvous::try_read(int rank) const {
    std::ifstream in(path_of(rank), std::ios::binary);
    if (!in) return std::nullopt;
    std::string value((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) return std::nullopt;
    return value;
}

StatusOr<std::vector<std::string>> FileRendezvous::collect(
    std::span<const int> ranks, std::chrono::milliseconds timeout) const {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::vector<std::optional<std::string>> got(ranks.size());
    for (;;) {
        std::string missing;
        for (size_t i = 0; i < ranks.size(); ++i) {
            if (!got[i]) got[i] = try_read(ranks[i]);
            if (!got[i]) missing += (missing.empty() ? "" : ", ") + std::to_string(ranks[i]);
        }
        if (missing.empty()) break;
        if (std::chrono::steady_clock::now() >= deadline) {
            return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                               "rendezvous in {}: rank(s) {} did not publish '{}' within {} ms",
                               directory_, missing, key_, timeout.count());
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::vector<std::string> values;
    values.reserve(got.size());
    for (auto& v : got) values.push_back(std::move(*v));
    return values;
}

}  // namespace pdsim::transfer

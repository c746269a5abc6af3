#include "common/npy.h"

#include <cstring>
#include <fstream>
#include <regex>

namespace pdsim {

namespace {
size_t descr_size(const std::string& d) {
    if (d == "<f4" || d == "<i4") return 4;
    if (d == "<u2") return 2;
    return 0;
}
}  // namespace

int64_t NpyArray::count() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
}

Status write_npy(const std::string& path, const std::string& descr,
                 const std::vector<int64_t>& shape, const void* data, size_t bytes) {
    const size_t esize = descr_size(descr);
    if (esize == 0)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: unsupported npy dtype {}", path,
                           descr);
    int64_t count = 1;
    for (int64_t s : shape) count *= s;
    if (static_cast<size_t>(count) * esize != bytes) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "{}: shape holds {} elements but {} bytes given", path, count, bytes);
    }
    std::string shp = "(";
    for (size_t i = 0; i < shape.size(); ++i)
        shp += std::to_string(shape[i]) +
               (shape.size() == 1 ? "," : (i + 1 < shape.size() ? ", " : ""));
    shp += ")";
    std::string header =
        "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shp + ", }";
    // magic(6) + version(2) + len(2) + header + '\n' padded to a multiple of 64.
    size_t total = 10 + header.size() + 1;
    header.append((64 - total % 64) % 64, ' ');
    header.push_back('\n');
    std::ofstream f(path, std::ios::binary);
    if (!f) return PDSIM_ERROR(StatusCode::kInvalidArgument, "cannot open {} for writing", path);
    const char magic[] = "\x93NUMPY";
    f.write(magic, 6);
    const char ver[2] = {1, 0};
    f.write(ver, 2);
    uint16_t hlen = static_cast<uint16_t>(header.size());
    const char len[2] = {static_cast<char>(hlen & 0xff), static_cast<char>(hlen >> 8)};
    f.write(len, 2);
    f.write(header.data(), static_cast<std::streamsize>(header.size()));
    f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
    if (!f) return PDSIM_ERROR(StatusCode::kUnavailable, "write to {} failed", path);
    return {};
}

StatusOr<NpyArray> read_npy(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) return PDSIM_ERROR(StatusCode::kNotFound, "cannot open {}", path);
    char head[10];
    f.read(head, 10);
    if (!f || std::memcmp(head, "\x93NUMPY", 6) != 0 || head[6] != 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: not a version-1 .npy file", path);
    }
    const size_t hlen =
        static_cast<uint8_t>(head[8]) | (static_cast<size_t>(static_cast<uint8_t>(head[9])) << 8);
    std::string header(hlen, '\0');
    f.read(header.data(), static_cast<std::streamsize>(hlen));
    std::smatch m;
    NpyArray a;
    if (!std::regex_search(header, m, std::regex("'descr': '([^']+)'"))) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: no descr in header", path);
    }
    a.descr = m[1];
    if (header.find("'fortran_order': False") == std::string::npos) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: Fortran order not supported", path);
    }
    if (!std::regex_search(header, m, std::regex("'shape': \\(([^)]*)\\)"))) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: no shape in header", path);
    }
    std::string dims = m[1];
    std::regex num("[0-9]+");
    for (auto it = std::sregex_iterator(dims.begin(), dims.end(), num);
         it != std::sregex_iterator(); ++it) {
        a.shape.push_back(std::stoll(it->str()));
    }
    const size_t esize = descr_size(a.descr);
    if (esize == 0)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: unsupported dtype {}", path, a.descr);
    a.data.resize(static_cast<size_t>(a.count()) * esize);
    f.read(reinterpret_cast<char*>(a.data.data()), static_cast<std::streamsize>(a.data.size()));
    if (!f) return PDSIM_ERROR(StatusCode::kDataLoss, "{}: truncated data", path);
    return a;
}

}  // namespace pdsim

// An in-memory regular file (memfd) with a path, for the readers that take a path
// (common/input_file.h reads regular files only; a memfd is one). One per process; rewritten per
// input, nothing touches the disk.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace pdsim::fuzz {

// The path of a memfd holding exactly `data`. The descriptor is created once and kept open.
inline const std::string& mem_file(const uint8_t* data, size_t size) {
    static const int fd = [] {
        const int f = memfd_create("pdsim-fuzz", 0);
        if (f < 0) std::abort();
        return f;
    }();
    static const std::string path = "/proc/self/fd/" + std::to_string(fd);
    if (ftruncate(fd, 0) != 0) std::abort();
    size_t done = 0;
    while (done < size) {
        const ssize_t n = pwrite(fd, data + done, size - done, static_cast<off_t>(done));
        if (n <= 0) std::abort();
        done += static_cast<size_t>(n);
    }
    return path;
}

}  // namespace pdsim::fuzz

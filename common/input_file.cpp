#include "common/input_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace pdsim::files {

namespace {

Status file_error(const std::string& path, std::string_view what) {
    return invalid_argument_error(fmt::format("{}: {}", path, what));
}

std::string_view file_type_name(mode_t mode) {
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISSOCK(mode)) return "a socket";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    return "not a plain file";
}

}  // namespace

std::string format_byte_limit(uint64_t bytes) {
    if (bytes >= (uint64_t{1} << 30) && bytes % (uint64_t{1} << 30) == 0) {
        return fmt::format("{} GiB", bytes >> 30);
    }
    if (bytes >= (uint64_t{1} << 20) && bytes % (uint64_t{1} << 20) == 0) {
        return fmt::format("{} MiB", bytes >> 20);
    }
    return fmt::format("{} bytes", bytes);
}

InputFile::InputFile(std::string path, int fd, uint64_t size, uint64_t max_bytes)
    : path_(std::move(path)), size_at_open_(size) {
    buf_.fd = fd;
    buf_.max_bytes = max_bytes;
}

InputFile::~InputFile() {
    if (buf_.fd >= 0) ::close(buf_.fd);
}

StatusOr<std::unique_ptr<InputFile>> InputFile::open(const std::string& path, uint64_t max_bytes) {
    if (path.empty()) return invalid_argument_error("empty file name");
    const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        return file_error(path, fmt::format("cannot open: {}", std::strerror(errno)));
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        const int err = errno;
        ::close(fd);
        return file_error(path, fmt::format("cannot stat: {}", std::strerror(err)));
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        return file_error(path,
                          fmt::format("is {}, not a regular file", file_type_name(st.st_mode)));
    }
    const auto size = static_cast<uint64_t>(st.st_size);
    if (size > max_bytes) {
        ::close(fd);
        return file_error(path, fmt::format("{} bytes is larger than the {} limit for this file",
                                            size, format_byte_limit(max_bytes)));
    }
    // Regular files never block; clear O_NONBLOCK anyway so reads behave as usual.
    if (const int flags = ::fcntl(fd, F_GETFL); flags >= 0) {
        (void)::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    }
    return std::unique_ptr<InputFile>(new InputFile(path, fd, size, max_bytes));
}

InputFile::FdBuf::int_type InputFile::FdBuf::underflow() {
    if (gptr() < egptr()) return traits_type::to_int_type(*gptr());
    if (consumed >= max_bytes) {
        // One probe byte tells "exactly max_bytes" from "grew past the cap".
        char probe = 0;
        ssize_t n = 0;
        do {
            n = ::read(fd, &probe, 1);
        } while (n < 0 && errno == EINTR);
        if (n > 0) over_limit = true;
        return traits_type::eof();
    }
    const uint64_t want = std::min<uint64_t>(sizeof data, max_bytes - consumed);
    ssize_t n = 0;
    do {
        n = ::read(fd, data, static_cast<size_t>(want));
    } while (n < 0 && errno == EINTR);
    if (n < 0) {
        read_errno = errno;
        return traits_type::eof();
    }
    if (n == 0) return traits_type::eof();
    consumed += static_cast<uint64_t>(n);
    setg(data, data, data + n);
    return traits_type::to_int_type(*gptr());
}

Status InputFile::read_status() const {
    if (buf_.read_errno != 0) {
        return file_error(path_, fmt::format("read error: {}", std::strerror(buf_.read_errno)));
    }
    if (buf_.over_limit) {
        return file_error(path_, fmt::format("grew past the {} limit for this file while it was "
                                             "read",
                                             format_byte_limit(buf_.max_bytes)));
    }
    return ok_status();
}

StatusOr<std::string> read_input_file(const std::string& path, uint64_t max_bytes) {
    PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<InputFile> file, InputFile::open(path, max_bytes));
    std::string text;
    text.reserve(static_cast<size_t>(file->size_at_open()));
    char chunk[65536];
    std::istream& in = file->stream();
    while (in.read(chunk, sizeof chunk) || in.gcount() > 0) {
        text.append(chunk, static_cast<size_t>(in.gcount()));
    }
    PDSIM_RETURN_IF_ERROR(file->read_status());
    return text;
}

}  // namespace pdsim::files

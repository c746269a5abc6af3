// Opening the files a user names (--trace, --topology, --model, --cost-model, timelines): the edge
// where a path becomes bytes.
//
// Only regular files are read. The path is opened with O_NONBLOCK, so a FIFO without a writer
// cannot block the open, and the open descriptor is fstat'ed: a FIFO, socket, character or block
// device (/dev/zero) or directory is refused at once. A file larger than the cap of its kind is
// refused before any of it is read, and reading stops at the cap if the file grows meanwhile, so
// memory stays bounded whatever the path names.
//
// Every error is kInvalidArgument whose message starts with the path ("<path>: is a FIFO, not a
// regular file"); the CLI turns it into exit status 2.
//
// Thread-safety: the functions are reentrant; one InputFile is used by one thread at a time.
#pragma once

#include <cstdint>
#include <istream>
#include <memory>
#include <streambuf>
#include <string>

#include "common/status.h"

namespace pdsim::files {

// Caps per kind of file. Traces (and timelines) may be large; configuration files are small.
inline constexpr uint64_t kMaxTraceFileBytes = uint64_t{4} << 30;    // 4 GiB
inline constexpr uint64_t kMaxConfigFileBytes = uint64_t{16} << 20;  // 16 MiB

// An open regular file read as a std::istream (unbuffered by the C library: 64 KiB reads).
class InputFile {
public:
    // Opens `path` for reading. kInvalidArgument when it cannot be opened, is not a regular file,
    // or is larger than `max_bytes`.
    [[nodiscard]] static StatusOr<std::unique_ptr<InputFile>> open(const std::string& path,
                                                                   uint64_t max_bytes);
    ~InputFile();
    InputFile(const InputFile&) = delete;
    InputFile& operator=(const InputFile&) = delete;

    [[nodiscard]] const std::string& path() const { return path_; }
    [[nodiscard]] uint64_t size_at_open() const { return size_at_open_; }
    // The file's contents up to max_bytes. The stream ends early (eof, with over_limit() true)
    // when the file has grown past max_bytes since it was opened, and sets badbit on a read error.
    [[nodiscard]] std::istream& stream() { return stream_; }
    // True once reading stopped at max_bytes: the caller must not trust a parse of the prefix.
    [[nodiscard]] bool over_limit() const { return buf_.over_limit; }
    // kInvalidArgument naming the path when over_limit() or a read failed; OK otherwise.
    [[nodiscard]] Status read_status() const;

private:
    struct FdBuf : std::streambuf {
        int fd = -1;
        uint64_t max_bytes = 0;
        uint64_t consumed = 0;
        bool over_limit = false;
        int read_errno = 0;
        char data[65536];
        int_type underflow() override;
    };

    InputFile(std::string path, int fd, uint64_t size, uint64_t max_bytes);

    std::string path_;
    uint64_t size_at_open_ = 0;
    FdBuf buf_;
    std::istream stream_{&buf_};
};

// All of the regular file at `path` (see InputFile::open for the errors), at most `max_bytes`.
[[nodiscard]] StatusOr<std::string> read_input_file(const std::string& path, uint64_t max_bytes);

// "16 MiB", "4 GiB", "512 bytes": a cap for a message.
[[nodiscard]] std::string format_byte_limit(uint64_t bytes);

}  // namespace pdsim::files

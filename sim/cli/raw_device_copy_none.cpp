// RawDeviceCopy in a build without CUDA.
#include "sim/cli/raw_device_copy.h"

namespace pdsim::cli {

StatusOr<std::unique_ptr<RawDeviceCopy>> make_raw_device_copy(int /*device*/) {
    return Status(StatusCode::kUnavailable, "raw device copy: pdsim was built without CUDA");
}

}  // namespace pdsim::cli

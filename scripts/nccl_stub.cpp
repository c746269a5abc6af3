// A stand-in libnccl.so.2 for the GPU bundle (scripts/gpu_bundle.sh builds it into
// .gpu/nccl-stub/). scripts/gpu_check.sh puts it on the library path only when the GPU machine has
// no libnccl.so.2 of its own, so that binaries linked against NCCL still load; every call fails,
// and the nccl transport then reports kUnavailable with the message below and its tests skip.
#include <nccl.h>

namespace {
constexpr const char* kMessage =
    "libnccl.so.2 was not found on this machine: NCCL is not built into this run (the pdsim GPU "
    "bundle loaded its stub instead)";
}  // namespace

extern "C" {

const char* ncclGetErrorString(ncclResult_t) {
    return kMessage;
}
const char* ncclGetLastError(ncclComm_t) {
    return kMessage;
}
ncclResult_t ncclGetVersion(int*) {
    return ncclSystemError;
}
ncclResult_t ncclGetUniqueId(ncclUniqueId*) {
    return ncclSystemError;
}
ncclResult_t ncclCommInitRank(ncclComm_t*, int, ncclUniqueId, int) {
    return ncclSystemError;
}
ncclResult_t ncclCommDestroy(ncclComm_t) {
    return ncclSystemError;
}
ncclResult_t ncclCommAbort(ncclComm_t) {
    return ncclSystemError;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t, ncclResult_t*) {
    return ncclSystemError;
}
ncclResult_t ncclGroupStart() {
    return ncclSystemError;
}
ncclResult_t ncclGroupEnd() {
    return ncclSystemError;
}
ncclResult_t ncclSend(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) {
    return ncclSystemError;
}
ncclResult_t ncclRecv(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) {
    return ncclSystemError;
}

}  // extern "C"

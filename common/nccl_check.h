// NCCL_CHECK(call): a failing NCCL call becomes a Status naming the call, ncclGetErrorString and
// file:line, returned from the enclosing function. Include only from transfer/nccl/.
#pragma once

#include <nccl.h>

#include "common/status.h"

#define NCCL_CHECK(call)                                                                  \
    do {                                                                                  \
        ncclResult_t pdsim_nccl_rc_ = (call);                                             \
        if (pdsim_nccl_rc_ != ncclSuccess) [[unlikely]]                                   \
            return PDSIM_ERROR(::pdsim::StatusCode::kUnavailable, "{} failed: {}", #call, \
                               ncclGetErrorString(pdsim_nccl_rc_));                       \
    } while (0)

#include "backends/pd/step_gate.h"

namespace pdsim::pd {

std::string_view gate_path_name(GatePath path) {
    switch (path) {
        case GatePath::kReady:
            return "ready";
        case GatePath::kStreamOrder:
            return "stream_order";
        case GatePath::kEvent:
            return "event";
        case GatePath::kValueWait:
            return "value_wait";
        case GatePath::kWouldDeadlock:
            return "would_deadlock";
    }
    return "unknown";
}

GatePath decide_gate(const GateInputs& in) {
    if (raw_reached(in.ready_raw, in.target_raw)) return GatePath::kReady;
    if (!in.exact) return GatePath::kValueWait;
    if (raw_reached(in.enqueued_raw, in.target_raw)) {  // the target's record is enqueued
        if (in.same_stream) return GatePath::kStreamOrder;
        // enqueued_raw - target_raw >= 0 here: how many eager records were enqueued after it.
        const uint64_t newer = in.enqueued_raw - in.target_raw;
        return newer < in.ring_capacity ? GatePath::kEvent : GatePath::kValueWait;
    }
    return in.same_stream ? GatePath::kWouldDeadlock : GatePath::kValueWait;
}

}  // namespace pdsim::pd

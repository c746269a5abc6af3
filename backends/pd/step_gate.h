// The pure host logic of pd::StepCounter (backends/pd/step_counter.h): the wrapped/raw step rule
// and the choice of a gate's mechanism. No state, no I/O, no device headers, so both
// implementations (CPU and CUDA) share it and it is unit-tested without a device.
//
// Wrapped and raw steps. The API speaks in steps modulo kStepCountMax = 2^62 (tokenspeed's
// StepCounter rule: `begin + l` may be passed unwrapped, readiness is is_step_ready). Underneath,
// each counter is a raw 64-bit value that only ever grows by one per record and never wraps (2^64
// records would take centuries). Every query, wait and gate converts at the API:
//  - wrap_raw(raw) is the wrapped step a raw value shows;
//  - raw_wait_target(step, raw_ready) is the raw value the counter must reach for `step` to be
//    ready, read against the raw value published now: a target that is ready already maps to
//    raw_ready (nothing to wait for), one that is not (equal, or ahead by up to 2^61) to the raw
//    value of the record that moves the counter past it. A device-side wait compares raw values
//    (cuStreamWaitValue64's cyclic >=), never wrapped ones, so it is exact across the 2^62 wrap.
//
// Thread-safety: everything here is a pure function of its arguments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace pdsim::pd {

// Steps at the API are residues modulo this (2^62).
inline constexpr int64_t kStepCountMax = int64_t{1} << 62;

// `step` mod 2^62, in [0, 2^62), for any int64 (negative values too).
constexpr int64_t wrap_step(int64_t step) {
    return static_cast<int64_t>(static_cast<uint64_t>(step) &
                                static_cast<uint64_t>(kStepCountMax - 1));
}

// The wrapped step a raw counter value shows.
constexpr int64_t wrap_raw(uint64_t raw) {
    return static_cast<int64_t>(raw & static_cast<uint64_t>(kStepCountMax - 1));
}

// True when `ready` has moved past `target` modulo 2^62 (strict: equal is not ready), by less
// than half the ring: target != ready && (target - ready) mod 2^62 > 2^61. Computed in uint64
// (2^64 is a multiple of 2^62, so the unsigned wrap keeps the residue): no input overflows.
constexpr bool is_step_ready(int64_t ready, int64_t target) {
    const uint64_t diff = (static_cast<uint64_t>(target) - static_cast<uint64_t>(ready)) &
                          static_cast<uint64_t>(kStepCountMax - 1);
    return diff > static_cast<uint64_t>(kStepCountMax / 2);  // implies target != ready
}

// Whether a raw counter at `raw` has reached `target_raw`: cyclic >= on 64 bits, the comparison
// cuStreamWaitValue64 (CU_STREAM_WAIT_VALUE_GEQ) makes on the device.
constexpr bool raw_reached(uint64_t raw, uint64_t target_raw) {
    return static_cast<int64_t>(raw - target_raw) >= 0;
}

// The raw value the counter must reach for the wrapped API step `target` (any int64; only its
// residue counts) to be ready, given the raw value `raw_ready` published now:
//  - raw_ready itself when is_step_ready(wrap_raw(raw_ready), target) already holds;
//  - otherwise raw_ready + d + 1, d = (target - raw_ready) mod 2^62 in [0, 2^61]: the record
//    that publishes that raw value shows wrapped step target + 1, the first one past target.
// So "ready now" is exactly raw_wait_target(target, raw_ready) == raw_ready, and a counter at any
// raw r >= the result (until it runs 2^61 records past it) satisfies is_step_ready.
constexpr uint64_t raw_wait_target(int64_t target, uint64_t raw_ready) {
    const uint64_t d =
        (static_cast<uint64_t>(target) - raw_ready) & static_cast<uint64_t>(kStepCountMax - 1);
    if (d > static_cast<uint64_t>(kStepCountMax / 2)) return raw_ready;  // ready already
    return raw_ready + d + 1;
}

// The wrapped API step a raw wait target stands for (for messages): the inverse of
// raw_wait_target on targets that are not ready yet.
constexpr int64_t step_of_raw_target(uint64_t target_raw) {
    return wrap_raw(target_raw - 1);
}

// How a gate makes another stream wait (StepCounter::gate returns the one it used).
enum class GatePath : uint8_t {
    // The step is ready already: nothing is enqueued.
    kReady,
    // `other` is the counter's own stream and the record is already enqueued on it.
    kStreamOrder,
    // A wait on the event recorded right after that (eagerly enqueued) record.
    kEvent,
    // A wait on the counter's value: cuStreamWaitValue64 on a CUDA stream, a task waiting on the
    // host mirror on a CPU stream.
    kValueWait,
    // Refused: `other` is the counter's own stream and the record that would satisfy the wait is
    // not enqueued yet (nothing could ever satisfy it).
    kWouldDeadlock,
};

[[nodiscard]] std::string_view gate_path_name(GatePath path);

// What decide_gate looks at; the StepCounter fills it under its lock.
struct GateInputs {
    uint64_t target_raw = 0;    // raw_wait_target(step, ready_raw)
    uint64_t ready_raw = 0;     // the raw value published now (the host mirror)
    uint64_t enqueued_raw = 0;  // the raw value the last eagerly enqueued record will publish
    // How many of the latest eager records keep an event to wait on (0: the implementation keeps
    // none). Eager record publishing raw r is in the ring while enqueued_raw - r < ring_capacity.
    size_t ring_capacity = 0;
    // False once a record was captured into a graph (or failed after it may have been enqueued):
    // replays run records the host does not see, so enqueued_raw no longer says which raw value
    // an eager record publishes, and only the counter's value can be waited on.
    bool exact = true;
    bool same_stream = false;  // `other` is the counter's own stream
};

// The mechanism for one gate:
//  1. target already reached (raw_reached(ready_raw, target_raw))           -> kReady;
//  2. exact bookkeeping and the target's record is enqueued (target <= enqueued):
//       same stream                                                          -> kStreamOrder,
//       its event still in the ring                                          -> kEvent,
//       evicted (more than ring_capacity eager records since)                -> kValueWait;
//  3. exact and the record is not enqueued yet: same stream -> kWouldDeadlock, else kValueWait;
//  4. not exact (after a capture)                                            -> kValueWait
//     (on the same stream too: the record may sit in a graph launched earlier on it).
[[nodiscard]] GatePath decide_gate(const GateInputs& in);

}  // namespace pdsim::pd

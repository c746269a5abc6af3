// The libFuzzer targets' common frame (fuzz/README.md).
//
// A target is written once as
//     PDSIM_FUZZ_TARGET(trace_jsonl_fuzz) { ...feed data/size to the entry point...; return 0; }
// which defines `int pdsim_fuzz_trace_jsonl_fuzz(const uint8_t*, size_t)` and, in the fuzz build,
// LLVMFuzzerTestOneInput calling it. The normal test build compiles every target into one binary
// (tests/fuzz_replay_test.cpp, PDSIM_FUZZ_REPLAY defined: no LLVMFuzzerTestOneInput) and replays
// the seeds and the crash regressions through the same functions, so they run everywhere.
//
// PDSIM_FUZZ_CHECK(cond, what): an invariant of a successful parse (a round trip that must give
// back the same bytes, a field that must be in range). A failure prints `what` and traps
// (__builtin_trap), which libFuzzer reports as a crash and saves the input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>

#ifdef PDSIM_FUZZ_REPLAY
#define PDSIM_FUZZ_ENTRY(name)
#else
#define PDSIM_FUZZ_ENTRY(name)                                                \
    extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { \
        return pdsim_fuzz_##name(data, size);                                 \
    }
#endif

#define PDSIM_FUZZ_TARGET(name)                              \
    int pdsim_fuzz_##name(const uint8_t* data, size_t size); \
    PDSIM_FUZZ_ENTRY(name)                                   \
    int pdsim_fuzz_##name([[maybe_unused]] const uint8_t* data, [[maybe_unused]] size_t size)

#define PDSIM_FUZZ_CHECK(cond, what)                                                            \
    do {                                                                                        \
        if (!(cond)) {                                                                          \
            std::fprintf(stderr, "%s:%d: fuzz invariant failed: %s (%s)\n", __FILE__, __LINE__, \
                         #cond, what);                                                          \
            __builtin_trap();                                                                   \
        }                                                                                       \
    } while (false)

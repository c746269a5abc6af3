// What a sliding-window layer's transfer sends (issue 15). A decode step at position p >= L
// (L = the prompt length) attends to keys [p - W + 1, p]; the prompt's keys it can ever read are
// [L - W + 1, L). The window engine (docs/design.md "Hybrid models") sends, for every sliding
// layer, positions [window_start(L, W, ps), L) -- that range rounded down to a page boundary so
// that both sides address it with a page table slice -- as its request's tokens 0, 1, ... Both
// sides compute it from the same L, W and page size (the testbed runs one page size).
#pragma once

#include <algorithm>
#include <cstdint>

namespace pdsim::testbed {

// The first prompt position a sliding layer of window `window` sends (a multiple of page_size).
// Preconditions: window >= 1, page_size >= 1, input_len >= 0.
[[nodiscard]] inline int64_t window_start(int64_t input_len, int window, int page_size) {
    const int64_t first = std::max<int64_t>(0, input_len - window + 1);
    return first / page_size * page_size;
}

}  // namespace pdsim::testbed

// What a sliding-window layer's transfer sends (issue 15). A decode step at position p >= L
// (L = the prompt length) attends to keys [p - W + 1, p]; the prompt's keys it can ever read are
// [L - W + 1, L). The window engine (docs/design.md "Hybrid models") sends, for every sliding
// layer, positions [window_start(L, W, ps), L) -- that range rounded down to a page boundary so
// that both sides address it with a page table slice -- as its request's tokens 0, 1, ... Both
// sides compute it from the same L, W and page size (the testbed runs one page size).
//
// The sliding layers' own pages. A sliding layer never reads a position more than W - 1 before
// its query, so its cache group (its own KV pool, rank_builder.h) keeps a ring of R pages per
// request: logical page j (positions [j * ps, (j + 1) * ps)) lives in ring[j % R], and a page that
// falls out of the window is reused for the request's next page. A forward that computes
// positions [s, e) of a request first writes them, then reads keys from s - W + 1 on: it touches
// logical pages floor((s - W + 1) / ps) .. floor((e - 1) / ps), at most
// floor((e - s + W - 2) / ps) + 2 of them. With R that many for the longest extend a rank runs
// (window_ring_pages), the pages one forward touches are distinct ring slots, and a slot is
// overwritten only after every later query's window has left its old page. A decode rank (extends
// of 1) needs floor((W - 1) / ps) + 2 pages, which also hold the window it receives.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

namespace pdsim::testbed {

// The first prompt position a sliding layer of window `window` sends (a multiple of page_size).
// Preconditions: window >= 1, page_size >= 1, input_len >= 0.
[[nodiscard]] inline int64_t window_start(int64_t input_len, int window, int page_size) {
    const int64_t first = std::max<int64_t>(0, input_len - window + 1);
    return first / page_size * page_size;
}

// The ring size R of a request (see the file comment) on a rank whose extends compute at most
// `max_extend` positions of a request per forward, for a request of at most `max_tokens`
// positions (never more pages than the request has). Preconditions: window, page_size,
// max_extend, max_tokens >= 1.
[[nodiscard]] inline int window_ring_pages(int window, int page_size, int64_t max_extend,
                                           int64_t max_tokens) {
    const int64_t ring = (max_extend + window - 2) / page_size + 2;
    const int64_t all = (max_tokens + page_size - 1) / page_size;
    return static_cast<int>(std::max<int64_t>(1, std::min(ring, all)));
}

// Logical pages [first_page, end_page) of a request whose ring is `ring` (not empty), as a page
// list: entry i is ring[(first_page + i) % R].
[[nodiscard]] inline std::vector<int32_t> ring_pages(std::span<const int32_t> ring,
                                                     int64_t first_page, int64_t end_page) {
    std::vector<int32_t> out;
    const auto r = static_cast<int64_t>(ring.size());
    for (int64_t j = first_page; j < end_page; ++j) out.push_back(ring[static_cast<size_t>(j % r)]);
    return out;
}

}  // namespace pdsim::testbed

// The sliding layers' window (sim/testbed/window.h): what the window engine sends, and the ring of
// pages a request keeps in the sliding layers' own pool. The ring is checked against a
// position-level oracle: every slot remembers the position last written to it, and every key a
// query reads must still be its own position's, through chunked prefill, the sent window, a
// decode rank's receive and its decode steps.
#include <gtest/gtest.h>

#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "sim/testbed/window.h"

namespace pdsim::testbed {
namespace {

TEST(Window, StartIsThePageOfTheFirstPositionADecodeStepReads) {
    EXPECT_EQ(window_start(100, 8, 16), 80);  // 93 rounded down to a page
    EXPECT_EQ(window_start(100, 8, 1), 93);
    EXPECT_EQ(window_start(5, 8, 4), 0);  // the window covers the whole prompt
    EXPECT_EQ(window_start(0, 1, 4), 0);
    EXPECT_EQ(window_start(9, 1, 4), 8);  // W = 1: only the last position
}

// One request's ring in one rank's sliding pool, with the oracle.
class RingOracle {
public:
    RingOracle(int ring_size, int page_size) : page_size_(page_size) {
        ring_.resize(static_cast<size_t>(ring_size));
        std::iota(ring_.begin(), ring_.end(), 1);  // pages 1..R of the pool
        slot_pos_.assign(static_cast<size_t>((ring_size + 1) * page_size), -1);
    }
    [[nodiscard]] size_t slot(int64_t pos) const {
        const auto page = ring_pages(ring_, pos / page_size_, pos / page_size_ + 1).front();
        return static_cast<size_t>(page * page_size_ + pos % page_size_);
    }
    void write(int64_t pos) { slot_pos_[slot(pos)] = pos; }
    [[nodiscard]] bool holds(int64_t pos) const { return slot_pos_[slot(pos)] == pos; }
    // A forward computing [begin, end): writes them all, then each query reads its window.
    // Returns the first position read wrong, or -1.
    int64_t forward(int64_t begin, int64_t end, int window) {
        for (int64_t t = begin; t < end; ++t) write(t);
        for (int64_t p = begin; p < end; ++p) {
            for (int64_t q = std::max<int64_t>(0, p - window + 1); q <= p; ++q) {
                if (!holds(q)) return q;
            }
        }
        return -1;
    }
    [[nodiscard]] const std::vector<int32_t>& ring() const { return ring_; }

private:
    int page_size_;
    std::vector<int32_t> ring_;
    std::vector<int64_t> slot_pos_;
};

// Prefill rank (chunks of `chunk`), the window it sends, the decode rank's receive of it and
// `decode` decode steps, and a colocated rank doing both in one ring. `shrink` pages are taken off
// every ring (0: window_ring_pages). Returns "" or what went wrong.
std::string run_request(int window, int ps, int chunk, int prompt, int decode, int shrink) {
    auto ring_of = [&](int64_t max_extend, int64_t tokens) {
        return std::max(1, window_ring_pages(window, ps, max_extend, tokens) - shrink);
    };
    // Prefill: chunks, then the sent window must be intact.
    RingOracle prefill(ring_of(chunk, prompt), ps);
    for (int s = 0; s < prompt; s += chunk) {
        const int64_t bad = prefill.forward(s, std::min(prompt, s + chunk), window);
        if (bad >= 0)
            return "prefill chunk at " + std::to_string(s) + " read " + std::to_string(bad);
    }
    const int64_t first = window_start(prompt, window, ps);
    for (int64_t q = first; q < prompt; ++q) {
        if (!prefill.holds(q)) return "the sent window lost position " + std::to_string(q);
    }
    // Each side's page list of the window: distinct pages (the engine writes each once).
    RingOracle receiver(ring_of(1, prompt + decode), ps);
    for (const RingOracle* side : {&prefill, &receiver}) {
        const auto pages = ring_pages(side->ring(), first / ps, (prompt + ps - 1) / ps);
        if (std::set<int32_t>(pages.begin(), pages.end()).size() != pages.size()) {
            return "the window's pages repeat a ring page";
        }
    }
    for (int64_t q = first; q < prompt; ++q) receiver.write(q);
    for (int64_t p = prompt; p < prompt + decode; ++p) {
        const int64_t bad = receiver.forward(p, p + 1, window);
        if (bad >= 0) return "decode at " + std::to_string(p) + " read " + std::to_string(bad);
    }
    RingOracle colocated(ring_of(chunk, prompt + decode), ps);
    for (int s = 0; s < prompt; s += chunk) {
        const int64_t bad = colocated.forward(s, std::min(prompt, s + chunk), window);
        if (bad >= 0) return "colocated chunk at " + std::to_string(s);
    }
    for (int64_t p = prompt; p < prompt + decode; ++p) {
        if (colocated.forward(p, p + 1, window) >= 0)
            return "colocated decode at " + std::to_string(p);
    }
    return "";
}

TEST(WindowRing, EveryReadFindsItsPositionOverAGrid) {
    int cases = 0;
    for (int window = 1; window <= 19; window += 3) {
        for (int ps = 1; ps <= 5; ++ps) {
            for (int chunk : {1, 2, 5, 8, 13}) {
                for (int prompt = 1; prompt <= 45; prompt += 4) {
                    const std::string err = run_request(window, ps, chunk, prompt, 25, 0);
                    ASSERT_EQ(err, "") << "W " << window << " ps " << ps << " chunk " << chunk
                                       << " prompt " << prompt;
                    ++cases;
                }
            }
        }
    }
    EXPECT_EQ(cases, 7 * 5 * 5 * 12);
}

// The ring is no bigger than it must be: one page fewer breaks a read for every window, page size
// and chunk of the grid (at some prompt length). The exception: one position per forward with a
// window of at most a page, where the positions a query reads have distinct offsets in a page, so
// that a one-page ring would do (the rule counts pages, not slots).
TEST(WindowRing, OnePageFewerLosesAKey) {
    for (int window = 2; window <= 19; window += 3) {
        for (int ps = 1; ps <= 5; ++ps) {
            for (int chunk : {1, 5, 13}) {
                if (chunk == 1 && window <= ps) continue;
                bool broke = false;
                for (int prompt = 1; prompt <= 60 && !broke; ++prompt) {
                    broke = !run_request(window, ps, chunk, prompt, 30, 1).empty();
                }
                EXPECT_TRUE(broke) << "W " << window << " ps " << ps << " chunk " << chunk;
            }
        }
    }
}

TEST(WindowRing, NeverMorePagesThanTheRequestHas) {
    EXPECT_EQ(window_ring_pages(128, 16, 512, 100), 7);       // 100 tokens: 7 pages
    EXPECT_EQ(window_ring_pages(128, 16, 512, 1 << 20), 41);  // (512 + 126) / 16 + 2
    EXPECT_EQ(window_ring_pages(128, 16, 1, 1 << 20), 9);     // a decode rank: 127 / 16 + 2
    EXPECT_EQ(ring_pages(std::vector<int32_t>{4, 8, 6}, 2, 6), (std::vector<int32_t>{6, 4, 8, 6}));
}

}  // namespace
}  // namespace pdsim::testbed

// Batch planning shared by the testbed's instance leaders and the simulator's instances
// (docs/testbed.md section 2, "Batches"):
//   extend forward: the queued requests in FCFS order, each contributing
//     min(remaining, chunk_size, tokens left in the forward's budget) tokens, until the budget
//     (max_batch_tokens) is spent; a request with nothing left is skipped.
//   decode forward: the running requests in FCFS order, up to max_decode_batch requests and, when
//     max_decode_kv_tokens > 0, that many KV tokens in all (the first request always fits).
//   A forward is either extend or decode, never mixed; an instance with both kinds of work
//   alternates them (extend unless the previous forward was an extend).
// The planners are incremental so a caller can walk its own queue without copying it:
//   ExtendPlanner plan(options);
//   for (auto& r : queue) { if (plan.full()) break; if (int64_t n = plan.take(r.remaining)) ...; }
// Thread-safety: plain values.
#pragma once

#include <algorithm>
#include <cstdint>

namespace pdsim::policy {

struct BatchingOptions {
    int64_t chunk_size = 512;          // prefill tokens of one request per extend forward
    int64_t max_batch_tokens = 2048;   // tokens per extend forward
    int64_t max_decode_batch = 64;     // requests per decode forward
    int64_t max_decode_kv_tokens = 0;  // KV tokens per decode forward; 0: no bound
};

class ExtendPlanner {
public:
    explicit ExtendPlanner(const BatchingOptions& o)
        : chunk_(o.chunk_size), budget_(o.max_batch_tokens) {}
    // True once the forward's token budget is spent (stop walking the queue).
    [[nodiscard]] bool full() const { return budget_ <= 0; }
    // Tokens a request with `remaining` unprefilled tokens computes in this forward; 0: skip it.
    int64_t take(int64_t remaining) {
        const int64_t n = std::min({remaining, chunk_, budget_});
        if (n <= 0) return 0;
        budget_ -= n;
        tokens_ += n;
        return n;
    }
    [[nodiscard]] int64_t tokens() const { return tokens_; }

private:
    int64_t chunk_;
    int64_t budget_;
    int64_t tokens_ = 0;
};

class DecodePlanner {
public:
    explicit DecodePlanner(const BatchingOptions& o)
        : max_batch_(o.max_decode_batch), max_kv_(o.max_decode_kv_tokens) {}
    // Whether the next running request (FCFS), whose context after this step is `kv_tokens`,
    // joins the batch; false closes the batch (stop walking).
    bool take(int64_t kv_tokens) {
        if (count_ >= max_batch_) return false;
        if (count_ > 0 && max_kv_ > 0 && kv_ + kv_tokens > max_kv_) return false;
        kv_ += kv_tokens;
        ++count_;
        return true;
    }
    [[nodiscard]] int64_t count() const { return count_; }
    [[nodiscard]] int64_t kv_tokens() const { return kv_; }

private:
    int64_t max_batch_;
    int64_t max_kv_;
    int64_t count_ = 0;
    int64_t kv_ = 0;
};

enum class ForwardKind { kNone, kExtend, kDecode };

// The next forward of an instance with extend work (requests with unprefilled tokens) and/or
// decode work (running requests), given whether its previous forward was an extend.
[[nodiscard]] inline ForwardKind choose_forward(bool has_extend, bool has_decode,
                                                bool last_was_extend) {
    if (has_extend && (!has_decode || !last_was_extend)) return ForwardKind::kExtend;
    return has_decode ? ForwardKind::kDecode : ForwardKind::kNone;
}

}  // namespace pdsim::policy

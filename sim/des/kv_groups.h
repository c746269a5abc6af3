// The simulator's rules for a request's KV by layer group (topo::LayerKind): what it occupies in
// an instance's KV pool (KvFootprint) and what its disaggregated transfer moves (KvTransferBytes).
// docs/simulator.md section "Hybrid models" works an example by hand. For a model whose layers
// are all full attention ("dense") both reduce to what the simulator always did.
//
// Notation: F, S, R = the model's full-attention, sliding-window and recurrent layers; W = its
// sliding_window; ps = page size (tokens); kv(tp) = KV bytes of one token in one layer on one rank
// of a TP group of tp (ModelShape::kv_elems_per_token_per_layer(tp) x the KV dtype's bytes);
// st(tp) = bytes of one request's state in one recurrent layer on one rank
// (ModelShape::state_elems_per_request_layer(tp) x 4: fp32, whatever the KV dtype).
//
// Memory (KvFootprint). The pool counts pages; a page holds ps tokens of KV on one rank
//   dense:   of every layer (page bytes ps x kv(tp) x num_layers: the page it always was);
//   hybrid:  of ONE attention layer ("layer page", ps x kv(tp) bytes).
// A request that holds T tokens (context: its prompt, plus the tokens generated or reserved) holds,
// with P = ceil(T / ps):
//   full-attention group    P pages per full layer (dense: P pages in all);
//   sliding-window group    min(P, ceil((s - 1) / ps) + 1) pages per sliding layer: the most
//                           pages that s consecutive tokens can touch, where s is the span the
//                           instance keeps: W on a disaggregated decode instance (a decode step's
//                           query attends the last W positions, its own included), W - 1 + C on
//                           an instance that prefills in chunks of up to C tokens (prefill,
//                           colocated: the chunk's first query attends W - 1 earlier positions).
//                           A real engine frees the pages that fall out of the span; here the
//                           reservation stops growing once it covers the span;
//   recurrent group         ceil(R x st(tp) / page bytes) pages per request whatever T (the
//                           recurrent and conv state of every recurrent layer, rounded up to whole
//                           pages once per request), held from admission to release.
// pages_for(T) is non-decreasing in T, so a request's reservation only grows. Not modelled: the
// transient pages of a recompute's chunk on a decode instance (it keeps the span W).
// The prefix cache holds 512-token blocks of whole pages: only a dense model's pages are a token
// range of every layer, so it is on for dense models only (a hybrid's hit would also need the
// window's KV and the recurrent state at the hit, which the simulator does not keep).
//
// Transfer (KvTransferBytes; whole-model bytes before the route's share, kv(1) and st(1)): a
// prompt of L tokens moves
//   full-attention layers   every prompt token's KV: L x F x kv(1);
//   sliding-window layers   the KV of the last min(L, W) prompt tokens only (a decode step
//                           attends no further back): min(L, W) x S x kv(1);
//   recurrent layers        the state once, after the last prompt token: R x st(1).
// A chunk of prompt tokens [first, first + n) carries its tokens' full-layer KV, the sliding-layer
// KV of its tokens at positions >= L - W, and the state when it holds the last prompt token.
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <algorithm>
#include <cstdint>

#include "topology/model_shape.h"

namespace pdsim::des {

// True when every layer of `model` is full attention (its KV is one uniform group).
[[nodiscard]] inline bool all_full_attention(const topo::ModelShape& model) {
    return model.count_layers(topo::LayerKind::kFullAttention) == model.num_layers;
}

// What one request occupies in an instance's KV pool (rules above), in the pool's pages.
struct KvFootprint {
    int page_size = 16;             // tokens per page (>= 1)
    bool dense = true;              // every layer is full attention: a page spans every layer
    int page_layers = 1;            // layers one page holds: num_layers when dense, else 1
    double page_bytes = 0;          // bytes of one page on one rank
    int64_t full_layers = 0;        // hybrid: F (pages per ps tokens of the full group)
    int64_t sliding_layers = 0;     // hybrid: S
    int64_t sliding_max_pages = 0;  // hybrid: ceil((span - 1) / ps) + 1, per sliding layer
    int64_t state_pages = 0;        // hybrid: ceil(R x st(tp) / page_bytes), per request

    // Pages of a request that holds `tokens` tokens. Precondition: tokens >= 0 (0 pages for 0).
    [[nodiscard]] int64_t pages_for(int64_t tokens) const {
        const int64_t p = (tokens + page_size - 1) / page_size;
        if (dense || tokens <= 0) return p;
        return full_layers * p + sliding_layers * std::min(p, sliding_max_pages) + state_pages;
    }
};

// A dense footprint of `page_size` tokens per page (page_bytes unknown: 0).
[[nodiscard]] inline KvFootprint dense_kv_footprint(int page_size) {
    KvFootprint f;
    f.page_size = page_size;
    return f;
}

// The footprint of `model` on an instance of TP size `tp` whose KV elements take `kv_dtype_bytes`,
// with pages of `page_size` tokens and sliding layers that keep `sliding_span` tokens (rules
// above; ignored without sliding layers). Preconditions: tp, kv_dtype_bytes, page_size,
// sliding_span >= 1.
[[nodiscard]] inline KvFootprint kv_footprint(const topo::ModelShape& model, int tp,
                                              int kv_dtype_bytes, int page_size,
                                              int64_t sliding_span) {
    KvFootprint f;
    f.page_size = page_size;
    f.dense = all_full_attention(model);
    f.page_layers = f.dense ? model.num_layers : 1;
    // The expression kv_capacity_pages always used (dense: bit-identical capacities).
    f.page_bytes = static_cast<double>(page_size) *
                   static_cast<double>(model.kv_elems_per_token_per_layer(tp)) * f.page_layers *
                   kv_dtype_bytes;
    if (f.dense) return f;
    f.full_layers = model.count_layers(topo::LayerKind::kFullAttention);
    f.sliding_layers = model.count_layers(topo::LayerKind::kSlidingWindow);
    if (f.sliding_layers > 0)
        f.sliding_max_pages = (sliding_span - 1 + page_size - 1) / page_size + 1;
    const int64_t recurrent = model.count_layers(topo::LayerKind::kRecurrent);
    const int64_t page =
        int64_t{page_size} * model.kv_elems_per_token_per_layer(tp) * kv_dtype_bytes;
    const int64_t state = recurrent * model.state_elems_per_request_layer(tp) * 4;
    f.state_pages = (state + page - 1) / page;
    return f;
}

// A request's transfer bytes by group.
struct KvGroupBytes {
    double full = 0;
    double sliding = 0;
    double state = 0;
};

// What a disaggregated KV transfer moves (rules above), whole model, before the route's share.
struct KvTransferBytes {
    double full_per_token = 0;     // F x kv(1)
    double sliding_per_token = 0;  // S x kv(1)
    int64_t window = 0;            // W
    double state = 0;              // R x st(1), once per request

    // The bytes of prompt tokens [first, first + n) of a prompt of `prompt` tokens.
    // Precondition: 0 <= first, first + n <= prompt.
    [[nodiscard]] KvGroupBytes chunk(int64_t prompt, int64_t first, int64_t n) const {
        KvGroupBytes b;
        b.full = static_cast<double>(n) * full_per_token;
        const int64_t window_start = std::max<int64_t>(0, prompt - window);
        const int64_t in_window = std::max<int64_t>(0, first + n - std::max(first, window_start));
        b.sliding = static_cast<double>(in_window) * sliding_per_token;
        b.state = n > 0 && first + n == prompt ? state : 0.0;
        return b;
    }
    [[nodiscard]] KvGroupBytes request(int64_t prompt) const { return chunk(prompt, 0, prompt); }
};

// The transfer bytes of `model` with KV elements of `kv_dtype_bytes` (the prefill side's).
[[nodiscard]] inline KvTransferBytes kv_transfer_bytes(const topo::ModelShape& model,
                                                       int kv_dtype_bytes) {
    KvTransferBytes t;
    const double kv = static_cast<double>(model.kv_elems_per_token_per_layer(1));
    // Dense: the expression the simulator always used (bit-identical transfers).
    t.full_per_token = kv * model.count_layers(topo::LayerKind::kFullAttention) * kv_dtype_bytes;
    t.sliding_per_token = kv * model.count_layers(topo::LayerKind::kSlidingWindow) * kv_dtype_bytes;
    t.window = model.sliding_window;
    t.state = static_cast<double>(model.state_bytes_per_request());
    return t;
}

}  // namespace pdsim::des

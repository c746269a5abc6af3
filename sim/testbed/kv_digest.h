// The KV-level parity check of the testbed (beside the token comparison): a digest of everything a
// request's decode needs from its prefill -- the full layers' KV of its prompt tokens, the sliding
// layers' KV of the sent window (window.h) and every recurrent layer's state -- taken by the
// prefill side once its last chunk has run and by the decode side once its transfer completed
// (before any decode forward). The router compares the two per request; a difference fails the
// request ("KV digest differs").
//
// The digest is a sum (mod 2^64) of one hash per (layer, buffer, head, token) -- the head's bytes,
// seeded by all four -- so it splits over the heads: a TP group's ranks each digest their own
// heads, and the sum over the group's ranks is the same whatever the TP split, so a TP-2 prefill
// instance's digest equals a TP-1 decode instance's for the same bytes.
//
// Host layouts only (CPU ranks). Thread-safety: a pure function of the memory it reads, which
// nothing may write meanwhile (the caller's stream is synchronized and no transfer writes it).
#pragma once

#include <cstdint>
#include <span>

#include "transfer/engine/kv_layout.h"

namespace pdsim::testbed {

// The digest of `tokens` prompt tokens of `kv` (page table `pages`) and, when `states` is not
// null, of state slot `state_slot` of every layer of `states`. Preconditions: host layouts; the
// pages cover `tokens`; state_slot is a slot of `states`.
[[nodiscard]] uint64_t request_kv_digest(const transfer::KvLayout& kv,
                                         std::span<const int32_t> pages, int64_t tokens,
                                         const transfer::KvLayout* states, int32_t state_slot);

}  // namespace pdsim::testbed

// StatePool: the per-request states of a model's recurrent layers (topo::LayerKind::kRecurrent),
// one slot per request, as a KVPool whose "page" is a request's slot and whose page size is 1.
//
// Layout. Per recurrent layer r (0 .. num_layers - 1, the model's recurrent layers in order) two
// buffers, fp32 in host memory:
//   buffer 0, the recurrent state  [num_slots][1][num_heads][head_dim * head_dim]
//             (head h's matrix S[key channel][value channel], row-major)
//   buffer 1, the convolution state [num_slots][1][num_heads][(conv_kernel - 1) * 3 * head_dim]
//             (head h's last conv_kernel - 1 pre-convolution inputs, oldest first, each
//              [q channels | k channels | v channels])
// Being a KVPool with page_size 1 and heads outermost in a slot, a slot is addressed the way the
// transfer engine addresses a KV page (transfer/engine/kv_layout.h: page p of (layer, buf) at
// data(layer, buf) + p * page_bytes(layer, buf), head h at + h * head bytes), so a state moves
// between ranks of different TP sizes with the same head slicing as KV.
//
// Slots are handed out by the pool's PageAllocator (allocator()); slot 0 is the null slot that is
// never handed out. A slot's content is whatever its last user left: the model starts a request's
// state from zeros at its first prefill chunk (position 0), and a decode rank receives it.
//
// Ownership and thread-safety as KVPool (the allocator is synchronized; contents follow stream
// order).
#pragma once

#include <memory>

#include "backends/kv/kv_pool.h"
#include "common/status.h"

namespace pdsim::kv {

struct StatePoolConfig {
    int num_layers = 1;  // recurrent layers of the model
    int num_slots = 2;   // including the null slot 0
    int num_heads = 1;   // state heads on this rank (after TP)
    int head_dim = 64;
    int conv_kernel = 4;  // >= 2 (the convolution state keeps conv_kernel - 1 inputs)
};

class StatePool final : public KVPool {
public:
    // kInvalidArgument naming the field for a config out of range (num_layers, num_heads,
    // head_dim >= 1; num_slots >= 2; conv_kernel >= 2).
    [[nodiscard]] static StatusOr<std::unique_ptr<StatePool>> create(const StatePoolConfig& cfg);

    [[nodiscard]] int num_heads() const { return cfg_.num_heads; }
    [[nodiscard]] int head_dim() const { return cfg_.head_dim; }
    [[nodiscard]] int conv_kernel() const { return cfg_.conv_kernel; }
    // fp32 elements of one head's recurrent state / convolution state.
    [[nodiscard]] int64_t state_elems_per_head() const {
        return int64_t{cfg_.head_dim} * cfg_.head_dim;
    }
    [[nodiscard]] int64_t conv_elems_per_head() const {
        return int64_t{cfg_.conv_kernel - 1} * 3 * cfg_.head_dim;
    }
    // Head `head`'s recurrent state / convolution state in slot `slot` of recurrent layer `layer`.
    // No validation (callers checked layer, slot and head).
    [[nodiscard]] float* recurrent_state(int layer, int slot, int head) const {
        return static_cast<float*>(data(layer, 0)) +
               (int64_t{slot} * cfg_.num_heads + head) * state_elems_per_head();
    }
    [[nodiscard]] float* conv_state(int layer, int slot, int head) const {
        return static_cast<float*>(data(layer, 1)) +
               (int64_t{slot} * cfg_.num_heads + head) * conv_elems_per_head();
    }

private:
    explicit StatePool(const StatePoolConfig& cfg);
    StatePoolConfig cfg_;
};

}  // namespace pdsim::kv

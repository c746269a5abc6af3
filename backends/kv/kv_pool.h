// Paged KV-cache pools.
//
// MHATokenToKVPool: per layer a K and a V buffer laid out
// [num_pages][page_size][kv_heads][head_dim]. MLATokenToKVPool: per layer one buffer
// [num_pages][page_size][kv_lora_rank + rope_dim]. Both expose buffer_count(), data(layer, buf) and
// page_bytes(layer, buf), so the transfer engine addresses page p of a buffer as data(layer, buf) +
// p * page_bytes(layer, buf), and a token slot `loc` (= page * page_size + offset) as data + loc *
// token_bytes.
//
// Kernels. layer_view(layer) describes one layer's buffers as typed views (runtime::TensorView:
// base pointer, dtype, device, shape and element strides), so a device kernel addresses the pool
// without reaching into it: element e of head h of slot `loc` of K is at
// k.data + (loc / page_size) * k.stride(0) + (loc % page_size) * k.stride(1) + h * k.stride(2) + e.
//
// Dtype. A pool's element type is a runtime::DType (kv::KVDtype is the same type); pools support
// fp32 and bf16. The host write helpers take typed views (fp32 or bf16 sources, converted to the
// pool's dtype with round-to-nearest-even) and an int32 view of the slots.
//
// Pages are handed out by a PageAllocator; page 0 is never handed out (the null hole that padded
// tokens write to), so the usable capacity is num_pages - 1.
//
// Held layers. A pool numbers its layers as the model does (0 .. num_layers - 1) but may hold
// buffers for some of them only (MHAPoolConfig::layers): a hybrid model's cache groups each have
// their own pool and page allocator (the full-attention layers' pool, the sliding-window layers'
// pool), so a layer id means the same layer in every pool. A layer the pool does not hold has no
// memory: data() is null for it, and buffer_view / layer_view / the write helpers refuse it
// (kInvalidArgument naming the layer).
//
// Ownership: a pool owns its buffers (on the configured device); views from layer_view() borrow
// them and are valid while the pool lives. Thread-safety: the allocator is internally
// synchronized; buffer contents follow stream order (writers are kernels on the compute stream).
// The host-side write/read helpers touch CPU memory directly and are meant to run inside stream
// tasks (or after a synchronize); on a pool in device memory they fail with kFailedPrecondition
// (a device backend writes its KV with a kernel).
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "backends/runtime/device.h"
#include "backends/runtime/tensor.h"
#include "common/status.h"

namespace pdsim::kv {

// The pool's element type: a runtime::DType, of which pools support kF32 and kBF16.
using KVDtype = runtime::DType;

using runtime::dtype_name;  // "fp32", "bf16", ...
using runtime::dtype_size;  // bytes per element
// "fp32" | "float32" | "bf16" | "bfloat16"; anything else (including dtypes that are valid
// runtime::DTypes but not pool dtypes, e.g. "fp16") is kInvalidArgument.
[[nodiscard]] StatusOr<KVDtype> parse_dtype(std::string_view text);
// True for the dtypes a pool can hold (kF32, kBF16).
[[nodiscard]] bool is_pool_dtype(runtime::DType dtype);

// One layer of a pool as a kernel addresses it (see the file comment). Borrowed views.
struct KVLayerView {
    int layer = 0;
    runtime::DType dtype = runtime::DType::kF32;
    runtime::Device device{};
    int num_pages = 0;
    int page_size = 0;
    // MHA: K [num_pages][page_size][num_kv_heads][head_dim].
    // MLA: the latent buffer [num_pages][page_size][1][kv_lora_rank + rope_dim].
    runtime::TensorView k;
    // MHA: V [num_pages][page_size][num_kv_heads][v_head_dim]. MLA: a null view.
    runtime::TensorView v;
};

// Hands out page ids in [1, num_pages). Thread-safe.
class PageAllocator {
public:
    explicit PageAllocator(int num_pages);

    // n pages, or kResourceExhausted (nothing is allocated then). Lowest ids first, so a fresh
    // allocator hands out contiguous runs.
    [[nodiscard]] StatusOr<std::vector<int32_t>> alloc(int n);
    // Returns pages to the pool. Freeing page 0, an out-of-range page or a page that is not
    // allocated is kInvalidArgument and frees nothing.
    [[nodiscard]] Status free(std::span<const int32_t> pages);

    [[nodiscard]] int available() const;
    [[nodiscard]] int capacity() const { return num_pages_ - 1; }
    [[nodiscard]] bool is_allocated(int32_t page) const;

private:
    const int num_pages_;
    mutable std::mutex mu_;
    std::vector<int32_t> free_;    // stack; the lowest id on top
    std::vector<uint8_t> in_use_;  // by page id
};

class KVPool {
public:
    virtual ~KVPool() = default;
    KVPool(const KVPool&) = delete;
    KVPool& operator=(const KVPool&) = delete;

    [[nodiscard]] int num_layers() const { return num_layers_; }
    // Whether the pool has buffers for `layer` (every layer unless built with a layer list).
    [[nodiscard]] bool holds_layer(int layer) const {
        return layer >= 0 && layer < num_layers_ && held_[static_cast<size_t>(layer)] != 0;
    }
    // The layers it holds, in order.
    [[nodiscard]] std::vector<int> held_layers() const;
    [[nodiscard]] int num_pages() const { return num_pages_; }
    [[nodiscard]] int page_size() const { return page_size_; }
    [[nodiscard]] KVDtype dtype() const { return dtype_; }
    [[nodiscard]] runtime::Device device() const { return device_; }
    [[nodiscard]] int buffer_count() const { return buffer_count_; }

    // Base address of buffer `buf` (0 = K or the MLA buffer, 1 = V) of `layer`; null for a layer
    // the pool does not hold.
    [[nodiscard]] void* data(int layer, int buf) const;
    // Buffer `buf` of `layer` as a view [num_pages][page_size][heads][dim] (MLA: heads 1), or
    // kInvalidArgument naming `layer` / `buf` when out of range.
    [[nodiscard]] StatusOr<runtime::TensorView> buffer_view(int layer, int buf) const;
    // Both buffers of `layer` (see KVLayerView), or kInvalidArgument naming `layer`.
    [[nodiscard]] StatusOr<KVLayerView> layer_view(int layer) const;
    // Elements (of dtype()) one token occupies in buffer `buf`.
    [[nodiscard]] int token_elems(int buf) const { return token_elems_[buf]; }
    [[nodiscard]] size_t token_bytes(int layer, int buf) const;
    [[nodiscard]] size_t page_bytes(int layer, int buf) const;
    // Bytes of every buffer the pool holds.
    [[nodiscard]] size_t total_bytes() const;

    [[nodiscard]] PageAllocator& allocator() { return allocator_; }
    [[nodiscard]] const PageAllocator& allocator() const { return allocator_; }

    // Host helpers for CPU pools: write/read one token slot of buffer `buf` as float (converted
    // to/from dtype()). `loc` must be in [0, num_pages * page_size). No validation (callers have
    // checked layer, buf, loc and that the pool is in host memory).
    void write_token(int layer, int buf, int64_t loc, const float* src);
    void read_token(int layer, int buf, int64_t loc, float* dst) const;
    // Fills every buffer with `byte` (poisoning in tests).
    [[nodiscard]] Status fill(int byte);
    // kInvalidArgument unless 0 <= loc < num_pages * page_size.
    [[nodiscard]] Status check_loc(int64_t loc) const;

protected:
    // Per buffer: heads x dim elements per token.
    struct BufferShape {
        int heads = 1;
        int dim = 0;
    };
    // `held`: the layers it holds (empty: all); checked by check_held_layers before construction.
    KVPool(int num_layers, int num_pages, int page_size, KVDtype dtype, runtime::Device device,
           std::vector<BufferShape> buffers, const std::vector<int>& held = {});
    // kInvalidArgument naming the entry for a layer outside [0, num_layers) or listed twice.
    [[nodiscard]] static Status check_held_layers(int num_layers, const std::vector<int>& held);
    // kInvalidArgument naming `layer` when it is out of range or not held.
    [[nodiscard]] Status check_layer(int layer) const;
    [[nodiscard]] Status allocate_buffers();
    // The checks every host write helper makes before writing anything: the pool is in host
    // memory (else kFailedPrecondition naming `op`), `layer` in range, `locs` an int32 host view
    // [n] of valid slots (kInvalidArgument naming the argument). Returns n.
    [[nodiscard]] StatusOr<int64_t> check_host_write(std::string_view op, int layer,
                                                     const runtime::ConstTensorView& locs) const;
    // Writes row i of `src` (n rows of token_elems(buf) elements, fp32 or bf16, contiguous,
    // checked) to slot locs[i], for every i (bf16 into a bf16 pool: bits copied; else converted).
    void write_rows(int layer, int buf, const runtime::ConstTensorView& locs,
                    const runtime::ConstTensorView& src);

private:
    const int num_layers_;
    const int num_pages_;
    const int page_size_;
    const KVDtype dtype_;
    const runtime::Device device_;
    const int buffer_count_;
    const std::vector<BufferShape> shapes_;
    const std::vector<int> token_elems_;
    std::vector<uint8_t> held_;                   // by layer
    std::vector<runtime::DeviceBuffer> buffers_;  // [layer * buffer_count + buf]; empty: not held
    PageAllocator allocator_;
};

struct MHAPoolConfig {
    int num_layers = 1;
    int num_pages = 2;  // including the null page 0
    int page_size = 16;
    int num_kv_heads = 1;
    int head_dim = 64;
    int v_head_dim = 0;             // 0: same as head_dim
    KVDtype dtype = KVDtype::kF32;  // kF32 or kBF16
    runtime::Device device{};
    // The layers it holds buffers for (see "Held layers" above); empty: every layer.
    std::vector<int> layers;
};

class MHATokenToKVPool final : public KVPool {
public:
    [[nodiscard]] static StatusOr<std::unique_ptr<MHATokenToKVPool>> create(
        const MHAPoolConfig& cfg);

    [[nodiscard]] int num_kv_heads() const { return cfg_.num_kv_heads; }
    [[nodiscard]] int head_dim() const { return cfg_.head_dim; }
    [[nodiscard]] int v_head_dim() const { return cfg_.v_head_dim; }
    [[nodiscard]] void* k_data(int layer) const { return data(layer, 0); }
    [[nodiscard]] void* v_data(int layer) const { return data(layer, 1); }

    // Writes n tokens' K and V into slots locs[0..n) of `layer`, converting to dtype():
    //   locs  int32 [n]
    //   k     fp32 or bf16 [n][num_kv_heads][head_dim], contiguous
    //   v     fp32 or bf16 [n][num_kv_heads][v_head_dim], contiguous
    // all in host memory. A pool in device memory is kFailedPrecondition; a bad layer, slot or
    // view is kInvalidArgument naming it. Nothing is written unless every check passes.
    [[nodiscard]] Status set_kv_buffer(int layer, const runtime::ConstTensorView& locs,
                                       const runtime::ConstTensorView& k,
                                       const runtime::ConstTensorView& v);

private:
    explicit MHATokenToKVPool(const MHAPoolConfig& cfg);
    MHAPoolConfig cfg_;
};

struct MLAPoolConfig {
    int num_layers = 1;
    int num_pages = 2;
    int page_size = 64;
    int kv_lora_rank = 512;
    int rope_dim = 64;
    KVDtype dtype = KVDtype::kBF16;  // kF32 or kBF16
    runtime::Device device{};
};

class MLATokenToKVPool final : public KVPool {
public:
    [[nodiscard]] static StatusOr<std::unique_ptr<MLATokenToKVPool>> create(
        const MLAPoolConfig& cfg);

    [[nodiscard]] int kv_lora_rank() const { return cfg_.kv_lora_rank; }
    [[nodiscard]] int rope_dim() const { return cfg_.rope_dim; }

    // Writes n tokens' latent KV into slots locs[0..n) of `layer`, converting to dtype():
    //   locs  int32 [n];   kv  fp32 or bf16 [n][kv_lora_rank + rope_dim], contiguous;
    // in host memory. Errors as set_kv_buffer's.
    [[nodiscard]] Status set_mla_kv_buffer(int layer, const runtime::ConstTensorView& locs,
                                           const runtime::ConstTensorView& kv);

private:
    explicit MLATokenToKVPool(const MLAPoolConfig& cfg);
    MLAPoolConfig cfg_;
};

}  // namespace pdsim::kv

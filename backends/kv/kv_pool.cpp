#include "backends/kv/kv_pool.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

#include "common/bf16.h"
#include "common/check.h"

namespace pdsim::kv {

bool is_pool_dtype(runtime::DType dtype) {
    return dtype == KVDtype::kF32 || dtype == KVDtype::kBF16;
}

StatusOr<KVDtype> parse_dtype(std::string_view text) {
    if (text == "fp32" || text == "float32") return KVDtype::kF32;
    if (text == "bf16" || text == "bfloat16") return KVDtype::kBF16;
    return PDSIM_ERROR(StatusCode::kInvalidArgument,
                       "unknown KV dtype '{}' (expected fp32 or bf16)", text);
}

// ---------------------------------------------------------------------------------------------
PageAllocator::PageAllocator(int num_pages) : num_pages_(num_pages) {
    PDSIM_CHECK(num_pages >= 1);
    in_use_.assign(static_cast<size_t>(num_pages), 0);
    in_use_[0] = 1;  // the null page is never free
    for (int p = num_pages - 1; p >= 1; --p) free_.push_back(p);
}

StatusOr<std::vector<int32_t>> PageAllocator::alloc(int n) {
    if (n < 0) return PDSIM_ERROR(StatusCode::kInvalidArgument, "alloc of {} pages", n);
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<size_t>(n) > free_.size()) {
        return PDSIM_ERROR(StatusCode::kResourceExhausted, "need {} pages, {} of {} free", n,
                           free_.size(), num_pages_ - 1);
    }
    std::vector<int32_t> out(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
        out[static_cast<size_t>(i)] = free_.back();
        free_.pop_back();
        in_use_[static_cast<size_t>(out[static_cast<size_t>(i)])] = 1;
    }
    return out;
}

Status PageAllocator::free(std::span<const int32_t> pages) {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < pages.size(); ++i) {
        int32_t p = pages[i];
        if (p <= 0 || p >= num_pages_) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "free of page {} (valid: 1..{})", p,
                               num_pages_ - 1);
        }
        if (!in_use_[static_cast<size_t>(p)]) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "double free of page {}", p);
        }
        for (size_t j = 0; j < i; ++j) {
            if (pages[j] == p)
                return PDSIM_ERROR(StatusCode::kInvalidArgument, "page {} freed twice in one call",
                                   p);
        }
    }
    for (int32_t p : pages) {
        in_use_[static_cast<size_t>(p)] = 0;
        free_.push_back(p);
    }
    // Keep the lowest ids on top so that later allocations stay contiguous where possible.
    std::sort(free_.begin(), free_.end(), std::greater<>());
    return {};
}

int PageAllocator::available() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(free_.size());
}

bool PageAllocator::is_allocated(int32_t page) const {
    std::lock_guard<std::mutex> lock(mu_);
    return page > 0 && page < num_pages_ && in_use_[static_cast<size_t>(page)] != 0;
}

// ---------------------------------------------------------------------------------------------
KVPool::KVPool(int num_layers, int num_pages, int page_size, KVDtype dtype, runtime::Device device,
               std::vector<BufferShape> buffers, const std::vector<int>& held)
    : num_layers_(num_layers),
      num_pages_(num_pages),
      page_size_(page_size),
      dtype_(dtype),
      device_(device),
      buffer_count_(static_cast<int>(buffers.size())),
      shapes_(std::move(buffers)),
      token_elems_([this] {
          std::vector<int> elems;
          for (const BufferShape& b : shapes_) elems.push_back(b.heads * b.dim);
          return elems;
      }()),
      held_(static_cast<size_t>(std::max(num_layers, 0)), held.empty() ? 1 : 0),
      allocator_(std::max(num_pages, 1)) {
    for (int l : held) held_[static_cast<size_t>(l)] = 1;
}

Status KVPool::check_held_layers(int num_layers, const std::vector<int>& held) {
    std::vector<uint8_t> seen(static_cast<size_t>(std::max(num_layers, 0)), 0);
    for (size_t i = 0; i < held.size(); ++i) {
        const int l = held[i];
        if (l < 0 || l >= num_layers) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "layers[{}]: layer {} out of [0, {})",
                               i, l, num_layers);
        }
        if (seen[static_cast<size_t>(l)]++ != 0) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "layers[{}]: layer {} listed twice", i,
                               l);
        }
    }
    return {};
}

std::vector<int> KVPool::held_layers() const {
    std::vector<int> out;
    for (int l = 0; l < num_layers_; ++l) {
        if (holds_layer(l)) out.push_back(l);
    }
    return out;
}

Status KVPool::check_layer(int layer) const {
    if (layer < 0 || layer >= num_layers_) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "layer {} out of range [0, {})", layer,
                           num_layers_);
    }
    if (!holds_layer(layer)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "layer {} is not held by this pool (it holds layers {})", layer,
                           fmt::join(held_layers(), ","));
    }
    return {};
}

Status KVPool::allocate_buffers() {
    buffers_.clear();
    for (int l = 0; l < num_layers_; ++l) {
        for (int b = 0; b < buffer_count_; ++b) {
            if (!holds_layer(l)) {
                buffers_.emplace_back();
                continue;
            }
            size_t bytes = page_bytes(l, b) * static_cast<size_t>(num_pages_);
            PDSIM_ASSIGN_OR_RETURN(auto buf, runtime::DeviceBuffer::allocate(device_, bytes));
            buffers_.push_back(std::move(buf));
        }
    }
    return {};
}

void* KVPool::data(int layer, int buf) const {
    PDSIM_CHECK(layer >= 0 && layer < num_layers_ && buf >= 0 && buf < buffer_count_);
    return buffers_[static_cast<size_t>(layer * buffer_count_ + buf)].data();
}

StatusOr<runtime::TensorView> KVPool::buffer_view(int layer, int buf) const {
    PDSIM_RETURN_IF_ERROR(check_layer(layer));
    if (buf < 0 || buf >= buffer_count_) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "buf {} out of range [0, {})", buf,
                           buffer_count_);
    }
    const BufferShape& bs = shapes_[static_cast<size_t>(buf)];
    return runtime::make_view(data(layer, buf), dtype_, device_,
                              {num_pages_, page_size_, bs.heads, bs.dim});
}

StatusOr<KVLayerView> KVPool::layer_view(int layer) const {
    KVLayerView v;
    v.layer = layer;
    v.dtype = dtype_;
    v.device = device_;
    v.num_pages = num_pages_;
    v.page_size = page_size_;
    PDSIM_ASSIGN_OR_RETURN(v.k, buffer_view(layer, 0));
    if (buffer_count_ > 1) {
        PDSIM_ASSIGN_OR_RETURN(v.v, buffer_view(layer, 1));
    }
    return v;
}

size_t KVPool::token_bytes(int /*layer*/, int buf) const {
    return static_cast<size_t>(token_elems_[static_cast<size_t>(buf)]) * dtype_size(dtype_);
}

size_t KVPool::page_bytes(int layer, int buf) const {
    return token_bytes(layer, buf) * static_cast<size_t>(page_size_);
}

size_t KVPool::total_bytes() const {
    size_t total = 0;
    for (const auto& b : buffers_) total += b.size();
    return total;
}

Status KVPool::check_loc(int64_t loc) const {
    int64_t slots = static_cast<int64_t>(num_pages_) * page_size_;
    if (loc < 0 || loc >= slots) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "KV slot {} out of range [0, {})", loc,
                           slots);
    }
    return {};
}

StatusOr<int64_t> KVPool::check_host_write(std::string_view op, int layer,
                                           const runtime::ConstTensorView& locs) const {
    if (device_.kind != runtime::DeviceKind::kCpu) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition, "{} on a {} pool from the host", op,
                           runtime::device_kind_name(device_.kind));
    }
    PDSIM_RETURN_IF_ERROR(check_layer(layer));
    PDSIM_RETURN_IF_ERROR(runtime::check_view(
        locs, "locs", {.dtypes = {runtime::DType::kI32}, .shape = {-1}, .allow_null = true}));
    if (locs.empty()) {
        if (locs.rank == 1 && locs.size(0) == 0) return int64_t{0};
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "locs: null data pointer");
    }
    const int32_t* l = locs.as<int32_t>();
    for (int64_t i = 0; i < locs.size(0); ++i) {
        Status st = check_loc(l[i]);
        if (!st.ok()) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "locs[{}]: KV slot {} out of range [0, {})", i, l[i],
                               static_cast<int64_t>(num_pages_) * page_size_);
        }
    }
    return locs.size(0);
}

void KVPool::write_rows(int layer, int buf, const runtime::ConstTensorView& locs,
                        const runtime::ConstTensorView& src) {
    const int64_t n = locs.size(0);
    if (n == 0) return;
    const int32_t* l = locs.as<int32_t>();
    const size_t elems = static_cast<size_t>(token_elems_[static_cast<size_t>(buf)]);
    const size_t tb = token_bytes(layer, buf);
    char* base = static_cast<char*>(data(layer, buf));
    if (src.dtype == dtype_) {  // same type: bits copied (fp32 -> fp32, bf16 -> bf16)
        const char* from = static_cast<const char*>(src.data);
        for (int64_t i = 0; i < n; ++i) {
            std::memcpy(base + static_cast<size_t>(l[i]) * tb, from + static_cast<size_t>(i) * tb,
                        tb);
        }
    } else if (src.dtype == KVDtype::kF32) {  // fp32 -> bf16 pool
        const float* from = src.as<float>();
        for (int64_t i = 0; i < n; ++i)
            write_token(layer, buf, l[i], from + static_cast<size_t>(i) * elems);
    } else {  // bf16 -> fp32 pool
        const bf16_t* from = src.as<bf16_t>();
        for (int64_t i = 0; i < n; ++i) {
            auto* dst = reinterpret_cast<float*>(base + static_cast<size_t>(l[i]) * tb);
            const bf16_t* row = from + static_cast<size_t>(i) * elems;
            for (size_t e = 0; e < elems; ++e) dst[e] = bf16_to_float(row[e]);
        }
    }
}

void KVPool::write_token(int layer, int buf, int64_t loc, const float* src) {
    const int n = token_elems_[static_cast<size_t>(buf)];
    char* base =
        static_cast<char*>(data(layer, buf)) + static_cast<size_t>(loc) * token_bytes(layer, buf);
    if (dtype_ == KVDtype::kF32) {
        std::memcpy(base, src, static_cast<size_t>(n) * sizeof(float));
    } else {
        auto* dst = reinterpret_cast<bf16_t*>(base);
        for (int i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
    }
}

void KVPool::read_token(int layer, int buf, int64_t loc, float* dst) const {
    const int n = token_elems_[static_cast<size_t>(buf)];
    const char* base = static_cast<const char*>(data(layer, buf)) +
                       static_cast<size_t>(loc) * token_bytes(layer, buf);
    if (dtype_ == KVDtype::kF32) {
        std::memcpy(dst, base, static_cast<size_t>(n) * sizeof(float));
    } else {
        const auto* src = reinterpret_cast<const bf16_t*>(base);
        for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
    }
}

Status KVPool::fill(int byte) {
    for (auto& b : buffers_) PDSIM_RETURN_IF_ERROR(b.fill(byte));
    return {};
}

// ---------------------------------------------------------------------------------------------
namespace {
Status validate_common(int num_layers, int num_pages, int page_size, KVDtype dtype) {
    if (!is_pool_dtype(dtype)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "dtype {} is not a KV pool dtype (expected fp32 or bf16)",
                           runtime::dtype_name(dtype));
    }
    if (num_layers < 1)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "num_layers {} < 1", num_layers);
    if (num_pages < 2) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "num_pages {} < 2 (page 0 is the null page)", num_pages);
    }
    if (page_size < 1)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "page_size {} < 1", page_size);
    return {};
}
}  // namespace

MHATokenToKVPool::MHATokenToKVPool(const MHAPoolConfig& cfg)
    : KVPool(cfg.num_layers, cfg.num_pages, cfg.page_size, cfg.dtype, cfg.device,
             {{cfg.num_kv_heads, cfg.head_dim}, {cfg.num_kv_heads, cfg.v_head_dim}}, cfg.layers),
      cfg_(cfg) {}

StatusOr<std::unique_ptr<MHATokenToKVPool>> MHATokenToKVPool::create(const MHAPoolConfig& in) {
    MHAPoolConfig cfg = in;
    if (cfg.v_head_dim == 0) cfg.v_head_dim = cfg.head_dim;
    PDSIM_RETURN_IF_ERROR(validate_common(cfg.num_layers, cfg.num_pages, cfg.page_size, cfg.dtype));
    PDSIM_RETURN_IF_ERROR(check_held_layers(cfg.num_layers, cfg.layers));
    if (cfg.num_kv_heads < 1 || cfg.head_dim < 1 || cfg.v_head_dim < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "num_kv_heads {} / head_dim {} / v_head_dim {} must be >= 1",
                           cfg.num_kv_heads, cfg.head_dim, cfg.v_head_dim);
    }
    std::unique_ptr<MHATokenToKVPool> pool(new MHATokenToKVPool(cfg));
    PDSIM_RETURN_IF_ERROR(pool->allocate_buffers());
    return pool;
}

Status MHATokenToKVPool::set_kv_buffer(int layer, const runtime::ConstTensorView& locs,
                                       const runtime::ConstTensorView& k,
                                       const runtime::ConstTensorView& v) {
    PDSIM_ASSIGN_OR_RETURN(const int64_t n, check_host_write("set_kv_buffer", layer, locs));
    const bool none = n == 0;  // zero tokens: k and v may be null
    PDSIM_RETURN_IF_ERROR(runtime::check_view(k, "k",
                                              {.dtypes = {KVDtype::kF32, KVDtype::kBF16},
                                               .shape = {n, cfg_.num_kv_heads, cfg_.head_dim},
                                               .allow_null = none}));
    PDSIM_RETURN_IF_ERROR(runtime::check_view(v, "v",
                                              {.dtypes = {KVDtype::kF32, KVDtype::kBF16},
                                               .shape = {n, cfg_.num_kv_heads, cfg_.v_head_dim},
                                               .allow_null = none}));
    write_rows(layer, 0, locs, k);
    write_rows(layer, 1, locs, v);
    return {};
}

MLATokenToKVPool::MLATokenToKVPool(const MLAPoolConfig& cfg)
    : KVPool(cfg.num_layers, cfg.num_pages, cfg.page_size, cfg.dtype, cfg.device,
             {{1, cfg.kv_lora_rank + cfg.rope_dim}}),
      cfg_(cfg) {}

StatusOr<std::unique_ptr<MLATokenToKVPool>> MLATokenToKVPool::create(const MLAPoolConfig& cfg) {
    PDSIM_RETURN_IF_ERROR(validate_common(cfg.num_layers, cfg.num_pages, cfg.page_size, cfg.dtype));
    if (cfg.kv_lora_rank < 1 || cfg.rope_dim < 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "kv_lora_rank {} / rope_dim {} invalid",
                           cfg.kv_lora_rank, cfg.rope_dim);
    }
    std::unique_ptr<MLATokenToKVPool> pool(new MLATokenToKVPool(cfg));
    PDSIM_RETURN_IF_ERROR(pool->allocate_buffers());
    return pool;
}

Status MLATokenToKVPool::set_mla_kv_buffer(int layer, const runtime::ConstTensorView& locs,
                                           const runtime::ConstTensorView& kv) {
    PDSIM_ASSIGN_OR_RETURN(const int64_t n, check_host_write("set_mla_kv_buffer", layer, locs));
    PDSIM_RETURN_IF_ERROR(runtime::check_view(kv, "kv",
                                              {.dtypes = {KVDtype::kF32, KVDtype::kBF16},
                                               .shape = {n, cfg_.kv_lora_rank + cfg_.rope_dim},
                                               .allow_null = n == 0}));
    write_rows(layer, 0, locs, kv);
    return {};
}

}  // namespace pdsim::kv

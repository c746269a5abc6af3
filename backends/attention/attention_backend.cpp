#include "backends/attention/attention_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <mutex>

namespace pdsim::attn {

std::string_view forward_mode_name(ForwardMode m) {
    switch (m) {
        case ForwardMode::kExtend:
            return "extend";
        case ForwardMode::kDecode:
            return "decode";
        case ForwardMode::kMixed:
            return "mixed";
        case ForwardMode::kIdle:
            return "idle";
        case ForwardMode::kTargetVerify:
            return "target_verify";
        case ForwardMode::kDraftExtend:
            return "draft_extend";
    }
    return "unknown";
}

StatusOr<ForwardMode> parse_forward_mode(std::string_view text) {
    for (ForwardMode m :
         {ForwardMode::kExtend, ForwardMode::kDecode, ForwardMode::kMixed, ForwardMode::kIdle,
          ForwardMode::kTargetVerify, ForwardMode::kDraftExtend}) {
        if (forward_mode_name(m) == text) return m;
    }
    return PDSIM_ERROR(
        StatusCode::kInvalidArgument,
        "unknown forward mode '{}' (extend|decode|mixed|idle|target_verify|draft_extend)", text);
}

float layer_scaling(const LayerSpec& l) {
    return l.scaling > 0.f ? l.scaling : 1.0f / std::sqrt(static_cast<float>(l.head_dim));
}

// ---- MetadataBuffers ------------------------------------------------------------------------
MetadataBuffers::MetadataBuffers(int max_bs, int max_pages_per_seq)
    : max_bs_(max_bs), max_pages_(max_pages_per_seq) {
    seq_lens_.assign(static_cast<size_t>(max_bs), 0);
    q_lens_.assign(static_cast<size_t>(max_bs), 0);
    q_start_.assign(static_cast<size_t>(max_bs) + 1, 0);
    page_table_.assign(static_cast<size_t>(max_bs) * static_cast<size_t>(max_pages_per_seq), 0);
}

void MetadataBuffers::assign(ForwardMode mode, int bs, const int32_t* seq_lens,
                             const int32_t* q_lens, const int32_t* page_table, int stride) {
    const bool fixed = max_bs_ > 0;  // graph buffers: addresses must not change
    const size_t ubs = static_cast<size_t>(bs);
    if (!fixed) {
        seq_lens_.resize(ubs);
        q_lens_.resize(ubs);
        q_start_.resize(ubs + 1);
        page_table_.resize(ubs * static_cast<size_t>(stride));
        stride_ = stride;
    } else {
        stride_ = max_pages_;
    }
    mode_ = mode;
    bs_ = bs;
    q_start_[0] = 0;
    for (size_t i = 0; i < ubs; ++i) {
        if (seq_lens != nullptr) seq_lens_[i] = seq_lens[i];
        q_lens_[i] = q_lens != nullptr ? q_lens[i] : 1;
        q_start_[i + 1] = q_start_[i] + q_lens_[i];
        for (int p = 0; p < stride_; ++p) {
            page_table_[i * static_cast<size_t>(stride_) + static_cast<size_t>(p)] =
                p < stride ? page_table[i * static_cast<size_t>(stride) + static_cast<size_t>(p)]
                           : 0;
        }
    }
}

BatchView MetadataBuffers::view() const {
    return BatchView{mode_,
                     bs_,
                     q_start_.empty() ? 0 : q_start_[static_cast<size_t>(bs_)],
                     seq_lens_ext_ != nullptr ? seq_lens_ext_ : seq_lens_.data(),
                     q_lens_.data(),
                     q_start_.data(),
                     page_table_.data(),
                     stride_,
                     max_bs_ > 0};
}

// ---- AttentionBackend -----------------------------------------------------------------------
AttentionBackend::AttentionBackend(const AttentionConfig& config) : config_(config) {
    if (config_.v_head_dim == 0) config_.v_head_dim = config_.head_dim;
}

bool AttentionBackend::support_kv_cache_prewrite(std::optional<ForwardMode> /*mode*/) const {
    return false;
}

runtime::ConstTensorView AttentionBackend::select_out_cache_loc(
    const LayerSpec& /*layer*/, const runtime::ConstTensorView& out_cache_loc,
    std::optional<ForwardMode> /*mode*/) const {
    return out_cache_loc;
}

Status AttentionBackend::configure_runtime(const std::map<std::string, std::string>& /*options*/) {
    return {};
}

Status validate_forward_batch(const ForwardBatch& b, int max_bs, int max_pages) {
    if (b.bs < 0) return PDSIM_ERROR(StatusCode::kInvalidArgument, "batch: bs {} < 0", b.bs);
    if (max_bs > 0 && b.bs > max_bs) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "batch: bs {} > graph max_bs {}", b.bs,
                           max_bs);
    }
    if (is_idle(b.mode) && b.bs != 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "batch: idle mode with bs {}", b.bs);
    }
    if (b.seq_lens.size() < static_cast<size_t>(b.bs)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "batch: seq_lens has {} entries, bs {}",
                           b.seq_lens.size(), b.bs);
    }
    if (!b.extend_lens.empty() && b.extend_lens.size() < static_cast<size_t>(b.bs)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "batch: extend_lens has {} entries, bs {}",
                           b.extend_lens.size(), b.bs);
    }
    if (b.bs > 0 && b.page_table_stride < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "batch: page_table_stride {} < 1",
                           b.page_table_stride);
    }
    if (max_pages > 0 && b.page_table_stride > max_pages) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "batch: page_table_stride {} > graph max_pages_per_seq {}",
                           b.page_table_stride, max_pages);
    }
    if (b.page_table.size() <
        static_cast<size_t>(b.bs) * static_cast<size_t>(std::max(b.page_table_stride, 0))) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "batch: page_table has {} entries, need {} x {}", b.page_table.size(),
                           b.bs, b.page_table_stride);
    }
    for (int i = 0; i < b.bs; ++i) {
        const int32_t s = b.seq_lens[static_cast<size_t>(i)];
        const int32_t q = b.extend_lens.empty() ? 1 : b.extend_lens[static_cast<size_t>(i)];
        if (is_decode(b.mode) && q != 1) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "batch: decode request {} has extend_len {}", i, q);
        }
        if (q < 1 || s < q) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "batch: request {} has extend_len {} and seq_len {} (need 1 <= "
                               "extend_len <= seq_len)",
                               i, q, s);
        }
    }
    return ok_status();
}

Status AttentionBackend::enqueue_assign(MetadataBuffers* dst, const ForwardBatch& b,
                                        bool keep_aliased_seq_lens) {
    // Stage by value: the caller's arrays may change as soon as we return.
    struct Staged {
        ForwardMode mode;
        int bs;
        int stride;
        std::vector<int32_t> seq_lens, q_lens, page_table;
    };
    auto staged = std::make_shared<Staged>();
    staged->mode = b.mode;
    staged->bs = b.bs;
    staged->stride = b.page_table_stride;
    staged->seq_lens.assign(b.seq_lens.begin(), b.seq_lens.begin() + b.bs);
    if (b.extend_lens.empty()) {
        staged->q_lens.assign(static_cast<size_t>(b.bs), 1);
    } else {
        staged->q_lens.assign(b.extend_lens.begin(), b.extend_lens.begin() + b.bs);
    }
    staged->page_table.assign(
        b.page_table.begin(),
        b.page_table.begin() + static_cast<ptrdiff_t>(b.bs) * b.page_table_stride);
    return stream().enqueue([dst, staged, keep_aliased_seq_lens] {
        dst->assign(staged->mode, staged->bs,
                    keep_aliased_seq_lens ? nullptr : staged->seq_lens.data(),
                    staged->q_lens.data(), staged->page_table.data(), staged->stride);
        return Status();
    });
}

Status AttentionBackend::init_forward_metadata(const ForwardBatch& batch) {
    if (config_.stream == nullptr)
        return PDSIM_ERROR(StatusCode::kFailedPrecondition, "{}: no compute stream", name());
    PDSIM_RETURN_IF_ERROR(validate_forward_batch(batch, 0, 0));
    const bool window = !batch.window_page_table.empty();
    ForwardBatch window_batch = batch;
    if (window && !capabilities().flat_cache_groups) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "window_page_table: backend '{}' does not declare flat cache groups "
                           "(a page table per group)",
                           name());
    }
    if (window) {
        window_batch.page_table = batch.window_page_table;
        window_batch.page_table_stride = batch.window_page_table_stride;
        window_batch.window_page_table = {};
        Status st = validate_forward_batch(window_batch, 0, 0);
        if (!st.ok()) return st.with_context("window_page_table");
    }
    active_ = &eager_;
    PDSIM_RETURN_IF_ERROR(enqueue_assign(&eager_, batch, false));
    window_meta_ = window;
    if (window) PDSIM_RETURN_IF_ERROR(enqueue_assign(&eager_window_, window_batch, false));
    int64_t tokens = 0;
    for (int i = 0; i < batch.bs; ++i) {
        tokens += batch.extend_lens.empty() ? 1 : batch.extend_lens[static_cast<size_t>(i)];
    }
    eager_num_tokens_ = tokens;
    return {};
}

std::set<std::string> AttentionBackend::accepted_graph_state_extras() const {
    return {"max_pages_per_seq"};
}

Status AttentionBackend::init_cuda_graph_state(int max_bs, const int32_t* seq_lens_buf,
                                               const GraphStateExtras& extras) {
    if (max_bs < 1)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "init_cuda_graph_state: max_bs {} < 1",
                           max_bs);
    if (seq_lens_buf == nullptr) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "init_cuda_graph_state: seq_lens_buf is null");
    }
    const int max_pages = extras.max_pages_per_seq.value_or(1024);
    if (max_pages < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "init_cuda_graph_state: max_pages_per_seq {} < 1", max_pages);
    }
    PDSIM_RETURN_IF_ERROR(stream().synchronize());  // no work may still read old graph buffers
    graph_ = std::make_unique<MetadataBuffers>(max_bs, max_pages);
    graph_->alias_seq_lens(seq_lens_buf);
    return {};
}

Status AttentionBackend::init_forward_metadata_capture_cuda_graph(int bs, ForwardMode mode) {
    if (!graph_)
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "{}: capture before init_cuda_graph_state", name());
    if (bs < 0 || bs > graph_->max_bs()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "capture bs {} outside [0, {}]", bs,
                           graph_->max_bs());
    }
    captured_bs_ = bs;
    window_meta_ = false;
    active_ = graph_.get();
    (void)mode;
    return {};
}

Status AttentionBackend::init_forward_metadata_replay_cuda_graph(const ForwardBatch& batch) {
    if (!graph_)
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "{}: replay before init_cuda_graph_state", name());
    PDSIM_RETURN_IF_ERROR(
        validate_forward_batch(batch, graph_->max_bs(), graph_->max_pages_per_seq()));
    if (!batch.window_page_table.empty()) {
        return PDSIM_ERROR(StatusCode::kUnimplemented,
                           "{}: graph metadata has no sliding-window page table", name());
    }
    window_meta_ = false;
    active_ = graph_.get();
    return enqueue_assign(graph_.get(), batch, /*keep_aliased_seq_lens=*/true);
}

Status init_backend_cuda_graph_state(AttentionBackend& backend, int max_bs,
                                     const int32_t* seq_lens_buf, const GraphStateExtras& extras) {
    std::set<std::string> accepted = backend.accepted_graph_state_extras();
    if (accepted.count("*") != 0)
        return backend.init_cuda_graph_state(max_bs, seq_lens_buf, extras);
    GraphStateExtras filtered;
    if (accepted.count("max_pages_per_seq") != 0)
        filtered.max_pages_per_seq = extras.max_pages_per_seq;
    if (accepted.count("paged_cache_group_specs") != 0) {
        filtered.paged_cache_group_specs = extras.paged_cache_group_specs;
    }
    return backend.init_cuda_graph_state(max_bs, seq_lens_buf, filtered);
}

// ---- the record rule ------------------------------------------------------------------------
AttentionBackend::RecordPdCacheStep::RecordPdCacheStep(AttentionBackend& backend, ForwardMode mode,
                                                       bool save_kv_cache,
                                                       std::optional<bool> record_kv_cache)
    : backend_(backend), save_kv_cache_(save_kv_cache) {
    bool record =
        record_kv_cache.has_value() ? *record_kv_cache : (!is_decode(mode) && !is_idle(mode));
    record_ = record && backend.step_counter() != nullptr;
}

Status AttentionBackend::RecordPdCacheStep::enter() {
    if (record_ && !save_kv_cache_) return backend_.step_counter()->record_cache();
    return {};
}

Status AttentionBackend::RecordPdCacheStep::exit() {
    if (record_ && save_kv_cache_) return backend_.step_counter()->record_cache();
    return {};
}

namespace {

template <typename T>
std::string join(const std::vector<T>& items, std::string_view sep, auto&& name) {
    std::string out;
    for (const T& i : items) out += fmt::format("{}{}", out.empty() ? "" : sep, name(i));
    return out.empty() ? "nothing" : out;
}

std::string dtype_list(const std::vector<runtime::DType>& dtypes) {
    return join(dtypes, " or ", [](runtime::DType d) { return runtime::dtype_name(d); });
}

template <typename T>
bool contains(const std::vector<T>& items, const T& x) {
    return std::find(items.begin(), items.end(), x) != items.end();
}

}  // namespace

Status AttentionBackend::validate_forward(const ForwardArgs& a) const {
    const BackendCapabilities caps = capabilities();
    const kv::KVPool& pool = *a.pool;
    const runtime::Device device = pool.device();
    if (!contains(caps.devices, device.kind)) {
        return PDSIM_ERROR(
            StatusCode::kInvalidArgument, "pool: memory on {}, backend '{}' accepts {}",
            runtime::device_kind_name(device.kind), name(),
            join(caps.devices, " or ",
                 [](runtime::DeviceKind k) { return runtime::device_kind_name(k); }));
    }
    if (!contains(caps.kv_dtypes, pool.dtype())) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "pool: dtype {}, backend '{}' accepts {}",
                           runtime::dtype_name(pool.dtype()), name(), dtype_list(caps.kv_dtypes));
    }
    const LayerSpec& L = a.layer;
    if (L.num_q_heads < 1 || L.num_kv_heads < 1 || L.num_q_heads % L.num_kv_heads != 0 ||
        L.head_dim < 1 || L.v_head_dim < 0) {
        return PDSIM_ERROR(
            StatusCode::kInvalidArgument,
            "layer {}: num_q_heads {} must be a positive multiple of num_kv_heads {}, head_dim {} "
            "positive, v_head_dim {} >= 0",
            L.layer_id, L.num_q_heads, L.num_kv_heads, L.head_dim, L.v_head_dim);
    }
    if (L.sliding_window < 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "layer {}: sliding_window {} must be >= 0 (0: full attention)",
                           L.layer_id, L.sliding_window);
    }
    if (L.sliding_window > 0 && !caps.sliding_window) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "layer {}: sliding_window {}: backend '{}' does not declare "
                           "sliding-window attention",
                           L.layer_id, L.sliding_window, name());
    }
    if (L.layer_id < 0 || L.layer_id >= pool.num_layers()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "layer: layer_id {} out of range [0, {}) of the pool", L.layer_id,
                           pool.num_layers());
    }
    if (!pool.holds_layer(L.layer_id)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "layer: layer_id {} is not held by the pool (another cache group's)",
                           L.layer_id);
    }
    // Eager metadata: the batch's token count is known here; graph metadata: the views agree.
    int64_t tokens = active_ == &eager_ && eager_num_tokens_.has_value() ? *eager_num_tokens_ : -1;
    const bool no_tokens = a.bs == 0 || tokens == 0;
    const bool kv_optional = no_tokens || !a.save_kv_cache;

    struct Arg {
        const char* name;
        runtime::ConstTensorView view;
        int heads;
        int dim;           // 0: out_cache_loc (rank 1, int32)
        bool optional;     // a null view is accepted
        const char* need;  // why it is required otherwise
    };
    const char* kHasTokens = "the forward has tokens";
    const char* kSaves = "save_kv_cache is set and the forward has tokens";
    const Arg args[] = {
        {"q", a.q, L.num_q_heads, L.head_dim, no_tokens, kHasTokens},
        {"k", a.k, L.num_kv_heads, L.head_dim, kv_optional, kSaves},
        {"v", a.v, L.num_kv_heads, v_dim(L), kv_optional, kSaves},
        {"out", a.out, L.num_q_heads, v_dim(L), no_tokens, kHasTokens},
        {"out_cache_loc", a.out_cache_loc, 0, 0, kv_optional, kSaves},
    };
    std::optional<runtime::DType> act;  // the activation dtype: the first non-null activation's
    const char* act_from = nullptr;
    for (const Arg& arg : args) {
        const bool is_loc = arg.dim == 0;
        if (arg.view.empty()) {
            if (arg.optional) continue;
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "{}: null data pointer ({})", arg.name,
                               arg.need);
        }
        runtime::DType want = runtime::DType::kI32;
        if (!is_loc) {
            if (!act.has_value()) {
                if (!contains(caps.activation_dtypes, arg.view.dtype)) {
                    return PDSIM_ERROR(StatusCode::kInvalidArgument,
                                       "{}: dtype {}, backend '{}' accepts {}", arg.name,
                                       runtime::dtype_name(arg.view.dtype), name(),
                                       dtype_list(caps.activation_dtypes));
                }
                act = arg.view.dtype;
                act_from = arg.name;
            } else if (arg.view.dtype != *act) {
                return PDSIM_ERROR(StatusCode::kInvalidArgument,
                                   "{}: dtype {}, expected {} (the dtype of {})", arg.name,
                                   runtime::dtype_name(arg.view.dtype), runtime::dtype_name(*act),
                                   act_from);
            }
            want = *act;
        }
        if (is_loc) {
            PDSIM_RETURN_IF_ERROR(runtime::check_view(
                arg.view, arg.name, {.dtypes = {want}, .device = device.kind, .shape = {tokens}}));
        } else {
            PDSIM_RETURN_IF_ERROR(runtime::check_view(
                arg.view, arg.name,
                {.dtypes = {want}, .device = device.kind, .shape = {tokens, arg.heads, arg.dim}}));
        }
        if (arg.view.device.index != device.index) {
            return PDSIM_ERROR(
                StatusCode::kInvalidArgument, "{}: memory on {}:{}, the pool is on {}:{}", arg.name,
                runtime::device_kind_name(arg.view.device.kind), arg.view.device.index,
                runtime::device_kind_name(device.kind), device.index);
        }
        if (tokens < 0) tokens = arg.view.size(0);  // the first view sets num_tokens for the rest
    }
    return {};
}

Status AttentionBackend::check_streams() const {
    if (config_.stream == nullptr)
        return PDSIM_ERROR(StatusCode::kFailedPrecondition, "{}: no compute stream", name());
    if (step_counter_ != nullptr && &step_counter_->stream() != config_.stream) {
        return PDSIM_ERROR(
            StatusCode::kFailedPrecondition,
            "{}: the StepCounter records on stream '{}', the backend computes on '{}'", name(),
            step_counter_->stream().name(), config_.stream->name());
    }
    return {};
}

Status AttentionBackend::forward(const runtime::ConstTensorView& q,
                                 const runtime::ConstTensorView& k,
                                 const runtime::ConstTensorView& v, const LayerSpec& layer,
                                 const runtime::ConstTensorView& out_cache_loc, kv::KVPool& pool,
                                 ForwardMode mode, int bs, const runtime::TensorView& out,
                                 bool save_kv_cache, std::optional<bool> record_kv_cache) {
    PDSIM_RETURN_IF_ERROR(check_streams());
    if (bs < 0) return PDSIM_ERROR(StatusCode::kInvalidArgument, "bs: {} < 0", bs);
    ForwardArgs args;
    args.q = q;
    args.k = k;
    args.v = v;
    args.layer = layer;
    args.out_cache_loc = out_cache_loc;
    args.pool = &pool;
    args.mode = mode;
    args.bs = bs;
    args.out = out;
    args.save_kv_cache = save_kv_cache;
    // A sliding layer reads its own cache group's page table when the batch has one.
    args.meta =
        layer.sliding_window > 0 && window_meta_ && active_ == &eager_ ? &eager_window_ : active_;
    PDSIM_RETURN_IF_ERROR(validate_forward(args));
    RecordPdCacheStep guard(*this, mode, save_kv_cache, record_kv_cache);
    PDSIM_RETURN_IF_ERROR(guard.enter());
    PDSIM_RETURN_IF_ERROR(is_decode(mode) ? forward_decode(args) : forward_extend(args));
    return guard.exit();
}

Status AttentionBackend::forward_recurrent_impl(const RecurrentArgs& args) {
    return PDSIM_ERROR(StatusCode::kUnimplemented, "{}: no recurrent layers (layer {})", name(),
                       args.layer.layer_id);
}

Status AttentionBackend::forward_recurrent(const RecurrentArgs& in,
                                           std::optional<bool> record_kv_cache) {
    const RecurrentSpec& l = in.layer;
    if (!capabilities().recurrent_layers) {
        return PDSIM_ERROR(StatusCode::kUnimplemented,
                           "{}: layer {} is recurrent and this backend runs attention only (wrap "
                           "it in the hybrid backend)",
                           name(), l.layer_id);
    }
    PDSIM_RETURN_IF_ERROR(check_streams());
    if (in.pool == nullptr)
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "layer {}: no state pool", l.layer_id);
    const kv::StatePool& pool = *in.pool;
    if (l.num_heads != pool.num_heads() || l.head_dim != pool.head_dim() ||
        l.conv_kernel != pool.conv_kernel() || l.state_layer < 0 ||
        l.state_layer >= pool.num_layers()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "layer {}: state layer {} of {} heads x {} (conv {}) does not match the "
                           "state pool ({} layers of {} heads x {}, conv {})",
                           l.layer_id, l.state_layer, l.num_heads, l.head_dim, l.conv_kernel,
                           pool.num_layers(), pool.num_heads(), pool.head_dim(),
                           pool.conv_kernel());
    }
    if (in.bs < 0) return PDSIM_ERROR(StatusCode::kInvalidArgument, "bs: {} < 0", in.bs);
    const int64_t n = in.qkv.empty() ? 0 : in.qkv.size(0);
    if (eager_num_tokens_.has_value() && active_ == &eager_ && n != *eager_num_tokens_) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "qkv: {} tokens, the batch of init_forward_metadata has {}", n,
                           *eager_num_tokens_);
    }
    const bool none = n == 0;
    const int h = l.num_heads, d = l.head_dim;
    PDSIM_RETURN_IF_ERROR(runtime::check_view(
        in.qkv, "qkv",
        {.dtypes = {runtime::DType::kF32}, .shape = {n, h, 3 * d}, .allow_null = none}));
    PDSIM_RETURN_IF_ERROR(runtime::check_view(
        in.gate, "gate", {.dtypes = {runtime::DType::kF32}, .shape = {n, h}, .allow_null = none}));
    PDSIM_RETURN_IF_ERROR(runtime::check_view(
        in.out, "out", {.dtypes = {runtime::DType::kF32}, .shape = {n, h, d}, .allow_null = none}));
    PDSIM_RETURN_IF_ERROR(runtime::check_view(
        in.conv_weight, "conv_weight",
        {.dtypes = {runtime::DType::kF32}, .shape = {h, 3 * d, l.conv_kernel}}));
    PDSIM_RETURN_IF_ERROR(runtime::check_view(
        in.state_slots, "state_slots",
        {.dtypes = {runtime::DType::kI32}, .shape = {in.bs}, .allow_null = in.bs == 0}));
    for (int i = 0; i < in.bs; ++i) {
        const int32_t slot = in.state_slots.as<int32_t>()[i];
        if (slot < 1 || slot >= pool.num_pages()) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "state_slots[{}]: slot {} outside [1, {})", i, slot,
                               pool.num_pages());
        }
    }
    RecurrentArgs args = in;
    args.meta = active_;
    RecordPdCacheStep guard(*this, in.mode, /*save_kv_cache=*/true, record_kv_cache);
    PDSIM_RETURN_IF_ERROR(guard.enter());
    PDSIM_RETURN_IF_ERROR(forward_recurrent_impl(args));
    return guard.exit();
}

// ---- registry -------------------------------------------------------------------------------
void register_builtin_attention_backends();  // backends/builtin.cpp

namespace {
struct BackendRegistry {
    std::mutex mu;
    std::map<std::string, BackendFactory> factories;
};
BackendRegistry& backend_registry() {
    static BackendRegistry* r = new BackendRegistry();
    return *r;
}
void ensure_builtins() {
    static std::once_flag once;
    std::call_once(once, [] { register_builtin_attention_backends(); });
}
}  // namespace

void register_attention_backend(const std::string& name, BackendFactory factory) {
    BackendRegistry& r = backend_registry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.factories[name] = std::move(factory);
}

StatusOr<std::unique_ptr<AttentionBackend>> create_attention_backend(
    const std::string& name, const AttentionConfig& config) {
    ensure_builtins();
    BackendFactory f;
    {
        BackendRegistry& r = backend_registry();
        std::lock_guard<std::mutex> lock(r.mu);
        auto it = r.factories.find(name);
        if (it == r.factories.end()) {
            std::string known;
            for (auto& [n, _] : r.factories) known += (known.empty() ? "" : ", ") + n;
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "unknown attention backend '{}' (available: {})", name, known);
        }
        f = it->second;
    }
    if (config.stream == nullptr) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "attention backend '{}': config.stream is null", name);
    }
    if (config.num_q_heads < 1 || config.num_kv_heads < 1 ||
        config.num_q_heads % config.num_kv_heads != 0) {
        return PDSIM_ERROR(
            StatusCode::kInvalidArgument,
            "attention backend '{}': num_q_heads {} must be a positive multiple of num_kv_heads {}",
            name, config.num_q_heads, config.num_kv_heads);
    }
    PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<AttentionBackend> backend, f(config));
    const BackendCapabilities caps = backend->capabilities();
    if (!contains(caps.kv_dtypes, config.kv_dtype)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "attention backend '{}': config.kv_dtype {}, it accepts {}", name,
                           runtime::dtype_name(config.kv_dtype), dtype_list(caps.kv_dtypes));
    }
    return backend;
}

std::vector<std::string> attention_backend_names() {
    ensure_builtins();
    BackendRegistry& r = backend_registry();
    std::lock_guard<std::mutex> lock(r.mu);
    std::vector<std::string> out;
    for (auto& [n, _] : r.factories) out.push_back(n);
    return out;
}

}  // namespace pdsim::attn

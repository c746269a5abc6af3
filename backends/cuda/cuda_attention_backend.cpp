// CudaAttentionBackend (see cuda_attention_backend.h): host code against cudart. The planning
// logic it relies on is in cuda_attention_plan.cpp (unit-tested without a GPU); the kernels are
// FlashInfer's (flashinfer_*.cu) and kv_append.cu.
#include "backends/cuda/cuda_attention_backend.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstddef>
#include <limits>
#include <type_traits>
#include <utility>

#include "backends/cuda/cuda_stream.h"
#include "backends/cuda/kv_append.h"
#include "backends/runtime/device.h"
#include "common/cuda_check.h"

namespace pdsim::attn::cuda {

namespace {

using runtime::cuda::ScopedDevice;

// Pinned metadata slots per adapter: batches planned ahead of the GPU.
constexpr int kStagingSlots = 4;
// The graph default of the base class (AttentionBackend::init_cuda_graph_state).
constexpr int kDefaultMaxPagesPerSeq = 1024;

// Row `row` of a contiguous [rows][heads][dim] view (bytes: the view's dtype).
template <typename Pointer>
Pointer row_pointer(Pointer base, int64_t row, int64_t row_elems, runtime::DType dtype) {
    using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<Pointer>>,
                                    const std::byte, std::byte>;
    return static_cast<Byte*>(base) +
           row * row_elems * static_cast<int64_t>(runtime::dtype_size(dtype));
}

}  // namespace

CudaAttentionBackend::CudaAttentionBackend(const AttentionConfig& config, void* stream, int device)
    : AttentionBackend(config), stream_(stream), device_(device) {}

CudaAttentionBackend::~CudaAttentionBackend() {
    // Queued kernels read the adapters' workspaces; a capturing stream cannot be synchronized.
    if (config().stream != nullptr && !stream().is_capturing()) {
        stream().synchronize().ignore_error();
    }
}

StatusOr<std::unique_ptr<AttentionBackend>> CudaAttentionBackend::create(
    const AttentionConfig& config) {
    if (config.stream == nullptr) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "attention backend 'cuda': config.stream is null");
    }
    PDSIM_ASSIGN_OR_RETURN(runtime::DeviceRuntime * cuda_runtime,
                           runtime::device_runtime(runtime::DeviceKind::kCuda));
    if (cuda_runtime->device_count() == 0) {
        return PDSIM_ERROR(StatusCode::kUnavailable, "attention backend 'cuda': {}",
                           cuda_runtime->unavailable_reason());
    }
    auto native = runtime::cuda::native_stream(*config.stream);
    if (!native.ok()) {
        return native.status().with_context(
            "attention backend 'cuda': config.stream must be a CudaStream");
    }
    PDSIM_RETURN_IF_ERROR(check_backend_config(config));
    return std::unique_ptr<AttentionBackend>(new CudaAttentionBackend(
        config, static_cast<void*>(*native), config.stream->device().index));
}

BackendCapabilities CudaAttentionBackend::capabilities() const {
    return {{runtime::DType::kBF16}, {runtime::DType::kBF16}, {runtime::DeviceKind::kCuda}};
}

bool CudaAttentionBackend::graph_metadata_active() const {
    const MetadataBuffers* active = active_metadata();
    return active != nullptr && active->max_bs() > 0;  // the eager buffers have no fixed size
}

// ---- metadata -------------------------------------------------------------------------------
Status CudaAttentionBackend::init_forward_metadata(const ForwardBatch& batch) {
    PDSIM_RETURN_IF_ERROR(validate_forward_batch(batch, 0, 0));
    use_eager_metadata();
    eager_batch_ = stage_batch(batch);
    eager_split_ = split_batch(*eager_batch_);
    ++eager_generation_;
    eager_checked_geometry_.reset();
    // Plan now when the batch fits the pool of the latest forward; otherwise (no forward yet, or
    // a batch for another pool) its first forward plans it against that forward's pool.
    if (last_geometry_.has_value() && !stream().is_capturing() &&
        check_batch_against_pool(*eager_batch_, *last_geometry_).ok()) {
        ScopedDevice device(device_);
        PDSIM_RETURN_IF_ERROR(device.status());
        Status planned = plan_eager(*last_geometry_);
        if (!planned.ok()) {
            eager_batch_.reset();
            eager_split_ = {};
            return planned;
        }
    }
    return ok_status();
}

Status CudaAttentionBackend::plan_eager(const PoolGeometry& geometry) {
    const StagedBatch& batch = *eager_batch_;
    if (eager_checked_geometry_ != geometry) {
        PDSIM_RETURN_IF_ERROR(check_batch_against_pool(batch, geometry));
        eager_checked_geometry_ = geometry;
    }
    for (const std::optional<SubBatch>* sub : {&eager_split_.decode, &eager_split_.extend}) {
        if (!sub->has_value()) continue;
        const AttentionKind kind = (*sub)->kind;
        AdapterSlot& slot = kind == AttentionKind::kDecode ? eager_decode_ : eager_extend_;
        if (slot.planned_generation == eager_generation_ && slot.planned_geometry == geometry) {
            continue;
        }
        PDSIM_RETURN_IF_ERROR(ensure_eager_adapter(slot, kind, geometry.page_size,
                                                   capacity_for(batch, **sub, geometry.page_size)));
        slot.planned_generation = 0;
        PDSIM_RETURN_IF_ERROR(slot.adapter->plan(to_paged_batch(batch, **sub), stream_));
        slot.planned_generation = eager_generation_;
        slot.planned_geometry = geometry;
    }
    return ok_status();
}

Status CudaAttentionBackend::ensure_eager_adapter(AdapterSlot& slot, AttentionKind kind,
                                                  int page_size, const PlanCapacity& need) {
    PlanCapacity have;
    if (slot.adapter != nullptr) {
        const FlashInferConfig& current = slot.adapter->config();
        if (current.shape.page_size == page_size) {
            if (covers(current.capacity, need)) return ok_status();
            have = current.capacity;
        }
    }
    if (stream().is_capturing()) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "cuda backend: the {} adapter must grow, which cannot happen while the "
                           "stream is capturing",
                           attention_kind_name(kind));
    }
    if (slot.adapter != nullptr) {
        // Kernels still queued read the old workspace: let them finish before freeing it.
        PDSIM_RETURN_IF_ERROR(stream().synchronize());
        slot.adapter.reset();
        slot.planned_generation = 0;
    }
    PDSIM_ASSIGN_OR_RETURN(slot.adapter,
                           make_adapter(kind, page_size, grown_capacity(have, need, page_size),
                                        /*cuda_graph=*/false));
    return ok_status();
}

StatusOr<std::unique_ptr<FlashInferAttention>> CudaAttentionBackend::make_adapter(
    AttentionKind kind, int page_size, const PlanCapacity& capacity, bool cuda_graph) const {
    FlashInferConfig c;
    c.kind = kind;
    c.shape.num_qo_heads = config().num_q_heads;
    c.shape.num_kv_heads = config().num_kv_heads;
    c.shape.head_dim = config().head_dim;
    c.shape.page_size = page_size;
    c.shape.dtype = runtime::DType::kBF16;
    c.capacity = capacity;
    c.num_pages = 0;  // page ids are checked against the pool here (check_batch_against_pool)
    c.cuda_graph = cuda_graph;
    c.device = device_;
    c.staging_slots = kStagingSlots;
    auto adapter = FlashInferAttention::create(c);
    if (!adapter.ok()) {
        return adapter.status().with_context(fmt::format(
            "cuda backend: {} {} adapter for page size {}, {} requests, {} rows, {} pages",
            cuda_graph ? "graph" : "eager", attention_kind_name(kind), page_size, capacity.max_bs,
            capacity.max_tokens, capacity.max_pages));
    }
    return adapter;
}

Status CudaAttentionBackend::init_cuda_graph_state(int max_bs, const int32_t* seq_lens_buf,
                                                   const GraphStateExtras& extras) {
    const int max_pages = extras.max_pages_per_seq.value_or(kDefaultMaxPagesPerSeq);
    if (max_bs >= 1 && max_pages >= 1) {  // else the base class names the bad argument
        PDSIM_RETURN_IF_ERROR(
            graph_capacity(AttentionKind::kDecode, max_bs, max_pages, 0).status());
    }
    // Validates, and synchronizes the stream: nothing queued reads the old graph adapters.
    PDSIM_RETURN_IF_ERROR(AttentionBackend::init_cuda_graph_state(max_bs, seq_lens_buf, extras));
    graph_ = std::make_unique<GraphState>();
    graph_->max_bs = max_bs;
    graph_->max_pages_per_seq = max_pages;
    return ok_status();
}

Status CudaAttentionBackend::init_forward_metadata_capture_cuda_graph(int bs, ForwardMode mode) {
    if (mode == ForwardMode::kMixed) return graph_kind(mode).status();
    return AttentionBackend::init_forward_metadata_capture_cuda_graph(bs, mode);
}

Status CudaAttentionBackend::init_forward_metadata_replay_cuda_graph(const ForwardBatch& batch) {
    if (graph_ == nullptr) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "cuda: replay before init_cuda_graph_state");
    }
    PDSIM_RETURN_IF_ERROR(validate_forward_batch(batch, graph_->max_bs, graph_->max_pages_per_seq));
    if (stream().is_capturing()) {
        return PDSIM_ERROR(
            StatusCode::kFailedPrecondition,
            "cuda: init_forward_metadata_replay_cuda_graph while the stream is "
            "capturing; refresh the metadata before each replay, outside the capture");
    }
    if (is_idle(batch.mode)) {  // nothing is planned for (or launched by) an idle graph
        return AttentionBackend::init_forward_metadata_capture_cuda_graph(0, batch.mode);
    }
    PDSIM_ASSIGN_OR_RETURN(const AttentionKind kind, graph_kind(batch.mode));
    StagedBatch staged = stage_batch(batch);
    PDSIM_RETURN_IF_ERROR(
        AttentionBackend::init_forward_metadata_capture_cuda_graph(batch.bs, batch.mode));
    const bool decode = kind == AttentionKind::kDecode;
    AdapterSlot& slot = decode ? graph_->decode : graph_->extend;
    if (slot.adapter == nullptr) {  // planned by the warm-up forward that creates the adapter
        (decode ? graph_->pending_decode : graph_->pending_extend) = std::move(staged);
        return ok_status();
    }
    ScopedDevice device(device_);
    PDSIM_RETURN_IF_ERROR(device.status());
    return plan_graph(slot, staged);
}

Status CudaAttentionBackend::plan_graph(AdapterSlot& slot, const StagedBatch& batch) {
    PDSIM_RETURN_IF_ERROR(check_batch_against_pool(batch, *graph_->geometry));
    const FlashInferConfig& c = slot.adapter->config();
    if (batch.num_tokens > c.capacity.max_tokens) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "batch: {} query tokens exceed the {} rows of the {} graph (the static "
                           "buffers of its first forward)",
                           batch.num_tokens, c.capacity.max_tokens, attention_kind_name(c.kind));
    }
    const SubBatch whole{c.kind, 0, batch.bs, 0, batch.num_tokens};
    return slot.adapter->plan(to_paged_batch(batch, whole), stream_);
}

// ---- forward --------------------------------------------------------------------------------
Status CudaAttentionBackend::forward_any(const ForwardArgs& args) {
    PDSIM_RETURN_IF_ERROR(check_layer(args.layer, config()));
    const runtime::Device pool_device = args.pool->device();
    if (pool_device.index != device_) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "pool: memory on cuda:{}, the compute stream '{}' is on cuda:{}",
                           pool_device.index, stream().name(), device_);
    }
    PDSIM_ASSIGN_OR_RETURN(const kv::KVLayerView layer_view,
                           args.pool->layer_view(args.layer.layer_id));
    PDSIM_RETURN_IF_ERROR(check_pool_layer(layer_view, config()));
    const PoolGeometry geometry{layer_view.page_size, layer_view.num_pages};
    last_geometry_ = geometry;
    ScopedDevice device(device_);
    PDSIM_RETURN_IF_ERROR(device.status());
    return graph_metadata_active() ? forward_graph(args, geometry, layer_view)
                                   : forward_eager(args, geometry, layer_view);
}

Status CudaAttentionBackend::forward_eager(const ForwardArgs& args, const PoolGeometry& geometry,
                                           const kv::KVLayerView& layer_view) {
    if (!eager_batch_.has_value()) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "cuda: forward without metadata: call init_forward_metadata first (a "
                           "failed call leaves none)");
    }
    if (stream().is_capturing()) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "cuda: an eager forward while the stream is capturing (eager plans have "
                           "a batch-dependent launch shape); call "
                           "init_forward_metadata_capture_cuda_graph before capturing");
    }
    const StagedBatch& batch = *eager_batch_;
    PDSIM_RETURN_IF_ERROR(check_forward_matches_batch(args.mode, args.bs, args.q, "q", batch));
    if (batch.num_tokens == 0) return ok_status();
    PDSIM_RETURN_IF_ERROR(plan_eager(geometry));
    if (args.save_kv_cache) {
        PDSIM_RETURN_IF_ERROR(enqueue_kv_append(args, layer_view, batch.num_tokens));
    }
    if (eager_split_.decode.has_value()) {
        PDSIM_RETURN_IF_ERROR(run_sub_batch(*eager_decode_.adapter, args, layer_view,
                                            eager_split_.decode->row_begin));
    }
    if (eager_split_.extend.has_value()) {
        PDSIM_RETURN_IF_ERROR(run_sub_batch(*eager_extend_.adapter, args, layer_view,
                                            eager_split_.extend->row_begin));
    }
    return ok_status();
}

Status CudaAttentionBackend::forward_graph(const ForwardArgs& args, const PoolGeometry& geometry,
                                           const kv::KVLayerView& layer_view) {
    if (graph_ == nullptr) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "cuda: graph metadata without init_cuda_graph_state");
    }
    if (is_idle(args.mode)) return ok_status();
    PDSIM_ASSIGN_OR_RETURN(const AttentionKind kind, graph_kind(args.mode));
    GraphState& gs = *graph_;
    if (gs.geometry.has_value() && *gs.geometry != geometry) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "pool: page size {} and {} pages, the graph adapters were made for page "
                           "size {} and {} pages",
                           geometry.page_size, geometry.num_pages, gs.geometry->page_size,
                           gs.geometry->num_pages);
    }
    const bool decode = kind == AttentionKind::kDecode;
    AdapterSlot& slot = decode ? gs.decode : gs.extend;
    const int64_t rows = args.q.empty() ? 0 : args.q.size(0);
    if (slot.adapter == nullptr) {
        if (stream().is_capturing()) {
            return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                               "cuda: a {} forward is being captured before its graph adapter "
                               "exists; warm up first: run the forwards once with graph metadata "
                               "active outside the capture",
                               forward_mode_name(args.mode));
        }
        if (!decode && rows == 0) return ok_status();  // nothing to size the extend graph by
        PDSIM_ASSIGN_OR_RETURN(const PlanCapacity capacity,
                               graph_capacity(kind, gs.max_bs, gs.max_pages_per_seq, rows));
        PDSIM_ASSIGN_OR_RETURN(slot.adapter, make_adapter(kind, geometry.page_size, capacity,
                                                          /*cuda_graph=*/true));
        gs.geometry = geometry;
        std::optional<StagedBatch>& pending = decode ? gs.pending_decode : gs.pending_extend;
        if (pending.has_value()) {
            const StagedBatch batch = std::move(*pending);
            pending.reset();
            PDSIM_RETURN_IF_ERROR(plan_graph(slot, batch));
        }
    }
    const PlanCapacity& capacity = slot.adapter->config().capacity;
    if (!decode && rows > capacity.max_tokens) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "q: {} rows, but the extend graph adapter was sized for {} by the first "
                           "graph-mode extend forward (static buffers cannot grow)",
                           rows, capacity.max_tokens);
    }
    if (rows == 0) return ok_status();
    if (args.save_kv_cache) PDSIM_RETURN_IF_ERROR(enqueue_kv_append(args, layer_view, rows));
    return run_sub_batch(*slot.adapter, args, layer_view, 0);
}

Status CudaAttentionBackend::enqueue_kv_append(const ForwardArgs& args, const kv::KVLayerView& lv,
                                               int64_t rows) const {
    if (rows > std::numeric_limits<int>::max()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "k: {} rows exceed 2^31 - 1", rows);
    }
    KvAppendParams p;
    p.k = args.k.data;
    p.v = args.v.data;
    p.src_dtype = args.k.dtype;
    p.k_cache = lv.k.data;
    p.v_cache = lv.v.data;
    p.cache_dtype = lv.dtype;
    p.num_slots = static_cast<int64_t>(lv.num_pages) * lv.page_size;
    p.num_kv_heads = args.layer.num_kv_heads;
    p.head_dim = args.layer.head_dim;
    p.v_head_dim = v_dim(args.layer);
    p.out_cache_loc = args.out_cache_loc.as<int32_t>();
    p.n = static_cast<int>(rows);
    return kv_append(p, stream_);
}

Status CudaAttentionBackend::run_sub_batch(const FlashInferAttention& adapter,
                                           const ForwardArgs& args, const kv::KVLayerView& lv,
                                           int64_t row_begin) const {
    const int64_t q_row = static_cast<int64_t>(args.layer.num_q_heads) * args.layer.head_dim;
    const int64_t o_row = static_cast<int64_t>(args.layer.num_q_heads) * v_dim(args.layer);
    AttentionRunArgs run;
    run.q = row_pointer(args.q.data, row_begin, q_row, args.q.dtype);
    run.k_cache = lv.k.data;
    run.v_cache = lv.v.data;
    run.o = row_pointer(args.out.data, row_begin, o_row, args.out.dtype);
    run.sm_scale = layer_scaling(args.layer);
    return adapter.run(run, stream_);
}

}  // namespace pdsim::attn::cuda

// CudaSyntheticModel (see cuda_synthetic_model.h): weights, workspace and GEMM plans at create();
// forward() = stage inputs -> backend metadata -> enqueue_body (every kernel) -> enqueue_output
// (tokens to the host); decode graphs capture enqueue_body once per bucket.
#include "backends/cuda/cuda_synthetic_model.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "backends/cuda/cuda_pinned_memory.h"
#include "backends/cuda/cuda_stream.h"
#include "backends/cuda/flashinfer_staging.h"
#include "backends/cuda/gemm.h"
#include "backends/cuda/kv_append.h"
#include "backends/cuda/model_kernels.h"
#include "common/bf16.h"
#include "common/cuda_check.h"
#include "common/device_health.h"

namespace pdsim::model::cuda {

namespace {

using runtime::DeviceBuffer;
using runtime::DeviceKind;
using runtime::DType;

attn::ForwardBatch to_forward_batch(const StepBatch& b) {
    attn::ForwardBatch fb;
    fb.mode = b.mode;
    fb.bs = static_cast<int>(b.seq_lens.size());
    fb.seq_lens = b.seq_lens;
    fb.extend_lens = b.extend_lens;
    fb.page_table = b.page_table;
    fb.page_table_stride = b.page_table_stride;
    return fb;
}

StatusOr<DeviceBuffer> allocate(int device, size_t bytes) {
    return DeviceBuffer::allocate({DeviceKind::kCuda, device}, std::max<size_t>(bytes, 1));
}

// Allocates `layout` (bf16 or fp32) on the device and enqueues its generation on `stream`.
StatusOr<DeviceBuffer> generated(uint64_t seed, const WeightLayout& layout, DType dtype, int device,
                                 runtime::Stream& stream) {
    const size_t bytes =
        static_cast<size_t>(layout.rows * layout.cols) * runtime::dtype_size(dtype);
    PDSIM_ASSIGN_OR_RETURN(DeviceBuffer b, allocate(device, bytes));
    PDSIM_RETURN_IF_ERROR(generate_weights(seed, layout, b.data(), dtype, stream));
    return b;
}

}  // namespace

struct CudaSyntheticModel::Weights {
    struct Layer {
        DeviceBuffer qkv, o_proj, gate_up, down;  // bf16 [N][K]
        DeviceBuffer norm1, norm2;                // fp32 [hidden]
    };
    std::vector<Layer> layers;
    DeviceBuffer embedding;   // bf16 [vocab][hidden]
    DeviceBuffer lm_head;     // bf16 [vocab][hidden]
    DeviceBuffer final_norm;  // fp32 [hidden]
};

CudaSyntheticModel::CudaSyntheticModel(const ModelConfig& config, const CudaModelOptions& options,
                                       TpComm* tp, DeviceTpComm* device_tp)
    : cfg_(config), options_(options), tp_(tp), device_tp_(device_tp) {
    tp_size_ = tp != nullptr ? tp->size() : 1;
    tp_rank_ = tp != nullptr ? tp->rank() : 0;
    sliced_ = uses_sliced_reduction(tp_size_, options_);
    hq_ = cfg_.num_q_heads / tp_size_;
    hkv_ = cfg_.num_kv_heads / tp_size_;
    inter_ = cfg_.intermediate / tp_size_;
    q_cols_ = static_cast<int64_t>(hq_) * cfg_.head_dim;
    kv_cols_ = static_cast<int64_t>(hkv_) * cfg_.head_dim;
    qkv_cols_ = q_cols_ + 2 * kv_cols_;
    slices_ = cfg_.num_kv_heads;
    local_slices_ = slices_ / tp_size_;
    o_slice_cols_ = static_cast<int64_t>(cfg_.num_q_heads / slices_) * cfg_.head_dim;
    qkv_slice_cols_ = o_slice_cols_ + 2 * static_cast<int64_t>(cfg_.head_dim);
    down_slice_cols_ = cfg_.intermediate / slices_;
    gate_up_slice_cols_ = 2 * down_slice_cols_;
    layout_ = plan_workspace(cfg_, options_, tp_size_);
    weight_memory_ = estimate_weight_memory(cfg_, tp_size_);
}

CudaSyntheticModel::~CudaSyntheticModel() {
    cudaSetDevice(options_.device);
    // Queued work reads the buffers below (the host task reads pinned_tokens_): let it finish.
    if (forwarded_ && forward_done_ != nullptr) {
        if (Status st = forward_done_->synchronize(); !st.ok()) {
            mark_device_hung(options_.device, fmt::format("model {}: its last forward: {}",
                                                          cfg_.name, st.message()));
        }
    }
    graphs_.clear();
    staging_.reset();  // waits for its copies in flight (not on a hung device)
    for (void* ev : timing_events_) {
        if (ev != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(ev));
    }
    // cudaFreeHost waits for the device; queued work may still read the tokens' pinned memory.
    if (!device_hung(options_.device)) {
        if (pinned_tokens_ != nullptr) cudaFreeHost(pinned_tokens_);
        // After a failed exchange a peer or a pending MPI collective may still touch these.
        if (tp_broken_.empty()) {
            if (pinned_partials_ != nullptr) cudaFreeHost(pinned_partials_);
            if (pinned_gathered_ != nullptr) cudaFreeHost(pinned_gathered_);
        }
    }
}

StatusOr<std::unique_ptr<CudaSyntheticModel>> CudaSyntheticModel::create(
    const ModelConfig& config, TpComm* tp, const CudaModelOptions& options,
    DeviceTpComm* device_tp) {
    const int tp_size = tp != nullptr ? tp->size() : 1;
    PDSIM_RETURN_IF_ERROR(check_cuda_model_config(config, tp_size, options));
    if (tp != nullptr && (tp->rank() < 0 || tp->rank() >= tp_size)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "tp: rank {} outside [0, size {})",
                           tp->rank(), tp_size);
    }
    if (device_tp != nullptr &&
        (tp == nullptr || device_tp->size() != tp_size || device_tp->rank() != tp->rank())) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "device_tp: rank {} of {}, but the host TP group is {}",
                           device_tp->rank(), device_tp->size(),
                           tp == nullptr ? std::string("absent (TP 1)")
                                         : fmt::format("rank {} of {}", tp->rank(), tp_size));
    }
    PDSIM_ASSIGN_OR_RETURN(runtime::DeviceRuntime * rt, runtime::device_runtime(DeviceKind::kCuda));
    if (rt->device_count() == 0) {
        return PDSIM_ERROR(StatusCode::kUnavailable, "{}", rt->unavailable_reason());
    }
    if (options.device >= rt->device_count()) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "options.device {}: {} CUDA devices",
                           options.device, rt->device_count());
    }
    std::unique_ptr<CudaSyntheticModel> m(new CudaSyntheticModel(config, options, tp, device_tp));
    PDSIM_RETURN_IF_ERROR(m->init().with_context("model " + config.name));
    return m;
}

Status CudaSyntheticModel::init() {
    const int dev = options_.device;
    CUDA_CHECK(cudaSetDevice(dev));
    PDSIM_ASSIGN_OR_RETURN(runtime::DeviceRuntime * rt, runtime::device_runtime(DeviceKind::kCuda));
    PDSIM_ASSIGN_OR_RETURN(std::unique_ptr<runtime::Stream> stream,
                           rt->create_stream(dev, "cuda-synthetic-model-init"));
    PDSIM_RETURN_IF_ERROR(init_weights(*stream));

    // RoPE table (host-computed, bit-identical to the CPU model's cos/sin).
    const std::vector<float> cos_sin =
        rope_cos_sin_cache(cfg_.rope_theta, cfg_.head_dim, options_.max_positions);
    PDSIM_ASSIGN_OR_RETURN(rope_cos_sin_, allocate(dev, cos_sin.size() * sizeof(float)));
    PDSIM_RETURN_IF_ERROR(
        rope_cos_sin_.copy_from_host(cos_sin.data(), cos_sin.size() * sizeof(float)));

    // Workspace, zeroed so that rows no forward has written yet read as zeros, not garbage.
    PDSIM_ASSIGN_OR_RETURN(workspace_, allocate(dev, layout_.total_bytes));
    PDSIM_RETURN_IF_ERROR(workspace_.fill(0));

    // One pinned cuBLASLt algorithm per projection shape, shared by every layer.
    GemmOptions go;
    go.device = dev;
    go.max_rows = options_.max_tokens;
    const int64_t H = cfg_.hidden, I = inter_;
    if (sliced_) {
        // The slice shapes: the same on every TP size, so the same pinned algorithms.
        GemmShape partial_o{o_slice_cols_, H};
        partial_o.out_dtype = DType::kF32;
        GemmShape partial_down{down_slice_cols_, H};
        partial_down.out_dtype = DType::kF32;
        PDSIM_ASSIGN_OR_RETURN(qkv_gemm_, BatchInvariantGemm::create({H, qkv_slice_cols_}, go));
        PDSIM_ASSIGN_OR_RETURN(o_gemm_, BatchInvariantGemm::create(partial_o, go));
        PDSIM_ASSIGN_OR_RETURN(gate_up_gemm_,
                               BatchInvariantGemm::create({H, gate_up_slice_cols_}, go));
        PDSIM_ASSIGN_OR_RETURN(down_gemm_, BatchInvariantGemm::create(partial_down, go));
    } else {
        PDSIM_ASSIGN_OR_RETURN(qkv_gemm_, BatchInvariantGemm::create({H, qkv_cols_}, go));
        PDSIM_ASSIGN_OR_RETURN(o_gemm_, BatchInvariantGemm::create({q_cols_, H}, go));
        PDSIM_ASSIGN_OR_RETURN(gate_up_gemm_, BatchInvariantGemm::create({H, 2 * I}, go));
        PDSIM_ASSIGN_OR_RETURN(down_gemm_, BatchInvariantGemm::create({I, H}, go));
    }
    GemmOptions lm = go;
    lm.max_rows = options_.max_bs;
    GemmShape lm_shape{H, cfg_.vocab};
    lm_shape.out_dtype = DType::kF32;
    PDSIM_ASSIGN_OR_RETURN(lm_gemm_, BatchInvariantGemm::create(lm_shape, lm));

    // Input staging and the pinned landing buffer of the sampled tokens.
    PDSIM_ASSIGN_OR_RETURN(staging_,
                           attn::cuda::PinnedStagingRing::create(
                               attn::cuda::make_cuda_pinned_memory(dev), options_.staging_slots,
                               static_cast<size_t>(layout_.input.total) * sizeof(int32_t)));
    void* pinned = nullptr;
    CUDA_CHECK(cudaHostAlloc(&pinned, static_cast<size_t>(options_.max_bs) * sizeof(int32_t),
                             cudaHostAllocDefault));
    pinned_tokens_ = static_cast<int32_t*>(pinned);
    std::fill(pinned_tokens_, pinned_tokens_ + options_.max_bs, -1);
    if (tp_size_ > 1 && device_tp_ == nullptr) {
        // The host exchange's landing buffers (the gather reads and writes them on the host).
        CUDA_CHECK(cudaHostAlloc(&pinned, layout_.partials_bytes, cudaHostAllocDefault));
        pinned_partials_ = static_cast<float*>(pinned);
        CUDA_CHECK(cudaHostAlloc(&pinned, layout_.gathered_bytes, cudaHostAllocDefault));
        pinned_gathered_ = static_cast<float*>(pinned);
    }
    forward_done_ = stream->create_event();
    if (forward_done_ == nullptr) {
        return PDSIM_ERROR(StatusCode::kUnavailable, "creating the forward_done event failed");
    }
    timing_events_.assign(static_cast<size_t>(2 * cfg_.num_layers + 2), nullptr);
    for (void*& ev : timing_events_) {
        cudaEvent_t e = nullptr;
        CUDA_CHECK(cudaEventCreate(&e));
        ev = e;
    }
    return stream->synchronize();  // the weights are generated; errors surface here
}

Status CudaSyntheticModel::init_weights(runtime::Stream& stream) {
    const int dev = options_.device;
    const uint64_t seed = cfg_.seed;
    // Weights, generated on the device (bit-equal to SyntheticModel::weight_value, then bf16).
    // This rank's part of each projection, or, for the sliced forward, its canonical slices one
    // after the other: slice g of the model is what a rank of a TP group of `slices` would hold
    // (make_model_dims(config, slices, g)), so each slice's matrix is contiguous.
    std::vector<ModelDims> parts;
    if (sliced_) {
        for (int s = 0; s < local_slices_; ++s) {
            PDSIM_ASSIGN_OR_RETURN(ModelDims d,
                                   make_model_dims(cfg_, slices_, tp_rank_ * local_slices_ + s));
            parts.push_back(d);
        }
    } else {
        PDSIM_ASSIGN_OR_RETURN(ModelDims d, make_model_dims(cfg_, tp_size_, tp_rank_));
        parts.push_back(d);
    }
    PDSIM_ASSIGN_OR_RETURN(ModelDims whole, make_model_dims(cfg_, tp_size_, tp_rank_));
    // One bf16 matrix made of every part's `layout_of` matrix, back to back.
    auto projection = [&](auto layout_of, int layer) -> StatusOr<DeviceBuffer> {
        int64_t elems = 0;
        for (const ModelDims& d : parts) {
            const WeightLayout l = layout_of(d, layer);
            elems += l.rows * l.cols;
        }
        PDSIM_ASSIGN_OR_RETURN(DeviceBuffer b, allocate(dev, static_cast<size_t>(elems) * 2));
        int64_t at = 0;
        for (const ModelDims& d : parts) {
            const WeightLayout l = layout_of(d, layer);
            PDSIM_RETURN_IF_ERROR(
                generate_weights(seed, l, b.as<bf16_t>() + at, DType::kBF16, stream));
            at += l.rows * l.cols;
        }
        return b;
    };
    weights_ = std::make_unique<Weights>();
    weights_->layers.resize(static_cast<size_t>(cfg_.num_layers));
    for (int l = 0; l < cfg_.num_layers; ++l) {
        Weights::Layer& L = weights_->layers[static_cast<size_t>(l)];
        PDSIM_ASSIGN_OR_RETURN(L.qkv, projection(qkv_weight_layout, l));
        PDSIM_ASSIGN_OR_RETURN(L.o_proj, projection(o_proj_weight_layout, l));
        PDSIM_ASSIGN_OR_RETURN(L.gate_up, projection(gate_up_weight_layout, l));
        PDSIM_ASSIGN_OR_RETURN(L.down, projection(down_weight_layout, l));
        PDSIM_ASSIGN_OR_RETURN(
            L.norm1, generated(seed, norm_weight_layout(whole, l, WeightKind::kNorm1), DType::kF32,
                               dev, stream));
        PDSIM_ASSIGN_OR_RETURN(
            L.norm2, generated(seed, norm_weight_layout(whole, l, WeightKind::kNorm2), DType::kF32,
                               dev, stream));
    }
    PDSIM_ASSIGN_OR_RETURN(weights_->embedding,
                           generated(seed, embedding_layout(whole), DType::kBF16, dev, stream));
    PDSIM_ASSIGN_OR_RETURN(weights_->lm_head, generated(seed, lm_head_weight_layout(whole),
                                                        DType::kBF16, dev, stream));
    PDSIM_ASSIGN_OR_RETURN(weights_->final_norm,
                           generated(seed, norm_weight_layout(whole, -1, WeightKind::kFinalNorm),
                                     DType::kF32, dev, stream));
    return {};
}

size_t CudaSyntheticModel::weight_bytes() const {
    return static_cast<size_t>(weight_memory_.total);
}

attn::LayerSpec CudaSyntheticModel::layer_spec(int layer) const {
    return attn::LayerSpec{layer, hq_, hkv_, cfg_.head_dim, 0, 0.f};
}

Status CudaSyntheticModel::check_call(attn::AttentionBackend& backend,
                                      const kv::KVPool& pool) const {
    const runtime::Device want{DeviceKind::kCuda, options_.device};
    runtime::Stream& stream = backend.stream();
    if (stream.device() != want) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "backend '{}': compute stream {} is on {}:{}, the model is on cuda:{}",
                           backend.name(), stream.name(),
                           runtime::device_kind_name(stream.device().kind), stream.device().index,
                           options_.device);
    }
    PDSIM_RETURN_IF_ERROR(runtime::cuda::native_stream(stream).status());
    if (pool.device() != want) {
        return PDSIM_ERROR(
            StatusCode::kInvalidArgument, "pool: memory on {}:{}, the model is on cuda:{}",
            runtime::device_kind_name(pool.device().kind), pool.device().index, options_.device);
    }
    if (pool.num_layers() < cfg_.num_layers) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "pool: {} layers, the model has {}",
                           pool.num_layers(), cfg_.num_layers);
    }
    if (stream.is_capturing()) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "stream {} is capturing a graph: the model captures its own "
                           "(capture_decode_graphs)",
                           stream.name());
    }
    return {};
}

Status CudaSyntheticModel::upload_inputs(const StepBatch& b, runtime::Stream& stream) {
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, runtime::cuda::native_stream(stream));
    PDSIM_ASSIGN_OR_RETURN(attn::cuda::PinnedStagingRing::Slot slot,
                           staging_->acquire(runtime::kDefaultWaitTimeout));
    const InputLayout& l = layout_.input;
    auto* host = reinterpret_cast<int32_t*>(slot.data.data());
    pack_inputs(b, l, std::span<int32_t>(host, static_cast<size_t>(l.total)));
    int32_t* dev = at<int32_t>(layout_.inputs);
    const int64_t T = static_cast<int64_t>(b.tokens.size());
    const int64_t bs = static_cast<int64_t>(b.seq_lens.size());
    const struct {
        int64_t offset, count;
    } regions[] = {{l.tokens, T}, {l.out_cache_loc, T}, {l.seq_lens, bs}, {l.qo_indptr, bs + 1}};
    bool enqueued = false;
    for (const auto& r : regions) {
        if (r.count == 0) continue;
        const cudaError_t rc = cudaMemcpyAsync(dev + r.offset, host + r.offset,
                                               static_cast<size_t>(r.count) * sizeof(int32_t),
                                               cudaMemcpyHostToDevice, s);
        if (rc != cudaSuccess) {
            // A copy already enqueued still reads the slot: keep it in flight.
            if (enqueued) {
                staging_->commit(slot.index, s).ignore_error();
            } else {
                staging_->abandon(slot.index);
            }
            CUDA_CHECK(rc);
        }
        enqueued = true;
    }
    return staging_->commit(slot.index, s);
}

Status CudaSyntheticModel::record_timing(int index, runtime::Stream& stream) {
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, runtime::cuda::native_stream(stream));
    CUDA_CHECK(
        cudaEventRecord(static_cast<cudaEvent_t>(timing_events_[static_cast<size_t>(index)]), s));
    return {};
}

Status CudaSyntheticModel::enqueue_body(int rows, int requests, attn::ForwardMode mode,
                                        attn::AttentionBackend& backend, kv::KVPool& pool,
                                        bool save_kv_cache, bool timed) {
    runtime::Stream& stream = backend.stream();
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, runtime::cuda::native_stream(stream));
    const runtime::Device device{DeviceKind::kCuda, options_.device};
    const int H = cfg_.hidden, D = cfg_.head_dim, I = inter_, V = cfg_.vocab;
    const int hq = hq_, hkv = hkv_;
    const InputLayout& in = layout_.input;
    const int32_t* tokens = at<int32_t>(layout_.inputs) + in.tokens;
    const int32_t* locs = at<int32_t>(layout_.inputs) + in.out_cache_loc;
    const int32_t* seq_lens = at<int32_t>(layout_.inputs) + in.seq_lens;
    const int32_t* qo_indptr = at<int32_t>(layout_.inputs) + in.qo_indptr;
    bf16_t* hidden = at<bf16_t>(layout_.hidden);
    bf16_t* normed = at<bf16_t>(layout_.normed);
    bf16_t* qkv = at<bf16_t>(layout_.qkv);
    bf16_t* q = at<bf16_t>(layout_.q);
    bf16_t* k = at<bf16_t>(layout_.k);
    bf16_t* v = at<bf16_t>(layout_.v);
    bf16_t* attn_out = at<bf16_t>(layout_.attn);
    bf16_t* gate_up = at<bf16_t>(layout_.gate_up);
    bf16_t* act = at<bf16_t>(layout_.act);
    int32_t* positions = at<int32_t>(layout_.positions);
    const size_t bf16 = sizeof(bf16_t);

    if (timed) PDSIM_RETURN_IF_ERROR(record_timing(0, stream));
    PDSIM_RETURN_IF_ERROR(embedding_gather(
        {weights_->embedding.as<const bf16_t>(), tokens, hidden, H, rows, H, V}, stream));
    PDSIM_RETURN_IF_ERROR(token_positions({qo_indptr, seq_lens, requests, positions}, stream));

    // The backend's views of this forward's rows ([rows][heads][D], bf16, on the device).
    const runtime::ConstTensorView q_view =
        runtime::make_view(static_cast<const void*>(q), DType::kBF16, device, {rows, hq, D});
    const runtime::ConstTensorView k_view =
        runtime::make_view(static_cast<const void*>(k), DType::kBF16, device, {rows, hkv, D});
    const runtime::ConstTensorView v_view =
        runtime::make_view(static_cast<const void*>(v), DType::kBF16, device, {rows, hkv, D});
    const runtime::TensorView out_view =
        runtime::make_view(static_cast<void*>(attn_out), DType::kBF16, device, {rows, hq, D});
    const runtime::ConstTensorView loc_view =
        runtime::make_view(static_cast<const void*>(locs), DType::kI32, device, {rows});

    for (int l = 0; l < cfg_.num_layers; ++l) {
        const Weights::Layer& W = weights_->layers[static_cast<size_t>(l)];
        if (timed) PDSIM_RETURN_IF_ERROR(record_timing(1 + 2 * l, stream));
        PDSIM_RETURN_IF_ERROR(rms_norm(
            {hidden, H, W.norm1.as<const float>(), normed, H, rows, H, cfg_.rms_eps}, stream));
        if (sliced_) {
            PDSIM_RETURN_IF_ERROR(enqueue_sliced_qkv(l, rows, stream));
        } else {
            PDSIM_RETURN_IF_ERROR(
                qkv_gemm_->run(normed, W.qkv.as<const bf16_t>(), qkv, rows, stream));
        }
        RopeParams rope{};
        // RoPE on the fused rows, or (sliced: q, k and v are already split) on q and k.
        rope.q = sliced_ ? q : qkv;
        rope.q_ld = sliced_ ? q_cols_ : qkv_cols_;
        rope.q_heads = hq;
        rope.k = sliced_ ? k : qkv + q_cols_;
        rope.k_ld = sliced_ ? kv_cols_ : qkv_cols_;
        rope.k_heads = hkv;
        rope.head_dim = D;
        rope.positions = positions;
        rope.cos_sin = rope_cos_sin_.as<const float>();
        rope.max_positions = options_.max_positions;
        rope.rows = rows;
        PDSIM_RETURN_IF_ERROR(apply_rope(rope, stream));
        if (!sliced_) {
            // The backend takes contiguous q, k, v: split the fused rows (strided 2D copies).
            const size_t pitch = static_cast<size_t>(qkv_cols_) * bf16;
            CUDA_CHECK(cudaMemcpy2DAsync(q, static_cast<size_t>(q_cols_) * bf16, qkv, pitch,
                                         static_cast<size_t>(q_cols_) * bf16,
                                         static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, s));
            CUDA_CHECK(cudaMemcpy2DAsync(k, static_cast<size_t>(kv_cols_) * bf16, qkv + q_cols_,
                                         pitch, static_cast<size_t>(kv_cols_) * bf16,
                                         static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, s));
            CUDA_CHECK(cudaMemcpy2DAsync(v, static_cast<size_t>(kv_cols_) * bf16,
                                         qkv + q_cols_ + kv_cols_, pitch,
                                         static_cast<size_t>(kv_cols_) * bf16,
                                         static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, s));
        }
        if (!save_kv_cache) {
            // The fused-prewrite path: the KV lands before the attention call (which then records
            // first, by the backend's record rule).
            PDSIM_ASSIGN_OR_RETURN(kv::KVLayerView lv, pool.layer_view(l));
            attn::cuda::KvAppendParams kp;
            kp.k = k;
            kp.v = v;
            kp.src_dtype = DType::kBF16;
            kp.k_cache = lv.k.data;
            kp.v_cache = lv.v.data;
            kp.cache_dtype = lv.dtype;
            kp.num_slots = static_cast<int64_t>(lv.num_pages) * lv.page_size;
            kp.num_kv_heads = hkv;
            kp.head_dim = D;
            kp.out_cache_loc = locs;
            kp.n = rows;
            PDSIM_RETURN_IF_ERROR(attn::cuda::kv_append(kp, s));
        }
        PDSIM_RETURN_IF_ERROR(backend.forward(q_view, k_view, v_view, layer_spec(l), loc_view, pool,
                                              mode, requests, out_view, save_kv_cache));
        if (sliced_) {
            PDSIM_RETURN_IF_ERROR(enqueue_sliced_reduction(attn_out, q_cols_, o_slice_cols_,
                                                           W.o_proj.as<const bf16_t>(), *o_gemm_,
                                                           rows, stream));
        } else {
            PDSIM_RETURN_IF_ERROR(
                o_gemm_->run(attn_out, W.o_proj.as<const bf16_t>(), normed, rows, stream));
            PDSIM_RETURN_IF_ERROR(residual_add({hidden, H, normed, H, rows, H}, stream));
        }
        PDSIM_RETURN_IF_ERROR(rms_norm(
            {hidden, H, W.norm2.as<const float>(), normed, H, rows, H, cfg_.rms_eps}, stream));
        if (sliced_) {
            // Per slice: its gate | up columns, slice-major in gate_up, then silu * up straight
            // into the down GEMM's slice-major input.
            bf16_t* slice_in = at<bf16_t>(layout_.slice_in);
            const int64_t is = down_slice_cols_, gus = gate_up_slice_cols_;
            for (int sl = 0; sl < local_slices_; ++sl) {
                bf16_t* out = gate_up + sl * rows * gus;
                PDSIM_RETURN_IF_ERROR(gate_up_gemm_->run(
                    normed, W.gate_up.as<const bf16_t>() + sl * gus * H, out, rows, stream));
                PDSIM_RETURN_IF_ERROR(silu_mul(
                    {out, gus, slice_in + sl * rows * is, is, rows, static_cast<int>(is)}, stream));
            }
            PDSIM_RETURN_IF_ERROR(enqueue_sliced_reduction(
                nullptr, 0, is, W.down.as<const bf16_t>(), *down_gemm_, rows, stream));
        } else {
            PDSIM_RETURN_IF_ERROR(
                gate_up_gemm_->run(normed, W.gate_up.as<const bf16_t>(), gate_up, rows, stream));
            PDSIM_RETURN_IF_ERROR(
                silu_mul({gate_up, 2 * static_cast<int64_t>(I), act, I, rows, I}, stream));
            PDSIM_RETURN_IF_ERROR(
                down_gemm_->run(act, W.down.as<const bf16_t>(), normed, rows, stream));
            PDSIM_RETURN_IF_ERROR(residual_add({hidden, H, normed, H, rows, H}, stream));
        }
        if (timed) PDSIM_RETURN_IF_ERROR(record_timing(2 + 2 * l, stream));
    }

    // Each request's last token -> final norm -> LM head (fp32 logits) -> greedy argmax.
    bf16_t* last = at<bf16_t>(layout_.last);
    bf16_t* last_normed = at<bf16_t>(layout_.last_normed);
    float* logits = at<float>(layout_.logits);
    PDSIM_RETURN_IF_ERROR(gather_last_tokens({hidden, H, qo_indptr, requests, last, H, H}, stream));
    PDSIM_RETURN_IF_ERROR(rms_norm({last, H, weights_->final_norm.as<const float>(), last_normed, H,
                                    requests, H, cfg_.rms_eps},
                                   stream));
    PDSIM_RETURN_IF_ERROR(
        lm_gemm_->run(last_normed, weights_->lm_head.as<const bf16_t>(), logits, requests, stream));
    PDSIM_RETURN_IF_ERROR(
        argmax({logits, DType::kF32, V, requests, V, at<int32_t>(layout_.sampled)}, stream));
    if (timed) {
        PDSIM_RETURN_IF_ERROR(record_timing(static_cast<int>(timing_events_.size()) - 1, stream));
    }
    return {};
}

Status CudaSyntheticModel::enqueue_sliced_qkv(int layer, int rows, runtime::Stream& stream) {
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, runtime::cuda::native_stream(stream));
    const Weights::Layer& W = weights_->layers[static_cast<size_t>(layer)];
    const int64_t H = cfg_.hidden, D = cfg_.head_dim, qs = o_slice_cols_, cols = qkv_slice_cols_;
    const bf16_t* normed = at<bf16_t>(layout_.normed);
    bf16_t* qkv = at<bf16_t>(layout_.qkv);
    bf16_t* q = at<bf16_t>(layout_.q);
    bf16_t* k = at<bf16_t>(layout_.k);
    bf16_t* v = at<bf16_t>(layout_.v);
    const size_t bf16 = sizeof(bf16_t), pitch = static_cast<size_t>(cols) * bf16;
    const size_t height = static_cast<size_t>(rows);
    // Slice sl's [q | k | v] rows (its q heads, its one KV head), then into q, k and v at the
    // slice's heads.
    for (int sl = 0; sl < local_slices_; ++sl) {
        bf16_t* out = qkv + sl * rows * cols;
        PDSIM_RETURN_IF_ERROR(
            qkv_gemm_->run(normed, W.qkv.as<const bf16_t>() + sl * cols * H, out, rows, stream));
        CUDA_CHECK(cudaMemcpy2DAsync(q + sl * qs, static_cast<size_t>(q_cols_) * bf16, out, pitch,
                                     static_cast<size_t>(qs) * bf16, height,
                                     cudaMemcpyDeviceToDevice, s));
        CUDA_CHECK(cudaMemcpy2DAsync(k + sl * D, static_cast<size_t>(kv_cols_) * bf16, out + qs,
                                     pitch, static_cast<size_t>(D) * bf16, height,
                                     cudaMemcpyDeviceToDevice, s));
        CUDA_CHECK(cudaMemcpy2DAsync(v + sl * D, static_cast<size_t>(kv_cols_) * bf16, out + qs + D,
                                     pitch, static_cast<size_t>(D) * bf16, height,
                                     cudaMemcpyDeviceToDevice, s));
    }
    return {};
}

Status CudaSyntheticModel::enqueue_sliced_reduction(const bf16_t* x, int64_t x_cols,
                                                    int64_t slice_cols, const bf16_t* weights,
                                                    BatchInvariantGemm& gemm, int rows,
                                                    runtime::Stream& stream) {
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, runtime::cuda::native_stream(stream));
    const int64_t H = cfg_.hidden;
    bf16_t* slice_in = at<bf16_t>(layout_.slice_in);
    float* partials = at<float>(layout_.partials);
    const size_t bf16 = sizeof(bf16_t);
    if (x != nullptr) {
        // Slice-major copies of x's slices, so each GEMM reads a contiguous [rows][slice_cols].
        for (int sl = 0; sl < local_slices_; ++sl) {
            CUDA_CHECK(cudaMemcpy2DAsync(slice_in + sl * rows * slice_cols,
                                         static_cast<size_t>(slice_cols) * bf16,
                                         x + sl * slice_cols, static_cast<size_t>(x_cols) * bf16,
                                         static_cast<size_t>(slice_cols) * bf16,
                                         static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, s));
        }
    }
    for (int sl = 0; sl < local_slices_; ++sl) {
        PDSIM_RETURN_IF_ERROR(gemm.run(slice_in + sl * rows * slice_cols,
                                       weights + sl * H * slice_cols, partials + sl * rows * H,
                                       rows, stream));
    }
    const float* all = partials;
    if (tp_size_ > 1) {
        PDSIM_ASSIGN_OR_RETURN(all, exchange_partials(rows, stream));
    }
    SliceReduceParams reduce;
    reduce.partials = all;
    reduce.slice_stride = static_cast<int64_t>(rows) * H;
    reduce.partial_ld = H;
    reduce.slices = slices_;
    reduce.residual = at<bf16_t>(layout_.hidden);
    reduce.residual_ld = H;
    reduce.rows = rows;
    reduce.hidden = static_cast<int>(H);
    return slice_reduce_residual(reduce, stream);
}

StatusOr<const float*> CudaSyntheticModel::exchange_partials(int rows, runtime::Stream& stream) {
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, runtime::cuda::native_stream(stream));
    const size_t mine = static_cast<size_t>(local_slices_) * static_cast<size_t>(rows) *
                        static_cast<size_t>(cfg_.hidden);
    float* gathered = at<float>(layout_.gathered);
    if (device_tp_ != nullptr) {
        // Rank-major, as the host gather: slice g of the group lands at g * rows * hidden.
        if (Status st =
                device_tp_->enqueue_allgather(at<float>(layout_.partials), mine, gathered, stream);
            !st.ok()) {
            tp_broken_ = st.to_string();
            return st.with_context(
                fmt::format("TP rank {} of {}: the {} exchange of the "
                            "projection partials",
                            tp_rank_, tp_size_, device_tp_->name()));
        }
        return static_cast<const float*>(gathered);
    }
    // The previous exchange's copy out of pinned_gathered_ is ordered before this one's copy into
    // pinned_partials_ and finished by the synchronize below, before the gather writes it.
    CUDA_CHECK(cudaMemcpyAsync(pinned_partials_, at<float>(layout_.partials), mine * sizeof(float),
                               cudaMemcpyDeviceToHost, s));
    PDSIM_RETURN_IF_ERROR(stream.synchronize().with_context("the TP exchange's partials"));
    if (Status st = tp_->allgather(pinned_partials_, mine, pinned_gathered_); !st.ok()) {
        tp_broken_ = st.to_string();
        return st.with_context(fmt::format(
            "TP rank {} of {}: the exchange of the projection partials", tp_rank_, tp_size_));
    }
    // The peers' blocks from the host; this rank's own block is still on the device (the same
    // bytes as its copy in pinned_gathered_).
    for (int r = 0; r < tp_size_; ++r) {
        const size_t at_r = static_cast<size_t>(r) * mine;
        if (r == tp_rank_) {
            CUDA_CHECK(cudaMemcpyAsync(gathered + at_r, at<float>(layout_.partials),
                                       mine * sizeof(float), cudaMemcpyDeviceToDevice, s));
        } else {
            CUDA_CHECK(cudaMemcpyAsync(gathered + at_r, pinned_gathered_ + at_r,
                                       mine * sizeof(float), cudaMemcpyHostToDevice, s));
        }
    }
    return static_cast<const float*>(gathered);
}

Status CudaSyntheticModel::enqueue_output(runtime::Stream& stream, int requests,
                                          int32_t* next_tokens) {
    PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, runtime::cuda::native_stream(stream));
    CUDA_CHECK(cudaMemcpyAsync(pinned_tokens_, at<int32_t>(layout_.sampled),
                               static_cast<size_t>(requests) * sizeof(int32_t),
                               cudaMemcpyDeviceToHost, s));
    // The one host step: runs after the copy above (stream order) and before any later work on
    // the stream, so the next forward's copy cannot overwrite pinned_tokens_ under it.
    const int32_t* src = pinned_tokens_;
    std::shared_ptr<const TpGroupHealth> health =
        device_tp_ != nullptr ? device_tp_->health() : nullptr;
    PDSIM_RETURN_IF_ERROR(stream.enqueue([src, requests, next_tokens, health]() -> Status {
        // A device group that broke may have aborted a gather of this forward: its tokens were
        // computed from garbage partials.
        if (health != nullptr) {
            PDSIM_RETURN_IF_ERROR(health->status().with_context("the TP exchange"));
        }
        for (int i = 0; i < requests; ++i) {
            if (src[i] < 0) {
                return PDSIM_ERROR(StatusCode::kDataLoss,
                                   "request {} of the batch: non-finite logits", i);
            }
            next_tokens[i] = src[i];
        }
        return Status();
    }));
    PDSIM_RETURN_IF_ERROR(stream.record(*forward_done_));
    forwarded_ = true;
    return {};
}

Status CudaSyntheticModel::forward(const StepBatch& batch, attn::AttentionBackend& backend,
                                   kv::KVPool& pool, int32_t* next_tokens, bool save_kv_cache) {
    if (tp_broken_.empty() && device_tp_ != nullptr) {
        if (Status health = device_tp_->health()->status(); !health.ok()) {
            tp_broken_ = health.to_string();
        }
    }
    if (!tp_broken_.empty()) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "TP rank {} of {}: an earlier exchange failed ({}); this model cannot "
                           "forward again",
                           tp_rank_, tp_size_, tp_broken_);
    }
    PDSIM_RETURN_IF_ERROR(check_call(backend, pool));
    PDSIM_RETURN_IF_ERROR(
        check_step_batch(batch, cfg_, options_, {pool.num_pages(), pool.page_size()}));
    const int bs = static_cast<int>(batch.seq_lens.size());
    const int rows = static_cast<int>(batch.tokens.size());
    last_bucket_ = 0;
    if (bs == 0) return {};
    if (next_tokens == nullptr) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "next_tokens: null");
    }
    if (!save_kv_cache) {
        const auto* mha = dynamic_cast<const kv::MHATokenToKVPool*>(&pool);
        if (mha == nullptr || mha->num_kv_heads() != hkv_ || mha->head_dim() != cfg_.head_dim ||
            mha->v_head_dim() != cfg_.head_dim) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "pool: the prewrite path (save_kv_cache=false) needs an MHA pool of "
                               "{} KV heads x {} dims",
                               hkv_, cfg_.head_dim);
        }
    }
    CUDA_CHECK(cudaSetDevice(options_.device));
    runtime::Stream& stream = backend.stream();
    Status st = [&]() -> Status {
        if (graphs_enabled_ && !graphs_.empty() && attn::is_decode(batch.mode) && save_kv_cache &&
            &backend == graph_backend_ && &pool == graph_pool_ &&
            batch.page_table_stride <= graph_max_pages_) {
            if (const std::optional<int> bucket = choose_bucket(graph_buckets_, bs)) {
                return replay_decode(batch, *bucket, backend, next_tokens);
            }
        }
        PDSIM_RETURN_IF_ERROR(backend.init_forward_metadata(to_forward_batch(batch)));
        PDSIM_RETURN_IF_ERROR(upload_inputs(batch, stream));
        PDSIM_RETURN_IF_ERROR(
            enqueue_body(rows, bs, batch.mode, backend, pool, save_kv_cache, timing_enabled_));
        if (timing_enabled_) {
            timed_forward_ = true;
            timed_graph_ = false;
        }
        return enqueue_output(stream, bs, next_tokens);
    }();
    if (!st.ok()) {
        // Part of the forward may be queued and reads the workspace: the destructor waits for
        // this event.
        stream.record(*forward_done_).ignore_error();
        forwarded_ = true;
        if (tp_size_ > 1 && tp_broken_.empty()) tp_broken_ = "a forward failed: " + st.to_string();
    }
    return st;
}

Status CudaSyntheticModel::replay_decode(const StepBatch& batch, int bucket,
                                         attn::AttentionBackend& backend, int32_t* next_tokens) {
    runtime::Stream& stream = backend.stream();
    PDSIM_ASSIGN_OR_RETURN(StepBatch padded, pad_decode_batch(batch, bucket));
    if (!skip_graph_refresh_) {
        PDSIM_RETURN_IF_ERROR(
            backend.init_forward_metadata_replay_cuda_graph(to_forward_batch(padded)));
    }
    PDSIM_RETURN_IF_ERROR(upload_inputs(padded, stream));
    const int last_event = static_cast<int>(timing_events_.size()) - 1;
    if (timing_enabled_) PDSIM_RETURN_IF_ERROR(record_timing(0, stream));
    PDSIM_RETURN_IF_ERROR(graphs_.at(bucket)->launch(stream));
    if (timing_enabled_) PDSIM_RETURN_IF_ERROR(record_timing(last_event, stream));
    if (timing_enabled_) {
        timed_forward_ = true;
        timed_graph_ = true;
    }
    last_bucket_ = bucket;
    return enqueue_output(stream, static_cast<int>(batch.seq_lens.size()), next_tokens);
}

Status CudaSyntheticModel::capture_decode_graphs(attn::AttentionBackend& backend, kv::KVPool& pool,
                                                 const DecodeGraphOptions& options) {
    PDSIM_RETURN_IF_ERROR(check_call(backend, pool));
    std::vector<int> buckets =
        options.buckets.empty() ? default_decode_buckets(options_.max_bs) : options.buckets;
    PDSIM_RETURN_IF_ERROR(check_decode_buckets(buckets, options_.max_bs));
    if (tp_size_ > 1) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition, "tp {}: {}; decode runs eagerly",
                           tp_size_,
                           device_tp_ == nullptr
                               ? "a decode graph cannot hold the host TP exchange (a host round "
                                 "trip per projection)"
                               : "decode graphs with the device TP exchange are not built (every "
                                 "rank of the group would have to capture and replay in step)");
    }
    if (options.max_pages_per_seq < 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "options.max_pages_per_seq {} must be >= 0", options.max_pages_per_seq);
    }
    const int max_pages = options.max_pages_per_seq > 0
                              ? options.max_pages_per_seq
                              : (options_.max_positions + pool.page_size() - 1) / pool.page_size();
    CUDA_CHECK(cudaSetDevice(options_.device));
    runtime::Stream& stream = backend.stream();
    PDSIM_RETURN_IF_ERROR(stream.synchronize());  // nothing may still run the old graphs
    graphs_.clear();
    graph_buckets_.clear();
    graph_backend_ = nullptr;
    graph_pool_ = nullptr;

    attn::GraphStateExtras extras;
    extras.max_pages_per_seq = max_pages;
    const int32_t* seq_lens_buf = at<int32_t>(layout_.inputs) + layout_.input.seq_lens;
    PDSIM_RETURN_IF_ERROR(
        attn::init_backend_cuda_graph_state(backend, buckets.back(), seq_lens_buf, extras));

    std::map<int, std::unique_ptr<runtime::Graph>> graphs;
    auto capture_one = [&](int bucket) -> Status {
        const StepBatch padding = padding_decode_batch(bucket);
        const attn::ForwardBatch fb = to_forward_batch(padding);
        PDSIM_RETURN_IF_ERROR(
            backend.init_forward_metadata_capture_cuda_graph(bucket, attn::ForwardMode::kDecode));
        PDSIM_RETURN_IF_ERROR(backend.init_forward_metadata_replay_cuda_graph(fb));
        PDSIM_RETURN_IF_ERROR(upload_inputs(padding, stream));
        // Warm-up outside the capture, on the graph metadata: loads every kernel and checks every
        // GEMM row count, so nothing is done for the first time inside the capture.
        PDSIM_RETURN_IF_ERROR(enqueue_body(bucket, bucket, attn::ForwardMode::kDecode, backend,
                                           pool, /*save_kv_cache=*/true, /*timed=*/false));
        PDSIM_RETURN_IF_ERROR(stream.synchronize().with_context("decode graph warm-up"));
        PDSIM_RETURN_IF_ERROR(stream.begin_capture());
        const Status body = enqueue_body(bucket, bucket, attn::ForwardMode::kDecode, backend, pool,
                                         /*save_kv_cache=*/true, /*timed=*/false);
        StatusOr<std::unique_ptr<runtime::Graph>> graph = stream.end_capture();
        PDSIM_RETURN_IF_ERROR(body.with_context("decode graph capture"));
        PDSIM_RETURN_IF_ERROR(graph.status());
        graphs[bucket] = std::move(*graph);
        return {};
    };
    for (int bucket : buckets) {
        const Status st = capture_one(bucket);
        if (!st.ok()) {
            backend.use_eager_metadata();
            return st.with_context(fmt::format("decode graph bucket {}", bucket));
        }
    }
    backend.use_eager_metadata();
    PDSIM_RETURN_IF_ERROR(stream.synchronize());
    graphs_ = std::move(graphs);
    graph_buckets_ = std::move(buckets);
    graph_backend_ = &backend;
    graph_pool_ = &pool;
    graph_max_pages_ = max_pages;
    return {};
}

std::string CudaSyntheticModel::tp_exchange() const {
    if (tp_size_ == 1) return "none";
    return device_tp_ != nullptr ? device_tp_->name() : "host";
}

StatusOr<ForwardTiming> CudaSyntheticModel::last_forward_timing() const {
    if (!timed_forward_) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "no timed forward: set_layer_timing(true) before the forward");
    }
    CUDA_CHECK(cudaSetDevice(options_.device));
    auto ev = [&](size_t i) { return static_cast<cudaEvent_t>(timing_events_[i]); };
    const size_t last = timing_events_.size() - 1;
    CUDA_CHECK(cudaEventSynchronize(ev(last)));
    auto since_begin = [&](size_t i) -> StatusOr<float> {
        float ms = 0.f;
        CUDA_CHECK(cudaEventElapsedTime(&ms, ev(0), ev(i)));
        return ms;
    };
    ForwardTiming t;
    t.graph = timed_graph_;
    PDSIM_ASSIGN_OR_RETURN(t.total_ms, since_begin(last));
    if (!timed_graph_) {
        for (int l = 0; l < cfg_.num_layers; ++l) {
            PDSIM_ASSIGN_OR_RETURN(float b, since_begin(static_cast<size_t>(1 + 2 * l)));
            PDSIM_ASSIGN_OR_RETURN(float e, since_begin(static_cast<size_t>(2 + 2 * l)));
            t.layer_begin_ms.push_back(b);
            t.layer_end_ms.push_back(e);
        }
    }
    return t;
}

StatusOr<std::vector<float>> CudaSyntheticModel::copy_last_logits(int rows) const {
    if (rows < 0 || rows > options_.max_bs) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "rows {} outside [0, max_bs {}]", rows,
                           options_.max_bs);
    }
    std::vector<float> out(static_cast<size_t>(rows) * static_cast<size_t>(cfg_.vocab));
    if (!out.empty()) {
        PDSIM_RETURN_IF_ERROR(
            workspace_.copy_to_host(out.data(), out.size() * sizeof(float), layout_.logits));
    }
    return out;
}

StatusOr<std::vector<float>> CudaSyntheticModel::copy_last_final_hidden(int rows) const {
    if (rows < 0 || rows > options_.max_bs) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "rows {} outside [0, max_bs {}]", rows,
                           options_.max_bs);
    }
    std::vector<bf16_t> bits(static_cast<size_t>(rows) * static_cast<size_t>(cfg_.hidden));
    if (!bits.empty()) {
        PDSIM_RETURN_IF_ERROR(workspace_.copy_to_host(bits.data(), bits.size() * sizeof(bf16_t),
                                                      layout_.last_normed));
    }
    std::vector<float> out(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) out[i] = bf16_to_float(bits[i]);
    return out;
}

}  // namespace pdsim::model::cuda

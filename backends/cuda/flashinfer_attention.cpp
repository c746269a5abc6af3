// FlashInferAttention (see flashinfer_attention.h): configuration checks, the device workspace,
// plan() (CSR + work list into a pinned slot, one async copy) and run() (the launch arguments of
// flashinfer_kernels.h). Host code against cudart; the kernels live in flashinfer_*_hd*.cu.
#include "backends/cuda/flashinfer_attention.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "backends/cuda/cuda_pinned_memory.h"
#include "backends/cuda/cuda_stream.h"
#include "backends/cuda/flashinfer_kernels.h"
#include "common/align.h"
#include "common/device_health.h"

namespace pdsim::attn::cuda {

static_assert(detail::kExtendKernelCtaTileQ == kExtendCtaTileQ,
              "the extend kernels must be instantiated with the tile the plan cuts");

namespace {

using runtime::cuda::ScopedDevice;

Status cuda_status(cudaError_t rc, std::string_view what) {
    if (rc == cudaSuccess) return ok_status();
    const StatusCode code =
        rc == cudaErrorMemoryAllocation ? StatusCode::kResourceExhausted : StatusCode::kUnavailable;
    return Status(code, fmt::format("{} failed: {} ({})", what, cudaGetErrorString(rc),
                                    cudaGetErrorName(rc)));
}

Status launch_status(const std::string& error, std::string_view what) {
    if (error.empty()) return ok_status();
    const StatusCode code =
        error.rfind("cuda: ", 0) == 0 ? StatusCode::kUnavailable : StatusCode::kInternal;
    return Status(code, fmt::format("{}: {}", what, error));
}

// Vector loads read 16 bytes (8 bf16) at a time: rows and heads must start on 16-byte boundaries.
Status check_device_pointer(const void* p, std::string_view name) {
    if (p == nullptr)
        return Status(StatusCode::kInvalidArgument, fmt::format("args.{}: null", name));
    if (!is_aligned(p, 16)) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("args.{}: {} is not 16-byte aligned", name, p));
    }
    return ok_status();
}

Status check_stride(int64_t stride, std::string_view name) {
    if (stride < 8 || stride % 8 != 0 || stride > std::numeric_limits<int32_t>::max()) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("args.{}: {} must be a positive multiple of 8 elements below "
                                  "2^31",
                                  name, stride));
    }
    return ok_status();
}

}  // namespace

FlashInferAttention::FlashInferAttention(const FlashInferConfig& config,
                                         const MetadataLayout& layout)
    : config_(config), layout_(layout) {}

FlashInferAttention::~FlashInferAttention() {
    ScopedDevice device(config_.device);
    staging_.reset();
    // cudaFree waits for the device: not on a hung one (common/device_health.h).
    if (workspace_ != nullptr && !device_hung(config_.device)) cudaFree(workspace_);
}

StatusOr<std::unique_ptr<FlashInferAttention>> FlashInferAttention::create(
    const FlashInferConfig& config, std::unique_ptr<PinnedMemory> pinned) {
    PDSIM_RETURN_IF_ERROR(check_shape(config.shape, config.kind));
    if (config.staging_slots < 1) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("config.staging_slots: {} must be >= 1", config.staging_slots));
    }
    if (config.staging_timeout.count() < 0) {
        return Status(StatusCode::kInvalidArgument, "config.staging_timeout: must be >= 0");
    }
    if (config.num_pages < 0) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("config.num_pages: {} must be >= 0", config.num_pages));
    }
    if (config.device < 0) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("config.device: {} must be >= 0", config.device));
    }
    // FlashInfer addresses a batch's KV tokens (kv_indptr[i] * page_size + t) in 32 bits.
    if (static_cast<int64_t>(config.capacity.max_pages) * config.shape.page_size >
        std::numeric_limits<int32_t>::max()) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("config.capacity.max_pages: {} pages of {} tokens exceed the "
                                  "2^31 KV tokens per batch FlashInfer can index",
                                  config.capacity.max_pages, config.shape.page_size));
    }
    PDSIM_ASSIGN_OR_RETURN(MetadataLayout layout, make_metadata_layout(config.kind, config.capacity,
                                                                       config.shape.group_size()));
    std::unique_ptr<FlashInferAttention> self(new FlashInferAttention(config, layout));
    ScopedDevice device(config.device);
    PDSIM_RETURN_IF_ERROR(device.status());
    PDSIM_RETURN_IF_ERROR(
        cuda_status(cudaMalloc(&self->workspace_, layout.total_bytes),
                    fmt::format("cudaMalloc({} bytes of attention metadata)", layout.total_bytes)));
    // Defined contents from the start: a graph replayed before its first plan reads zeros (an
    // all-masked launch) rather than garbage.
    // cudaMemset runs on the legacy default stream, which callers' non-blocking streams do not
    // wait for: finish it here.
    PDSIM_RETURN_IF_ERROR(cuda_status(cudaMemset(self->workspace_, 0, layout.total_bytes),
                                      "cudaMemset(attention metadata)"));
    PDSIM_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize"));
    if (pinned == nullptr) pinned = make_cuda_pinned_memory();
    PDSIM_ASSIGN_OR_RETURN(
        self->staging_,
        PinnedStagingRing::create(std::move(pinned), config.staging_slots, layout.total_bytes));
    return self;
}

Status FlashInferAttention::plan(const PagedBatch& batch, void* stream) {
    ScopedDevice device(config_.device);
    PDSIM_RETURN_IF_ERROR(device.status());
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    PDSIM_RETURN_IF_ERROR(
        cuda_status(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture),
                    "cudaStreamIsCapturing"));
    if (capture != cudaStreamCaptureStatusNone) {
        return Status(StatusCode::kFailedPrecondition,
                      "plan: the stream is capturing a graph; plan before capturing (and before "
                      "each replay), outside the capture");
    }
    // Validate and convert first: a bad batch fails without waiting for a slot.
    PDSIM_ASSIGN_OR_RETURN(PagedKvCsr csr,
                           build_paged_kv_csr(batch, config_.shape.page_size, config_.num_pages));
    PDSIM_ASSIGN_OR_RETURN(PinnedStagingRing::Slot slot,
                           staging_->acquire(config_.staging_timeout));
    auto info = write_plan_metadata(csr, config_.shape.group_size(), layout_, config_.cuda_graph,
                                    slot.data);
    if (!info.ok()) {
        staging_->abandon(slot.index);
        return info.status();
    }
    if (!config_.cuda_graph && info->num_work == 0) {  // an empty eager batch: nothing to read
        staging_->abandon(slot.index);
        plan_ = *info;
        planned_ = true;
        return ok_status();
    }
    Status copied =
        cuda_status(cudaMemcpyAsync(workspace_, slot.data.data(), info->bytes_used,
                                    cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)),
                    "cudaMemcpyAsync(attention metadata)");
    if (!copied.ok()) {
        staging_->abandon(slot.index);
        return copied;
    }
    PDSIM_RETURN_IF_ERROR(staging_->commit(slot.index, stream));
    plan_ = *info;
    planned_ = true;
    return ok_status();
}

Status FlashInferAttention::run(const AttentionRunArgs& args, void* stream) const {
    if (!config_.cuda_graph && !planned_) {
        return Status(StatusCode::kFailedPrecondition, "run: no plan yet (call plan() first)");
    }
    const AttentionShape& shape = config_.shape;
    const bool mla = shape.is_mla();
    PDSIM_RETURN_IF_ERROR(check_device_pointer(args.q, "q"));
    if (mla) PDSIM_RETURN_IF_ERROR(check_device_pointer(args.q_pe, "q_pe"));
    PDSIM_RETURN_IF_ERROR(check_device_pointer(args.k_cache, "k_cache"));
    if (!mla) PDSIM_RETURN_IF_ERROR(check_device_pointer(args.v_cache, "v_cache"));
    PDSIM_RETURN_IF_ERROR(check_device_pointer(args.o, "o"));
    const int64_t contiguous_token = static_cast<int64_t>(shape.num_qo_heads) * shape.head_dim;
    const int64_t stride_token = args.q_stride_token != 0 ? args.q_stride_token : contiguous_token;
    const int64_t stride_head = args.q_stride_head != 0 ? args.q_stride_head : shape.head_dim;
    PDSIM_RETURN_IF_ERROR(check_stride(stride_token, "q_stride_token"));
    PDSIM_RETURN_IF_ERROR(check_stride(stride_head, "q_stride_head"));
    if (mla && (stride_token != contiguous_token || stride_head != shape.head_dim)) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("args.q_stride_token/q_stride_head: {}/{}; MLA decode takes a "
                                  "contiguous q ({}/{})",
                                  stride_token, stride_head, contiguous_token, shape.head_dim));
    }
    if (mla && args.sm_scale == 0.f) {
        return Status(StatusCode::kInvalidArgument,
                      "args.sm_scale: MLA needs the model's scale (1 / sqrt(qk_nope_head_dim + "
                      "rope_dim) in the absorbed form; DeepSeek-V3: 1 / sqrt(192)), not a default");
    }
    const float sm_scale =
        args.sm_scale != 0.f ? args.sm_scale : 1.f / std::sqrt(static_cast<float>(shape.head_dim));
    if (!std::isfinite(sm_scale)) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("args.sm_scale: {} is not finite", args.sm_scale));
    }

    const bool graph = config_.cuda_graph;
    detail::PagedKernelArgs k;
    k.q = args.q;
    k.q_pe = args.q_pe;
    k.k_cache = args.k_cache;
    k.v_cache = args.v_cache;
    k.o = args.o;
    k.q_stride_token = static_cast<int32_t>(stride_token);
    k.q_stride_head = static_cast<int32_t>(stride_head);
    k.sm_scale = sm_scale;
    k.num_qo_heads = static_cast<uint32_t>(shape.num_qo_heads);
    k.num_kv_heads = static_cast<uint32_t>(shape.num_kv_heads);
    k.page_size = static_cast<uint32_t>(shape.page_size);
    // Graph mode: a launch shape from the configuration only (the captured kernel's arguments).
    k.kv_batch_size = static_cast<uint32_t>(graph ? layout_.max_bs : plan_.kv_batch_size);
    k.padded_work = static_cast<uint32_t>(graph ? layout_.max_work : plan_.padded_work);
    k.num_tokens = static_cast<uint32_t>(graph ? layout_.max_tokens : plan_.num_tokens);
    if (k.padded_work == 0) return ok_status();  // an empty eager batch

    auto* base = static_cast<std::byte*>(workspace_);
    auto at = [base](size_t offset) { return reinterpret_cast<int32_t*>(base + offset); };
    k.qo_indptr = at(layout_.qo_indptr);
    k.kv_indptr = at(layout_.kv_indptr);
    k.kv_indices = at(layout_.kv_indices);
    k.kv_last_page_len = at(layout_.kv_last_page_len);
    k.request_indices = at(layout_.request_indices);
    k.qo_tile_indices = at(layout_.qo_tile_indices);
    k.kv_tile_indices = at(layout_.kv_tile_indices);
    k.o_indptr = at(layout_.o_indptr);
    k.kv_chunk_size = at(layout_.kv_chunk_size);
    k.block_valid_mask = graph ? reinterpret_cast<bool*>(base + layout_.block_valid_mask) : nullptr;

    ScopedDevice device(config_.device);
    PDSIM_RETURN_IF_ERROR(device.status());
    const bool decode = config_.kind == AttentionKind::kDecode;
    std::string error;
    if (mla) {
        error = detail::launch_paged_decode_mla(k, stream);
    } else if (shape.head_dim == 64) {
        error = decode ? detail::launch_paged_decode<64>(k, stream)
                       : detail::launch_paged_extend<64>(k, stream);
    } else {
        error = decode ? detail::launch_paged_decode<128>(k, stream)
                       : detail::launch_paged_extend<128>(k, stream);
    }
    return launch_status(error, mla      ? "FlashInfer paged MLA decode"
                                : decode ? "FlashInfer paged decode"
                                         : "FlashInfer paged extend");
}

}  // namespace pdsim::attn::cuda

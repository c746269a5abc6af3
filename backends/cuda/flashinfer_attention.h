// FlashInferAttention: pdsim's adapter over FlashInfer's FA2 paged-attention kernels (FlashInfer
// 0.7.4, fetched by scripts/fetch_flashinfer.sh; never committed). Plain C++: no CUDA or
// FlashInfer headers, so any translation unit may include it. FlashInfer's internal API (its
// params structs and launchers, which change between versions) stays behind the
// backends/cuda/flashinfer_*.cu translation units.
//
// What it computes. Causal softmax attention of bf16 queries over a paged bf16 KV cache, bf16
// output, no positional encoding in the kernel (pdsim applies RoPE itself), scale sm_scale:
//   decode: one query per request, attending to the request's seq_len KV tokens;
//   extend: q_len queries per request, the last q_len of its seq_len tokens, query j attending to
//           tokens [0, seq_len - q_len + j] (prefill, extend with a cached prefix, and each chunk
//           of a chunked prefill alike).
// GQA: query head h reads KV head h / group_size. KV layout NHD as pdsim's pools
// (backends/kv/kv_pool.h): per layer separate K and V buffers [num_pages][page_size]
// [num_kv_heads][head_dim]. Supported: head_dim 64 and 128; any page size; decode group sizes
// kDecodeGroupSizes (1, 2, 3, 4, 6, 8, 16), extend any group size (see check_shape()).
// MLA decode (kv_lora_rank 512 + rope 64 in pdsim's MLATokenToKVPool layout, any number of query
// heads): FlashInfer's CUDA-core MLA decode kernel (attention/decode.cuh,
// BatchDecodeWithPagedKVCacheKernelMLA, no CUTLASS), absorbed form: logits = q_nope . ckv +
// q_pe . kpe, output = softmax . ckv (the caller applies W_UV). MLA extend is not wrapped:
// FlashInfer's FA2 MLA prefill (attention/mla.cuh) is a separate, larger instantiation, and its
// other MLA kernels (mla_hopper.cuh, cutlass_mla.cuh) need sm90a or CUTLASS.
// Not supported, by design: fp32 KV (FlashInfer has no fp32 KV kernels; the caller rejects such
// pools), fp16 and fp8 KV (not instantiated: fp8 would double the kernels to compile), sliding
// windows, logits soft-cap, ALiBi, the LSE output and split-KV.
//
// Batch invariance. A request's output does not depend on the other requests of its batch, bit
// for bit: split-KV is never used (one CTA covers a request's whole KV: decode per request and
// KV head, MLA decode per request and 16 query heads, extend per query tile and KV head), and
// extend tiles are a fixed kExtendCtaTileQ = 128 packed rows cut per request, instead of
// FlashInfer's default of choosing the tile (16/64/128) from the batch's average query length.
// What still varies, on purpose: the KV tile of extend (NUM_MMA_KV) follows the GPU's shared
// memory, so results are reproducible per GPU model, not across models; decode and extend are
// different kernels, so a token computed by decode differs (within rounding) from the same token
// computed as an extend row. There is no non-invariant fast mode: the split-KV path would need
// partial-output buffers and a merge, and FlashInfer's own split heuristic depends on the batch.
// Small batches with long contexts therefore use fewer CTAs than the GPU has SMs (a fixed split
// size, batch-invariant too, is the natural next step).
//
// Planning and running. plan() takes a batch's host-side description (PagedBatch: seq_lens,
// q_lens, page table; see backends/cuda/flashinfer_plan.h), converts it to FlashInfer's CSR
// form and work list on the host, writes that into a pinned host slot of a PinnedStagingRing and
// enqueues one cudaMemcpyAsync of it to the adapter's device workspace on `stream`. run()
// launches the kernel on `stream`; its kernels read the metadata the latest plan() copied
// (stream order). Plan once per forward, run once per layer; plan and run on the same stream,
// and enqueue every run of a batch before planning the next (a run reads what the latest plan
// before it in stream order copied). The next batch may be planned while the previous one is
// still queued on the GPU: the device workspace is only overwritten in stream order, and a pinned
// slot is reused only after an event recorded after its copy has completed (plan() waits up to
// staging_timeout when all slots are in flight, then fails with kDeadlineExceeded).
// A mixed batch (extend and decode requests in one forward) is two adapters and two plans: run
// its decode requests through a decode plan, so that they compute exactly what a pure decode
// batch computes (a q_len-1 extend row is a different kernel, see above).
//
// CUDA graphs (config.cuda_graph). The device workspace is allocated once at fixed addresses
// sized for config.capacity, and run() launches a shape that depends only on the configuration
// (max_bs CTAs for decode, extend_max_tiles() for extend, padding masked off), so a graph
// captured around run() stays valid: before each replay call plan() for the replay's batch (bs
// <= max_bs, within the capacity), outside the capture, on the replay stream; it refreshes the
// metadata in place. The pointers given to run() (q, k/v cache, o) are captured too: a replay
// uses the same buffers. Rows of o past the batch's query count are not written. Run once
// outside the capture first (a warm-up, as engines do): it loads the kernels and sets their
// shared-memory attribute, which lazy module loading would otherwise do inside the capture.
//
// Streams are native handles (cudaStream_t as void*); a pdsim CudaStream gives its handle with
// runtime::cuda::native_stream() (backends/cuda/cuda_stream.h).
//
// Devices. Everything runs on config.device; each call makes it current for its duration and
// restores the caller's. Thread-safety: one host thread drives an adapter (as one scheduler
// thread drives a GPU). Ownership: the adapter owns its device workspace and staging ring; the
// caller owns q, the KV cache, o and the stream.
//
// Errors: kInvalidArgument for a bad config, batch or argument (naming it; nothing enqueued);
// kUnimplemented for a shape the adapter does not build; kUnavailable for a CUDA failure (with
// the CUDA error); kInternal for an error raised inside FlashInfer; kDeadlineExceeded when no
// pinned slot frees up in time; kFailedPrecondition for run() before any plan() (eager mode) or
// plan() while `stream` is capturing.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include "backends/cuda/cuda_pinned_memory.h"
#include "backends/cuda/flashinfer_plan.h"
#include "backends/cuda/flashinfer_staging.h"
#include "backends/runtime/stream.h"
#include "common/status.h"

namespace pdsim::attn::cuda {

struct FlashInferConfig {
    AttentionKind kind = AttentionKind::kDecode;
    AttentionShape shape;
    PlanCapacity capacity;
    int num_pages = 0;        // pages of the KV pool; > 0: plan() checks page ids against it
    bool cuda_graph = false;  // fixed launch shape and metadata addresses (see the file comment)
    int device = 0;
    int staging_slots = 4;  // pinned metadata slots (batches planned ahead of the GPU)
    std::chrono::milliseconds staging_timeout = runtime::kDefaultWaitTimeout;
};

// Device pointers of one run (one layer). q and o hold the batch's query rows in batch order
// (request i's rows at [qo_indptr[i], qo_indptr[i + 1]); decode: row i). Every pointer is
// 16-byte aligned and every stride a multiple of 8 elements (the kernels load 16 bytes at a time).
// MLA (shape.is_mla()): q is q_nope [rows][num_qo_heads][kv_lora_rank] and q_pe
// [rows][num_qo_heads][rope_dim], both contiguous (strides 0 or the contiguous ones); k_cache is
// the layer's latent buffer [num_pages][page_size][kv_lora_rank + rope_dim]; v_cache is unused; o
// has kv_lora_rank dims per head; sm_scale has no default (the model's, e.g. DeepSeek-V3's
// 1 / sqrt(128 + 64) in the absorbed form).
struct AttentionRunArgs {
    const void* q = nullptr;        // bf16 [rows][num_qo_heads][head_dim] (strided, see below)
    int64_t q_stride_token = 0;     // elements between query rows; 0: num_qo_heads * head_dim
    int64_t q_stride_head = 0;      // elements between heads of a row; 0: head_dim
    const void* q_pe = nullptr;     // MLA only
    const void* k_cache = nullptr;  // bf16 [num_pages][page_size][num_kv_heads][head_dim]
    const void* v_cache = nullptr;  // bf16, same layout as k_cache
    void* o = nullptr;              // bf16 [rows][num_qo_heads][head_dim], contiguous
    float sm_scale = 0.f;           // 0: 1 / sqrt(head_dim) (MHA/GQA only)
};

class FlashInferAttention {
public:
    // Validates `config` (check_shape, check_capacity, staging_slots >= 1), allocates the device
    // workspace (zeroed; blocks until it is) and the staging ring. `pinned` defaults to
    // make_cuda_pinned_memory() (backends/cuda/cuda_pinned_memory.h).
    [[nodiscard]] static StatusOr<std::unique_ptr<FlashInferAttention>> create(
        const FlashInferConfig& config, std::unique_ptr<PinnedMemory> pinned = nullptr);
    // Waits for the staging copies in flight (PinnedStagingRing's destructor), then frees the
    // device workspace. The caller must not destroy it while kernels of run() are still queued.
    ~FlashInferAttention();
    FlashInferAttention(const FlashInferAttention&) = delete;
    FlashInferAttention& operator=(const FlashInferAttention&) = delete;

    // Plans `batch` (see the file comment) and enqueues its metadata copy on `stream`
    // (a cudaStream_t). May block up to config.staging_timeout for a free pinned slot.
    [[nodiscard]] Status plan(const PagedBatch& batch, void* stream);

    // Launches attention for the latest plan on `stream` (a cudaStream_t). Eager mode with an
    // empty batch launches nothing. Never blocks; may be captured into a CUDA graph.
    [[nodiscard]] Status run(const AttentionRunArgs& args, void* stream) const;

    [[nodiscard]] const FlashInferConfig& config() const { return config_; }
    [[nodiscard]] const MetadataLayout& layout() const { return layout_; }
    // The latest plan (zero-initialized before the first).
    [[nodiscard]] const PlanInfo& plan_info() const { return plan_; }
    [[nodiscard]] bool has_plan() const { return planned_; }
    // The device workspace; its address never changes.
    [[nodiscard]] const void* device_metadata() const { return workspace_; }

private:
    FlashInferAttention(const FlashInferConfig& config, const MetadataLayout& layout);

    FlashInferConfig config_;
    MetadataLayout layout_;
    void* workspace_ = nullptr;  // device, layout_.total_bytes
    std::unique_ptr<PinnedStagingRing> staging_;
    PlanInfo plan_;
    bool planned_ = false;
};

}  // namespace pdsim::attn::cuda

// The host logic of the CUDA attention backend (backends/cuda/cuda_attention_backend.h): the batch
// checks the AttentionBackend base class makes (restated here, because the CUDA backend replaces
// the base class's host metadata buffers with FlashInfer plans), the by-value copy of a batch, the
// split of a batch into the sub-batches that go through the decode and the extend plan, the
// translation of a sub-batch into the FlashInfer adapter's PagedBatch, the checks of a batch
// against the pool and of a forward against its batch, and the capacities of the adapters.
// Plain C++: no CUDA or FlashInfer headers (flashinfer_plan.h is pdsim's own, CUDA-free), so it is
// built and unit-tested in every configuration (tests/cuda_attention_plan_test.cpp).
//
// The split (split_batch). decode mode: every request through the decode plan. extend,
// target_verify, draft_extend: every request through the extend plan. mixed: the decode requests
// are a run of requests with extend_len 1 at one end of the batch: the trailing run (SGLang's
// layout, the running decode requests appended after the prefill chunks), or, when the batch does
// not end in one, the leading run (vLLM's layout, decodes first). The rest of the batch, which may
// contain extend_len-1 requests too (a one-token chunk), goes through the extend plan. Each
// sub-batch is contiguous, in requests and in query rows, so a kernel reads its rows at an offset.
// Why: a decode request of a mixed batch then computes exactly what it computes in a pure decode
// batch (the decode and extend kernels round differently; flashinfer_attention.h).
//
// Errors: kInvalidArgument naming the argument (messages as the base class's for the checks it
// shares with it); kFailedPrecondition when a forward does not match its metadata;
// kUnimplemented for what the backend does not build (named in the message).
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "backends/attention/attention_backend.h"
#include "backends/cuda/flashinfer_plan.h"
#include "backends/kv/kv_pool.h"
#include "backends/runtime/tensor.h"
#include "common/status.h"

namespace pdsim::attn::cuda {

// The pool the plans are checked and made for: its page size (the kernels' page size) and page
// count (page ids must be below it).
struct PoolGeometry {
    int page_size = 0;
    int num_pages = 0;
    friend bool operator==(const PoolGeometry&, const PoolGeometry&) = default;
};

// A ForwardBatch copied by value (the caller's arrays may change as soon as the call returns).
struct StagedBatch {
    ForwardMode mode = ForwardMode::kIdle;
    int bs = 0;
    int page_table_stride = 0;
    std::vector<int32_t> seq_lens;    // [bs]
    std::vector<int32_t> q_lens;      // [bs]; 1 each for decode
    std::vector<int32_t> page_table;  // [bs * page_table_stride]
    int64_t num_tokens = 0;           // sum of q_lens
};

// Requests [first, first + count) of a batch, whose query (and output) rows are
// [row_begin, row_begin + rows), planned as `kind`.
struct SubBatch {
    AttentionKind kind = AttentionKind::kExtend;
    int first = 0;
    int count = 0;
    int64_t row_begin = 0;
    int64_t rows = 0;
    friend bool operator==(const SubBatch&, const SubBatch&) = default;
};

// The sub-batches of one forward (either may be absent; both absent for an empty batch).
struct BatchSplit {
    std::optional<SubBatch> decode;
    std::optional<SubBatch> extend;
};

// Copies a validated batch (attn::validate_forward_batch, attention_backend.h) by value.
[[nodiscard]] StagedBatch stage_batch(const ForwardBatch& batch);

// The split described in the file comment.
[[nodiscard]] BatchSplit split_batch(const StagedBatch& batch);

// The adapter's view of one sub-batch: spans into `batch` (valid while it lives and is unchanged).
// Decode sub-batches leave q_lens empty (one query each).
[[nodiscard]] PagedBatch to_paged_batch(const StagedBatch& batch, const SubBatch& sub);

// Checks `batch` against the pool: every request's pages, ceil(seq_len / page_size), fit in
// page_table_stride, and every page id it uses is in [0, num_pages). kInvalidArgument naming the
// request and the entry.
[[nodiscard]] Status check_batch_against_pool(const StagedBatch& batch, const PoolGeometry& pool);

// What planning `sub` needs from an adapter: its requests, its query rows (decode: one per
// request) and its pages.
[[nodiscard]] PlanCapacity capacity_for(const StagedBatch& batch, const SubBatch& sub,
                                        int page_size);
// True when an adapter of capacity `have` can plan a sub-batch needing `need`.
[[nodiscard]] bool covers(const PlanCapacity& have, const PlanCapacity& need);
// The capacity of a replacement eager adapter: every field at least `need` and `have`, rounded up
// to a power of two (minimum kMinEagerCapacity), with max_pages * page_size kept below 2^31 (what
// FlashInfer can index) when `need` allows it.
[[nodiscard]] PlanCapacity grown_capacity(const PlanCapacity& have, const PlanCapacity& need,
                                          int page_size);
inline constexpr PlanCapacity kMinEagerCapacity{16, 256, 256};

// The kind of plan a graph of `mode` uses: decode -> decode; extend, target_verify, draft_extend
// -> extend. mixed: kUnimplemented (its split, and with it the kernels' row offsets, changes from
// batch to batch; a graph bakes them in). idle: kInvalidArgument (nothing to plan).
[[nodiscard]] StatusOr<AttentionKind> graph_kind(ForwardMode mode);

// The fixed capacity of a graph-mode adapter: max_bs requests, max_bs * max_pages_per_seq pages,
// and query rows max_bs (decode) or `extend_rows` (extend: the rows of the static buffers).
// kInvalidArgument when the pages overflow int32 or extend_rows < 1 for extend.
[[nodiscard]] StatusOr<PlanCapacity> graph_capacity(AttentionKind kind, int max_bs,
                                                    int max_pages_per_seq, int64_t extend_rows);

// A forward against its eager batch: the mode (idle matches an empty batch of any mode) and bs
// must be the batch's (kFailedPrecondition naming both), and `view` (q or out, named `name`) must
// hold the batch's num_tokens rows (kInvalidArgument: "q: shape [4, 8, 64], expected
// [5, 8, 64] (...)").
[[nodiscard]] Status check_forward_matches_batch(ForwardMode mode, int bs,
                                                 const runtime::ConstTensorView& view,
                                                 std::string_view name, const StagedBatch& batch);

// The backend's configuration: head_dim 64 or 128, v_head_dim equal to head_dim, query heads a
// multiple of KV heads with a decode group size FlashInfer instantiates (check_shape for both
// kinds). kInvalidArgument / kUnimplemented naming the field.
[[nodiscard]] Status check_backend_config(const AttentionConfig& config);

// A layer against the backend's configuration: the heads and head dims must be the config's (the
// adapters are built for one shape). kInvalidArgument naming the field.
[[nodiscard]] Status check_layer(const LayerSpec& layer, const AttentionConfig& config);

// One layer of the pool as the kernels read it: an MHA pool (MLA: kUnimplemented, see
// cuda_attention_backend.h), K and V contiguous [num_pages][page_size][num_kv_heads][head_dim] in
// bf16 with the config's heads and head dim. kInvalidArgument naming "pool".
[[nodiscard]] Status check_pool_layer(const kv::KVLayerView& layer, const AttentionConfig& config);

}  // namespace pdsim::attn::cuda

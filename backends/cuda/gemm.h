// bf16 GEMMs on cuBLASLt for the GPU synthetic model's projections, and the cuBLAS baseline of
// `pdsim bench attention --backend cuda`.
//
//   Y[T][N] = X[T][K] @ W^T      X, W bf16; fp32 accumulation; Y bf16 (or fp32)
//
// W is stored [N][K] row-major ("out x in": row n holds the K weights of output column n), the
// layout of backends/cuda/model_kernels.h's weight layouts; a fused projection (QKV, gate/up) is
// one W whose rows are the concatenated outputs. Row strides (ldx, ldw, ldy) are in elements.
//
// BatchInvariantGemm pins ONE cuBLASLt algorithm per (K, N) shape, chosen when it is planned: the
// same algorithm id, tile, stages, swizzle, custom option and cluster shape for every T, with no
// split-K (CUBLASLT_ALGO_CONFIG_SPLITK_NUM = 1) and no reduction scheme, so each output element is
// one K loop of one CTA, in an order that does not depend on T. Row t of Y then depends on row t
// of X and W only: bit-identical whatever rows it is batched with (the property the testbed needs
// for disaggregated tokens == colocated tokens). Each T is checked with cublasLtMatmulAlgoCheck the
// first time it is run (or by check_rows); a T the pinned algorithm cannot run is an error, never a
// silent switch to another algorithm.
//
// HeuristicGemm is a plain cuBLASLt GEMM for one fixed (M, N, K): the heuristic's fastest
// algorithm, split-K allowed. It is the baseline extend attention is compared to (same FLOPs).
//
// Ownership: a plan owns its cuBLASLt handle, descriptors and its device workspace; it is tied to
// the device it was created on. Pointers passed to run() are borrowed for the stream's duration.
// Thread-safety: not thread-safe; one host thread drives a plan (the model's). run() enqueues on
// the stream and returns; it is capturable into a CUDA graph (no allocation, no synchronization).
// Errors: bad shapes or arguments are kInvalidArgument naming the field; a shape or T the pinned
// algorithm cannot run is kFailedPrecondition naming the shape, T and the algorithm; no device is
// kUnavailable; a failing cuBLASLt call is kInternal with its status name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "backends/runtime/stream.h"
#include "backends/runtime/tensor.h"
#include "common/bf16.h"
#include "common/status.h"

namespace pdsim::model::cuda {

struct GemmShape {
    int64_t k = 0;
    int64_t n = 0;
    int64_t ldx = 0;                                   // row stride of X (0: k)
    int64_t ldw = 0;                                   // row stride of W (0: k)
    int64_t ldy = 0;                                   // row stride of Y (0: n)
    runtime::DType out_dtype = runtime::DType::kBF16;  // kBF16 or kF32
};

struct GemmOptions {
    int device = 0;
    int max_rows = 8192;                       // the largest T a plan runs
    size_t workspace_bytes = size_t{4} << 20;  // the most workspace an algorithm may use
};

// `shape` with its zero strides resolved, after checking it (host only, no device needed):
// k, n > 0; ld's >= their row lengths; every row stride a multiple of 16 bytes (8 bf16, 4 fp32:
// the alignment the pinned algorithms are chosen for); out_dtype bf16 or fp32; max_rows >= 1.
// kInvalidArgument naming the field otherwise.
[[nodiscard]] StatusOr<GemmShape> resolve_gemm_shape(const GemmShape& shape,
                                                     const GemmOptions& options);

// The cuBLASLt algorithm configuration a plan runs, for logs and reports.
struct GemmAlgo {
    int id = -1;
    int tile = 0;
    int stages = 0;
    int splitk = 0;
    int reduction = 0;
    int swizzle = 0;
    int custom = 0;
    int inner_shape = 0;
    int cluster_shape = 0;
    size_t workspace_bytes = 0;  // the most the checked T's need
    [[nodiscard]] std::string to_string() const;
};

class BatchInvariantGemm {
public:
    // Plans (K, N): picks the first candidate of cuBLASLt's heuristic (for T = min(max_rows,
    // 1024), reduction schemes excluded) that, pinned to split-K 1, passes
    // cublasLtMatmulAlgoCheck at T = 1, 7, 64, min(max_rows, 1024) and max_rows within the
    // workspace bound. kFailedPrecondition when none does; kUnavailable with no device.
    [[nodiscard]] static StatusOr<std::unique_ptr<BatchInvariantGemm>> create(
        const GemmShape& shape, const GemmOptions& options = {});
    ~BatchInvariantGemm();
    BatchInvariantGemm(const BatchInvariantGemm&) = delete;
    BatchInvariantGemm& operator=(const BatchInvariantGemm&) = delete;

    // Enqueues Y[rows][n] = X[rows][k] @ W^T on `stream` (a CUDA stream on the plan's device).
    // x, w, y are device pointers, 16-byte aligned. rows in [0, max_rows]; 0 enqueues nothing.
    [[nodiscard]] Status run(const bf16_t* x, const bf16_t* w, void* y, int rows,
                             runtime::Stream& stream);
    // Checks that the pinned algorithm runs `rows` (cached; run() calls it). A caller may check
    // every T it will use up front, e.g. before capturing graphs.
    [[nodiscard]] Status check_rows(int rows);

    [[nodiscard]] const GemmShape& shape() const;
    [[nodiscard]] const GemmAlgo& algo() const;
    [[nodiscard]] int max_rows() const;

    struct Impl;

private:
    explicit BatchInvariantGemm(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

class HeuristicGemm {
public:
    // Plans Y[m][n] = X[m][k] @ W^T with cuBLASLt's fastest heuristic algorithm for exactly m.
    [[nodiscard]] static StatusOr<std::unique_ptr<HeuristicGemm>> create(
        int64_t m, const GemmShape& shape, const GemmOptions& options = {});
    ~HeuristicGemm();
    HeuristicGemm(const HeuristicGemm&) = delete;
    HeuristicGemm& operator=(const HeuristicGemm&) = delete;

    // Enqueues the planned GEMM on `stream`; x, w, y as BatchInvariantGemm::run.
    [[nodiscard]] Status run(const bf16_t* x, const bf16_t* w, void* y, runtime::Stream& stream);

    [[nodiscard]] int64_t m() const;
    [[nodiscard]] const GemmShape& shape() const;
    [[nodiscard]] const GemmAlgo& algo() const;
    // 2 * m * n * k: the multiply-adds of one run, for FLOP/s.
    [[nodiscard]] double flops() const;

    struct Impl;

private:
    explicit HeuristicGemm(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

}  // namespace pdsim::model::cuda

// `pdsim bench attention --backend cuda`: the GPU attention backend and the GPU model on one GPU,
// each figure against a baseline measured in the same run (docs/design.md "bench JSON",
// docs/gpu-results.md).
//
//   decode  GB/s = (KV bytes read + q bytes read + out bytes written) / device time of one decode
//           forward of the "cuda" backend (FlashInfer's paged decode) over a bf16 pool, pages in
//           the allocator's order. Baseline: cudaMemcpyAsync device-to-device on the same stream,
//           GB/s counting read + write bytes (as STREAM does), of copy_bytes (default: as many
//           bytes as the decode reads, at least 256 MiB: far above any L2). Target >= 0.75.
//   extend  GFLOP/s = exact causal work (2 * (head_dim + v_head_dim) * q_heads * the query-key
//           pairs attended, extend_causal_flops) / device time of one causal prefill forward (no
//           cached prefix). Baseline: a cuBLASLt bf16 GEMM (model::cuda::HeuristicGemm, fp32
//           accumulation) of about the same FLOPs, square-ish (gemm_dims_for_flops); GFLOP/s
//           counts its own 2 m n k. Target >= 0.40.
//   model   model::cuda::CudaSyntheticModel (`model`, default llama3-8b, with `layers` layers): a
//           prefill of model_prefill tokens (one request) and a decode step of decode_batch
//           requests of decode_len tokens each: device time per layer (layer timing events) vs
//           the roofline cost model (sim/cost, default mfu/mbu) for the same layer on the
//           detected GPU (match_gpu_spec); ratio = measured / roofline. Information, no target.
// Timing: CUDA events around each run; the decode (extend) and its baseline alternate in rounds
// enqueued back to back (the host runs ahead, so no launch gap is timed), each timed decode right
// after an untimed one (the copy leaves the L2 dirty; a decode leaves it clean); the first
// `warmup` rounds are dropped and a figure is the MEDIAN of `reps` rounds (the best is in the
// JSON too). The model: per round two forwards back to back, the second one timed.
// Outputs are poisoned (NaN) before the first run and checked after the last: every element
// finite, and a few rows equal (within bf16 tolerance) to an fp64 host oracle over the same
// bf16 inputs, else kDataLoss (a bench that times garbage is worse than none).
//
// Errors: bad options kInvalidArgument naming the flag (exit 2), checked before any device is
// touched; no GPU kUnavailable "no device" (exit 1, as `bench transfer --transport cuda_ipc`);
// in a build without CUDA or FlashInfer run_bench_attention_cuda is kInvalidArgument saying
// "--backend cuda: pdsim was built without ..." (exit 2); CUDA / cuBLASLt failures as the
// callees return them.
//
// The host logic (counts, dims, the GPU spec match, the per-layer roofline, the option checks)
// is plain C++ in bench_attention_cuda_plan.cpp, built everywhere and unit-tested
// (tests/bench_attention_cuda_test.cpp); run_bench_attention_cuda lives in
// bench_attention_cuda.cpp (CUDA + FlashInfer builds) or bench_attention_cuda_none.cpp.
// Thread-safety: the functions here are pure, except run_bench_attention_cuda (one caller; it
// owns the device for its duration).
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "backends/cuda/cuda_synthetic_model_plan.h"
#include "backends/model/model_config.h"
#include "common/status.h"
#include "topology/gpu_spec.h"

namespace pdsim::cli {

inline constexpr double kCudaDecodeTarget = 0.75;
inline constexpr double kCudaExtendTarget = 0.40;

struct CudaBenchOptions {
    std::string json_path;
    // Attention shapes (llama3-8b's by default).
    int q_heads = 32;
    int kv_heads = 8;
    int head_dim = 128;
    int page_size = 16;
    int decode_batch = 64;
    int decode_len = 4096;  // KV tokens per decode request
    int extend_batch = 4;
    int extend_len = 4096;  // new tokens per prefill request (no cached prefix)
    int reps = 20;
    int warmup = 3;
    int64_t copy_bytes = 0;  // the copy baseline's bytes per array; 0: decode_copy_bytes()
    // The model (decode step: decode_batch requests of decode_len tokens).
    std::string model = "llama3-8b";
    int layers = 4;
    int model_prefill = 4096;  // tokens of the prefill (one request)
    uint64_t seed = 1;
    int device = 0;
};

// Checks every option before a device is touched; kInvalidArgument naming the flag:
// --q-heads / --kv-heads / --head-dim that the cuda backend does not build (check_backend_config),
// --page-size and the batch sizes and lengths < 1, --reps < 1, --warmup < 0, --copy-mib < 0,
// --layers < 1, a --model that does not resolve or that the GPU model does not run
// (check_cuda_model_config with bench_model_options).
[[nodiscard]] Status check_cuda_bench_options(const CudaBenchOptions& o);

// The model's configuration: resolve_model(o.model) with num_layers = o.layers.
[[nodiscard]] StatusOr<model::ModelConfig> bench_model_config(const CudaBenchOptions& o);
// The GPU model's sizes for the bench: max_tokens = max(model_prefill, decode_batch), max_bs =
// decode_batch, max_positions = max(model_prefill, decode_len), on o.device.
[[nodiscard]] model::cuda::CudaModelOptions bench_model_options(const CudaBenchOptions& o);

// Query-key pairs a causal prefill of `bs` requests of `len` new tokens each (no cached prefix)
// attends: query j (0-based) attends j + 1 keys, so bs * len * (len + 1) / 2.
[[nodiscard]] double causal_pairs(int bs, int len);
// FLOPs of that prefill's attention: 2 * (head_dim + v_head_dim) * q_heads * causal_pairs
// (Q K^T and P V, one multiply-add = 2 FLOPs).
[[nodiscard]] double extend_causal_flops(int bs, int len, int q_heads, int head_dim,
                                         int v_head_dim);
// Bytes one bf16 decode forward moves: KV read (bs * len * kv_heads * (head_dim + v_head_dim)
// elements), q read and out written (bs * q_heads * head_dim elements each), 2 bytes each.
[[nodiscard]] double decode_traffic_bytes(int bs, int len, int q_heads, int kv_heads, int head_dim,
                                          int v_head_dim);
// The copy baseline's default size (bytes per array): the decode's traffic rounded up to a MiB,
// at least 256 MiB.
[[nodiscard]] int64_t decode_copy_bytes(double decode_bytes);

// A GEMM Y[m][n] = X[m][k] W^T of about `flops` FLOPs (2 m n k), square-ish: n = k = a multiple
// of 256 (at least 256) nearest to cbrt(flops / 2), m the multiple of 8 (at least 8) nearest to
// flops / (2 n k). So |2 m n k - flops| <= 8 n k. kInvalidArgument unless flops > 0 and every
// dimension fits an int32.
struct GemmDims {
    int64_t m = 0;
    int64_t n = 0;
    int64_t k = 0;
    [[nodiscard]] double flops() const {
        return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
    }
};
[[nodiscard]] StatusOr<GemmDims> gemm_dims_for_flops(double flops);

// The GPU spec table entry (topology/gpu_spec.h) for a CUDA device name as the runtime reports
// it ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"): the first word (split at
// spaces, '-' and '_', after a leading "NVIDIA") that names a table GPU. The table holds SXM
// parts, so a name with a "PCIe" or "NVL" word matches nothing (their clocks and bandwidth
// differ). spec null when nothing matches; `reason` then says why, for the report.
struct GpuSpecMatch {
    const topo::GpuSpec* spec = nullptr;
    std::string reason;
};
[[nodiscard]] GpuSpecMatch match_gpu_spec(std::string_view device_name);

// The roofline cost model's time of ONE layer (every layer is the same) of `config` on `gpu`
// (a table name), TP 1, bf16 KV, with the given mfu / mbu: the difference between the model's
// forward time at 2L and at L layers, over L (so the LM head and fixed costs cancel).
//   prefill_s  one request of prefill_tokens new tokens, no cached prefix;
//   decode_s   decode_bs requests attending decode_kv_tokens KV tokens in all.
// kInvalidArgument for what make_cost_model("roofline") rejects (an unknown GPU, a bad model).
struct LayerRoofline {
    double prefill_s = 0;
    double decode_s = 0;
    std::string describe;  // the cost model's describe(): "roofline H200 tp1 (mfu 0.50, ...)"
};
[[nodiscard]] StatusOr<LayerRoofline> roofline_per_layer(const model::ModelConfig& config,
                                                         std::string_view gpu, int prefill_tokens,
                                                         int decode_bs, int64_t decode_kv_tokens,
                                                         double mfu = 0.5, double mbu = 0.8);

// ---- the run's results and their report (host logic, bench_attention_cuda_plan.cpp) ----

// The device the bench ran on, as the CUDA runtime reports it.
struct CudaBenchDevice {
    int index = 0;
    std::string name;
    int cc_major = 0, cc_minor = 0;
    int sms = 0;
    double memory_gib = 0;
    double l2_mib = 0;
    int driver = 0, runtime = 0;
    GpuSpecMatch spec;
};

struct CudaDecodeResult {
    double bytes = 0, kv_bytes = 0, seconds_median = 0, seconds_best = 0;
    double copy_bytes = 0, copy_seconds_median = 0, copy_seconds_best = 0;
    double gbps = 0, baseline_gbps = 0, ratio = 0, max_abs_error = 0;
};

struct CudaExtendResult {
    double flops = 0, seconds_median = 0, seconds_best = 0;
    GemmDims gemm;
    std::string gemm_algo;
    double gemm_seconds_median = 0, gemm_seconds_best = 0;
    double gflops = 0, baseline_gflops = 0, ratio = 0, max_abs_error = 0;
};

struct CudaModelPhase {
    double per_layer_ms = 0;       // median over rounds of the mean layer time
    double forward_ms = 0;         // median whole-forward time (LM head and sampling included)
    std::vector<double> layer_ms;  // each layer's time, in the round of the median
    std::optional<double> roofline_ms, roofline_peak_ms;
};

struct CudaModelResult {
    model::ModelConfig config;
    size_t weight_bytes = 0;
    CudaModelPhase prefill, decode;
    std::string roofline;  // the cost model's description, or why there is none
    bool have_roofline = false;
};

struct CudaBenchResults {
    CudaBenchDevice device;
    CudaDecodeResult decode;
    CudaExtendResult extend;
    CudaModelResult model;
};

// The table on stdout (header, decode, extend, the model's prefill and decode rows, baselines).
void print_cuda_bench(const CudaBenchOptions& o, const CudaBenchResults& r);
// The bench JSON (docs/design.md "bench JSON").
[[nodiscard]] nlohmann::json cuda_bench_json(const CudaBenchOptions& o, const CudaBenchResults& r);

// Runs the bench (see the file comment); prints the table to stdout, progress to stderr, and
// writes o.json_path when set. Precondition: check_cuda_bench_options(o) passed.
[[nodiscard]] Status run_bench_attention_cuda(const CudaBenchOptions& o);

}  // namespace pdsim::cli

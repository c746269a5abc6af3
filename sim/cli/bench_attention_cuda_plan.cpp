// Host logic of `pdsim bench attention --backend cuda` (sim/cli/bench_attention_cuda.h): plain C++,
// built in every configuration.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <string>

#include "backends/attention/attention_backend.h"
#include "backends/cuda/cuda_attention_plan.h"
#include "sim/cli/bench_attention_cuda.h"
#include "sim/cost/cost_model.h"

namespace pdsim::cli {

namespace {

Status at_least(const char* flag, int64_t value, int64_t minimum) {
    if (value < minimum)
        return invalid_argument_error(fmt::format("{} {} must be >= {}", flag, value, minimum));
    return {};
}

std::string upper(std::string_view s) {
    std::string out(s);
    for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return out;
}

}  // namespace

StatusOr<model::ModelConfig> bench_model_config(const CudaBenchOptions& o) {
    auto cfg = model::resolve_model(o.model);
    if (!cfg.ok())
        return invalid_argument_error("--model " + o.model + ": " + cfg.status().message());
    cfg->num_layers = o.layers;
    return cfg;
}

model::cuda::CudaModelOptions bench_model_options(const CudaBenchOptions& o) {
    model::cuda::CudaModelOptions m;
    m.device = o.device;
    m.max_tokens = std::max(o.model_prefill, o.decode_batch);
    m.max_bs = o.decode_batch;
    m.max_positions = std::max(o.model_prefill, o.decode_len);
    return m;
}

Status check_cuda_bench_options(const CudaBenchOptions& o) {
    PDSIM_RETURN_IF_ERROR(at_least("--q-heads", o.q_heads, 1));
    PDSIM_RETURN_IF_ERROR(at_least("--kv-heads", o.kv_heads, 1));
    PDSIM_RETURN_IF_ERROR(at_least("--head-dim", o.head_dim, 1));
    PDSIM_RETURN_IF_ERROR(at_least("--page-size", o.page_size, 1));
    PDSIM_RETURN_IF_ERROR(at_least("--decode-batch", o.decode_batch, 1));
    PDSIM_RETURN_IF_ERROR(at_least("--decode-len", o.decode_len, 1));
    PDSIM_RETURN_IF_ERROR(at_least("--extend-batch", o.extend_batch, 1));
    PDSIM_RETURN_IF_ERROR(at_least("--extend-len", o.extend_len, 1));
    PDSIM_RETURN_IF_ERROR(at_least("--reps", o.reps, 1));
    PDSIM_RETURN_IF_ERROR(at_least("--warmup", o.warmup, 0));
    PDSIM_RETURN_IF_ERROR(at_least("--copy-mib", o.copy_bytes, 0));
    PDSIM_RETURN_IF_ERROR(at_least("--layers", o.layers, 1));
    PDSIM_RETURN_IF_ERROR(at_least("--model-prefill", o.model_prefill, 1));
    if (o.q_heads % o.kv_heads != 0) {
        return invalid_argument_error(
            fmt::format("--q-heads {} is not a multiple of --kv-heads {}", o.q_heads, o.kv_heads));
    }
    attn::AttentionConfig ac;
    ac.num_q_heads = o.q_heads;
    ac.num_kv_heads = o.kv_heads;
    ac.head_dim = o.head_dim;
    ac.kv_dtype = runtime::DType::kBF16;
    if (Status st = attn::cuda::check_backend_config(ac); !st.ok()) {
        return invalid_argument_error(fmt::format("--q-heads {} --kv-heads {} --head-dim {}: {}",
                                                  o.q_heads, o.kv_heads, o.head_dim, st.message()));
    }
    // Pages of one request must stay addressable as int32 slots (page id * page size).
    const int64_t pages_per_request = (int64_t{o.decode_len} + o.page_size - 1) / o.page_size;
    if (pages_per_request * o.decode_batch * o.page_size > std::numeric_limits<int32_t>::max()) {
        return invalid_argument_error(
            fmt::format("--decode-batch {} x --decode-len {}: more KV slots than int32 "
                        "indexes",
                        o.decode_batch, o.decode_len));
    }
    PDSIM_ASSIGN_OR_RETURN(const model::ModelConfig cfg, bench_model_config(o));
    if (Status st = model::cuda::check_cuda_model_config(cfg, 1, bench_model_options(o));
        !st.ok()) {
        return invalid_argument_error(fmt::format(
            "--model {} (--layers {}, --model-prefill {}, --decode-batch {}, "
            "--decode-len {}): {}",
            o.model, o.layers, o.model_prefill, o.decode_batch, o.decode_len, st.message()));
    }
    return {};
}

double causal_pairs(int bs, int len) {
    return static_cast<double>(bs) * len * (len + 1.0) / 2.0;
}

double extend_causal_flops(int bs, int len, int q_heads, int head_dim, int v_head_dim) {
    return 2.0 * (head_dim + v_head_dim) * q_heads * causal_pairs(bs, len);
}

double decode_traffic_bytes(int bs, int len, int q_heads, int kv_heads, int head_dim,
                            int v_head_dim) {
    const double kv = static_cast<double>(bs) * len * kv_heads * (head_dim + v_head_dim);
    const double q_and_out = 2.0 * bs * q_heads * head_dim;
    return 2.0 * (kv + q_and_out);
}

int64_t decode_copy_bytes(double decode_bytes) {
    constexpr int64_t kMiB = int64_t{1} << 20;
    const auto mib = static_cast<int64_t>(std::ceil(decode_bytes / static_cast<double>(kMiB)));
    return std::max<int64_t>(256, mib) * kMiB;
}

StatusOr<GemmDims> gemm_dims_for_flops(double flops) {
    if (!(flops > 0) || !std::isfinite(flops)) {
        return invalid_argument_error(
            fmt::format("gemm_dims_for_flops: flops {} must be > 0", flops));
    }
    auto nearest = [](double x, int64_t multiple) {
        return std::max<int64_t>(multiple,
                                 std::llround(x / static_cast<double>(multiple)) * multiple);
    };
    GemmDims d;
    d.n = d.k = nearest(std::cbrt(flops / 2.0), 256);
    d.m = nearest(flops / (2.0 * static_cast<double>(d.n) * static_cast<double>(d.k)), 8);
    const int64_t limit = std::numeric_limits<int32_t>::max();
    if (d.m > limit || d.n > limit) {
        return invalid_argument_error(
            fmt::format("gemm_dims_for_flops: {} FLOPs need dimensions beyond int32", flops));
    }
    return d;
}

GpuSpecMatch match_gpu_spec(std::string_view device_name) {
    std::vector<std::string> words;
    std::string word;
    for (char c : device_name) {
        if (c == ' ' || c == '-' || c == '_') {
            if (!word.empty()) words.push_back(std::move(word));
            word.clear();
        } else {
            word.push_back(c);
        }
    }
    if (!word.empty()) words.push_back(std::move(word));
    if (!words.empty() && upper(words.front()) == "NVIDIA") words.erase(words.begin());
    GpuSpecMatch m;
    for (const std::string& w : words) {
        const std::string u = upper(w);
        if (u == "PCIE" || u == "NVL") {
            m.reason = fmt::format("'{}' is a {} part; the GPU spec table holds SXM parts ({})",
                                   device_name, w, topo::gpu_spec_names());
            return m;
        }
    }
    for (const std::string& w : words) {
        if (const topo::GpuSpec* spec = topo::gpu_spec(w); spec != nullptr) {
            m.spec = spec;
            return m;
        }
    }
    m.reason =
        fmt::format("'{}' is not in the GPU spec table ({})", device_name, topo::gpu_spec_names());
    return m;
}

StatusOr<LayerRoofline> roofline_per_layer(const model::ModelConfig& config, std::string_view gpu,
                                           int prefill_tokens, int decode_bs,
                                           int64_t decode_kv_tokens, double mfu, double mbu) {
    if (config.num_layers < 1) {
        return invalid_argument_error(
            fmt::format("roofline_per_layer: num_layers {} must be >= 1", config.num_layers));
    }
    cost::RooflineOptions ro;
    ro.mfu = mfu;
    ro.mbu = mbu;
    const int layers = config.num_layers;
    struct Times {
        double prefill = 0, decode = 0;
        std::string describe;
    };
    auto times_at = [&](int num_layers) -> StatusOr<Times> {
        cost::InstanceSpec spec;
        spec.model = config;
        spec.model.num_layers = num_layers;
        spec.tp = 1;
        spec.device = std::string(gpu);
        spec.kv_dtype_bytes = 2;
        PDSIM_ASSIGN_OR_RETURN(auto cm, cost::make_cost_model("roofline", spec, nullptr, ro));
        const cost::ExtendItem prefill{prefill_tokens, 0};
        return Times{cm->extend_s({&prefill, 1}), cm->decode_s(decode_bs, decode_kv_tokens),
                     cm->describe()};
    };
    PDSIM_ASSIGN_OR_RETURN(const Times one, times_at(layers));
    PDSIM_ASSIGN_OR_RETURN(const Times two, times_at(2 * layers));
    LayerRoofline r;
    r.prefill_s = (two.prefill - one.prefill) / layers;
    r.decode_s = (two.decode - one.decode) / layers;
    r.describe = one.describe;
    return r;
}

namespace {

const char* verdict(double ratio, double target) {
    return ratio >= target ? "PASS" : "BELOW";
}

// ---- the report
// -------------------------------------------------------------------------------------

nlohmann::json phase_json(const CudaModelPhase& p) {
    nlohmann::json j = {
        {"per_layer_ms", p.per_layer_ms}, {"forward_ms", p.forward_ms}, {"layer_ms", p.layer_ms}};
    if (p.roofline_ms) {
        j["roofline_per_layer_ms"] = *p.roofline_ms;
        j["roofline_peak_per_layer_ms"] = *p.roofline_peak_ms;
        j["ratio"] = p.per_layer_ms / *p.roofline_ms;
    } else {
        j["roofline_per_layer_ms"] = nullptr;
        j["roofline_peak_per_layer_ms"] = nullptr;
        j["ratio"] = nullptr;
    }
    return j;
}

void print_model_row(const std::string& figure, const CudaModelPhase& p) {
    if (p.roofline_ms) {
        fmt::print(
            "{:<36} {:>10.3f} ms   {:>5} {:>10.3f} ms   {:>6.2f} {:>7}  (measured/roofline)\n",
            figure, p.per_layer_ms, "roof", *p.roofline_ms, p.per_layer_ms / *p.roofline_ms, "-");
    } else {
        fmt::print("{:<36} {:>10.3f} ms   {:>5} {:>13} {:>6} {:>7}\n", figure, p.per_layer_ms,
                   "roof", "-", "-", "-");
    }
}

}  // namespace

void print_cuda_bench(const CudaBenchOptions& o, const CudaBenchResults& r) {
    fmt::print(
        "pdsim bench attention: backend cuda on {} (sm {}.{}, {} SMs, {:.0f} GiB), KV bf16, "
        "{}q/{}kv heads, head_dim {}, page {}; median of {} rounds\n",
        r.device.name, r.device.cc_major, r.device.cc_minor, r.device.sms, r.device.memory_gib,
        o.q_heads, o.kv_heads, o.head_dim, o.page_size, o.reps);
    fmt::print("{:<36} {:>15} {:>21} {:>6} {:>7}\n", "figure", "measured", "baseline", "ratio",
               "target");
    fmt::print("{:<36} {:>10.1f} GB/s {:>5} {:>10.1f} GB/s {:>6.2f} {:>7.2f}  {}\n",
               fmt::format("decode {}x{} KV tokens", o.decode_batch, o.decode_len), r.decode.gbps,
               "copy", r.decode.baseline_gbps, r.decode.ratio, kCudaDecodeTarget,
               verdict(r.decode.ratio, kCudaDecodeTarget));
    fmt::print("{:<36} {:>7.1f} TFLOP/s {:>5} {:>7.1f} TFLOP/s {:>6.2f} {:>7.2f}  {}\n",
               fmt::format("extend {}x{} tokens causal", o.extend_batch, o.extend_len),
               r.extend.gflops / 1e3, "gemm", r.extend.baseline_gflops / 1e3, r.extend.ratio,
               kCudaExtendTarget, verdict(r.extend.ratio, kCudaExtendTarget));
    print_model_row(
        fmt::format("{} prefill {} tok, per layer", r.model.config.name, o.model_prefill),
        r.model.prefill);
    print_model_row(fmt::format("{} decode {}x{}, per layer", r.model.config.name, o.decode_batch,
                                o.decode_len),
                    r.model.decode);
    fmt::print(
        "baselines: cudaMemcpyAsync device-to-device of {} MiB (read + write bytes); "
        "cuBLASLt bf16 GEMM {}x{}x{} ({}); model: {}\n",
        static_cast<int64_t>(r.decode.copy_bytes / 2) >> 20, r.extend.gemm.m, r.extend.gemm.n,
        r.extend.gemm.k, r.extend.gemm_algo, r.model.roofline);
    fmt::print(
        "outputs checked: finite, and against an fp64 host oracle (max abs error: decode "
        "{:.2g}, extend {:.2g})\n",
        r.decode.max_abs_error, r.extend.max_abs_error);
}

nlohmann::json cuda_bench_json(const CudaBenchOptions& o, const CudaBenchResults& r) {
    nlohmann::json spec_name = nullptr;
    if (r.device.spec.spec != nullptr) spec_name = std::string(r.device.spec.spec->name);
    nlohmann::json j = {
        {"decode",
         {{"gbps", r.decode.gbps},
          {"baseline_gbps", r.decode.baseline_gbps},
          {"ratio", r.decode.ratio},
          {"target", kCudaDecodeTarget},
          {"pass", r.decode.ratio >= kCudaDecodeTarget},
          {"batch", o.decode_batch},
          {"kv_len", o.decode_len},
          {"pages", "allocator_order"},
          {"kv_bytes", r.decode.kv_bytes},
          {"bytes", r.decode.bytes},
          {"seconds_median", r.decode.seconds_median},
          {"seconds_best", r.decode.seconds_best},
          {"gbps_best", r.decode.bytes / r.decode.seconds_best / 1e9},
          {"baseline", "cuda_memcpy_d2d"},
          {"baseline_bytes", r.decode.copy_bytes},
          {"baseline_seconds_median", r.decode.copy_seconds_median},
          {"baseline_seconds_best", r.decode.copy_seconds_best},
          {"max_abs_error", r.decode.max_abs_error}}},
        {"extend",
         {{"gflops", r.extend.gflops},
          {"baseline_gflops", r.extend.baseline_gflops},
          {"ratio", r.extend.ratio},
          {"target", kCudaExtendTarget},
          {"pass", r.extend.ratio >= kCudaExtendTarget},
          {"batch", o.extend_batch},
          {"q_len", o.extend_len},
          {"flops", r.extend.flops},
          {"seconds_median", r.extend.seconds_median},
          {"seconds_best", r.extend.seconds_best},
          {"gflops_best", r.extend.flops / r.extend.seconds_best / 1e9},
          {"baseline", "cublaslt_bf16_gemm"},
          {"baseline_flops", r.extend.gemm.flops()},
          {"baseline_m", r.extend.gemm.m},
          {"baseline_n", r.extend.gemm.n},
          {"baseline_k", r.extend.gemm.k},
          {"baseline_algo", r.extend.gemm_algo},
          {"baseline_seconds_median", r.extend.gemm_seconds_median},
          {"baseline_seconds_best", r.extend.gemm_seconds_best},
          {"max_abs_error", r.extend.max_abs_error}}},
        {"model",
         {{"name", r.model.config.name},
          {"layers", r.model.config.num_layers},
          {"weight_bytes", r.model.weight_bytes},
          {"roofline",
           r.model.have_roofline ? nlohmann::json(r.model.roofline) : nlohmann::json(nullptr)},
          {"roofline_note", r.model.have_roofline ? "per layer: the cost model at 2L minus at L "
                                                    "layers, over L; peak: mfu = mbu = 1"
                                                  : r.model.roofline},
          {"prefill", phase_json(r.model.prefill)},
          {"decode", phase_json(r.model.decode)}}},
        {"device",
         {{"name", r.device.name},
          {"index", r.device.index},
          {"compute_capability", fmt::format("{}.{}", r.device.cc_major, r.device.cc_minor)},
          {"sms", r.device.sms},
          {"memory_gib", r.device.memory_gib},
          {"l2_mib", r.device.l2_mib},
          {"driver_version", r.device.driver},
          {"runtime_version", r.device.runtime},
          {"gpu_spec", spec_name},
          {"gpu_spec_reason", r.device.spec.reason}}},
        {"backend", "cuda"},
        {"dtype", "bf16"},
        {"num_q_heads", o.q_heads},
        {"num_kv_heads", o.kv_heads},
        {"head_dim", o.head_dim},
        {"page_size", o.page_size},
        {"reps", o.reps},
        {"warmup", o.warmup},
        {"model_prefill", o.model_prefill}};
    j["model"]["decode"]["batch"] = o.decode_batch;
    j["model"]["decode"]["kv_len"] = o.decode_len;
    j["model"]["prefill"]["tokens"] = o.model_prefill;
    return j;
}

}  // namespace pdsim::cli

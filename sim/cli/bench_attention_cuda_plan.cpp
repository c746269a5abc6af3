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

Status bad(std::string message) {
    return Status(StatusCode::kInvalidArgument, std::move(message));
}

Status at_least(const char* flag, int64_t value, int64_t minimum) {
    if (value < minimum) return bad(fmt::format("{} {} must be >= {}", flag, value, minimum));
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
    if (!cfg.ok()) return bad("--model " + o.model + ": " + cfg.status().message());
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
        return bad(fmt::format("--q-heads {} is not a multiple of --kv-heads {}", o.q_heads,
                               o.kv_heads));
    }
    attn::AttentionConfig ac;
    ac.num_q_heads = o.q_heads;
    ac.num_kv_heads = o.kv_heads;
    ac.head_dim = o.head_dim;
    ac.kv_dtype = runtime::DType::kBF16;
    if (Status st = attn::cuda::check_backend_config(ac); !st.ok()) {
        return bad(fmt::format("--q-heads {} --kv-heads {} --head-dim {}: {}", o.q_heads,
                               o.kv_heads, o.head_dim, st.message()));
    }
    // Pages of one request must stay addressable as int32 slots (page id * page size).
    const int64_t pages_per_request = (int64_t{o.decode_len} + o.page_size - 1) / o.page_size;
    if (pages_per_request * o.decode_batch * o.page_size > std::numeric_limits<int32_t>::max()) {
        return bad(fmt::format("--decode-batch {} x --decode-len {}: more KV slots than int32 "
                               "indexes",
                               o.decode_batch, o.decode_len));
    }
    PDSIM_ASSIGN_OR_RETURN(const model::ModelConfig cfg, bench_model_config(o));
    if (Status st = model::cuda::check_cuda_model_config(cfg, 1, bench_model_options(o));
        !st.ok()) {
        return bad(fmt::format("--model {} (--layers {}, --model-prefill {}, --decode-batch {}, "
                               "--decode-len {}): {}",
                               o.model, o.layers, o.model_prefill, o.decode_batch, o.decode_len,
                               st.message()));
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
        return bad(fmt::format("gemm_dims_for_flops: flops {} must be > 0", flops));
    }
    auto nearest = [](double x, int64_t multiple) {
        return std::max<int64_t>(multiple, std::llround(x / static_cast<double>(multiple)) *
                                               multiple);
    };
    GemmDims d;
    d.n = d.k = nearest(std::cbrt(flops / 2.0), 256);
    d.m = nearest(flops / (2.0 * static_cast<double>(d.n) * static_cast<double>(d.k)), 8);
    const int64_t limit = std::numeric_limits<int32_t>::max();
    if (d.m > limit || d.n > limit) {
        return bad(fmt::format("gemm_dims_for_flops: {} FLOPs need dimensions beyond int32",
                               flops));
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
    m.reason = fmt::format("'{}' is not in the GPU spec table ({})", device_name,
                           topo::gpu_spec_names());
    return m;
}

StatusOr<LayerRoofline> roofline_per_layer(const model::ModelConfig& config, std::string_view gpu,
                                           int prefill_tokens, int decode_bs,
                                           int64_t decode_kv_tokens, double mfu, double mbu) {
    if (config.num_layers < 1) {
        return bad(fmt::format("roofline_per_layer: num_layers {} must be >= 1",
                               config.num_layers));
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

}  // namespace pdsim::cli

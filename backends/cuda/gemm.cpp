// bf16 GEMMs on cuBLASLt (see gemm.h for the contracts).
//
// cuBLASLt is column-major. Row-major Y[T][N] (row stride ldy) is the column-major N x T matrix D
// with leading dimension ldy, and
//   D (N x T) = op(A) (N x K) * B (K x T)
// with B = X read column-major (K x T, ld ldx: column t is row t of X) and A = W read column-major
// (K x N, ld ldw: column n is row n of W) transposed. That is the "TN" GEMM of every nn.Linear.
#include "backends/cuda/gemm.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <vector>

#include "backends/cuda/cuda_stream.h"
#include "backends/runtime/device.h"
#include "common/align.h"
#include "common/cuda_check.h"

#define CUBLASLT_CHECK(call)                                                                \
    do {                                                                                    \
        const cublasStatus_t pdsim_lt_rc_ = (call);                                         \
        if (pdsim_lt_rc_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                             \
            return PDSIM_ERROR(::pdsim::StatusCode::kInternal, "{} failed: {} ({})", #call, \
                               cublasLtGetStatusName(pdsim_lt_rc_),                         \
                               cublasLtGetStatusString(pdsim_lt_rc_));                      \
    } while (0)

namespace pdsim::model::cuda {

namespace {

using runtime::DType;

constexpr int kHeuristicCandidates = 16;
constexpr int kDefaultPlanRowsCap = 1024;

size_t elem_bytes(DType d) {
    return runtime::dtype_size(d);
}

Status check_ld(const char* field, int64_t ld, int64_t row_len, size_t elem) {
    if (ld < row_len) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "gemm: {} {} must be >= the row length {}",
                           field, ld, row_len);
    }
    if ((static_cast<size_t>(ld) * elem) % 16 != 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "gemm: {} {} must be a multiple of {} elements (16-byte rows)", field,
                           ld, 16 / elem);
    }
    return {};
}

Status check_pointers(const void* x, const void* w, const void* y) {
    if (x == nullptr || w == nullptr || y == nullptr) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "gemm: x, w and y must be device pointers (got {}, {}, {})", x, w, y);
    }
    if (!is_aligned(x, 16) || !is_aligned(w, 16) || !is_aligned(y, 16)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "gemm: x {}, w {} and y {} must be 16-byte aligned", x, w, y);
    }
    return {};
}

Status check_device(int device) {
    int n = 0;
    const cudaError_t rc = cudaGetDeviceCount(&n);
    if (rc != cudaSuccess || n == 0) {
        cudaGetLastError();
        return PDSIM_ERROR(StatusCode::kUnavailable, "no device: {}",
                           rc != cudaSuccess ? cudaGetErrorString(rc) : "no CUDA GPU visible");
    }
    if (device < 0 || device >= n) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "gemm: device {} (have {})", device, n);
    }
    CUDA_CHECK(cudaSetDevice(device));
    return {};
}

template <typename T>
T config_attr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
    T v{};
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) !=
        CUBLAS_STATUS_SUCCESS) {
        return T{};
    }
    return v;
}

GemmAlgo describe(const cublasLtMatmulAlgo_t& algo, size_t workspace) {
    GemmAlgo a;
    a.id = config_attr<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID);
    a.tile = static_cast<int>(config_attr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID));
    a.stages = static_cast<int>(config_attr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID));
    a.splitk = config_attr<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
    a.reduction =
        static_cast<int>(config_attr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME));
    a.swizzle = static_cast<int>(config_attr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING));
    a.custom = static_cast<int>(config_attr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION));
    a.inner_shape = config_attr<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID);
    a.cluster_shape = config_attr<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID);
    a.workspace_bytes = workspace;
    return a;
}

// One cuBLASLt matmul problem Y[T][N] = X[T][K] @ W^T with a variable T: the handle, the
// descriptors (B's and D's column count follow T), the heuristic preference and the workspace.
class LtProblem {
public:
    LtProblem() = default;
    LtProblem(const LtProblem&) = delete;
    LtProblem& operator=(const LtProblem&) = delete;
    ~LtProblem() {
        if (pref_ != nullptr) cublasLtMatmulPreferenceDestroy(pref_);
        if (d_ != nullptr) cublasLtMatrixLayoutDestroy(d_);
        if (b_ != nullptr) cublasLtMatrixLayoutDestroy(b_);
        if (a_ != nullptr) cublasLtMatrixLayoutDestroy(a_);
        if (desc_ != nullptr) cublasLtMatmulDescDestroy(desc_);
        if (handle_ != nullptr) cublasLtDestroy(handle_);
    }

    Status init(const GemmShape& shape, const GemmOptions& options, int64_t initial_rows) {
        shape_ = shape;
        options_ = options;
        PDSIM_RETURN_IF_ERROR(check_device(options.device));
        CUBLASLT_CHECK(cublasLtCreate(&handle_));
        CUBLASLT_CHECK(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
        CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a,
                                                      sizeof(trans_a)));
        CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b,
                                                      sizeof(trans_b)));
        const cudaDataType_t out = shape.out_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
        CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&a_, CUDA_R_16BF, static_cast<uint64_t>(shape.k),
                                                  static_cast<uint64_t>(shape.n), shape.ldw));
        CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&b_, CUDA_R_16BF, static_cast<uint64_t>(shape.k),
                                                  static_cast<uint64_t>(initial_rows), shape.ldx));
        CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&d_, out, static_cast<uint64_t>(shape.n),
                                                  static_cast<uint64_t>(initial_rows), shape.ldy));
        rows_ = initial_rows;
        CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref_));
        const uint64_t ws = options.workspace_bytes;
        CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
            pref_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
        // run() accepts any 16-byte aligned pointers: keep algorithms that need more out.
        const uint32_t align = 16;
        for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
            CUBLASLT_CHECK(
                cublasLtMatmulPreferenceSetAttribute(pref_, attr, &align, sizeof(align)));
        }
        if (options.workspace_bytes > 0) {
            PDSIM_ASSIGN_OR_RETURN(workspace_, runtime::DeviceBuffer::allocate(
                                                   {runtime::DeviceKind::kCuda, options.device},
                                                   options.workspace_bytes));
        }
        return {};
    }

    // Whether the heuristic may propose algorithms with a split-K reduction (the default).
    Status allow_reductions(bool allow) {
        const uint32_t mask =
            allow ? CUBLASLT_REDUCTION_SCHEME_MASK : CUBLASLT_REDUCTION_SCHEME_NONE;
        CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
            pref_, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof(mask)));
        return {};
    }

    Status set_rows(int64_t rows) {
        if (rows == rows_) return {};
        const uint64_t cols = static_cast<uint64_t>(rows);
        CUBLASLT_CHECK(
            cublasLtMatrixLayoutSetAttribute(b_, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof(cols)));
        CUBLASLT_CHECK(
            cublasLtMatrixLayoutSetAttribute(d_, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof(cols)));
        rows_ = rows;
        return {};
    }

    // The heuristic's candidates for the current T, fastest first (only those whose state is OK).
    StatusOr<std::vector<cublasLtMatmulHeuristicResult_t>> heuristic(int count) {
        std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(count));
        int returned = 0;
        const cublasStatus_t rc = cublasLtMatmulAlgoGetHeuristic(
            handle_, desc_, a_, b_, d_, d_, pref_, count, results.data(), &returned);
        if (rc == CUBLAS_STATUS_NOT_SUPPORTED) {
            returned = 0;  // no algorithm for this problem: the callers say so
        } else {
            CUBLASLT_CHECK(rc);
        }
        std::vector<cublasLtMatmulHeuristicResult_t> ok;
        for (int i = 0; i < returned; ++i) {
            if (results[static_cast<size_t>(i)].state == CUBLAS_STATUS_SUCCESS) {
                ok.push_back(results[static_cast<size_t>(i)]);
            }
        }
        return ok;
    }

    // cublasLtMatmulAlgoCheck of `algo` at the current T: the workspace it needs, or the reason it
    // cannot run.
    StatusOr<size_t> check(const cublasLtMatmulAlgo_t& algo) {
        cublasLtMatmulHeuristicResult_t result{};
        const cublasStatus_t rc =
            cublasLtMatmulAlgoCheck(handle_, desc_, a_, b_, d_, d_, &algo, &result);
        if (rc != CUBLAS_STATUS_SUCCESS) {
            return Status(
                StatusCode::kFailedPrecondition,
                fmt::format("{} ({})", cublasLtGetStatusName(rc), cublasLtGetStatusString(rc)));
        }
        if (result.workspaceSize > options_.workspace_bytes) {
            return Status(StatusCode::kFailedPrecondition,
                          fmt::format("needs {} bytes of workspace, the plan has {}",
                                      result.workspaceSize, options_.workspace_bytes));
        }
        return result.workspaceSize;
    }

    Status matmul(const cublasLtMatmulAlgo_t& algo, const bf16_t* x, const bf16_t* w, void* y,
                  runtime::Stream& stream) {
        if (stream.device().kind != runtime::DeviceKind::kCuda ||
            stream.device().index != options_.device) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument,
                               "gemm: stream {} is not on cuda:{}, the plan's device",
                               stream.name(), options_.device);
        }
        PDSIM_ASSIGN_OR_RETURN(cudaStream_t s, runtime::cuda::native_stream(stream));
        CUDA_CHECK(cudaSetDevice(options_.device));
        const float alpha = 1.0f, beta = 0.0f;
        CUBLASLT_CHECK(cublasLtMatmul(handle_, desc_, &alpha, w, a_, x, b_, &beta, y, d_, y, d_,
                                      &algo, workspace_.data(), workspace_.size(), s));
        return {};
    }

    const GemmShape& shape() const { return shape_; }
    const GemmOptions& options() const { return options_; }

private:
    GemmShape shape_;
    GemmOptions options_;
    cublasLtHandle_t handle_ = nullptr;
    cublasLtMatmulDesc_t desc_ = nullptr;
    cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, d_ = nullptr;
    cublasLtMatmulPreference_t pref_ = nullptr;
    int64_t rows_ = -1;
    runtime::DeviceBuffer workspace_;
};

std::string shape_text(const GemmShape& s) {
    return fmt::format("K={} N={} (ldx {}, ldw {}, ldy {}, out {})", s.k, s.n, s.ldx, s.ldw, s.ldy,
                       runtime::dtype_name(s.out_dtype));
}

}  // namespace

std::string GemmAlgo::to_string() const {
    return fmt::format(
        "algo {} tile {} stages {} splitk {} reduction {} swizzle {} custom {} inner {} cluster {} "
        "workspace {}",
        id, tile, stages, splitk, reduction, swizzle, custom, inner_shape, cluster_shape,
        workspace_bytes);
}

StatusOr<GemmShape> resolve_gemm_shape(const GemmShape& shape, const GemmOptions& options) {
    if (shape.k <= 0 || shape.n <= 0) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "gemm: k {} and n {} must be > 0", shape.k,
                           shape.n);
    }
    if (shape.out_dtype != DType::kBF16 && shape.out_dtype != DType::kF32) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "gemm: out_dtype {}, expected bf16 or fp32",
                           runtime::dtype_name(shape.out_dtype));
    }
    if (options.max_rows < 1) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument, "gemm: max_rows {} must be >= 1",
                           options.max_rows);
    }
    GemmShape s = shape;
    if (s.ldx == 0) s.ldx = s.k;
    if (s.ldw == 0) s.ldw = s.k;
    if (s.ldy == 0) s.ldy = s.n;
    PDSIM_RETURN_IF_ERROR(check_ld("ldx", s.ldx, s.k, 2));
    PDSIM_RETURN_IF_ERROR(check_ld("ldw", s.ldw, s.k, 2));
    PDSIM_RETURN_IF_ERROR(check_ld("ldy", s.ldy, s.n, elem_bytes(s.out_dtype)));
    return s;
}

// ---------------------------------------------------------------------------------------------
// BatchInvariantGemm
// ---------------------------------------------------------------------------------------------

struct BatchInvariantGemm::Impl {
    LtProblem problem;
    cublasLtMatmulAlgo_t algo{};
    GemmAlgo info;
    std::vector<uint8_t> checked;  // [max_rows + 1]: 1 once check_rows(T) passed
};

BatchInvariantGemm::BatchInvariantGemm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BatchInvariantGemm::~BatchInvariantGemm() = default;

StatusOr<std::unique_ptr<BatchInvariantGemm>> BatchInvariantGemm::create(
    const GemmShape& shape, const GemmOptions& options) {
    PDSIM_ASSIGN_OR_RETURN(GemmShape s, resolve_gemm_shape(shape, options));
    auto impl = std::make_unique<Impl>();
    const int64_t plan_rows = std::min(options.max_rows, kDefaultPlanRowsCap);
    PDSIM_RETURN_IF_ERROR(impl->problem.init(s, options, plan_rows));
    // Ask for algorithms without a reduction scheme first; should the heuristic have none, take
    // its usual ones: either way each candidate is pinned to split-K 1 below.
    PDSIM_RETURN_IF_ERROR(impl->problem.allow_reductions(false));
    PDSIM_ASSIGN_OR_RETURN(auto candidates, impl->problem.heuristic(kHeuristicCandidates));
    if (candidates.empty()) {
        PDSIM_RETURN_IF_ERROR(impl->problem.allow_reductions(true));
        PDSIM_ASSIGN_OR_RETURN(candidates, impl->problem.heuristic(kHeuristicCandidates));
    }

    // The T's every candidate must run: the two ends and the sizes the invariance tests batch at.
    std::vector<int64_t> probes = {1, 7, 64, plan_rows, options.max_rows};
    std::sort(probes.begin(), probes.end());
    probes.erase(std::unique(probes.begin(), probes.end()), probes.end());
    probes.erase(std::remove_if(probes.begin(), probes.end(),
                                [&](int64_t t) { return t > options.max_rows; }),
                 probes.end());

    std::string rejected;
    for (const auto& cand : candidates) {
        cublasLtMatmulAlgo_t algo = cand.algo;
        const int32_t one = 1;
        const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
        if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one,
                                                 sizeof(one)) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                                                 &none, sizeof(none)) != CUBLAS_STATUS_SUCCESS) {
            continue;
        }
        size_t workspace = 0;
        Status st;
        for (int64_t t : probes) {
            PDSIM_RETURN_IF_ERROR(impl->problem.set_rows(t));
            auto ws = impl->problem.check(algo);
            if (!ws.ok()) {
                st = ws.status().with_context(fmt::format("T={}", t));
                break;
            }
            workspace = std::max(workspace, *ws);
        }
        if (!st.ok()) {
            rejected += fmt::format("; {}: {}", describe(algo, 0).to_string(), st.message());
            continue;
        }
        impl->algo = algo;
        impl->info = describe(algo, workspace);
        impl->checked.assign(static_cast<size_t>(options.max_rows) + 1, 0);
        for (int64_t t : probes) impl->checked[static_cast<size_t>(t)] = 1;
        return std::unique_ptr<BatchInvariantGemm>(new BatchInvariantGemm(std::move(impl)));
    }
    return PDSIM_ERROR(
        StatusCode::kFailedPrecondition,
        "gemm {}: no cuBLASLt algorithm without split-K runs every T in [1, {}] ({} heuristic "
        "candidates{})",
        shape_text(s), options.max_rows, candidates.size(), rejected);
}

Status BatchInvariantGemm::check_rows(int rows) {
    const int max_rows = static_cast<int>(impl_->checked.size()) - 1;
    if (rows < 1 || rows > max_rows) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "gemm {}: rows {} outside [1, max_rows {}]",
                           shape_text(impl_->problem.shape()), rows, max_rows);
    }
    if (impl_->checked[static_cast<size_t>(rows)] != 0) return {};
    PDSIM_RETURN_IF_ERROR(impl_->problem.set_rows(rows));
    auto ws = impl_->problem.check(impl_->algo);
    if (!ws.ok()) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "gemm {}: the pinned cuBLASLt {} cannot run T={}: {}",
                           shape_text(impl_->problem.shape()), impl_->info.to_string(), rows,
                           ws.status().message());
    }
    impl_->info.workspace_bytes = std::max(impl_->info.workspace_bytes, *ws);
    impl_->checked[static_cast<size_t>(rows)] = 1;
    return {};
}

Status BatchInvariantGemm::run(const bf16_t* x, const bf16_t* w, void* y, int rows,
                               runtime::Stream& stream) {
    if (rows == 0) return {};
    PDSIM_RETURN_IF_ERROR(check_pointers(x, w, y));
    PDSIM_RETURN_IF_ERROR(check_rows(rows));
    PDSIM_RETURN_IF_ERROR(impl_->problem.set_rows(rows));
    return impl_->problem.matmul(impl_->algo, x, w, y, stream);
}

const GemmShape& BatchInvariantGemm::shape() const {
    return impl_->problem.shape();
}
const GemmAlgo& BatchInvariantGemm::algo() const {
    return impl_->info;
}
int BatchInvariantGemm::max_rows() const {
    return static_cast<int>(impl_->checked.size()) - 1;
}

// ---------------------------------------------------------------------------------------------
// HeuristicGemm
// ---------------------------------------------------------------------------------------------

struct HeuristicGemm::Impl {
    LtProblem problem;
    cublasLtMatmulAlgo_t algo{};
    GemmAlgo info;
    int64_t m = 0;
};

HeuristicGemm::HeuristicGemm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HeuristicGemm::~HeuristicGemm() = default;

StatusOr<std::unique_ptr<HeuristicGemm>> HeuristicGemm::create(int64_t m, const GemmShape& shape,
                                                               const GemmOptions& options) {
    if (m < 1) return PDSIM_ERROR(StatusCode::kInvalidArgument, "gemm: m {} must be >= 1", m);
    PDSIM_ASSIGN_OR_RETURN(GemmShape s, resolve_gemm_shape(shape, options));
    auto impl = std::make_unique<Impl>();
    impl->m = m;
    PDSIM_RETURN_IF_ERROR(impl->problem.init(s, options, m));
    PDSIM_ASSIGN_OR_RETURN(auto candidates, impl->problem.heuristic(1));
    if (candidates.empty()) {
        return PDSIM_ERROR(StatusCode::kFailedPrecondition,
                           "gemm M={} {}: cuBLASLt has no algorithm", m, shape_text(s));
    }
    impl->algo = candidates[0].algo;
    impl->info = describe(impl->algo, candidates[0].workspaceSize);
    return std::unique_ptr<HeuristicGemm>(new HeuristicGemm(std::move(impl)));
}

Status HeuristicGemm::run(const bf16_t* x, const bf16_t* w, void* y, runtime::Stream& stream) {
    PDSIM_RETURN_IF_ERROR(check_pointers(x, w, y));
    return impl_->problem.matmul(impl_->algo, x, w, y, stream);
}

int64_t HeuristicGemm::m() const {
    return impl_->m;
}
const GemmShape& HeuristicGemm::shape() const {
    return impl_->problem.shape();
}
const GemmAlgo& HeuristicGemm::algo() const {
    return impl_->info;
}
double HeuristicGemm::flops() const {
    const GemmShape& s = impl_->problem.shape();
    return 2.0 * static_cast<double>(impl_->m) * static_cast<double>(s.n) *
           static_cast<double>(s.k);
}

}  // namespace pdsim::model::cuda

#include "sim/cost/calibrated.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/stats.h"
#include "topology/model_shape.h"

namespace pdsim::cost {

namespace {

using json = nlohmann::json;

// Solves A x = b (n x n, row-major) by Gaussian elimination with partial pivoting; false when
// A is singular to working precision.
bool solve(std::vector<double> a, std::vector<double> b, size_t n, std::vector<double>* x) {
    for (size_t col = 0; col < n; ++col) {
        size_t piv = col;
        for (size_t r = col + 1; r < n; ++r) {
            if (std::abs(a[r * n + col]) > std::abs(a[piv * n + col])) piv = r;
        }
        if (std::abs(a[piv * n + col]) < 1e-12) return false;
        if (piv != col) {
            for (size_t c = 0; c < n; ++c) std::swap(a[col * n + c], a[piv * n + c]);
            std::swap(b[col], b[piv]);
        }
        for (size_t r = col + 1; r < n; ++r) {
            const double f = a[r * n + col] / a[col * n + col];
            for (size_t c = col; c < n; ++c) a[r * n + c] -= f * a[col * n + c];
            b[r] -= f * b[col];
        }
    }
    x->assign(n, 0);
    for (size_t i = n; i-- > 0;) {
        double s = b[i];
        for (size_t c = i + 1; c < n; ++c) s -= a[i * n + c] * (*x)[c];
        (*x)[i] = s / a[i * n + i];
    }
    return true;
}

class CalibratedModel final : public CostModel {
public:
    CalibratedModel(std::string label, std::array<double, 4> extend, std::array<double, 4> decode,
                    double interference_extend, double interference_decode, CostNoise noise_extend,
                    CostNoise noise_decode, CostWake wake)
        : label_(std::move(label)),
          extend_(extend),
          decode_(decode),
          interference_extend_(interference_extend),
          interference_decode_(interference_decode),
          noise_extend_(noise_extend),
          noise_decode_(noise_decode),
          wake_(wake) {}

    [[nodiscard]] CostWake wake() const override { return wake_; }

    [[nodiscard]] CostNoise noise(bool decode) const override {
        return decode ? noise_decode_ : noise_extend_;
    }

    [[nodiscard]] double interference(bool decode) const override {
        return decode ? interference_decode_ : interference_extend_;
    }

    [[nodiscard]] std::string describe() const override { return label_; }

    [[nodiscard]] double extend_s(std::span<const ExtendItem> batch) const override {
        const auto f = extend_features(batch);
        if (f[1] <= 0) return 0;
        double s = 0;
        for (size_t i = 0; i < f.size(); ++i) s += extend_[i] * f[i];
        return s;
    }

    [[nodiscard]] double decode_s(int64_t batch_size, int64_t kv_tokens) const override {
        if (batch_size <= 0) return 0;
        const auto f = decode_features(batch_size, kv_tokens);
        double s = 0;
        for (size_t i = 0; i < f.size(); ++i) s += decode_[i] * f[i];
        return s;
    }

private:
    std::string label_;
    std::array<double, 4> extend_;
    std::array<double, 4> decode_;
    double interference_extend_, interference_decode_;
    CostNoise noise_extend_, noise_decode_;
    CostWake wake_;
};

std::string list_fits(const json& fits) {
    std::string s;
    for (const auto& f : fits) {
        s += fmt::format("{}tp {} threads {}", s.empty() ? "" : ", ", f.at("tp").get<int>(),
                         f.at("threads").get<int>());
    }
    return s;
}

}  // namespace

double attn_pairs(std::span<const ExtendItem> batch) {
    double p = 0;
    for (const ExtendItem& it : batch) {
        const double n = static_cast<double>(it.new_tokens);
        if (n <= 0) continue;
        p += n * (static_cast<double>(it.cached_tokens) + (n + 1) / 2);
    }
    return p;
}

std::array<double, 4> extend_features(std::span<const ExtendItem> batch) {
    double tokens = 0, requests = 0;
    for (const ExtendItem& it : batch) {
        if (it.new_tokens <= 0) continue;
        tokens += static_cast<double>(it.new_tokens);
        requests += 1;
    }
    return {1.0, tokens, attn_pairs(batch), requests};
}

double weight_passes(int64_t rows) {
    return static_cast<double>(rows / 4 + rows % 4);
}

std::array<double, 4> decode_features(int64_t batch_size, int64_t kv_tokens) {
    return {1.0, static_cast<double>(batch_size), weight_passes(batch_size),
            static_cast<double>(kv_tokens)};
}

namespace {

// Non-negative least squares of (x_i . coef - y_i) / w_i.
StatusOr<std::vector<double>> fit_weighted(const std::vector<std::vector<double>>& x,
                                           const std::vector<double>& y,
                                           const std::vector<double>& w) {
    const size_t m = y.size(), p = x[0].size();
    // Columns scaled to unit max for conditioning.
    std::vector<double> scale(p, 0);
    for (size_t i = 0; i < m; ++i) {
        for (size_t j = 0; j < p; ++j) scale[j] = std::max(scale[j], std::abs(x[i][j] / w[i]));
    }
    for (double& s : scale) s = s > 0 ? s : 1;
    auto row = [&](size_t i, size_t j) { return x[i][j] / w[i] / scale[j]; };

    double best_sse = std::numeric_limits<double>::infinity();
    std::vector<double> best(p, 0);
    for (uint32_t mask = 1; mask < (1u << p); ++mask) {
        std::vector<size_t> cols;
        for (size_t j = 0; j < p; ++j) {
            if (mask & (1u << j)) cols.push_back(j);
        }
        const size_t k = cols.size();
        std::vector<double> ata(k * k, 0), atb(k, 0), sol;
        for (size_t i = 0; i < m; ++i) {
            const double t = y[i] / w[i];
            for (size_t a = 0; a < k; ++a) {
                const double va = row(i, cols[a]);
                atb[a] += va * t;
                for (size_t b = 0; b < k; ++b) ata[a * k + b] += va * row(i, cols[b]);
            }
        }
        if (!solve(ata, atb, k, &sol)) continue;
        if (std::any_of(sol.begin(), sol.end(), [](double v) { return v < 0; })) continue;
        double sse = 0;
        for (size_t i = 0; i < m; ++i) {
            double r = -y[i] / w[i];
            for (size_t a = 0; a < k; ++a) r += row(i, cols[a]) * sol[a];
            sse += r * r;
        }
        if (sse < best_sse) {
            best_sse = sse;
            std::fill(best.begin(), best.end(), 0);
            for (size_t a = 0; a < k; ++a) best[cols[a]] = sol[a] / scale[cols[a]];
        }
    }
    if (!std::isfinite(best_sse)) {
        return Status(StatusCode::kInvalidArgument, "fit: no non-negative solution");
    }
    return best;
}

}  // namespace

StatusOr<LinearFit> fit_nonnegative(const std::vector<std::vector<double>>& x,
                                    const std::vector<double>& y, FitTarget target) {
    const size_t m = y.size();
    if (m == 0 || x.size() != m) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("fit: {} feature rows for {} times", x.size(), m));
    }
    const size_t p = x[0].size();
    if (m < p) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("fit: {} points for {} features", m, p));
    }
    for (size_t i = 0; i < m; ++i) {
        if (x[i].size() != p) return Status(StatusCode::kInvalidArgument, "fit: ragged features");
        if (!(y[i] > 0) || !std::isfinite(y[i])) {
            return Status(StatusCode::kInvalidArgument,
                          fmt::format("fit: time {} of point {} is not positive", y[i], i));
        }
    }
    PDSIM_ASSIGN_OR_RETURN(std::vector<double> best, fit_weighted(x, y, y));
    if (target == FitTarget::kMean) {
        std::vector<double> w(m);
        for (size_t i = 0; i < m; ++i) {
            double pred = 0;
            for (size_t j = 0; j < p; ++j) pred += best[j] * x[i][j];
            w[i] = pred > 0 ? pred : y[i];
        }
        PDSIM_ASSIGN_OR_RETURN(best, fit_weighted(x, y, w));
    }
    LinearFit fit;
    fit.coef = best;
    double mean = 0;
    for (double v : y) mean += v;
    mean /= static_cast<double>(m);
    double ss_res = 0, ss_tot = 0;
    for (size_t i = 0; i < m; ++i) {
        double pred = 0;
        for (size_t j = 0; j < p; ++j) pred += best[j] * x[i][j];
        ss_res += (pred - y[i]) * (pred - y[i]);
        ss_tot += (y[i] - mean) * (y[i] - mean);
        const double rel = std::abs(pred - y[i]) / y[i];
        fit.max_rel_err = std::max(fit.max_rel_err, rel);
        fit.mean_rel_err += rel / static_cast<double>(m);
    }
    fit.r2 = ss_tot > 0 ? 1 - ss_res / ss_tot : (ss_res == 0 ? 1 : 0);
    return fit;
}

StatusOr<std::unique_ptr<CostModel>> make_calibrated_model(const InstanceSpec& spec,
                                                           const CostFile& file) {
    const json& j = file.json();
    const std::string& src = file.source();
    // What the file measured: the CPU testbed (calibrate's microbenchmark, or CPU ranks'
    // timelines), or GPU ranks' timelines (`device: gpu`). It serves devices of that kind only.
    const std::string file_device = j.value("device", std::string("cpu"));
    if (file_device == "gpu" && spec.device == "cpu") {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("calibrated cost model ({}): device 'cpu', but the file was "
                                  "fitted on GPU ranks' timelines (device: gpu)",
                                  src));
    }
    if (file_device != "gpu" && spec.device != "cpu") {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("calibrated cost model ({}): device '{}' is not cpu; the cost "
                                  "file measures the CPU testbed (calibrate --from-timeline on a "
                                  "GPU testbed run's timelines, or use roofline for GPUs)",
                                  src, spec.device));
    }
    const std::string file_model = j.at("model").get<std::string>();
    const json& fits = j.at("fits");
    if (spec.model.name != file_model) {
        return Status(
            StatusCode::kInvalidArgument,
            fmt::format("{}: model: the file is calibrated for model '{}', not '{}' "
                        "(it has: {}); run pdsim calibrate --model {}",
                        src, file_model, spec.model.name, list_fits(fits), spec.model.name));
    }
    if (j.contains("model_config")) {
        const json& mc = j["model_config"];
        const model::ModelConfig& m = spec.model;
        for (const topo::ModelDimension& dim : topo::kModelDimensions) {
            const std::string key(dim.key);
            const int want = m.*dim.field;
            if (mc.contains(key) && mc[key].get<int>() != want) {
                return Status(StatusCode::kInvalidArgument,
                              fmt::format("{}: model_config.{} is {}, model {} here has {}", src,
                                          key, mc[key].get<int>(), m.name, want));
            }
        }
    }
    std::vector<const json*> same_tp;
    for (const auto& f : fits) {
        if (f.at("tp").get<int>() == spec.tp) same_tp.push_back(&f);
    }
    const json* chosen = nullptr;
    if (spec.threads > 0) {
        for (const json* f : same_tp) {
            if (f->at("threads").get<int>() == spec.threads) chosen = f;
        }
    } else if (same_tp.size() == 1) {
        chosen = same_tp.front();
    } else if (same_tp.size() > 1) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("{}: fits: model {} tp {} was calibrated at several thread "
                                  "counts ({}); say which (threads)",
                                  src, file_model, spec.tp, list_fits(fits)));
    }
    if (chosen == nullptr) {
        return Status(
            StatusCode::kInvalidArgument,
            fmt::format("{}: fits: no fit for model {} tp {}{} (it has: {}); run pdsim "
                        "calibrate --model {} --tp {}{}",
                        src, file_model, spec.tp,
                        spec.threads > 0 ? fmt::format(" threads {}", spec.threads) : "",
                        list_fits(fits), file_model, spec.tp,
                        spec.threads > 0 ? fmt::format(" --threads {}", spec.threads) : ""));
    }
    std::array<double, 4> e{};
    std::array<double, 4> d{};
    for (size_t i = 0; i < kExtendKeys.size(); ++i) {
        e[i] = chosen->at("extend").at(kExtendKeys[i]).get<double>();
    }
    for (size_t i = 0; i < kDecodeKeys.size(); ++i) {
        d[i] = chosen->at("decode").value(kDecodeKeys[i], 0.0);
    }
    const std::string label = fmt::format("calibrated {} tp{} threads {}", src, spec.tp,
                                          chosen->at("threads").get<int>());
    // A fit's own interference (the serve probe's, measured in that fit's rank layout) wins over
    // the file's (a --from-timeline fit of every instance together).
    const json ix = chosen->contains("interference") ? chosen->at("interference")
                                                     : j.value("interference", json::object());
    const json nz = j.value("noise", json::object());
    auto noise = [&](const char* kind) {
        const json k = nz.value(kind, json::object());
        return CostNoise{k.value("fast_cv", 0.0), k.value("fast_quantiles", std::vector<double>()),
                         k.value("slow_cv", 0.0), k.value("slow_period_s", 0.0)};
    };
    CostWake wake;
    if (chosen->contains("wake")) {
        const json& w = chosen->at("wake");
        wake = {w.at("min_idle_s").get<double>(), w.at("lost_s").get<double>(),
                w.at("tau_s").get<double>()};
    }
    return std::unique_ptr<CostModel>(new CalibratedModel(label, e, d, ix.value("extend", 0.0),
                                                          ix.value("decode", 0.0), noise("extend"),
                                                          noise("decode"), wake));
}

std::optional<WakeFit> fit_wake(std::span<const double> median_s) {
    if (median_s.size() < kWakeWarmTail + 2) return std::nullopt;
    const double warm = stats::median(std::vector<double>(
        median_s.end() - static_cast<std::ptrdiff_t>(kWakeWarmTail), median_s.end()));
    if (!(warm > 0)) return std::nullopt;
    // log(excess_k) = a + k log q over the leading forwards still measurably slow.
    std::vector<double> ks, ys;
    for (size_t k = 0; k + kWakeWarmTail < median_s.size(); ++k) {
        const double excess = median_s[k] / warm - 1;
        if (!(excess > kWakeMinExcess)) break;
        ks.push_back(static_cast<double>(k));
        ys.push_back(std::log(excess));
    }
    if (ks.size() < 2) return std::nullopt;
    const auto n = static_cast<double>(ks.size());
    double mk = 0, my = 0;
    for (size_t i = 0; i < ks.size(); ++i) {
        mk += ks[i] / n;
        my += ys[i] / n;
    }
    double sxy = 0, sxx = 0;
    for (size_t i = 0; i < ks.size(); ++i) {
        sxy += (ks[i] - mk) * (ys[i] - my);
        sxx += (ks[i] - mk) * (ks[i] - mk);
    }
    const double slope = sxy / sxx;
    const double q = std::exp(slope);
    if (!(q > 0 && q < 1)) return std::nullopt;
    const double excess0 = std::exp(my - slope * mk);
    WakeFit f;
    f.wake = {kWakeMinIdleS, excess0 * warm / (1 - q), warm / std::log(1 / q)};
    f.warm_forward_s = warm;
    return f;
}

}  // namespace pdsim::cost

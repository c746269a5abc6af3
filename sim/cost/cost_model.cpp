#include "sim/cost/cost_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "common/input_file.h"
#include "common/stats.h"
#include "common/text.h"
#include "sim/cost/calibrated.h"
#include "sim/cost/roofline.h"
#include "topology/model_shape.h"

namespace pdsim::cost {

namespace {

// A core_wait above this is not a scheduler's wait (a descheduled forward, a stalled machine).
constexpr double kMaxCoreWaitMs = 1000;

using json = nlohmann::json;

std::string type_name(const json& v) {
    if (v.is_number_integer()) return "an integer";
    if (v.is_number()) return "a number";
    return std::string("a ") + v.type_name();
}

// Validation of the cost file: every error names the source and the field path.
class Checker {
public:
    explicit Checker(std::string source) : source_(std::move(source)) {}

    [[nodiscard]] Status error(const std::string& path, const std::string& what) const {
        return Status(StatusCode::kInvalidArgument, fmt::format("{}: {}: {}", source_, path, what));
    }

    [[nodiscard]] StatusOr<const json*> field(const json& obj, const std::string& path,
                                              const std::string& key) const {
        if (!obj.contains(key)) return error(join(path, key), "missing");
        return &obj.at(key);
    }

    [[nodiscard]] Status object(const json& obj, const std::string& path,
                                const std::string& key) const {
        PDSIM_ASSIGN_OR_RETURN(const json* v, field(obj, path, key));
        if (!v->is_object())
            return error(join(path, key), "expected an object, got " + type_name(*v));
        return {};
    }

    [[nodiscard]] StatusOr<int64_t> integer(const json& obj, const std::string& path,
                                            const std::string& key, int64_t min) const {
        PDSIM_ASSIGN_OR_RETURN(const json* v, field(obj, path, key));
        if (!v->is_number_integer()) {
            return error(join(path, key), "expected an integer, got " + type_name(*v));
        }
        const auto n = v->get<int64_t>();
        if (n < min) return error(join(path, key), fmt::format("{} must be >= {}", n, min));
        return n;
    }

    // A finite number >= 0 (> 0 when `positive`).
    [[nodiscard]] StatusOr<double> number(const json& obj, const std::string& path,
                                          const std::string& key, bool positive) const {
        PDSIM_ASSIGN_OR_RETURN(const json* v, field(obj, path, key));
        if (!v->is_number())
            return error(join(path, key), "expected a number, got " + type_name(*v));
        const auto x = v->get<double>();
        if (!std::isfinite(x) || x < 0 || (positive && x == 0)) {
            return error(join(path, key),
                         fmt::format("{} must be {}", x, positive ? "> 0" : ">= 0"));
        }
        return x;
    }

    [[nodiscard]] static std::string join(const std::string& path, const std::string& key) {
        return path.empty() ? key : path + "." + key;
    }

private:
    std::string source_;
};

Status validate(const json& j, const std::string& source) {
    Checker c(source);
    if (!j.is_object())
        return c.error("(root)", "a cost file is a JSON object, got " + type_name(j));
    PDSIM_ASSIGN_OR_RETURN(int64_t version, c.integer(j, "", "schema_version", 1));
    if (version != kCostSchemaVersion) {
        return c.error("schema_version", fmt::format("{} is not supported (this pdsim reads {})",
                                                     version, kCostSchemaVersion));
    }
    PDSIM_ASSIGN_OR_RETURN(const json* model, c.field(j, "", "model"));
    if (!model->is_string() || model->get<std::string>().empty()) {
        return c.error("model", "expected a model name (string), got " + type_name(*model));
    }
    if (j.contains("model_config")) {
        if (!j["model_config"].is_object()) {
            return c.error("model_config",
                           "expected an object, got " + type_name(j["model_config"]));
        }
        for (const topo::ModelDimension& dim : topo::kModelDimensions) {
            const std::string key(dim.key);
            if (!j["model_config"].contains(key)) continue;
            PDSIM_RETURN_IF_ERROR(c.integer(j["model_config"], "model_config", key, 1).status());
        }
    }
    if (j.contains("device")) {
        const json& d = j["device"];
        if (!d.is_string() || (d.get<std::string>() != "cpu" && d.get<std::string>() != "gpu")) {
            return c.error("device", "expected \"cpu\" or \"gpu\", got " + d.dump());
        }
    }
    PDSIM_ASSIGN_OR_RETURN(const json* fits, c.field(j, "", "fits"));
    if (!fits->is_array()) return c.error("fits", "expected an array, got " + type_name(*fits));
    if (fits->empty()) return c.error("fits", "empty (no calibrated TP size)");
    std::set<std::pair<int64_t, int64_t>> seen;
    for (size_t i = 0; i < fits->size(); ++i) {
        const json& f = (*fits)[i];
        const std::string path = fmt::format("fits[{}]", i);
        if (!f.is_object()) return c.error(path, "expected an object, got " + type_name(f));
        PDSIM_ASSIGN_OR_RETURN(int64_t tp, c.integer(f, path, "tp", 1));
        PDSIM_ASSIGN_OR_RETURN(int64_t threads, c.integer(f, path, "threads", 1));
        if (!seen.insert({tp, threads}).second) {
            return c.error(path, fmt::format("a second fit for tp {} threads {}", tp, threads));
        }
        PDSIM_RETURN_IF_ERROR(c.object(f, path, "extend"));
        for (const char* key : kExtendKeys) {
            PDSIM_RETURN_IF_ERROR(c.number(f["extend"], path + ".extend", key, false).status());
        }
        PDSIM_RETURN_IF_ERROR(c.object(f, path, "decode"));
        for (size_t k = 0; k < kDecodeKeys.size(); ++k) {
            if (!kDecodeKeyRequired[k] && !f["decode"].contains(kDecodeKeys[k])) continue;
            PDSIM_RETURN_IF_ERROR(
                c.number(f["decode"], path + ".decode", kDecodeKeys[k], false).status());
        }
        if (f.contains("wake")) {
            PDSIM_RETURN_IF_ERROR(c.object(f, path, "wake"));
            for (const char* key : {"min_idle_s", "lost_s", "tau_s"}) {
                PDSIM_RETURN_IF_ERROR(c.number(f["wake"], path + ".wake", key, false).status());
            }
        }
        if (f.contains("interference")) {
            PDSIM_RETURN_IF_ERROR(c.object(f, path, "interference"));
            for (const char* kind : {"extend", "decode"}) {
                if (f["interference"].contains(kind)) {
                    PDSIM_RETURN_IF_ERROR(
                        c.number(f["interference"], path + ".interference", kind, false).status());
                }
            }
        }
        if (f.contains("points") && !f["points"].is_array()) {
            return c.error(path + ".points", "expected an array, got " + type_name(f["points"]));
        }
    }
    if (j.contains("interference")) {
        const json& x = j["interference"];
        if (!x.is_object()) {
            return c.error("interference", "expected an object, got " + type_name(x));
        }
        for (const char* kind : {"extend", "decode"}) {
            if (x.contains(kind)) {
                PDSIM_RETURN_IF_ERROR(c.number(x, "interference", kind, false).status());
            }
        }
    }
    if (j.contains("noise")) {
        const json& x = j["noise"];
        if (!x.is_object()) return c.error("noise", "expected an object, got " + type_name(x));
        for (const char* kind : {"extend", "decode"}) {
            if (!x.contains(kind)) continue;
            const std::string path = std::string("noise.") + kind;
            if (!x[kind].is_object()) {
                return c.error(path, "expected an object, got " + type_name(x[kind]));
            }
            for (const char* key : {"fast_cv", "slow_cv", "slow_period_s"}) {
                if (x[kind].contains(key)) {
                    PDSIM_RETURN_IF_ERROR(c.number(x[kind], path, key, false).status());
                }
            }
            if (x[kind].contains("fast_quantiles")) {
                const json& q = x[kind]["fast_quantiles"];
                const std::string qp = path + ".fast_quantiles";
                if (!q.is_array() || q.size() < 2) {
                    return c.error(qp, "expected an array of at least 2 numbers");
                }
                double prev = 0;
                for (size_t i = 0; i < q.size(); ++i) {
                    const bool ok = q[i].is_number() && std::isfinite(q[i].get<double>()) &&
                                    q[i].get<double>() >= prev;
                    if (!ok) {
                        return c.error(fmt::format("{}[{}]", qp, i),
                                       "expected a finite number >= 0 and >= the one before");
                    }
                    prev = q[i].get<double>();
                }
            }
        }
    }
    if (j.contains("speed_probe")) {
        PDSIM_RETURN_IF_ERROR(c.object(j, "", "speed_probe"));
        const json& p = j["speed_probe"];
        if (!p.contains("kernel") || !p["kernel"].is_string()) {
            return c.error("speed_probe.kernel", "expected the probe kernel's name (string)");
        }
        PDSIM_RETURN_IF_ERROR(c.number(p, "speed_probe", "cpu_ms_p50", true).status());
    }
    if (j.contains("core_wait")) {
        PDSIM_RETURN_IF_ERROR(c.object(j, "", "core_wait"));
        const json& w = j["core_wait"];
        PDSIM_ASSIGN_OR_RETURN(const double ms, c.number(w, "core_wait", "dispatch_ms", false));
        if (ms > kMaxCoreWaitMs) {
            return c.error("core_wait.dispatch_ms",
                           fmt::format("{} ms: expected at most {} ms", ms, kMaxCoreWaitMs));
        }
    }
    if (j.contains("step_wait")) {
        PDSIM_RETURN_IF_ERROR(c.object(j, "", "step_wait"));
        PDSIM_ASSIGN_OR_RETURN(const json* decode, c.field(j["step_wait"], "step_wait", "decode"));
        if (!decode->is_array()) {
            return c.error("step_wait.decode", "expected an array, got " + type_name(*decode));
        }
        for (size_t i = 0; i < decode->size(); ++i) {
            const std::string path = fmt::format("step_wait.decode[{}]", i);
            const json& row = (*decode)[i];
            if (!row.is_object()) return c.error(path, "expected an object, got " + type_name(row));
            PDSIM_ASSIGN_OR_RETURN(const int64_t n, c.integer(row, path, "competitors", 1));
            if (n != static_cast<int64_t>(i) + 1) {
                return c.error(
                    path + ".competitors",
                    fmt::format("{}: expected {} (one row per count, from 1)", n, i + 1));
            }
            PDSIM_ASSIGN_OR_RETURN(const double chance, c.number(row, path, "chance", false));
            if (chance > 1) {
                return c.error(path + ".chance", fmt::format("{}: expected at most 1", chance));
            }
            PDSIM_ASSIGN_OR_RETURN(const double ms, c.number(row, path, "wait_ms", false));
            if (ms > kMaxCoreWaitMs) {
                return c.error(path + ".wait_ms",
                               fmt::format("{} ms: expected at most {} ms", ms, kMaxCoreWaitMs));
            }
        }
    }
    if (j.contains("transports")) {
        const json& t = j["transports"];
        if (!t.is_object()) return c.error("transports", "expected an object, got " + type_name(t));
        for (const auto& [name, v] : t.items()) {
            const std::string path = "transports." + name;
            if (!v.is_object()) return c.error(path, "expected an object, got " + type_name(v));
            PDSIM_RETURN_IF_ERROR(c.number(v, path, "gbps", true).status());
            PDSIM_RETURN_IF_ERROR(c.number(v, path, "latency_us", false).status());
        }
    }
    return {};
}

}  // namespace

StatusOr<CostFile> CostFile::load(const std::string& path) {
    auto bytes = files::read_input_file(path, files::kMaxConfigFileBytes);
    if (!bytes.ok()) {
        return invalid_argument_error(bytes.status().message() +
                                      " (a cost file; write one with pdsim calibrate)");
    }
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(*bytes);
    } catch (const nlohmann::json::parse_error& e) {
        const size_t at = std::min(e.byte, bytes->size());
        const auto line =
            1 + std::count(bytes->begin(), bytes->begin() + static_cast<long>(at), '\n');
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("{}:{}: not valid JSON (byte {}): {}", path, line, e.byte,
                                  text::excerpt(e.what(), 160)));
    } catch (const nlohmann::json::exception& e) {
        // Not a syntax error but a value nlohmann cannot hold (out_of_range 406: a number such as
        // 1e400 that overflows a double), thrown by the same parse.
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("{}: not valid JSON: {}", path, text::excerpt(e.what(), 160)));
    }
    return from_json(j, path);
}

StatusOr<CostFile> CostFile::from_json(const nlohmann::json& j, const std::string& source) {
    PDSIM_RETURN_IF_ERROR(validate(j, source));
    CostFile f;
    f.json_ = j;
    f.source_ = source;
    return f;
}

std::optional<LinkCost> CostFile::transport(const std::string& name) const {
    if (!json_.contains("transports") || !json_["transports"].contains(name)) return std::nullopt;
    const nlohmann::json& t = json_["transports"][name];
    return LinkCost{t.at("gbps").get<double>(), t.at("latency_us").get<double>()};
}

std::optional<SpeedLevel> report_speed_level(const nlohmann::json& report,
                                             std::string_view instance) {
    if (!report.is_object() || !report.contains("ranks") || !report["ranks"].is_array()) {
        return std::nullopt;
    }
    std::string kernel;
    std::vector<double> levels;
    for (const json& rank : report["ranks"]) {
        if (!rank.is_object() || !rank.contains("stats") || !rank["stats"].is_object()) continue;
        if (!instance.empty()) {
            const json id = rank.value("instance", json());
            if (!id.is_string() || id.get<std::string>() != instance) continue;
        }
        const json& stats = rank["stats"];
        if (!stats.contains("speed_probe") || !stats["speed_probe"].is_object()) continue;
        const json& p = stats["speed_probe"];
        const json k = p.value("kernel", json()), level = p.value("cpu_ms_p50", json());
        if (!k.is_string() || !level.is_number() || !std::isfinite(level.get<double>()) ||
            level.get<double>() <= 0) {
            continue;
        }
        if (!kernel.empty() && kernel != k.get<std::string>()) return std::nullopt;
        kernel = k.get<std::string>();
        levels.push_back(level.get<double>());
    }
    if (levels.empty()) return std::nullopt;
    return SpeedLevel{kernel, stats::median(levels)};
}

std::optional<SpeedLevel> CostFile::speed_probe() const {
    if (!json_.contains("speed_probe")) return std::nullopt;
    const nlohmann::json& p = json_["speed_probe"];
    return SpeedLevel{p.at("kernel").get<std::string>(), p.at("cpu_ms_p50").get<double>()};
}

std::optional<CoreWait> CostFile::core_wait() const {
    if (!json_.contains("core_wait")) return std::nullopt;
    const nlohmann::json& w = json_["core_wait"];
    return CoreWait{w.at("dispatch_ms").get<double>() / 1e3};
}

std::optional<StepWait> CostFile::step_wait() const {
    if (!json_.contains("step_wait")) return std::nullopt;
    StepWait w;
    for (const nlohmann::json& row : json_["step_wait"]["decode"]) {
        w.decode.push_back({.chance = row.at("chance").get<double>(),
                            .wait_s = row.at("wait_ms").get<double>() / 1e3});
    }
    return w;
}

ScaledCostModel::ScaledCostModel(std::shared_ptr<const CostModel> base, double extend_factor,
                                 double decode_factor)
    : base_(std::move(base)), extend_factor_(extend_factor), decode_factor_(decode_factor) {}

std::string ScaledCostModel::describe() const {
    if (extend_factor_ == decode_factor_) {
        return fmt::format("{} x{:.3f} (machine speed)", base_->describe(), decode_factor_);
    }
    return fmt::format("{} extends x{:.3f}, decodes x{:.3f} (machine speed)", base_->describe(),
                       extend_factor_, decode_factor_);
}

double ScaledCostModel::extend_s(std::span<const ExtendItem> batch) const {
    return base_->extend_s(batch) * extend_factor_;
}

double ScaledCostModel::decode_s(int64_t batch_size, int64_t kv_tokens) const {
    return base_->decode_s(batch_size, kv_tokens) * decode_factor_;
}

CostWake ScaledCostModel::wake() const {
    CostWake w = base_->wake();
    w.lost_s *= decode_factor_;
    w.tau_s *= decode_factor_;
    return w;
}

StatusOr<std::unique_ptr<CostModel>> make_cost_model(const std::string& kind,
                                                     const InstanceSpec& spec, const CostFile* file,
                                                     const RooflineOptions& roofline) {
    if (kind == "roofline") return make_roofline_model(spec, roofline);
    if (kind == "calibrated") {
        if (file == nullptr) {
            return Status(StatusCode::kInvalidArgument,
                          "calibrated cost model: no cost file (write one with pdsim calibrate, "
                          "pass it with --cost-model F)");
        }
        StatusOr<std::unique_ptr<CostModel>> m = make_calibrated_model(spec, *file);
        // pdsim calibrate fits dense models only (it refuses the others): its linear terms in
        // tokens and KV tokens know nothing of windows or recurrent states.
        const int dense = spec.model.count_layers(model::LayerKind::kFullAttention);
        if (m.ok() && dense != spec.model.num_layers) {
            return Status(
                StatusCode::kInvalidArgument,
                fmt::format("calibrated cost model ({}): model {} has {} sliding-window and {} "
                            "recurrent layers, and cost files are fitted on full-attention "
                            "models only; use --cost-model roofline (GPU devices)",
                            file->source(), spec.model.name,
                            spec.model.count_layers(model::LayerKind::kSlidingWindow),
                            spec.model.count_layers(model::LayerKind::kRecurrent)));
        }
        return m;
    }
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("unknown cost model kind '{}' (roofline, calibrated)", kind));
}

double CostWake::extra_s(double since_wake_s, double duration_s) const {
    if (!any() || duration_s <= 0) return 0;
    const double t = std::max(0.0, since_wake_s);
    return lost_s * (std::exp(-t / tau_s) - std::exp(-(t + duration_s) / tau_s));
}

}  // namespace pdsim::cost

#include "sim/des/search.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <tuple>

#include "common/check.h"
#include "topology/builders.h"
#include "topology/gpu_spec.h"

namespace pdsim::des {

namespace {

bool is_gb200(std::string_view gpu) {
    const topo::GpuSpec* spec = topo::gpu_spec(gpu);
    return spec != nullptr && spec->name == "GB200";
}

StatusOr<topo::Topology> build(std::string_view gpu, int units, const topo::ClusterOptions& o) {
    return is_gb200(gpu) ? topo::make_gb200_nvl72(units, o) : topo::make_dgx(gpu, units, o);
}

// Candidates of one (tp_p, tp_d) pair, or of one colocated tp when tp_d == 0, using between
// `least` and `budget` GPUs.
int64_t count_pairs(int budget, int least, int tp_p, int tp_d) {
    int64_t n = 0;
    for (int p = 1; p * tp_p <= budget; ++p) {
        if (tp_d == 0) {
            n += p * tp_p >= least ? 1 : 0;
        } else {
            const int most = (budget - p * tp_p) / tp_d;
            const int fewest = std::max(1, (least - p * tp_p + tp_d - 1) / tp_d);
            n += std::max(0, most - fewest + 1);
        }
    }
    return n;
}

int rank_group(const CandidateResult& r) {
    if (!r.ran) return 2;
    return r.meets ? 0 : 1;
}

}  // namespace

std::string Layout::name() const {
    if (mode == SimMode::kColocated) return fmt::format("{}x colocated tp{}", prefill, prefill_tp);
    return fmt::format("{}P(tp{})+{}D(tp{})", prefill, prefill_tp, decode, decode_tp);
}

Layout disagg_layout(int prefill, int prefill_tp, int decode, int decode_tp) {
    return Layout{SimMode::kDisagg, prefill, prefill_tp, decode, decode_tp};
}

Layout colocated_layout(int instances, int tp) {
    return Layout{SimMode::kColocated, instances, tp, 0, 0};
}

StatusOr<int> nvlink_domain(std::string_view gpu) {
    const topo::GpuSpec* spec = topo::gpu_spec(gpu);
    if (spec == nullptr) {
        return invalid_argument_error(
            fmt::format("--gpu {}: unknown GPU (known: {})", gpu, topo::gpu_spec_names()));
    }
    return spec->name == "GB200" ? 72 : 8;
}

StatusOr<std::vector<int>> allowed_tp_sizes(const model::ModelConfig& model,
                                            const SearchSpace& space, const KvCapacityOptions& kv,
                                            std::vector<std::string>* notes) {
    PDSIM_ASSIGN_OR_RETURN(const int domain, nvlink_domain(space.gpu));
    if (space.gpus < 1)
        return invalid_argument_error(fmt::format("--gpus {}: must be >= 1", space.gpus));
    for (int tp : space.tp_sizes) {
        if (tp < 1 || tp > domain || tp > space.gpus) {
            return invalid_argument_error(
                fmt::format("--tp {}: must be in [1, {}] (one NVLink domain of {} and the "
                            "budget of {} GPUs)",
                            tp, std::min(domain, space.gpus), space.gpu, space.gpus));
        }
        if (Status st = model::check_tp(model, tp); !st.ok()) {
            return invalid_argument_error(fmt::format("--tp {}: {}", tp, st.message()));
        }
    }
    std::vector<int> out;
    for (int tp = 1; tp <= std::min(domain, space.gpus); ++tp) {
        if (!model::check_tp(model, tp).ok()) continue;
        if (!space.tp_sizes.empty() &&
            std::find(space.tp_sizes.begin(), space.tp_sizes.end(), tp) == space.tp_sizes.end()) {
            continue;
        }
        PDSIM_ASSIGN_OR_RETURN(topo::Topology t,
                               layout_topology(space.gpu, space.gpus, colocated_layout(1, tp)));
        StatusOr<int64_t> pages = kv_capacity_pages(t, model, 0, kv);
        if (!pages.ok()) {
            if (notes != nullptr) {
                notes->push_back(fmt::format("tp {} left out: {}", tp, pages.status().message()));
            }
            continue;
        }
        out.push_back(tp);
    }
    if (out.empty()) {
        return invalid_argument_error(
            fmt::format("--gpus {}: no TP size of {} fits {} on {} (within one NVLink "
                        "domain of {})",
                        space.gpus, model.name, model.name, space.gpu, domain));
    }
    return out;
}

StatusOr<std::vector<Layout>> enumerate_layouts(std::span<const int> tps,
                                                const SearchSpace& space) {
    if (space.gpus < 1)
        return invalid_argument_error(fmt::format("--gpus {}: must be >= 1", space.gpus));
    if (!space.disagg && !space.colocated)
        return invalid_argument_error("--modes: no mode selected");
    const int n = space.gpus;
    const int least = space.min_gpus;
    if (least < 1 || least > n) {
        return invalid_argument_error(
            fmt::format("--min-gpus {}: must be in [1, --gpus {}]", least, n));
    }
    int64_t total = 0;
    for (int a : tps) {
        if (space.disagg) {
            for (int b : tps) total += count_pairs(n, least, a, b);
        }
        if (space.colocated) total += count_pairs(n, least, a, 0);
    }
    if (total > space.max_candidates) {
        return invalid_argument_error(
            fmt::format("--max-candidates {}: {} GPUs and TP sizes {{{}}} give {} "
                        "candidates; narrow them (--tp, --modes, --gpus) or raise "
                        "--max-candidates",
                        space.max_candidates, n, fmt::join(tps, ", "), total));
    }
    std::vector<Layout> out;
    out.reserve(static_cast<size_t>(total));
    if (space.disagg) {
        for (int a : tps) {
            for (int b : tps) {
                for (int p = 1; p * a + b <= n; ++p) {
                    for (int d = 1; p * a + d * b <= n; ++d) {
                        if (p * a + d * b >= least) out.push_back(disagg_layout(p, a, d, b));
                    }
                }
            }
        }
    }
    if (space.colocated) {
        for (int a : tps) {
            for (int c = 1; c * a <= n; ++c) {
                if (c * a >= least) out.push_back(colocated_layout(c, a));
            }
        }
    }
    PDSIM_CHECK(static_cast<int64_t>(out.size()) == total);
    return out;
}

StatusOr<topo::Topology> layout_topology(std::string_view gpu, int budget, const Layout& layout) {
    PDSIM_ASSIGN_OR_RETURN(const int domain, nvlink_domain(gpu));
    if (budget < 1) return invalid_argument_error(fmt::format("--gpus {}: must be >= 1", budget));
    if (layout.prefill < 1 || layout.prefill_tp < 1 ||
        (layout.mode == SimMode::kDisagg && (layout.decode < 1 || layout.decode_tp < 1))) {
        return invalid_argument_error(
            fmt::format("layout {}: needs at least one instance of each role", layout.name()));
    }
    if (layout.gpus() > budget) {
        return invalid_argument_error(fmt::format("layout {}: {} GPUs exceed the budget of {}",
                                                  layout.name(), layout.gpus(), budget));
    }
    const int units = (budget + domain - 1) / domain;
    topo::ClusterOptions o;
    o.name = layout.name();
    o.prefill = layout.prefill;
    o.prefill_tp = layout.prefill_tp;
    if (layout.mode == SimMode::kDisagg) {
        o.decode = layout.decode;
        o.decode_tp = layout.decode_tp;
        StatusOr<topo::Topology> t = build(gpu, units, o);
        if (!t.ok())
            return invalid_argument_error(
                fmt::format("layout {}: {}", layout.name(), t.status().message()));
        return t;
    }
    // The builders always place a decode instance: add one behind the colocated instances in a
    // spare domain, check the others stayed inside the budget's domains, then drop it.
    o.decode = 1;
    o.decode_tp = layout.prefill_tp;
    StatusOr<topo::Topology> t = build(gpu, units + 1, o);
    if (!t.ok())
        return invalid_argument_error(
            fmt::format("layout {}: {}", layout.name(), t.status().message()));
    std::vector<std::string> inside;
    for (const auto& node : t->nodes) {
        for (const auto& dev : node.devices) inside.push_back(dev.id);
    }
    inside.resize(static_cast<size_t>(units) * static_cast<size_t>(domain));
    t->instances.pop_back();
    for (const auto& inst : t->instances) {
        for (const auto& dev : inst.devices) {
            if (std::find(inside.begin(), inside.end(), dev) == inside.end()) {
                return invalid_argument_error(
                    fmt::format("layout {}: does not fit on {} {} without straddling "
                                "{}-GPU NVLink domains",
                                layout.name(), budget, gpu, domain));
            }
        }
    }
    t->world_size = t->num_ranks();
    return t;
}

void rank_candidates(std::vector<CandidateResult>* results) {
    std::stable_sort(results->begin(), results->end(),
                     [](const CandidateResult& a, const CandidateResult& b) {
                         const int ga = rank_group(a), gb = rank_group(b);
                         if (ga != gb) return ga < gb;
                         if (ga == 2) return false;
                         const int gpa = a.layout.gpus(), gpb = b.layout.gpus();
                         const std::string na = a.layout.name(), nb = b.layout.name();
                         if (ga == 0) {
                             return std::tie(b.goodput_per_gpu, b.slo_attainment, gpa, na) <
                                    std::tie(a.goodput_per_gpu, a.slo_attainment, gpb, nb);
                         }
                         return std::tie(b.slo_attainment, b.goodput_per_gpu, gpa, na) <
                                std::tie(a.slo_attainment, a.goodput_per_gpu, gpb, nb);
                     });
}

StatusOr<SearchResult> run_search(const SearchOptions& options,
                                  std::span<const workload::Request> requests) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!(options.attainment_target > 0 && options.attainment_target <= 1)) {
        return invalid_argument_error(
            fmt::format("--attainment {}: must be in (0, 1]", options.attainment_target));
    }
    if (requests.empty()) return invalid_argument_error("search: no requests");
    const model::ModelConfig& model = options.base.model;
    SearchResult out;
    PDSIM_ASSIGN_OR_RETURN(out.tp_sizes,
                           allowed_tp_sizes(model, options.space, options.kv, &out.notes));
    PDSIM_ASSIGN_OR_RETURN(std::vector<Layout> layouts,
                           enumerate_layouts(out.tp_sizes, options.space));
    out.candidates = static_cast<int64_t>(layouts.size());
    out.ranked.reserve(layouts.size());
    for (size_t i = 0; i < layouts.size(); ++i) {
        CandidateResult r;
        r.layout = layouts[i];
        StatusOr<topo::Topology> t =
            layout_topology(options.space.gpu, options.space.gpus, r.layout);
        StatusOr<std::vector<InstanceSetup>> setups =
            t.ok()
                ? make_instance_setups(*t, model, "roofline", nullptr, options.kv, options.roofline)
                : StatusOr<std::vector<InstanceSetup>>(t.status());
        if (!setups.ok()) {
            r.error = setups.status().message();
        } else {
            SimConfig c = options.base;
            c.topology = std::move(*t);
            c.topology_label = r.layout.name();
            c.instances = std::move(*setups);
            c.mode = r.layout.mode;
            c.timeline = nullptr;
            c.on_request_done = nullptr;
            c.on_progress = nullptr;
            StatusOr<SimResult> sim = run_simulation(c, requests);
            if (!sim.ok()) {
                r.error = sim.status().message();
            } else {
                const metrics::Report& rep = sim->report;
                r.ran = true;
                r.goodput_rps = rep.goodput_rps;
                r.goodput_per_gpu = rep.goodput_rps / r.layout.gpus();
                r.slo_attainment = rep.slo_attainment;
                r.meets = rep.slo_attainment >= options.attainment_target;
                r.throughput_tokens_s = rep.throughput_tokens_s;
                r.ttft_ms = rep.ttft_ms;
                r.tpot_ms = rep.tpot_ms;
                r.requests_completed = rep.requests_completed;
                r.requests_failed = rep.requests_failed;
                r.preemptions = sim->stats.preemptions;
                r.sim_s = sim->stats.sim_s;
                r.wall_s = sim->stats.wall_s;
            }
        }
        out.ranked.push_back(std::move(r));
        if (options.on_candidate) {
            options.on_candidate(
                SearchProgress{static_cast<int64_t>(i) + 1, out.candidates, &out.ranked.back()});
        }
    }
    rank_candidates(&out.ranked);
    out.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return out;
}

}  // namespace pdsim::des

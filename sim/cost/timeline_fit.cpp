#include "sim/cost/timeline_fit.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <iterator>
#include <tuple>

#include "common/input_file.h"
#include "common/stats.h"
#include "common/text.h"

namespace pdsim::cost {

namespace {

using json = nlohmann::json;
using GroupKey = std::pair<int, int>;  // (tp, threads)

Status bad_timeline(const std::string& flag, const std::string& path, const std::string& what) {
    return Status(StatusCode::kInvalidArgument, fmt::format("{} {}: {}", flag, path, what));
}

StatusOr<json> load_timeline_json(const std::string& path, const std::string& flag) {
    // A regular file only (a FIFO or device is refused at once), at most the trace cap.
    auto file = files::InputFile::open(path, files::kMaxTraceFileBytes);
    if (!file.ok()) return invalid_argument_error(flag + " " + file.status().message());
    json doc;
    try {
        (*file)->stream() >> doc;
    } catch (const json::exception& e) {
        PDSIM_RETURN_IF_ERROR((*file)->read_status().with_context(flag));
        return bad_timeline(flag, path, fmt::format("not JSON: {}", text::excerpt(e.what(), 160)));
    }
    PDSIM_RETURN_IF_ERROR((*file)->read_status().with_context(flag));
    return doc;
}

// The events of the timeline at `path`: the document itself when it is an array, else its
// traceEvents array.
StatusOr<json> load_timeline_events(const std::string& path, const std::string& flag) {
    PDSIM_ASSIGN_OR_RETURN(json doc, load_timeline_json(path, flag));
    if (doc.is_array()) return doc;
    if (doc.is_object() && doc.contains("traceEvents") && doc["traceEvents"].is_array()) {
        return std::move(doc["traceEvents"]);
    }
    return bad_timeline(flag, path,
                        "no traceEvents array (expected the timeline of pdsim testbed "
                        "--timeline)");
}

// The forward slices of `events` with batch args, in file order: times, instance and TP place
// (every TP rank's: a follower's forward overlapping another instance's leader counts as that
// instance computing); `args` gets each one's args, for its batch.
StatusOr<std::vector<TimelineForward>> read_slices(const json& events, const std::string& path,
                                                   const std::string& flag,
                                                   std::vector<const json*>* args) {
    std::vector<TimelineForward> slices;
    for (const json& e : events) {
        if (!e.is_object() || e.value("ph", "") != "X" || e.value("cat", "") != "forward") continue;
        if (!e.contains("args")) continue;
        const json& a = e["args"];
        if (!a.is_object() || !a.contains("tp") || !a.contains("tp_rank") ||
            !a.contains("threads") || !a.contains("instance")) {
            continue;  // an older timeline's slice: no batch to fit
        }
        try {
            TimelineForward f;
            f.begin_us = e.at("ts").get<double>();
            f.duration_us = e.at("dur").get<double>();
            f.end_us = f.begin_us + f.duration_us;
            f.tp_rank = a.at("tp_rank").get<int>();
            f.instance = a.at("instance").get<int>();
            f.compute_threads = a.at("tp").get<double>() * std::max(1, a.at("threads").get<int>());
            f.tp = a.at("tp").get<int>();
            f.threads = a.at("threads").get<int>();
            if (a.contains("thread_cpu_us")) {
                f.thread_cpu_us = a.at("thread_cpu_us").get<double>();
                if (!(f.thread_cpu_us >= 0)) {
                    return bad_timeline(flag, path,
                                        fmt::format("forward slice at ts {}: thread_cpu_us {}: "
                                                    "expected a number >= 0",
                                                    f.begin_us, f.thread_cpu_us));
                }
            }
            f.device = a.value("device", std::string("cpu"));
            if (f.device != "cpu" && f.device != "gpu") {
                return bad_timeline(flag, path,
                                    fmt::format("forward slice at ts {}: device '{}': expected "
                                                "cpu or gpu",
                                                f.begin_us, f.device));
            }
            slices.push_back(std::move(f));
            args->push_back(&a);
        } catch (const json::exception& ex) {
            return bad_timeline(flag, path, fmt::format("forward slice: {}", ex.what()));
        }
    }
    return slices;
}

// Reads the batch of a leader forward from its slice's args.
void read_batch(const json& args, TimelineForward* f) {
    f->decode = args.contains("kv_tokens");
    if (f->decode) {
        f->batch = args.at("batch").get<int64_t>();
        f->kv_tokens = args.at("kv_tokens").get<int64_t>();
        return;
    }
    for (const json& it : args.at("items")) {
        f->items.push_back({it.at(0).get<int64_t>(), it.at(1).get<int64_t>()});
    }
}

double predict(const std::vector<double>& coef, const std::vector<double>& features) {
    double pred = 0;
    for (size_t k = 0; k < features.size(); ++k) pred += coef[k] * features[k];
    return pred;
}

// Tells, for a timeline's forwards sorted by begin, which overlap another instance's, and how a
// leader forward's time splits into alone and shared (see OverlappedForward).
class OverlapIndex {
public:
    explicit OverlapIndex(std::span<const TimelineForward> slices) : slices_(slices) {
        for (const TimelineForward& x : slices_)
            longest_ = std::max(longest_, x.end_us - x.begin_us);
    }

    // The simulator's CPU contention model slows forwards of instances that compute at the same
    // time; fitting such forwards would count that slowdown twice.
    [[nodiscard]] bool overlapped(size_t i) const {
        const TimelineForward& x = slices_[i];
        for (size_t j = i + 1; j < slices_.size() && slices_[j].begin_us < x.end_us; ++j) {
            if (slices_[j].instance != x.instance) return true;
        }
        for (size_t j = i; j-- > 0 && slices_[j].begin_us > x.begin_us - longest_;) {
            if (slices_[j].instance != x.instance && slices_[j].end_us > x.begin_us) return true;
        }
        return false;
    }

    // Alone and shared time of leader forward i, from the other instances' leader forwards; with
    // `rank_cores` (per instance, the core of each rank: ranks bound to cores), x's pace while
    // others compute is its slowest rank's thread share of that rank's core, as the simulator's
    // bound contention model gives it (cpu_contention.h), instead of the node-wide share.
    [[nodiscard]] OverlapSplit split(size_t i, double node_cpus,
                                     std::span<const std::vector<int>> rank_cores = {}) {
        if (!rank_cores.empty()) return split_bound(i, rank_cores);
        OverlapSplit o{i, 0, 0};
        const TimelineForward& x = slices_[i];
        edges_.clear();
        for (size_t j : other_leaders(i)) {
            const TimelineForward& y = slices_[j];
            edges_.emplace_back(std::max(x.begin_us, y.begin_us), y.compute_threads);
            edges_.emplace_back(std::min(x.end_us, y.end_us), -y.compute_threads);
        }
        std::sort(edges_.begin(), edges_.end());
        double others = 0, t = x.begin_us, shared = 0;
        auto account = [&](double until) {
            if (until <= t) return;
            if (others > 1e-9) {
                shared += until - t;
                o.shared_core_s +=
                    (until - t) * std::min(1.0, node_cpus / (x.compute_threads + others));
            }
            t = until;
        };
        for (const auto& [at, d] : edges_) {
            account(at);
            others += d;
        }
        account(x.end_us);
        o.alone_s = (x.end_us - x.begin_us - shared) * 1e-6;
        o.shared_core_s *= 1e-6;
        return o;
    }

private:
    // The other instances' leader forwards that overlap slice i (in others_). Slices are sorted
    // by begin and none is longer than `longest_`: only those that begin after
    // begin - longest_ can reach into it.
    const std::vector<size_t>& other_leaders(size_t i) {
        const TimelineForward& x = slices_[i];
        others_.clear();
        auto first =
            std::lower_bound(slices_.begin(), slices_.end(), x.begin_us - longest_,
                             [](const TimelineForward& a, double t) { return a.begin_us < t; });
        for (size_t j = static_cast<size_t>(first - slices_.begin());
             j < slices_.size() && slices_[j].begin_us < x.end_us; ++j) {
            const TimelineForward& y = slices_[j];
            if (y.tp_rank != 0 || y.instance == x.instance || y.end_us <= x.begin_us) continue;
            others_.push_back(j);
        }
        return others_;
    }

    [[nodiscard]] OverlapSplit split_bound(size_t i, std::span<const std::vector<int>> rank_cores) {
        OverlapSplit o{i, 0, 0};
        const TimelineForward& x = slices_[i];
        const auto cores_of = [&](int instance) -> std::span<const int> {
            if (instance < 0 || static_cast<size_t>(instance) >= rank_cores.size()) return {};
            return rank_cores[static_cast<size_t>(instance)];
        };
        std::vector<double> cuts = {x.begin_us, x.end_us};
        for (size_t j : other_leaders(i)) {
            cuts.push_back(std::max(x.begin_us, slices_[j].begin_us));
            cuts.push_back(std::min(x.end_us, slices_[j].end_us));
        }
        std::sort(cuts.begin(), cuts.end());
        double shared = 0;
        for (size_t k = 0; k + 1 < cuts.size(); ++k) {
            const double a = cuts[k], b = cuts[k + 1];
            if (b <= a) continue;
            const double mid = (a + b) / 2;
            // Threads on each of x's cores: x's own, and those of every other instance computing.
            double pace = 1;
            bool any = false;
            for (int core : cores_of(x.instance)) {
                double threads = 0;
                for (int c : cores_of(x.instance)) threads += c == core ? x.threads : 0;
                for (size_t j : others_) {
                    const TimelineForward& y = slices_[j];
                    if (!(y.begin_us <= mid && mid < y.end_us)) continue;
                    any = true;
                    for (int c : cores_of(y.instance)) threads += c == core ? y.threads : 0;
                }
                pace = std::min(pace, 1.0 / std::max(1.0, threads));
            }
            if (!any) continue;
            shared += b - a;
            o.shared_core_s += (b - a) * pace;
        }
        o.alone_s = (x.end_us - x.begin_us - shared) * 1e-6;
        o.shared_core_s *= 1e-6;
        return o;
    }

    std::span<const TimelineForward> slices_;
    double longest_ = 0;
    std::vector<std::pair<double, double>> edges_;  // (time, +-cores)
    std::vector<size_t> others_;                    // other_leaders' result
};

// The noise of one kind from residual ratios r = measured / fitted: total cv^2 = var(r); slow
// cv^2 = var of the window means of r less what the fast part leaves in a mean of n points
// (cv^2 / n); fast cv^2 = the rest. Windows with fewer than 3 points (long extends) cannot tell
// slow from fast: then all of it is fast.
struct Residuals {
    std::vector<double> r;
    std::vector<std::tuple<size_t, int, int64_t>> r_window;
    std::map<std::tuple<size_t, int, int64_t>, std::pair<double, int>> windows;
};

std::pair<double, double> mean_var(const std::vector<double>& v) {
    double mu = 0, q = 0;
    for (double a : v) mu += a;
    mu /= static_cast<double>(v.size());
    for (double a : v) q += (a - mu) * (a - mu);
    return {mu, q / static_cast<double>(v.size())};
}

// The fast part's quantiles: `fast` sorted, normalised to mean 1. The simulator interpolates
// linearly between quantiles, so the distribution it draws from has mean sum (q_i + q_i+1) / 2K.
// Between the two highest quantiles that misstates the slowest 1/K of the forwards (one 5x
// outlier as the maximum made the mean 1.05): the highest quantile is set so that the mean is
// the sample's, 1.
std::vector<double> fast_quantiles(const std::vector<double>& fast) {
    double fm = 0;
    for (double v : fast) fm += v;
    fm /= static_cast<double>(fast.size());
    std::vector<double> qv;
    for (size_t q = 0; q <= kNoiseQuantiles; ++q) {
        qv.push_back(stats::quantile_sorted(fast, static_cast<double>(q) / kNoiseQuantiles) / fm);
    }
    auto pl_mean = [&] {
        double sum = 0;
        for (size_t i = 0; i + 1 < qv.size(); ++i) sum += (qv[i] + qv[i + 1]) / 2;
        return sum / kNoiseQuantiles;
    };
    qv.back() -= 2.0 * kNoiseQuantiles * (pl_mean() - 1);
    if (qv.back() < qv[qv.size() - 2]) {
        qv.back() = qv[qv.size() - 2];
        const double mean = pl_mean();
        for (double& v : qv) v /= mean;
    }
    return qv;
}

json noise_of(Residuals& res) {
    const std::vector<double>& r = res.r;
    const auto [mr, vr] = mean_var(r);
    const double cv2 = vr / (mr * mr);
    std::vector<double> means;
    double points = 0;
    for (const auto& [k, win] : res.windows) {
        if (win.second < 3) continue;
        means.push_back(win.first / win.second);
        points += win.second;
    }
    double slow2 = 0;
    if (means.size() >= kMinTimelinePoints) {
        const auto [mw, vw] = mean_var(means);
        const double per_window = points / static_cast<double>(means.size());
        slow2 = std::clamp(vw / (mw * mw) - cv2 / per_window, 0.0, cv2);
    }
    // Each point relative to its window's mean where the slow part was measured, else relative
    // to the overall mean.
    std::vector<double> fast;
    for (size_t i = 0; i < r.size(); ++i) {
        const auto& win = res.windows[res.r_window[i]];
        fast.push_back(slow2 > 0 && win.second >= 3 ? r[i] / (win.first / win.second) : r[i] / mr);
    }
    std::sort(fast.begin(), fast.end());
    json quantiles = fast_quantiles(fast);
    return {{"fast_cv", std::sqrt(cv2 - slow2)},
            {"fast_quantiles", quantiles},
            {"slow_cv", std::sqrt(slow2)},
            {"slow_period_s", slow2 > 0 ? kNoiseWindowS : 0.0},
            {"points", r.size()},
            {"windows", means.size()}};
}

}  // namespace

std::vector<bool> overlapped_forwards(std::span<const TimelineForward> forwards) {
    const OverlapIndex index(forwards);
    std::vector<bool> out(forwards.size());
    for (size_t i = 0; i < forwards.size(); ++i) out[i] = index.overlapped(i);
    return out;
}

StatusOr<std::vector<TimelineForward>> read_timeline_forwards(const std::string& path,
                                                              const std::string& flag) {
    PDSIM_ASSIGN_OR_RETURN(const json events, load_timeline_events(path, flag));
    std::vector<const json*> args;
    PDSIM_ASSIGN_OR_RETURN(std::vector<TimelineForward> slices,
                           read_slices(events, path, flag, &args));
    // Sorted by begin as the fit needs them; the batches are read in that order, so that the
    // first bad one is the earliest.
    std::vector<size_t> order(slices.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(),
              [&](size_t x, size_t y) { return slices[x].begin_us < slices[y].begin_us; });
    std::vector<TimelineForward> sorted;
    sorted.reserve(slices.size());
    for (size_t i : order) {
        TimelineForward f = std::move(slices[i]);
        if (f.tp_rank == 0 && f.duration_us * 1e-6 > 0) {
            try {
                read_batch(*args[i], &f);
            } catch (const json::exception& ex) {
                return bad_timeline(
                    flag, path, fmt::format("forward slice at ts {}: {}", f.begin_us, ex.what()));
            }
        }
        sorted.push_back(std::move(f));
    }
    return sorted;
}

StatusOr<std::map<int64_t, double>> read_timeline_arrivals(const std::string& path,
                                                           const std::string& flag) {
    PDSIM_ASSIGN_OR_RETURN(const json events, load_timeline_events(path, flag));
    std::map<int64_t, double> out;
    constexpr std::string_view kSuffix = " to first token";
    for (const json& e : events) {
        if (!e.is_object() || e.value("cat", std::string()) != "request") continue;
        const std::string name = e.value("name", std::string());
        if (name.size() <= kSuffix.size() + 1 || name[0] != 'r' || !name.ends_with(kSuffix)) {
            continue;
        }
        const std::string id = name.substr(1, name.size() - kSuffix.size() - 1);
        int64_t value = 0;
        const auto [end, ec] = std::from_chars(id.data(), id.data() + id.size(), value);
        if (ec != std::errc() || end != id.data() + id.size() || !e.contains("ts") ||
            !e["ts"].is_number()) {
            continue;
        }
        out[value] = e["ts"].get<double>();
    }
    return out;
}

json fit_to_json(std::span<const char* const> keys, const LinearFit& fit, size_t num_points,
                 const std::string& source) {
    json j;
    for (size_t i = 0; i < keys.size(); ++i) j[keys[i]] = fit.coef[i];
    j["r2"] = fit.r2;
    j["max_rel_err"] = fit.max_rel_err;
    j["mean_rel_err"] = fit.mean_rel_err;
    j["num_points"] = num_points;
    if (!source.empty()) j["source"] = source;
    return j;
}

TimelineFitter::TimelineFitter(TimelineFitOptions options) : options_(std::move(options)) {}

StatusOr<TimelineFileSummary> TimelineFitter::add_timeline(
    const std::string& path, std::span<const TimelineForward> forwards) {
    const size_t file_index = files_.size();
    OverlapIndex index(forwards);
    TimelineFileSummary summary{path, 0, 0};
    for (size_t i = 0; i < forwards.size(); ++i) {
        const TimelineForward& x = forwards[i];
        if (x.tp_rank != 0) continue;
        devices_.insert(x.device);
        const double s = x.duration_us * 1e-6;
        if (!(s > 0)) continue;
        const GroupKey key{x.tp, x.threads};
        std::vector<double> features;
        if (x.decode) {
            const auto f = decode_features(x.batch, x.kv_tokens);
            features.assign(f.begin(), f.end());
        } else {
            const auto f = extend_features(x.items);
            if (f[1] <= 0) continue;
            features.assign(f.begin(), f.end());
        }
        if (!options_.include_overlapped && index.overlapped(i)) {
            ++summary.overlapped_skipped;
            const OverlapSplit split = index.split(i, options_.node_cpus);
            OverlappedForward o{file_index,          key,           x.decode,
                                std::move(features), split.alone_s, split.shared_core_s};
            if (o.shared_core_s > 0) overlapped_.push_back(std::move(o));
            continue;
        }
        Group& g = groups_[key];
        (x.decode ? g.dx : g.ex).push_back(std::move(features));
        (x.decode ? g.dy : g.ey).push_back(s);
        (x.decode ? g.dw : g.ew).push_back({file_index, x.instance, x.begin_us * 1e-6});
        ++summary.forwards;
    }
    if (summary.forwards == 0) {
        const size_t skipped = summary.overlapped_skipped;
        return bad_timeline(
            options_.flag, path,
            fmt::format("no forward slices with batch args (a timeline written by pdsim testbed "
                        "--timeline){}",
                        skipped > 0 ? fmt::format(" that no other instance's forward overlaps "
                                                  "({} did)",
                                                  skipped)
                                    : ""));
    }
    files_.push_back(summary);
    return summary;
}

std::vector<OverlapSplit> overlap_splits(std::span<const TimelineForward> forwards,
                                         double node_cpus,
                                         std::span<const std::vector<int>> rank_cores) {
    OverlapIndex index(forwards);
    std::vector<OverlapSplit> out;
    for (size_t i = 0; i < forwards.size(); ++i) {
        if (forwards[i].tp_rank != 0 || !(forwards[i].duration_us > 0) || !index.overlapped(i)) {
            continue;
        }
        const OverlapSplit o = index.split(i, node_cpus, rank_cores);
        if (o.shared_core_s > 0) out.push_back(o);
    }
    return out;
}

namespace {

// Whether timeline instances `a` and `b` may run on one core (`instance_cores[i]`: the cores
// instance i's ranks may run on; an instance beyond it shares nothing).
bool share_a_core(std::span<const std::vector<int>> instance_cores, int a, int b) {
    if (a < 0 || b < 0 || static_cast<size_t>(a) >= instance_cores.size() ||
        static_cast<size_t>(b) >= instance_cores.size()) {
        return false;
    }
    for (int core : instance_cores[static_cast<size_t>(a)]) {
        const auto& other = instance_cores[static_cast<size_t>(b)];
        if (std::find(other.begin(), other.end(), core) != other.end()) return true;
    }
    return false;
}

}  // namespace

DispatchWaits dispatch_waits(std::span<const DispatchRequest> requests,
                             std::span<const TimelineForward> forwards,
                             std::span<const std::vector<int>> instance_cores) {
    DispatchWaits out;
    for (const DispatchRequest& r : requests) {
        const double t = r.arrival_us;
        if (!(r.prefill_start_us >= t)) continue;
        bool own_busy = false, core_busy = false;
        for (const TimelineForward& f : forwards) {
            if (!(f.begin_us <= t && t < f.end_us)) continue;
            if (f.instance == r.instance) {
                own_busy = true;
                break;
            }
            core_busy = core_busy || share_a_core(instance_cores, r.instance, f.instance);
        }
        for (const DispatchRequest& q : requests) {
            if (own_busy) break;
            // An earlier request of the instance still waiting: this one queued behind it.
            own_busy = &q != &r && q.instance == r.instance && q.arrival_us <= t &&
                       q.prefill_start_us > t && (q.arrival_us < t || &q < &r);
        }
        if (own_busy) continue;
        const double wait_s = (r.prefill_start_us - t) / 1e6;
        (core_busy ? out.core_busy_s : out.idle_s).push_back(wait_s);
    }
    return out;
}

std::vector<StepGap> decode_step_gaps(std::span<const TimelineForward> forwards,
                                      std::span<const std::vector<int>> instance_cores) {
    // Per (instance, tp rank): its forwards by begin. One rank runs one forward at a time, so
    // their ends are in the same order and a binary search finds the one in flight at a time.
    std::map<std::pair<int, int>, std::vector<const TimelineForward*>> streams;
    for (const TimelineForward& f : forwards) streams[{f.instance, f.tp_rank}].push_back(&f);
    for (auto& [key, list] : streams) {
        std::sort(list.begin(), list.end(), [](const TimelineForward* a, const TimelineForward* b) {
            return a->begin_us < b->begin_us;
        });
    }
    const auto in_flight = [](const std::vector<const TimelineForward*>& list, double t) {
        const auto after = std::upper_bound(
            list.begin(), list.end(), t,
            [](double time, const TimelineForward* f) { return time < f->begin_us; });
        return after != list.begin() && (*std::prev(after))->end_us > t;
    };
    std::vector<StepGap> out;
    for (const auto& [key, list] : streams) {
        const auto [instance, tp_rank] = key;
        if (tp_rank != 0) continue;
        for (size_t k = 0; k + 1 < list.size(); ++k) {
            const TimelineForward& done = *list[k];
            const TimelineForward& next = *list[k + 1];
            if (!done.decode || !next.decode) continue;
            const double gap_us = next.begin_us - done.end_us;
            if (!(gap_us >= 0 && gap_us < kMaxStepGapUs)) continue;
            std::set<int> competitors;
            for (const auto& [other_key, other] : streams) {
                const int other_instance = other_key.first;
                if (other_instance == instance || competitors.contains(other_instance) ||
                    !share_a_core(instance_cores, instance, other_instance)) {
                    continue;
                }
                if (in_flight(other, done.end_us)) competitors.insert(other_instance);
            }
            out.push_back({.competitors = static_cast<int>(competitors.size()),
                           .gap_s = gap_us / 1e6,
                           .next_s = next.duration_us / 1e6});
        }
    }
    return out;
}

json fit_step_wait(std::span<const StepGap> gaps, size_t min_gaps) {
    std::map<int, std::vector<StepGap>> by_count;
    for (const StepGap& g : gaps) by_count[g.competitors].push_back(g);
    const auto mean_ms = [](const std::vector<double>& v) {
        double sum = 0;
        for (double x : v) sum += x;
        return v.empty() ? 0.0 : sum / static_cast<double>(v.size()) * 1e3;
    };
    const auto gaps_of = [](const std::vector<StepGap>& v) {
        std::vector<double> out;
        for (const StepGap& g : v) out.push_back(g.gap_s);
        return out;
    };
    json out = {
        {"decode", json::array()},
        {"slice_above_ms", kStepWaitSliceUs / 1e3},
        {"idle", {{"gaps", by_count[0].size()}, {"mean_gap_ms", mean_ms(gaps_of(by_count[0]))}}}};
    for (int n = 1;; ++n) {
        const auto it = by_count.find(n);
        if (it == by_count.end() || it->second.size() < min_gaps) break;
        std::vector<double> slices, slice_steps, other_steps;  // gap; gap + next forward
        for (const StepGap& g : it->second) {
            const bool slice = g.gap_s * 1e6 > kStepWaitSliceUs;
            if (slice) slices.push_back(g.gap_s);
            (slice ? slice_steps : other_steps).push_back(g.gap_s + g.next_s);
        }
        const double wait_ms = slices.empty() ? 0.0
                               : other_steps.empty()
                                   ? mean_ms(slices)
                                   : std::max(0.0, mean_ms(slice_steps) - mean_ms(other_steps));
        out["decode"].push_back({{"competitors", n},
                                 {"gaps", it->second.size()},
                                 {"chance", static_cast<double>(slices.size()) /
                                                static_cast<double>(it->second.size())},
                                 {"wait_ms", wait_ms},
                                 {"slice_ms", mean_ms(slices)},
                                 {"mean_gap_ms", mean_ms(gaps_of(it->second))}});
    }
    return out;
}

// Run levels. The testbed's runs differ as a whole (a run of the same command may be 10% slower
// than the next: the host), and the comparison takes the median of runs; so the fit follows the
// median run. Per (file, kind): level = sum measured / sum fitted over that file's points, with
// fits of all points; each file's times are divided by its level over the median level before
// the fits, and its overlapped forwards are compared with fitted times at its level.
TimelineFitter::Levels TimelineFitter::run_levels(std::map<GroupKey, Group>* groups,
                                                  json* levels) const {
    Levels level;
    std::map<std::pair<size_t, bool>, std::pair<double, double>> sums;  // measured, fitted
    for (const auto& [key, g] : *groups) {
        for (const bool decode : {false, true}) {
            const auto& x = decode ? g.dx : g.ex;
            const auto& y = decode ? g.dy : g.ey;
            const auto& w = decode ? g.dw : g.ew;
            if (y.size() < kMinTimelinePoints) continue;
            auto f = fit_nonnegative(x, y, FitTarget::kMean);
            if (!f.ok()) continue;  // reported by the fit of the groups
            for (size_t i = 0; i < y.size(); ++i) {
                auto& sm = sums[{w[i].file, decode}];
                sm.first += y[i];
                sm.second += predict(f->coef, x[i]);
            }
        }
    }
    for (const bool decode : {false, true}) {
        std::vector<double> v;
        for (const auto& [fk, sm] : sums) {
            if (fk.second == decode && sm.second > 0) v.push_back(sm.first / sm.second);
        }
        if (v.size() < 2) continue;
        const double med = stats::median(v);
        for (const auto& [fk, sm] : sums) {
            if (fk.second == decode && sm.second > 0) level[fk] = sm.first / sm.second / med;
        }
    }
    for (auto& [key, g] : *groups) {
        for (const bool decode : {false, true}) {
            auto& y = decode ? g.dy : g.ey;
            const auto& w = decode ? g.dw : g.ew;
            for (size_t i = 0; i < y.size(); ++i) {
                auto it = level.find({w[i].file, decode});
                if (it != level.end()) y[i] /= it->second;
            }
        }
    }
    for (size_t fi = 0; fi < files_.size(); ++fi) {
        json l = {{"path", files_[fi].path}};
        for (const bool decode : {false, true}) {
            auto it = level.find({fi, decode});
            l[decode ? "decode" : "extend"] = it == level.end() ? json() : json(it->second);
        }
        levels->push_back(std::move(l));
    }
    return level;
}

StatusOr<json> TimelineFitter::fit_groups(const std::map<GroupKey, Group>& groups,
                                          const CostFile* base, Coefficients* coef) const {
    auto from_base = [&](int tp, int threads, const char* kind) -> const json* {
        if (base == nullptr) return nullptr;
        for (const json& f : base->json().at("fits")) {
            if (f.at("tp").get<int>() == tp && f.at("threads").get<int>() == threads) {
                return &f.at(kind);
            }
        }
        return nullptr;
    };
    const std::string& label = options_.timelines_label;
    json fits = json::array();
    for (const auto& [key, g] : groups) {
        const auto [tp, threads] = key;
        json fit = {{"tp", tp}, {"threads", threads}};
        for (const bool decode : {false, true}) {
            const char* kind = decode ? "decode" : "extend";
            const auto& x = decode ? g.dx : g.ex;
            const auto& y = decode ? g.dy : g.ey;
            if (y.empty()) {
                if (const json* b = from_base(tp, threads, kind)) {
                    fit[kind] = *b;
                    fit[kind]["source"] = "base " + options_.base_path;
                    continue;
                }
                return Status(StatusCode::kInvalidArgument,
                              fmt::format("{} {}: tp {} threads {} has no {} forwards; give --base "
                                          "COST.json with a tp {} threads {} fit to take them from",
                                          options_.flag, label, tp, threads, kind, tp, threads));
            }
            if (y.size() < kMinTimelinePoints) {
                return Status(StatusCode::kInvalidArgument,
                              fmt::format("{} {}: tp {} threads {} has {} {} forwards, too few "
                                          "to fit (at least {})",
                                          options_.flag, label, tp, threads, y.size(), kind,
                                          kMinTimelinePoints));
            }
            auto f = fit_nonnegative(x, y, FitTarget::kMean);
            if (!f.ok()) {
                return f.status().with_context(fmt::format(
                    "{} {}: tp {} threads {} {}", options_.flag, label, tp, threads, kind));
            }
            (*coef)[{key, decode}] = f->coef;
            fit[kind] = decode ? fit_to_json(kDecodeKeys, *f, y.size(), "timeline")
                               : fit_to_json(kExtendKeys, *f, y.size(), "timeline");
        }
        fits.push_back(std::move(fit));
    }
    return fits;
}

// Interference, per kind: 1 + x = sum shared_core_s / sum (iso - alone_s) over the overlapped
// forwards whose (tp, threads, kind) was fitted here (a ratio of sums: long forwards weigh more,
// as they do in a request's latency).
json TimelineFitter::fit_interference(const Coefficients& coef, const Levels& level) const {
    json interference = json::object();
    json counts = json::object();
    for (const bool decode : {false, true}) {
        const char* kind = decode ? "decode" : "extend";
        double num = 0, den = 0;
        size_t n = 0;
        for (const OverlappedForward& f : overlapped_) {
            auto c = coef.find({f.key, decode});
            if (f.decode != decode || c == coef.end()) continue;
            double iso = predict(c->second, f.features);
            if (auto l = level.find({f.file, decode}); l != level.end()) iso *= l->second;
            num += f.shared_core_s;
            den += iso - f.alone_s;
            ++n;
        }
        // Too few, or faster than the contention model already predicts: none measured.
        interference[kind] =
            n >= kMinTimelinePoints && den > 0 ? std::max(0.0, num / den - 1) : 0.0;
        counts[kind] = n;
    }
    interference["node_cpus"] = options_.node_cpus;
    interference["overlapped_forwards"] = std::move(counts);
    return interference;
}

StatusOr<json> TimelineFitter::fit(const CostFile* base) const {
    std::map<GroupKey, Group> groups = groups_;  // the run levels rescale the times
    Levels level;
    json levels = json::array();
    if (files_.size() >= 2) level = run_levels(&groups, &levels);
    if (devices_.size() > 1) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("{} {}: the timelines mix CPU and GPU ranks' forwards; "
                                  "calibrate each kind from its own runs",
                                  options_.flag, options_.timelines_label));
    }
    Coefficients coef;
    PDSIM_ASSIGN_OR_RETURN(json fits, fit_groups(groups, base, &coef));
    json interference = json::object();
    if (!options_.include_overlapped) interference = fit_interference(coef, level);
    json noise = json::object();
    for (const bool decode : {false, true}) {
        Residuals res;
        for (const auto& [key, g] : groups) {
            auto c = coef.find({key, decode});
            if (c == coef.end()) continue;
            const auto& x = decode ? g.dx : g.ex;
            const auto& y = decode ? g.dy : g.ey;
            const auto& w = decode ? g.dw : g.ew;
            for (size_t i = 0; i < y.size(); ++i) {
                const double pred = predict(c->second, x[i]);
                if (!(pred > 0)) continue;
                res.r.push_back(y[i] / pred);
                res.r_window.emplace_back(w[i].file, w[i].instance,
                                          static_cast<int64_t>(std::floor(w[i].t / kNoiseWindowS)));
                auto& win = res.windows[res.r_window.back()];
                win.first += y[i] / pred;
                ++win.second;
            }
        }
        if (res.r.size() < kMinTimelinePoints) continue;
        noise[decode ? "decode" : "extend"] = noise_of(res);
    }
    json files = json::array();
    for (const TimelineFileSummary& f : files_) {
        files.push_back({{"path", f.path},
                         {"forwards", f.forwards},
                         {"overlapped_skipped", f.overlapped_skipped}});
    }
    const std::string& base_path = options_.base_path;
    // The device the forwards ran on: the calibrated model serves topology devices of that kind
    // only (sim/cost/calibrated.h).
    const std::string device = devices_.empty() ? std::string("cpu") : *devices_.begin();
    return json{{"fits", fits},
                {"device", device},
                {"interference", interference},
                {"noise", noise},
                {"source",
                 {{"kind", "testbed timelines"},
                  {"files", files},
                  {"leaders_only", true},
                  {"overlapped_included", options_.include_overlapped},
                  {"run_levels", levels},
                  {"base", base_path.empty() ? json() : json(base_path)}}},
                {"transports", base != nullptr ? base->json().value("transports", json::object())
                                               : json::object()}};
}

}  // namespace pdsim::cost

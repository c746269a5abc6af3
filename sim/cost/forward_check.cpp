#include "sim/cost/forward_check.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <memory>
#include <tuple>
#include <utility>

#include "common/stats.h"

namespace pdsim::cost {

namespace {

// Buckets: (order, label).
std::pair<int, std::string> bucket_of(const TimelineForward& f) {
    if (f.decode) {
        const int64_t b = f.batch;
        if (b <= 1) return {0, "batch 1"};
        if (b <= 3) return {1, "batch 2-3"};
        if (b <= 7) return {2, "batch 4-7"};
        if (b <= 15) return {3, "batch 8-15"};
        return {4, "batch 16+"};
    }
    int64_t tokens = 0;
    for (const ExtendItem& item : f.items) tokens += item.new_tokens;
    if (tokens < 64) return {0, "new tokens 1-63"};
    if (tokens < 256) return {1, "new tokens 64-255"};
    if (tokens < 1024) return {2, "new tokens 256-1023"};
    return {3, "new tokens 1024+"};
}

struct Sample {
    std::vector<double> measured_ms, predicted_ms, ratio, wall_over_cpu;
};

ForwardCheckRow summarize(Sample s) {
    ForwardCheckRow row;
    row.count = s.ratio.size();
    for (double v : s.measured_ms) row.measured_ms_sum += v;
    for (double v : s.predicted_ms) row.predicted_ms_sum += v;
    std::sort(s.measured_ms.begin(), s.measured_ms.end());
    std::sort(s.predicted_ms.begin(), s.predicted_ms.end());
    std::sort(s.ratio.begin(), s.ratio.end());
    row.measured_ms_p50 = stats::quantile_sorted(s.measured_ms, 0.5);
    row.predicted_ms_p50 = stats::quantile_sorted(s.predicted_ms, 0.5);
    row.ratio_p10 = stats::quantile_sorted(s.ratio, 0.1);
    row.ratio_p50 = stats::quantile_sorted(s.ratio, 0.5);
    row.ratio_p90 = stats::quantile_sorted(s.ratio, 0.9);
    row.wall_over_cpu_p50 = stats::median(std::move(s.wall_over_cpu));  // 0 when none
    return row;
}

}  // namespace

StatusOr<std::vector<ForwardCheckRow>> check_forwards(std::span<const TimelineForward> forwards,
                                                      const CostFile& cost,
                                                      const model::ModelConfig& model) {
    const std::vector<bool> overlapped = overlapped_forwards(forwards);
    // (decode, tp, threads) -> the cost model of that instance shape.
    std::map<std::tuple<bool, int, int>, std::unique_ptr<CostModel>> models;
    // (decode, tp, threads, overlapped, bucket order) -> bucket label and sample.
    using Key = std::tuple<bool, int, int, bool, int>;
    std::map<Key, std::pair<std::string, Sample>> groups;
    for (size_t i = 0; i < forwards.size(); ++i) {
        const TimelineForward& f = forwards[i];
        if (f.tp_rank != 0 || f.duration_us <= 0) continue;
        const auto shape = std::make_tuple(f.decode, f.tp, f.threads);
        auto it = models.find(shape);
        if (it == models.end()) {
            InstanceSpec spec;
            spec.model = model;
            spec.tp = f.tp;
            spec.device = "cpu";
            spec.kv_dtype_bytes = 4;
            spec.threads = f.threads;
            auto m = make_cost_model("calibrated", spec, &cost);
            if (!m.ok()) {
                return m.status().with_context(fmt::format(
                    "the timeline's forwards ran with tp {} and {} threads", f.tp, f.threads));
            }
            it = models.emplace(shape, std::move(*m)).first;
        }
        const double predicted_s =
            f.decode ? it->second->decode_s(f.batch, f.kv_tokens) : it->second->extend_s(f.items);
        if (!(predicted_s > 0)) continue;  // nothing to compare with (an empty batch)
        const double measured_ms = f.duration_us / 1000.0;
        auto [order, label] = bucket_of(f);
        for (int b : {order, 100}) {  // 100: the "all" row of the group
            auto& [name, sample] = groups[Key{f.decode, f.tp, f.threads, overlapped[i], b}];
            name = b == 100 ? "all" : label;
            sample.measured_ms.push_back(measured_ms);
            sample.predicted_ms.push_back(predicted_s * 1000.0);
            sample.ratio.push_back(measured_ms / (predicted_s * 1000.0));
            if (f.thread_cpu_us > 0)
                sample.wall_over_cpu.push_back(f.duration_us / f.thread_cpu_us);
        }
    }
    if (groups.empty()) {
        return Status(StatusCode::kInvalidArgument,
                      "no instance leader forward with a batch to compare (a timeline of "
                      "`pdsim testbed --timeline`?)");
    }
    std::vector<ForwardCheckRow> rows;
    for (auto& [key, group] : groups) {
        ForwardCheckRow row = summarize(std::move(group.second));
        std::tie(row.decode, row.tp, row.threads, row.overlapped, std::ignore) = key;
        row.bucket = group.first;
        rows.push_back(std::move(row));
    }
    return rows;
}

std::string forward_check_table(std::span<const ForwardCheckRow> rows) {
    std::string out =
        "| kind | tp | threads | other instance computing | batch | forwards | measured ms p50 | "
        "predicted ms p50 | measured / predicted p10 / p50 / p90 | share of measured time "
        "explained | measured / thread CPU p50 |\n|---|---|---|---|---|---|---|---|---|---|---|\n";
    for (const ForwardCheckRow& r : rows) {
        out += fmt::format(
            "| {} | {} | {} | {} | {} | {} | {:.3f} | {:.3f} | {:.2f} / {:.2f} / {:.2f} | {:.0f}% "
            "| {} |\n",
            r.decode ? "decode" : "extend", r.tp, r.threads, r.overlapped ? "yes" : "no", r.bucket,
            r.count, r.measured_ms_p50, r.predicted_ms_p50, r.ratio_p10, r.ratio_p50, r.ratio_p90,
            r.measured_ms_sum > 0 ? 100.0 * r.predicted_ms_sum / r.measured_ms_sum : 0.0,
            r.wall_over_cpu_p50 > 0 ? fmt::format("{:.2f}", r.wall_over_cpu_p50) : "-");
    }
    return out;
}

std::vector<ForwardGapRow> forward_gaps(std::span<const TimelineForward> forwards) {
    // Each instance's leader forwards, in order of begin.
    std::map<int, std::vector<const TimelineForward*>> leaders;
    for (const TimelineForward& f : forwards) {
        if (f.tp_rank == 0 && f.duration_us > 0) leaders[f.instance].push_back(&f);
    }
    // Whether instance `self`'s neighbours had a forward in flight at `t_us`.
    auto others_at = [&](int self, double t_us) {
        for (const auto& [instance, list] : leaders) {
            if (instance == self) continue;
            auto it = std::upper_bound(
                list.begin(), list.end(), t_us,
                [](double t, const TimelineForward* f) { return t < f->begin_us; });
            if (it != list.begin() && (*std::prev(it))->end_us > t_us) return true;
        }
        return false;
    };
    std::vector<ForwardGapRow> rows;
    for (const auto& [instance, list] : leaders) {
        size_t decodes = 0;
        double forward_ms = 0;
        for (const TimelineForward* f : list) {
            decodes += f->decode ? 1 : 0;
            forward_ms += f->duration_us / 1000.0;
        }
        std::vector<double> gaps_ms[2];  // others computing: no, yes
        for (size_t i = 1; i < list.size(); ++i) {
            const double gap_us = list[i]->begin_us - list[i - 1]->end_us;
            if (gap_us < 0 || gap_us >= kIdleGapS * 1e6) continue;
            const double middle = list[i - 1]->end_us + gap_us / 2;
            gaps_ms[others_at(instance, middle) ? 1 : 0].push_back(gap_us / 1000.0);
        }
        for (bool others : {false, true}) {
            std::vector<double>& g = gaps_ms[others ? 1 : 0];
            if (g.empty()) continue;
            std::sort(g.begin(), g.end());
            ForwardGapRow row;
            row.instance = instance;
            row.decode = 2 * decodes > list.size();
            row.others_computing = others;
            row.count = g.size();
            for (double v : g) row.gap_ms_sum += v;
            row.gap_ms_mean = row.gap_ms_sum / static_cast<double>(g.size());
            row.gap_ms_p50 = stats::quantile_sorted(g, 0.5);
            row.gap_ms_p90 = stats::quantile_sorted(g, 0.9);
            row.forward_ms_sum = forward_ms;
            rows.push_back(row);
        }
    }
    return rows;
}

std::string forward_gap_table(std::span<const ForwardGapRow> rows) {
    std::string out =
        "| instance | kind | other instance computing | gaps | gap ms mean / p50 / p90 | gaps ms "
        "| forwards ms |\n|---|---|---|---|---|---|---|\n";
    for (const ForwardGapRow& r : rows) {
        out += fmt::format("| {} | {} | {} | {} | {:.3f} / {:.3f} / {:.3f} | {:.1f} | {:.1f} |\n",
                           r.instance, r.decode ? "decode" : "extend",
                           r.others_computing ? "yes" : "no", r.count, r.gap_ms_mean, r.gap_ms_p50,
                           r.gap_ms_p90, r.gap_ms_sum, r.forward_ms_sum);
    }
    return out;
}

std::vector<bool> decode_warmup(std::span<const TimelineForward> forwards, double min_idle_s,
                                int warmup) {
    struct Last {
        double end_us = 0;
        int left = 0;  // forwards of the warm-up still to come
        bool seen = false;
    };
    std::map<int, Last> last;  // per instance, its leader's previous forward
    std::vector<bool> out(forwards.size(), false);
    for (size_t i = 0; i < forwards.size(); ++i) {
        const TimelineForward& f = forwards[i];
        if (f.tp_rank != 0) continue;
        Last& l = last[f.instance];
        if (!l.seen || f.begin_us - l.end_us >= min_idle_s * 1e6) l.left = warmup;
        l.seen = true;
        l.end_us = f.end_us;
        if (l.left > 0) {
            --l.left;
            out[i] = f.decode;  // an extend is tens of ms: its warm-up is noise in it
        }
    }
    return out;
}

}  // namespace pdsim::cost

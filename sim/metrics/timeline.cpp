#include "sim/metrics/timeline.h"

#include <fstream>

#include "common/text.h"

namespace pdsim::metrics {

void Timeline::name_process(int pid, const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(
        {{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"args", {{"name", name}}}});
}

void Timeline::name_thread(int pid, int tid, const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back({{"name", "thread_name"},
                       {"ph", "M"},
                       {"pid", pid},
                       {"tid", tid},
                       {"args", {{"name", name}}}});
}

void Timeline::add_slice(int pid, int tid, const std::string& name, const std::string& cat,
                         double start_us, double dur_us, nlohmann::json args) {
    nlohmann::json e = {{"name", name},
                        {"cat", cat},
                        {"ph", "X"},
                        {"pid", pid},
                        {"tid", tid},
                        {"ts", start_us},
                        {"dur", std::max(0.0, dur_us)}};
    if (!args.empty()) e["args"] = std::move(args);
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(e));
}

void Timeline::add_instant(int pid, int tid, const std::string& name, const std::string& cat,
                           double ts_us) {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back({{"name", name},
                       {"cat", cat},
                       {"ph", "i"},
                       {"s", "t"},
                       {"pid", pid},
                       {"tid", tid},
                       {"ts", ts_us}});
}

size_t Timeline::size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return events_.size();
}

void Timeline::merge(const nlohmann::json& events) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& e : events) events_.push_back(e);
}

nlohmann::json Timeline::events() const {
    std::lock_guard<std::mutex> lock(mu_);
    return nlohmann::json(events_);
}

Status Timeline::write(const std::string& path) const {
    std::ofstream f(path);
    if (!f)
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("{}: cannot open timeline file for writing", path));
    nlohmann::json doc = {{"traceEvents", events()}, {"displayTimeUnit", "ms"}};
    f << text::dump_json(doc) << "\n";  // never throws on content
    if (!f) return Status(StatusCode::kUnavailable, fmt::format("{}: write failed", path));
    return {};
}

}  // namespace pdsim::metrics

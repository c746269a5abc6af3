// Timeline: Chrome / Perfetto trace-event JSON ("X" complete events, one track per rank and
// stream). Open the file in ui.perfetto.dev or chrome://tracing.
// Thread-safety: add_* may be called from any thread (internally locked).
#pragma once

#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/status.h"

namespace pdsim::metrics {

class Timeline {
public:
    // pid: the rank (a process row in the viewer); tid: a stream or thread within it.
    void name_process(int pid, const std::string& name);
    void name_thread(int pid, int tid, const std::string& name);
    // A slice [start_us, start_us + dur_us) named `name` in category `cat`.
    void add_slice(int pid, int tid, const std::string& name, const std::string& cat,
                   double start_us, double dur_us, nlohmann::json args = nlohmann::json::object());
    // An instant (e.g. a record).
    void add_instant(int pid, int tid, const std::string& name, const std::string& cat,
                     double ts_us);

    [[nodiscard]] size_t size() const;
    // Appends another timeline's events (e.g. gathered from other ranks).
    void merge(const nlohmann::json& events);
    [[nodiscard]] nlohmann::json events() const;
    [[nodiscard]] Status write(const std::string& path) const;

private:
    mutable std::mutex mu_;
    std::vector<nlohmann::json> events_;
};

}  // namespace pdsim::metrics

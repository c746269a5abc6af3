#include "sim/des/flow_network.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "common/check.h"

namespace pdsim::des {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Relative slack when deciding which links and caps bind at the current fill level: shares that
// equal the level up to rounding freeze in the same round instead of one round later.
constexpr double kTieSlack = 1e-12;
// A flow is finished when remaining <= kDoneFraction * max(1, total bytes) (floating drift).
constexpr double kDoneFraction = 1e-9;
constexpr uint32_t kMaxGen = (uint32_t{1} << 31) - 1;  // keeps FlowId positive

}  // namespace

struct FlowNetwork::Impl {
    struct Link {
        double capacity = 0;
        double bytes = 0;  // carried up to last_update
        double load = 0;   // sum of current rates (during filling: of the frozen flows)
        int32_t unfrozen = 0;
        bool saturated = false;
        uint64_t stamp = 0;  // == Impl::stamp: already seen in this pass
    };
    struct Flow {
        uint32_t gen = 1;
        bool active = false;
        bool frozen = false;
        double total = 0;
        double remaining = 0;  // as of last_update
        double rate = 0;
        double cap = 0;  // 0: uncapped
        double latency = 0;
        Time finish_t = kForever;  // projected at the last recompute
        std::vector<LinkId> path;
        std::function<void()> on_done;
    };

    explicit Impl(EventLoop& l) : loop(l) {}

    EventLoop& loop;
    std::vector<Link> links;
    std::vector<std::string> names;
    std::vector<Flow> flows;  // by slot
    std::vector<uint32_t> free_slots;
    std::vector<uint32_t> active;    // slots of active flows, in start order
    std::vector<LinkId> used_links;  // links crossed by active flows (last recompute)
    uint64_t stamp = 0;
    Time last_update = 0;
    EventLoop::EventId pending = 0;
    Time pending_t = kForever;

    static FlowId make_id(uint32_t slot, uint32_t gen) {
        return static_cast<FlowId>((static_cast<uint64_t>(gen) << 32) | slot);
    }

    Flow* find(FlowId id) {
        if (id <= 0) return nullptr;
        const uint64_t slot = static_cast<uint64_t>(id) & 0xffffffffu;
        const uint64_t gen = static_cast<uint64_t>(id) >> 32;
        if (slot >= flows.size()) return nullptr;
        Flow& f = flows[slot];
        return f.active && f.gen == gen ? &f : nullptr;
    }
    const Flow* find(FlowId id) const { return const_cast<Impl*>(this)->find(id); }

    static bool unbounded(const Flow& f) { return f.path.empty() && f.cap == 0; }
    static bool done(const Flow& f) {
        return f.remaining <= kDoneFraction * std::max(1.0, f.total) || unbounded(f);
    }

    const Link& link(LinkId l) const {
        PDSIM_CHECK_MSG(l >= 0 && static_cast<size_t>(l) < links.size(), "FlowNetwork: bad link {}",
                        l);
        return links[static_cast<size_t>(l)];
    }

    // Moves every flow to now() at its current rate. A flow whose projected finish time has come
    // is set to exactly 0 remaining, so the completion event always finishes the flow it was
    // scheduled for, however coarse the clock is against the flow's duration. Links are credited
    // with the bytes the flows actually moved, so link totals conserve the flows' bytes.
    void advance() {
        const Time now = loop.now();
        const double dt = now - last_update;
        for (const uint32_t s : active) {
            Flow& f = flows[s];
            double moved;
            if (f.finish_t <= now) {
                moved = f.remaining;
            } else if (dt > 0) {
                moved = std::min(f.remaining, f.rate * dt);
            } else {
                continue;
            }
            f.remaining -= moved;
            credit(f, moved);
        }
        last_update = now;
    }

    void credit(const Flow& f, double bytes) {
        for (const LinkId l : f.path) links[static_cast<size_t>(l)].bytes += bytes;
    }

    // Removes finished flows (scheduling their on_done in start order), then recomputes rates
    // (when a flow left or `rates_changed`: bytes alone do not move max-min rates) and the
    // completion event.
    void settle(bool rates_changed) {
        size_t kept = 0;
        for (size_t i = 0; i < active.size(); ++i) {
            const uint32_t s = active[i];
            Flow& f = flows[s];
            if (!done(f)) {
                active[kept++] = s;
                continue;
            }
            credit(f, f.remaining);  // the sub-tolerance rest counts as sent
            if (f.on_done) loop.schedule(f.latency, std::move(f.on_done));
            release(s);
        }
        if (kept != active.size()) rates_changed = true;
        active.resize(kept);
        if (rates_changed) recompute_rates();
        reschedule();
    }

    void release(uint32_t s) {
        Flow& f = flows[s];
        f.active = false;
        f.on_done = nullptr;
        f.path.clear();  // keeps capacity for the slot's next flow
        f.rate = 0;
        f.gen = f.gen == kMaxGen ? 1 : f.gen + 1;
        free_slots.push_back(s);
    }

    // Progressive filling: all unfrozen flows share one rising level; each round raises it to the
    // next point where a link fills or a cap is reached, and freezes the flows that bind there.
    void recompute_rates() {
        for (const LinkId l : used_links) links[static_cast<size_t>(l)].load = 0;
        used_links.clear();
        ++stamp;
        for (const uint32_t s : active) {
            Flow& f = flows[s];
            f.frozen = false;
            f.rate = 0;
            for (const LinkId l : f.path) {
                Link& L = links[static_cast<size_t>(l)];
                if (L.stamp != stamp) {
                    L.stamp = stamp;
                    L.load = 0;
                    L.unfrozen = 0;
                    L.saturated = false;
                    used_links.push_back(l);
                }
                ++L.unfrozen;
            }
        }
        size_t unfrozen_flows = active.size();
        double level = 0;
        while (unfrozen_flows > 0) {
            double next = kInf;
            for (const LinkId l : used_links) {
                const Link& L = links[static_cast<size_t>(l)];
                if (L.unfrozen > 0) next = std::min(next, (L.capacity - L.load) / L.unfrozen);
            }
            for (const uint32_t s : active) {
                const Flow& f = flows[s];
                if (!f.frozen && f.cap > 0) next = std::min(next, f.cap);
            }
            PDSIM_CHECK_MSG(std::isfinite(next), "FlowNetwork: unbounded flow left in filling");
            level = std::max(level, next);
            const double bound = level * (1 + kTieSlack);
            for (const LinkId l : used_links) {
                Link& L = links[static_cast<size_t>(l)];
                if (L.unfrozen > 0 && (L.capacity - L.load) / L.unfrozen <= bound) {
                    L.saturated = true;
                }
            }
            for (const uint32_t s : active) {
                Flow& f = flows[s];
                if (f.frozen) continue;
                bool freeze = f.cap > 0 && f.cap <= bound;
                for (size_t i = 0; !freeze && i < f.path.size(); ++i) {
                    freeze = links[static_cast<size_t>(f.path[i])].saturated;
                }
                if (!freeze) continue;
                f.frozen = true;
                f.rate = f.cap > 0 ? std::min(f.cap, level) : level;
                --unfrozen_flows;
                for (const LinkId l : f.path) {
                    Link& L = links[static_cast<size_t>(l)];
                    L.load += f.rate;
                    --L.unfrozen;
                }
            }
        }
    }

    void reschedule() {
        const Time now = loop.now();
        Time earliest = kForever;
        for (const uint32_t s : active) {
            Flow& f = flows[s];
            f.finish_t = f.rate > 0 ? now + f.remaining / f.rate : kForever;
            earliest = std::min(earliest, f.finish_t);
        }
        if (pending != 0 && earliest == pending_t) return;
        if (pending != 0) loop.cancel(pending);
        pending = 0;
        pending_t = kForever;
        if (std::isfinite(earliest)) {
            pending_t = earliest;
            pending = loop.schedule_at(earliest, [this] {
                pending = 0;
                pending_t = kForever;
                advance();
                settle(true);
            });
        }
    }
};

FlowNetwork::FlowNetwork(EventLoop& loop) : impl_(std::make_unique<Impl>(loop)) {}

FlowNetwork::~FlowNetwork() {
    if (impl_->pending != 0) impl_->loop.cancel(impl_->pending);
}

FlowNetwork::LinkId FlowNetwork::add_link(double bytes_per_s, std::string name) {
    PDSIM_CHECK_MSG(bytes_per_s > 0 && std::isfinite(bytes_per_s),
                    "FlowNetwork::add_link: capacity {} B/s", bytes_per_s);
    PDSIM_CHECK(impl_->links.size() < static_cast<size_t>(std::numeric_limits<LinkId>::max()));
    Impl::Link l;
    l.capacity = bytes_per_s;
    impl_->links.push_back(l);
    impl_->names.push_back(std::move(name));
    return static_cast<LinkId>(impl_->links.size() - 1);
}

size_t FlowNetwork::num_links() const {
    return impl_->links.size();
}

const std::string& FlowNetwork::link_name(LinkId link) const {
    impl_->link(link);
    return impl_->names[static_cast<size_t>(link)];
}

double FlowNetwork::link_capacity(LinkId link) const {
    return impl_->link(link).capacity;
}

FlowNetwork::FlowId FlowNetwork::start_flow(std::span<const LinkId> path, double bytes,
                                            double latency_s, std::function<void()> on_done,
                                            double rate_cap) {
    Impl& m = *impl_;
    PDSIM_CHECK_MSG(bytes >= 0 && std::isfinite(bytes), "FlowNetwork::start_flow: bytes {}", bytes);
    PDSIM_CHECK_MSG(latency_s >= 0 && std::isfinite(latency_s),
                    "FlowNetwork::start_flow: latency {} s", latency_s);
    PDSIM_CHECK_MSG(rate_cap >= 0 && std::isfinite(rate_cap),
                    "FlowNetwork::start_flow: rate cap {}", rate_cap);
    ++m.stamp;
    for (const LinkId l : path) {
        PDSIM_CHECK_MSG(l >= 0 && static_cast<size_t>(l) < m.links.size(),
                        "FlowNetwork::start_flow: bad link {}", l);
        Impl::Link& L = m.links[static_cast<size_t>(l)];
        PDSIM_CHECK_MSG(L.stamp != m.stamp, "FlowNetwork::start_flow: link {} twice in path", l);
        L.stamp = m.stamp;
    }

    m.advance();
    uint32_t slot;
    if (!m.free_slots.empty()) {
        slot = m.free_slots.back();
        m.free_slots.pop_back();
    } else {
        PDSIM_CHECK(m.flows.size() < std::numeric_limits<uint32_t>::max());
        slot = static_cast<uint32_t>(m.flows.size());
        m.flows.emplace_back();
    }
    Impl::Flow& f = m.flows[slot];
    f.active = true;
    f.total = bytes;
    f.remaining = bytes;
    f.rate = 0;
    f.cap = rate_cap;
    f.latency = latency_s;
    f.finish_t = kForever;
    f.path.assign(path.begin(), path.end());
    f.on_done = std::move(on_done);
    const FlowId id = Impl::make_id(slot, f.gen);
    m.active.push_back(slot);
    m.settle(true);
    return id;
}

bool FlowNetwork::add_bytes(FlowId flow, double bytes) {
    PDSIM_CHECK_MSG(bytes >= 0 && std::isfinite(bytes), "FlowNetwork::add_bytes: bytes {}", bytes);
    Impl& m = *impl_;
    if (m.find(flow) == nullptr) return false;
    m.advance();
    Impl::Flow* f = m.find(flow);
    const bool ok = !Impl::done(*f);
    if (ok) {
        f->remaining += bytes;
        f->total += bytes;
    }
    m.settle(false);
    return ok;
}

bool FlowNetwork::set_rate_cap(FlowId flow, double rate_cap) {
    PDSIM_CHECK_MSG(rate_cap >= 0 && std::isfinite(rate_cap),
                    "FlowNetwork::set_rate_cap: rate cap {}", rate_cap);
    Impl& m = *impl_;
    if (m.find(flow) == nullptr) return false;
    m.advance();
    Impl::Flow* f = m.find(flow);
    const bool ok = !Impl::done(*f);
    if (ok) f->cap = rate_cap;
    m.settle(true);
    return ok;
}

double FlowNetwork::rate(FlowId flow) const {
    const Impl::Flow* f = impl_->find(flow);
    if (f == nullptr || f->finish_t <= impl_->loop.now()) return 0;
    return f->rate;
}

double FlowNetwork::remaining_bytes(FlowId flow) const {
    const Impl::Flow* f = impl_->find(flow);
    const Time now = impl_->loop.now();
    if (f == nullptr || f->finish_t <= now) return 0;
    return std::max(0.0, f->remaining - f->rate * (now - impl_->last_update));
}

size_t FlowNetwork::active_flows() const {
    return impl_->active.size();
}

double FlowNetwork::link_bytes(LinkId link) const {
    const Impl::Link& L = impl_->link(link);
    return L.bytes + L.load * (impl_->loop.now() - impl_->last_update);
}

double FlowNetwork::link_busy_s(LinkId link) const {
    return link_bytes(link) / impl_->link(link).capacity;
}

}  // namespace pdsim::des

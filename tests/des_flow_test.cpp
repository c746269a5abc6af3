// FlowNetwork: hand-computed cases (the arithmetic is in the comments), then random scenarios
// against a brute-force reference solver stepped event by event, and a direct check of the
// max-min property of the rates.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "sim/des/flow_network.h"

namespace pdsim::des {
namespace {

using LinkId = FlowNetwork::LinkId;
using FlowId = FlowNetwork::FlowId;
constexpr double kEps = 1e-9;

TEST(FlowNetwork, OneFlowAloneThenACappedOneFromItsOnDone) {
    EventLoop loop;
    FlowNetwork net(loop);
    const LinkId l = net.add_link(100, "l");
    EXPECT_EQ(net.num_links(), 1u);
    EXPECT_EQ(net.link_name(l), "l");
    EXPECT_EQ(net.link_capacity(l), 100);
    const std::vector<LinkId> path{l};
    double first = -1, second = -1;
    FlowId g = 0;
    // 500 B at 100 B/s = 5 s, + 0.25 s latency -> 5.25.
    const FlowId f = net.start_flow(path, 500, 0.25, [&] {
        first = loop.now();
        // Starts at 5.25; capped at 50 B/s: 500 / 50 = 10 s, + 0.25 -> 15.5.
        g = net.start_flow(
            path, 500, 0.25, [&] { second = loop.now(); }, 50);
        EXPECT_NEAR(net.rate(g), 50, kEps);
    });
    EXPECT_GT(f, 0);
    EXPECT_NEAR(net.rate(f), 100, kEps);
    EXPECT_NEAR(net.remaining_bytes(f), 500, kEps);
    EXPECT_EQ(net.active_flows(), 1u);
    loop.run();
    EXPECT_NEAR(first, 5.25, kEps);
    EXPECT_NEAR(second, 15.5, kEps);
    EXPECT_NE(f, g);
    EXPECT_EQ(net.active_flows(), 0u);
    EXPECT_EQ(net.rate(f), 0);
    EXPECT_EQ(net.remaining_bytes(g), 0);
}

TEST(FlowNetwork, TwoFlowsShareALinkThenTheSurvivorSpeedsUp) {
    EventLoop loop;
    FlowNetwork net(loop);
    const std::vector<LinkId> path{net.add_link(100)};
    double d1 = -1, d2 = -1;
    // Both at 50 B/s. f1: 300 / 50 = 6 s. f2 then has 500 - 300 = 200 B at 100 B/s: 6 + 2 = 8.
    const FlowId f1 = net.start_flow(path, 300, 0, [&] { d1 = loop.now(); });
    const FlowId f2 = net.start_flow(path, 500, 0, [&] { d2 = loop.now(); });
    EXPECT_NEAR(net.rate(f1), 50, kEps);
    EXPECT_NEAR(net.rate(f2), 50, kEps);
    loop.schedule_at(7, [&] {
        EXPECT_NEAR(net.rate(f2), 100, kEps);
        EXPECT_NEAR(net.remaining_bytes(f2), 100, kEps);  // 200 - 1 s * 100
    });
    loop.run();
    EXPECT_NEAR(d1, 6, kEps);
    EXPECT_NEAR(d2, 8, kEps);
}

TEST(FlowNetwork, ClassicMaxMinAndTheReshareWhenTheSmallFlowEnds) {
    EventLoop loop;
    FlowNetwork net(loop);
    const LinkId a = net.add_link(10, "A");
    const LinkId b = net.add_link(4, "B");
    const std::vector<LinkId> pa{a}, pab{a, b}, pb{b};
    double d1 = -1, d2 = -1, d3 = -1;
    // B is the bottleneck: f2 = f3 = 4 / 2 = 2; f1 takes the rest of A: 10 - 2 = 8.
    const FlowId f1 = net.start_flow(pa, 80, 0, [&] { d1 = loop.now(); });
    const FlowId f2 = net.start_flow(pab, 20, 0, [&] { d2 = loop.now(); });
    const FlowId f3 = net.start_flow(pb, 6, 0, [&] { d3 = loop.now(); });
    loop.schedule_at(1, [&] {
        EXPECT_NEAR(net.rate(f1), 8, kEps);
        EXPECT_NEAR(net.rate(f2), 2, kEps);
        EXPECT_NEAR(net.rate(f3), 2, kEps);
        EXPECT_NEAR(net.link_bytes(a), 10, kEps);  // (8 + 2) * 1 s
        EXPECT_NEAR(net.link_bytes(b), 4, kEps);
    });
    // f3 ends at 6 / 2 = 3. Then f1 has 80 - 24 = 56, f2 20 - 6 = 14. Filling: B fills at 4
    // (f2 alone) before A's share 10 / 2 = 5, so f2 = 4 and f1 = 10 - 4 = 6.
    loop.schedule_at(4, [&] {
        EXPECT_NEAR(net.rate(f1), 6, kEps);
        EXPECT_NEAR(net.rate(f2), 4, kEps);
        EXPECT_EQ(net.rate(f3), 0);
    });
    // f2 ends at 3 + 14 / 4 = 6.5; f1 has 56 - 6 * 3.5 = 35 left at 10 B/s: 6.5 + 3.5 = 10.
    loop.run();
    EXPECT_NEAR(d3, 3, kEps);
    EXPECT_NEAR(d2, 6.5, kEps);
    EXPECT_NEAR(d1, 10, kEps);
    // A carried 80 + 20 B (busy 100 / 10 = 10 s); B 20 + 6 B, full from 0 to 6.5 s.
    EXPECT_NEAR(net.link_bytes(a), 100, 1e-9);
    EXPECT_NEAR(net.link_busy_s(a), 10, 1e-9);
    EXPECT_NEAR(net.link_bytes(b), 26, 1e-9);
    EXPECT_NEAR(net.link_busy_s(b), 6.5, 1e-9);
}

TEST(FlowNetwork, ACappedFlowLeavesItsUnusedShareToAnother) {
    EventLoop loop;
    FlowNetwork net(loop);
    const std::vector<LinkId> path{net.add_link(100)};
    double d1 = -1, d2 = -1;
    // f1 capped at 20 (below the fair 50), so f2 gets 80. f1: 100 / 20 = 5 s. f2: 400 B by then,
    // the other 400 at 100 B/s: 5 + 4 = 9.
    const FlowId f1 = net.start_flow(
        path, 100, 0, [&] { d1 = loop.now(); }, 20);
    const FlowId f2 = net.start_flow(path, 800, 0, [&] { d2 = loop.now(); });
    EXPECT_NEAR(net.rate(f1), 20, kEps);
    EXPECT_NEAR(net.rate(f2), 80, kEps);
    loop.run();
    EXPECT_NEAR(d1, 5, kEps);
    EXPECT_NEAR(d2, 9, kEps);
}

TEST(FlowNetwork, SetRateCapMidFlight) {
    EventLoop loop;
    FlowNetwork net(loop);
    const std::vector<LinkId> path{net.add_link(100)};
    double d1 = -1, d2 = -1;
    // f1 capped at 10: 20 B by t = 2; cap removed: the other 80 at 100 B/s -> 2.8.
    const FlowId f1 = net.start_flow(
        path, 100, 0, [&] { d1 = loop.now(); }, 10);
    loop.schedule_at(2, [&] {
        EXPECT_TRUE(net.set_rate_cap(f1, 0));
        EXPECT_NEAR(net.rate(f1), 100, kEps);
        EXPECT_NEAR(net.remaining_bytes(f1), 80, kEps);
    });
    loop.run();
    EXPECT_NEAR(d1, 2.8, kEps);
    // f2 uncapped from 2.8: 50 B by 3.3; then capped at 25: 50 / 25 = 2 s -> 5.3.
    const FlowId f2 = net.start_flow(path, 100, 0, [&] { d2 = loop.now(); });
    loop.schedule_at(3.3, [&] { EXPECT_TRUE(net.set_rate_cap(f2, 25)); });
    loop.run();
    EXPECT_NEAR(d2, 5.3, kEps);
    EXPECT_FALSE(net.set_rate_cap(f1, 5));     // done
    EXPECT_FALSE(net.set_rate_cap(12345, 5));  // never existed
}

TEST(FlowNetwork, AddBytesExtendsAFlow) {
    EventLoop loop;
    FlowNetwork net(loop);
    const std::vector<LinkId> path{net.add_link(100)};
    double d = -1;
    int runs = 0;
    // 50 B by t = 0.5, then 150 more: 200 B at 100 B/s -> 2.5, + 0.1 latency -> 2.6.
    const FlowId f = net.start_flow(path, 100, 0.1, [&] {
        d = loop.now();
        ++runs;
    });
    loop.schedule_at(0.5, [&] {
        EXPECT_TRUE(net.add_bytes(f, 150));
        EXPECT_NEAR(net.remaining_bytes(f), 200, kEps);
    });
    loop.run();
    EXPECT_NEAR(d, 2.6, kEps);
    EXPECT_EQ(runs, 1);
    EXPECT_FALSE(net.add_bytes(f, 10));
    EXPECT_FALSE(net.add_bytes(0, 10));
    EXPECT_FALSE(net.add_bytes(-5, 10));
}

TEST(FlowNetwork, AddBytesAtTheExactCompletionInstantFails) {
    EventLoop loop;
    FlowNetwork net(loop);
    const std::vector<LinkId> path{net.add_link(100)};
    FlowId f = 0;
    bool added = true;
    int runs = 0;
    double d = -1;
    // Scheduled before the flow starts, so it runs before the completion event at t = 1 (100 B at
    // 100 B/s): the last byte has left, the flow is done.
    loop.schedule_at(1, [&] { added = net.add_bytes(f, 50); });
    f = net.start_flow(path, 100, 0, [&] {
        d = loop.now();
        ++runs;
    });
    loop.run();
    EXPECT_FALSE(added);
    EXPECT_EQ(runs, 1);
    EXPECT_NEAR(d, 1, kEps);
}

TEST(FlowNetwork, ZeroByteFlowTakesOnlyItsLatency) {
    EventLoop loop;
    FlowNetwork net(loop);
    const std::vector<LinkId> path{net.add_link(10)};
    double dz = -1, dg = -1;
    const FlowId g = net.start_flow(path, 100, 0, [&] { dg = loop.now(); });  // 100 / 10 = 10
    const FlowId z = net.start_flow(path, 0, 0.3, [&] { dz = loop.now(); });  // 0.3
    EXPECT_GT(z, 0);
    EXPECT_NE(z, g);
    EXPECT_EQ(net.active_flows(), 1u);
    EXPECT_EQ(net.rate(z), 0);
    EXPECT_FALSE(net.add_bytes(z, 5));
    EXPECT_NEAR(net.rate(g), 10, kEps);  // z never took a share
    loop.run();
    EXPECT_NEAR(dz, 0.3, kEps);
    EXPECT_NEAR(dg, 10, kEps);
}

TEST(FlowNetwork, EmptyPathIsLimitedByItsCapAlone) {
    EventLoop loop;
    FlowNetwork net(loop);
    double capped = -1, free = -1;
    // 100 B at 25 B/s = 4 s, + 1 s latency -> 5. Uncapped: latency only -> 0.5.
    const FlowId f = net.start_flow(
        {}, 100, 1, [&] { capped = loop.now(); }, 25);
    net.start_flow({}, 100, 0.5, [&] { free = loop.now(); });
    EXPECT_NEAR(net.rate(f), 25, kEps);
    EXPECT_EQ(net.active_flows(), 1u);
    loop.run();
    EXPECT_NEAR(capped, 5, kEps);
    EXPECT_NEAR(free, 0.5, kEps);
}

TEST(FlowNetwork, LinkAccountingIntegratesRates) {
    EventLoop loop;
    FlowNetwork net(loop);
    const LinkId a = net.add_link(10);
    const LinkId idle = net.add_link(10);
    const std::vector<LinkId> path{a};
    // 50 B at a cap of 5 B/s on a 10 B/s link: 10 s at half utilisation.
    net.start_flow(path, 50, 0, nullptr, 5);
    loop.schedule_at(4, [&] {
        EXPECT_NEAR(net.link_bytes(a), 20, kEps);
        EXPECT_NEAR(net.link_busy_s(a), 2, kEps);
    });
    loop.run();
    EXPECT_NEAR(loop.now(), 10, kEps);
    EXPECT_NEAR(net.link_bytes(a), 50, kEps);
    EXPECT_NEAR(net.link_busy_s(a), 5, kEps);
    EXPECT_EQ(net.link_bytes(idle), 0);
    EXPECT_EQ(net.link_busy_s(idle), 0);
}

TEST(FlowNetwork, FlowsFinishingTogetherCompleteInStartOrder) {
    EventLoop loop;
    FlowNetwork net(loop);
    const LinkId a = net.add_link(30);
    const LinkId b = net.add_link(1000);
    std::vector<int> order;
    // Three flows of 100 B at 10 B/s each all end at t = 10; the second also crosses b.
    const std::vector<LinkId> pa{a}, pba{b, a};
    net.start_flow(pa, 100, 0, [&] { order.push_back(1); });
    net.start_flow(pba, 100, 0, [&] { order.push_back(2); });
    net.start_flow(pa, 100, 0, [&] { order.push_back(3); });
    loop.run();
    EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
    EXPECT_NEAR(loop.now(), 10, kEps);
}

TEST(FlowNetwork, ShortFlowsLateInTheRunStillComplete) {
    // At t = 1e7 the clock's resolution (~2e-9 s) is a large part of each 1e-6 s flow; every
    // completion event must still finish its flow (no event storm at one instant).
    EventLoop loop;
    FlowNetwork net(loop);
    const std::vector<LinkId> path{net.add_link(1e3)};
    int done = 0;
    std::function<void()> next = [&] {
        if (++done < 1000) net.start_flow(path, 1e-3, 0, next);
    };
    loop.schedule_at(1e7, [&] { net.start_flow(path, 1e-3, 0, next); });
    loop.run();
    EXPECT_EQ(done, 1000);
    EXPECT_LT(loop.events_run(), 2100u);        // one completion + one on_done per flow
    EXPECT_NEAR(net.link_bytes(0), 1.0, 1e-9);  // 1000 * 1e-3 B
}

TEST(FlowNetwork, DestroyingTheNetworkCancelsItsEvent) {
    EventLoop loop;
    bool ran = false;
    {
        FlowNetwork net(loop);
        const std::vector<LinkId> path{net.add_link(1)};
        net.start_flow(path, 10, 0, [&] { ran = true; });
        EXPECT_EQ(loop.pending(), 1u);
    }
    EXPECT_EQ(loop.pending(), 0u);
    loop.run();
    EXPECT_FALSE(ran);
}

// ---- Random scenarios against a reference --------------------------------------------------

struct RefFlow {
    std::vector<int> path;
    double start = 0, bytes = 0, cap = 0, latency = 0;
};
struct RefOp {
    double t;
    int flow;
    bool is_add;  // else set_rate_cap
    double value;
};

// Textbook max-min solver: repeatedly find the tightest constraint (the link with the smallest
// equal share of its residual capacity among its unfixed flows, or the smallest cap), and fix
// the flows it binds at that share. Sums are recomputed from scratch every round.
std::vector<double> reference_rates(const std::vector<double>& link_cap,
                                    const std::vector<const std::vector<int>*>& paths,
                                    const std::vector<double>& caps) {
    const size_t n = paths.size();
    std::vector<double> rate(n, 0);
    std::vector<bool> fixed(n, false);
    for (size_t left = n; left > 0;) {
        double best = std::numeric_limits<double>::infinity();
        int best_link = -1;
        size_t best_flow = n;
        for (size_t l = 0; l < link_cap.size(); ++l) {
            double used = 0;
            int users = 0;
            for (size_t i = 0; i < n; ++i) {
                if (std::find(paths[i]->begin(), paths[i]->end(), static_cast<int>(l)) ==
                    paths[i]->end())
                    continue;
                if (fixed[i])
                    used += rate[i];
                else
                    ++users;
            }
            if (users > 0 && (link_cap[l] - used) / users < best) {
                best = (link_cap[l] - used) / users;
                best_link = static_cast<int>(l);
                best_flow = n;
            }
        }
        for (size_t i = 0; i < n; ++i) {
            if (!fixed[i] && caps[i] > 0 && caps[i] < best) {
                best = caps[i];
                best_flow = i;
                best_link = -1;
            }
        }
        for (size_t i = 0; i < n; ++i) {
            if (fixed[i]) continue;
            const bool binds =
                best_flow == i || (best_link >= 0 && std::find(paths[i]->begin(), paths[i]->end(),
                                                               best_link) != paths[i]->end());
            if (binds) {
                rate[i] = best;
                fixed[i] = true;
                --left;
            }
        }
    }
    return rate;
}

struct RefResult {
    std::vector<double> done;  // on_done time per flow
    std::vector<int> op_ok;    // per op: 1 accepted, 0 refused
};

// Steps the scenario event by event: between events every rate is constant.
RefResult reference_run(const std::vector<double>& link_cap, const std::vector<RefFlow>& flows,
                        const std::vector<RefOp>& ops) {
    struct Ev {
        double t;
        int kind;  // 0 start, 1 op
        int idx;
    };
    std::vector<Ev> evs;
    for (size_t i = 0; i < flows.size(); ++i)
        evs.push_back({flows[i].start, 0, static_cast<int>(i)});
    for (size_t k = 0; k < ops.size(); ++k) evs.push_back({ops[k].t, 1, static_cast<int>(k)});
    std::sort(evs.begin(), evs.end(), [](const Ev& x, const Ev& y) { return x.t < y.t; });

    const size_t n = flows.size();
    RefResult res{std::vector<double>(n, -1), std::vector<int>(ops.size(), -1)};
    std::vector<double> remaining(n, 0), total(n, 0), cap(n, 0);
    std::vector<bool> active(n, false);
    double t = 0;
    size_t next = 0;
    auto finish = [&](size_t i) {
        active[i] = false;
        res.done[i] = t + flows[i].latency;
    };
    auto tol = [&](size_t i) { return 1e-9 * std::max(1.0, total[i]); };
    for (;;) {
        std::vector<size_t> act;
        std::vector<const std::vector<int>*> paths;
        std::vector<double> caps;
        for (size_t i = 0; i < n; ++i) {
            if (!active[i]) continue;
            act.push_back(i);
            paths.push_back(&flows[i].path);
            caps.push_back(cap[i]);
        }
        if (act.empty() && next == evs.size()) break;
        const std::vector<double> r = reference_rates(link_cap, paths, caps);
        double t_done = std::numeric_limits<double>::infinity();
        for (size_t j = 0; j < act.size(); ++j)
            t_done = std::min(t_done, t + remaining[act[j]] / r[j]);
        const double t_ev =
            next < evs.size() ? evs[next].t : std::numeric_limits<double>::infinity();
        const double t_new = std::min(t_done, t_ev);
        for (size_t j = 0; j < act.size(); ++j) {
            const double end = t + remaining[act[j]] / r[j];
            remaining[act[j]] = end <= t_new ? 0 : remaining[act[j]] - r[j] * (t_new - t);
        }
        t = t_new;
        for (const size_t i : act)
            if (remaining[i] <= tol(i)) finish(i);
        if (t_done <= t_ev) continue;
        const Ev e = evs[next++];
        if (e.kind == 0) {
            const size_t i = static_cast<size_t>(e.idx);
            const RefFlow& f = flows[i];
            remaining[i] = total[i] = f.bytes;
            cap[i] = f.cap;
            active[i] = true;
            if (f.bytes == 0 || (f.path.empty() && f.cap == 0)) finish(i);
            continue;
        }
        const RefOp& op = ops[static_cast<size_t>(e.idx)];
        const size_t i = static_cast<size_t>(op.flow);
        res.op_ok[static_cast<size_t>(e.idx)] = active[i] ? 1 : 0;
        if (!active[i]) continue;
        if (op.is_add) {
            remaining[i] += op.value;
            total[i] += op.value;
        } else {
            cap[i] = op.value;
            if (flows[i].path.empty() && cap[i] == 0) finish(i);
        }
    }
    return res;
}

// Max-min fairness, checked from its definition: rates are feasible, and every flow is either
// at its cap or crosses a full link on which no flow is faster.
void expect_max_min(const FlowNetwork& net, const std::vector<double>& link_cap,
                    const std::vector<RefFlow>& flows, const std::vector<FlowId>& ids,
                    const std::vector<double>& caps) {
    std::vector<double> load(link_cap.size(), 0), fastest(link_cap.size(), 0);
    std::vector<size_t> live;
    for (size_t i = 0; i < ids.size(); ++i) {
        if (ids[i] == 0 || net.rate(ids[i]) == 0) continue;
        live.push_back(i);
        for (const int l : flows[i].path) {
            load[static_cast<size_t>(l)] += net.rate(ids[i]);
            fastest[static_cast<size_t>(l)] =
                std::max(fastest[static_cast<size_t>(l)], net.rate(ids[i]));
        }
    }
    for (size_t l = 0; l < link_cap.size(); ++l) EXPECT_LE(load[l], link_cap[l] * (1 + 1e-9));
    for (const size_t i : live) {
        const double r = net.rate(ids[i]);
        if (caps[i] > 0) {
            EXPECT_LE(r, caps[i] * (1 + 1e-9));
        }
        bool bottleneck = caps[i] > 0 && r >= caps[i] * (1 - 1e-9);
        for (const int l : flows[i].path) {
            const size_t u = static_cast<size_t>(l);
            if (load[u] >= link_cap[u] * (1 - 1e-9) && r >= fastest[u] * (1 - 1e-9))
                bottleneck = true;
        }
        EXPECT_TRUE(bottleneck) << "flow " << i << " at " << r << " has no bottleneck";
    }
}

TEST(FlowNetwork, RandomScenariosMatchAReferenceSolver) {
    for (uint64_t seed = 1; seed <= 20; ++seed) {
        SCOPED_TRACE(seed);
        std::mt19937_64 rng(seed);
        std::uniform_real_distribution<double> u01(0, 1);
        const size_t num_links = 2 + rng() % 5;
        const size_t num_flows = 120;
        std::vector<double> link_cap;
        for (size_t l = 0; l < num_links; ++l) link_cap.push_back(1 + 99 * u01(rng));
        std::vector<RefFlow> flows(num_flows);
        for (RefFlow& f : flows) {
            f.start = 40 * u01(rng);
            f.bytes = u01(rng) < 0.1 ? 0 : 200 * u01(rng);
            f.latency = u01(rng) < 0.3 ? 0 : 0.5 * u01(rng);
            f.cap = u01(rng) < 0.3 ? 0.5 + 30 * u01(rng) : 0;
            for (size_t l = 0; l < num_links; ++l)
                if (u01(rng) < 0.35) f.path.push_back(static_cast<int>(l));
            std::shuffle(f.path.begin(), f.path.end(), rng);
        }
        std::vector<RefOp> ops;
        for (int k = 0; k < 80; ++k) {
            const int i = static_cast<int>(rng() % num_flows);
            const double t = flows[static_cast<size_t>(i)].start + 5 * u01(rng);
            const bool add = k % 2 == 0;
            ops.push_back({t, i, add, add ? 100 * u01(rng) : (u01(rng) < 0.3 ? 0 : 20 * u01(rng))});
        }
        const RefResult want = reference_run(link_cap, flows, ops);

        EventLoop loop;
        FlowNetwork net(loop);
        for (const double c : link_cap) net.add_link(c);
        std::vector<FlowId> ids(num_flows, 0);
        std::vector<double> caps(num_flows, 0), got(num_flows, -1);
        std::vector<int> op_ok(ops.size(), -1);
        for (size_t i = 0; i < num_flows; ++i) {
            loop.schedule_at(flows[i].start, [&, i] {
                const std::vector<LinkId> path(flows[i].path.begin(), flows[i].path.end());
                caps[i] = flows[i].cap;
                ids[i] = net.start_flow(
                    path, flows[i].bytes, flows[i].latency, [&, i] { got[i] = loop.now(); },
                    flows[i].cap);
                expect_max_min(net, link_cap, flows, ids, caps);
            });
        }
        for (size_t k = 0; k < ops.size(); ++k) {
            loop.schedule_at(ops[k].t, [&, k] {
                const RefOp& op = ops[k];
                const FlowId id = ids[static_cast<size_t>(op.flow)];
                bool ok;
                if (op.is_add) {
                    ok = net.add_bytes(id, op.value);
                } else {
                    ok = net.set_rate_cap(id, op.value);
                    if (ok) caps[static_cast<size_t>(op.flow)] = op.value;
                }
                op_ok[k] = ok ? 1 : 0;
                expect_max_min(net, link_cap, flows, ids, caps);
            });
        }
        loop.run();
        EXPECT_EQ(net.active_flows(), 0u);
        EXPECT_EQ(op_ok, want.op_ok);
        double carried = 0, expected_bytes = 0;
        for (size_t i = 0; i < num_flows; ++i) {
            EXPECT_NEAR(got[i], want.done[i], 1e-9 * std::max(1.0, want.done[i])) << "flow " << i;
            expected_bytes += flows[i].bytes * static_cast<double>(flows[i].path.size());
        }
        for (size_t k = 0; k < ops.size(); ++k) {
            if (ops[k].is_add && want.op_ok[k] == 1)
                expected_bytes +=
                    ops[k].value *
                    static_cast<double>(flows[static_cast<size_t>(ops[k].flow)].path.size());
        }
        for (size_t l = 0; l < num_links; ++l) carried += net.link_bytes(static_cast<LinkId>(l));
        EXPECT_NEAR(carried, expected_bytes, 1e-9 * expected_bytes);
    }
}

TEST(FlowNetworkDeathTest, BadPreconditionsAbort) {
    EventLoop loop;
    FlowNetwork net(loop);
    const LinkId a = net.add_link(10);
    const std::vector<LinkId> bad{a, 7}, twice{a, a}, good{a};
    EXPECT_DEATH(net.add_link(0), "capacity");
    EXPECT_DEATH(net.add_link(std::numeric_limits<double>::infinity()), "capacity");
    EXPECT_DEATH(net.start_flow(bad, 1, 0, nullptr), "bad link");
    EXPECT_DEATH(net.start_flow(twice, 1, 0, nullptr), "twice");
    EXPECT_DEATH(net.start_flow(good, -1, 0, nullptr), "bytes");
    EXPECT_DEATH(net.start_flow(good, std::nan(""), 0, nullptr), "bytes");
    EXPECT_DEATH(net.start_flow(good, 1, -0.5, nullptr), "latency");
    EXPECT_DEATH(net.start_flow(good, 1, 0, nullptr, -2), "cap");
    const FlowId f = net.start_flow(good, 100, 0, nullptr);
    EXPECT_DEATH(net.add_bytes(f, -1), "bytes");
    EXPECT_DEATH(net.set_rate_cap(f, -1), "cap");
    EXPECT_DEATH((void)net.link_capacity(3), "bad link");
}

}  // namespace
}  // namespace pdsim::des

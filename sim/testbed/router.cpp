#include "sim/testbed/router.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <limits>
#include <map>

#include "common/logging.h"
#include "sim/policy/routing.h"
#include "sim/testbed/protocol.h"

namespace pdsim::testbed {

namespace {

using json = nlohmann::json;
using std::chrono::microseconds;

constexpr double kGraceMs = 5000;

struct Track {
    bool dispatched = false;
    bool terminal = false;
    bool first_seen = false;
    bool prefill_done = false;
    int p = -1, d = -1;  // instance indices
    // Backpressure: the request counts against its prefill (colocated: its) instance's in-flight
    // requests (a) and its decode instance's (b) while these are set.
    bool holds_a = false, holds_b = false;
    double progress_us = 0;  // dispatch, then its own last report (first token, prefill done)
};

// Least loaded among `candidates` (instance indices); ties round-robin after `last`.
int pick(const std::vector<int>& candidates, const std::vector<double>& load, int* last) {
    return policy::pick_least_loaded(candidates, load, last);
}

}  // namespace

namespace {
Status run_router_impl(const RouterConfig& rc, RouterResult* out);
}  // namespace

int64_t effective_max_inflight(const ResolvedConfig& cfg) {
    const TestbedOptions& o = cfg.options;
    if (o.max_inflight_per_instance > 0) return o.max_inflight_per_instance;
    // Auto: what one instance can hold at once -- a decode batch, and no more requests of the
    // trace's mean size than its KV pool holds (TP 1's pool: the smallest per-rank share).
    double mean_tokens = 1;
    if (!cfg.requests.empty()) {
        double sum = 0;
        for (const auto& r : cfg.requests) sum += r.input_len + r.output_len;
        mean_tokens = std::max(1.0, sum / static_cast<double>(cfg.requests.size()));
    }
    const runtime::DType dtype = cfg.gpu_ranks() ? runtime::DType::kBF16 : runtime::DType::kF32;
    const double pool_tokens =
        static_cast<double>(kv_pool_pages(cfg.model, 1, o.page_size, o.kv_pool_mb, dtype) - 1) *
        o.page_size;
    const auto by_kv = static_cast<int64_t>(pool_tokens / mean_tokens);
    return std::clamp<int64_t>(std::min<int64_t>(o.max_decode_batch, by_kv), 1,
                               TestbedLimits::kMaxInflightPerInstance);
}

Status run_router(const RouterConfig& rc, RouterResult* out) {
    try {
        return run_router_impl(rc, out);
    } catch (const std::exception& e) {
        return PDSIM_ERROR(StatusCode::kInternal, "router: {}", e.what());
    }
}

namespace {
Status run_router_impl(const RouterConfig& rc, RouterResult* out) {
    const ResolvedConfig& cfg = *rc.config;
    const auto& reqs = cfg.requests;
    const size_t n = reqs.size();
    const topo::RankMap map = cfg.topology.rank_map();
    const int ninst = static_cast<int>(cfg.topology.instances.size());
    std::vector<int> prefill, decode, all;
    for (int i = 0; i < ninst; ++i) {
        all.push_back(i);
        const topo::Role role = cfg.topology.instances[static_cast<size_t>(i)].role;
        if (role == topo::Role::kPrefill) prefill.push_back(i);
        if (role == topo::Role::kDecode) decode.push_back(i);
    }
    const bool colocated = rc.phase == Phase::kColocated;
    std::vector<double> load_a(static_cast<size_t>(ninst), 0),
        load_b(static_cast<size_t>(ninst), 0);
    int last_a = -1, last_b = -1;

    out->records.assign(n, {});
    out->token_ms.assign(n, {});
    std::vector<Track> tr(n);
    // The KV-level parity check (kv_digest.h): each side's digest of a request, compared once
    // both are known (the prefill side's report may come before or after the decode side's).
    std::map<size_t, uint64_t> prefill_digest, decode_digest;
    // The mismatch message when both digests of `id` are known and differ (counted once).
    auto compare_digests = [&](size_t id) -> std::string {
        auto p = prefill_digest.find(id);
        auto d = decode_digest.find(id);
        if (p == prefill_digest.end() || d == decode_digest.end()) return {};
        const uint64_t want = p->second, got = d->second;
        prefill_digest.erase(p);
        decode_digest.erase(d);
        if (want == 0 || got == 0) return {};  // a side took none (GPU ranks)
        ++out->kv_digests_checked;
        if (want == got) return {};
        out->kv_digest_mismatches.push_back(id);
        return fmt::format(
            "the decode side's KV digest {:016x} differs from the prefill side's {:016x} (its KV "
            "or recurrent states did not arrive as computed)",
            got, want);
    };
    if (rc.journal != nullptr) rc.journal->begin_phase(rc.phase);
    for (size_t i = 0; i < n; ++i) {
        auto& r = out->records[i];
        r.id = static_cast<int64_t>(i);
        r.arrival_ms = reqs[i].arrival_ms;
        r.input_len = reqs[i].input_len;
        r.output_len = reqs[i].output_len;
    }
    const double timeout_us = cfg.options.request_timeout_s * 1e6 + kGraceMs * 1e3;
    const int64_t max_inflight = effective_max_inflight(cfg);
    std::vector<int64_t> inflight_a(static_cast<size_t>(ninst), 0),
        inflight_b(static_cast<size_t>(ninst), 0);
    // Instance progress (router.h, "Deadlines"): when an instance last reported something or
    // heartbeated a changed progress count.
    std::vector<double> inst_progress(static_cast<size_t>(ninst), 0);
    std::deque<size_t> queue;  // arrived, not dispatched yet (arrival order)
    size_t dispatched = 0;
    const double t_base = now_us() + 20'000;  // let every rank enter its loop
    out->t_base_us = t_base;
    auto rel_ms = [&](int src, double t_remote) {
        const double off = src >= 0 && static_cast<size_t>(src) < rc.offsets.size()
                               ? rc.offsets[static_cast<size_t>(src)]
                               : 0;
        return (t_remote - off - t_base) / 1000.0;
    };
    auto leader = [&](int inst) { return map.first_rank(inst); };

    // Liveness (heartbeats; see router.h).
    const double hb_timeout_us = cfg.options.heartbeat_timeout_s * 1e6;
    const int world = map.world_size();
    std::vector<double> last_seen(static_cast<size_t>(world), t_base);
    std::vector<bool> rank_dead(static_cast<size_t>(world), false);
    std::vector<bool> inst_dead(static_cast<size_t>(ninst), false);
    std::vector<int64_t> hb_progress(static_cast<size_t>(world), -1);
    for (double& t : inst_progress) t = t_base;

    size_t next = 0, terminal = 0, failed = 0;
    double last_finish_us = t_base;
    // Load bookkeeping: what a request contributes until its first token (a) and until terminal
    // (b).
    auto release_a = [&](size_t i) {
        Track& t = tr[i];
        if (t.first_seen || t.prefill_done) return;
        t.prefill_done = true;
        const int inst = colocated ? t.d : t.p;
        if (inst < 0) return;  // never assigned (no live instance)
        if (!colocated && t.holds_a) {
            t.holds_a = false;
            --inflight_a[static_cast<size_t>(inst)];
        }
        load_a[static_cast<size_t>(inst)] -= reqs[i].input_len;
    };
    auto release_b = [&](size_t i) {
        Track& t = tr[i];
        if (t.d < 0) return;  // never assigned (no live instance)
        if (colocated) {
            load_a[static_cast<size_t>(t.d)] -= reqs[i].output_len;
        } else {
            load_b[static_cast<size_t>(t.d)] -= reqs[i].input_len + reqs[i].output_len;
        }
    };
    auto make_terminal = [&](size_t i, bool ok, const std::string& err, double t_ms) -> Status {
        Track& t = tr[i];
        if (t.terminal) return {};
        release_a(i);
        release_b(i);
        if (t.holds_a) {
            t.holds_a = false;
            --inflight_a[static_cast<size_t>(colocated ? t.d : t.p)];
        }
        if (t.holds_b) {
            t.holds_b = false;
            --inflight_b[static_cast<size_t>(t.d)];
        }
        t.terminal = true;
        ++terminal;
        auto& r = out->records[i];
        r.ok = ok;
        if (!ok) {
            ++failed;
            r.error = err;
            r.finish_ms = -1;
            // Tell the instances to drop it (no-op where it is already gone).
            const json c = encode_message(CancelMsg{.id = i});
            if (t.d >= 0) PDSIM_RETURN_IF_ERROR(rc.mbox->send(leader(t.d), Channel::kInstance, c));
            if (!colocated && t.p >= 0)
                PDSIM_RETURN_IF_ERROR(rc.mbox->send(leader(t.p), Channel::kInstance, c));
        } else {
            r.finish_ms = t_ms;
        }
        if (rc.journal != nullptr) rc.journal->record(rc.phase, r);
        last_finish_us = std::max(last_finish_us, now_us());
        return {};
    };

    // A report is for this phase's request `id` (a previous phase's stragglers are dropped).
    auto for_request = [&](const std::string& phase, uint64_t id, bool* current) -> Status {
        *current = phase == phase_name(rc.phase);
        if (*current && id >= n) {
            return PDSIM_ERROR(StatusCode::kInternal, "router: report for unknown request {}", id);
        }
        return {};
    };
    auto note_prefill_start = [&](size_t id, int src, double prefill_start_us) {
        if (prefill_start_us > 0 && out->records[id].prefill_start_ms < 0) {
            out->records[id].prefill_start_ms = rel_ms(src, prefill_start_us);
        }
    };
    auto on_report = [&](const Message& m) -> Status {
        const std::string k = m.kind();
        bool current = false;
        if (k == FirstTokenReport::kKind) {
            PDSIM_ASSIGN_OR_RETURN(FirstTokenReport rep, decode_message<FirstTokenReport>(m.body));
            PDSIM_RETURN_IF_ERROR(for_request(rep.phase, rep.id, &current));
            if (!current) return {};
            const auto id = static_cast<size_t>(rep.id);
            note_prefill_start(id, m.src, rep.prefill_start_us);
            if (!tr[id].terminal) {
                tr[id].progress_us = now_us();
                out->records[id].first_token_ms = rel_ms(m.src, rep.t_us);
                release_a(id);
                tr[id].first_seen = true;
            }
        } else if (k == PrefillDoneReport::kKind) {
            PDSIM_ASSIGN_OR_RETURN(PrefillDoneReport rep,
                                   decode_message<PrefillDoneReport>(m.body));
            PDSIM_RETURN_IF_ERROR(for_request(rep.phase, rep.id, &current));
            if (!current) return {};
            const auto id = static_cast<size_t>(rep.id);
            note_prefill_start(id, m.src, rep.prefill_start_us);
            if (!rep.ok) return make_terminal(id, false, rep.error, -1);
            prefill_digest[id] = rep.kv_digest;
            if (std::string differs = compare_digests(id); !differs.empty()) {
                auto& r = out->records[id];
                if (!tr[id].terminal) return make_terminal(id, false, differs, -1);
                if (r.ok) {  // the decode side finished first: it failed after all
                    r.ok = false;
                    r.error = differs;
                    r.finish_ms = -1;
                    ++failed;
                }
            }
            tr[id].progress_us = now_us();
            release_a(id);
        } else if (k == RequestDoneReport::kKind) {
            PDSIM_ASSIGN_OR_RETURN(RequestDoneReport rep,
                                   decode_message<RequestDoneReport>(m.body));
            PDSIM_RETURN_IF_ERROR(for_request(rep.phase, rep.id, &current));
            if (!current) return {};
            const auto id = static_cast<size_t>(rep.id);
            auto& r = out->records[id];
            if (rep.ok && !tr[id].terminal) {
                decode_digest[id] = rep.kv_digest;
                if (std::string differs = compare_digests(id); !differs.empty()) {
                    rep.ok = false;
                    rep.error = std::move(differs);
                }
            }
            if (rep.ok && !tr[id].terminal) {
                r.tokens = std::move(rep.tokens);
                r.generated = static_cast<int32_t>(r.tokens.size());
                r.transfer_bytes = static_cast<int64_t>(rep.bytes);
                for (double t : rep.token_t_us) out->token_ms[id].push_back(rel_ms(m.src, t));
                if (r.first_token_ms < 0 && !out->token_ms[id].empty()) {
                    r.first_token_ms = out->token_ms[id].front();
                }
            }
            return make_terminal(id, rep.ok, rep.error, rel_ms(m.src, rep.t_us));
        } else {
            PDSIM_LOG_WARN("router: unexpected message '{}' from rank {}", k, m.src);
        }
        return {};
    };

    const bool tty = ::isatty(2) != 0;
    double next_progress = t_base + 1e6;
    auto progress = [&](bool final) {
        if (!rc.progress && !tty) return;
        const double el = (now_us() - t_base) / 1e6;
        std::string line = fmt::format(
            "[pdsim testbed {}] {}/{} done ({} failed), {} submitted, {} queued, {:.1f} s",
            rc.label, terminal, n, failed, dispatched, queue.size(), std::max(0.0, el));
        if (tty) {
            std::fprintf(stderr, "\r%s%s", line.c_str(), final ? "\n" : "");
        } else {
            std::fprintf(stderr, "%s\n", line.c_str());
        }
        std::fflush(stderr);
    };

    // A rank silent past the heartbeat timeout: its instance is dead (see router.h).
    auto check_liveness = [&](double now) -> Status {
        if (hb_timeout_us <= 0) return {};
        for (int r = 1; r < world; ++r) {
            const auto ri = static_cast<size_t>(r);
            if (rank_dead[ri] || now - last_seen[ri] <= hb_timeout_us) continue;
            rank_dead[ri] = true;
            out->dead_ranks.push_back(r);
            const int inst = map.at(r).instance;
            const std::string& id = cfg.topology.instances[static_cast<size_t>(inst)].id;
            const std::string why = fmt::format(
                "instance {} (rank {}) silent for {:.0f} s: dead or hung (--heartbeat-timeout-s)",
                id, r, (now - last_seen[ri]) / 1e6);
            PDSIM_LOG_ERROR("router: {}; its requests fail, the rest of the run goes on", why);
            if (rc.journal != nullptr) {
                rc.journal->record_dead_rank(rc.phase, r, id, (now - last_seen[ri]) / 1e6);
            }
            if (inst_dead[static_cast<size_t>(inst)]) continue;
            inst_dead[static_cast<size_t>(inst)] = true;
            for (auto* list : {&prefill, &decode, &all}) std::erase(*list, inst);
            for (size_t i = 0; i < next; ++i) {
                if (tr[i].dispatched && !tr[i].terminal && (tr[i].p == inst || tr[i].d == inst)) {
                    PDSIM_RETURN_IF_ERROR(make_terminal(i, false, "request: " + why, -1));
                }
            }
        }
        return {};
    };

    // Every report already there, waiting up to `wait` for the first one only; a report says its
    // rank is alive and its instance moved.
    auto receive_reports = [&](microseconds wait) -> Status {
        PDSIM_ASSIGN_OR_RETURN(std::optional<Message> m, rc.mbox->recv(Channel::kRouter, wait));
        while (m) {
            if (m->src > 0 && m->src < world) {
                const double t = now_us();
                last_seen[static_cast<size_t>(m->src)] = t;
                inst_progress[static_cast<size_t>(map.at(m->src).instance)] = t;
            }
            PDSIM_RETURN_IF_ERROR(on_report(*m));
            PDSIM_ASSIGN_OR_RETURN(m, rc.mbox->recv(Channel::kRouter, microseconds(0)));
        }
        return {};
    };

    while (terminal < n) {
        const double now = now_us();
        {
            // Heartbeats (and any report) say who is alive.
            PDSIM_ASSIGN_OR_RETURN(std::optional<Message> hb,
                                   rc.mbox->recv(Channel::kHeartbeat, microseconds(0)));
            while (hb) {
                if (hb->src > 0 && hb->src < world) {
                    const auto si = static_cast<size_t>(hb->src);
                    last_seen[si] = now;
                    if (rc.journal != nullptr) rc.journal->heard_from(hb->src);
                    // A changed progress count: the rank's instance moved (router.h).
                    const int64_t pc = hb->body.value("p", int64_t{-1});
                    if (pc >= 0 && pc != hb_progress[si]) {
                        hb_progress[si] = pc;
                        inst_progress[static_cast<size_t>(map.at(hb->src).instance)] = now;
                    }
                }
                PDSIM_ASSIGN_OR_RETURN(hb, rc.mbox->recv(Channel::kHeartbeat, microseconds(0)));
            }
            PDSIM_RETURN_IF_ERROR(check_liveness(now));
        }
        // Arrivals join the router's queue; its head is dispatched while its instances have room
        // (router.h, "Backpressure"): strict arrival order.
        while (next < n && t_base + reqs[next].arrival_ms * 1000.0 <= now) queue.push_back(next++);
        // With no live instance of a role left, no request can be served: the ones still to
        // arrive fail now (below) rather than one by one at their arrival times, so a run whose
        // only decode (or prefill) instance died ends within the heartbeat timeout.
        if (next < n && (colocated ? all.empty() : prefill.empty() || decode.empty())) {
            while (next < n) queue.push_back(next++);
        }
        while (!queue.empty()) {
            const size_t i = queue.front();
            Track& t = tr[i];
            const bool no_live = colocated ? all.empty() : prefill.empty() || decode.empty();
            if (no_live) {
                queue.pop_front();
                PDSIM_RETURN_IF_ERROR(make_terminal(
                    i, false,
                    fmt::format("no live {} instance left (the others were silent past "
                                "--heartbeat-timeout-s)",
                                colocated         ? "colocated"
                                : prefill.empty() ? "prefill"
                                                  : "decode"),
                    -1));
                continue;
            }
            auto with_room = [&](const std::vector<int>& list, const std::vector<int64_t>& in) {
                std::vector<int> room;
                for (int inst : list) {
                    if (in[static_cast<size_t>(inst)] < max_inflight) room.push_back(inst);
                }
                return room;
            };
            const std::vector<int> room_a = with_room(colocated ? all : prefill, inflight_a);
            const std::vector<int> room_b = colocated ? room_a : with_room(decode, inflight_b);
            if (room_a.empty() || room_b.empty()) break;  // the head waits; so does the rest
            queue.pop_front();
            ++dispatched;
            t.dispatched = true;
            t.progress_us = now;
            out->records[i].queue_ms =
                std::max(0.0, (now - (t_base + reqs[i].arrival_ms * 1000.0)) / 1000.0);
            SubmitMsg sub;
            sub.id = i;
            sub.input_len = reqs[i].input_len;
            sub.output_len = reqs[i].output_len;
            sub.hash = reqs[i].hash_ids;
            if (colocated) {
                t.d = t.p = pick(room_a, load_a, &last_a);
                load_a[static_cast<size_t>(t.d)] += reqs[i].input_len + reqs[i].output_len;
                t.holds_a = true;
                ++inflight_a[static_cast<size_t>(t.d)];
                sub.prefill_instance = t.p;
                sub.decode_instance = t.d;
                PDSIM_RETURN_IF_ERROR(
                    rc.mbox->send(leader(t.d), Channel::kInstance, encode_message(sub)));
            } else {
                t.p = pick(room_a, load_a, &last_a);
                t.d = pick(room_b, load_b, &last_b);
                load_a[static_cast<size_t>(t.p)] += reqs[i].input_len;
                load_b[static_cast<size_t>(t.d)] += reqs[i].input_len + reqs[i].output_len;
                t.holds_a = t.holds_b = true;
                ++inflight_a[static_cast<size_t>(t.p)];
                ++inflight_b[static_cast<size_t>(t.d)];
                sub.prefill_instance = t.p;
                sub.decode_instance = t.d;
                const json wire = encode_message(sub);
                // Decode first: its bootstrap can reach the prefill side early.
                PDSIM_RETURN_IF_ERROR(rc.mbox->send(leader(t.d), Channel::kInstance, wire));
                PDSIM_RETURN_IF_ERROR(rc.mbox->send(leader(t.p), Channel::kInstance, wire));
            }
            out->records[i].prefill_instance = t.p;
            out->records[i].decode_instance = t.d;
        }
        // Deadlines (router.h): no progress of the request, nor of the instance it waits on.
        for (size_t i = 0; i < next; ++i) {
            const Track& t = tr[i];
            if (!t.dispatched || t.terminal) continue;
            const int stage = colocated || t.prefill_done || t.first_seen ? t.d : t.p;
            const double last = std::max(t.progress_us, inst_progress[static_cast<size_t>(stage)]);
            if (now - last > timeout_us) {
                PDSIM_RETURN_IF_ERROR(make_terminal(
                    i, false,
                    fmt::format("no progress for {:.0f} s (router timeout, --request-timeout-s "
                                "plus {:.0f} s grace; waiting on instance {}; instances {} / {})",
                                timeout_us / 1e6, kGraceMs / 1e3, stage, t.p, t.d),
                    -1));
            }
        }
        if (now >= next_progress) {
            progress(false);
            next_progress = now + 1e6;
        }
        if (terminal >= n) break;
        // Wait for reports until the next arrival (at most 50 ms, for deadlines and progress).
        double wait_us = 50'000;
        if (next < n)
            wait_us =
                std::min(wait_us, std::max(0.0, t_base + reqs[next].arrival_ms * 1000.0 - now));
        PDSIM_RETURN_IF_ERROR(receive_reports(microseconds(static_cast<int64_t>(wait_us))));
    }
    // A request ends when its decode side reports; its prefill side's report (and digest) can
    // still be on its way (a TP prefill instance reports once every rank's sender finished). Wait
    // for those, briefly, so that every completed request's KV parity is checked.
    if (!colocated && !decode_digest.empty()) {
        const double drain_until = now_us() + std::min(timeout_us, 10e6);
        while (!decode_digest.empty() && now_us() < drain_until) {
            PDSIM_RETURN_IF_ERROR(receive_reports(microseconds(20'000)));
        }
        if (!decode_digest.empty()) {
            PDSIM_LOG_WARN(
                "router: {} request(s) ended without their prefill side's report within {:.0f} "
                "s; their KV parity is unchecked",
                decode_digest.size(), std::min(timeout_us, 10e6) / 1e6);
        }
    }
    out->wall_s = (last_finish_us - t_base) / 1e6;
    progress(true);
    for (int i = 0; i < ninst; ++i) {
        PDSIM_RETURN_IF_ERROR(
            rc.mbox->send(leader(i), Channel::kInstance, encode_message(EndMsg{})));
    }
    return {};
}
}  // namespace

}  // namespace pdsim::testbed

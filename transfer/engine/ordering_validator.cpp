#include "transfer/engine/ordering_validator.h"

#include <fmt/chrono.h>
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <optional>

#include "transfer/engine/kv_copy_plan.h"
#include "transfer/engine/kv_hash.h"
#include "transfer/engine/kv_memory_ops.h"

namespace pdsim::transfer {

uint64_t kv_hash(const void* data, size_t bytes, uint64_t seed) {
    return kv_hash_inline(data, bytes, seed);
}

void kv_checksums_add_run(const KvLayout& layout, int layer, int buf, int64_t token_begin,
                          int64_t count, int64_t slot0, size_t offset, int head_count,
                          uint64_t* sums) {
    const size_t hb = layout.head_bytes(buf);
    for (int64_t k = 0; k < count; ++k) {
        const std::byte* tok = layout.slot_addr(layer, buf, slot0 + k) + offset;
        const auto seed = static_cast<uint64_t>(token_begin + k);
        for (int h = 0; h < head_count; ++h) {
            sums[h] += kv_hash_inline(tok + static_cast<size_t>(h) * hb, hb, seed);
        }
    }
}

std::vector<uint64_t> kv_checksums(const KvLayout& layout, std::span<const int32_t> pages,
                                   int layer, int buf, int64_t t0, int64_t t1, int head_begin,
                                   int head_count) {
    std::vector<uint64_t> sums(static_cast<size_t>(head_count), 0);
    const size_t offset =
        static_cast<size_t>(head_begin - layout.head_begin()) * layout.head_bytes(buf);
    const int ps = layout.page_size();
    int64_t t = t0;
    while (t < t1) {
        // One page segment at a time: slots are consecutive inside a page.
        const int64_t n = std::min<int64_t>(t1 - t, ps - t % ps);
        kv_checksums_add_run(layout, layer, buf, t, n, token_slot(pages, ps, t), offset, head_count,
                             sums.data());
        t += n;
    }
    return sums;
}

std::string Violation::to_string() const {
    return fmt::format("request {} layer {} buffer {} rank {}: {}", request, layer, buffer, rank,
                       what);
}

void OrderingReport::merge(const OrderingReport& other) {
    checked_layers += other.checked_layers;
    violations.insert(violations.end(), other.violations.begin(), other.violations.end());
}

std::string OrderingReport::to_string(size_t max_listed) const {
    std::string out =
        fmt::format("{} checked layers, {} violations", checked_layers, violations.size());
    for (size_t i = 0; i < violations.size() && i < max_listed; ++i) {
        out += "\n  " + violations[i].to_string();
    }
    if (violations.size() > max_listed) {
        out += fmt::format("\n  ... {} more", violations.size() - max_listed);
    }
    return out;
}

void OrderingValidator::record_expected(uint64_t request, int layer, int buf, int head_begin,
                                        std::span<const uint64_t> sums, int64_t t0, int64_t t1) {
    std::optional<Violation> overlap;
    {
        std::lock_guard<std::mutex> lock(mu_);
        Entry& e = expected_[Key{request, layer, buf}];
        for (const auto& [a, b] : e.ranges) {
            if (t0 < b && a < t1) {
                overlap = Violation{request, layer, buf, rank_,
                                    fmt::format("compute: tokens [{}, {}) recorded again (already "
                                                "[{}, {})): the layer was written twice",
                                                t0, t1, a, b)};
                break;
            }
        }
        e.ranges.emplace_back(t0, t1);
        e.covered += t1 - t0;
        for (size_t i = 0; i < sums.size(); ++i) {
            e.sums[head_begin + static_cast<int>(i)] += sums[i];
        }
        if (overlap) report_.violations.push_back(*overlap);
    }
    cv_.notify_all();
}

StatusOr<std::vector<uint64_t>> OrderingValidator::wait_expected(
    uint64_t request, int layer, int buf, int64_t num_tokens, int head_begin, int head_count,
    std::chrono::nanoseconds timeout) const {
    std::unique_lock<std::mutex> lock(mu_);
    const Key key{request, layer, buf};
    auto covered = [&]() -> int64_t {
        auto it = expected_.find(key);
        return it == expected_.end() ? 0 : it->second.covered;
    };
    if (!cv_.wait_for(lock, timeout, [&] { return covered() >= num_tokens; })) {
        return PDSIM_ERROR(StatusCode::kDeadlineExceeded,
                           "request {} layer {} buffer {}: compute checksums cover {} of {} "
                           "tokens after {}",
                           request, layer, buf, covered(), num_tokens,
                           std::chrono::duration_cast<std::chrono::milliseconds>(timeout));
    }
    const Entry& e = expected_.at(key);
    std::vector<uint64_t> out(static_cast<size_t>(head_count), 0);
    for (int h = 0; h < head_count; ++h) {
        auto it = e.sums.find(head_begin + h);
        if (it == e.sums.end()) {
            return PDSIM_ERROR(StatusCode::kNotFound,
                               "request {} layer {} buffer {}: no compute checksum for head {} "
                               "(not one of this rank's heads?)",
                               request, layer, buf, head_begin + h);
        }
        out[static_cast<size_t>(h)] = it->second;
    }
    return out;
}

size_t OrderingValidator::compare(uint64_t request, int layer, int buf, int head_begin,
                                  std::span<const uint64_t> observed,
                                  std::span<const uint64_t> expected, std::string_view side) {
    size_t bad = 0;
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < observed.size() && i < expected.size(); ++i) {
        if (observed[i] == expected[i]) continue;
        ++bad;
        report_.violations.push_back(
            Violation{request, layer, buf, rank_,
                      fmt::format("{}: head {} checksum {:016x} != recorded {:016x}", side,
                                  head_begin + static_cast<int>(i), observed[i], expected[i])});
    }
    return bad;
}

void OrderingValidator::add_violation(Violation v) {
    std::lock_guard<std::mutex> lock(mu_);
    report_.violations.push_back(std::move(v));
}

void OrderingValidator::add_checked_layers(uint64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    report_.checked_layers += n;
}

OrderingReport OrderingValidator::report() const {
    std::lock_guard<std::mutex> lock(mu_);
    return report_;
}

size_t OrderingValidator::violation_count() const {
    std::lock_guard<std::mutex> lock(mu_);
    return report_.violations.size();
}

void OrderingValidator::forget(uint64_t request) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = expected_.lower_bound(Key{request, -1, -1});
    while (it != expected_.end() && std::get<0>(it->first) == request) it = expected_.erase(it);
}

namespace {

// enqueue_layer_checksum of a device layout: the ops' checksums into their sums memory, then a
// host task that records them.
Status enqueue_device_layer_checksum(runtime::Stream& stream, OrderingValidator& validator,
                                     const KvLayout& layout, uint64_t request_id, int layer,
                                     const std::vector<int32_t>& pages, int64_t token_begin,
                                     int64_t token_end, KvMemoryOps* ops) {
    if (ops == nullptr || ops->memory_kind() != layout.device().kind) {
        return PDSIM_ERROR(
            StatusCode::kInvalidArgument,
            "checksum of layer {}: the layout's memory is on {}:{}; ops: {} (KV "
            "memory ops of that memory kind are needed)",
            layer, runtime::device_kind_name(layout.device().kind), layout.device().index,
            ops == nullptr ? std::string("null")
                           : fmt::format("'{}' works on {} memory", ops->name(),
                                         runtime::device_kind_name(ops->memory_kind())));
    }
    PDSIM_RETURN_IF_ERROR(layout.check_pages(pages, token_end));
    PDSIM_ASSIGN_OR_RETURN(
        KvChecksumPlan plan,
        plan_page_checksums(layout, pages, token_begin, token_end, layer, layer + 1,
                            layout.head_begin(), layout.local_heads()));
    PDSIM_ASSIGN_OR_RETURN(KvOpsMemory sums, ops->allocate_sums(plan.sum_count));
    auto held = std::make_shared<KvOpsMemory>(std::move(sums));
    PDSIM_RETURN_IF_ERROR(ops->enqueue_checksums(stream, layout, plan.ops, held->as<uint64_t>()));
    std::vector<size_t> at;
    for (int b = 0; b < layout.buffer_count(); ++b) at.push_back(plan.sum_index(layer, b));
    return stream.enqueue([&validator, held, at = std::move(at), request_id, layer,
                           head_begin = layout.head_begin(), heads = layout.local_heads(),
                           token_begin, token_end]() {
        for (size_t b = 0; b < at.size(); ++b) {
            validator.record_expected(
                request_id, layer, static_cast<int>(b), head_begin,
                std::span<const uint64_t>(held->as<uint64_t>() + at[b], static_cast<size_t>(heads)),
                token_begin, token_end);
        }
        return Status();
    });
}

}  // namespace

Status enqueue_layer_checksum(runtime::Stream& stream, OrderingValidator& validator,
                              const KvLayout& layout, uint64_t request_id, int layer,
                              std::vector<int32_t> pages, int64_t token_begin, int64_t token_end,
                              KvMemoryOps* ops) {
    if (layer < 0 || layer >= layout.num_layers() || token_begin < 0 || token_end < token_begin) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "checksum of layer {} tokens [{}, {}) (layout has {} layers)", layer,
                           token_begin, token_end, layout.num_layers());
    }
    if (!layout.is_host()) {
        return enqueue_device_layer_checksum(stream, validator, layout, request_id, layer, pages,
                                             token_begin, token_end, ops);
    }
    PDSIM_RETURN_IF_ERROR(layout.check_pages(pages, token_end));
    auto shared = std::make_shared<const KvLayout>(layout);
    return stream.enqueue([&validator, shared, request_id, layer, pages = std::move(pages),
                           token_begin, token_end]() {
        const KvLayout& l = *shared;
        for (int b = 0; b < l.buffer_count(); ++b) {
            std::vector<uint64_t> sums = kv_checksums(l, pages, layer, b, token_begin, token_end,
                                                      l.head_begin(), l.local_heads());
            validator.record_expected(request_id, layer, b, l.head_begin(), sums, token_begin,
                                      token_end);
        }
        return Status();
    });
}

}  // namespace pdsim::transfer

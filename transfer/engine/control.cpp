#include "transfer/engine/control.h"

#include <fmt/format.h>

#include <atomic>
#include <cstring>
#include <type_traits>

#include "common/logging.h"
#include "common/thread_info.h"

namespace pdsim::transfer {

std::string_view msg_type_name(MsgType type) {
    switch (type) {
        case MsgType::kBootstrap:
            return "bootstrap";
        case MsgType::kAck:
            return "ack";
        case MsgType::kChunk:
            return "chunk";
        case MsgType::kAbort:
            return "abort";
        case MsgType::kHeartbeat:
            return "heartbeat";
        case MsgType::kCompletion:
            return "completion";
    }
    return "?";
}

namespace {

constexpr uint32_t kMagic = 0x564B4450;  // "PDKV"
constexpr uint16_t kVersion = 1;
constexpr size_t kHeaderBytes = 8;
constexpr uint32_t kMaxStringBytes = 1 << 16;

class Writer {
public:
    explicit Writer(MsgType type) {
        put(kMagic);
        put(kVersion);
        put(static_cast<uint16_t>(type));
    }
    template <typename T>
    void put(T v) {
        static_assert(std::is_trivially_copyable_v<T>);
        const auto* p = reinterpret_cast<const uint8_t*>(&v);
        out_.insert(out_.end(), p, p + sizeof(T));
    }
    void put_bool(bool b) { put<uint8_t>(b ? 1 : 0); }
    void put_string(const std::string& s) {
        const auto n = static_cast<uint32_t>(std::min<size_t>(s.size(), kMaxStringBytes));
        put(n);
        out_.insert(out_.end(), s.begin(), s.begin() + n);
    }
    template <typename T>
    void put_vector(const std::vector<T>& v) {
        put(static_cast<uint32_t>(v.size()));
        const auto* p = reinterpret_cast<const uint8_t*>(v.data());
        out_.insert(out_.end(), p, p + v.size() * sizeof(T));
    }
    void put_layout(const KvLayoutSummary& s) {
        put(static_cast<uint8_t>(s.kind));
        put(s.num_layers);
        put(s.buffer_count);
        put(s.page_size);
        put(s.dtype_bytes);
        put(s.tp_size);
        put(s.tp_rank);
        put(s.total_kv_heads);
        put(s.head_begin);
        put(s.local_heads);
        for (uint64_t hb : s.head_bytes) put(hb);
    }
    Bytes take() { return std::move(out_); }

private:
    Bytes out_;
};

class Reader {
public:
    explicit Reader(std::span<const uint8_t> in) : in_(in), pos_(kHeaderBytes) {}
    template <typename T>
    T get() {
        T v{};
        if (!ok_ || in_.size() - pos_ < sizeof(T)) {
            ok_ = false;
            return v;
        }
        std::memcpy(&v, in_.data() + pos_, sizeof(T));
        pos_ += sizeof(T);
        return v;
    }
    bool get_bool() { return get<uint8_t>() != 0; }
    std::string get_string() {
        const auto n = get<uint32_t>();
        if (!ok_ || n > kMaxStringBytes || in_.size() - pos_ < n) {
            ok_ = false;
            return {};
        }
        std::string s(reinterpret_cast<const char*>(in_.data() + pos_), n);
        pos_ += n;
        return s;
    }
    template <typename T>
    std::vector<T> get_vector() {
        const auto n = get<uint32_t>();
        if (!ok_ || (in_.size() - pos_) / sizeof(T) < n) {
            ok_ = false;
            return {};
        }
        std::vector<T> v(n);
        std::memcpy(v.data(), in_.data() + pos_, n * sizeof(T));
        pos_ += n * sizeof(T);
        return v;
    }
    KvLayoutSummary get_layout() {
        KvLayoutSummary s;
        const auto kind = get<uint8_t>();
        if (kind > 1) ok_ = false;
        s.kind = static_cast<KvKind>(kind);
        s.num_layers = get<int32_t>();
        s.buffer_count = get<int32_t>();
        s.page_size = get<int32_t>();
        s.dtype_bytes = get<int32_t>();
        s.tp_size = get<int32_t>();
        s.tp_rank = get<int32_t>();
        s.total_kv_heads = get<int32_t>();
        s.head_begin = get<int32_t>();
        s.local_heads = get<int32_t>();
        for (uint64_t& hb : s.head_bytes) hb = get<uint64_t>();
        if (s.buffer_count < 1 || s.buffer_count > kMaxKvBuffers || s.page_size < 1 ||
            s.num_layers < 1 || s.tp_size < 1 || s.local_heads < 1) {
            ok_ = false;
        }
        return s;
    }
    [[nodiscard]] Status finish(MsgType type) const {
        if (!ok_) {
            return PDSIM_ERROR(StatusCode::kDataLoss,
                               "truncated or malformed {} message ({} bytes)", msg_type_name(type),
                               in_.size());
        }
        return {};
    }

private:
    std::span<const uint8_t> in_;
    size_t pos_;
    bool ok_ = true;
};

Status expect_type(std::span<const uint8_t> bytes, MsgType want) {
    PDSIM_ASSIGN_OR_RETURN(MsgType got, peek_type(bytes));
    if (got != want) {
        return PDSIM_ERROR(StatusCode::kDataLoss, "expected a {} message, got {}",
                           msg_type_name(want), msg_type_name(got));
    }
    return {};
}

}  // namespace

StatusOr<MsgType> peek_type(std::span<const uint8_t> bytes) {
    if (bytes.size() < kHeaderBytes) {
        return PDSIM_ERROR(StatusCode::kDataLoss, "control message of {} bytes", bytes.size());
    }
    uint32_t magic;
    uint16_t version;
    uint16_t type;
    std::memcpy(&magic, bytes.data(), 4);
    std::memcpy(&version, bytes.data() + 4, 2);
    std::memcpy(&type, bytes.data() + 6, 2);
    if (magic != kMagic) {
        return PDSIM_ERROR(StatusCode::kDataLoss, "bad control message magic {:#x}", magic);
    }
    if (version != kVersion) {
        return PDSIM_ERROR(StatusCode::kDataLoss, "control message version {} (expected {})",
                           version, kVersion);
    }
    if (type < 1 || type > 6) {
        return PDSIM_ERROR(StatusCode::kDataLoss, "unknown control message type {}", type);
    }
    return static_cast<MsgType>(type);
}

Bytes encode(const BootstrapMsg& m) {
    Writer w(MsgType::kBootstrap);
    w.put(m.request_id);
    w.put(m.decode_rank);
    w.put(m.decode_tp_rank);
    w.put(m.decode_tp_size);
    w.put(m.data_tag);
    w.put(m.num_tokens);
    w.put(m.max_message_bytes);
    w.put_layout(m.layout);
    w.put_vector(m.dst_pages);
    return w.take();
}

StatusOr<BootstrapMsg> decode_bootstrap(std::span<const uint8_t> bytes) {
    PDSIM_RETURN_IF_ERROR(expect_type(bytes, MsgType::kBootstrap));
    Reader r(bytes);
    BootstrapMsg m;
    m.request_id = r.get<uint64_t>();
    m.decode_rank = r.get<int32_t>();
    m.decode_tp_rank = r.get<int32_t>();
    m.decode_tp_size = r.get<int32_t>();
    m.data_tag = r.get<Tag>();
    m.num_tokens = r.get<int64_t>();
    m.max_message_bytes = r.get<uint64_t>();
    m.layout = r.get_layout();
    m.dst_pages = r.get_vector<int32_t>();
    PDSIM_RETURN_IF_ERROR(r.finish(MsgType::kBootstrap));
    return m;
}

Bytes encode(const AckMsg& m) {
    Writer w(MsgType::kAck);
    w.put(m.request_id);
    w.put(m.prefill_tp_rank);
    w.put(m.prefill_tp_size);
    w.put_bool(m.ok);
    w.put_string(m.reason);
    w.put(m.max_message_bytes);
    w.put_layout(m.layout);
    return w.take();
}

StatusOr<AckMsg> decode_ack(std::span<const uint8_t> bytes) {
    PDSIM_RETURN_IF_ERROR(expect_type(bytes, MsgType::kAck));
    Reader r(bytes);
    AckMsg m;
    m.request_id = r.get<uint64_t>();
    m.prefill_tp_rank = r.get<int32_t>();
    m.prefill_tp_size = r.get<int32_t>();
    m.ok = r.get_bool();
    m.reason = r.get_string();
    m.max_message_bytes = r.get<uint64_t>();
    m.layout = r.get_layout();
    PDSIM_RETURN_IF_ERROR(r.finish(MsgType::kAck));
    return m;
}

Bytes encode(const ChunkMsg& m) {
    Writer w(MsgType::kChunk);
    w.put(m.request_id);
    w.put(m.chunk_index);
    w.put(m.token_begin);
    w.put(m.token_end);
    w.put_bool(m.is_last);
    w.put(m.src_first_page);
    w.put_vector(m.src_pages);
    return w.take();
}

StatusOr<ChunkMsg> decode_chunk(std::span<const uint8_t> bytes) {
    PDSIM_RETURN_IF_ERROR(expect_type(bytes, MsgType::kChunk));
    Reader r(bytes);
    ChunkMsg m;
    m.request_id = r.get<uint64_t>();
    m.chunk_index = r.get<uint32_t>();
    m.token_begin = r.get<int64_t>();
    m.token_end = r.get<int64_t>();
    m.is_last = r.get_bool();
    m.src_first_page = r.get<int64_t>();
    m.src_pages = r.get_vector<int32_t>();
    PDSIM_RETURN_IF_ERROR(r.finish(MsgType::kChunk));
    return m;
}

Bytes encode(const AbortMsg& m) {
    Writer w(MsgType::kAbort);
    w.put(m.request_id);
    w.put_string(m.reason);
    return w.take();
}

StatusOr<AbortMsg> decode_abort(std::span<const uint8_t> bytes) {
    PDSIM_RETURN_IF_ERROR(expect_type(bytes, MsgType::kAbort));
    Reader r(bytes);
    AbortMsg m;
    m.request_id = r.get<uint64_t>();
    m.reason = r.get_string();
    PDSIM_RETURN_IF_ERROR(r.finish(MsgType::kAbort));
    return m;
}

Bytes encode_heartbeat() {
    Writer w(MsgType::kHeartbeat);
    w.put(uint64_t{0});
    return w.take();
}

size_t completion_capacity(int num_layers, int buffer_count, int head_count) {
    // Header + fixed fields + vector length + the sums.
    return kHeaderBytes + 8 + 4 + 1 + 4 + 4 * 4 + 4 + 1 + 4 +
           static_cast<size_t>(num_layers) * static_cast<size_t>(buffer_count) *
               static_cast<size_t>(head_count) * 8;
}

Bytes encode(const CompletionMsg& m) {
    Writer w(MsgType::kCompletion);
    w.put(m.request_id);
    w.put(m.src_tp_rank);
    w.put_bool(m.has_first_token);
    w.put(m.first_token);
    w.put(m.num_layers);
    w.put(m.buffer_count);
    w.put(m.head_begin);
    w.put(m.head_count);
    w.put(m.chunks);
    w.put_bool(m.has_checksums);
    w.put_vector(m.checksums);
    return w.take();
}

StatusOr<CompletionMsg> decode_completion(std::span<const uint8_t> bytes) {
    PDSIM_RETURN_IF_ERROR(expect_type(bytes, MsgType::kCompletion));
    Reader r(bytes);
    CompletionMsg m;
    m.request_id = r.get<uint64_t>();
    m.src_tp_rank = r.get<int32_t>();
    m.has_first_token = r.get_bool();
    m.first_token = r.get<int32_t>();
    m.num_layers = r.get<int32_t>();
    m.buffer_count = r.get<int32_t>();
    m.head_begin = r.get<int32_t>();
    m.head_count = r.get<int32_t>();
    m.chunks = r.get<uint32_t>();
    m.has_checksums = r.get_bool();
    m.checksums = r.get_vector<uint64_t>();
    PDSIM_RETURN_IF_ERROR(r.finish(MsgType::kCompletion));
    if (m.has_checksums &&
        m.checksums.size() != static_cast<size_t>(m.num_layers) *
                                  static_cast<size_t>(std::max(m.buffer_count, 0)) *
                                  static_cast<size_t>(std::max(m.head_count, 0))) {
        return PDSIM_ERROR(StatusCode::kDataLoss,
                           "completion of request {} carries {} checksums for {} layers x {} "
                           "buffers x {} heads",
                           m.request_id, m.checksums.size(), m.num_layers, m.buffer_count,
                           m.head_count);
    }
    return m;
}

// ---- ControlChannel ----

std::shared_ptr<ControlChannel> ControlChannel::create(Transport& transport,
                                                       ControlOptions options) {
    return std::shared_ptr<ControlChannel>(new ControlChannel(transport, options));
}

ControlChannel::ControlChannel(Transport& transport, ControlOptions options)
    : transport_(transport), options_(options) {
    const auto n = static_cast<size_t>(transport.world_size());
    last_heard_.assign(n, Clock::now());
    failed_.assign(n, 0);
    interest_.assign(n, 0);
    last_heartbeat_.assign(n, Clock::time_point{});
    recv_handles_.resize(n);
    heartbeat_busy_ = std::make_unique<std::atomic<bool>[]>(n);
    for (size_t i = 0; i < n; ++i) heartbeat_busy_[i].store(false);
}

ControlChannel::~ControlChannel() {
    stop(false);
}

Status ControlChannel::start(ControlListener* listener) {
    if (started_) return PDSIM_ERROR(StatusCode::kFailedPrecondition, "control channel started");
    listener_ = listener;
    started_ = true;
    const auto now = Clock::now();
    for (auto& t : last_heard_) t = now;
    for (int p = 0; p < transport_.world_size(); ++p) {
        if (p != transport_.rank()) post_control_recv(p);
    }
    thread_ = std::thread([this] {
        set_thread_name("pdsim-control");
        loop();
    });
    return {};
}

void ControlChannel::stop(bool drain) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
        stop_ = true;
        if (!drain) tasks_.clear();
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    {
        std::lock_guard<std::mutex> lock(mu_);
        closed_ = true;
        tasks_.clear();
    }
    // Withdraw what is still posted. A receive or send that is already moving data cannot be
    // cancelled; it completes on its own (its buffer is owned by its callback, so that is safe).
    for (RequestHandle& h : recv_handles_) {
        if (h.valid() && !h.done()) transport_.cancel(h).ignore_error();
    }
    std::unordered_map<uint64_t, RequestHandle> sends;
    {
        std::lock_guard<std::mutex> lock(sends_mu_);
        sends.swap(sends_);
    }
    for (auto& [id, h] : sends) {
        if (h.valid() && !h.done()) transport_.cancel(h).ignore_error();
    }
}

bool ControlChannel::on_control_thread() const {
    return std::this_thread::get_id() == thread_.get_id();
}

void ControlChannel::post(std::function<void()> fn) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (closed_) return;
        tasks_.push_back(std::move(fn));
    }
    cv_.notify_one();
}

void ControlChannel::loop() {
    auto next_tick = Clock::now() + options_.tick;
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
        cv_.wait_until(lock, next_tick, [&] { return stop_ || !tasks_.empty(); });
        while (!tasks_.empty()) {
            auto fn = std::move(tasks_.front());
            tasks_.pop_front();
            lock.unlock();
            fn();
            lock.lock();
        }
        if (stop_) return;
        const auto now = Clock::now();
        if (now >= next_tick) {
            lock.unlock();
            send_heartbeats(now);
            listener_->on_tick(now);
            lock.lock();
            next_tick = now + options_.tick;
        }
    }
}

void ControlChannel::post_control_recv(int peer) {
    if (failed_[static_cast<size_t>(peer)]) return;
    auto buf = std::make_shared<Bytes>(options_.max_control_bytes);
    auto h = transport_.post_recv(peer, kControlTag, buf->data(), buf->size());
    if (!h.ok()) {
        failed_[static_cast<size_t>(peer)] = 1;
        listener_->on_peer_failed(peer, h.status());
        return;
    }
    recv_handles_[static_cast<size_t>(peer)] = *h;
    std::weak_ptr<ControlChannel> weak = weak_from_this();
    // The callback only hands the message to the control thread: it may run on a transport
    // thread (or inside post_recv on this thread), where re-entering the engine is not allowed.
    h->on_complete([weak, peer, buf](const Status& st, size_t n) {
        if (auto self = weak.lock()) {
            self->post(
                [self = self.get(), peer, buf, st, n] { self->on_recv_done(peer, buf, st, n); });
        }
    });
}

void ControlChannel::on_recv_done(int peer, const std::shared_ptr<Bytes>& buf, const Status& st,
                                  size_t n) {
    if (!st.ok()) {
        if (st.code() == StatusCode::kAborted) return;  // withdrawn at stop
        failed_[static_cast<size_t>(peer)] = 1;
        listener_->on_peer_failed(peer,
                                  st.with_context(fmt::format("control link to rank {}", peer)));
        return;
    }
    last_heard_[static_cast<size_t>(peer)] = Clock::now();
    // Repost before handling: the next message from this peer can land while we work.
    post_control_recv(peer);
    listener_->on_control(peer, std::span<const uint8_t>(buf->data(), n));
}

void ControlChannel::send(int peer, Bytes bytes) {
    post_tracked_send(peer, std::make_shared<Bytes>(std::move(bytes)), nullptr);
}

void ControlChannel::post_tracked_send(int peer, std::shared_ptr<Bytes> buf,
                                       std::function<void()> on_finished) {
    uint64_t id;
    {
        std::lock_guard<std::mutex> lock(sends_mu_);
        id = next_send_id_++;
        sends_.emplace(id, RequestHandle{});
    }
    auto h = transport_.post_send(peer, kControlTag, buf->data(), buf->size());
    std::weak_ptr<ControlChannel> weak = weak_from_this();
    auto on_done = [weak, peer, id, buf, on_finished](const Status& st, size_t) {
        if (on_finished) on_finished();
        auto self = weak.lock();
        if (!self) return;
        {
            std::lock_guard<std::mutex> lock(self->sends_mu_);
            self->sends_.erase(id);
        }
        if (!st.ok() && st.code() == StatusCode::kUnavailable) {
            self->post([self = self.get(), peer, st] {
                if (self->failed_[static_cast<size_t>(peer)]) return;
                self->failed_[static_cast<size_t>(peer)] = 1;
                self->listener_->on_peer_failed(
                    peer, st.with_context(fmt::format("control send to rank {}", peer)));
            });
        }
    };
    if (!h.ok()) {
        on_done(h.status(), 0);
        return;
    }
    {
        std::lock_guard<std::mutex> lock(sends_mu_);
        auto it = sends_.find(id);
        if (it != sends_.end()) it->second = *h;
    }
    h->on_complete(on_done);
}

void ControlChannel::send_heartbeats(Clock::time_point now) {
    for (int p = 0; p < transport_.world_size(); ++p) {
        const auto i = static_cast<size_t>(p);
        if (interest_[i] == 0 || failed_[i]) continue;
        if (now - last_heartbeat_[i] < options_.heartbeat_interval) continue;
        // At most one heartbeat in flight per peer: a silent peer that never posts receives
        // must not accumulate an unbounded queue of them.
        bool expected = false;
        if (!heartbeat_busy_[i].compare_exchange_strong(expected, true)) continue;
        last_heartbeat_[i] = now;
        // The flag lives as long as the channel's shared state; the callback holds a weak ref.
        std::weak_ptr<ControlChannel> weak = weak_from_this();
        post_tracked_send(p, std::make_shared<Bytes>(encode_heartbeat()), [weak, i] {
            if (auto self = weak.lock()) self->heartbeat_busy_[i].store(false);
        });
    }
}

ControlChannel::Clock::time_point ControlChannel::last_heard(int peer) const {
    return last_heard_[static_cast<size_t>(peer)];
}

bool ControlChannel::peer_failed(int peer) const {
    return failed_[static_cast<size_t>(peer)] != 0;
}

void ControlChannel::set_interest(std::vector<uint8_t> peers) {
    peers.resize(interest_.size(), 0);
    interest_ = std::move(peers);
}

}  // namespace pdsim::transfer

// "tcp": a two-sided Transport over TCP with Boost.Asio (see transfer/transport.h for the
// contract, transfer/tcp/frame.h for the wire format).
//
// - One io_context per endpoint, run by its own thread; it owns every socket. Posting threads only
//   lock a per-peer queue and, when the peer's writer is idle, post a kick to the io thread.
// - A full mesh: rank r connects to every lower rank and accepts every higher one. Rendezvous via
//   TcpOptions (its option block: endpoints list, or a bootstrap directory where each rank
//   publishes its bound address), or the environment (PDSIM_TCP_ENDPOINTS,
//   PDSIM_TCP_BOOTSTRAP_DIR). Connection attempts are retried until
//   TransportOptions::connect_timeout; each hello exchange must finish within
//   TcpOptions::handshake_timeout. The factory returns once the mesh is up.
// - Hello frames carry the session token: a connection with another token (or world size, or an
//   unexpected rank) is rejected with a kReject frame; the connecting side fails at once with
//   kFailedPrecondition quoting the reason, the accepting side logs it, keeps waiting for the right
//   peer, and names it if the setup then times out.
// - TCP_NODELAY; messages are length-prefixed frames. A send is written as a gather of its header
//   and the caller's buffer (several queued sends go out in one gather); no intermediate copy. On
//   receive, a message whose receive is already posted is read straight into that buffer; else it
//   is read into an unexpected-message queue and copied once when the receive is posted.
// - A lost connection (EOF, reset, write error) fails that peer's pending handles with
//   kUnavailable naming the peer and what was in flight; a protocol error (bad header, frame above
//   max_frame_bytes) fails them with kDataLoss and drops the connection (after a best-effort kError
//   frame to the peer). Messages already fully received stay receivable.
// - Sends complete when the whole frame is in the kernel's socket buffer.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "transfer/transport.h"

namespace pdsim::transfer {

// tcp's option block (TransportOptions::set).
struct TcpOptions {
    // Rendezvous, first that is set wins: `endpoints` ("host:port" per rank, index = rank),
    // `bootstrap_dir` (each rank binds port 0, publishes "host:port" to <dir>/rank-<r>.addr and
    // reads the others'), then the environment PDSIM_TCP_ENDPOINTS ("h:p,h:p,...") and
    // PDSIM_TCP_BOOTSTRAP_DIR.
    std::vector<std::string> endpoints;
    std::string bootstrap_dir;
    // Address to listen on. Empty: the host of this rank's endpoint, or 127.0.0.1 (loopback).
    std::string bind_address;
    // Shared secret of the session; a hello with another token is rejected (checked before any
    // other field of the hello is acted on). Empty: env PDSIM_SESSION_TOKEN; else, with a
    // bootstrap directory, <dir>/session.token (the first rank there writes a random one, mode
    // 0600); else make_tcp_transport fails with kInvalidArgument. There is no built-in token.
    std::string session_token;
    // A frame whose payload is larger is a protocol error (and larger sends are refused).
    size_t max_frame_bytes = size_t{1} << 30;
    // Per connection attempt: the hello exchange must finish within this.
    std::chrono::milliseconds handshake_timeout{5'000};
    // SO_SNDBUF / SO_RCVBUF; 0 keeps the kernel's autotuning.
    int socket_buffer_bytes = 0;
};

// What "tcp" declares (registered with it, see transfer/transport.h).
[[nodiscard]] inline TransportDescriptor tcp_transport_descriptor() {
    return {.name = "tcp",
            .caps = {.host_memory = true,
                     .two_sided = true,
                     .tag_matching = true,
                     .detects_peer_failure = true,
                     .spans_processes = true,
                     .spans_nodes = true,
                     .threads_of_one_process = true,
                     .setup = TransportSetup::kRendezvous,
                     .medium = TransportMedium::kSocket},
            .summary =
                "two-sided over TCP (Boost.Asio); ranks meet through TcpOptions endpoints "
                "or a bootstrap directory"};
}

// Reads TcpOptions from `options`.
[[nodiscard]] StatusOr<std::unique_ptr<Transport>> make_tcp_transport(
    const TransportOptions& options);

// Splits "host:port" or "[v6addr]:port".
struct HostPort {
    std::string host;
    uint16_t port = 0;
};
[[nodiscard]] StatusOr<HostPort> parse_host_port(std::string_view text);

}  // namespace pdsim::transfer

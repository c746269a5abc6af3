// Network interfaces of this host, by name (as NCCL_SOCKET_IFNAME and OpenMPI's
// btl_tcp_if_include name them): what a rank listens on when its peers are on other hosts.
#pragma once

#include <string>

#include "common/status.h"

namespace pdsim::net {

// The first IPv4 address of the interface `name` on this host (in this process's network
// namespace), as text ("10.77.0.11"). kNotFound naming the interface and listing the interfaces
// that have an IPv4 address when there is no such interface or it has none; kInvalidArgument for
// an empty name. Thread-safe; does not block.
[[nodiscard]] StatusOr<std::string> interface_ipv4(const std::string& name);

}  // namespace pdsim::net

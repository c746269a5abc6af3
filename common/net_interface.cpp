#include "common/net_interface.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <set>

namespace pdsim::net {

StatusOr<std::string> interface_ipv4(const std::string& name) {
    if (name.empty()) return Status(StatusCode::kInvalidArgument, "empty interface name");
    ifaddrs* list = nullptr;
    if (::getifaddrs(&list) != 0) {
        return PDSIM_ERROR(StatusCode::kUnavailable, "getifaddrs failed: errno {}", errno);
    }
    std::string found;
    std::set<std::string> names;
    for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
        if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
        names.insert(a->ifa_name);
        if (!found.empty() || name != a->ifa_name) continue;
        char text[INET_ADDRSTRLEN] = {};
        const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
        if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) != nullptr) found = text;
    }
    ::freeifaddrs(list);
    if (!found.empty()) return found;
    std::string have;
    for (const std::string& n : names) have += (have.empty() ? "" : ", ") + n;
    return Status(StatusCode::kNotFound,
                  fmt::format("no interface '{}' with an IPv4 address on this host (have: {})",
                              name.substr(0, 64), have));
}

}  // namespace pdsim::net

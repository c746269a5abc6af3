// Topologies the unit tests share, read from the repository's examples (topology/examples/) so
// that each exists once.
#pragma once

#include <string>
#include <utility>

#include "common/check.h"
#include "topology/loader.h"

namespace pdsim::test {

// topology/examples/<file>, loaded and validated. Aborts with the loader's message if the file is
// missing or invalid (a broken checkout, not a test result). PDSIM_SOURCE_DIR is defined for
// every test by pdsim_add_test (tests/CMakeLists.txt).
inline topo::Topology example_topology(const std::string& file) {
    StatusOr<topo::Topology> topology =
        topo::load_topology(std::string(PDSIM_SOURCE_DIR) + "/topology/examples/" + file);
    PDSIM_CHECK_OK(topology.status());
    return *std::move(topology);
}

// cpu-1p1d.yaml: two cpu devices (node0.cpu0 runs instance prefill0, node0.cpu1 runs decode0)
// behind a loopback switch, each link 10 GB/s per direction and 1 us; model tiny.
inline topo::Topology cpu_1p1d_topology() {
    return example_topology("cpu-1p1d.yaml");
}

}  // namespace pdsim::test

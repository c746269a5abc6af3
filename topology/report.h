// Text views of a (validated) topology: the `pdsim topology` summaries and the OpenMPI hostfile
// and rankfile.
//
// Hostfile: one "<hostname> slots=<ranks on it>" line per host that runs ranks, in rank order.
// Rankfile: "rank <r>=<hostname> slot=<cores>" per rank. The cores are the device's `cores`;
// else, with C cpus on the node (the node's `cpus`, else `fallback_cpus`) and n devices, the
// device with ordinal position d gets cores [d*C/n, (d+1)*C/n - 1] (core d % C when n > C);
// with no cpu count at all, core d.
//
// Thread-safety: pure functions.
#pragma once

#include <string>

#include "topology/topology.h"

namespace pdsim::topo {

// "cpu-1p1d: 1 node, 2 devices (2x cpu), 2 instances (1 prefill, 1 decode), 2 ranks, model tiny"
std::string one_line_summary(const Topology& topology);

// The readable summary `pdsim topology show` prints: model, nodes, instances, the rank table
// and, per prefill/decode instance pair, the bottleneck bandwidth and latency of the KV path
// (worst TP rank pair; pairs per tp_overlap_pairs()).
std::string summary_text(const Topology& topology);

std::string hostfile_text(const Topology& topology);
std::string rankfile_text(const Topology& topology, int fallback_cpus = 0);

// The cores the rank running on `device_id` binds to (as in the rankfile).
std::string cores_for(const Topology& topology, std::string_view device_id, int fallback_cpus = 0);

}  // namespace pdsim::topo

// libFuzzer target: parse_topology() on arbitrary bytes, as YAML and as JSON. A valid result is
// also pushed through the queries, the text reports and a to_yaml() round trip, which must give
// back an equal topology. Build and run with scripts/fuzz.sh (fuzz/README.md).
#include <string_view>

#include "fuzz/fuzz_target.h"
#include "topology/loader.h"
#include "topology/report.h"
#include "topology/shaping.h"
#include "topology/validate.h"

namespace {

void exercise(const pdsim::topo::Topology& t) {
    using namespace pdsim::topo;
    (void)one_line_summary(t);
    (void)summary_text(t);
    (void)hostfile_text(t);
    (void)rankfile_text(t, 4);
    (void)shaping_for(t, 10.0);
    const RankMap rm = t.rank_map();
    if (rm.world_size() >= 2) {
        (void)shaping_for_path(t, rm.at(0).device, rm.at(rm.world_size() - 1).device, 2.0);
    }
    auto back = parse_topology(to_yaml(t), "<roundtrip>", Format::kYaml);
    PDSIM_FUZZ_CHECK(back.ok() && *back == t, "to_yaml must round-trip every valid topology");
    for (const ModelShape& m : builtin_model_shapes()) (void)validate(t, &m);
}

}  // namespace

PDSIM_FUZZ_TARGET(topology_loader_fuzz) {
    using namespace pdsim::topo;
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    for (Format f : {Format::kYaml, Format::kJson}) {
        auto t = parse_topology(text, "<fuzz>", f);
        if (t.ok()) exercise(*t);
    }
    return 0;
}

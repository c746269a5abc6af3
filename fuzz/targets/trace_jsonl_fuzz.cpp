// libFuzzer target: the Mooncake JSONL trace reader (workload::parse_mooncake) on arbitrary bytes,
// from memory, with the default options and with caps, skip and sampling. A parse either fails with
// a Status or gives a trace that keeps every promise of sim/workload/workload.h
// (fuzz/targets/trace_check.h).
#include <sstream>
#include <string>

#include "fuzz/fuzz_target.h"
#include "fuzz/targets/trace_check.h"
#include "sim/workload/workload.h"

PDSIM_FUZZ_TARGET(trace_jsonl_fuzz) {
    using namespace pdsim;
    const std::string text(reinterpret_cast<const char*>(data), size);
    for (const workload::LoadOptions& o : fuzz::trace_option_sets(size)) {
        std::istringstream in(text);
        auto reqs = workload::parse_mooncake(in, "<fuzz>", o);
        if (reqs.ok()) fuzz::check_trace(*reqs, o);
    }
    return 0;
}

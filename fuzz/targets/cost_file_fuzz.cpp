// libFuzzer target: the cost file reader (cost::CostFile::load, what `--cost-model FILE` reads) on
// arbitrary bytes, through an in-memory file (fuzz/mem_file.h). A file it accepts must validate
// again from its own JSON, and give, for every fit it holds, a calibrated model (or a Status)
// whose costs, noise and transports evaluate without a throw or undefined behaviour.
#include <climits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backends/model/model_config.h"
#include "fuzz/fuzz_target.h"
#include "fuzz/mem_file.h"
#include "sim/cost/cost_model.h"
#include "topology/model_shape.h"

namespace {

using pdsim::cost::CostFile;
using json = nlohmann::json;

int clamp_int(const json& v) {
    const auto n = v.get<int64_t>();
    return n > INT_MAX ? INT_MAX : static_cast<int>(n);
}

void exercise(const CostFile& f) {
    using namespace pdsim;
    const json& j = f.json();
    // The model the file names: a built-in shape when there is one, with the file's
    // model_config, so that the check against it passes and the fits are reached.
    const std::string name = j.at("model").get<std::string>();
    model::ModelConfig m;
    if (const topo::ModelShape* b = topo::builtin_model_shape(name)) m = *b;
    m.name = name;
    if (j.contains("model_config")) {
        for (const topo::ModelDimension& dim : topo::kModelDimensions) {
            const std::string key(dim.key);
            if (j["model_config"].contains(key)) m.*dim.field = clamp_int(j["model_config"][key]);
        }
    }
    const bool gpu = j.value("device", std::string("cpu")) == "gpu";
    for (const json& fit : j.at("fits")) {
        cost::InstanceSpec spec;
        spec.model = m;
        spec.tp = clamp_int(fit.at("tp"));
        spec.threads = clamp_int(fit.at("threads"));
        spec.device = gpu ? "H100" : "cpu";
        auto model = cost::make_cost_model("calibrated", spec, &f);
        if (!model.ok()) continue;
        const std::vector<cost::ExtendItem> batch = {{100, 50}, {20, 0}};
        (void)(*model)->extend_s(batch);
        (void)(*model)->decode_s(8, 4000);
        for (bool decode : {false, true}) {
            (void)(*model)->interference(decode);
            (void)(*model)->noise(decode);
        }
        (void)(*model)->describe();
    }
    if (j.contains("transports")) {
        for (const auto& [key, value] : j["transports"].items()) (void)f.transport(key);
    }
}

}  // namespace

PDSIM_FUZZ_TARGET(cost_file_fuzz) {
    auto f = CostFile::load(pdsim::fuzz::mem_file(data, size));
    if (!f.ok()) return 0;
    auto again = CostFile::from_json(f->json(), "<again>");
    PDSIM_FUZZ_CHECK(again.ok(), "an accepted cost file validates from its own JSON");
    exercise(*f);
    return 0;
}

// libFuzzer target: the model file reader (model::resolve_model on a file, what `--model FILE`
// reads) on arbitrary bytes, through an in-memory file (fuzz/mem_file.h). A model it accepts
// must pass validate_model, and its derived sizes (KV bytes, parameters, the TP rule) must
// compute without overflow (UBSan).
#include "backends/model/model_config.h"
#include "fuzz/fuzz_target.h"
#include "fuzz/mem_file.h"

PDSIM_FUZZ_TARGET(model_file_fuzz) {
    using namespace pdsim;
    auto m = model::resolve_model(fuzz::mem_file(data, size));
    if (!m.ok()) return 0;
    PDSIM_FUZZ_CHECK(model::validate_model(*m).ok(), "an accepted model validates");
    (void)m->kv_bytes_per_token(2);
    (void)m->kv_bytes_per_token_layer(4);
    (void)m->num_params();
    for (int tp : {1, 2, 3, 8}) {
        if (model::check_tp(*m, tp).ok()) (void)m->kv_elems_per_token_per_layer(tp);
    }
    for (int layer = 0; layer < 4; ++layer) (void)m->layer_kind(layer);
    return 0;
}

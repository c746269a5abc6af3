#include "backends/kv/state_pool.h"

namespace pdsim::kv {

StatePool::StatePool(const StatePoolConfig& cfg)
    : KVPool(cfg.num_layers, cfg.num_slots, /*page_size=*/1, KVDtype::kF32, runtime::Device{},
             {BufferShape{cfg.num_heads, cfg.head_dim * cfg.head_dim},
              BufferShape{cfg.num_heads, (cfg.conv_kernel - 1) * 3 * cfg.head_dim}}),
      cfg_(cfg) {}

StatusOr<std::unique_ptr<StatePool>> StatePool::create(const StatePoolConfig& cfg) {
    const std::pair<const char*, int> minimums[] = {
        {"num_layers", 1}, {"num_slots", 2}, {"num_heads", 1}, {"head_dim", 1}, {"conv_kernel", 2}};
    const int values[] = {cfg.num_layers, cfg.num_slots, cfg.num_heads, cfg.head_dim,
                          cfg.conv_kernel};
    for (size_t i = 0; i < std::size(values); ++i) {
        if (values[i] < minimums[i].second) {
            return PDSIM_ERROR(StatusCode::kInvalidArgument, "state pool: {} {} must be >= {}",
                               minimums[i].first, values[i], minimums[i].second);
        }
    }
    // head_dim^2 and the conv buffer per head must fit an int (KVPool's element counts).
    if (int64_t{cfg.head_dim} * cfg.head_dim * cfg.num_heads > (int64_t{1} << 30)) {
        return PDSIM_ERROR(StatusCode::kInvalidArgument,
                           "state pool: {} heads of head_dim {} is too large a state per slot",
                           cfg.num_heads, cfg.head_dim);
    }
    std::unique_ptr<StatePool> pool(new StatePool(cfg));
    PDSIM_RETURN_IF_ERROR(pool->allocate_buffers());
    return pool;
}

}  // namespace pdsim::kv

// checked as: sim/des/parts_probe.cpp
// A planted violation for the layering self-test: the simulator (sim/des/, library pdsim_des)
// must not include the testbed, the CLI, the transfer engine, CLI11 or Boost; it may include the
// cost models, workloads and backends. Lines marked "expect-violation" must be flagged.
#include <CLI/CLI.hpp>             // expect-violation
#include <boost/asio.hpp>          // expect-violation

#include "backends/model/model_config.h"
#include "sim/cli/command.h"       // expect-violation
#include "sim/cost/cost_model.h"
#include "sim/testbed/server.h"    // expect-violation
#include "transfer/transport.h"    // expect-violation

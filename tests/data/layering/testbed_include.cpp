// checked as: sim/testbed/cli_probe.cpp
// A planted violation for the layering self-test: the testbed may use the transfer engine and the
// simulator's parts but not the CLI above it. Lines marked "expect-violation" must be flagged.
#include <mpi.h>

#include "sim/cli/command.h"  // expect-violation
#include "sim/des/kv_cache.h"
#include "transfer/engine/kv_sender.h"

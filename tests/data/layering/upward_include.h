// checked as: common/upward_probe.h
// A planted violation for the layering self-test (scripts/check_layering.py --self-test): as if it
// were in common/, it includes the simulator, three layers up, and MPI, which common/ links only in
// mpi_check. Lines marked "expect-violation" must be flagged; no other line may be.
#pragma once

#include <mpi.h>  // expect-violation

#include "common/status.h"
#include "sim/des/simulator.h"  // expect-violation

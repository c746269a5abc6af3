// The --transport-fault grammar (transfer/fault/fault_transport.h), strictly: every spec the
// tests and docs use parses as before; unknown kinds and keys, missing required keys, empty parts,
// repeated keys or kinds, and numbers that are not finite, whole where they must be, or within
// their bounds are kInvalidArgument naming the bad part.
#include <gtest/gtest.h>

#include <string>

#include "tests/status_matchers.h"
#include "transfer/fault/fault_transport.h"

namespace pdsim::transfer {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(FaultSpecStrict, ValidSpecsOfTestsAndDocsStillParse) {
    for (const char* spec : {"delay:ms=1",
                             "delay:ms=2",
                             "delay:ms=300",
                             "delay:ms=5000",
                             "delay:ms=5,jitter_ms=2",
                             "delay:ms=5,jitter_ms=2; drop:p=0.25,seed=9",
                             "delay:ms=2;drop:p=0.05,seed=7",
                             "drop:p=0",
                             "drop:p=1",
                             "drop:p=0.3,seed=12",
                             "corrupt:p=1,bytes=4",
                             "corrupt:p=1,bytes=3,seed=5",
                             "reorder",
                             "reorder:p=1,hold_ms=2000",
                             "reorder:p=1,hold_ms=300",
                             "disconnect:after=1",
                             "disconnect:after=3",
                             "disconnect:after=20",
                             "",
                             "  "}) {
        EXPECT_OK(parse_fault_spec(spec)) << spec;
    }
    // What the parsed fields hold is fault_transport_test's FaultSpec.Parses.
}

TEST(FaultSpecStrict, BadSpecsNameTheBadPart) {
    struct Bad {
        const char* spec;
        const char* mention;
    };
    for (const Bad& b : {
             Bad{"explode:p=1", "unknown fault 'explode'"},
             Bad{"drop:q=1", "unknown key 'q'"},
             Bad{"delay", "delay needs ms=VALUE"},
             Bad{"delay:jitter_ms=2", "delay needs ms=VALUE"},
             Bad{"drop", "drop needs p=VALUE"},
             Bad{"corrupt:bytes=2", "corrupt needs p=VALUE"},
             Bad{"disconnect", "disconnect needs after=VALUE"},
             Bad{";;;", "fault 1 is empty"},
             Bad{"delay:ms=2;", "fault 2 is empty"},
             Bad{"delay:ms=2;;drop:p=0", "fault 2 is empty"},
             Bad{"drop:p=0.1,", "expected key=value"},
             Bad{"drop:", "expected key=value"},
             Bad{"delay:ms", "expected key=value"},
             Bad{"drop:p=abc", "p='abc'"},
             Bad{"drop:p=", "p=''"},
             Bad{"drop:p=2", "p='2' is not a number in [0, 1]"},
             Bad{"drop:p=nan", "p='nan'"},
             Bad{"delay:ms=inf", "ms='inf'"},
             Bad{"delay:ms=-1", "ms='-1'"},
             Bad{"delay:ms=1e9", "ms='1e9'"},
             Bad{"disconnect:after=2.5", "after='2.5' is not an integer"},
             Bad{"corrupt:p=1,bytes=0.5", "bytes='0.5' is not an integer"},
             Bad{"corrupt:p=1,bytes=1e30", "bytes='1e30'"},
             Bad{"drop:p=0.1,seed=1.5", "seed='1.5'"},
             Bad{"drop:p=0.1,p=0.2", "key 'p' given twice"},
             Bad{"drop:p=0.1;drop:p=0.2", "drop given twice"},
         }) {
        EXPECT_THAT(parse_fault_spec(b.spec),
                    StatusIs(StatusCode::kInvalidArgument, HasSubstr(b.mention)))
            << b.spec;
    }
}

TEST(FaultSpecStrict, MessagesQuoteABoundedExcerpt) {
    const std::string kind(300, 'k');
    const StatusOr<FaultSpec> s = parse_fault_spec(kind + ":p=1");
    EXPECT_THAT(s, StatusIs(StatusCode::kInvalidArgument, HasSubstr("...")));
    EXPECT_THAT(s.status().message(), Not(HasSubstr(std::string(81, 'k'))));
}

}  // namespace
}  // namespace pdsim::transfer

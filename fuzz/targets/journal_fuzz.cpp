// libFuzzer target: the testbed result journal's reader (sim/testbed/journal_format.h: what the
// report keeper and `pdsim recover-report` read) on arbitrary bytes. A journal it accepts has
// every request id inside [0, requests_submitted) and every time finite, and prints (to_text) to a
// journal that parses again and prints the same (to_text is a fixed point of parse).
#include <string>
#include <string_view>

#include "fuzz/fuzz_target.h"
#include "sim/testbed/journal_format.h"

PDSIM_FUZZ_TARGET(journal_fuzz) {
    namespace journal = pdsim::testbed::journal;
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    auto contents = journal::parse(text, "fuzz.jsonl");
    if (!contents.ok()) return 0;
    for (const journal::Record& r : contents->records) {
        PDSIM_FUZZ_CHECK(r.record.id >= 0 && r.record.id < contents->head.submitted,
                         "request ids inside [0, requests_submitted)");
    }
    const std::string once = journal::to_text(*contents);
    auto again = journal::parse(once, "again.jsonl");
    PDSIM_FUZZ_CHECK(again.ok(), "a printed journal parses");
    PDSIM_FUZZ_CHECK(journal::to_text(*again) == once, "to_text(parse(x)) is a fixed point");
    return 0;
}

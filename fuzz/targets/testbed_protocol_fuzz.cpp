// libFuzzer target: the testbed protocol's decoder (sim/testbed/protocol.h) on arbitrary bytes,
// the way the Mailbox (sim/testbed/comm.cpp) reads a message: decode_cbor, then
// decode_message of every message kind. A message a decoder accepts must re-encode to a body
// that decodes again and re-encodes to the same CBOR bytes.
#include <nlohmann/json.hpp>
#include <vector>

#include "fuzz/fuzz_target.h"
#include "sim/testbed/protocol.h"

namespace {

using nlohmann::json;

template <class Msg>
void round_trip(const json& body) {
    using namespace pdsim::testbed;
    auto m = decode_message<Msg>(body);
    if (!m.ok()) return;
    const json once = encode_message(*m);
    auto again = decode_message<Msg>(once);
    PDSIM_FUZZ_CHECK(again.ok(), "an encoded message decodes");
    PDSIM_FUZZ_CHECK(json::to_cbor(encode_message(*again)) == json::to_cbor(once),
                     "encode(decode(x)) is canonical");
}

}  // namespace

PDSIM_FUZZ_TARGET(testbed_protocol_fuzz) {
    using namespace pdsim::testbed;
    auto parsed = decode_cbor(std::span<const uint8_t>(data, size));
    if (!parsed.ok()) return 0;
    const json& body = *parsed;
    round_trip<SubmitMsg>(body);
    round_trip<CancelMsg>(body);
    round_trip<EndMsg>(body);
    round_trip<Plan>(body);
    round_trip<AdmitMsg>(body);
    round_trip<ReleaseMsg>(body);
    round_trip<SentReport>(body);
    round_trip<ReadyReport>(body);
    round_trip<FirstTokenReport>(body);
    round_trip<PrefillDoneReport>(body);
    round_trip<RequestDoneReport>(body);
    round_trip<TcpBootstrapMsg>(body);
    round_trip<ShapeMsg>(body);
    round_trip<ExitMsg>(body);
    round_trip<RankResult>(body);
    return 0;
}

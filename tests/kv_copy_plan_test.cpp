// The device KV memory ops' planning (transfer/engine/kv_copy_plan.h) and their host
// implementation (transfer/engine/kv_memory_ops.h), against the independent host oracle:
// gather_run, scatter_run and kv_checksums_add_run (transfer/engine/transfer_plan.h,
// ordering_validator.h). Also pins kv_hash (transfer/engine/kv_hash.h), which the host and the
// device must compute bit for bit alike.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <vector>

#include "tests/status_matchers.h"
#include "transfer/engine/ordering_validator.h"

namespace pdsim::transfer {
namespace {

// ---------------------------------------------------------------------------------------------
// kv_hash, pinned

uint64_t splitmix64(uint64_t& state) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

struct PinnedHash {
    size_t bytes;
    std::array<uint64_t, 4> hash;  // per case of kHashCases
};

// (start offset into the data, seed): unaligned starts, seeds from 0 to 2^64 - 1.
constexpr std::array<std::pair<size_t, uint64_t>, 4> kHashCases = {
    {{0, 0}, {1, 1}, {3, 4095}, {7, ~0ull}}};

// kv_hash(data + offset, bytes, seed) as ordering_validator.cpp computed it at commit ee1c159
// (before kv_hash moved into kv_hash.h for the device), for the data of hash_input_data().
// Regenerating this table from the current code would defeat it: it exists to fail when the
// function changes.
constexpr PinnedHash kPinnedHashes[] = {
    {0,
     {0xef46db3751d8e999ull, 0xd5afba1336a3be4bull, 0xc0731ace00cd0f0cull, 0x298f4c84b24f5380ull}},
    {1,
     {0x669e741f161d1d56ull, 0x60cdc2eaf35e4c0bull, 0xb79b1f0e160dd6f9ull, 0xeb99210e3e7b678dull}},
    {2,
     {0x22f2caaf6854589full, 0x4a2e491a236d782bull, 0xce3b663ccb78d2bbull, 0x0c467850fce4fa45ull}},
    {3,
     {0x9c4ce4a2cb8a5047ull, 0xc7772dc5379cd9a3ull, 0x26fb043e990fea30ull, 0xae97ecde8a86a9d0ull}},
    {4,
     {0x93a6773d4b0e7a51ull, 0xd9edd6df96775eb9ull, 0x3c06081d202a5173ull, 0x8b2cc6b19cb7528dull}},
    {5,
     {0x3d388b43d5635c54ull, 0xd78a93672ca53b9bull, 0x14d4c454d00875eeull, 0x3a691a7516a081f9ull}},
    {6,
     {0xfc86e36b6cbf4436ull, 0xac55fecb121ac1e7ull, 0x76fa4b18c0cbb865ull, 0xd92e80ae793b37f9ull}},
    {7,
     {0xba28fb36e9bc4812ull, 0xf10956905fb71db2ull, 0x335c83cdb3f85ba3ull, 0xec9a4a1fcddf47eeull}},
    {8,
     {0x40502c6fd41aaf1dull, 0xeb3458d935b6979aull, 0xe6fa09411a37fdc4ull, 0x59a5a4da0bfcae34ull}},
    {9,
     {0x781e860edb17b0afull, 0x6c6183e7fc84b9d0ull, 0x3370f3b5f35a50aeull, 0xffd6a16a1cc49178ull}},
    {10,
     {0xe72401fc59376bafull, 0xcd55d634a2f12418ull, 0x8ab33e29fa4692cbull, 0xcf58c2cc6bf3b28aull}},
    {11,
     {0x2e89a8813bd4632eull, 0xc9ee2e09fd9bf5dcull, 0xb06531c0bd32b2f6ull, 0xbc9ca23097eb0294ull}},
    {12,
     {0x2cf22e7c3de8d00aull, 0xf763410dcfd2addaull, 0x92e5d9d767a64e6bull, 0x6d8d705b402a54a6ull}},
    {13,
     {0xeece352f2c2dff51ull, 0x96ba2da92fbf1ba5ull, 0xf38356773ddc7bfdull, 0xb0c6c6fed77af855ull}},
    {14,
     {0xfbff6fe8cee9ff3full, 0x269305db8b94eea0ull, 0x7d6af529425f39ecull, 0xf5653d53f5b6f538ull}},
    {15,
     {0x828b2e915144ebe2ull, 0xed31e5883e51d8bdull, 0xc2945bb6d6e74fc6ull, 0xf567dfd7a55d2597ull}},
    {16,
     {0x49198e787d465bbeull, 0x41d3a58a4f597920ull, 0xe4345ac5de50d963ull, 0x4fdc5646aa0c69cdull}},
    {17,
     {0xfb2922d72790d3d6ull, 0xc7eb6b9a05cc1175ull, 0xa87793274ca22a7aull, 0x10e5790a03c8d5bfull}},
    {18,
     {0xb5f56d85feb37bb8ull, 0x61c0f28c913d0a0aull, 0x7fff9cabadfa98abull, 0x7887d69bf05118d9ull}},
    {19,
     {0xb124381a5115a840ull, 0x55716ee844d27dbdull, 0xda681d8f62a8baacull, 0xce4a9ca6d30863f9ull}},
    {20,
     {0x91a1337470437d43ull, 0xd1a58e28aca02e01ull, 0x9ac05b5c474435d3ull, 0xcd08478870f890beull}},
    {21,
     {0xdf0024e345b73798ull, 0xfea2438cc96f6f0eull, 0xce6e5a7ecc6d60d7ull, 0x0651e12e6c36f990ull}},
    {22,
     {0x9975e4bfd26eb03eull, 0xde3cdfae1074df25ull, 0x1630023b2cab4a5full, 0x9436ffd05f68a32cull}},
    {23,
     {0x4c3c07eba7d932d6ull, 0x671051e9dfbdfdb1ull, 0x448c7f0521a99831ull, 0x4a9586375e511241ull}},
    {24,
     {0x5f76d5dad2d1fffbull, 0xd45e23e4dbb2525bull, 0x1c810c22191c3c9dull, 0xafc20beb87c5b9e7ull}},
    {25,
     {0x322811e5f5b0acc9ull, 0x38ca8741a2959fb0ull, 0x31410fb9f8ad25f6ull, 0xc5dcc38040f1e64aull}},
    {26,
     {0x934fe4aa28c35e86ull, 0xc2075b4efd7cd2fdull, 0x20593d7b2a346e05ull, 0x5033d4edce46a415ull}},
    {27,
     {0x8305c5083ed3e833ull, 0xbdd83c5ac6e76858ull, 0xb4866b6845dac5dfull, 0xe00b0d98ecfe1907ull}},
    {28,
     {0x76a69caabb6d0b84ull, 0xa7d31ec0db55c893ull, 0xfb4a20ba86efbb4aull, 0x474b04a9db94ddceull}},
    {29,
     {0xb54c727b081f4d39ull, 0x3cd6eabbc2ba33c5ull, 0xef938074b0ea8559ull, 0xf9370507b93cdb9eull}},
    {30,
     {0xed0c31b54493f0abull, 0x6aa76329ee420cadull, 0x4e94986d5ec66113ull, 0x51fb4d34c839ea15ull}},
    {31,
     {0x421ab1f2bef5b843ull, 0xca9e309af51b2d88ull, 0xc26fa8f7efa75224ull, 0xb7757e0a5536b6fbull}},
    {32,
     {0x17f3148a152c291cull, 0x7717b3f50f881bb3ull, 0xd394f8d7a6e885f0ull, 0xa45bab19bb8664b1ull}},
    {33,
     {0x1ca68d99db9b021eull, 0x15a13934050fe321ull, 0xea9a613c43915214ull, 0x030a76a304210399ull}},
    {34,
     {0x38a2b54db8248ca5ull, 0x47413d9c35e56a23ull, 0x72531af2f8d6ee00ull, 0x4a2d5bf3e5ee8fe4ull}},
    {35,
     {0x3c992c86d8d6a48dull, 0x4220e0febf7f9c8bull, 0x3f24b34792cd0fd1ull, 0xe9ce551c7d0a2f91ull}},
    {36,
     {0x7880681f4e9210bbull, 0xa13022dd51473cb8ull, 0xaaaa0a047649d285ull, 0xa29847638710b517ull}},
    {37,
     {0x4bc876638906e4d7ull, 0x2b9a44746a5e75ffull, 0x6256f8cf6c343c51ull, 0x06aca7572245ea4bull}},
    {38,
     {0x5630bacf2db0a17full, 0xf48cc6045c1de514ull, 0x7c7f668cac86273dull, 0x2b6b07ed7d789907ull}},
    {39,
     {0x2b4cd0fed63fd7b0ull, 0x55085dbe19491b56ull, 0x525b27e92b8a96ecull, 0xce8a6702477d7f89ull}},
    {40,
     {0xee2f9a7c9c814bb0ull, 0x3f28d84439a31332ull, 0xe809f2d90a4e094full, 0x19ea2cb8032f5fe3ull}},
    {41,
     {0x22e2be3f1224bb0aull, 0xe5e19d64596e798bull, 0xe8cafb7396e462d0ull, 0xee370ef13a1f74d6ull}},
    {42,
     {0xaee1549620a4634aull, 0xa255d603157fff1eull, 0x676af43a398ae686ull, 0xb236cdfbe6d52cd8ull}},
    {43,
     {0x57e9063c0fbea1c6ull, 0x1c07f7e049447383ull, 0xb4b723e55d9e1ef3ull, 0xeceb5bbbdf57d2c6ull}},
    {44,
     {0x2b8fa16d2bf653c7ull, 0x159a8b0bc46c513bull, 0x42fc9877bca9a8c9ull, 0x343a0064467cc176ull}},
    {45,
     {0xb543cadd047605ecull, 0xc84642f966305806ull, 0x55b0602a5ac7e3cfull, 0x40f79dc82ea64d89ull}},
    {46,
     {0x874a8668b701ca78ull, 0xdbcec165b21a1fedull, 0x290c41be13c9eb9cull, 0x78f9974e435eee28ull}},
    {47,
     {0x413ac52cfcb84325ull, 0x2b1de671fd1d5818ull, 0xa7ef7a4a58b77206ull, 0xb183cca6e1b86bbeull}},
    {48,
     {0x4ae4bbc2bf0bdceeull, 0xd652ca5cbeefcadcull, 0x8fe49facc2de7ab7ull, 0x81d578b94178035full}},
    {49,
     {0x563ff20e1df99242ull, 0x1a3b81acf373e367ull, 0x6876052fc3f17c84ull, 0x61f1dbe98cd0faefull}},
    {50,
     {0x647cf8de6baaf0c6ull, 0xb180d691ce9d5e1bull, 0xf37e4effc9e5b420ull, 0xd63ca544c0877eabull}},
    {51,
     {0x38815b227a87e5adull, 0x6833de9a11cecd78ull, 0x5289c37075d7c0e7ull, 0xae06bec753f4a7efull}},
    {52,
     {0xa0ae2a3ed3c02466ull, 0x38fcd5da506ddcf0ull, 0xfbe5f7fb011d5fd7ull, 0x0b71b4e6bf2a118aull}},
    {53,
     {0x3b21be15af3cbb99ull, 0x065ff03daaafd709ull, 0x42e54b3b105e5e34ull, 0x0e641acb383a3de6ull}},
    {54,
     {0xda2e76ec6e4fafc7ull, 0x01e55c2818fe126full, 0x6c0799fdc270e39bull, 0x7f71c8da454d3057ull}},
    {55,
     {0x55dc887647f149a6ull, 0xd7d1cc79948a81ddull, 0xebf700b98c19faebull, 0xb051f518948cfc13ull}},
    {56,
     {0x048eb2081c1aff04ull, 0x839eaa8c5a335568ull, 0x424a4521479bbd45ull, 0xd8fa6f80b7d7c006ull}},
    {57,
     {0xa497b6f9f2d13443ull, 0xf198a7db22d78b95ull, 0x1f9ddb203a072140ull, 0x8bc8f4821fd2353eull}},
    {58,
     {0x28f6bed4d51ffb21ull, 0xba00c98265a780c6ull, 0x549b76946310a107ull, 0x04b99ca06227a3d7ull}},
    {59,
     {0x9e360484a362d784ull, 0xf4ab6f418c17acd9ull, 0x6dcc5595bec87f1cull, 0x68c8e909959e9224ull}},
    {60,
     {0xf85c0bc69c6512d5ull, 0x921e26e2ff6bb44aull, 0x5170c6f7464bd6fdull, 0x8d154deeb0424e7eull}},
    {61,
     {0xcc127b6901e4220dull, 0xc7ac072070f0dc3cull, 0x50286d3c3afd88b4ull, 0xc69a8ba6dd7ff8f0ull}},
    {62,
     {0xa17eb4334b5d7567ull, 0xc9ab1c2e00fb36f4ull, 0xa9ab5daa137558ceull, 0xbfa382f56b6b4585ull}},
    {63,
     {0xb5d645e02e4b21cbull, 0xcab5f7f51568e118ull, 0x4080e4a4ba48f4c6ull, 0xaedaa6a4d6e2b779ull}},
    {64,
     {0x65e0e2970c3cee84ull, 0xd8284da61cef9a1cull, 0x063fccdcbe9631d6ull, 0x888f6b4939c6e3c4ull}},
    {65,
     {0x639829933988ee93ull, 0xf56211ad148e7509ull, 0x890c0b8ad597aaf3ull, 0x2a156f890d4b24c0ull}},
    {66,
     {0xf34a9d5ef9613e83ull, 0x338479ab99926bf4ull, 0x0abe5bbe9b38eca1ull, 0x2d1f2415da134fc2ull}},
    {67,
     {0x42ea4d33cfedc452ull, 0xa2da4c5cf97931acull, 0x00d632dc70423b3full, 0x9ad13f49f0ff8e14ull}},
    {68,
     {0x63188e0af63e61d3ull, 0xaca5b55ae9958022ull, 0xc1b8c28096c38a88ull, 0x3f68bc504c39dfb6ull}},
    {69,
     {0x7470b9c32095a845ull, 0x5fba2d2c87416a9bull, 0xd5d256cf333c2981ull, 0x8a96ff426c02a787ull}},
    {70,
     {0x30ec328a2f33975dull, 0xd9f1be6b11d81526ull, 0xcb26fc3cb0fa64ddull, 0xb65b8fb52b4a939eull}},
    {127,
     {0x3a69c5fb5699cdb5ull, 0x673dd4bf07fb21fdull, 0x9d06b686fd03d080ull, 0xbf62bdd2cccaa3f6ull}},
    {128,
     {0xcf864c59fdddfe04ull, 0xe9f9791c7500fa79ull, 0x7f2f5d2749c023e1ull, 0xc81c9e880cb25ff9ull}},
    {129,
     {0x1d5145a300dad72dull, 0xa24ce138f479c0c2ull, 0x276e95be466c58e7ull, 0x1cd42c9f2b010352ull}},
    {4096,
     {0xb3d91827e291bbdbull, 0xae109c146266a21aull, 0x35aba3ad8b06e87cull, 0x6771b3f1ad89fb75ull}},
};

std::vector<unsigned char> hash_input_data() {
    std::vector<unsigned char> data(4096 + 16);
    uint64_t state = 0x5EEDull;
    for (unsigned char& b : data) b = static_cast<unsigned char>(splitmix64(state) >> 56);
    return data;
}

TEST(KvHashTest, MatchesPinnedValues) {
    const std::vector<unsigned char> data = hash_input_data();
    size_t checked = 0;
    for (const PinnedHash& pinned : kPinnedHashes) {
        for (size_t c = 0; c < kHashCases.size(); ++c) {
            const auto [offset, seed] = kHashCases[c];
            EXPECT_EQ(kv_hash(data.data() + offset, pinned.bytes, seed), pinned.hash[c])
                << "bytes " << pinned.bytes << " offset " << offset << " seed " << seed;
            ++checked;
        }
    }
    EXPECT_EQ(checked, 75u * kHashCases.size());  // lengths 0..70, 127, 128, 129, 4096
}

TEST(KvHashTest, EveryInputByteAndTheSeedMatter) {
    // The pinned table proves identity; this shows the table could not be satisfied by a hash
    // that ignores a byte or the seed.
    std::vector<unsigned char> data = hash_input_data();
    for (size_t bytes : {1u, 7u, 8u, 31u, 32u, 33u, 129u}) {
        const uint64_t base = kv_hash(data.data(), bytes, 5);
        EXPECT_NE(kv_hash(data.data(), bytes, 6), base) << bytes;
        for (size_t i = 0; i < bytes; ++i) {
            data[i] ^= 0x01;
            EXPECT_NE(kv_hash(data.data(), bytes, 5), base) << "bytes " << bytes << " flip " << i;
            data[i] ^= 0x01;
        }
    }
}

}  // namespace
}  // namespace pdsim::transfer

// The device KV memory ops' planning (transfer/engine/kv_copy_plan.h) and their host
// implementation (transfer/engine/kv_memory_ops.h), against the independent host oracle:
// gather_run, scatter_run and kv_checksums_add_run (transfer/engine/transfer_plan.h,
// ordering_validator.h). Also pins kv_hash (transfer/engine/kv_hash.h), which the host and the
// device must compute bit for bit alike.
#include "transfer/engine/kv_copy_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "backends/kv/kv_pool.h"
#include "backends/runtime/cpu_stream.h"
#include "tests/kv_memory_ops_test_util.h"
#include "tests/status_matchers.h"
#include "transfer/engine/kv_hash.h"
#include "transfer/engine/kv_memory_ops.h"
#include "transfer/engine/ordering_validator.h"

namespace pdsim::transfer {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::KvOpsCase;
using testing::RankPool;

constexpr auto kWait = std::chrono::seconds(30);

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
            EXPECT_EQ(kv_hash_inline(data.data() + offset, pinned.bytes, seed), pinned.hash[c]);
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

// ---------------------------------------------------------------------------------------------
// The plans and the host ops on the layout matrix, against the oracle

constexpr auto kStagingPoison = std::byte{0xA5};
constexpr int kPoolPoison = 0x5A;

std::vector<RankPool> make_side(const KvOpsCase& c, bool source) {
    std::vector<RankPool> side;
    for (int r = 0; r < (source ? c.src_tp : c.dst_tp); ++r) {
        auto pool = testing::make_rank_pool(c, source, r);
        EXPECT_OK(pool);
        if (!pool.ok()) return {};
        side.push_back(std::move(*pool));
    }
    return side;
}

// Random sums, so that a test can see the ops add to what is there.
std::vector<uint64_t> random_sums(size_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint64_t> v(n);
    for (uint64_t& x : v) x = rng();
    return v;
}

class KvOpsMatrix : public ::testing::TestWithParam<KvOpsCase> {
protected:
    struct Chunk {
        int64_t t0;
        int64_t t1;
    };
    struct LayerRange {
        int begin;
        int end;
    };
    void SetUp() override {
        c_ = GetParam();
        src_ = make_side(c_, true);
        dst_ = make_side(c_, false);
        ASSERT_EQ(static_cast<int>(src_.size()), c_.src_tp);
        ASSERT_EQ(static_cast<int>(dst_.size()), c_.dst_tp);
        for (size_t r = 0; r < src_.size(); ++r) testing::fill_random(src_[r].layout, 100 + r);
        src_pages_ = testing::make_page_table(src_[0].layout.num_pages(), c_.src_page_size,
                                              c_.num_tokens, c_.shuffled_pages, 7);
        dst_pages_ = testing::make_page_table(dst_[0].layout.num_pages(), c_.dst_page_size,
                                              c_.num_tokens, c_.shuffled_pages, 8);
        pairs_ = testing::fragment_pairs(c_, src_, dst_);
        ASSERT_FALSE(pairs_.empty());
    }
    // Two chunks (the cut is on no page boundary) and two layer ranges.
    std::vector<Chunk> chunks() const { return {{0, 40}, {40, c_.num_tokens}}; }
    std::vector<LayerRange> layer_ranges() const {
        return {{0, c_.num_layers}, {1, c_.num_layers}};
    }
    std::vector<TokenRun> runs(const testing::KvOpsPair& p, Chunk ch) const {
        return testing::chunk_runs(c_, p.frag, src_[0].layout.buffer_count(), src_pages_,
                                   dst_pages_, ch.t0, ch.t1);
    }

    KvOpsCase c_;
    std::vector<RankPool> src_;
    std::vector<RankPool> dst_;
    std::vector<int32_t> src_pages_;
    std::vector<int32_t> dst_pages_;
    std::vector<testing::KvOpsPair> pairs_;
    runtime::CpuStream stream_{"kv-ops-test"};
    HostKvMemoryOps ops_;
};

TEST_P(KvOpsMatrix, StagingPlansFollowTheEngineMessageOrder) {
    for (const auto& p : pairs_) {
        const KvLayout& src = src_[static_cast<size_t>(p.src_rank)].layout;
        const KvLayout& dst = dst_[static_cast<size_t>(p.dst_rank)].layout;
        for (Chunk ch : chunks()) {
            const std::vector<TokenRun> rs = runs(p, ch);
            for (LayerRange lr : layer_ranges()) {
                ASSERT_OK_AND_ASSIGN(KvStagingPlan g,
                                     plan_gather(src, p.frag, rs, lr.begin, lr.end));
                ASSERT_OK_AND_ASSIGN(KvStagingPlan s,
                                     plan_scatter(dst, p.frag, rs, lr.begin, lr.end));
                EXPECT_EQ(g.messages, s.messages) << "gather and scatter staging layouts";
                ASSERT_EQ(g.messages.size(), static_cast<size_t>(lr.end - lr.begin) *
                                                 static_cast<size_t>(src.buffer_count()) *
                                                 rs.size());
                ASSERT_EQ(g.ops.size(), g.messages.size());
                uint64_t end = 0;
                size_t i = 0;
                for (int l = lr.begin; l < lr.end; ++l) {
                    for (int b = 0; b < src.buffer_count(); ++b) {
                        for (size_t r = 0; r < rs.size(); ++r, ++i) {
                            const KvStagedMessage& m = g.messages[i];
                            EXPECT_EQ(&g.message(l, b, static_cast<int>(r)), &m);
                            EXPECT_EQ(m.layer, l);
                            EXPECT_EQ(m.buf, b);
                            EXPECT_EQ(m.run, static_cast<int>(r));
                            EXPECT_EQ(m.bytes, message_bytes(p.frag, b, rs[r]));
                            EXPECT_EQ(m.staging_offset % kStagingAlignment, 0u);
                            EXPECT_GE(m.staging_offset, end);
                            EXPECT_LT(m.staging_offset, end + kStagingAlignment);
                            end = m.staging_offset + m.bytes;
                            EXPECT_EQ(g.ops[i].src_slot, rs[r].src_slot);
                            EXPECT_EQ(s.ops[i].dst_slot, rs[r].dst_slot);
                        }
                    }
                }
                EXPECT_EQ(g.staging_bytes, end);
                EXPECT_EQ(staging_extent(g.ops), end);
                EXPECT_EQ(staging_extent(s.ops), end);
            }
        }
    }
}

TEST_P(KvOpsMatrix, HostGatherAndScatterMatchGatherRunAndScatterRun) {
    for (const auto& p : pairs_) {
        const KvLayout& src = src_[static_cast<size_t>(p.src_rank)].layout;
        for (Chunk ch : chunks()) {
            const std::vector<TokenRun> rs = runs(p, ch);
            for (LayerRange lr : layer_ranges()) {
                SCOPED_TRACE(::testing::Message()
                             << "prefill rank " << p.src_rank << " -> decode rank " << p.dst_rank
                             << ", tokens [" << ch.t0 << ", " << ch.t1 << "), layers [" << lr.begin
                             << ", " << lr.end << ")");
                ASSERT_OK_AND_ASSIGN(KvStagingPlan g,
                                     plan_gather(src, p.frag, rs, lr.begin, lr.end));
                // Gather: the ops vs gather_run per message, both into poisoned staging.
                std::vector<std::byte> staged(g.staging_bytes, kStagingPoison);
                std::vector<std::byte> oracle(g.staging_bytes, kStagingPoison);
                ASSERT_OK(ops_.enqueue_gather(stream_, src, g.ops, staged.data()));
                for (const KvStagedMessage& m : g.messages) {
                    gather_run(src, p.frag, m.layer, m.buf, rs[static_cast<size_t>(m.run)],
                               oracle.data() + m.staging_offset);
                }
                ASSERT_OK(stream_.synchronize(kWait));
                ASSERT_EQ(testing::first_difference(staged, oracle), std::nullopt);

                // Scatter: the ops from their staging vs scatter_run from the oracle's, into two
                // decode pools poisoned alike; then the whole pools must be equal.
                auto landed = testing::make_rank_pool(c_, false, p.dst_rank);
                auto expected = testing::make_rank_pool(c_, false, p.dst_rank);
                ASSERT_OK(landed);
                ASSERT_OK(expected);
                ASSERT_OK(landed->pool->fill(kPoolPoison));
                ASSERT_OK(expected->pool->fill(kPoolPoison));
                ASSERT_OK_AND_ASSIGN(KvStagingPlan s,
                                     plan_scatter(landed->layout, p.frag, rs, lr.begin, lr.end));
                ASSERT_OK(ops_.enqueue_scatter(stream_, landed->layout, s.ops, staged.data()));
                for (const KvStagedMessage& m : s.messages) {
                    scatter_run(expected->layout, p.frag, m.layer, m.buf,
                                rs[static_cast<size_t>(m.run)], oracle.data() + m.staging_offset);
                }
                ASSERT_OK(stream_.synchronize(kWait));
                EXPECT_EQ(testing::first_difference(testing::host_bytes(landed->layout),
                                                    testing::host_bytes(expected->layout)),
                          std::nullopt);
                // And something landed: the poison is gone from the first token's fragment.
                const TokenRun& r0 = rs.front();
                const std::byte* first =
                    landed->layout.slot_addr(lr.begin, 0, r0.dst_slot) + p.frag.dst_offset[0];
                EXPECT_EQ(std::memcmp(
                              first, src.slot_addr(lr.begin, 0, r0.src_slot) + p.frag.src_offset[0],
                              p.frag.bytes[0]),
                          0);
            }
        }
    }
}

TEST_P(KvOpsMatrix, HostFragmentChecksumsMatchKvChecksumsAddRun) {
    for (const auto& p : pairs_) {
        const KvLayout& src = src_[static_cast<size_t>(p.src_rank)].layout;
        const int B = src.buffer_count();
        for (Chunk ch : chunks()) {
            const std::vector<TokenRun> rs = runs(p, ch);
            for (LayerRange lr : layer_ranges()) {
                ASSERT_OK_AND_ASSIGN(
                    KvChecksumPlan plan,
                    plan_fragment_checksums(src, KvSide::kSource, p.frag, rs, lr.begin, lr.end));
                ASSERT_EQ(plan.sum_count, static_cast<size_t>(c_.num_layers) *
                                              static_cast<size_t>(B) *
                                              static_cast<size_t>(p.frag.head_count));
                EXPECT_LE(sums_extent(plan.ops), plan.sum_count);
                // The engine's observed array, [layer][buf][head], starting from random sums.
                std::vector<uint64_t> sums = random_sums(plan.sum_count, 3);
                std::vector<uint64_t> oracle = sums;
                ASSERT_OK(ops_.enqueue_checksums(stream_, src, plan.ops, sums.data()));
                for (int l = lr.begin; l < lr.end; ++l) {
                    for (int b = 0; b < B; ++b) {
                        for (const TokenRun& run : rs) {
                            kv_checksums_add_run(
                                src, l, b, run.token_begin, run.count, run.src_slot,
                                p.frag.src_offset[static_cast<size_t>(b)], p.frag.head_count,
                                oracle.data() + plan.sum_index(l, b));
                        }
                    }
                }
                ASSERT_OK(stream_.synchronize(kWait));
                EXPECT_EQ(sums, oracle);
                EXPECT_NE(sums, random_sums(plan.sum_count, 3)) << "nothing was added";
            }
        }
    }
}

TEST_P(KvOpsMatrix, LandedChecksumsEqualTheSendersAndKvChecksums) {
    // End to end on the host ops: gather, scatter, then the decode side's sums over what landed
    // (fragment plan on the destination side, and page plan over its whole head slice) equal the
    // prefill side's and kv_checksums'.
    for (const auto& p : pairs_) {
        const KvLayout& src = src_[static_cast<size_t>(p.src_rank)].layout;
        auto landed = testing::make_rank_pool(c_, false, p.dst_rank);
        ASSERT_OK(landed);
        ASSERT_OK(landed->pool->fill(kPoolPoison));
        const KvLayout& dst = landed->layout;
        const Chunk ch{0, c_.num_tokens};
        const std::vector<TokenRun> rs = runs(p, ch);
        ASSERT_OK_AND_ASSIGN(KvStagingPlan g, plan_gather(src, p.frag, rs, 0, c_.num_layers));
        ASSERT_OK_AND_ASSIGN(KvStagingPlan s, plan_scatter(dst, p.frag, rs, 0, c_.num_layers));
        std::vector<std::byte> staging(g.staging_bytes, kStagingPoison);
        ASSERT_OK(ops_.enqueue_gather(stream_, src, g.ops, staging.data()));
        ASSERT_OK(ops_.enqueue_scatter(stream_, dst, s.ops, staging.data()));

        ASSERT_OK_AND_ASSIGN(
            KvChecksumPlan sent,
            plan_fragment_checksums(src, KvSide::kSource, p.frag, rs, 0, c_.num_layers));
        ASSERT_OK_AND_ASSIGN(
            KvChecksumPlan got,
            plan_fragment_checksums(dst, KvSide::kDestination, p.frag, rs, 0, c_.num_layers));
        std::vector<uint64_t> sent_sums(sent.sum_count, 0);
        std::vector<uint64_t> got_sums(got.sum_count, 0);
        ASSERT_OK(ops_.enqueue_checksums(stream_, src, sent.ops, sent_sums.data()));
        ASSERT_OK(ops_.enqueue_checksums(stream_, dst, got.ops, got_sums.data()));
        ASSERT_OK(stream_.synchronize(kWait));
        EXPECT_EQ(got_sums, sent_sums);
        EXPECT_NE(got_sums, std::vector<uint64_t>(got.sum_count, 0));
    }
    // Page plan vs kv_checksums on a source layout (every head it holds, two token ranges).
    const KvLayout& src = src_[0].layout;
    for (Chunk ch : chunks()) {
        for (LayerRange lr : layer_ranges()) {
            ASSERT_OK_AND_ASSIGN(KvChecksumPlan plan,
                                 plan_page_checksums(src, src_pages_, ch.t0, ch.t1, lr.begin,
                                                     lr.end, src.head_begin(), src.local_heads()));
            std::vector<uint64_t> sums(plan.sum_count, 0);
            ASSERT_OK(ops_.enqueue_checksums(stream_, src, plan.ops, sums.data()));
            ASSERT_OK(stream_.synchronize(kWait));
            for (int l = 0; l < c_.num_layers; ++l) {
                for (int b = 0; b < src.buffer_count(); ++b) {
                    const std::vector<uint64_t> want =
                        l < lr.begin
                            ? std::vector<uint64_t>(static_cast<size_t>(src.local_heads()), 0)
                            : kv_checksums(src, src_pages_, l, b, ch.t0, ch.t1, src.head_begin(),
                                           src.local_heads());
                    const auto at = sums.begin() + static_cast<ptrdiff_t>(plan.sum_index(l, b));
                    EXPECT_EQ(std::vector<uint64_t>(at, at + src.local_heads()), want)
                        << "layer " << l << " buffer " << b;
                }
            }
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Layouts, KvOpsMatrix, ::testing::ValuesIn(testing::kv_ops_cases()),
                         [](const ::testing::TestParamInfo<KvOpsCase>& param) {
                             return param.param.name;
                         });

// ---------------------------------------------------------------------------------------------
// The host ops' contract

class HostKvMemoryOpsTest : public ::testing::Test {
protected:
    void SetUp() override {
        c_ = testing::kv_ops_cases().front();  // TP 1 -> 1, page size 16
        auto src = testing::make_rank_pool(c_, true, 0);
        ASSERT_OK(src);
        src_ = std::move(*src);
        testing::fill_random(src_.layout, 11);
        pages_ = testing::make_page_table(src_.layout.num_pages(), c_.src_page_size, c_.num_tokens,
                                          true, 5);
        auto frag = make_fragment(src_.layout.summary(), src_.layout.summary());
        ASSERT_TRUE(frag.has_value());
        frag_ = *frag;
        runs_ = make_runs(pages_, c_.src_page_size, 0, pages_, c_.src_page_size, 0, c_.num_tokens,
                          c_.num_tokens);
        auto plan = plan_gather(src_.layout, frag_, runs_, 0, c_.num_layers);
        ASSERT_OK(plan);
        plan_ = std::move(*plan);
    }

    KvOpsCase c_;
    RankPool src_;
    std::vector<int32_t> pages_;
    Fragment frag_;
    std::vector<TokenRun> runs_;
    KvStagingPlan plan_;
    runtime::CpuStream stream_{"kv-ops-contract"};
    HostKvMemoryOps ops_;
};

TEST_F(HostKvMemoryOpsTest, DescribesItsMemory) {
    EXPECT_EQ(ops_.memory_kind(), runtime::DeviceKind::kCpu);
    ASSERT_OK_AND_ASSIGN(auto made, make_kv_memory_ops({runtime::DeviceKind::kCpu, 0}));
    EXPECT_EQ(made->memory_kind(), runtime::DeviceKind::kCpu);
    EXPECT_EQ(made->name(), "host");
}

TEST_F(HostKvMemoryOpsTest, RunsInStreamOrderFromDescriptorsCopiedAtEnqueue) {
    // A gate holds the stream; the ops are enqueued behind it, then the caller's descriptors
    // are overwritten. What runs after the gate must be the descriptors as enqueued.
    std::atomic<bool> open{false};
    std::atomic<bool> ran_early{false};
    std::vector<std::byte> staging(plan_.staging_bytes, kStagingPoison);
    ASSERT_OK(stream_.enqueue([&] {
        while (!open.load()) std::this_thread::yield();
        ran_early = staging[0] != kStagingPoison;
        return Status();
    }));
    std::vector<KvCopyOp> ops = plan_.ops;
    ASSERT_OK(ops_.enqueue_gather(stream_, src_.layout, ops, staging.data()));
    for (KvCopyOp& op : ops) op = KvCopyOp{};  // the caller reuses its vector at once
    ops.clear();
    open = true;
    ASSERT_OK(stream_.synchronize(kWait));
    EXPECT_FALSE(ran_early.load()) << "the gather ran before the task enqueued before it";
    std::vector<std::byte> oracle(plan_.staging_bytes, kStagingPoison);
    for (const KvStagedMessage& m : plan_.messages) {
        gather_run(src_.layout, frag_, m.layer, m.buf, runs_[static_cast<size_t>(m.run)],
                   oracle.data() + m.staging_offset);
    }
    EXPECT_EQ(testing::first_difference(staging, oracle), std::nullopt);
}

TEST_F(HostKvMemoryOpsTest, AllocatesStagingAndZeroedSumsTheOpsUse) {
    // Staging: at least the bytes asked for, 16-byte aligned, host-readable; the gather into it
    // equals the oracle (poisoned first: a gather that did not run shows).
    ASSERT_OK_AND_ASSIGN(KvOpsMemory staging, ops_.allocate_staging(plan_.staging_bytes));
    EXPECT_GE(staging.size(), plan_.staging_bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(staging.data()) % 16, 0u);
    EXPECT_TRUE(staging.host_readable());
    std::memset(staging.data(), static_cast<int>(kStagingPoison), staging.size());
    ASSERT_OK(ops_.enqueue_gather(stream_, src_.layout, plan_.ops, staging.data()));
    // Sums: `count` zeroed values (written over first by a discarded allocation of the same size:
    // fresh memory could be zero by chance, recycled memory must be zeroed on purpose).
    ASSERT_OK_AND_ASSIGN(
        KvChecksumPlan sums_plan,
        plan_fragment_checksums(src_.layout, KvSide::kSource, frag_, runs_, 0, c_.num_layers));
    {
        ASSERT_OK_AND_ASSIGN(KvOpsMemory dirty, ops_.allocate_sums(sums_plan.sum_count));
        std::memset(dirty.data(), 0xFF, dirty.size());
    }
    ASSERT_OK_AND_ASSIGN(KvOpsMemory sums, ops_.allocate_sums(sums_plan.sum_count));
    ASSERT_GE(sums.size(), sums_plan.sum_count * sizeof(uint64_t));
    EXPECT_TRUE(sums.host_readable());
    for (size_t i = 0; i < sums_plan.sum_count; ++i) ASSERT_EQ(sums.as<uint64_t>()[i], 0u) << i;
    ASSERT_OK(ops_.enqueue_checksums(stream_, src_.layout, sums_plan.ops, sums.as<uint64_t>()));
    ASSERT_OK(stream_.synchronize(kWait));
    std::vector<std::byte> oracle(plan_.staging_bytes, kStagingPoison);
    for (const KvStagedMessage& m : plan_.messages) {
        gather_run(src_.layout, frag_, m.layer, m.buf, runs_[static_cast<size_t>(m.run)],
                   oracle.data() + m.staging_offset);
    }
    EXPECT_EQ(
        testing::first_difference(
            std::vector<std::byte>(staging.data(), staging.data() + plan_.staging_bytes), oracle),
        std::nullopt);
    for (int l = 0; l < c_.num_layers; ++l) {
        for (int b = 0; b < src_.layout.buffer_count(); ++b) {
            const std::vector<uint64_t> want = kv_checksums(
                src_.layout, pages_, l, b, 0, c_.num_tokens, frag_.head_begin, frag_.head_count);
            const uint64_t* got = sums.as<uint64_t>() + sums_plan.sum_index(l, b);
            EXPECT_EQ(std::vector<uint64_t>(got, got + frag_.head_count), want)
                << "layer " << l << " buffer " << b;
        }
    }
    // 0 is taken as 1; a handle is move-only and gives its memory back once.
    ASSERT_OK_AND_ASSIGN(KvOpsMemory tiny, ops_.allocate_staging(0));
    EXPECT_GE(tiny.size(), 1u);
    int released = 0;
    {
        KvOpsMemory counted(tiny.data(), tiny.size(), true,
                            [&released](void*, size_t) { ++released; });
        KvOpsMemory moved = std::move(counted);
        EXPECT_TRUE(counted.empty());  // NOLINT(bugprone-use-after-move): the contract
        EXPECT_EQ(moved.data(), tiny.data());
        EXPECT_EQ(released, 0);
    }
    EXPECT_EQ(released, 1);
}

TEST_F(HostKvMemoryOpsTest, NoTokensEnqueueNothingAndNeedNoBuffer) {
    std::vector<KvCopyOp> empty_ops = plan_.ops;
    for (KvCopyOp& op : empty_ops) op.token_count = 0;
    EXPECT_OK(ops_.enqueue_gather(stream_, src_.layout, empty_ops, nullptr));
    EXPECT_OK(ops_.enqueue_gather(stream_, src_.layout, {}, nullptr));
    EXPECT_OK(ops_.enqueue_checksums(stream_, src_.layout, {}, nullptr));
    EXPECT_OK(stream_.synchronize(kWait));
}

TEST_F(HostKvMemoryOpsTest, RejectsBadCallsWithoutEnqueueing) {
    std::vector<std::byte> staging(plan_.staging_bytes);
    // Null buffers.
    EXPECT_THAT(ops_.enqueue_gather(stream_, src_.layout, plan_.ops, nullptr),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("staging: null")));
    ASSERT_OK_AND_ASSIGN(KvChecksumPlan sums_plan,
                         plan_fragment_checksums(src_.layout, KvSide::kSource, frag_, runs_, 0, 1));
    EXPECT_THAT(ops_.enqueue_checksums(stream_, src_.layout, sums_plan.ops, nullptr),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("sums_out: null")));
    // The wrong direction: gather ops handed to a scatter.
    EXPECT_THAT(ops_.enqueue_scatter(stream_, src_.layout, plan_.ops, staging.data()),
                StatusIs(StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("op 0"), HasSubstr("a scatter reads staging"))));
    // A layout of device memory (never dereferenced: refused first).
    ASSERT_OK_AND_ASSIGN(
        KvLayout device_layout,
        KvLayout::create(
            src_.layout.summary(), src_.layout.num_pages(),
            std::vector<std::byte*>(static_cast<size_t>(c_.num_layers * 2), src_.layout.base(0, 0)),
            {runtime::DeviceKind::kCuda, 0}));
    EXPECT_THAT(ops_.enqueue_gather(stream_, device_layout, plan_.ops, staging.data()),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("layout: memory on cuda:0")));
    EXPECT_THAT(enqueue_layer_checksum(stream_, *std::make_unique<OrderingValidator>(0),
                                       device_layout, 1, 0, pages_, 0, 10),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("memory is on cuda:0")));
    EXPECT_OK(stream_.synchronize(kWait));
}

TEST(KvCopyOpsCheck, NamesTheBadOpAndField) {
    const KvOpsCase c = testing::kv_ops_cases().front();
    ASSERT_OK_AND_ASSIGN(RankPool p, testing::make_rank_pool(c, true, 0));
    const KvLayout& layout = p.layout;
    const uint64_t tb = layout.token_bytes(0);
    const KvCopyOp good{.layer = 0,
                        .buf = 0,
                        .token_count = 4,
                        .src_slot = 16,
                        .src_offset = 0,
                        .src_stride = tb,
                        .dst_slot = kStagingSlot,
                        .dst_offset = 0,
                        .dst_stride = tb,
                        .bytes = tb};
    EXPECT_OK(check_copy_ops(layout, std::vector<KvCopyOp>{good}, KvCopyDirection::kGather));
    auto bad = [&](auto mutate, KvCopyDirection dir = KvCopyDirection::kGather) {
        std::vector<KvCopyOp> ops{good, good};
        mutate(ops[1]);
        return check_copy_ops(layout, ops, dir);
    };
    EXPECT_THAT(bad([](KvCopyOp& op) { op.layer = 3; }),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("op 1: layer 3 outside")));
    EXPECT_THAT(bad([](KvCopyOp& op) { op.buf = 2; }),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("op 1: buf 2 outside")));
    EXPECT_THAT(bad([](KvCopyOp& op) { op.token_count = -1; }),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("token_count -1")));
    EXPECT_THAT(bad([](KvCopyOp& op) { op.bytes = 0; }),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("bytes must be >= 1")));
    EXPECT_THAT(bad([&](KvCopyOp& op) { op.src_slot = layout.num_slots() - 2; }),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("src_slot " + std::to_string(layout.num_slots() - 2))));
    EXPECT_THAT(bad([](KvCopyOp& op) { op.src_stride += 1; }),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("src_stride")));
    EXPECT_THAT(bad([](KvCopyOp& op) { op.src_offset = 1; }),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("src_offset 1 + bytes")));
    EXPECT_THAT(bad([](KvCopyOp& op) { op.dst_stride = op.bytes - 1; }),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("staging dst_stride")));
    EXPECT_THAT(bad([](KvCopyOp& op) { op.dst_slot = 16; }),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("a gather reads slots")));
    EXPECT_THAT(bad([](KvCopyOp&) {}, KvCopyDirection::kScatter),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("op 0:")));
}

TEST(KvChecksumOpsCheck, NamesTheBadOpAndField) {
    const KvOpsCase c = testing::kv_ops_cases().front();
    ASSERT_OK_AND_ASSIGN(RankPool p, testing::make_rank_pool(c, true, 0));
    const KvLayout& layout = p.layout;
    const KvChecksumOp good{.layer = 1,
                            .buf = 1,
                            .token_begin = 0,
                            .token_count = 3,
                            .slot = 20,
                            .offset = layout.head_bytes(1),
                            .slot_stride = layout.token_bytes(1),
                            .head_count = layout.local_heads() - 1,
                            .head_bytes = layout.head_bytes(1),
                            .sum_index = 0};
    EXPECT_OK(check_checksum_ops(layout, std::vector<KvChecksumOp>{good}));
    auto bad = [&](auto mutate) {
        std::vector<KvChecksumOp> ops{good};
        mutate(ops[0]);
        return check_checksum_ops(layout, ops);
    };
    EXPECT_THAT(bad([](KvChecksumOp& op) { op.head_count = 4; }),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("op 0: offset")));
    EXPECT_THAT(bad([](KvChecksumOp& op) { op.head_count = 0; }),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("head_count 0")));
    EXPECT_THAT(bad([](KvChecksumOp& op) { op.slot = -1; }),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("slot -1")));
    EXPECT_THAT(bad([](KvChecksumOp& op) { op.slot_stride = 0; }),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("slot_stride 0")));
    EXPECT_THAT(bad([](KvChecksumOp& op) { op.token_begin = -5; }),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("token_begin -5")));
}

TEST(KvCopyPlanBuilders, RejectBadInputs) {
    const KvOpsCase c = testing::kv_ops_cases()[3];  // 6 heads, TP 2 -> 3
    ASSERT_OK_AND_ASSIGN(RankPool src0, testing::make_rank_pool(c, true, 0));
    ASSERT_OK_AND_ASSIGN(RankPool src1, testing::make_rank_pool(c, true, 1));
    ASSERT_OK_AND_ASSIGN(RankPool dst1, testing::make_rank_pool(c, false, 1));
    // Decode rank 1 holds heads [2, 4): head 2 from prefill rank 0, head 3 from prefill rank 1.
    const std::optional<Fragment> f0 = make_fragment(src0.layout.summary(), dst1.layout.summary());
    const std::optional<Fragment> f1 = make_fragment(src1.layout.summary(), dst1.layout.summary());
    ASSERT_TRUE(f0 && f1);
    const std::vector<TokenRun> runs{
        {.token_begin = 0, .count = 10, .src_slot = 64, .dst_slot = 1}};
    EXPECT_OK(plan_gather(src0.layout, *f0, runs, 0, c.num_layers).status());
    EXPECT_THAT(plan_gather(src0.layout, *f0, runs, 0, c.num_layers + 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("layer range [0, 4)")));
    EXPECT_THAT(plan_gather(src0.layout, *f0, runs, 2, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("layer range [2, 1)")));
    // Prefill rank 1's fragment on prefill rank 0's layout: head 3 is not among its heads [0, 3).
    EXPECT_THAT(plan_gather(src0.layout, *f1, runs, 0, 1),
                StatusIs(StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("fragment"), HasSubstr("head range [3, 4) is outside "
                                                                "the layout's heads [0, 3)"))));
    Fragment shifted = *f0;
    shifted.src_offset[1] += 2;
    EXPECT_THAT(plan_gather(src0.layout, shifted, runs, 0, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("fragment buffer 1: src")));
    std::vector<TokenRun> outside = runs;
    outside[0].src_slot = src0.layout.num_slots() - 5;  // 10 tokens past the last page
    EXPECT_THAT(plan_gather(src0.layout, *f0, outside, 0, 1),
                StatusIs(StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("run 0: src slots"), HasSubstr("outside the pool"))));
    outside[0].src_slot = 3;  // the null page 0
    EXPECT_THAT(plan_gather(src0.layout, *f0, outside, 0, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("run 0: src slots [3, 13)")));
    std::vector<TokenRun> empty_run = runs;
    empty_run[0].count = 0;
    EXPECT_THAT(plan_scatter(dst1.layout, *f0, empty_run, 0, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("run 0: tokens [0, 0)")));
    std::vector<TokenRun> dst_outside = runs;
    dst_outside[0].dst_slot = dst1.layout.num_slots();
    EXPECT_THAT(plan_scatter(dst1.layout, *f0, dst_outside, 0, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("run 0: dst slots")));
    EXPECT_THAT(plan_fragment_checksums(src0.layout, KvSide::kDestination, *f0, runs, 0, 1),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("fragment buffer 0: dst")));
    // Page plans: heads, tokens and the page table.
    const std::vector<int32_t> pages{1, 2};
    EXPECT_OK(plan_page_checksums(src0.layout, pages, 0, 100, 0, 1, 0, 3).status());
    EXPECT_THAT(plan_page_checksums(src0.layout, pages, 0, 100, 0, 1, 2, 2),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("head range [2, 4)")));
    EXPECT_THAT(plan_page_checksums(src0.layout, pages, 50, 10, 0, 1, 0, 3),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("token range [50, 10)")));
    EXPECT_THAT(plan_page_checksums(src0.layout, pages, 0, 200, 0, 1, 0, 3),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("page table of 2 pages")));
}

// A layout over some layers of a pool (one cache group's engine, sim/testbed/rank_builder.h):
// layout layer i is pool layer layers[i], at that layer's buffers; a layer the pool does not hold
// is refused by name.
TEST(KvLayoutFromPool, PicksTheGroupsLayers) {
    kv::MHAPoolConfig c;
    c.num_layers = 4;
    c.num_pages = 3;
    c.page_size = 2;
    c.num_kv_heads = 2;
    c.head_dim = 4;
    c.layers = {1, 3};
    auto pool = kv::MHATokenToKVPool::create(c);
    ASSERT_OK(pool);
    const std::vector<int> layers = {3, 1};
    auto layout = KvLayout::from_mha_pool(**pool, 1, 0, 2, layers);
    ASSERT_OK(layout);
    EXPECT_EQ(layout->num_layers(), 2);
    EXPECT_EQ(layout->base(0, 1), static_cast<std::byte*>((*pool)->data(3, 1)));
    EXPECT_EQ(layout->base(1, 0), static_cast<std::byte*>((*pool)->data(1, 0)));
    const std::vector<int> unheld = {1, 2};
    EXPECT_THAT(KvLayout::from_mha_pool(**pool, 1, 0, 2, unheld).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("layer 2 is not held")));
    // Every layer (the default) needs them all.
    EXPECT_THAT(KvLayout::from_mha_pool(**pool, 1, 0, 2).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("null buffer base")));
}

}  // namespace
}  // namespace pdsim::transfer

// The "mpi" transport under mpirun (processes as ranks; run with -np 2 and -np 4). The
// conformance suite plus MPI-specific checks. Every wait has a timeout, so a failing rank makes the
// others fail instead of hanging; ctest's TIMEOUT is the last line of defence.
#include <gtest/gtest.h>
#include <mpi.h>

#include "tests/status_matchers.h"
#include "tests/transport_conformance.h"
#include "transfer/mpi/mpi_transport.h"

namespace pdsim::transfer {
namespace {

using namespace std::chrono_literals;
using conformance::compare_message;
using conformance::kWait;
using conformance::make_message;

// Each run gets a fresh transport (MPI_Comm_dup: its own communicator, so tests cannot see each
// other's messages), runs the body on this process's rank, and synchronizes before closing.
class MpiHarness : public conformance::Harness {
public:
    void run(const conformance::Body& body) override {
        int n = 0;
        MPI_Comm_size(MPI_COMM_WORLD, &n);
        if (n < 2) GTEST_SKIP() << "run under mpirun -np 2 (or more)";
        auto t = create_transport("mpi", TransportOptions{});
        ASSERT_OK(t);
        body(**t);
        MPI_Barrier(MPI_COMM_WORLD);
    }
    [[nodiscard]] bool in_process() const override { return false; }
};

MpiHarness g_mpi;

}  // namespace

PDSIM_TRANSPORT_CONFORMANCE_TESTS(MpiConformance, g_mpi)

TEST(MpiTransport, OwnCommunicatorIsolatesTraffic) {
    g_mpi.run([](Transport& t) {
        EXPECT_EQ(t.name(), "mpi");
        EXPECT_FALSE(t.capabilities().detects_peer_failure);
        int world_rank = 0;
        MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
        EXPECT_EQ(t.rank(), world_rank);
        int right = conformance::right_of(t);
        int left = conformance::left_of(t);
        // A message on MPI_COMM_WORLD with the same tag must not satisfy the transport's receive.
        int app_out = 1234;
        int app_in = 0;
        MPI_Request app_reqs[2];
        MPI_Irecv(&app_in, 1, MPI_INT, left, 5, MPI_COMM_WORLD, &app_reqs[0]);
        MPI_Isend(&app_out, 1, MPI_INT, right, 5, MPI_COMM_WORLD, &app_reqs[1]);
        std::vector<uint8_t> in(4);
        auto r = t.post_recv(left, 5, in.data(), in.size());
        ASSERT_OK(r);
        MPI_Waitall(2, app_reqs, MPI_STATUSES_IGNORE);
        EXPECT_EQ(app_in, 1234);
        EXPECT_EQ(t.wait(*r, 100ms).code(), StatusCode::kDeadlineExceeded);
        // Nobody sends on the transport before every rank has checked the above.
        MPI_Barrier(MPI_COMM_WORLD);
        auto msg = make_message(t.rank(), right, 1, 4);
        auto s = t.post_send(right, 5, msg.data(), msg.size());
        ASSERT_OK(s);
        ASSERT_OK(t.wait(*r, kWait));
        EXPECT_EQ(compare_message(in.data(), 4, left, t.rank(), 1), "");
        EXPECT_OK(t.wait(*s, kWait));
    });
}

TEST(MpiTransport, ManyLargeMessagesInFlight) {
    g_mpi.run([](Transport& t) {
        int right = conformance::right_of(t);
        int left = conformance::left_of(t);
        constexpr int kCount = 16;
        const size_t n = size_t{4} << 20;
        std::vector<std::vector<uint8_t>> outs;
        std::vector<std::vector<uint8_t>> ins(kCount, std::vector<uint8_t>(n));
        std::vector<RequestHandle> hs;
        for (int k = 0; k < kCount; ++k) {
            auto r = t.post_recv(left, 40, ins[k].data(), n);
            ASSERT_OK(r);
            hs.push_back(*r);
        }
        for (int k = 0; k < kCount; ++k) {
            outs.push_back(make_message(t.rank(), right, 50 + k, n));
            auto s = t.post_send(right, 40, outs.back().data(), n);
            ASSERT_OK(s);
            hs.push_back(*s);
        }
        ASSERT_OK(wait_all(t, hs, kWait));
        for (int k = 0; k < kCount; ++k) {
            ASSERT_EQ(compare_message(ins[k].data(), n, left, t.rank(), 50 + k), "") << k;
        }
    });
}

TEST(MpiTransport, CloseFailsPendingReceives) {
    g_mpi.run([](Transport& t) {
        std::vector<uint8_t> in(16);
        auto r = t.post_recv(conformance::left_of(t), 77, in.data(), in.size());
        ASSERT_OK(r);
        t.close();
        Status st = t.wait(*r, kWait);
        EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
        EXPECT_EQ(t.post_send(conformance::right_of(t), 1, in.data(), 1).status().code(),
                  StatusCode::kUnavailable);
    });
}

}  // namespace pdsim::transfer

int main(int argc, char** argv) {
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    // Every rank runs every test; the exit code is the worst rank's.
    ::testing::InitGoogleTest(&argc, argv);
    int rc = RUN_ALL_TESTS();
    int worst = 0;
    MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Finalize();
    return worst;
}

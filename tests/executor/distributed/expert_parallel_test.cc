// The expert-parallel collectives over Gloo, ranks as threads: all-gather of per-expert counts and
// the all-to-all of rows with uneven, zero and all-empty splits (what a sparse layer exchanges
// when some ranks route nothing to some others).
#include "executor/distributed/expert_parallel_group.h"
#include "executor/distributed/parallel_groups.h"

#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/gloo_ranks.h"

namespace dta {
namespace {

using testing::RunRanks;

TEST(ExpertParallel, ExpertsSplitIntoContiguousBlocks) {
  EXPECT_EQ(ExpertRange(128, 0, 8), (IndexRange{0, 16}));
  EXPECT_EQ(ExpertRange(128, 7, 8), (IndexRange{112, 128}));
  EXPECT_EQ(ExpertRange(5, 1, 2), (IndexRange{2, 5}));
}

TEST(ExpertParallel, AllGatherStacksEveryRanksTensorInRankOrder) {
  RunRanks(3, [](ProcessGroup& group) {
    const ExpertParallelOverProcessGroup ep(group);
    const at::Tensor counts = at::arange(4, at::kLong) + 10 * ep.rank();
    const at::Tensor all = ep.AllGather(counts);
    ASSERT_EQ(all.sizes(), at::IntArrayRef({3, 4}));
    for (int r = 0; r < 3; ++r) EXPECT_TRUE(at::equal(all[r], at::arange(4, at::kLong) + 10 * r));
  });
}

// Rank s sends (s + r) % 3 rows to rank r (zero for some pairs), each row tagged with its source,
// destination and index; every rank checks what arrives, in source order.
TEST(ExpertParallel, AllToAllDeliversUnevenAndEmptySplitsInRankOrder) {
  constexpr int kRanks = 3;
  const auto rows = [](int source, int destination) { return int64_t{(source + destination) % 3}; };
  RunRanks(kRanks, [&](ProcessGroup& group) {
    const ExpertParallelOverProcessGroup ep(group);
    const int me = ep.rank();
    std::vector<int64_t> send(kRanks), receive(kRanks);
    std::vector<at::Tensor> parts;
    for (int r = 0; r < kRanks; ++r) {
      send[r] = rows(me, r);
      receive[r] = rows(r, me);
      for (int64_t i = 0; i < send[r]; ++i)
        parts.push_back(at::tensor({double(me), double(r), double(i)}, at::kDouble).view({1, 3}));
    }
    const at::Tensor input = parts.empty() ? at::empty({0, 3}, at::kDouble) : at::cat(parts);
    int64_t total = 0;
    for (int64_t n : receive) total += n;
    at::Tensor output = at::full({total, 3}, -1.0, at::kDouble);
    ep.StartAllToAll(output, input, receive, send)->Wait();
    int64_t row = 0;
    for (int source = 0; source < kRanks; ++source) {
      for (int64_t i = 0; i < receive[source]; ++i, ++row) {
        EXPECT_TRUE(at::equal(output[row],
                              at::tensor({double(source), double(me), double(i)}, at::kDouble)))
            << "rank " << me << " row " << row << ": " << output[row];
      }
    }
    // Nobody sends anything: a zero-row exchange still matches across ranks.
    at::Tensor none = at::empty({0, 3}, at::kDouble);
    const std::vector<int64_t> zeros(kRanks, 0);
    ep.StartAllToAll(none, at::empty({0, 3}, at::kDouble), zeros, zeros)->Wait();
  });
}

// 8 ranks as TP 2 x DP 4 with EP 2: world rank w = d TP + t, d = f EP + e. Each group's members are
// checked by gathering their world ranks.
TEST(ExpertParallel, GroupsLiveInsideTheDataParallelGroup) {
  RunRanks(8, [](ProcessGroup& world) {
    const ParallelGroups groups(world, /*tensor_parallel=*/2, /*expert_parallel=*/2,
                                testing::LoopbackOptions());
    const int w = world.rank(), t = w % 2, d = w / 2, e = d % 2, f = d / 2;
    EXPECT_EQ(groups.expert_parallel_size(), 2);
    EXPECT_EQ(groups.expert_parallel_rank(), e);
    EXPECT_EQ(groups.expert_data_parallel_size(), 2);
    EXPECT_EQ(groups.expert_data_parallel_rank(), f);
    const at::Tensor me = at::tensor({int64_t{w}});
    ASSERT_NE(groups.expert_parallel_collectives(), nullptr);
    const at::Tensor ep = groups.expert_parallel_collectives()->AllGather(me);
    for (int i = 0; i < 2; ++i) EXPECT_EQ(ep[i].item<int64_t>(), (f * 2 + i) * 2 + t);
    const ExpertParallelOverProcessGroup edp(groups.expert_data_parallel());
    const at::Tensor edp_ranks = edp.AllGather(me);
    for (int i = 0; i < 2; ++i) EXPECT_EQ(edp_ranks[i].item<int64_t>(), (i * 2 + e) * 2 + t);
  });
  RunRanks(2, [](ProcessGroup& world) {
    const ParallelGroups plain(world, 1, testing::LoopbackOptions());
    EXPECT_EQ(plain.expert_parallel(), nullptr);
    EXPECT_EQ(&plain.expert_data_parallel(), &world);
    try {
      ParallelGroups(world, 1, /*expert_parallel=*/3, testing::LoopbackOptions());
      ADD_FAILURE() << "EP 3 over 2 replicas";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("expert parallelism over 3 replicas does not divide"),
                std::string::npos);
    }
  });
}

TEST(ExpertParallel, BadSplitsAreRefusedBeforeAnyExchange) {
  RunRanks(2, [](ProcessGroup& group) {
    const ExpertParallelOverProcessGroup ep(group);
    at::Tensor out = at::empty({2, 3}, at::kDouble);
    const at::Tensor in = at::zeros({2, 3}, at::kDouble);
    const auto message = [&](const std::vector<int64_t>& receive,
                             const std::vector<int64_t>& send) {
      try {
        ep.StartAllToAll(out, in, receive, send);
      } catch (const c10::Error& e) {
        return std::string(e.what_without_backtrace());
      }
      return std::string();
    };
    EXPECT_NE(message({2}, {1, 1}).find("one split per rank (2)"), std::string::npos);
    EXPECT_NE(message({1, 1}, {2, 1}).find("splits of 3 and 2 rows for tensors of 2 and 2"),
              std::string::npos);
  });
}

}  // namespace
}  // namespace dta

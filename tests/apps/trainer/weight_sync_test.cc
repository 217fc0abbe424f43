// The weight sync's pure parts: bucket packing and the engine list (the protocol itself is tested
// end to end against Python engines in tests/python/test_weight_sync.py).
#include "apps/engines/weight_sync.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(PackBucketsTest, FillsBucketsInOrderWithoutSplittingTensors) {
  EXPECT_THAT(PackBuckets({}, 10), ElementsAre(0));
  EXPECT_THAT(PackBuckets({4}, 10), ElementsAre(0, 1));
  // 4 + 6 fills a bucket exactly; 3 + 7 too; the last one is alone.
  EXPECT_THAT(PackBuckets({4, 6, 3, 7, 1}, 10), ElementsAre(0, 2, 4, 5));
  // One tensor per bucket when each is over half the limit.
  EXPECT_THAT(PackBuckets({6, 6, 6}, 10), ElementsAre(0, 1, 2, 3));
  // A tensor larger than a bucket goes alone, and does not disturb its neighbours.
  EXPECT_THAT(PackBuckets({1, 25, 2, 3}, 10), ElementsAre(0, 1, 2, 4));
  EXPECT_THAT(PackBuckets({25}, 10), ElementsAre(0, 1));
  // Seven tensors of 1 in buckets of 3.
  EXPECT_THAT(PackBuckets(std::vector<int64_t>(7, 1), 3), ElementsAre(0, 3, 6, 7));
}

TEST(ParseWeightSyncEnginesTest, KindsUrlsAndWorkerCounts) {
  absl::StatusOr<std::vector<WeightSyncEngine>> engines =
      ParseWeightSyncEngines("sglang=http://10.0.0.5:30000*2,areal-vllm=https://h:8000/");
  ASSERT_TRUE(engines.ok()) << engines.status();
  ASSERT_EQ(engines->size(), 2u);
  EXPECT_EQ((*engines)[0].kind, EngineKind::kSglang);
  EXPECT_EQ((*engines)[0].url, "http://10.0.0.5:30000");
  EXPECT_EQ((*engines)[0].workers, 2);
  EXPECT_EQ((*engines)[1].kind, EngineKind::kArealVllm);
  EXPECT_EQ((*engines)[1].url, "https://h:8000");
  EXPECT_EQ((*engines)[1].workers, 1);
  EXPECT_TRUE(ParseWeightSyncEngines("")->empty());
}

TEST(ParseWeightSyncEnginesTest, RefusesWhatCannotJoinAGroup) {
  EXPECT_THAT(ParseWeightSyncEngines("vllm=http://h:1").status().message(),
              HasSubstr("cannot join a c10d group"));
  EXPECT_THAT(ParseWeightSyncEngines("sglang=http://h:1*0").status().message(),
              HasSubstr("worker count"));
  EXPECT_THAT(ParseWeightSyncEngines("sglang=http://h:1*x").status().message(),
              HasSubstr("worker count"));
  EXPECT_THAT(ParseWeightSyncEngines("sglang=ftp://h").status().message(), HasSubstr("http://"));
}

}  // namespace
}  // namespace dta

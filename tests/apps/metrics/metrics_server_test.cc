#include "apps/metrics/metrics_server.h"

#include <gtest/gtest.h>

#include <atomic>
#include <string>

#include "tests/testing/http_get.h"

namespace dta {
namespace {

std::string Url(const MetricsServer& server, const std::string& path = "/metrics") {
  return "http://127.0.0.1:" + std::to_string(server.port()) + path;
}

TEST(MetricsServer, RendersOnEveryScrapeAndServesNothingElse) {
  std::atomic<int> scrapes{0};
  auto server = MetricsServer::Start(
      "127.0.0.1:0", "", [&scrapes] { return "dta_scrapes " + std::to_string(++scrapes) + "\n"; });
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_GT((*server)->port(), 0);
  EXPECT_EQ(testing::HttpGet(Url(**server)), std::make_pair(200L, std::string("dta_scrapes 1\n")));
  EXPECT_EQ(testing::HttpGet(Url(**server)), std::make_pair(200L, std::string("dta_scrapes 2\n")));
  EXPECT_EQ(testing::HttpGet(Url(**server, "/")).first, 404);
  EXPECT_EQ(testing::HttpGet(Url(**server, "/metrics/../wal")).first, 404);
  EXPECT_EQ(scrapes.load(), 2);
}

TEST(MetricsServer, ATokenGuardsTheEndpoint) {
  auto server = MetricsServer::Start("127.0.0.1:0", "secret", [] { return std::string("x 1\n"); });
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(testing::HttpGet(Url(**server)).first, 401);
  EXPECT_EQ(testing::HttpGet(Url(**server), "secreT").first, 401);
  EXPECT_EQ(testing::HttpGet(Url(**server), "secret-and-more").first, 401);
  EXPECT_EQ(testing::HttpGet(Url(**server), "secret"), std::make_pair(200L, std::string("x 1\n")));
}

TEST(MetricsServer, RefusesBadAddressesAndOpenRemoteOnes) {
  const auto render = [] { return std::string(); };
  for (const char* address : {"", "9400", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:70000",
                              "[::1:9400", "0.0.0.0:0", ":9400", "127.0.0.1.example:0"}) {
    auto server = MetricsServer::Start(address, "", render);
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << address;
  }
  auto taken = MetricsServer::Start("127.0.0.1:0", "", render);
  ASSERT_TRUE(taken.ok()) << taken.status();
  auto again = MetricsServer::Start("127.0.0.1:" + std::to_string((*taken)->port()), "", render);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
  // Any address with a token (here one every interface listens on).
  auto remote = MetricsServer::Start("0.0.0.0:0", "secret", render);
  ASSERT_TRUE(remote.ok()) << remote.status();
  EXPECT_EQ(testing::HttpGet(Url(**remote), "secret").first, 200);
}

TEST(MetricsServer, StopsRightAfterStarting) {
  for (int i = 0; i < 20; ++i) {
    auto server = MetricsServer::Start("127.0.0.1:0", "", [] { return std::string(); });
    ASSERT_TRUE(server.ok()) << server.status();
  }
}

}  // namespace
}  // namespace dta

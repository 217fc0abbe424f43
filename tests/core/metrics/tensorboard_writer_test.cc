// The event file's framing and fields, read back here byte by byte (tests/python/test_train_cli.py
// also reads dta-train's event files with tensorboardX's own protos and CRC).
#include "core/metrics/tensorboard_writer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/testing/event_records.h"

namespace dta {
namespace {

namespace fs = std::filesystem;

TEST(Crc32c, MatchesTheStandardCheckValues) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);            // the CRC catalogue's check value
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8A9136AAu);  // RFC 3720 B.4
  EXPECT_EQ(Crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(""), 0u);
}

TEST(TensorBoardWriter, WritesTheVersionThenOneEventPerStep) {
  const fs::path dir = fs::path(::testing::TempDir()) / "tensorboard_writer" / "run";
  fs::remove_all(dir.parent_path());
  auto writer = TensorBoardWriter::Open(dir.string());
  ASSERT_TRUE(writer.ok()) << writer.status();
  EXPECT_EQ(fs::path((*writer)->path()).parent_path(), dir);
  EXPECT_EQ(fs::path((*writer)->path()).filename().string().rfind("events.out.tfevents.", 0), 0u);
  ASSERT_TRUE((*writer)->Write(300, {{"loss", 0.5}, {"rl/approx_kl", -2.0}}, 1700000000.25).ok());
  ASSERT_TRUE((*writer)->Write(301, {{"loss", 0.25}}, 1700000001.0).ok());

  // Flushed: readable while the writer is open.
  const std::vector<std::string> records = testing::EventRecords((*writer)->path());
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[0][0], '\x09');  // wall_time, fixed64
  EXPECT_NE(records[0].find("\x1a\x0d"
                            "brain.Event:2"),
            std::string::npos);

  // Event{wall_time 1700000000.25, step 300, summary{value{"loss", 0.5f}, value{...}}}.
  std::string expected = "\x09";
  const double wall_time = 1700000000.25;
  expected.append(reinterpret_cast<const char*>(&wall_time), 8);
  expected += "\x10\xac\x02";  // step 300 as a varint
  const float half = 0.5f, minus_two = -2.0f;
  std::string loss =
      std::string("\x0a\x04loss\x15", 7) + std::string(reinterpret_cast<const char*>(&half), 4);
  std::string kl = std::string("\x0a\x0crl/approx_kl\x15", 15) +
                   std::string(reinterpret_cast<const char*>(&minus_two), 4);
  std::string summary = "\x0a" + std::string(1, static_cast<char>(loss.size())) + loss + "\x0a" +
                        std::string(1, static_cast<char>(kl.size())) + kl;
  expected += "\x2a" + std::string(1, static_cast<char>(summary.size())) + summary;
  EXPECT_EQ(records[1], expected);
}

TEST(TensorBoardWriter, TwoWritersInOneDirectoryGetTheirOwnFiles) {
  const fs::path dir = fs::path(::testing::TempDir()) / "tensorboard_two";
  fs::remove_all(dir);
  auto first = TensorBoardWriter::Open(dir.string());
  ASSERT_TRUE(first.ok()) << first.status();
  // Same second, same host, same pid: the second writer must not share or clobber the file.
  auto second = TensorBoardWriter::Open(dir.string());
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE((*first)->path(), (*second)->path());
  ASSERT_TRUE((*first)->Write(1, {{"x", 1}}).ok());
  EXPECT_EQ(testing::EventRecords((*first)->path()).size(), 2u);
  EXPECT_EQ(testing::EventRecords((*second)->path()).size(), 1u);
}

TEST(TensorBoardWriter, ReportsWhatItCannotCreate) {
  EXPECT_EQ(TensorBoardWriter::Open("").status().code(), absl::StatusCode::kInvalidArgument);
  const fs::path file = fs::path(::testing::TempDir()) / "tensorboard_not_a_dir";
  std::ofstream(file) << "x";
  auto writer = TensorBoardWriter::Open((file / "sub").string());
  EXPECT_FALSE(writer.ok());
  EXPECT_NE(writer.status().message().find(file.string()), std::string_view::npos)
      << writer.status();
}

}  // namespace
}  // namespace dta

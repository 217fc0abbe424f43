#include "core/progress/progress_line.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <string>

namespace dta {
namespace {

// What was written to `file` so far.
std::string Contents(std::FILE* file) {
  std::fflush(file);
  std::rewind(file);
  std::string text;
  char buffer[256];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), file)) > 0) text.append(buffer, n);
  return text;
}

TEST(ProgressLine, DescribesDoneRateAndEta) {
  EXPECT_EQ(ProgressLine::Describe(412345, 1020000, 8.05, "tokens"),
            "412K/1.02M tokens (40%), 51.2K tokens/s, ETA 12 s");
  EXPECT_EQ(ProgressLine::Describe(0, 999, 3, "tokens"), "0/999 tokens (0%)");
  EXPECT_EQ(ProgressLine::Describe(1000, 1000000, 1, "tokens"),
            "1K/1M tokens (0%), 1K tokens/s, ETA 17 min");
  EXPECT_EQ(ProgressLine::Describe(5, 5, 2, "rollouts"),
            "5/5 rollouts (100%), 2.5 rollouts/s, ETA 0 s");
}

TEST(ProgressLine, IsQuietInAFileUnlessAskedAndThenPrintsWholeLinesEveryTenSeconds) {
  double now = 100;
  std::FILE* file = std::tmpfile();
  {
    ProgressLine quiet("step 1", "tokens", ProgressMode::kAuto, file, [&] { return now; });
    for (int i = 1; i <= 60; ++i) {
      now += 1;
      quiet.Update(i, 60);
    }
  }
  EXPECT_EQ(Contents(file), "");
  {
    ProgressLine never("step 1", "tokens", ProgressMode::kNever, file, [&] { return now; });
    now += 100;
    never.Update(1, 2);
  }
  EXPECT_EQ(Contents(file), "");
  now = 0;
  {
    ProgressLine always("step 2", "tokens", ProgressMode::kAlways, file, [&] { return now; });
    for (int i = 1; i <= 25; ++i) {
      now = i;
      always.Update(1000 * i, 25000);
    }
  }
  // At 10 s (the first after the delay) and 20 s.
  EXPECT_EQ(Contents(file),
            "step 2: 10K/25K tokens (40%), 1K tokens/s, ETA 15 s\n"
            "step 2: 20K/25K tokens (80%), 1K tokens/s, ETA 5 s\n");
  std::fclose(file);
}

TEST(ProgressLine, RewritesOneLineOnATerminalAndClearsIt) {
  const int master = posix_openpt(O_RDWR | O_NOCTTY);
  ASSERT_GE(master, 0);
  ASSERT_EQ(grantpt(master), 0);
  ASSERT_EQ(unlockpt(master), 0);
  const int follower = open(ptsname(master), O_RDWR | O_NOCTTY);
  ASSERT_GE(follower, 0);
  // Raw output: the terminal must not turn \n into \r\n behind our back (none is written anyway).
  std::FILE* terminal = fdopen(follower, "w");
  double now = 0;
  {
    ProgressLine line("step 1", "tokens", ProgressMode::kAuto, terminal, [&] { return now; });
    for (int i = 1; i <= 8; ++i) {
      now = 0.5 * i;  // 0.5 s .. 4 s: shown from 2 s on, every 0.5 s
      line.Update(100 * i, 1000);
    }
  }  // Finish clears the line
  std::fclose(terminal);
  std::string seen;
  char buffer[512];
  ssize_t n;
  while ((n = read(master, buffer, sizeof(buffer))) > 0) seen.append(buffer, n);
  close(master);
  EXPECT_EQ(seen.find('\n'), std::string::npos) << seen;
  EXPECT_NE(seen.find("\r\033[Kstep 1: 400/1K tokens (40%), 200 tokens/s, ETA 3 s"),
            std::string::npos)
      << seen;
  EXPECT_NE(seen.find("\r\033[Kstep 1: 800/1K tokens (80%), 200 tokens/s, ETA 1 s"),
            std::string::npos)
      << seen;
  EXPECT_EQ(seen.substr(seen.size() - 4), "\r\033[K") << seen;
}

TEST(ProgressLine, ParsesModes) {
  EXPECT_EQ(*ParseProgressMode("auto"), ProgressMode::kAuto);
  EXPECT_EQ(*ParseProgressMode("always"), ProgressMode::kAlways);
  EXPECT_EQ(*ParseProgressMode("never"), ProgressMode::kNever);
  EXPECT_EQ(ParseProgressMode("sometimes").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dta

#include "core/cli/usage.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

class FlagFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("usage_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& contents) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path) << contents;
    return path;
  }

  static absl::Status Check(const std::vector<std::string>& args) {
    std::vector<const char*> argv = {"dta-test"};
    for (const std::string& a : args) argv.push_back(a.c_str());
    return CheckFlagFiles(static_cast<int>(argv.size()), argv.data());
  }

  fs::path dir_;
};

TEST_F(FlagFilesTest, AcceptsNestedAndListedFiles) {
  const std::string inner = Write("inner.flags", "--lr=1e-5\n");
  const std::string outer = Write("outer.flags", "--steps=3\n  --flagfile=" + inner + "\n");
  const std::string other = Write("other.flags", "--flagfile=" + inner + "\n");
  EXPECT_TRUE(Check({"--flagfile=" + outer}).ok());
  EXPECT_TRUE(Check({"--flagfile=" + outer + "," + other, "--lr=2"}).ok());
  EXPECT_TRUE(Check({"-flagfile", outer}).ok());
  EXPECT_TRUE(Check({"--", "--flagfile=" + (dir_ / "missing").string()}).ok());  // positional
}

// Abseil reads a file that includes itself forever (memory grows by megabytes a second).
TEST_F(FlagFilesTest, RefusesAFileThatIncludesItself) {
  const std::string self = (dir_ / "self.flags").string();
  Write("self.flags", "--lr=1\n--flagfile=" + self + "\n");
  const absl::Status direct = Check({"--flagfile=" + self});
  ASSERT_EQ(direct.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(direct.message()),
              AllOf(HasSubstr("--flagfile in " + self), HasSubstr("includes itself"),
                    HasSubstr(self + " -> " + self)));

  const std::string a = (dir_ / "a.flags").string(), b = (dir_ / "b.flags").string();
  Write("a.flags", "--flagfile=" + b + "\n");
  Write("b.flags", "--steps=1\n--flagfile=" + (dir_ / "." / "a.flags").string() + "\n");
  const absl::Status cycle = Check({"--steps=2", "--flagfile", a});
  ASSERT_EQ(cycle.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(cycle.message()), HasSubstr(a + " -> " + b + " -> " + a));
}

// A directory used to be skipped silently: the run started on default flags.
TEST_F(FlagFilesTest, RefusesADirectoryOrAMissingFile) {
  const absl::Status directory = Check({"--flagfile=" + dir_.string()});
  ASSERT_EQ(directory.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(directory.message()),
              AllOf(HasSubstr(dir_.string()), HasSubstr("not a regular file")));
  const std::string missing = (dir_ / "missing.flags").string();
  const std::string outer = Write("outer.flags", "--flagfile=" + missing + "\n");
  const absl::Status nested = Check({"--flagfile=" + outer});
  ASSERT_EQ(nested.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(nested.message()),
              AllOf(HasSubstr("--flagfile in " + outer), HasSubstr("cannot read " + missing)));
}

TEST_F(FlagFilesTest, ParseCommandLineExitsWithStatusTwo) {
  const std::string self = (dir_ / "self.flags").string();
  Write("self.flags", "--flagfile=" + self + "\n");
  std::string flag = "--flagfile=" + self;
  char name[] = "dta-test";
  char* argv[] = {name, flag.data()};
  EXPECT_EXIT(ParseCommandLine(2, argv), ::testing::ExitedWithCode(2), "includes itself");
}

}  // namespace
}  // namespace dta

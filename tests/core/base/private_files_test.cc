#include "core/base/private_files.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

class PrivateFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("private_files_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    fs::permissions(dir_, fs::perms::owner_all);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& contents, fs::perms mode) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path) << contents;
    fs::permissions(path, mode);
    return path;
  }

  fs::path dir_;
};

constexpr fs::perms kOwnerReadWrite = fs::perms::owner_read | fs::perms::owner_write;

TEST_F(PrivateFilesTest, ReadsAPrivateFileTrimmed) {
  const std::string path = Write("token", "  s3cret\n", kOwnerReadWrite);
  absl::StatusOr<std::string> read = ReadPrivateFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "s3cret");
  EXPECT_EQ(*ReadPrivateFile(path, /*trim=*/false), "  s3cret\n");
  EXPECT_TRUE(ReadPrivateFile(Write("read-only", "x", fs::perms::owner_read)).ok());
}

// One rule for every credential: group or others may neither read nor write it (0640 and 0644
// alike), and the error names the file, its mode and its owner.
TEST_F(PrivateFilesTest, RefusesAFileOpenToGroupOrOthers) {
  for (const fs::perms extra : {fs::perms::group_read, fs::perms::others_read,
                                fs::perms::group_write, fs::perms::others_write}) {
    const std::string path = Write("loose", "s3cret", kOwnerReadWrite | extra);
    absl::StatusOr<std::string> read = ReadPrivateFile(path);
    ASSERT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition) << read.status();
    EXPECT_THAT(std::string(read.status().message()),
                AllOf(HasSubstr(path), HasSubstr("open to group or others"), HasSubstr("mode 06"),
                      HasSubstr("owner uid "), HasSubstr("chmod 600")));
    EXPECT_EQ(CheckPrivateFile(path).code(), absl::StatusCode::kFailedPrecondition);
  }
}

TEST_F(PrivateFilesTest, RefusesAFileOfAnotherUser) {
  const std::string path = Write("planted", "s3cret", kOwnerReadWrite);
  const OwnerRule someone_else = {.user = ::geteuid() + 1};
  absl::StatusOr<std::string> read = ReadPrivateFile(path, true, someone_else);
  ASSERT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition) << read.status();
  EXPECT_THAT(std::string(read.status().message()),
              AllOf(HasSubstr(path), HasSubstr("is owned by uid " + std::to_string(::geteuid())),
                    HasSubstr("not by this process's user uid " + std::to_string(::geteuid() + 1)),
                    HasSubstr("mode 0600")));
  EXPECT_EQ(CheckPrivateFile(path, someone_else).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(PrivateFilesTest, RefusesLinksDirectoriesAndEmptyOrMissingFiles) {
  const std::string target = Write("target", "s3cret", kOwnerReadWrite);
  const std::string link = (dir_ / "link").string();
  fs::create_symlink(target, link);
  EXPECT_EQ(ReadPrivateFile(link).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CheckPrivateFile(link).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReadPrivateFile(dir_.string()).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReadPrivateFile(Write("empty", " \n", kOwnerReadWrite)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadPrivateFile((dir_ / "missing").string()).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(PrivateFilesTest, CreatesOnceWithModeSixHundred) {
  const std::string path = (dir_ / "created").string();
  ASSERT_TRUE(CreatePrivateFile(path, "abc\n").ok());
  EXPECT_EQ(fs::status(path).permissions() & fs::perms::all, kOwnerReadWrite);
  EXPECT_EQ(*ReadPrivateFile(path), "abc");
  // O_EXCL: an existing file is never opened for writing, whoever made it.
  EXPECT_EQ(CreatePrivateFile(path, "other").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(*ReadPrivateFile(path), "abc");
  const std::string dangling = (dir_ / "dangling").string();
  fs::create_symlink(dir_ / "nowhere", dangling);
  EXPECT_EQ(CreatePrivateFile(dangling, "x").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_FALSE(fs::exists(dir_ / "nowhere"));
}

// /tmp-like directories: anyone may create a name there before the process does.
TEST_F(PrivateFilesTest, CreatesOnlyInADirectoryOthersCannotWrite) {
  fs::permissions(dir_, fs::perms::all | fs::perms::sticky_bit);
  const std::string path = (dir_ / "token").string();
  const absl::Status status = CreatePrivateFile(path, "abc");
  ASSERT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("will not create " + path), HasSubstr(dir_.string()),
                    HasSubstr("writable by group or others"), HasSubstr("mode 1777")));
  EXPECT_FALSE(fs::exists(path));
  fs::permissions(dir_, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec);
  if (::geteuid() != 0) {  // a directory of root's is fine for anyone; of another user's, not
    EXPECT_EQ(CreatePrivateFile(path, "abc", {.user = ::geteuid() + 1}).code(),
              absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_TRUE(CreatePrivateFile(path, "abc").ok());
}

TEST_F(PrivateFilesTest, OwnedDirectories) {
  const std::string made = (dir_ / "a" / "b" / "checkpoints").string();
  ASSERT_TRUE(MakeOwnedDirectory(made).ok());
  EXPECT_TRUE(fs::is_directory(made));
  EXPECT_TRUE(MakeOwnedDirectory(made).ok());  // existing and the user's own: fine
  EXPECT_TRUE(CheckOwnedDirectory(made).ok());

  fs::permissions(made, fs::perms::others_write, fs::perm_options::add);
  const absl::Status writable = MakeOwnedDirectory(made);
  ASSERT_EQ(writable.code(), absl::StatusCode::kFailedPrecondition) << writable;
  EXPECT_THAT(
      std::string(writable.message()),
      AllOf(HasSubstr(made), HasSubstr("writable by group or others"), HasSubstr("mode 0757")));
  fs::permissions(made, fs::perms::others_write, fs::perm_options::remove);

  const absl::Status foreign = CheckOwnedDirectory(made, {.user = ::geteuid() + 1});
  ASSERT_EQ(foreign.code(), absl::StatusCode::kFailedPrecondition) << foreign;
  EXPECT_THAT(std::string(foreign.message()),
              AllOf(HasSubstr(made), HasSubstr("is owned by uid " + std::to_string(::geteuid()))));

  const std::string file = Write("file", "x", kOwnerReadWrite);
  EXPECT_EQ(MakeOwnedDirectory(file).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CheckOwnedDirectory((dir_ / "missing").string()).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace dta

#include "dispatcher/wal/wal.h"

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <zlib.h>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

// A replayed record, owning its payload.
using Record = std::pair<int, std::string>;

std::string RandomBytes(size_t n, std::mt19937& rng) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng() & 0xff);
  return s;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Writes a log file by hand, private as the log itself creates one (an existing log open to others
// is refused).
void WriteFile(const std::string& path, std::string_view bytes) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write);
}

int64_t RecordBytes(const Record& r) { return kWalHeaderBytes + r.second.size(); }
// What one Append of `r` adds to the file: a group header, then the record.
int64_t AppendedBytes(const Record& r) { return kWalGroupHeaderBytes + RecordBytes(r); }

class WalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) / absl::StrCat("wal_test_", getpid(), "_", info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    path_ = (dir_ / "log.wal").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  WalOptions Options(bool sync = true) const {
    WalOptions options;
    options.path = path_;
    options.sync = sync;
    return options;
  }

  // Opens the log, collecting what it replays into `replayed`.
  static absl::StatusOr<std::unique_ptr<WriteAheadLog>> OpenCollect(const WalOptions& options,
                                                                    std::vector<Record>& replayed) {
    replayed.clear();
    return WriteAheadLog::Open(options, [&](const WalRecord& r) {
      replayed.emplace_back(r.type, std::string(r.payload));
      return absl::OkStatus();
    });
  }

  static void AppendAll(WriteAheadLog& wal, const std::vector<Record>& records) {
    for (const Record& r : records) ASSERT_TRUE(wal.Append(r.first, r.second).ok());
  }

  std::vector<std::string> DirEntries() const {
    std::vector<std::string> names;
    for (const fs::directory_entry& e : fs::directory_iterator(dir_)) {
      names.push_back(e.path().filename().string());
    }
    return names;
  }

  fs::path dir_;
  std::string path_;
};

// The log holds every trajectory: its owner alone may read it, when created and after a rewrite
// replaces the file; an existing log open to others is refused, not silently tightened (others may
// have read it meanwhile), and so is a symbolic link in the log's place.
TEST_F(WalTest, TheLogIsPrivateToItsOwner) {
  auto mode = [&] { return fs::status(path_).permissions() & fs::perms::all; };
  const fs::perms owner = fs::perms::owner_read | fs::perms::owner_write;
  std::vector<Record> replayed;
  {
    auto wal = OpenCollect(Options(), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    EXPECT_EQ(mode(), owner);
    ASSERT_TRUE((*wal)->Append(1, "x").ok());
    ASSERT_TRUE((*wal)->Rewrite({}).ok());
    EXPECT_EQ(mode(), owner);
  }
  fs::permissions(path_, owner | fs::perms::group_read | fs::perms::others_read);
  auto loose = OpenCollect(Options(), replayed);
  ASSERT_EQ(loose.status().code(), absl::StatusCode::kFailedPrecondition) << loose.status();
  EXPECT_THAT(std::string(loose.status().message()),
              ::testing::AllOf(::testing::HasSubstr(path_), ::testing::HasSubstr("mode 0644"),
                               ::testing::HasSubstr("chmod 600")));
  fs::permissions(path_, owner);
  EXPECT_TRUE(OpenCollect(Options(), replayed).ok());

  fs::rename(path_, path_ + ".real");
  fs::create_symlink(path_ + ".real", path_);
  auto link = OpenCollect(Options(), replayed);
  EXPECT_EQ(link.status().code(), absl::StatusCode::kFailedPrecondition) << link.status();
}

// Another local user who creates the log's file first (in a shared directory such as /tmp) must
// not end up owning, and so reading, every trajectory: the dispatcher refuses it, naming the owner.
TEST_F(WalTest, ALogAnotherUserCreatedIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to create a file owned by another user";
  { std::ofstream(path_) << ""; }
  fs::permissions(path_, fs::perms::owner_read | fs::perms::owner_write);
  ASSERT_EQ(chown(path_.c_str(), 65534, 65534), 0);
  std::vector<Record> replayed;
  auto wal = OpenCollect(Options(), replayed);
  ASSERT_EQ(wal.status().code(), absl::StatusCode::kFailedPrecondition) << wal.status();
  EXPECT_THAT(std::string(wal.status().message()),
              ::testing::AllOf(::testing::HasSubstr(path_), ::testing::HasSubstr("uid 65534"),
                               ::testing::HasSubstr("mode 0600")));
}

TEST_F(WalTest, RoundTripOddSizes) {
  std::mt19937 rng(7);
  std::vector<Record> written;
  int64_t bytes = 0;
  for (int round = 0; round < 2; ++round) {
    for (size_t size : {0, 1, 3, 7, 19, 733, 100000}) {
      written.emplace_back(static_cast<int>(rng() % 256), RandomBytes(size, rng));
      bytes += AppendedBytes(written.back());
    }
  }
  {
    std::vector<Record> replayed;
    auto wal = OpenCollect(Options(), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    EXPECT_TRUE(replayed.empty());
    AppendAll(**wal, written);
    EXPECT_EQ((*wal)->file_bytes(), bytes);
    EXPECT_EQ((*wal)->records_appended(), static_cast<int64_t>(written.size()));
    EXPECT_EQ((*wal)->syncs_performed(), static_cast<int64_t>(written.size()));
  }
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(path_)), bytes);

  std::vector<Record> replayed;
  {
    auto wal = OpenCollect(Options(), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    EXPECT_THAT(replayed, ElementsAreArray(written));
    EXPECT_EQ((*wal)->records_replayed(), static_cast<int64_t>(written.size()));
    EXPECT_EQ((*wal)->truncated_tail_bytes(), 0);
    EXPECT_EQ((*wal)->file_bytes(), bytes);
    // Appends after a reopen continue the log.
    std::vector<Record> more = {{3, "after reopen"}, {0, ""}, {255, RandomBytes(19, rng)}};
    AppendAll(**wal, more);
    written.insert(written.end(), more.begin(), more.end());
  }
  auto wal = OpenCollect(Options(), replayed);
  ASSERT_TRUE(wal.ok()) << wal.status();
  EXPECT_THAT(replayed, ElementsAreArray(written));
}

TEST_F(WalTest, TornTailAtEveryOffsetIsTruncated) {
  std::mt19937 rng(19);
  const std::vector<Record> kept = {{1, RandomBytes(7, rng)}, {2, ""}, {3, RandomBytes(733, rng)}};
  const Record last = {4, RandomBytes(100, rng)};
  {
    std::vector<Record> replayed;
    auto wal = OpenCollect(Options(/*sync=*/false), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    AppendAll(**wal, kept);
    AppendAll(**wal, {last});
  }
  const std::string full = ReadFile(path_);
  // The last Append's group, from its header on: a cut anywhere in it drops all of it.
  const int64_t last_start = static_cast<int64_t>(full.size()) - AppendedBytes(last);

  for (int64_t cut = last_start + 1; cut < static_cast<int64_t>(full.size()); ++cut) {
    SCOPED_TRACE(absl::StrCat("cut at ", cut));
    WriteFile(path_, std::string_view(full).substr(0, cut));
    // Every 16th cut goes through the durable path (ftruncate + fsync); the rest skip the syncs.
    const bool sync = (cut - last_start) % 16 == 1;
    std::vector<Record> replayed;
    {
      auto wal = OpenCollect(Options(sync), replayed);
      ASSERT_TRUE(wal.ok()) << wal.status();
      EXPECT_THAT(replayed, ElementsAreArray(kept));
      EXPECT_EQ((*wal)->truncated_tail_bytes(), cut - last_start);
      EXPECT_EQ((*wal)->file_bytes(), last_start);
      EXPECT_EQ(static_cast<int64_t>(fs::file_size(path_)), last_start);
      ASSERT_TRUE((*wal)->Append(9, "new tail").ok());
    }
    auto wal = OpenCollect(Options(sync), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    std::vector<Record> expected = kept;
    expected.emplace_back(9, "new tail");
    EXPECT_THAT(replayed, ElementsAreArray(expected));
    EXPECT_EQ((*wal)->truncated_tail_bytes(), 0);
  }
}

TEST_F(WalTest, FlippedByteInLastRecordIsTornTail) {
  std::mt19937 rng(3);
  const std::vector<Record> records = {{1, RandomBytes(19, rng)}, {2, RandomBytes(733, rng)}};
  {
    std::vector<Record> replayed;
    auto wal = OpenCollect(Options(), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    AppendAll(**wal, records);
  }
  const std::string full = ReadFile(path_);
  const int64_t last_start = AppendedBytes(records[0]);
  const int64_t record_start = last_start + kWalGroupHeaderBytes;
  // A payload byte, the type byte, and the first magic byte of the last record, and the group
  // header's count and magic.
  for (int64_t at : {record_start + kWalHeaderBytes + 500, record_start + 8, record_start,
                     last_start + kWalHeaderBytes, last_start}) {
    SCOPED_TRACE(absl::StrCat("flip at ", at));
    std::string damaged = full;
    damaged[at] ^= 0x20;
    WriteFile(path_, damaged);
    std::vector<Record> replayed;
    auto wal = OpenCollect(Options(), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    EXPECT_THAT(replayed, ElementsAreArray({records[0]}));
    EXPECT_EQ((*wal)->truncated_tail_bytes(), AppendedBytes(records[1]));
  }
}

TEST_F(WalTest, FlippedByteInMiddleRecordIsDataLoss) {
  std::mt19937 rng(5);
  std::vector<Record> records;
  for (size_t size : {3, 7, 19, 733, 1}) records.emplace_back(1, RandomBytes(size, rng));
  {
    std::vector<Record> replayed;
    auto wal = OpenCollect(Options(), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    AppendAll(**wal, records);
  }
  const std::string full = ReadFile(path_);
  // The third record, after its group header.
  const int64_t bad = AppendedBytes(records[0]) + AppendedBytes(records[1]) + kWalGroupHeaderBytes;
  // A payload byte; the length's low byte (checksum mismatch); its third byte (the record now
  // runs past the end of the file); its top byte (beyond max_record_bytes).
  for (auto [at, mask] : {std::pair{bad + kWalHeaderBytes + 5, 0x01}, std::pair{bad + 4, 0x01},
                          std::pair{bad + 6, 0x01}, std::pair{bad + 7, 0x80}}) {
    SCOPED_TRACE(absl::StrCat("flip at ", at));
    std::string damaged = full;
    damaged[at] ^= mask;
    WriteFile(path_, damaged);
    std::vector<Record> replayed;
    auto wal = OpenCollect(Options(), replayed);
    ASSERT_FALSE(wal.ok());
    EXPECT_EQ(wal.status().code(), absl::StatusCode::kDataLoss) << wal.status();
    EXPECT_THAT(std::string(wal.status().message()), HasSubstr(path_));
    EXPECT_THAT(std::string(wal.status().message()), HasSubstr(absl::StrCat("byte offset ", bad)));
    EXPECT_EQ(ReadFile(path_), damaged);  // nothing truncated
  }
}

// Power loss during a group's write: its pages may reach the disk in any order, so a later page
// can survive an earlier one. The group was never acknowledged (its sync never returned): it goes
// as a whole, and the records of earlier (synced) groups stay.
TEST_F(WalTest, ATornGroupGoesWholeWhateverPagesSurvived) {
  std::mt19937 rng(23);
  const std::vector<Record> synced = {{1, RandomBytes(100, rng)}, {2, RandomBytes(5000, rng)}};
  std::vector<Record> torn;
  for (int i = 0; i < 5; ++i) torn.emplace_back(7, RandomBytes(3000, rng));
  {
    std::vector<Record> replayed;
    auto wal = OpenCollect(Options(/*sync=*/false), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    AppendAll(**wal, synced);
    std::vector<WalRecord> batch;
    for (const Record& r : torn) batch.push_back({static_cast<uint8_t>(r.first), r.second});
    ASSERT_TRUE((*wal)->AppendBatch(batch).ok());
  }
  const std::string full = ReadFile(path_);
  const int64_t group = AppendedBytes(synced[0]) + AppendedBytes(synced[1]);
  const int64_t second = group + kWalGroupHeaderBytes + RecordBytes(torn[0]);
  struct Loss {
    const char* name;
    int64_t from, bytes;
  };
  for (const Loss& loss :
       {Loss{"the group header", group, kWalGroupHeaderBytes},
        Loss{"the header's page", group, 4096}, Loss{"a page in the middle", second + 100, 4096},
        Loss{"the second record's header", second, kWalHeaderBytes},
        Loss{"the group's end", static_cast<int64_t>(full.size()) - 10, 10}}) {
    SCOPED_TRACE(loss.name);
    std::string damaged = full;
    std::fill(damaged.begin() + loss.from, damaged.begin() + loss.from + loss.bytes, '\0');
    WriteFile(path_, damaged);
    std::vector<Record> replayed;
    {
      auto wal = OpenCollect(Options(), replayed);
      ASSERT_TRUE(wal.ok()) << wal.status();
      EXPECT_THAT(replayed, ElementsAreArray(synced));
      EXPECT_EQ((*wal)->truncated_tail_bytes(), static_cast<int64_t>(full.size()) - group);
      EXPECT_EQ(static_cast<int64_t>(fs::file_size(path_)), group);
      ASSERT_TRUE((*wal)->Append(9, "after").ok());
    }
    auto wal = OpenCollect(Options(), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    std::vector<Record> expected = synced;
    expected.emplace_back(9, "after");
    EXPECT_THAT(replayed, ElementsAreArray(expected));
  }
  // The same damage to a group that a later group follows is acknowledged data: refused.
  std::string damaged = full;
  const int64_t first_group_record = kWalGroupHeaderBytes;
  std::fill(damaged.begin() + first_group_record, damaged.begin() + first_group_record + 20, '\0');
  WriteFile(path_, damaged);
  std::vector<Record> replayed;
  auto wal = OpenCollect(Options(), replayed);
  EXPECT_EQ(wal.status().code(), absl::StatusCode::kDataLoss) << wal.status();
  EXPECT_THAT(std::string(wal.status().message()),
              HasSubstr(absl::StrCat("corrupt record at byte offset ", first_group_record)));
  EXPECT_THAT(std::string(wal.status().message()),
              HasSubstr(absl::StrCat("valid record at byte offset ", AppendedBytes(synced[0]))));
  // And so is a damaged group header that a later group follows.
  damaged = full;
  std::fill(damaged.begin() + AppendedBytes(synced[0]),
            damaged.begin() + AppendedBytes(synced[0]) + 8, '\0');
  WriteFile(path_, damaged);
  EXPECT_EQ(OpenCollect(Options(), replayed).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ReadFile(path_), damaged);  // nothing truncated
}

// A log written before group headers (plain records back to back) still opens, takes appends,
// and refuses to drop a damaged record that valid ones follow.
TEST_F(WalTest, ALogWithoutGroupHeadersStillOpens) {
  const std::vector<Record> old = {{1, "first"}, {2, std::string(300, 'x')}, {3, "third"}};
  std::string bytes;
  for (const Record& r : old) {
    char header[kWalHeaderBytes];
    const uint32_t fields[] = {kWalMagic, static_cast<uint32_t>(r.second.size())};
    for (int i = 0; i < 8; ++i) header[i] = static_cast<char>(fields[i / 4] >> (8 * (i % 4)));
    header[8] = static_cast<char>(r.first);
    uLong crc = crc32(0L, Z_NULL, 0);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(header + 8), 1);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(header + 4), 4);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(r.second.data()),
                static_cast<uInt>(r.second.size()));
    for (int i = 0; i < 4; ++i) header[9 + i] = static_cast<char>(crc >> (8 * i));
    bytes.append(header, kWalHeaderBytes);
    bytes.append(r.second);
  }
  WriteFile(path_, bytes);
  std::vector<Record> replayed;
  {
    auto wal = OpenCollect(Options(), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    EXPECT_THAT(replayed, ElementsAreArray(old));
    ASSERT_TRUE((*wal)->Append(4, "new").ok());
  }
  std::vector<Record> expected = old;
  expected.emplace_back(4, "new");
  {
    auto wal = OpenCollect(Options(), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    EXPECT_THAT(replayed, ElementsAreArray(expected));
  }
  std::string damaged = ReadFile(path_);
  damaged[RecordBytes(old[0]) + kWalHeaderBytes + 10] ^= 1;
  WriteFile(path_, damaged);
  EXPECT_EQ(OpenCollect(Options(), replayed).status().code(), absl::StatusCode::kDataLoss);
}

TEST_F(WalTest, OversizedRecords) {
  WalOptions options = Options();
  options.max_record_bytes = 100;
  std::vector<Record> replayed;
  {
    auto wal = OpenCollect(options, replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    absl::Status s = (*wal)->Append(1, std::string(101, 'x'));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(path_));
    const std::string big(101, 'y');
    const WalRecord batch[] = {{1, "fine"}, {2, big}};
    EXPECT_EQ((*wal)->AppendBatch(batch).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ((*wal)->file_bytes(), 0);  // nothing of the batch was written
    ASSERT_TRUE((*wal)->Append(1, std::string(100, 'z')).ok());
    EXPECT_EQ((*wal)->records_appended(), 1);
  }
  // An intact record above a lowered limit is not cut off as a torn tail.
  options.max_record_bytes = 50;
  auto wal = OpenCollect(options, replayed);
  EXPECT_EQ(wal.status().code(), absl::StatusCode::kFailedPrecondition) << wal.status();
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(path_)),
            kWalGroupHeaderBytes + kWalHeaderBytes + 100);
  options.max_record_bytes = 100;
  wal = OpenCollect(options, replayed);
  ASSERT_TRUE(wal.ok()) << wal.status();
  EXPECT_THAT(replayed, ElementsAreArray({Record{1, std::string(100, 'z')}}));
}

TEST_F(WalTest, ReplayErrorAbortsOpen) {
  const std::vector<Record> records = {{1, "a"}, {2, "b"}, {3, "c"}};
  std::vector<Record> replayed;
  {
    auto wal = OpenCollect(Options(), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    AppendAll(**wal, records);
  }
  int calls = 0;
  auto wal = WriteAheadLog::Open(Options(), [&](const WalRecord& r) {
    ++calls;
    return r.payload == "b" ? absl::AbortedError("bad state") : absl::OkStatus();
  });
  EXPECT_EQ(wal.status(), absl::AbortedError("bad state"));
  EXPECT_EQ(calls, 2);
  wal = OpenCollect(Options(), replayed);  // the failed Open released the file and changed nothing
  ASSERT_TRUE(wal.ok()) << wal.status();
  EXPECT_THAT(replayed, ElementsAreArray(records));
}

TEST_F(WalTest, GroupCommitSharesSyncs) {
  constexpr int kThreads = 16;
  constexpr int kAppends = 40;
  std::vector<Record> replayed;
  {
    auto wal = OpenCollect(Options(/*sync=*/true), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    std::atomic<int> failures{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kAppends; ++i) {
          if (!(*wal)->Append(t, absl::StrCat(t, ":", i)).ok()) ++failures;
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    EXPECT_EQ(failures.load(), 0);
    EXPECT_EQ((*wal)->records_appended(), kThreads * kAppends);
    EXPECT_GT((*wal)->syncs_performed(), 0);
    EXPECT_LT((*wal)->syncs_performed(), kThreads * kAppends);

    // A batch is one write and one sync.
    const int64_t syncs = (*wal)->syncs_performed();
    const WalRecord batch[] = {{100, "x"}, {100, ""}, {100, "yz"}};
    ASSERT_TRUE((*wal)->AppendBatch(batch).ok());
    EXPECT_EQ((*wal)->syncs_performed(), syncs + 1);
    EXPECT_TRUE((*wal)->AppendBatch({}).ok());
    EXPECT_EQ((*wal)->syncs_performed(), syncs + 1);
  }
  auto wal = OpenCollect(Options(), replayed);
  ASSERT_TRUE(wal.ok()) << wal.status();
  ASSERT_EQ(replayed.size(), static_cast<size_t>(kThreads * kAppends + 3));
  // Every record exactly once, each thread's records in the order it appended them.
  std::vector<int> next(kThreads, 0);
  for (size_t i = 0; i < kThreads * kAppends; ++i) {
    const auto& [type, payload] = replayed[i];
    ASSERT_LT(type, kThreads);
    EXPECT_EQ(payload, absl::StrCat(type, ":", next[type]++));
  }
  EXPECT_THAT(next, ::testing::Each(kAppends));
  EXPECT_THAT(std::vector<Record>(replayed.end() - 3, replayed.end()),
              ElementsAreArray({Record{100, "x"}, Record{100, ""}, Record{100, "yz"}}));
}

TEST_F(WalTest, RewriteKeepsExactlyTheLiveRecords) {
  std::mt19937 rng(11);
  std::vector<Record> all;
  for (int i = 0; i < 10; ++i) all.emplace_back(i, RandomBytes(rng() % 50, rng));
  std::vector<Record> live;
  for (int i = 0; i < 10; i += 3) live.push_back(all[i]);
  std::vector<Record> replayed;
  {
    auto wal = OpenCollect(Options(), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    AppendAll(**wal, all);
    std::vector<WalRecord> views;
    int64_t live_bytes = kWalGroupHeaderBytes;  // a rewrite is one group
    for (const Record& r : live) {
      views.push_back({static_cast<uint8_t>(r.first), r.second});
      live_bytes += RecordBytes(r);
    }
    ASSERT_TRUE((*wal)->Rewrite(views).ok());
    EXPECT_EQ((*wal)->file_bytes(), live_bytes);
    EXPECT_THAT(DirEntries(), ElementsAreArray({"log.wal"}));  // no temp file left
    ASSERT_TRUE((*wal)->Append(42, "after rewrite").ok());
    EXPECT_EQ((*wal)->file_bytes(), live_bytes + kWalGroupHeaderBytes + kWalHeaderBytes + 13);
  }
  live.emplace_back(42, "after rewrite");
  {
    auto wal = OpenCollect(Options(), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    EXPECT_THAT(replayed, ElementsAreArray(live));
    ASSERT_TRUE((*wal)->Rewrite({}).ok());  // everything consumed
  }
  auto wal = OpenCollect(Options(), replayed);
  ASSERT_TRUE(wal.ok()) << wal.status();
  EXPECT_TRUE(replayed.empty());
}

TEST_F(WalTest, RewriteFromASourceWritesRecordsAsTheyCome) {
  // More bytes than one write buffer (kMaxGroupBytes), each payload built in the shared scratch.
  std::mt19937 rng(5);
  std::vector<Record> live;
  for (int i = 0; i < 40; ++i) live.emplace_back(i % 7, RandomBytes(rng() % (1 << 20), rng));
  std::vector<Record> replayed;
  {
    auto wal = OpenCollect(Options(/*sync=*/false), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    AppendAll(**wal, {{1, "consumed"}, {2, "consumed too"}});
    size_t next = 0;
    int64_t live_bytes = kWalGroupHeaderBytes;  // a rewrite is one group
    ASSERT_TRUE(
        (*wal)
            ->RewriteFrom([&](WalRecord& record, std::string& scratch) -> absl::StatusOr<bool> {
              if (next == live.size()) return false;
              scratch = live[next].second;
              record = {static_cast<uint8_t>(live[next].first), scratch};
              live_bytes += RecordBytes(live[next++]);
              return true;
            })
            .ok());
    EXPECT_EQ((*wal)->file_bytes(), live_bytes);
  }
  {
    auto wal = OpenCollect(Options(/*sync=*/false), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    EXPECT_THAT(replayed, ElementsAreArray(live));
  }
  // A record over the limit abandons the rewrite: the log keeps what it had and takes appends.
  WalOptions small = Options(/*sync=*/false);
  small.max_record_bytes = 1 << 20;
  {
    auto wal = OpenCollect(small, replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    int calls = 0;
    const std::string big(small.max_record_bytes + 1, 'x');
    const absl::Status status =
        (*wal)->RewriteFrom([&](WalRecord& record, std::string&) -> absl::StatusOr<bool> {
          record = {9, ++calls == 3 ? std::string_view(big) : std::string_view("small")};
          return calls <= 3;
        });
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(status.message(), HasSubstr("record 2 has"));
    EXPECT_THAT(DirEntries(), ElementsAreArray({"log.wal"}));  // the temp file is gone
    // So does an error of the source, unchanged.
    calls = 0;
    const absl::Status source_error =
        (*wal)->RewriteFrom([&](WalRecord& record, std::string&) -> absl::StatusOr<bool> {
          if (++calls == 2) return absl::InternalError("the state changed");
          record = {9, "small"};
          return true;
        });
    EXPECT_EQ(source_error, absl::InternalError("the state changed"));
    EXPECT_THAT(DirEntries(), ElementsAreArray({"log.wal"}));
    ASSERT_TRUE((*wal)->Append(3, "after").ok());
  }
  live.emplace_back(3, "after");
  auto wal = OpenCollect(small, replayed);
  ASSERT_TRUE(wal.ok()) << wal.status();
  EXPECT_THAT(replayed, ElementsAreArray(live));
}

TEST_F(WalTest, RewriteExcludesConcurrentAppends) {
  constexpr int kThreads = 4;
  constexpr int kAppends = 50;
  const std::vector<WalRecord> live = {{200, "live 0"}, {200, "live 1"}};
  std::vector<Record> replayed;
  {
    auto wal = OpenCollect(Options(/*sync=*/false), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kAppends; ++i) {
          EXPECT_TRUE((*wal)->Append(t, absl::StrCat(t, ":", i)).ok());
        }
      });
    }
    for (int i = 0; i < 5; ++i) EXPECT_TRUE((*wal)->Rewrite(live).ok());
    for (std::thread& thread : threads) thread.join();
  }
  // The log is well formed: the last rewrite's records, then appends that followed it, each
  // thread's in order and without duplicates.
  auto wal = OpenCollect(Options(), replayed);
  ASSERT_TRUE(wal.ok()) << wal.status();
  EXPECT_EQ((*wal)->truncated_tail_bytes(), 0);
  ASSERT_GE(replayed.size(), 2u);
  EXPECT_EQ(replayed[0], Record(200, "live 0"));
  EXPECT_EQ(replayed[1], Record(200, "live 1"));
  std::vector<int> last(kThreads, -1);
  for (size_t i = 2; i < replayed.size(); ++i) {
    const auto& [type, payload] = replayed[i];
    ASSERT_LT(type, kThreads);
    const int index = std::stoi(payload.substr(payload.find(':') + 1));
    EXPECT_GT(index, last[type]);
    last[type] = index;
  }
}

TEST_F(WalTest, OpenRemovesStaleTempFile) {
  WriteFile(path_ + ".tmp", "half a rewrite");
  std::vector<Record> replayed;
  auto wal = OpenCollect(Options(), replayed);
  ASSERT_TRUE(wal.ok()) << wal.status();
  EXPECT_THAT(DirEntries(), ElementsAreArray({"log.wal"}));
}

TEST_F(WalTest, OpenErrorsNameThePath) {
  std::vector<Record> replayed;
  WalOptions options = Options();
  options.path = (dir_ / "no_such_dir" / "log.wal").string();
  auto wal = OpenCollect(options, replayed);
  EXPECT_EQ(wal.status().code(), absl::StatusCode::kNotFound) << wal.status();
  EXPECT_THAT(std::string(wal.status().message()), HasSubstr(options.path));

  options.path = "";
  EXPECT_EQ(OpenCollect(options, replayed).status().code(), absl::StatusCode::kInvalidArgument);

  options.path = dir_.string();  // a directory
  wal = OpenCollect(options, replayed);
  EXPECT_FALSE(wal.ok());
  EXPECT_THAT(std::string(wal.status().message()), HasSubstr(options.path));

  // A second opener of the same log is refused while the first holds it.
  auto first = OpenCollect(Options(), replayed);
  ASSERT_TRUE(first.ok()) << first.status();
  wal = OpenCollect(Options(), replayed);
  EXPECT_EQ(wal.status().code(), absl::StatusCode::kFailedPrecondition) << wal.status();
  EXPECT_THAT(std::string(wal.status().message()), HasSubstr(path_));
  first->reset();
  EXPECT_TRUE(OpenCollect(Options(), replayed).ok());
}

TEST_F(WalTest, FailedWriteIsStickyAndRecoverable) {
  std::vector<Record> replayed;
  {
    auto wal = OpenCollect(Options(), replayed);
    ASSERT_TRUE(wal.ok()) << wal.status();
    ASSERT_TRUE((*wal)->Append(1, "durable").ok());

    // Let the file grow by only 20 more bytes: the next write is cut short, then fails (EFBIG).
    rlimit old_limit;
    ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old_limit), 0);
    rlimit limit = old_limit;
    limit.rlim_cur = (*wal)->file_bytes() + 20;
    sighandler_t old_handler = signal(SIGXFSZ, SIG_IGN);
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &limit), 0);
    absl::Status s = (*wal)->Append(2, std::string(100, 'x'));
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old_limit), 0);
    signal(SIGXFSZ, old_handler);

    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(path_));
    // The log stays failed: no later append may claim durability.
    EXPECT_EQ((*wal)->Append(3, "later"), s);
    EXPECT_EQ((*wal)->records_appended(), 1);
  }
  auto wal = OpenCollect(Options(), replayed);
  ASSERT_TRUE(wal.ok()) << wal.status();
  EXPECT_THAT(replayed, ElementsAreArray({Record{1, "durable"}}));
  EXPECT_EQ((*wal)->truncated_tail_bytes(), 20);
}

}  // namespace
}  // namespace dta

#include "dispatcher/wal/wal.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/absl_string_view.h"
#include "core/base/private_files.h"
#include "core/base/status_macros.h"
#include "core/base/unique_fd.h"

namespace dta {
namespace {

// A group commit stops growing past this many bytes, so one large batch does not hold many small
// appenders behind a long write (the leader's own records always go in).
constexpr size_t kMaxGroupBytes = 4u << 20;
// Open reads the file through a window of at least this size.
constexpr size_t kReadChunk = 1u << 20;

// Code chosen by what the caller can do: fix the path, fix permissions, or retry later.
absl::Status ErrnoError(int err, std::string_view path, std::string_view what) {
  std::string message = absl::StrCat("wal ", AsAbsl(path), ": ", AsAbsl(what), ": ", strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    default:
      return absl::UnavailableError(message);
  }
}

void PutU32(char* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

uint32_t GetU32(const char* in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<unsigned char>(in[i])} << (8 * i);
  return v;
}

// CRC-32 over the type byte, the little-endian length and then the payload, possibly fed in
// pieces: RecordCrcStart, then RecordCrcExtend for each piece of the payload.
uLong RecordCrcStart(uint8_t type, uint32_t length) {
  char length_le[4];
  PutU32(length_le, length);
  const Bytef type_byte = type;
  uLong crc = crc32(0L, Z_NULL, 0);
  crc = crc32(crc, &type_byte, 1);
  return crc32(crc, reinterpret_cast<const Bytef*>(length_le), 4);
}

uLong RecordCrcExtend(uLong crc, std::string_view piece) {
  return crc32(crc, reinterpret_cast<const Bytef*>(piece.data()), static_cast<uInt>(piece.size()));
}

uint32_t RecordCrc(uint8_t type, std::string_view payload) {
  return static_cast<uint32_t>(
      RecordCrcExtend(RecordCrcStart(type, static_cast<uint32_t>(payload.size())), payload));
}

size_t EncodedSize(absl::Span<const WalRecord> records) {
  size_t bytes = 0;
  for (const WalRecord& r : records) bytes += kWalHeaderBytes + r.payload.size();
  return bytes;
}

void EncodeWithMagic(uint32_t magic, const WalRecord& record, std::string& out) {
  char header[kWalHeaderBytes];
  PutU32(header, magic);
  PutU32(header + 4, static_cast<uint32_t>(record.payload.size()));
  header[8] = static_cast<char>(record.type);
  PutU32(header + 9, RecordCrc(record.type, record.payload));
  out.append(header, kWalHeaderBytes);
  out.append(record.payload.data(), record.payload.size());
}

void EncodeRecord(const WalRecord& record, std::string& out) {
  EncodeWithMagic(kWalMagic, record, out);
}

// The header of a group commit whose records take `bytes` bytes after it.
void EncodeGroupHeader(uint64_t bytes, std::string& out) {
  char count[8];
  PutU32(count, static_cast<uint32_t>(bytes));
  PutU32(count + 4, static_cast<uint32_t>(bytes >> 32));
  EncodeWithMagic(kWalGroupMagic, WalRecord{0, std::string_view(count, 8)}, out);
}

absl::Status CheckSize(const WalRecord& record, size_t index, const WalOptions& options) {
  if (record.payload.size() <= options.max_record_bytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("wal ", options.path, ": record ", index, " has ", record.payload.size(),
                   " bytes, more than max_record_bytes = ", options.max_record_bytes));
}

absl::Status CheckSizes(absl::Span<const WalRecord> records, const WalOptions& options) {
  for (size_t i = 0; i < records.size(); ++i) {
    RETURN_IF_ERROR(CheckSize(records[i], i, options));
  }
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, std::string_view bytes, int64_t offset, std::string_view path) {
  while (!bytes.empty()) {
    ssize_t n = pwrite(fd, bytes.data(), bytes.size(), offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, path, "write");
    }
    bytes.remove_prefix(n);
    offset += n;
  }
  return absl::OkStatus();
}

absl::Status SyncDirectoryOf(const std::string& path) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  UniqueFd fd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    return ErrnoError(err, path, absl::StrCat("open directory ", dir));
  }
  if (fsync(fd.get()) != 0) {
    const int err = errno;
    return ErrnoError(err, path, absl::StrCat("fsync directory ", dir));
  }
  return absl::OkStatus();
}

// Reads the file through a buffer: Get returns views into it, valid until the next Get.
class FileWindow {
 public:
  FileWindow(int fd, int64_t file_size, std::string_view path)
      : fd_(fd), file_size_(file_size), path_(path) {}

  // [offset, offset + n) must lie within the file.
  absl::StatusOr<std::string_view> Get(int64_t offset, size_t n) {
    if (offset < start_ ||
        offset + static_cast<int64_t>(n) > start_ + static_cast<int64_t>(buf_.size())) {
      size_t want = std::min<int64_t>(std::max(n, kReadChunk), file_size_ - offset);
      buf_.resize(want);
      size_t got = 0;
      while (got < want) {
        ssize_t r = pread(fd_, buf_.data() + got, want - got, offset + got);
        if (r < 0) {
          if (errno == EINTR) continue;
          return ErrnoError(errno, path_, "read");
        }
        if (r == 0) {
          return absl::UnavailableError(
              absl::StrCat("wal ", AsAbsl(path_), ": file shrank while being read"));
        }
        got += r;
      }
      start_ = offset;
    }
    return std::string_view(buf_.data() + (offset - start_), n);
  }

 private:
  int fd_;
  int64_t file_size_;
  std::string_view path_;
  std::string buf_;
  int64_t start_ = 0;
};

struct ParsedRecord {
  std::string error;  // empty if the record is valid
  WalRecord record;   // valid only until the window is read again
  int64_t next = 0;   // offset of the following record
  bool group_header = false;
  uint64_t group_bytes = 0;  // a group header's: its records' bytes, from `next` on
};

absl::StatusOr<ParsedRecord> ParseAt(FileWindow& window, int64_t offset, int64_t file_size,
                                     uint32_t max_record_bytes, std::string_view path) {
  ParsedRecord parsed;
  const int64_t left = file_size - offset;
  if (left < kWalHeaderBytes) {
    parsed.error = absl::StrCat("incomplete header (", left, " bytes left)");
    return parsed;
  }
  absl::StatusOr<std::string_view> header = window.Get(offset, kWalHeaderBytes);
  if (!header.ok()) return header.status();
  const uint32_t magic = GetU32(header->data());
  const uint32_t length = GetU32(header->data() + 4);
  const uint8_t type = static_cast<uint8_t>((*header)[8]);
  const uint32_t crc = GetU32(header->data() + 9);
  if (magic != kWalMagic && magic != kWalGroupMagic) {
    parsed.error = "bad magic";
    return parsed;
  }
  parsed.group_header = magic == kWalGroupMagic;
  if (parsed.group_header && (type != 0 || length != 8)) {
    parsed.error = "bad group header";
    return parsed;
  }
  if (length > max_record_bytes) {
    // Usually a corrupt length field; but an intact record means the limit was lowered since it
    // was written, and cutting it off as a torn tail would drop acknowledged data.
    if (kWalHeaderBytes + int64_t{length} <= left) {
      uLong streamed = RecordCrcStart(type, length);
      for (int64_t done = 0; done < length;) {
        const size_t n = std::min<int64_t>(kReadChunk, length - done);
        absl::StatusOr<std::string_view> piece = window.Get(offset + kWalHeaderBytes + done, n);
        if (!piece.ok()) return piece.status();
        streamed = RecordCrcExtend(streamed, *piece);
        done += n;
      }
      if (static_cast<uint32_t>(streamed) == crc) {
        return absl::FailedPreconditionError(
            absl::StrCat("wal ", AsAbsl(path), ": the record at byte offset ", offset, " has ",
                         length, " bytes, more than max_record_bytes = ", max_record_bytes,
                         "; open the log with a larger max_record_bytes"));
      }
    }
    parsed.error = absl::StrCat("length ", length, " exceeds max_record_bytes ", max_record_bytes);
    return parsed;
  }
  if (kWalHeaderBytes + int64_t{length} > left) {
    parsed.error = absl::StrCat("incomplete record (", kWalHeaderBytes + int64_t{length},
                                " bytes, ", left, " left in the file)");
    return parsed;
  }
  absl::StatusOr<std::string_view> whole = window.Get(offset, kWalHeaderBytes + length);
  if (!whole.ok()) return whole.status();
  std::string_view payload = whole->substr(kWalHeaderBytes);
  if (RecordCrc(type, payload) != crc) {
    parsed.error = "checksum mismatch";
    return parsed;
  }
  parsed.record = WalRecord{type, payload};
  parsed.next = offset + kWalHeaderBytes + length;
  if (parsed.group_header) {
    parsed.group_bytes = uint64_t{GetU32(payload.data())} | uint64_t{GetU32(payload.data() + 4)}
                                                                << 32;
  }
  return parsed;
}

// The offset of the first valid record (or only group header) starting after `from`, or -1 if
// there is none.
absl::StatusOr<int64_t> FindValidRecordAfter(int fd, int64_t from, int64_t file_size,
                                             bool group_headers_only, uint32_t max_record_bytes,
                                             std::string_view path) {
  char magics[8];
  PutU32(magics, kWalMagic);
  PutU32(magics + 4, kWalGroupMagic);
  const std::string_view record_magic(magics, 4);
  const std::string_view group_magic(magics + 4, 4);
  // The next position of a magic looked for at or after `at`.
  auto find = [&](std::string_view chunk, size_t at) {
    const size_t group = chunk.find(group_magic, at);
    return group_headers_only ? group : std::min(group, chunk.find(record_magic, at));
  };
  FileWindow scan(fd, file_size, path);
  FileWindow verify(fd, file_size, path);
  int64_t pos = from + 1;
  while (file_size - pos >= kWalHeaderBytes) {
    const size_t n = std::min<int64_t>(kReadChunk, file_size - pos);
    absl::StatusOr<std::string_view> chunk = scan.Get(pos, n);
    if (!chunk.ok()) return chunk.status();
    for (size_t hit = find(*chunk, 0); hit != std::string_view::npos; hit = find(*chunk, hit + 1)) {
      absl::StatusOr<ParsedRecord> parsed =
          ParseAt(verify, pos + static_cast<int64_t>(hit), file_size, max_record_bytes, path);
      if (!parsed.ok()) return parsed.status();
      if (parsed->error.empty()) return pos + static_cast<int64_t>(hit);
    }
    constexpr size_t kMagicBytes = 4;  // both magics
    if (n < kMagicBytes) break;
    pos += n - (kMagicBytes - 1);  // a magic straddling two chunks is seen by the next one
  }
  return -1;
}

}  // namespace

struct WriteAheadLog::Writer {
  explicit Writer(absl::Span<const WalRecord> records)
      : records(records), bytes(EncodedSize(records)) {}
  explicit Writer(const RecordSource& source) : rewrite(&source) {}

  absl::Span<const WalRecord> records;  // an append's
  size_t bytes = 0;
  const RecordSource* rewrite = nullptr;  // a Rewrite's; it runs alone, never in a group
  bool done = false;
  absl::Status status;
  absl::CondVar cv;
};

absl::StatusOr<std::unique_ptr<WriteAheadLog>> WriteAheadLog::Open(const WalOptions& options,
                                                                   const ReplayFn& replay) {
  const std::string& path = options.path;
  if (path.empty()) return absl::InvalidArgumentError("wal: options.path is empty");
  if (!replay)
    return absl::InvalidArgumentError(absl::StrCat("wal ", path, ": no replay function"));

  // The log holds every trajectory (prompts, rewards): created readable by its owner only, and an
  // existing one is used only when it is this user's and closed to others (core/base/
  // private_files.h): a log another user planted in a shared directory, or one others could read
  // meanwhile, is refused rather than trusted or silently tightened.
  UniqueFd fd(open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (fd.get() < 0 && errno == EEXIST)
    fd = UniqueFd(open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC));
  if (fd.get() < 0 && errno == ELOOP) {
    return absl::FailedPreconditionError(
        absl::StrCat("wal ", path, ": a symbolic link; give the log's own path"));
  }
  if (fd.get() < 0) return ErrnoError(errno, path, "open");
  if (absl::Status s = CheckPrivateDescriptor(fd.get(), path); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("wal ", s.message()));
  }
  if (flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      return absl::FailedPreconditionError(
          absl::StrCat("wal ", path, ": already open by another WriteAheadLog (flock held)"));
    }
    return ErrnoError(errno, path, "flock");
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return ErrnoError(errno, path, "fstat");
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("wal ", path, ": not a regular file"));
  }
  // A crash during Rewrite leaves the temp file; the log itself is intact (old or new).
  const std::string tmp = path + ".tmp";
  if (unlink(tmp.c_str()) != 0 && errno != ENOENT) return ErrnoError(errno, tmp, "unlink");
  // The file may have just been created, or the previous creator crashed before its directory
  // entry was durable.
  if (options.sync) {
    absl::Status s = SyncDirectoryOf(path);
    if (!s.ok()) return s;
  }

  const int64_t file_size = st.st_size;
  FileWindow window(fd.get(), file_size, path);
  int64_t offset = 0;  // the end of what is replayed
  int64_t replayed = 0;
  std::string corruption;
  int64_t damage = 0;       // where the first bad record starts
  int64_t search_from = 0;  // a valid record beyond this one means acknowledged data is damaged
  // From here on the log is made of groups (appends of this version, a rewrite), so only a valid
  // group header proves that a later group was written, hence that a damaged one had been synced.
  int64_t grouped_from = -1;
  while (offset < file_size) {
    absl::StatusOr<ParsedRecord> parsed =
        ParseAt(window, offset, file_size, options.max_record_bytes, path);
    if (!parsed.ok()) return parsed.status();
    if (!parsed->error.empty()) {
      corruption = std::move(parsed->error);
      damage = search_from = offset;
      break;
    }
    if (!parsed->group_header) {  // a record of a rewrite (or of a log from before group headers)
      absl::Status s = replay(parsed->record);
      if (!s.ok()) return s;
      ++replayed;
      offset = parsed->next;
      continue;
    }
    // A group commit: every record must check out before any is replayed.
    if (grouped_from < 0) grouped_from = offset;
    const int64_t first = parsed->next;
    const int64_t end = parsed->group_bytes > static_cast<uint64_t>(file_size - first)
                            ? file_size + 1  // runs past the end of the file
                            : first + static_cast<int64_t>(parsed->group_bytes);
    int64_t at = first;
    while (at < end && at < file_size) {
      absl::StatusOr<ParsedRecord> record =
          ParseAt(window, at, file_size, options.max_record_bytes, path);
      if (!record.ok()) return record.status();
      if (record->error.empty() && record->group_header)
        record->error = "a group header inside a group";
      if (!record->error.empty()) {
        corruption = std::move(record->error);
        break;
      }
      at = record->next;
    }
    if (at != end) {  // torn: the whole group goes, from its header on
      if (corruption.empty()) {
        corruption =
            absl::StrCat("group of ", parsed->group_bytes, " bytes ends at byte offset ", at);
      }
      damage = at;
      search_from = std::min(end, file_size) - 1;
      break;
    }
    for (at = first; at < end;) {
      absl::StatusOr<ParsedRecord> record =
          ParseAt(window, at, file_size, options.max_record_bytes, path);
      if (!record.ok()) return record.status();
      absl::Status s = replay(record->record);
      if (!s.ok()) return s;
      ++replayed;
      at = record->next;
    }
    offset = end;
  }

  int64_t truncated = 0;
  if (offset < file_size) {
    absl::StatusOr<int64_t> valid = FindValidRecordAfter(
        fd.get(), search_from, file_size, grouped_from >= 0, options.max_record_bytes, path);
    if (!valid.ok()) return valid.status();
    if (*valid >= 0) {
      return absl::DataLossError(
          absl::StrCat("wal ", path, ": corrupt record at byte offset ", damage, " (", corruption,
                       ") followed by a valid record at byte offset ", *valid,
                       "; not truncating acknowledged data, repair or restore the log"));
    }
    // A torn tail: never acknowledged, so it is safe to cut.
    if (ftruncate(fd.get(), offset) != 0) return ErrnoError(errno, path, "ftruncate");
    if (options.sync && fsync(fd.get()) != 0) return ErrnoError(errno, path, "fsync");
    truncated = file_size - offset;
  }
  return std::unique_ptr<WriteAheadLog>(
      new WriteAheadLog(options, fd.release(), offset, replayed, truncated));
}

WriteAheadLog::WriteAheadLog(const WalOptions& options, int fd, int64_t size,
                             int64_t records_replayed, int64_t truncated_tail_bytes)
    : options_(options),
      fd_(fd),
      size_(size),
      records_replayed_(records_replayed),
      truncated_tail_bytes_(truncated_tail_bytes),
      file_bytes_(size) {}

WriteAheadLog::~WriteAheadLog() {
  // Nothing to report to: every acknowledged record is already durable.
  if (fd_ >= 0) close(fd_);
}

absl::Status WriteAheadLog::Append(uint8_t type, std::string_view payload) {
  const WalRecord record{type, payload};
  return AppendBatch(absl::MakeConstSpan(&record, 1));
}

absl::Status WriteAheadLog::AppendBatch(absl::Span<const WalRecord> records) {
  if (records.empty()) return absl::OkStatus();
  absl::Status s = CheckSizes(records, options_);
  if (!s.ok()) return s;
  Writer writer(records);
  return Commit(writer);
}

absl::Status WriteAheadLog::Rewrite(absl::Span<const WalRecord> live) {
  absl::Status s = CheckSizes(live, options_);
  if (!s.ok()) return s;
  size_t next = 0;
  return RewriteFrom([&](WalRecord& record, std::string&) -> absl::StatusOr<bool> {
    if (next == live.size()) return false;
    record = live[next++];
    return true;
  });
}

absl::Status WriteAheadLog::RewriteFrom(const RecordSource& live) {
  Writer writer(live);
  return Commit(writer);
}

// LevelDB's writer queue: the writer at the front leads, does the I/O for itself and the appends
// queued behind it with mu_ released (others keep queueing meanwhile and form the next group),
// then completes them and hands the lead to the next in line.
absl::Status WriteAheadLog::Commit(Writer& writer) {
  absl::MutexLock lock(&mu_);
  writers_.push_back(&writer);
  while (!writer.done && &writer != writers_.front()) writer.cv.Wait(&mu_);
  if (writer.done) return writer.status;

  Writer* last = &writer;
  int64_t group_records = 0;
  absl::Status status = failed_;
  if (status.ok() && writer.rewrite) {
    bool failed = false;
    mu_.Unlock();
    status = RewriteFile(*writer.rewrite, failed);
    mu_.Lock();
    file_bytes_ = size_;  // the old file's size unless the rename happened
    if (failed) failed_ = status;
  } else if (status.ok()) {
    size_t bytes = writer.bytes;
    for (size_t i = 1; i < writers_.size(); ++i) {
      Writer* next = writers_[i];
      if (next->rewrite || bytes + next->bytes > kMaxGroupBytes) break;
      bytes += next->bytes;
      last = next;
    }
    scratch_.clear();
    scratch_.reserve(kWalGroupHeaderBytes + bytes);
    EncodeGroupHeader(bytes, scratch_);
    for (Writer* w : writers_) {
      for (const WalRecord& r : w->records) {
        EncodeRecord(r, scratch_);
        ++group_records;
      }
      if (w == last) break;
    }
    bool synced = false;
    mu_.Unlock();
    status = WriteAndSync(scratch_, synced);
    mu_.Lock();
    if (synced) ++syncs_performed_;
    if (status.ok()) {
      file_bytes_ = size_;
      records_appended_ += group_records;
    } else {
      failed_ = status;
    }
    // Do not keep a large group's buffer for the life of the log.
    if (scratch_.capacity() > kMaxGroupBytes) std::string().swap(scratch_);
  }

  while (true) {
    Writer* done = writers_.front();
    writers_.pop_front();
    if (done != &writer) {
      done->status = status;
      done->done = true;
      done->cv.Signal();
    }
    if (done == last) break;
  }
  if (!writers_.empty()) writers_.front()->cv.Signal();
  return status;
}

absl::Status WriteAheadLog::WriteAndSync(std::string_view bytes, bool& synced) {
  const int64_t offset = size_;
  absl::Status s = WriteAll(fd_, bytes, offset, options_.path);
  if (!s.ok()) return s;  // UNAVAILABLE: the record was not (fully) written
  size_ = offset + static_cast<int64_t>(bytes.size());
  if (options_.sync) {
    synced = true;
    // After a failed fdatasync the kernel may have dropped the dirty pages and a retry would
    // wrongly succeed, so the failure is final (the log enters the failed state).
    if (fdatasync(fd_) != 0) {
      return absl::DataLossError(absl::StrCat("wal ", options_.path, ": fdatasync: ",
                                              strerror(errno), "; the log is unusable, reopen it"));
    }
  }
  return absl::OkStatus();
}

absl::Status WriteAheadLog::RewriteFile(const RecordSource& live, bool& failed) {
  const std::string tmp = options_.path + ".tmp";
  // A fresh file (O_EXCL, never a link): whatever stood under the temporary name goes first.
  if (unlink(tmp.c_str()) != 0 && errno != ENOENT) return ErrnoError(errno, tmp, "unlink");
  UniqueFd fd(open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (fd.get() < 0) return ErrnoError(errno, tmp, "open");
  // Until the rename, the old log is untouched: on failure drop the temp file and carry on.
  auto abandon = [&](absl::Status s) {
    unlink(tmp.c_str());
    return s;
  };
  // One group: its header (written last, once its count is known) and the records.
  int64_t size = kWalGroupHeaderBytes;
  std::string buffer;
  std::string scratch;
  WalRecord record;
  for (size_t i = 0;; ++i) {
    absl::StatusOr<bool> more = live(record, scratch);
    if (!more.ok()) return abandon(more.status());
    if (!*more) break;
    if (absl::Status s = CheckSize(record, i, options_); !s.ok()) return abandon(s);
    EncodeRecord(record, buffer);
    if (buffer.size() >= kMaxGroupBytes) {
      absl::Status s = WriteAll(fd.get(), buffer, size, tmp);
      if (!s.ok()) return abandon(s);
      size += buffer.size();
      buffer.clear();
    }
  }
  if (!buffer.empty()) {
    absl::Status s = WriteAll(fd.get(), buffer, size, tmp);
    if (!s.ok()) return abandon(s);
    size += buffer.size();
  }
  buffer.clear();
  EncodeGroupHeader(static_cast<uint64_t>(size - kWalGroupHeaderBytes), buffer);
  if (absl::Status s = WriteAll(fd.get(), buffer, 0, tmp); !s.ok()) return abandon(s);
  if (options_.sync && fsync(fd.get()) != 0) return abandon(ErrnoError(errno, tmp, "fsync"));
  // Lock the new file before it takes the log's name, so no other opener can slip in.
  if (flock(fd.get(), LOCK_EX | LOCK_NB) != 0) return abandon(ErrnoError(errno, tmp, "flock"));
  if (rename(tmp.c_str(), options_.path.c_str()) != 0) {
    const int err = errno;
    return abandon(ErrnoError(err, options_.path, absl::StrCat("rename from ", tmp)));
  }
  // The new file is the log now, whatever happens next.
  close(fd_);
  fd_ = fd.release();
  size_ = size;
  if (options_.sync) {
    absl::Status s = SyncDirectoryOf(options_.path);
    if (!s.ok()) {
      // The rename may not survive a crash, and later appends would go to a file that does not.
      failed = true;
      return absl::DataLossError(absl::StrCat(s.message(), "; the log is unusable, reopen it"));
    }
  }
  return absl::OkStatus();
}

int64_t WriteAheadLog::file_bytes() const {
  absl::MutexLock lock(&mu_);
  return file_bytes_;
}

int64_t WriteAheadLog::records_appended() const {
  absl::MutexLock lock(&mu_);
  return records_appended_;
}

int64_t WriteAheadLog::syncs_performed() const {
  absl::MutexLock lock(&mu_);
  return syncs_performed_;
}

}  // namespace dta

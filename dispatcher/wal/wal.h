// A write-ahead log for the rollout dispatcher: every accepted trajectory and every committed
// training step is appended here, and is on disk, before the dispatcher acknowledges it. After a
// crash (kill -9, power loss) the dispatcher reopens the log and replays it.
//
// The log is agnostic of what it stores: a record is a one-byte type chosen by the caller and an
// opaque payload (a serialized protobuf in the dispatcher).
//
// File format: records back to back, no file header. Each record is a 13-byte header followed by
// the payload, all integers little-endian:
//
//   u32 magic (kWalMagic) | u32 payload length | u8 type | u32 crc32 | payload
//
// where crc32 is zlib's CRC-32 over the type byte, the 4 length bytes and the payload.
//
// Every group commit (one write, one sync) starts with a group header: a record with magic
// kWalGroupMagic, type 0 and an 8-byte payload, the u64 byte count of the group's records that
// follow it. Rewrite's records (one atomic file) have none. Group headers are never replayed.
//
// Recovery. Open reads the file front to back. A record that is incomplete or fails its checks
// (magic, length at most max_record_bytes, checksum) is the torn tail of a crash mid-write when no
// valid record follows it: the bytes from its start on are truncated away and reported by
// truncated_tail_bytes(). Such a record was never acknowledged, since Append returns only after
// the whole record is on disk. A group is replayed only once all of its records check out, and a
// group that does not is torn as a whole: after a power loss the pages of its unsynced write may
// have reached the disk in any order, so valid records inside its extent prove nothing; the group
// is truncated from its header on (none of it was acknowledged: its sync never returned). When a
// valid record follows the damage beyond that (found by scanning forward for either magic and a
// matching checksum), acknowledged data would be lost: Open fails with DATA_LOSS and never skips
// it. A payload that itself contains a well-formed record can make a torn tail look like that
// case; the log then refuses to open rather than guess.
//
// Usage:
//
//   dta::WalOptions options;
//   options.path = "/var/lib/dta/dispatcher.wal";
//   absl::StatusOr<std::unique_ptr<dta::WriteAheadLog>> wal = dta::WriteAheadLog::Open(
//       options, [&](const dta::WalRecord& record) { return state.Apply(record); });
//   if (!wal.ok()) return wal.status();
//   absl::Status s = (*wal)->Append(kTrajectoryRecord, trajectory.SerializeAsString());
//   if (!s.ok()) return s;  // not acknowledged
//   ...
//   s = (*wal)->Rewrite(state.LiveRecords());  // drop consumed trajectories
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace dta {

// The first four bytes of every record ("DWAL" read as a little-endian u32).
inline constexpr uint32_t kWalMagic = 0x4C415744;
// Bytes of a record's header: magic, length, type, checksum.
inline constexpr int kWalHeaderBytes = 13;
// The first four bytes of a group header ("DWAG"), and its size: a header and a u64.
inline constexpr uint32_t kWalGroupMagic = 0x47415744;
inline constexpr int kWalGroupHeaderBytes = kWalHeaderBytes + 8;

struct WalOptions {
  // The log file. Created if missing; its directory must exist. A file `path + ".tmp"` in the same
  // directory is used by Rewrite (and removed by Open if a crash left it behind). Required.
  std::string path;

  // If true (the default), Append returns only after fdatasync, and Open and Rewrite fsync what
  // they change (the directory included). If false no sync is ever issued: a record survives a
  // killed process but maybe not a power loss. For tests and benchmarks.
  bool sync = true;

  // Largest payload accepted by Append, AppendBatch and Rewrite (INVALID_ARGUMENT beyond it). A
  // record on disk whose length field exceeds it is treated as corrupt, unless its checksum
  // matches (the limit was lowered since): then Open fails with FAILED_PRECONDITION rather than
  // truncate it. Default 64 MiB.
  uint32_t max_record_bytes = 64u << 20;
};

// One record: a view, not an owner. In the replay callback the payload is valid only for the
// duration of the call; passed to AppendBatch or Rewrite it must stay valid until they return.
struct WalRecord {
  uint8_t type = 0;
  std::string_view payload;
};

// The log. Owns its file descriptor (and an exclusive flock on the file, so a second dispatcher
// cannot open the same log); not copyable or movable; the destructor closes the file and issues
// no sync (every acknowledged record is already synced).
//
// Thread safety: Append, AppendBatch, Rewrite and the statistics accessors may be called from any
// number of threads at once. Concurrent appends are committed as a group: the first waiting
// caller writes the records of everyone queued behind it with one write and one fdatasync, then
// wakes them. The destructor must not run concurrently with any other call.
//
// Failure: when a write or a sync fails, the log enters a failed state and that call and every
// later Append, AppendBatch and Rewrite return the same error (UNAVAILABLE for a failed write,
// DATA_LOSS for a failed sync, with the path and the errno text); it never reports a record as
// durable that may not be. Reopen the log to recover: the unacknowledged tail is truncated.
class WriteAheadLog {
 public:
  using ReplayFn = std::function<absl::Status(const WalRecord&)>;

  // Opens or creates options.path, passes every valid record to `replay` in file order, truncates
  // a torn tail (see the file comment), and positions the log for appends.
  //
  // Errors: INVALID_ARGUMENT if options.path or replay is empty; NOT_FOUND if its directory does
  // not exist; PERMISSION_DENIED; FAILED_PRECONDITION if another WriteAheadLog (in this or another
  // process) holds the file, or an intact record exceeds options.max_record_bytes; DATA_LOSS naming
  // the path and byte offset for corruption followed by valid records; UNAVAILABLE for other I/O
  // errors. A non-OK status from `replay` stops the replay and is returned unchanged. On any
  // error the caller must discard the records replayed so far; the log's records are untouched.
  static absl::StatusOr<std::unique_ptr<WriteAheadLog>> Open(const WalOptions& options,
                                                             const ReplayFn& replay);

  WriteAheadLog(const WriteAheadLog&) = delete;
  WriteAheadLog& operator=(const WriteAheadLog&) = delete;
  ~WriteAheadLog();

  // Appends one record; returns once it is written and (with options.sync) fdatasync'ed.
  // INVALID_ARGUMENT if the payload exceeds options.max_record_bytes (the log is unaffected);
  // otherwise see "Failure" above.
  absl::Status Append(uint8_t type, std::string_view payload);

  // Appends several records with one write and one sync, in order, all in the same group commit.
  // INVALID_ARGUMENT (nothing written) if any payload is too large. An empty span is a no-op.
  absl::Status AppendBatch(absl::Span<const WalRecord> records);

  // Atomically replaces the log's contents with exactly `live`, in order: writes `path.tmp`,
  // fsyncs it, renames it over the log and fsyncs the directory. Waits for appends already queued
  // and holds later ones back until done, which then go to the new file. A record appended before
  // Rewrite that is not in `live` is gone, so the caller must build `live` after every append it
  // wants to keep has returned. INVALID_ARGUMENT if a payload is too large, UNAVAILABLE if the
  // temp file cannot be written (the old log stays in place and usable), DATA_LOSS (failed state)
  // if the directory sync fails after the rename.
  absl::Status Rewrite(absl::Span<const WalRecord> live);

  // Produces a Rewrite's records one at a time, in order: sets `record` and returns true, returns
  // false when there are no more, or an error that abandons the rewrite. The payload may point
  // into `scratch` (the same string on every call) and must stay valid until the next call.
  using RecordSource = std::function<absl::StatusOr<bool>(WalRecord& record, std::string& scratch)>;

  // Rewrite, from a source, so that a large log need not be held in memory twice: the records are
  // encoded and written as they come (the source runs on the calling thread; appends wait). The
  // same guarantees and errors; a too-large payload (INVALID_ARGUMENT) or an error of the source
  // (returned unchanged) abandons the rewrite, and the old log stays in place and usable.
  absl::Status RewriteFrom(const RecordSource& live);

  const std::string& path() const { return options_.path; }

  // Statistics. file_bytes: current size of the log file. records_appended: records written by
  // Append and AppendBatch through this object (not by Rewrite). syncs_performed: fdatasync calls
  // made for appends (fewer than records_appended under concurrency: group commit).
  int64_t file_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t records_appended() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t syncs_performed() const ABSL_LOCKS_EXCLUDED(mu_);
  // Set by Open: records passed to replay, and bytes of torn tail truncated away (0 if none).
  int64_t records_replayed() const { return records_replayed_; }
  int64_t truncated_tail_bytes() const { return truncated_tail_bytes_; }

 private:
  struct Writer;

  WriteAheadLog(const WalOptions& options, int fd, int64_t size, int64_t records_replayed,
                int64_t truncated_tail_bytes);

  // Queues `writer`, waits until it is done or leads a group, and returns its status.
  absl::Status Commit(Writer& writer) ABSL_LOCKS_EXCLUDED(mu_);
  // Run by the leader with mu_ released: the leader alone touches fd_ and size_.
  absl::Status WriteAndSync(std::string_view bytes, bool& synced);
  absl::Status RewriteFile(const RecordSource& live, bool& failed);

  const WalOptions options_;
  // Owned by the writer at the front of writers_ (the leader), which uses them with mu_ released
  // while every other writer waits.
  int fd_;
  int64_t size_;
  std::string scratch_;  // the group's encoded records

  const int64_t records_replayed_;
  const int64_t truncated_tail_bytes_;

  mutable absl::Mutex mu_;
  std::deque<Writer*> writers_ ABSL_GUARDED_BY(mu_);
  absl::Status failed_ ABSL_GUARDED_BY(mu_);  // OK until a write or sync fails
  int64_t file_bytes_ ABSL_GUARDED_BY(mu_);
  int64_t records_appended_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t syncs_performed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace dta

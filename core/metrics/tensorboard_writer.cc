#include "core/metrics/tensorboard_writer.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace dta {
namespace {

// Reflected polynomial 0x82F63B78, one byte at a time: event files are small, a step's scalars
// are a few hundred bytes.
constexpr std::array<uint32_t, 256> MakeCrc32cTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t byte = 0; byte < 256; ++byte) {
    uint32_t crc = byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1) ? 0x82F63B78u : 0);
    table[byte] = crc;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kCrc32cTable = MakeCrc32cTable();

// The protobuf wire format of the fields an Event of scalars uses (tensorflow/core/util/event.proto
// and framework/summary.proto): Event{double wall_time = 1; int64 step = 2; string file_version =
// 3; Summary summary = 5}, Summary{repeated Value value = 1}, Value{string tag = 1; float
// simple_value = 2}.
void AppendVarint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out += static_cast<char>((value & 0x7F) | 0x80);
    value >>= 7;
  }
  out += static_cast<char>(value);
}

template <typename T>
void AppendLittleEndian(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // x86-64 and aarch64 are little-endian
  out.append(bytes, sizeof(T));
}

void AppendTag(std::string& out, int field, int wire_type) {
  AppendVarint(out, static_cast<uint64_t>(field) << 3 | wire_type);
}

void AppendBytesField(std::string& out, int field, std::string_view bytes) {
  AppendTag(out, field, 2);
  AppendVarint(out, bytes.size());
  out.append(bytes);
}

std::string EventHeader(double wall_time, int64_t step) {
  std::string event;
  AppendTag(event, 1, 1);
  AppendLittleEndian(event, wall_time);
  if (step != 0) {
    AppendTag(event, 2, 0);
    AppendVarint(event, static_cast<uint64_t>(step));
  }
  return event;
}

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

absl::Status OsError(const std::string& what, int error) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(error)));
}

}  // namespace

uint32_t Crc32c(std::string_view data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (const char c : data) crc = kCrc32cTable[(crc ^ static_cast<uint8_t>(c)) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t MaskCrc32c(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u; }

absl::StatusOr<std::unique_ptr<TensorBoardWriter>> TensorBoardWriter::Open(
    const std::string& directory) {
  if (directory.empty()) return absl::InvalidArgumentError("the TensorBoard directory is empty");
  std::error_code error;
  std::filesystem::create_directories(directory, error);
  if (error) {
    return absl::UnavailableError(
        absl::StrCat("cannot create the TensorBoard directory ", directory, ": ", error.message()));
  }
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  const int64_t seconds = static_cast<int64_t>(NowSeconds());
  const std::string base = (std::filesystem::path(directory) /
                            absl::StrCat("events.out.tfevents.", seconds, ".", host, ".", getpid()))
                               .string();
  // "x": never append to (or clobber) another writer's file; a second writer of this process in
  // the same second gets a numbered name (TensorBoard reads every *tfevents* file).
  std::string path = base;
  std::FILE* file = nullptr;
  for (int attempt = 1; (file = std::fopen(path.c_str(), "wbx")) == nullptr; ++attempt) {
    if (errno != EEXIST || attempt > 1000) return OsError("cannot create " + path, errno);
    path = absl::StrCat(base, ".", attempt);
  }
  std::unique_ptr<TensorBoardWriter> writer(new TensorBoardWriter(path, file));
  std::string first = EventHeader(NowSeconds(), 0);
  AppendBytesField(first, 3, "brain.Event:2");
  if (absl::Status status = writer->WriteRecord(first); !status.ok()) return status;
  return writer;
}

TensorBoardWriter::~TensorBoardWriter() { std::fclose(file_); }

absl::Status TensorBoardWriter::Write(int64_t step, const Scalars& scalars) {
  return Write(step, scalars, NowSeconds());
}

absl::Status TensorBoardWriter::Write(int64_t step, const Scalars& scalars,
                                      double wall_time_seconds) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string entry;
    AppendBytesField(entry, 1, tag);
    AppendTag(entry, 2, 5);
    AppendLittleEndian(entry, static_cast<float>(value));
    AppendBytesField(summary, 1, entry);
  }
  std::string event = EventHeader(wall_time_seconds, step);
  AppendBytesField(event, 5, summary);
  return WriteRecord(event);
}

absl::Status TensorBoardWriter::WriteRecord(std::string_view event) {
  std::string record;
  record.reserve(event.size() + 16);
  AppendLittleEndian(record, static_cast<uint64_t>(event.size()));
  AppendLittleEndian(record, MaskCrc32c(Crc32c(record)));
  record.append(event);
  AppendLittleEndian(record, MaskCrc32c(Crc32c(event)));
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size() ||
      std::fflush(file_) != 0) {
    return OsError("cannot write " + path_, errno);
  }
  return absl::OkStatus();
}

}  // namespace dta

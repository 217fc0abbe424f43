// TensorBoard event files of scalars, as TensorBoard (and tensorboardX, torch.utils.tensorboard)
// read them: TFRecord framing (length, masked CRC-32C of the length, an Event protocol buffer, its
// masked CRC-32C), the first event naming the file version "brain.Event:2", then one Event per
// step holding a Summary of simple_value scalars. The few protobuf fields involved are encoded
// here, so the trainers and the dispatcher need neither TensorFlow nor its protos.
//
// Each call writes whole records and flushes them to the file, so a reader (or a crash) sees every
// step written so far and never a torn record. Not thread-safe: one writer per thread.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dta {

using Scalars = std::vector<std::pair<std::string, double>>;

class TensorBoardWriter {
 public:
  // Creates `directory` (and its parents) if needed and a new event file in it, named as
  // TensorBoard's own writers name theirs: events.out.tfevents.<unix seconds>.<host>.<pid>.
  // INVALID_ARGUMENT for an empty directory; the OS error naming the path otherwise.
  static absl::StatusOr<std::unique_ptr<TensorBoardWriter>> Open(const std::string& directory);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One event at `step` carrying every scalar (float32, as TensorBoard stores them; tags as given,
  // e.g. "loss" or "rl/approx_kl"), stamped with the current time.
  absl::Status Write(int64_t step, const Scalars& scalars);
  absl::Status Write(int64_t step, const Scalars& scalars, double wall_time_seconds);

  const std::string& path() const { return path_; }

 private:
  TensorBoardWriter(std::string path, std::FILE* file) : path_(std::move(path)), file_(file) {}
  absl::Status WriteRecord(std::string_view event);

  std::string path_;
  std::FILE* file_;
};

// CRC-32C (Castagnoli) of `data`, and TFRecord's masked form of a CRC. Exposed for tests.
uint32_t Crc32c(std::string_view data);
uint32_t MaskCrc32c(uint32_t crc);

}  // namespace dta

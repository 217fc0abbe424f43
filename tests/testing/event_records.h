// The records of a TensorBoard event file, every length and CRC checked (gtest expectations), for
// tests that read what dta's TensorBoardWriter wrote.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "core/metrics/tensorboard_writer.h"

namespace dta::testing {

inline std::vector<std::string> EventRecords(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto read32 = [&bytes](size_t at) {
    uint32_t value;
    std::memcpy(&value, bytes.data() + at, 4);
    return value;
  };
  std::vector<std::string> records;
  size_t at = 0;
  while (at + 12 <= bytes.size()) {
    uint64_t length;
    std::memcpy(&length, bytes.data() + at, 8);
    EXPECT_EQ(read32(at + 8), MaskCrc32c(Crc32c(bytes.substr(at, 8)))) << path << " at " << at;
    if (at + 16 + length > bytes.size()) break;
    records.push_back(bytes.substr(at + 12, length));
    EXPECT_EQ(read32(at + 12 + length), MaskCrc32c(Crc32c(records.back()))) << path;
    at += 16 + length;
  }
  EXPECT_EQ(at, bytes.size()) << path << ": a torn record";
  return records;
}

}  // namespace dta::testing

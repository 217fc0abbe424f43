// Splits [0, n) into contiguous pieces of at least `grain` elements over at most `threads`
// threads (this one included) and runs fn(begin, end) on each; returns when all are done.
//
// For memory-bound host loops in code that links LibTorch (pass at::get_num_threads()): not
// at::parallel_for, whose OpenMP loop is inlined into the caller's file, which is not compiled
// with -fopenmp (that would load a second OpenMP runtime beside torch's), so it runs on one
// thread. Measured on the H100 machine, that held the offloaded AdamW update to ~15 GB/s.
//
//   ParallelFor(n, int64_t{1} << 16, at::get_num_threads(),
//               [&](int64_t begin, int64_t end) { for (int64_t i = begin; i < end; ++i) ...; });
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace dta {

template <typename Fn>
void ParallelFor(int64_t n, int64_t grain, int threads, const Fn& fn) {
  if (n <= 0) return;
  const int64_t pieces =
      std::clamp<int64_t>(n / std::max<int64_t>(grain, 1), 1, std::max<int64_t>(threads, 1));
  const int64_t per_piece = (n + pieces - 1) / pieces;
  std::vector<std::thread> workers;
  workers.reserve(pieces - 1);
  for (int64_t t = 1; t < pieces; ++t) {
    const int64_t begin = std::min(n, t * per_piece);
    const int64_t end = std::min(n, begin + per_piece);
    if (begin < end) workers.emplace_back(fn, begin, end);
  }
  fn(0, std::min(n, per_piece));
  for (std::thread& worker : workers) worker.join();
}

}  // namespace dta

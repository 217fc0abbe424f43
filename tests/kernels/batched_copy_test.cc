// kernels/batched_copy.h against ATen's copy_ and zero_: bitwise, for the stack's shapes (row
// slices of [rows, heads, head_dim] buffers at any offset), dtype casts, more pieces than one
// launch takes, layouts the kernel refuses (which then run through ATen), and nothing written
// outside the destinations. On the CPU every piece runs through ATen; the CUDA cases run on a GPU.
#include "kernels/batched_copy.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <vector>

#include "gtest/gtest.h"

namespace dta::kernels {
namespace {

struct Case {
  at::Tensor source_buffer, destination_buffer;  // whole buffers, to check outside the pieces
  std::vector<at::Tensor> sources, destinations;
};

// `pieces` row slices [b, e) of per-piece [64, heads, dim] buffers, the sources in `from`, the
// destinations in `to` (rows of 16-byte words, or not with an odd dim).
Case StackLikeCase(int pieces, at::ScalarType from, at::ScalarType to, const at::Device& device,
                   int heads = 3, int dim = 32) {
  Case c;
  const at::TensorOptions options = at::TensorOptions().device(device);
  c.source_buffer = at::randn({pieces, 64, heads, dim}, options.dtype(at::kFloat)).to(from);
  c.destination_buffer = at::randn({pieces, 64, heads, dim}, options.dtype(at::kFloat)).to(to);
  for (int i = 0; i < pieces; ++i) {
    const int64_t begin = (i * 7) % 13, end = begin + 1 + (i * 11) % 40;
    c.sources.push_back(c.source_buffer[i].slice(0, begin, end));
    c.destinations.push_back(c.destination_buffer[i].slice(0, begin, end));
  }
  return c;
}

void ExpectCopyMatchesAten(Case c) {
  const at::Tensor expected = c.destination_buffer.clone();
  for (size_t i = 0; i < c.sources.size(); ++i) {
    const int64_t offset =
        c.destinations[i].storage_offset() - c.destination_buffer.storage_offset();
    expected.view(-1)
        .slice(0, offset, offset + c.destinations[i].numel())
        .view(c.destinations[i].sizes())
        .copy_(c.sources[i]);
  }
  CopyAll(c.sources, c.destinations);
  EXPECT_TRUE(at::equal(c.destination_buffer.cpu(), expected.cpu()));
}

std::vector<at::Device> Devices() {
  std::vector<at::Device> devices{at::kCPU};
  if (at::hasCUDA()) devices.emplace_back(at::kCUDA);
  return devices;
}

TEST(BatchedCopy, CopiesRowSlicesBitwise) {
  for (const at::Device& device : Devices()) {
    for (const auto& [from, to] :
         std::vector<std::pair<at::ScalarType, at::ScalarType>>{{at::kBFloat16, at::kBFloat16},
                                                                {at::kFloat, at::kFloat},
                                                                {at::kFloat, at::kBFloat16},
                                                                {at::kBFloat16, at::kFloat},
                                                                {at::kFloat, at::kHalf},
                                                                {at::kDouble, at::kDouble}}) {
      SCOPED_TRACE(::testing::Message() << device << " " << from << " -> " << to);
      ExpectCopyMatchesAten(StackLikeCase(5, from, to, device));
      ExpectCopyMatchesAten(StackLikeCase(5, from, to, device, /*heads=*/1));
      ExpectCopyMatchesAten(StackLikeCase(5, from, to, device, /*heads=*/1, /*dim=*/5));
    }
  }
}

TEST(BatchedCopy, MorePiecesThanOneLaunchTakes) {
  for (const at::Device& device : Devices()) {
    ExpectCopyMatchesAten(
        StackLikeCase(2 * kBatchedCopyMaxPieces + 3, at::kFloat, at::kBFloat16, device));
  }
}

TEST(BatchedCopy, LayoutsTheKernelRefusesStillCopy) {
  for (const at::Device& device : Devices()) {
    const at::TensorOptions options = at::TensorOptions().device(device);
    // A transposed source, a column slice, a 1-d vector, a 0-d tensor and an integer tensor.
    const at::Tensor a = at::randn({6, 10}, options), b = at::randn({10, 6}, options);
    const at::Tensor c = at::randn({8, 12}, options), d = at::randn({8, 5}, options);
    const at::Tensor e = at::randn({17}, options), f = at::randn({}, options);
    const at::Tensor g = at::randint(0, 100, {9}, options.dtype(at::kLong));
    std::vector<at::Tensor> destinations{a.clone(), c.clone(), e.clone(), f.clone(),
                                         at::zeros({9}, options.dtype(at::kLong))};
    const std::vector<at::Tensor> sources{b.t(), c.slice(1, 2, 7).mul(2).contiguous(), e * 3, f + 1,
                                          g};
    std::vector<at::Tensor> views{destinations[0], destinations[1].slice(1, 2, 7), destinations[2],
                                  destinations[3], destinations[4]};
    CopyAll(sources, views);
    for (size_t i = 0; i < views.size(); ++i) EXPECT_TRUE(at::equal(views[i], sources[i])) << i;
    EXPECT_TRUE(at::equal(destinations[1].slice(1, 0, 2), c.slice(1, 0, 2)));  // untouched
  }
}

TEST(BatchedCopy, ZeroesExactlyThePieces) {
  for (const at::Device& device : Devices()) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kDouble}) {
      Case c = StackLikeCase(kBatchedCopyMaxPieces + 9, dtype, dtype, device, 2,
                             dtype == at::kDouble ? 3 : 32);
      const at::Tensor expected = c.destination_buffer.clone();
      for (const at::Tensor& d : c.destinations) {
        const int64_t offset = d.storage_offset() - c.destination_buffer.storage_offset();
        expected.view(-1).slice(0, offset, offset + d.numel()).zero_();
      }
      ZeroAll(c.destinations);
      EXPECT_TRUE(at::equal(c.destination_buffer.cpu(), expected.cpu())) << device << dtype;
    }
  }
}

// Like copy_ and zero_, the batch bumps each destination's version, so autograd refuses a
// backward through a tensor it saved and that was overwritten since.
TEST(BatchedCopy, BumpsTheVersionOfWhatItWrites) {
  for (const at::Device& device : Devices()) {
    const at::Tensor buffer = at::randn({8, 16}, at::TensorOptions().device(device));
    at::Tensor rows = buffer.slice(0, 2, 5);
    const auto before = rows._version();
    CopyAll({at::randn({3, 16}, buffer.options())}, {rows});
    EXPECT_GT(rows._version(), before) << device;
    const auto copied = rows._version();
    ZeroAll({rows});
    EXPECT_GT(rows._version(), copied) << device;
  }
}

TEST(BatchedCopy, EmptyPiecesAndMismatchedShapes) {
  const at::Tensor x = at::randn({4, 8});
  CopyAll({x.slice(0, 0, 0)}, {at::empty({0, 8})});
  ZeroAll({});
  EXPECT_THROW(CopyAll({x}, {at::empty({4, 7})}), c10::Error);
  EXPECT_THROW(CopyAll({x, x}, {at::empty({4, 8})}), c10::Error);
}

}  // namespace
}  // namespace dta::kernels

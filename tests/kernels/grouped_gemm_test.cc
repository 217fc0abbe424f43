// The experts' grouped weight-gradient GEMM (kernels/grouped_gemm.h) against a float64 reference:
// accumulator[e] += dy[rows of e]^T x[rows of e] from bfloat16 operands into a float32 accumulator
// that already holds a gradient, for experts with many, few and no rows, shapes that are not
// multiples of the tiles, and Qwen3-30B-A3B's expert shapes; bitwise equal across two runs;
// overwriting an accumulator of NaNs bitwise equal to accumulating into zeros; shapes
// the kernel does not take are declined with nothing written. Skipped without a CUDA device, on
// GPUs other than compute capability 9.x, or in builds without the Hopper kernels.
#include <ATen/cuda/CUDAContext.h>
#include <torch/cuda.h>

#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/grouped_gemm.h"
#include "tests/kernels/kernel_testing.h"

namespace dta::kernels {
namespace {

using testing::RelativeError;

struct Case {
  int64_t experts, m, n;
  std::vector<int64_t> rows;  // per expert

  std::string Name() const {
    return "E=" + std::to_string(experts) + " M=" + std::to_string(m) + " N=" + std::to_string(n);
  }
  // Random bfloat16 dy [rows, m] and x [rows, n] on the GPU.
  std::pair<at::Tensor, at::Tensor> Operands() const {
    int64_t total = 0;
    for (int64_t r : rows) total += r;
    const at::TensorOptions bf16 = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    return {at::randn({total, m}, bf16), at::randn({total, n}, bf16)};
  }
};

class GroupedWeightGrad : public ::testing::Test {
 protected:
  void SetUp() override {
#ifndef DTA_KERNELS_HAVE_HOPPER
    GTEST_SKIP() << "built without the Hopper kernels";
#endif
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
    if (at::cuda::getCurrentDeviceProperties()->major != 9) GTEST_SKIP() << "not Hopper";
  }
};

at::Tensor Ends(const std::vector<int64_t>& rows) {
  std::vector<int64_t> ends;
  int64_t sum = 0;
  for (int64_t r : rows) ends.push_back(sum += r);
  return at::tensor(ends, at::kLong).cuda();
}

TEST_F(GroupedWeightGrad, AccumulatesEveryExpertsProductInFloat32) {
  at::manual_seed(3);
  std::vector<int64_t> skewed(128);
  for (int64_t e = 0; e < 128; ++e) skewed[e] = e % 7 == 3 ? 0 : 64 + (e * 37) % 900;
  const std::vector<Case> cases = {
      {.experts = 4, .m = 8, .n = 8, .rows = {3, 0, 1, 17}},
      {.experts = 5, .m = 24, .n = 40, .rows = {77, 0, 0, 130, 5}},
      {.experts = 3, .m = 136, .n = 264, .rows = {0, 1000, 0}},
      {.experts = 128, .m = 768, .n = 2048, .rows = skewed},  // Qwen3-30B-A3B's gate/up
      {.experts = 128, .m = 2048, .n = 768, .rows = skewed},  // and its down projection
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.Name());
    const at::TensorOptions cuda = at::TensorOptions().device(at::kCUDA);
    const auto [dy, x] = c.Operands();
    const at::Tensor before = at::randn({c.experts, c.m, c.n}, cuda.dtype(at::kFloat));
    at::Tensor accumulator = before.clone();
    ASSERT_TRUE(AddGroupedWeightGrad(accumulator, dy, x, Ends(c.rows)));
    // float64 reference of the same bfloat16 values.
    at::Tensor expected = before.to(at::kDouble);
    int64_t begin = 0;
    for (int64_t e = 0; e < c.experts; ++e) {
      const int64_t end = begin + c.rows[e];
      if (end > begin) {
        expected[e] += at::mm(dy.slice(0, begin, end).to(at::kDouble).t(),
                              x.slice(0, begin, end).to(at::kDouble));
      }
      begin = end;
    }
    EXPECT_LE(RelativeError(accumulator, expected), 1e-5);
    // Experts without rows keep their gradient bit for bit.
    for (int64_t e = 0; e < c.experts; ++e) {
      if (c.rows[e] == 0) {
        EXPECT_TRUE(at::equal(accumulator[e], before[e])) << "expert " << e;
      }
    }
    at::Tensor again = before.clone();
    ASSERT_TRUE(AddGroupedWeightGrad(again, dy, x, Ends(c.rows)));
    EXPECT_TRUE(at::equal(again, accumulator)) << "not deterministic";
  }
}

// Overwriting never reads the accumulator (NaNs there stay out of the result), zeroes the experts
// without rows, and gives the bits that accumulating into zeros gives (0 + p = p).
TEST_F(GroupedWeightGrad, OverwritingIsAccumulatingIntoZeros) {
  at::manual_seed(5);
  std::vector<int64_t> rows(64);
  for (int64_t e = 0; e < 64; ++e) rows[e] = e % 5 == 1 ? 0 : 1 + (e * 53) % 400;
  const std::vector<Case> cases = {
      {.experts = 5, .m = 24, .n = 40, .rows = {77, 0, 0, 130, 5}},
      {.experts = 64, .m = 512, .n = 2048, .rows = rows},  // Qwen3-Next's gate/up
      {.experts = 64, .m = 2048, .n = 512, .rows = rows},  // and its down projection
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.Name());
    const at::TensorOptions cuda = at::TensorOptions().device(at::kCUDA);
    const auto [dy, x] = c.Operands();
    at::Tensor accumulated = at::zeros({c.experts, c.m, c.n}, cuda.dtype(at::kFloat));
    ASSERT_TRUE(AddGroupedWeightGrad(accumulated, dy, x, Ends(c.rows)));
    at::Tensor overwritten = at::full_like(accumulated, std::numeric_limits<float>::quiet_NaN());
    ASSERT_TRUE(AddGroupedWeightGrad(overwritten, dy, x, Ends(c.rows), /*overwrite=*/true));
    EXPECT_TRUE(at::equal(overwritten, accumulated));
    for (int64_t e = 0; e < c.experts; ++e) {
      if (c.rows[e] == 0) {
        EXPECT_EQ(overwritten[e].abs().max().item<float>(), 0.f) << "expert " << e;
      }
    }
  }
}

TEST_F(GroupedWeightGrad, DeclinesWhatItDoesNotTake) {
  const at::TensorOptions cuda = at::TensorOptions().device(at::kCUDA);
  const at::Tensor ends = Ends({2, 2});
  at::Tensor accumulator = at::zeros({2, 12, 16}, cuda.dtype(at::kFloat));
  const at::Tensor x = at::randn({4, 16}, cuda.dtype(at::kBFloat16));
  // M = 12 is not a multiple of 8 (TMA's 16-byte rows).
  EXPECT_FALSE(
      AddGroupedWeightGrad(accumulator, at::randn({4, 12}, cuda.dtype(at::kBFloat16)), x, ends));
  EXPECT_TRUE(at::equal(accumulator, at::zeros_like(accumulator)));
  // float32 operands.
  at::Tensor wide = at::zeros({2, 8, 16}, cuda.dtype(at::kFloat));
  EXPECT_FALSE(AddGroupedWeightGrad(wide, at::randn({4, 8}, cuda.dtype(at::kFloat)),
                                    x.to(at::kFloat), ends));
}

}  // namespace
}  // namespace dta::kernels

// Float32Bmm (kernels/float32_bmm.h): the 3xTF32 batched GEMM against a float64 reference at the
// chunked Gated DeltaNet's shapes and layouts (row-major and transposed operands, 4-D batches,
// more batch entries than one launch's grid holds), as accurate as cuBLAS's float32 GEMM,
// bitwise reproducible; what the kernel does not take runs at::matmul bit for bit. Skipped without
// a CUDA device, on GPUs other than compute capability 9.x, or in builds without the Hopper
// kernels.
#include "kernels/float32_bmm.h"

#include <ATen/cuda/CUDAContext.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"
#include "tests/kernels/kernel_testing.h"

namespace dta::kernels {
namespace {

using testing::RelativeError;

class Float32BmmTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifndef DTA_KERNELS_HAVE_HOPPER
    GTEST_SKIP() << "built without the Hopper kernels";
#endif
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
    if (at::cuda::getCurrentDeviceProperties()->major != 9) GTEST_SKIP() << "not Hopper";
  }
};

const at::TensorOptions kCuda = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);

// Float32Bmm(a, b) runs the kernel and lies about as close to the float64 product as cuBLAS's
// float32 GEMM does (within 8x its max-norm error, and 1e-6 relative: measured 1-4x on an H200);
// two runs give the same bits.
void ExpectAccurate(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_TRUE(Float32BmmUsesKernel(a, b));
  const at::Tensor c = Float32Bmm(a, b);
  const at::Tensor exact = at::matmul(a.to(at::kDouble), b.to(at::kDouble));
  const double error = RelativeError(c, exact);
  const double cublas = RelativeError(at::matmul(a, b), exact);
  EXPECT_LE(error, 1e-6);
  EXPECT_LE(error, 8 * cublas + 1e-9);
  EXPECT_TRUE(at::equal(c, Float32Bmm(a, b))) << "not reproducible";
  EXPECT_TRUE(c.is_contiguous());
}

TEST_F(Float32BmmTest, ChunkedRuleShapesAndLayouts) {
  at::manual_seed(4);
  const int64_t h = 8, n = 37, c = 64, dk = 128, dv = 128;
  const at::Tensor qd = at::randn({h, n, c, dk}, kCuda);
  const at::Tensor states = at::randn({h, n, dk, dv}, kCuda);
  const at::Tensor intra = at::randn({h, n, c, c}, kCuda).tril();
  const at::Tensor v_new = at::randn({h, n, c, dv}, kCuda);
  const at::Tensor d_out = at::randn({h, n, c, dv}, kCuda);
  ExpectAccurate(qd, states, "Qd h");
  ExpectAccurate(intra, v_new, "intra v_new");
  ExpectAccurate(d_out, states.transpose(-1, -2), "dOut h^T");
  ExpectAccurate(qd.transpose(-1, -2), d_out, "Qd^T dOut");
  ExpectAccurate(d_out, v_new.transpose(-1, -2), "dOut v_new^T");
  ExpectAccurate(intra.transpose(-1, -2), d_out, "intra^T dOut");
  // Sizes that are not multiples of the tiles, and a 3-D batch.
  ExpectAccurate(at::randn({5, 20, 36}, kCuda), at::randn({5, 36, 44}, kCuda), "20 x 36 x 44");
  ExpectAccurate(at::randn({3, 1, 8}, kCuda), at::randn({3, 8, 4}, kCuda), "one row");
}

// More batch entries than one launch's grid (65,535) holds.
TEST_F(Float32BmmTest, ManyBatchEntries) {
  at::manual_seed(5);
  ExpectAccurate(at::randn({70001, 8, 8}, kCuda), at::randn({70001, 8, 4}, kCuda), "70,001");
}

// What the kernel does not take (float64, both operands transposed, unaligned sizes, batch
// dimensions that do not collapse, the switch off) is at::matmul's result bit for bit.
TEST_F(Float32BmmTest, OtherwiseIsMatmul) {
  at::manual_seed(6);
  const at::Tensor a = at::randn({4, 16, 32}, kCuda), b = at::randn({4, 32, 24}, kCuda);
  const auto expect_matmul = [](const at::Tensor& x, const at::Tensor& y, const char* what) {
    EXPECT_FALSE(Float32BmmUsesKernel(x, y)) << what;
    EXPECT_TRUE(at::equal(Float32Bmm(x, y), at::matmul(x, y))) << what;
  };
  expect_matmul(a.to(at::kDouble), b.to(at::kDouble), "float64");
  expect_matmul(at::randn({4, 32, 16}, kCuda).transpose(-1, -2),
                at::randn({4, 24, 32}, kCuda).transpose(-1, -2), "both transposed");
  expect_matmul(a, at::randn({4, 32, 6}, kCuda), "N = 6");
  expect_matmul(at::randn({4, 16, 30}, kCuda), at::randn({4, 30, 24}, kCuda), "K = 30");
  expect_matmul(at::randn({3, 2, 16, 32}, kCuda).transpose(0, 1), at::randn({2, 3, 32, 24}, kCuda),
                "batch dimensions that do not collapse");
  ASSERT_TRUE(Float32BmmUsesKernel(a, b));
  ASSERT_EQ(setenv("DTA_FLOAT32_BMM", "0", 1), 0);
  expect_matmul(a, b, "DTA_FLOAT32_BMM=0");
  ASSERT_EQ(unsetenv("DTA_FLOAT32_BMM"), 0);
}

}  // namespace
}  // namespace dta::kernels

// AddMatmulTuned (kernels/tuned_matmul.h): every call, whichever candidate GEMM it runs while a
// class is explored and after one is chosen, gives at::addmm_out's bits, at the executor's layouts
// (a weight gradient's transposed dy, an input gradient's row-major dy, a column block of a wider
// dy), at sizes in one class and across classes, and over a long K; calls it does not take (small
// or huge outputs among them) return false and leave the accumulator alone. The GPU cases are
// skipped without a CUDA device.
#include "kernels/tuned_matmul.h"

#include <torch/cuda.h>

#include <string>

#include "core/base/scoped_env.h"
#include "gtest/gtest.h"

namespace dta::kernels {
namespace {

const at::TensorOptions kBf16Cuda = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);

class TunedMatmulCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  }
};

// `calls` accumulations of a @ b into copies of one accumulator, each against ATen's; returns how
// many ran a cuBLASLt algorithm.
int64_t ExpectAtensBits(const at::Tensor& a, const at::Tensor& b, int calls,
                        const std::string& what) {
  SCOPED_TRACE(what);
  const at::Tensor start =
      at::randn({a.size(0), b.size(1)}, at::TensorOptions().device(at::kCUDA).dtype(at::kFloat));
  at::Tensor expected = start.clone();
  at::addmm_out(expected, expected, a, b, at::kFloat);
  const int64_t lt_before = TunedMatmulLtCalls();
  for (int i = 0; i < calls; ++i) {
    at::Tensor accumulator = start.clone();
    EXPECT_TRUE(AddMatmulTuned(accumulator, a, b));
    EXPECT_TRUE(at::equal(accumulator.view(at::kInt), expected.view(at::kInt)))  // bits
        << "call " << i << ": max difference "
        << (accumulator - expected).abs().max().item<double>();
  }
  return TunedMatmulLtCalls() - lt_before;
}

TEST_F(TunedMatmulCuda, EveryCandidateGivesAtensBits) {
  at::manual_seed(11);
  // 24 calls: more than the 8 candidates x 2 timed calls of a class, then the chosen one.
  constexpr int kCalls = 24;
  int64_t lt = 0;
  // Weight gradients, grad [out, in] += dy^T x: two chunk lengths of one class, then other classes.
  for (const int64_t tokens : {3000, 3100, 1000}) {
    const at::Tensor dy = at::randn({tokens, 2048}, kBf16Cuda);
    const at::Tensor x = at::randn({tokens, 2048}, kBf16Cuda);
    lt += ExpectAtensBits(dy.t(), x, kCalls, "dW over " + std::to_string(tokens) + " tokens");
  }
  const at::Tensor dy_gate_up = at::randn({2420, 6144}, kBf16Cuda);
  const at::Tensor x_gate_up = at::randn({2420, 1024}, kBf16Cuda);
  lt += ExpectAtensBits(dy_gate_up.t(), x_gate_up, kCalls, "a wide dW over 2,420 tokens");
  // An input gradient, dx [T, in] += dy W, W [out, in].
  const at::Tensor dy = at::randn({4608, 1024}, kBf16Cuda);
  const at::Tensor w = at::randn({1024, 1024}, kBf16Cuda);
  lt += ExpectAtensBits(dy, w, kCalls, "dx");
  // A long K.
  const at::Tensor long_a = at::randn({30000, 2048}, kBf16Cuda);
  const at::Tensor long_b = at::randn({30000, 2048}, kBf16Cuda);
  lt += ExpectAtensBits(long_a.t(), long_b, kCalls, "2,048 x 2,048 over K = 30,000");
  // A row stride wider than the row (a column block of a wider tensor, as stacked projections).
  const at::Tensor wide = at::randn({2048, 6144}, kBf16Cuda);
  const at::Tensor x = at::randn({2048, 2048}, kBf16Cuda);
  lt += ExpectAtensBits(wide.narrow(1, 2048, 2048).t(), x, kCalls, "a column block of dy");
  EXPECT_GT(lt, 0) << "no call ran a cuBLASLt algorithm: only ATen's GEMM was compared";
}

TEST_F(TunedMatmulCuda, CallsItDoesNotTakeReturnFalseAndLeaveTheAccumulator) {
  at::manual_seed(12);
  const at::TensorOptions f32 = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  // [2048 x 32] x [32 x 2048]: 4M outputs, as small as is taken.
  const at::Tensor a = at::randn({2048, 32}, kBf16Cuda), b = at::randn({32, 2048}, kBf16Cuda);
  auto untouched = [&](at::Tensor accumulator, const at::Tensor& x, const at::Tensor& y,
                       const std::string& what) {
    SCOPED_TRACE(what);
    const at::Tensor before = accumulator.clone();
    EXPECT_FALSE(AddMatmulTuned(accumulator, x, y));
    EXPECT_TRUE(at::equal(accumulator, before));
  };
  {
    at::Tensor accumulator = at::zeros({2048, 2048}, f32);
    EXPECT_TRUE(AddMatmulTuned(accumulator, a, b)) << "the smallest output taken";
  }
  untouched(at::zeros({2048, 2048}, f32.dtype(at::kBFloat16)), a, b, "a bfloat16 accumulator");
  untouched(at::zeros({2048, 2048}, f32), a.to(at::kHalf), b.to(at::kHalf), "float16 operands");
  untouched(at::zeros({2048, 2048}, f32), a.narrow(1, 0, 31).contiguous(), b.narrow(0, 0, 31),
            "K = 31: leading dimensions not 16-byte multiples");
  untouched(at::zeros({2048, 2048}, f32).t(), a, b, "a column-major accumulator");
  untouched(at::zeros({2047, 2048}, f32), a.narrow(0, 0, 2047), b, "under 4M outputs");
  untouched(at::zeros({16384, 8200}, f32), at::randn({16384, 32}, kBf16Cuda),
            at::randn({32, 8200}, kBf16Cuda), "over 128M outputs");
  {
    const ScopedEnv off("DTA_TUNED_MATMUL", "0");
    untouched(at::zeros({2048, 2048}, f32), a, b, "DTA_TUNED_MATMUL=0");
  }
}

TEST(TunedMatmul, TheCpuIsNotTaken) {
  at::Tensor accumulator = at::zeros({4, 3});
  const at::Tensor a = at::ones({4, 2}, at::kBFloat16), b = at::ones({2, 3}, at::kBFloat16);
  EXPECT_FALSE(AddMatmulTuned(accumulator, a, b));
  EXPECT_TRUE(at::equal(accumulator, at::zeros({4, 3})));
}

}  // namespace
}  // namespace dta::kernels

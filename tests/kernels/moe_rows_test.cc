// kernels/moe_rows.h: on the CPU the ATen path against loops over the pairs in float64; on a GPU
// the kernels against the ATen path (DTA_MOE_ROWS=0) on the same inputs: GatherPairs bit for bit,
// CombinePairs and SumPairs to float32 rounding (their k terms may be summed in another order), and
// bitwise equal across two calls. Shapes: Qwen3-30B-A3B's top 8 and hidden 2048, and odd ones.
#include "kernels/moe_rows.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace dta::kernels {
namespace {

struct Pairs {
  at::Tensor rows, inverse, weights, dy, token, w, other;
  int64_t top_k = 0;
};

// T tokens routed to k of E experts each: pairs sorted by expert, as the sparse block sorts them.
Pairs MakePairs(int64_t t, int64_t k, int64_t hidden, const at::TensorOptions& options,
                at::ScalarType rows_type, uint64_t seed) {
  at::manual_seed(seed);
  const at::TensorOptions host = at::TensorOptions().dtype(at::kLong);
  const at::Tensor index = at::argsort(at::rand({t, 16}), /*dim=*/int64_t{1}, /*descending=*/false)
                               .slice(1, 0, k)
                               .contiguous();
  const auto [sorted, order] = at::sort(index.reshape({-1}), /*stable=*/true, 0, false);
  const at::Tensor inverse =
      at::empty_like(order).scatter_(0, order, at::arange(order.size(0), host));
  Pairs p;
  p.top_k = k;
  p.rows = at::randn({t * k, hidden}).to(options.dtype(rows_type));
  p.other = at::randn({t * k, hidden}).to(options.dtype(rows_type));
  p.inverse = inverse.to(options.device());
  p.weights = at::rand({t, k}).to(options.dtype(at::kFloat));
  p.dy = at::randn({t, hidden}).to(options.dtype(at::kFloat));
  p.token = at::div(order, k, "floor").to(options.device());
  p.w = at::rand({t * k, 1}).to(options.dtype(at::kFloat));
  return p;
}

TEST(MoeRows, TheAtenPathIsTheSumOverEachTokensPairs) {
  const Pairs p = MakePairs(37, 3, 10, at::TensorOptions(), at::kDouble, 1);
  const at::Tensor weights = p.weights.to(at::kDouble);
  const at::Tensor y = CombinePairs(p.rows, p.inverse, weights);
  const at::Tensor dx = SumPairs(p.rows, p.other, p.inverse, p.top_k, at::kDouble);
  const PairGradients g =
      GatherPairs(p.dy.to(at::kDouble), p.token, p.w.to(at::kDouble), at::kDouble);
  for (int64_t t = 0; t < 37; ++t) {
    at::Tensor expected_y = at::zeros({10}, at::kDouble),
               expected_dx = at::zeros({10}, at::kDouble);
    for (int64_t j = 0; j < p.top_k; ++j) {
      const int64_t row = p.inverse[t * p.top_k + j].item<int64_t>();
      expected_y += weights[t][j] * p.rows[row];
      expected_dx += p.rows[row] + p.other[row];
    }
    EXPECT_TRUE(at::allclose(y[t], expected_y, 1e-12, 1e-12)) << t;
    EXPECT_TRUE(at::allclose(dx[t], expected_dx, 1e-12, 1e-12)) << t;
  }
  for (int64_t q = 0; q < 37 * 3; ++q) {
    const at::Tensor source = p.dy.to(at::kDouble)[p.token[q].item<int64_t>()];
    EXPECT_TRUE(at::equal(g.rows[q], source)) << q;
    EXPECT_TRUE(at::allclose(g.scaled[q], source * p.w[q].item<double>(), 1e-15, 0)) << q;
  }
}

// The kernels (DTA_MOE_ROWS on) and ATen (off) on the same inputs.
TEST(MoeRows, KernelsEqualTheAtenPathOnTheGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const at::TensorOptions cuda = at::TensorOptions().device(at::kCUDA);
  struct Shape {
    int64_t t, k, hidden;
  };
  for (const Shape s : {Shape{1000, 8, 2048}, Shape{37, 3, 10}, Shape{1, 1, 300}}) {
    SCOPED_TRACE(std::to_string(s.t) + " tokens, top " + std::to_string(s.k) + ", hidden " +
                 std::to_string(s.hidden));
    const Pairs p = MakePairs(s.t, s.k, s.hidden, cuda, at::kBFloat16, 2);
    auto run = [&] {
      return std::vector<at::Tensor>{CombinePairs(p.rows, p.inverse, p.weights),
                                     SumPairs(p.rows, p.other, p.inverse, p.top_k, at::kFloat),
                                     SumPairs(p.rows, at::Tensor(), p.inverse, p.top_k, at::kFloat),
                                     GatherPairs(p.dy, p.token, p.w, at::kBFloat16).rows,
                                     GatherPairs(p.dy, p.token, p.w, at::kBFloat16).scaled};
    };
    setenv("DTA_MOE_ROWS", "0", 1);
    const std::vector<at::Tensor> aten = run();
    unsetenv("DTA_MOE_ROWS");
    const std::vector<at::Tensor> kernels = run();
    const std::vector<at::Tensor> again = run();
    for (size_t i = 0; i < aten.size(); ++i) {
      SCOPED_TRACE(i);
      EXPECT_TRUE(at::equal(kernels[i], again[i]));
      if (i >= 3) {
        EXPECT_TRUE(at::equal(kernels[i], aten[i]));  // one rounding each: bit for bit
      } else {
        const double scale = aten[i].abs().max().item<double>();
        EXPECT_LE((kernels[i] - aten[i]).abs().max().item<double>(), 4e-7 * scale);
      }
    }
  }
}

}  // namespace
}  // namespace dta::kernels

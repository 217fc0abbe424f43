// GatherRows and AddRowsInto: the gather and its gradient against a one-hot matrix product in
// float64 (repeated, unused and out-of-order indices), bad input named, and on a GPU (skipped
// without one) the same bits on every run where index_add_'s atomics varied.
#include "executor/model/ops/gather_rows.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include "gtest/gtest.h"

namespace dta {
namespace {

TEST(GatherRows, GradientIsTheOneHotProductsInFloat64) {
  at::manual_seed(1);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor table = at::randn({5, 3}, f64).requires_grad_(true);
  // Row 1 three times, row 4 never, out of order.
  const at::Tensor index = at::tensor({1, 3, 1, 0, 2, 1}, at::TensorOptions().dtype(at::kLong));
  const at::Tensor upstream = at::randn({6, 3}, f64);
  const at::Tensor gathered = GatherRows(table, index);
  EXPECT_TRUE(at::equal(gathered, table.detach().index_select(0, index)));
  (gathered * upstream).sum().backward();
  // d table = onehot(index)^T @ upstream.
  const at::Tensor onehot = at::one_hot(index, 5).to(at::kDouble);
  EXPECT_LE((table.grad() - onehot.t().mm(upstream)).abs().max().item<double>(), 1e-15);
  EXPECT_TRUE(at::equal(table.grad()[4], at::zeros({3}, f64)));
}

TEST(GatherRows, AddRowsIntoNamesBadInput) {
  at::Tensor accumulator = at::zeros({4, 2});
  const at::Tensor index = at::tensor({0, 1}, at::TensorOptions().dtype(at::kLong));
  EXPECT_THROW(
      {
        try {
          AddRowsInto(accumulator, index, at::zeros({2, 2}, at::kDouble));
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("rows must have the accumulator's dtype"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      c10::Error);
  EXPECT_THROW(AddRowsInto(accumulator, index, at::zeros({3, 2})), c10::Error);
  // No rows: nothing added.
  AddRowsInto(accumulator, index.slice(0, 0, 0), at::zeros({0, 2}));
  EXPECT_TRUE(at::equal(accumulator, at::zeros({4, 2})));
}

// 200,000 float32 rows into 3 slots (the shape that made index_add_'s sums vary): every run gives
// the same bits, within float32 rounding of the float64 sum.
TEST(GatherRows, AddRowsIntoIsReproducibleOnTheGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(2);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const at::Tensor index = at::randint(0, 3, {200000}, cuda.dtype(at::kLong));
  const at::Tensor rows = at::randn({200000, 64}, cuda.dtype(at::kFloat));
  at::Tensor first = at::zeros({3, 64}, cuda.dtype(at::kFloat));
  AddRowsInto(first, index, rows);
  for (int run = 0; run < 5; ++run) {
    at::Tensor again = at::zeros({3, 64}, cuda.dtype(at::kFloat));
    AddRowsInto(again, index, rows);
    EXPECT_TRUE(at::equal(again, first)) << "run " << run;
  }
  at::Tensor exact = at::zeros({3, 64}, cuda.dtype(at::kDouble));
  exact.index_add_(0, index, rows.to(at::kDouble));
  EXPECT_LE(((first.to(at::kDouble) - exact).norm() / exact.norm()).item<double>(), 1e-5);
}

}  // namespace
}  // namespace dta

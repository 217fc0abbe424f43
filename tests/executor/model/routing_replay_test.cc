// Routing replay in the sparse block (executor/model/ops/moe.h's SparseMoe with `replay`): the
// router's own choice replayed is bitwise no replay; replayed experts (with rows that route
// themselves) equal a plain ATen autograd reference in float64, forward and every gradient; the
// load-balancing loss still counts the router's own top-k.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <optional>
#include <vector>

#include "executor/model/ops/moe.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

constexpr int64_t kTokens = 11, kHidden = 12, kExperts = 6, kWidth = 5, kTopK = 3;
constexpr double kEps = 1e-6;

struct Weights {
  at::Tensor norm, router, gate, up, down;
  std::vector<at::Tensor> all() const { return {norm, router, gate, up, down}; }
};

Weights MakeWeights() {
  const at::TensorOptions f64 = at::TensorOptions().dtype(at::kDouble);
  at::manual_seed(7);
  return {.norm = (1 + 0.1 * at::randn({kHidden}, f64)).requires_grad_(),
          .router = at::randn({kExperts, kHidden}, f64).requires_grad_(),
          .gate = (0.3 * at::randn({kExperts, kWidth, kHidden}, f64)).requires_grad_(),
          .up = (0.3 * at::randn({kExperts, kWidth, kHidden}, f64)).requires_grad_(),
          .down = (0.3 * at::randn({kExperts, kHidden, kWidth}, f64)).requires_grad_()};
}

struct Result {
  at::Tensor y, own_index, dx;
  std::vector<at::Tensor> grads;  // of Weights::all()
};

void ZeroGrads(const Weights& w) {
  for (const at::Tensor& p : w.all()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
}

std::vector<at::Tensor> Grads(const Weights& w) {
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : w.all()) grads.push_back(p.grad().clone());
  return grads;
}

// The op, with a fixed upstream gradient dy and a gradient seeded at the probabilities.
Result RunOp(const Weights& w, const at::Tensor& x_value, const at::Tensor& dy,
             const at::Tensor& dprobs, bool norm_topk, const std::optional<at::Tensor>& replay) {
  ZeroGrads(w);
  const at::Tensor x = x_value.clone().requires_grad_();
  const torch::autograd::variable_list out =
      SparseMoe::apply(x, w.norm, kEps, w.router, w.gate, w.up, w.down, kTopK, norm_topk,
                       /*group=*/0, /*expert_group=*/0, std::nullopt, /*residual=*/false, replay,
                       /*fresh_gradients=*/0);
  torch::autograd::backward({out[0], out[1]}, {dy, dprobs});
  return {.y = out[0].detach(), .own_index = out[2], .dx = x.grad().clone(), .grads = Grads(w)};
}

// transformers' block with the given experts per token (-1 rows: the router's own top-k), in
// plain differentiable ATen.
Result RunReference(const Weights& w, const at::Tensor& x_value, const at::Tensor& dy,
                    const at::Tensor& dprobs, bool norm_topk, const at::Tensor& replay) {
  ZeroGrads(w);
  const at::Tensor x = x_value.clone().requires_grad_();
  const at::Tensor xb = x * at::rsqrt(x.pow(2).mean(-1, true) + kEps) * w.norm;
  const at::Tensor probs = at::softmax(at::mm(xb, w.router.t()), -1);
  const at::Tensor own = std::get<1>(at::topk(probs.detach(), kTopK, -1));
  const at::Tensor recorded = replay.ge(0).all(-1, true);
  const at::Tensor index = at::where(recorded, replay, own);
  at::Tensor top = probs.gather(1, index);
  if (norm_topk) top = top / top.sum(-1, true);
  std::vector<at::Tensor> rows;
  for (int64_t t = 0; t < kTokens; ++t) {
    at::Tensor row = at::zeros({kHidden}, x.options());
    for (int64_t j = 0; j < kTopK; ++j) {
      const int64_t e = index[t][j].item<int64_t>();
      const at::Tensor h = xb[t];
      const at::Tensor act = at::silu(at::mv(w.gate[e], h)) * at::mv(w.up[e], h);
      row = row + top[t][j] * at::mv(w.down[e], act);
    }
    rows.push_back(row);
  }
  const at::Tensor y = at::stack(rows);
  torch::autograd::backward({y, probs}, {dy, dprobs});
  return {.y = y.detach(), .own_index = own, .dx = x.grad().clone(), .grads = Grads(w)};
}

double RelativeError(const at::Tensor& a, const at::Tensor& b) {
  const double scale = b.norm().item<double>();
  return (a - b).norm().item<double>() / (scale > 0 ? scale : 1.0);
}

struct Inputs {
  at::Tensor x, dy, dprobs;
};

Inputs MakeInputs() {
  const at::TensorOptions f64 = at::TensorOptions().dtype(at::kDouble);
  at::manual_seed(11);
  return {.x = at::randn({kTokens, kHidden}, f64),
          .dy = at::randn({kTokens, kHidden}, f64),
          .dprobs = 0.1 * at::randn({kTokens, kExperts}, f64)};
}

TEST(RoutingReplay, ReplayingTheRoutersOwnChoiceIsBitwiseNoReplay) {
  const Weights w = MakeWeights();
  const Inputs in = MakeInputs();
  for (const bool norm_topk : {false, true}) {
    const Result own = RunOp(w, in.x, in.dy, in.dprobs, norm_topk, std::nullopt);
    const Result replayed = RunOp(w, in.x, in.dy, in.dprobs, norm_topk, own.own_index.clone());
    EXPECT_TRUE(at::equal(replayed.y, own.y)) << norm_topk;
    EXPECT_TRUE(at::equal(replayed.dx, own.dx)) << norm_topk;
    for (size_t i = 0; i < own.grads.size(); ++i) {
      EXPECT_TRUE(at::equal(replayed.grads[i], own.grads[i])) << norm_topk << " weight " << i;
    }
  }
}

TEST(RoutingReplay, ReplayedExpertsEqualAnAtenReferenceInFloat64) {
  const Weights w = MakeWeights();
  const Inputs in = MakeInputs();
  // Each row k distinct experts in an arbitrary order; rows 2 and 7 unrecorded (route themselves).
  at::manual_seed(3);
  std::vector<at::Tensor> rows;
  for (int64_t t = 0; t < kTokens; ++t) {
    rows.push_back(t == 2 || t == 7 ? at::full({kTopK}, -1, at::kLong)
                                    : at::randperm(kExperts, at::kLong).slice(0, 0, kTopK));
  }
  const at::Tensor replay = at::stack(rows);
  for (const bool norm_topk : {false, true}) {
    const Result op = RunOp(w, in.x, in.dy, in.dprobs, norm_topk, replay);
    const Result reference = RunReference(w, in.x, in.dy, in.dprobs, norm_topk, replay);
    EXPECT_LT(RelativeError(op.y, reference.y), 1e-12) << norm_topk;
    EXPECT_LT(RelativeError(op.dx, reference.dx), 1e-12) << norm_topk;
    for (size_t i = 0; i < op.grads.size(); ++i) {
      EXPECT_LT(RelativeError(op.grads[i], reference.grads[i]), 1e-12)
          << norm_topk << " weight " << i;
    }
    // The load-balancing loss counts the router's own choice, not the replayed one.
    EXPECT_TRUE(at::equal(op.own_index, reference.own_index));
    // And the replay changed the routing (else this test would not test it).
    EXPECT_FALSE(at::equal(op.y, RunOp(w, in.x, in.dy, in.dprobs, norm_topk, std::nullopt).y));
  }
}

TEST(RoutingReplay, ReplayOfTheWrongShapeIsRefused) {
  const Weights w = MakeWeights();
  const Inputs in = MakeInputs();
  const at::Tensor wrong = at::zeros({kTokens, kTopK + 1}, at::kLong);
  EXPECT_THROW(RunOp(w, in.x, in.dy, in.dprobs, true, wrong), c10::Error);
}

}  // namespace
}  // namespace dta

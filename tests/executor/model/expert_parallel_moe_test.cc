// The sparse block with its experts spread over expert-parallel ranks (SparseMoe with an
// ExpertParallelGroup, executor/model/ops/moe.h), ranks as threads over Gloo, float64: every
// rank's outputs, input gradient, router and norm gradients equal the block run on that rank's
// tokens alone with every expert, and each rank's experts' gradients equal that block of the sum
// over every rank's tokens (1e-12). Ranks hold different numbers of tokens, one none, some replay
// routings (with rows that route themselves), and a load-balancing gradient is seeded; two calls
// in a row check that the exchanges match call by call. Where two GPUs are present, the same over
// NCCL (one rank per GPU): float64 to 1e-12, bfloat16 to its rounding.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include <optional>
#include <string>
#include <vector>

#include "executor/distributed/expert_parallel_group.h"
#include "executor/model/ops/moe.h"
#include "executor/model/ops/numerics.h"
#include "gtest/gtest.h"
#include "tests/testing/gloo_ranks.h"

namespace dta {
namespace {

constexpr int64_t kHidden = 6, kExperts = 5, kWidth = 4, kTopK = 2;
constexpr double kEps = 1e-6;
const at::TensorOptions kF64 = at::TensorOptions().dtype(at::kDouble);

struct Weights {
  at::Tensor norm, router, gate, up, down;
  std::vector<at::Tensor> all() const { return {norm, router, gate, up, down}; }
};

Weights FullWeights() {
  at::Generator g = at::detail::createCPUGenerator(11);
  return {.norm = 1 + 0.1 * at::randn({kHidden}, g, kF64),
          .router = at::randn({kExperts, kHidden}, g, kF64),
          .gate = 0.3 * at::randn({kExperts, kWidth, kHidden}, g, kF64),
          .up = 0.3 * at::randn({kExperts, kWidth, kHidden}, g, kF64),
          .down = 0.3 * at::randn({kExperts, kHidden, kWidth}, g, kF64)};
}

// Rank r's inputs for call `call`: its tokens, upstream gradients and replayed experts.
struct Inputs {
  at::Tensor x, dy, dprobs;
  std::optional<at::Tensor> replay;
};

Inputs RankInputs(int rank, int call) {
  const int64_t tokens = std::vector<int64_t>{3, 0, 7, 2}[rank] + call;
  at::Generator g = at::detail::createCPUGenerator(100 * rank + call);
  Inputs in{.x = at::randn({tokens, kHidden}, g, kF64),
            .dy = at::randn({tokens, kHidden}, g, kF64),
            .dprobs = 0.1 * at::randn({tokens, kExperts}, g, kF64),
            .replay = std::nullopt};
  if (rank % 2 == 0 && tokens > 0) {
    at::Tensor replay = at::empty({tokens, kTopK}, at::kLong);
    for (int64_t t = 0; t < tokens; ++t) {
      const at::Tensor order = at::randperm(kExperts, g, at::kLong);
      replay[t] = t % 3 == 1 ? at::full({kTopK}, -1, at::kLong) : order.slice(0, 0, kTopK);
    }
    in.replay = replay;
  }
  return in;
}

struct Outputs {
  at::Tensor y, dx;
  std::vector<at::Tensor> grads;  // of Weights::all()
};

// One call of the block on `in` with `w` (leaves whose .grad collect), under `expert_group`.
Outputs RunBlock(const Weights& w, const Inputs& in, int64_t expert_group) {
  for (const at::Tensor& p : w.all()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  const at::Tensor x = in.x.clone().requires_grad_();
  const torch::autograd::variable_list out =
      SparseMoe::apply(x, w.norm, kEps, w.router, w.gate, w.up, w.down, kTopK, /*norm_topk=*/true,
                       /*group=*/0, expert_group, std::nullopt, /*residual=*/false, in.replay,
                       /*fresh_gradients=*/0);
  torch::autograd::backward({out[0], out[1]}, {in.dy, in.dprobs});
  Outputs result{.y = out[0].detach(), .dx = x.grad().clone(), .grads = {}};
  for (const at::Tensor& p : w.all()) {
    result.grads.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
  }
  return result;
}

Weights Leaves(const Weights& w) {
  Weights leaves;
  std::vector<at::Tensor*> slots = {&leaves.norm, &leaves.router, &leaves.gate, &leaves.up,
                                    &leaves.down};
  const std::vector<at::Tensor> values = w.all();
  for (size_t i = 0; i < slots.size(); ++i) *slots[i] = values[i].clone().requires_grad_();
  return leaves;
}

void ExpectClose(const at::Tensor& value, const at::Tensor& reference, const std::string& what) {
  ASSERT_EQ(value.sizes(), reference.sizes()) << what;
  if (reference.numel() == 0) return;
  const double scale = std::max(1.0, reference.abs().max().item<double>());
  EXPECT_LE((value - reference).abs().max().item<double>(), 1e-12 * scale) << what;
}

class ExpertParallelMoe : public ::testing::TestWithParam<int> {};

TEST_P(ExpertParallelMoe, EqualsEveryExpertOnOneRank) {
  const int ranks = GetParam();
  const Weights full = FullWeights();
  testing::RunRanks(ranks, [&](ProcessGroup& group) {
    const ExpertParallelOverProcessGroup ep(group);
    const int me = ep.rank();
    const IndexRange mine = ExpertRange(kExperts, me, ranks);
    Weights local = Leaves(full);
    local.gate = full.gate.slice(0, mine.begin, mine.end).clone().requires_grad_();
    local.up = full.up.slice(0, mine.begin, mine.end).clone().requires_grad_();
    local.down = full.down.slice(0, mine.begin, mine.end).clone().requires_grad_();
    for (int call = 0; call < 2; ++call) {
      SCOPED_TRACE("rank " + std::to_string(me) + " call " + std::to_string(call));
      const Outputs got = RunBlock(local, RankInputs(me, call), ExpertGroupHandle(&ep));
      // The reference: every rank's tokens alone with every expert.
      const Weights reference = Leaves(full);
      std::vector<at::Tensor> expert_grads(3);
      Outputs own;
      for (int r = 0; r < ranks; ++r) {
        const Outputs one = RunBlock(reference, RankInputs(r, call), /*expert_group=*/0);
        for (int i = 0; i < 3; ++i) {
          expert_grads[i] =
              expert_grads[i].defined() ? expert_grads[i] + one.grads[2 + i] : one.grads[2 + i];
        }
        if (r == me) own = one;
      }
      ExpectClose(got.y, own.y, "y");
      ExpectClose(got.dx, own.dx, "dx");
      ExpectClose(got.grads[0], own.grads[0], "norm");
      ExpectClose(got.grads[1], own.grads[1], "router");
      for (int i = 0; i < 3; ++i) {
        ExpectClose(got.grads[2 + i], expert_grads[i].slice(0, mine.begin, mine.end),
                    std::vector<std::string>{"gate", "up", "down"}[i]);
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ExpertParallelMoe, ::testing::Values(2, 3, 4));

// Two ranks on two GPUs over NCCL, in `dtype`: outputs within `tolerance` of every expert on one
// GPU (relative to the largest magnitude), gradients within `grad_tolerance`.
void CheckOnTwoGpus(at::ScalarType dtype, double tolerance, double grad_tolerance) {
  const Weights full = FullWeights();
  testing::RunRanksOnGpus(2, [&](ProcessGroup& group) {
    const int r = group.rank();
    const at::Device device = group.device();
    const ExpertParallelOverProcessGroup ep(group);
    const IndexRange mine = ExpertRange(kExperts, r, 2);
    const auto on_gpu = [&](const at::Tensor& t) { return t.to(device, dtype); };
    const auto leaves = [&](const Weights& w, bool local) {
      const auto experts = [&](const at::Tensor& t) {
        return local ? t.slice(0, mine.begin, mine.end) : t;
      };
      return Weights{.norm = on_gpu(w.norm).requires_grad_(),
                     .router = on_gpu(w.router).requires_grad_(),
                     .gate = on_gpu(experts(w.gate)).requires_grad_(),
                     .up = on_gpu(experts(w.up)).requires_grad_(),
                     .down = on_gpu(experts(w.down)).requires_grad_()};
    };
    const auto inputs = [&](int rank) {
      Inputs in = RankInputs(rank, 0);
      in.x = on_gpu(in.x);
      in.dy = on_gpu(in.dy);
      in.dprobs = in.dprobs.to(device, ComputeType(dtype));
      if (in.replay) in.replay = in.replay->to(device);
      return in;
    };
    const Outputs got = RunBlock(leaves(full, true), inputs(r), ExpertGroupHandle(&ep));
    const Weights reference = leaves(full, false);
    std::vector<at::Tensor> expert_grads(3);
    Outputs own;
    for (int s = 0; s < 2; ++s) {
      const Outputs one = RunBlock(reference, inputs(s), /*expert_group=*/0);
      for (int i = 0; i < 3; ++i) {
        expert_grads[i] =
            expert_grads[i].defined() ? expert_grads[i] + one.grads[2 + i] : one.grads[2 + i];
      }
      if (s == r) own = one;
    }
    const auto close = [](const at::Tensor& a, const at::Tensor& b, double tol, const char* what) {
      if (b.numel() == 0) return;
      const double scale = std::max(1.0, b.abs().max().item<double>());
      const double error = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
      EXPECT_LE(error, tol * scale) << what;
    };
    close(got.y, own.y, tolerance, "y");
    close(got.dx, own.dx, grad_tolerance, "dx");
    close(got.grads[1], own.grads[1], grad_tolerance, "router");
    for (int i = 0; i < 3; ++i)
      close(got.grads[2 + i], expert_grads[i].slice(0, mine.begin, mine.end), grad_tolerance,
            "experts");
  });
}

TEST(ExpertParallelMoeNccl, TwoGpusEqualEveryExpertOnOne) {
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  CheckOnTwoGpus(at::kDouble, 1e-12, 1e-12);
  // bfloat16: the grouped GEMMs see other row counts per expert (their tiles may differ) and the
  // experts' weight gradients sum the rows in another order: within bfloat16's rounding.
  CheckOnTwoGpus(at::kBFloat16, 2e-2, 2e-2);
}

}  // namespace
}  // namespace dta

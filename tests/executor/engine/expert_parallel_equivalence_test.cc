// A decoder whose sparse layers' experts are spread over expert-parallel ranks (Decoder with an
// ExpertParallelGroup; ranks as threads over Gloo), float64: each rank trains its own rollouts with
// the methods whose model calls are the same on every rank without a lockstep (dense over equally
// many rollouts, packed as one forward), and its loss, log-probabilities and every gradient equal
// a single process holding every expert on that rank's rollouts, but for the experts' gradients,
// which equal this rank's block of the sum over every rank's rollouts (1e-10). With the router's
// load-balancing loss and routing replay on one rank's rollouts.
#include <string>
#include <vector>

#include "executor/distributed/expert_parallel_group.h"
#include "executor/engine/executor.h"
#include "gtest/gtest.h"
#include "tests/testing/executor_cases.h"
#include "tests/testing/gloo_ranks.h"

namespace dta {
namespace {

using testing::MakeRollouts;
using testing::MethodRun;
using testing::RelativeError;
using testing::RunMethod;

ModelConfig TinyMoe() { return testing::WithFamily(testing::TinyConfig(), "qwen3_moe"); }

// Rank r's rollouts: three per rank (dense runs them one forward each), different trees.
std::vector<Rollout> RankRollouts(int rank) {
  std::vector<std::vector<TokenId>> sequences = {
      {1, 2, 3, 4, 5, 6}, {1, 2, 3, 7, 8}, {9, 10, 11, 12, 13, 14, 15, 16}};
  for (auto& s : sequences) {
    for (TokenId& t : s) t = static_cast<TokenId>((t + 3 * rank) % 19);
  }
  std::vector<Rollout> rollouts = MakeRollouts(sequences, 10 + rank);
  for (Rollout& r : rollouts) r.group = "g";  // one group per rank: non-zero advantages
  if (rank == 1) {
    // Routing replay on this rank: top-2 of 5 experts at both (sparse) layers, last token unrouted.
    for (Rollout& r : rollouts) {
      RoutedExperts routed{.layers = 2, .top_k = 2, .ids = {}};
      for (size_t t = 0; t + 1 < r.tokens.size(); ++t) {
        for (int l = 0; l < 2; ++l) {
          routed.ids.push_back(static_cast<int32_t>((t + l) % 5));
          routed.ids.push_back(static_cast<int32_t>((t + l + 2) % 5));
        }
      }
      r.routed_experts = routed;
    }
  }
  return rollouts;
}

class ExpertParallelEquivalence : public ::testing::TestWithParam<int> {};

TEST_P(ExpertParallelEquivalence, EachRankEqualsOneProcessWithEveryExpert) {
  const int ranks = GetParam();
  const ModelConfig config = TinyMoe();
  const at::TensorOptions f64 = at::TensorOptions().dtype(at::kDouble);
  const LossOptions loss{.kind = LossKind::kPpo, .router_aux_loss_coef = 0.5};
  const std::vector<ExecutorOptions> methods = {{.method = Method::kDense},
                                                {.method = Method::kPacked}};
  testing::RunRanks(ranks, [&](ProcessGroup& group) {
    auto ep = std::make_shared<ExpertParallelOverProcessGroup>(group);
    Decoder model(config, f64, nullptr, ep);
    model.InitRandom(7, 0.3);
    Decoder whole(config, f64);
    whole.InitRandom(7, 0.3);
    const int me = ep->rank();
    for (const ExecutorOptions& options : methods) {
      SCOPED_TRACE(std::string(MethodName(options.method)) + " rank " + std::to_string(me));
      const MethodRun got = RunMethod(model, RankRollouts(me), loss, options);
      std::vector<MethodRun> reference;
      for (int r = 0; r < ranks; ++r)
        reference.push_back(RunMethod(whole, RankRollouts(r), loss, options));
      const MethodRun& own = reference[me];
      EXPECT_NEAR(got.result.loss, own.result.loss,
                  1e-10 * std::max(1.0, std::abs(own.result.loss)));
      EXPECT_NEAR(got.result.router_aux_loss, own.result.router_aux_loss, 1e-10);
      for (size_t i = 0; i < got.result.logprobs.size(); ++i)
        EXPECT_LE(RelativeError(got.result.logprobs[i], own.result.logprobs[i]), 1e-10);
      for (size_t i = 0; i < model.named_parameters().size(); ++i) {
        const ParameterSplit& split = model.parameter_splits()[i];
        at::Tensor expected = own.grads[i];
        if (split.expert_parallel()) {
          expected = at::zeros_like(own.grads[i]);
          for (const MethodRun& run : reference) expected += run.grads[i];
          expected = expected.narrow(0, split.experts.begin, split.experts.size());
        }
        EXPECT_GT(expected.norm().item<double>(), 0.0) << model.named_parameters()[i].first;
        EXPECT_LE(RelativeError(got.grads[i], expected), 1e-10)
            << model.named_parameters()[i].first;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ExpertParallelEquivalence, ::testing::Values(2, 3));

}  // namespace
}  // namespace dta

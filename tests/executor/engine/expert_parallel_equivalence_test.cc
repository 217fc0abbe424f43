// A decoder whose sparse layers' experts are spread over expert-parallel ranks (Decoder with an
// ExpertParallelGroup; ranks as threads over Gloo), float64. Each rank trains its own rollouts
// (different trees, so every method makes different model calls on every rank, and the last of
// three or more has none: the engine's lockstep pads them), with every method and layout of the
// exactness tests (EP 2, 3 and 4, and EP 2 x TP 2). Its loss, log-probabilities and every gradient
// equal a single process holding every expert on that rank's rollouts, but for the experts'
// gradients, which equal this rank's block of the sum over every rank's rollouts (1e-10). With the
// router's load-balancing loss, routing replay on one rank's rollouts, decoupled PPO's forward-only
// proximal pass, and ComputeLogprobs; the same on two GPUs over NCCL where a machine has them.
// Under EP x TP the TP peers of a replica train the same rollouts and each holds its slice of every
// tensor-parallel parameter: its gradients equal that slice of the single process's.
#include <torch/cuda.h>

#include <string>
#include <vector>

#include "executor/distributed/expert_parallel_group.h"
#include "executor/distributed/parallel_groups.h"
#include "executor/engine/executor.h"
#include "gtest/gtest.h"
#include "tests/core/tree/random_trees.h"
#include "tests/testing/executor_cases.h"
#include "tests/testing/gloo_ranks.h"

namespace dta {
namespace {

using testing::MakeRollouts;
using testing::MethodRun;
using testing::RelativeError;
using testing::RunMethod;

constexpr double kTolerance = 1e-10;

// Rank r's rollouts: its own random trees (duplicates, prefixes, one-token segments) in one GRPO
// group, rank 0 also a 30-token chain; the last rank of three or more has none. Rank 1's carry
// routing replay at every layer (the dense layers' rows are unused), the last token unrouted.
std::vector<Rollout> RankRollouts(const ModelConfig& config, int rank, int ranks) {
  if (ranks >= 3 && rank == ranks - 1) return {};
  std::vector<std::vector<TokenId>> sequences =
      testing::RandomRollouts(100 + rank, {.max_rollouts = 6, .max_length = 8, .vocab = 3});
  for (auto& tokens : sequences) {
    for (TokenId& t : tokens) t = static_cast<TokenId>((6 * t + rank) % config.vocab_size);
  }
  // A rollout that is a prefix of another, on every rank with rollouts: at least two per GRPO
  // group, so the advantages are not all zero.
  sequences.push_back({5, 6, 7, 8});
  sequences.push_back({5, 6, 7});
  if (rank == 0) {
    std::vector<TokenId> chain;
    for (int t = 0; t < 30; ++t) chain.push_back(static_cast<TokenId>((7 * t + 3) % 19));
    sequences.push_back(chain);
  }
  std::vector<Rollout> rollouts = MakeRollouts(sequences, 10 + rank);
  for (Rollout& r : rollouts) r.group = "g";
  if (rank == 1) {
    const int layers = static_cast<int>(config.num_hidden_layers);
    for (Rollout& r : rollouts) {
      RoutedExperts routed{.layers = layers, .top_k = 2, .ids = {}};
      for (size_t t = 0; t + 1 < r.tokens.size(); ++t) {
        for (int l = 0; l < layers; ++l) {
          routed.ids.push_back(static_cast<int32_t>((t + l) % 5));
          routed.ids.push_back(static_cast<int32_t>((t + l + 2) % 5));
        }
      }
      r.routed_experts = routed;
    }
  }
  return rollouts;
}

struct Case {
  int ranks;  // expert-parallel ranks
  std::string family;
  bool gpus = false;        // rank r on CUDA device r over NCCL; Gloo on the CPU otherwise
  int tensor_parallel = 1;  // TP peers per EP rank (Gloo only): ranks x tensor_parallel processes
};

class ExpertParallelEquivalence : public ::testing::TestWithParam<Case> {
 protected:
  ModelConfig Config() const {
    return testing::WithFamily(testing::TinyConfig(), GetParam().family);
  }

  // body(model, whole, rank, rollouts) on every rank: `model` holds the rank's experts, `whole`
  // every expert, with the same weights; `rollouts` are the rank's.
  template <typename Body>
  void OnEveryRank(Body body) const {
    const int ranks = GetParam().ranks;
    const ModelConfig config = Config();
    const auto run = [&](ProcessGroup& group) {
      const at::TensorOptions f64 = at::TensorOptions().dtype(at::kDouble).device(group.device());
      auto ep = std::make_shared<ExpertParallelOverProcessGroup>(group);
      Decoder model(config, f64, nullptr, ep);
      model.InitRandom(7, 0.3);
      Decoder whole(config, f64);
      whole.InitRandom(7, 0.3);
      body(model, whole, ep->rank(), RankRollouts(config, ep->rank(), ranks));
    };
    const int tp = GetParam().tensor_parallel;
    if (tp > 1) {
      testing::RunRanks(ranks * tp, [&](ProcessGroup& world) {
        const ParallelGroups groups(world, tp, ranks, testing::LoopbackOptions());
        const at::TensorOptions f64 = at::TensorOptions().dtype(at::kDouble);
        Decoder model(config, f64, groups.tensor_parallel_collectives(),
                      groups.expert_parallel_collectives());
        model.InitRandom(7, 0.3);
        Decoder whole(config, f64);
        whole.InitRandom(7, 0.3);
        const int me = groups.expert_parallel_rank();
        body(model, whole, me, RankRollouts(config, me, ranks));
      });
    } else if (!GetParam().gpus) {
      testing::RunRanks(ranks, run);
    } else if (torch::cuda::device_count() < ranks) {
      GTEST_SKIP() << "needs " << ranks << " CUDA devices";
    } else {
      testing::RunRanksOnGpus(ranks, run);
    }
  }

  // On every rank, `run` on the expert-parallel model and on one process holding every expert
  // (for each rank's rollouts) compare as the file's comment says.
  void ExpectExact(const std::vector<std::pair<std::string, ExecutorOptions>>& methods,
                   const LossOptions& loss) {
    const int ranks = GetParam().ranks;
    const ModelConfig config = Config();
    OnEveryRank(
        [&](const Decoder& model, const Decoder& whole, int me, const std::vector<Rollout>& mine) {
          for (const auto& [name, options] : methods) {
            SCOPED_TRACE(name + ", rank " + std::to_string(me));
            const MethodRun got = RunMethod(model, mine, loss, options);
            std::vector<MethodRun> reference;
            for (int r = 0; r < ranks; ++r)
              reference.push_back(RunMethod(whole, RankRollouts(config, r, ranks), loss, options));
            const MethodRun& own = reference[me];
            EXPECT_NEAR(got.result.loss, own.result.loss,
                        kTolerance * std::max(1.0, std::abs(own.result.loss)));
            EXPECT_NEAR(got.result.router_aux_loss, own.result.router_aux_loss, kTolerance);
            ASSERT_EQ(got.result.logprobs.size(), mine.size());
            for (size_t i = 0; i < mine.size(); ++i)
              EXPECT_LE(RelativeError(got.result.logprobs[i], own.result.logprobs[i]), kTolerance);
            for (size_t i = 0; i < model.named_parameters().size(); ++i) {
              const std::string& parameter = model.named_parameters()[i].first;
              const ParameterSplit& split = model.parameter_splits()[i];
              at::Tensor expected = own.grads[i];
              if (split.expert_parallel()) {
                expected = at::zeros_like(own.grads[i]);
                for (const MethodRun& run : reference) expected += run.grads[i];
              }
              expected = model.LocalPart(i, expected);
              // Only a rank without rollouts has no gradient but its experts'.
              if (!mine.empty() || split.expert_parallel()) {
                EXPECT_GT(expected.norm().item<double>(), 0.0) << parameter;
              }
              EXPECT_LE(RelativeError(got.grads[i], expected), kTolerance) << parameter;
            }
          }
        });
  }
};

int64_t Longest(const ModelConfig& config, int ranks) {
  int64_t longest = 0;
  for (int r = 0; r < ranks; ++r) {
    for (const Rollout& rollout : RankRollouts(config, r, ranks))
      longest = std::max<int64_t>(longest, rollout.tokens.size());
  }
  return longest;
}

TEST_P(ExpertParallelEquivalence, EveryMethodWithTheRouterBalanceLoss) {
  ExpectExact(testing::ExactnessMethods(Longest(Config(), GetParam().ranks)),
              {.kind = LossKind::kPpo, .router_aux_loss_coef = 0.5});
}

TEST_P(ExpertParallelEquivalence, DecoupledPpoAlignsItsProximalPass) {
  ExpectExact({{"dense", {.method = Method::kDense}},
               {"dta B=3 budget=4", {.method = Method::kDta, .block_size = 3, .graph_budget = 4}}},
              {.kind = LossKind::kDecoupledPpo, .behave_imp_weight_cap = 5.0});
}

TEST_P(ExpertParallelEquivalence, LogprobsOnlyPasses) {
  const int64_t longest = Longest(Config(), GetParam().ranks);
  OnEveryRank(
      [&](const Decoder& model, const Decoder& whole, int me, const std::vector<Rollout>& mine) {
        for (const auto& [name, options] : testing::ExactnessMethods(longest)) {
          SCOPED_TRACE(name + ", rank " + std::to_string(me));
          const std::vector<at::Tensor> got = ComputeLogprobs(model, mine, options);
          const std::vector<at::Tensor> expected = ComputeLogprobs(whole, mine, options);
          ASSERT_EQ(got.size(), mine.size());
          for (size_t i = 0; i < mine.size(); ++i)
            EXPECT_LE(RelativeError(got[i], expected[i]), kTolerance);
        }
      });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ExpertParallelEquivalence,
                         ::testing::Values(Case{2, "qwen3_moe"}, Case{3, "qwen3_moe"},
                                           Case{4, "qwen3_moe"}, Case{2, "qwen3_next"},
                                           Case{3, "qwen3_next"}, Case{2, "qwen3_5_moe_text"},
                                           Case{2, "qwen3_moe", false, /*tensor_parallel=*/2}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           const Case& c = info.param;
                           return c.family + "_ep" + std::to_string(c.ranks) +
                                  (c.tensor_parallel > 1 ? "_tp" + std::to_string(c.tensor_parallel)
                                                         : "");
                         });

// NCCL, one rank per GPU (float64: the same tolerance); skipped on fewer GPUs.
INSTANTIATE_TEST_SUITE_P(Gpus, ExpertParallelEquivalence,
                         ::testing::Values(Case{2, "qwen3_moe", true}, Case{2, "qwen3_next", true}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.family + "_ep" + std::to_string(info.param.ranks) +
                                  "_nccl";
                         });

}  // namespace
}  // namespace dta

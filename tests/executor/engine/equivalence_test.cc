// The contract: dense, packed tree and dta compute the same loss, the same log-probabilities and
// the same gradient of every parameter (float64, relative error <= 1e-9), on random trees with
// duplicates, prefix rollouts, one-token segments, a long chain and a wide branch, for every loss,
// for B in {1, 3, 64, unbounded}, both leaf orders, with and without a graph budget and packing
// (each case states pack: the executor packs by default).
// The random trees, the adversarial small trees, a 400-token chain and a 64-way branch run for
// every model family (FamilyEquivalence): Qwen3, Llama with q/k/v/o biases and llama3 rope scaling,
// Qwen2 with q/k/v biases and YaRN, Qwen3-MoE with top-2 of 5 experts, Qwen3-Next with a Gated
// DeltaNet layer whose recurrent state and convolution rows dta routes through its stack
// (testing::WithFamily).
#include "executor/engine/executor.h"
#include "tests/testing/test_family.h"

#include "executor/optim/adamw.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/base/scoped_env.h"
#include "core/model/family.h"
#include "gtest/gtest.h"
#include "tests/core/tree/random_trees.h"
#include "tests/testing/executor_cases.h"

namespace dta {
namespace {

// The test-only family runs every suite parametrized over the registry, as a shipped one.
[[maybe_unused]] const bool kTestFamilyRegistered = [] {
  RegisterTestFamily();
  return true;
}();

using testing::Losses;
using testing::MakeRollouts;
using testing::MethodRun;
using testing::RelativeError;
using testing::RunMethod;
using testing::TinyConfig;

constexpr double kTolerance = 1e-9;

void ExpectSame(const Decoder& model, const MethodRun& run, const MethodRun& reference,
                const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_NEAR(run.result.loss, reference.result.loss,
              kTolerance * std::max(1.0, std::abs(reference.result.loss)));
  EXPECT_NEAR(run.result.router_aux_loss, reference.result.router_aux_loss,
              kTolerance * std::max(1.0, std::abs(reference.result.router_aux_loss)));
  // The losses' diagnostics (token counts, clipping, KL, ratios, entropy), whatever order or
  // thread each method computed the rollouts' losses in.
  const auto sums = run.result.diagnostics.Sums(),
             reference_sums = reference.result.diagnostics.Sums();
  for (size_t i = 0; i < sums.size(); ++i) {
    EXPECT_NEAR(sums[i], reference_sums[i], kTolerance * std::max(1.0, std::abs(reference_sums[i])))
        << "diagnostics sum " << i;
  }
  EXPECT_EQ(run.result.diagnostics.ratio_max >= run.result.diagnostics.ratio_min,
            reference.result.diagnostics.ratio_max >= reference.result.diagnostics.ratio_min);
  if (reference.result.diagnostics.ratio_max >= reference.result.diagnostics.ratio_min) {
    EXPECT_NEAR(run.result.diagnostics.ratio_max, reference.result.diagnostics.ratio_max,
                kTolerance * std::abs(reference.result.diagnostics.ratio_max));
    EXPECT_NEAR(run.result.diagnostics.ratio_min, reference.result.diagnostics.ratio_min,
                kTolerance * std::abs(reference.result.diagnostics.ratio_min));
  }
  ASSERT_EQ(run.result.logprobs.size(), reference.result.logprobs.size());
  for (size_t r = 0; r < run.result.logprobs.size(); ++r) {
    EXPECT_LE(RelativeError(run.result.logprobs[r], reference.result.logprobs[r]), kTolerance)
        << "rollout " << r;
  }
  for (size_t i = 0; i < run.grads.size(); ++i) {
    // A zero reference would make the comparison vacuous.
    EXPECT_GT(reference.grads[i].norm().item<double>(), 0.0) << model.named_parameters()[i].first;
    const double error = RelativeError(run.grads[i], reference.grads[i]);
    EXPECT_LE(error, kTolerance) << model.named_parameters()[i].first;
  }
}

class Equivalence : public ::testing::Test {
 protected:
  explicit Equivalence(const ModelConfig& config = TinyConfig())
      : model_(config, at::TensorOptions().dtype(at::kDouble)) {
    model_.InitRandom(7, 0.3);
  }

  void CheckAllMethods(const std::vector<Rollout>& rollouts, const LossOptions& loss,
                       const std::string& what,
                       const std::vector<int64_t>& blocks = {1, 3, 64, kUnboundedBlock}) {
    const MethodRun dense = RunMethod(model_, rollouts, loss, {.method = Method::kDense});
    ExpectSame(model_, RunMethod(model_, rollouts, loss, {.method = Method::kPacked}), dense,
               what + " packed");
    ExpectSame(model_,
               RunMethod(model_, rollouts, loss, {.method = Method::kDense, .checkpointing = true}),
               dense, what + " dense+ckpt");
    // Packed under a capacity of the longest rollout: Tree Training's partitioning splits the tree.
    int64_t longest = 0;
    for (const Rollout& r : rollouts) longest = std::max<int64_t>(longest, r.tokens.size());
    ExpectSame(
        model_,
        RunMethod(model_, rollouts, loss, {.method = Method::kPacked, .token_capacity = longest}),
        dense, what + " packed capacity " + std::to_string(longest));
    ExpectSame(
        model_,
        RunMethod(model_, rollouts, loss,
                  {.method = Method::kPacked, .token_capacity = longest, .checkpointing = true}),
        dense, what + " packed+ckpt capacity " + std::to_string(longest));
    struct Variant {
      LeafOrderKind order;
      int64_t budget;
      bool pack;
    };
    const Variant variants[] = {{LeafOrderKind::kBackwardDfs, 0, false},
                                {LeafOrderKind::kLexicographic, 0, false},
                                {LeafOrderKind::kBackwardDfs, 6, true},
                                {LeafOrderKind::kLexicographic, 1 << 20, true}};
    for (int64_t block : blocks) {
      for (const Variant& v : variants) {
        const std::string name =
            what + " dta B=" + (block == kUnboundedBlock ? "inf" : std::to_string(block)) +
            (v.order == LeafOrderKind::kLexicographic ? " lex" : " bdfs") +
            " budget=" + std::to_string(v.budget) + (v.pack ? " packed" : "");
        ExpectSame(model_,
                   RunMethod(model_, rollouts, loss,
                             {.method = Method::kDta,
                              .block_size = block,
                              .order = v.order,
                              .graph_budget = v.budget,
                              .pack = v.pack}),
                   dense, name);
      }
    }
  }

  Decoder model_;
};

// Eight chunks of the chain and a branch off its sixth: every method's cost is quadratic in the
// chain's length in float64 on a CPU, so the chain is long in chunks, not in tokens.
TEST_F(Equivalence, LongChain) {
  std::vector<TokenId> chain(4000);
  for (size_t i = 0; i < chain.size(); ++i) chain[i] = static_cast<TokenId>((i * 7) % 19);
  std::vector<TokenId> branch(chain.begin(), chain.begin() + 2800);
  branch.push_back(3);
  CheckAllMethods(MakeRollouts({chain, branch}, 5), {.kind = LossKind::kPpo}, "chain", {512});
}

// A short prompt before long answers (AIME-like) runs as separate trees, the prompt recomputed
// for each answer (ExecutorOptions::unshared_prefix_fraction): the gradient is dense's either way,
// beside rollouts that stay shared (a duplicate, a rollout that is a prefix of a long one, a short
// answer), for B unbounded and 1000, both leaf orders, with and without packing, and a
// sequence-level loss (GSPO).
TEST_F(Equivalence, ShortPromptBeforeLongAnswersIsRecomputedExactly) {
  std::vector<TokenId> prompt(40);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<TokenId>((i * 5 + 1) % 19);
  auto answer = [&](TokenId first, int64_t length) {
    std::vector<TokenId> tokens = prompt;
    tokens.push_back(first);
    for (int64_t i = 1; i < length; ++i)
      tokens.push_back(static_cast<TokenId>((first * 7 + i * 3 + i / 5) % 19));
    return tokens;
  };
  const std::vector<TokenId> first = answer(2, 4200);
  const std::vector<TokenId> prefix_of_first(first.begin(), first.begin() + 240);
  const std::vector<std::vector<TokenId>> sequences = {first, answer(9, 4150), answer(5, 4300),
                                                       first, prefix_of_first, answer(11, 30)};
  const std::vector<Rollout> rollouts = MakeRollouts(sequences, 3);
  // Lexicographic order: 2..., 5..., 9..., 11...; the long answers are cut apart (40 shared tokens
  // of 4,200 is under 1/64), the short one stays on the prompt of the answer before it.
  int64_t tree_tokens = static_cast<int64_t>(prompt.size());
  for (const auto& s : {first, answer(9, 4150), answer(5, 4300), answer(11, 30)})
    tree_tokens += static_cast<int64_t>(s.size() - prompt.size());
  const MethodRun dense =
      RunMethod(model_, rollouts, {.kind = LossKind::kPpo}, {.method = Method::kDense});
  // Unbounded B: each answer one chunk, as on a GPU (no graphs kept and no packed step, so that a
  // CPU holds the scores).
  ExpectSame(model_,
             RunMethod(model_, rollouts, {.kind = LossKind::kPpo},
                       {.method = Method::kDta,
                        .block_size = kUnboundedBlock,
                        .graph_budget = 0,
                        .pack = false}),
             dense, "B inf");
  for (const double fraction : {1.0 / 64, 0.0}) {
    for (const auto& [pack, order] : {std::pair{false, LeafOrderKind::kBackwardDfs},
                                      std::pair{true, LeafOrderKind::kLexicographic}}) {
      const MethodRun run = RunMethod(model_, rollouts, {.kind = LossKind::kPpo},
                                      {.method = Method::kDta,
                                       .block_size = 1000,
                                       .order = order,
                                       .graph_budget = 1 << 20,
                                       .pack = pack,
                                       .unshared_prefix_fraction = fraction});
      const std::string what =
          "fraction " + std::to_string(fraction) + " B 1000" + (pack ? " packed lex" : " bdfs");
      ExpectSame(model_, run, dense, what);
      // Every graph kept: each tree's tokens are forwarded once, and with the default the prompt
      // once more for each of the two answers cut off the first tree.
      const int64_t recomputed = fraction > 0 ? 2 * static_cast<int64_t>(prompt.size()) : 0;
      EXPECT_EQ(run.result.forwarded_tokens, tree_tokens + recomputed) << what;
    }
  }
  // A sequence-level loss: each tree's rollouts are normalised with the whole batch's context.
  const LossOptions gspo{.kind = LossKind::kGspo};
  ExpectSame(
      model_,
      RunMethod(
          model_, rollouts, gspo,
          {.method = Method::kDta, .block_size = 1000, .graph_budget = 1 << 20, .pack = true}),
      RunMethod(model_, rollouts, gspo, {.method = Method::kDense}), "gspo");
  EXPECT_THROW(RunMethod(model_, rollouts, {.kind = LossKind::kPpo},
                         {.method = Method::kDta, .unshared_prefix_fraction = -1}),
               c10::Error);
}

class WideEquivalence : public Equivalence {
 protected:
  WideEquivalence() : Equivalence(TinyConfig(/*vocab=*/530)) {}
};

TEST_F(WideEquivalence, FiveHundredTwelveWayBranch) {
  std::vector<std::vector<TokenId>> sequences;
  for (TokenId i = 0; i < 512; ++i) sequences.push_back({1, 2, 3, 4, 5 + i, 7 + (i % 3)});
  CheckAllMethods(MakeRollouts(sequences, 9, 530), {.kind = LossKind::kPpo}, "512-way",
                  {3, kUnboundedBlock});
}

// The adversarial trees for each family. Every parameter's gradient is compared, biases included
// (ExpectSame also requires each reference gradient to be non-zero).
class FamilyEquivalence : public Equivalence, public ::testing::WithParamInterface<std::string> {
 protected:
  FamilyEquivalence() : Equivalence(testing::WithFamily(TinyConfig(), GetParam())) {}
};

// The decoder has what the family's traits (core/model/family.h) say its layers have, on this
// family's test model (testing::WithFamily): Qwen3-Next's layer 0 is linear attention with a dense
// MLP, every other family's is attention; layer 1 is sparse in the MoE families.
TEST_P(FamilyEquivalence, HasTheFamilysBiasesAndNorms) {
  std::vector<std::string> names;
  for (const auto& [name, p] : model_.named_parameters()) names.push_back(name);
  const auto has = [&](const std::string& name) {
    return std::find(names.begin(), names.end(), name) != names.end();
  };
  const ModelConfig& c = model_.config();
  const ModelFamily& family = *FindModelFamily(GetParam());
  const bool linear =
      family.linear_attention && c.layer_types.front() == LayerType::kLinearAttention;
  const bool sparse = family.moe && c.num_experts > 0;  // layer 1 (layer 0 dense with linear)
  const bool from_config = family.attention_bias == AttentionBiasRule::kFromConfig;
  const bool qkv_bias =
      family.attention_bias == AttentionBiasRule::kQkvAlways || (from_config && c.attention_bias);
  // Qwen3-Next's grouped input projections, or Qwen3.5's separate ones.
  const bool separate = family.separate_linear_projections;
  EXPECT_EQ(has("model.layers.0.linear_attn.in_proj_qkvz.weight"), linear && !separate);
  EXPECT_EQ(has("model.layers.0.linear_attn.in_proj_qkv.weight"), linear && separate);
  EXPECT_EQ(has("model.layers.0.linear_attn.in_proj_a.weight"), linear && separate);
  EXPECT_EQ(has("model.layers.0.linear_attn.A_log"), linear);
  EXPECT_EQ(has("model.layers.0.self_attn.q_proj.weight"), !linear);
  EXPECT_EQ(has("model.layers.1.mlp.shared_expert.gate_proj.weight"),
            sparse && family.shared_expert);
  EXPECT_EQ(has("model.layers.1.mlp.shared_expert_gate.weight"), sparse && family.shared_expert);
  EXPECT_EQ(model_.parameter("model.layers.1.self_attn.q_proj.weight").size(0),
            (family.gated_attention ? 2 : 1) * c.num_attention_heads * c.head_dim)
      << "gated attention: a query and a gate per head";
  EXPECT_EQ(has("model.layers.1.mlp.gate.weight"), sparse);
  EXPECT_EQ(has("model.layers.1.mlp.experts.gate_proj"), sparse);
  EXPECT_EQ(has("model.layers.1.mlp.experts.up_proj"), sparse);
  EXPECT_EQ(has("model.layers.1.mlp.experts.down_proj"), sparse);
  EXPECT_EQ(has("model.layers.1.mlp.gate_proj.weight"), !sparse);
  EXPECT_EQ(has("model.layers.1.self_attn.q_proj.bias"), qkv_bias);
  EXPECT_EQ(has("model.layers.1.self_attn.k_proj.bias"), qkv_bias);
  EXPECT_EQ(has("model.layers.1.self_attn.v_proj.bias"), qkv_bias);
  EXPECT_EQ(has("model.layers.1.self_attn.o_proj.bias"), from_config && c.attention_bias);
  EXPECT_EQ(has("model.layers.1.self_attn.q_norm.weight"), family.qk_norm);
  EXPECT_EQ(has("model.layers.1.self_attn.k_norm.weight"), family.qk_norm);
  // The test models switch every trait of their family on (no test passes by leaving one off).
  EXPECT_TRUE(family.attention_bias == AttentionBiasRule::kNone || qkv_bias) << GetParam();
  EXPECT_EQ(linear, family.linear_attention);
  EXPECT_EQ(sparse, family.moe);
}

TEST_P(FamilyEquivalence, RandomTreesEveryLoss) {
  const auto losses = Losses();
  for (uint64_t seed = 0; seed < 12; ++seed) {
    const auto sequences =
        testing::RandomRollouts(seed, {.max_rollouts = 10, .max_length = 12, .vocab = 4});
    const auto& [name, loss] = losses[seed % losses.size()];
    CheckAllMethods(MakeRollouts(sequences, seed), loss,
                    "seed " + std::to_string(seed) + " " + name);
  }
}

TEST_P(FamilyEquivalence, SharedPrefixWithDifferentAdvantagesAndMasks) {
  // Three rollouts share 6 tokens but carry different masks and advantages on them.
  std::vector<Rollout> rollouts =
      MakeRollouts({{1, 2, 3, 4, 5, 6, 7}, {1, 2, 3, 4, 5, 6, 8, 9}, {1, 2, 3, 4, 5, 6}}, 3);
  rollouts[0].loss_mask = {0, 1, 1, 1, 1, 1, 1};
  rollouts[1].loss_mask = {0, 0, 0, 1, 0, 1, 1, 1};
  rollouts[2].loss_mask = {0, 1, 0, 1, 0, 1};
  rollouts[0].advantages = {0, 1, 1, 1, 1, 1, 1};
  rollouts[1].advantages = {0, -2, -2, -2, -2, -2, -2, -2};
  rollouts[2].advantages = {0, 0.5, 0.5, 0.5, 0.5, 0.5};
  for (const auto& [name, loss] : Losses()) CheckAllMethods(rollouts, loss, name);
}

TEST_P(FamilyEquivalence, DuplicatesPrefixesAndOneTokenRollouts) {
  const std::vector<Rollout> rollouts =
      MakeRollouts({{5}, {5, 6}, {5, 6}, {5, 6, 7}, {5}, {4}, {5, 6, 7, 8, 9, 10}, {5, 6, 7}}, 11);
  CheckAllMethods(rollouts, {.kind = LossKind::kPpo}, "ppo");
  CheckAllMethods(rollouts, {.kind = LossKind::kSft}, "sft");
}

// The LM head runs only on the positions some loss reads (engine::LogprobPositions): a position
// shared by rollouts is read when any of them has it in its loss. Every method and every built-in
// loss against dense computing every position (DTA_LOSS_ROWS_ONLY=0): the same loss and gradients,
// the same log-probabilities where read and exactly 0 elsewhere, where the reference has real
// values (so the comparison sees the skip). The tree has a prompt no rollout trains on (chunks of B
// = 1 and 3 with no read position), a token trained by one rollout and not the others sharing it,
// a rollout with no loss token and a duplicate.
TEST_P(FamilyEquivalence, LogprobsOnlyWhereALossReadsThem) {
  std::vector<Rollout> rollouts = MakeRollouts({{1, 2, 3, 4, 5, 6, 7, 8},
                                                {1, 2, 3, 4, 5, 6, 9, 10, 11},
                                                {1, 2, 3, 4, 5, 6, 9, 12},
                                                {1, 2, 3, 4, 5, 6, 9, 12},
                                                {1, 2, 3, 13}},
                                               17);
  rollouts[0].loss_mask = {0, 0, 0, 0, 0, 1, 1, 1};
  rollouts[1].loss_mask = {0, 0, 0, 0, 0, 0, 0, 1, 1};
  rollouts[2].loss_mask = {0, 0, 0, 0, 0, 0, 1, 1};
  rollouts[3].loss_mask = {0, 0, 0, 0, 0, 0, 0, 1};
  rollouts[4].loss_mask = {0, 0, 0, 0};  // no loss token at all
  // Read positions by brute force: position p of r is read when any rollout with r's first p + 1
  // tokens has it in its loss.
  std::vector<std::vector<bool>> read(rollouts.size());
  int64_t unread = 0;
  for (size_t r = 0; r < rollouts.size(); ++r) {
    const std::vector<TokenId>& tokens = rollouts[r].tokens;
    for (size_t p = 0; p < tokens.size(); ++p) {
      bool any = false;
      for (const Rollout& other : rollouts) {
        any = any || (p < other.tokens.size() && other.loss_mask[p] != 0 &&
                      std::equal(tokens.begin(), tokens.begin() + p + 1, other.tokens.begin()));
      }
      read[r].push_back(any);
      unread += p > 0 && !any;
    }
  }
  ASSERT_TRUE(read[0][5] && !read[0][4] && read[1][6] && read[3][6]);  // the cases meant above
  ASSERT_GT(unread, 10);
  int64_t longest = 0;
  for (const Rollout& r : rollouts) longest = std::max<int64_t>(longest, r.tokens.size());
  for (const auto& [loss_name, loss] : Losses()) {
    MethodRun every;
    {
      const ScopedEnv all_rows("DTA_LOSS_ROWS_ONLY", "0");
      every = RunMethod(model_, rollouts, loss, {.method = Method::kDense});
    }
    for (const auto& [method_name, options] : testing::ExactnessMethods(longest)) {
      const std::string what = loss_name + " " + method_name;
      SCOPED_TRACE(what);
      const MethodRun run = RunMethod(model_, rollouts, loss, options);
      EXPECT_NEAR(run.result.loss, every.result.loss,
                  kTolerance * std::max(1.0, std::abs(every.result.loss)));
      for (size_t i = 0; i < run.grads.size(); ++i) {
        EXPECT_LE(RelativeError(run.grads[i], every.grads[i]), kTolerance)
            << model_.named_parameters()[i].first;
      }
      for (size_t r = 0; r < rollouts.size(); ++r) {
        for (size_t p = 1; p < read[r].size(); ++p) {
          const double got = run.result.logprobs[r][p].item<double>();
          const double all = every.result.logprobs[r][p].item<double>();
          ASSERT_LT(all, 0.0) << "rollout " << r << " position " << p;
          if (read[r][p]) {
            EXPECT_NEAR(got, all, kTolerance * std::abs(all))
                << "rollout " << r << " position " << p;
          } else {
            EXPECT_EQ(got, 0.0) << "rollout " << r << " position " << p << " is read by no loss";
          }
        }
      }
    }
  }
}

// A packed step computes the losses that sum token terms for all its rollouts at once and the
// others rollout by rollout on DTA_LOSS_THREADS host threads (4 by default), adding their gradients
// and diagnostics in rollout order: the same bits as on one thread, for every loss, packed steps
// holding many rollouts (the 64-way branch, packed whole at B = inf) and few; rollout by rollout
// (DTA_BATCHED_LOSSES=0) the same gradients as at once.
TEST_P(FamilyEquivalence, PackedLossesOnSeveralThreadsAreBitwiseOneThreads) {
  std::vector<std::vector<TokenId>> sequences;
  for (TokenId i = 0; i < 64; ++i) sequences.push_back({1, 2, 3, 4, 5 + i % 8, 5 + i / 8, 7});
  for (const std::vector<TokenId>& random :
       testing::RandomRollouts(4, {.max_rollouts = 10, .max_length = 12, .vocab = 4})) {
    sequences.push_back(random);
  }
  const std::vector<Rollout> rollouts = MakeRollouts(sequences, 21);
  for (const auto& [name, loss] : Losses()) {
    for (const int64_t block : {int64_t{3}, kUnboundedBlock}) {
      SCOPED_TRACE(name + " B=" + std::to_string(block));
      const ExecutorOptions options{.method = Method::kDta, .block_size = block, .pack = true};
      MethodRun one;
      {
        const ScopedEnv threads("DTA_LOSS_THREADS", "1");
        one = RunMethod(model_, rollouts, loss, options);
      }
      const ScopedEnv threads("DTA_LOSS_THREADS", "4");
      const MethodRun several = RunMethod(model_, rollouts, loss, options);
      EXPECT_EQ(several.result.loss, one.result.loss);
      for (size_t i = 0; i < one.grads.size(); ++i) {
        EXPECT_TRUE(at::equal(several.grads[i], one.grads[i]))
            << model_.named_parameters()[i].first;
      }
      EXPECT_EQ(several.result.diagnostics.Sums(), one.result.diagnostics.Sums());
      // A loss summing token terms, computed for all the rollouts at once (the default) and
      // rollout by rollout: the same gradients up to the order of the loss's sums.
      const ScopedEnv per_rollout("DTA_BATCHED_LOSSES", "0");
      ExpectSame(model_, RunMethod(model_, rollouts, loss, options), one, "rollout by rollout");
    }
  }
  const ScopedEnv bad("DTA_LOSS_THREADS", "0");
  EXPECT_THROW(
      {
        try {
          RunMethod(model_, rollouts, {.kind = LossKind::kGspo},
                    {.method = Method::kDta, .block_size = kUnboundedBlock, .pack = true});
        } catch (const c10::Error& e) {
          EXPECT_NE(
              std::string(e.what()).find("DTA_LOSS_THREADS must be a positive integer, got '0'"),
              std::string::npos)
              << e.what();
          throw;
        }
      },
      c10::Error);
}

// Deep enough that positions pass every band of the scaled RoPE (up to 6x the original context);
// the 4,000-token chain runs for Qwen3 only (LongChain).
TEST_P(FamilyEquivalence, DeepChainWithABranch) {
  std::vector<TokenId> chain(400);
  for (size_t i = 0; i < chain.size(); ++i) chain[i] = static_cast<TokenId>((i * 7) % 19);
  std::vector<TokenId> branch(chain.begin(), chain.begin() + 250);
  branch.push_back(3);
  CheckAllMethods(MakeRollouts({chain, branch}, 5), {.kind = LossKind::kPpo}, "chain", {1, 64});
}

// A wide branch within the 19-token vocabulary (the 512-way one: WideEquivalence, Qwen3 only).
TEST_P(FamilyEquivalence, SixtyFourWayBranch) {
  std::vector<std::vector<TokenId>> sequences;
  for (TokenId i = 0; i < 64; ++i) sequences.push_back({1, 2, 3, 4, 5 + i % 8, 5 + i / 8, 7});
  CheckAllMethods(MakeRollouts(sequences, 9), {.kind = LossKind::kPpo}, "64-way",
                  {3, kUnboundedBlock});
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyEquivalence,
                         // Every family of the registry: a new one fails here until
                         // the test model of tests/testing knows it.
                         ::testing::ValuesIn(ModelFamilyTypes()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

// dta keeps a linear layer's last conv_kernel - 1 convolution inputs at each chunk end (dta.cc):
// with kernels of 4 and 5 (3 and 4 rows), two linear layers, one-token segments and branches at
// positions 1, 2 and 3, B as small as 1 and 2, a chunk reads rows of several chunks below it, and
// of fewer than conv_kernel - 1 positions near the root, and sends their gradients back down.
class WideKernelEquivalence
    : public Equivalence,
      public ::testing::WithParamInterface<std::tuple<std::string, int64_t>> {
 protected:
  WideKernelEquivalence() : Equivalence(Config()) {}
  static ModelConfig Config() {
    ModelConfig c = TinyConfig();
    c.num_hidden_layers = 3;
    c = testing::WithFamily(c, std::get<0>(GetParam()));
    c.layer_types[1] = LayerType::kLinearAttention;
    c.linear_conv_kernel_dim = std::get<1>(GetParam());
    return c;
  }
};

TEST_P(WideKernelEquivalence, ShortSegmentsAndEarlyBranches) {
  const std::vector<Rollout> rollouts = MakeRollouts({{7},
                                                      {7, 8},
                                                      {7, 9},
                                                      {7, 8, 10},
                                                      {7, 8, 11, 12},
                                                      {7, 8, 11, 13, 14, 15, 16},
                                                      {7, 8, 11, 13, 14, 17},
                                                      {7, 8, 11, 13, 14, 17},
                                                      {3},
                                                      {3, 4, 5, 6, 7, 8, 9, 10, 11, 12},
                                                      {3, 4, 5, 6, 7, 8, 9, 10, 11},
                                                      {3, 4, 5, 6, 7, 8, 9, 1}},
                                                     13);
  CheckAllMethods(rollouts, {.kind = LossKind::kPpo}, "ppo", {1, 2, 3, kUnboundedBlock});
}

INSTANTIATE_TEST_SUITE_P(Kernels, WideKernelEquivalence,
                         ::testing::Combine(::testing::Values("qwen3_next", "qwen3_5_text",
                                                              "qwen3_5_moe_text"),
                                            ::testing::Values(4, 5)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_kernel" +
                                  std::to_string(std::get<1>(info.param));
                         });

// The router's load-balancing loss (LossOptions::router_aux_loss_coef) for the mixture-of-experts
// families: every method agrees on the adversarial trees; its value equals each rollout's own
// loss from the router statistics of a forward over it alone; its gradient equals central finite
// differences of that value.
class RouterBalanceEquivalence : public FamilyEquivalence {
 protected:
  // The mean over rollouts of aux_r = E <c_r, p_r> / (sparse layers x length)^2, each rollout
  // forwarded alone (no graph).
  double PerRolloutAuxLoss(const std::vector<Rollout>& rollouts) {
    torch::autograd::AutoGradMode no_grad(false);
    const ModelConfig& c = model_.config();
    int64_t sparse = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) sparse += IsSparseLayer(c, l);
    double sum = 0;
    for (const Rollout& r : rollouts) {
      const int64_t length = static_cast<int64_t>(r.tokens.size());
      const at::Tensor tokens = at::tensor(std::vector<int64_t>(r.tokens.begin(), r.tokens.end()));
      const ChunkOutput out = model_.Forward(
          {.tokens = tokens, .positions = at::arange(length), .router_statistics = true});
      // Each sparse layer puts exactly top-k experts in a token's counts; probabilities sum to 1.
      EXPECT_TRUE(at::allclose(
          out.router_counts.sum(1),
          at::full({length}, double(sparse * c.num_experts_per_tok), out.router_counts.options())));
      EXPECT_TRUE(at::allclose(out.router_probs.sum(1),
                               at::full({length}, double(sparse), out.router_probs.options())));
      const double rows = static_cast<double>(sparse * length);
      sum += static_cast<double>(c.num_experts) *
             (out.router_counts.sum(0) * out.router_probs.sum(0)).sum().item<double>() /
             (rows * rows);
    }
    return sum / static_cast<double>(rollouts.size());
  }
};

TEST_P(RouterBalanceEquivalence, EveryMethodOnTheAdversarialTrees) {
  const LossOptions loss{.kind = LossKind::kPpo, .router_aux_loss_coef = 0.7};
  CheckAllMethods(
      MakeRollouts({{5}, {5, 6}, {5, 6}, {5, 6, 7}, {5}, {4}, {5, 6, 7, 8, 9, 10}, {5, 6, 7}}, 11),
      loss, "duplicates, prefixes, one-token rollouts");
  for (uint64_t seed = 0; seed < 4; ++seed) {
    CheckAllMethods(MakeRollouts(testing::RandomRollouts(
                                     seed, {.max_rollouts = 10, .max_length = 12, .vocab = 4}),
                                 seed),
                    loss, "seed " + std::to_string(seed));
  }
  std::vector<TokenId> chain(300);
  for (size_t i = 0; i < chain.size(); ++i) chain[i] = static_cast<TokenId>((i * 7) % 19);
  std::vector<TokenId> branch(chain.begin(), chain.begin() + 200);
  branch.push_back(3);
  CheckAllMethods(MakeRollouts({chain, branch}, 5), loss, "chain", {1, 64});
}

TEST_P(RouterBalanceEquivalence, ValueAndGradientAreTheLoadBalancingLoss) {
  const std::vector<Rollout> rollouts =
      MakeRollouts({{1, 2, 3, 4, 5, 6, 7}, {1, 2, 3, 4, 8}, {1, 2, 3, 4, 8}, {2}, {1, 2, 9, 3}}, 4);
  const double coef = 0.7;
  const LossOptions with{.kind = LossKind::kPpo, .router_aux_loss_coef = coef};
  const LossOptions without{.kind = LossKind::kPpo};
  const ExecutorOptions dta{.method = Method::kDta, .block_size = 2};
  const MethodRun on = RunMethod(model_, rollouts, with, dta);
  const MethodRun off = RunMethod(model_, rollouts, without, dta);
  const double aux = PerRolloutAuxLoss(rollouts);
  EXPECT_GT(aux, 0.0);
  EXPECT_NEAR(on.result.router_aux_loss, aux, 1e-12);
  EXPECT_NEAR(on.result.loss, off.result.loss + coef * aux, 1e-12);
  EXPECT_EQ(off.result.router_aux_loss, 0.0);
  // d aux / d theta by central differences, for a router and for the parameters below it.
  const ModelConfig& c = model_.config();
  int64_t first_sparse = 0;
  while (!IsSparseLayer(c, first_sparse)) ++first_sparse;
  const std::string layer = "model.layers." + std::to_string(first_sparse) + ".";
  for (const std::string& name :
       {layer + "mlp.gate.weight", layer + "post_attention_layernorm.weight",
        std::string("model.embed_tokens.weight")}) {
    SCOPED_TRACE(name);
    size_t index = 0;
    while (model_.named_parameters()[index].first != name) ++index;
    const at::Tensor parameter = model_.named_parameters()[index].second;
    const at::Tensor analytic = (on.grads[index] - off.grads[index]) / coef;
    EXPECT_GT(analytic.abs().max().item<double>(), 1e-6);
    for (const int64_t flat : {int64_t{0}, parameter.numel() / 2 + 1, parameter.numel() - 1}) {
      const double h = 1e-6;
      at::Tensor entry = parameter.detach().view({-1}).narrow(0, flat, 1);
      const double original = entry.item<double>();
      entry.fill_(original + h);
      const double plus = PerRolloutAuxLoss(rollouts);
      entry.fill_(original - h);
      const double minus = PerRolloutAuxLoss(rollouts);
      entry.fill_(original);
      const double numeric = (plus - minus) / (2 * h);
      EXPECT_NEAR(analytic.view({-1})[flat].item<double>(), numeric,
                  1e-6 * std::max(1.0, std::abs(numeric)))
          << "entry " << flat;
    }
  }
}

TEST_P(RouterBalanceEquivalence, RefusesBadCoefficients) {
  const std::vector<Rollout> rollouts = MakeRollouts({{1, 2, 3}}, 1);
  for (const double coef : {-0.1, std::nan("")}) {
    EXPECT_THROW(
        {
          try {
            RunMethod(model_, rollouts, {.router_aux_loss_coef = coef}, {.method = Method::kDta});
          } catch (const c10::Error& e) {
            EXPECT_NE(std::string(e.what()).find("router_aux_loss_coef must be finite and >= 0"),
                      std::string::npos)
                << e.what();
            throw;
          }
        },
        c10::Error);
  }
}

// The registry's families whose sparse layers have a router.
std::vector<std::string> MixtureOfExpertsFamilyTypes() {
  std::vector<std::string> types;
  for (const std::string& type : ModelFamilyTypes()) {
    if (FindModelFamily(type)->moe) types.push_back(type);
  }
  return types;
}

INSTANTIATE_TEST_SUITE_P(Families, RouterBalanceEquivalence,
                         // Every family of the registry with a router.
                         ::testing::ValuesIn(MixtureOfExpertsFamilyTypes()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

// Routing replay (Rollout::routed_experts): rollouts carry the experts an inference engine routed
// each token to, and every method routes them so. Routings are a function of each token's prefix
// (rollouts through a shared prefix agree on it, as one engine's radix cache makes them), except
// where a rollout is given a conflicting one: the tree then splits there
// (GradientResult::replay_split_tokens), and every method still equals dense.
int64_t FirstSparseLayer(const ModelConfig& c) {
  int64_t l = 0;
  while (!IsSparseLayer(c, l)) ++l;
  return l;
}

class RoutingReplayEquivalence : public FamilyEquivalence {
 protected:
  struct Routing {
    bool every_layer = false;  // rows of every decoder layer (the engines' form), else sparse only
    uint64_t salt = 0;
    int conflict_every = 0;  // rollout i (i % n == n - 1) gets a different routing at one position
  };

  // k distinct experts for (seed, layer).
  std::vector<int32_t> Experts(uint64_t seed, int64_t layer) const {
    const ModelConfig& c = model_.config();
    std::vector<int32_t> experts(c.num_experts);
    std::iota(experts.begin(), experts.end(), 0);
    std::mt19937_64 rng(seed * 1000003 + static_cast<uint64_t>(layer));
    std::shuffle(experts.begin(), experts.end(), rng);
    experts.resize(c.num_experts_per_tok);
    return experts;
  }

  // Attaches routed experts to the rollouts: odd ones lack the last token's row, every fourth
  // (from the third) has no routing at all, and token 1 of the second is not recorded.
  void AttachRouting(std::vector<Rollout>& rollouts, const Routing& routing) const {
    const ModelConfig& c = model_.config();
    std::vector<int64_t> sparse;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
      if (IsSparseLayer(c, l)) sparse.push_back(l);
    const int64_t k = c.num_experts_per_tok;
    for (size_t i = 0; i < rollouts.size(); ++i) {
      Rollout& r = rollouts[i];
      if (i % 4 == 2) continue;
      const int32_t layers =
          static_cast<int32_t>(routing.every_layer ? c.num_hidden_layers : sparse.size());
      RoutedExperts routed{.layers = layers, .top_k = static_cast<int32_t>(k), .ids = {}};
      const int64_t rows = static_cast<int64_t>(r.tokens.size()) - static_cast<int64_t>(i % 2);
      const bool conflicting =
          routing.conflict_every > 0 &&
          static_cast<int>(i % routing.conflict_every) == routing.conflict_every - 1;
      uint64_t prefix = routing.salt;
      for (int64_t t = 0; t < rows; ++t) {
        prefix = prefix * 1099511628211ULL + static_cast<uint64_t>(r.tokens[t]) + 1;
        const uint64_t seed = prefix + (conflicting && t == rows / 2 ? 77 : 0);
        for (int32_t l = 0; l < layers; ++l) {
          const bool is_sparse = !routing.every_layer || IsSparseLayer(c, l);
          const std::vector<int32_t> experts =
              (i == 1 && t == 1) ? std::vector<int32_t>(k, kNotRecorded)
              : is_sparse        ? Experts(seed, l)
                                 : std::vector<int32_t>(k, 0);  // the engine's unused rows
          routed.ids.insert(routed.ids.end(), experts.begin(), experts.end());
        }
      }
      r.routed_experts = std::move(routed);
    }
  }

  void CheckReplay(std::vector<Rollout> rollouts, const Routing& routing, const std::string& what,
                   const std::vector<int64_t>& blocks = {1, 3, 64, kUnboundedBlock}) {
    AttachRouting(rollouts, routing);
    CheckAllMethods(rollouts, {.kind = LossKind::kPpo, .router_aux_loss_coef = 0.7}, what + " aux",
                    blocks);
    // Decoupled PPO's proximal log-probabilities come from a forward-only pass, which replays too.
    CheckAllMethods(rollouts, {.kind = LossKind::kDecoupledPpo}, what + " decoupled", {2});
  }

  // The sparse layers' own top-k of a rollout forwarded alone: [T, sparse layers, k] int32, each
  // layer's set in increasing expert order.
  at::Tensor OwnRouting(const Rollout& rollout) const {
    torch::autograd::AutoGradMode no_grad(false);
    const int64_t length = static_cast<int64_t>(rollout.tokens.size());
    const ChunkInput input{
        .tokens = at::tensor(std::vector<int64_t>(rollout.tokens.begin(), rollout.tokens.end())),
        .positions = at::arange(length),
        .router_statistics = true};
    const ChunkContext context = model_.MakeContext(input);
    at::Tensor h = model_.Embed(input.tokens);
    std::vector<at::Tensor> layers;
    for (int64_t l = 0; l < model_.config().num_hidden_layers; ++l) {
      const LayerOutput out = model_.ForwardLayer(l, h, context, {});
      if (out.router_counts.defined()) {
        // The indicator rows' nonzero columns, in increasing order.
        const at::Tensor chosen =
            std::get<1>(out.router_counts.topk(model_.config().num_experts_per_tok, 1));
        layers.push_back(std::get<0>(chosen.sort(1)).to(at::kInt));
      }
      h = out.hidden;
    }
    return at::stack(layers, 1);
  }
};

TEST_P(RoutingReplayEquivalence, EveryMethodOnTheAdversarialTrees) {
  const std::vector<std::vector<TokenId>> adversarial = {
      {5}, {5, 6}, {5, 6}, {5, 6, 7}, {5}, {4}, {5, 6, 7, 8, 9, 10}, {5, 6, 7}};
  CheckReplay(MakeRollouts(adversarial, 11), {}, "agreeing, sparse rows");
  CheckReplay(MakeRollouts(adversarial, 11), {.every_layer = true, .salt = 3, .conflict_every = 3},
              "conflicting, every layer's rows");
  for (uint64_t seed = 0; seed < 2; ++seed) {
    CheckReplay(MakeRollouts(testing::RandomRollouts(
                                 seed, {.max_rollouts = 10, .max_length = 12, .vocab = 4}),
                             seed),
                {.salt = seed, .conflict_every = 2}, "seed " + std::to_string(seed));
  }
  std::vector<TokenId> chain(300);
  for (size_t i = 0; i < chain.size(); ++i) chain[i] = static_cast<TokenId>((i * 7) % 19);
  std::vector<TokenId> branch(chain.begin(), chain.begin() + 200);
  branch.push_back(3);
  CheckReplay(MakeRollouts({chain, branch, chain}, 5), {.conflict_every = 3}, "chain", {1, 64});
}

// Replaying the router's own choice is training without replay; replaying another changes the
// log-probabilities (so the rows reach the experts).
TEST_P(RoutingReplayEquivalence, OwnRoutingIsNoReplayAndOtherRoutingIsNot) {
  std::vector<Rollout> rollouts = MakeRollouts({{1, 2, 3, 4, 5, 6}, {1, 2, 3, 7}}, 2);
  for (Rollout& r : rollouts) r.group = "g";  // one group: non-zero GRPO advantages
  const LossOptions loss{.kind = LossKind::kPpo, .router_aux_loss_coef = 0.3};
  const ExecutorOptions dta{.method = Method::kDta, .block_size = 2};
  const MethodRun free = RunMethod(model_, rollouts, loss, dta);
  const ModelConfig& c = model_.config();
  for (Rollout& r : rollouts) {
    const at::Tensor own = OwnRouting(r).contiguous();
    const int32_t* data = own.data_ptr<int32_t>();
    r.routed_experts = RoutedExperts{.layers = static_cast<int32_t>(own.size(1)),
                                     .top_k = static_cast<int32_t>(c.num_experts_per_tok),
                                     .ids = std::vector<int32_t>(data, data + own.numel())};
  }
  const MethodRun own = RunMethod(model_, rollouts, loss, dta);
  EXPECT_EQ(own.result.replay_split_tokens, 0);
  ExpectSame(model_, own, free, "own routing replayed");
  // Every recorded row rotated by one expert: a different routing wherever k < E.
  for (Rollout& r : rollouts) {
    for (int32_t& id : r.routed_experts->ids) id = static_cast<int32_t>((id + 1) % c.num_experts);
  }
  const MethodRun other = RunMethod(model_, rollouts, loss, dta);
  EXPECT_GT(RelativeError(other.result.logprobs[0], free.result.logprobs[0]), 1e-6);
  ExpectSame(model_, other, RunMethod(model_, rollouts, loss, {.method = Method::kDense}),
             "rotated routing");
}

// Two rollouts that share three tokens but were routed differently at the second do not share it:
// the tree holds 1 + 2 x 3 unique tokens instead of 3 + 2.
TEST_P(RoutingReplayEquivalence, DisagreeingRoutingSplitsTheSharedPrefix) {
  std::vector<Rollout> rollouts = MakeRollouts({{1, 2, 3, 4}, {1, 2, 3, 5}}, 3);
  AttachRouting(rollouts, {});
  // The second's rows (one fewer than its tokens) are the first's: one routing of the prefix.
  RoutedExperts& second = *rollouts[1].routed_experts;
  const std::vector<int32_t>& first = rollouts[0].routed_experts->ids;
  std::copy(first.begin(), first.begin() + static_cast<int64_t>(second.ids.size()),
            second.ids.begin());
  const ExecutorOptions packed{.method = Method::kPacked};
  EXPECT_EQ(RunMethod(model_, rollouts, {}, packed).result.replay_split_tokens, 0);
  const int64_t row = static_cast<int64_t>(second.layers) * second.top_k;
  std::rotate(second.ids.begin() + row, second.ids.begin() + row + 1,
              second.ids.begin() + 2 * row);  // row 1: the same experts in another order
  EXPECT_EQ(RunMethod(model_, rollouts, {}, packed).result.replay_split_tokens, 2);
}

TEST_P(RoutingReplayEquivalence, RefusesRoutingThatDoesNotFitTheModel) {
  const ModelConfig& c = model_.config();
  const auto refused = [&](const RoutedExperts& routed, const std::string& expected) {
    std::vector<Rollout> rollouts = MakeRollouts({{1, 2, 3}, {1, 2}}, 1);
    rollouts[1].routed_experts = routed;
    for (const Method method : {Method::kDense, Method::kPacked, Method::kDta}) {
      try {
        RunMethod(model_, rollouts, {}, {.method = method});
        ADD_FAILURE() << "accepted: " << expected;
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("rollout 'r1': field 'routed_experts': " + expected),
                  std::string::npos)
            << e.what();
      }
    }
  };
  int32_t sparse = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) sparse += IsSparseLayer(c, l);
  const int32_t k = static_cast<int32_t>(c.num_experts_per_tok);
  // `rows` rows of `layers` x `top_k` ids, 0 .. top_k - 1 at each layer (the first row's first id
  // `first`).
  const auto routing = [](int32_t rows, int32_t layers, int32_t top_k, int32_t first = 0) {
    RoutedExperts routed{.layers = layers, .top_k = top_k, .ids = {}};
    for (int32_t i = 0; i < rows * layers * top_k; ++i) routed.ids.push_back(i % top_k);
    routed.ids[0] = first;
    return routed;
  };
  refused(routing(1, sparse, k + 1), "top_k is " + std::to_string(k + 1));
  refused(routing(1, static_cast<int32_t>(c.num_hidden_layers) + 1, k),
          std::to_string(c.num_hidden_layers + 1) + " layers per row, but the model has");
  refused(routing(3, sparse, k), "3 rows for 2 tokens");
  const int32_t experts = static_cast<int32_t>(c.num_experts);
  refused(routing(2, sparse, k, experts),
          "row 0, layer " + std::to_string(FirstSparseLayer(c)) + ": [" + std::to_string(experts));
}

INSTANTIATE_TEST_SUITE_P(Families, RoutingReplayEquivalence,
                         ::testing::ValuesIn(MixtureOfExpertsFamilyTypes()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

TEST_F(Equivalence, RoutingReplayNeedsAMixtureOfExperts) {
  std::vector<Rollout> rollouts = MakeRollouts({{1, 2, 3}}, 1);
  rollouts[0].routed_experts = RoutedExperts{.layers = 2, .top_k = 1, .ids = {0, 0, 0, 0}};
  try {
    RunMethod(model_, rollouts, {}, {.method = Method::kDta});
    FAIL() << "a dense model took routed experts";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rollout 'r0': field 'routed_experts': the model (qwen3) "
                                         "has no mixture-of-experts layers"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(Equivalence, RouterBalanceNeedsAMixtureOfExperts) {
  const std::vector<Rollout> rollouts = MakeRollouts({{1, 2, 3}}, 1);
  try {
    RunMethod(model_, rollouts, {.router_aux_loss_coef = 0.01}, {.method = Method::kDense});
    FAIL() << "a dense model took a router-balance loss";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no mixture-of-experts layers"), std::string::npos)
        << e.what();
  }
}

TEST_F(Equivalence, ParametersAgreeAfterSeveralOptimizerSteps) {
  const auto rollouts =
      MakeRollouts(testing::RandomRollouts(17, {.max_rollouts = 8, .vocab = 4}), 17);
  const LossOptions loss{.kind = LossKind::kPpo};
  const std::vector<ExecutorOptions> methods = {
      {.method = Method::kDense},
      {.method = Method::kPacked},
      {.method = Method::kDta, .block_size = 3, .pack = false},
      {.method = Method::kDta, .block_size = 5, .graph_budget = 8, .pack = true},
      {.method = Method::kDta, .pack = true}};  // automatic B and graph budget
  std::vector<std::vector<at::Tensor>> finals;
  for (const ExecutorOptions& options : methods) {
    Decoder model(TinyConfig(), at::TensorOptions().dtype(at::kDouble));
    model.InitRandom(7, 0.3);
    AdamW optimizer(model.named_parameters(), {.lr = 1e-2, .max_grad_norm = 0.5});
    for (int step = 0; step < 4; ++step) {
      optimizer.ZeroGrad();
      ComputeGradients(model, rollouts, loss, options);
      optimizer.Step();
    }
    std::vector<at::Tensor> params;
    for (const auto& [name, p] : model.named_parameters()) params.push_back(p.detach().clone());
    finals.push_back(std::move(params));
  }
  Decoder initial(TinyConfig(), at::TensorOptions().dtype(at::kDouble));
  initial.InitRandom(7, 0.3);
  for (size_t m = 1; m < finals.size(); ++m) {
    for (size_t i = 0; i < finals[0].size(); ++i) {
      const std::string& name = initial.named_parameters()[i].first;
      // The parameters moved, and every method moved them the same way.
      const at::Tensor moved = finals[0][i] - initial.named_parameters()[i].second;
      EXPECT_GT(moved.norm().item<double>(), 0.0) << name;
      EXPECT_LE(RelativeError(finals[m][i] - initial.named_parameters()[i].second, moved), 1e-9)
          << "method " << m << " " << name;
    }
  }
}

// gate_proj and up_proj live stacked in one tensor, so that a projection onto both is one GEMM and
// their gradients one accumulation into one stacked buffer. The stacked path computes the
// gradient of the one-weight-at-a-time path (DTA_STACKED_PROJECTIONS=0), and still does when a
// caller has replaced the gradients by separate tensors.
TEST_F(Equivalence, StackedProjectionsGiveTheSameGradient) {
  const auto rollouts =
      MakeRollouts(testing::RandomRollouts(23, {.max_rollouts = 6, .vocab = 4}), 19);
  const LossOptions loss{.kind = LossKind::kPpo};
  const ExecutorOptions dta{.method = Method::kDta, .block_size = 3, .pack = true};
  const at::Tensor gate = model_.parameter("model.layers.1.mlp.gate_proj.weight");
  const at::Tensor up = model_.parameter("model.layers.1.mlp.up_proj.weight");
  ASSERT_EQ(up.data_ptr<double>(), gate.data_ptr<double>() + gate.numel());
  for (const auto& [name, p] : model_.named_parameters())
    const_cast<at::Tensor&>(p).mutable_grad() = at::Tensor();
  const MethodRun stacked = RunMethod(model_, rollouts, loss, dta);
  EXPECT_EQ(up.grad().data_ptr<double>(), gate.grad().data_ptr<double>() + gate.numel())
      << "the gradients are allocated stacked too";
  ASSERT_EQ(setenv("DTA_STACKED_PROJECTIONS", "0", 1), 0);
  const MethodRun separate = RunMethod(model_, rollouts, loss, dta);
  ASSERT_EQ(unsetenv("DTA_STACKED_PROJECTIONS"), 0);
  ExpectSame(model_, stacked, separate, "stacked vs one weight at a time");
  const_cast<at::Tensor&>(gate).mutable_grad() = at::zeros_like(gate);
  const_cast<at::Tensor&>(up).mutable_grad() = at::zeros_like(up);
  ExpectSame(model_, RunMethod(model_, rollouts, loss, dta), separate,
             "stacked weights, separate gradients");
  ExpectSame(model_, RunMethod(model_, rollouts, loss, {.method = Method::kDense}), separate,
             "dense");
}

// Every method of `methods` computes bitwise the same loss and gradients with the environment
// switch `variable` at "0" as with its default (on): a fusion that must not change a bit.
void ExpectSwitchChangesNoBit(const Decoder& model, const std::vector<Rollout>& rollouts,
                              std::initializer_list<ExecutorOptions> methods,
                              const char* variable) {
  const LossOptions loss{.kind = LossKind::kPpo};
  for (const ExecutorOptions& options : methods) {
    const MethodRun on = RunMethod(model, rollouts, loss, options);
    ASSERT_EQ(setenv(variable, "0", 1), 0);
    const MethodRun off = RunMethod(model, rollouts, loss, options);
    ASSERT_EQ(unsetenv(variable), 0);
    EXPECT_EQ(on.result.loss, off.result.loss) << variable;
    ASSERT_EQ(on.grads.size(), off.grads.size());
    for (size_t i = 0; i < on.grads.size(); ++i) {
      const std::string& name = model.named_parameters()[i].first;
      EXPECT_GT(on.grads[i].norm().item<double>(), 0.0) << name;
      EXPECT_TRUE(at::equal(on.grads[i], off.grads[i]))
          << variable << ": " << name << " differs by " << RelativeError(on.grads[i], off.grads[i]);
    }
  }
}

// The residual stream's gradient summed inside the norm's backward (the default) is bitwise
// autograd's sum of the two gradients (DTA_FUSED_RESIDUAL=0), for dta and for dense, in every
// family (biases, linear attention, a mixture of experts with and without a shared expert).
TEST_P(FamilyEquivalence, FusedResidualGradientIsBitwiseAutogradsSum) {
  ExpectSwitchChangesNoBit(
      model_, MakeRollouts(testing::RandomRollouts(29, {.max_rollouts = 6, .vocab = 4}), 31),
      {ExecutorOptions{.method = Method::kDta, .block_size = 3, .pack = true},
       ExecutorOptions{.method = Method::kDense}},
      "DTA_FUSED_RESIDUAL");
}

// The residual add before the post-attention norm folded into the norm's kernel (the default) is
// bitwise adding first (DTA_FUSED_RESIDUAL_ADD=0), for dta, dense, packed and dense with layer
// replay, in every family (a sparse block adds first itself; Gated DeltaNet layers fold as
// attention layers do).
TEST_P(FamilyEquivalence, FoldedResidualAddIsBitwiseAddingFirst) {
  ExpectSwitchChangesNoBit(
      model_, MakeRollouts(testing::RandomRollouts(37, {.max_rollouts = 6, .vocab = 4}), 41),
      {ExecutorOptions{.method = Method::kDta, .block_size = 3, .pack = true},
       ExecutorOptions{.method = Method::kDense},
       ExecutorOptions{.method = Method::kDense, .checkpointing = true},
       ExecutorOptions{.method = Method::kPacked}},
      "DTA_FUSED_RESIDUAL_ADD");
}

// ExecutorOptions::replace_gradients: on a model without gradients yet, and over gradients that
// hold anything (NaN here, as a stale step might), every method's gradient is bitwise the one
// accumulated into zeros, in every family (a mixture of experts' stacked expert gradients written
// whole by their first chunk, the others zeroed first).
TEST_P(FamilyEquivalence, ReplacingGradientsIsAccumulatingIntoZeros) {
  const auto rollouts =
      MakeRollouts(testing::RandomRollouts(17, {.max_rollouts = 6, .vocab = 4}), 19);
  const LossOptions loss{.kind = LossKind::kPpo};
  for (const auto& [name, p] : model_.named_parameters()) ASSERT_FALSE(p.grad().defined()) << name;
  bool first = true;
  for (ExecutorOptions options :
       {ExecutorOptions{.method = Method::kDta, .block_size = 3, .pack = true},
        ExecutorOptions{.method = Method::kDta, .block_size = 1, .pack = false},
        ExecutorOptions{.method = Method::kDense}, ExecutorOptions{.method = Method::kPacked}}) {
    std::vector<at::Tensor> from_none;  // the first method: replacing on a model with no .grad
    if (std::exchange(first, false)) {
      ExecutorOptions replace = options;
      replace.replace_gradients = true;
      ComputeGradients(model_, rollouts, loss, replace);
      for (const auto& [name, p] : model_.named_parameters()) from_none.push_back(p.grad().clone());
    }
    const MethodRun zeroed = RunMethod(model_, rollouts, loss, options);
    for (size_t i = 0; i < from_none.size(); ++i) {
      EXPECT_TRUE(at::equal(from_none[i], zeroed.grads[i])) << model_.named_parameters()[i].first;
    }
    for (const auto& [name, p] : model_.named_parameters()) {
      ASSERT_TRUE(p.grad().defined()) << name;
      p.mutable_grad().fill_(std::numeric_limits<double>::quiet_NaN());
    }
    options.replace_gradients = true;
    const GradientResult replaced = ComputeGradients(model_, rollouts, loss, options);
    EXPECT_EQ(replaced.loss, zeroed.result.loss);
    for (size_t i = 0; i < zeroed.grads.size(); ++i) {
      const auto& [name, p] = model_.named_parameters()[i];
      EXPECT_GT(zeroed.grads[i].norm().item<double>(), 0.0) << name;
      EXPECT_TRUE(at::equal(p.grad(), zeroed.grads[i]))
          << name << ": differs by " << RelativeError(p.grad(), zeroed.grads[i]);
    }
  }
}

// Decoder::StartFreshGradients zeroes every gradient but the stacked experts', which it marks
// instead; a mark that no backward takes is zeroed when the run's marks are dropped.
TEST_P(FamilyEquivalence, FreshGradientsNoChunkWroteEndAsZeros) {
  for (const auto& [name, p] : model_.named_parameters()) {
    p.mutable_grad() = at::full_like(p, 7.0);
  }
  const auto is_expert_stack = [](const std::string& name) {
    return name.find("mlp.experts.") != std::string::npos;
  };
  int experts = 0;
  {
    FreshGradients fresh;
    model_.StartFreshGradients(&fresh);
    for (const auto& [name, p] : model_.named_parameters()) {
      experts += is_expert_stack(name);
      EXPECT_EQ(p.grad().abs().max().item<double>(), is_expert_stack(name) ? 7.0 : 0.0) << name;
    }
    model_.StartFreshGradients(nullptr);
  }  // the marks dropped: nothing took them
  EXPECT_EQ(experts > 0, FindModelFamily(GetParam())->moe);
  for (const auto& [name, p] : model_.named_parameters()) {
    EXPECT_EQ(p.grad().abs().max().item<double>(), 0.0) << name;
  }
}

// Data parallelism's contract on one process: the batch cut into contiguous parts, each part's
// rollouts carrying the whole batch's group advantages and each part run with the whole batch's
// normalisers, give gradients that sum to the whole batch's gradient, for every loss.
TEST_F(Equivalence, PartsWithTheBatchContextSumToTheWholeBatch) {
  const auto losses = Losses();
  for (uint64_t seed = 0; seed < losses.size(); ++seed) {
    const auto& [name, loss] = losses[seed];
    SCOPED_TRACE(name);
    const std::vector<Rollout> rollouts = MakeRollouts(
        testing::RandomRollouts(100 + seed, {.max_rollouts = 9, .max_length = 10, .vocab = 4}),
        seed);
    const MethodRun whole = RunMethod(model_, rollouts, loss, {.method = Method::kDense});
    const BatchLossContext batch = MakeBatchContext(rollouts);
    absl::StatusOr<std::vector<std::vector<float>>> advantages = GroupAdvantages(rollouts);
    ASSERT_TRUE(advantages.ok()) << advantages.status();
    std::vector<Rollout> with_advantages = rollouts;
    for (size_t r = 0; r < rollouts.size(); ++r) with_advantages[r].advantages = (*advantages)[r];
    const size_t cut[] = {0, with_advantages.size() / 3, with_advantages.size() / 2,
                          with_advantages.size()};
    for (const auto& [name, p] : model_.named_parameters()) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    double loss_sum = 0;
    for (int part = 0; part < 3; ++part) {
      const auto first = with_advantages.begin();
      const std::vector<Rollout> rollouts_of_part(first + cut[part], first + cut[part + 1]);
      loss_sum += ComputeGradients(model_, rollouts_of_part, loss,
                                   {.method = Method::kDta, .block_size = 3}, batch)
                      .loss;
    }
    EXPECT_NEAR(loss_sum, whole.result.loss,
                kTolerance * std::max(1.0, std::abs(whole.result.loss)));
    for (size_t i = 0; i < whole.grads.size(); ++i) {
      const at::Tensor& grad = model_.named_parameters()[i].second.grad();
      EXPECT_GT(whole.grads[i].norm().item<double>(), 0.0) << model_.named_parameters()[i].first;
      EXPECT_LE(RelativeError(grad, whole.grads[i]), kTolerance)
          << model_.named_parameters()[i].first;
    }
  }
}

TEST_F(Equivalence, ForwardOnlyLogprobs) {
  const auto rollouts = MakeRollouts(testing::RandomRollouts(42, {.vocab = 5}), 42);
  const std::vector<at::Tensor> dense =
      ComputeLogprobs(model_, rollouts, {.method = Method::kDense});
  for (Method method : {Method::kPacked, Method::kDta}) {
    const std::vector<at::Tensor> other =
        ComputeLogprobs(model_, rollouts, {.method = method, .block_size = 2});
    ASSERT_EQ(other.size(), dense.size());
    for (size_t r = 0; r < dense.size(); ++r)
      EXPECT_LE(RelativeError(other[r], dense[r]), kTolerance);
  }
}

// The progress callback counts what forwarded_tokens counts: never backwards, ending at its total.
TEST_F(Equivalence, ProgressCountsForwardedTokensUpToTheirTotal) {
  const auto rollouts = MakeRollouts(testing::RandomRollouts(3, {.vocab = 5}), 3);
  const ExecutorOptions variants[] = {
      {.method = Method::kDense},
      {.method = Method::kDense, .checkpointing = true},
      {.method = Method::kPacked},
      {.method = Method::kPacked, .token_capacity = 40, .checkpointing = true},
      {.method = Method::kDta, .block_size = 1, .pack = false},
      {.method = Method::kDta, .block_size = 3, .graph_budget = 6, .pack = true},
      {.method = Method::kDta, .block_size = kUnboundedBlock, .pack = false}};
  for (ExecutorOptions options : variants) {
    const std::string what = std::string(MethodName(options.method)) +
                             " B=" + std::to_string(options.block_size) +
                             (options.checkpointing ? " ckpt" : "") + (options.pack ? " pack" : "");
    std::vector<std::pair<int64_t, int64_t>> calls;
    options.progress = [&calls](int64_t done, int64_t total) { calls.emplace_back(done, total); };
    const GradientResult result =
        ComputeGradients(model_, rollouts, {.kind = LossKind::kPpo}, options);
    ASSERT_FALSE(calls.empty()) << what;
    EXPECT_EQ(calls.back(), std::make_pair(result.forwarded_tokens, result.forwarded_tokens))
        << what;
    for (size_t i = 0; i < calls.size(); ++i) {
      EXPECT_EQ(calls[i].second, result.forwarded_tokens) << what;
      EXPECT_LE(calls[i].first, calls[i].second) << what;
      if (i > 0) {
        EXPECT_GT(calls[i].first, calls[i - 1].first) << what;
      }
    }
    if (options.method == Method::kDta && options.block_size == 1 && !options.pack) {
      EXPECT_GT(calls.size(), rollouts.size()) << "one call per chunk";
    }
  }
}

TEST_F(Equivalence, RejectsTokensOutsideTheVocabulary) {
  const auto rollouts = MakeRollouts({{1, 2, 40}}, 1);
  try {
    ComputeGradients(model_, rollouts, {.kind = LossKind::kSft});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rollout 'r0'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dta

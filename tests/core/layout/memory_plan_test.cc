#include "core/layout/memory_plan.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int64_t kGiB = int64_t{1} << 30;

ModelConfig Shape(int64_t hidden, int64_t intermediate, int64_t layers, int64_t heads,
                  int64_t kv_heads, bool tie) {
  ModelConfig c;
  c.vocab_size = 151936;
  c.hidden_size = hidden;
  c.intermediate_size = intermediate;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = 128;
  c.tie_word_embeddings = tie;
  return c;
}

// Qwen3's published shapes.
ModelConfig Qwen3_1_7B() { return Shape(2048, 6144, 28, 16, 8, true); }
ModelConfig Qwen3_8B() { return Shape(4096, 12288, 36, 32, 8, false); }
ModelConfig Qwen3_14B() { return Shape(5120, 17408, 40, 40, 8, false); }
ModelConfig Qwen3_32B() { return Shape(5120, 25600, 64, 64, 8, false); }

TEST(CountParameters, MatchesThePublishedModels) {
  // Qwen3-8B's model.safetensors.index.json: 8,190,735,360 parameters (16,381,470,720 bytes).
  EXPECT_EQ(CountParameters(Qwen3_8B()).total(), 8190735360);
  // Per layer: 2 RMSNorms of 4096 and q_norm, k_norm of 128; plus the final norm.
  EXPECT_EQ(CountParameters(Qwen3_8B()).replicated, 36 * (2 * 4096 + 2 * 128) + 4096);
  // Tied: the embedding counts once.
  const ModelConfig tied = Qwen3_1_7B();
  ModelConfig untied = tied;
  untied.tie_word_embeddings = false;
  EXPECT_EQ(CountParameters(untied).total() - CountParameters(tied).total(), 151936 * 2048);
}

// The other families' presets against their published parameter counts (model cards and
// model.safetensors.index.json totals): biases counted, q/k norms not.
TEST(CountParameters, MatchesThePublishedModelsOfEachFamily) {
  EXPECT_EQ(CountParameters(*ModelPreset("llama-3.1-8b")).total(), 8030261248);
  EXPECT_EQ(CountParameters(*ModelPreset("llama-3.2-1b")).total(), 1235814400);
  const ParameterCount qwen25 = CountParameters(*ModelPreset("qwen2.5-1.5b"));
  EXPECT_EQ(qwen25.total(), 1543714304);
  // Per layer: 2 RMSNorms of 1536; the q/k/v biases split with their projections.
  EXPECT_EQ(qwen25.replicated, 28 * 2 * 1536 + 1536);
  ModelConfig with_o_bias = *ModelPreset("llama-3.2-1b");
  with_o_bias.attention_bias = true;  // q/k/v (2048 + 2 x 512) and o_proj (2048) per layer
  const ParameterCount biased = CountParameters(with_o_bias);
  EXPECT_EQ(biased.total() - 1235814400, 16 * (2048 + 2 * 512 + 2048));
  EXPECT_EQ(biased.replicated - CountParameters(*ModelPreset("llama-3.2-1b")).replicated,
            16 * 2048);
}

// Qwen3-30B-A3B and Qwen3-235B-A22B: their model.safetensors.index.json total sizes (61,064,245,248
// and 470,187,269,120 bytes of bfloat16); the routed experts are nearly all of it.
TEST(CountParameters, MatchesQwen3Moe) {
  const ParameterCount small = CountParameters(*ModelPreset("qwen3-30b-a3b"));
  EXPECT_EQ(small.total(), 30532122624);
  EXPECT_EQ(small.experts, int64_t{48} * 128 * 3 * 2048 * 768);
  const ParameterCount large = CountParameters(*ModelPreset("qwen3-235b-a22b"));
  EXPECT_EQ(large.total(), 235093634560);
  EXPECT_EQ(large.experts, int64_t{94} * 128 * 3 * 4096 * 1536);
  EXPECT_EQ(CountParameters(Qwen3_8B()).experts, 0);
}

// Qwen3-Next-80B-A3B: the parameters of transformers' Qwen3NextForCausalLM for its config.json
// (79,674,391,296, as its published weights without the multi-token-prediction layer), 3.9B of
// them used by a token (its top 10 of 512 experts).
TEST(CountParameters, MatchesQwen3Next) {
  const ParameterCount a3b = CountParameters(*ModelPreset("qwen3-next-80b-a3b"));
  EXPECT_EQ(a3b.total(), 79674391296);
  EXPECT_EQ(a3b.active(), 3874929408);
  EXPECT_EQ(a3b.unused_per_token, int64_t{48} * (512 - 10) * 3 * 2048 * 512);
  // Replicated: per layer 2 RMSNorms of 2048, the router (512 x 2048) and the shared expert's gate
  // (2048); per linear layer (36) the gated norm of 128, per attention layer (12) q_norm and k_norm
  // of 256; the final norm.
  EXPECT_EQ(a3b.replicated, 48 * (2 * 2048 + 512 * 2048 + 2048) + 36 * 128 + 12 * 2 * 256 + 2048);
  const ParameterCount small = CountParameters(*ModelPreset("qwen3-next-small"));
  EXPECT_EQ(small.total(), 2375019584);
  EXPECT_EQ(small.active(), 890235968);

  // One layer of each kind, by hand: hidden 64, 4 heads of 16 (2 KV), Gated DeltaNet of 2 key heads
  // and 4 value heads of 8, kernel 4; no experts (dense MLPs of 96), untied vocabulary of 10.
  ModelConfig c = *ModelPreset("qwen3-next-small");
  c.vocab_size = 10;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_hidden_layers = 2;
  c.layer_types = {LayerType::kLinearAttention, LayerType::kFullAttention};
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.linear_num_key_heads = 2;
  c.linear_num_value_heads = 4;
  c.linear_key_head_dim = 8;
  c.linear_value_head_dim = 8;
  c.linear_conv_kernel_dim = 4;
  c.num_experts = 0;
  c.attention_bias = true;
  ASSERT_TRUE(ValidateModelConfig(c).ok()) << ValidateModelConfig(c);
  // key_dim 16, value_dim 32, conv_dim 64: in_proj_qkvz 96 x 64, in_proj_ba 8 x 64, conv1d 64 x 4,
  // dt_bias and A_log 4 each, out_proj 64 x 32; its norm 8.
  const int64_t linear = 96 * 64 + 8 * 64 + 64 * 4 + 2 * 4 + 64 * 32;
  // q_proj 128 (queries and gates) x 64 with its bias, k_proj and v_proj 32 x 64 with theirs,
  // o_proj 64 x 64 (its bias 64 replicated); q_norm, k_norm 16 each.
  const int64_t attention = 128 * 64 + 128 + 2 * (32 * 64 + 32) + 64 * 64;
  const ParameterCount count = CountParameters(c);
  EXPECT_EQ(count.sharded, 2 * 10 * 64 + linear + attention + 2 * 3 * 64 * 96);
  EXPECT_EQ(count.replicated, 2 * 2 * 64 + 8 + (2 * 16 + 64) + 64);
  EXPECT_EQ(count.unused_per_token, 0);
  // Sparse: 5 experts of 8 (top 2), a shared expert of 12 with its gate, and the router.
  c.num_experts = 5;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 8;
  c.shared_expert_intermediate_size = 12;
  const ParameterCount sparse = CountParameters(c);
  EXPECT_EQ(sparse.sharded - count.sharded, 2 * (5 * 3 * 64 * 8 + 3 * 64 * 12 - 3 * 64 * 96));
  EXPECT_EQ(sparse.replicated - count.replicated, 2 * (5 * 64 + 64));
  EXPECT_EQ(sparse.unused_per_token, 2 * 3 * 3 * 64 * 8);
}

TEST(EstimateMemory, CountsEighteenBytesPerParameterWithoutSharding) {
  const ModelConfig config = Qwen3_8B();
  const int64_t p = CountParameters(config).total();
  const MemoryEstimate m = EstimateMemory(config, {}, {.activation_bytes = 3});
  EXPECT_EQ(m.weights, 2 * p);
  EXPECT_EQ(m.gradients, 4 * p);
  EXPECT_EQ(m.optimizer, 12 * p);
  EXPECT_EQ(m.activations, 3);
  EXPECT_EQ(m.host_optimizer, 0);
  EXPECT_EQ(m.gpu_total(), 18 * p + 3);
}

TEST(EstimateMemory, TensorParallelSplitsAllButTheNormsAndShardingDividesTheOptimizer) {
  const ModelConfig config = Qwen3_8B();
  const ParameterCount count = CountParameters(config);
  const int64_t local = count.sharded / 4 + count.replicated;  // 4 divides every sharded matrix
  const MemoryEstimate sharded =
      EstimateMemory(config, {.tensor_parallel = 4, .data_parallel = 2, .shard_optimizer = true},
                     {.activation_bytes = 0});
  EXPECT_EQ(sharded.weights, 2 * local);
  EXPECT_EQ(sharded.gradients, 4 * local);
  EXPECT_EQ(sharded.optimizer, 6 * local);
  const MemoryEstimate offloaded = EstimateMemory(config,
                                                  {.tensor_parallel = 4,
                                                   .data_parallel = 2,
                                                   .shard_optimizer = true,
                                                   .offload_optimizer = true},
                                                  {.activation_bytes = 0});
  EXPECT_EQ(offloaded.optimizer, 0);
  EXPECT_EQ(offloaded.host_optimizer, 6 * local);
  EXPECT_EQ(offloaded.gpu_total(), 6 * local);
}

// Expert parallelism divides the experts' weights, gradients and (as the ranks holding the same
// experts shard them) optimizer state; the rest stays as it was.
TEST(EstimateMemory, ExpertParallelismSpreadsOnlyTheExperts) {
  const ModelConfig config = *ModelPreset("qwen3-30b-a3b");
  const ParameterCount count = CountParameters(config);
  const int64_t dense = count.total() - count.experts;
  const MemoryEstimate whole = EstimateMemory(config, {.data_parallel = 8, .shard_optimizer = true},
                                              {.activation_bytes = 0});
  for (const int32_t ep : {2, 4, 8}) {
    SCOPED_TRACE(ep);
    const MemoryEstimate m =
        EstimateMemory(config, {.data_parallel = 8, .expert_parallel = ep, .shard_optimizer = true},
                       {.activation_bytes = 0});
    EXPECT_EQ(m.weights, 2 * (dense + count.experts / ep));
    EXPECT_EQ(m.gradients, 4 * (dense + count.experts / ep));
    EXPECT_NEAR(static_cast<double>(m.optimizer), static_cast<double>(whole.optimizer), 16.0);
  }
}

TEST(AllowedExpertParallel, DividesTheExpertsAndTheReplicas) {
  const ModelConfig moe = *ModelPreset("qwen3-30b-a3b");  // 128 experts
  EXPECT_THAT(AllowedExpertParallel(moe, 8), ElementsAre(1, 2, 4, 8));
  EXPECT_THAT(AllowedExpertParallel(moe, 6), ElementsAre(1, 2));
  EXPECT_THAT(AllowedExpertParallel(Qwen3_8B(), 8), ElementsAre(1));
}

TEST(AllowedTensorParallel, DividesHeadsKvHeadsAndTheWorldWithinANode) {
  EXPECT_THAT(AllowedTensorParallel(Qwen3_14B(), {.world_size = 8, .gpus_per_node = 8}),
              ElementsAre(1, 2, 4, 8));
  EXPECT_THAT(AllowedTensorParallel(Qwen3_14B(), {.world_size = 16, .gpus_per_node = 4}),
              ElementsAre(1, 2, 4));
  EXPECT_THAT(AllowedTensorParallel(Qwen3_8B(), {.world_size = 6, .gpus_per_node = 8}),
              ElementsAre(1, 2));
  ModelConfig two_kv = Qwen3_8B();
  two_kv.num_key_value_heads = 2;
  EXPECT_THAT(AllowedTensorParallel(two_kv, {.world_size = 8, .gpus_per_node = 8}),
              ElementsAre(1, 2));
  // Qwen3-Next-80B-A3B: 2 KV heads, and 16 linear-attention key heads.
  const ModelConfig next = *ModelPreset("qwen3-next-80b-a3b");
  EXPECT_THAT(AllowedTensorParallel(next, {.world_size = 8, .gpus_per_node = 8}),
              ElementsAre(1, 2));
  ModelConfig few_key_heads = next;
  few_key_heads.num_key_value_heads = 8;
  few_key_heads.linear_num_key_heads = 4;
  EXPECT_THAT(AllowedTensorParallel(few_key_heads, {.world_size = 8, .gpus_per_node = 8}),
              ElementsAre(1, 2, 4));
  const absl::StatusOr<LayoutPlan> forced =
      PlanLayout(few_key_heads, {.world_size = 8, .gpu_bytes = 80 * kGiB, .tensor_parallel = 8});
  EXPECT_EQ(forced.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(forced.status().message()),
              HasSubstr("field 'tensor_parallel': 8 is not allowed: it must be a power of two up "
                        "to the GPUs per node (8) dividing the world size (8), the 16 attention "
                        "heads, the 8 KV heads and the 4 linear-attention key heads"));
}

// Small models (tests, the tour's qwen3-tiny) used to print "for 0.00B parameters".
TEST(FormatParameterCount, ReadsAsPeopleWriteIt) {
  EXPECT_EQ(FormatParameterCount(8'190'735'360), "8.19B");
  EXPECT_EQ(FormatParameterCount(1'000'000'000), "1.00B");
  EXPECT_EQ(FormatParameterCount(596'049'920), "596.05M");
  EXPECT_EQ(FormatParameterCount(1'000'000), "1.00M");
  EXPECT_EQ(FormatParameterCount(12'345), "12.3K");
  EXPECT_EQ(FormatParameterCount(950), "950");
  EXPECT_EQ(FormatParameterCount(0), "0");
}

TEST(PlanLayout, ASmallModelStaysWholeOnOneGpu) {
  const absl::StatusOr<LayoutPlan> plan = PlanLayout(Qwen3_1_7B(), {.gpu_bytes = 80 * kGiB});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->layout, (TrainingLayout{.tensor_parallel = 1, .data_parallel = 1}));
  EXPECT_THAT(DescribeLayout(*plan),
              HasSubstr("layout: TP 1 x DP 1 for 1.72B parameters; per GPU"));
}

TEST(PlanLayout, EightBOnOneGpuNeedsTheOptimizerOnTheHost) {
  const absl::StatusOr<LayoutPlan> plan = PlanLayout(Qwen3_8B(), {.gpu_bytes = 80 * kGiB});
  ASSERT_TRUE(plan.ok()) << plan.status();
  const MemoryEstimate& m = plan->memory;
  EXPECT_EQ(plan->layout,
            (TrainingLayout{.offload_optimizer = true, .offload_resident_bytes = m.optimizer}));
  EXPECT_EQ(m.host_optimizer, 12 * CountParameters(Qwen3_8B()).total());
  // What the GPU holds beside the weights, gradients and executor keeps its part of the state,
  // less the headroom.
  EXPECT_EQ(m.gpu_total(), 80 * kGiB - ResidentHeadroom(80 * kGiB));
  EXPECT_GT(m.optimizer, 10 * kGiB);
  EXPECT_EQ(ResidentHeadroom(80 * kGiB), 4 * kGiB);
  EXPECT_EQ(ResidentHeadroom(24 * kGiB), 2 * kGiB);
  EXPECT_THAT(DescribeLayout(*plan), HasSubstr("optimizer offloaded to the host"));
  EXPECT_THAT(DescribeLayout(*plan), HasSubstr("host: 91.5 GiB per rank ("));
  EXPECT_THAT(DescribeLayout(*plan), HasSubstr("of it also on the GPU, updated there)"));
  // A host too small for it is refused, naming both memories.
  const absl::StatusOr<LayoutPlan> small_host =
      PlanLayout(Qwen3_8B(), {.gpu_bytes = 80 * kGiB, .host_bytes_per_node = 64 * kGiB});
  EXPECT_EQ(small_host.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(small_host.status().message()), HasSubstr("on hosts of 64.0 GiB"));
}

TEST(PlanLayout, TheOffloadedStateKeptOnTheGpuIsChosenOrRefused) {
  const auto plan_with = [](std::optional<int64_t> resident) {
    return PlanLayout(Qwen3_8B(), {.gpu_bytes = 80 * kGiB, .offload_resident_bytes = resident});
  };
  const absl::StatusOr<LayoutPlan> none = plan_with(0);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->layout, (TrainingLayout{.offload_optimizer = true}));
  EXPECT_EQ(none->memory.optimizer, 0);
  EXPECT_THAT(DescribeLayout(*none), Not(HasSubstr("also on the GPU")));
  const absl::StatusOr<LayoutPlan> some = plan_with(5 * kGiB);
  ASSERT_TRUE(some.ok()) << some.status();
  EXPECT_EQ(some->layout.offload_resident_bytes, 5 * kGiB);
  EXPECT_EQ(some->memory.gpu_total(), none->memory.gpu_total() + 5 * kGiB);
  // More than the GPU holds beside the rest is refused, naming the field.
  const absl::StatusOr<LayoutPlan> too_much = plan_with(60 * kGiB);
  EXPECT_EQ(too_much.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_much.status().message()),
              HasSubstr("field 'offload_resident_bytes': 60.0 GiB of optimizer state"));
  EXPECT_EQ(plan_with(-1).status().code(), absl::StatusCode::kInvalidArgument);
  // A GPU that holds it all keeps it all (the host's copy stays: checkpoints save it).
  const absl::StatusOr<LayoutPlan> small =
      PlanLayout(Qwen3_1_7B(), {.gpu_bytes = 80 * kGiB, .offload_optimizer = true});
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->memory.optimizer, small->memory.host_optimizer);
  // Without offload the field means nothing.
  const absl::StatusOr<LayoutPlan> whole =
      PlanLayout(Qwen3_1_7B(), {.gpu_bytes = 80 * kGiB, .offload_resident_bytes = kGiB});
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->layout.offload_resident_bytes, 0);
}

TEST(PlanLayout, EightBOnEightGpusShardsTheOptimizer) {
  const absl::StatusOr<LayoutPlan> plan =
      PlanLayout(Qwen3_8B(), {.world_size = 8, .gpu_bytes = 80 * kGiB});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->layout,
            (TrainingLayout{.tensor_parallel = 1, .data_parallel = 8, .shard_optimizer = true}));
}

TEST(PlanLayout, ThirtyTwoBOnEightGpusNeedsTensorParallelism) {
  const absl::StatusOr<LayoutPlan> plan =
      PlanLayout(Qwen3_32B(), {.world_size = 8, .gpu_bytes = 80 * kGiB});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->layout,
            (TrainingLayout{.tensor_parallel = 8, .data_parallel = 1, .shard_optimizer = false}));
  EXPECT_LE(plan->memory.gpu_total(), 80 * kGiB);
  // On 141 GB GPUs TP 4 is enough.
  const absl::StatusOr<LayoutPlan> h200 =
      PlanLayout(Qwen3_32B(), {.world_size = 8, .gpu_bytes = 141 * kGiB});
  ASSERT_TRUE(h200.ok()) << h200.status();
  EXPECT_EQ(h200->layout.tensor_parallel, 4);
  EXPECT_TRUE(h200->layout.shard_optimizer);
}

// Qwen3-30B-A3B's weights and gradients alone exceed a 141 GiB GPU: on 8 of them the planner
// spreads the experts rather than offloading or splitting every GEMM, and EP 1 needs more.
TEST(PlanLayout, MixtureOfExpertsOnEightGpusSpreadsTheExperts) {
  const ModelConfig config = *ModelPreset("qwen3-30b-a3b");
  const absl::StatusOr<LayoutPlan> plan =
      PlanLayout(config, {.world_size = 8, .gpu_bytes = 141 * kGiB, .expert_parallel = 0});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->layout.tensor_parallel, 1);
  EXPECT_GT(plan->layout.expert_parallel, 1);
  EXPECT_FALSE(plan->layout.offload_optimizer);
  EXPECT_LE(plan->memory.gpu_total(), 141 * kGiB);
  EXPECT_THAT(DescribeLayout(*plan), HasSubstr("(experts: EP "));
  const absl::StatusOr<LayoutPlan> without =
      PlanLayout(config, {.world_size = 8, .gpu_bytes = 141 * kGiB, .tensor_parallel = 1});
  EXPECT_TRUE(!without.ok() || without->layout.offload_optimizer) << DescribeLayout(*without);
}

TEST(PlanLayout, ExpertParallelOverridesAreCheckedNamingTheField) {
  const absl::StatusOr<LayoutPlan> dense =
      PlanLayout(Qwen3_8B(), {.world_size = 8, .gpu_bytes = 141 * kGiB, .expert_parallel = 2});
  EXPECT_EQ(dense.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dense.status().message(),
              AllOf(HasSubstr("expert_parallel"), HasSubstr("have no experts")));
  const ModelConfig moe = *ModelPreset("qwen3-30b-a3b");
  const absl::StatusOr<LayoutPlan> three =
      PlanLayout(moe, {.world_size = 6, .gpu_bytes = 141 * kGiB, .expert_parallel = 3});
  EXPECT_EQ(three.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(three.status().message(), HasSubstr("must divide the 128 experts"));
  const absl::StatusOr<LayoutPlan> fixed =
      PlanLayout(moe, {.world_size = 8, .gpu_bytes = 141 * kGiB, .expert_parallel = 8});
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  EXPECT_EQ(fixed->layout.expert_parallel, 8);
  EXPECT_EQ(PlanLayout(moe, {.world_size = 8, .gpu_bytes = 141 * kGiB, .expert_parallel = -1})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PlanLayout, WhatCannotFitIsRefusedNamingTheNumbers) {
  const absl::StatusOr<LayoutPlan> plan = PlanLayout(Qwen3_32B(), {.gpu_bytes = 80 * kGiB});
  ASSERT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string message(plan.status().message());
  EXPECT_THAT(message,
              HasSubstr("a model of 32.76B parameters cannot be trained on 1 GPU(s) of 80.0 GiB"));
  EXPECT_THAT(
      message,
      HasSubstr("the smallest layout allowed (TP 1 x DP 1, optimizer offloaded to the host)"));
  // The executor's estimate, with its terms and token counts (rollouts of 8,192 tokens planned).
  EXPECT_THAT(message, HasSubstr("(estimated: stack "));
  EXPECT_THAT(message, HasSubstr("for a 8192-token path and 2048 graph tokens)"));
  EXPECT_THAT(message, HasSubstr("lower the executor's block size and graph budget"));
  // A reserve given instead is named as such.
  const absl::StatusOr<LayoutPlan> reserved =
      PlanLayout(Qwen3_32B(), {.gpu_bytes = 80 * kGiB, .activation_bytes = 8 * kGiB});
  EXPECT_THAT(std::string(reserved.status().message()), HasSubstr("activations 8.0 GiB)"));
  EXPECT_THAT(std::string(reserved.status().message()), HasSubstr("lower the activation reserve"));
}

TEST(PlanLayout, EstimatesTheExecutorByDefaultAndTakesAReserveInstead) {
  const ModelConfig config = Qwen3_8B();
  LayoutRequest request{.gpu_bytes = 80 * kGiB};
  request.executor = {.longest_rollout = 7821, .block_size = 2048, .graph_budget = 0};
  const absl::StatusOr<LayoutPlan> plan = PlanLayout(config, request);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->memory.activations_estimated);
  EXPECT_EQ(plan->memory.activations, EstimateExecutorMemory(config, request.executor).total());
  EXPECT_EQ(plan->memory.executor_tokens.stack, 7821);
  EXPECT_THAT(DescribeLayout(*plan),
              HasSubstr("activations 13.1 GiB (estimated: stack 3.5, graphs 7.8, workspace 1.1, "
                        "log-prob head 0.7 GiB"));
  EXPECT_THAT(DescribeLayout(*plan), HasSubstr("for a 7821-token path and 2048 graph tokens)"));

  request.activation_bytes = 3;
  const absl::StatusOr<LayoutPlan> reserved = PlanLayout(config, request);
  ASSERT_TRUE(reserved.ok()) << reserved.status();
  EXPECT_FALSE(reserved->memory.activations_estimated);
  EXPECT_EQ(reserved->memory.activations, 3);
  EXPECT_THAT(DescribeLayout(*reserved), Not(HasSubstr("estimated")));
}

TEST(PlanLayout, TheEstimateShrinksWithTensorParallelism) {
  // Each TP degree is planned with its own estimate: TP 2 holds half the K/V and graphs.
  const ModelConfig config = Qwen3_8B();
  LayoutRequest request{.world_size = 2, .gpu_bytes = 80 * kGiB, .tensor_parallel = 1};
  const MemoryEstimate tp1 = EstimateMemory(config, {.tensor_parallel = 1}, request);
  const MemoryEstimate tp2 = EstimateMemory(config, {.tensor_parallel = 2}, request);
  EXPECT_LT(tp2.activations, tp1.activations);
  EXPECT_EQ(tp2.activations, EstimateExecutorMemory(config, request.executor, 2).total());
}

TEST(PlanLayout, TheEstimateUnderExpertParallelismCountsTheServedRows) {
  // An EP layout's graphs also hold the rows each sparse layer's experts served.
  const ModelConfig config = *ModelPreset("qwen3-30b-a3b");
  LayoutRequest request{.world_size = 8, .gpu_bytes = 141 * kGiB};
  const MemoryEstimate alone = EstimateMemory(config, {.data_parallel = 8}, request);
  const MemoryEstimate spread =
      EstimateMemory(config, {.data_parallel = 8, .expert_parallel = 4}, request);
  ExecutorMemoryOptions executor = request.executor;
  executor.expert_parallel = 4;
  EXPECT_EQ(spread.activations, EstimateExecutorMemory(config, executor).total());
  EXPECT_EQ(spread.executor.graphs - alone.executor.graphs,
            spread.executor_tokens.graphs * config.num_hidden_layers * 8 * (2048 * 2 + 2 * 8));
  executor.expert_parallel = 0;
  request.executor = executor;
  EXPECT_THAT(PlanLayout(config, request).status().message(),
              HasSubstr("executor.expert_parallel"));
}

TEST(PlanLayout, BadExecutorOptionsAreRefusedNamingTheField) {
  LayoutRequest request{.gpu_bytes = 80 * kGiB};
  request.executor.longest_rollout = 0;
  absl::StatusOr<LayoutPlan> plan = PlanLayout(Qwen3_8B(), request);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(plan.status().message()),
              HasSubstr("field 'executor.longest_rollout': must be >= 1, got 0"));
  request.executor = {.block_size = 0};
  plan = PlanLayout(Qwen3_8B(), request);
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("executor.block_size"));
  request.executor = {.graph_budget = -2};
  plan = PlanLayout(Qwen3_8B(), request);
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("executor.graph_budget"));
  // Not checked when a reserve is given.
  request.activation_bytes = 0;
  EXPECT_TRUE(PlanLayout(Qwen3_8B(), request).ok());
}

TEST(PlanLayout, OverridesAreKeptOrRefused) {
  const absl::StatusOr<LayoutPlan> forced = PlanLayout(Qwen3_1_7B(), {.world_size = 4,
                                                                      .gpu_bytes = 80 * kGiB,
                                                                      .tensor_parallel = 2,
                                                                      .shard_optimizer = false,
                                                                      .offload_optimizer = true});
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_EQ(forced->layout,
            (TrainingLayout{.tensor_parallel = 2,
                            .data_parallel = 2,
                            .offload_optimizer = true,
                            .offload_resident_bytes = forced->memory.host_optimizer}));

  const absl::StatusOr<LayoutPlan> odd =
      PlanLayout(Qwen3_8B(), {.world_size = 8, .gpu_bytes = 80 * kGiB, .tensor_parallel = 3});
  EXPECT_EQ(odd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(odd.status().message()),
              HasSubstr("field 'tensor_parallel': 3 is not allowed"));

  const absl::StatusOr<LayoutPlan> no_offload =
      PlanLayout(Qwen3_8B(), {.gpu_bytes = 80 * kGiB, .offload_optimizer = false});
  EXPECT_EQ(no_offload.status().code(), absl::StatusCode::kResourceExhausted);

  EXPECT_EQ(PlanLayout(Qwen3_8B(), {}).status().code(),
            absl::StatusCode::kInvalidArgument);  // no GPU memory
  EXPECT_EQ(PlanLayout(Qwen3_8B(), {.world_size = 0, .gpu_bytes = kGiB}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dta

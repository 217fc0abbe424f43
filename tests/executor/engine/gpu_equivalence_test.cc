// The methods on a GPU: the float64 contract again on CUDA, float32 against float32 dense, and
// bfloat16 against float32 dense (no tree method may add error to bfloat16 dense's). The bf16 model
// has head_dim 64, so attention runs kernels/tree_attention's CUDA kernels; float32 and float64 run
// its reference on the GPU. Each check runs for every model family (testing::WithFamily: Qwen3;
// Llama with q/k/v/o biases and llama3 rope scaling; Qwen2 with q/k/v biases and YaRN; Qwen3-MoE,
// top-2 of 5 experts: grouped GEMMs in float32 and bfloat16, the expert loop in float64;
// Qwen3-Next, a Gated DeltaNet layer and gated attention with partial RoPE). Skipped without a
// GPU.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/model/family.h"
#include "executor/engine/executor.h"
#include "gtest/gtest.h"
#include "tests/core/tree/random_trees.h"
#include "tests/testing/executor_cases.h"
#include "tests/testing/test_family.h"

namespace dta {
namespace {

// The test-only family runs every suite parametrized over the registry, as a shipped one.
[[maybe_unused]] const bool kTestFamilyRegistered = [] {
  RegisterTestFamily();
  return true;
}();

ModelConfig SmallConfig() {
  ModelConfig c;
  c.vocab_size = 512;
  c.hidden_size = 256;
  c.intermediate_size = 512;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.tie_word_embeddings = false;
  return c;
}

// A random batch whose tree has the awkward shapes (duplicates, rollouts that are prefixes of
// others, one-token segments, wide branches): tests/core/tree/random_trees.h over a 4-token
// alphabet, mapped injectively per position into the model's vocabulary so that the model sees
// varied ids while the tree keeps its shape. Every token after the first is a loss token.
std::vector<Rollout> Batch(uint64_t seed, int max_rollouts, int max_length) {
  const std::vector<std::vector<TokenId>> sequences = testing::RandomRollouts(
      seed, {.max_rollouts = max_rollouts, .max_length = max_length, .vocab = 4});
  std::vector<Rollout> rollouts;
  for (size_t r = 0; r < sequences.size(); ++r) {
    Rollout rollout{.id = "r" + std::to_string(r), .group = "g" + std::to_string(r % 3)};
    for (size_t i = 0; i < sequences[r].size(); ++i) {
      rollout.tokens.push_back(static_cast<TokenId>((sequences[r][i] * 131 + i * 7) % 512));
      rollout.loss_mask.push_back(i == 0 ? 0 : 1);
      rollout.logprobs.push_back(-1.0f);
    }
    rollout.reward = static_cast<double>(r % 2);
    rollouts.push_back(std::move(rollout));
  }
  return rollouts;
}

struct GradRun {
  double loss = 0;
  std::vector<at::Tensor> grads;  // float64 on the CPU
};

GradRun RunOn(const Decoder& model, const std::vector<Rollout>& rollouts,
              const ExecutorOptions& options) {
  for (const auto& [name, p] : model.named_parameters()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  GradRun run;
  // SFT: every loss token carries gradient (GRPO's is 0 where a group's rewards agree, as they do
  // in many small batches, and a zero gradient would compare equal to anything).
  run.loss = ComputeGradients(model, rollouts, {.kind = LossKind::kSft}, options).loss;
  for (const auto& [name, p] : model.named_parameters()) {
    EXPECT_TRUE(p.grad().defined()) << name;
    run.grads.push_back(p.grad().to(at::kCPU, at::kDouble));
  }
  return run;
}

double RelativeError(const at::Tensor& value, const at::Tensor& reference) {
  const double scale = reference.norm().item<double>();
  return (value - reference).norm().item<double>() / std::max(scale, 1e-30);
}

struct Agreement {
  double flat = 0;    // ||g - g_ref|| / ||g_ref|| over all parameters flattened
  double median = 0;  // median of the per-parameter relative errors
  double loss = 0;    // relative error of the loss
};

Agreement Compare(const GradRun& run, const GradRun& reference) {
  double reference_norm = 0;
  for (const at::Tensor& g : reference.grads) reference_norm += g.norm().item<double>();
  EXPECT_GT(reference_norm, 0) << "the reference gradient is 0: the comparison would be vacuous";
  EXPECT_GT(std::abs(reference.loss), 0) << "the reference loss is 0";
  std::vector<double> per_parameter;
  std::vector<at::Tensor> a, b;
  for (size_t i = 0; i < run.grads.size(); ++i) {
    per_parameter.push_back(RelativeError(run.grads[i], reference.grads[i]));
    a.push_back(run.grads[i].flatten());
    b.push_back(reference.grads[i].flatten());
  }
  std::sort(per_parameter.begin(), per_parameter.end());
  return {.flat = RelativeError(at::cat(a), at::cat(b)),
          .median = per_parameter[per_parameter.size() / 2],
          .loss = std::abs(run.loss - reference.loss) / std::max(std::abs(reference.loss), 1e-30)};
}

// Every method; the packed capacity is the longest rollout, so larger trees are split.
std::vector<std::pair<std::string, ExecutorOptions>> Methods(const std::vector<Rollout>& rollouts) {
  int64_t longest = 0;
  for (const Rollout& r : rollouts) longest = std::max<int64_t>(longest, r.tokens.size());
  return {
      {"dense", {.method = Method::kDense}},
      {"dense+ckpt", {.method = Method::kDense, .checkpointing = true}},
      {"packed", {.method = Method::kPacked}},
      {"packed+ckpt, capacity = longest",
       {.method = Method::kPacked, .token_capacity = longest, .checkpointing = true}},
      {"dta B=64", {.method = Method::kDta, .block_size = 64, .graph_budget = 0, .pack = false}},
      {"dta B=256 auto budget", {.method = Method::kDta, .block_size = 256, .pack = false}},
      {"dta B=256 pack",
       {.method = Method::kDta, .block_size = 256, .graph_budget = 512, .pack = true}},
      {"dta auto B, auto budget, pack", {.method = Method::kDta, .pack = true}},
  };
}

class GpuEquivalence : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device: GPU equivalence runs on the GPU machines";
  }
  Decoder Model(at::ScalarType dtype) const {
    ModelConfig config = testing::WithFamily(SmallConfig(), GetParam());
    // Experts (routed and shared) as wide as the grouped GEMM's alignment wants (16-byte rows in
    // bfloat16).
    if (config.num_experts > 0) config.moe_intermediate_size = 64;
    if (config.shared_expert_intermediate_size > 0) config.shared_expert_intermediate_size = 64;
    // Qwen3-Next's linear layers at head sizes of the real model's order.
    if (!config.layer_types.empty()) {
      config.linear_key_head_dim = 32;
      config.linear_value_head_dim = 32;
    }
    Decoder model(config, at::TensorOptions().dtype(dtype).device(at::kCUDA));
    model.InitRandom(11, 0.05);
    return model;
  }
};

TEST_P(GpuEquivalence, Float64MatchesDenseToRounding) {
  const std::vector<Rollout> rollouts = Batch(/*seed=*/5, /*max_rollouts=*/12, /*max_length=*/60);
  const Decoder model = Model(at::kDouble);
  const GradRun dense = RunOn(model, rollouts, {.method = Method::kDense});
  for (const auto& [name, options] : Methods(rollouts)) {
    const Agreement a = Compare(RunOn(model, rollouts, options), dense);
    EXPECT_LE(a.flat, 1e-9) << name;
    EXPECT_LE(a.loss, 1e-9) << name;
  }
}

TEST_P(GpuEquivalence, Float32MatchesFloat32Dense) {
  const std::vector<Rollout> rollouts = Batch(/*seed=*/6, /*max_rollouts=*/24, /*max_length=*/120);
  const Decoder model = Model(at::kFloat);
  const GradRun dense = RunOn(model, rollouts, {.method = Method::kDense});
  for (const auto& [name, options] : Methods(rollouts)) {
    const Agreement a = Compare(RunOn(model, rollouts, options), dense);
    std::printf("%s float32 %-28s flat %.2e  median %.2e  loss %.2e\n", GetParam().c_str(),
                name.c_str(), a.flat, a.median, a.loss);
    EXPECT_LE(a.flat, 1e-4) << name;
    EXPECT_LE(a.loss, 1e-5) << name;
  }
}

// bfloat16 against float32 dense. The tree methods must add no error of their own: each is within
// 15% (plus 0.1 percentage point) of bfloat16 dense's own distance to the reference, and close to
// bfloat16 dense itself. bfloat16 dense must be a sane bfloat16 run: median under 3%, or 5% with
// routed experts, whose top-k choices flip where bfloat16 rounding reorders near-tied router
// logits (on this random model, H200: qwen3 1.8%, qwen3_moe 2.1%, qwen3_next 2.8%, dta_test_hybrid
// 3.2%, qwen3_5_moe_text 4.2%, experts in every layer); the benchmark's 1% target is measured and
// reported by dta-bench, not asserted here.
TEST_P(GpuEquivalence, Bfloat16AddsNoErrorToDense) {
  const std::vector<Rollout> rollouts = Batch(/*seed=*/6, /*max_rollouts=*/24, /*max_length=*/120);
  const Decoder reference_model = Model(at::kFloat);
  const GradRun reference = RunOn(reference_model, rollouts, {.method = Method::kDense});
  const Decoder model = Model(at::kBFloat16);
  const GradRun dense = RunOn(model, rollouts, {.method = Method::kDense});
  const Agreement dense_error = Compare(dense, reference);
  EXPECT_LE(dense_error.median, model.config().num_experts > 0 ? 0.05 : 0.03);
  EXPECT_LE(dense_error.loss, 1e-3);
  for (const auto& [name, options] : Methods(rollouts)) {
    const GradRun run = RunOn(model, rollouts, options);
    const Agreement a = Compare(run, reference);
    const Agreement to_dense = Compare(run, dense);
    std::printf(
        "%s bfloat16 %-32s vs float32: flat %.2e  median %.2e  loss %.2e;  vs bf16 dense: flat "
        "%.2e\n",
        GetParam().c_str(), name.c_str(), a.flat, a.median, a.loss, to_dense.flat);
    // Routing is discontinuous: a token whose top-k margin is below bfloat16's noise may pick
    // other experts when only the summation order changes (chunks of B = 64 measured 2.31e-2 vs
    // dense's 1.91e-2 on an H100, and the same with the experts' weight gradients in float32).
    const double slack = model.config().num_experts > 0 ? 1.3 : 1.15;
    EXPECT_LE(a.median, slack * dense_error.median + 1e-3) << name;
    EXPECT_LE(a.flat, slack * dense_error.flat + 1e-3) << name;
    EXPECT_LE(to_dense.flat, 2 * dense_error.flat) << name;
    EXPECT_LE(a.loss, 1e-3) << name;
  }
}

// The methods of the bitwise checks below, with a fixed block size and graph budget: automatic
// ones follow the free memory, which may differ between two runs and change the summation order.
std::vector<std::pair<std::string, ExecutorOptions>> FixedPlanMethods() {
  return {{"dta B=64 pack",
           {.method = Method::kDta, .block_size = 64, .graph_budget = 512, .pack = true}},
          {"packed", {.method = Method::kPacked}},
          {"dense", {.method = Method::kDense}}};
}

// Every gradient of `run` bitwise `other`'s, and none of them zero (a vacuous comparison).
void ExpectBitwiseEqual(const Decoder& model, const GradRun& run, const GradRun& other,
                        const std::string& where) {
  EXPECT_EQ(run.loss, other.loss) << where;
  const auto parameters = model.named_parameters();
  ASSERT_EQ(run.grads.size(), parameters.size());
  ASSERT_EQ(other.grads.size(), parameters.size());
  for (size_t i = 0; i < parameters.size(); ++i) {
    const std::string& parameter = parameters[i].first;
    EXPECT_GT(run.grads[i].norm().item<double>(), 0.0) << where << " " << parameter;
    EXPECT_TRUE(at::equal(run.grads[i], other.grads[i]))
        << where << " " << parameter << ": differs by "
        << RelativeError(run.grads[i], other.grads[i]);
  }
}

// The same step twice gives the same bits in every gradient, float32 and bfloat16, dta, packed and
// dense: the attention backward has no atomics, and gathers sum repeated rows in a fixed order
// (executor/model/ops/gather_rows.h: the embedding, Qwen3-Next's convolution, a branch point's
// predictions; index_add_'s atomics made the embedding's and in_proj_qkvz's float32 gradients
// differ from run to run).
TEST_P(GpuEquivalence, EveryGradientIsBitwiseReproducible) {
  const std::vector<Rollout> rollouts = Batch(/*seed=*/9, /*max_rollouts=*/16, /*max_length=*/80);
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const Decoder model = Model(dtype);
    for (const auto& [name, options] : FixedPlanMethods()) {
      const GradRun first = RunOn(model, rollouts, options);
      ExpectBitwiseEqual(model, first, RunOn(model, rollouts, options),
                         name + " " + c10::toString(dtype));
    }
  }
}

// ExecutorOptions::replace_gradients over gradients full of NaN (a stale step's, at worst) is
// bitwise zeroing them first and accumulating, in float32 and bfloat16: the bfloat16 experts'
// first chunk runs the grouped GEMM with beta = 0 (kernels/grouped_gemm.h), which never reads them.
TEST_P(GpuEquivalence, ReplacingGradientsIsAccumulatingIntoZeros) {
  const std::vector<Rollout> rollouts = Batch(/*seed=*/10, /*max_rollouts=*/12, /*max_length=*/80);
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const Decoder model = Model(dtype);
    for (auto [name, options] : FixedPlanMethods()) {
      const GradRun zeroed = RunOn(model, rollouts, options);
      for (const auto& [parameter, p] : model.named_parameters()) {
        p.mutable_grad().fill_(std::numeric_limits<float>::quiet_NaN());
      }
      options.replace_gradients = true;
      GradRun replaced;
      replaced.loss = ComputeGradients(model, rollouts, {.kind = LossKind::kSft}, options).loss;
      for (const auto& [parameter, p] : model.named_parameters()) {
        replaced.grads.push_back(p.grad().to(at::kCPU, at::kDouble));
      }
      ExpectBitwiseEqual(model, zeroed, replaced, name + " " + c10::toString(dtype));
    }
  }
}

// Every fixed-plan method gives bitwise the same gradients with the environment switch `variable`
// at "0" as with its default (on), in float32 and bfloat16 (the CUDA kernels' paths).
void ExpectSwitchChangesNoBit(const std::string& family, const std::vector<Rollout>& rollouts,
                              const std::function<Decoder(at::ScalarType)>& make_model,
                              const char* variable) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const Decoder model = make_model(dtype);
    for (const auto& [name, options] : FixedPlanMethods()) {
      const GradRun on = RunOn(model, rollouts, options);
      ASSERT_EQ(setenv(variable, "0", 1), 0);
      const GradRun off = RunOn(model, rollouts, options);
      ASSERT_EQ(unsetenv(variable), 0);
      ExpectBitwiseEqual(model, on, off,
                         family + " " + name + " " + c10::toString(dtype) + " " + variable);
    }
  }
}

// The residual add before the post-attention norm folded into the norm's kernel (the default)
// against adding first (DTA_FUSED_RESIDUAL_ADD=0): the kernel adds with the one rounding ATen's
// add makes, so every gradient is bitwise the same.
TEST_P(GpuEquivalence, FoldedResidualAddIsBitwiseAddingFirst) {
  ExpectSwitchChangesNoBit(
      GetParam(), Batch(/*seed=*/9, /*max_rollouts=*/12, /*max_length=*/80),
      [&](at::ScalarType dtype) { return Model(dtype); }, "DTA_FUSED_RESIDUAL_ADD");
}

// The residual stream's gradient summed inside the norm's backward kernel (the default) against
// autograd's sum of the two gradients (DTA_FUSED_RESIDUAL=0, which also leaves the residual add
// unfolded): the kernel adds with one rounding in float32, as autograd's add does, so every
// gradient is bitwise the same (the step being reproducible, above).
TEST_P(GpuEquivalence, FusedResidualGradientIsBitwiseAutogradsSum) {
  ExpectSwitchChangesNoBit(
      GetParam(), Batch(/*seed=*/8, /*max_rollouts=*/12, /*max_length=*/80),
      [&](at::ScalarType dtype) { return Model(dtype); }, "DTA_FUSED_RESIDUAL");
}

// ExecutorOptions::memory_budget: budgets from below the smallest chunk to above the whole tree.
// Each step either refuses, naming the budget, or runs with a plan that fits. In bfloat16 (the
// kernel path the estimate models) its peak allocation stays within the budget, up to 4 MiB of
// per-step tensors the estimate leaves out (index tensors, tables, the kernels' workspaces:
// nothing beside a real model's GiB, where dta-bench measures the bound strictly; float32 and
// float64 attention run the reference, whose [T, P + T] scores the estimate does not count). In
// float64 the budgeted step's gradient is dense's.
TEST_P(GpuEquivalence, MemoryBudgetBoundsThePeakAndKeepsTheGradient) {
  const std::vector<Rollout> rollouts = Batch(/*seed=*/7, /*max_rollouts=*/12, /*max_length=*/600);
  int64_t longest = 0;
  for (const Rollout& r : rollouts) longest = std::max<int64_t>(longest, r.tokens.size());
  ASSERT_GT(longest, 300) << "the batch must allow chunks shorter than its longest rollout";
  const c10::DeviceIndex device = c10::cuda::current_device();
  auto allocated = [&] {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(device).allocated_bytes[0].current;
  };
  constexpr int64_t kMiB = int64_t{1} << 20;
  // Runs dta under `budget` bytes above what is allocated now; false when it refuses.
  auto budgeted = [&](const Decoder& model, int64_t above, GradientResult& result) {
    const ExecutorOptions options{
        .method = Method::kDta, .memory_budget = allocated() + above, .pack = true};
    try {
      result = ComputeGradients(model, rollouts, {.kind = LossKind::kSft}, options);
      return true;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("memory_budget of"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("a chunk of"), std::string::npos) << e.what();
      return false;
    }
  };
  std::vector<int64_t> budgets;  // bytes above the weights and gradients
  for (int64_t megabytes = 1; megabytes <= 256; megabytes *= 2) {
    budgets.push_back(megabytes * kMiB);
    budgets.push_back(megabytes * 3 / 2 * kMiB);
  }

  int refused = 0, shortened = 0, whole = 0;
  const Decoder bf16 = Model(at::kBFloat16);
  RunOn(bf16, rollouts, {.method = Method::kDense});  // gradients and workspaces allocated
  for (const int64_t above : budgets) {
    c10::cuda::CUDACachingAllocator::emptyCache();
    const int64_t budget = allocated() + above;
    c10::cuda::CUDACachingAllocator::resetPeakStats(device);
    GradientResult result;
    if (!budgeted(bf16, above, result)) {
      ++refused;
      continue;
    }
    const int64_t peak =
        c10::cuda::CUDACachingAllocator::getDeviceStats(device).allocated_bytes[0].peak;
    std::printf("%s bf16 budget %lld B: B %lld, graph budget %lld, peak %lld B (%.3f)\n",
                GetParam().c_str(), static_cast<long long>(budget),
                static_cast<long long>(result.block_size),
                static_cast<long long>(result.graph_budget), static_cast<long long>(peak),
                static_cast<double>(peak) / static_cast<double>(budget));
    EXPECT_LE(peak, budget + 4 * kMiB) << above / kMiB << " MiB above the weights";
    (result.block_size < longest ? shortened : whole) += 1;
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(shortened, 0);
  EXPECT_GT(whole, 0);

  const Decoder exact = Model(at::kDouble);
  const GradRun dense = RunOn(exact, rollouts, {.method = Method::kDense});
  for (const int64_t above : budgets) {
    for (const auto& [name, p] : exact.named_parameters()) p.mutable_grad().zero_();
    GradientResult result;
    if (!budgeted(exact, above, result)) continue;
    GradRun run{.loss = result.loss};
    for (const auto& [name, p] : exact.named_parameters())
      run.grads.push_back(p.grad().to(at::kCPU, at::kDouble));
    const Agreement a = Compare(run, dense);
    EXPECT_LE(a.flat, 1e-9) << "budget " << above / kMiB << " MiB, B " << result.block_size;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, GpuEquivalence,
                         // Every family of the registry: a new one fails here until
                         // the test model of tests/testing knows it.
                         ::testing::ValuesIn(ModelFamilyTypes()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace dta

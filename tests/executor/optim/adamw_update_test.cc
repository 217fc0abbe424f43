// AdamWUpdate's two paths: the fused float32 kernel on the GPU (kernels/adamw_step.h) against
// LibTorch's ops (DTA_FUSED_ADAMW=0) and against torch::optim::AdamW itself, bit for bit, over
// sizes that exercise the kernel's vector and scalar loops, unaligned views, values over many
// magnitudes and the options whose scalars take another rounding path (no weight decay, beta1 or
// beta2 of 0, clipping); on the CPU, the clip factor applied as clip_grad_norm_ applies it and the
// kernel wrapper's errors.
#include "executor/optim/adamw_update.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "core/base/scoped_env.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/adamw_step.h"

namespace dta {
namespace {

using ::testing::HasSubstr;

// DTA_FUSED_ADAMW for the scope: unset (the default, the kernel) or "0" (the ops).
ScopedEnv FusedSwitch(bool on) { return {"DTA_FUSED_ADAMW", on ? nullptr : "0"}; }

// Equal bit for bit, NaN equal to any NaN (the ops and the kernel may pick different NaN payloads).
::testing::AssertionResult SameBits(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.contiguous().cpu();
  const at::Tensor w = want.contiguous().cpu();
  if (g.sizes() != w.sizes()) return ::testing::AssertionFailure() << "sizes differ";
  const at::Tensor both_nan = at::isnan(g) & at::isnan(w);
  const at::Tensor differ = (g.view(at::kInt) != w.view(at::kInt)) & ~both_nan;
  const int64_t count = differ.sum().item<int64_t>();
  if (count == 0) return ::testing::AssertionSuccess();
  const int64_t first = differ.nonzero()[0][0].item<int64_t>();
  return ::testing::AssertionFailure()
         << count << " of " << g.numel() << " elements differ; first at " << first << ": "
         << g[first].item<float>() << " vs " << w[first].item<float>();
}

struct State {
  at::Tensor master, exp_avg, exp_avg_sq;
};

// `n` elements as views at `offset` floats into their storage (1: not 16-byte aligned), values
// spread over many magnitudes, some exact zeros.
at::Tensor Spread(int64_t n, int64_t offset, uint64_t seed, double low_exp, double high_exp,
                  bool non_negative, const at::Device& device) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const at::TensorOptions f64 = at::TensorOptions().dtype(at::kDouble);
  at::Tensor mantissa = at::randn({n}, gen, f64);
  if (non_negative) mantissa = mantissa.abs();
  const at::Tensor exponent = at::rand({n}, gen, f64) * (high_exp - low_exp) + low_exp;
  at::Tensor v = mantissa * at::pow(10.0, exponent);
  v.masked_fill_(at::rand({n}, gen, f64) < 0.03, 0.0);
  at::Tensor storage =
      at::zeros({n + offset}, at::TensorOptions().dtype(at::kFloat).device(device));
  at::Tensor view = storage.narrow(0, offset, n);
  view.copy_(v.to(at::kFloat));
  return view;
}

State MakeState(int64_t n, int64_t offset, uint64_t seed, const at::Device& device) {
  return {Spread(n, offset, seed, -6, 2, false, device),
          Spread(n, offset, seed + 1, -12, -1, false, device),
          Spread(n, offset, seed + 2, -24, -2, true, device)};
}

State Clone(const State& s) { return {s.master.clone(), s.exp_avg.clone(), s.exp_avg_sq.clone()}; }

struct Case {
  std::string name;
  AdamWOptions options;
  double clip_coef = 1.0;
};

std::vector<Case> Cases() {
  return {
      {"defaults", {.lr = 1e-3}},
      {"no weight decay", {.lr = 3e-4, .weight_decay = 0}},
      {"beta2 of 0 (addcmul's alpha is 1)", {.lr = 1e-3, .beta2 = 0}},
      {"beta1 of 0", {.lr = 1e-3, .beta1 = 0, .beta2 = 0.95}},
      {"clipped", {.lr = 1e-3, .weight_decay = 0.1}, 0.3712},
      {"large rate, eps 0", {.lr = 0.7, .eps = 0, .weight_decay = 0.5}, 0.999},
  };
}

bool HaveCuda() { return at::hasCUDA(); }

TEST(AdamWUpdateGpuTest, FusedKernelEqualsTheOpsBitForBit) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device: the fused kernel runs on the GPU machines";
  const at::Device cuda(at::kCUDA, 0);
  for (const Case& c : Cases()) {
    for (const int64_t n :
         {int64_t{1}, int64_t{3}, int64_t{4}, int64_t{5}, int64_t{4099}, (int64_t{1} << 20) + 3}) {
      for (const int64_t offset : {0, 1}) {
        SCOPED_TRACE(c.name + ", n " + std::to_string(n) + ", offset " + std::to_string(offset));
        const State start = MakeState(n, offset, 17 + n, cuda);
        State fused = Clone(start);
        State ops = Clone(start);
        if (offset == 1) {  // clones are aligned: keep the unaligned views for the kernel
          fused = MakeState(n, offset, 17 + n, cuda);
        }
        for (int64_t t = 1; t <= 3; ++t) {
          SCOPED_TRACE("step " + std::to_string(t));
          const at::Tensor grad = Spread(n, offset, 1000 * t + n, -9, 1, false, cuda);
          const at::Tensor grad_before = grad.clone();
          const AdamWStepScalars scalars = AdamWScalarsFor(c.options, t);
          {
            const auto on = FusedSwitch(true);
            ASSERT_TRUE(
                kernels::FusedAdamWStepTakes(fused.master, fused.exp_avg, fused.exp_avg_sq, grad));
            AdamWUpdate(fused.master, fused.exp_avg, fused.exp_avg_sq, grad, scalars, c.clip_coef);
          }
          {
            const auto off = FusedSwitch(false);
            ASSERT_FALSE(
                kernels::FusedAdamWStepTakes(ops.master, ops.exp_avg, ops.exp_avg_sq, grad));
            AdamWUpdate(ops.master, ops.exp_avg, ops.exp_avg_sq, grad, scalars, c.clip_coef);
          }
          EXPECT_TRUE(SameBits(grad, grad_before)) << "the gradient was modified";
          EXPECT_TRUE(SameBits(fused.exp_avg, ops.exp_avg)) << "exp_avg";
          EXPECT_TRUE(SameBits(fused.exp_avg_sq, ops.exp_avg_sq)) << "exp_avg_sq";
          EXPECT_TRUE(SameBits(fused.master, ops.master)) << "master";
          ASSERT_FALSE(SameBits(fused.master, start.master)) << "the step changed nothing";
        }
      }
    }
  }
}

TEST(AdamWUpdateGpuTest, FusedKernelEqualsTorchAdamWOnTheGpu) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device: the fused kernel runs on the GPU machines";
  const at::Device cuda(at::kCUDA, 0);
  const int64_t n = 100003;
  for (const Case& c : Cases()) {
    if (c.clip_coef != 1.0) continue;  // torch::optim::AdamW does not clip
    SCOPED_TRACE(c.name);
    State ours = MakeState(n, 0, 5, cuda);
    at::Tensor reference = ours.master.clone().requires_grad_(true);
    AdamWOptions o = c.options;
    torch::optim::AdamW theirs(std::vector<at::Tensor>{reference},
                               torch::optim::AdamWOptions(o.lr)
                                   .betas({o.beta1, o.beta2})
                                   .eps(o.eps)
                                   .weight_decay(o.weight_decay));
    ours.exp_avg.zero_();
    ours.exp_avg_sq.zero_();
    for (int64_t t = 1; t <= 3; ++t) {
      SCOPED_TRACE("step " + std::to_string(t));
      const at::Tensor grad = Spread(n, 0, 77 * t, -9, 1, false, cuda);
      AdamWUpdate(ours.master, ours.exp_avg, ours.exp_avg_sq, grad, AdamWScalarsFor(o, t));
      reference.mutable_grad() = grad.clone();
      theirs.step();
      const auto& state = static_cast<const torch::optim::AdamWParamState&>(
          *theirs.state().at(reference.unsafeGetTensorImpl()));
      EXPECT_TRUE(SameBits(ours.exp_avg, state.exp_avg())) << "exp_avg";
      EXPECT_TRUE(SameBits(ours.exp_avg_sq, state.exp_avg_sq())) << "exp_avg_sq";
      EXPECT_TRUE(SameBits(ours.master, reference.detach())) << "master";
    }
  }
}

TEST(AdamWUpdateTest, ClipFactorMultipliesTheGradientAsClipGradNormDoes) {
  const at::Device cpu(at::kCPU);
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const State start = MakeState(1001, 0, 3, cpu);
    State a{start.master.to(dtype, /*non_blocking=*/false, /*copy=*/true),
            start.exp_avg.to(dtype, /*non_blocking=*/false, /*copy=*/true),
            start.exp_avg_sq.to(dtype, /*non_blocking=*/false, /*copy=*/true)};
    State b = Clone(a);
    const at::Tensor grad = Spread(1001, 0, 9, -9, 1, false, cpu).to(dtype);
    const at::Tensor grad_before = grad.clone();
    const AdamWStepScalars scalars = AdamWScalarsFor({.lr = 1e-3}, 2);
    AdamWUpdate(a.master, a.exp_avg, a.exp_avg_sq, grad, scalars, 0.4217);
    AdamWUpdate(b.master, b.exp_avg, b.exp_avg_sq, grad.mul(0.4217), scalars);
    EXPECT_TRUE(at::equal(grad, grad_before)) << "the gradient was modified";
    EXPECT_TRUE(at::equal(a.master, b.master));
    EXPECT_TRUE(at::equal(a.exp_avg, b.exp_avg));
    EXPECT_TRUE(at::equal(a.exp_avg_sq, b.exp_avg_sq));
    EXPECT_FALSE(at::equal(a.master, start.master.to(dtype)));
  }
}

TEST(AdamWUpdateTest, FusedKernelTakesOnlyDenseFloat32GpuStateAndNamesWhatIsWrong) {
  const at::Tensor cpu = at::zeros({8});
  EXPECT_FALSE(kernels::FusedAdamWStepTakes(cpu, cpu, cpu, cpu));
  at::Tensor master = cpu.clone();
  at::Tensor m = cpu.clone();
  at::Tensor v = cpu.clone();
  try {
    kernels::FusedAdamWStep(master, m, v, cpu, {});
    ADD_FAILURE() << "a CPU master was taken";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.msg(), HasSubstr("master must be a contiguous float32 CUDA tensor"));
  }
  if (!HaveCuda()) return;
  const at::Device cuda(at::kCUDA, 0);
  at::Tensor gpu = at::zeros({8}, at::TensorOptions().device(cuda));
  at::Tensor short_m = at::zeros({7}, gpu.options());
  at::Tensor v_gpu = gpu.clone();
  const at::Tensor m_gpu = gpu.clone();
  const at::Tensor g_gpu = gpu.clone();
  EXPECT_TRUE(kernels::FusedAdamWStepTakes(gpu, m_gpu, v_gpu, g_gpu));
  EXPECT_FALSE(kernels::FusedAdamWStepTakes(gpu, short_m, v_gpu, g_gpu));
  EXPECT_FALSE(kernels::FusedAdamWStepTakes(gpu, gpu.to(at::kDouble), v_gpu, g_gpu));
  EXPECT_FALSE(kernels::FusedAdamWStepTakes(
      gpu, m_gpu, v_gpu, at::zeros({16}, gpu.options()).view({8, 2}).select(1, 0)));
  // Views of one [3, 8] buffer are disjoint; the same tensor twice is not.
  const at::Tensor rows = at::zeros({3, 8}, gpu.options());
  at::Tensor r0 = rows[0];
  at::Tensor r1 = rows[1];
  at::Tensor r2 = rows[2];
  EXPECT_TRUE(kernels::FusedAdamWStepTakes(r0, r1, r2, gpu));
  EXPECT_FALSE(kernels::FusedAdamWStepTakes(r0, r1, r2, r1));
  try {
    kernels::FusedAdamWStep(r0, r1, r2, r0, {});
    ADD_FAILURE() << "a gradient sharing master's memory was taken";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.msg(), HasSubstr("must not share memory"));
  }
  try {
    kernels::FusedAdamWStep(gpu, short_m, v_gpu, gpu, {});
    ADD_FAILURE() << "a short exp_avg was taken";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.msg(), HasSubstr("exp_avg must be a contiguous float32 tensor of master's 8"));
  }
}

}  // namespace
}  // namespace dta

// AdamW against LibTorch's own torch::optim::AdamW (bit-exact in float64 and float32), clipping
// against a hand computation, bf16 parameters with float32 master weights, save / load / resume
// bit-exactness, and the errors.
#include "executor/optim/adamw.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

using ::testing::HasSubstr;
using Named = std::vector<std::pair<std::string, at::Tensor>>;

const std::vector<std::pair<std::string, std::vector<int64_t>>> kShapes = {
    {"model.layers.0.mlp.up_proj.weight", {6, 5}},
    {"model.layers.0.mlp.up_proj.bias", {6}},
    {"model.norm.weight", {7}},
};

at::Tensor Randn(c10::IntArrayRef shape, uint64_t seed) {
  return at::randn(shape, at::detail::createCPUGenerator(seed),
                   at::TensorOptions().dtype(at::kDouble));
}

// Leaf parameters of `dtype` requiring grad, random (or zero) values.
Named MakeParams(at::ScalarType dtype, uint64_t seed, bool zeros = false) {
  Named named;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    at::Tensor v = zeros ? at::zeros(kShapes[i].second, at::kDouble)
                         : Randn(kShapes[i].second, seed * 100 + i);
    named.emplace_back(kShapes[i].first, v.to(dtype).requires_grad_(true));
  }
  return named;
}

// Deterministic grads for `step`, in each parameter's dtype.
std::vector<at::Tensor> MakeGrads(const Named& named, int64_t step, double scale) {
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < named.size(); ++i) {
    const at::Tensor& p = named[i].second;
    grads.push_back((Randn(p.sizes(), 7919 * step + i) * scale).to(p.scalar_type()));
  }
  return grads;
}

void SetGrads(const Named& named, const std::vector<at::Tensor>& grads) {
  for (size_t i = 0; i < named.size(); ++i) named[i].second.mutable_grad() = grads[i].clone();
}

std::vector<at::Tensor> Clones(const Named& named, at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  for (const auto& [name, p] : named)
    out.push_back(p.detach().to(dtype).clone().requires_grad_(true));
  return out;
}

double HandNorm(const std::vector<at::Tensor>& grads) {
  double sum = 0;
  for (const at::Tensor& g : grads) {
    at::Tensor d = g.to(at::kDouble).contiguous();
    const double* x = d.const_data_ptr<double>();
    for (int64_t k = 0; k < d.numel(); ++k) sum += x[k] * x[k];
  }
  return std::sqrt(sum);
}

torch::optim::AdamWOptions TorchOptions(const AdamWOptions& o) {
  return torch::optim::AdamWOptions(o.lr)
      .betas({o.beta1, o.beta2})
      .eps(o.eps)
      .weight_decay(o.weight_decay);
}

const torch::optim::AdamWParamState& TorchState(const torch::optim::AdamW& opt,
                                                const at::Tensor& p) {
  return static_cast<const torch::optim::AdamWParamState&>(
      *opt.state().at(p.unsafeGetTensorImpl()));
}

std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.msg();
  }
  return "<no error>";
}

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "dta_adamw_" + name + ".safetensors";
}

// Runs `steps` steps of ours and of torch::optim::AdamW (on `reference_dtype` copies of the
// parameters, fed the grads converted and multiplied by our clip coefficient) and checks
// parameters, master weights and moments bit for bit after every step.
void ExpectMatchesTorch(at::ScalarType dtype, at::ScalarType reference_dtype,
                        const AdamWOptions& options, double grad_scale, int steps) {
  Named params = MakeParams(dtype, 1);
  std::vector<at::Tensor> reference = Clones(params, reference_dtype);
  AdamW ours(params, options);
  torch::optim::AdamW theirs(reference, TorchOptions(options));
  for (int step = 1; step <= steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const std::vector<at::Tensor> grads = MakeGrads(params, step, grad_scale);
    SetGrads(params, grads);
    const StepStats stats = ours.Step();
    EXPECT_EQ(stats.step, step);
    EXPECT_NEAR(stats.grad_norm, HandNorm(grads), 1e-12 * HandNorm(grads));
    const double expected_coef =
        options.max_grad_norm > 0 ? std::min(1.0, options.max_grad_norm / (stats.grad_norm + 1e-6))
                                  : 1.0;
    EXPECT_EQ(stats.clip_coef, expected_coef);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(at::equal(params[i].second.grad(), grads[i])) << "our Step modified the grad";
      at::Tensor g = grads[i].to(reference_dtype);
      if (stats.clip_coef != 1.0) g.mul_(stats.clip_coef);  // what clip_grad_norm_ does in place
      reference[i].mutable_grad() = g;
    }
    theirs.step();
    for (size_t i = 0; i < params.size(); ++i) {
      const std::string& name = params[i].first;
      SCOPED_TRACE(name);
      const torch::optim::AdamWParamState& state = TorchState(theirs, reference[i]);
      EXPECT_TRUE(at::equal(ours.master(name), reference[i].detach()));
      EXPECT_TRUE(at::equal(params[i].second.detach(), reference[i].detach().to(dtype)));
      EXPECT_TRUE(at::equal(ours.exp_avg(name), state.exp_avg()));
      EXPECT_TRUE(at::equal(ours.exp_avg_sq(name), state.exp_avg_sq()));
    }
  }
}

TEST(AdamWTest, MatchesTorchAdamWFloat64) {
  ExpectMatchesTorch(at::kDouble, at::kDouble,
                     {.lr = 1e-2, .weight_decay = 0.1, .max_grad_norm = 0}, 1.0, 6);
}

TEST(AdamWTest, MatchesTorchAdamWFloat32) {
  ExpectMatchesTorch(at::kFloat, at::kFloat, {.lr = 1e-2, .weight_decay = 0.1, .max_grad_norm = 0},
                     1.0, 6);
}

TEST(AdamWTest, MatchesTorchAdamWNoWeightDecayOtherBetas) {
  const AdamWOptions options{
      .lr = 3e-3, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0, .max_grad_norm = 0};
  ExpectMatchesTorch(at::kDouble, at::kDouble, options, 1e-3, 5);
  ExpectMatchesTorch(at::kFloat, at::kFloat, options, 1e-3, 5);
}

TEST(AdamWTest, MatchesTorchAdamWAfterClipping) {
  // Grads of norm ~ 6 * scale against max 0.5: every step clips. eps is large so that the
  // update depends on the grad's scale and a wrong coefficient would show.
  const AdamWOptions options{.lr = 1e-2, .eps = 1e-1, .weight_decay = 0.01, .max_grad_norm = 0.5};
  ExpectMatchesTorch(at::kDouble, at::kDouble, options, 1.0, 5);
  ExpectMatchesTorch(at::kFloat, at::kFloat, options, 1.0, 5);
  // Below the threshold nothing is scaled.
  ExpectMatchesTorch(at::kDouble, at::kDouble, {.lr = 1e-2, .max_grad_norm = 1e3}, 1.0, 3);
}

TEST(AdamWTest, ClippingAgainstHandComputation) {
  // Grads [3, 4] and [12]: global norm 13; an undefined grad counts as zero.
  Named params = {{"a", at::zeros({2}, at::kDouble).requires_grad_(true)},
                  {"b", at::zeros({1}, at::kDouble).requires_grad_(true)},
                  {"frozen", at::ones({3}, at::kDouble).requires_grad_(true)}};
  params[0].second.mutable_grad() = at::tensor({3.0, 4.0}, at::kDouble);
  params[1].second.mutable_grad() = at::tensor({12.0}, at::kDouble);
  EXPECT_EQ(GlobalGradNorm(params), 13.0);

  const double lr = 0.1, eps = 1.0, max_norm = 1.0;
  AdamW opt(params, {.lr = lr, .eps = eps, .weight_decay = 0.5, .max_grad_norm = max_norm});
  const StepStats stats = opt.Step();
  const double c = max_norm / (13.0 + 1e-6);
  EXPECT_EQ(stats.grad_norm, 13.0);
  EXPECT_EQ(stats.clip_coef, c);
  EXPECT_EQ(stats.step, 1);
  // First step: mhat = c g, vhat = (c g)^2, so p = 0 - lr * c g / (c |g| + eps) (decay of 0 is 0).
  const double expected[] = {3.0, 4.0, 12.0};
  const at::Tensor got = at::cat({params[0].second.detach(), params[1].second.detach()});
  for (int k = 0; k < 3; ++k) {
    const double want = -lr * c * expected[k] / (c * expected[k] + eps);
    EXPECT_NEAR(got[k].item<double>(), want, 1e-15 * std::abs(want)) << k;
  }
  // The grad itself is not modified; the parameter without a grad is not touched, not even decayed.
  EXPECT_TRUE(at::equal(params[0].second.grad(), at::tensor({3.0, 4.0}, at::kDouble)));
  EXPECT_TRUE(at::equal(params[2].second.detach(), at::ones({3}, at::kDouble)));
  EXPECT_TRUE(at::equal(opt.exp_avg("frozen"), at::zeros({3}, at::kDouble)));

  // Disabled clipping: coefficient 1 whatever the norm.
  AdamW unclipped(params, {.max_grad_norm = 0});
  const StepStats s2 = unclipped.Step();
  EXPECT_EQ(s2.grad_norm, 13.0);
  EXPECT_EQ(s2.clip_coef, 1.0);

  // No grads at all: norm 0, coefficient 1.
  Named none = {{"x", at::ones({2}, at::kFloat).requires_grad_(true)}};
  EXPECT_EQ(GlobalGradNorm(none), 0.0);
}

TEST(AdamWTest, GlobalGradNormFloat64AccumulationOfLowPrecisionGrads) {
  Named params = MakeParams(at::kBFloat16, 3);
  const std::vector<at::Tensor> grads = MakeGrads(params, 1, 100.0);
  SetGrads(params, grads);
  const double hand = HandNorm(grads);
  EXPECT_NEAR(GlobalGradNorm(params), hand, 1e-12 * hand);
}

TEST(AdamWTest, Bf16ParametersKeepFloat32MasterWeights) {
  // bf16 parameters against torch's AdamW on float32 parameters: our master copy is bit-equal to
  // torch's float32 parameters, our parameters are those rounded to bf16.
  ExpectMatchesTorch(at::kBFloat16, at::kFloat,
                     {.lr = 1e-2, .eps = 1e-3, .weight_decay = 0.01, .max_grad_norm = 0.5}, 1.0, 6);

  // Updates far below bf16's resolution accumulate in the master copy while the parameter holds.
  Named params = MakeParams(at::kBFloat16, 5);
  AdamW opt(params, {.lr = 1e-6, .weight_decay = 0, .max_grad_norm = 0});
  // The master copy is taken at the first Step, so weights written after construction count.
  {
    at::NoGradGuard no_grad;
    for (auto& [name, p] : params) p.fill_(1.0);
  }
  const std::string name = params[0].first;
  EXPECT_EQ(opt.master(name).scalar_type(), at::kFloat);
  for (int step = 1; step <= 3; ++step) {
    SetGrads(params, MakeGrads(params, step, 1.0));
    opt.Step();
  }
  const at::Tensor master = opt.master(name);
  EXPECT_EQ(master.scalar_type(), at::kFloat);
  EXPECT_EQ(opt.exp_avg(name).scalar_type(), at::kFloat);
  EXPECT_FALSE(at::equal(master, at::ones_like(master)));  // ~3e-6 moved
  EXPECT_LT((master - 1.0).abs().max().item<double>(), 1e-5);
  EXPECT_TRUE(
      at::equal(params[0].second.detach(), at::ones_like(params[0].second)));  // rounds to 1
  EXPECT_TRUE(at::equal(params[0].second.detach(), master.to(at::kBFloat16)));
}

// Saves after `split` of `total` steps, loads into a fresh optimizer over fresh (zero) parameters
// built with other options, continues, and compares everything bit for bit with an uninterrupted
// run.
void ExpectResumeIsBitExact(at::ScalarType dtype) {
  const AdamWOptions options{.lr = 1e-2, .eps = 1e-3, .weight_decay = 0.05, .max_grad_norm = 0.7};
  const int total = 6, split = 3;
  Named straight = MakeParams(dtype, 11);
  AdamW a(straight, options);
  for (int step = 1; step <= total; ++step) {
    SetGrads(straight, MakeGrads(straight, step, 1.0));
    a.Step();
  }

  Named first = MakeParams(dtype, 11);
  AdamW b(first, options);
  for (int step = 1; step <= split; ++step) {
    SetGrads(first, MakeGrads(first, step, 1.0));
    b.Step();
  }
  const std::string path = TempPath(std::string("resume_") + c10::toString(dtype));
  b.SaveState(path);

  Named resumed = MakeParams(dtype, 0, /*zeros=*/true);
  AdamW c(resumed, {.lr = 5.0, .beta1 = 0.5, .weight_decay = 0, .max_grad_norm = 0});
  c.LoadState(path);
  EXPECT_EQ(c.step(), split);
  EXPECT_EQ(c.options().lr, options.lr);
  EXPECT_EQ(c.options().beta1, options.beta1);
  EXPECT_EQ(c.options().beta2, options.beta2);
  EXPECT_EQ(c.options().eps, options.eps);
  EXPECT_EQ(c.options().weight_decay, options.weight_decay);
  EXPECT_EQ(c.options().max_grad_norm, options.max_grad_norm);
  for (size_t i = 0; i < resumed.size(); ++i) {
    EXPECT_TRUE(at::equal(resumed[i].second.detach(), first[i].second.detach()))
        << resumed[i].first;
    EXPECT_TRUE(at::equal(c.master(resumed[i].first), b.master(first[i].first)))
        << resumed[i].first;
  }
  for (int step = split + 1; step <= total; ++step) {
    SetGrads(resumed, MakeGrads(resumed, step, 1.0));
    EXPECT_EQ(c.Step().step, step);
  }
  for (size_t i = 0; i < straight.size(); ++i) {
    const std::string& name = straight[i].first;
    SCOPED_TRACE(name);
    EXPECT_TRUE(at::equal(resumed[i].second.detach(), straight[i].second.detach()));
    EXPECT_TRUE(at::equal(c.master(name), a.master(name)));
    EXPECT_TRUE(at::equal(c.exp_avg(name), a.exp_avg(name)));
    EXPECT_TRUE(at::equal(c.exp_avg_sq(name), a.exp_avg_sq(name)));
  }
  std::remove(path.c_str());
}

TEST(AdamWTest, SaveLoadResumesBitExactFloat64) { ExpectResumeIsBitExact(at::kDouble); }
TEST(AdamWTest, SaveLoadResumesBitExactFloat32) { ExpectResumeIsBitExact(at::kFloat); }
TEST(AdamWTest, SaveLoadResumesBitExactBFloat16) { ExpectResumeIsBitExact(at::kBFloat16); }

TEST(AdamWTest, SaveBeforeAnyStepAndLoadRoundTrip) {
  Named params = MakeParams(at::kBFloat16, 2);
  AdamW a(params, {.lr = 0.25});
  const std::string path = TempPath("fresh");
  a.SaveState(path);
  Named other = MakeParams(at::kBFloat16, 0, /*zeros=*/true);
  AdamW b(other, {});
  b.LoadState(path);
  EXPECT_EQ(b.step(), 0);
  EXPECT_EQ(b.options().lr, 0.25);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::equal(other[i].second.detach(), params[i].second.detach()));
  }
  std::remove(path.c_str());
}

Named Shaped(const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes,
             at::ScalarType dtype = at::kFloat) {
  Named named;
  for (const auto& [name, shape] : shapes)
    named.emplace_back(name, at::ones(shape, dtype).requires_grad_(true));
  return named;
}

TEST(AdamWTest, LoadStateRejectsMismatches) {
  const std::string path = TempPath("mismatch");
  {
    Named params = Shaped({{"a", {3}}, {"b", {2, 2}}});
    AdamW opt(params, {});
    SetGrads(params, MakeGrads(params, 1, 1.0));
    opt.Step();
    opt.SaveState(path);
  }

  // A parameter the file does not have.
  Named extra = Shaped({{"a", {3}}, {"b", {2, 2}}, {"c", {1}}});
  AdamW with_extra(extra, {});
  std::string error = ErrorOf([&] { with_extra.LoadState(path); });
  EXPECT_THAT(error, HasSubstr("missing tensor 'c.exp_avg'"));
  EXPECT_THAT(error, HasSubstr(path));
  // Nothing changed.
  EXPECT_EQ(with_extra.step(), 0);
  EXPECT_TRUE(at::equal(extra[0].second.detach(), at::ones({3})));

  // Another shape.
  Named reshaped = Shaped({{"a", {4}}, {"b", {2, 2}}});
  AdamW with_reshaped(reshaped, {});
  error = ErrorOf([&] { with_reshaped.LoadState(path); });
  EXPECT_THAT(error, HasSubstr("tensor 'a.exp_avg' has shape [3] but parameter 'a' has shape [4]"));
  EXPECT_THAT(error, HasSubstr(path));

  // A tensor of a parameter this optimizer lacks.
  Named fewer = Shaped({{"a", {3}}});
  AdamW with_fewer(fewer, {});
  error = ErrorOf([&] { with_fewer.LoadState(path); });
  EXPECT_THAT(error, HasSubstr("tensor 'b.exp_avg' belongs to no parameter"));
  EXPECT_THAT(error, HasSubstr(path));

  // Another state dtype (float64 parameters keep float64 state).
  Named doubles = Shaped({{"a", {3}}, {"b", {2, 2}}}, at::kDouble);
  AdamW with_doubles(doubles, {});
  error = ErrorOf([&] { with_doubles.LoadState(path); });
  EXPECT_THAT(error, HasSubstr("tensor 'a.exp_avg' has dtype F32, expected F64"));

  // No file.
  AdamW any(Shaped({{"a", {3}}}), {});
  const std::string missing = TempPath("does_not_exist");
  error = ErrorOf([&] { any.LoadState(missing); });
  EXPECT_THAT(error, HasSubstr(missing));
  std::remove(path.c_str());
}

TEST(AdamWTest, NonFiniteGradNamesTheParameterAndUpdatesNothing) {
  Named params = MakeParams(at::kBFloat16, 4);
  AdamW opt(params, {.lr = 1e-2});
  SetGrads(params, MakeGrads(params, 1, 1.0));
  opt.Step();

  std::vector<at::Tensor> values, masters, m, v;
  for (const auto& [name, p] : params) {
    values.push_back(p.detach().clone());
    masters.push_back(opt.master(name).clone());
    m.push_back(opt.exp_avg(name).clone());
    v.push_back(opt.exp_avg_sq(name).clone());
  }
  for (const double bad : {std::nan(""), double{INFINITY}, -double{INFINITY}}) {
    std::vector<at::Tensor> grads = MakeGrads(params, 2, 1.0);
    grads[1][3] = bad;
    SetGrads(params, grads);
    const std::string error = ErrorOf([&] { opt.Step(); });
    EXPECT_THAT(error, HasSubstr("parameter 'model.layers.0.mlp.up_proj.bias'")) << bad;
    EXPECT_THAT(error, HasSubstr("not finite")) << bad;
    // Skipping instead: the same nothing-updated, reported rather than raised.
    const StepStats skipped = opt.Step(NonFiniteGradients::kSkip);
    EXPECT_TRUE(skipped.skipped) << bad;
    EXPECT_FALSE(std::isfinite(skipped.grad_norm)) << bad;
    EXPECT_EQ(skipped.step, 1) << bad;
    EXPECT_EQ(skipped.lr, 1e-2) << bad;
  }
  EXPECT_EQ(opt.step(), 1);
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params[i].first;
    EXPECT_TRUE(at::equal(params[i].second.detach(), values[i])) << name;
    EXPECT_TRUE(at::equal(opt.master(name), masters[i])) << name;
    EXPECT_TRUE(at::equal(opt.exp_avg(name), m[i])) << name;
    EXPECT_TRUE(at::equal(opt.exp_avg_sq(name), v[i])) << name;
  }
}

TEST(AdamWTest, AFiniteStepAfterASkippedOneIsTheStepThatWouldHaveBeenTaken) {
  Named skipping = MakeParams(at::kBFloat16, 4);
  Named straight = MakeParams(at::kBFloat16, 4);
  AdamW a(skipping, {.lr = 1e-2, .max_grad_norm = 0.5});
  AdamW b(straight, {.lr = 1e-2, .max_grad_norm = 0.5});
  std::vector<at::Tensor> poisoned = MakeGrads(skipping, 1, 1.0);
  poisoned[0][0] = std::nan("");
  SetGrads(skipping, poisoned);
  EXPECT_TRUE(a.Step(NonFiniteGradients::kSkip).skipped);
  for (auto [named, opt] : {std::pair{&skipping, &a}, std::pair{&straight, &b}}) {
    SetGrads(*named, MakeGrads(*named, 1, 1.0));
    const StepStats stats = opt->Step(NonFiniteGradients::kSkip);
    EXPECT_FALSE(stats.skipped);
    EXPECT_EQ(stats.step, 1);
  }
  for (size_t i = 0; i < skipping.size(); ++i) {
    const std::string& name = skipping[i].first;
    EXPECT_TRUE(at::equal(skipping[i].second.detach(), straight[i].second.detach())) << name;
    EXPECT_TRUE(at::equal(a.exp_avg_sq(name), b.exp_avg_sq(name))) << name;
  }
}

TEST(AdamWTest, ResetMasterFromParametersFollowsWeightsWrittenIntoTheModel) {
  Named params = MakeParams(at::kBFloat16, 6);
  AdamW opt(params, {.lr = 1e-2});
  SetGrads(params, MakeGrads(params, 1, 1.0));
  opt.Step();  // the float32 master copies exist from here on
  const std::string name = params[2].first;
  const at::Tensor moments = opt.exp_avg(name).clone();
  {
    at::NoGradGuard no_grad;
    for (auto& [n, p] : params) p.fill_(0.375);  // e.g. a checkpoint loaded into the live model
  }
  EXPECT_FALSE(at::equal(opt.master(name), at::full_like(opt.master(name), 0.375)));
  opt.ResetMasterFromParameters();
  EXPECT_TRUE(at::equal(opt.master(name), at::full_like(opt.master(name), 0.375)));
  EXPECT_TRUE(at::equal(opt.exp_avg(name), moments));  // the moments and the count stay
  EXPECT_EQ(opt.step(), 1);
  // Without the reset the next step would have written the old weights back.
  SetGrads(params, MakeGrads(params, 2, 1.0));
  opt.Step();
  EXPECT_LT((params[2].second.detach().to(at::kFloat) - 0.375).abs().max().item<double>(), 0.05);
}

TEST(AdamWTest, ZeroGrad) {
  Named params = MakeParams(at::kFloat, 6);
  AdamW opt(params, {});
  SetGrads(params, MakeGrads(params, 1, 1.0));
  const void* data = params[0].second.grad().data_ptr();
  opt.ZeroGrad();
  for (const auto& [name, p] : params) {
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_TRUE(at::equal(p.grad(), at::zeros_like(p))) << name;
  }
  EXPECT_EQ(params[0].second.grad().data_ptr(), data);  // in place
  opt.ZeroGrad(/*set_to_none=*/true);
  for (const auto& [name, p] : params) EXPECT_FALSE(p.grad().defined()) << name;
  // A step with no grads changes nothing but the count.
  const at::Tensor before = params[0].second.detach().clone();
  const StepStats stats = opt.Step();
  EXPECT_EQ(stats.step, 1);
  EXPECT_EQ(stats.grad_norm, 0.0);
  EXPECT_TRUE(at::equal(params[0].second.detach(), before));
}

TEST(AdamWTest, ConstructorAndOptionErrors) {
  EXPECT_THAT(ErrorOf([] {
                AdamW(Shaped({{"a", {2}}, {"a", {3}}}), {});
              }),
              HasSubstr("'a' appears twice"));
  EXPECT_THAT(ErrorOf([] {
                AdamW({{"ids", at::zeros({2}, at::kLong)}}, {});
              }),
              HasSubstr("'ids' has dtype"));
  EXPECT_THAT(ErrorOf([] { AdamW(Shaped({{"a", {2}}}), {.beta2 = 1.0}); }), HasSubstr("beta2"));
  EXPECT_THAT(ErrorOf([] { AdamW(Shaped({{"a", {2}}}), {.lr = -1}); }), HasSubstr("lr"));
  at::Tensor t = at::ones({2}).requires_grad_(true);
  EXPECT_THAT(ErrorOf([&] {
                AdamW({{"x", t}, {"y", t}}, {});
              }),
              HasSubstr("'y' is the same tensor"));
  AdamW opt(Shaped({{"a", {2}}}), {});
  opt.set_lr(0.5);
  EXPECT_EQ(opt.options().lr, 0.5);
  EXPECT_THAT(ErrorOf([&] { opt.set_lr(NAN); }), HasSubstr("lr"));
  EXPECT_THAT(ErrorOf([&] { opt.master("nope"); }), HasSubstr("'nope'"));
}

}  // namespace
}  // namespace dta

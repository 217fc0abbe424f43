#include "executor/loss/loss.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

using ::testing::HasSubstr;
using Vec = std::vector<double>;

constexpr double kH = 1e-6;  // finite-difference step

at::Tensor T(const Vec& v, at::ScalarType dtype = at::kDouble) {
  return at::from_blob(const_cast<double*>(v.data()), {static_cast<int64_t>(v.size())}, at::kDouble)
      .to(dtype, /*non_blocking=*/false, /*copy=*/true);
}

Vec V(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kDouble).contiguous();
  return Vec(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

std::vector<float> F(const Vec& v) { return std::vector<float>(v.begin(), v.end()); }

// A rollout whose behaviour log-probabilities (and reference ones) are exactly representable in
// float, so that the double reference below sees the same numbers as the loss.
Rollout MakeRollout(std::string id, std::vector<uint8_t> mask, const Vec& behave,
                    const Vec& ref = {}) {
  Rollout r;
  r.id = std::move(id);
  r.group = "g";
  r.loss_mask = std::move(mask);
  for (size_t t = 0; t < r.loss_mask.size(); ++t) r.tokens.push_back(static_cast<TokenId>(t + 3));
  r.logprobs = F(behave);
  r.ref_logprobs = F(ref);
  return r;
}

Vec AsDouble(const std::vector<float>& v) { return Vec(v.begin(), v.end()); }

// ---------------------------------------------------------------------------------------------
// Independent reference in plain doubles.

double RefSurrogate(double ratio, double a, const LossOptions& o) {
  const double clipped = std::min(std::max(ratio, 1 - o.eps_clip_low), 1 + o.eps_clip_high);
  double l = std::max(-a * ratio, -a * clipped);
  if (o.dual_clip > 1 && a < 0) l = std::min(l, -o.dual_clip * a);
  return l;
}

struct RefCase {
  const Rollout* rollout;
  Vec lp;    // current policy
  Vec ent;   // empty: none
  Vec prox;  // empty: none
  std::vector<float> adv;
};

double RefLoss(const RefCase& c, const LossOptions& o, const BatchLossContext& b) {
  const Rollout& r = *c.rollout;
  const Vec old = AsDouble(r.logprobs);
  const Vec ref = AsDouble(r.ref_logprobs);
  const size_t n = r.tokens.size();
  double m_count = 0;
  int first = -1;
  for (size_t t = 0; t < n; ++t) {
    if (!r.loss_mask[t]) continue;
    if (first < 0) first = static_cast<int>(t);
    m_count += 1;
  }
  if (m_count == 0) return 0;
  double token_sum = 0;
  double seq = 0;
  for (size_t t = 0; t < n; ++t) {
    if (!r.loss_mask[t]) continue;
    double l = 0;
    switch (o.kind) {
      case LossKind::kSft:
        l = -c.lp[t];
        break;
      case LossKind::kPpo:
        l = RefSurrogate(std::exp(c.lp[t] - old[t]), c.adv[t], o);
        break;
      case LossKind::kDecoupledPpo: {
        const double w = std::exp(c.prox[t] - old[t]);
        l = (o.behave_imp_weight_cap > 0 && w > o.behave_imp_weight_cap)
                ? 0.0
                : RefSurrogate(std::exp(c.lp[t] - c.prox[t]), c.adv[t], o) * w;
        break;
      }
      case LossKind::kGspo:
        l = 0;
        break;
    }
    if (o.entropy_coef != 0) l -= o.entropy_coef * c.ent[t];
    if (o.kl_coef != 0) {
      const double d = ref[t] - c.lp[t];
      l += o.kl_coef * (std::exp(d) - d - 1);
    }
    token_sum += l;
  }
  if (o.kind == LossKind::kGspo) {
    double mean = 0;
    for (size_t t = 0; t < n; ++t) {
      if (r.loss_mask[t]) mean += c.lp[t] - old[t];
    }
    mean /= m_count;
    const double s = std::exp(mean);
    const double a = c.adv[first];
    const double clipped = std::min(std::max(s, 1 - o.gspo_eps_low), 1 + o.gspo_eps_high);
    seq = std::max(-a * s, -a * clipped);
    if (o.normalization != Normalization::kSum) seq /= static_cast<double>(b.num_rollouts);
  }
  switch (o.normalization) {
    case Normalization::kTokenMean:
      token_sum /= b.total_loss_tokens;
      break;
    case Normalization::kSequenceMean:
      token_sum /= m_count * b.num_rollouts;
      break;
    case Normalization::kSum:
      break;
  }
  return token_sum + seq;
}

RolloutLossInputs Inputs(const RefCase& c, at::ScalarType dtype = at::kDouble) {
  RolloutLossInputs in;
  in.rollout = c.rollout;
  in.logprobs = T(c.lp, dtype).requires_grad_(true);
  if (!c.ent.empty()) in.entropy = T(c.ent, dtype).requires_grad_(true);
  if (!c.prox.empty()) in.proximal_logprobs = T(c.prox, dtype);
  in.advantages = &c.adv;
  return in;
}

double LossValue(const RolloutLossInputs& in, const LossOptions& o, const BatchLossContext& b) {
  at::NoGradGuard no_grad;
  return RolloutLoss(in, o, b).item<double>();
}

// Central differences of the loss in each coordinate of `field` (logprobs or entropy).
Vec FiniteDifferences(const RefCase& c, bool entropy, const LossOptions& o,
                      const BatchLossContext& b) {
  Vec grad;
  const Vec& x = entropy ? c.ent : c.lp;
  for (size_t i = 0; i < x.size(); ++i) {
    RefCase plus = c, minus = c;
    (entropy ? plus.ent : plus.lp)[i] += kH;
    (entropy ? minus.ent : minus.lp)[i] -= kH;
    grad.push_back((LossValue(Inputs(plus), o, b) - LossValue(Inputs(minus), o, b)) / (2 * kH));
  }
  return grad;
}

void ExpectGradNear(const Vec& got, const Vec& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 1e-6 * std::abs(want[i]) + 1e-8) << what << " position " << i;
  }
}

// Loss value against the reference (1e-12), gradients against finite differences; returns the
// gradients for further analytic checks.
RolloutLossGrad CheckCase(const RefCase& c, const LossOptions& o, const BatchLossContext& b,
                          const std::string& what) {
  RolloutLossGrad g = RolloutLossAndGrad(Inputs(c), o, b);
  EXPECT_NEAR(g.loss.item<double>(), RefLoss(c, o, b), 1e-12) << what;
  EXPECT_NEAR(LossValue(Inputs(c), o, b), g.loss.item<double>(), 1e-15) << what;
  ExpectGradNear(V(g.dlogprobs), FiniteDifferences(c, false, o, b), what + " dlogprobs");
  if (!c.ent.empty()) {
    ExpectGradNear(V(g.dentropy), FiniteDifferences(c, true, o, b), what + " dentropy");
  }
  return g;
}

// ---------------------------------------------------------------------------------------------
// A PPO rollout covering every clip region. Position 0 is the dummy (and its behaviour logprob is
// extreme), position 4 is masked with an extreme current logprob: neither may leak into the loss.

struct PpoFixture {
  Rollout rollout;
  RefCase c;
  // Per position: ratio r_t = exp(lp - old) and advantage; eps 0.2, dual clip 1.4.
  //  t  ratio  A     region (no dual)            with dual clip 1.4
  //  1  1.1    0.8   inside                      inside
  //  2  1.5   -0.5   A<0, above: unclipped       -A r = 0.75 > 0.7: dual cap, no gradient
  //  3  0.6    1.3   A>0, below: unclipped       unclipped
  //  5  0.9   -1.1   inside                      inside
  //  6  1.25   0.4   A>0, above: clipped         clipped
  //  7  0.5   -1.0   A<0, below: clipped         clipped
  //  8  1.3   -0.7   A<0, above: unclipped       -A r = 0.91 < 0.98: unclipped
  Vec ratio = {1, 1.1, 1.5, 0.6, 1, 0.9, 1.25, 0.5, 1.3};
  std::vector<float> adv = {0, 0.8f, -0.5f, 1.3f, 2.0f, -1.1f, 0.4f, -1.0f, -0.7f};

  PpoFixture() {
    const Vec old = {-100, -1.25, -0.75, -2.0, -0.25, -1.5, -0.875, -3.0, -0.5};
    rollout = MakeRollout("ppo-1", {0, 1, 1, 1, 0, 1, 1, 1, 1}, old,
                          {0, -1.0, -0.5, -2.5, -0.125, -1.25, -1.0, -2.75, -0.625});
    c.rollout = &rollout;
    c.adv = adv;
    for (size_t t = 0; t < old.size(); ++t) c.lp.push_back(old[t] + std::log(ratio[t]));
    c.lp[0] = 0;   // the executor's dummy
    c.lp[4] = 50;  // masked, extreme
    c.ent = {0, 0.5, 1.25, 0.75, 9, 2.0, 0.25, 1.5, 1.0};
  }
};

TEST(LossTest, MakeBatchContextCountsLossTokensAndRollouts) {
  std::vector<Rollout> rollouts = {MakeRollout("a", {0, 1, 1, 0}, {0, 0, 0, 0}),
                                   MakeRollout("b", {0, 0}, {0, 0}),
                                   MakeRollout("c", {0, 1, 1, 1, 1}, {0, 0, 0, 0, 0})};
  BatchLossContext b = MakeBatchContext(rollouts);
  EXPECT_EQ(b.total_loss_tokens, 6);
  EXPECT_EQ(b.num_rollouts, 3);
}

TEST(LossTest, SftMatchesReferenceAndAnalyticGradient) {
  PpoFixture f;
  const BatchLossContext b{.total_loss_tokens = 17, .num_rollouts = 3};
  for (Normalization norm :
       {Normalization::kTokenMean, Normalization::kSequenceMean, Normalization::kSum}) {
    LossOptions o{.kind = LossKind::kSft, .normalization = norm};
    RolloutLossInputs in = Inputs(f.c);
    in.advantages = nullptr;  // SFT needs none
    RolloutLossGrad g = RolloutLossAndGrad(in, o, b);
    EXPECT_NEAR(g.loss.item<double>(), RefLoss(f.c, o, b), 1e-12);
    const double normaliser = norm == Normalization::kTokenMean      ? 17.0
                              : norm == Normalization::kSequenceMean ? 7.0 * 3
                                                                     : 1.0;
    Vec want;
    for (uint8_t m : f.rollout.loss_mask) want.push_back(-m / normaliser);
    ExpectGradNear(V(g.dlogprobs), want, "sft analytic");
    CheckCase(f.c, o, b, "sft");
  }
}

TEST(LossTest, PpoClipRegionsMatchReferenceAndAnalyticGradient) {
  PpoFixture f;
  const BatchLossContext b{.total_loss_tokens = 20, .num_rollouts = 2};
  for (double dual : {0.0, 1.4}) {
    LossOptions o{.kind = LossKind::kPpo, .dual_clip = dual};
    RolloutLossGrad g = CheckCase(f.c, o, b, dual > 0 ? "ppo dual" : "ppo");
    // d/dlp of -A r is -A r; clipped or dual-capped tokens have no gradient.
    std::vector<bool> live = {false, true, dual == 0, true, false, true, false, false, true};
    Vec want;
    for (size_t t = 0; t < live.size(); ++t) {
      want.push_back(live[t] ? -f.adv[t] * f.ratio[t] / 20.0 : 0.0);
    }
    ExpectGradNear(V(g.dlogprobs), want, "ppo analytic");
  }
}

TEST(LossTest, PpoAsymmetricClipAndEveryNormalization) {
  PpoFixture f;
  const BatchLossContext b{.total_loss_tokens = 11, .num_rollouts = 4};
  for (Normalization norm :
       {Normalization::kTokenMean, Normalization::kSequenceMean, Normalization::kSum}) {
    LossOptions o{.kind = LossKind::kPpo,
                  .normalization = norm,
                  .eps_clip_low = 0.15,
                  .eps_clip_high = 0.28,
                  .dual_clip = 3.0};
    CheckCase(f.c, o, b, "ppo asymmetric");
  }
}

TEST(LossTest, EntropyAndKlTerms) {
  PpoFixture f;
  const BatchLossContext b{.total_loss_tokens = 9, .num_rollouts = 2};
  for (LossKind kind : {LossKind::kSft, LossKind::kPpo, LossKind::kGspo}) {
    for (Normalization norm :
         {Normalization::kTokenMean, Normalization::kSequenceMean, Normalization::kSum}) {
      LossOptions o{.kind = kind, .normalization = norm, .entropy_coef = 0.01, .kl_coef = 0.05};
      RolloutLossGrad g = CheckCase(f.c, o, b, "entropy+kl");
      const double normaliser = norm == Normalization::kTokenMean      ? 9.0
                                : norm == Normalization::kSequenceMean ? 7.0 * 2
                                                                       : 1.0;
      Vec want;
      for (uint8_t m : f.rollout.loss_mask) want.push_back(-0.01 * m / normaliser);
      ExpectGradNear(V(g.dentropy), want, "dentropy analytic");
    }
  }
  // KL alone (SFT part removed by comparing with and without): d k3 / d lp = 1 - exp(ref - lp).
  LossOptions with_kl{.kind = LossKind::kSft, .normalization = Normalization::kSum, .kl_coef = 1};
  LossOptions without{.kind = LossKind::kSft, .normalization = Normalization::kSum};
  const Vec d1 = V(RolloutLossAndGrad(Inputs(f.c), with_kl, b).dlogprobs);
  const Vec d0 = V(RolloutLossAndGrad(Inputs(f.c), without, b).dlogprobs);
  for (size_t t = 0; t < d1.size(); ++t) {
    const double want =
        f.rollout.loss_mask[t] ? 1 - std::exp(f.rollout.ref_logprobs[t] - f.c.lp[t]) : 0.0;
    EXPECT_NEAR(d1[t] - d0[t], want, 1e-12) << t;
  }
  // Entropy given but unused: zero gradient, not an error.
  LossOptions plain{.kind = LossKind::kPpo};
  RolloutLossGrad g = RolloutLossAndGrad(Inputs(f.c), plain, b);
  ASSERT_TRUE(g.dentropy.defined());
  EXPECT_EQ(at::count_nonzero(g.dentropy).item<int64_t>(), 0);
}

TEST(LossTest, DecoupledPpoBehaviourWeightAndCap) {
  PpoFixture f;
  const Vec old = AsDouble(f.rollout.logprobs);
  // pi_prox / pi_behave per position; 2.5 and 3.0 exceed the cap 2.
  const Vec w = {1, 1.0, 0.5, 2.5, 1, 1.2, 0.8, 3.0, 1.1};
  RefCase c = f.c;
  c.prox.resize(old.size());
  for (size_t t = 0; t < old.size(); ++t) {
    c.prox[t] = old[t] + std::log(w[t]);
    c.lp[t] = c.prox[t] + std::log(f.ratio[t]);
  }
  c.lp[0] = 0;
  c.lp[4] = 50;
  c.prox[0] = 0;
  const BatchLossContext b{.total_loss_tokens = 7, .num_rollouts = 1};
  for (double cap : {0.0, 2.0}) {
    for (Normalization norm :
         {Normalization::kTokenMean, Normalization::kSequenceMean, Normalization::kSum}) {
      LossOptions o{
          .kind = LossKind::kDecoupledPpo, .normalization = norm, .behave_imp_weight_cap = cap};
      CheckCase(c, o, b, cap > 0 ? "decoupled cap" : "decoupled");
    }
    LossOptions o{.kind = LossKind::kDecoupledPpo, .behave_imp_weight_cap = cap};
    const Vec g = V(RolloutLossAndGrad(Inputs(c), o, b).dlogprobs);
    std::vector<bool> live = {false, true, true, cap == 0, false, true, false, false, true};
    for (size_t t = 0; t < g.size(); ++t) {
      const double want = live[t] ? -f.adv[t] * f.ratio[t] * w[t] / 7.0 : 0.0;
      EXPECT_NEAR(g[t], want, 1e-12) << "cap " << cap << " position " << t;
    }
  }
  // The cap masks the loss too: with cap 2 the capped tokens (3 and 7) contribute nothing.
  LossOptions capped{.kind = LossKind::kDecoupledPpo,
                     .normalization = Normalization::kSum,
                     .behave_imp_weight_cap = 2.0};
  LossOptions uncapped{.kind = LossKind::kDecoupledPpo, .normalization = Normalization::kSum};
  const double diff = LossValue(Inputs(c), uncapped, b) - LossValue(Inputs(c), capped, b);
  const double want = RefSurrogate(f.ratio[3], f.adv[3], uncapped) * w[3] +
                      RefSurrogate(f.ratio[7], f.adv[7], uncapped) * w[7];
  EXPECT_NEAR(diff, want, 1e-12);
}

TEST(LossTest, DecoupledPpoWithProximalEqualBehaviourIsPpo) {
  PpoFixture f;
  RefCase c = f.c;
  c.prox = AsDouble(f.rollout.logprobs);
  const BatchLossContext b{.total_loss_tokens = 7, .num_rollouts = 1};
  LossOptions ppo{.kind = LossKind::kPpo, .dual_clip = 1.4};
  LossOptions decoupled = ppo;
  decoupled.kind = LossKind::kDecoupledPpo;
  RolloutLossGrad a = RolloutLossAndGrad(Inputs(c), ppo, b);
  RolloutLossGrad d = RolloutLossAndGrad(Inputs(c), decoupled, b);
  EXPECT_NEAR(a.loss.item<double>(), d.loss.item<double>(), 1e-14);
  ExpectGradNear(V(d.dlogprobs), V(a.dlogprobs), "decoupled == ppo");
}

struct GspoFixture {
  Rollout rollout;
  RefCase c;
  explicit GspoFixture(const Vec& log_ratio, float adv) {
    const Vec old = {0, -1.5, -0.25, -2.0, -0.75, -1.0};
    rollout = MakeRollout("gspo-1", {0, 1, 1, 1, 1, 0}, old);
    c.rollout = &rollout;
    c.adv.assign(old.size(), adv);
    for (size_t t = 0; t < old.size(); ++t) c.lp.push_back(old[t] + log_ratio[t]);
  }
};

TEST(LossTest, GspoSequenceRatioInsideClip) {
  // Mean log-ratio over the 4 loss tokens = 1e-4: s inside [1 - 3e-4, 1 + 4e-4].
  const Vec log_ratio = {0, 2e-4, -1e-4, 3e-4, 0, 7.0};
  const BatchLossContext b{.total_loss_tokens = 12, .num_rollouts = 3};
  for (float adv : {0.7f, -0.7f}) {
    GspoFixture f(log_ratio, adv);
    for (Normalization norm :
         {Normalization::kTokenMean, Normalization::kSequenceMean, Normalization::kSum}) {
      LossOptions o{.kind = LossKind::kGspo, .normalization = norm};
      RolloutLossGrad g = CheckCase(f.c, o, b, "gspo inside");
      const double s = std::exp(1e-4);
      const double r = norm == Normalization::kSum ? 1.0 : 3.0;
      Vec want;
      for (uint8_t m : f.rollout.loss_mask) want.push_back(m ? -adv * s / 4.0 / r : 0.0);
      ExpectGradNear(V(g.dlogprobs), want, "gspo analytic");
    }
  }
}

TEST(LossTest, GspoSequenceRatioClipRegions) {
  const BatchLossContext b{.total_loss_tokens = 12, .num_rollouts = 2};
  LossOptions o{.kind = LossKind::kGspo};
  struct Case {
    double log_ratio;
    float adv;
    bool clipped;
  };
  for (Case k : {Case{0.01, 0.5f, true}, Case{0.01, -0.5f, false}, Case{-0.01, -0.5f, true},
                 Case{-0.01, 0.5f, false}}) {
    GspoFixture f({0, k.log_ratio, k.log_ratio, k.log_ratio, k.log_ratio, 0}, k.adv);
    RolloutLossGrad g = CheckCase(f.c, o, b, "gspo clip");
    const double s = std::exp(k.log_ratio);
    for (size_t t = 0; t < f.rollout.loss_mask.size(); ++t) {
      const double want = f.rollout.loss_mask[t] && !k.clipped ? -k.adv * s / 4.0 / 2.0 : 0.0;
      EXPECT_NEAR(V(g.dlogprobs)[t], want, 1e-12) << k.log_ratio << " " << k.adv << " " << t;
    }
  }
}

TEST(LossTest, TokenMeanSumOverRolloutsEqualsTokenMeanOfConcatenation) {
  std::vector<Rollout> rollouts = {
      MakeRollout("c0", {0, 1, 1, 0, 1}, {-0.5, -1.0, -0.25, -2.0, -0.75}),
      MakeRollout("c1", {0, 0, 1}, {-1.0, -0.5, -1.5}),
      MakeRollout("c2", {0, 1, 1, 1, 1, 1}, {-2.0, -0.125, -1.0, -0.5, -3.0, -0.25})};
  const std::vector<Vec> lps = {
      {0, -0.9, -0.3, -1.0, -0.95}, {0, -0.2, -1.2}, {0, -0.1, -1.4, -0.45, -2.5, -0.3}};
  const std::vector<std::vector<float>> advs = {
      {0, 1.5f, -0.5f, 2.0f, 0.25f}, {0, 0, -1.0f}, {0, 0.5f, 0.5f, -2.0f, 1.0f, -0.75f}};
  Rollout all;
  all.id = "concat";
  Vec all_lp;
  std::vector<float> all_adv;
  for (size_t i = 0; i < rollouts.size(); ++i) {
    const Rollout& r = rollouts[i];
    all.tokens.insert(all.tokens.end(), r.tokens.begin(), r.tokens.end());
    all.loss_mask.insert(all.loss_mask.end(), r.loss_mask.begin(), r.loss_mask.end());
    all.logprobs.insert(all.logprobs.end(), r.logprobs.begin(), r.logprobs.end());
    all_lp.insert(all_lp.end(), lps[i].begin(), lps[i].end());
    all_adv.insert(all_adv.end(), advs[i].begin(), advs[i].end());
  }
  const BatchLossContext b = MakeBatchContext(rollouts);
  const BatchLossContext b_all = MakeBatchContext({&all, 1});
  ASSERT_EQ(b.total_loss_tokens, b_all.total_loss_tokens);
  for (LossKind kind : {LossKind::kSft, LossKind::kPpo}) {
    LossOptions o{.kind = kind, .eps_clip_low = 0.2, .eps_clip_high = 0.2, .dual_clip = 2.0};
    double sum = 0;
    Vec grads;
    for (size_t i = 0; i < rollouts.size(); ++i) {
      RolloutLossGrad g = RolloutLossAndGrad(
          {.rollout = &rollouts[i], .logprobs = T(lps[i]), .advantages = &advs[i]}, o, b);
      sum += g.loss.item<double>();
      for (double v : V(g.dlogprobs)) grads.push_back(v);
    }
    RolloutLossGrad whole = RolloutLossAndGrad(
        {.rollout = &all, .logprobs = T(all_lp), .advantages = &all_adv}, o, b_all);
    EXPECT_NEAR(sum, whole.loss.item<double>(), 1e-12);
    ExpectGradNear(grads, V(whole.dlogprobs), "concatenation");
  }
}

TEST(LossTest, RolloutWithoutLossTokensContributesZero) {
  Rollout r = MakeRollout("empty", {0, 0, 0}, {-1, -2, -3}, {-1, -1, -1});
  const std::vector<float> adv = {1, 1, 1};
  for (LossKind kind : {LossKind::kSft, LossKind::kPpo, LossKind::kDecoupledPpo, LossKind::kGspo}) {
    for (Normalization norm :
         {Normalization::kTokenMean, Normalization::kSequenceMean, Normalization::kSum}) {
      LossOptions o{.kind = kind, .normalization = norm, .entropy_coef = 0.1, .kl_coef = 0.1};
      RolloutLossInputs in{.rollout = &r,
                           .logprobs = T({0, -0.5, -0.25}).requires_grad_(true),
                           .entropy = T({1, 1, 1}).requires_grad_(true),
                           .proximal_logprobs = T({0, -1, -1}),
                           .advantages = &adv};
      const BatchLossContext empty_batch{.total_loss_tokens = 0, .num_rollouts = 0};
      at::Tensor loss = RolloutLoss(in, o, empty_batch);
      EXPECT_TRUE(loss.requires_grad());
      EXPECT_EQ(loss.item<double>(), 0.0);
      RolloutLossGrad g = RolloutLossAndGrad(in, o, empty_batch);
      EXPECT_EQ(g.loss.item<double>(), 0.0);
      EXPECT_EQ(at::count_nonzero(g.dlogprobs).item<int64_t>(), 0);
      EXPECT_EQ(at::count_nonzero(g.dentropy).item<int64_t>(), 0);
    }
  }
}

TEST(LossTest, RolloutLossBackwardMatchesRolloutLossAndGrad) {
  PpoFixture f;
  const BatchLossContext b{.total_loss_tokens = 10, .num_rollouts = 2};
  LossOptions o{.kind = LossKind::kPpo, .entropy_coef = 0.02, .kl_coef = 0.1};
  RolloutLossInputs in = Inputs(f.c);
  at::Tensor loss = RolloutLoss(in, o, b);
  EXPECT_EQ(loss.dim(), 0);
  EXPECT_EQ(loss.scalar_type(), at::kDouble);
  loss.backward();
  RolloutLossGrad g;
  {
    at::NoGradGuard no_grad;  // RolloutLossAndGrad works under no-grad too
    g = RolloutLossAndGrad(in, o, b);
  }
  EXPECT_NEAR(loss.item<double>(), g.loss.item<double>(), 1e-15);
  ExpectGradNear(V(in.logprobs.grad()), V(g.dlogprobs), "backward logprobs");
  ExpectGradNear(V(in.entropy.grad()), V(g.dentropy), "backward entropy");
}

TEST(LossTest, Float32WithExtremeMaskedValuesStaysFinite) {
  PpoFixture f;  // old[0] = -100 and lp[4] = 50: exp overflows float32 if not masked first
  const BatchLossContext b{.total_loss_tokens = 7, .num_rollouts = 1};
  for (LossKind kind : {LossKind::kSft, LossKind::kPpo, LossKind::kDecoupledPpo, LossKind::kGspo}) {
    RefCase c = f.c;
    c.prox = AsDouble(f.rollout.logprobs);
    LossOptions o{.kind = kind, .entropy_coef = 0.01, .kl_coef = 0.05};
    RolloutLossGrad g = RolloutLossAndGrad(Inputs(c, at::kFloat), o, b);
    EXPECT_EQ(g.dlogprobs.scalar_type(), at::kFloat);
    const double want = RefLoss(c, o, b);
    EXPECT_NEAR(g.loss.item<double>(), want, 1e-5 * std::max(1.0, std::abs(want)));
    EXPECT_TRUE(at::isfinite(g.dlogprobs).all().item<bool>());
    const Vec d = V(g.dlogprobs);
    const Vec d64 = V(RolloutLossAndGrad(Inputs(c), o, b).dlogprobs);
    for (size_t t = 0; t < d.size(); ++t) {
      if (!f.rollout.loss_mask[t]) {
        EXPECT_EQ(d[t], 0.0) << t;
      }
      EXPECT_NEAR(d[t], d64[t], 1e-5) << t;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// GRPO advantages.

Rollout Rewarded(std::string id, std::string group, double reward, size_t length = 3) {
  Rollout r = MakeRollout(std::move(id), std::vector<uint8_t>(length, 1), Vec(length, -1.0));
  r.loss_mask[0] = 0;
  r.group = std::move(group);
  r.reward = reward;
  return r;
}

void ExpectBroadcast(const std::vector<float>& adv, size_t length, double value) {
  ASSERT_EQ(adv.size(), length);
  for (float a : adv) EXPECT_EQ(a, static_cast<float>(value));
}

TEST(LossTest, GrpoAdvantagesPerGroupAcrossBatchOrder) {
  Rollout keeps = MakeRollout("own", {0, 1}, {-1, -1});
  keeps.group = "a";
  keeps.advantages = {0.0f, 0.25f};
  std::vector<Rollout> rollouts = {Rewarded("a1", "a", 1.0, 4),
                                   Rewarded("b1", "b", 0.1),
                                   Rewarded("a2", "a", 0.0),
                                   Rewarded("b2", "b", 0.1, 5),
                                   keeps,
                                   Rewarded("a3", "a", 1.0),
                                   Rewarded("c1", "c", 5.0),
                                   Rewarded("b3", "b", 0.1)};
  const double mean = 2.0 / 3.0;
  const double std = std::sqrt(((1 - mean) * (1 - mean) * 2 + mean * mean) / 2.0);
  std::vector<std::vector<float>> adv = ComputeAdvantages(rollouts);
  ASSERT_EQ(adv.size(), rollouts.size());
  ExpectBroadcast(adv[0], 4, (1 - mean) / (std + 1e-6));
  ExpectBroadcast(adv[2], 3, (0 - mean) / (std + 1e-6));
  ExpectBroadcast(adv[5], 3, (1 - mean) / (std + 1e-6));
  // Equal rewards (std 0): exactly 0, no NaN, even for 0.1 whose float mean is inexact.
  ExpectBroadcast(adv[1], 3, 0.0);
  ExpectBroadcast(adv[3], 5, 0.0);
  ExpectBroadcast(adv[7], 3, 0.0);
  ExpectBroadcast(adv[6], 3, 0.0);  // a group of one
  EXPECT_EQ(adv[4], keeps.advantages);

  std::vector<std::vector<float>> centred =
      ComputeAdvantages(rollouts, {.std_level = AdvantageLevel::kNone});
  ExpectBroadcast(centred[0], 4, 1 - mean);
  ExpectBroadcast(centred[2], 3, -mean);
  ExpectBroadcast(centred[1], 3, 0.0);
}

TEST(LossTest, GrpoRewardOfRolloutWithOwnAdvantagesCountsInItsGroup) {
  Rollout both = Rewarded("e1", "e", 1.0);
  both.advantages = {0, 9, 9};
  std::vector<Rollout> rollouts = {both, Rewarded("e2", "e", 0.0)};
  std::vector<std::vector<float>> adv = ComputeAdvantages(rollouts);
  EXPECT_EQ(adv[0], both.advantages);
  ExpectBroadcast(adv[1], 3, -0.5 / (std::sqrt(0.5) + 1e-6));
}

// ---------------------------------------------------------------------------------------------
// Errors name the rollout and the field.

void ExpectError(const std::function<void()>& f, std::initializer_list<const char*> parts) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    for (const char* part : parts) EXPECT_THAT(message, HasSubstr(part));
  }
}

TEST(LossTest, AdvantageOptionsShapeRewardsAndChooseTheLevel) {
  // Loss tokens (length - 1): a1 3, a2 1, b1 2, b2 2.
  const std::vector<Rollout> rollouts = {Rewarded("a1", "a", 1.0, 4), Rewarded("a2", "a", 0.0, 2),
                                         Rewarded("b1", "b", 3.0), Rewarded("b2", "b", 6.0)};
  // Shaping: clip((r - 1) * 2, +-5) = 0, -2, 4, 5 (10 clipped). Batch mean 7/4, unbiased std.
  const std::vector<double> shaped = {0, -2, 4, 5};
  const double mean = 7.0 / 4;
  double sq = 0;
  for (double x : shaped) sq += (x - mean) * (x - mean);
  const double std = std::sqrt(sq / 3);
  const std::vector<std::vector<float>> batch =
      ComputeAdvantages(rollouts, {.reward_bias = -1,
                                   .reward_scaling = 2,
                                   .reward_clip = 5,
                                   .mean_level = AdvantageLevel::kBatch,
                                   .std_level = AdvantageLevel::kBatch,
                                   .std_eps = 1e-3});
  for (size_t i = 0; i < rollouts.size(); ++i) {
    ExpectBroadcast(batch[i], rollouts[i].tokens.size(), (shaped[i] - mean) / (std + 1e-3));
  }
  // No centring, the group's std: a's rewards 1, 0 (std sqrt(1/2)), b's 3, 6 (std sqrt(9/2)).
  const std::vector<std::vector<float>> scaled =
      ComputeAdvantages(rollouts, {.mean_level = AdvantageLevel::kNone, .std_eps = 0});
  ExpectBroadcast(scaled[0], 4, 1 / std::sqrt(0.5));
  ExpectBroadcast(scaled[3], 3, 6 / std::sqrt(4.5));
  // Token weighted (AReaL's adv_norm): a's mean (3 * 1 + 1 * 0) / 4, std over 4 - 1.
  const std::vector<std::vector<float>> weighted =
      ComputeAdvantages(rollouts, {.token_weighted = true});
  const double a_mean = 0.75;
  const double a_std = std::sqrt((3 * 0.25 * 0.25 + 0.75 * 0.75) / 3);
  ExpectBroadcast(weighted[0], 4, (1 - a_mean) / (a_std + 1e-6));
  ExpectBroadcast(weighted[1], 2, (0 - a_mean) / (a_std + 1e-6));
  const double b_std = std::sqrt((2 * 1.5 * 1.5 + 2 * 1.5 * 1.5) / 3);
  ExpectBroadcast(weighted[2], 3, -1.5 / (b_std + 1e-6));
}

TEST(LossTest, AdvantageOptionsAreChecked) {
  const std::vector<Rollout> rollouts = {Rewarded("a1", "a", 1.0)};
  ExpectError([&] { ComputeAdvantages(rollouts, {.reward_clip = 0}); },
              {"reward_clip", "positive"});
  ExpectError([&] { ComputeAdvantages(rollouts, {.std_eps = -1}); }, {"std_eps"});
  ExpectError([&] { ComputeAdvantages(rollouts, {.reward_scaling = NAN}); }, {"reward_scaling"});
  EXPECT_EQ(*ParseAdvantageLevel("batch"), AdvantageLevel::kBatch);
  EXPECT_THAT(std::string(ParseAdvantageLevel("token").status().message()),
              HasSubstr("group, batch or none, got 'token'"));
}

TEST(LossTest, RejectionSamplingParsesTheCommandLineSpelling) {
  absl::StatusOr<RejectionSampling> rs = ParseRejectionSampling(
      "level=sequence,action=clamp,metric=kl_k3,aggregation=max,upper=2,"
      "lower=0.5");
  ASSERT_TRUE(rs.ok()) << rs.status();
  EXPECT_EQ(rs->level, RejectionSampling::Level::kSequence);
  EXPECT_EQ(rs->action, RejectionSampling::Action::kClamp);
  EXPECT_EQ(rs->metric, RejectionSampling::Metric::kKlK3);
  EXPECT_EQ(rs->aggregation, RejectionSampling::Aggregation::kMax);
  EXPECT_EQ(rs->upper, 2);
  EXPECT_EQ(rs->lower, 0.5);
  absl::StatusOr<RejectionSampling> defaults = ParseRejectionSampling("upper=3");
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ(defaults->level, RejectionSampling::Level::kToken);
  EXPECT_FALSE(defaults->lower.has_value());
  EXPECT_THAT(std::string(ParseRejectionSampling("metric=kl").status().message()),
              HasSubstr("metric must be ratio, kl_k1, kl_k2, kl_k3, got 'kl'"));
  EXPECT_THAT(std::string(ParseRejectionSampling("upper=x").status().message()),
              HasSubstr("upper must be a number"));
  EXPECT_THAT(std::string(ParseRejectionSampling("cap=3").status().message()),
              HasSubstr("unknown key 'cap'"));
  EXPECT_THAT(std::string(ParseRejectionSampling("token").status().message()),
              HasSubstr("expected key=value"));
}

TEST(LossTest, GrpoAdvantagesErrorsNameTheRollout) {
  Rollout none = MakeRollout("no-reward", {0, 1}, {0, 0});
  std::vector<Rollout> rollouts = {Rewarded("ok", "a", 1.0), none};
  ExpectError([&] { ComputeAdvantages(rollouts); }, {"'no-reward'", "reward", "advantages"});
  rollouts[1].advantages = {1, 2, 3};
  ExpectError([&] { ComputeAdvantages(rollouts); }, {"'no-reward'", "'advantages'", "3 values"});
}

TEST(LossTest, InputErrorsNameTheRolloutAndField) {
  PpoFixture f;
  const BatchLossContext b{.total_loss_tokens = 7, .num_rollouts = 1};
  const LossOptions ppo{.kind = LossKind::kPpo};
  auto run = [&](RolloutLossInputs in, const LossOptions& o) {
    return [in, o, b] { RolloutLossAndGrad(in, o, b); };
  };
  RolloutLossInputs in = Inputs(f.c);

  RolloutLossInputs short_lp = in;
  short_lp.logprobs = in.logprobs.detach().slice(0, 1);
  ExpectError(run(short_lp, ppo), {"'ppo-1'", "'logprobs'", "8 values for 9 tokens"});
  ExpectError([&] { RolloutLoss(short_lp, ppo, b); }, {"'ppo-1'", "'logprobs'"});

  RolloutLossInputs int_lp = in;
  int_lp.logprobs = at::zeros({9}, at::kLong);
  ExpectError(run(int_lp, ppo), {"'ppo-1'", "'logprobs'", "dtype"});
  RolloutLossInputs half_lp = in;
  half_lp.logprobs = at::zeros({9}, at::kHalf);
  ExpectError(run(half_lp, ppo), {"'ppo-1'", "'logprobs'", "dtype"});

  const std::vector<float> short_adv(8, 1.0f);
  RolloutLossInputs bad_adv = in;
  bad_adv.advantages = &short_adv;
  ExpectError(run(bad_adv, ppo), {"'ppo-1'", "'advantages'", "8 values for 9 tokens"});
  bad_adv.advantages = nullptr;
  ExpectError(run(bad_adv, ppo), {"'ppo-1'", "'advantages'", "missing"});

  ExpectError(run(in, {.kind = LossKind::kDecoupledPpo}), {"'ppo-1'", "'proximal_logprobs'"});
  RolloutLossInputs bad_prox = in;
  bad_prox.proximal_logprobs = at::zeros({3}, at::kDouble);
  ExpectError(run(bad_prox, {.kind = LossKind::kDecoupledPpo}),
              {"'ppo-1'", "'proximal_logprobs'", "3 values"});

  RolloutLossInputs no_entropy = in;
  no_entropy.entropy = at::Tensor();
  ExpectError(run(no_entropy, {.kind = LossKind::kPpo, .entropy_coef = 0.1}),
              {"'ppo-1'", "'entropy'", "missing"});
  RolloutLossInputs bad_entropy = in;
  bad_entropy.entropy = at::zeros({2, 9}, at::kDouble);
  ExpectError(run(bad_entropy, ppo), {"'ppo-1'", "'entropy'", "1-D"});

  Rollout no_ref = f.rollout;
  no_ref.ref_logprobs.clear();
  RolloutLossInputs in_no_ref = in;
  in_no_ref.rollout = &no_ref;
  ExpectError(run(in_no_ref, {.kind = LossKind::kSft, .kl_coef = 0.1}),
              {"'ppo-1'", "'ref_logprobs'", "missing"});

  Rollout bad_behave = f.rollout;
  bad_behave.logprobs.pop_back();
  RolloutLossInputs in_bad_behave = in;
  in_bad_behave.rollout = &bad_behave;
  ExpectError(run(in_bad_behave, ppo), {"'ppo-1'", "'logprobs (behaviour)'", "8 values"});
  RolloutLossInputs sft = in_bad_behave;  // SFT does not read behaviour logprobs
  EXPECT_NO_THROW(RolloutLossAndGrad(sft, {.kind = LossKind::kSft}, b));

  Rollout bad_mask = f.rollout;
  bad_mask.loss_mask.push_back(1);
  RolloutLossInputs in_bad_mask = in;
  in_bad_mask.rollout = &bad_mask;
  ExpectError(run(in_bad_mask, ppo), {"'ppo-1'", "'loss_mask'", "10 values"});

  ExpectError(run(in, {.kind = LossKind::kPpo, .dual_clip = 0.5}), {"'ppo-1'", "dual_clip"});
  ExpectError([&] { RolloutLoss(in, ppo, {.total_loss_tokens = 0, .num_rollouts = 1}); },
              {"'ppo-1'", "total_loss_tokens"});
}

TEST(LossTest, CustomLossReplacesTheBuiltInOnes) {
  PpoFixture f;
  const BatchLossContext b{.total_loss_tokens = 10, .num_rollouts = 2};
  const LossOptions ppo{.kind = LossKind::kPpo};
  const RolloutLossInputs in = Inputs(f.c);
  const RolloutLossGrad want = RolloutLossAndGrad(in, ppo, b);
  // Twice PPO through the hook; kind = kSft shows that the built-in kind is ignored.
  LossOptions custom{.kind = LossKind::kSft};
  int calls = 0;
  custom.custom = [&](const RolloutLossInputs& given, const BatchLossContext& batch) {
    ++calls;
    EXPECT_EQ(given.rollout, &f.rollout);
    EXPECT_EQ(given.advantages, &f.c.adv);
    EXPECT_EQ(batch, b);
    return 2 * RolloutLoss(given, ppo, batch);
  };
  const RolloutLossGrad got = RolloutLossAndGrad(in, custom, b);
  EXPECT_EQ(calls, 1);
  EXPECT_NEAR(got.loss.item<double>(), 2 * want.loss.item<double>(), 1e-15);
  ExpectGradNear(V(got.dlogprobs), V(2 * want.dlogprobs), "custom dlogprobs");

  // A loss that ignores logprobs still reaches them (zero gradient), so backward works.
  custom.custom = [](const RolloutLossInputs& given, const BatchLossContext&) {
    return at::full({}, 3.0, given.logprobs.options().requires_grad(false));
  };
  const at::Tensor constant = RolloutLoss(in, custom, b);
  EXPECT_TRUE(constant.requires_grad());
  constant.backward();
  EXPECT_EQ(constant.item<double>(), 3.0);
  ExpectGradNear(V(in.logprobs.grad()), Vec(f.c.lp.size(), 0.0), "constant custom loss");

  custom.custom = [](const RolloutLossInputs& given, const BatchLossContext&) {
    return given.logprobs * 2;
  };
  ExpectError([&] { RolloutLoss(in, custom, b); },
              {"'ppo-1'", "custom loss", "one floating-point value"});
}

// RolloutsLossAndGrad over rollouts of different lengths (one without loss tokens, position 0's
// dummy value extreme): the sum of RolloutLossAndGrad's losses, its gradients laid out as the
// concatenation, the same diagnostics, for every option set that sums token terms, in float64
// and float32.
TEST(LossTest, RolloutsLossAndGradIsEachRolloutsConcatenated) {
  at::manual_seed(5);
  std::vector<Rollout> rollouts;
  std::vector<std::vector<float>> advantages;
  std::vector<at::Tensor> lps, entropies, proximal;
  const std::vector<std::vector<uint8_t>> masks = {
      {0, 1, 1, 0, 1}, {0, 0, 0}, {0, 1, 1, 1, 1, 1, 1, 1}, {0, 1}};
  for (size_t i = 0; i < masks.size(); ++i) {
    const int64_t length = static_cast<int64_t>(masks[i].size());
    Vec behave(length), ref(length);
    for (int64_t t = 0; t < length; ++t) {
      behave[t] = -0.25 * static_cast<double>((t + i) % 5) - 0.5;
      ref[t] = -0.125 * static_cast<double>((t * 3 + i) % 7) - 0.25;
    }
    behave[0] = -100;  // the dummy position's extreme value never reaches the loss
    rollouts.push_back(MakeRollout("r" + std::to_string(i), masks[i], behave, ref));
    std::vector<float> adv(length);
    for (int64_t t = 0; t < length; ++t) adv[t] = (i % 2 == 0 ? 1.0f : -1.5f) * (1 + t % 3);
    advantages.push_back(adv);
    lps.push_back(at::log(at::rand({length}, at::kDouble) * 0.9 + 0.05));
    entropies.push_back(at::rand({length}, at::kDouble) * 3);
    proximal.push_back(T(behave) + at::randn({length}, at::kDouble) * 0.3);
  }
  const BatchLossContext b = MakeBatchContext(rollouts);
  RejectionSampling clamp_kl{.action = RejectionSampling::Action::kClamp,
                             .metric = RejectionSampling::Metric::kKlK3,
                             .upper = 0.05};
  const std::vector<std::pair<std::string, LossOptions>> options = {
      {"sft", {.kind = LossKind::kSft}},
      {"ppo", {.kind = LossKind::kPpo, .entropy_coef = 0.01, .kl_coef = 0.05}},
      {"dual clip, sequence mean",
       {.kind = LossKind::kPpo, .normalization = Normalization::kSequenceMean, .dual_clip = 2.0}},
      {"decoupled, cap, sum",
       {.kind = LossKind::kDecoupledPpo,
        .normalization = Normalization::kSum,
        .behave_imp_weight_cap = 1.2}},
      {"decoupled, token rejection",
       {.kind = LossKind::kDecoupledPpo,
        .normalization = Normalization::kSequenceMean,
        .rejection_sampling = clamp_kl,
        .kl_coef = 0.1}},
  };
  for (const auto& [name, o] : options) {
    ASSERT_TRUE(SumsTokenTerms(o)) << name;
    for (const at::ScalarType dtype : {at::kDouble, at::kFloat}) {
      SCOPED_TRACE(name + (dtype == at::kDouble ? " float64" : " float32"));
      const bool with_entropy = o.entropy_coef != 0;
      double loss = 0;
      std::vector<at::Tensor> dlogprobs, dentropy;
      DiagnosticsAccumulator each;
      RolloutsLossInputs all;
      for (size_t i = 0; i < rollouts.size(); ++i) {
        const RolloutLossInputs in{.rollout = &rollouts[i],
                                   .logprobs = lps[i].to(dtype),
                                   .entropy = with_entropy ? entropies[i].to(dtype) : at::Tensor(),
                                   .proximal_logprobs = proximal[i].to(dtype),
                                   .advantages = &advantages[i]};
        const RolloutLossGrad g = RolloutLossAndGrad(in, o, b, &each);
        loss += g.loss.item<double>();
        dlogprobs.push_back(g.dlogprobs);
        if (with_entropy) dentropy.push_back(g.dentropy);
        all.rollouts.push_back(&rollouts[i]);
        all.proximal_logprobs.push_back(in.proximal_logprobs);
        all.advantages.push_back(&advantages[i]);
      }
      all.logprobs = at::cat(lps).to(dtype);
      if (with_entropy) all.entropy = at::cat(entropies).to(dtype);
      DiagnosticsAccumulator together;
      const RolloutLossGrad g = RolloutsLossAndGrad(all, o, b, &together);
      const double tolerance = dtype == at::kDouble ? 1e-13 : 1e-5;
      EXPECT_NEAR(g.loss.item<double>(), loss, tolerance * std::max(1.0, std::abs(loss)));
      EXPECT_EQ(g.dlogprobs.scalar_type(), dtype);
      const at::Tensor want = at::cat(dlogprobs);
      EXPECT_GT(want.abs().max().item<double>(), 0.0);
      EXPECT_LE((g.dlogprobs - want).abs().max().item<double>(),
                tolerance * want.abs().max().item<double>());
      if (with_entropy) {
        EXPECT_TRUE(at::allclose(g.dentropy, at::cat(dentropy), tolerance, 0));
      } else {
        EXPECT_FALSE(g.dentropy.defined());
      }
      const LossDiagnostics d_each = each.Read(), d_together = together.Read();
      for (int k = 0; k < LossDiagnostics::kSums; ++k) {
        EXPECT_NEAR(d_together.Sums()[k], d_each.Sums()[k],
                    tolerance * std::max(1.0, std::abs(d_each.Sums()[k])))
            << "diagnostic sum " << k;
      }
      EXPECT_EQ(d_together.ratio_max, d_each.ratio_max);
      EXPECT_EQ(d_together.ratio_min, d_each.ratio_min);
    }
  }
}

// A loss that is not a sum of token terms is refused; inputs are checked as RolloutLossAndGrad
// checks them, naming the rollout.
TEST(LossTest, RolloutsLossAndGradChecksItsInputs) {
  const Rollout a = MakeRollout("a", {0, 1, 1}, {-1, -1, -1});
  const Rollout b = MakeRollout("b", {0, 1}, {-1, -1});
  const std::vector<float> adv3 = {1, 1, 1}, adv2 = {1, 1};
  const BatchLossContext batch{.total_loss_tokens = 3, .num_rollouts = 2};
  RolloutsLossInputs in{.rollouts = {&a, &b},
                        .logprobs = T({0, -0.875, -0.875, 0, -0.875}),
                        .proximal_logprobs = {at::Tensor(), at::Tensor()},
                        .advantages = {&adv3, &adv2}};
  const LossOptions ppo{.kind = LossKind::kPpo};
  EXPECT_NEAR(RolloutsLossAndGrad(in, ppo, batch).loss.item<double>(), -std::exp(0.125),
              1e-12);  // every ratio exp(0.125), inside the clip

  EXPECT_FALSE(SumsTokenTerms({.kind = LossKind::kGspo}));
  EXPECT_FALSE(SumsTokenTerms(
      {.kind = LossKind::kDecoupledPpo,
       .rejection_sampling = RejectionSampling{.level = RejectionSampling::Level::kSequence}}));
  EXPECT_FALSE(SumsTokenTerms({.custom = [](const RolloutLossInputs& r, const BatchLossContext&) {
    return r.logprobs.sum();
  }}));
  ExpectError([&] { RolloutsLossAndGrad(in, {.kind = LossKind::kGspo}, batch); },
              {"not a sum of per-token terms"});

  RolloutsLossInputs short_logprobs = in;
  short_logprobs.logprobs = T({0, -0.875, -0.875, 0});
  ExpectError([&] { RolloutsLossAndGrad(short_logprobs, ppo, batch); },
              {"rollout 'b'", "field 'logprobs'", "1 values left for 2 tokens"});
  RolloutsLossInputs long_logprobs = in;
  long_logprobs.logprobs = T({0, -0.875, -0.875, 0, -0.875, 0});
  ExpectError([&] { RolloutsLossAndGrad(long_logprobs, ppo, batch); },
              {"logprobs holds 6 values for the rollouts' 5 tokens"});
  RolloutsLossInputs no_advantages = in;
  no_advantages.advantages[1] = nullptr;
  ExpectError([&] { RolloutsLossAndGrad(no_advantages, ppo, batch); },
              {"rollout 'b'", "field 'advantages' is missing"});
  RolloutsLossInputs wrong_advantages = in;
  wrong_advantages.advantages[0] = &adv2;
  ExpectError([&] { RolloutsLossAndGrad(wrong_advantages, ppo, batch); },
              {"rollout 'a'", "field 'advantages': 2 values for 3 tokens"});
  ExpectError([&] { RolloutsLossAndGrad(in, {.kind = LossKind::kDecoupledPpo}, batch); },
              {"rollout 'a'", "field 'proximal_logprobs' is missing"});
  ExpectError([&] { RolloutsLossAndGrad(in, ppo, {.total_loss_tokens = 0, .num_rollouts = 2}); },
              {"rollout 'a'", "total_loss_tokens = 0"});
}
}  // namespace
}  // namespace dta

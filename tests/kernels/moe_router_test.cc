// kernels/moe_router.h: on the CPU the ATen path against loops over the tokens (float64 and
// float32 routing, stable counting sort) and autograd (the backward, float64); on a GPU the kernels
// against the ATen path (DTA_MOE_ROUTER=0) on the same inputs: probs to float32 rounding, the
// experts exactly (logits without ties), weights to one rounding of their dtype, mismatch counts
// and the sort bit for bit, the backward to 1e-5; and every kernel bitwise equal across two calls.
#include "kernels/moe_router.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "tests/kernels/kernel_testing.h"

namespace dta::kernels {
namespace {

using testing::RelativeError;

// [T, E] logits, each row a random permutation of E values 8 / E apart around 0: no ties, and
// exact in bfloat16 for E <= 512 (integers of at most 8 bits over a power of two).
at::Tensor DistinctLogits(int64_t t, int64_t e, at::ScalarType type, uint64_t seed) {
  at::manual_seed(seed);
  const at::Tensor rank = at::argsort(at::rand({t, e}), /*dim=*/int64_t{1}, /*descending=*/false);
  return ((rank.to(at::kDouble) - static_cast<double>(e / 2)) * (8.0 / static_cast<double>(e)))
      .to(type);
}

// Row kinds, by token % 4: 0 the own top k reversed (recorded, no mismatch), 1 the k least probable
// experts (recorded, a mismatch when 2 k <= E), 2 no record (-1), 3 a partial record (not
// recorded). own_index and probs on the host.
at::Tensor MakeReplay(const at::Tensor& own_index, const at::Tensor& probs) {
  const int64_t t = own_index.size(0), k = own_index.size(1);
  const at::Tensor least = at::argsort(probs.to(at::kDouble), /*dim=*/int64_t{1}, false);
  at::Tensor replay = at::full({t, k}, -1, at::kLong);
  for (int64_t row = 0; row < t; ++row) {
    const int64_t kind = row % 4;
    if (kind == 0) replay[row].copy_(own_index[row].flip(0));
    if (kind == 1 || kind == 3) replay[row].copy_(least[row].slice(0, 0, k));
    if (kind == 3) replay[row][0] = -1;
  }
  return replay;
}

struct Expected {
  at::Tensor probs, own_index, index, weights;  // float64 probs and weights, on the host
  int64_t mismatches = 0;
};

// RouteTokens by loops over the tokens in float64: exp(z - max) / sum, the top k by descending
// probability (ties to the lower index), the replayed rows where recorded.
Expected RouteByLoops(const at::Tensor& logits, int64_t k, bool norm, const at::Tensor& replay) {
  const at::Tensor z = logits.to(at::kDouble).cpu().contiguous();
  const int64_t t = z.size(0), e = z.size(1);
  Expected out{.probs = at::empty({t, e}, at::kDouble),
               .own_index = at::empty({t, k}, at::kLong),
               .index = at::empty({t, k}, at::kLong),
               .weights = at::empty({t, k}, at::kDouble)};
  const auto zs = z.accessor<double, 2>();
  auto probs = out.probs.accessor<double, 2>();
  for (int64_t row = 0; row < t; ++row) {
    double max = -INFINITY, sum = 0;
    for (int64_t c = 0; c < e; ++c) max = std::max(max, zs[row][c]);
    for (int64_t c = 0; c < e; ++c) sum += std::exp(zs[row][c] - max);
    for (int64_t c = 0; c < e; ++c) probs[row][c] = std::exp(zs[row][c] - max) / sum;
    std::vector<int64_t> experts(e);
    std::iota(experts.begin(), experts.end(), 0);
    std::stable_sort(experts.begin(), experts.end(),
                     [&](int64_t a, int64_t b) { return probs[row][a] > probs[row][b]; });
    std::vector<int64_t> own(experts.begin(), experts.begin() + k), ids = own;
    bool recorded = replay.defined();
    for (int64_t j = 0; recorded && j < k; ++j) recorded = replay[row][j].item<int64_t>() >= 0;
    if (recorded) {
      for (int64_t j = 0; j < k; ++j) ids[j] = replay[row][j].item<int64_t>();
      std::vector<int64_t> a = own, b = ids;
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      out.mismatches += a != b;
    }
    double top_sum = 0;
    for (int64_t j = 0; j < k; ++j) top_sum += probs[row][ids[j]];
    for (int64_t j = 0; j < k; ++j) {
      out.own_index[row][j] = own[j];
      out.index[row][j] = ids[j];
      out.weights[row][j] = probs[row][ids[j]] / (norm ? top_sum : 1.0);
    }
  }
  return out;
}

// |actual - expected| <= rtol |expected| everywhere (on the host, in float64).
bool Near(const at::Tensor& actual, const at::Tensor& expected, double rtol) {
  const at::Tensor a = actual.to(at::kDouble).cpu(), e = expected.to(at::kDouble).cpu();
  return ((a - e).abs() <= rtol * e.abs() + 1e-300).all().item<bool>();
}

// One ulp of bfloat16 (8 significant bits) relative to the value, at most.
constexpr double kBFloat16Ulp = 1.0 / 128;

TEST(MoeRouter, TheAtenPathRoutesAsLoopsOverTheTokens) {
  struct Case {
    at::ScalarType logits, weights;
    double rtol;
  };
  for (const Case c : {Case{at::kDouble, at::kDouble, 1e-12}, Case{at::kFloat, at::kFloat, 1e-6},
                       Case{at::kFloat, at::kBFloat16, kBFloat16Ulp}}) {
    for (const bool norm : {false, true}) {
      SCOPED_TRACE(std::string(c10::toString(c.logits)) + " to " + c10::toString(c.weights) +
                   (norm ? ", renormalised" : ""));
      const int64_t t = 37, e = 12, k = 3;
      const at::Tensor logits = DistinctLogits(t, e, c.logits, 1);
      const Routing own = RouteTokens(logits, k, norm, c.weights, std::nullopt);
      const at::Tensor replay = MakeReplay(own.own_index, own.probs);
      const Routing r = RouteTokens(logits, k, norm, c.weights, replay);
      const Expected x = RouteByLoops(logits, k, norm, replay);
      const at::ScalarType ct = c.logits == at::kDouble ? at::kDouble : at::kFloat;
      EXPECT_EQ(r.probs.scalar_type(), ct);
      EXPECT_EQ(r.weights.scalar_type(), ct);
      EXPECT_TRUE(Near(r.probs, x.probs, c.logits == at::kDouble ? 1e-12 : 1e-6));
      EXPECT_TRUE(at::equal(r.own_index, x.own_index));
      EXPECT_TRUE(at::equal(r.index, x.index));
      EXPECT_TRUE(Near(r.weights, x.weights, c.rtol));
      EXPECT_TRUE(at::equal(r.weights, r.weights.to(c.weights).to(ct)));  // rounded
      // Rows of kind 1 (9 of 37) hold the 3 least probable of 12 experts: all of them differ.
      EXPECT_EQ(x.mismatches, 9);
      EXPECT_EQ(r.mismatches.item<int64_t>(), x.mismatches);
      EXPECT_FALSE(own.mismatches.defined());
      EXPECT_TRUE(at::equal(own.index, own.own_index));
      EXPECT_TRUE(at::equal(r.own_index, own.own_index));
    }
  }
}

TEST(MoeRouter, RouteTokensChecksTheReplayedExperts) {
  const at::Tensor logits = DistinctLogits(5, 8, at::kFloat, 2);
  EXPECT_THAT(
      [&] {
        RouteTokens(logits, 2, true, at::kFloat, at::zeros({5, 3}, at::kLong));
      },
      ::testing::ThrowsMessage<c10::Error>(
          ::testing::HasSubstr("replayed experts must be [T, k] = [5, 2] int64")));
  EXPECT_THROW(RouteTokens(logits, 2, true, at::kFloat, at::zeros({5, 2}, at::kInt)), c10::Error);
}

// The stable counting sort by loops: each expert's pairs in pair order.
PairOrder SortByLoops(const at::Tensor& index, int64_t experts) {
  const at::Tensor flat = index.reshape({-1}).cpu();
  const int64_t n = flat.numel(), k = index.size(1);
  PairOrder p{.order = at::empty({n}, at::kLong),
              .inverse = at::empty({n}, at::kLong),
              .token = at::empty({n}, at::kLong),
              .ends = at::zeros({experts}, at::kLong)};
  int64_t place = 0;
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t q = 0; q < n; ++q) {
      if (flat[q].item<int64_t>() != e) continue;
      p.order[place] = q;
      p.inverse[q] = place;
      p.token[place] = q / k;
      ++place;
    }
    p.ends[e] = place;
  }
  return p;
}

void ExpectEqual(const PairOrder& a, const PairOrder& b) {
  EXPECT_TRUE(at::equal(a.order.cpu(), b.order.cpu()));
  EXPECT_TRUE(at::equal(a.inverse.cpu(), b.inverse.cpu()));
  EXPECT_TRUE(at::equal(a.token.cpu(), b.token.cpu()));
  EXPECT_TRUE(at::equal(a.ends.cpu(), b.ends.cpu()));
}

TEST(MoeRouter, TheAtenPathSortsPairsStablyByExpert) {
  at::manual_seed(3);
  for (const int64_t t : {int64_t{0}, int64_t{1}, int64_t{37}}) {
    SCOPED_TRACE(t);
    const at::Tensor index = at::randint(0, 6, {t, 3}, at::kLong);  // repeated ids in rows too
    ExpectEqual(SortPairs(index, 7), SortByLoops(index, 7));        // expert 6 has no pairs
  }
}

// The gradient of sum_j w_j g_j + sum_c probs_c extra_c through the routing weights w (unrounded)
// and the softmax, by autograd.
at::Tensor AutogradDlogits(const at::Tensor& logits, const at::Tensor& index, const at::Tensor& g,
                           bool norm, const at::Tensor& extra) {
  const at::Tensor z = logits.detach().clone().requires_grad_(true);
  const at::Tensor probs = at::softmax(z, -1);
  const at::Tensor top = probs.gather(1, index);
  at::Tensor loss = ((norm ? top / top.sum(-1, true) : top) * g).sum();
  if (extra.defined()) loss = loss + (probs * extra).sum();
  loss.backward();
  return z.grad();
}

TEST(MoeRouter, TheAtenBackwardIsTheAutogradGradient) {
  const int64_t t = 37, e = 12, k = 3;
  const at::Tensor logits = DistinctLogits(t, e, at::kDouble, 4);
  const Routing own = RouteTokens(logits, k, true, at::kDouble, std::nullopt);
  const Routing r = RouteTokens(logits, k, true, at::kDouble, MakeReplay(own.own_index, own.probs));
  const PairOrder pairs = SortPairs(r.index, e);
  const at::Tensor g = at::randn({t, k}, at::kDouble);
  // The weights' gradients in sorted-pair order: pair q's at its place inverse[q].
  const at::Tensor dweights_sorted =
      at::zeros({t * k}, at::kDouble).scatter_(0, pairs.inverse, g.reshape({-1}));
  for (const bool norm : {false, true}) {
    for (const bool with_extra : {false, true}) {
      SCOPED_TRACE(std::string(norm ? "renormalised" : "") + (with_extra ? ", aux" : ""));
      const at::Tensor extra = with_extra ? at::randn({t, e}, at::kDouble) : at::Tensor();
      const at::Tensor dlogits = RouterBackward(r.probs, r.index, dweights_sorted, pairs.inverse,
                                                norm, extra, at::kDouble);
      EXPECT_LE(RelativeError(dlogits, AutogradDlogits(logits, r.index, g, norm, extra)), 1e-12);
    }
  }
}

TEST(MoeRouter, EmptyChunks) {
  for (const at::ScalarType type : {at::kDouble, at::kFloat}) {
    const Routing r =
        RouteTokens(at::empty({0, 8}, type), 2, true, type, at::empty({0, 2}, at::kLong));
    EXPECT_EQ(r.probs.sizes(), (std::vector<int64_t>{0, 8}));
    EXPECT_EQ(r.index.sizes(), (std::vector<int64_t>{0, 2}));
    EXPECT_EQ(r.weights.sizes(), (std::vector<int64_t>{0, 2}));
    EXPECT_EQ(r.mismatches.item<int64_t>(), 0);
    const PairOrder p = SortPairs(r.index, 8);
    EXPECT_EQ(p.order.numel(), 0);
    EXPECT_TRUE(at::equal(p.ends, at::zeros({8}, at::kLong)));
    const at::Tensor dlogits =
        RouterBackward(r.probs, r.index, at::empty({0}, type), p.inverse, true, at::Tensor(), type);
    EXPECT_EQ(dlogits.sizes(), (std::vector<int64_t>{0, 8}));
  }
}

struct Shape {
  int64_t t, k, e;
  std::string Name() const {
    return std::to_string(t) + " tokens, top " + std::to_string(k) + " of " + std::to_string(e);
  }
};

// Top k of E experts for E in {8, 128, 512} and k in {1, 2, 8, 10} (k <= E), T in `tokens`.
std::vector<Shape> RouterShapes(std::initializer_list<int64_t> tokens) {
  std::vector<Shape> shapes;
  for (const int64_t e : {8, 128, 512}) {
    for (const int64_t k : {1, 2, 8, 10}) {
      for (const int64_t t : tokens) {
        if (k <= e) shapes.push_back({t, k, e});
      }
    }
  }
  return shapes;
}

// Runs f with the ATen ops (DTA_MOE_ROUTER=0), then twice with the kernels: {aten, kernel, again}.
template <typename F>
auto AtenThenKernelTwice(F f) {
  setenv("DTA_MOE_ROUTER", "0", 1);
  auto aten = f();
  unsetenv("DTA_MOE_ROUTER");
  auto kernel = f();
  auto again = f();
  return std::vector<decltype(aten)>{aten, kernel, again};
}

TEST(MoeRouter, RouteTokensKernelEqualsTheAtenPathOnTheGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  uint64_t seed = 10;
  for (const Shape s : RouterShapes({0, 1, 37, 1000, 5000})) {
    const int64_t t = s.t, k = s.k, e = s.e;
    for (const at::ScalarType type : {at::kBFloat16, at::kFloat}) {
      for (const bool norm : {false, true}) {
        SCOPED_TRACE(s.Name() + ", " + c10::toString(type) + (norm ? ", renormalised" : ""));
        const at::Tensor logits = DistinctLogits(t, e, type, ++seed).cuda();
        setenv("DTA_MOE_ROUTER", "0", 1);
        const Routing own = RouteTokens(logits, k, norm, type, std::nullopt);
        unsetenv("DTA_MOE_ROUTER");
        // The replay from the host on odd seeds, on the device on even ones.
        at::Tensor replay = MakeReplay(own.own_index.cpu(), own.probs.cpu());
        if (seed % 2 == 0) replay = replay.cuda();
        for (const bool replayed : {false, true}) {
          SCOPED_TRACE(replayed ? "replayed" : "own");
          const std::optional<at::Tensor> rows =
              replayed ? std::optional<at::Tensor>(replay) : std::nullopt;
          const std::vector<Routing> runs =
              AtenThenKernelTwice([&] { return RouteTokens(logits, k, norm, type, rows); });
          const Routing &aten = runs[0], &kernel = runs[1], &again = runs[2];
          EXPECT_TRUE(Near(kernel.probs, aten.probs, 1e-6));
          EXPECT_TRUE(at::equal(kernel.own_index, aten.own_index));
          EXPECT_TRUE(at::equal(kernel.index, aten.index));
          EXPECT_TRUE(Near(kernel.weights, aten.weights, type == at::kFloat ? 1e-6 : kBFloat16Ulp));
          EXPECT_EQ(kernel.weights.scalar_type(), at::kFloat);
          EXPECT_EQ(kernel.mismatches.defined(), replayed);
          if (replayed) {
            EXPECT_EQ(kernel.mismatches.item<int64_t>(), aten.mismatches.item<int64_t>());
            if (2 * k <= e) {  // rows of kind 1
              EXPECT_EQ(kernel.mismatches.item<int64_t>(), (t + 2) / 4);
            }
          }
          EXPECT_TRUE(at::equal(kernel.probs, again.probs));
          EXPECT_TRUE(at::equal(kernel.own_index, again.own_index));
          EXPECT_TRUE(at::equal(kernel.index, again.index));
          EXPECT_TRUE(at::equal(kernel.weights, again.weights));
        }
      }
    }
  }
}

// Equal probabilities: the kernel takes the lower expert first.
TEST(MoeRouter, RouteTokensKernelBreaksTiesToTheLowerExpert) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (const int64_t e : {128, 512}) {
    SCOPED_TRACE(e);
    at::Tensor logits = at::zeros({2, e}, at::kFloat);  // row 1: all equal
    for (const int64_t c : {100, 69, 37, 5}) logits[0][c] = 2.0;
    for (const int64_t c : {90, 3}) logits[0][c] = 1.0;
    const Routing r =
        RouteTokens(logits.to(at::kBFloat16).cuda(), 6, true, at::kBFloat16, std::nullopt);
    EXPECT_TRUE(
        at::equal(r.own_index.cpu(),
                  at::tensor({5, 37, 69, 100, 3, 90, 0, 1, 2, 3, 4, 5}, at::kLong).view({2, 6})));
  }
}

TEST(MoeRouter, SortPairsKernelEqualsTheAtenPathOnTheGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(20);
  for (const Shape s : {Shape{0, 8, 128}, Shape{1, 1, 8}, Shape{37, 3, 8}, Shape{1000, 8, 128},
                        Shape{5000, 10, 512}, Shape{40000, 8, 128}, Shape{3000, 2, 2048}}) {
    for (const bool skewed : {false, true}) {
      SCOPED_TRACE(s.Name() + (skewed ? ", skewed" : ""));
      // Skewed: most pairs to expert 1, the rest to the last expert.
      const at::Tensor index = skewed ? at::where(at::rand({s.t, s.k}) < 0.9, int64_t{1}, s.e - 1)
                                      : at::randint(0, s.e, {s.t, s.k}, at::kLong);
      const at::Tensor ids = index.cuda();
      const std::vector<PairOrder> runs = AtenThenKernelTwice([&] { return SortPairs(ids, s.e); });
      ExpectEqual(runs[1], runs[0]);
      ExpectEqual(runs[2], runs[1]);
    }
  }
}

TEST(MoeRouter, RouterBackwardKernelEqualsTheAtenPathOnTheGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  uint64_t seed = 30;
  for (const Shape s : RouterShapes({1, 37, 1000, 5000})) {
    const int64_t t = s.t, k = s.k, e = s.e;
    SCOPED_TRACE(s.Name());
    const at::Tensor logits = DistinctLogits(t, e, at::kBFloat16, ++seed).cuda();
    setenv("DTA_MOE_ROUTER", "0", 1);
    const Routing own = RouteTokens(logits, k, true, at::kBFloat16, std::nullopt);
    const Routing r = RouteTokens(logits, k, true, at::kBFloat16,
                                  MakeReplay(own.own_index.cpu(), own.probs.cpu()));
    const PairOrder pairs = SortPairs(r.index, e);
    unsetenv("DTA_MOE_ROUTER");
    const at::Tensor dweights = at::randn({t * k}, r.probs.options());
    const at::Tensor aux = at::randn({t, e}, r.probs.options());
    for (const bool norm : {false, true}) {
      for (const bool with_aux : {false, true}) {
        for (const at::ScalarType out : {at::kFloat, at::kBFloat16}) {
          SCOPED_TRACE(std::string(norm ? "renormalised, " : "") + (with_aux ? "aux, " : "") +
                       c10::toString(out));
          const at::Tensor extra = with_aux ? aux : at::Tensor();
          const std::vector<at::Tensor> runs = AtenThenKernelTwice([&] {
            return RouterBackward(r.probs, r.index, dweights, pairs.inverse, norm, extra, out);
          });
          EXPECT_EQ(runs[1].scalar_type(), out);
          EXPECT_TRUE(at::equal(runs[1], runs[2]));
          if (out == at::kFloat) {
            EXPECT_LE(RelativeError(runs[1], runs[0]), 1e-5);
          } else {  // one bfloat16 rounding apart, or a float32 difference near zero
            const at::Tensor a = runs[1].to(at::kDouble), b = runs[0].to(at::kDouble);
            const double floor = 1e-5 * b.abs().max().item<double>();
            EXPECT_TRUE(((a - b).abs() <= kBFloat16Ulp * b.abs() + floor).all().item<bool>());
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace dta::kernels

// The Hopper kernels (kernels/hopper/) against the float64 reference and against the
// FlashAttention-2 kernels, in one process: DTA_HOPPER_ATTENTION=0 selects the FlashAttention-2
// forward and DTA_HOPPER_ATTENTION_BACKWARD=0 the FlashAttention-2 backward, per call.
// Same inputs and tolerances as tree_attention_test.cc (out and gradients within 1e-2 of the
// reference's largest magnitude, lse within 1e-3): chains, random forests and 64-leaf trees;
// T in {1, 3, 7, 19, 200, 733, 2100, 4099, 6007, 8192, 16001}; P in {0, 37, 700, 1200, 3000,
// 3001}; D = 128, 64 and 256 (the backward's head-split kernels there); Hq:Hkv
// 16:8, 32:8, 8:8, 8:2, 14:2, 2:1, 16:2, 4:1; k and v as head slices of one projection, the prefix
// as the head of a larger cache; diffuse and peaked rows; the exact lse-counts test with q = 0. The
// Hopper backward (fed by the Hopper forward's out and lse) adds the prefix gradients into strided
// views of larger accumulators without touching their other rows, and is bitwise equal across two
// runs. Skipped without a CUDA device, on GPUs other than compute capability 9.x, or in builds
// without the Hopper kernels.
#include <torch/cuda.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/base/scoped_env.h"
#include "gtest/gtest.h"
#include "kernels/tree_attention.h"
#include "kernels/tree_attention_internal.h"
#include "kernels/tree_attention_reference.h"
#include "tests/kernels/tree_attention_testing.h"

namespace dta::kernels {
namespace {

using testing::MakeKeyEnd;
using testing::RelativeError;
using testing::TreeKind;

using testing::kLseTolerance;
using testing::kTolerance;

struct Case {
  int64_t tokens, prefix, q_heads, kv_heads;
  TreeKind kind;
  bool int32_key_end = false;
  double q_std = 1;  // 4: rows dominated by a few keys (see tree_attention_test.cc)
  int64_t head_dim = 128;
  std::string Name() const {
    return "T=" + std::to_string(tokens) + " P=" + std::to_string(prefix) +
           " Hq=" + std::to_string(q_heads) + " Hkv=" + std::to_string(kv_heads) +
           " D=" + std::to_string(head_dim) + " " + testing::TreeKindName(kind) +
           (int32_key_end ? " int32" : "") + (q_std != 1 ? " peaky" : "");
  }
};

// The head dims the Hopper kernels are compiled for; the fixture probes both.
constexpr int64_t kHeadDims[] = {64, 128, 256};
// The long-chain test's head dim (the benchmark's).
constexpr int64_t kHeadDim = 128;

constexpr const char* kForwardEnv = "DTA_HOPPER_ATTENTION";
constexpr const char* kBackwardEnv = "DTA_HOPPER_ATTENTION_BACKWARD";
constexpr const char* kFusedEnv = "DTA_HOPPER_ATTENTION_BACKWARD_FUSED";

class HopperTreeAttention : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device; the kernel needs a GPU";
    const ScopedEnv on(kForwardEnv, "1");
    const ScopedEnv on_backward(kBackwardEnv, "1");
    for (const int64_t d : kHeadDims) {
      const at::Tensor probe =
          at::empty({1, 1, d}, at::TensorOptions(at::kCUDA).dtype(at::kBFloat16));
      internal::TreeAttentionShape shape;
      shape.tokens = 1;
      shape.q_heads = shape.kv_heads = 1;
      shape.head_dim = d;
      if (!internal::UsesHopperForward(shape, probe) ||
          !internal::UsesHopperBackward(shape, probe)) {
        GTEST_SKIP() << "no Hopper kernels for head dim " << d
                     << " here: needs a compute capability 9.x GPU and a build with the CUTLASS "
                        "headers (DTA_KERNELS_HAVE_HOPPER)";
      }
    }
  }
};

at::Tensor RandnBf16(at::IntArrayRef shape, at::Generator& gen) {
  return at::normal(0.0, 1.0, shape, gen, at::TensorOptions().dtype(at::kFloat)).to(at::kBFloat16);
}

double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble).to(a.device())).abs().max().item<double>();
}

// The GPU operands laid out as the executor has them.
struct GpuInputs {
  at::Tensor q, k, v, prefix_k, prefix_v, key_end;
};

GpuInputs ToGpu(const Case& c, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& pk, const at::Tensor& pv, const at::Tensor& ends,
                at::Generator& gen) {
  const int64_t t = c.tokens, p = c.prefix, hkv = c.kv_heads, d = c.head_dim;
  GpuInputs g;
  g.q = q.to(at::kCUDA);
  const at::Tensor kv =
      at::empty({t, 2 * hkv, d}, at::TensorOptions(at::kCUDA).dtype(at::kBFloat16));
  g.k = kv.slice(1, 0, hkv);
  g.v = kv.slice(1, hkv, 2 * hkv);
  g.k.copy_(k);
  g.v.copy_(v);
  if (p > 0) {
    g.prefix_k = RandnBf16({p + 9, hkv, d}, gen).to(at::kCUDA).slice(0, 0, p);
    g.prefix_v = RandnBf16({p + 9, hkv, d}, gen).to(at::kCUDA).slice(0, 0, p);
    g.prefix_k.copy_(pk);
    g.prefix_v.copy_(pv);
  }
  g.key_end = (c.int32_key_end ? ends.to(at::kInt) : ends).to(at::kCUDA);
  return g;
}

TreeAttentionOutput Forward(const GpuInputs& g, double scale, const char* hopper) {
  const ScopedEnv env(kForwardEnv, hopper);
  return TreeAttentionForward(g.q, g.k, g.v, g.prefix_k, g.prefix_v, g.key_end, scale);
}

// The backward into views of clones of acc_k0 / acc_v0 (see testing::RunIntoViews): the Hopper
// single kernel twice where it runs (DTA_HOPPER_ATTENTION_BACKWARD_FUSED = 1; else the default),
// the Hopper dQ and dK/dV kernels (the default) and FlashAttention-2 once each.
struct BackwardRuns {
  testing::GradsIntoViews hopper, hopper_again, two_kernels, fa2;
};

BackwardRuns RunBackwards(const GpuInputs& g, const at::Tensor& grad_out,
                          const TreeAttentionOutput& fwd, double scale, const at::Tensor& acc_k0,
                          const at::Tensor& acc_v0) {
  const int64_t prefix = g.prefix_k.defined() ? g.prefix_k.size(0) : 0;
  auto run = [&](const char* hopper, const char* fused) {
    const ScopedEnv env(kBackwardEnv, hopper);
    const ScopedEnv fused_env(kFusedEnv, fused);
    return testing::RunIntoViews(acc_k0, acc_v0, prefix, [&](at::Tensor& gk, at::Tensor& gv) {
      return TreeAttentionBackward(grad_out, g.q, g.k, g.v, g.prefix_k, g.prefix_v, g.key_end,
                                   fwd.out, fwd.lse, scale, gk, gv);
    });
  };
  BackwardRuns runs{run("1", "1"), run("1", "1"), run("1", "0"), run("0", "1")};
  EXPECT_TRUE(testing::BitwiseEqual(runs.hopper, runs.hopper_again))
      << "the Hopper backward is not deterministic";
  EXPECT_TRUE(runs.hopper.neighbours_untouched) << "rows outside the prefix views changed";
  EXPECT_TRUE(runs.two_kernels.neighbours_untouched) << "rows outside the prefix views changed";
  // The single kernel sums dK and dV (and the prefix's gradients) exactly as the dK/dV kernel does;
  // only dQ's order of sums differs.
  EXPECT_TRUE(at::equal(runs.hopper.dk, runs.two_kernels.dk));
  EXPECT_TRUE(at::equal(runs.hopper.dv, runs.two_kernels.dv));
  EXPECT_TRUE(at::equal(runs.hopper.acc_k, runs.two_kernels.acc_k));
  EXPECT_TRUE(at::equal(runs.hopper.acc_v, runs.two_kernels.acc_v));
  return runs;
}

// Relative errors of a's dq, dk, dv against want's, each expected within kTolerance.
struct GradErrors {
  double dq, dk, dv;
};

template <typename Grads>
GradErrors ExpectGradsClose(const testing::GradsIntoViews& a, const Grads& want) {
  const GradErrors e{RelativeError(a.dq, want.dq), RelativeError(a.dk, want.dk),
                     RelativeError(a.dv, want.dv)};
  EXPECT_LE(e.dq, kTolerance);
  EXPECT_LE(e.dk, kTolerance);
  EXPECT_LE(e.dv, kTolerance);
  return e;
}

Case AtHeadDim(int64_t head_dim, Case c) {
  c.head_dim = head_dim;
  return c;
}

void CheckCase(const Case& c, uint64_t seed) {
  SCOPED_TRACE(c.Name());
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const int64_t t = c.tokens, p = c.prefix, d = c.head_dim, hkv = c.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const at::Tensor ends = testing::KeyEndTensor(MakeKeyEnd(c.kind, t, seed));
  const at::Tensor q =
      (RandnBf16({t, c.q_heads, d}, gen).to(at::kFloat) * c.q_std).to(at::kBFloat16);
  const at::Tensor k = RandnBf16({t, hkv, d}, gen);
  const at::Tensor v = RandnBf16({t, hkv, d}, gen);
  const at::Tensor grad_out = RandnBf16({t, c.q_heads, d}, gen);
  const at::Tensor pk = p > 0 ? RandnBf16({p, hkv, d}, gen) : at::Tensor();
  const at::Tensor pv = p > 0 ? RandnBf16({p, hkv, d}, gen) : at::Tensor();

  const at::Device ref_device = t * (t + p) * c.q_heads > (int64_t{1} << 26) ? at::kCUDA : at::kCPU;
  auto f64 = [&](const at::Tensor& x) { return x.defined() ? x.to(ref_device, at::kDouble) : x; };
  const TreeAttentionOutput ref = ReferenceTreeAttentionForward(
      f64(q), f64(k), f64(v), f64(pk), f64(pv), ends.to(ref_device), scale);

  const GpuInputs g = ToGpu(c, q, k, v, pk, pv, ends, gen);
  const TreeAttentionOutput hopper = Forward(g, scale, "1");
  const TreeAttentionOutput fa2 = Forward(g, scale, "0");
  ASSERT_EQ(hopper.out.sizes(), fa2.out.sizes());
  ASSERT_EQ(hopper.out.scalar_type(), at::kBFloat16);
  ASSERT_EQ(hopper.lse.scalar_type(), at::kFloat);
  ASSERT_EQ(hopper.lse.sizes(), (at::IntArrayRef{c.q_heads, t}));
  ASSERT_TRUE(hopper.out.isfinite().all().item<bool>());
  const double out_err = RelativeError(hopper.out, ref.out);
  const double lse_err = MaxAbsDiff(hopper.lse, ref.lse);
  const double fa2_out_err = RelativeError(fa2.out, ref.out);
  const double vs_fa2_out = RelativeError(hopper.out, fa2.out);
  const double vs_fa2_lse = MaxAbsDiff(hopper.lse, fa2.lse);
  EXPECT_LE(out_err, kTolerance);
  EXPECT_LE(lse_err, kLseTolerance);
  EXPECT_LE(vs_fa2_out, kTolerance);
  EXPECT_LE(vs_fa2_lse, kLseTolerance);

  // The backward fed by the Hopper forward's out and lse: Hopper twice, FlashAttention-2 once.
  at::Tensor ref_gpk = p > 0 ? at::zeros({p, hkv, d}, f64(pk).options()) : at::Tensor();
  at::Tensor ref_gpv = p > 0 ? at::zeros({p, hkv, d}, f64(pk).options()) : at::Tensor();
  const TreeAttentionGrads ref_grads = ReferenceTreeAttentionBackward(
      f64(grad_out), f64(q), f64(k), f64(v), f64(pk), f64(pv), ends.to(ref_device), ref.out,
      ref.lse, scale, ref_gpk, ref_gpv);
  const at::Tensor acc_k0 = at::randn({p + 7, hkv, d}, gen, at::kFloat).to(at::kCUDA);
  const at::Tensor acc_v0 = at::randn({p + 7, hkv, d}, gen, at::kFloat).to(at::kCUDA);
  const at::Tensor d_out = grad_out.to(at::kCUDA);
  const BackwardRuns runs = RunBackwards(g, d_out, hopper, scale, acc_k0, acc_v0);
  const testing::GradsIntoViews& hb = runs.hopper;
  ASSERT_EQ(hb.dq.sizes(), q.sizes());
  ASSERT_EQ(hb.dk.sizes(), k.sizes());
  ASSERT_EQ(hb.dv.sizes(), v.sizes());
  ASSERT_EQ(hb.dq.scalar_type(), at::kBFloat16);
  const GradErrors vs_ref = ExpectGradsClose(hb, ref_grads);
  const GradErrors two_vs_ref = ExpectGradsClose(runs.two_kernels, ref_grads);
  const GradErrors fa2_vs_ref = ExpectGradsClose(runs.fa2, ref_grads);
  ExpectGradsClose(hb, runs.fa2);
  double dpk_err = 0, dpv_err = 0;
  if (p > 0) {
    dpk_err = RelativeError(hb.added_k, ref_gpk);
    dpv_err = RelativeError(hb.added_v, ref_gpv);
    EXPECT_LE(dpk_err, kTolerance);
    EXPECT_LE(dpv_err, kTolerance);
    EXPECT_LE(RelativeError(hb.added_k, runs.fa2.added_k), kTolerance);
    EXPECT_LE(RelativeError(hb.added_v, runs.fa2.added_v), kTolerance);
  }
  // Which gradients came out in the FlashAttention-2 kernels' bits (the two sum in the same order,
  // so a change to a kernel's arithmetic shows here first; not required).
  auto same = [](const at::Tensor& a, const at::Tensor& b) { return at::equal(a, b) ? '=' : '~'; };
  std::printf(
      "%-40s hopper out %.2e lse %.2e | fa2 out %.2e | vs fa2 out %.2e lse %.2e | "
      "hopper bwd dq %.2e dk %.2e dv %.2e dpk %.2e dpv %.2e | two kernels dq %.2e | "
      "fa2 bwd dq %.2e dk %.2e | bits vs fa2 dq%c dk%c dv%c pk%c pv%c\n",
      c.Name().c_str(), out_err, lse_err, fa2_out_err, vs_fa2_out, vs_fa2_lse, vs_ref.dq, vs_ref.dk,
      vs_ref.dv, dpk_err, dpv_err, two_vs_ref.dq, fa2_vs_ref.dq, fa2_vs_ref.dk,
      same(hb.dq, runs.fa2.dq), same(hb.dk, runs.fa2.dk), same(hb.dv, runs.fa2.dv),
      same(hb.acc_k, runs.fa2.acc_k), same(hb.acc_v, runs.fa2.acc_v));
}

TEST_F(HopperTreeAttention, SmallChunks) {
  CheckCase({1, 0, 16, 8, TreeKind::kChain}, 1);
  CheckCase({3, 0, 16, 8, TreeKind::kChain}, 2);
  CheckCase({7, 3000, 16, 8, TreeKind::kChain}, 3);
  CheckCase({19, 0, 32, 8, TreeKind::kRandom}, 4);
  CheckCase({19, 3001, 8, 8, TreeKind::kRandom, true}, 5);
  CheckCase({1, 3000, 16, 8, TreeKind::kChain}, 6);
  CheckCase({3, 37, 32, 8, TreeKind::kRandom}, 7);
}

TEST_F(HopperTreeAttention, Chains) {
  CheckCase({733, 0, 16, 8, TreeKind::kChain}, 11);
  CheckCase({733, 3001, 16, 8, TreeKind::kChain}, 13);
  CheckCase({200, 37, 32, 8, TreeKind::kChain}, 14);
  CheckCase({8192, 0, 16, 8, TreeKind::kChain}, 15);
  CheckCase({4099, 0, 32, 8, TreeKind::kChain, true}, 16);
}

// The benchmark's 8K chain with 32 query heads, whose float64 reference would not fit next to the
// kernels: the Hopper forward and backward against the FlashAttention-2 ones only, at each head
// dim.
TEST_F(HopperTreeAttention, LongChainMatchesTheFa2Forward) {
  for (const int64_t d : kHeadDims) {
    at::Generator gen = at::detail::createCPUGenerator(17);
    const int64_t t = 8192;
    Case c{t, 0, 32, 8, TreeKind::kChain};
    c.head_dim = d;
    SCOPED_TRACE(c.Name());
    const at::Tensor ends = testing::KeyEndTensor(MakeKeyEnd(c.kind, t, 17));
    const at::Tensor q = RandnBf16({t, c.q_heads, d}, gen);
    const at::Tensor k = RandnBf16({t, c.kv_heads, d}, gen);
    const at::Tensor v = RandnBf16({t, c.kv_heads, d}, gen);
    const GpuInputs g = ToGpu(c, q, k, v, {}, {}, ends, gen);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    const TreeAttentionOutput hopper = Forward(g, scale, "1");
    const TreeAttentionOutput fa2 = Forward(g, scale, "0");
    const double out_err = RelativeError(hopper.out, fa2.out);
    const double lse_err = MaxAbsDiff(hopper.lse, fa2.lse);
    EXPECT_LE(out_err, kTolerance);
    EXPECT_LE(lse_err, kLseTolerance);
    const at::Tensor d_out = RandnBf16({t, c.q_heads, d}, gen).to(at::kCUDA);
    const at::Tensor acc =  // P = 0: no rows of the accumulators are views
        at::zeros({7, c.kv_heads, d}, at::TensorOptions(at::kCUDA).dtype(at::kFloat));
    const BackwardRuns runs = RunBackwards(g, d_out, hopper, scale, acc, acc);
    const GradErrors vs_fa2 = ExpectGradsClose(runs.hopper, runs.fa2);
    std::printf("%-40s vs fa2 out %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", c.Name().c_str(),
                out_err, lse_err, vs_fa2.dq, vs_fa2.dk, vs_fa2.dv);
  }
}

// Head dim 256 (Qwen3-Next / Qwen3.5 attention layers): the Hopper forward at 64-key tiles and 2
// stages, the backward's head-split kernels (64 x 64 score tiles shared through shared memory,
// each warpgroup half of the gradient's columns), through every shape class of the D = 128 tests.
TEST_F(HopperTreeAttention, HeadDim256) {
  CheckCase(AtHeadDim(256, {1, 0, 16, 8, TreeKind::kChain}), 91);
  CheckCase(AtHeadDim(256, {7, 3000, 16, 2, TreeKind::kChain}), 92);
  CheckCase(AtHeadDim(256, {19, 3001, 8, 8, TreeKind::kRandom, true}), 93);
  CheckCase(AtHeadDim(256, {733, 3001, 16, 8, TreeKind::kChain}), 94);
  CheckCase(AtHeadDim(256, {8192, 0, 16, 2, TreeKind::kChain}), 95);
  CheckCase(AtHeadDim(256, {733, 1000, 32, 8, TreeKind::kRandom, true}), 96);
  CheckCase(AtHeadDim(256, {2100, 700, 14, 2, TreeKind::kRandom}), 97);
  CheckCase(AtHeadDim(256, {2100, 0, 16, 8, TreeKind::kBranches, false, 4.0}), 98);
  CheckCase(AtHeadDim(256, {6007, 1200, 4, 1, TreeKind::kRandom, false, 4.0}), 99);
}

// Head dim 64 (Llama-style small models, Qwen2.5-0.5B's 64-wide heads): the same kernels
// instantiated at D = 64, through every shape class the D = 128 tests cover.
TEST_F(HopperTreeAttention, HeadDim64) {
  CheckCase(AtHeadDim(64, {1, 0, 16, 8, TreeKind::kChain}), 81);
  CheckCase(AtHeadDim(64, {7, 3000, 16, 8, TreeKind::kChain}), 82);
  CheckCase(AtHeadDim(64, {19, 3001, 8, 8, TreeKind::kRandom, true}), 83);
  CheckCase(AtHeadDim(64, {733, 3001, 16, 8, TreeKind::kChain}), 84);
  CheckCase(AtHeadDim(64, {8192, 0, 16, 8, TreeKind::kChain}), 85);
  CheckCase(AtHeadDim(64, {733, 1000, 32, 8, TreeKind::kRandom, true}), 86);
  CheckCase(AtHeadDim(64, {2100, 700, 14, 2, TreeKind::kRandom}), 87);
  CheckCase(AtHeadDim(64, {2100, 0, 16, 8, TreeKind::kBranches, false, 4.0}), 88);
  CheckCase(AtHeadDim(64, {6007, 1200, 8, 2, TreeKind::kRandom, false, 4.0}), 89);
}

TEST_F(HopperTreeAttention, RandomTrees) {
  CheckCase({733, 3000, 8, 8, TreeKind::kRandom}, 22);
  CheckCase({200, 37, 32, 8, TreeKind::kRandom}, 23);
  CheckCase({733, 1000, 32, 8, TreeKind::kRandom, true}, 24);
  CheckCase({2100, 700, 16, 8, TreeKind::kRandom}, 25);
}

TEST_F(HopperTreeAttention, ManyShortBranches) {
  CheckCase({733, 0, 32, 8, TreeKind::kBranches}, 31);
  CheckCase({733, 3000, 8, 8, TreeKind::kBranches}, 33);
  CheckCase({2100, 0, 16, 8, TreeKind::kBranches, false, 4.0}, 34);
}

TEST_F(HopperTreeAttention, PackedTreeSizes) {
  CheckCase({16001, 0, 2, 1, TreeKind::kRandom}, 62);
  CheckCase({6007, 1200, 8, 2, TreeKind::kRandom, false, 4.0}, 65);
  // Hundreds of key-tile CTAs in several waves, eight query heads per kv head: the single kernel's
  // ordered dQ sums across waves.
  CheckCase({16001, 3001, 16, 2, TreeKind::kBranches}, 66);
}

// q = 0: lse_i = log(P + keys visible to i), exact in float32 up to rounding (see
// tree_attention_test.cc): the Hopper kernel's tile walk and mask against the definition.
TEST_F(HopperTreeAttention, LseCountsExactlyTheVisibleKeys) {
  for (const Case& c :
       {Case{733, 0, 4, 2, TreeKind::kRandom}, Case{2100, 700, 16, 8, TreeKind::kBranches},
        Case{16001, 3000, 2, 1, TreeKind::kRandom}, Case{5000, 0, 32, 8, TreeKind::kRandom},
        Case{8192, 0, 16, 8, TreeKind::kChain}, Case{301, 129, 16, 8, TreeKind::kBranches},
        Case{2100, 700, 16, 8, TreeKind::kBranches, false, 1, 64},
        Case{5000, 0, 32, 8, TreeKind::kRandom, false, 1, 64},
        Case{2100, 700, 16, 2, TreeKind::kBranches, false, 1, 256},
        Case{8192, 0, 16, 2, TreeKind::kChain, false, 1, 256},
        Case{301, 129, 16, 8, TreeKind::kBranches, false, 1, 256}}) {
    SCOPED_TRACE(c.Name());
    const std::vector<int64_t> key_end = MakeKeyEnd(c.kind, c.tokens, 70);
    std::vector<double> visible(c.tokens, static_cast<double>(c.prefix));
    for (int64_t j = 0; j < c.tokens; ++j) {
      for (int64_t i = j; i < key_end[j]; ++i) visible[i] += 1;
    }
    std::vector<double> expected(c.tokens);
    for (int64_t i = 0; i < c.tokens; ++i) expected[i] = std::log(visible[i]);
    const at::Tensor want = at::tensor(expected, at::TensorOptions().dtype(at::kDouble))
                                .unsqueeze(0)
                                .expand({c.q_heads, c.tokens});
    at::Generator gen = at::detail::createCPUGenerator(71);
    const at::TensorOptions bf16 = at::TensorOptions(at::kCUDA).dtype(at::kBFloat16);
    const at::Tensor q = at::zeros({c.tokens, c.q_heads, c.head_dim}, bf16);
    const at::Tensor k = RandnBf16({c.tokens, c.kv_heads, c.head_dim}, gen).to(at::kCUDA);
    const at::Tensor v = RandnBf16({c.tokens, c.kv_heads, c.head_dim}, gen).to(at::kCUDA);
    const at::Tensor pk = c.prefix > 0
                              ? RandnBf16({c.prefix, c.kv_heads, c.head_dim}, gen).to(at::kCUDA)
                              : at::Tensor();
    const GpuInputs g{q, k, v, pk, pk, testing::KeyEndTensor(key_end).to(at::kCUDA)};
    const TreeAttentionOutput out =
        Forward(g, 1.0 / std::sqrt(static_cast<double>(c.head_dim)), "1");
    const double err = MaxAbsDiff(out.lse.cpu(), want);
    EXPECT_LE(err, 1e-5);
    std::printf("%-40s lse counts max err %.2e\n", c.Name().c_str(), err);
  }
}

// The switches, one per direction: "0" runs the FlashAttention-2 kernel, anything else (or unset)
// the Hopper one.
TEST_F(HopperTreeAttention, EnvironmentSelectsTheKernel) {
  const at::Tensor q =
      at::zeros({5, 16, kHeadDim}, at::TensorOptions(at::kCUDA).dtype(at::kBFloat16));
  internal::TreeAttentionShape shape;
  shape.tokens = 5;
  shape.q_heads = 16;
  shape.kv_heads = 8;
  shape.head_dim = kHeadDim;
  {
    const ScopedEnv off(kForwardEnv, "0");
    const ScopedEnv on(kBackwardEnv, "1");
    EXPECT_FALSE(internal::UsesHopperForward(shape, q));
    EXPECT_TRUE(internal::UsesHopperBackward(shape, q));
  }
  {
    const ScopedEnv on(kForwardEnv, "1");
    const ScopedEnv off(kBackwardEnv, "0");
    EXPECT_TRUE(internal::UsesHopperForward(shape, q));
    EXPECT_FALSE(internal::UsesHopperBackward(shape, q));
  }
  {
    const ScopedEnv on(kForwardEnv, "1");
    const ScopedEnv on_backward(kBackwardEnv, "1");
    shape.head_dim = 64;
    EXPECT_TRUE(internal::UsesHopperForward(shape, q.narrow(2, 0, 64)));
    EXPECT_TRUE(internal::UsesHopperBackward(shape, q.narrow(2, 0, 64)));
    shape.head_dim = 256;
    const at::Tensor q256 =
        at::zeros({5, 16, 256}, at::TensorOptions(at::kCUDA).dtype(at::kBFloat16));
    EXPECT_TRUE(internal::UsesHopperForward(shape, q256));
    EXPECT_TRUE(internal::UsesHopperBackward(shape, q256));
    const ScopedEnv on_fused(kFusedEnv, "1");
    EXPECT_TRUE(internal::UsesHopperFusedBackward(shape, q256));  // the head-split kernel's
    shape.head_dim = 64;  // the warpgroups split the keys there
    EXPECT_TRUE(internal::UsesHopperFusedBackward(shape, q.narrow(2, 0, 64)));
    shape.head_dim = kHeadDim;
    {
      const ScopedEnv on_fused(kFusedEnv, "1");
      EXPECT_TRUE(internal::UsesHopperFusedBackward(shape, q));
    }
    for (const char* off : {"0", "", "yes"}) {  // opt-in: only "1" selects it
      const ScopedEnv off_fused(kFusedEnv, off);
      EXPECT_FALSE(internal::UsesHopperFusedBackward(shape, q)) << off;
      EXPECT_TRUE(internal::UsesHopperBackward(shape, q));
    }
    shape.head_dim = 96;  // compiled for neither kernel family
    EXPECT_FALSE(internal::UsesHopperForward(shape, q.narrow(2, 0, 96)));
    EXPECT_FALSE(internal::UsesHopperBackward(shape, q.narrow(2, 0, 96)));
  }
}

}  // namespace
}  // namespace dta::kernels

// The CUDA kernels against the float64 reference on the same bf16-rounded inputs: out and the
// gradients within 1e-2 of the reference's largest magnitude, lse within 1e-3; the backward is
// bitwise deterministic; prefix gradients are added into strided views of larger accumulators
// without touching the rows around them. Chains, random forests and 64-leaf trees; T in
// {1, 3, 7, 19, 200, 733, 2100} and whole packed trees of 6007 to 16001 tokens (the float64
// reference then runs on the GPU); P in {0, 37, 700, 1000, 1200, 2500, 3000, 3001}; D in {64, 128,
// 256}; Hq:Hkv 8:8, 16:8, 32:8, 4:2, 2:1, 8:2; diffuse and peaked softmax rows. With q = 0 the
// forward's lse must count exactly the keys each query sees (an exact test of the mask and tile
// skipping). Skipped without a CUDA device or without nvcc at build time. On compute capability 9.x
// builds with the CUTLASS headers, the D = 128 forwards here run the Hopper kernel
// (kernels/hopper/); hopper_tree_attention_test compares it with the FlashAttention-2 forward in
// one process.
#include "kernels/tree_attention.h"

#include <torch/cuda.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "gtest/gtest.h"
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
  int64_t tokens, prefix, q_heads, kv_heads, head_dim;
  TreeKind kind;
  bool int32_key_end = false;
  // Standard deviation of q: 1 gives diffuse softmax rows; 4 gives rows dominated by a few keys,
  // so that a key wrongly skipped or wrongly seen moves the output by much more than rounding.
  double q_std = 1;
  std::string Name() const {
    return "T=" + std::to_string(tokens) + " P=" + std::to_string(prefix) +
           " Hq=" + std::to_string(q_heads) + " Hkv=" + std::to_string(kv_heads) +
           " D=" + std::to_string(head_dim) + " " + testing::TreeKindName(kind) +
           (int32_key_end ? " int32" : "") + (q_std != 1 ? " peaky" : "");
  }
};

class TreeAttentionCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device; the kernels need a GPU";
    const at::Tensor probe =
        at::empty({1, 1, 64}, at::TensorOptions(at::kCUDA).dtype(at::kBFloat16));
    if (!TreeAttentionKernelSupports(probe, probe)) {
      GTEST_SKIP() << "built without nvcc: TreeAttentionKernelSupports is false";
    }
  }
};

at::Tensor RandnBf16(at::IntArrayRef shape, at::Generator& gen) {
  return at::normal(0.0, 1.0, shape, gen, at::TensorOptions().dtype(at::kFloat)).to(at::kBFloat16);
}

double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a.cpu().to(at::kDouble) - b.cpu().to(at::kDouble)).abs().max().item<double>();
}

void CheckCase(const Case& c, uint64_t seed) {
  SCOPED_TRACE(c.Name());
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const int64_t t = c.tokens, p = c.prefix, d = c.head_dim, hkv = c.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const at::TensorOptions cuda = at::TensorOptions(at::kCUDA);
  const at::Tensor ends = testing::KeyEndTensor(MakeKeyEnd(c.kind, t, seed));

  const at::Tensor q =
      (RandnBf16({t, c.q_heads, d}, gen).to(at::kFloat) * c.q_std).to(at::kBFloat16);
  const at::Tensor k = RandnBf16({t, hkv, d}, gen);
  const at::Tensor v = RandnBf16({t, hkv, d}, gen);
  const at::Tensor grad_out = RandnBf16({t, c.q_heads, d}, gen);
  const at::Tensor pk = p > 0 ? RandnBf16({p, hkv, d}, gen) : at::Tensor();
  const at::Tensor pv = p > 0 ? RandnBf16({p, hkv, d}, gen) : at::Tensor();

  // The float64 reference on the same bf16 values; on the GPU for long chunks (its [Hq, T, P + T]
  // scores would take the CPU minutes).
  const at::Device ref_device = t * (t + p) * c.q_heads > (int64_t{1} << 26) ? at::kCUDA : at::kCPU;
  auto f64 = [&](const at::Tensor& x) { return x.defined() ? x.to(ref_device, at::kDouble) : x; };
  const at::TensorOptions ref_options = at::TensorOptions(ref_device).dtype(at::kDouble);
  const TreeAttentionOutput ref = ReferenceTreeAttentionForward(
      f64(q), f64(k), f64(v), f64(pk), f64(pv), ends.to(ref_device), scale);
  at::Tensor ref_gpk = p > 0 ? at::zeros({p, hkv, d}, ref_options) : at::Tensor();
  at::Tensor ref_gpv = p > 0 ? at::zeros({p, hkv, d}, ref_options) : at::Tensor();
  const TreeAttentionGrads ref_grads = ReferenceTreeAttentionBackward(
      f64(grad_out), f64(q), f64(k), f64(v), f64(pk), f64(pv), ends.to(ref_device), ref.out,
      ref.lse, scale, ref_gpk, ref_gpv);

  // GPU operands as the executor lays them out: k and v are head slices of one [T, 2 Hkv, D]
  // projection (row stride 2 Hkv D), the prefix is the head of a larger cache.
  const at::Tensor q_gpu = q.to(at::kCUDA);
  const at::Tensor kv = at::empty({t, 2 * hkv, d}, cuda.dtype(at::kBFloat16));
  const at::Tensor k_gpu = kv.slice(1, 0, hkv);
  const at::Tensor v_gpu = kv.slice(1, hkv, 2 * hkv);
  k_gpu.copy_(k);
  v_gpu.copy_(v);
  at::Tensor pk_gpu, pv_gpu;
  if (p > 0) {
    const at::Tensor cache_k = RandnBf16({p + 9, hkv, d}, gen).to(at::kCUDA);
    const at::Tensor cache_v = RandnBf16({p + 9, hkv, d}, gen).to(at::kCUDA);
    pk_gpu = cache_k.slice(0, 0, p);
    pv_gpu = cache_v.slice(0, 0, p);
    pk_gpu.copy_(pk);
    pv_gpu.copy_(pv);
  }
  const at::Tensor ends_gpu = (c.int32_key_end ? ends.to(at::kInt) : ends).to(at::kCUDA);
  ASSERT_TRUE(TreeAttentionKernelSupports(q_gpu, k_gpu));

  const TreeAttentionOutput fwd =
      TreeAttentionForward(q_gpu, k_gpu, v_gpu, pk_gpu, pv_gpu, ends_gpu, scale);
  ASSERT_EQ(fwd.out.scalar_type(), at::kBFloat16);
  ASSERT_EQ(fwd.lse.scalar_type(), at::kFloat);
  const double out_err = RelativeError(fwd.out, ref.out);
  const double lse_err = MaxAbsDiff(fwd.lse, ref.lse);
  EXPECT_LE(out_err, kTolerance);
  EXPECT_LE(lse_err, kLseTolerance);

  // Accumulators: [P + 7] rows of random float32, the view is rows [3, 3 + P).
  const at::Tensor acc_k0 = at::randn({p + 7, hkv, d}, gen, at::kFloat).to(at::kCUDA);
  const at::Tensor acc_v0 = at::randn({p + 7, hkv, d}, gen, at::kFloat).to(at::kCUDA);
  std::vector<TreeAttentionGrads> runs;
  std::vector<at::Tensor> acc_k, acc_v;
  for (int run = 0; run < 2; ++run) {
    acc_k.push_back(acc_k0.clone());
    acc_v.push_back(acc_v0.clone());
    at::Tensor gk = p > 0 ? acc_k.back().slice(0, 3, 3 + p) : at::Tensor();
    at::Tensor gv = p > 0 ? acc_v.back().slice(0, 3, 3 + p) : at::Tensor();
    runs.push_back(TreeAttentionBackward(grad_out.to(at::kCUDA), q_gpu, k_gpu, v_gpu, pk_gpu,
                                         pv_gpu, ends_gpu, fwd.out, fwd.lse, scale, gk, gv));
  }
  const TreeAttentionGrads& g = runs[0];
  const double dq_err = RelativeError(g.dq, ref_grads.dq);
  const double dk_err = RelativeError(g.dk, ref_grads.dk);
  const double dv_err = RelativeError(g.dv, ref_grads.dv);
  EXPECT_LE(dq_err, kTolerance);
  EXPECT_LE(dk_err, kTolerance);
  EXPECT_LE(dv_err, kTolerance);
  double pk_err = 0, pv_err = 0;
  if (p > 0) {
    pk_err = RelativeError(acc_k[0].slice(0, 3, 3 + p) - acc_k0.slice(0, 3, 3 + p), ref_gpk);
    pv_err = RelativeError(acc_v[0].slice(0, 3, 3 + p) - acc_v0.slice(0, 3, 3 + p), ref_gpv);
    EXPECT_LE(pk_err, kTolerance);
    EXPECT_LE(pv_err, kTolerance);
  }
  for (const at::Tensor* acc : {&acc_k[0], &acc_v[0]}) {
    const at::Tensor& init = acc == &acc_k[0] ? acc_k0 : acc_v0;
    EXPECT_TRUE(at::equal(acc->slice(0, 0, 3), init.slice(0, 0, 3))) << "rows before the view";
    EXPECT_TRUE(at::equal(acc->slice(0, 3 + p), init.slice(0, 3 + p))) << "rows after the view";
  }
  // Deterministic: the second run is bitwise equal.
  EXPECT_TRUE(at::equal(runs[0].dq, runs[1].dq));
  EXPECT_TRUE(at::equal(runs[0].dk, runs[1].dk));
  EXPECT_TRUE(at::equal(runs[0].dv, runs[1].dv));
  EXPECT_TRUE(at::equal(acc_k[0], acc_k[1]));
  EXPECT_TRUE(at::equal(acc_v[0], acc_v[1]));
  std::printf("%-44s out %.2e lse %.2e dq %.2e dk %.2e dv %.2e dpk %.2e dpv %.2e\n",
              c.Name().c_str(), out_err, lse_err, dq_err, dk_err, dv_err, pk_err, pv_err);
}

TEST_F(TreeAttentionCuda, SmallChunks) {
  CheckCase({1, 0, 8, 8, 64, TreeKind::kChain}, 1);
  CheckCase({3, 0, 16, 8, 128, TreeKind::kChain}, 2);
  CheckCase({7, 3000, 16, 8, 128, TreeKind::kChain}, 3);
  CheckCase({19, 0, 32, 8, 64, TreeKind::kRandom}, 4);
  CheckCase({19, 3001, 8, 8, 128, TreeKind::kRandom, true}, 5);
  CheckCase({1, 3000, 16, 8, 128, TreeKind::kChain}, 6);
  CheckCase({3, 37, 32, 8, 64, TreeKind::kRandom}, 7);
}

TEST_F(TreeAttentionCuda, Chains) {
  CheckCase({733, 0, 16, 8, 128, TreeKind::kChain}, 11);
  CheckCase({733, 0, 8, 8, 64, TreeKind::kChain, true}, 12);
  CheckCase({733, 3001, 16, 8, 128, TreeKind::kChain}, 13);
  CheckCase({200, 37, 32, 8, 128, TreeKind::kChain}, 14);
}

TEST_F(TreeAttentionCuda, RandomTrees) {
  CheckCase({733, 0, 16, 8, 64, TreeKind::kRandom}, 21);
  CheckCase({733, 3000, 8, 8, 128, TreeKind::kRandom}, 22);
  CheckCase({200, 37, 32, 8, 128, TreeKind::kRandom}, 23);
  CheckCase({733, 1000, 32, 8, 64, TreeKind::kRandom, true}, 24);
}

TEST_F(TreeAttentionCuda, ManyShortBranches) {
  CheckCase({733, 0, 32, 8, 128, TreeKind::kBranches}, 31);
  CheckCase({733, 1000, 16, 8, 64, TreeKind::kBranches}, 32);
  CheckCase({733, 3000, 8, 8, 128, TreeKind::kBranches}, 33);
}

// ceil(T / 128) * Hq >= 2 * SMs: the forward takes its 128-row query tiles (smaller grids, as in
// every case above, take 64-row tiles).
TEST_F(TreeAttentionCuda, LongChunks) {
  CheckCase({2100, 700, 16, 8, 128, TreeKind::kRandom}, 51);
  CheckCase({2100, 0, 16, 8, 64, TreeKind::kBranches}, 52);
  CheckCase({2100, 0, 32, 8, 128, TreeKind::kChain, true}, 53);
}

// Qwen3-Next / Qwen3.5's attention head dim: 64-row forward tiles, dK/dV split over 8 warps along
// D (tree_attention_kernel.cuh's Tiles<256>). Odd lengths, GQA, prefixes, int32 key_end, peaked
// rows.
TEST_F(TreeAttentionCuda, HeadDim256) {
  CheckCase({1, 0, 8, 8, 256, TreeKind::kChain}, 81);
  CheckCase({3, 37, 4, 2, 256, TreeKind::kRandom}, 82);
  CheckCase({19, 3001, 16, 2, 256, TreeKind::kRandom, true}, 83);
  CheckCase({7, 3000, 8, 8, 256, TreeKind::kChain}, 84);
  CheckCase({733, 0, 16, 8, 256, TreeKind::kChain}, 85);
  CheckCase({733, 1000, 8, 2, 256, TreeKind::kRandom, true}, 86);
  CheckCase({733, 3000, 8, 8, 256, TreeKind::kBranches, false, 4.0}, 87);
  CheckCase({200, 37, 32, 8, 256, TreeKind::kRandom}, 88);
  CheckCase({2100, 700, 16, 2, 256, TreeKind::kBranches}, 89);
  CheckCase({6007, 1200, 4, 1, 256, TreeKind::kRandom, false, 4.0}, 90);
}

// The sizes of whole packed trees (Tree Training's micro-batches, dta's packed subtrees): tens of
// thousands of DFS-ordered tokens in one chunk.
TEST_F(TreeAttentionCuda, PackedTreeSizes) {
  CheckCase({12289, 0, 4, 2, 64, TreeKind::kBranches}, 61);
  CheckCase({16001, 0, 2, 1, 128, TreeKind::kRandom}, 62);
  CheckCase({9001, 2500, 4, 2, 64, TreeKind::kRandom, true}, 63);
  CheckCase({12289, 0, 4, 2, 64, TreeKind::kBranches, false, 4.0}, 64);
  CheckCase({6007, 1200, 8, 2, 128, TreeKind::kRandom, false, 4.0}, 65);
}

// With q = 0 every visible key scores 0, so lse_i = log(P + keys visible to i in the chunk) in
// float32: one key wrongly skipped or wrongly seen among thousands moves it by far more than
// float32 rounding. Exact mask coverage of the forward's tile skipping at every size.
TEST_F(TreeAttentionCuda, LseCountsExactlyTheVisibleKeys) {
  for (const Case& c :
       {Case{733, 0, 4, 2, 64, TreeKind::kRandom}, Case{2100, 700, 16, 8, 128, TreeKind::kBranches},
        Case{12289, 0, 4, 2, 64, TreeKind::kBranches},
        Case{16001, 3000, 2, 1, 128, TreeKind::kRandom},
        Case{5000, 0, 32, 8, 128, TreeKind::kRandom},
        Case{2100, 700, 8, 2, 256, TreeKind::kBranches},
        Case{4001, 0, 4, 4, 256, TreeKind::kRandom}}) {
    SCOPED_TRACE(c.Name());
    const std::vector<int64_t> key_end = MakeKeyEnd(c.kind, c.tokens, 70);
    std::vector<double> visible(c.tokens, static_cast<double>(c.prefix));
    for (int64_t j = 0; j < c.tokens; ++j) {
      for (int64_t i = j; i < key_end[j]; ++i) visible[i] += 1;
    }
    const at::TensorOptions cuda = at::TensorOptions(at::kCUDA).dtype(at::kBFloat16);
    at::Generator gen = at::detail::createCPUGenerator(71);
    const at::Tensor q = at::zeros({c.tokens, c.q_heads, c.head_dim}, cuda);
    const at::Tensor k = RandnBf16({c.tokens, c.kv_heads, c.head_dim}, gen).to(at::kCUDA);
    const at::Tensor pk = c.prefix > 0
                              ? RandnBf16({c.prefix, c.kv_heads, c.head_dim}, gen).to(at::kCUDA)
                              : at::Tensor();
    const TreeAttentionOutput fwd =
        TreeAttentionForward(q, k, k, pk, pk, testing::KeyEndTensor(key_end).to(at::kCUDA),
                             1.0 / std::sqrt(static_cast<double>(c.head_dim)));
    const at::Tensor expected =
        at::log(at::tensor(visible, at::TensorOptions().dtype(at::kDouble)));
    const double err =
        (fwd.lse.cpu().to(at::kDouble) - expected.unsqueeze(0)).abs().max().item<double>();
    EXPECT_LE(err, 1e-5) << "a key was skipped or seen wrongly";
  }
}

TEST_F(TreeAttentionCuda, UnsupportedInputsFallBackToTheReference) {
  at::Generator gen = at::detail::createCPUGenerator(41);
  const at::Tensor q = at::randn({7, 4, 32}, gen, at::kFloat).to(at::kCUDA);
  const at::Tensor k = at::randn({7, 2, 32}, gen, at::kFloat).to(at::kCUDA);
  const at::Tensor ends = testing::KeyEndTensor(MakeKeyEnd(TreeKind::kRandom, 7, 41)).to(at::kCUDA);
  EXPECT_FALSE(TreeAttentionKernelSupports(q, k));
  const TreeAttentionOutput fwd = TreeAttentionForward(q, k, k, {}, {}, ends, 0.3);
  const TreeAttentionOutput ref =
      ReferenceTreeAttentionForward(q.cpu().to(at::kDouble), k.cpu().to(at::kDouble),
                                    k.cpu().to(at::kDouble), {}, {}, ends.cpu(), 0.3);
  EXPECT_LE(RelativeError(fwd.out, ref.out), 1e-5);
}

}  // namespace
}  // namespace dta::kernels

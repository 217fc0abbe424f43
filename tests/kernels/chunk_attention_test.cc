// kernels/chunk_attention: the log-sum-exp split of a chunk's attention into its prefix part and
// its own part gives what one pass over all keys gives.
//   - CPU, float64 (AttentionPath::kSplit runs the parts' exact ATen code): output and every
//     gradient (q, k, v and the prefix's K/V, added into accumulators that already hold values)
//     equal the tree-attention reference to 1e-12, on one-token chunks, one-row prefixes, chains
//     and trees, grouped-query shapes, and with no accumulators (the prefix's gradient dropped).
//   - MergeAttention: a part that saw nothing (lse -inf) leaves the other whole; bad shapes named.
//   - GPU, bf16 (kSplit: cuDNN for the prefix, cuDNN or tree kernels for the chunk): within 1e-2 of
//     the float64 reference's largest magnitude (the tree kernels' bar), and the split really ran;
//     the CUDA merge equals the ATen merge to float32 rounding.
#include "kernels/chunk_attention.h"

#include <torch/cuda.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/chain_attention.h"
#include "kernels/tree_attention_reference.h"
#include "tests/kernels/tree_attention_testing.h"

namespace dta::kernels {
namespace {

using testing::RelativeError;

struct Case {
  int64_t tokens, prefix, q_heads, kv_heads, dim;
  testing::TreeKind tree;
  bool accumulators = true;
};

std::string Name(const Case& c) {
  return "T " + std::to_string(c.tokens) + " P " + std::to_string(c.prefix) + " Hq " +
         std::to_string(c.q_heads) + " Hkv " + std::to_string(c.kv_heads) + " D " +
         std::to_string(c.dim) + " " + testing::TreeKindName(c.tree) +
         (c.accumulators ? "" : " without accumulators");
}

struct Inputs {
  at::Tensor q, k, v, prefix_k, prefix_v, key_end, grad_out;
};

Inputs MakeInputs(const Case& c, at::TensorOptions options) {
  at::manual_seed(c.tokens * 131 + c.prefix);
  Inputs in;
  in.q = at::randn({c.tokens, c.q_heads, c.dim}, options);
  // k and v as the model has them: views into one projection's output.
  const at::Tensor kv = at::randn({c.tokens, 2 * c.kv_heads, c.dim}, options);
  in.k = kv.slice(1, 0, c.kv_heads);
  in.v = kv.slice(1, c.kv_heads);
  // The prefix as the executor has it: the first rows of a longer stack.
  const at::Tensor stack_k = at::randn({c.prefix + 5, c.kv_heads, c.dim}, options);
  const at::Tensor stack_v = at::randn({c.prefix + 5, c.kv_heads, c.dim}, options);
  in.prefix_k = stack_k.slice(0, 0, c.prefix);
  in.prefix_v = stack_v.slice(0, 0, c.prefix);
  if (c.tree != testing::TreeKind::kChain) {
    in.key_end =
        at::tensor(testing::MakeKeyEnd(c.tree, c.tokens, 7), at::kLong).to(options.device());
  }
  in.grad_out = at::randn({c.tokens, c.q_heads, c.dim}, options);
  return in;
}

// Runs ChunkAttention forward and backward and checks it against the float64 reference.
void ExpectMatchesReference(const Case& c, at::TensorOptions options, AttentionPath path,
                            double tolerance, bool expect_split) {
  const std::string name = Name(c);
  const Inputs in = MakeInputs(c, options);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
  const ChunkAttentionResult fwd = ChunkAttentionForward(in.q, in.k, in.v, in.prefix_k, in.prefix_v,
                                                         in.key_end, scale, {.path = path});
  if (expect_split) {
    EXPECT_NE(fwd.saved.path, 0) << name << ": the split did not run";
  }
  // The accumulators already hold something: the prefix's gradient is added to it.
  const at::TensorOptions acc =
      options.dtype(options.dtype().toScalarType() == at::kDouble ? at::kDouble : at::kFloat);
  const at::Tensor initial = at::randn({c.prefix, c.kv_heads, c.dim}, acc);
  at::Tensor grad_prefix_k, grad_prefix_v;
  if (c.accumulators) {
    grad_prefix_k = initial.clone();
    grad_prefix_v = initial.clone() * 2;
  }
  const TreeAttentionGrads g =
      ChunkAttentionBackward(in.grad_out, in.q, in.k, in.v, in.prefix_k, in.prefix_v, in.key_end,
                             fwd.saved, scale, grad_prefix_k, grad_prefix_v);

  auto f64 = [](const at::Tensor& t) { return t.to(at::kDouble); };
  const at::Tensor key_end =
      in.key_end.defined() ? in.key_end : at::full({c.tokens}, c.tokens, options.dtype(at::kLong));
  const TreeAttentionOutput ref = ReferenceTreeAttentionForward(
      f64(in.q), f64(in.k), f64(in.v), f64(in.prefix_k), f64(in.prefix_v), key_end, scale);
  at::Tensor ref_prefix_k = f64(initial).clone();  // to(kDouble) of a double tensor is itself
  at::Tensor ref_prefix_v = f64(initial) * 2;
  const TreeAttentionGrads ref_grads = ReferenceTreeAttentionBackward(
      f64(in.grad_out), f64(in.q), f64(in.k), f64(in.v), f64(in.prefix_k), f64(in.prefix_v),
      key_end, ref.out, ref.lse, scale, ref_prefix_k, ref_prefix_v);
  EXPECT_EQ(fwd.out.sizes(), in.q.sizes()) << name;
  EXPECT_EQ(g.dk.sizes(), in.k.sizes()) << name;
  EXPECT_LT(RelativeError(fwd.out, ref.out), tolerance) << name;
  EXPECT_LT(RelativeError(g.dq, ref_grads.dq), tolerance) << name;
  EXPECT_LT(RelativeError(g.dk, ref_grads.dk), tolerance) << name;
  EXPECT_LT(RelativeError(g.dv, ref_grads.dv), tolerance) << name;
  if (c.accumulators) {
    // Compared as the part added, so that the initial values do not hide its error.
    EXPECT_LT(RelativeError(grad_prefix_k - initial, ref_prefix_k - f64(initial)), tolerance)
        << name;
    EXPECT_LT(RelativeError(grad_prefix_v - initial * 2, ref_prefix_v - f64(initial) * 2),
              tolerance)
        << name;
  }
}

TEST(ChunkAttention, SplitEqualsOnePassInFloat64) {
  using testing::TreeKind;
  for (const Case& c : std::vector<Case>{{1, 1, 2, 1, 8, TreeKind::kChain},
                                         {1, 9, 4, 2, 8, TreeKind::kChain},
                                         {6, 1, 2, 2, 16, TreeKind::kChain},
                                         {13, 7, 4, 2, 16, TreeKind::kChain},
                                         {13, 7, 4, 1, 16, TreeKind::kRandom},
                                         {40, 21, 4, 2, 8, TreeKind::kBranches},
                                         {40, 21, 4, 4, 8, TreeKind::kRandom},
                                         {17, 5, 4, 2, 8, TreeKind::kRandom, false}}) {
    ExpectMatchesReference(c, at::TensorOptions().dtype(at::kDouble), AttentionPath::kSplit, 1e-12,
                           /*expect_split=*/true);
  }
}

TEST(ChunkAttention, TreePathAndShortPrefixesRunTreeAttention) {
  const Case c{9, 4, 2, 1, 8, testing::TreeKind::kRandom};
  const Inputs in = MakeInputs(c, at::TensorOptions().dtype(at::kDouble));
  EXPECT_EQ(ChunkAttentionForward(in.q, in.k, in.v, in.prefix_k, in.prefix_v, in.key_end, 0.5,
                                  {.path = AttentionPath::kTree})
                .saved.path,
            0);
  // kAuto on the CPU: cuDNN never takes it.
  EXPECT_EQ(
      ChunkAttentionForward(in.q, in.k, in.v, in.prefix_k, in.prefix_v, in.key_end, 0.5).saved.path,
      0);
  ExpectMatchesReference(c, at::TensorOptions().dtype(at::kDouble), AttentionPath::kAuto, 1e-12,
                         /*expect_split=*/false);
}

TEST(ChunkAttention, MergeKeepsAPartThatSawNothingOut) {
  const at::TensorOptions f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor out_a = at::randn({3, 2, 4}, f64);
  const at::Tensor out_b = at::randn({3, 2, 4}, f64);
  const at::Tensor lse_b = at::randn({2, 3}, f64);
  const at::Tensor nothing = at::full({2, 3}, -std::numeric_limits<double>::infinity(), f64);
  const TreeAttentionOutput merged = MergeAttention(out_a, nothing, out_b, lse_b);
  EXPECT_TRUE(at::allclose(merged.out, out_b, 0, 1e-15));
  EXPECT_TRUE(at::allclose(merged.lse, lse_b, 0, 1e-15));
  // Equal log-sum-exps: the mean.
  const TreeAttentionOutput halves = MergeAttention(out_a, lse_b, out_b, lse_b);
  EXPECT_TRUE(at::allclose(halves.out, (out_a + out_b) / 2, 0, 1e-15));
  EXPECT_TRUE(at::allclose(halves.lse, lse_b + std::log(2.0), 0, 1e-15));
  try {
    MergeAttention(out_a, lse_b.t(), out_b, lse_b);
    ADD_FAILURE() << "a transposed log-sum-exp was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("MergeAttention"), std::string::npos) << e.what();
  }
}

class ChunkAttentionCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
    const at::Tensor probe =
        at::zeros({4, 2, 64}, at::TensorOptions(at::kCUDA).dtype(at::kBFloat16));
    if (!ChainAttentionSupports(probe, probe)) GTEST_SKIP() << "cuDNN attention is not available";
  }
};

TEST_F(ChunkAttentionCuda, SplitMatchesTheReference) {
  using testing::TreeKind;
  const at::TensorOptions bf16 = at::TensorOptions(at::kCUDA).dtype(at::kBFloat16);
  for (const Case& c : std::vector<Case>{{2, kMinSplitPrefix, 8, 8, 128, TreeKind::kChain},
                                         {333, 1000, 16, 8, 128, TreeKind::kChain},
                                         {333, 1000, 16, 8, 128, TreeKind::kRandom},
                                         {700, 2500, 32, 8, 128, TreeKind::kBranches},
                                         {129, 300, 4, 2, 64, TreeKind::kRandom},
                                         {64, 200, 4, 4, 64, TreeKind::kChain, false}}) {
    ExpectMatchesReference(c, bf16, AttentionPath::kSplit, 1e-2, /*expect_split=*/true);
  }
  ASSERT_FALSE(CudnnAttentionFailed()) << "cuDNN failed: the tree fallback ran instead";
}

// kAuto's policy: a causal chain of kMinSplitChain tokens splits off even a short prefix (a long
// rollout after its shared prompt); a shorter chain or a tree on a short prefix does not, and
// DTA_CUDNN_PREFIX=0 turns the split off.
TEST_F(ChunkAttentionCuda, AutoSplitsLongChainsOnAnyPrefix) {
  using testing::TreeKind;
  const at::TensorOptions bf16 = at::TensorOptions(at::kCUDA).dtype(at::kBFloat16);
  ASSERT_EQ(unsetenv("DTA_CUDNN_PREFIX"), 0);
  const Case long_chain{kMinSplitChain, 100, 4, 2, 128, TreeKind::kChain};
  ExpectMatchesReference(long_chain, bf16, AttentionPath::kAuto, 1e-2, /*expect_split=*/true);
  auto path_of = [&](const Case& c) {
    const Inputs in = MakeInputs(c, bf16);
    return ChunkAttentionForward(in.q, in.k, in.v, in.prefix_k, in.prefix_v, in.key_end, 0.1)
        .saved.path;
  };
  EXPECT_EQ(path_of({kMinSplitChain - 1, 100, 4, 2, 128, TreeKind::kChain}), 0);
  EXPECT_EQ(path_of({kMinSplitChain, 100, 4, 2, 128, TreeKind::kRandom}), 0);
  ASSERT_EQ(setenv("DTA_CUDNN_PREFIX", "0", 1), 0);
  EXPECT_EQ(path_of(long_chain), 0);
  ASSERT_EQ(setenv("DTA_CUDNN_PREFIX", "1", 1), 0);
  EXPECT_NE(path_of({kMinSplitChain - 1, kMinSplitPrefix, 4, 2, 128, TreeKind::kRandom}), 0);
  ASSERT_EQ(unsetenv("DTA_CUDNN_PREFIX"), 0);
  ASSERT_FALSE(CudnnAttentionFailed()) << "cuDNN failed: the tree fallback ran instead";
}

TEST_F(ChunkAttentionCuda, CudaMergeEqualsTheAtenMerge) {
  const at::TensorOptions f32 = at::TensorOptions(at::kCUDA).dtype(at::kFloat);
  const at::Tensor out_a = at::randn({37, 6, 128}, f32);
  const at::Tensor out_b = at::randn({37, 6, 128}, f32);
  const at::Tensor lse_a = at::randn({6, 37}, f32) * 4;
  const at::Tensor lse_b = at::randn({6, 37}, f32) * 4;
  const TreeAttentionOutput gpu =
      MergeAttention(out_a.to(at::kBFloat16), lse_a, out_b.to(at::kBFloat16), lse_b);
  const TreeAttentionOutput cpu =
      MergeAttention(out_a.to(at::kBFloat16).cpu().to(at::kDouble), lse_a.cpu().to(at::kDouble),
                     out_b.to(at::kBFloat16).cpu().to(at::kDouble), lse_b.cpu().to(at::kDouble));
  EXPECT_EQ(gpu.out.scalar_type(), at::kBFloat16);
  // One bf16 rounding of the output, float32 arithmetic for the log-sum-exp.
  EXPECT_LT(RelativeError(gpu.out, cpu.out), 1e-2);
  EXPECT_LT((gpu.lse.cpu().to(at::kDouble) - cpu.lse).abs().max().item<double>(), 1e-5);
}

}  // namespace
}  // namespace dta::kernels

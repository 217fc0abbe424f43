// kernels/chain_attention (cuDNN's fused attention for causal chains without a prefix) against the
// float64 tree-attention reference on the same bf16 inputs, with a chain mask: out and every
// gradient within 1e-2 of the reference's largest magnitude (the tree kernels' bar), for odd
// lengths, grouped-query shapes (1:1, 2:1, 4:1), head dims 64 and 128, and gradients of k and v
// that sum each group's query heads. ChainAttentionSupports refuses the CPU, float32, one token
// (cuDNN's backward refuses it), head dims above 128 and Hq not a multiple of Hkv. Skipped without
// a CUDA device or where cuDNN attention does not run (said in the skip message).
#include "kernels/chain_attention.h"

#include <torch/cuda.h>

#include <cmath>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/tree_attention_reference.h"
#include "tests/kernels/tree_attention_testing.h"

namespace dta::kernels {
namespace {

using testing::RelativeError;

TEST(ChainAttention, SupportsOnlyWhatCudnnTakes) {
  const at::Tensor cpu = at::zeros({4, 2, 64}, at::kBFloat16);
  EXPECT_FALSE(ChainAttentionSupports(cpu, cpu));
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device for the rest";
  const at::TensorOptions cuda = at::TensorOptions(at::kCUDA);
  EXPECT_FALSE(ChainAttentionSupports(at::zeros({4, 2, 64}, cuda.dtype(at::kFloat)),
                                      at::zeros({4, 2, 64}, cuda.dtype(at::kFloat))));
  EXPECT_FALSE(ChainAttentionSupports(at::zeros({4, 2, 256}, cuda.dtype(at::kBFloat16)),
                                      at::zeros({4, 2, 256}, cuda.dtype(at::kBFloat16))));
  EXPECT_FALSE(ChainAttentionSupports(at::zeros({4, 3, 64}, cuda.dtype(at::kBFloat16)),
                                      at::zeros({4, 2, 64}, cuda.dtype(at::kBFloat16))));
  EXPECT_FALSE(ChainAttentionSupports(at::zeros({1, 2, 64}, cuda.dtype(at::kBFloat16)),
                                      at::zeros({1, 2, 64}, cuda.dtype(at::kBFloat16))));
}

TEST(ChainAttentionCuda, MatchesTheReference) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  struct Case {
    int64_t tokens, q_heads, kv_heads, dim;
  };
  for (const Case& c : std::vector<Case>{{2, 8, 8, 128},
                                         {7, 16, 8, 128},
                                         {200, 32, 8, 128},
                                         {733, 4, 2, 64},
                                         {2100, 16, 8, 128}}) {
    const std::string name = "T " + std::to_string(c.tokens) + " Hq " + std::to_string(c.q_heads) +
                             " Hkv " + std::to_string(c.kv_heads) + " D " + std::to_string(c.dim);
    at::manual_seed(c.tokens);
    const at::TensorOptions bf16 = at::TensorOptions(at::kCUDA).dtype(at::kBFloat16);
    const at::Tensor q = at::randn({c.tokens, c.q_heads, c.dim}, bf16);
    // k and v as the model has them: views into one projection's output.
    const at::Tensor kv = at::randn({c.tokens, 2 * c.kv_heads, c.dim}, bf16);
    const at::Tensor k = kv.slice(1, 0, c.kv_heads);
    const at::Tensor v = kv.slice(1, c.kv_heads);
    const at::Tensor grad_out = at::randn({c.tokens, c.q_heads, c.dim}, bf16);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
    if (!ChainAttentionSupports(q, k)) GTEST_SKIP() << "cuDNN attention is not available here";
    ChainAttentionOutput fwd;
    try {
      fwd = ChainAttentionForward(q, k, v, scale);
    } catch (const c10::Error& e) {
      GTEST_SKIP() << "cuDNN attention does not run here: " << e.what();
    }
    const TreeAttentionGrads grads = ChainAttentionBackward(grad_out, q, k, v, fwd, scale);

    auto f64 = [](const at::Tensor& t) { return t.to(at::kDouble); };
    const at::Tensor chain =
        at::full({c.tokens}, c.tokens, at::TensorOptions(at::kCUDA).dtype(at::kLong));
    const TreeAttentionOutput ref = ReferenceTreeAttentionForward(
        f64(q), f64(k), f64(v), at::Tensor(), at::Tensor(), chain, scale);
    at::Tensor none_k, none_v;
    const TreeAttentionGrads ref_grads = ReferenceTreeAttentionBackward(
        f64(grad_out), f64(q), f64(k), f64(v), at::Tensor(), at::Tensor(), chain, ref.out, ref.lse,
        scale, none_k, none_v);
    EXPECT_EQ(fwd.out.sizes(), q.sizes()) << name;
    EXPECT_EQ(grads.dk.sizes(), k.sizes()) << name;
    EXPECT_LT(RelativeError(fwd.out, ref.out), 1e-2) << name;
    EXPECT_LT(RelativeError(grads.dq, ref_grads.dq), 1e-2) << name;
    EXPECT_LT(RelativeError(grads.dk, ref_grads.dk), 1e-2) << name;
    EXPECT_LT(RelativeError(grads.dv, ref_grads.dv), 1e-2) << name;
  }
}

}  // namespace
}  // namespace dta::kernels

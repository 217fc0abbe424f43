// The contract of the reference: forward (out, lse) and backward (dq, dk, dv, and prefix
// gradients added into accumulators) equal plain ATen autograd over the definition of tree
// attention, in float64, to 1e-12 relative, for chains, random forests and branchy trees, with
// and without a prefix, with and without grouped-query heads.
#include "kernels/tree_attention_reference.h"

#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/tree_attention.h"
#include "tests/kernels/tree_attention_testing.h"

namespace dta::kernels {
namespace {

using testing::MakeKeyEnd;
using testing::NaiveMask;
using testing::RelativeError;
using testing::TreeKind;

constexpr double kTolerance = 1e-12;
// The log-sum-exp goes through exp and log, whose float64 CPU kernels differ between machines
// (9e-11 relative was seen on the GPU machines' CPUs, 1e-16 here): a looser, still float64 bound.
constexpr double kLseTolerance = 1e-9;

struct Case {
  int64_t tokens, prefix, q_heads, kv_heads, head_dim;
  TreeKind kind;
  std::string Name() const {
    return "T=" + std::to_string(tokens) + " P=" + std::to_string(prefix) +
           " Hq=" + std::to_string(q_heads) + " Hkv=" + std::to_string(kv_heads) +
           " D=" + std::to_string(head_dim) + " " + testing::TreeKindName(kind);
  }
};

at::Tensor Randn(at::IntArrayRef shape, at::Generator& gen) {
  return at::normal(0.0, 1.0, shape, gen, at::TensorOptions().dtype(at::kDouble));
}

// out and lse of the definition, differentiable: keys and values are repeated per query head,
// the mask is built entry by entry.
std::pair<at::Tensor, at::Tensor> Definition(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& pk,
                                             const at::Tensor& pv,
                                             const std::vector<int64_t>& key_end, double scale) {
  const int64_t group = q.size(1) / k.size(1);
  const at::Tensor keys = (pk.defined() ? at::cat({pk, k}) : k).repeat_interleave(group, 1);
  const at::Tensor values = (pv.defined() ? at::cat({pv, v}) : v).repeat_interleave(group, 1);
  const int64_t prefix = pk.defined() ? pk.size(0) : 0;
  at::Tensor scores = at::einsum("thd,lhd->htl", {q, keys}) * scale;
  scores = scores.masked_fill(NaiveMask(key_end, prefix).logical_not().unsqueeze(0),
                              -std::numeric_limits<double>::infinity());
  const at::Tensor lse = at::logsumexp(scores, -1);
  const at::Tensor out = at::einsum("htl,lhd->thd", {at::softmax(scores, -1), values});
  return {out, lse};
}

void CheckCase(const Case& c, uint64_t seed) {
  SCOPED_TRACE(c.Name());
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const int64_t t = c.tokens, p = c.prefix, d = c.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const std::vector<int64_t> key_end = MakeKeyEnd(c.kind, t, seed);
  const at::Tensor q = Randn({t, c.q_heads, d}, gen).requires_grad_(true);
  const at::Tensor k = Randn({t, c.kv_heads, d}, gen).requires_grad_(true);
  const at::Tensor v = Randn({t, c.kv_heads, d}, gen).requires_grad_(true);
  at::Tensor pk, pv;
  if (p > 0) {
    pk = Randn({p, c.kv_heads, d}, gen).requires_grad_(true);
    pv = Randn({p, c.kv_heads, d}, gen).requires_grad_(true);
  }
  const auto [out, lse] = Definition(q, k, v, pk, pv, key_end, scale);
  const at::Tensor grad_out = Randn({t, c.q_heads, d}, gen);
  std::vector<at::Tensor> inputs = {q, k, v};
  if (p > 0) inputs.insert(inputs.end(), {pk, pv});
  const std::vector<at::Tensor> grads =
      torch::autograd::grad({out}, inputs, {grad_out}, /*retain_graph=*/false);

  const at::Tensor ends = testing::KeyEndTensor(key_end);
  const at::Tensor qd = q.detach(), kd = k.detach(), vd = v.detach();
  const at::Tensor pkd = p > 0 ? pk.detach() : at::Tensor();
  const at::Tensor pvd = p > 0 ? pv.detach() : at::Tensor();
  const TreeAttentionOutput ref = ReferenceTreeAttentionForward(qd, kd, vd, pkd, pvd, ends, scale);
  EXPECT_LE(RelativeError(ref.out, out.detach()), kTolerance);
  EXPECT_LE(RelativeError(ref.lse, lse.detach()), kLseTolerance);
  EXPECT_EQ(ref.lse.scalar_type(), at::kDouble);

  // Accumulators start nonzero: the prefix gradients must be added.
  const at::Tensor gpk0 = p > 0 ? Randn({p, c.kv_heads, d}, gen) : at::Tensor();
  const at::Tensor gpv0 = p > 0 ? Randn({p, c.kv_heads, d}, gen) : at::Tensor();
  at::Tensor gpk = p > 0 ? gpk0.clone() : at::Tensor();
  at::Tensor gpv = p > 0 ? gpv0.clone() : at::Tensor();
  const TreeAttentionGrads g = ReferenceTreeAttentionBackward(grad_out, qd, kd, vd, pkd, pvd, ends,
                                                              ref.out, ref.lse, scale, gpk, gpv);
  EXPECT_LE(RelativeError(g.dq, grads[0]), kTolerance);
  EXPECT_LE(RelativeError(g.dk, grads[1]), kTolerance);
  EXPECT_LE(RelativeError(g.dv, grads[2]), kTolerance);
  if (p > 0) {
    EXPECT_LE(RelativeError(gpk - gpk0, grads[3]), kTolerance);
    EXPECT_LE(RelativeError(gpv - gpv0, grads[4]), kTolerance);
  }
}

TEST(TreeAttentionReference, MatchesAutogradOfTheDefinition) {
  uint64_t seed = 1;
  for (const int64_t tokens : {1, 3, 7, 19, 200}) {
    for (const int64_t prefix : {0, 5, 300}) {
      for (const auto& [q_heads, kv_heads] : {std::pair<int64_t, int64_t>{4, 1}, {2, 2}}) {
        for (const int64_t head_dim : {16, 64}) {
          for (const TreeKind kind : {TreeKind::kChain, TreeKind::kRandom}) {
            CheckCase({tokens, prefix, q_heads, kv_heads, head_dim, kind}, seed++);
          }
        }
      }
    }
  }
}

TEST(TreeAttentionReference, BranchyTreeWithPrefix) {
  CheckCase({200, 37, 4, 2, 16, TreeKind::kBranches}, 7);
}

// Enough query rows and keys that the reference runs in several blocks of rows (about 4M scores
// each: here 551 rows of 4 heads x 1,900 keys, the last block shorter), each over only the keys its
// rows may see, and sums dK and dV across them.
TEST(TreeAttentionReference, BlocksOfQueryRowsMatchTheDefinition) {
  CheckCase({1500, 400, 4, 2, 8, TreeKind::kBranches}, 11);
  CheckCase({1500, 0, 4, 4, 8, TreeKind::kChain}, 12);
}

TEST(TreeAttentionReference, MaskMatchesDefinition) {
  for (const TreeKind kind : {TreeKind::kChain, TreeKind::kRandom, TreeKind::kBranches}) {
    const std::vector<int64_t> key_end = MakeKeyEnd(kind, 97, 3);
    const at::Tensor ends = testing::KeyEndTensor(key_end);
    EXPECT_TRUE(at::equal(TreeAttentionMask(ends, 11), NaiveMask(key_end, 11)));
    EXPECT_TRUE(at::equal(TreeAttentionMask(ends.to(at::kInt), 0), NaiveMask(key_end, 0)));
  }
}

TEST(TreeAttentionReference, Float32InputsComputeInFloat32) {
  at::Generator gen = at::detail::createCPUGenerator(5);
  const at::Tensor q = Randn({7, 2, 8}, gen).to(at::kFloat);
  const at::Tensor k = Randn({7, 1, 8}, gen).to(at::kFloat);
  const at::Tensor ends = testing::KeyEndTensor(MakeKeyEnd(TreeKind::kRandom, 7, 5));
  const TreeAttentionOutput fwd = TreeAttentionForward(q, k, k, {}, {}, ends, 0.5);
  EXPECT_EQ(fwd.out.scalar_type(), at::kFloat);
  EXPECT_EQ(fwd.lse.scalar_type(), at::kFloat);
  EXPECT_FALSE(TreeAttentionKernelSupports(q, k));
}

TEST(TreeAttentionReference, RejectsBadInputs) {
  const at::TensorOptions f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor q = at::zeros({3, 4, 8}, f64);
  const at::Tensor k = at::zeros({3, 2, 8}, f64);
  const at::Tensor ends = at::full({3}, 3, at::TensorOptions().dtype(at::kLong));
  EXPECT_THROW(ReferenceTreeAttentionForward(q, at::zeros({3, 3, 8}, f64),
                                             at::zeros({3, 3, 8}, f64), {}, {}, ends, 1.0),
               c10::Error);  // Hq not a multiple of Hkv
  EXPECT_THROW(ReferenceTreeAttentionForward(q, k, k, {}, {}, ends.slice(0, 0, 2), 1.0),
               c10::Error);  // key_end of the wrong length
  EXPECT_THROW(ReferenceTreeAttentionForward(q, k, k, {}, {}, ends.to(at::kFloat), 1.0),
               c10::Error);  // key_end not integral
  EXPECT_THROW(ReferenceTreeAttentionForward(q, k, k, {}, {}, at::zeros({3}, ends.options()), 1.0),
               c10::Error);  // key_end[j] <= j
  EXPECT_THROW(ReferenceTreeAttentionForward(q, k, k, at::zeros({5, 2, 4}, f64),
                                             at::zeros({5, 2, 4}, f64), ends, 1.0),
               c10::Error);  // prefix head dim differs
  EXPECT_THROW(
      ReferenceTreeAttentionForward(q, k.to(at::kFloat), k.to(at::kFloat), {}, {}, ends, 1.0),
      c10::Error);  // mixed dtypes
}

}  // namespace
}  // namespace dta::kernels

// Trees, masks and error measures shared by the tree attention tests.
#ifndef DTA_TESTS_KERNELS_TREE_ATTENTION_TESTING_H_
#define DTA_TESTS_KERNELS_TREE_ATTENTION_TESTING_H_

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace dta::kernels::testing {

// What the CUDA kernels must meet against the float64 reference on the same bf16-rounded inputs:
// out and gradients within this fraction of the reference's largest magnitude, lse within the next.
inline constexpr double kTolerance = 1e-2;
inline constexpr double kLseTolerance = 1e-3;

enum class TreeKind { kChain, kRandom, kBranches };

inline std::string TreeKindName(TreeKind kind) {
  switch (kind) {
    case TreeKind::kChain:
      return "chain";
    case TreeKind::kRandom:
      return "random";
    case TreeKind::kBranches:
      return "branches";
  }
  return "?";
}

// key_end from parent pointers in DFS order (parent[j] < j, or -1 for a root).
inline std::vector<int64_t> KeyEndFromParents(const std::vector<int64_t>& parent) {
  const int64_t n = static_cast<int64_t>(parent.size());
  std::vector<int64_t> end(n);
  for (int64_t j = 0; j < n; ++j) end[j] = j + 1;
  for (int64_t j = n - 1; j >= 0; --j) {
    if (parent[j] >= 0) end[parent[j]] = std::max(end[parent[j]], end[j]);
  }
  return end;
}

// A random forest in DFS order: each token continues the current path, or hangs off one of its
// ancestors, or (rarely) starts a new root.
inline std::vector<int64_t> RandomTreeKeyEnd(int64_t tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> parent(tokens, -1);
  std::vector<int64_t> path;
  for (int64_t j = 0; j < tokens; ++j) {
    if (!path.empty() && rng() % 10 >= 6) path.resize(rng() % (path.size() + 1));
    parent[j] = path.empty() ? -1 : path.back();
    path.push_back(j);
  }
  return KeyEndFromParents(parent);
}

// A trunk of about a quarter of the tokens, then `leaves` chains hanging off its last token.
inline std::vector<int64_t> BranchesKeyEnd(int64_t tokens, int64_t leaves) {
  const int64_t trunk = std::max<int64_t>(1, tokens / 4);
  std::vector<int64_t> parent(tokens, -1);
  for (int64_t j = 1; j < trunk; ++j) parent[j] = j - 1;
  const int64_t rest = tokens - trunk;
  const int64_t branches = std::max<int64_t>(1, std::min(leaves, rest));
  int64_t j = trunk;
  for (int64_t b = 0; b < branches && j < tokens; ++b) {
    const int64_t len = rest / branches + (b < rest % branches ? 1 : 0);
    for (int64_t x = 0; x < len; ++x, ++j) parent[j] = x == 0 ? trunk - 1 : j - 1;
  }
  return KeyEndFromParents(parent);
}

inline std::vector<int64_t> MakeKeyEnd(TreeKind kind, int64_t tokens, uint64_t seed) {
  switch (kind) {
    case TreeKind::kChain:
      return std::vector<int64_t>(tokens, tokens);
    case TreeKind::kRandom:
      return RandomTreeKeyEnd(tokens, seed);
    case TreeKind::kBranches:
      return BranchesKeyEnd(tokens, 64);
  }
  return {};
}

inline at::Tensor KeyEndTensor(const std::vector<int64_t>& key_end) {
  return at::tensor(key_end, at::TensorOptions().dtype(at::kLong));
}

// [T, P + T] bool by the definition, one entry at a time.
inline at::Tensor NaiveMask(const std::vector<int64_t>& key_end, int64_t prefix_len) {
  const int64_t tokens = static_cast<int64_t>(key_end.size());
  at::Tensor mask = at::zeros({tokens, prefix_len + tokens}, at::TensorOptions().dtype(at::kBool));
  auto m = mask.accessor<bool, 2>();
  for (int64_t i = 0; i < tokens; ++i) {
    for (int64_t l = 0; l < prefix_len; ++l) m[i][l] = true;
    for (int64_t j = 0; j <= i; ++j) m[i][prefix_len + j] = i < key_end[j];
  }
  return mask;
}

// max |a - b| / max |b| in float64 (absolute when b is all zeros).
inline double RelativeError(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.to(at::kDouble).cpu();
  const at::Tensor y = b.to(at::kDouble).cpu();
  const double diff = (x - y).abs().max().item<double>();
  const double ref = y.abs().max().item<double>();
  return ref > 0 ? diff / ref : diff;
}

// Gradients of one backward run whose prefix gradients were added into rows [3, 3 + P) of
// [P + 7]-row float32 accumulators (strided views, as the trainer passes them).
struct GradsIntoViews {
  at::Tensor dq, dk, dv;
  at::Tensor acc_k, acc_v;           // the whole accumulators after the run
  at::Tensor added_k, added_v;       // what the run added into the views; undefined when P = 0
  bool neighbours_untouched = true;  // rows outside the views kept their values bitwise
};

// Runs `backward(grad_prefix_k_view, grad_prefix_v_view)` on clones of acc_k0 / acc_v0
// ([P + 7, Hkv, D] float32) and collects the results.
template <typename Backward>
GradsIntoViews RunIntoViews(const at::Tensor& acc_k0, const at::Tensor& acc_v0, int64_t prefix,
                            Backward&& backward) {
  GradsIntoViews r;
  r.acc_k = acc_k0.clone();
  r.acc_v = acc_v0.clone();
  at::Tensor gk = prefix > 0 ? r.acc_k.slice(0, 3, 3 + prefix) : at::Tensor();
  at::Tensor gv = prefix > 0 ? r.acc_v.slice(0, 3, 3 + prefix) : at::Tensor();
  const auto grads = backward(gk, gv);
  r.dq = grads.dq;
  r.dk = grads.dk;
  r.dv = grads.dv;
  if (prefix > 0) {
    r.added_k = r.acc_k.slice(0, 3, 3 + prefix) - acc_k0.slice(0, 3, 3 + prefix);
    r.added_v = r.acc_v.slice(0, 3, 3 + prefix) - acc_v0.slice(0, 3, 3 + prefix);
  }
  for (const auto& [acc, init] : {std::pair{r.acc_k, acc_k0}, std::pair{r.acc_v, acc_v0}}) {
    r.neighbours_untouched = r.neighbours_untouched &&
                             at::equal(acc.slice(0, 0, 3), init.slice(0, 0, 3)) &&
                             at::equal(acc.slice(0, 3 + prefix), init.slice(0, 3 + prefix));
  }
  return r;
}

// True when two runs are bitwise equal, accumulators included.
inline bool BitwiseEqual(const GradsIntoViews& a, const GradsIntoViews& b) {
  return at::equal(a.dq, b.dq) && at::equal(a.dk, b.dk) && at::equal(a.dv, b.dv) &&
         at::equal(a.acc_k, b.acc_k) && at::equal(a.acc_v, b.acc_v);
}

}  // namespace dta::kernels::testing

#endif  // DTA_TESTS_KERNELS_TREE_ATTENTION_TESTING_H_

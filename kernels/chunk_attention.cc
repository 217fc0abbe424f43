#include "kernels/chunk_attention.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

#include "kernels/chain_attention.h"
#include "kernels/tree_attention_internal.h"
#include "kernels/tree_attention_reference.h"

namespace dta::kernels {

#ifdef DTA_KERNELS_HAVE_CUDA
namespace internal {
// In kernels/chunk_attention.cu. Contiguous inputs on one device; out_a's dtype bf16, f16 or f32.
void MergeAttentionCuda(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                        const at::Tensor& lse_b, at::Tensor& out, at::Tensor& lse);
}  // namespace internal
#endif

namespace {

// ChunkAttentionSaved::path: what ran. The split's two parts are flags.
enum Path : int64_t {
  kTreeRan = 0,      // tensors: out, lse
  kChainRan = 1,     // tensors: cuDNN's out_bhsd, logsumexp, philox seed, philox offset
  kSplitRan = 2,     // tensors: merged out, merged lse, then each cuDNN part's seed and offset
  kPrefixCudnn = 4,  // with kSplitRan: the prefix part ran on cuDNN (else the ATen reference)
  kChunkCudnn = 8,   // with kSplitRan: the chunk part ran on cuDNN's causal kernel (else tree)
};

bool HasRows(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

// A causal chain as a tree mask: every key visible to every later query.
at::Tensor ChainKeyEnd(const at::Tensor& q) {
  return at::full({q.size(0)}, q.size(0), q.options().dtype(at::kLong));
}

at::Tensor KeyEndOrChain(const at::Tensor& key_end, const at::Tensor& q) {
  return key_end.defined() ? key_end : ChainKeyEnd(q);
}

// cuDNN's [1, H, T, 1] log-sum-exp as [H, T].
at::Tensor Lse(const ChainAttentionOutput& part) {
  return part.logsumexp.reshape({part.logsumexp.size(1), part.logsumexp.size(2)});
}

ChunkAttentionResult TreeForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                 const at::Tensor& key_end, double scale) {
  TreeAttentionOutput tree =
      TreeAttentionForward(q, k, v, prefix_k, prefix_v, KeyEndOrChain(key_end, q), scale);
  return {.out = tree.out, .saved = {.path = kTreeRan, .tensors = {tree.out, tree.lse}}};
}

TreeAttentionGrads TreeBackward(const at::Tensor& grad_out, const at::Tensor& q,
                                const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                const at::Tensor& key_end, const at::Tensor& out,
                                const at::Tensor& lse, double scale,
                                const at::Tensor& grad_prefix_k, const at::Tensor& grad_prefix_v) {
  at::Tensor grad_k = grad_prefix_k;
  at::Tensor grad_v = grad_prefix_v;
  if (HasRows(prefix_k) && !grad_k.defined()) {
    // Nobody collects the prefix's gradient: the kernel adds it into scratch.
    const at::TensorOptions o =
        prefix_k.options().dtype(prefix_k.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
    grad_k = at::zeros(prefix_k.sizes(), o);
    grad_v = at::zeros(prefix_v.sizes(), o);
  }
  return TreeAttentionBackward(grad_out.contiguous(), q, k, v, prefix_k, prefix_v,
                               KeyEndOrChain(key_end, q), out, lse, scale, grad_k, grad_v);
}

// Whether kAuto splits: cuDNN takes the prefix part, and the chunk is a causal chain of at least
// kMinSplitChain tokens, or DTA_CUDNN_PREFIX=1 asks for every prefix of kMinSplitPrefix rows;
// DTA_CUDNN_PREFIX=0 never splits. Read at every call (a few hundred per step), so that one process
// can alternate for a benchmark.
bool AutoSplits(const at::Tensor& q, const at::Tensor& prefix_k, const at::Tensor& key_end) {
  const char* value = std::getenv("DTA_CUDNN_PREFIX");
  const bool never = value != nullptr && std::strcmp(value, "0") == 0;
  const bool every = value != nullptr && std::strcmp(value, "1") == 0;
  if (never || !HasRows(prefix_k)) return false;
  const bool long_chain = !key_end.defined() && q.size(0) >= kMinSplitChain;
  const bool asked = every && prefix_k.size(0) >= kMinSplitPrefix;
  return (long_chain || asked) && ChainAttentionSupports(q, prefix_k);
}

ChunkAttentionResult SplitForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                  const at::Tensor& key_end, double scale) {
  int64_t path = kSplitRan;
  std::vector<at::Tensor> random_state;
  TreeAttentionOutput prefix_part;
  if (ChainAttentionSupports(q, prefix_k)) {
    const ChainAttentionOutput part = PrefixAttentionForward(q, prefix_k, prefix_v, scale);
    prefix_part = {part.out, Lse(part)};
    random_state.insert(random_state.end(), {part.philox_seed, part.philox_offset});
    path |= kPrefixCudnn;
  } else {
    prefix_part = ReferencePrefixAttentionForward(q, prefix_k, prefix_v, scale);
  }
  TreeAttentionOutput chunk_part;
  if (!key_end.defined() && ChainAttentionSupports(q, k)) {
    const ChainAttentionOutput part = ChainAttentionForward(q, k, v, scale);
    chunk_part = {part.out, Lse(part)};
    random_state.insert(random_state.end(), {part.philox_seed, part.philox_offset});
    path |= kChunkCudnn;
  } else {
    chunk_part =
        TreeAttentionForward(q, k, v, at::Tensor(), at::Tensor(), KeyEndOrChain(key_end, q), scale);
  }
  TreeAttentionOutput merged =
      MergeAttention(prefix_part.out, prefix_part.lse, chunk_part.out, chunk_part.lse);
  std::vector<at::Tensor> tensors = {merged.out, merged.lse};
  tensors.insert(tensors.end(), random_state.begin(), random_state.end());
  return {.out = merged.out, .saved = {.path = path, .tensors = std::move(tensors)}};
}

TreeAttentionGrads SplitBackward(const at::Tensor& grad_out, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                 const at::Tensor& key_end, const ChunkAttentionSaved& saved,
                                 double scale, const at::Tensor& grad_prefix_k,
                                 const at::Tensor& grad_prefix_v) {
  const at::Tensor& out = saved.tensors[0];
  const at::Tensor& lse = saved.tensors[1];
  // A cuDNN part's state (its random-number state at `first` of the saved tensors) with the merged
  // output and log-sum-exp in place of its own.
  auto merged_state = [&](size_t first) {
    const ChainAttentionOutput state{.out = out,
                                     .out_bhsd = {},
                                     .logsumexp = {},
                                     .philox_seed = saved.tensors[first],
                                     .philox_offset = saved.tensors[first + 1]};
    return WithMergedOutput(state, out, lse);
  };
  // The chunk's part first: if either cuDNN call fails, nothing has been added into the prefix's
  // accumulators yet, and the tree-attention redo adds the whole gradient once.
  TreeAttentionGrads g;
  if (saved.path & kChunkCudnn) {
    const ChainAttentionOutput chunk_state = merged_state((saved.path & kPrefixCudnn) ? 4 : 2);
    g = ChainAttentionBackward(grad_out, q, k, v, chunk_state, scale);
  } else {
    g = TreeBackward(grad_out, q, k, v, at::Tensor(), at::Tensor(), key_end, out, lse, scale,
                     at::Tensor(), at::Tensor());
  }
  at::Tensor dq;
  if (saved.path & kPrefixCudnn) {
    const TreeAttentionGrads p =
        PrefixAttentionBackward(grad_out, q, prefix_k, prefix_v, merged_state(2), scale);
    if (grad_prefix_k.defined()) {
      at::Tensor(grad_prefix_k).add_(p.dk);
      at::Tensor(grad_prefix_v).add_(p.dv);
    }
    dq = p.dq;
  } else {
    dq = ReferencePrefixAttentionBackward(grad_out, q, prefix_k, prefix_v, out, lse, scale,
                                          grad_prefix_k, grad_prefix_v);
  }
  g.dq.add_(dq);  // g.dq is this call's own tensor
  return g;
}

}  // namespace

ChunkAttentionResult ChunkAttentionForward(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& prefix_k,
                                           const at::Tensor& prefix_v, const at::Tensor& key_end,
                                           double scale, const ChunkAttentionOptions& options) {
  const bool has_prefix = HasRows(prefix_k);
  if (options.path != AttentionPath::kTree) {
    try {
      if (has_prefix &&
          (options.path == AttentionPath::kSplit || AutoSplits(q, prefix_k, key_end))) {
        return SplitForward(q, k, v, prefix_k, prefix_v, key_end, scale);
      }
      if (!has_prefix && !key_end.defined() && ChainAttentionSupports(q, k)) {
        ChainAttentionOutput chain = ChainAttentionForward(q, k, v, scale);
        return {.out = chain.out,
                .saved = {.path = kChainRan,
                          .tensors = {chain.out_bhsd, chain.logsumexp, chain.philox_seed,
                                      chain.philox_offset}}};
      }
    } catch (const c10::Error&) {
      // A cuDNN failure, reported once by kernels/chain_attention: tree attention from now on.
      // Anything else is a real error.
      if (!CudnnAttentionFailed()) throw;
    }
  }
  return TreeForward(q, k, v, prefix_k, prefix_v, key_end, scale);
}

TreeAttentionGrads ChunkAttentionBackward(const at::Tensor& grad_out, const at::Tensor& q,
                                          const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                          const at::Tensor& key_end,
                                          const ChunkAttentionSaved& saved, double scale,
                                          const at::Tensor& grad_prefix_k,
                                          const at::Tensor& grad_prefix_v) {
  if (saved.path == kTreeRan) {
    return TreeBackward(grad_out, q, k, v, prefix_k, prefix_v, key_end, saved.tensors[0],
                        saved.tensors[1], scale, grad_prefix_k, grad_prefix_v);
  }
  try {
    if (saved.path == kChainRan) {
      const ChainAttentionOutput chain{.out = {},
                                       .out_bhsd = saved.tensors[0],
                                       .logsumexp = saved.tensors[1],
                                       .philox_seed = saved.tensors[2],
                                       .philox_offset = saved.tensors[3]};
      return ChainAttentionBackward(grad_out, q, k, v, chain, scale);
    }
    return SplitBackward(grad_out, q, k, v, prefix_k, prefix_v, key_end, saved, scale,
                         grad_prefix_k, grad_prefix_v);
  } catch (const c10::Error&) {
    if (!CudnnAttentionFailed()) throw;  // not cuDNN's failure: a real error
  }
  // cuDNN failed (reported once): the forward again with tree attention, and its backward.
  const ChunkAttentionResult tree = TreeForward(q, k, v, prefix_k, prefix_v, key_end, scale);
  return TreeBackward(grad_out, q, k, v, prefix_k, prefix_v, key_end, tree.saved.tensors[0],
                      tree.saved.tensors[1], scale, grad_prefix_k, grad_prefix_v);
}

TreeAttentionOutput MergeAttention(const at::Tensor& out_a, const at::Tensor& lse_a,
                                   const at::Tensor& out_b, const at::Tensor& lse_b) {
  TORCH_CHECK(
      out_a.dim() == 3 && out_a.sizes() == out_b.sizes() &&
          out_a.scalar_type() == out_b.scalar_type() &&
          lse_a.sizes() == at::IntArrayRef({out_a.size(1), out_a.size(0)}) &&
          lse_b.sizes() == lse_a.sizes() && lse_a.scalar_type() == lse_b.scalar_type(),
      "MergeAttention: outputs must be [T, H, D] of one dtype and log-sum-exps [H, T]; got ",
      out_a.sizes(), " ", out_a.scalar_type(), ", ", out_b.sizes(), " ", out_b.scalar_type(), ", ",
      lse_a.sizes(), ", ", lse_b.sizes());
#ifdef DTA_KERNELS_HAVE_CUDA
  if (out_a.is_cuda() && lse_a.scalar_type() == at::kFloat &&
      (out_a.scalar_type() == at::kBFloat16 || out_a.scalar_type() == at::kHalf ||
       out_a.scalar_type() == at::kFloat)) {
    at::Tensor out = at::empty(out_a.sizes(), out_a.options());
    at::Tensor lse = at::empty(lse_a.sizes(), lse_a.options());
    internal::MergeAttentionCuda(out_a.contiguous(), lse_a.contiguous(), out_b.contiguous(),
                                 lse_b.contiguous(), out, lse);
    return {out, lse};
  }
#endif
  const at::Tensor lse = at::logaddexp(lse_a, lse_b);
  // A row neither part saw (both -inf) would be NaN; attention always sees its own token.
  auto weight = [&](const at::Tensor& part_lse) {
    return (part_lse - lse).exp().t().unsqueeze(-1);  // [T, H, 1]
  };
  const at::ScalarType type = lse.scalar_type();
  const at::Tensor out = out_a.to(type) * weight(lse_a) + out_b.to(type) * weight(lse_b);
  return {out.to(out_a.scalar_type()).contiguous(), lse.contiguous()};
}

}  // namespace dta::kernels

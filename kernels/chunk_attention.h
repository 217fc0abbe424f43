// The attention of one chunk on its cached prefix, on the fastest path that takes it: the one entry
// point the model calls (executor/model), with the paths below as its building blocks.
//
// A chunk's query i sees every prefix key and the chunk keys its tree mask allows
// (kernels/tree_attention.h). Softmax attention over a union of key sets is the log-sum-exp merge
// of the attention over each part (out = sum_p out_p exp(lse_p - lse), lse = log sum_p exp(lse_p)),
// so the prefix, which every query sees whole, can run as plain unmasked attention, and the chunk
// itself as a causal chain or a tree:
//   - the prefix part through cuDNN's fused attention (kernels/chain_attention.h: FlashAttention-3
//     class kernels on Hopper, about 2.9x our tree kernels), non-causal;
//   - the chunk part through cuDNN's causal attention for a chain, tree attention for a tree;
//   - one kernel merges the two outputs and log-sum-exps.
// Backward runs each part's backward against the merged output and log-sum-exp (both are what a
// single pass over all keys would have produced), and adds the two query gradients.
//
// Paths, by AttentionPath (ChunkAttentionOptions::path):
//   kAuto: cuDNN's causal attention for a chain without a prefix (where cuDNN takes the inputs:
//     ChainAttentionSupports), and the split for a causal chain of at least kMinSplitChain tokens
//     on any prefix (a long rollout after its short shared prompt: the chain's attention dominates
//     and cuDNN's causal kernel is the fastest there is); tree attention otherwise (everything on
//     the CPU, in float32/float64, or with DTA_CUDNN_ATTENTION=0). The environment (read at every
//     call) widens or narrows this: DTA_CUDNN_PREFIX=1 also splits shorter chunks and trees on
//     prefixes of at least kMinSplitPrefix rows, DTA_CUDNN_PREFIX=0 never splits. Splitting short
//     chunks is not the default: on an H100 it cut dta's attention GPU time 2.6x but made a
//     host-bound step 19% longer (two cuDNN calls, K/V head copies and a merge per call;
//     docs/benchmarks.md).
//   kTree: tree attention for everything (the reference path of tests and benchmarks).
//   kSplit: the split whenever there is a prefix, its parts through cuDNN where it takes them and
//     through exact ATen code otherwise (so that the split's algebra is tested on the CPU in
//     float64); chains without a prefix as kAuto.
// A cuDNN failure in either direction is reported once (kernels/chain_attention.h) and the call is
// redone with tree attention (in backward: the forward recomputed with tree attention first), so a
// step never fails for it.
//
// Usage, one layer of one chunk (an autograd function keeps `saved`):
//   ChunkAttentionResult fwd = ChunkAttentionForward(q, k, v, prefix_k, prefix_v, key_end, scale);
//   TreeAttentionGrads g = ChunkAttentionBackward(d_out, q, k, v, prefix_k, prefix_v, key_end,
//                                                 fwd.saved, scale, grad_prefix_k, grad_prefix_v);
//
// Thread safety: stateless apart from the once-reported cuDNN failure; calls run on the current
// CUDA stream of q's device.
// Failure: c10::Error for inputs tree attention refuses (shapes, dtypes, devices).
#ifndef DTA_KERNELS_CHUNK_ATTENTION_H_
#define DTA_KERNELS_CHUNK_ATTENTION_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "kernels/tree_attention.h"

namespace dta::kernels {

enum class AttentionPath { kAuto, kTree, kSplit };

struct ChunkAttentionOptions {
  AttentionPath path = AttentionPath::kAuto;
};

// The shortest prefix kAuto splits off: below it the split's extra launches and copies cost more
// than the faster kernel saves.
inline constexpr int64_t kMinSplitPrefix = 128;

// The shortest causal chain (a chunk without a tree mask) that kAuto splits off any prefix by
// default: its causal attention, quadratic in the chunk, outweighs the split's extra launches.
inline constexpr int64_t kMinSplitChain = 4096;

// What ChunkAttentionBackward needs besides the inputs. Opaque to callers: keep it whole.
struct ChunkAttentionSaved {
  int64_t path = 0;                 // which path ran (internal)
  std::vector<at::Tensor> tensors;  // the path's outputs and log-sum-exps (internal)
};

struct ChunkAttentionResult {
  at::Tensor out;  // [T, Hq, D], q's dtype
  ChunkAttentionSaved saved;
};

// q [T, Hq, D]; k, v [T, Hkv, D]; prefix_k, prefix_v [P, Hkv, D] or undefined/empty; key_end [T]
// as in kernels/tree_attention.h, or undefined for a causal chain.
ChunkAttentionResult ChunkAttentionForward(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& prefix_k,
                                           const at::Tensor& prefix_v, const at::Tensor& key_end,
                                           double scale, const ChunkAttentionOptions& options = {});

// dq, dk, dv of the chunk; the prefix's K/V gradients are ADDED into grad_prefix_k/v (float32,
// float64 for float64 inputs, [P, Hkv, D]) when they are defined, and dropped otherwise.
TreeAttentionGrads ChunkAttentionBackward(const at::Tensor& grad_out, const at::Tensor& q,
                                          const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& prefix_k, const at::Tensor& prefix_v,
                                          const at::Tensor& key_end,
                                          const ChunkAttentionSaved& saved, double scale,
                                          const at::Tensor& grad_prefix_k,
                                          const at::Tensor& grad_prefix_v);

// The log-sum-exp merge of two attention outputs over disjoint key sets: out_a, out_b [T, H, D];
// lse_a, lse_b [H, T] float32 (float64 for float64 outputs). Returns the merged output (out_a's
// dtype, rounded once from float32/float64) and log-sum-exp. One CUDA kernel on the GPU, ATen
// elsewhere. A row whose part saw no key (lse -inf) takes the other part whole.
TreeAttentionOutput MergeAttention(const at::Tensor& out_a, const at::Tensor& lse_a,
                                   const at::Tensor& out_b, const at::Tensor& lse_b);

}  // namespace dta::kernels

#endif  // DTA_KERNELS_CHUNK_ATTENTION_H_

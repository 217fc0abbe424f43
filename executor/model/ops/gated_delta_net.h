// Gated DeltaNet (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", 2024), the linear-attention
// token mixer of Qwen3-Next and Qwen3.5, over a chunk of tokens that continues a cached context, so
// that a tree's shared prefix runs once (Tree Training's state routing, inside the push/pop
// executor).
//
// What a linear layer needs from the tokens before a chunk is not every earlier token's K/V but
//   - the recurrent state S [value_heads, key_head_dim, value_head_dim] after the chunk's parent
//     token (the last token of the cached path), and
//   - the inputs of its short causal convolution (the mixed q/k/v projections) of the last
//     kernel - 1 tokens on the path to it.
// Per value head h and token t (q and k L2-normalised, q scaled by key_head_dim^-1/2):
//   S_t = exp(g_t) S_p (I - beta_t k_t k_t^T) + beta_t k_t v_t^T,   o_t = S_t^T q_t,
// where p is t's parent: the previous token of a chain, or the branch point of a tree. Within a
// chunk, tokens are in DFS order with a parent each; a run of tokens whose parents are each the
// previous token (and whose previous token has no other child) is a chain, run by the chunked
// algorithm (as transformers' torch_chunk_gated_delta_rule and flash-linear-attention's
// chunk_gated_delta_rule) from its parent run's final state.
//
// Gradients: a context's state and convolution inputs are constants of the chunk's graph; backward
// adds d loss / d state and d loss / d inputs into accumulators the caller gives (the executor's
// stack), as attention does for a prefix's K/V (executor/model/chunk_io.h's PrefixKv).
//
// Numerics: the delta rule, the L2 norms and the decays in float32 (float64 for float64 inputs);
// float64 runs are exact references. Everything is ATen but the chunked rule's two parts, CUDA
// kernels on a GPU: the intra-chunk terms, one kernel each way for all chunks on tensor cores
// (3xTF32 / DMMA; kernels/gated_delta_chunk.h; DTA_GATED_DELTA_FUSED=0 turns them off), and the
// recurrence across chunks, one kernel each way in plain float32/float64 arithmetic
// (kernels/chunk_state_recurrence.h; DTA_LINEAR_ATTENTION_KERNEL=0 turns it off), which with the
// chunks' outputs keeps no state for backward; elsewhere batched ATen ops and an ATen loop.
//
// Example (one chain continuing a context):
//   LinearContext context{.conv_inputs = last3, .state = s};
//   LinearMixerOutput out = GatedDeltaNetForward(weights, shape, x, /*parents=*/{}, context);
//   // out.final_state continues the next chunk; out.conv_inputs are its tokens' cache rows.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace dta {

// `constant` as a leaf of the graph being built whose gradient backward adds into `accumulator`
// (same shape): a view sharing its storage with a version counter of its own, so later in-place
// writes to the storage's other rows do not invalidate the graph. `constant` itself when grad mode
// is off or there is no accumulator.
at::Tensor GradientInto(const at::Tensor& constant, const at::Tensor& accumulator);

// The parent of every token of a chunk in DFS order (index in the chunk; -1: the context's last
// token, or none at a rollout's start). Empty means a chain: parents[t] = t - 1.
using TokenParents = absl::Span<const int64_t>;

// Maximal chains of a chunk: runs [begin, end) whose tokens' parents are each the previous token,
// and which end where a token has a child other than the next token (a branch point).
struct TokenRun {
  int64_t begin = 0, end = 0;
  int64_t parent_run = -1;  // the run whose final state this one starts from; -1: the context's
};
// CHECKs that parents are valid (each parent before its token).
std::vector<TokenRun> ChainRuns(TokenParents parents, int64_t tokens);

// A chain of `tokens` tokens cut after each of `points` (sorted, in (0, tokens)): runs [0, p1),
// [p1, p2), ... [pk, tokens), each starting from the previous one's final state, so that the state
// after p tokens is run i's final state where points[i] = p (how the executor keeps the states a
// later chunk starts from inside this one).
std::vector<TokenRun> CutChain(int64_t tokens, absl::Span<const int64_t> points);

// Rows a token's causal convolution reads, nearest last: index[t][kernel - 1] = t's own row,
// index[t][kernel - 2] = its parent's, ... in the table cat(zero row, context rows, chunk rows):
// row 0 is zero (before a rollout's start), context row r is 1 + r (the last context row is the
// chunk root's parent), chunk token u is 1 + context_rows + u. [tokens, kernel] int64, on `device`.
at::Tensor ConvAncestorIndex(TokenParents parents, int64_t tokens, int64_t context_rows,
                             int64_t kernel, at::Device device);

// silu(depthwise causal convolution) over a tree: out[t] = silu(sum_i weight[:, i] *
// table[index[t][i]]) with table = cat(zero, context, x). x [T, C], weight [C, kernel], context
// [P, C] or undefined (P = 0); computed in float32 (float64 for float64 x), returned in x's dtype.
at::Tensor TreeCausalConv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& context,
                          const at::Tensor& index);

struct GatedDeltaOutput {
  at::Tensor out;          // [T, H, Dv], the compute dtype
  at::Tensor final_state;  // [H, Dk, Dv], after the last token
  // TreeGatedDeltaRule: the state after each run's last token, in the runs' order.
  std::vector<at::Tensor> run_states = {};
};

// The gated delta rule over one chain: q, k [T, Hk, Dk] (L2-normalised; q is scaled by Dk^-1/2
// here; value head h reads key head h / (H / Hk), Hk dividing H), v [T, H, Dv], g (log decay, <= 0)
// and beta [T, H]; initial_state [H, Dk, Dv] or undefined (zeros). In float32, or float64 for
// float64 inputs. Chunked: chunk_size tokens at a time with a triangular solve per chunk, for all
// chunks at once (kernels::GatedDeltaChunkTerms), then the state recurrence across chunks
// (kernels::ChunkStateRecurrence); differentiable.
GatedDeltaOutput ChunkedGatedDeltaRule(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& g,
                                       const at::Tensor& beta, const at::Tensor& initial_state,
                                       int64_t chunk_size = 64);
// The same token by token: the reference the chunked form is tested against.
GatedDeltaOutput RecurrentGatedDeltaRule(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& g,
                                         const at::Tensor& beta, const at::Tensor& initial_state);
// Over a chunk's tree: each run of ChainRuns from its parent run's final state (the initial state
// for runs on the context). final_state: after the chunk's last token. The runs of one depth in
// the tree of runs share one chunked call (each padded to whole chunks, a segment of the state
// recurrence); the depths run in order.
GatedDeltaOutput TreeGatedDeltaRule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& g, const at::Tensor& beta,
                                    const std::vector<TokenRun>& runs,
                                    const at::Tensor& initial_state, int64_t chunk_size = 64);

// A Qwen3-Next linear-attention layer's sizes (config.json's linear_* fields). A tensor-parallel
// rank's part of a layer (some key heads and their value heads; executor/model/decoder.h) is
// itself a layer of the rank's head counts: its parts of the parameters (conv1d's q, k and v
// channels of those heads, concatenated) have the shapes and layouts of such a layer's.
struct GatedDeltaNetShape {
  int64_t key_heads = 0;       // linear_num_key_heads
  int64_t value_heads = 0;     // linear_num_value_heads (a multiple of key_heads)
  int64_t key_head_dim = 0;    // linear_key_head_dim
  int64_t value_head_dim = 0;  // linear_value_head_dim
  int64_t conv_kernel = 4;     // linear_conv_kernel_dim
  double eps = 1e-6;           // the gated RMSNorm's (rms_norm_eps)
  int64_t key_dim() const { return key_heads * key_head_dim; }
  int64_t value_dim() const { return value_heads * value_head_dim; }
  // Channels of the convolution: q, k and v.
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
};

// A layer's parameters, shaped as transformers' Qwen3NextGatedDeltaNet (and its checkpoints), or
// with Qwen3_5GatedDeltaNet's input projections instead of in_proj_qkvz and in_proj_ba (a layer
// has one set of them; the other stays undefined).
struct GatedDeltaNetWeights {
  at::Tensor in_proj_qkvz = {};  // [2 key_dim + 2 value_dim, hidden], grouped per key head: q k v z
  at::Tensor in_proj_ba = {};    // [2 value_heads, hidden], grouped per key head: b a
  at::Tensor in_proj_qkv = {};   // [conv_dim, hidden]: all q, all k, all v (conv1d's channels)
  at::Tensor in_proj_z = {};     // [value_dim, hidden]
  at::Tensor in_proj_b = {};     // [value_heads, hidden]
  at::Tensor in_proj_a = {};     // [value_heads, hidden]
  at::Tensor conv1d = {};        // [conv_dim, 1, conv_kernel]
  at::Tensor dt_bias = {};       // [value_heads]
  at::Tensor a_log = {};         // [value_heads] (A_log)
  at::Tensor norm = {};          // [value_head_dim], the gated RMSNorm's weight (not 1 + weight)
  at::Tensor out_proj = {};      // [hidden, value_dim]
};

// What a chunk continues: the path's last convolution inputs and recurrent state, with the
// accumulators their gradients go to (undefined: none, or no gradient wanted).
struct LinearContext {
  at::Tensor conv_inputs;       // [P, conv_dim], P <= conv_kernel - 1 rows, the last one nearest
  at::Tensor grad_conv_inputs;  // same shape
  at::Tensor state;             // [value_heads, key_head_dim, value_head_dim]; undefined: zeros
  at::Tensor grad_state;        // same shape
};

struct LinearMixerOutput {
  at::Tensor out;          // [T, hidden], x's dtype ([T, value_dim] from GatedDeltaNetMix)
  at::Tensor conv_inputs;  // [T, conv_dim]: what later chunks' convolutions read
  at::Tensor final_state;  // [value_heads, key_head_dim, value_head_dim], compute dtype
  std::vector<at::Tensor> run_states = {};  // after each of `runs` (GatedDeltaOutput)
};

// A layer's projected inputs in the one layout the mixer reads (Qwen3.5's, whose in_proj_qkv
// rows are the convolution's channels): qkv [T, conv_dim] (all q, all k, all v), z [T,
// value_dim], b and a [T, value_heads].
struct LinearProjections {
  at::Tensor qkv, z, b, a;
};

// Qwen3-Next's projections in that layout (views and one concatenation, differentiable):
// qkvz = x @ in_proj_qkvz^T [T, 2 key_dim + 2 value_dim], per key head its q, k, its group's v and
// z; ba = x @ in_proj_ba^T [T, 2 value_heads], per key head its group's b, then its group's a.
LinearProjections UngroupedProjections(const GatedDeltaNetShape& shape, const at::Tensor& qkvz,
                                       const at::Tensor& ba);

// The layer on normalised hidden states x [T, hidden], as transformers' Qwen3NextGatedDeltaNet
// (Qwen3_5GatedDeltaNet with its projections): in_proj, the causal convolution with silu, beta =
// sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), the delta rule with q/k L2-normalised, the
// gated RMSNorm (norm(o) weight silu(z)) and out_proj. `conv_index`: ConvAncestorIndex of the
// chunk; `runs`: its ChainRuns.
LinearMixerOutput GatedDeltaNetForward(const GatedDeltaNetWeights& weights,
                                       const GatedDeltaNetShape& shape, const at::Tensor& x,
                                       const at::Tensor& conv_index,
                                       const std::vector<TokenRun>& runs,
                                       const LinearContext& context);

// The layer between its projections (what the model runs, its in_proj and out_proj being the
// decoder's fused projections); out is the gated norm's output [T, value_dim] in the projections'
// dtype, before out_proj. Reads only conv1d, dt_bias, a_log and norm of `weights`.
LinearMixerOutput GatedDeltaNetMix(const GatedDeltaNetWeights& weights,
                                   const GatedDeltaNetShape& shape,
                                   const LinearProjections& projected, const at::Tensor& conv_index,
                                   const std::vector<TokenRun>& runs, const LinearContext& context);
// The same on Qwen3-Next's projections (UngroupedProjections).
LinearMixerOutput GatedDeltaNetMix(const GatedDeltaNetWeights& weights,
                                   const GatedDeltaNetShape& shape, const at::Tensor& qkvz,
                                   const at::Tensor& ba, const at::Tensor& conv_index,
                                   const std::vector<TokenRun>& runs, const LinearContext& context);

}  // namespace dta

// The intra-chunk terms of the chunked gated delta rule (Gated DeltaNet;
// executor/model/ops/gated_delta_net.h): everything of the chunked (WY/UT) algorithm that is
// independent across chunks. Per value head h and chunk n of C tokens (q scaled by Dk^-1/2; c the
// cumulative sum of g within the chunk; P[i][j] = exp(c_i - c_j) for j <= i, else 0):
//   S = (beta k k^T) * P, M = I + strictly_lower(S), T = M^-1 (forward substitution)
//   U = T (beta v)              new_values   [C, Dv]
//   W = T (beta exp(c) k)       k_cumdecay   [C, Dk]
//   Kd = exp(c_last - c) k      k_decayed    [C, Dk]
//   Qd = exp(c) q               q_decayed    [C, Dk]
//   intra = (q k^T) * P         intra        [C, C]
//   d = exp(c_last)             chunk_decay
// They feed kernels/chunk_state_recurrence.h (W, U, Kd, d) and the output
// out_n = Qd_n h_n + intra_n v_new_n. The last chunk is padded with zero tokens (g = 0, beta = 0).
//
// Two paths compute them:
//   - ATen: the batched ops ChunkedGatedDeltaRule always ran (about 25 kernels forward over all
//     chunks, autograd's backward through them; the reference);
//   - fused: one autograd function, one CUDA kernel each way on a GPU (gated_delta_chunk.cu: one
//     block per chunk and value head, the chunk's products on tensor cores, 3xTF32 in float32
//     and DMMA in float64; triangular systems solved by 16-row blocks; every sum in a fixed order,
//     so bitwise reproducible). Backward recomputes P, S and the blocks' inverses from the inputs,
//     U and W only (none of the [C, C] intermediates are kept); a key head's group of value heads
//     is summed by one ATen reduction. Where the backward kernel does not run (the CPU, shapes it
//     does not fit, or DTA_GATED_DELTA_BACKWARD_KERNEL=0, read at every backward) the analytic
//     gradient runs as batched ATen ops with T applied by triangular solves (the reference). On
//     the CPU the forward is a plain loop of sums in index order (the reference the kernel is
//     tested against).
// The two paths differ only in rounding: float64 within ~1e-12, float32 within ~1e-5 relative
// (the triangular solve's conditioning times float32's epsilon; sums in other orders).
//
// GatedDeltaPath::kAuto takes the fused path where its CUDA kernels run: built with nvcc
// (DTA_KERNELS_HAVE_CUDA), the tensors on a CUDA device, C <= 64, the shared memory fitting
// (float32: Dk <= 368, float64: Dk <= 128 at C = 64 on an H100 or H200), DTA_GATED_DELTA_FUSED not
// "0" in the environment (read at every call: the before/after switch of benchmarks), and, in a
// pass that keeps a graph, the backward kernel fitting and not switched off (its analytic
// backward as batched ATen ops is slower than autograd's over the ATen forward).
//
// Example (the chunked rule's head; q, k, v, g, beta float32 or float64 on one device):
//   ChunkTerms terms = GatedDeltaChunkTerms(q, k, v, g, beta, 64);
//   ChunkStates s = ChunkStateRecurrence(terms.k_cumdecay, terms.new_values, terms.k_decayed,
//                                        terms.chunk_decay, state);
//
// Thread safety: stateless; CUDA work runs on the current stream of the inputs' device.
// Failure: TORCH_CHECK (c10::Error) naming the tensor whose shape, dtype or device is wrong.
#ifndef DTA_KERNELS_GATED_DELTA_CHUNK_H_
#define DTA_KERNELS_GATED_DELTA_CHUNK_H_

#include <ATen/ATen.h>

#include <cstdint>

namespace dta::kernels {

struct ChunkTerms {
  at::Tensor k_cumdecay;   // W [H, N, C, Dk]
  at::Tensor new_values;   // U [H, N, C, Dv]
  at::Tensor k_decayed;    // Kd [H, N, C, Dk]
  at::Tensor q_decayed;    // Qd [H, N, C, Dk], q scaled by Dk^-1/2
  at::Tensor intra;        // [H, N, C, C], zero above the diagonal
  at::Tensor chunk_decay;  // d [H, N]
};

enum class GatedDeltaPath {
  kAuto,   // fused where its CUDA kernel runs, else ATen
  kAten,   // the batched ATen ops
  kFused,  // the fused function on any device (CHECKs that the CUDA kernel fits on a GPU)
};

// The terms above, differentiable with respect to q, k, v, g and beta. q, k [T, Hk, Dk]
// (L2-normalised, unscaled), v [T, H, Dv], g (log decay) and beta [T, H], where Hk divides H and
// value head h reads key head h / (H / Hk); one type, float32 or float64, on one device; T >= 1.
ChunkTerms GatedDeltaChunkTerms(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& g, const at::Tensor& beta, int64_t chunk_size,
                                GatedDeltaPath path = GatedDeltaPath::kAuto);

// Whether kAuto takes the fused path for these inputs (q [T, Hk, Dk], value_dim Dv) when no
// gradient is asked for.
bool GatedDeltaChunkUsesKernel(const at::Tensor& q, int64_t value_dim, int64_t chunk_size);

}  // namespace dta::kernels

#endif  // DTA_KERNELS_GATED_DELTA_CHUNK_H_

// The inter-chunk state recurrence of the chunked gated delta rule (Gated DeltaNet, the linear
// attention of Qwen3-Next; executor/model/ops/gated_delta_net.h): the one part of the chunked
// (WY/UT) algorithm that is sequential over chunks. With the intra-chunk terms computed for all
// chunks at once, per value head (C tokens a chunk, N chunks, S [Dk, Dv]):
//   for i = 0 .. N-1:  h_i = S;  v_new_i = U_i - W_i S;  S = d_i S + Kd_i^T v_new_i
// (W = k_cumdecay, U = new_values, Kd = k_decayed, d = chunk_decay). Its outputs h_i (the state at
// each chunk's start) and v_new_i then give every chunk's output in two batched matmuls,
// out_i = Qd_i h_i + intra_i v_new_i, outside this function.
//
// As a loop of ATen ops this is ~5 kernels a chunk forward and more backward, hundreds of tiny
// launches a layer for a 4,096-token chunk: host-bound on a GPU. Here it is one autograd function
// whose forward and backward are each one CUDA kernel launch (backward then adds three batched
// matmuls over all chunks for the gradients of W, Kd and d). Backward, with g the gradient of the
// state after chunk i:
//   for i = N-1 .. 0:  dvt_i = dv_new_i + Kd_i g;  g_i = g;  g = d_i g - W_i^T dvt_i + dh_i
// then dS0 = g, dU = dvt, dW_i = -dvt_i h_i^T, dKd_i = v_new_i g_i^T, dd_i = sum(h_i * g_i).
//
// Numerics: everything in the inputs' type, float32 or float64 (the delta rule's compute type).
// The ATen path computes the loop above with at::matmul, as ChunkedGatedDeltaRule did before this
// function; the CUDA kernel computes the same expressions with plain (SIMT) fused multiply-adds,
// no TF32, so the two differ only in the order of each dot product's terms. The batched products
// over all chunks (the output's, and the gradients of W and Kd) run as kernels/float32_bmm.h's
// Float32Bmm: 3xTF32 on Hopper's tensor cores, float32-accurate.
//
// The CUDA kernel runs when the library is built with nvcc (DTA_KERNELS_HAVE_CUDA), the tensors are
// on a CUDA device, ChunkStateOptions::use_kernel is true, DTA_LINEAR_ATTENTION_KERNEL is not "0"
// in the environment (read at every call: the before/after switch of benchmarks, and a way to rule
// the kernel out when debugging), and its shared memory fits the device's per-block limit (227 KiB
// on an H100): a block keeps a [Dk, 32] slice of the state, one chunk's step results and one or
// two chunks' W and Kd (two overlap the next chunk's loads with this one's arithmetic),
//   bytes(type) * (32 (round4(Dk) + C) + stages 2 C (round4(Dk) + 4)).
// With C = 64: float32 takes Dk <= 344 (two stages up to 188), float64 Dk <= 164 (one stage), so
// Qwen3-Next's Dk = 128 runs in both; Dv is any size (blocks of 32 columns, the last one partial).
// Everything else, and the CPU, takes the ATen path.
// ChunkStateUsesKernel says which path a call takes.
//
// Example (the chunked rule's tail; every tensor float32 or float64 on one device):
//   ChunkStates s = ChunkStateRecurrence(k_cumdecay, new_values, k_decayed, chunk_decay, state);
//   at::Tensor out = at::matmul(q_decayed, s.states) + at::matmul(intra, s.new_values);
//   // s.final_state continues the next chunk; all three are differentiable. ChunkStateOutput
//   // computes the same out and final state keeping less for backward.
//
// Thread safety: stateless (the environment is read at each call); CUDA work runs on the current
// stream of the inputs' device.
// Failure: TORCH_CHECK (c10::Error) naming the tensor whose shape, dtype or device is wrong.
#ifndef DTA_KERNELS_CHUNK_STATE_RECURRENCE_H_
#define DTA_KERNELS_CHUNK_STATE_RECURRENCE_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace dta::kernels {

struct ChunkStateOptions {
  // false: the ATen loop even where the CUDA kernel would run (tests, benchmarks). Default true.
  bool use_kernel = true;
  // Independent sequences of chunks in one call (a tree's runs that start from their own states):
  // empty for one sequence; else S + 1 offsets 0 = o_0 <= o_1 <= ... <= o_S = N, sequence s being
  // chunks [o_s, o_{s+1}), scanned from its own initial state. The initial and final states (and
  // their gradients) are then [S, H, Dk, Dv]. The kernel scans the sequences side by side, so S
  // short runs cost about what the longest does; results equal S separate calls bit for bit.
  std::vector<int64_t> segment_chunks;
};

struct ChunkStates {
  at::Tensor states;       // h [H, N, Dk, Dv]: the state at each chunk's start
  at::Tensor new_values;   // v_new [H, N, C, Dv]
  at::Tensor final_state;  // [H, Dk, Dv]: after the last chunk ([S, H, Dk, Dv]: each segment's)
};

// The recurrence as an autograd function: gradients flow to every input that requires them.
// k_cumdecay (W) and k_decayed (Kd) [H, N, C, Dk]; new_values (U) [H, N, C, Dv]; chunk_decay (d)
// [H, N]; initial_state (S0) [H, Dk, Dv], or undefined for zeros. One floating type, float32 or
// float64, on one device; any strides (copied to contiguous where they are not).
ChunkStates ChunkStateRecurrence(const at::Tensor& k_cumdecay, const at::Tensor& new_values,
                                 const at::Tensor& k_decayed, const at::Tensor& chunk_decay,
                                 const at::Tensor& initial_state,
                                 const ChunkStateOptions& options = {});

// Whether ChunkStateRecurrence with these inputs (k_cumdecay [H, N, C, Dk], value_dim Dv) runs the
// CUDA kernel (else the ATen loop).
bool ChunkStateUsesKernel(const at::Tensor& k_cumdecay, int64_t value_dim,
                          const ChunkStateOptions& options = {});

// The two directions on their own, outside autograd (what the autograd function runs). Arguments
// as ChunkStateRecurrence's.
ChunkStates ChunkStateForward(const at::Tensor& k_cumdecay, const at::Tensor& new_values,
                              const at::Tensor& k_decayed, const at::Tensor& chunk_decay,
                              const at::Tensor& initial_state,
                              const ChunkStateOptions& options = {});

// Every chunk's output with the recurrence, as one autograd function that keeps neither h nor v_new
// for backward (the largest of the chunked rule's saved tensors: h is a [Dk, Dv] state per chunk,
// 32 KiB a token at Qwen3-Next's shapes): backward runs ChunkStateForward again (the same kernel or
// loop: the same h and v_new bit for bit), then ChunkStateBackward and the output products'
// gradients. q_decayed (Qd) [H, N, C, Dk] and intra [H, N, C, C] besides ChunkStateRecurrence's
// arguments; equal to at::matmul(Qd, h) + at::matmul(intra, v_new) and its gradients.
struct ChunkOutput {
  at::Tensor out;          // [H, N, C, Dv]
  at::Tensor final_state;  // [H, Dk, Dv] ([S, H, Dk, Dv] with segment_chunks)
};
ChunkOutput ChunkStateOutput(const at::Tensor& k_cumdecay, const at::Tensor& new_values,
                             const at::Tensor& k_decayed, const at::Tensor& chunk_decay,
                             const at::Tensor& initial_state, const at::Tensor& q_decayed,
                             const at::Tensor& intra, const ChunkStateOptions& options = {});

struct ChunkStateGrads {
  at::Tensor k_cumdecay;     // [H, N, C, Dk]
  at::Tensor new_values;     // [H, N, C, Dv]
  at::Tensor k_decayed;      // [H, N, C, Dk]
  at::Tensor chunk_decay;    // [H, N]
  at::Tensor initial_state;  // [H, Dk, Dv] ([S, H, Dk, Dv] with segment_chunks)
};

// The gradients of every input given those of the outputs: grad_states [H, N, Dk, Dv],
// grad_new_values [H, N, C, Dv] and grad_final_state [H, Dk, Dv], each undefined for zeros.
// states and new_values are ChunkStateForward's.
ChunkStateGrads ChunkStateBackward(const at::Tensor& grad_states, const at::Tensor& grad_new_values,
                                   const at::Tensor& grad_final_state, const at::Tensor& k_cumdecay,
                                   const at::Tensor& k_decayed, const at::Tensor& chunk_decay,
                                   const at::Tensor& states, const at::Tensor& new_values,
                                   const ChunkStateOptions& options = {});

}  // namespace dta::kernels

#endif  // DTA_KERNELS_CHUNK_STATE_RECURRENCE_H_

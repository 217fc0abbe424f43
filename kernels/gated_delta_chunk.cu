// The CUDA kernels of kernels/gated_delta_chunk.h: one block of 8 warps per (chunk, value head),
// every operand in shared memory, the chunk's products on tensor cores (kernels/block_mma.cuh:
// 3xTF32 in float32, DMMA in float64) between short scalar phases. Shapes are padded in shared
// memory with zero rows and columns to multiples of 16: Cp >= C tokens, Kp >= Dk features (a zero
// row is a token with k = q = v = g = beta = 0, which changes no sum). Triangular systems with
// M = I + S = I - N are solved by 16-row blocks: each diagonal block inverted once by forward
// substitution (16 steps), then every block of the solution is two tensor-core products.
//
// The forward, in three phases:
//   1. load the chunk's keys and scaled queries (zero rows past T), its cumulative log decay
//      (one thread's scan in shared memory) and beta; write Kd, Qd and d;
//   2. K K^T and Q K^T (tiles on and below the diagonal), times P_ij: N = -beta_i (k_i . k_j) P_ij
//      below the diagonal stays in shared memory, intra goes to global memory; N's diagonal
//      blocks inverted;
//   3. passes of `width` columns: U = M^-1 (beta v) and W = M^-1 (beta exp(c) k).
// The backward (gated_delta_chunk.cc's BackwardAnalytic, R_U = T^T dU, R_W = T^T dW), from q, k,
// v, g, beta, U, W and the six output gradients (a null one is zeros), in eight phases:
//   1. load keys, scaled queries, cum and beta as the forward does;
//   2. K K^T and Q K^T: ma = N, mg = dIntra_ij (q_i . k_j) P_ij; N's diagonal blocks inverted;
//   3. dcum's terms through intra (a thread a row), Qd and Kd (a warp a row); then g2 = dIntra * P;
//   4. dq = scale (g2 K + exp(c) dQd), dk = g2^T Q + exp(c_last - c) dKd, the products
//      accumulated by tensor cores straight into the padded gradients in global memory;
//   5. passes of `width` columns: X = M^-T [dU | dW]; dv = beta R_U, dk += beta exp(c) R_W; then
//      mg += X [U | W]^T (the pass's columns of U and W staged in shared memory), v . R_U and
//      k . R_W a warp a row;
//   6. K K^T again; dS = -mg below the diagonal; g1 = dS beta_i P_ij, mirrored into g1 + g1^T;
//      ma = dS (k_i . k_j) P_ij;
//   7. a thread a row: dbeta and dcum's S and W terms; dk += (g1 + g1^T) K on tensor cores;
//   8. dg, the reversed cumulative sum of dcum, by one thread (c_last's gradient at the end).
// q's and k's gradients are written per value head into [N * Cp, H, Kp] buffers (the caller
// narrows them and sums a key head's group). Global reads and writes are coalesced, outside the
// sequential phases. Every sum runs in a fixed order: bitwise reproducible. Shared memory at
// Qwen3-Next's C = 64, Dk = 128 in float32: 109 KB forward and 110 KB backward with 64-column
// passes (two blocks an SM).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/block_mma.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/gated_delta_chunk_internal.h"
#include "kernels/warp_sum.cuh"

namespace dta::kernels::internal {
namespace {

using block_mma::BlockGemm;

constexpr int kThreads = 256;
// Row padding of every shared matrix (16 bytes in float32, WMMA's least leading dimension; tiles
// start every 16 rows, so they stay 32-byte aligned): moves consecutive rows to other banks.
constexpr int kRowPad = 4;
// The triangular solves' diagonal blocks.
constexpr int kSolveBlock = 16;

// Shared memory of a kernel, in elements. Forward: TokenScalars [4][Cp]; keys [Cp][Kp + 4]; N (=
// -S) and Q K^T [Cp][Cp + 4]; the diagonal blocks' inverses [Cp][16 + 4]; then the larger of
// queries [Cp][Kp + 4] and two [Cp][width + 4] buffers (a solve's right-hand sides and solution).
// Backward: TokenScalars and four more vectors [Cp]; keys; ma and mg [Cp][Cp + 4]; the inverses;
// then the larger of queries and the two buffers (right-hand sides, then the pass's U and W
// columns; solution).
struct Layout {
  int cp = 0, kp = 0, key_stride = 0, s_stride = 0, diag_stride = 0, width = 0, work_stride = 0;
  int64_t elements = 0;
};

Layout PlanLayout(int64_t chunk, int64_t dk, int width, bool backward) {
  Layout l;
  l.cp = static_cast<int>(PadToMmaTile(chunk));
  l.kp = static_cast<int>(PadToMmaTile(dk));
  l.key_stride = l.kp + kRowPad;
  l.s_stride = l.cp + kRowPad;
  l.diag_stride = kSolveBlock + kRowPad;
  l.width = width;
  l.work_stride = width + kRowPad;
  const int64_t cp = l.cp, keys = cp * l.key_stride, square = cp * l.s_stride;
  l.elements = (backward ? 8 : 4) * cp + keys + 2 * square + cp * l.diag_stride +
               std::max(keys, 2 * cp * l.work_stride);
  return l;
}

// The widest pass (of 256, 128, 64, 32, 16 columns) with which two blocks share an SM, else the
// widest that fits one; elements 0 when none does.
Layout ChooseLayout(at::ScalarType type, int64_t chunk, int64_t dk, bool backward, int device) {
  if (type != at::kFloat && type != at::kDouble) return {};
  if (chunk < 1 || chunk > kGatedDeltaMaxChunk || dk < 1 || dk > (1 << 16)) return {};
  const int64_t element = type == at::kDouble ? 8 : 4;
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device);
  const int64_t per_block = static_cast<int64_t>(prop->sharedMemPerBlockOptin);
  const int64_t per_sm = static_cast<int64_t>(prop->sharedMemPerMultiprocessor);
  const int64_t reserved = static_cast<int64_t>(prop->reservedSharedMemPerBlock);
  Layout fits_one;
  for (int width = kThreads; width >= 16; width /= 2) {
    const Layout l = PlanLayout(chunk, dk, width, backward);
    const int64_t bytes = l.elements * element;
    if (2 * (bytes + reserved) <= per_sm && bytes <= per_block) return l;
    if (fits_one.elements == 0 && bytes <= per_block) fits_one = l;
  }
  return fits_one;
}

// What both kernels read: the inputs and their sizes.
template <typename T>
struct ChunkInputs {
  const T* q;     // [T, Hk, Dk]
  const T* k;     // [T, Hk, Dk]
  const T* v;     // [T, H, Dv]
  const T* g;     // [T, H]
  const T* beta;  // [T, H]
  int tokens, key_heads, heads, dk, dv, chunk, chunks;
  T scale;
  Layout layout;
};

template <typename T>
void SetInputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
               const at::Tensor& beta, int64_t chunk, int64_t chunks, ChunkInputs<T>& p) {
  p.q = q.data_ptr<T>();
  p.k = k.data_ptr<T>();
  p.v = v.data_ptr<T>();
  p.g = g.data_ptr<T>();
  p.beta = beta.data_ptr<T>();
  p.tokens = static_cast<int>(q.size(0));
  p.key_heads = static_cast<int>(q.size(1));
  p.dk = static_cast<int>(q.size(2));
  p.heads = static_cast<int>(v.size(1));
  p.dv = static_cast<int>(v.size(2));
  p.chunk = static_cast<int>(chunk);
  p.chunks = static_cast<int>(chunks);
  p.scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(p.dk)));
}

__device__ __forceinline__ float Exp(float x) { return expf(x); }
__device__ __forceinline__ double Exp(double x) { return exp(x); }

// f(i, c) for every row i < rows and column c < cols: a warp a row, a lane a column (no index
// division; a warp's global accesses are one row's consecutive elements).
template <class F>
__device__ __forceinline__ void ForEachElement(int rows, int cols, F&& f) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  for (int i = static_cast<int>(threadIdx.x) / 32; i < rows; i += kThreads / 32) {
    for (int c = lane; c < cols; c += 32) f(i, c);
  }
}

// A chunk's per-token scalars in shared memory, [Cp] each.
template <typename T>
struct TokenScalars {
  T* cum;         // cumulative log decay
  T* beta;        //
  T* from_start;  // exp(cum_i)
  T* to_end;      // exp(c_last - cum_i)

  // The four vectors laid out from `base`, Cp elements each.
  static __device__ TokenScalars At(T* base, int cp) {
    return {.cum = base, .beta = base + cp, .from_start = base + 2 * cp, .to_end = base + 3 * cp};
  }
};

// Phase 1 of both kernels: keys and scaled queries [Cp][Kp] (zero past the chunk's tokens and
// Dk), cum (one thread's scan in token order), beta and the two decays. Every global read is
// coalesced: the sequential phases then wait on shared memory only. Returns synchronised.
template <typename T>
__device__ __forceinline__ void LoadChunk(const ChunkInputs<T>& p, int n, int h, T* ks, T* qs,
                                          const TokenScalars<T>& t) {
  const Layout& l = p.layout;
  const int kh = h / (p.heads / p.key_heads), first = n * p.chunk;
  const int real = min(p.chunk, p.tokens - first);
  ForEachElement(l.cp, l.kp, [&](int i, int d) {
    const bool in = i < real && d < p.dk;
    const int64_t at = (static_cast<int64_t>(first + i) * p.key_heads + kh) * p.dk + d;
    ks[i * l.key_stride + d] = in ? p.k[at] : T(0);
    qs[i * l.key_stride + d] = in ? p.q[at] * p.scale : T(0);
  });
  for (int i = threadIdx.x; i < l.cp; i += kThreads) {
    const int64_t at = static_cast<int64_t>(first + i) * p.heads + h;
    t.cum[i] = i < real ? p.g[at] : T(0);
    t.beta[i] = i < real ? p.beta[at] : T(0);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < l.cp; ++i) t.cum[i] += t.cum[i - 1];
  }
  __syncthreads();
  const T last = t.cum[l.cp - 1];  // padding rows add g = 0
  for (int i = threadIdx.x; i < l.cp; i += kThreads) {
    t.from_start[i] = Exp(t.cum[i]);
    t.to_end[i] = Exp(last - t.cum[i]);
  }
  __syncthreads();
}

// sum_d a[d] b[d] over d < n by one warp: lane l sums d = l, l + 32, ..., then WarpSum; every
// lane holds the result.
template <typename T>
__device__ __forceinline__ T WarpDot(const T* a, const T* b, int n) {
  T sum = T(0);
  for (int d = static_cast<int>(threadIdx.x) % 32; d < n; d += 32) sum += a[d] * b[d];
  return WarpSum(sum);
}

// inv[b + r][c] = ((I - N_bb)^-1)[r][c] for each 16-row diagonal block N_bb of the strictly lower
// N [Cp][Cp] (forward substitution, one thread a column of a block; zero above the diagonal).
// The caller synchronises before and after.
template <typename T>
__device__ __forceinline__ void InvertDiagonalBlocks(const T* n, int ns, T* inv, int is, int cp) {
  if (static_cast<int>(threadIdx.x) >= cp) return;
  const int b = static_cast<int>(threadIdx.x) / kSolveBlock * kSolveBlock;
  const int c = static_cast<int>(threadIdx.x) % kSolveBlock;
  const T* nb = n + b * ns + b;
  T* x = inv + b * is + c;
  for (int r = 0; r < kSolveBlock; ++r) {
    T xr = r == c ? T(1) : T(0);
    for (int q = c; q < r; ++q) xr += nb[r * ns + q] * x[q * is];
    x[r * is] = xr;
  }
}

// X = (I - N)^-1 R for the strictly lower N [Cp][Cp] with InvertDiagonalBlocks' inverses, `wp`
// columns (a multiple of 16): block b of 16 rows from the top, R_b += N_{b,<b} X_{<b} (in place),
// then X_b = inv_bb R_b, both on tensor cores. The caller synchronises before; returns
// synchronised.
template <typename T>
__device__ __forceinline__ void SolveLower(const T* n, int ns, const T* inv, int is, T* r, T* x,
                                           int ws, int cp, int wp) {
  for (int b = 0; b < cp; b += kSolveBlock) {
    if (b > 0) {
      BlockGemm<T, false, false>(kSolveBlock, wp, b, n + b * ns, ns, x, ws, r + b * ws, ws, true);
      __syncthreads();
    }
    BlockGemm<T, false, false>(kSolveBlock, wp, kSolveBlock, inv + b * is, is, r + b * ws, ws,
                               x + b * ws, ws, false);
    __syncthreads();
  }
}

// X = (I - N)^-T R, the same way from the bottom block up: R_b += (N_{>b,b})^T X_{>b}, then
// X_b = inv_bb^T R_b.
template <typename T>
__device__ __forceinline__ void SolveUpper(const T* n, int ns, const T* inv, int is, T* r, T* x,
                                           int ws, int cp, int wp) {
  for (int b = cp - kSolveBlock; b >= 0; b -= kSolveBlock) {
    const int below = b + kSolveBlock;
    if (below < cp) {
      BlockGemm<T, true, false>(kSolveBlock, wp, cp - below, n + below * ns + b, ns, x + below * ws,
                                ws, r + b * ws, ws, true);
      __syncthreads();
    }
    BlockGemm<T, true, false>(kSolveBlock, wp, kSolveBlock, inv + b * is, is, r + b * ws, ws,
                              x + b * ws, ws, false);
    __syncthreads();
  }
}

template <typename T>
struct Params : ChunkInputs<T> {
  T* w;      // [H, N, C, Dk]
  T* u;      // [H, N, C, Dv]
  T* kd;     // [H, N, C, Dk]
  T* qd;     // [H, N, C, Dk]
  T* intra;  // [H, N, C, C]
  T* decay;  // [H, N]
};

template <typename T>
__global__ void __launch_bounds__(kThreads) GatedDeltaChunkKernel(const Params<T> p) {
  WaitForPreviousKernels();
  extern __shared__ __align__(128) unsigned char shared_bytes[];
  const Layout l = p.layout;
  const int c_len = p.chunk, cp = l.cp, kp = l.kp, dk = p.dk, dv = p.dv;
  const int kst = l.key_stride, ss = l.s_stride, ws = l.work_stride, is = l.diag_stride;
  T* const vectors = reinterpret_cast<T*>(shared_bytes);
  const auto ts = TokenScalars<T>::At(vectors, cp);
  const T *cum = ts.cum, *beta = ts.beta, *from_start = ts.from_start, *to_end = ts.to_end;
  T* ks = vectors + 4 * cp;  // [Cp][key_stride]
  T* s = ks + cp * kst;      // [Cp][s_stride]: K K^T, then N = -S
  T* qk = s + cp * ss;       // [Cp][s_stride]: Q K^T
  T* inv = qk + cp * ss;     // [Cp][diag_stride]: (I - N_bb)^-1
  T* work = inv + cp * is;   // queries [Cp][key_stride], then right-hand sides [Cp][work_stride]
  T* xs = work + cp * ws;    // the solution [Cp][work_stride]
  const int n = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int64_t chunk_index = static_cast<int64_t>(h) * p.chunks + n;
  const int first = n * c_len;
  const int real = min(c_len, p.tokens - first);

  // Phase 1.
  LoadChunk(p, n, h, ks, work, ts);
  if (tid == 0) p.decay[chunk_index] = from_start[cp - 1];
  {
    T* kd = p.kd + chunk_index * c_len * dk;
    T* qd = p.qd + chunk_index * c_len * dk;
    ForEachElement(c_len, dk, [&](int i, int d) {
      kd[i * dk + d] = ks[i * kst + d] * to_end[i];
      qd[i * dk + d] = work[i * kst + d] * from_start[i];
    });
  }

  // Phase 2.
  BlockGemm<T, false, true>(cp, cp, kp, ks, kst, ks, kst, s, ss, false, true);
  BlockGemm<T, false, true>(cp, cp, kp, work, kst, ks, kst, qk, ss, false, true);
  __syncthreads();
  T* intra = p.intra + chunk_index * c_len * c_len;
  ForEachElement(cp, cp, [&](int i, int j) {
    const T pij = j <= i ? Exp(cum[i] - cum[j]) : T(0);
    s[i * ss + j] = j < i ? -beta[i] * s[i * ss + j] * pij : T(0);
    if (i < c_len && j < c_len) intra[i * c_len + j] = j <= i ? qk[i * ss + j] * pij : T(0);
  });
  __syncthreads();  // N is whole, and the queries are read: work is free
  InvertDiagonalBlocks(s, ss, inv, is, cp);

  // Phase 3, passes of `width` columns: the right-hand sides loaded (coalesced, zero past the
  // chunk and the pass), solved by blocks on tensor cores, written out (coalesced).
  T* u = p.u + chunk_index * c_len * dv;
  T* w = p.w + chunk_index * c_len * dk;
  for (int col0 = 0; col0 < dv + dk; col0 += l.width) {
    const int cols = min(l.width, dv + dk - col0);
    const int padded = static_cast<int>(PadToMmaTile(cols));
    ForEachElement(cp, padded, [&](int i, int c) {
      const int col = col0 + c;
      T x = T(0);
      if (i < real && c < cols) {
        if (col < dv) {
          x = p.v[(static_cast<int64_t>(first + i) * p.heads + h) * dv + col] * beta[i];
        } else {
          x = ks[i * kst + col - dv] * beta[i] * from_start[i];
        }
      }
      work[i * ws + c] = x;
    });
    __syncthreads();
    SolveLower(s, ss, inv, is, work, xs, ws, cp, padded);
    ForEachElement(c_len, cols, [&](int i, int c) {
      const int col = col0 + c;
      if (col < dv) {
        u[i * dv + col] = xs[i * ws + c];
      } else {
        w[i * dk + col - dv] = xs[i * ws + c];
      }
    });
    __syncthreads();
  }
}

template <typename T>
void Launch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
            const at::Tensor& beta, ChunkTerms& out) {
  Params<T> p;
  SetInputs(q, k, v, g, beta, out.intra.size(2), out.intra.size(1), p);
  p.w = out.k_cumdecay.data_ptr<T>();
  p.u = out.new_values.data_ptr<T>();
  p.kd = out.k_decayed.data_ptr<T>();
  p.qd = out.q_decayed.data_ptr<T>();
  p.intra = out.intra.data_ptr<T>();
  p.decay = out.chunk_decay.data_ptr<T>();
  p.layout = ChooseLayout(q.scalar_type(), p.chunk, p.dk, /*backward=*/false, q.device().index());
  TORCH_CHECK(p.layout.elements > 0, "gated delta chunk: no forward kernel fits C = ", p.chunk,
              ", Dk = ", p.dk);
  if (p.chunks == 0 || p.heads == 0) return;
  const size_t bytes = static_cast<size_t>(p.layout.elements) * sizeof(T);
  C10_CUDA_CHECK(cudaFuncSetAttribute(GatedDeltaChunkKernel<T>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
  const dim3 grid(static_cast<unsigned>(p.chunks), static_cast<unsigned>(p.heads));
  C10_CUDA_CHECK(LaunchAfterPrevious(GatedDeltaChunkKernel<T>, grid, kThreads, bytes,
                                     at::cuda::getCurrentCUDAStream(), p));
}

template <typename T>
struct BackwardParams : ChunkInputs<T> {
  const T* u;  // U [H, N, C, Dv]
  const T* w;  // W [H, N, C, Dk]
  // The output gradients, nullptr for zeros.
  const T* d_w;      // [H, N, C, Dk]
  const T* d_u;      // [H, N, C, Dv]
  const T* d_kd;     // [H, N, C, Dk]
  const T* d_qd;     // [H, N, C, Dk]
  const T* d_intra;  // [H, N, C, C]
  const T* d_decay;  // [H, N]
  T* out_q;          // [N * Cp, H, Kp], per value head
  T* out_k;          // [N * Cp, H, Kp], per value head
  T* out_v;          // [T, H, Dv]
  T* out_g;          // [T, H]
  T* out_beta;       // [T, H]
};

// The analytic gradient of gated_delta_chunk.cc's BackwardAnalytic for one chunk and value head
// (phases in the header comment).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    GatedDeltaChunkBackwardKernel(const BackwardParams<T> p) {
  WaitForPreviousKernels();
  extern __shared__ __align__(128) unsigned char shared_bytes[];
  const Layout l = p.layout;
  const int c_len = p.chunk, cp = l.cp, kp = l.kp, dk = p.dk, dv = p.dv;
  const int kst = l.key_stride, ss = l.s_stride, ws = l.work_stride, is = l.diag_stride;
  T* const vectors = reinterpret_cast<T*>(shared_bytes);
  const auto ts = TokenScalars<T>::At(vectors, cp);
  const T *cum = ts.cum, *beta = ts.beta, *from_start = ts.from_start, *to_end = ts.to_end;
  T* dcum = vectors + 4 * cp;
  T* vru = dcum + cp;     // v_i . R_U_i
  T* krw = vru + cp;      // k_i . R_W_i
  T* kdt = krw + cp;      // exp(c_last - c_i) k_i . dKd_i
  T* ks = kdt + cp;       // [Cp][key_stride]
  T* ma = ks + cp * kst;  // [Cp][s_stride]: N = -S, then dS_ij (k_i . k_j) P_ij
  T* mg = ma + cp * ss;   // [Cp][s_stride]: intra's terms, g2, then -dS, then g1 + g1^T
  T* inv = mg + cp * ss;  // [Cp][diag_stride]: (I - N_bb)^-1
  T* qs = inv + cp * is;  // [Cp][key_stride], phases 1-4
  T* bs = qs;             // [Cp][work_stride], phase 5: right-hand sides, then U's and W's columns
  T* xs = bs + cp * ws;   // [Cp][work_stride], phase 5: the solution
  const int n = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int64_t chunk_index = static_cast<int64_t>(h) * p.chunks + n;
  const int first = n * c_len;
  const int real = min(c_len, p.tokens - first);  // the chunk's rows that are tokens
  auto row_of = [&](int i) { return static_cast<int64_t>(first + i) * p.heads + h; };
  // The chunk's rows of this head's padded q and k gradients.
  const int out_stride = p.heads * kp;
  T* oq = p.out_q + (static_cast<int64_t>(n) * cp * p.heads + h) * kp;
  T* ok = p.out_k + (static_cast<int64_t>(n) * cp * p.heads + h) * kp;

  // Phase 1.
  LoadChunk(p, n, h, ks, qs, ts);
  const T* d_intra = p.d_intra ? p.d_intra + chunk_index * c_len * c_len : nullptr;
  const T* d_qd = p.d_qd ? p.d_qd + chunk_index * c_len * dk : nullptr;
  const T* d_kd = p.d_kd ? p.d_kd + chunk_index * c_len * dk : nullptr;

  // Phase 2.
  BlockGemm<T, false, true>(cp, cp, kp, ks, kst, ks, kst, ma, ss, false, true);
  BlockGemm<T, false, true>(cp, cp, kp, qs, kst, ks, kst, mg, ss, false, true);
  __syncthreads();
  ForEachElement(cp, cp, [&](int i, int j) {
    const T pij = j <= i ? Exp(cum[i] - cum[j]) : T(0);
    ma[i * ss + j] = j < i ? -beta[i] * ma[i * ss + j] * pij : T(0);
    mg[i * ss + j] =
        j <= i && i < c_len && d_intra ? d_intra[i * c_len + j] * mg[i * ss + j] * pij : T(0);
  });
  __syncthreads();

  InvertDiagonalBlocks(ma, ss, inv, is, cp);
  // Phase 3: dcum's terms through intra (row sum minus column sum) a thread a row, then its Qd
  // and Kd terms a warp a row.
  if (tid < cp) {
    const int i = tid;
    T row = T(0), col = T(0);
    for (int j = 0; j <= i; ++j) row += mg[i * ss + j];
    for (int j = i; j < cp; ++j) col += mg[j * ss + i];
    dcum[i] = row - col;
    vru[i] = T(0);
    krw[i] = T(0);
  }
  __syncthreads();
  for (int i = tid / 32; i < cp; i += kThreads / 32) {
    const bool in = i < c_len;
    const T qdq = in && d_qd ? WarpDot(qs + i * kst, d_qd + i * dk, dk) : T(0);
    const T kdk = in && d_kd ? WarpDot(ks + i * kst, d_kd + i * dk, dk) : T(0);
    if (tid % 32 == 0) {
      kdt[i] = to_end[i] * kdk;
      dcum[i] += from_start[i] * qdq - kdt[i];
    }
  }
  __syncthreads();
  // mg = g2 = dIntra * P; the gradients' elementwise terms, which phase 4's products add to.
  ForEachElement(cp, cp, [&](int i, int j) {
    mg[i * ss + j] =
        j <= i && i < c_len && d_intra ? d_intra[i * c_len + j] * Exp(cum[i] - cum[j]) : T(0);
  });
  ForEachElement(cp, kp, [&](int i, int d) {
    const bool in = i < c_len && d < dk;
    oq[i * out_stride + d] = in && d_qd ? p.scale * from_start[i] * d_qd[i * dk + d] : T(0);
    ok[i * out_stride + d] = in && d_kd ? to_end[i] * d_kd[i * dk + d] : T(0);
  });
  __syncthreads();

  // Phase 4: dk += g2^T Q, then dq += (scale g2) K.
  BlockGemm<T, true, false>(cp, kp, cp, mg, ss, qs, kst, ok, out_stride, true);
  __syncthreads();
  ForEachElement(cp, cp, [&](int i, int j) { mg[i * ss + j] *= p.scale; });
  __syncthreads();
  BlockGemm<T, false, false>(cp, kp, cp, mg, ss, ks, kst, oq, out_stride, true);
  __syncthreads();  // the queries and g2 are read: qs and mg are free
  ForEachElement(cp, cp, [&](int i, int j) { mg[i * ss + j] = T(0); });
  __syncthreads();

  // Phase 5, passes of `width` columns: X = M^-T [dU | dW] (R_U's Dv columns then R_W's Dk); then
  // mg += X [U | W]^T over the pass's columns, v . R_U and k . R_W.
  const T* u = p.u + chunk_index * c_len * dv;
  const T* w = p.w + chunk_index * c_len * dk;
  for (int col0 = 0; col0 < dv + dk; col0 += l.width) {
    const int cols = min(l.width, dv + dk - col0);
    const int padded = static_cast<int>(PadToMmaTile(cols));
    const int u_cols = max(0, min(cols, dv - col0));  // the pass's first u_cols columns are R_U's
    // The pass's columns of dU and dW (the right-hand sides), coalesced; zero past the chunk and
    // the pass.
    const T* d_u = p.d_u ? p.d_u + chunk_index * c_len * dv : nullptr;
    const T* d_w = p.d_w ? p.d_w + chunk_index * c_len * dk : nullptr;
    ForEachElement(cp, padded, [&](int j, int c) {
      const int col = col0 + c;
      T x = T(0);
      if (j < c_len && c < cols) {
        if (col < dv) {
          x = d_u ? d_u[j * dv + col] : T(0);
        } else {
          x = d_w ? d_w[j * dk + col - dv] : T(0);
        }
      }
      bs[j * ws + c] = x;
    });
    __syncthreads();
    SolveUpper(ma, ss, inv, is, bs, xs, ws, cp, padded);
    // The pass's columns of U and W, where the right-hand sides were.
    ForEachElement(cp, padded, [&](int j, int c) {
      const int col = col0 + c;
      T b = T(0);
      if (j < c_len && c < cols) b = col < dv ? u[j * dv + col] : w[j * dk + col - dv];
      bs[j * ws + c] = b;
    });
    __syncthreads();
    // dv = beta R_U, dk += beta exp(c) R_W (each element by one thread); mg += X [U | W]^T;
    // v . R_U and k . R_W a warp a row.
    ForEachElement(c_len, cols, [&](int i, int c) {
      const int col = col0 + c;
      const T x = xs[i * ws + c];
      if (col < dv) {
        if (i < real) p.out_v[row_of(i) * dv + col] = beta[i] * x;
      } else {
        ok[i * out_stride + col - dv] += beta[i] * from_start[i] * x;
      }
    });
    BlockGemm<T, false, true>(cp, cp, padded, xs, ws, bs, ws, mg, ss, true, true);
    for (int i = tid / 32; i < real; i += kThreads / 32) {
      const T* xi = xs + i * ws;
      const T a = u_cols > 0 ? WarpDot(p.v + row_of(i) * dv + col0, xi, u_cols) : T(0);
      const T b = cols > u_cols
                      ? WarpDot(ks + i * kst + (col0 + u_cols - dv), xi + u_cols, cols - u_cols)
                      : T(0);
      if (tid % 32 == 0) {
        vru[i] += a;
        krw[i] += b;
      }
    }
    __syncthreads();
  }

  // Phase 6, below the diagonal: dS = -mg; mg = g1 = dS beta_i P_ij; ma = dS (k_i . k_j) P_ij
  // (K K^T again: N is solved with). Then mg's upper triangle mirrors its lower one: g1 + g1^T,
  // for one product in phase 7.
  BlockGemm<T, false, true>(cp, cp, kp, ks, kst, ks, kst, ma, ss, false, true);
  __syncthreads();
  ForEachElement(cp, cp, [&](int i, int j) {
    if (j >= i) return;
    const T pij = Exp(cum[i] - cum[j]);
    const T ds = -mg[i * ss + j];
    mg[i * ss + j] = ds * beta[i] * pij;
    ma[i * ss + j] = ds * ma[i * ss + j] * pij;
  });
  __syncthreads();
  ForEachElement(cp, cp, [&](int i, int j) {
    if (j >= i) mg[i * ss + j] = j == i ? T(0) : mg[j * ss + i];
  });
  __syncthreads();

  // Phase 7: dbeta and dcum's S and W terms a thread a row; dk += (g1 + g1^T) K.
  if (tid < c_len) {
    const int i = tid;
    T row = T(0), col = T(0);
    for (int j = 0; j < i; ++j) row += ma[i * ss + j];
    for (int j = i + 1; j < c_len; ++j) col += beta[j] * ma[j * ss + i];
    if (i < real) p.out_beta[row_of(i)] = vru[i] + from_start[i] * krw[i] + row;
    dcum[i] += beta[i] * row - col + beta[i] * from_start[i] * krw[i];
  }
  BlockGemm<T, false, false>(cp, kp, cp, mg, ss, ks, kst, ok, out_stride, true);
  __syncthreads();

  // Phase 8: dg, the reversed cumulative sum of dcum; c_last's gradient (Kd, d) enters at the end.
  if (tid == 0) {
    T acc = T(0);
    for (int i = 0; i < c_len; ++i) acc += kdt[i];
    acc += p.d_decay ? p.d_decay[chunk_index] * from_start[cp - 1] : T(0);
    for (int i = c_len - 1; i >= 0; --i) {
      acc += dcum[i];
      if (i < real) p.out_g[row_of(i)] = acc;
    }
  }
}

template <typename T>
const T* DataOrNull(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

template <typename T>
void LaunchBackward(const BackwardInputs& in, const ChunkTerms& grad, const BackwardOutputs& out) {
  BackwardParams<T> p;
  SetInputs(in.q, in.k, in.v, in.g, in.beta, in.new_values.size(2), in.new_values.size(1), p);
  p.u = in.new_values.data_ptr<T>();
  p.w = in.k_cumdecay.data_ptr<T>();
  p.d_w = DataOrNull<T>(grad.k_cumdecay);
  p.d_u = DataOrNull<T>(grad.new_values);
  p.d_kd = DataOrNull<T>(grad.k_decayed);
  p.d_qd = DataOrNull<T>(grad.q_decayed);
  p.d_intra = DataOrNull<T>(grad.intra);
  p.d_decay = DataOrNull<T>(grad.chunk_decay);
  p.out_q = out.q.data_ptr<T>();
  p.out_k = out.k.data_ptr<T>();
  p.out_v = out.v.data_ptr<T>();
  p.out_g = out.g.data_ptr<T>();
  p.out_beta = out.beta.data_ptr<T>();
  p.layout =
      ChooseLayout(in.q.scalar_type(), p.chunk, p.dk, /*backward=*/true, in.q.device().index());
  TORCH_CHECK(p.layout.elements > 0, "gated delta chunk: no backward kernel fits C = ", p.chunk,
              ", Dk = ", p.dk);
  TORCH_CHECK(
      out.q.size(0) == static_cast<int64_t>(p.chunks) * p.layout.cp && out.q.size(2) == p.layout.kp,
      "gated delta chunk: the q and k gradients must be [N * Cp, H, Kp], got ", out.q.sizes());
  if (p.chunks == 0 || p.heads == 0) return;
  const size_t bytes = static_cast<size_t>(p.layout.elements) * sizeof(T);
  C10_CUDA_CHECK(cudaFuncSetAttribute(GatedDeltaChunkBackwardKernel<T>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
  const dim3 grid(static_cast<unsigned>(p.chunks), static_cast<unsigned>(p.heads));
  C10_CUDA_CHECK(LaunchAfterPrevious(GatedDeltaChunkBackwardKernel<T>, grid, kThreads, bytes,
                                     at::cuda::getCurrentCUDAStream(), p));
}

}  // namespace

bool GatedDeltaChunkFits(at::ScalarType type, int64_t chunk, int64_t dk, int device) {
  return ChooseLayout(type, chunk, dk, /*backward=*/false, device).elements > 0;
}

bool GatedDeltaChunkBackwardFits(at::ScalarType type, int64_t chunk, int64_t dk, int device) {
  return ChooseLayout(type, chunk, dk, /*backward=*/true, device).elements > 0;
}

void GatedDeltaChunkForwardCuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& g, const at::Tensor& beta, ChunkTerms& out) {
  const c10::cuda::CUDAGuard guard(q.device());
  if (q.scalar_type() == at::kDouble) {
    Launch<double>(q, k, v, g, beta, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "gated delta chunk: no kernel for ",
                q.scalar_type());
    Launch<float>(q, k, v, g, beta, out);
  }
}

void GatedDeltaChunkBackwardCuda(const BackwardInputs& in, const ChunkTerms& grad,
                                 const BackwardOutputs& out) {
  const c10::cuda::CUDAGuard guard(in.q.device());
  if (in.q.scalar_type() == at::kDouble) {
    LaunchBackward<double>(in, grad, out);
  } else {
    TORCH_CHECK(in.q.scalar_type() == at::kFloat, "gated delta chunk: no kernel for ",
                in.q.scalar_type());
    LaunchBackward<float>(in, grad, out);
  }
}

}  // namespace dta::kernels::internal

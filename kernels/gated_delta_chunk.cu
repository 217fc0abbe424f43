// The forward CUDA kernel of kernels/gated_delta_chunk.h: one block per (chunk, value head)
// computes every term of the chunk from q, k, v, g and beta, in three phases over shared memory:
//   1. load the chunk's keys and scaled queries (zero rows past T), its cumulative log decay
//      (summed in token order by one thread) and beta; write Kd, Qd and d;
//   2. for each pair j <= i: (beta_i k_i) . k_j and q_i . k_j (dot products in index order), times
//      P_ij: S's strictly lower part into shared memory, intra to global memory;
//   3. forward substitution, x_i = rhs_i - sum_{j < i} S_ij x_j (j ascending), one right-hand
//      column a thread: U's Dv columns (beta v) and W's Dk columns (beta exp(c) k), blocks of 128.
// Plain (fused) multiply-adds in the tensors' type (float32 or float64), no tensor cores: the
// sums of the CPU loops of gated_delta_chunk.cc in their order, bitwise reproducible run to run.
// Phase 3's columns reuse phase 2's query buffer. Shared memory: 83 KB a block in float32 for
// Qwen3-Next's Dk = 128 (two blocks an SM), 166 KB in float64.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/gated_delta_chunk_internal.h"

namespace dta::kernels::internal {
namespace {

constexpr int kThreads = 128;

// Shared memory, in elements: cum [C], beta [C], keys [C][Dk + 1], S [C][C + 1], then the larger
// of queries [C][Dk + 1] and the solve's columns [C][kThreads]. The odd row strides put a warp's
// reads of one column of different rows on different banks.
struct Layout {
  int key_stride = 0, s_stride = 0;
  int64_t elements = 0;
};

Layout PlanLayout(int64_t chunk, int64_t dk) {
  Layout l;
  l.key_stride = static_cast<int>(dk + 1);
  l.s_stride = static_cast<int>(chunk + 1);
  l.elements = 2 * chunk + chunk * l.key_stride + chunk * l.s_stride +
               std::max<int64_t>(chunk * l.key_stride, chunk * kThreads);
  return l;
}

template <typename T>
struct Params {
  const T* q;     // [T, Hk, Dk]
  const T* k;     // [T, Hk, Dk]
  const T* v;     // [T, H, Dv]
  const T* g;     // [T, H]
  const T* beta;  // [T, H]
  T* w;           // [H, N, C, Dk]
  T* u;           // [H, N, C, Dv]
  T* kd;          // [H, N, C, Dk]
  T* qd;          // [H, N, C, Dk]
  T* intra;       // [H, N, C, C]
  T* decay;       // [H, N]
  int tokens, key_heads, heads, dk, dv, chunk, chunks;
  T scale;
  Layout layout;
};

__device__ __forceinline__ float Exp(float x) { return expf(x); }
__device__ __forceinline__ double Exp(double x) { return exp(x); }

template <typename T>
__global__ void __launch_bounds__(kThreads) GatedDeltaChunkKernel(const Params<T> p) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const Layout l = p.layout;
  const int c_len = p.chunk, dk = p.dk, dv = p.dv;
  T* cum = reinterpret_cast<T*>(shared_bytes);
  T* beta = cum + c_len;
  T* ks = beta + c_len;              // [C][key_stride]
  T* s = ks + c_len * l.key_stride;  // [C][s_stride]
  T* work = s + c_len * l.s_stride;  // queries [C][key_stride], then columns [C][kThreads]
  const int n = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int kh = h / (p.heads / p.key_heads);
  const int64_t chunk_index = static_cast<int64_t>(h) * p.chunks + n;
  const int first = n * c_len;  // the chunk's first token

  // Phase 1.
  for (int e = tid; e < c_len * dk; e += kThreads) {
    const int i = e / dk, d = e - i * dk, t = first + i;
    const int64_t at = (static_cast<int64_t>(t) * p.key_heads + kh) * dk + d;
    ks[i * l.key_stride + d] = t < p.tokens ? p.k[at] : T(0);
    work[i * l.key_stride + d] = t < p.tokens ? p.q[at] * p.scale : T(0);
  }
  if (tid == 0) {
    T acc = T(0);
    for (int i = 0; i < c_len; ++i) {
      const int t = first + i;
      acc += t < p.tokens ? p.g[static_cast<int64_t>(t) * p.heads + h] : T(0);
      cum[i] = acc;
    }
  }
  for (int i = tid; i < c_len; i += kThreads) {
    const int t = first + i;
    beta[i] = t < p.tokens ? p.beta[static_cast<int64_t>(t) * p.heads + h] : T(0);
  }
  __syncthreads();
  const T last = cum[c_len - 1];
  if (tid == 0) p.decay[chunk_index] = Exp(last);
  {
    T* kd = p.kd + chunk_index * c_len * dk;
    T* qd = p.qd + chunk_index * c_len * dk;
    for (int e = tid; e < c_len * dk; e += kThreads) {
      const int i = e / dk, d = e - i * dk;
      kd[e] = ks[i * l.key_stride + d] * Exp(last - cum[i]);
      qd[e] = work[i * l.key_stride + d] * Exp(cum[i]);
    }
  }

  // Phase 2.
  T* intra = p.intra + chunk_index * c_len * c_len;
  for (int e = tid; e < c_len * c_len; e += kThreads) {
    const int i = e / c_len, j = e - i * c_len;
    T kk = T(0), qk = T(0);
    if (j <= i) {
      const T* ki = ks + i * l.key_stride;
      const T* kj = ks + j * l.key_stride;
      const T* qi = work + i * l.key_stride;
      const T bi = beta[i];
      for (int d = 0; d < dk; ++d) {
        kk += ki[d] * bi * kj[d];
        qk += qi[d] * kj[d];
      }
    }
    const T pij = j <= i ? Exp(cum[i] - cum[j]) : T(0);
    s[i * l.s_stride + j] = j < i ? kk * pij : T(0);
    intra[e] = qk * pij;
  }
  __syncthreads();  // S is whole, and the queries are read: work is free

  // Phase 3.
  T* u = p.u + chunk_index * c_len * dv;
  T* w = p.w + chunk_index * c_len * dk;
  for (int col0 = 0; col0 < dv + dk; col0 += kThreads) {
    const int col = col0 + tid;
    if (col >= dv + dk) break;
    for (int i = 0; i < c_len; ++i) {
      const int t = first + i;
      T x;
      if (col < dv) {
        x = (t < p.tokens ? p.v[(static_cast<int64_t>(t) * p.heads + h) * dv + col] : T(0)) *
            beta[i];
      } else {
        x = ks[i * l.key_stride + col - dv] * beta[i] * Exp(cum[i]);
      }
      const T* si = s + i * l.s_stride;
      for (int j = 0; j < i; ++j) x -= si[j] * work[j * kThreads + tid];
      work[i * kThreads + tid] = x;
      if (col < dv) {
        u[i * dv + col] = x;
      } else {
        w[i * dk + col - dv] = x;
      }
    }
  }
}

template <typename T>
void Launch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
            const at::Tensor& beta, ChunkTerms& out) {
  Params<T> p;
  p.q = q.data_ptr<T>();
  p.k = k.data_ptr<T>();
  p.v = v.data_ptr<T>();
  p.g = g.data_ptr<T>();
  p.beta = beta.data_ptr<T>();
  p.w = out.k_cumdecay.data_ptr<T>();
  p.u = out.new_values.data_ptr<T>();
  p.kd = out.k_decayed.data_ptr<T>();
  p.qd = out.q_decayed.data_ptr<T>();
  p.intra = out.intra.data_ptr<T>();
  p.decay = out.chunk_decay.data_ptr<T>();
  p.tokens = static_cast<int>(q.size(0));
  p.key_heads = static_cast<int>(q.size(1));
  p.dk = static_cast<int>(q.size(2));
  p.heads = static_cast<int>(v.size(1));
  p.dv = static_cast<int>(v.size(2));
  p.chunk = static_cast<int>(out.intra.size(2));
  p.chunks = static_cast<int>(out.intra.size(1));
  p.scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(p.dk)));
  p.layout = PlanLayout(p.chunk, p.dk);
  const int64_t bytes = p.layout.elements * static_cast<int64_t>(sizeof(T));
  if (p.chunks == 0 || p.heads == 0) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaFuncSetAttribute(GatedDeltaChunkKernel<T>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
  const dim3 grid(static_cast<unsigned>(p.chunks), static_cast<unsigned>(p.heads));
  GatedDeltaChunkKernel<T><<<grid, kThreads, static_cast<size_t>(bytes), stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool GatedDeltaChunkFits(at::ScalarType type, int64_t chunk, int64_t dk, int device) {
  if (type != at::kFloat && type != at::kDouble) return false;
  if (chunk < 1 || chunk > kGatedDeltaMaxChunk || dk < 1 || dk > (1 << 16)) return false;
  const int64_t element = type == at::kDouble ? 8 : 4;
  return PlanLayout(chunk, dk).elements * element <=
         static_cast<int64_t>(at::cuda::getDeviceProperties(device)->sharedMemPerBlockOptin);
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

}  // namespace dta::kernels::internal

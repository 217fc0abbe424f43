// The CUDA kernel of kernels/chunk_state_recurrence.h: one launch runs the whole recurrence over
// chunks, forward or backward. Both directions are the same scan of a carried [Dk, Dv] matrix X
// (the state forward, its gradient backward) over the chunks, in order or reversed:
//   R_i = add_a_i + sign_a A_i X           ("step A", [C, Dv])
//   X   = d_i X + sign_b B_i^T R_i + add_b_i ("step B", [Dk, Dv]), writing X's value before it.
// Forward: A = W, B = Kd, add_a = U, sign_a = -1, sign_b = +1, no add_b; R = v_new, X_i = h_i.
// Backward (reversed): A = Kd, B = W, add_a = dv_new, sign_a = +1, sign_b = -1, add_b = dh;
// R = dvt, X_i = g_i.
//
// Both steps are independent across X's columns, so a block owns (head, 32 columns of X) and loops
// over the chunks with its slice of X in shared memory; heads x ceil(Dv / 32) blocks (128 for
// Qwen3-Next's 32 heads of Dv = 128, one wave on an H100's 132 SMs). Independent sequences of
// chunks (segments: a tree's runs that start from their own states) are the grid's second
// dimension, up to kMaxSegments a launch, so their scans run side by side. A chunk's A and B ([C,
// Dk], read by every column block of the head, so mostly from L2) are copied to shared memory with
// cp.async, the next chunk's while this one computes with two stages (ScanStages). 256 threads:
// step A gives each thread a 2 x 4 tile of R per 64 rows of C, step B a 4 x 4 tile of X per 128
// rows of Dk, each a register-blocked outer product over 4-wide shared-memory vector loads. Plain
// fused multiply-adds in the tensors' type, so float32 stays float32 (no TF32). (3xTF32 tensor-core
// products through kernels/block_mma.cuh ran this scan 1.3x slower at Qwen3-Next's shapes on an
// H200, and their error over 48 chunks was 30x the fused multiply-adds'.)
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_pipeline_primitives.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/dependent_launch.cuh"

namespace dta::kernels::internal {
namespace {

constexpr int kColumns = 32;                    // X's columns a block owns
constexpr int kThreads = 256;                   // per block
constexpr int kQuads = kColumns / 4;            // column quads: 8 threads across a row
constexpr int kThreadRows = kThreads / kQuads;  // 32
constexpr int kRowsA = 2;                       // step A: R rows per thread and row group
constexpr int kGroupA = kThreadRows * kRowsA;   // 64 rows of C per step A pass
constexpr int kRowsB = 4;                       // step B: X rows per thread and row group
constexpr int kGroupB = kThreadRows * kRowsB;   // 128 rows of Dk per step B pass

// Segments a launch takes: their chunk offsets travel in the kernel's parameters (1 KiB).
constexpr int kMaxSegments = 255;

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Shared memory, in elements: X [dk_pad][32], R [C][32], then `stages` times A and B, each
// [C][stride] (columns past Dk zero). stride = dk_pad + 4 puts step A's four rows of a warp on
// distinct banks for float32.
struct Layout {
  int dk_pad = 0, stride = 0, stages = 0;
  int64_t bytes = 0;
};

Layout PlanLayout(int64_t element_bytes, int64_t chunk, int64_t dk, int64_t max_bytes,
                  int max_stages = 2) {
  Layout l;
  l.dk_pad = static_cast<int>(RoundUp(dk, 4));
  l.stride = l.dk_pad + 4;
  for (int stages = max_stages; stages >= 1; --stages) {
    const int64_t elements =
        static_cast<int64_t>(kColumns) * (l.dk_pad + chunk) + 2LL * stages * chunk * l.stride;
    if (elements * element_bytes <= max_bytes) {
      l.stages = stages;
      l.bytes = elements * element_bytes;
      return l;
    }
  }
  return l;  // stages == 0: does not fit
}

int64_t MaxSharedBytes(int device) {
  int bytes = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return bytes;
}

// The stages a launch of `blocks` blocks uses. Two overlap a block's copies of the next chunk with
// its products, but at Qwen3-Next's shapes (C = 64, Dk = 128, float32: 159 KB) hold an SM to one
// block of 8 warps, whose products then wait on shared-memory loads; one stage (92 KB) lets two
// blocks share an SM and overlap each other's copies and products. So one stage when the launch
// has blocks for two an SM (a tree's runs as segments) and two one-stage blocks fit an SM.
// DTA_SCAN_STAGES=1 or 2 (read at every call) forces either, where it fits.
int ScanStages(int64_t element_bytes, int64_t chunk, int64_t dk, int64_t blocks, int device) {
  if (const char* forced = std::getenv("DTA_SCAN_STAGES")) {
    if (std::string(forced) == "1") return 1;
    if (std::string(forced) == "2") return 2;
  }
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(device);
  const Layout one = PlanLayout(element_bytes, chunk, dk, MaxSharedBytes(device), 1);
  const int64_t per_sm = static_cast<int64_t>(props->sharedMemPerMultiprocessor);
  const int64_t one_block = one.bytes + static_cast<int64_t>(props->reservedSharedMemPerBlock);
  const bool two_fit = one.stages == 1 && 2 * one_block <= per_sm;
  return two_fit && blocks >= 2 * props->multiProcessorCount ? 1 : 2;
}

template <typename T>
struct ScanParams {
  const T* a;      // [H, N, C, Dk]
  const T* b;      // [H, N, C, Dk]
  const T* add_a;  // [H, N, C, Dv] or null (zeros)
  const T* add_b;  // [H, N, Dk, Dv] or null (zeros)
  const T* decay;  // [H, N]
  const T* init;   // [S, H, Dk, Dv] or null (zeros): X before each segment's first step
  T* carried;      // [H, N, Dk, Dv]: X before each chunk's step B
  T* rows;         // [H, N, C, Dv]: R
  T* last;         // [S, H, Dk, Dv]: X after each segment's last step
  int chunks, chunk, dk, dv;
  int heads;
  // Segment s (blockIdx.y) is chunks [offsets[s], offsets[s + 1]) of the N.
  int offsets[kMaxSegments + 1];
  T sign_a, sign_b;
  bool reverse;    // chunks from N-1 down to 0
  bool vector_io;  // every global [.., Dv] row 16-byte aligned: 4-wide global loads and stores
  bool vector_ab;  // A and B 16-byte aligned and Dk a whole number of 16 bytes: 16-byte copies
  Layout layout;
};

template <typename T>
struct Four {
  T v[4];
};

// Four consecutive elements, 16-byte aligned, in shared or global memory (generic addressing).
__device__ __forceinline__ Four<float> Load4(const float* p) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  return {{x.x, x.y, x.z, x.w}};
}
__device__ __forceinline__ Four<double> Load4(const double* p) {
  const double2 x = reinterpret_cast<const double2*>(p)[0];
  const double2 y = reinterpret_cast<const double2*>(p)[1];
  return {{x.x, x.y, y.x, y.y}};
}
__device__ __forceinline__ void Store4(float* p, const Four<float>& f) {
  *reinterpret_cast<float4*>(p) = make_float4(f.v[0], f.v[1], f.v[2], f.v[3]);
}
__device__ __forceinline__ void Store4(double* p, const Four<double>& f) {
  reinterpret_cast<double2*>(p)[0] = make_double2(f.v[0], f.v[1]);
  reinterpret_cast<double2*>(p)[1] = make_double2(f.v[2], f.v[3]);
}

// Columns j .. j + 3 of a global row of dv elements; those at or past dv read as zero. `row` null:
// zeros. The vector path needs row + j 16-byte aligned (vector_io, j a multiple of 4).
template <typename T>
__device__ __forceinline__ Four<T> LoadGlobal4(const T* row, int j, int dv, bool vector_io) {
  Four<T> f = {{T(0), T(0), T(0), T(0)}};
  if (row == nullptr) return f;
  if (vector_io && j + 3 < dv) return Load4(row + j);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (j + q < dv) f.v[q] = row[j + q];
  }
  return f;
}

template <typename T>
__device__ __forceinline__ void StoreGlobal4(T* row, int j, int dv, bool vector_io,
                                             const Four<T>& f) {
  if (vector_io && j + 3 < dv) {
    Store4(row + j, f);
    return;
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (j + q < dv) row[j + q] = f.v[q];
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) ChunkScanKernel(const ScanParams<T> p) {
  WaitForPreviousKernels();
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const Layout l = p.layout;
  T* x = reinterpret_cast<T*>(shared_bytes);  // [dk_pad][kColumns]
  T* r = x + l.dk_pad * kColumns;             // [C][kColumns]
  T* mats = r + p.chunk * kColumns;           // stages x {A, B} x [C][stride]
  const int mat = p.chunk * l.stride;

  const int tiles = (p.dv + kColumns - 1) / kColumns;
  const int head = blockIdx.x / tiles;
  const int segment = blockIdx.y;
  const int first = p.offsets[segment], count = p.offsets[segment + 1] - first;
  const int64_t state_base = (static_cast<int64_t>(segment) * p.heads + head) * p.dk * p.dv;
  const int j0 = (blockIdx.x % tiles) * kColumns;  // the block's first column of X
  const int tid = threadIdx.x;
  const int jq = (tid % kQuads) * 4;  // this thread's column quad within the block's columns
  const int trow = tid / kQuads;
  const int64_t dkdv = static_cast<int64_t>(p.dk) * p.dv;
  const int64_t cdk = static_cast<int64_t>(p.chunk) * p.dk;

  // Padding must read as zero: A's and B's columns past Dk (cp.async writes only [0, C) x [0, Dk)),
  // X's rows past Dk and columns past Dv.
  for (int e = tid; e < 2 * l.stages * mat; e += kThreads) mats[e] = T(0);
  for (int e = tid; e < l.dk_pad * kColumns; e += kThreads) {
    const int k = e / kColumns, j = j0 + e % kColumns;
    x[e] = p.init != nullptr && k < p.dk && j < p.dv ? p.init[state_base + k * p.dv + j] : T(0);
  }
  __syncthreads();

  auto chunk_of = [&](int step) { return p.reverse ? first + count - 1 - step : first + step; };
  // Copies chunk `step`'s A and B into `stage`, asynchronously (one commit group).
  auto issue = [&](int step, int stage) {
    const int64_t base = (static_cast<int64_t>(head) * p.chunks + chunk_of(step)) * cdk;
    T* sa = mats + 2 * stage * mat;
    T* sb = sa + mat;
    if (p.vector_ab) {  // 16 bytes a copy: a row of Dk holds whole vectors
      constexpr int kPer = 16 / sizeof(T);
      for (int e = tid * kPer; e < cdk; e += kThreads * kPer) {
        const int c = e / p.dk, k = e - c * p.dk;
        __pipeline_memcpy_async(sa + c * l.stride + k, p.a + base + e, 16);
        __pipeline_memcpy_async(sb + c * l.stride + k, p.b + base + e, 16);
      }
    } else {
      for (int e = tid; e < cdk; e += kThreads) {
        const int c = e / p.dk, k = e - c * p.dk;
        __pipeline_memcpy_async(sa + c * l.stride + k, p.a + base + e, sizeof(T));
        __pipeline_memcpy_async(sb + c * l.stride + k, p.b + base + e, sizeof(T));
      }
    }
    __pipeline_commit();
  };

  if (count > 0) issue(0, 0);
  for (int step = 0; step < count; ++step) {
    const int i = chunk_of(step);
    const int stage = l.stages == 2 ? (step & 1) : 0;
    __pipeline_wait_prior(0);
    // This chunk's A and B are visible, and every thread is done with the previous chunk: X is
    // updated and the other stage's buffers are free for the next chunk.
    __syncthreads();
    if (l.stages == 2 && step + 1 < count) issue(step + 1, (step + 1) & 1);
    const T* sa = mats + 2 * stage * mat;
    const T* sb = sa + mat;
    const int64_t chunk_index = static_cast<int64_t>(head) * p.chunks + i;
    const int64_t rows_base = chunk_index * p.chunk * p.dv;
    const int64_t carried_base = chunk_index * dkdv;

    // Step A: R = add_a + sign_a A X, rows c0 + 2 trow + {0, 1} of each 64-row group. Rows past C
    // read row C - 1 and are not stored.
    for (int c0 = 0; c0 < p.chunk; c0 += kGroupA) {
      const int c = c0 + kRowsA * trow;
      Four<T> sum[kRowsA];
      Four<T> add[kRowsA];
      int row[kRowsA];
#pragma unroll
      for (int rr = 0; rr < kRowsA; ++rr) {
        const bool valid = c + rr < p.chunk;
        row[rr] = (valid ? c + rr : p.chunk - 1) * l.stride;
        add[rr] = LoadGlobal4(
            valid && p.add_a != nullptr ? p.add_a + rows_base + (c + rr) * p.dv : nullptr, j0 + jq,
            p.dv, p.vector_io);
        sum[rr] = {{T(0), T(0), T(0), T(0)}};
      }
      // Unrolled so that the next k's shared-memory loads issue under this k's multiply-adds.
#pragma unroll 4
      for (int k = 0; k < l.dk_pad; k += 4) {
        Four<T> xs[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) xs[q] = Load4(x + (k + q) * kColumns + jq);
#pragma unroll
        for (int rr = 0; rr < kRowsA; ++rr) {
          const Four<T> as = Load4(sa + row[rr] + k);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
#pragma unroll
            for (int col = 0; col < 4; ++col) sum[rr].v[col] += as.v[q] * xs[q].v[col];
          }
        }
      }
#pragma unroll
      for (int rr = 0; rr < kRowsA; ++rr) {
        Four<T> out;
#pragma unroll
        for (int col = 0; col < 4; ++col) out.v[col] = add[rr].v[col] + p.sign_a * sum[rr].v[col];
        if (c + rr < p.chunk) {
          Store4(r + (c + rr) * kColumns + jq, out);
          StoreGlobal4(p.rows + rows_base + (c + rr) * p.dv, j0 + jq, p.dv, p.vector_io, out);
        }
      }
    }
    __syncthreads();  // R is whole, and step A's reads of X are done

    // Step B: X = d X + sign_b B^T R + add_b, rows k0 .. k0 + 3 of each 128-row group.
    const T d = p.decay[chunk_index];
    for (int k0 = kRowsB * trow; k0 < l.dk_pad; k0 += kGroupB) {
      Four<T> old[kRowsB];
      Four<T> add[kRowsB];
      Four<T> sum[kRowsB];
#pragma unroll
      for (int rr = 0; rr < kRowsB; ++rr) {
        const int k = k0 + rr;
        old[rr] = Load4(x + k * kColumns + jq);
        if (k < p.dk) {
          StoreGlobal4(p.carried + carried_base + k * p.dv, j0 + jq, p.dv, p.vector_io, old[rr]);
        }
        add[rr] = LoadGlobal4(
            k < p.dk && p.add_b != nullptr ? p.add_b + carried_base + k * p.dv : nullptr, j0 + jq,
            p.dv, p.vector_io);
        sum[rr] = {{T(0), T(0), T(0), T(0)}};
      }
#pragma unroll 8
      for (int c = 0; c < p.chunk; ++c) {
        const Four<T> rs = Load4(r + c * kColumns + jq);
        const Four<T> bs = Load4(sb + c * l.stride + k0);
#pragma unroll
        for (int rr = 0; rr < kRowsB; ++rr) {
#pragma unroll
          for (int col = 0; col < 4; ++col) sum[rr].v[col] += bs.v[rr] * rs.v[col];
        }
      }
#pragma unroll
      for (int rr = 0; rr < kRowsB; ++rr) {
        Four<T> next;
#pragma unroll
        for (int col = 0; col < 4; ++col) {
          next.v[col] = d * old[rr].v[col] + p.sign_b * sum[rr].v[col] + add[rr].v[col];
        }
        Store4(x + (k0 + rr) * kColumns + jq, next);
      }
    }
    if (l.stages == 1 && step + 1 < count) {
      __syncthreads();  // every read of this chunk's A and B is done
      issue(step + 1, 0);
    }
  }
  __syncthreads();
  for (int e = tid; e < p.dk * kColumns; e += kThreads) {
    const int k = e / kColumns, j = j0 + e % kColumns;
    if (j < p.dv) p.last[state_base + k * p.dv + j] = x[e];
  }
}

bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename T>
void Launch(const at::Tensor& a, const at::Tensor& b, const at::Tensor& add_a,
            const at::Tensor& add_b, const at::Tensor& decay, const at::Tensor& init,
            const std::vector<int64_t>& offsets, bool reverse, T sign_a, T sign_b,
            at::Tensor& carried, at::Tensor& rows, at::Tensor& last) {
  const int64_t heads = a.size(0), dv = rows.size(3);
  ScanParams<T> p;
  p.a = a.data_ptr<T>();
  p.b = b.data_ptr<T>();
  p.add_a = add_a.defined() ? add_a.data_ptr<T>() : nullptr;
  p.add_b = add_b.defined() ? add_b.data_ptr<T>() : nullptr;
  p.decay = decay.data_ptr<T>();
  p.init = init.defined() ? init.data_ptr<T>() : nullptr;
  p.carried = carried.data_ptr<T>();
  p.rows = rows.data_ptr<T>();
  p.last = last.data_ptr<T>();
  p.chunks = static_cast<int>(a.size(1));
  p.heads = static_cast<int>(heads);
  p.chunk = static_cast<int>(a.size(2));
  p.dk = static_cast<int>(a.size(3));
  p.dv = static_cast<int>(dv);
  p.sign_a = sign_a;
  p.sign_b = sign_b;
  p.reverse = reverse;
  p.vector_io = (dv * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  for (const void* ptr : {static_cast<const void*>(p.add_a), static_cast<const void*>(p.add_b),
                          static_cast<const void*>(p.init), static_cast<const void*>(p.carried),
                          static_cast<const void*>(p.rows)}) {
    if (ptr != nullptr && !Aligned16(ptr)) p.vector_io = false;
  }
  p.vector_ab =
      (p.dk * static_cast<int64_t>(sizeof(T))) % 16 == 0 && Aligned16(p.a) && Aligned16(p.b);
  const int64_t blocks = heads * ((dv + kColumns - 1) / kColumns);
  const int64_t segments = static_cast<int64_t>(offsets.size()) - 1;
  const int device = a.device().index();
  const int stages = ScanStages(sizeof(T), p.chunk, p.dk,
                                blocks * std::min<int64_t>(segments, kMaxSegments), device);
  p.layout = PlanLayout(sizeof(T), p.chunk, p.dk, MaxSharedBytes(device), stages);
  TORCH_CHECK(p.layout.stages > 0, "chunk state recurrence: no kernel for C = ", p.chunk,
              ", Dk = ", p.dk, " (shared memory)");
  if (blocks == 0 || segments < 1) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaFuncSetAttribute(ChunkScanKernel<T>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(p.layout.bytes)));
  // The segments' states are [S, H, Dk, Dv]: a launch's first segment moves init and last.
  const int64_t state = heads * p.dk * dv;
  const T* init_base = p.init;
  T* last_base = p.last;
  for (int64_t s0 = 0; s0 < segments; s0 += kMaxSegments) {
    const int64_t n = std::min<int64_t>(kMaxSegments, segments - s0);
    for (int64_t s = 0; s <= n; ++s) p.offsets[s] = static_cast<int>(offsets[s0 + s]);
    p.init = init_base != nullptr ? init_base + s0 * state : nullptr;
    p.last = last_base + s0 * state;
    const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(n));
    C10_CUDA_CHECK(LaunchAfterPrevious(ChunkScanKernel<T>, grid, kThreads,
                                       static_cast<size_t>(p.layout.bytes), stream, p));
  }
}

}  // namespace

bool ChunkScanFits(at::ScalarType type, int64_t chunk, int64_t dk, int device) {
  if (type != at::kFloat && type != at::kDouble) return false;
  if (chunk < 1 || dk < 1 || chunk > (1 << 20) || dk > (1 << 20)) return false;
  const int64_t element = type == at::kDouble ? 8 : 4;
  return PlanLayout(element, chunk, dk, MaxSharedBytes(device)).stages > 0;
}

void ChunkScanCuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& add_a,
                   const at::Tensor& add_b, const at::Tensor& decay, const at::Tensor& init,
                   const std::vector<int64_t>& offsets, bool backward, at::Tensor& carried,
                   at::Tensor& rows, at::Tensor& last) {
  const c10::cuda::CUDAGuard guard(a.device());
  const double sign_a = backward ? 1.0 : -1.0, sign_b = backward ? -1.0 : 1.0;
  if (a.scalar_type() == at::kDouble) {
    Launch<double>(a, b, add_a, add_b, decay, init, offsets, backward, sign_a, sign_b, carried,
                   rows, last);
  } else {
    TORCH_CHECK(a.scalar_type() == at::kFloat, "chunk state recurrence: no kernel for ",
                a.scalar_type());
    Launch<float>(a, b, add_a, add_b, decay, init, offsets, backward, static_cast<float>(sign_a),
                  static_cast<float>(sign_b), carried, rows, last);
  }
}

}  // namespace dta::kernels::internal

#include "kernels/hopper/grouped_gemm_hopper.h"

#include <cuda_bf16.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace dta::kernels {
namespace {

using cute::Shape;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) each
using Bf16 = cutlass::bfloat16_t;

// Per expert: A = dy[rows]^T (M x K, M contiguous: column-major), B = x[rows] (K x N, N
// contiguous: row-major in CUTLASS's K x N view), C = D = accumulator[e] (M x N row-major).
using LayoutA = cutlass::layout::ColumnMajor;
using LayoutB = cutlass::layout::RowMajor;
using LayoutC = cutlass::layout::RowMajor;
constexpr int kAlignment16 = 8;  // bfloat16 elements in 16 bytes
constexpr int kAlignment32 = 4;  // float elements in 16 bytes

using TileShape = Shape<cute::_128, cute::_256, cute::_64>;
using ClusterShape = Shape<cute::_1, cute::_1, cute::_1>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, LayoutC*, kAlignment32,
    float, LayoutC*, kAlignment32, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<float, float, float, float>>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA*, kAlignment16, Bf16,
    LayoutB*, kAlignment16, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

using GemmKernel =
    cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using StrideA = typename GemmKernel::InternalStrideA;
using StrideB = typename GemmKernel::InternalStrideB;
using StrideC = typename GemmKernel::InternalStrideC;
using StrideD = typename GemmKernel::InternalStrideD;

constexpr int kMaxExperts = 4096;

// The device arrays the grouped GEMM reads, laid out in the launch's buffer.
struct Arrays {
  ProblemShape::UnderlyingProblemShape* problems;
  const Bf16** a;
  const Bf16** b;
  const float** c;
  float** d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideC* stride_c;
  StrideD* stride_d;
  void* workspace;
};

size_t Align(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The stride whose one dynamic mode (the other is a static 1, the batch mode a static 0) is
// `leading`.
template <class Stride>
__host__ __device__ Stride LeadingStride(int64_t leading) {
  Stride stride{};
  if constexpr (cute::is_static<decltype(cute::get<0>(stride))>::value) {
    cute::get<1>(stride) = leading;
  } else {
    cute::get<0>(stride) = leading;
  }
  return stride;
}

// The arrays laid out from `base` (any address: 0 measures the bytes they take, up to
// arrays.workspace).
Arrays Layout(uintptr_t base, int experts) {
  uintptr_t at = base;
  auto take = [&](size_t bytes) {
    const uintptr_t here = at;
    at += Align(bytes);
    return here;
  };
  const size_t n = static_cast<size_t>(experts);
  Arrays arrays{};
  arrays.problems = reinterpret_cast<ProblemShape::UnderlyingProblemShape*>(
      take(n * sizeof(ProblemShape::UnderlyingProblemShape)));
  arrays.a = reinterpret_cast<const Bf16**>(take(n * sizeof(void*)));
  arrays.b = reinterpret_cast<const Bf16**>(take(n * sizeof(void*)));
  arrays.c = reinterpret_cast<const float**>(take(n * sizeof(void*)));
  arrays.d = reinterpret_cast<float**>(take(n * sizeof(void*)));
  arrays.stride_a = reinterpret_cast<StrideA*>(take(n * sizeof(StrideA)));
  arrays.stride_b = reinterpret_cast<StrideB*>(take(n * sizeof(StrideB)));
  arrays.stride_c = reinterpret_cast<StrideC*>(take(n * sizeof(StrideC)));
  arrays.stride_d = reinterpret_cast<StrideD*>(take(n * sizeof(StrideD)));
  arrays.workspace = reinterpret_cast<void*>(at);
  return arrays;
}

size_t ArraysBytes(int experts) {
  return static_cast<size_t>(reinterpret_cast<uintptr_t>(Layout(0, experts).workspace));
}

typename Gemm::Arguments MakeArguments(const GroupedWeightGradParams& p, const Arrays& arrays) {
  typename Gemm::Arguments arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                     {p.experts, arrays.problems, nullptr},
                                     {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b},
                                     {{}, arrays.c, arrays.stride_c, arrays.d, arrays.stride_d}};
  arguments.epilogue.thread.alpha = 1.0f;
  // Accumulate: D = A B + C with C = D; overwrite: D = A B, and the epilogue skips loading C (a
  // zero beta), so whatever the gradient held, NaN included, is not read.
  arguments.epilogue.thread.beta = p.overwrite ? 0.0f : 1.0f;
  arguments.hw_info.sm_count = p.sm_count;
  return arguments;
}

// One thread per expert: its problem (an expert without rows gets an empty one, no tiles), its
// operands' addresses and strides.
__global__ void PrepareGroupedWeightGrad(GroupedWeightGradParams p, Arrays arrays) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= p.experts) return;
  const int64_t begin = e == 0 ? 0 : p.ends[e - 1];
  const int rows = static_cast<int>(p.ends[e] - begin);
  arrays.problems[e] = rows > 0 ? cute::make_shape(p.m, p.n, rows) : cute::make_shape(0, p.n, 0);
  arrays.a[e] = static_cast<const Bf16*>(p.dy) + begin * p.m;
  arrays.b[e] = static_cast<const Bf16*>(p.x) + begin * p.n;
  float* slot = p.accumulator + static_cast<int64_t>(e) * p.m * p.n;
  arrays.c[e] = slot;
  arrays.d[e] = slot;
  arrays.stride_a[e] = LeadingStride<StrideA>(p.m);
  arrays.stride_b[e] = LeadingStride<StrideB>(p.n);
  arrays.stride_c[e] = LeadingStride<StrideC>(p.n);
  arrays.stride_d[e] = LeadingStride<StrideD>(p.n);
}

// Overwriting: zeros into the slots of the experts without rows (the grouped GEMM has no tiles for
// them). Blocks (expert, part); those of experts with rows return at once.
__global__ void ZeroExpertsWithoutRows(GroupedWeightGradParams p) {
  const int e = blockIdx.x;
  const int64_t begin = e == 0 ? 0 : p.ends[e - 1];
  if (p.ends[e] > begin) return;
  const int64_t slot_vectors = static_cast<int64_t>(p.m) * p.n / 4;  // m, n multiples of 8
  float4* slot = reinterpret_cast<float4*>(p.accumulator + static_cast<int64_t>(e) * p.m * p.n);
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; i < slot_vectors;
       i += static_cast<int64_t>(gridDim.y) * blockDim.x) {
    slot[i] = zero;
  }
}

bool Aligned(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

}  // namespace

size_t HopperGroupedWeightGradBufferBytes(const GroupedWeightGradParams& p) {
  return ArraysBytes(p.experts) + Gemm::get_workspace_size(MakeArguments(p, Layout(0, p.experts)));
}

cudaError_t LaunchHopperGroupedWeightGrad(const GroupedWeightGradParams& p, void* buffer,
                                          size_t buffer_bytes, cudaStream_t stream) {
  if (p.experts <= 0 || p.experts > kMaxExperts || p.m % 8 != 0 || p.n % 8 != 0 || p.m <= 0 ||
      p.n <= 0 || !Aligned(p.accumulator) || !Aligned(p.dy) || !Aligned(p.x) ||
      buffer_bytes < HopperGroupedWeightGradBufferBytes(p)) {
    return cudaErrorInvalidValue;
  }
  const Arrays arrays = Layout(reinterpret_cast<uintptr_t>(buffer), p.experts);
  constexpr int kThreads = 128;
  PrepareGroupedWeightGrad<<<(p.experts + kThreads - 1) / kThreads, kThreads, 0, stream>>>(p,
                                                                                           arrays);
  if (cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  if (p.overwrite) {
    constexpr int kPartsPerExpert = 8;
    ZeroExpertsWithoutRows<<<dim3(p.experts, kPartsPerExpert), 256, 0, stream>>>(p);
    if (cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  }
  Gemm gemm;
  const typename Gemm::Arguments arguments = MakeArguments(p, arrays);
  if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (gemm.initialize(arguments, arrays.workspace, stream) != cutlass::Status::kSuccess)
    return cudaErrorInvalidValue;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  return cudaGetLastError();
}

}  // namespace dta::kernels

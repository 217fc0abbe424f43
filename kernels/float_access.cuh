// Device code's access to bfloat16, float16 and float32 tensors as float32, their type a run-time
// value (one kernel for the three instead of one instantiation each): Load widens exactly, Store
// and Round round to nearest even. Shared by the .cu files of kernels/.
#ifndef DTA_KERNELS_FLOAT_ACCESS_CUH_
#define DTA_KERNELS_FLOAT_ACCESS_CUH_

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace dta::kernels::internal {

enum class Dtype : int { kFloat, kBFloat16, kHalf };

// Throws for any other type.
inline Dtype DtypeOf(at::ScalarType type) {
  switch (type) {
    case at::kBFloat16:
      return Dtype::kBFloat16;
    case at::kHalf:
      return Dtype::kHalf;
    case at::kFloat:
      return Dtype::kFloat;
    default:
      TORCH_CHECK(false, "kernels: no CUDA kernel for ", type);
  }
}
inline Dtype DtypeOf(const at::Tensor& t) { return DtypeOf(t.scalar_type()); }

// A tensor's data with its element type, read and written as float32.
struct In {
  const void* data;
  Dtype type;
};
struct Out {
  void* data;
  Dtype type;
};
inline In InOf(const at::Tensor& t) { return {t.data_ptr(), DtypeOf(t)}; }
inline Out OutOf(at::Tensor& t) { return {t.data_ptr(), DtypeOf(t)}; }

__device__ __forceinline__ float Load(In in, int64_t i) {
  switch (in.type) {
    case Dtype::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(in.data)[i]);
    case Dtype::kHalf:
      return __half2float(static_cast<const __half*>(in.data)[i]);
    default:
      return static_cast<const float*>(in.data)[i];
  }
}

__device__ __forceinline__ void Store(Out out, int64_t i, float v) {
  switch (out.type) {
    case Dtype::kBFloat16:
      static_cast<__nv_bfloat16*>(out.data)[i] = __float2bfloat16_rn(v);
      break;
    case Dtype::kHalf:
      static_cast<__half*>(out.data)[i] = __float2half_rn(v);
      break;
    default:
      static_cast<float*>(out.data)[i] = v;
  }
}

// v rounded to `type` and read back as float32.
__device__ __forceinline__ float Round(float v, Dtype type) {
  switch (type) {
    case Dtype::kBFloat16:
      return __bfloat162float(__float2bfloat16_rn(v));
    case Dtype::kHalf:
      return __half2float(__float2half_rn(v));
    default:
      return v;
  }
}

}  // namespace dta::kernels::internal

#endif  // DTA_KERNELS_FLOAT_ACCESS_CUH_

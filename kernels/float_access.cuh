// Device code's access to bfloat16, float16 and float32 tensors as float32, their type a run-time
// value (one kernel for the three instead of one instantiation each): Load and Load8 widen exactly,
// Store, Store8 and Round round to nearest even. Shared by the .cu files of kernels/.
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

// Eight consecutive elements through one 16-byte access (bfloat16, float16) or two (float32): i a
// multiple of 8 and the data 16-byte aligned. Load8 widens exactly, Store8 rounds to nearest even.
constexpr int kVector = 8;

// The eight 16-bit floats of one 16-byte word as float32, through `widen` (a pair to a float2).
template <class Pair, class Widen>
__device__ __forceinline__ void Unpack8(const uint4& raw, float (&v)[kVector], Widen widen) {
  const Pair* pairs = reinterpret_cast<const Pair*>(&raw);
#pragma unroll
  for (int k = 0; k < kVector / 2; ++k) {
    const float2 f = widen(pairs[k]);
    v[2 * k] = f.x, v[2 * k + 1] = f.y;
  }
}

__device__ __forceinline__ void Load8(In in, int64_t i, float (&v)[kVector]) {
  if (in.type == Dtype::kFloat) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(in.data) + i);
    const float4 a = p[0], b = p[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    return;
  }
  const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(in.data) + i);
  if (in.type == Dtype::kBFloat16) {
    Unpack8<__nv_bfloat162>(raw, v, [](__nv_bfloat162 x) { return __bfloat1622float2(x); });
  } else {
    Unpack8<__half2>(raw, v, [](__half2 x) { return __half22float2(x); });
  }
}

__device__ __forceinline__ void Store8(Out out, int64_t i, const float (&v)[kVector]) {
  if (out.type == Dtype::kFloat) {
    float4* p = reinterpret_cast<float4*>(static_cast<float*>(out.data) + i);
    p[0] = make_float4(v[0], v[1], v[2], v[3]);
    p[1] = make_float4(v[4], v[5], v[6], v[7]);
    return;
  }
  uint4 raw;
  if (out.type == Dtype::kBFloat16) {
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int k = 0; k < kVector / 2; ++k) pairs[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
  } else {
    __half2* pairs = reinterpret_cast<__half2*>(&raw);
#pragma unroll
    for (int k = 0; k < kVector / 2; ++k) pairs[k] = __floats2half2_rn(v[2 * k], v[2 * k + 1]);
  }
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(out.data) + i) = raw;
}

}  // namespace dta::kernels::internal

#endif  // DTA_KERNELS_FLOAT_ACCESS_CUH_

#include "kernels/float32_bmm.h"

#include <cstdint>
#include <optional>
#include <vector>

#include "core/base/env_switch.h"

#ifdef DTA_KERNELS_HAVE_HOPPER
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/hopper/float32_bmm_hopper.h"
#endif

namespace dta::kernels {
namespace {

#ifdef DTA_KERNELS_HAVE_HOPPER
// The batch stride of x's leading dimensions when they collapse to one (x.dim() - 2 of them, each
// stride the next one's times its size; size-1 dimensions are free), or none.
std::optional<int64_t> BatchStride(const at::Tensor& x) {
  const int64_t batch_dims = x.dim() - 2;
  if (batch_dims == 0) return 0;
  std::optional<int64_t> inner;  // the stride of the innermost batch dimension with size > 1
  int64_t expected = 0;          // what the next outer dimension's stride must be
  for (int64_t d = batch_dims - 1; d >= 0; --d) {
    if (x.size(d) == 1) continue;
    if (!inner) {
      inner = x.stride(d);
    } else if (x.stride(d) != expected) {
      return std::nullopt;
    }
    expected = x.stride(d) * x.size(d);
  }
  return inner.value_or(0);
}

// x's last two dimensions as a CUTLASS operand, or none where they are neither row- nor
// column-major.
std::optional<Float32BmmOperand> Operand(const at::Tensor& x) {
  const std::optional<int64_t> batch = BatchStride(x);
  if (!batch) return std::nullopt;
  const int64_t rows = x.size(-2), cols = x.size(-1);
  Float32BmmOperand operand{.data = x.const_data_ptr<float>(), .batch_stride = *batch};
  if (x.stride(-1) == 1 || cols == 1) {
    operand.leading = rows == 1 ? cols : x.stride(-2);
  } else if (x.stride(-2) == 1 || rows == 1) {
    operand.column_major = true;
    operand.leading = x.stride(-1);
  } else {
    return std::nullopt;
  }
  return operand;
}

// The kernel's parameters for a @ b (the result's pointer left null), or none where it does not
// run.
std::optional<Float32BmmParams> KernelParams(const at::Tensor& a, const at::Tensor& b) {
  const bool shapes = a.dim() >= 3 && a.dim() == b.dim() && a.size(-1) == b.size(-2) &&
                      a.sizes().slice(0, a.dim() - 2) == b.sizes().slice(0, b.dim() - 2);
  if (!shapes || !a.is_cuda() || a.scalar_type() != at::kFloat || b.scalar_type() != at::kFloat ||
      b.device() != a.device() || a.numel() == 0 || b.numel() == 0 ||
      !EnvSwitchOn("DTA_FLOAT32_BMM") ||
      at::cuda::getDeviceProperties(a.get_device())->major != 9) {
    return std::nullopt;
  }
  const std::optional<Float32BmmOperand> left = Operand(a), right = Operand(b);
  const int64_t m = a.size(-2), n = b.size(-1), k = a.size(-1);
  const auto aligned = [](const Float32BmmOperand& x, int64_t contiguous_extent) {
    return reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && x.leading % 4 == 0 &&
           x.batch_stride % 4 == 0 && contiguous_extent % 4 == 0;
  };
  // The extent along each operand's contiguous dimension must be whole 16-byte vectors too.
  if (!left || !right || (left->column_major && right->column_major) ||
      !aligned(*left, left->column_major ? m : k) ||
      !aligned(*right, right->column_major ? k : n) || n % 4 != 0) {
    return std::nullopt;
  }
  return Float32BmmParams{.a = *left,
                          .b = *right,
                          .c_batch_stride = m * n,
                          .m = static_cast<int>(m),
                          .n = static_cast<int>(n),
                          .k = static_cast<int>(k),
                          .batch = a.numel() / (m * k)};
}
#endif

}  // namespace

bool Float32BmmUsesKernel(const at::Tensor& a, const at::Tensor& b) {
#ifdef DTA_KERNELS_HAVE_HOPPER
  return KernelParams(a, b).has_value();
#else
  (void)a;
  (void)b;
  return false;
#endif
}

at::Tensor Float32Bmm(const at::Tensor& a, const at::Tensor& b) {
#ifdef DTA_KERNELS_HAVE_HOPPER
  if (std::optional<Float32BmmParams> p = KernelParams(a, b)) {
    const c10::cuda::CUDAGuard guard(a.device());  // the launch goes to a's device
    std::vector<int64_t> shape = a.sizes().vec();
    shape.back() = b.size(-1);
    at::Tensor c = at::empty(shape, a.options());
    p->c = c.data_ptr<float>();
    const cudaError_t error =
        LaunchFloat32Bmm(*p, at::cuda::getCurrentCUDAStream(a.get_device()).stream());
    TORCH_CHECK(error == cudaSuccess, "Float32Bmm: ", cudaGetErrorString(error));
    return c;
  }
#endif
  return at::matmul(a, b);
}

}  // namespace dta::kernels

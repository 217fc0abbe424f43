#include "executor/device/safetensors_tensors.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <vector>

namespace dta {

TensorToWrite ToWrite(const std::string& name, DType dtype, const at::Tensor& tensor) {
  TORCH_CHECK(tensor.device().is_cpu() && tensor.is_contiguous(), "ToWrite('", name,
              "'): the tensor must be contiguous and on the CPU");
  return {.name = name,
          .dtype = dtype,
          .shape = std::vector<int64_t>(tensor.sizes().begin(), tensor.sizes().end()),
          .data = absl::Span<const uint8_t>(static_cast<const uint8_t*>(tensor.const_data_ptr()),
                                            tensor.nbytes())};
}

at::Tensor TensorFromView(const TensorView& view, at::ScalarType type) {
  at::Tensor tensor = at::empty(view.shape, at::TensorOptions().dtype(type));
  TORCH_CHECK(static_cast<size_t>(tensor.nbytes()) == view.data.size(), "tensor '", view.name,
              "' holds ", view.data.size(), " bytes, not the ", tensor.nbytes(), " of ", type);
  if (view.nbytes() > 0) std::memcpy(tensor.data_ptr(), view.data.data(), view.data.size());
  return tensor;
}

}  // namespace dta

// ATen tensors to and from core/checkpoint's safetensors reader and writer (which are torch-free).
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "core/checkpoint/safetensors.h"

namespace dta {

// Describes `tensor` (a contiguous CPU tensor, which must outlive the write) for WriteSafetensors.
TensorToWrite ToWrite(const std::string& name, DType dtype, const at::Tensor& tensor);

// A CPU tensor of `type` holding a copy of the stored bytes (copied rather than wrapped: a mapping
// only guarantees the alignment the file gives). `type` must have the stored element size.
at::Tensor TensorFromView(const TensorView& view, at::ScalarType type);

}  // namespace dta

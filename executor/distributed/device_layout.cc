#include "executor/distributed/device_layout.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdlib>

namespace dta {
namespace {

int64_t PhysicalMemoryBytes() {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
}

int64_t DeviceMemoryBytes(const at::Device& device) {
  if (!device.is_cuda()) return PhysicalMemoryBytes();
  cudaDeviceProp properties{};
  C10_CUDA_CHECK(cudaGetDeviceProperties(
      &properties, device.has_index() ? device.index() : c10::cuda::current_device()));
  return static_cast<int64_t>(properties.totalGlobalMem);
}

}  // namespace

absl::StatusOr<LayoutPlan> PlanDeviceLayout(const ModelConfig& config, int world_size,
                                            const at::Device& device, at::ScalarType dtype,
                                            const LayoutOverrides& overrides) {
  if (overrides.gpu_memory_gb < 0) return absl::InvalidArgumentError("gpu_memory_gb must be >= 0");
  if (overrides.tensor_parallel < 0)
    return absl::InvalidArgumentError("tensor_parallel must be >= 0");
  LayoutRequest request;
  request.world_size = world_size;
  // Ranks per node, as torchrun exports it; TP never crosses it.
  const char* local_world = std::getenv("LOCAL_WORLD_SIZE");
  request.gpus_per_node =
      local_world != nullptr && std::atoi(local_world) > 0 ? std::atoi(local_world) : world_size;
  request.gpu_bytes = overrides.gpu_memory_gb > 0
                          ? static_cast<int64_t>(overrides.gpu_memory_gb * 1e9)
                          : DeviceMemoryBytes(device);
  request.activation_bytes = overrides.activation_gb < 0
                                 ? kEstimatedActivations
                                 : static_cast<int64_t>(overrides.activation_gb * 1e9);
  request.executor = overrides.executor;
  request.host_bytes_per_node = PhysicalMemoryBytes();
  request.weight_bytes = static_cast<int32_t>(c10::elementSize(dtype));
  request.tensor_parallel = overrides.tensor_parallel;
  request.expert_parallel = overrides.expert_parallel;
  request.shard_optimizer = overrides.shard_optimizer;
  request.offload_optimizer = overrides.offload_optimizer;
  if (overrides.offload_resident_gb.has_value()) {
    if (!(*overrides.offload_resident_gb >= 0)) {
      return absl::InvalidArgumentError("offload_resident_gb must be >= 0");
    }
    request.offload_resident_bytes = static_cast<int64_t>(*overrides.offload_resident_gb * 1e9);
  }
  // Only state streamed through a GPU can stay there.
  if (!device.is_cuda() || !overrides.offload_streamed) {
    if (request.offload_resident_bytes.value_or(0) > 0) {
      return absl::InvalidArgumentError(
          "offload_resident_gb: an optimizer offloaded to the host keeps state on a GPU only when "
          "it is streamed through one (a CUDA device, offload_update gpu)");
    }
    request.offload_resident_bytes = 0;
  }
  return PlanLayout(config, request);
}

}  // namespace dta

// How a model is laid out for training across GPUs (tensor parallelism, optimizer state sharded
// across data-parallel ranks, optimizer state offloaded to the host) and the memory each GPU needs
// for it: the planner issue "Scale" builds on. Torch-free: it counts bytes from the config.
//
// The model of memory per GPU, for P parameters of which P_s are split across TP ranks (the
// projections, the embedding and lm_head, vocabulary-parallel) and P_r replicated (the norms):
//   weights     (P_s / TP + P_r) x weight bytes (2: bfloat16)
//   gradients   (P_s / TP + P_r) x 4            (float32, accumulated in full before the reduction)
//   optimizer   (P_s / TP + P_r) x 12 / DP      (float32 master + two moments; / DP when sharded;
//                                                when offloaded all of it on the host, and on the
//                                                GPU only the part its spare memory keeps)
//   activations the executor's own peak, estimated from the shape at this TP degree and the
//               executor's options (executor_memory.h), or the caller's reserve
//
//   absl::StatusOr<LayoutPlan> plan = PlanLayout(config, {.world_size = 8, .gpu_bytes = 80e9});
//   if (!plan.ok()) { print plan.status().message(): it names the numbers }
//   std::cout << DescribeLayout(*plan);
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/layout/executor_memory.h"
#include "core/model/model_config.h"

namespace dta {

struct ParameterCount {
  int64_t sharded = 0;     // split across tensor-parallel ranks (experts included)
  int64_t replicated = 0;  // held whole by every tensor-parallel rank (RMSNorms, o_proj's bias,
                           // MoE routers)
  // Mixture of experts: the routed experts' parameters (part of `sharded`), which expert
  // parallelism spreads over the EP ranks.
  int64_t experts = 0;
  // Mixture of experts: the parameters one token does not use, the num_experts -
  // num_experts_per_tok experts of each sparse layer it is not routed to (0 for dense models).
  int64_t unused_per_token = 0;
  int64_t total() const { return sharded + replicated; }
  // The parameters one token uses ("3B active" of Qwen3-30B-A3B; the embedding and lm_head
  // counted whole, as Qwen counts them).
  int64_t active() const { return total() - unused_per_token; }
};

// Exactly the parameters Decoder holds for `config`: its layer spec's (core/model/layer_spec.h;
// lm_head counted once when tied), sharded or replicated as the spec splits them.
ParameterCount CountParameters(const ModelConfig& config);

struct TrainingLayout {
  int32_t tensor_parallel = 1;
  int32_t data_parallel = 1;
  // Mixture of experts: every sparse layer's experts spread over this many consecutive replicas
  // (inside the DP ranks, as Megatron-Core: EP divides DP and the experts); their gradients are
  // summed and their optimizer state sharded over the DP / EP ranks holding the same experts.
  int32_t expert_parallel = 1;
  // ZeRO-1: float32 master weights and moments partitioned across the DP ranks of a TP slice.
  bool shard_optimizer = false;
  // Master weights and moments in pinned host memory, updated there.
  bool offload_optimizer = false;
  // With offload: bytes of each rank's optimizer state that also stay on its GPU, where they are
  // updated without crossing the bus (the host's copy is refreshed only to save them). The bus is
  // an offloaded step's limit, so the planner gives them the GPU's spare memory.
  int64_t offload_resident_bytes = 0;

  bool operator==(const TrainingLayout&) const = default;
};

// Bytes per GPU (and per rank on the host) of one layout.
struct MemoryEstimate {
  int64_t weights = 0;
  int64_t gradients = 0;
  int64_t optimizer = 0;       // on the GPU; when offloaded, the resident part
  int64_t activations = 0;     // the executor's estimate, or the reserve asked for
  int64_t host_optimizer = 0;  // per rank, when offloaded (all of it)
  // Whether `activations` is the executor's estimate (then its terms and token counts below) or
  // the reserve the request gave.
  bool activations_estimated = false;
  ExecutorMemoryEstimate executor;
  ExecutorTokens executor_tokens;
  int64_t gpu_total() const { return weights + gradients + optimizer + activations; }
};

// LayoutRequest::activation_bytes: estimate the executor's memory instead of reserving a size.
inline constexpr int64_t kEstimatedActivations = -1;

// What an automatic offload_resident_bytes leaves free on a GPU of `gpu_bytes`: 5% of it, at
// least 2 GiB (the allocator's fragmentation, the streaming buffers, the estimate's error).
int64_t ResidentHeadroom(int64_t gpu_bytes);

struct LayoutRequest {
  int32_t world_size = 1;
  // Tensor parallelism stays within a node.
  int32_t gpus_per_node = 8;
  // Memory each GPU may use, bytes (required).
  int64_t gpu_bytes = 0;
  // Reserve for the executor, bytes; negative (the default): EstimateExecutorMemory for
  // `executor` at each layout's TP degree and weight bytes.
  int64_t activation_bytes = kEstimatedActivations;
  // Host memory per node for offloaded optimizer state, bytes; 0: not checked.
  int64_t host_bytes_per_node = 0;
  // Bytes of one weight on the GPU (2: bfloat16).
  int32_t weight_bytes = 2;
  // Overrides: a fixed TP degree (0: choose), sharding and offload (nullopt: choose).
  int32_t tensor_parallel = 0;
  // Expert parallelism (mixture-of-experts models): a fixed degree, or 0: the smallest that fits
  // (1 for dense models).
  int32_t expert_parallel = 1;
  std::optional<bool> shard_optimizer;
  std::optional<bool> offload_optimizer;
  // With offload: the optimizer bytes kept on each GPU (capped at the rank's state); nullopt: what
  // the GPU holds beyond the rest of the estimate and kResidentHeadroom.
  std::optional<int64_t> offload_resident_bytes;
  // What drives the executor's memory when activation_bytes is estimated.
  ExecutorMemoryOptions executor;
};

struct LayoutPlan {
  TrainingLayout layout;
  MemoryEstimate memory;
  ParameterCount parameters;
  int64_t gpu_bytes = 0;  // what was available
};

MemoryEstimate EstimateMemory(const ModelConfig& config, const TrainingLayout& layout,
                              const LayoutRequest& request);

// The TP degrees a config allows on `request`: powers of two up to gpus_per_node that divide the
// world size, the attention heads, the KV heads and Qwen3-Next's linear-attention key heads; only
// 1 for a model with a layer the decoder cannot split (LayerSpec::tensor_parallel).
std::vector<int32_t> AllowedTensorParallel(const ModelConfig& config, const LayoutRequest& request);

// The EP degrees a config allows on `data_parallel` replicas: 1, and for mixture-of-experts models
// every degree dividing both the replicas and the experts.
std::vector<int32_t> AllowedExpertParallel(const ModelConfig& config, int32_t data_parallel);

// The first layout that fits, preferring the least communication: without offload before with
// it (an offloaded layout keeps what it can of the state on the GPU: offload_resident_bytes), then
// the smallest TP degree, then (with LayoutRequest::expert_parallel 0) the smallest EP degree
// (experts spread over replicas keep their GEMMs whole, where TP splits them); the optimizer is
// sharded whenever DP > 1 (ZeRO-1 moves as many bytes as the all-reduce it replaces). The
// executor's estimate shrinks with TP (its per-head and per-vocabulary terms are split), so a
// larger TP degree can fit where a smaller one does not. INVALID_ARGUMENT for a request that makes
// no sense (no GPU memory, a world size of 0, an override the config does not allow, executor
// options out of range), naming the field; RESOURCE_EXHAUSTED when nothing fits, naming the
// parameters, the GPUs and the smallest layout's bytes (with the executor's terms and token counts
// when estimated).
absl::StatusOr<LayoutPlan> PlanLayout(const ModelConfig& config, const LayoutRequest& request);

// A --shard_optimizer / --offload_optimizer value: "auto" (nullopt: the planner chooses), "true"
// ("on", "1") or "false" ("off", "0"). INVALID_ARGUMENT "--<flag> must be auto, true or false,
// got '<value>'" otherwise.
absl::StatusOr<std::optional<bool>> ParseLayoutChoice(std::string_view flag,
                                                      std::string_view value);

// One line, e.g. "layout: TP 2 x DP 4, optimizer sharded for 8.19B parameters; per GPU 38.2 GiB
// of 80.0 GiB: weights 7.6 GiB, ..., activations 9.1 GiB (estimated: stack 1.8, graphs 6.2,
// workspace 0.6, log-prob head 0.5 GiB for a 8192-token path and 2048 graph tokens)", for the
// training binaries to print at start.
std::string DescribeLayout(const LayoutPlan& plan);

// A parameter count as people write it: "8.19B", "596.05M", "12.3K", "950".
std::string FormatParameterCount(int64_t count);

}  // namespace dta

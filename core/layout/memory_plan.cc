#include "core/layout/memory_plan.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/field_error.h"
#include "core/base/status_macros.h"
#include "core/layout/gib.h"
#include "core/model/layer_spec.h"

namespace dta {
namespace {

constexpr int64_t kGradientBytes = 4;    // float32
constexpr int64_t kOptimizerBytes = 12;  // float32 master weights and two moments

std::string LayoutName(const TrainingLayout& layout) {
  const std::string experts =
      layout.expert_parallel > 1 ? absl::StrCat(" (experts: EP ", layout.expert_parallel, " x EDP ",
                                                layout.data_parallel / layout.expert_parallel, ")")
                                 : "";
  return absl::StrCat("TP ", layout.tensor_parallel, " x DP ", layout.data_parallel, experts,
                      layout.shard_optimizer ? ", optimizer sharded" : "",
                      layout.offload_optimizer ? ", optimizer offloaded to the host" : "");
}

// " (estimated: stack 1.8, graphs 6.2, workspace 0.6, log-prob head 0.5 GiB for a 8192-token path
// and 2048 graph tokens)", or "" for a reserve the request gave.
std::string ExecutorTerms(const MemoryEstimate& m) {
  if (!m.activations_estimated) return "";
  const ExecutorMemoryEstimate& e = m.executor;
  const ExecutorTokens& t = m.executor_tokens;
  return absl::StrCat(" (estimated: stack ", GiBNumber(e.stack), ", graphs ", GiBNumber(e.graphs),
                      ", workspace ", GiBNumber(e.workspace), ", log-prob head ",
                      GiBNumber(e.logprob_head), " GiB for ",
                      t.stack > 0 ? absl::StrCat("a ", t.stack, "-token path and ") : "", t.graphs,
                      " graph tokens)");
}

absl::Status CheckExecutorOptions(const ExecutorMemoryOptions& e) {
  if (e.longest_rollout < 1)
    return FieldError("executor.longest_rollout",
                      absl::StrCat("must be >= 1, got ", e.longest_rollout));
  if (e.block_size != kAutomaticCapacity && e.block_size < 1) {
    return FieldError("executor.block_size",
                      absl::StrCat("must be >= 1 or automatic (-1), got ", e.block_size));
  }
  if (e.graph_budget != kAutomaticCapacity && e.graph_budget < 0) {
    return FieldError("executor.graph_budget",
                      absl::StrCat("must be >= 0 or automatic (-1), got ", e.graph_budget));
  }
  if (e.token_capacity < 0)
    return FieldError("executor.token_capacity",
                      absl::StrCat("must be >= 0, got ", e.token_capacity));
  if (e.tree_tokens < 0)
    return FieldError("executor.tree_tokens", absl::StrCat("must be >= 0, got ", e.tree_tokens));
  if (e.logprob_slice_rows < 1) {
    return FieldError("executor.logprob_slice_rows",
                      absl::StrCat("must be >= 1, got ", e.logprob_slice_rows));
  }
  if (e.expert_parallel < 1) {
    return FieldError("executor.expert_parallel",
                      absl::StrCat("must be >= 1, got ", e.expert_parallel));
  }
  return absl::OkStatus();
}

// Whether the config has layers without a tensor-parallel split (Qwen3-Next's).
bool HasTensorParallelGap(const ModelConfig& config) {
  return !BuildModelSpec(config).tensor_parallel();
}

// The linear-attention layers' key heads, which tensor parallelism splits (0 without any).
int64_t LinearKeyHeads(const ModelConfig& config) {
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    if (IsLinearAttentionLayer(config, layer)) return config.linear_num_key_heads;
  }
  return 0;
}

bool Fits(const MemoryEstimate& memory, const LayoutRequest& request, int32_t ranks_per_node) {
  if (memory.gpu_total() > request.gpu_bytes) return false;
  return request.host_bytes_per_node == 0 ||
         memory.host_optimizer * ranks_per_node <= request.host_bytes_per_node;
}

}  // namespace

ParameterCount CountParameters(const ModelConfig& c) {
  const ModelSpec spec = BuildModelSpec(c);
  ParameterCount count;
  for (const ParameterSpec& parameter : spec.Parameters()) {
    (parameter.split.replicated() ? count.replicated : count.sharded) += parameter.numel();
  }
  // A token uses k of a sparse layer's experts: the others' gate, up and down are unused.
  for (const LayerSpec& layer : spec.layers) {
    if (!layer.sparse()) continue;
    for (const ParameterSpec& parameter : layer.parameters) {
      if (parameter.per_expert()) {
        count.experts += parameter.numel();
        count.unused_per_token +=
            parameter.numel() / c.num_experts * (c.num_experts - c.num_experts_per_tok);
      }
    }
  }
  return count;
}

MemoryEstimate EstimateMemory(const ModelConfig& config, const TrainingLayout& layout,
                              const LayoutRequest& request) {
  const ParameterCount count = CountParameters(config);
  // Each rank's parameters; a sharded dimension that does not divide evenly rounds up. Its
  // experts are 1 / EP of them; their optimizer state is sharded over the DP / EP ranks holding
  // the same experts, the rest's over the DP ranks.
  const int64_t tp = layout.tensor_parallel;
  const int64_t ep = layout.expert_parallel;
  const int64_t experts = (count.experts + tp * ep - 1) / (tp * ep);
  const int64_t dense = (count.sharded - count.experts + tp - 1) / tp + count.replicated;
  const int64_t local = dense + experts;
  const int64_t dp = layout.shard_optimizer ? layout.data_parallel : 1;
  const int64_t edp = layout.shard_optimizer ? layout.data_parallel / ep : 1;
  const int64_t optimizer =
      (dense * kOptimizerBytes + dp - 1) / dp + (experts * kOptimizerBytes + edp - 1) / edp;
  MemoryEstimate memory;
  memory.weights = local * request.weight_bytes;
  memory.gradients = local * kGradientBytes;
  if (request.activation_bytes >= 0) {
    memory.activations = request.activation_bytes;
  } else {
    memory.activations_estimated = true;
    ExecutorMemoryOptions executor = request.executor;
    executor.expert_parallel = layout.expert_parallel;
    memory.executor_tokens = PlannedExecutorTokens(executor);
    memory.executor = EstimateExecutorMemory(config, executor, memory.executor_tokens,
                                             layout.tensor_parallel, request.weight_bytes);
    memory.activations = memory.executor.total();
  }
  if (layout.offload_optimizer) {
    memory.host_optimizer = optimizer;
    memory.optimizer = std::clamp<int64_t>(layout.offload_resident_bytes, 0, optimizer);
  } else {
    memory.optimizer = optimizer;
  }
  return memory;
}

int64_t ResidentHeadroom(int64_t gpu_bytes) {
  return std::max<int64_t>(int64_t{2} << 30, gpu_bytes / 20);
}

std::vector<int32_t> AllowedTensorParallel(const ModelConfig& config,
                                           const LayoutRequest& request) {
  std::vector<int32_t> allowed;
  // A layer without a tensor-parallel split: the model refuses TP > 1, so the planner does not
  // propose it.
  const bool splits = !HasTensorParallelGap(config);
  for (int32_t tp = 1; tp <= request.gpus_per_node && tp <= request.world_size; tp *= 2) {
    if (tp > 1 && !splits) break;
    // Whole heads per rank.
    if (request.world_size % tp == 0 && config.num_attention_heads % tp == 0 &&
        config.num_key_value_heads % tp == 0 && LinearKeyHeads(config) % tp == 0) {
      allowed.push_back(tp);
    }
  }
  return allowed;
}

std::vector<int32_t> AllowedExpertParallel(const ModelConfig& config, int32_t data_parallel) {
  std::vector<int32_t> allowed = {1};
  for (int32_t ep = 2; ep <= data_parallel && ep <= config.num_experts; ++ep) {
    if (data_parallel % ep == 0 && config.num_experts % ep == 0) allowed.push_back(ep);
  }
  return allowed;
}

absl::StatusOr<LayoutPlan> PlanLayout(const ModelConfig& config, const LayoutRequest& request) {
  if (request.world_size < 1) return FieldError("world_size", "must be >= 1");
  if (request.gpus_per_node < 1) return FieldError("gpus_per_node", "must be >= 1");
  if (request.gpu_bytes <= 0)
    return FieldError("gpu_bytes", "must be positive (the memory of one GPU)");
  if (request.activation_bytes < 0) RETURN_IF_ERROR(CheckExecutorOptions(request.executor));
  if (request.weight_bytes < 1) return FieldError("weight_bytes", "must be >= 1");
  if (config.num_attention_heads < 1 || config.num_key_value_heads < 1) {
    return FieldError("config", "needs attention heads and KV heads");
  }
  std::vector<int32_t> degrees = AllowedTensorParallel(config, request);
  if (request.tensor_parallel != 0) {
    bool allowed = false;
    for (int32_t tp : degrees) allowed |= tp == request.tensor_parallel;
    if (!allowed) {
      if (HasTensorParallelGap(config)) {
        return FieldError(
            "tensor_parallel",
            absl::StrCat(request.tensor_parallel, " is not allowed: ", config.model_type,
                         " models have no tensor-parallel split yet (use 1)"));
      }
      const int64_t linear = LinearKeyHeads(config);
      return FieldError(
          "tensor_parallel",
          absl::StrCat(
              request.tensor_parallel, " is not allowed: it must be a power of two ",
              "up to the GPUs per node (", request.gpus_per_node, ") dividing the world size (",
              request.world_size, "), the ", config.num_attention_heads, " attention heads",
              linear > 0 ? ", the " : " and the ", config.num_key_value_heads, " KV heads",
              linear > 0 ? absl::StrCat(" and the ", linear, " linear-attention key heads") : ""));
    }
    degrees = {request.tensor_parallel};
  }
  if (request.offload_resident_bytes.has_value() && *request.offload_resident_bytes < 0) {
    return FieldError("offload_resident_bytes",
                      absl::StrCat("must be >= 0, got ", *request.offload_resident_bytes));
  }
  if (request.expert_parallel < 0) {
    return FieldError("expert_parallel",
                      absl::StrCat("must be >= 0, got ", request.expert_parallel));
  }
  if (request.expert_parallel > 1) {
    bool allowed = false;
    for (int32_t tp : degrees) {
      for (int32_t ep : AllowedExpertParallel(config, request.world_size / tp))
        allowed |= ep == request.expert_parallel;
    }
    if (!allowed) {
      return FieldError(
          "expert_parallel",
          absl::StrCat(request.expert_parallel, " is not allowed: ",
                       config.num_experts == 0
                           ? absl::StrCat(config.model_type, " models have no experts (use 1)")
                           : absl::StrCat("it must divide the ", config.num_experts,
                                          " experts and the data-parallel ranks (the world size ",
                                          request.world_size, " over the tensor parallelism)")));
    }
  }
  const ParameterCount parameters = CountParameters(config);
  std::optional<LayoutPlan> smallest;
  for (const bool offload : {false, true}) {
    if (request.offload_optimizer.has_value() && *request.offload_optimizer != offload) continue;
    for (int32_t tp : degrees) {
      const int32_t dp = request.world_size / tp;
      std::vector<int32_t> eps = {request.expert_parallel};
      if (request.expert_parallel == 0) eps = AllowedExpertParallel(config, dp);
      for (int32_t ep : eps) {
        if (dp % ep != 0) continue;  // a fixed degree another TP allows
        TrainingLayout layout;
        layout.tensor_parallel = tp;
        layout.data_parallel = dp;
        layout.expert_parallel = ep;
        layout.shard_optimizer = request.shard_optimizer.value_or(layout.data_parallel > 1);
        layout.offload_optimizer = offload;
        LayoutPlan plan{layout, EstimateMemory(config, layout, request), parameters,
                        request.gpu_bytes};
        const int32_t ranks_per_node = std::min(request.gpus_per_node, request.world_size);
        if (Fits(plan.memory, request, ranks_per_node)) {
          if (offload) {
            const int64_t spare =
                request.gpu_bytes - plan.memory.gpu_total() - ResidentHeadroom(request.gpu_bytes);
            plan.layout.offload_resident_bytes =
                std::min(plan.memory.host_optimizer,
                         request.offload_resident_bytes.value_or(std::max<int64_t>(0, spare)));
            plan.memory = EstimateMemory(config, plan.layout, request);
            if (!Fits(plan.memory, request, ranks_per_node)) {
              return FieldError(
                  "offload_resident_bytes",
                  absl::StrCat(GiB(plan.memory.optimizer), " of optimizer state on each GPU do ",
                               "not fit beside the rest (", LayoutName(plan.layout), ": ",
                               GiB(plan.memory.gpu_total()), " of ", GiB(request.gpu_bytes), ")"));
            }
          }
          return plan;
        }
        if (!smallest.has_value() || plan.memory.gpu_total() < smallest->memory.gpu_total())
          smallest = plan;
      }
    }
  }
  if (!smallest.has_value()) {
    return FieldError("offload_optimizer", "no layout is left by the overrides");
  }
  const MemoryEstimate& m = smallest->memory;
  std::string host;
  if (request.host_bytes_per_node > 0 && m.host_optimizer > 0) {
    host =
        absl::StrCat(", and ", GiB(m.host_optimizer), " of optimizer state per rank on hosts of ",
                     GiB(request.host_bytes_per_node));
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "a model of ", FormatParameterCount(parameters.total()), " parameters cannot be trained on ",
      request.world_size, " GPU(s) of ", GiB(request.gpu_bytes), ": the smallest layout allowed (",
      LayoutName(smallest->layout), ") needs ", GiB(m.gpu_total()), " per GPU (weights ",
      GiB(m.weights), ", gradients ", GiB(m.gradients), ", optimizer ", GiB(m.optimizer),
      ", activations ", GiB(m.activations), ExecutorTerms(m), ")", host,
      HasTensorParallelGap(config)
          ? absl::StrCat(" (", config.model_type,
                         " has no tensor parallelism yet); allow offload, or ")
      : config.num_experts > 0 ? "; add GPUs, allow offload, tensor or expert parallelism, or "
                               : "; add GPUs, allow offload or tensor parallelism, or ",
      m.activations_estimated
          ? "lower the executor's block size and graph budget (or give an activation reserve)"
          : "lower the activation reserve"));
}

absl::StatusOr<std::optional<bool>> ParseLayoutChoice(std::string_view flag,
                                                      std::string_view value) {
  if (value == "auto") return std::optional<bool>();
  if (value == "true" || value == "on" || value == "1") return std::optional<bool>(true);
  if (value == "false" || value == "off" || value == "0") return std::optional<bool>(false);
  return absl::InvalidArgumentError(absl::StrCat(
      "--", std::string(flag), " must be auto, true or false, got '", std::string(value), "'"));
}

std::string FormatParameterCount(int64_t count) {
  const double n = static_cast<double>(count);
  if (n >= 1e9) return absl::StrFormat("%.2fB", n / 1e9);
  if (n >= 1e6) return absl::StrFormat("%.2fM", n / 1e6);
  if (n >= 1e3) return absl::StrFormat("%.1fK", n / 1e3);
  return absl::StrCat(count);
}

std::string DescribeLayout(const LayoutPlan& plan) {
  const MemoryEstimate& m = plan.memory;
  std::string out = absl::StrCat(
      "layout: ", LayoutName(plan.layout), " for ", FormatParameterCount(plan.parameters.total()),
      " parameters",
      plan.parameters.unused_per_token > 0
          ? absl::StrCat(" (", FormatParameterCount(plan.parameters.active()), " active per token)")
          : std::string(),
      "; per GPU ", GiB(m.gpu_total()), " of ", GiB(plan.gpu_bytes), ": weights ", GiB(m.weights),
      ", gradients ", GiB(m.gradients), ", optimizer ", GiB(m.optimizer), ", activations ",
      GiB(m.activations), ExecutorTerms(m));
  if (m.host_optimizer > 0) {
    absl::StrAppend(&out, "; host: ", GiB(m.host_optimizer), " per rank");
    if (m.optimizer > 0) {
      absl::StrAppend(&out, " (", GiB(m.optimizer), " of it also on the GPU, updated there)");
    }
  }
  return out;
}

}  // namespace dta

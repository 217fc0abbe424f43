// dta-layout: the training layout (tensor parallelism, sharded or offloaded optimizer state) a
// model needs on some GPUs, and the memory each GPU and host then holds (core/layout).
//
//   dta-layout --config=qwen3-8b --world_size=8 --gpu_gb=80
//   dta-layout --table                     # the memory table of docs/benchmarks.md
//   dta-layout --config=qwen3-8b --longest_rollout=16384 --block_size=4096 --graph_budget=4096
//
// The executor's share is estimated from the model at each TP degree and the executor flags
// (core/layout/executor_memory.h) unless --activation_gb gives a reserve.
//
// Exit status: 0 with the layout printed, 1 when nothing fits (the message names the numbers),
// 2 on bad input.
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/base/exit_codes.h"
#include "core/cli/bad_input.h"
#include "core/cli/usage.h"
#include "core/layout/memory_plan.h"
#include "core/model/config_json.h"
#include "core/model/model_config.h"

ABSL_FLAG(std::string, config, "",
          absl::StrCat("a preset (", absl::StrJoin(dta::ModelPresetNames(), ", "),
                       ") or a config.json; required without --table"));
ABSL_FLAG(int32_t, world_size, 1, "GPUs in all");
ABSL_FLAG(int32_t, gpus_per_node, 8, "GPUs per node (tensor parallelism stays within one)");
ABSL_FLAG(double, gpu_gb, 80, "memory of one GPU, GiB");
ABSL_FLAG(double, activation_gb, -1,
          "reserve for the executor per GPU, GiB; negative: the executor's own peak, estimated "
          "from the model at each TP degree, --longest_rollout, --block_size, --graph_budget and "
          "--pack (core/layout/executor_memory.h)");
ABSL_FLAG(int64_t, longest_rollout, dta::kDefaultPlannedRollout,
          "the longest rollout, tokens (the executor's path stack; B when automatic)");
ABSL_FLAG(int64_t, block_size, dta::kAutomaticCapacity,
          "dta's B, tokens per chunk (-1: automatic, planned at min(longest rollout, 2048))");
ABSL_FLAG(int64_t, graph_budget, dta::kAutomaticCapacity,
          "dta's kept graphs, tokens (-1: automatic, planned as 0)");
ABSL_FLAG(bool, pack, dta::ExecutorMemoryOptions{}.pack,
          "dta: packed steps of up to B tokens, as dta-train's default (--nopack: the paper's "
          "schedule)");
ABSL_FLAG(double, host_gb, 0,
          "host memory per node for offloaded optimizer state, GiB (0: not checked)");
ABSL_FLAG(int32_t, tensor_parallel, 0, "the TP degree (0: choose)");
ABSL_FLAG(int32_t, expert_parallel, 0,
          "mixture-of-experts models: the EP degree, experts spread over that many replicas "
          "(0: choose)");
ABSL_FLAG(std::string, shard_optimizer, "auto", "auto, true or false: ZeRO-1 across the DP ranks");
ABSL_FLAG(std::string, offload_optimizer, "auto",
          "auto, true or false: optimizer state in host memory");
ABSL_FLAG(bool, table, false,
          "print the memory table (Qwen3 1.7B to 32B on 1 to 8 GPUs of 80 and 141 GiB, "
          "Qwen3-30B-A3B and Qwen3-235B-A22B on 1 to 64)");

namespace dta {
namespace {

constexpr double kGiB = double{int64_t{1} << 30};

std::optional<bool> Choice(const char* flag, const std::string& value) {
  absl::StatusOr<std::optional<bool>> choice = ParseLayoutChoice(flag, value);
  if (!choice.ok()) throw BadInput{std::string(choice.status().message())};
  return *choice;
}

ModelConfig ConfigFromFlag(const std::string& name) {
  absl::StatusOr<ModelConfig> config = ModelConfigFromName(name);
  if (!config.ok()) throw BadInput{absl::StrCat("--config: ", config.status().message())};
  return *config;
}

int PrintTable(const LayoutRequest& base) {
  std::printf(
      "| Model | Parameters | GPUs | GPU memory | Layout | Per GPU (GiB) | of which executor "
      "(GiB) | Host per rank (GiB) |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (const char* name :
       {"qwen3-1.7b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b", "qwen3-235b-a22b"}) {
    const ModelConfig config = ConfigFromFlag(name);
    for (const double gpu_gb : {80.0, 141.0}) {
      // Mixture-of-experts models also on 2, 4 and 8 nodes (expert parallelism across them).
      std::vector<int32_t> gpu_counts = {1, 2, 4, 8};
      if (config.num_experts > 0) gpu_counts.insert(gpu_counts.end(), {16, 32, 64});
      for (const int32_t gpus : gpu_counts) {
        LayoutRequest request = base;
        request.world_size = gpus;
        request.gpu_bytes = static_cast<int64_t>(gpu_gb * kGiB);
        const absl::StatusOr<LayoutPlan> plan = PlanLayout(config, request);
        if (plan.status().code() == absl::StatusCode::kInvalidArgument)
          throw BadInput{std::string(plan.status().message())};
        const double billions = static_cast<double>(CountParameters(config).total()) / 1e9;
        if (!plan.ok()) {
          std::printf("| %s | %.2fB | %d | %.0f GiB | does not fit | - | - | - |\n", name, billions,
                      gpus, gpu_gb);
          continue;
        }
        const TrainingLayout& l = plan->layout;
        const std::string experts =
            l.expert_parallel > 1 ? absl::StrCat(", EP ", l.expert_parallel) : "";
        const std::string offloaded =
            !l.offload_optimizer ? ""
            : plan->memory.optimizer > 0
                ? absl::StrFormat(", offloaded (%.1f GiB of it kept on the GPU)",
                                  static_cast<double>(plan->memory.optimizer) / kGiB)
                : ", offloaded";
        std::printf(
            "| %s | %.2fB | %d | %.0f GiB | TP %d x DP %d%s%s%s | %.1f | %.1f | %s |\n", name,
            billions, gpus, gpu_gb, l.tensor_parallel, l.data_parallel, experts.c_str(),
            l.shard_optimizer ? ", sharded" : "", offloaded.c_str(),
            static_cast<double>(plan->memory.gpu_total()) / kGiB,
            static_cast<double>(plan->memory.activations) / kGiB,
            plan->memory.host_optimizer > 0
                ? absl::StrFormat("%.1f", static_cast<double>(plan->memory.host_optimizer) / kGiB)
                      .c_str()
                : "-");
      }
    }
  }
  return kExitOk;
}

int Run() {
  LayoutRequest request;
  request.gpus_per_node = absl::GetFlag(FLAGS_gpus_per_node);
  const double activation_gb = absl::GetFlag(FLAGS_activation_gb);
  request.activation_bytes =
      activation_gb < 0 ? kEstimatedActivations : static_cast<int64_t>(activation_gb * kGiB);
  request.executor = {.longest_rollout = absl::GetFlag(FLAGS_longest_rollout),
                      .block_size = absl::GetFlag(FLAGS_block_size),
                      .graph_budget = absl::GetFlag(FLAGS_graph_budget),
                      .pack = absl::GetFlag(FLAGS_pack)};
  request.host_bytes_per_node = static_cast<int64_t>(absl::GetFlag(FLAGS_host_gb) * kGiB);
  request.expert_parallel = absl::GetFlag(FLAGS_expert_parallel);
  if (absl::GetFlag(FLAGS_table)) return PrintTable(request);
  if (absl::GetFlag(FLAGS_config).empty()) throw BadInput{"--config is required (or --table)"};
  const ModelConfig config = ConfigFromFlag(absl::GetFlag(FLAGS_config));
  request.world_size = absl::GetFlag(FLAGS_world_size);
  request.gpu_bytes = static_cast<int64_t>(absl::GetFlag(FLAGS_gpu_gb) * kGiB);
  request.tensor_parallel = absl::GetFlag(FLAGS_tensor_parallel);
  request.shard_optimizer = Choice("shard_optimizer", absl::GetFlag(FLAGS_shard_optimizer));
  request.offload_optimizer = Choice("offload_optimizer", absl::GetFlag(FLAGS_offload_optimizer));
  const absl::StatusOr<LayoutPlan> plan = PlanLayout(config, request);
  if (plan.status().code() == absl::StatusCode::kInvalidArgument)
    throw BadInput{std::string(plan.status().message())};
  if (!plan.ok()) {
    std::cerr << "dta-layout: " << plan.status().message() << "\n";
    return kExitError;
  }
  std::printf("%s\n", DescribeLayout(*plan).c_str());
  return kExitOk;
}

}  // namespace
}  // namespace dta

int main(int argc, char** argv) {
  dta::SetProgramUsage(
      "dta-layout --config=PRESET|config.json [--world_size=N] [--gpu_gb=80] | --table");
  const std::vector<char*> rest = dta::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::cerr << "dta-layout: unexpected argument '" << rest[1] << "'\n";
    return dta::kExitBadInput;
  }
  try {
    return dta::Run();
  } catch (const dta::BadInput& e) {
    std::cerr << "dta-layout: " << e.message << "\n";
    return dta::kExitBadInput;
  }
}

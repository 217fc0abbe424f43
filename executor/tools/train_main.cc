// dta-train: training steps on a rollout file with one execution method.
//
//   dta-train --config=qwen3-0.6b | --config=DIR/config.json | --model=HF_DIR
//             --rollouts=FILE.jsonl [--method=dta|dense|packed] [--loss=grpo|sft|decoupled-ppo|gspo]
//             [--dtype=float32] [--device=cpu] [--block_size=2048] [--steps=1] [--lr=1e-6]
//             [--dump_grads=FILE.safetensors] [--save=DIR] [--json]
//
// Prints per step: loss, gradient norm, rollout tokens, tokens forwarded, compression, time,
// rollout tokens per second and peak memory. --dump_grads writes the first step's gradients under
// the Hugging Face parameter names, so methods (or other frameworks) can be compared bit by bit.
// Exit status: 0 on success, 2 on bad input (flags, files, rollouts, checkpoints).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "executor/engine/executor.h"
#include "executor/io/rollout_jsonl.h"
#include "executor/model/qwen3_checkpoint.h"
#include "executor/optim/adamw.h"
#include "executor/tools/training_flags.h"
#include "executor/tree/tree_stats.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, rollouts, "", "rollout file (JSON Lines); required");
ABSL_FLAG(int32_t, steps, 1, "optimizer steps over the batch");
ABSL_FLAG(std::string, dump_grads, "", "write the first step's gradients to this safetensors file");
ABSL_FLAG(std::string, save, "", "save the trained model (HF format) and optimizer state to this directory");
ABSL_FLAG(std::string, resume, "", "load optimizer state (optimizer.safetensors) from this directory first");
ABSL_FLAG(bool, json, false, "print one JSON object per step instead of a table");
ABSL_FLAG(std::string, metrics, "", "also append one JSON object per step to this file");

namespace dta {
namespace {

int Run() {
  const LossOptions loss = LossFromFlags();
  const ExecutorOptions executor = ExecutorFromFlags();
  const at::TensorOptions options = TensorOptionsFromFlags();
  const std::string path = absl::GetFlag(FLAGS_rollouts);
  if (path.empty()) throw BadInput{"--rollouts is required"};
  if (absl::GetFlag(FLAGS_steps) < 1) throw BadInput{"--steps must be >= 1"};
  Qwen3Model model = ModelFromFlags(options);
  absl::StatusOr<std::vector<Rollout>> rollouts = ReadRolloutsJsonl(path, {.vocab_size = model.config().vocab_size});
  if (!rollouts.ok()) throw BadInput{std::string(rollouts.status().message())};
  std::vector<std::vector<TokenId>> sequences;
  for (const Rollout& r : *rollouts) sequences.push_back(r.tokens);
  const TreeStats stats = ComputeTreeStats(*PrefixTree::FromRollouts(sequences));

  AdamW optimizer(model.named_parameters(), AdamWFromFlags());
  if (!absl::GetFlag(FLAGS_resume).empty()) {
    optimizer.LoadState((std::filesystem::path(absl::GetFlag(FLAGS_resume)) / "optimizer.safetensors").string());
  }
  const bool json = absl::GetFlag(FLAGS_json);
  if (!json) {
    std::cout << absl::StrFormat("%s: %d rollouts, %d rollout tokens, %d tree tokens (C = %.2fx); method %s, %s on %s\n",
                                 path, stats.num_rollouts, stats.rollout_tokens, stats.tree_tokens, stats.compression,
                                 absl::GetFlag(FLAGS_method), absl::GetFlag(FLAGS_dtype), absl::GetFlag(FLAGS_device));
    std::cout << absl::StrFormat("%5s %14s %10s %12s %12s %9s %14s %10s\n", "step", "loss", "grad norm",
                                 "rollout tok", "forwarded", "time s", "rollout tok/s", "peak GiB");
  }
  const at::Device device = options.device();
  std::ofstream metrics;
  if (!absl::GetFlag(FLAGS_metrics).empty()) {
    metrics.open(absl::GetFlag(FLAGS_metrics), std::ios::app);
    if (!metrics) throw BadInput{"cannot open --metrics file " + absl::GetFlag(FLAGS_metrics)};
  }
  for (int32_t step = 1; step <= absl::GetFlag(FLAGS_steps); ++step) {
    optimizer.ZeroGrad();
    ResetPeakMemory(device);
    const auto start = std::chrono::steady_clock::now();
    const GradientResult result = ComputeGradients(model, *rollouts, loss, executor);
    if (step == 1 && !absl::GetFlag(FLAGS_dump_grads).empty()) {
      std::vector<std::pair<std::string, at::Tensor>> grads;
      for (const auto& [name, p] : model.named_parameters()) {
        grads.emplace_back(name, p.grad().defined() ? p.grad() : at::zeros_like(p));
      }
      SaveNamedTensors(grads, absl::GetFlag(FLAGS_dump_grads));
    }
    const StepStats step_stats = optimizer.Step();
    if (device.is_cuda()) c10::cuda::device_synchronize();  // time the kernels, not their launches
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double peak = PeakMemoryGiB(device);
    const double throughput = result.rollout_tokens / seconds;
    const nlohmann::json record({{"step", step}, {"method", absl::GetFlag(FLAGS_method)}, {"loss", result.loss},
                                   {"grad_norm", step_stats.grad_norm}, {"rollout_tokens", result.rollout_tokens},
                                   {"tree_tokens", stats.tree_tokens}, {"forwarded_tokens", result.forwarded_tokens},
                                   {"compression", stats.compression}, {"seconds", seconds},
                                   {"rollout_tokens_per_second", throughput}, {"peak_memory_gib", peak}});
    if (metrics.is_open()) metrics << record.dump() << "\n" << std::flush;
    if (json) {
      std::cout << record.dump() << "\n";
    } else {
      std::cout << absl::StrFormat("%5d %14.8g %10.4g %12d %12d %9.3f %14.0f %10.3f\n", step, result.loss,
                                   step_stats.grad_norm, result.rollout_tokens, result.forwarded_tokens, seconds,
                                   throughput, peak);
    }
  }
  if (!absl::GetFlag(FLAGS_save).empty()) {
    const std::string dir = absl::GetFlag(FLAGS_save);
    SaveQwen3Model(model, dir);
    optimizer.SaveState((std::filesystem::path(dir) / "optimizer.safetensors").string());
  }
  return 0;
}

}  // namespace
}  // namespace dta

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("dta-train --config=PRESET|--model=DIR --rollouts=FILE.jsonl [--method=dta] ...");
  const std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::cerr << "dta-train: unexpected argument '" << rest[1] << "'\n";
    return dta::kBadInput;
  }
  try {
    return dta::Run();
  } catch (const dta::BadInput& e) {
    std::cerr << "dta-train: " << e.message << "\n";
    return dta::kBadInput;
  } catch (const c10::Error& e) {
    // Checkpoint, rollout and shape problems surface as TORCH_CHECK errors naming what is wrong.
    std::cerr << "dta-train: " << e.what_without_backtrace() << "\n";
    return dta::kBadInput;
  }
}

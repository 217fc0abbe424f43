// dta-train: training steps on a rollout file with one execution method.
//
//   dta-train --config=qwen3-0.6b | --config=DIR/config.json | --model=HF_DIR
//             --rollouts=FILE.jsonl [--method=dta|dense|packed]
//             [--loss=grpo|sft|decoupled-ppo|gspo]
//             [--dtype=float32] [--device=cpu] [--block_size=2048] [--steps=1] [--lr=1e-6]
//             [--dump_grads=FILE.safetensors] [--save=DIR] [--json]
//
// Prints per step: loss, gradient norm, rollout tokens, tokens forwarded, compression, time,
// rollout tokens per second and peak memory. --dump_grads writes the first step's gradients under
// the Hugging Face parameter names, so methods (or other frameworks) can be compared bit by bit.
// With --distributed, run one process per GPU under a launcher (torchrun --no-python dta-train
// ...): every rank reads the whole file, takes its part of the DFS-contiguous split (AReaL-DTA
// Algorithm 4) with GRPO advantages and loss normalisers computed over the whole batch, and the
// gradients are summed across ranks before every optimizer step, so the ranks train exactly what
// one process would. Rank 0 prints, dumps and saves. This is the data-parallel path for machines
// without gRPC; dta-trainer is the one fed by the dispatcher.
//
// The layout (core/layout) is planned from the model, the world size and the device's memory and
// printed at start: AdamW's state is sharded across the ranks (ZeRO-1) whenever there are several,
// and offloaded to host memory when it does not fit on the GPU otherwise; --shard_optimizer,
// --offload_optimizer, --gpu_memory_gb and --activation_gb override the plan (the executor's
// memory is estimated for the file's longest rollout and the executor flags unless
// --activation_gb gives a reserve). Each step's line
// gives the optimizer's share of the time and the host's peak memory too.
// --tensor_parallel=T (0: the planner's choice) splits each replica's weights across T
// consecutive ranks (Megatron-style, executor/model): the world is T x DP ranks, the batch is split
// across the DP replicas, and the TP ranks of a replica train its part together.
// --expert_parallel=E (mixture-of-experts models; 0: the planner's choice) spreads every sparse
// layer's experts over E consecutive replicas, whose methods run in lockstep (executor/engine/
// lockstep.h); the experts' gradients and optimizer state go over the DP / E ranks holding the
// same experts. --save writes the whole model (gathered) and each rank's optimizer state.
//
// Exit status: 0 on success, 2 on bad input (flags, files, rollouts, checkpoints).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "apps/advantages/advantage_flags.h"
#include "apps/balance/balance_flags.h"
#include "apps/train/training_flags.h"
#include "core/base/exit_codes.h"
#include "core/cli/usage.h"
#include "core/io/rollout_jsonl.h"
#include "core/metrics/tensorboard_writer.h"
#include "core/partition/partition.h"
#include "core/tree/tree_stats.h"
#include "dispatcher/batch/batch_plan.h"
#include "executor/checkpoint/training_checkpoint.h"
#include "executor/distributed/parallel_groups.h"
#include "executor/distributed/process_group.h"
#include "executor/distributed/training_optimizer.h"
#include "executor/engine/executor.h"
#include "executor/engine/replica_sums.h"
#include "executor/model/hf_checkpoint.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, rollouts, "", "rollout file (JSON Lines); required");
ABSL_FLAG(int32_t, steps, 1, "optimizer steps over the batch");
ABSL_FLAG(std::string, dump_grads, "", "write the first step's gradients to this safetensors file");
ABSL_FLAG(std::string, save, "",
          "save a checkpoint to this directory: DIR/model (Hugging Face, --checkpoint_dtype) and "
          "DIR/optimizer");
ABSL_FLAG(std::string, resume, "",
          "resume the optimizer (and through its master weights the parameters) from a checkpoint "
          "directory that --save wrote, or from its optimizer/ state");
ABSL_FLAG(bool, json, false, "print one JSON object per step instead of a table");
ABSL_FLAG(std::string, metrics, "", "also append one JSON object per step to this file");
ABSL_FLAG(
    std::string, tensorboard_dir, "",
    "also write each step's numbers (the JSON fields) as TensorBoard scalars in this directory");
ABSL_FLAG(bool, distributed, false,
          "data parallel without a dispatcher: one process per rank (RANK, WORLD_SIZE, LOCAL_RANK, "
          "MASTER_ADDR, "
          "MASTER_PORT from the launcher); each rank trains its DFS-contiguous part of the file "
          "under the whole "
          "batch's advantages and normalisers, gradients all-reduced in buckets (NCCL on GPUs, "
          "Gloo on CPUs)");
ABSL_FLAG(int32_t, timeout_s, 600,
          "--distributed: timeout of the process group's rendezvous and collectives, seconds");

namespace dta {
namespace {

// The split of the batch across ranks, with the paper's greedy baselines for comparison.
// Costs are tree tokens by default, else the --balance_per_token/--balance_per_key model's.
void PrintSplit(const PrefixTree& tree, const PartitionPlan& plan, int world_size,
                const BalanceCost& balance) {
  const Partition by_tokens = *PartitionGreedyByRolloutTokens(tree, world_size, balance);
  const Partition by_tree = *PartitionGreedyByTreeTokens(tree, world_size, balance);
  const char* unit = balance == BalanceCost{} ? "tree tokens" : "cost";
  std::cout << absl::StrFormat(
      "split over %d ranks: DFS-contiguous max %d %s (imbalance %.3f, %d extra tokens); greedy "
      "by rollout tokens max %d (imbalance %.3f, %d extra); greedy by tree tokens max %d "
      "(imbalance %.3f, %d extra)\n",
      world_size, plan.partition.max_cost, unit, plan.partition.imbalance,
      plan.partition.extra_tokens, by_tokens.max_cost, by_tokens.imbalance, by_tokens.extra_tokens,
      by_tree.max_cost, by_tree.imbalance, by_tree.extra_tokens);
}

int Run() {
  LossOptions loss = LossFromFlags();
  absl::StatusOr<AdvantageOptions> advantages = AdvantageOptionsFromFlags();
  if (!advantages.ok()) throw BadInput{std::string(advantages.status().message())};
  loss.advantages = *advantages;
  const ModelExportOptions model_export = ModelExportFromFlags();
  // Checked now, set once the optimizer knows its step (a resumed run decays over its whole
  // length: the steps it resumed from plus --steps).
  LrScheduleFromFlags(std::numeric_limits<int64_t>::max());
  const ExecutorOptions executor = ExecutorFromFlags();
  const ProgressMode progress_mode = ProgressFromFlags();
  const NonFiniteGradients nonfinite_gradients = NonFiniteGradientsFromFlags();
  const std::string path = absl::GetFlag(FLAGS_rollouts);
  if (path.empty()) throw BadInput{"--rollouts is required"};
  if (absl::GetFlag(FLAGS_steps) < 1) throw BadInput{"--steps must be >= 1"};
  const bool distributed = absl::GetFlag(FLAGS_distributed);
  LaunchEnvironment env;
  at::TensorOptions options = TensorOptionsFromFlags();
  if (distributed) {
    absl::StatusOr<LaunchEnvironment> from_env = LaunchEnvironmentFromEnv();
    if (!from_env.ok()) throw BadInput{std::string(from_env.status().message())};
    env = *from_env;
    if (options.device().is_cuda() && !options.device().has_index()) {
      options =
          options.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank)));
    }
  }
  const bool leader = env.rank == 0;  // prints, dumps and saves
  const ModelConfig config = ConfigFromFlags();
  absl::StatusOr<std::vector<Rollout>> rollouts =
      ReadRolloutsJsonl(path, {.vocab_size = config.vocab_size});
  if (!rollouts.ok()) throw BadInput{std::string(rollouts.status().message())};
  std::vector<std::vector<TokenId>> sequences;
  for (const Rollout& r : *rollouts) sequences.push_back(r.tokens);
  const PrefixTree tree = *PrefixTree::FromRollouts(sequences);
  const TreeStats stats = ComputeTreeStats(tree);
  // The layout before the model: tensor parallelism decides which part of it this rank builds. The
  // executor's memory is planned for this file's longest rollout and tree (a rank's share of it
  // needs no more).
  const LayoutPlan layout =
      LayoutFromFlags(config, env.world_size, options.device(),
                      {.longest_rollout = stats.longest_rollout, .tree_tokens = stats.tree_tokens});
  const int tensor_parallel = layout.layout.tensor_parallel;
  if (tensor_parallel > 1 && !absl::GetFlag(FLAGS_dump_grads).empty()) {
    throw BadInput{"--dump_grads needs the whole gradient, which tensor parallelism splits"};
  }
  const int expert_parallel = layout.layout.expert_parallel;
  if (expert_parallel > 1 && !absl::GetFlag(FLAGS_dump_grads).empty()) {
    throw BadInput{"--dump_grads needs the whole gradient, which expert parallelism splits"};
  }

  // This process's rollouts and the batch's normalisers (all of them, on one process). The
  // rollouts are split across the data-parallel replicas; the TP ranks of a replica share its part.
  BatchLossContext batch = MakeBatchContext(*rollouts);
  std::vector<Rollout> mine;
  std::unique_ptr<ProcessGroup> world;
  std::unique_ptr<ParallelGroups> groups;
  if (distributed) {
    ProcessGroupOptions group_options;
    group_options.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s));
    absl::StatusOr<std::unique_ptr<ProcessGroup>> created = ProcessGroup::Create(
        env, options.device().is_cuda() ? options.device() : at::Device(at::kCPU), group_options);
    if (!created.ok()) throw std::runtime_error(std::string(created.status().message()));
    world = *std::move(created);
    groups =
        std::make_unique<ParallelGroups>(*world, tensor_parallel, expert_parallel, group_options);
    const int replicas = groups->data_parallel_size();
    std::vector<const Rollout*> pointers;
    for (const Rollout& r : *rollouts) pointers.push_back(&r);
    absl::StatusOr<BalanceCost> balance = BalanceCostFromFlags();
    if (!balance.ok()) throw BadInput{std::string(balance.status().message())};
    absl::StatusOr<PartitionPlan> plan =
        PlanPartitions(pointers, replicas, /*with_advantages=*/loss.kind != LossKind::kSft,
                       loss.advantages, *balance);
    if (!plan.ok()) throw BadInput{std::string(plan.status().message())};
    batch = plan->context;
    mine = ShareOfRank(*plan, groups->data_parallel_rank(), *rollouts).rollouts;
    if (leader) PrintSplit(tree, *plan, replicas, *balance);
  } else {
    mine = *std::move(rollouts);
  }
  Decoder model = ModelFromFlags(options, groups ? groups->tensor_parallel_collectives() : nullptr,
                                 groups ? groups->expert_parallel_collectives() : nullptr);
  ProcessGroup* group = groups ? &groups->data_parallel() : nullptr;

  if (leader) {
    std::cerr << "dta-train: " << DescribeLayout(layout) << "\n";
  }
  if (layout.layout.shard_optimizer && env.world_size > 1 &&
      !absl::GetFlag(FLAGS_dump_grads).empty()) {
    throw BadInput{
        "--dump_grads needs every rank's whole gradient, which a sharded optimizer "
        "reduce-scatters: add --shard_optimizer=false"};
  }
  TrainingOptimizer optimizer(model.named_parameters(), group, layout.layout, AdamWFromFlags(),
                              int64_t{25} << 20, model.gradient_norm_scope(),
                              OffloadUpdateFromFlags(), ExpertParametersOf(model, groups.get()));
  if (leader && !optimizer.DescribeOffload().empty()) {
    std::cerr << "dta-train: " << optimizer.DescribeOffload() << "\n";
  }
  if (!absl::GetFlag(FLAGS_resume).empty()) {
    optimizer.LoadState(OptimizerStatePath(absl::GetFlag(FLAGS_resume)));
  }
  optimizer.set_schedule(LrScheduleFromFlags(optimizer.step() + absl::GetFlag(FLAGS_steps)));
  const bool json = absl::GetFlag(FLAGS_json);
  if (!json && leader) {
    std::cout << absl::StrFormat(
        "%s: %d rollouts, %d rollout tokens, %d tree tokens (C = %.2fx); method %s, %s on %s\n",
        path, stats.num_rollouts, stats.rollout_tokens, stats.tree_tokens, stats.compression,
        absl::GetFlag(FLAGS_method), absl::GetFlag(FLAGS_dtype), absl::GetFlag(FLAGS_device));
    std::cout << absl::StrFormat("%5s %14s %10s %12s %12s %9s %9s %14s %10s %10s%s\n", "step",
                                 "loss", "grad norm", "rollout tok", "forwarded", "time s",
                                 "optim s", "rollout tok/s", "peak GiB", "host GiB",
                                 loss.router_aux_loss_coef > 0 ? "     router aux" : "");
  }
  const at::Device device = options.device();
  std::ofstream metrics;
  if (!absl::GetFlag(FLAGS_metrics).empty()) {
    metrics.open(absl::GetFlag(FLAGS_metrics), std::ios::app);
    if (!metrics) throw BadInput{"cannot open --metrics file " + absl::GetFlag(FLAGS_metrics)};
  }
  std::unique_ptr<TensorBoardWriter> tensorboard;
  if (leader && !absl::GetFlag(FLAGS_tensorboard_dir).empty()) {
    absl::StatusOr<std::unique_ptr<TensorBoardWriter>> opened =
        TensorBoardWriter::Open(absl::GetFlag(FLAGS_tensorboard_dir));
    if (!opened.ok())
      throw BadInput{"--tensorboard_dir: " + std::string(opened.status().message())};
    tensorboard = *std::move(opened);
  }
  for (int32_t step = 1; step <= absl::GetFlag(FLAGS_steps); ++step) {
    // Under expert parallelism a replica without rollouts still serves its experts to the others'
    // tokens: the call is collective over its EP group. The call replaces the gradients (no
    // zero fill of the experts' before it); a replica that makes none zeroes them.
    const bool computes = !mine.empty() || expert_parallel > 1;
    if (!computes) optimizer.ZeroGrad();
    ResetPeakMemory(device);
    const auto start = std::chrono::steady_clock::now();
    GradientResult result;
    ProgressLine progress(absl::StrFormat("dta-train: step %d", step), "tokens",
                          leader ? progress_mode : ProgressMode::kNever);
    ExecutorOptions step_executor = executor;
    step_executor.progress = [&progress](int64_t done, int64_t total) {
      progress.Update(done, total);
    };
    step_executor.replace_gradients = true;
    if (computes) result = ComputeGradients(model, mine, loss, step_executor, batch);
    progress.Finish();
    optimizer.SyncGradients();
    if (group) {
      // The batch's loss and tokens: the sum over the data-parallel replicas (a replica's TP ranks
      // all hold its whole loss).
      SumOverReplicas(*group, groups->data_parallel_rank(), groups->data_parallel_size(), result);
    }
    if (step == 1 && leader && !absl::GetFlag(FLAGS_dump_grads).empty()) {
      std::vector<std::pair<std::string, at::Tensor>> grads;
      for (const auto& [name, p] : model.named_parameters()) {
        grads.emplace_back(name, p.grad().defined() ? p.grad() : at::zeros_like(p));
      }
      SaveNamedTensors(grads, absl::GetFlag(FLAGS_dump_grads));
    }
    if (device.is_cuda()) c10::cuda::device_synchronize();  // time the kernels, not their launches
    const auto optimizer_start = std::chrono::steady_clock::now();
    const StepStats step_stats = optimizer.Step(nonfinite_gradients);
    if (step_stats.skipped && leader) {
      std::fprintf(stderr,
                   "dta-train: step %d: the gradient norm is %g: step skipped, nothing updated\n",
                   step, step_stats.grad_norm);
    }
    if (device.is_cuda()) c10::cuda::device_synchronize();
    const auto end = std::chrono::steady_clock::now();
    const double seconds = std::chrono::duration<double>(end - start).count();
    const double optimizer_seconds = std::chrono::duration<double>(end - optimizer_start).count();
    const double peak = PeakMemoryGiB(device);
    const double host_peak = PeakMemoryGiB(at::kCPU);
    const double throughput = result.rollout_tokens / seconds;
    nlohmann::json record(
        {{"step", step},
         {"method", absl::GetFlag(FLAGS_method)},
         {"loss", result.loss},
         // The mean router load-balancing loss `loss` includes (null when off).
         {"router_aux_loss", loss.router_aux_loss_coef > 0 ? nlohmann::json(result.router_aux_loss)
                                                           : nlohmann::json(nullptr)},
         // Routing replay: the unique tokens the tree gained because shared tokens were routed
         // differently (0 without routed experts).
         {"replay_split_tokens", result.replay_split_tokens},
         {"grad_norm", step_stats.grad_norm},
         {"lr", step_stats.lr},
         {"rollout_tokens", result.rollout_tokens},
         {"tree_tokens", stats.tree_tokens},
         {"forwarded_tokens", result.forwarded_tokens},
         {"compression", stats.compression},
         {"seconds", seconds},
         {"executor_seconds", seconds - optimizer_seconds},
         {"optimizer_seconds", optimizer_seconds},
         {"offload_update_seconds", optimizer.offload_times().update},
         {"offload_copy_wait_seconds", optimizer.offload_times().copy_wait},
         {"rollout_tokens_per_second", throughput},
         {"peak_memory_gib", peak},
         {"host_peak_memory_gib", host_peak},
         {"skipped", step_stats.skipped}});
    if (!leader) continue;
    // The RL diagnostics (null where they do not apply, e.g. a ratio under SFT).
    for (const char* name :
         {"clip_fraction", "dual_clip_fraction", "approx_kl", "ratio_mean", "ratio_max",
          "ratio_min", "entropy", "rejected_fraction", "behave_imp_weight", "behave_approx_kl"})
      record[name] = nullptr;
    for (const auto& [name, value] : result.diagnostics.Applicable()) record[name] = value;
    if (tensorboard) {
      Scalars scalars;
      for (const auto& [name, value] : record.items()) {
        if (name == "step") continue;
        if (value.is_number()) scalars.emplace_back(name, value.get<double>());
        if (value.is_boolean()) scalars.emplace_back(name, value.get<bool>() ? 1.0 : 0.0);
      }
      const absl::Status written = tensorboard->Write(step, scalars);
      if (!written.ok()) throw std::runtime_error(std::string(written.message()));
    }
    if (metrics.is_open()) metrics << record.dump() << "\n" << std::flush;
    if (json) {
      std::cout << record.dump() << "\n";
    } else {
      std::cout << absl::StrFormat(
          "%5d %14.8g %10.4g %12d %12d %9.3f %9.3f %14.0f %10.3f %10.3f%s\n", step, result.loss,
          step_stats.grad_norm, result.rollout_tokens, result.forwarded_tokens, seconds,
          optimizer_seconds, throughput, peak, host_peak,
          loss.router_aux_loss_coef > 0 ? absl::StrFormat(" %14.8g", result.router_aux_loss) : "");
    }
  }
  if (!absl::GetFlag(FLAGS_save).empty()) {
    const std::string dir = absl::GetFlag(FLAGS_save);
    // Replica 0's TP ranks gather the split weights (world rank 0 writes them); every rank writes
    // the optimizer state it owns.
    // The model is gathered by the first replica (under expert parallelism, the first EP group's
    // replicas: their experts together are every expert).
    SaveTrainingCheckpoint(dir, model, &optimizer,
                           !groups || groups->expert_data_parallel_rank() == 0, model_export);
  }
  if (world) world->Barrier();  // rank 0's store outlives the others' last collective
  return 0;
}

}  // namespace
}  // namespace dta

int main(int argc, char** argv) {
  dta::SetProgramUsage(
      "dta-train --config=PRESET|--model=DIR --rollouts=FILE.jsonl [--method=dta] ...");
  const std::vector<char*> rest = dta::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::cerr << "dta-train: unexpected argument '" << rest[1] << "'\n";
    return dta::kExitBadInput;
  }
  try {
    return dta::Run();
  } catch (const dta::BadInput& e) {
    std::cerr << "dta-train: " << e.message << "\n";
    return dta::kExitBadInput;
  } catch (const c10::Error& e) {
    // Checkpoint, rollout and shape problems surface as TORCH_CHECK errors naming what is wrong.
    std::cerr << "dta-train: " << e.what_without_backtrace() << "\n";
    return dta::kExitBadInput;
  } catch (const std::runtime_error& e) {  // the process group could not be formed
    std::cerr << "dta-train: " << e.what() << "\n";
    return dta::kExitError;
  }
}

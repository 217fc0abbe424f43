#include "apps/train/training_flags.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <sys/resource.h>

#include <cmath>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/layout/memory_plan.h"
#include "core/model/config_json.h"
#include "core/model/family.h"
#include "core/model/model_config.h"
#include "executor/distributed/device_layout.h"
#include "executor/model/hf_checkpoint.h"

ABSL_FLAG(std::string, model, "",
          absl::StrCat("Hugging Face model directory to load (config.json + safetensors) of a "
                       "family dta builds, by config.json's model_type: ",
                       dta::DescribeModelFamilies()));
ABSL_FLAG(std::string, config, "",
          absl::StrCat("instead of --model: a preset (",
                       absl::StrJoin(dta::ModelPresetNames(), ", "),
                       ") or a config.json of one of the families, with random weights"));
ABSL_FLAG(uint64_t, init_seed, 1, "seed of the random weights (--config)");
ABSL_FLAG(double, init_std, 0.02, "standard deviation of the random weights (--config)");
namespace {

// dta::ExecutorOptions as default-constructed: the source of every executor flag's default, so
// that dta-train, dta-trainer, dta-bench and dta.Trainer agree.
const dta::ExecutorOptions kExecutorDefaults{};

// The flag's spelling of a block size: 0 for unbounded.
constexpr int64_t BlockSizeFlag(int64_t block_size) {
  return block_size == dta::kUnboundedBlock ? 0 : block_size;
}

}  // namespace

ABSL_FLAG(std::string, method, std::string(dta::MethodName(kExecutorDefaults.method)),
          "execution method: dta, dense or packed");
ABSL_FLAG(std::string, loss, "grpo",
          "loss: grpo (PPO clip with group advantages), sft, decoupled-ppo, gspo");
ABSL_FLAG(std::string, normalization, "token-mean",
          "loss normalisation: token-mean, sequence-mean, sum");
ABSL_FLAG(double, eps_clip_low, 0.2, "PPO ratio clip below 1");
ABSL_FLAG(double, eps_clip_high, 0.2, "PPO ratio clip above 1");
ABSL_FLAG(double, dual_clip, 0.0, "dual clip c > 1 (0 = off)");
ABSL_FLAG(double, behave_imp_weight_cap, 0.0,
          "decoupled PPO: cap on pi_prox / pi_behave (0 = none)");
ABSL_FLAG(bool, behave_imp_weight, true,
          "decoupled PPO: weight by pi_prox / pi_behave (false: AReaL 1.0 without rejection)");
ABSL_FLAG(std::string, rejection_sampling, "",
          "decoupled PPO: AReaL 1.0's rejection sampling of stale tokens, as key=value pairs: "
          "level=token|sequence,action=mask|clamp,metric=ratio|kl_k1|kl_k2|kl_k3,"
          "aggregation=sum|mean|max,upper=U[,lower=L] (empty: off; e.g. 'upper=5')");
ABSL_FLAG(double, temperature, kExecutorDefaults.temperature,
          "log-probabilities of softmax(logits / T): the temperature the rollouts were sampled at");
ABSL_FLAG(bool, entropy_stats, false,
          "compute the entropy for the step's diagnostics even when --entropy_coef is 0");
ABSL_FLAG(double, entropy_coef, 0.0, "entropy bonus coefficient");
ABSL_FLAG(double, kl_coef, 0.0, "KL-to-reference coefficient (needs ref_logprobs)");
ABSL_FLAG(double, router_aux_loss_coef, 0.0,
          "mixture-of-experts models: coefficient of the router's load-balancing loss, per "
          "rollout as transformers' aux_loss, averaged over the batch's rollouts (0 = off)");
ABSL_FLAG(std::string, dtype, "float32", "float32, float64 or bfloat16");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda[:N]");
ABSL_FLAG(std::string, checkpoint_dtype, "bfloat16",
          "the published model's weights: bfloat16, float16, float32, float64 or model (--dtype); "
          "resuming is exact either way (the optimizer's master weights)");
ABSL_FLAG(int64_t, block_size, BlockSizeFlag(kExecutorDefaults.block_size),
          "dta: B, the most tokens per backward chunk (0 = unbounded, -1 = automatic: the longest "
          "rollout if its graph fits in the free GPU memory, else what fits; with --pack at least "
          "8192 tokens, and for mixture-of-experts models all that fits)");
ABSL_FLAG(int64_t, graph_budget, kExecutorDefaults.graph_budget,
          "dta: tokens whose graphs may be kept instead of recomputed; -1: as many as fit in 80% "
          "of the GPU's free "
          "memory (0 on the CPU)");
ABSL_FLAG(double, memory_budget,
          static_cast<double>(kExecutorDefaults.memory_budget) /
              static_cast<double>(int64_t{1} << 30),
          "dta on a GPU: the most device memory a step may hold, GiB, weights, gradients and "
          "optimizer state included; the automatic --block_size and --graph_budget are the largest "
          "that fit, explicit ones are lowered to fit (0 = no budget)");
ABSL_FLAG(int64_t, token_capacity, kExecutorDefaults.token_capacity,
          "packed: the most unique tokens per packed forward (0 = the whole tree)");
ABSL_FLAG(bool, checkpointing, kExecutorDefaults.checkpointing,
          "dense and packed: activation checkpointing (recompute each layer in backward)");
ABSL_FLAG(bool, pack, kExecutorDefaults.pack,
          "dta: pack small complete subtrees into one forward (--nopack or --pack=false: the "
          "paper's schedule, one rollout's chunks at a time)");
ABSL_FLAG(std::string, order, std::string(dta::LeafOrderName(kExecutorDefaults.order)),
          "dta: leaf order, backward-dfs or lexicographic");
ABSL_FLAG(
    std::string, progress, "auto",
    "progress lines within a step (tokens done, rate, ETA): auto (on a terminal only), always "
    "(also into logs, every 10 s) or never");
ABSL_FLAG(std::string, nonfinite_gradients, "raise",
          "a step whose gradient norm is NaN or infinite: raise (stop with an error naming the "
          "parameter) or skip (update nothing, say so, go on); nothing is updated either way");
ABSL_FLAG(double, lr, 1e-6,
          "AdamW learning rate (the peak, with a schedule); AdamW's betas are (0.9, 0.999) and its "
          "eps 1e-8, as torch.optim.AdamW's defaults");
ABSL_FLAG(std::string, lr_schedule, "constant",
          "learning-rate decay after the warmup: constant, linear or cosine");
ABSL_FLAG(int64_t, warmup_steps, 0, "optimizer steps of linear warmup, from lr/N to lr");
ABSL_FLAG(int64_t, decay_steps, 0,
          "the optimizer step where a linear or cosine decay ends, counted from the first step "
          "(0: the run's last step: dta-train's resumed steps plus --steps, dta-trainer's "
          "--max_steps); the rate stays at --min_lr_ratio after it");
ABSL_FLAG(double, min_lr_ratio, 0.0, "the decayed learning rate's floor, as a fraction of --lr");
ABSL_FLAG(double, weight_decay, 0.01,
          "AdamW decoupled weight decay (w *= 1 - lr * weight_decay each step), applied to every "
          "parameter: norms, biases and embeddings included");
ABSL_FLAG(double, max_grad_norm, 1.0,
          "global gradient norm clip: every gradient is scaled by min(1, max_grad_norm / (norm + "
          "1e-6)), norm being the 2-norm of all gradients together, as "
          "torch.nn.utils.clip_grad_norm_ (<= 0: off)");
ABSL_FLAG(std::string, shard_optimizer, "auto",
          "auto, true or false: AdamW's state split across the data-parallel ranks (ZeRO-1); auto "
          "shards whenever there are several ranks. A state saved sharded "
          "(optimizer-*-of-*.safetensors) resumes only into a sharded or offloaded optimizer "
          "(--shard_optimizer=true or --offload_optimizer=true), a replicated one "
          "(optimizer.safetensors) only with both false");
ABSL_FLAG(std::string, offload_optimizer, "auto",
          "auto, true or false: AdamW's state in host memory, updated there; auto offloads only "
          "when the layout does not fit on the GPU otherwise");
ABSL_FLAG(std::string, offload_update, "gpu",
          "with an offloaded optimizer on a GPU, where AdamW updates it: gpu (streamed through the "
          "GPU from page-locked host memory) or host (on the host's cores)");
ABSL_FLAG(std::string, offload_resident_gb, "auto",
          "with an offloaded optimizer streamed through the GPU: GB (1e9 bytes) of its state "
          "per GPU kept there, updated without crossing the bus; auto: what the GPU holds beside "
          "the rest of the layout (less a headroom of 5%, at least 2 GiB); 0: none");
ABSL_FLAG(double, gpu_memory_gb, 0,
          "memory per GPU the layout may plan for, GB (0: the device's total; on the CPU, the "
          "host's)");
ABSL_FLAG(int32_t, tensor_parallel, 1,
          "ranks each replica's weights are split across (tensor parallelism, within a node; must "
          "divide the KV heads and the world size); 0: the layout planner's choice");
ABSL_FLAG(int32_t, expert_parallel, 1,
          "mixture-of-experts models: replicas each sparse layer's experts are spread across "
          "(expert parallelism, inside the data-parallel ranks; must divide them and the experts); "
          "0: the layout planner's choice");
ABSL_FLAG(double, activation_gb, -1,
          "memory per GPU reserved for the executor, GB (layout planning); negative: the "
          "executor's own peak, estimated from the model and --method, --block_size, "
          "--graph_budget, --pack, --token_capacity, --checkpointing and --longest_rollout");
ABSL_FLAG(int64_t, longest_rollout, 0,
          "the longest rollout the layout plans the executor's memory for, tokens (0: dta-train "
          "takes the rollout file's, dta-trainer plans for 8192)");

namespace dta {

LossOptions LossFromFlags() {
  LossOptions loss;
  const std::string name = absl::GetFlag(FLAGS_loss);
  if (name == "grpo" || name == "ppo") {
    loss.kind = LossKind::kPpo;
  } else if (name == "sft") {
    loss.kind = LossKind::kSft;
  } else if (name == "decoupled-ppo") {
    loss.kind = LossKind::kDecoupledPpo;
  } else if (name == "gspo") {
    loss.kind = LossKind::kGspo;
  } else {
    throw BadInput{"--loss must be grpo, ppo, sft, decoupled-ppo or gspo, got '" + name + "'"};
  }
  const std::string normalization = absl::GetFlag(FLAGS_normalization);
  if (normalization == "token-mean") {
    loss.normalization = Normalization::kTokenMean;
  } else if (normalization == "sequence-mean") {
    loss.normalization = Normalization::kSequenceMean;
  } else if (normalization == "sum") {
    loss.normalization = Normalization::kSum;
  } else {
    throw BadInput{"--normalization must be token-mean, sequence-mean or sum, got '" +
                   normalization + "'"};
  }
  loss.eps_clip_low = absl::GetFlag(FLAGS_eps_clip_low);
  loss.eps_clip_high = absl::GetFlag(FLAGS_eps_clip_high);
  loss.dual_clip = absl::GetFlag(FLAGS_dual_clip);
  loss.behave_imp_weight_cap = absl::GetFlag(FLAGS_behave_imp_weight_cap);
  loss.entropy_coef = absl::GetFlag(FLAGS_entropy_coef);
  loss.behave_imp_weight = absl::GetFlag(FLAGS_behave_imp_weight);
  loss.with_entropy = absl::GetFlag(FLAGS_entropy_stats);
  if (const std::string spec = absl::GetFlag(FLAGS_rejection_sampling); !spec.empty()) {
    absl::StatusOr<RejectionSampling> parsed = ParseRejectionSampling(spec);
    if (!parsed.ok())
      throw BadInput{"--rejection_sampling: " + std::string(parsed.status().message())};
    loss.rejection_sampling = *parsed;
  }
  loss.kl_coef = absl::GetFlag(FLAGS_kl_coef);
  loss.router_aux_loss_coef = absl::GetFlag(FLAGS_router_aux_loss_coef);
  return loss;
}

ProgressMode ProgressFromFlags() {
  absl::StatusOr<ProgressMode> mode = ParseProgressMode(absl::GetFlag(FLAGS_progress));
  if (!mode.ok()) throw BadInput{"--" + std::string(mode.status().message())};
  return *mode;
}

NonFiniteGradients NonFiniteGradientsFromFlags() {
  const std::string mode = absl::GetFlag(FLAGS_nonfinite_gradients);
  if (mode == "raise") return NonFiniteGradients::kRaise;
  if (mode == "skip") return NonFiniteGradients::kSkip;
  throw BadInput{"--nonfinite_gradients must be raise or skip, got '" + mode + "'"};
}

ExecutorOptions ExecutorFromFlags() {
  ExecutorOptions options;
  const std::string method = absl::GetFlag(FLAGS_method);
  if (method == "dta") {
    options.method = Method::kDta;
  } else if (method == "dense") {
    options.method = Method::kDense;
  } else if (method == "packed") {
    options.method = Method::kPacked;
  } else {
    throw BadInput{"--method must be dta, dense or packed, got '" + method + "'"};
  }
  const int64_t block = absl::GetFlag(FLAGS_block_size);
  if (block < kAutoBlockSize) throw BadInput{"--block_size must be >= 0, or -1 for automatic"};
  options.block_size = block == 0 ? kUnboundedBlock : block;
  options.graph_budget = absl::GetFlag(FLAGS_graph_budget);
  if (options.graph_budget < kAutoGraphBudget)
    throw BadInput{"--graph_budget must be >= 0, or -1 for automatic"};
  const double budget = absl::GetFlag(FLAGS_memory_budget);
  if (!(budget >= 0) || !std::isfinite(budget))
    throw BadInput{"--memory_budget must be >= 0 GiB (0 = no budget)"};
  options.memory_budget = static_cast<int64_t>(budget * static_cast<double>(int64_t{1} << 30));
  options.pack = absl::GetFlag(FLAGS_pack);
  options.temperature = absl::GetFlag(FLAGS_temperature);
  if (!(options.temperature > 0) || !std::isfinite(options.temperature))
    throw BadInput{"--temperature must be positive and finite"};
  options.checkpointing = absl::GetFlag(FLAGS_checkpointing);
  options.token_capacity = absl::GetFlag(FLAGS_token_capacity);
  if (options.token_capacity < 0) throw BadInput{"--token_capacity must be >= 0"};
  const std::string order = absl::GetFlag(FLAGS_order);
  if (order == "backward-dfs") {
    options.order = LeafOrderKind::kBackwardDfs;
  } else if (order == "lexicographic") {
    options.order = LeafOrderKind::kLexicographic;
  } else {
    throw BadInput{"--order must be backward-dfs or lexicographic, got '" + order + "'"};
  }
  return options;
}

ModelExportOptions ModelExportFromFlags() {
  const std::string dtype = absl::GetFlag(FLAGS_checkpoint_dtype);
  ModelExportOptions options;
  options.source_directory = absl::GetFlag(FLAGS_model);
  if (dtype == "model") {
    options.dtype = std::nullopt;
  } else if (dtype == "bfloat16") {
    options.dtype = at::kBFloat16;
  } else if (dtype == "float16") {
    options.dtype = at::kHalf;
  } else if (dtype == "float32") {
    options.dtype = at::kFloat;
  } else if (dtype == "float64") {
    options.dtype = at::kDouble;
  } else {
    throw BadInput{
        "--checkpoint_dtype must be bfloat16, float16, float32, float64 or model, got '" + dtype +
        "'"};
  }
  return options;
}

at::TensorOptions TensorOptionsFromFlags() {
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  at::ScalarType type;
  if (dtype == "float32") {
    type = at::kFloat;
  } else if (dtype == "float64") {
    type = at::kDouble;
  } else if (dtype == "bfloat16") {
    type = at::kBFloat16;
  } else {
    throw BadInput{"--dtype must be float32, float64 or bfloat16, got '" + dtype + "'"};
  }
  return at::TensorOptions().dtype(type).device(at::Device(absl::GetFlag(FLAGS_device)));
}

ModelConfig ConfigFromFlags() {
  const std::string dir = absl::GetFlag(FLAGS_model);
  const std::string config_name = absl::GetFlag(FLAGS_config);
  if (dir.empty() == config_name.empty())
    throw BadInput{"give exactly one of --model and --config"};
  absl::StatusOr<ModelConfig> config =
      dir.empty() ? ModelConfigFromName(config_name) : LoadModelConfig(dir);
  if (!config.ok()) throw BadInput{std::string(config.status().message())};
  return *config;
}

Decoder ModelFromFlags(const at::TensorOptions& options,
                       std::shared_ptr<const TensorParallelGroup> tensor_parallel,
                       std::shared_ptr<const ExpertParallelGroup> expert_parallel) {
  const ModelConfig config = ConfigFromFlags();
  const std::string dir = absl::GetFlag(FLAGS_model);
  if (!dir.empty())
    return LoadHfModel(dir, options, std::move(tensor_parallel), std::move(expert_parallel));
  Decoder model(config, options, std::move(tensor_parallel), std::move(expert_parallel));
  model.InitRandom(absl::GetFlag(FLAGS_init_seed), absl::GetFlag(FLAGS_init_std));
  return model;
}

namespace {

// "cuda" means the current device.
c10::DeviceIndex CudaIndex(const at::Device& device) {
  return device.has_index() ? device.index() : c10::cuda::current_device();
}

}  // namespace

double PeakMemoryGiB(const at::Device& device) {
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(CudaIndex(device));
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 30);
  }
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / (1 << 20);  // KiB -> GiB
}

void ResetPeakMemory(const at::Device& device) {
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(CudaIndex(device));
}

namespace {

std::optional<bool> LayoutChoiceFlag(const char* flag, const std::string& value) {
  absl::StatusOr<std::optional<bool>> choice = ParseLayoutChoice(flag, value);
  if (!choice.ok()) throw BadInput{std::string(choice.status().message())};
  return *choice;
}

}  // namespace

LayoutPlan LayoutFromFlags(const ModelConfig& config, int world_size, const at::Device& device,
                           const PlannedWorkload& workload) {
  LayoutOverrides overrides;
  overrides.gpu_memory_gb = absl::GetFlag(FLAGS_gpu_memory_gb);
  if (overrides.gpu_memory_gb < 0) throw BadInput{"--gpu_memory_gb must be >= 0"};
  overrides.activation_gb = absl::GetFlag(FLAGS_activation_gb);
  const int64_t longest = absl::GetFlag(FLAGS_longest_rollout);
  if (longest < 0) throw BadInput{"--longest_rollout must be >= 0"};
  overrides.executor = ExecutorMemoryOf(
      ExecutorFromFlags(), longest > 0 ? longest : workload.longest_rollout, workload.tree_tokens);
  overrides.tensor_parallel = absl::GetFlag(FLAGS_tensor_parallel);
  if (overrides.tensor_parallel < 0) throw BadInput{"--tensor_parallel must be >= 0"};
  overrides.expert_parallel = absl::GetFlag(FLAGS_expert_parallel);
  if (overrides.expert_parallel < 0) throw BadInput{"--expert_parallel must be >= 0"};
  overrides.shard_optimizer =
      LayoutChoiceFlag("shard_optimizer", absl::GetFlag(FLAGS_shard_optimizer));
  overrides.offload_optimizer =
      LayoutChoiceFlag("offload_optimizer", absl::GetFlag(FLAGS_offload_optimizer));
  if (const std::string resident = absl::GetFlag(FLAGS_offload_resident_gb); resident != "auto") {
    double gb = 0;
    if (!absl::SimpleAtod(resident, &gb) || !std::isfinite(gb) || gb < 0) {
      throw BadInput{"--offload_resident_gb must be auto or a number of GB >= 0, got '" + resident +
                     "'"};
    }
    overrides.offload_resident_gb = gb;
  }
  overrides.offload_streamed = OffloadUpdateFromFlags() == OffloadUpdate::kOnDevice;
  absl::StatusOr<LayoutPlan> plan = PlanDeviceLayout(
      config, world_size, device, TensorOptionsFromFlags().dtype().toScalarType(), overrides);
  if (!plan.ok()) throw BadInput{std::string(plan.status().message())};
  return *plan;
}

ExpertParameters ExpertParametersOf(const Decoder& model, const ParallelGroups* groups) {
  if (groups == nullptr || groups->expert_parallel_size() == 1) return {};
  ExpertParameters experts{.expert_data_parallel = &groups->expert_data_parallel(),
                           .expert_parallel_rank = groups->expert_parallel_rank(),
                           .expert_parallel_size = groups->expert_parallel_size()};
  for (const ParameterSplit& split : model.parameter_splits())
    experts.expert.push_back(split.expert_parallel());
  return experts;
}

OffloadUpdate OffloadUpdateFromFlags() {
  const std::string where = absl::GetFlag(FLAGS_offload_update);
  if (where == "gpu") return OffloadUpdate::kOnDevice;
  if (where == "host") return OffloadUpdate::kOnHost;
  throw BadInput{"--offload_update must be gpu or host, got '" + where + "'"};
}

LrSchedule LrScheduleFromFlags(int64_t run_steps) {
  absl::StatusOr<LrDecay> decay = ParseLrDecay(absl::GetFlag(FLAGS_lr_schedule));
  if (!decay.ok()) throw BadInput{absl::StrCat("--lr_schedule: ", decay.status().message())};
  const int64_t decay_steps = absl::GetFlag(FLAGS_decay_steps);
  const LrSchedule schedule = {.decay = *decay,
                               .warmup_steps = absl::GetFlag(FLAGS_warmup_steps),
                               .total_steps = decay_steps > 0 ? decay_steps : run_steps,
                               .min_lr_ratio = absl::GetFlag(FLAGS_min_lr_ratio)};
  if (schedule.warmup_steps < 0) throw BadInput{"--warmup_steps must be >= 0"};
  if (decay_steps < 0) throw BadInput{"--decay_steps must be >= 0"};
  if (!(schedule.min_lr_ratio >= 0.0 && schedule.min_lr_ratio <= 1.0)) {
    throw BadInput{"--min_lr_ratio must be in [0, 1]"};
  }
  if (schedule.decay != LrDecay::kConstant && schedule.total_steps <= schedule.warmup_steps) {
    throw BadInput{absl::StrCat("--lr_schedule=", absl::GetFlag(FLAGS_lr_schedule),
                                " decays until --decay_steps (default: the run's last step), "
                                "which must be above --warmup_steps (",
                                schedule.warmup_steps, "); it is ", schedule.total_steps)};
  }
  return schedule;
}

AdamWOptions AdamWFromFlags() {
  return {.lr = absl::GetFlag(FLAGS_lr),
          .weight_decay = absl::GetFlag(FLAGS_weight_decay),
          .max_grad_norm = absl::GetFlag(FLAGS_max_grad_norm)};
}

}  // namespace dta

#include "bindings/python/trainer.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <filesystem>
#include <sstream>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "core/model/config_json.h"
#include "core/model/model_config.h"
#include "core/tree/prefix_tree.h"
#include "dispatcher/batch/batch_plan.h"
#include "executor/checkpoint/training_checkpoint.h"
#include "executor/engine/replica_sums.h"
#include "executor/model/hf_checkpoint.h"

namespace dta::python {
namespace {

// The batch's unique tokens. Only the count: the trie points into the rollouts instead of copying
// their tokens again.
int64_t TreeTokens(absl::Span<const Rollout> rollouts) {
  PrefixTreeBuilder builder(TokenStorage::kBorrow);
  for (const Rollout& r : rollouts)
    TORCH_CHECK(builder.AddRollout(r.tokens).ok(), "rollout '", r.id, "'");
  return builder.num_tree_tokens();
}

// The split of `rollouts` across `replicas` (TORCH_CHECK naming the rollout when its advantages
// cannot be computed).
PartitionPlan SplitBatch(absl::Span<const Rollout> rollouts, int replicas, bool with_advantages,
                         const AdvantageOptions& advantages) {
  std::vector<const Rollout*> pointers;
  pointers.reserve(rollouts.size());
  for (const Rollout& r : rollouts) pointers.push_back(&r);
  absl::StatusOr<PartitionPlan> plan =
      PlanPartitions(pointers, replicas, with_advantages, advantages);
  TORCH_CHECK(plan.ok(), std::string(plan.status().message()));
  return *std::move(plan);
}

// `flat` (on the group's device) summed over `group`, in place.
void AllReduceSum(ProcessGroup& group, const at::Tensor& flat, const char* what) {
  std::vector<at::Tensor> tensors = {flat};
  group.Wait(*group.backend()->allreduce(tensors), what);
}

// The first field in which two configs describe different models ("" when none): the
// storage dtype may differ (a bfloat16 checkpoint of a float32 model is the same model).
std::string FirstDifference(const ModelConfig& model, const ModelConfig& loaded) {
  auto field = [](const char* name, const auto& a, const auto& b) {
    std::ostringstream out;
    if (!(a == b)) out << name << " " << b << ", the model's " << a;
    return out.str();
  };
  for (std::string differs : {
           field("model_type", model.model_type, loaded.model_type),
           field("vocab_size", model.vocab_size, loaded.vocab_size),
           field("hidden_size", model.hidden_size, loaded.hidden_size),
           field("intermediate_size", model.intermediate_size, loaded.intermediate_size),
           field("num_hidden_layers", model.num_hidden_layers, loaded.num_hidden_layers),
           field("num_attention_heads", model.num_attention_heads, loaded.num_attention_heads),
           field("num_key_value_heads", model.num_key_value_heads, loaded.num_key_value_heads),
           field("head_dim", model.head_dim, loaded.head_dim),
           field("rms_norm_eps", model.rms_norm_eps, loaded.rms_norm_eps),
           field("rope_theta", model.rope_theta, loaded.rope_theta),
           field("rope_scaling", RopeScalingToJson(model.rope_scaling),
                 RopeScalingToJson(loaded.rope_scaling)),
           field("attention_bias", model.attention_bias, loaded.attention_bias),
           field("tie_word_embeddings", model.tie_word_embeddings, loaded.tie_word_embeddings),
           field("max_position_embeddings", model.max_position_embeddings,
                 loaded.max_position_embeddings),
       }) {
    if (!differs.empty()) return differs;
  }
  return "";
}

}  // namespace

Trainer::Trainer(const ModelConfig& config, at::TensorOptions options, const AdamWOptions& adamw,
                 const ParallelOptions& parallel, const MakeModel& make_model) {
  TORCH_CHECK(parallel.timeout_s > 0, "timeout_s must be > 0, got ", parallel.timeout_s);
  LaunchEnvironment env;  // one process unless distributed
  if (parallel.distributed) {
    absl::StatusOr<LaunchEnvironment> from_env = LaunchEnvironmentFromEnv();
    TORCH_CHECK(from_env.ok(), "distributed: ", std::string(from_env.status().message()));
    env = *from_env;
    if (options.device().is_cuda() && !options.device().has_index()) {
      options =
          options.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank)));
    }
  }
  LayoutOverrides overrides = parallel.layout;
  overrides.offload_streamed = parallel.offload_update == OffloadUpdate::kOnDevice;
  absl::StatusOr<LayoutPlan> plan = PlanDeviceLayout(config, env.world_size, options.device(),
                                                     options.dtype().toScalarType(), overrides);
  TORCH_CHECK(plan.ok(), std::string(plan.status().message()));
  layout_ = *plan;
  if (parallel.distributed) {
    ProcessGroupOptions group_options;
    group_options.timeout = std::chrono::seconds(parallel.timeout_s);
    absl::StatusOr<std::unique_ptr<ProcessGroup>> world = ProcessGroup::Create(
        env, options.device().is_cuda() ? options.device() : at::Device(at::kCPU), group_options);
    TORCH_CHECK(world.ok(), "distributed: ", std::string(world.status().message()));
    world_ = *std::move(world);
    groups_ =
        std::make_unique<ParallelGroups>(*world_, layout_.layout.tensor_parallel, group_options);
  }
  model_.emplace(make_model(options, groups_ ? groups_->tensor_parallel_collectives() : nullptr));
  optimizer_ = std::make_unique<TrainingOptimizer>(
      model_->named_parameters(), groups_ ? &groups_->data_parallel() : nullptr, layout_.layout,
      adamw, int64_t{25} << 20, model_->gradient_norm_scope(), parallel.offload_update);
}

Trainer::~Trainer() {
  if (!world_) return;
  try {
    world_->Barrier();
  } catch (const std::exception& e) {
    TORCH_WARN("dta.Trainer: the final barrier failed (a peer is gone?): ", e.what());
  }
}

std::unique_ptr<Trainer> Trainer::FromDirectory(const std::string& directory,
                                                at::TensorOptions options,
                                                const AdamWOptions& adamw,
                                                const ParallelOptions& parallel) {
  absl::StatusOr<ModelConfig> config =
      LoadModelConfig((std::filesystem::path(directory) / "config.json").string());
  TORCH_CHECK(config.ok(), std::string(config.status().message()));
  std::unique_ptr<Trainer> trainer(
      new Trainer(*config, options, adamw, parallel,
                  [&](const at::TensorOptions& o, std::shared_ptr<const TensorParallelGroup> tp) {
                    return LoadHfModel(directory, o, std::move(tp));
                  }));
  trainer->source_directory_ = directory;
  return trainer;
}

std::unique_ptr<Trainer> Trainer::FromConfig(const std::string& config, uint64_t seed,
                                             double init_std, at::TensorOptions options,
                                             const AdamWOptions& adamw,
                                             const ParallelOptions& parallel) {
  absl::StatusOr<ModelConfig> parsed = ModelConfigFromName(config);
  TORCH_CHECK(parsed.ok(), std::string(parsed.status().message()));
  return std::unique_ptr<Trainer>(
      new Trainer(*parsed, options, adamw, parallel,
                  [&](const at::TensorOptions& o, std::shared_ptr<const TensorParallelGroup> tp) {
                    Decoder model(*parsed, o, std::move(tp));
                    model.InitRandom(seed, init_std);
                    return model;
                  }));
}

GradientStats Trainer::ComputeGradients(absl::Span<const Rollout> rollouts, const LossOptions& loss,
                                        const ExecutorOptions& executor) {
  GradientStats stats;
  // With replace_gradients the executor replaces the gradients; a rank that runs no executor call
  // zeroes them instead.
  if (rollouts.empty()) {
    if (executor.replace_gradients) ZeroGrad();
    return stats;
  }
  stats.tree_tokens = TreeTokens(rollouts);
  const int replicas = data_parallel_size();
  GradientResult result;
  if (replicas == 1) {  // one process, or tensor parallelism only: every rank trains the batch
    result = dta::ComputeGradients(*model_, rollouts, loss, executor);
  } else {
    // The advantages the executor would use on one process, over the whole batch.
    const bool with_advantages = UsesAdvantages(loss, rollouts);
    const PartitionPlan plan = SplitBatch(rollouts, replicas, with_advantages, loss.advantages);
    RankShare share = ShareOfRank(plan, data_parallel_rank(), rollouts);
    if (loss.custom && !with_advantages) {
      for (Rollout& r : share.rollouts) r.advantages.clear();  // as on one process: none at all
    }
    LossOptions share_loss = loss;
    if (loss.custom) {  // the callable sees the batch's rollouts (its index is the batch's)
      share_loss.custom = [custom = loss.custom, &share, rollouts](const RolloutLossInputs& in,
                                                                   const BatchLossContext& batch) {
        RolloutLossInputs mapped = in;
        mapped.rollout = &rollouts[share.positions[in.rollout - share.rollouts.data()]];
        return custom(mapped, batch);
      };
    }
    if (!share.rollouts.empty()) {
      result = dta::ComputeGradients(*model_, share.rollouts, share_loss, executor, plan.context);
    } else if (executor.replace_gradients) {
      ZeroGrad();
    }
    SumOverReplicas(groups_->data_parallel(), data_parallel_rank(), replicas, result);
  }
  stats.diagnostics = result.diagnostics;
  stats.loss = result.loss;
  stats.rollout_tokens = result.rollout_tokens;
  stats.forwarded_tokens = result.forwarded_tokens;
  stats.router_aux_loss = result.router_aux_loss;
  stats.replay_split_tokens = result.replay_split_tokens;
  return stats;
}

StepStats Trainer::Step(NonFiniteGradients on_nonfinite) {
  optimizer_->SyncGradients();
  return optimizer_->Step(on_nonfinite);
}

void Trainer::ZeroGrad() { optimizer_->ZeroGrad(); }

std::vector<at::Tensor> Trainer::ComputeLogprobs(absl::Span<const Rollout> rollouts,
                                                 const ExecutorOptions& executor) {
  if (rollouts.empty()) return {};
  const int replicas = data_parallel_size();
  if (replicas == 1) return dta::ComputeLogprobs(*model_, rollouts, executor);
  const PartitionPlan plan = SplitBatch(rollouts, replicas, /*with_advantages=*/false, {});
  const RankShare share = ShareOfRank(plan, data_parallel_rank(), rollouts);
  std::vector<at::Tensor> mine;
  if (!share.rollouts.empty()) mine = dta::ComputeLogprobs(*model_, share.rollouts, executor);
  // Every replica writes its rollouts into one flat buffer of the whole batch, zeros elsewhere,
  // and the sum over the replicas (exact: each value meets only zeros) gives every rank all of
  // them. float32 or float64: bfloat16 values widen exactly.
  std::vector<int64_t> offsets(rollouts.size() + 1, 0);
  for (size_t i = 0; i < rollouts.size(); ++i)
    offsets[i + 1] = offsets[i] + static_cast<int64_t>(rollouts[i].tokens.size());
  const at::ScalarType dtype = model_->options().dtype().toScalarType();
  const at::ScalarType wide = dtype == at::kDouble ? at::kDouble : at::kFloat;
  ProcessGroup& group = groups_->data_parallel();
  at::Tensor flat =
      at::zeros({offsets.back()}, at::TensorOptions().dtype(wide).device(group.device()));
  for (size_t j = 0; j < mine.size(); ++j) {
    const int64_t i = share.positions[j];
    flat.narrow(0, offsets[i], offsets[i + 1] - offsets[i]).copy_(mine[j]);
  }
  AllReduceSum(group, flat, "all-reduce of the batch's log-probabilities");
  std::vector<at::Tensor> out;
  out.reserve(rollouts.size());
  const at::Tensor on_model = flat.to(model_->options().device(), dtype);
  for (size_t i = 0; i < rollouts.size(); ++i)
    out.push_back(on_model.narrow(0, offsets[i], offsets[i + 1] - offsets[i]).clone());
  return out;
}

void Trainer::Save(const std::string& directory, std::optional<at::ScalarType> dtype,
                   bool with_optimizer) const {
  // Replica 0's TP ranks gather the split weights (TP rank 0 writes them); every rank writes the
  // optimizer state it owns.
  SaveTrainingCheckpoint(directory, *model_, with_optimizer ? optimizer_.get() : nullptr,
                         data_parallel_rank() == 0,
                         {.dtype = dtype, .source_directory = source_directory_});
  if (world_) world_->Barrier();  // the checkpoint is complete when any rank returns
}

void Trainer::LoadOptimizer(const std::string& path) {
  optimizer_->LoadState(OptimizerStatePath(path));
}

void Trainer::LoadWeights(const std::string& directory) {
  absl::StatusOr<ModelConfig> config =
      LoadModelConfig((std::filesystem::path(directory) / "config.json").string());
  TORCH_CHECK(config.ok(), std::string(config.status().message()));
  const std::string differs = FirstDifference(model_->config(), *config);
  TORCH_CHECK(differs.empty(), directory, "/config.json: not the trained model's configuration (",
              differs, "): load_weights replaces the weights of the same model only");
  // On the host in the model's dtype, so the device holds one copy of the weights throughout.
  const Decoder loaded = LoadHfModel(directory, model_->options().device(at::kCPU),
                                     groups_ ? groups_->tensor_parallel_collectives() : nullptr);
  at::NoGradGuard no_grad;
  const auto& from = loaded.named_parameters();
  const auto& into = model_->named_parameters();
  for (size_t i = 0; i < into.size(); ++i) {
    TORCH_CHECK(from[i].first == into[i].first, "load_weights: parameter ", i, " is '",
                from[i].first, "' in ", directory, " but '", into[i].first, "' in the model");
    into[i].second.detach().copy_(from[i].second);
  }
  optimizer_->ResetMasterFromParameters();
}

}  // namespace dta::python

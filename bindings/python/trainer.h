// A Qwen3 model and its AdamW optimizer, driven as the Python package's dta.Trainer drives them:
// the executor's calls behind one object. No Python in here (trainer_bindings.cc wraps it and
// handles the GIL), so it could serve any other front end.
//
// Example:
//   std::unique_ptr<Trainer> t = Trainer::FromDirectory("/ckpt/qwen3", at::dtype(at::kFloat), {});
//   (under torchrun: FromDirectory(..., {.distributed = true, .layout = {.tensor_parallel = 2}}))
//   t->ZeroGrad();
//   GradientStats g = t->ComputeGradients(rollouts, {.kind = LossKind::kPpo}, {});
//   StepStats s = t->Step();
//   t->Save("/ckpt/step-1", std::nullopt, /*with_optimizer=*/true);
//
// Errors: c10::Error (TORCH_CHECK) naming the file, rollout or field, as the executor reports them.
// Thread safety: none; one call at a time (the bindings hold a lock per trainer).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "core/io/rollout.h"
#include "executor/distributed/device_layout.h"
#include "executor/distributed/parallel_groups.h"
#include "executor/distributed/process_group.h"
#include "executor/distributed/training_optimizer.h"
#include "executor/engine/executor.h"
#include "executor/loss/loss.h"
#include "executor/model/decoder.h"

namespace dta::python {

struct GradientStats {
  double loss = 0;                  // the batch loss (sum over rollouts of the normalised losses)
  int64_t rollout_tokens = 0;       // every rollout's tokens
  int64_t tree_tokens = 0;          // the batch's unique tokens (its prefix tree's)
  int64_t forwarded_tokens = 0;     // tokens pushed through the model, recomputation included
  double router_aux_loss = 0;       // GradientResult::router_aux_loss (0 when off)
  int64_t replay_split_tokens = 0;  // GradientResult::replay_split_tokens
  LossDiagnostics diagnostics;      // the whole batch's
};

// How a trainer spreads over processes: the layout options of dta-train and dta-trainer.
struct ParallelOptions {
  // Join the process group the launcher describes (torchrun's RANK, WORLD_SIZE, LOCAL_RANK,
  // MASTER_ADDR, MASTER_PORT; "cuda" then means cuda:LOCAL_RANK). Every rank then makes the same
  // calls with the same whole batch: the batch is split across the data-parallel replicas
  // (lexicographic DFS-contiguous, advantages and normalisers over the whole batch), the TP ranks
  // of a replica train its share together.
  bool distributed = false;
  // Tensor parallelism, optimizer sharding and offload, memory: as the binaries' flags.
  LayoutOverrides layout;
  int timeout_s = 600;  // collectives and the rendezvous
  // Where an offloaded optimizer is updated when the model is on a GPU (--offload_update).
  OffloadUpdate offload_update = OffloadUpdate::kOnDevice;
};

class Trainer {
 public:
  // Loads a Hugging Face Qwen3 directory (config.json + safetensors) with `options` (dtype,
  // device), this rank's part of it under tensor parallelism.
  static std::unique_ptr<Trainer> FromDirectory(const std::string& directory,
                                                at::TensorOptions options,
                                                const AdamWOptions& adamw,
                                                const ParallelOptions& parallel = {});
  // A preset ("qwen3-0.6b", ...) or a config.json path, with deterministic random weights
  // (Decoder::InitRandom: the same model at every TP size). TORCH_CHECK naming the config when
  // it is neither.
  static std::unique_ptr<Trainer> FromConfig(const std::string& config, uint64_t seed,
                                             double init_std, at::TensorOptions options,
                                             const AdamWOptions& adamw,
                                             const ParallelOptions& parallel = {});

  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;
  // Distributed: waits for every rank (bounded by the timeout), so that rank 0's store outlives
  // the others' last collective. Never throws.
  ~Trainer();

  // Adds d batch loss / d parameter into every parameter's .grad (ZeroGrad first for a fresh
  // step, or executor.replace_gradients, which replaces them: zeros on a rank that gets no
  // rollouts); distributed, this rank's share's part (Step sums it over the replicas). Rollouts
  // must be valid with token ids below the vocabulary (TORCH_CHECK names the rollout). An empty
  // batch computes nothing. The stats are the whole batch's on every rank.
  GradientStats ComputeGradients(absl::Span<const Rollout> rollouts, const LossOptions& loss,
                                 const ExecutorOptions& executor);
  // Sums the gradients over the data-parallel replicas, then clips and steps AdamW (see
  // NonFiniteGradients for a gradient that is not finite).
  StepStats Step(NonFiniteGradients on_nonfinite = NonFiniteGradients::kRaise);
  void ZeroGrad();
  // Every rollout's per-token log-probabilities [L] (position 0 holds 0), without gradients; on
  // every rank, each replica computing its share.
  std::vector<at::Tensor> ComputeLogprobs(absl::Span<const Rollout> rollouts,
                                          const ExecutorOptions& executor);
  // Writes a training checkpoint (executor/checkpoint/training_checkpoint.h): directory/model as
  // inference engines load it (in `dtype`, nullopt: the model's; gathered across TP ranks; with
  // the tokenizer and generation config of the directory the model came from) and, with
  // `with_optimizer`, directory/optimizer (what each rank owns: optimizer.safetensors, or
  // optimizer-RRRRR-of-WWWWW.safetensors when sharded or offloaded; under TP in tp-RR-of-TT/).
  // Every rank calls it.
  void Save(const std::string& directory, std::optional<at::ScalarType> dtype,
            bool with_optimizer) const;
  // Restores the optimizer from a checkpoint Save (or dta-train --save, or dta-trainer) wrote, its
  // optimizer/ directory or one state file.
  void LoadOptimizer(const std::string& path);
  // Replaces the weights with those of a Hugging Face directory of the same model (config.json
  // equal to this model's, else TORCH_CHECK naming the first field that differs): read on the
  // host, this rank's part copied into the parameters, the optimizer's master weights taken from
  // them (its moments and step count stay, as after loading a model state into torch's AdamW).
  // Every rank calls it.
  void LoadWeights(const std::string& directory);

  const Decoder& model() const { return *model_; }
  TrainingOptimizer& optimizer() { return *optimizer_; }
  const LayoutPlan& layout() const { return layout_; }
  int rank() const { return world_ ? world_->rank() : 0; }
  int world_size() const { return world_ ? world_->size() : 1; }
  int tensor_parallel_rank() const { return groups_ ? groups_->tensor_parallel_rank() : 0; }
  int data_parallel_rank() const { return groups_ ? groups_->data_parallel_rank() : 0; }
  int data_parallel_size() const { return groups_ ? groups_->data_parallel_size() : 1; }

 private:
  using MakeModel =
      std::function<Decoder(const at::TensorOptions&, std::shared_ptr<const TensorParallelGroup>)>;
  Trainer(const ModelConfig& config, at::TensorOptions options, const AdamWOptions& adamw,
          const ParallelOptions& parallel, const MakeModel& make_model);

  // Declared first, destroyed last: the model's collectives use the groups.
  std::unique_ptr<ProcessGroup> world_;
  std::unique_ptr<ParallelGroups> groups_;
  LayoutPlan layout_;
  std::optional<Decoder> model_;
  std::unique_ptr<TrainingOptimizer> optimizer_;
  // The Hugging Face directory the model was loaded from (empty: random weights).
  std::string source_directory_;
};

}  // namespace dta::python

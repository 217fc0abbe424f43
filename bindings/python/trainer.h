// A Qwen3 model and its AdamW optimizer, driven as the Python package's dta.Trainer drives them:
// the executor's calls behind one object. No Python in here (trainer_bindings.cc wraps it and
// handles the GIL), so it could serve any other front end.
//
// Example:
//   std::unique_ptr<Trainer> t = Trainer::FromDirectory("/ckpt/qwen3", at::dtype(at::kFloat), {});
//   t->ZeroGrad();
//   GradientStats g = t->ComputeGradients(rollouts, {.kind = LossKind::kPpo}, {.method =
//   Method::kDta}); StepStats s = t->Step(); t->Save("/ckpt/step-1", std::nullopt,
//   /*with_optimizer=*/true);
//
// Errors: c10::Error (TORCH_CHECK) naming the file, rollout or field, as the executor reports them.
// Thread safety: none; one call at a time (the bindings hold a lock per trainer).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "core/io/rollout.h"
#include "executor/distributed/training_optimizer.h"
#include "executor/engine/executor.h"
#include "executor/loss/loss.h"
#include "executor/model/qwen3_model.h"

namespace dta::python {

struct GradientStats {
  double loss = 0;               // the batch loss (sum over rollouts of the normalised losses)
  int64_t rollout_tokens = 0;    // every rollout's tokens
  int64_t tree_tokens = 0;       // the batch's unique tokens (its prefix tree's)
  int64_t forwarded_tokens = 0;  // tokens pushed through the model, recomputation included
};

class Trainer {
 public:
  // Loads a Hugging Face Qwen3 directory (config.json + safetensors) with `options` (dtype,
  // device).
  // `offload_optimizer`: AdamW's state (float32 master weights and moments) in host memory,
  // updated there (ShardedAdamW over one rank), so that the GPU holds weights and gradients only.
  static std::unique_ptr<Trainer> FromDirectory(const std::string& directory,
                                                at::TensorOptions options,
                                                const AdamWOptions& adamw,
                                                bool offload_optimizer = false);
  // A preset ("qwen3-0.6b", ...) or a config.json path, with deterministic random weights
  // (Qwen3Model::InitRandom). TORCH_CHECK naming the config when it is neither.
  static std::unique_ptr<Trainer> FromConfig(const std::string& config, uint64_t seed,
                                             double init_std, at::TensorOptions options,
                                             const AdamWOptions& adamw,
                                             bool offload_optimizer = false);

  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Adds d batch loss / d parameter into every parameter's .grad (ZeroGrad first for a fresh
  // step). Rollouts must be valid with token ids below the vocabulary (TORCH_CHECK names the
  // rollout). An empty batch computes nothing.
  GradientStats ComputeGradients(absl::Span<const Rollout> rollouts, const LossOptions& loss,
                                 const ExecutorOptions& executor);
  // Clips and steps AdamW on the current gradients.
  StepStats Step();
  void ZeroGrad();
  // Every rollout's per-token log-probabilities [L] (position 0 holds 0), without gradients.
  std::vector<at::Tensor> ComputeLogprobs(absl::Span<const Rollout> rollouts,
                                          const ExecutorOptions& executor);
  // Writes the model as a Hugging Face checkpoint (in `dtype`, default the model's) and, with
  // `with_optimizer`, the optimizer's state (<directory>/optimizer.safetensors, or
  // optimizer-00000-of-00001.safetensors when offloaded).
  void Save(const std::string& directory, std::optional<at::ScalarType> dtype,
            bool with_optimizer) const;
  // Restores the optimizer from a directory or file written by Save (or dta-train --save).
  void LoadOptimizer(const std::string& path);

  const Qwen3Model& model() const { return model_; }
  TrainingOptimizer& optimizer() { return optimizer_; }

 private:
  Trainer(Qwen3Model model, const AdamWOptions& adamw, bool offload_optimizer);

  Qwen3Model model_;
  TrainingOptimizer optimizer_;
};

}  // namespace dta::python

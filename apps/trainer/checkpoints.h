// The trainer's checkpoints: a directory of "step-<N>" subdirectories, each a Hugging Face model
// (config.json + safetensors, what rollout workers reload) plus the optimizer's state
// (optimizer.safetensors: moments, step count and master weights, from which the parameters are
// restored exactly) and trainer.json {"step", "policy_version"}.
//
// A checkpoint is written to "step-<N>.tmp" and renamed into place, so a directory named
// "step-<N>" is always complete; "latest.json" names the newest one for rollout workers. With data
// parallelism every rank holds the same weights: rank 0 writes, and every rank reads the
// directory (it must be shared, e.g. on a network file system, for ranks on several hosts).
//
// Errors: c10::Error (TORCH_CHECK) naming the path.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "executor/model/qwen3_model.h"
#include "executor/optim/adamw.h"

namespace dta {

struct CheckpointInfo {
  int64_t step = 0;  // committed steps the weights include
  std::string path;  // the step-<N> directory
};

// The newest complete checkpoint under `directory`, or nothing (also when the directory is
// missing).
std::optional<CheckpointInfo> LatestCheckpoint(const std::string& directory);

// Writes the model and the optimizer after `step` committed steps, then removes all but the
// newest `keep` checkpoints (keep >= 1) and points latest.json at this one.
void SaveCheckpoint(const std::string& directory, int64_t step, int64_t policy_version,
                    const Qwen3Model& model, const AdamW& optimizer, int keep = 2);

// Restores the optimizer's state and, through its master weights, the model's parameters.
void LoadCheckpoint(const CheckpointInfo& checkpoint, AdamW& optimizer);

}  // namespace dta

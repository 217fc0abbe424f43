// The trainer's checkpoints: a directory of "step-<N>" subdirectories, each a training checkpoint
// (executor/checkpoint/training_checkpoint.h): model/ exactly as SGLang, vLLM and transformers
// load it (bf16 by default, with the source model's tokenizer and generation config), optimizer/
// with the optimizer's state (moments, step count and master weights, from which the parameters
// are restored exactly: one optimizer.safetensors when it is replicated, one
// optimizer-RRRRR-of-WWWWW.safetensors per rank when it is sharded or offloaded), and trainer.json
// {"step", "policy_version"}.
//
// A checkpoint is written to "step-<N>.tmp" and renamed into place, so a directory named
// "step-<N>" is always complete; "latest.json" {"step", "policy_version", "path", "model_path"}
// names the newest one, model_path being what a rollout engine reloads. Every rank writes what it
// owns into the same temporary directory before rank 0 renames it: the weights (gathered across
// tensor-parallel ranks) and a replicated optimizer once, each slice of a sharded optimizer, and
// each TP rank's parts (under optimizer/tp-RR-of-TT/); every rank reads the directory (it must be
// shared, e.g. on a network file system, for ranks on several hosts). Checkpoints written before
// the model/ and optimizer/ split (state files beside the weights) still resume.
//
// Errors: c10::Error (TORCH_CHECK) naming the path.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "executor/distributed/process_group.h"
#include "executor/distributed/training_optimizer.h"
#include "executor/model/decoder.h"
#include "executor/model/hf_checkpoint.h"

namespace dta {

struct CheckpointInfo {
  int64_t step = 0;  // committed steps the weights include
  std::string path;  // the step-<N> directory
};

// The newest complete checkpoint under `directory`, or nothing (also when the directory is
// missing).
std::optional<CheckpointInfo> LatestCheckpoint(const std::string& directory);

// Which ranks save a checkpoint together.
struct CheckpointRanks {
  // Every rank of the world (null: one process) saves together: each writes the optimizer state it
  // owns, the first data-parallel replica's TP ranks gather the weights (TP rank 0 writes them),
  // and world rank 0 publishes the checkpoint; they meet at two barriers of `world`. Under expert
  // parallelism the first EP group's replicas gather the weights (their experts together are
  // every expert): `expert_data_parallel_rank` is 0 on them.
  ProcessGroup* world = nullptr;
  int expert_data_parallel_rank = 0;
};

// Writes the model (as `model_export` says) and the optimizer after `step` committed steps, then
// removes all but the newest `keep` checkpoints (keep >= 1) and points latest.json at this one.
// Every rank of ranks.world calls it; returns the checkpoint written.
//
// With `weight_delta`, world rank 0 also writes the delta from the newest earlier checkpoint's
// weights (re-read from its model/ directory) to these, core/checkpoint/weight_delta.h's files
//   step-<N>/model/delta-from-<M>.safetensors and .json   (M: that checkpoint's step, 8 digits)
// which the engines' loaders skip (they read the files model.safetensors.index.json names), and
// names it in trainer.json and latest.json: "weight_delta": {"base_step": M, "index": the .json's
// path (relative to step-<N> in trainer.json), "changed_elements", "elements", "delta_bytes",
// "full_bytes"}. There is none for the first checkpoint, nor when the earlier weights cannot be
// read or hold other tensors (a message on stderr says why): receivers then load the whole model.
CheckpointInfo SaveCheckpoint(const std::string& directory, int64_t step, int64_t policy_version,
                              const Decoder& model, const TrainingOptimizer& optimizer,
                              int keep = 2, const CheckpointRanks& ranks = {},
                              const ModelExportOptions& model_export = {},
                              bool weight_delta = false);

// Restores the optimizer's state and, through its master weights, the model's parameters (a
// sharded optimizer reads the slices it needs from every rank's file: every rank calls it).
void LoadCheckpoint(const CheckpointInfo& checkpoint, TrainingOptimizer& optimizer);

}  // namespace dta

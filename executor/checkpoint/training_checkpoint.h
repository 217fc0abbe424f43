// A training checkpoint: one directory holding the model as inference engines load it and, beside
// it, the optimizer's state, so that nothing an engine's loader globs (*.safetensors) is anything
// but weights:
//
//   <checkpoint>/model/       config.json, generation_config.json, model.safetensors (or shards)
//                             + model.safetensors.index.json, the source's tokenizer files
//                             (ExportHfModel): what SGLang, vLLM and transformers load
//   <checkpoint>/optimizer/   the optimizer's state (TrainingOptimizer::SaveState: one file, or one
//                             per rank when sharded or offloaded; tp-RR-of-TT/ per TP rank)
//
// dta-train --save, dta.Trainer.save and dta-trainer's step-<N> (which adds trainer.json) write it;
// resuming reads <checkpoint>/optimizer, which restores the parameters exactly from the master
// weights, whatever dtype the published model has.
//
//   SaveTrainingCheckpoint("/ckpt/run", model, &optimizer, /*writes_model=*/dp_rank == 0,
//                          {.source_directory = "/models/Qwen3-8B"});
//   optimizer.LoadState(OptimizerStatePath("/ckpt/run"));
//
// Errors: c10::Error (TORCH_CHECK) naming the path.
#pragma once

#include <string>

#include "executor/distributed/training_optimizer.h"
#include "executor/model/decoder.h"
#include "executor/model/hf_checkpoint.h"

namespace dta {

inline constexpr char kCheckpointModelDirectory[] = "model";
inline constexpr char kCheckpointOptimizerDirectory[] = "optimizer";

// <checkpoint>/model and <checkpoint>/optimizer.
std::string CheckpointModelPath(const std::string& checkpoint);
std::string CheckpointOptimizerPath(const std::string& checkpoint);

// Writes a checkpoint into `directory` (created if missing). Every rank calls it: the ranks with
// `writes_model` (one data-parallel replica's tensor-parallel ranks, which gather the weights
// together) export the model, and every rank writes the optimizer state it owns (none when
// `optimizer` is null). It does not synchronise the ranks: the caller's barrier says when the
// checkpoint is complete.
void SaveTrainingCheckpoint(const std::string& directory, const Decoder& model,
                            const TrainingOptimizer* optimizer, bool writes_model,
                            const ModelExportOptions& model_export);

// Where a checkpoint's optimizer state is: <path>/optimizer when `path` is a checkpoint directory
// holding one, else `path` itself (a state directory or file, as TrainingOptimizer::LoadState
// reads).
std::string OptimizerStatePath(const std::string& path);

}  // namespace dta

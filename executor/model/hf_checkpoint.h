// Models of every family (core/model/family.h) as Hugging Face checkpoints: config.json
// plus model.safetensors, or shards named by model.safetensors.index.json
// (core/checkpoint/safetensors.h), under transformers' tensor names (biases included:
// "...q_proj.bias"), as the layer spec maps them (core/model/layer_spec.h,
// ParameterSpec::CheckpointNames). Qwen3-MoE's stacked experts (Decoder's
// "model.layers.L.mlp.experts.gate_proj",
// "...up_proj", "...down_proj", [E, ...]) are stored as the Hub's checkpoints and transformers 5's
// save_pretrained store them, one tensor per expert:
// "model.layers.L.mlp.experts.<e>.gate_proj.weight" (and up_proj, down_proj) for e in [0, E); the
// router is "model.layers.L.mlp.gate.weight" in both. Everything else that names parameters
// (optimizer state, training checkpoints' optimizer/, gradient dumps) uses the model's names. What
// SaveHfModel writes, transformers' Qwen3ForCausalLM, Qwen2ForCausalLM and
// LlamaForCausalLM.from_pretrained load, and what transformers' save_pretrained writes,
// LoadHfModel loads (tests/python/test_hf_parity.py and test_hf_parity_families.py check both
// directions and the log-probabilities against transformers').
//
// Example:
//   Decoder model = LoadHfModel("/ckpt/qwen3-0.6b", at::TensorOptions().dtype(at::kFloat));
//   SaveHfModel(model, "/ckpt/step-100", at::kBFloat16);  // bf16 export, as Hugging Face ships
//
// Errors are TORCH_CHECK failures (c10::Error) whose message names the directory or file and the
// tensor concerned.
//
// Thread safety: free functions; saving reads the parameters, so it must not overlap an optimizer
// step on the same model.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "executor/model/decoder.h"

namespace dta {

// Loads <directory>/config.json and the weights into a new model whose parameters have `options`
// (dtype, device) and require grad. Rules:
//   - every parameter of the model (Decoder::named_parameters) must be in the checkpoint with
//     exactly its shape: otherwise an error naming the tensor (and, for a shape, the file and both
//     shapes);
//   - stored dtypes BF16, F16, F32 and F64 are accepted and converted to the model's dtype (the
//     usual rounding when narrowing); any other stored dtype is an error naming the tensor;
//   - tensors the model does not have are an error naming them, except: rotary "inv_freq" buffers
//     (names ending in "inv_freq", written by old transformers versions), which are ignored; and
//     "lm_head.weight" when the config ties the embeddings, which transformers may store anyway:
//     it must then have the embedding's shape and equal values (compared in float64), else an
//     error, since a checkpoint whose head disagrees with the embedding it claims to be tied to
//     is inconsistent (transformers would silently use the embedding); and the tensors the
//     family's transformers class skips (ModelFamily::ignored_checkpoint_prefixes: Qwen3-Next's
//     and Qwen3.5's multi-token prediction head "mtp.*", Qwen3.5's vision tower
//     "model.visual.*");
//   - a vision-language checkpoint of Qwen3.5 (config.json "qwen3_5" or "qwen3_5_moe", read as
//     its text_config: config_json.h) holds the decoder's "model.*" tensors as
//     "model.language_model.*", and they are read from there (lm_head.weight as it is), as
//     transformers' Qwen3_5ForCausalLM reads them; a tensor stored under both names is an error.
//     What SaveHfModel writes is the decoder alone: "model.*", with the decoder's config.json.
// A missing or invalid config.json, or a directory without model.safetensors or its index, is an
// error naming the file. With `tensor_parallel`, each rank reads the whole tensors and keeps its
// part (Decoder's split); the checks are on the whole shapes. With `expert_parallel`, each rank
// reads only its experts' tensors.
Decoder LoadHfModel(const std::string& directory, at::TensorOptions options,
                    std::shared_ptr<const TensorParallelGroup> tensor_parallel = nullptr,
                    std::shared_ptr<const ExpertParallelGroup> expert_parallel = nullptr);

// Writes <directory>/config.json and the weights under their Hugging Face names (created if
// missing; files of an earlier save are replaced, stale shards removed): one model.safetensors up
// to max_shard_bytes of data, else shards plus model.safetensors.index.json. Tensors are stored in
// `dtype` (kBFloat16, kHalf, kFloat or kDouble; default: the model's dtype) and config.json's
// torch_dtype says which. lm_head.weight is not written when the embeddings are tied (as
// transformers does). Parameters on any device are copied to the CPU first. Under tensor (and
// expert) parallelism every rank of the model's groups calls it: the split parameters (and the
// experts) are gathered (Decoder::GatherParameter) and rank 0 of the groups writes the whole
// model; the others write nothing.
void SaveHfModel(const Decoder& model, const std::string& directory,
                 std::optional<at::ScalarType> dtype = std::nullopt,
                 int64_t max_shard_bytes = int64_t{5} << 30);

// How a model is published for inference engines.
struct ModelExportOptions {
  // The weights' storage type (kBFloat16, kHalf, kFloat or kDouble); nullopt: the model's.
  std::optional<at::ScalarType> dtype = at::kBFloat16;
  // The Hugging Face directory the model was loaded from (empty: none, e.g. random weights): its
  // tokenizer files and generation_config.json are copied, and its config.json's fields that
  // ModelConfig does not model (bos_token_id, eos_token_id, ...) kept (core/checkpoint/
  // model_files.h, SaveModelConfig).
  std::string source_directory;
  int64_t max_shard_bytes = int64_t{5} << 30;
};

// Writes what SGLang, vLLM and transformers load from a directory, and nothing else: the weights
// (SaveHfModel's files, always with model.safetensors.index.json, which the engines' loaders use
// to choose the *.safetensors files to read), config.json, generation_config.json and the source's
// tokenizer files. Every rank of the model's tensor-parallel group calls it; rank 0 writes.
void ExportHfModel(const Decoder& model, const std::string& directory,
                   const ModelExportOptions& options);

// Writes named tensors (any device; float64/32/16, bfloat16, float8 e4m3fn/e5m2, int64/32/16/8,
// uint8, bool) as one safetensors file at `path` with metadata {"format": "pt"}, each in its own
// dtype and shape, e.g. gradients for inspection. Error naming the tensor for an unsupported dtype
// or a repeated name, naming the file if it cannot be written.
void SaveNamedTensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::string& path);

}  // namespace dta

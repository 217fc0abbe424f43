#include "executor/model/hf_checkpoint.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <bit>
#include <filesystem>
#include <map>
#include <set>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/checkpoint/model_files.h"
#include "core/checkpoint/safetensors.h"
#include "core/model/config_json.h"
#include "core/model/family.h"
#include "core/model/layer_spec.h"
#include "core/model/model_config.h"
#include "executor/device/safetensors_tensors.h"

namespace dta {
namespace {

// Safetensors data is little-endian; tensors are copied byte for byte.
static_assert(std::endian::native == std::endian::little,
              "checkpoints assume a little-endian host");

// The safetensors dtype of a torch dtype, or nullopt if the format has none we support.
std::optional<DType> ToDType(at::ScalarType type) {
  switch (type) {
    case at::kDouble:
      return DType::kF64;
    case at::kFloat:
      return DType::kF32;
    case at::kBFloat16:
      return DType::kBF16;
    case at::kHalf:
      return DType::kF16;
    case at::kFloat8_e4m3fn:
      return DType::kF8E4M3;
    case at::kFloat8_e5m2:
      return DType::kF8E5M2;
    case at::kLong:
      return DType::kI64;
    case at::kInt:
      return DType::kI32;
    case at::kShort:
      return DType::kI16;
    case at::kChar:
      return DType::kI8;
    case at::kByte:
      return DType::kU8;
    case at::kBool:
      return DType::kBool;
    default:
      return std::nullopt;
  }
}

// The floating-point storage types a model checkpoint may use, with config.json's name for each.
std::optional<at::ScalarType> WeightType(DType dtype) {
  switch (dtype) {
    case DType::kF64:
      return at::kDouble;
    case DType::kF32:
      return at::kFloat;
    case DType::kBF16:
      return at::kBFloat16;
    case DType::kF16:
      return at::kHalf;
    default:
      return std::nullopt;
  }
}

const char* ConfigDTypeName(at::ScalarType type) {
  switch (type) {
    case at::kDouble:
      return "float64";
    case at::kFloat:
      return "float32";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    default:
      return nullptr;
  }
}

std::string FileOf(const SafetensorsCheckpoint& checkpoint, std::string_view name) {
  const SafetensorsFile* file = checkpoint.FileOf(name);
  return file != nullptr ? file->path() : std::string("?");
}

// A CPU tensor holding a copy of the stored bytes, in the stored dtype (copied rather than wrapped,
// since the mapping only guarantees the alignment the file gives).
at::Tensor ToTensor(const SafetensorsCheckpoint& checkpoint, const TensorView& view) {
  const std::optional<at::ScalarType> type = WeightType(view.dtype);
  TORCH_CHECK(type.has_value(), "LoadHfModel: ", FileOf(checkpoint, view.name), ": tensor '",
              view.name, "' is stored as ", DTypeName(view.dtype),
              "; model weights must be BF16, F16, F32 or F64");
  return TensorFromView(view, *type);
}

const TensorView* GetChecked(const SafetensorsCheckpoint& checkpoint, const std::string& name,
                             at::IntArrayRef shape) {
  absl::StatusOr<const TensorView*> view =
      checkpoint.Get(name, absl::Span<const int64_t>(shape.data(), shape.size()));
  TORCH_CHECK(view.ok(), "LoadHfModel: ", view.status().message());
  return *view;
}

// The layer spec's entry of each of the model's parameters (Decoder allocates from the spec, in
// its order), which says how checkpoints store it (ParameterSpec::CheckpointNames).
std::vector<ParameterSpec> SpecsOf(const Decoder& model) {
  std::vector<ParameterSpec> specs = BuildModelSpec(model.config()).Parameters();
  TORCH_CHECK(specs.size() == model.named_parameters().size(),
              "the model's parameters are not its layer spec's");
  return specs;
}

}  // namespace

Decoder LoadHfModel(const std::string& directory, at::TensorOptions options,
                    std::shared_ptr<const TensorParallelGroup> tensor_parallel,
                    std::shared_ptr<const ExpertParallelGroup> expert_parallel) {
  absl::StatusOr<ModelConfig> config = LoadModelConfig(directory);
  TORCH_CHECK(config.ok(), "LoadHfModel: ", config.status().message());
  absl::StatusOr<SafetensorsCheckpoint> opened = SafetensorsCheckpoint::Open(directory);
  TORCH_CHECK(opened.ok(), "LoadHfModel: ", opened.status().message());
  const SafetensorsCheckpoint& checkpoint = *opened;

  Decoder model(*config, options, std::move(tensor_parallel), std::move(expert_parallel));
  const std::vector<ParameterSpec> specs = SpecsOf(model);
  std::set<std::string> expected;
  for (const ParameterSpec& spec : specs) {
    for (std::string& name : spec.CheckpointNames()) expected.insert(std::move(name));
  }

  // Each model name's tensor: its own name, or in a vision-language checkpoint its language
  // model's (the family's multimodal_model_type).
  const ModelFamily& family = *FindModelFamily(config->model_type);  // validated
  constexpr std::string_view kLanguageModel = "model.language_model.";
  std::map<std::string, std::string> stored;
  auto stored_name = [&](const std::string& name) -> const std::string& {
    const auto it = stored.find(name);
    return it == stored.end() ? name : it->second;
  };
  // Names the model does not have: inv_freq buffers are recomputed from rope_theta; a tied head
  // must be the embedding; the family's transformers class skips some.
  constexpr std::string_view kInvFreq = "inv_freq";
  constexpr std::string_view kHead = "lm_head.weight";
  std::vector<std::string> unexpected;
  bool has_tied_head = false;
  for (const std::string& name : checkpoint.names()) {
    std::string model_name = name;
    if (!family.multimodal_model_type.empty() && name.starts_with(kLanguageModel)) {
      model_name = "model." + name.substr(kLanguageModel.size());
    }
    if (expected.count(model_name)) {
      const auto [it, first] = stored.emplace(model_name, name);
      TORCH_CHECK(first, "LoadHfModel: ", directory, ": tensor '", model_name,
                  "' is stored twice (as '", name, "' and '", it->second, "')");
      continue;
    }
    if (std::string_view(name).ends_with(kInvFreq)) continue;
    if (std::any_of(family.ignored_checkpoint_prefixes.begin(),
                    family.ignored_checkpoint_prefixes.end(),
                    [&](std::string_view prefix) { return name.starts_with(prefix); })) {
      continue;
    }
    if (name == kHead && config->tie_word_embeddings) {
      has_tied_head = true;
      continue;
    }
    unexpected.push_back(name);
  }

  at::NoGradGuard no_grad;
  for (size_t i = 0; i < model.named_parameters().size(); ++i) {
    const auto& [name, parameter] = model.named_parameters()[i];
    const std::vector<int64_t>& shape = model.parameter_splits()[i].full_shape;
    if (!specs[i].per_expert()) {
      const TensorView* view = GetChecked(checkpoint, stored_name(name), shape);
      parameter.copy_(model.LocalPart(i, ToTensor(checkpoint, *view)));
      continue;
    }
    // Stacked experts: each of this rank's experts' tensors (all of them without expert
    // parallelism), this rank's part of it, into its slot.
    const ParameterSplit& split = model.parameter_splits()[i];
    const std::vector<std::string> names = specs[i].CheckpointNames();
    const std::vector<int64_t> expert_shape(shape.begin() + 1, shape.end());
    const IndexRange experts =
        split.expert_parallel() ? split.experts : IndexRange{0, static_cast<int64_t>(names.size())};
    std::vector<int64_t> block_shape = shape;
    block_shape[0] = experts.size();
    at::Tensor block = at::empty(block_shape, at::TensorOptions().dtype(parameter.scalar_type()));
    for (int64_t e = experts.begin; e < experts.end; ++e) {
      const TensorView* view = GetChecked(checkpoint, stored_name(names[e]), expert_shape);
      block[e - experts.begin].copy_(ToTensor(checkpoint, *view));
    }
    parameter.copy_(split.Narrow(block));
  }

  if (!unexpected.empty()) {
    std::string list;
    constexpr size_t kShown = 10;
    for (size_t i = 0; i < unexpected.size() && i < kShown; ++i) {
      list +=
          (i ? ", '" : "'") + unexpected[i] + "' (in " + FileOf(checkpoint, unexpected[i]) + ")";
    }
    if (unexpected.size() > kShown)
      list += ", and " + std::to_string(unexpected.size() - kShown) + " more";
    TORCH_CHECK(false, "LoadHfModel: ", directory, ": ", unexpected.size(),
                " unexpected tensor(s) that the ", family.name, " model does not have: ", list);
  }

  if (has_tied_head) {
    const std::string embed_name = "model.embed_tokens.weight";
    const std::vector<int64_t>& embed_shape = model.parameter_splits()[0].full_shape;
    TORCH_CHECK(model.named_parameters()[0].first == embed_name, "the embedding comes first");
    const TensorView* head_view = GetChecked(checkpoint, std::string(kHead), embed_shape);
    const TensorView* embed_view = checkpoint.Find(stored_name(embed_name));
    const at::Tensor head = ToTensor(checkpoint, *head_view).to(at::kDouble);
    TORCH_CHECK(
        at::equal(head, ToTensor(checkpoint, *embed_view).to(at::kDouble)),
        "LoadHfModel: ", FileOf(checkpoint, kHead), ": tensor 'lm_head.weight' differs from '",
        embed_name,
        "' although config.json sets tie_word_embeddings (remove it, or untie the embeddings)");
  }
  return model;
}

namespace {

// Gathers the parameters (every rank of the model's tensor-parallel group) and writes the weights
// and config.json from its rank 0; returns whether this rank wrote.
bool WriteHfModel(const Decoder& model, const std::string& directory,
                  std::optional<at::ScalarType> dtype, int64_t max_shard_bytes, bool index_one_file,
                  const std::string& base_config) {
  const at::ScalarType type = dtype.value_or(model.options().dtype().toScalarType());
  const char* type_name = ConfigDTypeName(type);
  TORCH_CHECK(type_name != nullptr, "SaveHfModel: ", directory, ": cannot store weights as ", type,
              " (bfloat16, float16, float32 or float64)");
  ModelConfig config = model.config();
  config.torch_dtype = type_name;

  at::NoGradGuard no_grad;
  const bool writer =
      (model.tensor_parallel() == nullptr || model.tensor_parallel()->rank() == 0) &&
      (model.expert_parallel() == nullptr || model.expert_parallel()->rank() == 0);
  const std::vector<ParameterSpec> specs = SpecsOf(model);
  std::vector<at::Tensor> owned;
  std::vector<TensorToWrite> tensors;
  for (size_t i = 0; i < model.named_parameters().size(); ++i) {
    // Every rank takes part in the gathers; one writes.
    at::Tensor whole = model.GatherParameter(i);
    if (!writer) continue;
    const std::string& name = model.named_parameters()[i].first;
    const std::vector<std::string> names = specs[i].CheckpointNames();
    if (!specs[i].per_expert()) {
      owned.push_back(whole.to(at::kCPU, type).contiguous());
      tensors.push_back(ToWrite(name, *ToDType(type), owned.back()));
      continue;
    }
    // Stacked experts: one tensor per expert, as the Hub and transformers store them.
    for (size_t e = 0; e < names.size(); ++e) {
      owned.push_back(whole[e].to(at::kCPU, type).contiguous());
      tensors.push_back(ToWrite(names[e], *ToDType(type), owned.back()));
    }
  }
  if (!writer) return false;
  const absl::Status written =
      WriteSafetensorsCheckpoint(directory, tensors, max_shard_bytes, index_one_file);
  TORCH_CHECK(written.ok(), "SaveHfModel: ", directory, ": ", written.message());
  const absl::Status saved = SaveModelConfig(config, directory, base_config);
  TORCH_CHECK(saved.ok(), "SaveHfModel: ", directory, ": ", saved.message());
  return true;
}

}  // namespace

void SaveHfModel(const Decoder& model, const std::string& directory,
                 std::optional<at::ScalarType> dtype, int64_t max_shard_bytes) {
  WriteHfModel(model, directory, dtype, max_shard_bytes, /*index_one_file=*/false, "");
}

void ExportHfModel(const Decoder& model, const std::string& directory,
                   const ModelExportOptions& options) {
  const std::string base_config =
      options.source_directory.empty()
          ? ""
          : (std::filesystem::path(options.source_directory) / "config.json").string();
  if (!WriteHfModel(model, directory, options.dtype, options.max_shard_bytes,
                    /*index_one_file=*/true, base_config)) {
    return;
  }
  const absl::StatusOr<std::vector<std::string>> copied =
      CopyModelCompanionFiles(options.source_directory, directory);
  TORCH_CHECK(copied.ok(), "ExportHfModel: ", directory, ": ", copied.status().message());
}

void SaveNamedTensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::string& path) {
  std::vector<at::Tensor> owned;
  std::vector<TensorToWrite> to_write;
  owned.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK(tensor.defined(), "SaveNamedTensors: ", path, ": tensor '", name, "' is undefined");
    const std::optional<DType> dtype = ToDType(tensor.scalar_type());
    TORCH_CHECK(dtype.has_value(), "SaveNamedTensors: ", path, ": tensor '", name, "' has dtype ",
                tensor.scalar_type(), ", which safetensors files cannot hold");
    owned.push_back(tensor.detach().to(at::kCPU).contiguous());
    to_write.push_back(ToWrite(name, *dtype, owned.back()));
  }
  const absl::Status written = WriteSafetensors(path, to_write, {{"format", "pt"}});
  TORCH_CHECK(written.ok(), "SaveNamedTensors: ", written.message());
}

}  // namespace dta

#include "executor/checkpoint/training_checkpoint.h"

#include <filesystem>

namespace dta {

namespace fs = std::filesystem;

std::string CheckpointModelPath(const std::string& checkpoint) {
  return (fs::path(checkpoint) / kCheckpointModelDirectory).string();
}

std::string CheckpointOptimizerPath(const std::string& checkpoint) {
  return (fs::path(checkpoint) / kCheckpointOptimizerDirectory).string();
}

void SaveTrainingCheckpoint(const std::string& directory, const Decoder& model,
                            const TrainingOptimizer* optimizer, bool writes_model,
                            const ModelExportOptions& model_export) {
  if (optimizer != nullptr) optimizer->SaveState(CheckpointOptimizerPath(directory));
  if (writes_model) ExportHfModel(model, CheckpointModelPath(directory), model_export);
}

std::string OptimizerStatePath(const std::string& path) {
  std::error_code error;
  const std::string nested = CheckpointOptimizerPath(path);
  return fs::is_directory(nested, error) ? nested : path;
}

}  // namespace dta

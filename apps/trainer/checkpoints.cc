#include "apps/trainer/checkpoints.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "core/base/remove_tree.h"
#include "core/checkpoint/safetensors.h"
#include "core/checkpoint/weight_delta.h"
#include "executor/checkpoint/training_checkpoint.h"
#include "nlohmann/json.hpp"

namespace dta {
namespace {

namespace fs = std::filesystem;

constexpr char kPrefix[] = "step-";
constexpr char kTrainerFile[] = "trainer.json";

// Flushes the file system holding `path` (every file written into the checkpoint, and the
// directory entries).
void SyncFileSystem(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY);
  TORCH_CHECK(fd >= 0, "cannot open ", path.string(), " to sync it");
  const int result = ::syncfs(fd);
  ::close(fd);
  TORCH_CHECK(result == 0, "cannot sync ", path.string());
}

std::string StepName(int64_t step) { return absl::StrFormat("%s%08d", kPrefix, step); }

// Complete checkpoints (step-<N> with trainer.json), oldest first.
std::vector<CheckpointInfo> Checkpoints(const std::string& directory) {
  std::vector<CheckpointInfo> found;
  std::error_code error;
  if (!fs::is_directory(directory, error)) return found;
  for (const fs::directory_entry& entry : fs::directory_iterator(directory, error)) {
    const std::string name = entry.path().filename().string();
    int64_t step = 0;
    if (name.rfind(kPrefix, 0) != 0 || !absl::SimpleAtoi(name.substr(sizeof(kPrefix) - 1), &step))
      continue;
    if (!fs::exists(entry.path() / kTrainerFile)) continue;
    found.push_back({.step = step, .path = entry.path().string()});
  }
  std::sort(found.begin(), found.end(),
            [](const CheckpointInfo& a, const CheckpointInfo& b) { return a.step < b.step; });
  return found;
}

void WriteJson(const fs::path& path, const nlohmann::json& json) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp);
    out << json.dump(2) << "\n";
    TORCH_CHECK(out.good(), "cannot write ", tmp.string());
  }
  fs::rename(tmp, path);
}

// Writes into `tmp`'s model the delta from `previous`'s weights and returns its "weight_delta"
// entry (the index relative to `tmp`), or null with a message when there can be none.
nlohmann::json WriteWeightDeltaFrom(const CheckpointInfo& previous, const fs::path& tmp,
                                    int64_t step) {
  const std::string stem = absl::StrFormat("delta-from-%08d", previous.step);
  const fs::path model = CheckpointModelPath(tmp.string());
  absl::StatusOr<SafetensorsCheckpoint> base =
      SafetensorsCheckpoint::Open(CheckpointModelPath(previous.path));
  absl::StatusOr<SafetensorsCheckpoint> target = SafetensorsCheckpoint::Open(model.string());
  absl::StatusOr<WeightDeltaSummary> summary =
      !base.ok() ? absl::StatusOr<WeightDeltaSummary>(base.status())
      : !target.ok()
          ? absl::StatusOr<WeightDeltaSummary>(target.status())
          : WriteWeightDelta(
                *base, *target, (model / stem).string(),
                {.base_step = previous.step, .step = step, .threads = at::get_num_threads()});
  if (!summary.ok()) {
    std::fprintf(stderr, "dta-trainer: no weight delta for step %lld: %s\n",
                 static_cast<long long>(step), summary.status().ToString().c_str());
    return nullptr;
  }
  std::fprintf(stderr,
               "dta-trainer: weight delta from step %lld to %lld: %.4f%% of %lld elements "
               "changed, %.1f MB of %.1f MB\n",
               static_cast<long long>(previous.step), static_cast<long long>(step),
               100.0 * summary->changed_elements / std::max<int64_t>(summary->elements, 1),
               static_cast<long long>(summary->elements), summary->delta_bytes / 1e6,
               summary->full_bytes / 1e6);
  return {{"base_step", previous.step},
          {"index", fs::relative(summary->index_path, tmp).string()},
          {"changed_elements", summary->changed_elements},
          {"elements", summary->elements},
          {"delta_bytes", summary->delta_bytes},
          {"full_bytes", summary->full_bytes}};
}

}  // namespace

std::optional<CheckpointInfo> LatestCheckpoint(const std::string& directory) {
  std::vector<CheckpointInfo> found = Checkpoints(directory);
  if (found.empty()) return std::nullopt;
  return found.back();
}

CheckpointInfo SaveCheckpoint(const std::string& directory, int64_t step, int64_t policy_version,
                              const Decoder& model, const TrainingOptimizer& optimizer, int keep,
                              const CheckpointRanks& ranks, const ModelExportOptions& model_export,
                              bool weight_delta) {
  TORCH_CHECK(keep >= 1, "checkpoints to keep must be >= 1, got ", keep);
  const int rank = ranks.world != nullptr ? ranks.world->rank() : 0;
  const fs::path final_path = fs::path(directory) / StepName(step);
  const fs::path tmp = final_path.string() + ".tmp";
  if (rank == 0) {
    std::error_code error;
    fs::create_directories(directory, error);
    TORCH_CHECK(!error, "cannot create the checkpoint directory ", directory, ": ",
                error.message());
    RemoveTree(tmp);
    RemoveTree(final_path);  // a step saved again (after a replay) is replaced
  }
  if (ranks.world != nullptr) ranks.world->Barrier();  // nobody writes into what rank 0 clears
  // What this rank owns: its optimizer state (maybe nothing), and the model on the first replica.
  SaveTrainingCheckpoint(tmp.string(), model, &optimizer, ranks.expert_data_parallel_rank == 0,
                         model_export);
  if (ranks.world != nullptr) ranks.world->Barrier();  // all is written before rank 0 publishes
  const CheckpointInfo saved = {.step = step, .path = final_path.string()};
  if (rank != 0) return saved;
  nlohmann::json trainer = {{"step", step}, {"policy_version", policy_version}};
  nlohmann::json latest = {{"step", step},
                           {"policy_version", policy_version},
                           {"path", final_path.string()},
                           {"model_path", CheckpointModelPath(final_path.string())}};
  // The newest complete checkpoint is the previous one: this step's was removed above.
  const std::optional<CheckpointInfo> previous = LatestCheckpoint(directory);
  if (weight_delta && previous.has_value() && previous->step < step) {
    nlohmann::json delta = WriteWeightDeltaFrom(*previous, tmp, step);
    if (!delta.is_null()) {
      trainer["weight_delta"] = delta;
      delta["index"] = (final_path / delta["index"].get<std::string>()).string();
      latest["weight_delta"] = std::move(delta);
    }
  }
  WriteJson(tmp / kTrainerFile, trainer);
  // On disk before it is renamed into place: the dispatcher releases the replay data of the steps a
  // checkpoint holds once trainers report it, so a checkpoint must survive a host crash.
  SyncFileSystem(tmp);
  std::error_code error;
  fs::rename(tmp, final_path, error);
  TORCH_CHECK(!error, "cannot rename ", tmp.string(), " to ", final_path.string(), ": ",
              error.message());
  SyncFileSystem(directory);
  WriteJson(fs::path(directory) / "latest.json", latest);
  std::vector<CheckpointInfo> found = Checkpoints(directory);
  for (size_t i = 0; i + keep < found.size(); ++i) RemoveTree(found[i].path);
  return saved;
}

void LoadCheckpoint(const CheckpointInfo& checkpoint, TrainingOptimizer& optimizer) {
  optimizer.LoadState(OptimizerStatePath(checkpoint.path));
  TORCH_CHECK(optimizer.step() == checkpoint.step, "checkpoint ", checkpoint.path,
              " holds an optimizer after ", optimizer.step(), " steps, not ", checkpoint.step);
}

}  // namespace dta

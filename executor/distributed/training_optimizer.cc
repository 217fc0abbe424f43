#include "executor/distributed/training_optimizer.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace dta {
namespace fs = std::filesystem;

namespace {

// The name of a tp-RR-of-TT subdirectory of `directory`, or "" when it has none.
std::string TensorParallelStateIn(const std::string& directory) {
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(directory, error)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && name.starts_with("tp-")) return name;
  }
  return "";
}

}  // namespace

TrainingOptimizer::TrainingOptimizer(std::vector<std::pair<std::string, at::Tensor>> named,
                                     ProcessGroup* group, const TrainingLayout& layout,
                                     AdamWOptions options, int64_t bucket_bytes,
                                     TensorParallelNorm tensor_parallel,
                                     OffloadUpdate offload_update) {
  const int tp = tensor_parallel.group != nullptr ? tensor_parallel.group->size() : 1;
  TORCH_CHECK(layout.tensor_parallel == tp, "TrainingOptimizer: the layout's tensor parallelism (",
              layout.tensor_parallel, ") differs from the model's (", tp, ")");
  if (tp > 1) {
    char name[32];
    std::snprintf(name, sizeof(name), "tp-%02d-of-%02d", tensor_parallel.group->rank(), tp);
    tensor_parallel_subdirectory_ = name;
  }
  TORCH_CHECK(!layout.shard_optimizer || group != nullptr || layout.data_parallel == 1,
              "TrainingOptimizer: sharding across ", layout.data_parallel,
              " data-parallel ranks needs a process group");
  rank_ = group != nullptr ? group->rank() : 0;
  if (layout.shard_optimizer || layout.offload_optimizer) {
    // Unsharded offload is a sharded optimizer over one rank per slice: every rank holds it all.
    ProcessGroup* shard_group = layout.shard_optimizer ? group : nullptr;
    TORCH_CHECK(shard_group != nullptr || group == nullptr || group->size() == 1,
                "TrainingOptimizer: offload without sharding on ", group->size(),
                " data-parallel ranks is not supported; shard the optimizer as well");
    const int64_t element_bytes =
        named.empty() ? 4 : std::max<int64_t>(4, named.front().second.element_size());
    sharded_ = std::make_unique<ShardedAdamW>(
        shard_group, std::move(named), options,
        ShardedAdamWOptions{.offload = layout.offload_optimizer,
                            .offload_update = offload_update,
                            .bucket_elements = std::max<int64_t>(1, bucket_bytes / element_bytes),
                            .tensor_parallel = std::move(tensor_parallel)});
    return;
  }
  replicated_ = std::make_unique<AdamW>(named, options, std::move(tensor_parallel));
  if (group != nullptr) {
    all_reduce_ = std::make_unique<GradientSynchronizer>(
        *group, std::move(named), GradientSynchronizerOptions{.bucket_bytes = bucket_bytes});
  }
}

void TrainingOptimizer::ZeroGrad() {
  if (sharded_) {
    sharded_->ZeroGrad();
  } else {
    replicated_->ZeroGrad();
  }
}

void TrainingOptimizer::SyncGradients() {
  if (sharded_) {
    sharded_->ReduceGradients();
  } else if (all_reduce_) {
    all_reduce_->SyncGradients();
  }
}

std::string TrainingOptimizer::DescribeOffload() const {
  if (!sharded_ || !sharded_->sharding().offload) return "";
  if (sharded_->streams_through_device()) {
    return "the offloaded AdamW state streams through the GPU from page-locked host memory";
  }
  std::string text =
      absl::StrCat("the offloaded AdamW update runs on ", at::get_num_threads(), " host threads");
  if (!sharded_->streaming_refused().empty()) {
    absl::StrAppend(
        &text, " (streaming it through the GPU was refused: ", sharded_->streaming_refused(), ")");
  }
  return text;
}

StepStats TrainingOptimizer::Step(NonFiniteGradients on_nonfinite) {
  if (schedule_.has_value()) ApplyLr(peak_lr_ * LrFactor(*schedule_, step()));
  const double lr = options().lr;
  StepStats stats = sharded_ ? sharded_->Step(on_nonfinite) : replicated_->Step(on_nonfinite);
  stats.lr = lr;
  return stats;
}

void TrainingOptimizer::ResetMasterFromParameters() {
  if (sharded_) {
    sharded_->ResetMasterFromParameters();
  } else {
    replicated_->ResetMasterFromParameters();
  }
}

void TrainingOptimizer::set_schedule(const LrSchedule& schedule) {
  const absl::Status valid = ValidateLrSchedule(schedule);
  TORCH_CHECK(valid.ok(), "learning-rate schedule: ", valid.message());
  schedule_ = schedule;
  peak_lr_ = options().lr;
}

int64_t TrainingOptimizer::step() const {
  return sharded_ ? sharded_->step() : replicated_->step();
}

const AdamWOptions& TrainingOptimizer::options() const {
  return sharded_ ? sharded_->options() : replicated_->options();
}

void TrainingOptimizer::set_lr(double lr) {
  ApplyLr(lr);
  peak_lr_ = lr;
}

void TrainingOptimizer::ApplyLr(double lr) {
  if (sharded_) {
    sharded_->set_lr(lr);
  } else {
    replicated_->set_lr(lr);
  }
}

std::string TrainingOptimizer::StateDirectory(const std::string& directory) const {
  if (tensor_parallel_subdirectory_.empty()) return directory;
  return (fs::path(directory) / tensor_parallel_subdirectory_).string();
}

void TrainingOptimizer::SaveState(const std::string& top) const {
  const std::string directory = StateDirectory(top);
  std::error_code error;
  fs::create_directories(directory, error);
  TORCH_CHECK(!error, "cannot create ", directory, ": ", error.message());
  if (sharded_) {
    sharded_->SaveState(
        (fs::path(directory) / ShardedAdamW::ShardFileName(sharded_->rank(), sharded_->world()))
            .string());
  } else if (rank_ == 0) {
    replicated_->SaveState((fs::path(directory) / kReplicatedFile).string());
  }
}

bool TrainingOptimizer::HasState(const std::string& top) const {
  const std::string directory = StateDirectory(top);
  if (sharded_) return !ShardedAdamW::ShardFiles(directory).empty();
  return fs::exists(fs::path(directory) / kReplicatedFile);
}

void TrainingOptimizer::LoadState(const std::string& path) {
  if (fs::is_regular_file(path)) {  // one file: the replicated state, or one slice
    if (sharded_) {
      sharded_->LoadState({path});
    } else {
      replicated_->LoadState(path);
    }
    return;
  }
  const std::string directory = StateDirectory(path);
  // The state of a rank's parts does not reshard across tensor-parallel sizes.
  const std::string saved_tp = TensorParallelStateIn(path);
  TORCH_CHECK(
      fs::is_directory(directory) && (saved_tp.empty() || !tensor_parallel_subdirectory_.empty()),
      "optimizer state in ", path, ": ",
      saved_tp.empty() ? std::string("it was saved without tensor parallelism")
                       : "it was saved with tensor parallelism (" + saved_tp + ")",
      ", and this run ",
      tensor_parallel_subdirectory_.empty() ? std::string("has none")
                                            : "looks for " + tensor_parallel_subdirectory_,
      ": optimizer state resumes only with the tensor-parallel size it was saved with");
  const bool has_replicated = fs::exists(fs::path(directory) / kReplicatedFile);
  const std::vector<std::string> shards = ShardedAdamW::ShardFiles(directory);
  if (sharded_) {
    TORCH_CHECK(!shards.empty(), "optimizer state in ", directory, ": ",
                has_replicated ? "it holds a replicated optimizer (optimizer.safetensors); resume "
                                 "it with --shard_optimizer=false --offload_optimizer=false"
                               : "no optimizer-*-of-*.safetensors files");
    sharded_->LoadState(shards);
  } else {
    TORCH_CHECK(has_replicated, "optimizer state in ", directory, ": ",
                !shards.empty()
                    ? "it holds a sharded optimizer (optimizer-*-of-*.safetensors); "
                      "resume it with --shard_optimizer=true or --offload_optimizer=true"
                    : "no optimizer.safetensors");
    replicated_->LoadState((fs::path(directory) / kReplicatedFile).string());
  }
}

}  // namespace dta

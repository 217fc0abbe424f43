#include "executor/distributed/training_optimizer.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

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

// One optimizer over one set of parameters and the data-parallel ranks that hold them: the dense
// parameters over the DP ranks, or under expert parallelism the experts over the EDP ranks.
class TrainingOptimizer::Part {
 public:
  Part(std::vector<std::pair<std::string, at::Tensor>> named, ProcessGroup* group,
       const TrainingLayout& layout, AdamWOptions options, int64_t bucket_bytes,
       TensorParallelNorm tensor_parallel, OffloadUpdate offload_update, int64_t resident_bytes) {
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
                              .resident_elements = resident_bytes / (3 * element_bytes),
                              .tensor_parallel = std::move(tensor_parallel)});
      resident_bytes_ = sharded_->resident_elements() * 3 * element_bytes;
      return;
    }
    replicated_ = std::make_unique<AdamW>(named, options, std::move(tensor_parallel));
    if (group != nullptr) {
      all_reduce_ = std::make_unique<GradientSynchronizer>(
          *group, std::move(named), GradientSynchronizerOptions{.bucket_bytes = bucket_bytes});
    }
  }

  const ShardedAdamW* sharded() const { return sharded_.get(); }
  // The bytes of offloaded state this part keeps on the GPU.
  int64_t resident_bytes() const { return resident_bytes_; }

  void ZeroGrad() {
    if (sharded_) {
      sharded_->ZeroGrad();
    } else {
      replicated_->ZeroGrad();
    }
  }

  void SyncGradients() {
    if (sharded_) {
      sharded_->ReduceGradients();
    } else if (all_reduce_) {
      all_reduce_->SyncGradients();
    }
  }

  StepStats Step(NonFiniteGradients on_nonfinite) {
    return sharded_ ? sharded_->Step(on_nonfinite) : replicated_->Step(on_nonfinite);
  }
  // The squares of the gradients this rank owns for the global norm: its slice when sharded; all
  // of them on rank 0 of the group when replicated (every rank of the group holds the same sums).
  double OwnedGradSquares() const {
    if (sharded_) return sharded_->GradSquares();
    return rank_ == 0 ? replicated_->GradSquares() : 0.0;
  }
  StepStats StepWithNorm(double grad_norm, NonFiniteGradients on_nonfinite) {
    return sharded_ ? sharded_->StepWithNorm(grad_norm, on_nonfinite)
                    : replicated_->StepWithNorm(grad_norm, on_nonfinite);
  }

  void ResetMasterFromParameters() {
    if (sharded_) {
      sharded_->ResetMasterFromParameters();
    } else {
      replicated_->ResetMasterFromParameters();
    }
  }
  int64_t step() const { return sharded_ ? sharded_->step() : replicated_->step(); }
  const AdamWOptions& options() const {
    return sharded_ ? sharded_->options() : replicated_->options();
  }
  void set_lr(double lr) {
    if (sharded_) {
      sharded_->set_lr(lr);
    } else {
      replicated_->set_lr(lr);
    }
  }

  void SaveState(const std::string& directory) const {
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

  bool HasState(const std::string& directory) const {
    if (sharded_) return !ShardedAdamW::ShardFiles(directory).empty();
    return fs::exists(fs::path(directory) / kReplicatedFile);
  }

  // One file: the replicated state, or one slice.
  void LoadFile(const std::string& path) {
    if (sharded_) {
      sharded_->LoadState({path});
    } else {
      replicated_->LoadState(path);
    }
  }

  void LoadDirectory(const std::string& directory) {
    const bool has_replicated = fs::exists(fs::path(directory) / kReplicatedFile);
    const std::vector<std::string> shards = ShardedAdamW::ShardFiles(directory);
    if (sharded_) {
      TORCH_CHECK(!shards.empty(), "optimizer state in ", directory, ": ",
                  has_replicated
                      ? "it holds a replicated optimizer (optimizer.safetensors); resume "
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

 private:
  int rank_ = 0;
  std::unique_ptr<AdamW> replicated_;
  std::unique_ptr<GradientSynchronizer> all_reduce_;
  std::unique_ptr<ShardedAdamW> sharded_;
  int64_t resident_bytes_ = 0;
};

TrainingOptimizer::TrainingOptimizer(std::vector<std::pair<std::string, at::Tensor>> named,
                                     ProcessGroup* group, const TrainingLayout& layout,
                                     AdamWOptions options, int64_t bucket_bytes,
                                     TensorParallelNorm tensor_parallel,
                                     OffloadUpdate offload_update, ExpertParameters experts)
    : group_(group) {
  const int tp = tensor_parallel.group != nullptr ? tensor_parallel.group->size() : 1;
  TORCH_CHECK(layout.tensor_parallel == tp, "TrainingOptimizer: the layout's tensor parallelism (",
              layout.tensor_parallel, ") differs from the model's (", tp, ")");
  if (tp > 1) {
    char name[32];
    std::snprintf(name, sizeof(name), "tp-%02d-of-%02d", tensor_parallel.group->rank(), tp);
    tensor_parallel_subdirectory_ = name;
  }
  if (experts.expert_data_parallel == nullptr) {
    parts_.push_back(std::make_unique<Part>(std::move(named), group, layout, options, bucket_bytes,
                                            std::move(tensor_parallel), offload_update,
                                            layout.offload_resident_bytes));
    return;
  }
  TORCH_CHECK(group != nullptr,
              "TrainingOptimizer: expert parallelism needs the data-parallel group");
  TORCH_CHECK(experts.expert.size() == named.size(), "TrainingOptimizer: ", experts.expert.size(),
              " expert flags for ", named.size(), " parameters");
  char name[48];
  std::snprintf(name, sizeof(name), "experts/ep-%02d-of-%02d", experts.expert_parallel_rank,
                experts.expert_parallel_size);
  expert_subdirectory_ = name;
  // The parameters and their tensor-parallel replication flags, split into the dense and the
  // experts' (each keeping the optimizer's order).
  std::vector<std::pair<std::string, at::Tensor>> lists[2];
  TensorParallelNorm norms[2];
  for (TensorParallelNorm& norm : norms) norm.group = tensor_parallel.group;
  for (size_t i = 0; i < named.size(); ++i) {
    const int part = experts.expert[i] ? 1 : 0;
    lists[part].push_back(std::move(named[i]));
    if (!tensor_parallel.replicated.empty())
      norms[part].replicated.push_back(tensor_parallel.replicated.at(i));
  }
  TORCH_CHECK(!lists[1].empty(), "TrainingOptimizer: expert parallelism without expert parameters");
  tensor_parallel_ = {.group = tensor_parallel.group};
  device_ = lists[1].front().second.device();
  ProcessGroup* groups[2] = {group, experts.expert_data_parallel};
  // The dense parameters' state stays on the GPU first, the experts' in what is left.
  int64_t resident_left = layout.offload_resident_bytes;
  for (int part = 0; part < 2; ++part) {
    parts_.push_back(std::make_unique<Part>(std::move(lists[part]), groups[part], layout, options,
                                            bucket_bytes, std::move(norms[part]), offload_update,
                                            resident_left));
    resident_left -= parts_.back()->resident_bytes();
  }
}

TrainingOptimizer::~TrainingOptimizer() = default;

void TrainingOptimizer::ZeroGrad() {
  for (const auto& part : parts_) part->ZeroGrad();
}

void TrainingOptimizer::SyncGradients() {
  for (const auto& part : parts_) part->SyncGradients();
}

bool TrainingOptimizer::sharded() const { return parts_.front()->sharded() != nullptr; }

OffloadTimes TrainingOptimizer::offload_times() const {
  OffloadTimes sum;
  for (const auto& part : parts_) {
    if (part->sharded() == nullptr) continue;
    const OffloadTimes& t = part->sharded()->offload_times();
    sum.copy_wait += t.copy_wait;
    sum.update += t.update;
    sum.total += t.total;
  }
  return sum;
}

std::string TrainingOptimizer::DescribeOffload() const {
  const ShardedAdamW* sharded = parts_.front()->sharded();
  if (sharded == nullptr || !sharded->sharding().offload) return "";
  if (sharded->streams_through_device()) {
    int64_t resident = 0;
    for (const auto& part : parts_) resident += part->resident_bytes();
    return absl::StrCat(
        "the offloaded AdamW state streams through the GPU from page-locked host memory",
        resident > 0 ? absl::StrFormat(", but for %.1f GiB that stays on the GPU",
                                       static_cast<double>(resident) / (1 << 30))
                     : "");
  }
  std::string text =
      absl::StrCat("the offloaded AdamW update runs on ", at::get_num_threads(), " host threads");
  if (!sharded->streaming_refused().empty()) {
    absl::StrAppend(
        &text, " (streaming it through the GPU was refused: ", sharded->streaming_refused(), ")");
  }
  return text;
}

StepStats TrainingOptimizer::Step(NonFiniteGradients on_nonfinite) {
  if (schedule_.has_value()) ApplyLr(peak_lr_ * LrFactor(*schedule_, step()));
  const double lr = options().lr;
  StepStats stats;
  if (parts_.size() == 1) {
    stats = parts_.front()->Step(on_nonfinite);
  } else {
    // One global norm over both parts: each element's square is owned by one rank of the world,
    // so the sum over the data-parallel ranks (each holding every expert-data-parallel slice of
    // its experts once over its EP group) and then the tensor-parallel ranks is the whole.
    double owned = 0.0;
    for (const auto& part : parts_) owned += part->OwnedGradSquares();
    const double data_parallel = group_->AllReduceScalars({owned}).front();
    const double norm = std::sqrt(tensor_parallel_.Sum(data_parallel, device_));
    for (const auto& part : parts_) stats = part->StepWithNorm(norm, on_nonfinite);
  }
  stats.lr = lr;
  return stats;
}

void TrainingOptimizer::ResetMasterFromParameters() {
  for (const auto& part : parts_) part->ResetMasterFromParameters();
}

void TrainingOptimizer::set_schedule(const LrSchedule& schedule) {
  const absl::Status valid = ValidateLrSchedule(schedule);
  TORCH_CHECK(valid.ok(), "learning-rate schedule: ", valid.message());
  schedule_ = schedule;
  peak_lr_ = options().lr;
}

int64_t TrainingOptimizer::step() const { return parts_.front()->step(); }

const AdamWOptions& TrainingOptimizer::options() const { return parts_.front()->options(); }

void TrainingOptimizer::set_lr(double lr) {
  ApplyLr(lr);
  peak_lr_ = lr;
}

void TrainingOptimizer::ApplyLr(double lr) {
  for (const auto& part : parts_) part->set_lr(lr);
}

std::string TrainingOptimizer::StateDirectory(const std::string& directory, size_t part) const {
  fs::path path(directory);
  if (part == 1) path /= expert_subdirectory_;
  if (!tensor_parallel_subdirectory_.empty()) path /= tensor_parallel_subdirectory_;
  return path.string();
}

void TrainingOptimizer::SaveState(const std::string& top) const {
  for (size_t part = 0; part < parts_.size(); ++part)
    parts_[part]->SaveState(StateDirectory(top, part));
}

bool TrainingOptimizer::HasState(const std::string& top) const {
  for (size_t part = 0; part < parts_.size(); ++part) {
    if (!parts_[part]->HasState(StateDirectory(top, part))) return false;
  }
  return true;
}

void TrainingOptimizer::LoadState(const std::string& path) {
  if (fs::is_regular_file(path)) {
    TORCH_CHECK(parts_.size() == 1, "optimizer state ", path,
                ": one file holds no experts' state under expert parallelism; give the state "
                "directory");
    parts_.front()->LoadFile(path);
    return;
  }
  // The state of a rank's parts does not reshard across tensor-parallel sizes.
  const std::string saved_tp = TensorParallelStateIn(path);
  TORCH_CHECK(fs::is_directory(StateDirectory(path)) &&
                  (saved_tp.empty() || !tensor_parallel_subdirectory_.empty()),
              "optimizer state in ", path, ": ",
              saved_tp.empty() ? std::string("it was saved without tensor parallelism")
                               : "it was saved with tensor parallelism (" + saved_tp + ")",
              ", and this run ",
              tensor_parallel_subdirectory_.empty() ? std::string("has none")
                                                    : "looks for " + tensor_parallel_subdirectory_,
              ": optimizer state resumes only with the tensor-parallel size it was saved with");
  // Nor do the experts' across expert-parallel sizes (the EDP size may change).
  const fs::path saved_experts = fs::path(path) / "experts";
  const bool has_experts = fs::is_directory(saved_experts);
  if (has_experts || parts_.size() > 1) {
    std::string found;
    std::error_code error;
    for (const auto& entry : fs::directory_iterator(saved_experts, error))
      absl::StrAppend(&found, found.empty() ? "" : ", ", entry.path().filename().string());
    TORCH_CHECK(parts_.size() > 1 && fs::is_directory(fs::path(path) / expert_subdirectory_),
                "optimizer state in ", path, ": ",
                has_experts ? "it was saved with expert parallelism (experts/" + found + ")"
                            : std::string("it was saved without expert parallelism"),
                ", and this run ",
                parts_.size() > 1 ? "looks for " + expert_subdirectory_ : std::string("has none"),
                ": optimizer state resumes only with the expert-parallel size it was saved with");
  }
  for (size_t part = 0; part < parts_.size(); ++part)
    parts_[part]->LoadDirectory(StateDirectory(path, part));
}

}  // namespace dta

// Sends each committed step's weights to rollout engines over a c10d group (AReaL's "xccl" weight
// update; docs/weight_sync.md): world rank 0 hosts a TCPStore, the engines' workers join the group
// through their documented HTTP routes, and rank 0 broadcasts the model's tensors in bf16, in
// buckets, under their Hugging Face names (those the published checkpoint holds). Under tensor or
// expert parallelism each tensor is first gathered whole as the checkpoint export gathers it
// (Decoder::GatherParameter), the ranks that export the model taking part (TakePartInPublish).
//
//   sglang      /init_weights_update_group, /pause_generation {"mode": "retract"},
//               /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache,
//               weight_version} per bucket, /continue_generation, /destroy_weights_update_group
//   areal-vllm  /areal_init_weights_update_group, /areal_pause_generation,
//               /areal_set_update_weight_meta then /areal_update_weights_xccl per bucket,
//               /areal_continue_generation
//
// The group's store keys are laid out as torch's init_custom_process_group (SGLang's and AReaL's)
// lays them out, so a Python worker joining with torch.distributed meets this C++ rank 0: Gloo on
// the CPU, NCCL on a GPU (the model's device).
//
// Every step is bounded: each HTTP request and the group's rendezvous and collectives time out
// after `timeout`. Any failure tears the group down and is returned; the caller then publishes a
// checkpoint and calls ReloadFromDisk, which sends every engine the disk reload and then the
// continue (the engines may have been paused, or hold a mix of two versions' weights). The next
// Publish forms a new group (a fresh name, and a fresh port unless one is set). With a group file,
// a trainer restarted after a crash has the engines destroy the group its predecessor left.
//
//   WeightBroadcaster sync({.engines = *ParseWeightSyncEngines("sglang=http://10.0.0.5:30000*2"),
//                           .address = "10.0.0.1", .device = at::Device(at::kCUDA, 0)});
//   if (!sync.Publish(model, /*policy_version=*/7).ok()) {
//     ... save a checkpoint ...; sync.ReloadFromDisk(model_path, 7);
//   }
//
// Thread safety: one call at a time.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "apps/engines/engine_notifier.h"
#include "executor/distributed/process_group.h"
#include "executor/model/decoder.h"

namespace dta {

struct WeightSyncEngine {
  EngineKind kind = EngineKind::kSglang;  // kSglang or kArealVllm
  std::string url;                        // http(s)://host:port, without a trailing slash
  int workers = 1;                        // the engine's ranks in the group: its tp * pp
};

// "KIND=URL[*WORKERS][,...]" with KIND sglang or areal-vllm, WORKERS >= 1 (default 1).
// INVALID_ARGUMENT naming the entry otherwise; empty: none.
absl::StatusOr<std::vector<WeightSyncEngine>> ParseWeightSyncEngines(std::string_view spec);

// Tensors (their sizes in bytes, in order) packed into buckets of at most `bucket_bytes` each, in
// order, never split: a bucket holds consecutive tensors; one larger than `bucket_bytes` has a
// bucket of its own. Returns each bucket's first index and the end (size + 1 entries, the last
// being sizes.size()); empty sizes give {0}.
std::vector<size_t> PackBuckets(const std::vector<int64_t>& sizes, int64_t bucket_bytes);

struct WeightSyncOptions {
  std::vector<WeightSyncEngine> engines;
  // The address the engines reach rank 0's store at (the store listens on every interface).
  std::string address = "127.0.0.1";
  int port = 0;  // of the store; 0: a free one, chosen at each rendezvous
  int64_t bucket_bytes = int64_t{1} << 30;
  // Each HTTP request, the rendezvous, and each bucket's broadcasts.
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  std::string bearer_token;  // the engines' admin key; empty: no Authorization header
  // Where the model's tensors are: kCPU (Gloo) or a CUDA device with an index (NCCL).
  at::Device device = at::kCPU;
  std::string log_prefix = "dta-trainer";
  // Where the current group's name is kept (a private file, core/base/private_files.h: written once
  // the group forms, removed when it is torn down), so that a WeightBroadcaster started over a file
  // left by one that crashed first asks the SGLang engines to destroy that group. Empty: none.
  std::string group_file;
};

class ParameterGathers;  // weight_sync.cc: every parameter gathered whole, once, in order

class WeightBroadcaster {
 public:
  explicit WeightBroadcaster(WeightSyncOptions options);
  WeightBroadcaster(const WeightBroadcaster&) = delete;
  WeightBroadcaster& operator=(const WeightBroadcaster&) = delete;
  // Tears the group down (asks the engines to destroy theirs, best effort) and waits for the groups
  // of failed syncs to be destroyed.
  ~WeightBroadcaster();

  // Pauses every engine, broadcasts `model`'s weights, continues them; forms the group first when
  // there is none. On world rank 0, rank 0 of the model's tensor- and expert-parallel groups; their
  // other ranks call TakePartInPublish meanwhile: this rank gathers every parameter once, in order,
  // whether the sync succeeds or not. UNAVAILABLE naming the engine or the bucket on any failure,
  // after tearing the group down; the engines may then be paused or hold mixed weights
  // (ReloadFromDisk). A failed gather (the trainer's own group) is thrown, as the export throws it.
  absl::Status Publish(const Decoder& model, int64_t policy_version);

  // Every engine: the disk reload of `model_path` (EngineNotifier's request), then the continue,
  // each bounded by the timeout; failures are logged. For after a failed Publish.
  void ReloadFromDisk(const std::string& model_path, int64_t policy_version);

  bool connected() const { return group_ != nullptr; }

 private:
  absl::Status Connect();
  void Disconnect();
  // Asks the SGLang engines to destroy group `name` (best effort, bounded; AReaL has no route).
  void DestroyEngineGroups(const std::string& name);
  // Destroys the group named in options_.group_file, left by a predecessor that crashed.
  void DestroyPredecessorGroup();
  absl::Status Broadcast(const Decoder& model, ParameterGathers& gathers, int64_t policy_version);

  const WeightSyncOptions options_;
  int world_size_ = 1;                     // 1 + every engine's workers
  std::vector<int> rank_offsets_;          // per engine
  std::string group_name_;                 // of the current group
  c10::intrusive_ptr<c10d::Store> store_;  // the TCPStore rank 0 hosts, while connected
  std::unique_ptr<ProcessGroup> group_;    // null: not connected
  // Groups torn down after a failure, each destroyed on its own thread: torch's watchdog keeps a
  // timed-out NCCL group's destructor waiting for a flight-recorder dump (about a minute), which
  // must not hold up training. Joined by the destructor.
  std::vector<std::thread> retiring_;
};

// On every rank of `model`'s tensor- and expert-parallel groups but the sender's, once per
// WeightBroadcaster::Publish of the sender's: its part of the gathers (every parameter, in order,
// discarded). Throws what a gather throws.
void TakePartInPublish(const Decoder& model);

}  // namespace dta

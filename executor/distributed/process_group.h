// Data-parallel process groups: one process per GPU, started by a launcher (torchrun or the
// trainer daemon's) that exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
//
// A ProcessGroup owns a c10d store and one c10d backend: Gloo for CPU tensors, NCCL for CUDA
// tensors. On the launcher path rank 0 hosts a c10d::TCPStore at MASTER_ADDR:MASTER_PORT and every
// rank connects to it; tests (and anything else that runs several ranks in one process) pass a
// store they share instead, e.g. a c10d::HashStore. Environment variables the backends read
// themselves (GLOO_SOCKET_IFNAME, TORCH_GLOO_LAZY_INIT, TORCH_NCCL_*, NCCL_*, NCCL_NVLS_ENABLE
// included) are passed through untouched: nothing here sets or clears one.
//
// Collectives are matched across ranks by their order: every rank must make the same calls on its
// group in the same order. A collective that fails or outlives the group's timeout raises
// c10::Error naming the rank and the operation; after that the group is unusable (other ranks may
// be stuck in the same collective until their own timeout) and the trainer should exit and be
// restarted by its launcher.
//
// Errors: absl::Status from the factories (the seam with the launcher), c10::Error (TORCH_CHECK)
// from everything after, as in the rest of executor/.
// Thread safety: none; one call at a time per group. Distinct groups may be used from different
// threads at once only with c10d's flight recorder off (TORCH_FR_BUFFER_SIZE=0, as the tests set
// it): in torch 2.11 it updates a process-wide map outside its lock at a group's first collective.
//
// Example:
//   absl::StatusOr<LaunchEnvironment> env = LaunchEnvironmentFromEnv();
//   if (!env.ok()) return env.status();
//   absl::StatusOr<std::unique_ptr<ProcessGroup>> group =
//       ProcessGroup::Create(*env, at::Device(at::kCUDA, env->local_rank));
//   if (!group.ok()) return group.status();
//   std::vector<double> totals = (*group)->AllReduceScalars({loss_sum, token_count});
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace dta {

// The launcher's view of this process, as torchrun exports it.
struct LaunchEnvironment {
  int rank = 0;                           // RANK: 0 <= rank < world_size
  int world_size = 1;                     // WORLD_SIZE: >= 1
  int local_rank = 0;                     // LOCAL_RANK: GPU index on this host, in [0, world_size)
  std::string master_addr = "127.0.0.1";  // MASTER_ADDR: host of rank 0's TCPStore, non-empty
  int master_port = 29500;                // MASTER_PORT: 1..65535
  // TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent already hosts the TCPStore at
  // MASTER_ADDR:MASTER_PORT, so every rank (rank 0 included) connects to it as a client.
  bool agent_store = false;
  // TORCHELASTIC_RESTART_COUNT: which attempt of an elastic run this is (>= 0). The agent's store
  // outlives a restart, so each attempt's keys are prefixed with "attempt_<n>/": a restarted rank
  // must not read the previous attempt's Gloo addresses (it would dial a dead process).
  int restart_count = 0;
};

// Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE and
// TORCHELASTIC_RESTART_COUNT. A variable that is unset (or set to the empty string) takes the
// default above, so with none set this is the single-process environment {0, 1, 0, "127.0.0.1",
// 29500, no agent store, attempt 0}. INVALID_ARGUMENT naming the variable and its value
// when a value is not a decimal integer or is out of the range given above (RANK >= WORLD_SIZE
// included).
absl::StatusOr<LaunchEnvironment> LaunchEnvironmentFromEnv();

struct ProcessGroupOptions {
  // The one timeout of the group: connecting to the store, the backend's rendezvous, and every
  // blocking wait on a collective (GradientSynchronizer's included). Must be > 0.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
  // Every store key of the group is prefixed with "<group_name>/", so groups sharing a store need
  // distinct names. Also the backend's group uid (NCCL's logs and flight recorder show it).
  std::string group_name = "dta";
  // Gloo only: the host name or address the Gloo transport binds to and advertises. Empty: the
  // interfaces listed in GLOO_SOCKET_IFNAME (comma-separated) when it is set, else this host's name
  // resolved (falling back to the loopback address), as torch.distributed chooses.
  std::string gloo_hostname;
  // Gloo only: worker threads running the collectives (torch's default). Must be >= 1.
  int gloo_threads = 2;
  // NCCL only: run the collectives on a high-priority CUDA stream.
  bool nccl_high_priority_stream = false;
  // NCCL only: the other ranks are other programs (inference engines joining a weight-update
  // group) that may die or stop answering, and neither may hang or end this process. The
  // communicator then forms without blocking, so that its formation and each collective's launch
  // give up after TORCH_NCCL_NONBLOCKING_TIMEOUT seconds (set to `timeout` when the environment
  // leaves it unset; torch reads it once per process, and only non-blocking communicators use it),
  // and a collective that fails or times out makes NCCL's watchdog abort the group's communicators
  // instead of ending the process (torch's CleanUpOnly error handling, for this group only). Wait()
  // then fails; destroy the group after any failure. Off for the trainer's own groups: a lost
  // trainer rank should end the job, so that its launcher restarts it.
  bool peers_may_fail = false;
};

class ProcessGroup {
 public:
  // The launcher path. With world_size 1 the store is an in-process HashStore (no port is bound).
  // Otherwise rank 0 hosts a TCPStore on env.master_port and waits for the other ranks to
  // connect; they connect to env.master_addr:env.master_port, retrying until options.timeout
  // (under torchrun's agent store every rank connects, none hosts). The group's keys live under
  // "attempt_<env.restart_count>/". Then as CreateWithStore. INVALID_ARGUMENT for an environment
  // outside LaunchEnvironment's ranges or a bad device or option; UNAVAILABLE (retry, e.g. after
  // the launcher restarts the job) when the store or the rendezvous fails or times out, with c10d's
  // message and this rank.
  static absl::StatusOr<std::unique_ptr<ProcessGroup>> Create(
      const LaunchEnvironment& env, at::Device device, const ProcessGroupOptions& options = {});

  // Builds the backend over an existing store that every rank of the group shares (its keys are
  // prefixed with "<options.group_name>/"). `device`: kCPU selects Gloo; kCUDA with an index
  // selects NCCL on that GPU. Blocks until all `size` ranks have joined (Gloo connects a full mesh
  // now; NCCL creates its communicator at the first collective). INVALID_ARGUMENT for rank outside
  // [0, size), a null store, a timeout <= 0, gloo_threads < 1, or another device type or a CUDA
  // device without an index; FAILED_PRECONDITION for a CUDA device when this build has no NCCL;
  // UNAVAILABLE when the backend cannot be created (rendezvous failure or timeout; NCCL: no GPU).
  static absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateWithStore(
      c10::intrusive_ptr<c10d::Store> store, int rank, int size, at::Device device,
      const ProcessGroupOptions& options = {});

  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;
  // Shuts the backend down (NCCL: destroys its communicators) and releases the store. Warns
  // (TORCH_WARN) on failure, never throws.
  ~ProcessGroup();

  int rank() const { return rank_; }
  int size() const { return size_; }
  // CPU for Gloo, the GPU for NCCL: where collective buffers live.
  at::Device device() const { return device_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // "gloo" or "nccl".
  std::string backend_name() const;
  // For collectives not wrapped here. Owned by this object; valid while it lives.
  const c10::intrusive_ptr<c10d::Backend>& backend() const { return backend_; }
  // The group's (prefixed) store.
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  // Waits for `work` up to timeout(). TORCH_CHECK naming this rank and `what` (e.g. "all-reduce of
  // gradient bucket 3 of 7 (...)") when the collective failed, was aborted or timed out.
  void Wait(c10d::Work& work, std::string_view what) const;
  // For collectives inside a computation: on NCCL the current CUDA stream waits for `work` and the
  // host does not (a hang surfaces through NCCL's watchdog after timeout()); on Gloo, Wait().
  // TORCH_CHECK naming this rank and `what` when the collective failed.
  void WaitStreamOrdered(c10d::Work& work, std::string_view what) const;

  // The element-wise sum over the ranks of `values` (every rank passes as many), in float64:
  // small statistics such as loss sums and token counts. Empty in, empty out (no collective).
  // TORCH_CHECK naming the rank on failure or timeout.
  std::vector<double> AllReduceScalars(const std::vector<double>& values);

  // Returns once every rank has entered Barrier() (a one-element all-reduce, read back on the host
  // so that this rank's earlier CUDA work has finished too). TORCH_CHECK naming the rank on failure
  // or timeout.
  void Barrier();

 private:
  ProcessGroup(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Backend> backend,
               int rank, int size, at::Device device, std::chrono::milliseconds timeout);

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  int rank_;
  int size_;
  at::Device device_;
  std::chrono::milliseconds timeout_;
};

}  // namespace dta

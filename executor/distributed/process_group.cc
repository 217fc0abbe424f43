#include "executor/distributed/process_group.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>
#include <cstdlib>
#include <exception>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "executor/distributed/c10d_backends.h"

namespace dta {
namespace {

// The value of `name`, or nullptr when it is unset or empty (both mean "use the default").
const char* GetEnv(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

// Parses `name` into `out` when it is set; `out` keeps its default otherwise. `range` says
// [min, max] in words for the message.
absl::Status ReadIntEnv(const char* name, int min, int max, const std::string& range, int& out) {
  const char* value = GetEnv(name);
  if (value == nullptr) return absl::OkStatus();
  int parsed = 0;
  if (!absl::SimpleAtoi(value, &parsed)) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", name, "='", value, "' is not a decimal integer"));
  }
  if (parsed < min || parsed > max) {
    return absl::InvalidArgumentError(absl::StrCat("environment variable ", name, "='", value,
                                                   "' is out of range: must be ", range));
  }
  out = parsed;
  return absl::OkStatus();
}

absl::Status ValidateEnvironment(const LaunchEnvironment& env) {
  if (env.world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world size ", env.world_size, " must be >= 1"));
  }
  if (env.rank < 0 || env.rank >= env.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", env.rank, " is out of range [0, ", env.world_size, ")"));
  }
  if (env.local_rank < 0 || env.local_rank >= env.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("local rank ", env.local_rank, " is out of range [0, ", env.world_size, ")"));
  }
  if (env.master_addr.empty()) return absl::InvalidArgumentError("master address is empty");
  if (env.master_port < 1 || env.master_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("master port ", env.master_port, " is out of range [1, 65535]"));
  }
  return absl::OkStatus();
}

absl::Status ValidateTimeout(const ProcessGroupOptions& options) {
  if (options.timeout.count() > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("process group timeout must be > 0, got ", options.timeout.count(), " ms"));
}

// c10d's message without the C++ backtrace c10::Error appends.
std::string ErrorText(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return error->what_without_backtrace();
  }
  return e.what();
}

}  // namespace

absl::StatusOr<LaunchEnvironment> LaunchEnvironmentFromEnv() {
  LaunchEnvironment env;
  constexpr int kMaxInt = std::numeric_limits<int>::max();
  absl::Status status = ReadIntEnv("WORLD_SIZE", 1, kMaxInt, ">= 1", env.world_size);
  if (!status.ok()) return status;
  const std::string below_world = absl::StrCat("in [0, WORLD_SIZE=", env.world_size, ")");
  status = ReadIntEnv("RANK", 0, env.world_size - 1, below_world, env.rank);
  if (!status.ok()) return status;
  status = ReadIntEnv("LOCAL_RANK", 0, env.world_size - 1, below_world, env.local_rank);
  if (!status.ok()) return status;
  status = ReadIntEnv("MASTER_PORT", 1, 65535, "in [1, 65535]", env.master_port);
  if (!status.ok()) return status;
  if (const char* addr = GetEnv("MASTER_ADDR")) env.master_addr = addr;
  if (const char* agent_store = GetEnv("TORCHELASTIC_USE_AGENT_STORE")) {
    // torch.distributed's own test of the variable (rendezvous.py): exactly "True".
    env.agent_store = std::string_view(agent_store) == "True";
  }
  status = ReadIntEnv("TORCHELASTIC_RESTART_COUNT", 0, kMaxInt, ">= 0", env.restart_count);
  if (!status.ok()) return status;
  return env;
}

ProcessGroup::ProcessGroup(c10::intrusive_ptr<c10d::Store> store,
                           c10::intrusive_ptr<c10d::Backend> backend, int rank, int size,
                           at::Device device, std::chrono::milliseconds timeout)
    : store_(std::move(store)),
      backend_(std::move(backend)),
      rank_(rank),
      size_(size),
      device_(device),
      timeout_(timeout) {}

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::Create(
    const LaunchEnvironment& env, at::Device device, const ProcessGroupOptions& options) {
  RETURN_IF_ERROR(ValidateEnvironment(env));
  RETURN_IF_ERROR(ValidateTimeout(options));
  c10::intrusive_ptr<c10d::Store> store;
  if (env.world_size == 1) {
    // Nobody to meet, so no port to bind (MASTER_PORT may be taken by another job on this host).
    store = c10::make_intrusive<c10d::HashStore>();
  } else {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(env.master_port);
    store_options.isServer = env.rank == 0 && !env.agent_store;
    store_options.numWorkers = env.world_size;
    // Our own store counts its clients in; the agent's outlives attempts, so its count would not
    // mean this attempt's ranks (Gloo's rendezvous waits for every rank's address anyway).
    store_options.waitWorkers = !env.agent_store;
    store_options.timeout = options.timeout;
    try {
      store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat(
          "rank ", env.rank, " of ", env.world_size, ": cannot ",
          store_options.isServer ? "host" : "connect to", " the TCPStore at ", env.master_addr, ":",
          env.master_port, " within ", options.timeout.count(), " ms: ", ErrorText(e)));
    }
  }
  store = c10::make_intrusive<c10d::PrefixStore>(absl::StrCat("attempt_", env.restart_count),
                                                 std::move(store));
  return CreateWithStore(std::move(store), env.rank, env.world_size, device, options);
}

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::CreateWithStore(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size, at::Device device,
    const ProcessGroupOptions& options) {
  if (!store) return absl::InvalidArgumentError("process group store is null");
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is out of range [0, ", size, ") (world size must be >= 1)"));
  }
  RETURN_IF_ERROR(ValidateTimeout(options));
  if (options.gloo_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("gloo_threads must be >= 1, got ", options.gloo_threads));
  }
  const bool cuda = device.is_cuda();
  if (!cuda && !device.is_cpu()) {
    return absl::InvalidArgumentError(
        absl::StrCat("process groups run on CPU (Gloo) or CUDA (NCCL), not ", device.str()));
  }
  if (cuda && !device.has_index()) {
    return absl::InvalidArgumentError(
        "a CUDA process group needs a device index (cuda:LOCAL_RANK)");
  }
  if (cuda && !internal::HaveNccl()) {
    return absl::FailedPreconditionError(
        "this build of dta::distributed has no NCCL, so it cannot make a CUDA process group");
  }

  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(options.group_name, std::move(store));
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = cuda ? internal::MakeNcclBackend(prefixed, rank, size, device, options)
                   : internal::MakeGlooBackend(prefixed, rank, size, options);
    backend->setGroupUid(options.group_name);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", rank, " of ", size, ": cannot create the ",
                                               cuda ? "NCCL" : "Gloo", " process group '",
                                               options.group_name, "': ", ErrorText(e)));
  }
  return std::unique_ptr<ProcessGroup>(new ProcessGroup(std::move(prefixed), std::move(backend),
                                                        rank, size, device, options.timeout));
}

ProcessGroup::~ProcessGroup() {
  try {
    backend_->shutdown();
  } catch (const std::exception& e) {
    TORCH_WARN("rank ", rank_, " of ", size_, ": shutting down the ", backend_->getBackendName(),
               " process group failed: ", ErrorText(e));
  }
}

std::string ProcessGroup::backend_name() const { return backend_->getBackendName(); }

void ProcessGroup::Wait(c10d::Work& work, std::string_view what) const {
  bool completed = false;
  try {
    completed = work.wait(timeout_);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", rank_, " of ", size_, ": ", what, " failed or timed out (timeout ",
                timeout_.count(), " ms): ", ErrorText(e));
  }
  TORCH_CHECK(completed, "rank ", rank_, " of ", size_, ": ", what, " was aborted");
}

void ProcessGroup::WaitStreamOrdered(c10d::Work& work, std::string_view what) const {
  if (!device_.is_cuda()) return Wait(work, what);
  try {
    // Without a timeout WorkNCCL::wait only makes the current stream wait (with one it would
    // block the host until the collective finished).
    work.wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", rank_, " of ", size_, ": ", what, " failed: ", ErrorText(e));
  }
}

std::vector<double> ProcessGroup::AllReduceScalars(const std::vector<double>& values) {
  if (values.empty()) return {};
  at::Tensor sums =
      at::tensor(at::ArrayRef<double>(values), at::TensorOptions().dtype(at::kDouble)).to(device_);
  std::vector<at::Tensor> tensors = {sums};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  options.timeout = timeout_;
  c10::intrusive_ptr<c10d::Work> work = backend_->allreduce(tensors, options);
  Wait(*work, absl::StrCat("all-reduce of ", values.size(), " scalars"));
  at::Tensor host = sums.cpu();
  const double* data = host.data_ptr<double>();
  return std::vector<double>(data, data + values.size());
}

void ProcessGroup::Barrier() {
  std::vector<at::Tensor> tensors = {
      at::ones({1}, at::TensorOptions().dtype(at::kInt).device(device_))};
  c10d::AllreduceOptions options;
  options.timeout = timeout_;
  c10::intrusive_ptr<c10d::Work> work = backend_->allreduce(tensors, options);
  Wait(*work, "barrier");
  const int arrived = tensors[0].item<int>();  // reading it back waits for the device too
  TORCH_CHECK(arrived == size_, "rank ", rank_, " of ", size_, ": barrier counted ", arrived,
              " ranks");
}

}  // namespace dta

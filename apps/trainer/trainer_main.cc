// dta-trainer: the trainer daemon. One process per GPU (or CPU rank), started by a launcher with
// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (torchrun exports them):
//
//   torchrun --nproc_per_node=8 --max-restarts=100 --no-python dta-trainer --tensor_parallel=2
//       --dispatcher=host:50051 --token_file=token --checkpoint_dir=/shared/ckpt
//       --model=/models/Qwen3-8B --dtype=bfloat16 --device=cuda --loss=grpo --lr=1e-6
//
// Each step: fetch this rank's partition from the dispatcher, compute its gradients with the
// executor (dta by default) under the whole batch's normalisers, sum them over the ranks in buckets
// (NCCL on GPUs, Gloo on CPUs), report PREPARED, and step the optimizer only when the dispatcher
// answers COMMIT (every rank prepared, durably logged). Every --save_every committed steps, after
// the last step and on request (`kill -USR1` of any rank saves after the step in progress commits)
// the ranks save a checkpoint together: Hugging Face weights for rollout workers, plus each rank's
// optimizer state.
//
// Layout: rank 0 prints the one planned from the model, the world size and the GPU's memory
// (core/layout). --tensor_parallel=T splits each replica's weights across T consecutive ranks (one
// node's GPUs under torchrun); the dispatcher sees K = world size / T ranks: each replica's TP rank
// 0 registers as rank d of K and relays every partition and decision to its TP peers
// (apps/trainer/replica_session.h). With several replicas AdamW's state is sharded across them
// (ZeRO-1: gradients reduce-scattered, each rank updates its slice, weights all-gathered, each rank
// saving its slice into the checkpoint); it is offloaded to host memory when it does not fit on the
// GPU otherwise. The executor's memory is estimated from the executor flags for rollouts of up to
// --longest_rollout tokens (8192 unless given: the batches are not known at start).
// --shard_optimizer, --offload_optimizer, --gpu_memory_gb and --activation_gb override the plan;
// a sharded checkpoint resumes on any number of replicas, with the TP size it was saved with.
//
// Faults: when a collective fails (another rank died) or the dispatcher answers ABORT, the trainer
// reports the step FAILED and exits with status 75, asking its launcher to restart the group.
// A (re)started trainer loads the newest checkpoint and registers with its step: the dispatcher
// serves the committed steps since then again, so the group retrains exactly the committed
// batches, and no acknowledged trajectory is lost or trained twice.
//
// Exit status: 0 after --max_steps steps, 2 on bad input, 75 to be restarted, 1 on other errors.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "apps/engines/engine_notifier.h"
#include "apps/engines/weight_sync.h"
#include "apps/metrics/metrics_flags.h"
#include "apps/train/training_flags.h"
#include "apps/trainer/checkpoints.h"
#include "apps/trainer/replica_session.h"
#include "apps/trainer/trainer_loop.h"
#include "apps/trainer/trainer_metrics.h"
#include "core/base/exit_codes.h"
#include "core/base/private_files.h"
#include "core/cli/usage.h"
#include "dispatcher/client/trainer_session.h"
#include "executor/checkpoint/training_checkpoint.h"
#include "executor/distributed/parallel_groups.h"
#include "executor/distributed/process_group.h"
#include "executor/distributed/training_optimizer.h"
#include "executor/engine/executor.h"

ABSL_FLAG(std::string, dispatcher, "127.0.0.1:50051", "the dispatcher's host:port");
ABSL_FLAG(std::string, token_file, "",
          "file holding the trainer token (dta-dispatcher's --trainer_token_file, or the file it "
          "created beside its log and named at start)");
ABSL_FLAG(std::string, tls_roots, "", "PEM root certificates to trust (TLS to the dispatcher)");
ABSL_FLAG(std::string, checkpoint_dir, "", "checkpoints (shared by the ranks); required");
ABSL_FLAG(int64_t, save_every, 1, "save a checkpoint every this many committed steps (rank 0)");
ABSL_FLAG(int32_t, keep_checkpoints, 2, "checkpoints kept");
ABSL_FLAG(bool, publish_weight_delta, false,
          "each checkpoint also publishes model/delta-from-<M>.{safetensors,json}: the weights' "
          "elements changed since the previous checkpoint M (rank 0; see docs/weight_sync.md)");
ABSL_FLAG(int64_t, max_steps, 0,
          "stop after this many committed steps in all (0: run until stopped)");
ABSL_FLAG(int32_t, timeout_s, 600,
          "timeout of collectives and of the process group's rendezvous, seconds");
ABSL_FLAG(int64_t, bucket_mb, 25,
          "gradient all-reduce (or reduce-scatter and all-gather, when sharded) bucket size, MiB");
ABSL_FLAG(int32_t, wait_s, 86400,
          "how long to wait for a batch, or for an unreachable dispatcher, seconds");
ABSL_FLAG(std::string, notify_engines, "",
          "rollout engines to reload each published checkpoint (rank 0, in the background): "
          "KIND=URL[,KIND=URL...], KIND sglang (POST /update_weights_from_disk), vllm (POST "
          "/collective_rpc reload_weights; VLLM_SERVER_DEV_MODE=1) or areal-vllm (POST "
          "/areal_update_weights)");
ABSL_FLAG(std::string, notify_token_file, "",
          "file holding the bearer token the engines expect (SGLang's --api-key or "
          "--admin-api-key)");
ABSL_FLAG(int32_t, notify_attempts, 3, "attempts per engine and checkpoint (1 s apart)");
ABSL_FLAG(int32_t, notify_timeout_s, 30,
          "timeout of one reload request, the engine's load included, seconds (raise it for models "
          "that load slower); at exit the trainer waits at most this long for reloads in flight");
ABSL_FLAG(std::string, weight_sync, "disk",
          "how engines get each committed step's weights: disk (--notify_engines reload the "
          "published checkpoints) or xccl (rank 0 broadcasts them over a c10d group to "
          "--weight_sync_engines, falling back to a checkpoint and its disk reload on failure; "
          "under tensor or expert parallelism the first replica's ranks gather them for it, as "
          "for a checkpoint)");
ABSL_FLAG(int64_t, weight_sync_every, 1,
          "the engines get only the policy versions that are multiples of this (>= 1): xccl syncs "
          "those steps' weights, and --notify_engines are told of those checkpoints only");
ABSL_FLAG(std::string, weight_sync_engines, "",
          "--weight_sync=xccl: KIND=URL[*WORKERS][,...], KIND sglang or areal-vllm, WORKERS the "
          "engine's ranks in the group (its tp * pp, default 1)");
ABSL_FLAG(std::string, weight_sync_address, "127.0.0.1",
          "--weight_sync=xccl: the address the engines reach rank 0's store at");
ABSL_FLAG(int32_t, weight_sync_port, 0,
          "--weight_sync=xccl: the store's port (0: a free one at each rendezvous)");
ABSL_FLAG(int32_t, weight_sync_timeout_s, 120,
          "--weight_sync=xccl: bound on each engine request, the rendezvous and each bucket, "
          "seconds");
ABSL_FLAG(double, weight_sync_bucket_mb, 1024,
          "--weight_sync=xccl: bf16 bytes per broadcast bucket, MiB (fractions allowed; a larger "
          "tensor goes alone)");
ABSL_FLAG(int32_t, slow_step_ms, 0,
          "testing: sleep this long before the all-reduce (fault-injection tests)");

namespace dta {
namespace {

// Set by SIGUSR1: save a checkpoint once the step in progress commits (lock-free, so the handler
// may touch it; taken with one exchange, so a signal arriving meanwhile is never lost).
std::atomic<bool> checkpoint_requested{false};
static_assert(std::atomic<bool>::is_always_lock_free);
extern "C" void RequestCheckpoint(int) { checkpoint_requested.store(true); }

// The contents of a credential flag's file, or "" when the flag is empty. A secret (a token) must
// be a private file of this user's (core/base/private_files.h); certificates are public.
enum class Credential { kSecret, kCertificates };
std::string CredentialFromFlag(const std::string& path, const char* flag, Credential kind) {
  if (path.empty()) return "";
  absl::StatusOr<std::string> contents = kind == Credential::kSecret
                                             ? ReadPrivateFile(path, /*trim=*/true)
                                             : ReadCredentialFile(path, /*trim=*/false);
  if (!contents.ok()) throw BadInput{absl::StrCat("--", flag, ": ", contents.status().message())};
  return *std::move(contents);
}

std::string TrainerId() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return absl::StrCat(host, ":", getpid(), ":",
                      std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count());
}

// True on every rank when the ranks that registered with the dispatcher (`generation` set on
// those, `registered` of them) hold one generation. Per 8-bit piece c of the generation,
// n sum(c^2) == (sum c)^2 over the n registered ranks exactly when their pieces are equal
// (Cauchy-Schwarz), and every rank computes both sums: one verdict everywhere, exact in float64
// below 2^18 registered ranks.
bool RegisteredInOneGeneration(ProcessGroup& world, std::optional<int64_t> generation,
                               int64_t registered) {
  constexpr int kPieces = 8;
  std::vector<double> sums(2 * kPieces, 0.0);
  if (generation.has_value()) {
    const auto bits = static_cast<uint64_t>(*generation);
    for (int i = 0; i < kPieces; ++i) {
      const double piece = static_cast<double>((bits >> (8 * i)) & 0xff);
      sums[2 * i] = piece;
      sums[2 * i + 1] = piece * piece;
    }
  }
  sums = world.AllReduceScalars(sums);
  for (int i = 0; i < kPieces; ++i) {
    if (static_cast<double>(registered) * sums[2 * i + 1] != sums[2 * i] * sums[2 * i]) {
      return false;
    }
  }
  return true;
}

int Run() {
  struct sigaction on_request = {};
  on_request.sa_handler = RequestCheckpoint;
  on_request.sa_flags = SA_RESTART;  // the signal must not fail a read or a collective in progress
  sigaction(SIGUSR1, &on_request, nullptr);
  // A file-size limit (ulimit -f) would kill the trainer mid-checkpoint with SIGXFSZ and no word;
  // ignored, the write fails with EFBIG and the trainer exits 1 naming the file and the reason, as
  // on a full disk.
  std::signal(SIGXFSZ, SIG_IGN);
  const std::string checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  if (checkpoint_dir.empty()) throw BadInput{"--checkpoint_dir is required"};
  // The checkpoints are what a restart resumes from and what rollout engines load (latest.json):
  // a directory another user created first, or one others can write, could hand both forged
  // weights, so it must be this user's and closed to others' writes (core/base/private_files.h).
  if (absl::Status owned = MakeOwnedDirectory(checkpoint_dir); !owned.ok())
    throw BadInput{absl::StrCat("--checkpoint_dir: ", owned.message())};
  if (absl::GetFlag(FLAGS_save_every) < 1) throw BadInput{"--save_every must be >= 1"};
  absl::StatusOr<LaunchEnvironment> env = LaunchEnvironmentFromEnv();
  if (!env.ok()) throw BadInput{std::string(env.status().message())};
  const LossOptions loss = LossFromFlags();
  const ExecutorOptions executor = ExecutorFromFlags();
  const ProgressMode progress = ProgressFromFlags();
  const NonFiniteGradients nonfinite_gradients = NonFiniteGradientsFromFlags();
  const ModelExportOptions model_export = ModelExportFromFlags();
  const LrSchedule schedule = LrScheduleFromFlags(absl::GetFlag(FLAGS_max_steps));
  absl::StatusOr<std::vector<EngineEndpoint>> engines =
      ParseEngineEndpoints(absl::GetFlag(FLAGS_notify_engines));
  if (!engines.ok()) throw BadInput{absl::StrCat("--notify_engines: ", engines.status().message())};
  if (absl::GetFlag(FLAGS_notify_attempts) < 1) throw BadInput{"--notify_attempts must be >= 1"};
  if (absl::GetFlag(FLAGS_notify_timeout_s) < 1) throw BadInput{"--notify_timeout_s must be >= 1"};
  const std::string notify_token = CredentialFromFlag(absl::GetFlag(FLAGS_notify_token_file),
                                                      "notify_token_file", Credential::kSecret);
  const std::string weight_sync_mode = absl::GetFlag(FLAGS_weight_sync);
  if (weight_sync_mode != "disk" && weight_sync_mode != "xccl") {
    throw BadInput{
        absl::StrCat("--weight_sync must be disk or xccl, not '", weight_sync_mode, "'")};
  }
  absl::StatusOr<std::vector<WeightSyncEngine>> sync_engines =
      ParseWeightSyncEngines(absl::GetFlag(FLAGS_weight_sync_engines));
  if (!sync_engines.ok()) {
    throw BadInput{absl::StrCat("--weight_sync_engines: ", sync_engines.status().message())};
  }
  if (weight_sync_mode == "xccl" && sync_engines->empty()) {
    throw BadInput{"--weight_sync=xccl needs --weight_sync_engines"};
  }
  const int64_t sync_every = absl::GetFlag(FLAGS_weight_sync_every);
  if (sync_every < 1) {
    throw BadInput{absl::StrCat("--weight_sync_every must be >= 1, not ", sync_every)};
  }
  // Whether the engines get the weights of `policy_version`: the same answer on every rank.
  const auto engines_get = [sync_every](int64_t policy_version) {
    return policy_version % sync_every == 0;
  };
  if (absl::GetFlag(FLAGS_weight_sync_timeout_s) < 1 ||
      !(absl::GetFlag(FLAGS_weight_sync_bucket_mb) * (1 << 20) >= 1) ||
      absl::GetFlag(FLAGS_weight_sync_port) < 0 || absl::GetFlag(FLAGS_weight_sync_port) > 65535) {
    throw BadInput{
        "--weight_sync_timeout_s must be >= 1, --weight_sync_bucket_mb at least a byte, "
        "--weight_sync_port in [0, 65535]"};
  }
  at::TensorOptions options = TensorOptionsFromFlags();
  if (options.device().is_cuda() && !options.device().has_index()) {
    options = options.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(env->local_rank)));
  }
  const std::string prefix = absl::StrFormat("dta-trainer rank %d/%d", env->rank, env->world_size);
  // Which process and which of the launcher's attempts (torchrun --max_restarts) this is.
  std::fprintf(stderr, "%s: started, pid %d, attempt %d\n", prefix.c_str(),
               static_cast<int>(getpid()), env->restart_count);
  // Metrics: this rank's /metrics (on --metrics_listen's port + LOCAL_RANK) and event files.
  TrainerMetrics metrics(env->rank, env->restart_count);
  absl::StatusOr<std::unique_ptr<MetricsServer>> metrics_server = MetricsServerFromFlags(
      prefix, [&metrics] { return metrics.Prometheus(); }, env->local_rank);
  if (!metrics_server.ok()) throw BadInput{std::string(metrics_server.status().message())};
  absl::StatusOr<std::unique_ptr<TensorBoardWriter>> tensorboard =
      TensorBoardFromFlags(absl::StrCat("rank-", env->rank));
  if (!tensorboard.ok()) throw BadInput{std::string(tensorboard.status().message())};

  // The layout first: tensor parallelism decides which ranks talk to the dispatcher and which part
  // of the model each rank builds.
  const ModelConfig config = ConfigFromFlags();
  const LayoutPlan layout = LayoutFromFlags(config, env->world_size, options.device());
  const int tensor_parallel = layout.layout.tensor_parallel;
  const int tensor_parallel_rank = env->rank % tensor_parallel;
  const int replica = env->rank / tensor_parallel;
  const int replicas = env->world_size / tensor_parallel;
  // Under tensor or expert parallelism rank 0's peers wait in a gather while it talks to the
  // engines: up to about 4 engine timeouts (the rendezvous, the pause, a bucket's requests).
  if (weight_sync_mode == "xccl" && (tensor_parallel > 1 || layout.layout.expert_parallel > 1) &&
      absl::GetFlag(FLAGS_timeout_s) < 4 * int64_t{absl::GetFlag(FLAGS_weight_sync_timeout_s)}) {
    throw BadInput{
        "--weight_sync=xccl under tensor or expert parallelism needs --timeout_s >= 4 x "
        "--weight_sync_timeout_s (rank 0's peers wait in the weights' gathers while it syncs)"};
  }
  if (env->rank == 0)
    std::fprintf(stderr, "%s: %s\n", prefix.c_str(), DescribeLayout(layout).c_str());
  // The weights and the optimizer are restored once the group exists (a sharded optimizer's
  // restore is a collective); the step is known now, for registering.
  const std::optional<CheckpointInfo> latest = LatestCheckpoint(checkpoint_dir);
  const int64_t step = latest.has_value() ? latest->step : 0;

  // Each replica's TP rank 0 registers as the dispatcher's rank `replica` of `replicas`; its TP
  // peers follow it (apps/trainer/replica_session.h).
  std::unique_ptr<TrainerSession> session;
  ClientOptions client_options;
  const TrainerIdentity identity = {.rank = replica,
                                    .world_size = replicas,
                                    .device = options.device().str(),
                                    .resume_step = step,
                                    .trainer_id = TrainerId(),
                                    .vocab_size = config.vocab_size,
                                    .needs_ref_logprobs = loss.kl_coef != 0,
                                    .needs_advantages = loss.kind != LossKind::kSft,
                                    .routing = RoutingShapeOf(config)};
  // Registers (again: the same identity) and says so.
  const auto register_with_dispatcher = [&] {
    absl::StatusOr<std::unique_ptr<TrainerSession>> registered =
        TrainerSession::Register(client_options, identity);
    if (!registered.ok()) {
      // A dispatcher that accepts what this trainer cannot train: restarting would not help.
      if (registered.status().code() == absl::StatusCode::kFailedPrecondition) {
        throw BadInput{absl::StrCat("register: ", registered.status().message())};
      }
      // Nor would it with the wrong credential.
      if (registered.status().code() == absl::StatusCode::kUnauthenticated ||
          registered.status().code() == absl::StatusCode::kPermissionDenied) {
        throw BadInput{absl::StrCat(
            "register: ", registered.status().message(),
            absl::GetFlag(FLAGS_token_file).empty()
                ? " (pass --token_file: the trainer token file dta-dispatcher named at start)"
                : "")};
      }
      throw std::runtime_error(absl::StrCat("register: ", registered.status().ToString()));
    }
    session = *std::move(registered);
    std::fprintf(stderr, "%s: registered as rank %d of %d (%lld steps committed), next step %lld\n",
                 prefix.c_str(), replica, replicas,
                 static_cast<long long>(session->committed_steps()), static_cast<long long>(step));
  };
  if (tensor_parallel_rank == 0) {
    client_options.address = absl::GetFlag(FLAGS_dispatcher);
    // Waiting for rollouts is normal (generation may be slower than training): retry for long.
    client_options.retry_for = absl::Seconds(absl::GetFlag(FLAGS_wait_s));
    client_options.token =
        CredentialFromFlag(absl::GetFlag(FLAGS_token_file), "token_file", Credential::kSecret);
    client_options.tls_root_certificates =
        CredentialFromFlag(absl::GetFlag(FLAGS_tls_roots), "tls_roots", Credential::kCertificates);
    register_with_dispatcher();
  }

  const std::chrono::milliseconds timeout(int64_t{1000} * absl::GetFlag(FLAGS_timeout_s));
  const ProcessGroupOptions group_options{.timeout = timeout};
  absl::StatusOr<std::unique_ptr<ProcessGroup>> world = ProcessGroup::Create(
      *env, options.device().is_cuda() ? options.device() : at::Device(at::kCPU), group_options);
  if (!world.ok()) throw TrainerRestart{absl::StrCat("process group: ", world.status().message())};
  // Every rank must resume from the same checkpoint (a rank may see a shared directory late). The
  // sums of the steps and of their squares equal world x step and world x step^2 on some rank only
  // if all steps are equal (Cauchy-Schwarz), so every rank reaches the same verdict. Exact: the
  // sums are integers far below 2^53.
  const std::vector<double> sums = (*world)->AllReduceScalars(
      {static_cast<double>(step), static_cast<double>(step) * static_cast<double>(step)});
  if (static_cast<int64_t>(sums[0]) != env->world_size * step ||
      static_cast<int64_t>(sums[1]) != env->world_size * step * step) {
    throw TrainerRestart{absl::StrFormat(
        "the ranks resumed from different checkpoints (this one from step %d, mean %.2f)", step,
        sums[0] / env->world_size)};
  }
  // Registering is not atomic across the ranks. After a launcher restarts the group, a rank that
  // registers while the dispatcher still lists a dead rank of the last attempt completes a
  // generation that the live rank's registration then ends (it replaces the dead one), and its
  // first fetch would fail. The ranks agree before the first step instead: while they hold
  // different generations, each registers again (same identity: the dispatcher lists it in the
  // current generation, changing nothing for the others).
  for (int round = 0; !RegisteredInOneGeneration(
           **world,
           session != nullptr ? std::optional<int64_t>(session->generation()) : std::nullopt,
           replicas);
       ++round) {
    if (round == 3) {
      throw TrainerRestart{"the ranks registered into different dispatcher generations 3 times"};
    }
    if (session != nullptr) {
      std::fprintf(stderr, "%s: the ranks registered into different generations: again\n",
                   prefix.c_str());
      register_with_dispatcher();
    }
  }
  const ParallelGroups groups(**world, tensor_parallel, layout.layout.expert_parallel,
                              group_options);
  if (tensor_parallel > 1) {
    session = tensor_parallel_rank == 0
                  ? RelayToFollowers(std::move(session), groups.tensor_parallel()->store())
                  : FollowLeader(groups.tensor_parallel()->store(), tensor_parallel - 1,
                                 std::chrono::seconds(absl::GetFlag(FLAGS_wait_s)) + timeout);
    if (tensor_parallel_rank != 0) {
      std::fprintf(stderr, "%s: follows TP rank 0 of replica %d (world rank %d)\n", prefix.c_str(),
                   replica, replica * tensor_parallel);
    }
  }
  Decoder model = ModelFromFlags(options, groups.tensor_parallel_collectives(),
                                 groups.expert_parallel_collectives());
  TrainingOptimizer optimizer(model.named_parameters(), &groups.data_parallel(), layout.layout,
                              AdamWFromFlags(), absl::GetFlag(FLAGS_bucket_mb) << 20,
                              model.gradient_norm_scope(), OffloadUpdateFromFlags(),
                              ExpertParametersOf(model, &groups));
  if (groups.world().rank() == 0 && !optimizer.DescribeOffload().empty()) {
    std::fprintf(stderr, "%s: %s\n", prefix.c_str(), optimizer.DescribeOffload().c_str());
  }
  if (latest.has_value()) {
    LoadCheckpoint(*latest, optimizer);
    std::fprintf(stderr, "%s: resumed from %s (step %lld)\n", prefix.c_str(), latest->path.c_str(),
                 static_cast<long long>(step));
  }
  optimizer.set_schedule(schedule);  // on the committed steps' curve, resumed or not

  // World rank 0 publishes checkpoints, so it tells the engines. Every exit (the last step, a
  // restart's exception) passes the destructor, which waits at most --notify_timeout_s for reloads
  // in flight and reports on stderr what no engine confirmed.
  EngineNotifier notifier({.engines = env->rank == 0 ? *engines : std::vector<EngineEndpoint>{},
                           .bearer_token = notify_token,
                           .attempts = absl::GetFlag(FLAGS_notify_attempts),
                           .timeout = std::chrono::seconds(absl::GetFlag(FLAGS_notify_timeout_s)),
                           .log_prefix = prefix});
  // --weight_sync=xccl: world rank 0 sends the whole model; the ranks that export it in a
  // checkpoint (the first replica's TP ranks; under EP the first EP group's replicas) gather it.
  std::unique_ptr<WeightBroadcaster> weight_sync;
  const bool gathers_weights =
      weight_sync_mode == "xccl" && groups.expert_data_parallel_rank() == 0;
  if (weight_sync_mode == "xccl") {
    if (env->rank == 0) {
      weight_sync = std::make_unique<WeightBroadcaster>(WeightSyncOptions{
          .engines = *sync_engines,
          .address = absl::GetFlag(FLAGS_weight_sync_address),
          .port = absl::GetFlag(FLAGS_weight_sync_port),
          .bucket_bytes =
              static_cast<int64_t>(absl::GetFlag(FLAGS_weight_sync_bucket_mb) * (1 << 20)),
          .timeout = std::chrono::seconds(absl::GetFlag(FLAGS_weight_sync_timeout_s)),
          .bearer_token = notify_token,
          .device = options.device(),
          .log_prefix = prefix,
          .group_file = (std::filesystem::path(checkpoint_dir) / "weight_sync.json").string()});
    }
  }
  bool reload_from_disk = false;  // the last sync failed: its checkpoint goes to the engines
  RunTrainerSteps(
      *session, model, optimizer, [&optimizer] { optimizer.SyncGradients(); }, step,
      {.loss = loss,
       .executor = executor,
       .device = options.device(),
       .checkpoint_dir = checkpoint_dir,
       .save_every = absl::GetFlag(FLAGS_save_every),
       .keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints),
       .model_export = model_export,
       .publish_weight_delta = absl::GetFlag(FLAGS_publish_weight_delta),
       .on_published =
           [&](const CheckpointInfo& checkpoint, int64_t policy_version) {
             if (engines_get(policy_version)) {
               notifier.Publish(CheckpointModelPath(checkpoint.path), policy_version);
             }
             if (reload_from_disk) {
               weight_sync->ReloadFromDisk(CheckpointModelPath(checkpoint.path), policy_version);
               reload_from_disk = false;
             }
           },
       .on_weights =
           [&](const Decoder& weights, int64_t policy_version) {
             if (!gathers_weights || !engines_get(policy_version)) return false;
             absl::Status sent;
             try {  // a failed gather is the trainer group's fault, as in a step
               if (weight_sync == nullptr) {
                 TakePartInPublish(weights);  // rank 0's peers: the gathers, whatever its outcome
                 return false;
               }
               sent = weight_sync->Publish(weights, policy_version);
             } catch (const c10::Error& e) {
               throw TrainerRestart{
                   absl::StrCat("weight sync gather: ", e.what_without_backtrace())};
             }
             if (sent.ok()) return false;
             std::fprintf(stderr,
                          "%s: weight sync of policy version %lld failed, reloading from "
                          "disk: %s\n",
                          prefix.c_str(), static_cast<long long>(policy_version),
                          sent.ToString().c_str());
             reload_from_disk = true;
             return true;
           },
       .on_step =
           [&metrics, &tensorboard, &prefix](const StepReport& report) {
             metrics.Record(report);
             if (*tensorboard == nullptr) return;
             // Metrics never stop training: a full disk costs the event file, not the run.
             if (absl::Status written = (*tensorboard)->Write(report.step, StepScalars(report));
                 !written.ok()) {
               std::fprintf(stderr, "%s: TensorBoard off: %s\n", prefix.c_str(),
                            written.ToString().c_str());
               tensorboard->reset();
             }
           },
       .max_steps = absl::GetFlag(FLAGS_max_steps),
       .ranks = {.world = world->get(),
                 .expert_data_parallel_rank = groups.expert_data_parallel_rank()},
       .collective_steps = groups.expert_parallel_size() > 1,
       .slow_step = std::chrono::milliseconds(absl::GetFlag(FLAGS_slow_step_ms)),
       .log_prefix = prefix,
       .progress = progress,
       .nonfinite_gradients = nonfinite_gradients},
      &checkpoint_requested);
  // Every rank leaves together, so rank 0's store outlives the others' last collective.
  (*world)->Barrier();
  return 0;
}

}  // namespace
}  // namespace dta

int main(int argc, char** argv) {
  dta::SetProgramUsage(
      "dta-trainer --dispatcher=HOST:PORT --checkpoint_dir=DIR --config=PRESET|--model=DIR ...");
  const std::vector<char*> rest = dta::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::cerr << "dta-trainer: unexpected argument '" << rest[1] << "'\n";
    return dta::kExitBadInput;
  }
  try {
    return dta::Run();
  } catch (const dta::BadInput& e) {
    std::cerr << "dta-trainer: " << e.message << "\n";
    return dta::kExitBadInput;
  } catch (const dta::TrainerRestart& e) {
    std::cerr << "dta-trainer: restart needed: " << e.why << "\n";
    return dta::kExitRestart;
  } catch (const c10::Error& e) {
    std::cerr << "dta-trainer: " << e.what_without_backtrace() << "\n";
    return dta::kExitError;
  } catch (const std::exception& e) {
    std::cerr << "dta-trainer: " << e.what() << "\n";
    return dta::kExitError;
  }
}

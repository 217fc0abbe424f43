// dta-weight-sync-bench: times WeightBroadcaster::Publish of a preset's random bf16 weights to
// running engines (bench/weight_sync_bench.py starts fake ones and runs this). Each sync starts
// where the trainer's would (the optimizer step done: the device synchronised) and ends when
// every engine has answered its continue (it holds the weights). With --keep_going a failed sync
// is timed too: how long a dead or hanging engine holds the trainer.
#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "apps/engines/weight_sync.h"
#include "core/model/model_config.h"

ABSL_FLAG(std::string, config, "qwen3-8b", "model preset");
ABSL_FLAG(std::string, device, "cuda:0", "where the weights are (cuda:N: NCCL; cpu: Gloo)");
ABSL_FLAG(std::string, engines, "", "KIND=URL[*WORKERS][,...] (--weight_sync_engines)");
ABSL_FLAG(double, bucket_mb, 1024, "bucket size, MiB");
ABSL_FLAG(int32_t, syncs, 3, "syncs to time (the first includes the rendezvous)");
ABSL_FLAG(int32_t, timeout_s, 300, "timeout of each request, the rendezvous and each bucket");
ABSL_FLAG(bool, keep_going, false,
          "after a failed sync, print its time and error and go on to the next (as the trainer "
          "goes on to its next step); the exit status is then 0");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const auto config = dta::ModelPreset(absl::GetFlag(FLAGS_config));
  const auto engines = dta::ParseWeightSyncEngines(absl::GetFlag(FLAGS_engines));
  if (!config.ok() || !engines.ok() || engines->empty()) {
    std::fprintf(stderr, "dta-weight-sync-bench: %s\n",
                 !config.ok() ? config.status().ToString().c_str()
                              : (!engines.ok() ? engines.status().ToString().c_str()
                                               : "--engines is required"));
    return 2;
  }
  const at::Device device(absl::GetFlag(FLAGS_device));
  dta::Decoder model(*config, at::TensorOptions().dtype(at::kBFloat16).device(device));
  model.InitRandom(/*seed=*/1);
  int64_t bytes = 0;
  for (const auto& [name, parameter] : model.named_parameters()) bytes += parameter.nbytes();
  dta::WeightBroadcaster sync(
      {.engines = *engines,
       .bucket_bytes = static_cast<int64_t>(absl::GetFlag(FLAGS_bucket_mb) * (1 << 20)),
       .timeout = std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s)),
       .device = device,
       .log_prefix = "dta-weight-sync-bench"});
  for (int i = 1; i <= absl::GetFlag(FLAGS_syncs); ++i) {
    if (device.is_cuda()) {
      c10::impl::getDeviceGuardImpl(device.type())->synchronizeDevice(device.index());
    }
    const auto start = std::chrono::steady_clock::now();
    const absl::Status sent = sync.Publish(model, i);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!sent.ok()) {
      std::printf("sync %d: failed after %.3f s: %s\n", i, seconds, sent.ToString().c_str());
      std::fflush(stdout);
      if (!absl::GetFlag(FLAGS_keep_going)) return 1;
      continue;
    }
    std::printf(
        "sync %d: %.3f s from optimizer step done to engines holding %.2f GB (%.1f GB/s)%s\n", i,
        seconds, bytes / 1e9, bytes / 1e9 / seconds,
        i == 1 ? " (includes the rendezvous and NCCL's communicator)" : "");
    std::fflush(stdout);
  }
  return 0;
}

// dta-linear-attention-bench: Qwen3-Next's Gated DeltaNet layer, one of its CUDA kernels on and
// off, side by side in one run. --compare picks the switch:
//   - scan: the chunk state recurrence as one CUDA kernel each way
//   (kernels/chunk_state_recurrence.h)
//     against the ATen loop over chunks it replaces (DTA_LINEAR_ATTENTION_KERNEL=0);
//   - fused: the intra-chunk terms from one CUDA kernel each way (kernels/gated_delta_chunk.h)
//     against the batched ATen ops and autograd's backward (DTA_GATED_DELTA_FUSED=0), the
//     recurrence kernel on in both; DTA_GATED_DELTA_BACKWARD_KERNEL=0 in the environment keeps
//     the ATen ops in forward+backward on both sides (the kernel's forward alone);
//   - conv: the tree-causal convolution as CUDA kernels (kernels/tree_causal_conv.h) against the
//     gather and element-wise ATen ops (DTA_CONV_KERNEL=0); only "mix" includes it.
// --profile=FILE appends, per timed case, one forward+backward of the switched-on path under the
// profiler (bench/step_profile.h): where the GPU's time goes, kernel by kernel.
// Two things are timed per chunk length T:
//   - "rule": ChunkedGatedDeltaRule alone on float32 q, k, v, g, beta and a state;
//   - "mix": GatedDeltaNetMix, the layer between its projections as the model calls it (its
//     projections in bfloat16 on the GPU, float32 on the CPU; the delta rule in float32).
// Shapes are Qwen3-Next's: 16 key heads, 32 value heads, Dk = Dv = 128, 64-token chunks, one chain
// of T tokens. Times are wall-clock medians between device synchronisations (the path being
// replaced is bound by the host's launches, which event timing would hide), forward alone and
// forward + backward; then the chunked rule's FLOP-bound time at H200 dense peaks (bf16 989,
// tf32 494, fp32 67 TFLOP/s; RuleFlops) and the switched-on time over it; the last column checks
// that both paths computed the same (the largest difference of the output and of the first
// input's gradient, relative to the largest entry). On the CPU both columns take the ATen paths
// (the smoke test of this program).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/step_profile.h"
#include "core/cli/usage.h"
#include "executor/model/ops/gated_delta_net.h"
#include "kernels/chunk_state_recurrence.h"
#include "kernels/gated_delta_chunk.h"
#include "kernels/tree_causal_conv.h"

ABSL_FLAG(std::string, device, "auto", "cpu, cuda, or auto (cuda when there is a GPU)");
ABSL_FLAG(std::string, tokens, "",
          "comma-separated chunk lengths T (default: 1024,4096,16384 on cuda, 64,256 on cpu)");
ABSL_FLAG(std::string, what, "rule,mix", "what to time: rule, mix or both");
ABSL_FLAG(int32_t, runs, 0, "timed runs per number, the median printed (default: 10 cuda, 3 cpu)");
ABSL_FLAG(int32_t, warmups, 2, "untimed runs first");
ABSL_FLAG(std::string, compare, "fused",
          "the switch to compare: scan (DTA_LINEAR_ATTENTION_KERNEL), fused "
          "(DTA_GATED_DELTA_FUSED) or conv (DTA_CONV_KERNEL)");
ABSL_FLAG(std::string, profile, "",
          "a Markdown file: one forward+backward of each case's switched-on path under the "
          "profiler, its kernels by time");

namespace dta {
namespace {

constexpr int64_t kKeyHeads = 16, kValueHeads = 32, kHeadDim = 128, kChunk = 64;

// H200 dense peaks, TFLOP/s.
constexpr double kPeakBf16 = 989, kPeakTf32 = 494, kPeakFp32 = 67;

// The chunked rule's forward FLOPs (2 a multiply-add) over T tokens, per head and chunk of C:
// S = beta k k^T and q k^T (2 C^2 Dk each), the unit-triangular solve for U and W (C^2 (Dv + Dk)),
// the recurrence's W h and Kd^T v_new (2 C Dk Dv each), the output's Qd h (2 C Dk Dv) and
// intra v_new (2 C^2 Dv). Elementwise work is left out. Backward is counted as twice forward.
double RuleFlops(int64_t t) {
  const double c = kChunk, dk = kHeadDim, dv = kHeadDim;
  const double chunks = static_cast<double>((t + kChunk - 1) / kChunk);
  const double per_chunk = 4 * c * c * dk + c * c * (dv + dk) + 6 * c * dk * dv + 2 * c * c * dv;
  return per_chunk * chunks * kValueHeads;
}

// Milliseconds that `flops` take at `tflops` per second.
double BoundMs(double flops, double tflops) { return flops / (tflops * 1e12) * 1e3; }

struct Timing {
  double forward_ms = 0, step_ms = 0;
  at::Tensor out, grad;  // of the last run, to compare the two paths
};

void Synchronize(const at::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize();
}

double MedianMs(const at::Device& device, int runs, const std::function<void()>& fn) {
  for (int i = 0; i < absl::GetFlag(FLAGS_warmups); ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < runs; ++i) {
    Synchronize(device);
    const auto start = std::chrono::steady_clock::now();
    fn();
    Synchronize(device);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
  }
  std::sort(ms.begin(), ms.end());
  return ms.size() % 2 == 1 ? ms[ms.size() / 2] : (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]) / 2;
}

// A forward returning (output, loss) and the leaf whose gradient is compared.
struct Workload {
  std::function<at::Tensor()> forward;  // the output; the loss is sum(output * seed)
  at::Tensor leaf;
  at::Tensor seed;
};

Workload RuleWorkload(int64_t t, const at::Device& device) {
  at::manual_seed(1);
  const at::TensorOptions o = at::TensorOptions().dtype(at::kFloat).device(device);
  auto normalized = [&] {
    const at::Tensor x = at::randn({t, kValueHeads, kHeadDim}, o);
    return (x / x.norm(2, -1, /*keepdim=*/true)).requires_grad_(true);
  };
  const at::Tensor q = normalized(), k = normalized();
  const at::Tensor v = at::randn({t, kValueHeads, kHeadDim}, o).requires_grad_(true);
  const at::Tensor g = (-0.1 * at::rand({t, kValueHeads}, o)).requires_grad_(true);
  const at::Tensor beta = at::sigmoid(at::randn({t, kValueHeads}, o)).requires_grad_(true);
  const at::Tensor state = (0.1 * at::randn({kValueHeads, kHeadDim, kHeadDim}, o));
  Workload w;
  w.forward = [=] { return ChunkedGatedDeltaRule(q, k, v, g, beta, state).out; };
  w.leaf = v;
  w.seed = at::randn({t, kValueHeads, kHeadDim}, o);
  return w;
}

Workload MixWorkload(int64_t t, const at::Device& device) {
  at::manual_seed(2);
  const GatedDeltaNetShape shape{.key_heads = kKeyHeads,
                                 .value_heads = kValueHeads,
                                 .key_head_dim = kHeadDim,
                                 .value_head_dim = kHeadDim,
                                 .conv_kernel = 4,
                                 .eps = 1e-6};
  const at::ScalarType type = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  const at::TensorOptions o = at::TensorOptions().dtype(type).device(device);
  auto param = [&](std::vector<int64_t> sizes, double scale) {
    return (scale * at::randn(sizes, o)).requires_grad_(true);
  };
  GatedDeltaNetWeights weights;
  weights.conv1d = param({shape.conv_dim(), 1, shape.conv_kernel}, 0.5);
  weights.dt_bias = param({kValueHeads}, 0.5);
  // Log decays g = -exp(a_log) softplus(a + dt_bias) of about -0.07 a token: a chunk's decay stays
  // a normal float (no denormals on the CPU).
  weights.a_log = (-2.3 + 0.1 * at::randn({kValueHeads}, o)).requires_grad_(true);
  weights.norm = (1.0 + 0.1 * at::randn({kHeadDim}, o)).requires_grad_(true);
  const at::Tensor qkvz = param({t, 2 * shape.key_dim() + 2 * shape.value_dim()}, 1.0);
  const at::Tensor ba = param({t, 2 * kValueHeads}, 1.0);
  const at::Tensor index = ConvAncestorIndex({}, t, 0, shape.conv_kernel, device);
  const std::vector<TokenRun> runs = ChainRuns({}, t);
  Workload w;
  w.forward = [=] { return GatedDeltaNetMix(weights, shape, qkvz, ba, index, runs, {}).out; };
  w.leaf = qkvz;
  w.seed = at::randn({t, shape.value_dim()}, o);
  return w;
}

// One forward and backward; keeps the output and the leaf's gradient in `timing`.
void Step(const Workload& w, Timing& timing) {
  const at::Tensor out = w.forward();
  timing.grad = torch::autograd::grad({(out.to(at::kFloat) * w.seed).sum()}, {w.leaf})[0];
  timing.out = out.detach();
}

Timing Time(const Workload& w, const at::Device& device, int runs, const char* variable,
            bool kernel) {
  unsetenv("DTA_LINEAR_ATTENTION_KERNEL");
  unsetenv("DTA_GATED_DELTA_FUSED");
  unsetenv("DTA_CONV_KERNEL");
  if (!kernel) setenv(variable, "0", 1);
  Timing timing;
  timing.forward_ms = MedianMs(device, runs, [&] { w.forward(); });
  timing.step_ms = MedianMs(device, runs, [&] { Step(w, timing); });
  unsetenv(variable);
  return timing;
}

double RelativeDifference(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  return (x - y).abs().max().item<double>() / std::max(y.abs().max().item<double>(), 1e-30);
}

int Main() {
  std::string device_name = absl::GetFlag(FLAGS_device);
  if (device_name == "auto") device_name = torch::cuda::is_available() ? "cuda" : "cpu";
  if (device_name != "cpu" && device_name != "cuda") {
    std::fprintf(stderr, "--device must be cpu, cuda or auto, got '%s'\n", device_name.c_str());
    return 2;
  }
  if (device_name == "cuda" && !torch::cuda::is_available()) {
    std::fprintf(stderr, "--device=cuda: no CUDA device\n");
    return 2;
  }
  const at::Device device(device_name);
  const bool cuda = device.is_cuda();
  std::string token_list = absl::GetFlag(FLAGS_tokens);
  if (token_list.empty()) token_list = cuda ? "1024,4096,16384" : "64,256";
  std::vector<int64_t> lengths;
  for (const absl::string_view part : absl::StrSplit(token_list, ',', absl::SkipEmpty())) {
    int64_t t = 0;
    if (!absl::SimpleAtoi(part, &t) || t < 1) {
      std::fprintf(stderr, "--tokens: not a positive length: '%s'\n", std::string(part).c_str());
      return 2;
    }
    lengths.push_back(t);
  }
  const std::string what = absl::GetFlag(FLAGS_what);
  const int runs = absl::GetFlag(FLAGS_runs) > 0 ? absl::GetFlag(FLAGS_runs) : (cuda ? 10 : 3);
  const std::string compare = absl::GetFlag(FLAGS_compare);
  if (compare != "scan" && compare != "fused" && compare != "conv") {
    std::fprintf(stderr, "--compare must be scan, fused or conv, got '%s'\n", compare.c_str());
    return 2;
  }
  const bool fused = compare == "fused", conv = compare == "conv";
  const char* const variable = fused  ? "DTA_GATED_DELTA_FUSED"
                               : conv ? "DTA_CONV_KERNEL"
                                      : "DTA_LINEAR_ATTENTION_KERNEL";
  const at::TensorOptions o = at::TensorOptions().dtype(at::kFloat).device(device);
  const bool kernel_possible =
      fused  ? kernels::GatedDeltaChunkUsesKernel(at::zeros({1, kKeyHeads, kHeadDim}, o), kHeadDim,
                                                  kChunk)
      : conv ? kernels::TreeCausalConvKernelRuns(at::zeros({1, 8}, o), at::zeros({8, 4}, o),
                                                 at::zeros({0, 8}, o),
                                                 at::zeros({1, 4}, o.dtype(at::kLong)))
             : kernels::ChunkStateUsesKernel(at::zeros({1, 1, kChunk, kHeadDim}, o), kHeadDim);
  const char* const off_name = fused ? "ATen intra-chunk ops" : conv ? "ATen conv" : "ATen loop";
  const char* const on_name = fused ? "fused" : conv ? "conv kernels" : "scan kernel";
  std::printf(
      "Gated DeltaNet, %lld key / %lld value heads, Dk = Dv = %lld, %lld-token chunks, on %s; "
      "%s=0 against on; kernel %s; median of %d runs, wall-clock ms between synchronisations; "
      "bound: the rule's FLOPs (fwd+bwd) at H200 bf16 / tf32 / fp32 dense peaks\n\n",
      static_cast<long long>(kKeyHeads), static_cast<long long>(kValueHeads),
      static_cast<long long>(kHeadDim), static_cast<long long>(kChunk), cuda ? "cuda" : "cpu",
      variable, kernel_possible ? "available" : "not available (both columns are ATen)", runs);
  const std::string profile_path = absl::GetFlag(FLAGS_profile);
  std::ofstream profile_file;
  if (!profile_path.empty()) {
    profile_file.open(profile_path);
    if (!profile_file) {
      std::fprintf(stderr, "--profile: cannot write '%s'\n", profile_path.c_str());
      return 2;
    }
  }
  std::printf(
      "| what | T | fwd ms, %s | fwd ms, %s | fwd speed-up | fwd+bwd ms, %s | fwd+bwd ms, %s | "
      "fwd+bwd speed-up | GFLOP fwd+bwd | bound ms bf16 / tf32 / fp32 | %s over bound bf16 / "
      "fp32 | max rel. diff out / grad |\n",
      off_name, on_name, off_name, on_name, on_name);
  std::printf(
      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |\n");
  for (const std::string name : {"rule", "mix"}) {
    if (what.find(name) == std::string::npos) continue;
    for (const int64_t t : lengths) {
      const Workload w = name == "rule" ? RuleWorkload(t, device) : MixWorkload(t, device);
      const Timing off = Time(w, device, runs, variable, /*kernel=*/false);
      const Timing on = Time(w, device, runs, variable, /*kernel=*/true);
      const double flops = 3 * RuleFlops(t);
      const double bf16 = BoundMs(flops, kPeakBf16), fp32 = BoundMs(flops, kPeakFp32);
      std::printf(
          "| %s | %lld | %.3f | %.3f | %.2fx | %.3f | %.3f | %.2fx | %.1f | %.3f / %.3f / %.3f | "
          "%.1fx / %.1fx | %.1e / %.1e |\n",
          name.c_str(), static_cast<long long>(t), off.forward_ms, on.forward_ms,
          off.forward_ms / on.forward_ms, off.step_ms, on.step_ms, off.step_ms / on.step_ms,
          flops / 1e9, bf16, BoundMs(flops, kPeakTf32), fp32, on.step_ms / bf16, on.step_ms / fp32,
          RelativeDifference(on.out, off.out), RelativeDifference(on.grad, off.grad));
      std::fflush(stdout);
      if (!profile_path.empty()) {
        Timing unused;
        const bench::StepProfile profile = bench::ProfileStep(
            [&] {
              Step(w, unused);
              Synchronize(device);
            },
            device);
        profile_file << bench::ProfileMarkdown(
            profile, name + " at T = " + std::to_string(t) + ", " + on_name + ", fwd+bwd",
            /*top=*/40);
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace dta

int main(int argc, char** argv) {
  dta::SetProgramUsage(
      "dta-linear-attention-bench [--device=cuda] [--tokens=1024,4096,16384] [--what=rule,mix] "
      "[--compare=fused|scan|conv]: Gated DeltaNet with one of its CUDA kernels against the ATen "
      "ops "
      "it replaces");
  dta::ParseCommandLine(argc, argv);
  return dta::Main();
}

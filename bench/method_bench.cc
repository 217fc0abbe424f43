// dta-bench: every execution method on one workload and one model shape, side by side in one
// process: same model code, weights, rollouts, loss, dtype and device for every method.
//
//   dta-bench --rollouts=tau2.jsonl --config=qwen3-1.7b [--methods=dense,dense-ckpt,packed,...]
//             [--dtype=bfloat16] [--device=cuda] [--warmup=1] [--repeats=3] [--out_dir=DIR]
//
// Methods (--methods, comma separated):
//   dense          every rollout on its own (the reference and the papers' "Dense" baseline)
//   dense-ckpt     dense with activation checkpointing ("Dense+CKPT")
//   packed         Tree Training: the tree's unique tokens in packed forwards with a tree mask, at
//                  most --token_capacity unique tokens each (scripts/gpu_bench.sh: 24K, the paper's
//                  budget)
//   packed-ckpt    packed with activation checkpointing (n/a when the executor's packed method
//                  turns out not to checkpoint: its first step forwards no replayed tokens)
//   dta-b<B>[-g<G>][-pack][-lex]
//                  AReaL-DTA's push/pop schedule with backward chunks of at most B tokens
//                  ("binf": unbounded; "bauto": the executor's default, the longest rollout if its
//                  graph fits in the free memory, else what fits), a graph budget of G tokens
//                  ("gauto": -1, the executor's automatic budget where it has one; without -g: 0,
//                  the paper's recomputation), packing of small complete subtrees (-pack without -g
//                  takes --graph_budget), lexicographic instead of backward-DFS leaf order; e.g.
//                  dta-b2048, dta-b4096, dta-b4096-pack, dta-b4096-gauto-pack, dta-bauto-gauto-pack
//                  (the executor's defaults). A name without -pack runs without packing, although
//                  the executor packs by default; -m<GiB> runs it under a memory budget
//                  (ExecutorOptions::memory_budget), -mhalf under half of dense's measured peak
//                  (dense must be listed before it), e.g. dta-bauto-gauto-pack-mhalf
//
// Each timed step calls ComputeGradients once with ExecutorOptions::replace_gradients, as the
// trainers do (--replace_gradients=false: zeroes the gradients first and accumulates; GRPO: PPO
// clip with group advantages, token-mean; LossOptions' defaults, as dta-train). --warmup steps are
// run and discarded, then the median of --repeats steps is reported, each step bracketed by device
// synchronizations. Per method: step time, rollout tokens per second (all rollout tokens, shared or
// not: the same numerator for every method), speedups, peak memory (CUDA caching allocator,
// reset between methods; on the CPU the process's peak RSS, reset through /proc/self/clear_refs),
// MFU and the fraction of the ideal speedup. An agreement check (--check) first compares every
// method's gradient, in the benchmark's dtype, on a small shape with a float32 dense reference
// (same weights, the first --check_rollouts rollouts in lexicographic order). Its loss is SFT by
// default (--check_loss): the executor only sees d loss / d log-probability, and GRPO's gradient on
// random weights rests on a few tokens' importance ratios, or is 0 where a subset's rewards agree.
//
// Tensor parallelism: under torchrun, --tensor_parallel=T with T ranks (one replica) splits the
// model across them as dta-train and dta-trainer do (executor/parallel); every rank runs every
// method (and the agreement check, whose models are split alike), rank 0 reports its own timings
// and memory, and MFU counts T GPUs (a method that runs out of memory on some ranks only leaves
// the others waiting for --timeout_s):
//   NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 --no-python dta-bench --tensor_parallel=2 ...
//
// --profile runs one more step of each method under PyTorch's Kineto profiler (not timed) and
// writes DIR/profile-<method>.md: the GPU's kernels, copies and fills by time (on the CPU, the
// operators' inclusive times), the --profile_top largest (bench/step_profile.h).
//
// Writes DIR/results.md and DIR/results.json; progress goes to stderr. A method that runs out of
// memory is recorded as OOM and the next one runs. Exit status: 0 on success, 1 if a method failed
// for another reason, 2 on bad input (flags, files, rollouts, configs).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <sys/resource.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <new>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "bench/step_profile.h"
#include "core/base/env_switch.h"
#include "core/base/exit_codes.h"
#include "core/cli/bad_input.h"
#include "core/cli/usage.h"
#include "core/io/rollout_jsonl.h"
#include "core/layout/memory_plan.h"
#include "core/model/config_json.h"
#include "core/model/model_config.h"
#include "core/tree/prefix_tree.h"
#include "core/tree/shared_marks.h"
#include "core/tree/tree_partition.h"
#include "core/tree/tree_stats.h"
#include "executor/distributed/parallel_groups.h"
#include "executor/distributed/process_group.h"
#include "executor/engine/executor.h"
#include "executor/loss/loss.h"
#include "executor/model/decoder.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, rollouts, "",
          "workload file (JSON Lines, e.g. from dta-workload); required");
ABSL_FLAG(std::string, config, "qwen3-1.7b",
          absl::StrCat("model shape: a preset (", absl::StrJoin(dta::ModelPresetNames(), ", "),
                       ") or a config.json; random weights"));
ABSL_FLAG(std::string, methods,
          "dense,dense-ckpt,packed,packed-ckpt,dta-b2048,dta-b4096,dta-b4096-pack",
          "comma-separated: dense, dense-ckpt, packed, packed-ckpt, dta-b<B>[-g<G>][-pack][-lex]");
ABSL_FLAG(std::string, dtype, "bfloat16", "bfloat16, float32 or float64 (every method)");
ABSL_FLAG(std::string, device, "cuda", "cuda[:N] or cpu");
ABSL_FLAG(int32_t, warmup, 1, "steps per method run first and not timed");
ABSL_FLAG(int32_t, repeats, 3, "timed steps per method; the median is reported");
// The defaults are the executor's (dta::ExecutorOptions), as in dta-train and dta.Trainer;
// scripts/gpu_bench.sh passes the paper's budgets (--token_capacity=24576 --graph_budget=4096).
ABSL_FLAG(int64_t, token_capacity, dta::ExecutorOptions{}.token_capacity,
          "packed: the most unique tokens per packed forward (0 = the whole tree)");
ABSL_FLAG(int64_t, graph_budget, dta::ExecutorOptions{}.graph_budget,
          "dta-...-pack variants without -g<G>: the graph budget in tokens (-1: the executor's "
          "automatic budget)");
ABSL_FLAG(int64_t, logprob_slice_rows, dta::ExecutorOptions{}.logprob_slice_rows,
          "every method: rows of the LM head's logits computed at once (ExecutorOptions)");
ABSL_FLAG(int64_t, max_rollouts, 0, "use only the first N rollouts of the file (0 = all)");
ABSL_FLAG(double, peak_tflops, 989.0,
          "the device's peak dense bf16 TFLOP/s for MFU (989: H100/H200 SXM)");
ABSL_FLAG(uint64_t, init_seed, 1, "seed of the random weights");
ABSL_FLAG(double, init_std, 0.02,
          "standard deviation of the random weights (norm weights: 1 + N(0, std/4))");
ABSL_FLAG(bool, check, true,
          "compare every method's gradients with a float32 dense reference on a small shape");
ABSL_FLAG(std::string, check_config, "",
          "the check's model shape (preset or config.json); default the benchmarked model's family "
          "at hidden 256, 4 layers, 4 heads, 2 KV heads, head_dim 64, vocabulary = the largest "
          "token id + 1");
ABSL_FLAG(int32_t, check_rollouts, 16,
          "the check uses the first N rollouts in lexicographic order (they share prefixes)");
ABSL_FLAG(std::string, loss, "grpo",
          "the benchmark's loss: grpo (PPO clip 0.2, token-mean, group advantages; dta-train's "
          "default) or sft");
ABSL_FLAG(std::string, check_loss, "sft",
          "the check's loss: sft, or same (the benchmark's --loss)");
ABSL_FLAG(std::string, out_dir, "",
          "where results.md and results.json go; default bench/results/<timestamp>");
ABSL_FLAG(int32_t, tensor_parallel, 1,
          "split the model across this many ranks started by torchrun (RANK, WORLD_SIZE, ...: "
          "exactly this many; cuda means cuda:LOCAL_RANK); 1: one process");
ABSL_FLAG(int32_t, timeout_s, 600, "tensor parallelism: the collectives' timeout, seconds");
ABSL_FLAG(bool, profile, false,
          "after each method's timed steps, one more step under PyTorch's profiler: "
          "DIR/profile-<method>.md, the GPU's kernels (on the CPU, the operators) by time");
ABSL_FLAG(int32_t, profile_top, 40, "with --profile: the rows of each profile");
ABSL_FLAG(bool, replace_gradients, true,
          "each timed step's gradients replace the previous step's (ExecutorOptions::"
          "replace_gradients, as the trainers run); false zeroes every gradient before the step "
          "and accumulates into it");
ABSL_FLAG(std::string, label, "",
          "the workload's name in the outputs; default the rollout file's stem");

namespace dta {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// The agreement check passes when every method's median per-parameter relative error is below this.
constexpr double kCheckTarget = 0.01;

// ---------------------------------------------------------------------------------------------
// Methods

struct MethodSpec {
  std::string name;
  ExecutorOptions options;
  // -mhalf: options.memory_budget is set, before the method runs, to half of dense's peak.
  bool budget_half_of_dense = false;
  // Non-empty: the method is listed as n/a with this reason and not run.
  std::string unsupported;
};

// Thrown when the executor turns out not to do what a method asks (reported as n/a).
struct Unsupported {
  std::string reason;
};

MethodSpec ParseMethod(const std::string& name) {
  MethodSpec spec;
  spec.name = name;
  spec.options.logprob_slice_rows = absl::GetFlag(FLAGS_logprob_slice_rows);
  if (name == "dense") {
    spec.options.method = Method::kDense;
  } else if (name == "dense-ckpt") {
    spec.options.method = Method::kDense;
    spec.options.checkpointing = true;
  } else if (name == "packed" || name == "packed-ckpt") {
    spec.options.method = Method::kPacked;
    spec.options.token_capacity = absl::GetFlag(FLAGS_token_capacity);
    // An executor whose packed method ignores checkpointing is caught after the first step
    // (CheckHonoured) and packed-ckpt is then reported as n/a.
    spec.options.checkpointing = name == "packed-ckpt";
  } else if (absl::StartsWith(name, "dta-")) {
    spec.options.method = Method::kDta;
    // The name says everything: no -pack means no packing, whatever the executor's default.
    spec.options.pack = false;
    bool has_block = false, has_budget = false;
    for (absl::string_view part : absl::StrSplit(name.substr(4), '-')) {
      int64_t value = 0;
      if (absl::ConsumePrefix(&part, "b") &&
          (part == "inf" || part == "auto" || (absl::SimpleAtoi(part, &value) && value > 0))) {
        spec.options.block_size = part == "inf"    ? kUnboundedBlock
                                  : part == "auto" ? kAutoBlockSize
                                                   : value;
        has_block = true;
      } else if (absl::ConsumePrefix(&part, "g") &&
                 (part == "auto" || (absl::SimpleAtoi(part, &value) && value >= 0))) {
        spec.options.graph_budget = part == "auto" ? -1 : value;
        has_budget = true;
      } else if (part == "mhalf") {
        spec.budget_half_of_dense = true;
      } else if (double gib = 0; absl::ConsumePrefix(&part, "m") && absl::SimpleAtod(part, &gib) &&
                                 gib > 0 && std::isfinite(gib)) {
        spec.options.memory_budget = static_cast<int64_t>(gib * kGiB);
      } else if (part == "pack") {
        spec.options.pack = true;
      } else if (part == "lex") {
        spec.options.order = LeafOrderKind::kLexicographic;
      } else {
        throw BadInput{"--methods: cannot read '" + name +
                       "': dta variants are dta-b<B>[-g<G>][-pack][-lex][-m<GiB>|-mhalf], e.g. "
                       "dta-b2048, dta-b4096-pack, dta-binf-g8192, dta-b4096-gauto-pack, "
                       "dta-bauto-gauto-pack, dta-bauto-gauto-pack-mhalf"};
      }
    }
    if (!has_block) throw BadInput{"--methods: '" + name + "' needs a block size, e.g. dta-b2048"};
    // Without -g<G>: the paper's schedule recomputes every graph; -pack keeps --graph_budget
    // tokens.
    if (!has_budget)
      spec.options.graph_budget = spec.options.pack ? absl::GetFlag(FLAGS_graph_budget) : 0;
  } else {
    throw BadInput{
        "--methods: unknown method '" + name +
        "'; known: dense, dense-ckpt, packed, packed-ckpt, dta-b<B>[-g<G>][-pack][-lex]"};
  }
  spec.options.replace_gradients = absl::GetFlag(FLAGS_replace_gradients);
  return spec;
}

std::vector<MethodSpec> ParseMethods() {
  std::vector<MethodSpec> methods;
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_methods), ',', absl::SkipWhitespace())) {
    const std::string name(absl::StripAsciiWhitespace(part));
    for (const MethodSpec& m : methods) {
      if (m.name == name) throw BadInput{"--methods: '" + name + "' is listed twice"};
    }
    methods.push_back(ParseMethod(name));
  }
  if (methods.empty()) throw BadInput{"--methods is empty"};
  return methods;
}

nlohmann::json OptionsJson(const ExecutorOptions& o) {
  nlohmann::json j;
  switch (o.method) {
    case Method::kDense:
      j = {{"method", "dense"}, {"checkpointing", o.checkpointing}};
      break;
    case Method::kPacked:
      j = {{"method", "packed"},
           {"token_capacity", o.token_capacity},
           {"checkpointing", o.checkpointing}};
      break;
    case Method::kDta:
      j = {{"method", "dta"},
           {"block_size", o.block_size == kUnboundedBlock  ? nlohmann::json(nullptr)
                          : o.block_size == kAutoBlockSize ? nlohmann::json("auto")
                                                           : nlohmann::json(o.block_size)},
           {"graph_budget",
            o.graph_budget < 0 ? nlohmann::json("auto") : nlohmann::json(o.graph_budget)},
           {"pack", o.pack},
           {"memory_budget_gib",
            o.memory_budget > 0 ? nlohmann::json(o.memory_budget / kGiB) : nlohmann::json(nullptr)},
           {"order", o.order == LeafOrderKind::kBackwardDfs ? "backward-dfs" : "lexicographic"}};
      break;
  }
  j["logprob_slice_rows"] = o.logprob_slice_rows;
  return j;
}

// ---------------------------------------------------------------------------------------------
// Device, model, memory

struct DeviceInfo {
  at::Device device{at::kCPU};
  std::string name;
  std::string cuda_runtime;  // "13.0"; empty on the CPU
  std::string cuda_driver;
  double memory_gib = 0;
};

std::string CudaVersionString(int v) { return absl::StrFormat("%d.%d", v / 1000, (v % 1000) / 10); }

DeviceInfo OpenDevice(const std::string& spec) {
  DeviceInfo info;
  try {
    info.device = at::Device(spec);
  } catch (const c10::Error&) {
    throw BadInput{"--device must be cpu or cuda[:N], got '" + spec + "'"};
  }
  if (info.device.is_cuda()) {
    const int count = c10::cuda::device_count();
    if (count == 0) throw BadInput{"--device=" + spec + ": no CUDA device is visible"};
    if (!info.device.has_index()) info.device = at::Device(at::kCUDA, c10::cuda::current_device());
    if (info.device.index() >= count) {
      throw BadInput{absl::StrFormat("--device=%s: only %d CUDA device(s)", spec, count)};
    }
    c10::cuda::set_device(info.device.index());
    const cudaDeviceProp* props = at::cuda::getDeviceProperties(info.device.index());
    info.name = props->name;
    info.memory_gib = static_cast<double>(props->totalGlobalMem) / kGiB;
    int runtime = 0, driver = 0;
    cudaRuntimeGetVersion(&runtime);
    cudaDriverGetVersion(&driver);
    info.cuda_runtime = CudaVersionString(runtime);
    info.cuda_driver = CudaVersionString(driver);
  } else if (info.device.is_cpu()) {
    std::ifstream cpuinfo("/proc/cpuinfo");
    std::string line;
    while (std::getline(cpuinfo, line)) {
      if (absl::StartsWith(line, "model name")) {
        info.name = std::string(absl::StripAsciiWhitespace(line.substr(line.find(':') + 1)));
        break;
      }
    }
    if (info.name.empty()) info.name = "CPU";
  } else {
    throw BadInput{"--device must be cpu or cuda[:N], got '" + spec + "'"};
  }
  return info;
}

void Synchronize(const at::Device& device) {
  if (device.is_cuda()) c10::cuda::device_synchronize();
}

at::ScalarType ParseDtype(const std::string& name) {
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float32") return at::kFloat;
  if (name == "float64") return at::kDouble;
  throw BadInput{"--dtype must be bfloat16, float32 or float64, got '" + name + "'"};
}

std::string DtypeName(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return "bfloat16";
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    default:
      return std::string(c10::toString(t));
  }
}

ModelConfig LoadConfig(const std::string& flag, const std::string& name) {
  absl::StatusOr<ModelConfig> config = ModelConfigFromName(name);
  if (!config.ok()) {
    throw BadInput{
        absl::StrFormat("--%s=%s is neither a preset (%s) nor a readable config.json: %s", flag,
                        name, absl::StrJoin(ModelPresetNames(), ", "), config.status().message())};
  }
  const absl::Status valid = ValidateModelConfig(*config);
  if (!valid.ok()) throw BadInput{absl::StrFormat("--%s=%s: %s", flag, name, valid.message())};
  return *config;
}

// Random weights drawn where the parameters live (Decoder::InitRandom draws float64 on the CPU,
// too slow and too large for 8B): the same scheme, matrices ~ N(0, std) and norm weights ~
// 1 + N(0, std / 4), from one seeded generator of the parameters' device.
void InitOnDevice(const Decoder& model, uint64_t seed, double std) {
  const at::Device device = model.options().device();
  at::Generator generator = device.is_cuda() ? at::cuda::detail::createCUDAGenerator(device.index())
                                             : at::detail::createCPUGenerator(seed);
  generator.set_current_seed(seed);
  c10::NoGradGuard no_grad;
  const auto& named = model.named_parameters();
  for (size_t i = 0; i < named.size(); ++i) {
    at::Tensor p = named[i].second;
    // The whole tensor is drawn and this rank keeps its part: the same model at every TP size.
    at::Tensor full = at::empty(model.parameter_splits()[i].full_shape, p.options());
    if (p.dim() == 1) {
      full.normal_(1.0, std / 4, generator);
    } else {
      full.normal_(0.0, std, generator);
    }
    p.copy_(model.LocalPart(i, full));
  }
}

void CopyWeights(const Decoder& from, const Decoder& to) {
  c10::NoGradGuard no_grad;
  const auto& src = from.named_parameters();
  const auto& dst = to.named_parameters();
  TORCH_CHECK(src.size() == dst.size(), "models of different shapes");
  for (size_t i = 0; i < src.size(); ++i) {
    at::Tensor p = dst[i].second;
    p.copy_(src[i].second);
  }
}

void ZeroGrads(const Decoder& model) {
  for (const auto& [name, parameter] : model.named_parameters()) {
    if (parameter.grad().defined()) parameter.mutable_grad().zero_();
  }
}

// Every parameter's gradient as a float32 (float64 for float64 models) tensor, zeros where
// undefined. Gradients may be stored in the parameter's dtype or in float32 (bf16 models).
std::vector<at::Tensor> Grads(const Decoder& model, at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  for (const auto& [name, parameter] : model.named_parameters()) {
    const at::Tensor g = parameter.grad();
    out.push_back(g.defined() ? g.detach().to(dtype, /*non_blocking=*/false, /*copy=*/true)
                              : at::zeros(parameter.sizes(), parameter.options().dtype(dtype)));
  }
  return out;
}

class MemoryMeter {
 public:
  explicit MemoryMeter(const at::Device& device) : device_(device) {}

  // Frees cached blocks and starts a new peak.
  void Reset() {
    if (device_.is_cuda()) {
      c10::cuda::CUDACachingAllocator::emptyCache();
      c10::cuda::CUDACachingAllocator::resetPeakStats(device_.index());
      return;
    }
    // Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS.
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";
    clear.flush();
    rss_reset_ = static_cast<bool>(clear);
  }
  // Bytes allocated now (CUDA), or the current RSS (CPU).
  double CurrentGiB() const {
    if (device_.is_cuda()) return Stats().allocated_bytes[0].current / kGiB;
    return StatusKiB("VmRSS:") / (1024.0 * 1024.0);
  }
  double PeakGiB() const {
    if (device_.is_cuda()) return Stats().allocated_bytes[0].peak / kGiB;
    const double hwm = StatusKiB("VmHWM:");
    if (hwm > 0) return hwm / (1024.0 * 1024.0);
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    return static_cast<double>(usage.ru_maxrss) / (1024.0 * 1024.0);
  }
  double PeakReservedGiB() const {
    if (device_.is_cuda()) return Stats().reserved_bytes[0].peak / kGiB;
    return PeakGiB();
  }
  std::string Kind() const {
    if (device_.is_cuda())
      return "CUDA caching allocator: peak allocated bytes, reset before each method";
    return rss_reset_
               ? "process peak RSS (VmHWM), reset before each method through /proc/self/clear_refs"
               : "process peak RSS since start (could not reset it)";
  }

 private:
  c10::CachingDeviceAllocator::DeviceStats Stats() const {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index());
  }
  static double StatusKiB(const std::string& key) {
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line)) {
      if (absl::StartsWith(line, key)) {
        double kib = 0;
        std::istringstream(line.substr(key.size())) >> kib;
        return kib;
      }
    }
    return 0;
  }

  at::Device device_;
  bool rss_reset_ = false;
};

bool IsOutOfMemory(const c10::Error& e) {
  return dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr ||
         absl::StrContains(e.what_without_backtrace(), "out of memory");
}

double Median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// ---------------------------------------------------------------------------------------------
// FLOP model

// Model FLOPs of one training step (forward + backward) over `tokens` tokens whose attention
// contexts sum to `attention_work` (query-key pairs): 6 x matmul parameters per token (every
// linear layer a token uses, lm_head included, embedding lookups and norms excluded) plus, per
// query-key pair and full-attention layer, 4 x heads x head_dim for QK^T and PV in the forward,
// x 3 with the backward.
struct FlopModel {
  double matmul_parameters = 0;
  double per_token = 0;
  double lm_head_per_token = 0;  // part of per_token
  double per_attention_pair = 0;

  // Matmul parameters: the ones a token uses (core/layout/memory_plan.h's active count: a sparse
  // layer's routed experts, not all of them) less the embedding lookup, which is no matmul (a
  // tied embedding is lm_head's matmul and stays). Attention work counts only full-attention
  // layers: a linear-attention layer's cost per token is constant, and its small per-token terms
  // (the delta rule, the convolution) are left out, as norms and activations are.
  explicit FlopModel(const ModelConfig& c) {
    const double h = c.hidden_size;
    const double embedding = c.tie_word_embeddings ? 0.0 : static_cast<double>(c.vocab_size) * h;
    matmul_parameters = static_cast<double>(CountParameters(c).active()) - embedding;
    per_token = 6 * matmul_parameters;
    lm_head_per_token = 6 * static_cast<double>(c.vocab_size) * h;
    int64_t attention_layers = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
      attention_layers += IsLinearAttentionLayer(c, l) ? 0 : 1;
    per_attention_pair =
        4.0 * static_cast<double>(attention_layers) * c.num_attention_heads * c.head_dim * 3;
  }
  double Flops(double tokens, double attention_work) const {
    return per_token * tokens + per_attention_pair * attention_work;
  }
};

// Checkpointing replays every layer's forward in backward: about 8/6 of dense's FLOPs.
constexpr double kCheckpointingFactor = 4.0 / 3.0;

// ---------------------------------------------------------------------------------------------
// Running

struct Comparison {
  double grad_rel = 0;          // ||g - g_ref|| / ||g_ref|| over all parameters flattened
  double median_param_rel = 0;  // median over parameters of ||g_p - ref_p|| / ||ref_p||
  double max_param_rel = 0;
  std::string max_param;
  double loss_rel = 0;
  std::vector<std::pair<std::string, double>> per_param;  // every parameter's relative error
};

Comparison Compare(const std::vector<at::Tensor>& grads, double loss,
                   const std::vector<at::Tensor>& ref, double ref_loss, const Decoder& model) {
  Comparison c;
  double diff2 = 0, ref2 = 0;
  std::vector<double> per_param;
  for (size_t i = 0; i < ref.size(); ++i) {
    const at::Tensor r = ref[i].to(at::kDouble);
    const double d = (grads[i].to(at::kDouble) - r).norm().item<double>();
    const double n = r.norm().item<double>();
    diff2 += d * d;
    ref2 += n * n;
    if (n == 0) continue;  // a parameter without gradient in the reference (no defined ratio)
    per_param.push_back(d / n);
    c.per_param.emplace_back(model.named_parameters()[i].first, d / n);
    if (d / n >= c.max_param_rel) {
      c.max_param_rel = d / n;
      c.max_param = model.named_parameters()[i].first;
    }
  }
  c.grad_rel = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::nan("");
  c.median_param_rel = Median(per_param);
  c.loss_rel =
      ref_loss != 0 ? std::abs(loss - ref_loss) / std::abs(ref_loss) : std::abs(loss - ref_loss);
  return c;
}

nlohmann::json ComparisonJson(const Comparison& c) {
  return {{"grad_rel_err", c.grad_rel},           {"median_param_rel_err", c.median_param_rel},
          {"max_param_rel_err", c.max_param_rel}, {"max_param", c.max_param},
          {"loss_rel_err", c.loss_rel},           {"param_rel_err", nlohmann::json(c.per_param)}};
}

struct CheckRow {
  std::string method;
  std::string status;  // "ok", "n/a", "OOM", "error"
  std::string note;
  Comparison vs_reference;   // against the float32 (float64) dense reference
  Comparison vs_same_dense;  // against dense in the benchmark dtype
  double loss = 0;
};

struct CheckResult {
  bool ran = false;
  std::string config_name;
  ModelConfig config;
  std::string reference_dtype, dtype, loss;
  int64_t rollouts = 0, rollout_tokens = 0, tree_tokens = 0;
  double compression = 0;
  double reference_loss = 0;
  std::vector<CheckRow> rows;
  std::string error;  // set when the check itself could not run

  // Every method that ran is under the target (OOM and n/a rows do not count against it).
  bool Passed() const {
    if (!error.empty()) return false;
    for (const CheckRow& row : rows) {
      if (row.status == "error") return false;
      if (row.status == "ok" && !(row.vs_reference.median_param_rel < kCheckTarget)) return false;
    }
    return true;
  }
};

struct MethodResult {
  std::string name;
  nlohmann::json options;
  std::string status;  // "ok", "n/a", "OOM", "error"
  std::string note;
  std::vector<double> warmup_seconds, step_seconds;
  double median_seconds = std::nan("");
  double loss = std::nan("");
  int64_t forwarded_tokens = 0;
  int64_t block_size = 0, graph_budget = 0;  // dta: what the step ran with, automatic ones resolved
  double memory_before_gib = 0, peak_gib = std::nan(""), peak_reserved_gib = std::nan("");
  std::string profile_md;  // --profile: the profiled step, Markdown
  bool ok() const { return status == "ok"; }
};

std::string Elapsed(std::chrono::steady_clock::time_point start) {
  return absl::StrFormat(
      "%.1fs", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

const auto kStart = std::chrono::steady_clock::now();

// Under tensor parallelism rank 0 speaks for all (the ranks run the same steps).
bool quiet = false;

void Progress(const std::string& message) {
  if (quiet) return;
  std::cerr << "dta-bench [" << Elapsed(kStart) << "] " << message << std::endl;
}

// The model's collectives under --tensor_parallel (null: one process). Every model the benchmark
// builds is split with them.
std::shared_ptr<const TensorParallelGroup> tensor_parallel;

// Tokens the packed method forwards without checkpointing: Tree Training's partition of the tree
// under the token capacity (the whole tree when there is none).
int64_t PackedTokens(absl::Span<const Rollout> rollouts, int64_t capacity) {
  std::vector<std::vector<TokenId>> sequences;
  for (const Rollout& r : rollouts) sequences.push_back(r.tokens);
  const PrefixTree tree = *PrefixTree::FromRollouts(sequences);
  if (capacity <= 0) return tree.num_tree_tokens();
  absl::StatusOr<TreePartition> partition = PartitionTreeGreedy(tree, capacity);
  return partition.ok() ? partition->total_tokens : tree.num_tree_tokens();
}

// Throws Unsupported if the step did not do what the method asks: packed with checkpointing must
// forward its tokens twice (the executor counts replayed layers' tokens in forwarded_tokens), so
// an executor without packed checkpointing is reported as n/a instead of timed under that name.
void CheckHonoured(const MethodSpec& spec, absl::Span<const Rollout> rollouts,
                   const GradientResult& r) {
  if (spec.options.method != Method::kPacked || !spec.options.checkpointing) return;
  const int64_t plain = PackedTokens(rollouts, spec.options.token_capacity);
  if (r.forwarded_tokens <= plain) {
    throw Unsupported{absl::StrFormat(
        "the executor's packed method does not checkpoint (a step forwarded %d tokens, "
        "as packed without checkpointing does)",
        r.forwarded_tokens)};
  }
}

// Runs `f`, turning an out-of-memory error into status "OOM", Unsupported into "n/a" and any other
// error into "error".
template <typename F>
void Guarded(const std::string& what, std::string& status, std::string& note,
             const at::Device& device, F&& f) {
  try {
    f();
    status = "ok";
    return;
  } catch (const c10::Error& e) {
    if (IsOutOfMemory(e)) {
      status = "OOM";
      note = std::string(e.what_without_backtrace()).substr(0, 300);
    } else {
      status = "error";
      note = e.what_without_backtrace();
    }
  } catch (const std::bad_alloc&) {
    status = "OOM";
    note = "std::bad_alloc";
  } catch (const Unsupported& e) {
    status = "n/a";
    note = e.reason;
  }
  Progress(what + ": " + status + ": " + note);
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
}

// The check's built-in shape: the benchmarked model's family (its norms, biases, rope, layer
// pattern and routing options) at hidden 256, 4 layers, 4 heads / 2 KV heads x 64, with at most 16
// experts and the linear layers' heads at 32 dimensions, so that the check covers the family's own
// code paths at a size a float32 reference runs quickly.
ModelConfig SmallCheckConfig(const ModelConfig& model, int64_t vocab) {
  constexpr int64_t kLayers = 4;
  ModelConfig c = model;
  c.vocab_size = vocab;
  c.hidden_size = 256;
  c.intermediate_size = 768;
  c.num_hidden_layers = kLayers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.torch_dtype = "float32";
  if (!c.layer_types.empty()) {
    c.layer_types.resize(kLayers, LayerType::kFullAttention);
    // At least one layer of each kind the model has.
    c.layer_types.back() = LayerType::kFullAttention;
    if (IsLinearAttentionLayer(model, 0) || IsLinearAttentionLayer(model, 1))
      c.layer_types.front() = LayerType::kLinearAttention;
    if (c.linear_num_key_heads > 0) {
      c.linear_num_value_heads = 2 * (model.linear_num_value_heads / model.linear_num_key_heads);
      c.linear_num_key_heads = 2;
      c.linear_key_head_dim = 32;
      c.linear_value_head_dim = 32;
    }
  }
  if (c.num_experts > 0) {
    c.num_experts = std::min<int64_t>(c.num_experts, 16);
    c.num_experts_per_tok = std::min(c.num_experts_per_tok, c.num_experts);
    c.moe_intermediate_size = 64;
    std::erase_if(c.mlp_only_layers, [](int64_t layer) { return layer >= kLayers; });
  }
  if (c.shared_expert_intermediate_size > 0) c.shared_expert_intermediate_size = 64;
  return c;
}

CheckResult RunCheck(const std::vector<Rollout>& rollouts, const std::vector<MethodSpec>& methods,
                     at::ScalarType dtype, const at::Device& device, const LossOptions& bench_loss,
                     const ModelConfig& model_config) {
  CheckResult check;
  check.ran = true;
  const std::string loss_name = absl::GetFlag(FLAGS_check_loss);
  LossOptions loss = bench_loss;
  if (loss_name == "sft") {
    loss.kind = LossKind::kSft;
  } else if (loss_name != "same") {
    throw BadInput{"--check_loss must be sft or same, got '" + loss_name + "'"};
  }
  check.loss = loss_name == "sft" ? "sft (token-mean NLL)" : "the benchmark's loss";

  // The first N rollouts in lexicographic order of their tokens: they share prefixes.
  const int32_t n = absl::GetFlag(FLAGS_check_rollouts);
  if (n < 1) throw BadInput{"--check_rollouts must be >= 1"};
  std::vector<size_t> order(rollouts.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return rollouts[a].tokens < rollouts[b].tokens ||
           (rollouts[a].tokens == rollouts[b].tokens && a < b);
  });
  std::vector<Rollout> subset;
  TokenId max_token = 1;
  for (size_t i = 0; i < order.size() && static_cast<int32_t>(subset.size()) < n; ++i) {
    subset.push_back(rollouts[order[i]]);
  }
  std::vector<std::vector<TokenId>> sequences;
  for (const Rollout& r : subset) {
    sequences.push_back(r.tokens);
    for (TokenId t : r.tokens) max_token = std::max(max_token, t);
  }
  const TreeStats stats = ComputeTreeStats(*PrefixTree::FromRollouts(sequences));
  check.rollouts = stats.num_rollouts;
  check.rollout_tokens = stats.rollout_tokens;
  check.tree_tokens = stats.tree_tokens;
  check.compression = stats.compression;

  const std::string config_name = absl::GetFlag(FLAGS_check_config);
  if (config_name.empty()) {
    check.config_name = "small " + model_config.model_type + " (built in)";
    check.config = SmallCheckConfig(model_config, static_cast<int64_t>(max_token) + 1);
  } else {
    check.config_name = config_name;
    check.config = LoadConfig("check_config", config_name);
    if (check.config.vocab_size <= max_token) {
      throw BadInput{absl::StrFormat(
          "--check_config=%s: vocabulary %d, but the check's rollouts hold token %d", config_name,
          check.config.vocab_size, max_token)};
    }
  }
  const at::ScalarType reference_dtype = dtype == at::kDouble ? at::kDouble : at::kFloat;
  check.reference_dtype = DtypeName(reference_dtype);
  check.dtype = DtypeName(dtype);
  Progress(absl::StrFormat("check: %d rollouts (%d rollout tokens, %d unique), %s dense reference",
                           check.rollouts, check.rollout_tokens, check.tree_tokens,
                           check.reference_dtype));

  try {
    Decoder reference(check.config, at::TensorOptions().dtype(reference_dtype).device(device),
                      tensor_parallel);
    InitOnDevice(reference, absl::GetFlag(FLAGS_init_seed), absl::GetFlag(FLAGS_init_std));
    ZeroGrads(reference);
    const GradientResult ref =
        ComputeGradients(reference, subset, loss, {.method = Method::kDense});
    check.reference_loss = ref.loss;
    const std::vector<at::Tensor> ref_grads = Grads(reference, reference_dtype);

    Decoder model(check.config, at::TensorOptions().dtype(dtype).device(device), tensor_parallel);
    CopyWeights(reference, model);
    std::vector<at::Tensor> dense_grads;
    double dense_loss = 0;
    // Dense in the benchmark dtype first: the dtype's own error, and each method's error beyond it.
    std::vector<const MethodSpec*> order_run;
    MethodSpec dense;
    dense.name = "dense";
    dense.options.method = Method::kDense;
    order_run.push_back(&dense);
    for (const MethodSpec& m : methods) {
      if (m.name != "dense") order_run.push_back(&m);
    }
    for (const MethodSpec* m : order_run) {
      CheckRow row;
      row.method = m->name;
      if (!m->unsupported.empty()) {
        row.status = "n/a";
        row.note = m->unsupported;
      } else {
        Guarded("check " + m->name, row.status, row.note, device, [&] {
          ZeroGrads(model);
          const GradientResult r = ComputeGradients(model, subset, loss, m->options);
          CheckHonoured(*m, subset, r);
          const std::vector<at::Tensor> grads = Grads(model, reference_dtype);
          row.loss = r.loss;
          row.vs_reference = Compare(grads, r.loss, ref_grads, ref.loss, model);
          if (m == &dense) {
            dense_grads = grads;
            dense_loss = r.loss;
          }
          if (!dense_grads.empty())
            row.vs_same_dense = Compare(grads, r.loss, dense_grads, dense_loss, model);
        });
      }
      if (row.status == "ok") {
        Progress(absl::StrFormat(
            "check %s: grad rel err %.3g, median param %.3g, max param %.3g (%s), loss %.3g",
            row.method, row.vs_reference.grad_rel, row.vs_reference.median_param_rel,
            row.vs_reference.max_param_rel, row.vs_reference.max_param, row.vs_reference.loss_rel));
      }
      check.rows.push_back(std::move(row));
    }
  } catch (const c10::Error& e) {
    check.error = e.what_without_backtrace();
    Progress("check failed: " + check.error);
  }
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
  return check;
}

MethodResult RunMethod(const Decoder& model, const std::vector<Rollout>& rollouts,
                       const LossOptions& loss, const MethodSpec& spec, int index, int count,
                       MemoryMeter& memory, const at::Device& device) {
  MethodResult result;
  result.name = spec.name;
  result.options = OptionsJson(spec.options);
  const std::string tag = absl::StrFormat("[%d/%d] %s", index, count, spec.name);
  if (!spec.unsupported.empty()) {
    result.status = "n/a";
    result.note = spec.unsupported;
    Progress(tag + ": n/a: " + spec.unsupported);
    return result;
  }
  ZeroGrads(model);
  Synchronize(device);
  memory.Reset();
  result.memory_before_gib = memory.CurrentGiB();
  const int warmup = absl::GetFlag(FLAGS_warmup), repeats = absl::GetFlag(FLAGS_repeats);
  Guarded(tag, result.status, result.note, device, [&] {
    for (int step = 0; step < warmup + repeats; ++step) {
      Synchronize(device);
      const auto start = std::chrono::steady_clock::now();
      if (!spec.options.replace_gradients) ZeroGrads(model);
      const GradientResult r = ComputeGradients(model, rollouts, loss, spec.options);
      Synchronize(device);
      if (step == 0) CheckHonoured(spec, rollouts, r);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const bool warm = step < warmup;
      (warm ? result.warmup_seconds : result.step_seconds).push_back(seconds);
      result.loss = r.loss;
      result.forwarded_tokens = r.forwarded_tokens;
      result.block_size = r.block_size;
      result.graph_budget = r.graph_budget;
      Progress(absl::StrFormat("%s: %s %d/%d: %.3f s, %.0f rollout tok/s, loss %.6g", tag,
                               warm ? "warm-up" : "step", warm ? step + 1 : step - warmup + 1,
                               warm ? warmup : repeats, seconds, r.rollout_tokens / seconds,
                               r.loss));
    }
    if (absl::GetFlag(FLAGS_profile)) {
      const bench::StepProfile profile = bench::ProfileStep(
          [&] {
            Synchronize(device);
            if (!spec.options.replace_gradients) ZeroGrads(model);
            ComputeGradients(model, rollouts, loss, spec.options);
            Synchronize(device);
          },
          device);
      result.profile_md =
          bench::ProfileMarkdown(profile, spec.name, absl::GetFlag(FLAGS_profile_top));
      Progress(absl::StrFormat("%s: profiled step: %.3f s, %d %s", tag, profile.wall_ms / 1e3,
                               profile.events,
                               profile.device_events ? "GPU activities" : "CPU operator calls"));
    }
  });
  result.peak_gib = memory.PeakGiB();
  result.peak_reserved_gib = memory.PeakReservedGiB();
  if (result.ok()) result.median_seconds = Median(result.step_seconds);
  if (result.ok() && spec.options.memory_budget > 0) {
    result.note =
        absl::StrFormat("%.2f GiB budget: B %d, graph budget %d", spec.options.memory_budget / kGiB,
                        result.block_size, result.graph_budget);
  }
  ZeroGrads(model);
  return result;
}

// ---------------------------------------------------------------------------------------------
// Output

std::optional<double> Opt(double v) {
  return std::isfinite(v) ? std::optional<double>(v) : std::nullopt;
}

nlohmann::json J(std::optional<double> v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

// "1.72B", "596M", "0.27M".
std::string Count(double v) {
  if (v >= 1e9) return absl::StrFormat("%.2fB", v / 1e9);
  if (v >= 1e7) return absl::StrFormat("%.0fM", v / 1e6);
  return absl::StrFormat("%.2fM", v / 1e6);
}

std::string F2(std::optional<double> v) { return v ? absl::StrFormat("%.2f", *v) : "n/a"; }
std::string F3(std::optional<double> v) { return v ? absl::StrFormat("%.3f", *v) : "n/a"; }
std::string X2(std::optional<double> v) { return v ? absl::StrFormat("%.2fx", *v) : "n/a"; }
std::string Pct(std::optional<double> v) { return v ? absl::StrFormat("%.1f%%", 100 * *v) : "n/a"; }
std::string E2(std::optional<double> v) { return v ? absl::StrFormat("%.2e", *v) : "n/a"; }
std::string Int(double v) {
  std::string digits = absl::StrFormat("%.0f", v);
  std::string out;
  const int n = static_cast<int>(digits.size());
  for (int i = 0; i < n; ++i) {
    out += digits[i];
    if ((n - 1 - i) % 3 == 0 && i != n - 1 && digits[i] != '-') out += ',';
  }
  return out;
}

std::string Timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buffer[32];
  std::strftime(buffer, sizeof(buffer), "%Y%m%d-%H%M%S", &tm);
  return buffer;
}

std::string ShellQuote(const std::string& arg) {
  if (!arg.empty() && arg.find_first_of(" \t\n'\"\\$`*?;&|<>()") == std::string::npos) return arg;
  std::string out = "'";
  for (char c : arg) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

int Run(int argc, char** argv) {
  const std::string path = absl::GetFlag(FLAGS_rollouts);
  if (path.empty())
    throw BadInput{"--rollouts is required (a JSON Lines file, e.g. from dta-workload)"};
  if (!std::filesystem::exists(path)) throw BadInput{"--rollouts: no such file '" + path + "'"};
  if (absl::GetFlag(FLAGS_warmup) < 0) throw BadInput{"--warmup must be >= 0"};
  if (absl::GetFlag(FLAGS_repeats) < 1) throw BadInput{"--repeats must be >= 1"};
  if (absl::GetFlag(FLAGS_profile_top) < 1) throw BadInput{"--profile_top must be >= 1"};
  if (absl::GetFlag(FLAGS_token_capacity) < 0) throw BadInput{"--token_capacity must be >= 0"};
  if (absl::GetFlag(FLAGS_graph_budget) < -1)
    throw BadInput{"--graph_budget must be >= 0, or -1 (automatic)"};
  if (absl::GetFlag(FLAGS_max_rollouts) < 0) throw BadInput{"--max_rollouts must be >= 0"};
  if (absl::GetFlag(FLAGS_logprob_slice_rows) < 1)
    throw BadInput{"--logprob_slice_rows must be >= 1"};
  if (!(absl::GetFlag(FLAGS_peak_tflops) > 0)) throw BadInput{"--peak_tflops must be positive"};
  std::vector<MethodSpec> methods = ParseMethods();
  const at::ScalarType dtype = ParseDtype(absl::GetFlag(FLAGS_dtype));
  const std::string config_name = absl::GetFlag(FLAGS_config);
  const ModelConfig config = LoadConfig("config", config_name);
  const int tp = absl::GetFlag(FLAGS_tensor_parallel);
  if (tp < 1) throw BadInput{"--tensor_parallel must be >= 1"};
  if (absl::GetFlag(FLAGS_timeout_s) < 1) throw BadInput{"--timeout_s must be >= 1"};
  std::string device_spec = absl::GetFlag(FLAGS_device);
  LaunchEnvironment env;
  if (tp > 1) {
    absl::StatusOr<LaunchEnvironment> from_env = LaunchEnvironmentFromEnv();
    if (!from_env.ok()) throw BadInput{std::string(from_env.status().message())};
    env = *from_env;
    if (env.world_size != tp) {
      throw BadInput{absl::StrFormat(
          "--tensor_parallel=%d: start exactly %d ranks (torchrun --nproc_per_node=%d); "
          "WORLD_SIZE is %d",
          tp, tp, tp, env.world_size)};
    }
    if (device_spec == "cuda") device_spec = absl::StrCat("cuda:", env.local_rank);
    quiet = env.rank != 0;
  }
  const DeviceInfo device = OpenDevice(device_spec);
  std::unique_ptr<ProcessGroup> world;
  std::unique_ptr<ParallelGroups> groups;
  if (tp > 1) {
    ProcessGroupOptions options;
    options.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s));
    absl::StatusOr<std::unique_ptr<ProcessGroup>> created = ProcessGroup::Create(
        env, device.device.is_cuda() ? device.device : at::Device(at::kCPU), options);
    if (!created.ok()) throw BadInput{std::string(created.status().message())};
    world = *std::move(created);
    groups = std::make_unique<ParallelGroups>(*world, tp, options);
    tensor_parallel = groups->tensor_parallel_collectives();
  }
  LossOptions loss;  // GRPO: PPO clip 0.2/0.2, token-mean, group advantages (dta-train's default)
  const std::string loss_flag = absl::GetFlag(FLAGS_loss);
  if (loss_flag == "sft") {
    loss.kind = LossKind::kSft;
  } else if (loss_flag != "grpo") {
    throw BadInput{"--loss must be grpo or sft, got '" + loss_flag + "'"};
  }
  const std::string loss_name = loss_flag == "sft"
                                    ? "sft (token-mean NLL)"
                                    : "grpo (PPO clip 0.2/0.2, token-mean, group advantages)";

  absl::StatusOr<std::vector<Rollout>> read =
      ReadRolloutsJsonl(path, {.vocab_size = config.vocab_size});
  if (!read.ok()) throw BadInput{std::string(read.status().message())};
  std::vector<Rollout> rollouts = *std::move(read);
  if (rollouts.empty()) throw BadInput{"--rollouts: '" + path + "' holds no rollouts"};
  const int64_t max_rollouts = absl::GetFlag(FLAGS_max_rollouts);
  if (max_rollouts > 0 && static_cast<int64_t>(rollouts.size()) > max_rollouts)
    rollouts.resize(max_rollouts);
  std::vector<std::vector<TokenId>> sequences;
  std::vector<absl::Span<const uint8_t>> loss_masks;
  for (const Rollout& r : rollouts) {
    sequences.push_back(r.tokens);
    loss_masks.push_back(r.loss_mask);
  }
  const PrefixTree tree = *PrefixTree::FromRollouts(sequences);
  const TreeStats stats = ComputeTreeStats(tree);
  // The unique tokens whose log-probability a loss reads: dta's methods run the LM head on those
  // alone (executor/engine/methods.h's LogprobPositions; all of them with DTA_LOSS_ROWS_ONLY=0).
  const std::vector<uint8_t> read_flags = *MarksOfTreeTokens(tree, loss_masks);
  const int64_t read_tokens = EnvSwitchOn("DTA_LOSS_ROWS_ONLY")
                                  ? std::count(read_flags.begin(), read_flags.end(), uint8_t{1})
                                  : stats.tree_tokens;
  // GRPO advantages are 0 when every group's rewards are equal (a batch cut from one group, say):
  // the loss and every gradient are then exactly 0, which a benchmark must not time silently.
  std::string loss_warning;
  if (loss.kind == LossKind::kPpo) {
    bool all_zero = true;
    for (const std::vector<float>& a : ComputeAdvantages(rollouts)) {
      all_zero = all_zero && std::all_of(a.begin(), a.end(), [](float x) { return x == 0; });
    }
    if (all_zero) {
      loss_warning =
          "every GRPO advantage is 0 (equal rewards within every group): the loss and the "
          "gradients are 0";
      Progress("WARNING: " + loss_warning);
    }
  }
  std::string label = absl::GetFlag(FLAGS_label);
  if (label.empty()) label = std::filesystem::path(path).stem().string();

  std::string out_dir = absl::GetFlag(FLAGS_out_dir);
  if (out_dir.empty()) out_dir = "bench/results/" + Timestamp();
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) throw BadInput{"--out_dir: cannot create '" + out_dir + "': " + ec.message()};

  const int64_t packed_tokens = PackedTokens(rollouts, absl::GetFlag(FLAGS_token_capacity));
  const FlopModel flops(config);
  const double dense_flops = flops.Flops(stats.rollout_tokens, stats.dense_attention_work);
  const double tree_flops = flops.Flops(stats.tree_tokens, stats.tree_attention_work);
  // The tree FLOPs less the LM head's on the unique tokens it skips: what the step computes.
  const double computed_flops =
      tree_flops - flops.lm_head_per_token * static_cast<double>(stats.tree_tokens - read_tokens);
  const double ideal = dense_flops / tree_flops;

  Progress(absl::StrFormat("device %s (%s), torch %s%s", device.name, device.device.str(),
                           TORCH_VERSION,
                           device.cuda_runtime.empty() ? "" : ", CUDA " + device.cuda_runtime));
  Progress(absl::StrFormat(
      "workload %s: %d rollouts, %d rollout tokens, %d unique (C = %.3f, C_attn = %.3f), "
      "longest %d; ideal speedup vs dense %.2fx",
      label, stats.num_rollouts, stats.rollout_tokens, stats.tree_tokens, stats.compression,
      stats.attention_compression, stats.longest_rollout, ideal));

  CheckResult check;
  if (absl::GetFlag(FLAGS_check))
    check = RunCheck(rollouts, methods, dtype, device.device, loss, config);

  Progress(absl::StrFormat(
      "model %s: %d layers, hidden %d, %s matmul parameters, %s on %s; random weights", config_name,
      config.num_hidden_layers, config.hidden_size, Count(flops.matmul_parameters),
      DtypeName(dtype), device.device.str()));
  MemoryMeter memory(device.device);
  std::vector<MethodResult> results;
  double weights_gib = 0;
  {
    Decoder model(config, at::TensorOptions().dtype(dtype).device(device.device), tensor_parallel);
    InitOnDevice(model, absl::GetFlag(FLAGS_init_seed), absl::GetFlag(FLAGS_init_std));
    Synchronize(device.device);
    weights_gib = memory.CurrentGiB();
    for (size_t i = 0; i < methods.size(); ++i) {
      if (methods[i].budget_half_of_dense) {
        const auto dense = std::find_if(results.begin(), results.end(), [](const MethodResult& r) {
          return r.name == "dense" && r.ok();
        });
        if (dense == results.end()) {
          methods[i].unsupported = "-mhalf needs dense listed before it, and dense to have run";
        } else {
          methods[i].options.memory_budget = static_cast<int64_t>(dense->peak_gib / 2 * kGiB);
        }
      }
      results.push_back(RunMethod(model, rollouts, loss, methods[i], static_cast<int>(i + 1),
                                  static_cast<int>(methods.size()), memory, device.device));
    }
  }

  // Derived numbers.
  auto find = [&](const std::string& name) -> const MethodResult* {
    for (const MethodResult& r : results) {
      if (r.name == name && r.ok()) return &r;
    }
    return nullptr;
  };
  const MethodResult* dense = find("dense");
  const MethodResult* dense_ckpt = find("dense-ckpt");
  const double peak = absl::GetFlag(FLAGS_peak_tflops) * 1e12;
  const bool cuda = device.device.is_cuda();

  nlohmann::json methods_json = nlohmann::json::array();
  std::string table =
      "| Method | Step time (s) | Rollout tok/s | vs dense | vs dense-ckpt | Peak mem (GiB) | Mem "
      "vs dense | MFU | "
      "% of ideal | Grad rel err | Median param rel err | Loss rel err |\n"
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
  for (const MethodResult& r : results) {
    const CheckRow* row = nullptr;
    for (const CheckRow& c : check.rows) {
      if (c.method == r.name && c.status == "ok") row = &c;
    }
    std::optional<double> seconds, throughput, vs_dense, vs_ckpt, mem_vs_dense, mfu, mfu_dense,
        mfu_computed, of_ideal, peak_mem;
    if (r.ok()) {
      seconds = r.median_seconds;
      throughput = stats.rollout_tokens / r.median_seconds;
      if (dense) vs_dense = dense->median_seconds / r.median_seconds;
      if (dense_ckpt) vs_ckpt = dense_ckpt->median_seconds / r.median_seconds;
      if (cuda) {
        mfu = tree_flops / r.median_seconds / (peak * tp);
        mfu_dense = dense_flops / r.median_seconds / (peak * tp);
        mfu_computed = computed_flops / r.median_seconds / (peak * tp);
      }
      if (vs_dense) of_ideal = *vs_dense / ideal;
    }
    if (r.ok() || r.status == "OOM") peak_mem = Opt(r.peak_gib);
    if (r.ok() && dense) mem_vs_dense = r.peak_gib / dense->peak_gib;
    const std::string shown_time = r.ok() ? F3(seconds) : r.status;
    table +=
        absl::StrFormat("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", r.name,
                        shown_time, throughput ? Int(*throughput) : r.status, X2(vs_dense),
                        X2(vs_ckpt), r.ok() ? F2(peak_mem) : r.status, X2(mem_vs_dense), Pct(mfu),
                        Pct(of_ideal), row ? E2(row->vs_reference.grad_rel) : "n/a",
                        row ? E2(row->vs_reference.median_param_rel) : "n/a",
                        row ? E2(row->vs_reference.loss_rel) : "n/a");
    nlohmann::json m = {
        {"name", r.name},
        {"options", r.options},
        {"status", r.status},
        {"note", r.note},
        {"warmup_seconds", r.warmup_seconds},
        {"step_seconds", r.step_seconds},
        {"median_step_seconds", J(seconds)},
        {"rollout_tokens_per_second", J(throughput)},
        {"unique_tokens_per_second",
         J(r.ok() ? Opt(stats.tree_tokens / r.median_seconds) : std::nullopt)},
        {"speedup_vs_dense", J(vs_dense)},
        {"speedup_vs_dense_ckpt", J(vs_ckpt)},
        {"peak_memory_gib", J(peak_mem)},
        {"peak_reserved_gib",
         J(r.ok() || r.status == "OOM" ? Opt(r.peak_reserved_gib) : std::nullopt)},
        {"memory_before_gib",
         r.status == "n/a" ? nlohmann::json(nullptr) : nlohmann::json(r.memory_before_gib)},
        {"memory_vs_dense", J(mem_vs_dense)},
        {"mfu", J(mfu)},
        {"mfu_dense_counted", J(mfu_dense)},
        {"mfu_lm_head_on_read_tokens", J(mfu_computed)},
        {"fraction_of_ideal", J(of_ideal)},
        {"loss", J(r.ok() ? Opt(r.loss) : std::nullopt)},
        {"ran_with", r.ok() && r.block_size > 0 ? nlohmann::json{{"block_size", r.block_size},
                                                                 {"graph_budget", r.graph_budget}}
                                                : nlohmann::json(nullptr)},
        {"forwarded_tokens",
         r.ok() ? nlohmann::json(r.forwarded_tokens) : nlohmann::json(nullptr)}};
    m["check"] = row ? nlohmann::json({{"vs_reference", ComparisonJson(row->vs_reference)},
                                       {"vs_dense_same_dtype", ComparisonJson(row->vs_same_dense)}})
                     : nlohmann::json(nullptr);
    methods_json.push_back(m);
  }

  std::vector<std::string> args;
  for (int i = 0; i < argc; ++i) args.push_back(ShellQuote(argv[i]));
  const std::string command = absl::StrJoin(args, " ");

  nlohmann::json check_json = nullptr;
  if (check.ran) {
    nlohmann::json rows = nlohmann::json::array();
    for (const CheckRow& c : check.rows) {
      rows.push_back({{"method", c.method},
                      {"status", c.status},
                      {"note", c.note},
                      {"loss", c.status == "ok" ? nlohmann::json(c.loss) : nlohmann::json(nullptr)},
                      {"vs_reference",
                       c.status == "ok" ? ComparisonJson(c.vs_reference) : nlohmann::json(nullptr)},
                      {"vs_dense_same_dtype", c.status == "ok" ? ComparisonJson(c.vs_same_dense)
                                                               : nlohmann::json(nullptr)}});
    }
    check_json = {{"config_name", check.config_name},
                  {"passed", check.Passed()},
                  {"config", nlohmann::json::parse(ModelConfigToJson(check.config))},
                  {"reference", check.reference_dtype + " dense"},
                  {"dtype", check.dtype},
                  {"loss", check.loss},
                  {"rollouts", check.rollouts},
                  {"rollout_tokens", check.rollout_tokens},
                  {"tree_tokens", check.tree_tokens},
                  {"compression", check.compression},
                  {"reference_loss", check.reference_loss},
                  {"error", check.error},
                  {"target_median_param_rel_err", kCheckTarget},
                  {"rows", rows}};
  }

  const nlohmann::json json = {
      {"tool", "dta-bench"},
      {"command", command},
      {"timestamp", Timestamp()},
      {"label", label},
      {"rollouts_file", path},
      {"device",
       {{"name", device.name},
        {"device", device.device.str()},
        {"memory_gib", device.memory_gib},
        {"cuda_runtime", device.cuda_runtime},
        {"cuda_driver", device.cuda_driver}}},
      {"torch_version", TORCH_VERSION},
      {"model",
       {{"name", config_name},
        {"config", nlohmann::json::parse(ModelConfigToJson(config))},
        {"matmul_parameters", flops.matmul_parameters},
        {"weights_gib", weights_gib}}},
      {"dtype", DtypeName(dtype)},
      {"loss", loss_name},
      {"loss_warning", loss_warning},
      {"warmup", absl::GetFlag(FLAGS_warmup)},
      {"repeats", absl::GetFlag(FLAGS_repeats)},
      {"peak_tflops", absl::GetFlag(FLAGS_peak_tflops)},
      {"tensor_parallel", tp},
      {"memory_measure", memory.Kind()},
      {"workload",
       {{"label", label},
        {"rollouts", stats.num_rollouts},
        {"rollout_tokens", stats.rollout_tokens},
        {"unique_tokens", stats.tree_tokens},
        {"compression", stats.compression},
        {"attention_compression", stats.attention_compression},
        {"leaf_compression", stats.leaf_compression},
        {"potential_overlap_ratio", stats.potential_overlap_ratio},
        {"longest_rollout", stats.longest_rollout},
        {"dense_attention_work", stats.dense_attention_work},
        {"tree_attention_work", stats.tree_attention_work},
        {"packed_token_capacity", absl::GetFlag(FLAGS_token_capacity)},
        {"packed_tokens", packed_tokens}}},
      {"flops",
       {{"per_token", flops.per_token},
        {"per_attention_pair", flops.per_attention_pair},
        {"dense", dense_flops},
        {"tree", tree_flops},
        {"tree_lm_head_on_read_tokens", computed_flops},
        {"read_tokens", read_tokens},
        {"ideal_speedup_vs_dense", ideal},
        {"ideal_speedup_vs_dense_ckpt", ideal * kCheckpointingFactor},
        {"definition",
         "per step: 6 x matmul parameters (the linear layers a token uses and lm_head) x tokens + "
         "12 x full-attention layers x "
         "heads x head_dim x "
         "attention work (query-key pairs, TreeStats); dense = every rollout token on its own, "
         "tree = each unique "
         "token once; ideal speedup vs dense = dense / tree; dense-ckpt does about 4/3 of dense's "
         "FLOPs; MFU = tree "
         "FLOPs / step time / (peak x tensor_parallel GPUs); mfu_dense_counted = dense FLOPs / "
         "step time / (peak x GPUs); mfu_lm_head_on_read_tokens = MFU with lm_head's FLOPs counted "
         "only on the read_tokens unique tokens whose log-probability a loss reads (where dta "
         "runs it); "
         "fraction_of_ideal = speedup "
         "vs dense / ideal speedup vs dense"}}},
      {"methods", methods_json},
      {"check", check_json},
  };

  std::string md = absl::StrFormat("# dta-bench: %s on %s\n\n", label, config_name);
  md += absl::StrFormat(
      "- Device: %s (%s), torch %s%s\n", device.name, device.device.str(), TORCH_VERSION,
      cuda
          ? absl::StrFormat(", CUDA runtime %s, driver %s", device.cuda_runtime, device.cuda_driver)
          : std::string());
  md += absl::StrFormat(
      "- Model: %s (%d layers, hidden %d, %d heads / %d KV heads x %d, intermediate %d, vocabulary "
      "%d; %s matmul "
      "parameters), %s, random weights (seed %d)%s\n",
      config_name, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
      config.num_key_value_heads, config.head_dim, config.intermediate_size, config.vocab_size,
      Count(flops.matmul_parameters), DtypeName(dtype), absl::GetFlag(FLAGS_init_seed),
      tp > 1 ? absl::StrFormat("; tensor parallelism over %d ranks (rank 0's times and memory, "
                               "MFU over %d GPUs)",
                               tp, tp)
             : std::string());
  md += absl::StrFormat(
      "- Workload: `%s`: %s rollouts, %s rollout tokens, %s unique tokens, C = %.3f, C_attn = "
      "%.3f, longest rollout "
      "%s tokens; packed forwards %s tokens at a capacity of %s (Tree Training's partition)\n",
      path, Int(stats.num_rollouts), Int(stats.rollout_tokens), Int(stats.tree_tokens),
      stats.compression, stats.attention_compression, Int(stats.longest_rollout),
      Int(packed_tokens), Int(absl::GetFlag(FLAGS_token_capacity)));
  md += absl::StrFormat(
      "- Step: %s, loss %s; %d warm-up step(s) discarded, median of %d timed steps, each between "
      "device synchronizations\n",
      absl::GetFlag(FLAGS_replace_gradients) ? "ComputeGradients replacing the gradients"
                                             : "zero gradients + ComputeGradients",
      loss_name, absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_repeats));
  if (!loss_warning.empty()) md += "- **Warning**: " + loss_warning + "\n";
  md +=
      absl::StrFormat("- Ideal speedup from the FLOP model: %.2fx vs dense, %.2fx vs dense-ckpt\n",
                      ideal, ideal * kCheckpointingFactor);
  md += "- Command: `" + command + "`\n\n";
  md += table;
  md += absl::StrFormat(
      "\nRollout tok/s counts every rollout token, shared or not (%s per step), for every method. "
      "Speedups are step-time "
      "ratios against dense and dense-ckpt from this run. Peak memory: %s. MFU = tree FLOPs (each "
      "unique token once) / "
      "step time / %.0f TFLOP/s, with FLOPs = 6 x matmul parameters (active ones, lm_head "
      "included) x tokens + 12 x full-attention layers x heads x "
      "head_dim x attention work (query-key pairs); n/a on the CPU. Ideal speedup = dense FLOPs / "
      "tree FLOPs (same FLOP "
      "model) = %.2fx; %% of ideal = speedup vs dense / ideal. Dense-ckpt replays the forward "
      "(about 4/3 of dense's "
      "FLOPs), so the ideal vs dense-ckpt is %.2fx. Error columns: the agreement check below (vs a "
      "%s dense "
      "reference).\n",
      Int(stats.rollout_tokens), memory.Kind(), absl::GetFlag(FLAGS_peak_tflops), ideal,
      ideal * kCheckpointingFactor, check.ran ? check.reference_dtype : "float32");
  if (read_tokens < stats.tree_tokens) {
    md += absl::StrFormat(
        "\nThe LM head runs only on the %s of %s unique tokens whose log-probability a loss reads "
        "(%.1f%%; the others are prompt, observation or tool tokens no rollout trains on): the "
        "MFU column counts its FLOPs on every token, as the FLOP model's convention is; counting "
        "them only where it runs, each MFU is %.3f times the column's "
        "(`mfu_lm_head_on_read_tokens` in results.json; DTA_LOSS_ROWS_ONLY=0 runs it everywhere)."
        "\n",
        Int(read_tokens), Int(stats.tree_tokens), 100.0 * read_tokens / stats.tree_tokens,
        computed_flops / tree_flops);
  }
  // What dta's automatic sizes resolved to, and the tokens forwarded beyond the unique ones
  // (recomputation, prefixes a sharing group repeats): the first thing to read when a dta step
  // falls short of its ideal (long paths whose graphs do not all fit).
  for (const MethodResult& r : results) {
    if (!r.ok() || r.block_size <= 0) continue;
    md += absl::StrFormat(
        "\n- %s ran with B = %s tokens and a graph budget of %s; it forwarded %s tokens, %.2fx the "
        "%s unique.",
        r.name, Int(r.block_size), Int(r.graph_budget), Int(r.forwarded_tokens),
        static_cast<double>(r.forwarded_tokens) / static_cast<double>(stats.tree_tokens),
        Int(stats.tree_tokens));
  }
  for (const MethodResult& r : results) {
    if (!r.ok() || !r.note.empty())
      md += absl::StrFormat("\n- %s: %s: %s", r.name, r.status, r.note);
  }
  md += "\n";
  if (check.ran) {
    md += absl::StrFormat(
        "\n## Agreement check\n\nShape: %s (%d layers, hidden %d, %d heads / %d KV heads x %d, "
        "vocabulary %d); "
        "the first %d rollouts in lexicographic order (%s rollout tokens, %s unique, C = %.2f); "
        "loss: %s. Reference: "
        "%s dense; every method in %s with the same weights. Relative errors: the whole gradient "
        "flattened "
        "(||g - g_ref|| / ||g_ref||), per parameter (median, max), the loss. Target: median "
        "per-parameter error "
        "under 1%%.\n\n",
        check.config_name, check.config.num_hidden_layers, check.config.hidden_size,
        check.config.num_attention_heads, check.config.num_key_value_heads, check.config.head_dim,
        check.config.vocab_size, check.rollouts, Int(check.rollout_tokens), Int(check.tree_tokens),
        check.compression, check.loss, check.reference_dtype, check.dtype);
    if (!check.error.empty()) md += "The check could not run: " + check.error + "\n\n";
    std::string floor;
    for (const CheckRow& c : check.rows) {
      if (c.method == "dense" && c.status == "ok") {
        floor = absl::StrFormat("; dense in %s itself is at a median of %.2e", check.dtype,
                                c.vs_reference.median_param_rel);
      }
    }
    md += absl::StrFormat("Verdict: %s%s.\n\n",
                          check.Passed() ? "passed (every median per-parameter error under 1%)"
                                         : "FAILED (target 1%)",
                          floor);
    md += absl::StrFormat(
        "| Method | Grad rel err | Median param rel err | Max param rel err | Worst parameter | "
        "Loss rel err | Grad rel "
        "err vs dense (%s) |\n| --- | --- | --- | --- | --- | --- | --- |\n",
        check.dtype);
    for (const CheckRow& c : check.rows) {
      if (c.status != "ok") {
        md += absl::StrFormat("| %s | %s | | | | | |\n", c.method, c.status);
        continue;
      }
      md += absl::StrFormat("| %s | %s | %s | %s | %s | %s | %s |\n", c.method,
                            E2(c.vs_reference.grad_rel), E2(c.vs_reference.median_param_rel),
                            E2(c.vs_reference.max_param_rel), c.vs_reference.max_param,
                            E2(c.vs_reference.loss_rel), E2(c.vs_same_dense.grad_rel));
    }
  }

  if (world) world->Barrier();  // every rank has run every method; rank 0 reports
  tensor_parallel.reset();      // before the groups it uses
  if (quiet) return 0;
  const std::filesystem::path dir(out_dir);
  std::ofstream(dir / "results.json") << json.dump(2) << "\n";
  std::ofstream(dir / "results.md") << md;
  for (const MethodResult& r : results) {
    if (!r.profile_md.empty()) std::ofstream(dir / ("profile-" + r.name + ".md")) << r.profile_md;
  }
  std::cout << md << std::flush;
  Progress("wrote " + (dir / "results.md").string() + " and " + (dir / "results.json").string());
  for (const MethodResult& r : results) {
    if (r.status == "error") return 1;
  }
  return 0;
}

}  // namespace
}  // namespace dta

int main(int argc, char** argv) {
  dta::SetProgramUsage(
      "dta-bench --rollouts=FILE.jsonl --config=qwen3-1.7b "
      "[--methods=dense,dense-ckpt,packed,dta-b2048,...] "
      "[--device=cuda] [--dtype=bfloat16] [--out_dir=DIR]");
  const std::vector<char*> rest = dta::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::cerr << "dta-bench: unexpected argument '" << rest[1] << "'\n";
    return dta::kExitBadInput;
  }
  try {
    return dta::Run(argc, argv);
  } catch (const dta::BadInput& e) {
    std::cerr << "dta-bench: " << e.message << "\n";
    return dta::kExitBadInput;
  } catch (const c10::Error& e) {
    std::cerr << "dta-bench: " << e.what_without_backtrace() << "\n";
    return dta::kExitBadInput;
  }
}

// dta-hf-logprobs: a test helper for tests/python/test_hf_parity*.py. Loads a Hugging Face
// checkpoint (Qwen3, Qwen2, Llama) with LoadHfModel, computes every rollout's per-token
// log-probabilities with ComputeLogprobs and writes them as JSON, {"rollout id": [logprob per
// token, 0 first], ...}; optionally the gradient of every parameter for the summed negative
// log-likelihood of the loss-masked tokens (an SFT loss without normalisation), and optionally
// saves the loaded model again with SaveHfModel (for loading into transformers).
//
//   dta-hf-logprobs MODEL_DIR ROLLOUTS.jsonl OUT.json DTYPE METHOD [options]
//     DTYPE   float32 | float64 (the model's dtype; the checkpoint is converted on load)
//     METHOD  dense | packed | dta
//   options:
//     --block-size N          dta's backward chunk size B (default unbounded)
//     --pack true|false       dta's packing (ExecutorOptions::pack; default: its default, on)
//     --gradients FILE        also write every parameter's gradient (safetensors, HF names) of
//                             -sum over rollouts and loss-masked tokens of the log-probability
//     --router-aux-loss-coef C  with --gradients: add the router's load-balancing loss
//                             (LossOptions::router_aux_loss_coef, normalised by the number of
//                             rollouts) and print "router_aux_loss VALUE" (the mean per rollout)
//     --resave DIR            also save the loaded model to DIR
//     --resave-dtype NAME     bfloat16 | float16 | float32 | float64 (default: DTYPE)
//     --resave-shard-bytes N  shard the resaved weights above N bytes (default 5 GiB)
//
// Exit status: 0 on success, 1 on an error (message on stderr), 2 on bad arguments.
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "core/io/rollout_jsonl.h"
#include "executor/engine/executor.h"
#include "executor/model/hf_checkpoint.h"
#include "nlohmann/json.hpp"

namespace dta {
namespace {

constexpr int kFailed = 1;
constexpr int kBadArguments = 2;

constexpr const char* kUsage =
    "usage: dta-hf-logprobs MODEL_DIR ROLLOUTS.jsonl OUT.json float32|float64 dense|packed|dta\n"
    "         [--block-size N] [--pack true|false] [--gradients FILE] [--router-aux-loss-coef C]\n"
    "         [--resave DIR]\n"
    "         [--resave-dtype bfloat16|float16|float32|float64]\n"
    "         [--resave-shard-bytes N]\n";

std::optional<at::ScalarType> ParseDtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "float64") return at::kDouble;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  return std::nullopt;
}

std::optional<int64_t> ParsePositive(const std::string& text) {
  try {
    size_t used = 0;
    const long long value = std::stoll(text, &used);
    if (used != text.size() || value <= 0) return std::nullopt;
    return value;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

int BadArguments(const std::string& why) {
  std::cerr << "dta-hf-logprobs: " << why << "\n" << kUsage;
  return kBadArguments;
}

int Run(int argc, char** argv) {
  std::vector<std::string> positional;
  ExecutorOptions options;
  std::string resave;
  std::string gradients;
  double router_aux_loss_coef = 0;
  std::optional<at::ScalarType> resave_dtype;
  int64_t shard_bytes = int64_t{5} << 30;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--", 0) == 0) {
      if (i + 1 >= argc) return BadArguments(arg + " needs a value");
      const std::string value = argv[++i];
      if (arg == "--resave") {
        resave = value;
      } else if (arg == "--gradients") {
        gradients = value;
      } else if (arg == "--router-aux-loss-coef") {
        char* end = nullptr;
        router_aux_loss_coef = std::strtod(value.c_str(), &end);
        if (value.empty() || *end != '\0')
          return BadArguments("--router-aux-loss-coef must be a number, not " + value);
      } else if (arg == "--pack") {
        if (value != "true" && value != "false")
          return BadArguments("--pack must be true or false, not " + value);
        options.pack = value == "true";
      } else if (arg == "--resave-dtype") {
        resave_dtype = ParseDtype(value);
        if (!resave_dtype) return BadArguments("unknown --resave-dtype " + value);
      } else if (arg == "--resave-shard-bytes" || arg == "--block-size") {
        const std::optional<int64_t> n = ParsePositive(value);
        if (!n) return BadArguments(arg + " must be a positive integer, not " + value);
        (arg == "--block-size" ? options.block_size : shard_bytes) = *n;
      } else {
        return BadArguments("unknown option " + arg);
      }
    } else {
      positional.push_back(arg);
    }
  }
  if (positional.size() != 5) return BadArguments("expected 5 arguments");
  const std::string& model_dir = positional[0];
  const std::string& rollouts_path = positional[1];
  const std::string& out_path = positional[2];
  const std::optional<at::ScalarType> dtype = ParseDtype(positional[3]);
  if (!dtype || (*dtype != at::kFloat && *dtype != at::kDouble)) {
    return BadArguments("DTYPE must be float32 or float64, not " + positional[3]);
  }
  const std::string& method = positional[4];
  if (method == "dense")
    options.method = Method::kDense;
  else if (method == "packed")
    options.method = Method::kPacked;
  else if (method == "dta")
    options.method = Method::kDta;
  else
    return BadArguments("METHOD must be dense, packed or dta, not " + method);

  try {
    const Decoder model = LoadHfModel(model_dir, at::TensorOptions().dtype(*dtype));
    absl::StatusOr<std::vector<Rollout>> rollouts =
        ReadRolloutsJsonl(rollouts_path, {.vocab_size = model.config().vocab_size});
    if (!rollouts.ok()) {
      std::cerr << "dta-hf-logprobs: " << rollouts.status().message() << "\n";
      return kFailed;
    }
    const std::vector<at::Tensor> logprobs = [&] {
      torch::autograd::AutoGradMode no_grad(false);
      return ComputeLogprobs(model, *rollouts, options);
    }();
    nlohmann::json out = nlohmann::json::object();
    for (size_t i = 0; i < rollouts->size(); ++i) {
      const at::Tensor values = logprobs[i].detach().to(at::kCPU, at::kDouble).contiguous();
      const double* data = values.const_data_ptr<double>();
      out[(*rollouts)[i].id] = std::vector<double>(data, data + values.numel());
    }
    std::ofstream file(out_path);
    file << out.dump() << "\n";
    file.close();
    if (!file) {
      std::cerr << "dta-hf-logprobs: cannot write " << out_path << "\n";
      return kFailed;
    }
    if (!gradients.empty()) {
      LossOptions sft;
      sft.kind = LossKind::kSft;
      sft.normalization = Normalization::kSum;
      sft.router_aux_loss_coef = router_aux_loss_coef;
      const GradientResult result = ComputeGradients(model, *rollouts, sft, options);
      if (router_aux_loss_coef != 0) {
        std::cout.precision(17);
        std::cout << "router_aux_loss " << result.router_aux_loss << "\n";
      }
      std::vector<std::pair<std::string, at::Tensor>> grads;
      for (const auto& [name, parameter] : model.named_parameters()) {
        TORCH_CHECK(parameter.grad().defined(), "no gradient for ", name);
        grads.emplace_back(name, parameter.grad());
      }
      SaveNamedTensors(grads, gradients);
    }
    if (!resave.empty()) SaveHfModel(model, resave, resave_dtype.value_or(*dtype), shard_bytes);
  } catch (const c10::Error& e) {
    std::cerr << "dta-hf-logprobs: " << e.what_without_backtrace() << "\n";
    return kFailed;
  }
  return 0;
}

}  // namespace
}  // namespace dta

int main(int argc, char** argv) { return dta::Run(argc, argv); }

// _core.Trainer: bindings/python/trainer.h for Python, with the options structs it takes. Long
// calls release the GIL; a Python loss callable is called back with it re-acquired.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bindings/python/bindings.h"
#include "bindings/python/rollout_conversion.h"
#include "bindings/python/trainer.h"
#include "core/layout/memory_plan.h"
#include "core/metrics/tensorboard_writer.h"
#include "core/model/config_json.h"
#include "core/model/family.h"
#include "core/model/model_config.h"
#include "core/progress/progress_line.h"
#include "core/schedule/lr_schedule.h"

namespace py = pybind11;

namespace dta::python {
namespace {

// A Python loss behind LossOptions::custom. `fn(index, logprobs, advantages, total_loss_tokens,
// num_rollouts, entropy, proximal_logprobs)` (None for what was not computed) is dta.trainer's
// adapter around the user's callable. Its Python exception is kept (with the GIL) and re-raised by
// the binding once the executor has unwound, so the caller sees the callable's own exception.
struct PythonLoss {
  py::function fn;
  const Rollout* first = nullptr;
  std::optional<py::error_already_set> error;

  at::Tensor operator()(const RolloutLossInputs& in, const BatchLossContext& batch) {
    py::gil_scoped_acquire gil;
    try {
      py::object advantages = py::none();
      if (in.advantages != nullptr) {
        advantages = py::cast(at::tensor(*in.advantages).to(in.logprobs.options()));
      }
      const auto optional = [](const at::Tensor& t) {
        return t.defined() ? py::cast(t) : py::object(py::none());
      };
      return fn(in.rollout - first, in.logprobs, advantages, batch.total_loss_tokens,
                batch.num_rollouts, optional(in.entropy), optional(in.proximal_logprobs))
          .cast<at::Tensor>();
    } catch (py::error_already_set& e) {
      error = std::move(e);
      throw std::runtime_error("the Python loss raised an exception");
    }
  }
};

// The C++ trainer and the lock that keeps its calls one at a time. The lock is taken after the
// GIL is released, so a thread holding it can always re-acquire the GIL for a Python loss. `owner`
// is the thread inside a call: a Python loss calling back into its own trainer (same thread, lock
// held) gets an error instead of a deadlock.
struct BoundTrainer {
  std::unique_ptr<Trainer> trainer;
  std::mutex mu;
  std::atomic<std::thread::id> owner{};
  ProgressMode progress = ProgressMode::kAuto;  // progress lines within long calls (rank 0)
};

// A progress line for one long call, fed by a copy of its executor options (on rank 0 only: the
// others compute their shares of the same batch).
class CallProgress {
 public:
  CallProgress(const BoundTrainer& self, const char* call, const ExecutorOptions& options)
      : line_(std::string("dta.Trainer: ") + call, "tokens",
              self.trainer->rank() == 0 ? self.progress : ProgressMode::kNever),
        executor_(options) {
    executor_.progress = [this](int64_t done, int64_t total) { line_.Update(done, total); };
  }
  CallProgress(const CallProgress&) = delete;
  CallProgress& operator=(const CallProgress&) = delete;
  const ExecutorOptions& executor() const { return executor_; }

 private:
  ProgressLine line_;
  ExecutorOptions executor_;
};

// Runs `call` on the trainer without the GIL, under the trainer's lock.
template <typename Call>
auto WithoutGil(BoundTrainer& self, Call&& call) {
  if (self.owner.load() == std::this_thread::get_id()) {
    throw std::runtime_error(
        "a loss callable must not call its trainer (the trainer is inside compute_gradients)");
  }
  py::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(self.mu);
  struct Owner {
    std::atomic<std::thread::id>& owner;
    explicit Owner(std::atomic<std::thread::id>& o) : owner(o) {
      owner.store(std::this_thread::get_id());
    }
    ~Owner() { owner.store(std::thread::id()); }
  } owned(self.owner);
  return call(*self.trainer);
}

py::dict GradientStatsDict(const GradientStats& s) {
  py::dict d;
  d["loss"] = s.loss;
  d["rollout_tokens"] = s.rollout_tokens;
  d["tree_tokens"] = s.tree_tokens;
  d["forwarded_tokens"] = s.forwarded_tokens;
  d["router_aux_loss"] = s.router_aux_loss;
  d["replay_split_tokens"] = s.replay_split_tokens;
  const LossDiagnostics& g = s.diagnostics;
  py::dict diagnostics;
  for (const auto& [name, value] : std::initializer_list<std::pair<const char*, double>>{
           {"loss_tokens", g.loss_tokens},
           {"clipped_tokens", g.clipped_tokens},
           {"dual_clipped_tokens", g.dual_clipped_tokens},
           {"approx_kl", g.approx_kl},
           {"ratio", g.ratio},
           {"ratio_max", g.ratio_max},
           {"ratio_min", g.ratio_min},
           {"entropy", g.entropy},
           {"entropy_tokens", g.entropy_tokens},
           {"rejected_tokens", g.rejected_tokens},
           {"behave_weight", g.behave_weight},
           {"behave_approx_kl", g.behave_approx_kl},
           {"behave_tokens", g.behave_tokens}}) {
    diagnostics[name] = value;
  }
  d["diagnostics"] = diagnostics;
  return d;
}

py::dict ComputeGradientsBinding(BoundTrainer& self, const ConvertedBatch& batch, LossOptions loss,
                                 const std::optional<py::function>& custom,
                                 const ExecutorOptions& executor) {
  const std::vector<Rollout>& rollouts = batch.rollouts();
  std::shared_ptr<PythonLoss> python_loss;
  if (custom) {
    python_loss = std::make_shared<PythonLoss>();
    python_loss->fn = *custom;
    python_loss->first = rollouts.data();
    // A copy of the shared pointer per copy of the options: the executor copies them freely, and
    // the callable is released with this function's locals, with the GIL held.
    loss.custom = [python_loss](const RolloutLossInputs& in, const BatchLossContext& batch) {
      return (*python_loss)(in, batch);
    };
  }
  GradientStats stats;
  std::exception_ptr failure;
  WithoutGil(self, [&](Trainer& t) {
    try {
      const CallProgress progress(self, "compute_gradients", executor);
      stats = t.ComputeGradients(rollouts, loss, progress.executor());
    } catch (...) {
      failure = std::current_exception();
    }
  });
  if (python_loss && python_loss->error) throw std::move(*python_loss->error);
  if (failure) std::rethrow_exception(failure);
  return GradientStatsDict(stats);
}

void RegisterOptions(py::module_& m) {
  py::enum_<LossKind>(m, "LossKind")
      .value("SFT", LossKind::kSft)
      .value("PPO", LossKind::kPpo)
      .value("DECOUPLED_PPO", LossKind::kDecoupledPpo)
      .value("GSPO", LossKind::kGspo);
  py::enum_<Normalization>(m, "Normalization")
      .value("TOKEN_MEAN", Normalization::kTokenMean)
      .value("SEQUENCE_MEAN", Normalization::kSequenceMean)
      .value("SUM", Normalization::kSum);
  py::enum_<Method>(m, "Method")
      .value("DENSE", Method::kDense)
      .value("PACKED", Method::kPacked)
      .value("DTA", Method::kDta);
  py::enum_<LeafOrderKind>(m, "LeafOrder")
      .value("BACKWARD_DFS", LeafOrderKind::kBackwardDfs)
      .value("LEXICOGRAPHIC", LeafOrderKind::kLexicographic);
  m.attr("UNBOUNDED_BLOCK") = kUnboundedBlock;
  py::enum_<AdvantageLevel>(m, "AdvantageLevel")
      .value("GROUP", AdvantageLevel::kGroup)
      .value("BATCH", AdvantageLevel::kBatch)
      .value("NONE", AdvantageLevel::kNone);
  py::class_<AdvantageOptions>(m, "AdvantageOptions")
      .def(py::init<>())
      .def_readwrite("reward_bias", &AdvantageOptions::reward_bias)
      .def_readwrite("reward_scaling", &AdvantageOptions::reward_scaling)
      .def_readwrite("reward_clip", &AdvantageOptions::reward_clip)
      .def_readwrite("mean_level", &AdvantageOptions::mean_level)
      .def_readwrite("std_level", &AdvantageOptions::std_level)
      .def_readwrite("std_eps", &AdvantageOptions::std_eps)
      .def_readwrite("token_weighted", &AdvantageOptions::token_weighted);
  using RS = RejectionSampling;
  py::enum_<RS::Level>(m, "RejectionLevel")
      .value("TOKEN", RS::Level::kToken)
      .value("SEQUENCE", RS::Level::kSequence);
  py::enum_<RS::Action>(m, "RejectionAction")
      .value("MASK", RS::Action::kMask)
      .value("CLAMP", RS::Action::kClamp);
  py::enum_<RS::Metric>(m, "RejectionMetric")
      .value("RATIO", RS::Metric::kRatio)
      .value("KL_K1", RS::Metric::kKlK1)
      .value("KL_K2", RS::Metric::kKlK2)
      .value("KL_K3", RS::Metric::kKlK3);
  py::enum_<RS::Aggregation>(m, "RejectionAggregation")
      .value("SUM", RS::Aggregation::kSum)
      .value("MEAN", RS::Aggregation::kMean)
      .value("MAX", RS::Aggregation::kMax);
  py::class_<RS>(m, "RejectionSampling")
      .def(py::init<>())
      .def_readwrite("level", &RS::level)
      .def_readwrite("action", &RS::action)
      .def_readwrite("metric", &RS::metric)
      .def_readwrite("aggregation", &RS::aggregation)
      .def_readwrite("upper", &RS::upper)
      .def_readwrite("lower", &RS::lower);

  py::class_<LossOptions>(m, "LossOptions")
      .def(py::init<>())
      .def_readwrite("kind", &LossOptions::kind)
      .def_readwrite("normalization", &LossOptions::normalization)
      .def_readwrite("eps_clip_low", &LossOptions::eps_clip_low)
      .def_readwrite("eps_clip_high", &LossOptions::eps_clip_high)
      .def_readwrite("dual_clip", &LossOptions::dual_clip)
      .def_readwrite("behave_imp_weight_cap", &LossOptions::behave_imp_weight_cap)
      .def_readwrite("behave_imp_weight", &LossOptions::behave_imp_weight)
      .def_readwrite("rejection_sampling", &LossOptions::rejection_sampling)
      .def_readwrite("advantages", &LossOptions::advantages)
      .def_readwrite("with_entropy", &LossOptions::with_entropy)
      .def_readwrite("with_proximal", &LossOptions::with_proximal)
      .def_readwrite("entropy_coef", &LossOptions::entropy_coef)
      .def_readwrite("kl_coef", &LossOptions::kl_coef)
      .def_readwrite("router_aux_loss_coef", &LossOptions::router_aux_loss_coef)
      .def_readwrite("gspo_eps_low", &LossOptions::gspo_eps_low)
      .def_readwrite("gspo_eps_high", &LossOptions::gspo_eps_high);
  py::class_<ExecutorOptions>(m, "ExecutorOptions")
      .def(py::init<>())
      .def_readwrite("method", &ExecutorOptions::method)
      .def_readwrite("block_size", &ExecutorOptions::block_size)
      .def_readwrite("order", &ExecutorOptions::order)
      .def_readwrite("graph_budget", &ExecutorOptions::graph_budget)
      .def_readwrite("memory_budget", &ExecutorOptions::memory_budget)
      .def_readwrite("pack", &ExecutorOptions::pack)
      .def_readwrite("token_capacity", &ExecutorOptions::token_capacity)
      .def_readwrite("checkpointing", &ExecutorOptions::checkpointing)
      .def_readwrite("logprob_slice_rows", &ExecutorOptions::logprob_slice_rows)
      .def_readwrite("unshared_prefix_fraction", &ExecutorOptions::unshared_prefix_fraction)
      .def_readwrite("temperature", &ExecutorOptions::temperature)
      .def_readwrite("replace_gradients", &ExecutorOptions::replace_gradients);
  py::class_<LayoutOverrides>(m, "LayoutOverrides")
      .def(py::init<>())
      .def_readwrite("tensor_parallel", &LayoutOverrides::tensor_parallel)
      .def_readwrite("shard_optimizer", &LayoutOverrides::shard_optimizer)
      .def_readwrite("offload_optimizer", &LayoutOverrides::offload_optimizer)
      .def_readwrite("offload_resident_gb", &LayoutOverrides::offload_resident_gb)
      .def_readwrite("gpu_memory_gb", &LayoutOverrides::gpu_memory_gb)
      .def_readwrite("activation_gb", &LayoutOverrides::activation_gb)
      .def_property(
          "longest_rollout", [](const LayoutOverrides& o) { return o.executor.longest_rollout; },
          [](LayoutOverrides& o, int64_t tokens) { o.executor.longest_rollout = tokens; });
  py::class_<ParallelOptions>(m, "ParallelOptions")
      .def(py::init<>())
      .def_readwrite("distributed", &ParallelOptions::distributed)
      .def_readwrite("layout", &ParallelOptions::layout)
      .def_readwrite("timeout_s", &ParallelOptions::timeout_s)
      .def_property(
          "offload_update",
          [](const ParallelOptions& o) {
            return o.offload_update == OffloadUpdate::kOnHost ? "host" : "gpu";
          },
          [](ParallelOptions& o, const std::string& where) {
            if (where != "gpu" && where != "host") {
              throw py::value_error("offload_update must be 'gpu' or 'host', got '" + where + "'");
            }
            o.offload_update = where == "host" ? OffloadUpdate::kOnHost : OffloadUpdate::kOnDevice;
          });
  py::class_<AdamWOptions>(m, "AdamWOptions")
      .def(py::init<>())
      .def_readwrite("lr", &AdamWOptions::lr)
      .def_readwrite("beta1", &AdamWOptions::beta1)
      .def_readwrite("beta2", &AdamWOptions::beta2)
      .def_readwrite("eps", &AdamWOptions::eps)
      .def_readwrite("weight_decay", &AdamWOptions::weight_decay)
      .def_readwrite("max_grad_norm", &AdamWOptions::max_grad_norm);
}

at::TensorOptions ModelOptions(at::ScalarType dtype, at::Device device) {
  return at::TensorOptions().dtype(dtype).device(device);
}

}  // namespace

void RegisterTrainer(py::module_& m) {
  RegisterOptions(m);
  // The registry's lists (core/model/family.h), so that Python never keeps its own copy.
  m.def("model_presets", &ModelPresetNames, "The names Trainer.from_config accepts as presets.");
  m.def("model_families", &ModelFamilyTypes, "The config.json model_types dta builds, sorted.");
  py::class_<BoundTrainer>(m, "Trainer")
      .def_static(
          "from_directory",
          [](const std::string& directory, at::ScalarType dtype, at::Device device,
             const AdamWOptions& adamw, const ParallelOptions& parallel) {
            auto bound = std::make_unique<BoundTrainer>();
            py::gil_scoped_release release;
            bound->trainer =
                Trainer::FromDirectory(directory, ModelOptions(dtype, device), adamw, parallel);
            return bound;
          },
          py::arg("directory"), py::arg("dtype"), py::arg("device"), py::arg("adamw"),
          py::arg("parallel"))
      .def_static(
          "from_config",
          [](const std::string& config, uint64_t seed, double init_std, at::ScalarType dtype,
             at::Device device, const AdamWOptions& adamw, const ParallelOptions& parallel) {
            auto bound = std::make_unique<BoundTrainer>();
            py::gil_scoped_release release;
            bound->trainer = Trainer::FromConfig(config, seed, init_std,
                                                 ModelOptions(dtype, device), adamw, parallel);
            return bound;
          },
          py::arg("config"), py::arg("seed"), py::arg("init_std"), py::arg("dtype"),
          py::arg("device"), py::arg("adamw"), py::arg("parallel"))
      .def("compute_gradients", &ComputeGradientsBinding, py::arg("batch"), py::arg("loss"),
           py::arg("custom"), py::arg("executor"))
      .def(
          "step",
          [](BoundTrainer& self, bool skip_nonfinite) {
            const NonFiniteGradients on_nonfinite =
                skip_nonfinite ? NonFiniteGradients::kSkip : NonFiniteGradients::kRaise;
            const StepStats s = WithoutGil(self, [&](Trainer& t) { return t.Step(on_nonfinite); });
            py::dict d;
            d["grad_norm"] = s.grad_norm;
            d["clip_coef"] = s.clip_coef;
            d["step"] = s.step;
            d["lr"] = s.lr;
            d["skipped"] = s.skipped;
            return d;
          },
          py::arg("skip_nonfinite") = false)
      .def(
          "set_lr_schedule",
          [](BoundTrainer& self, const std::string& decay, int64_t warmup_steps,
             int64_t decay_steps, double min_lr_ratio) {
            const absl::StatusOr<LrDecay> parsed = ParseLrDecay(decay);
            if (!parsed.ok()) throw py::value_error(std::string(parsed.status().message()));
            const LrSchedule schedule = {.decay = *parsed,
                                         .warmup_steps = warmup_steps,
                                         .total_steps = decay_steps,
                                         .min_lr_ratio = min_lr_ratio};
            const absl::Status valid = ValidateLrSchedule(schedule);
            if (!valid.ok()) throw py::value_error(std::string(valid.message()));
            WithoutGil(self, [&](Trainer& t) { t.optimizer().set_schedule(schedule); });
          },
          py::arg("decay"), py::arg("warmup_steps"), py::arg("decay_steps"),
          py::arg("min_lr_ratio"))
      .def("zero_grad",
           [](BoundTrainer& self) { WithoutGil(self, [](Trainer& t) { t.ZeroGrad(); }); })
      .def(
          "compute_logprobs",
          [](BoundTrainer& self, const ConvertedBatch& batch, const ExecutorOptions& executor) {
            const std::vector<Rollout>& rollouts = batch.rollouts();
            return WithoutGil(self, [&](Trainer& t) {
              const CallProgress progress(self, "compute_logprobs", executor);
              return t.ComputeLogprobs(rollouts, progress.executor());
            });
          },
          py::arg("batch"), py::arg("executor"))
      .def(
          "save",
          [](BoundTrainer& self, const std::string& directory, std::optional<at::ScalarType> dtype,
             bool with_optimizer) {
            WithoutGil(self, [&](Trainer& t) { t.Save(directory, dtype, with_optimizer); });
          },
          py::arg("directory"), py::arg("dtype"), py::arg("with_optimizer"))
      .def(
          "load_optimizer",
          [](BoundTrainer& self, const std::string& path) {
            WithoutGil(self, [&](Trainer& t) { t.LoadOptimizer(path); });
          },
          py::arg("path"))
      .def(
          "load_weights",
          [](BoundTrainer& self, const std::string& directory) {
            WithoutGil(self, [&](Trainer& t) { t.LoadWeights(directory); });
          },
          py::arg("directory"))
      .def("named_parameters",
           [](BoundTrainer& self) { return self.trainer->model().named_parameters(); })
      .def("config_json",
           [](BoundTrainer& self) { return ModelConfigToJson(self.trainer->model().config()); })
      .def_property(
          "lr", [](BoundTrainer& self) { return self.trainer->optimizer().options().lr; },
          [](BoundTrainer& self, double lr) {
            WithoutGil(self, [&](Trainer& t) { t.optimizer().set_lr(lr); });
          })
      .def_property_readonly("sharded_optimizer",
                             [](BoundTrainer& self) { return self.trainer->optimizer().sharded(); })
      .def_property_readonly(
          "layout", [](BoundTrainer& self) { return DescribeLayout(self.trainer->layout()); })
      .def_property_readonly(
          "tensor_parallel",
          [](BoundTrainer& self) { return self.trainer->layout().layout.tensor_parallel; })
      .def_property_readonly(
          "shard_optimizer",
          [](BoundTrainer& self) { return self.trainer->layout().layout.shard_optimizer; })
      .def_property_readonly(
          "offload_optimizer",
          [](BoundTrainer& self) { return self.trainer->layout().layout.offload_optimizer; })
      .def_property_readonly(
          "offload_description",
          [](BoundTrainer& self) { return self.trainer->optimizer().DescribeOffload(); })
      .def_property_readonly("rank", [](BoundTrainer& self) { return self.trainer->rank(); })
      .def_property_readonly(
          "device", [](BoundTrainer& self) { return self.trainer->model().options().device(); })
      .def_property_readonly("world_size",
                             [](BoundTrainer& self) { return self.trainer->world_size(); })
      .def_property_readonly(
          "tensor_parallel_rank",
          [](BoundTrainer& self) { return self.trainer->tensor_parallel_rank(); })
      .def_property_readonly("data_parallel_rank",
                             [](BoundTrainer& self) { return self.trainer->data_parallel_rank(); })
      .def_property_readonly("data_parallel_size",
                             [](BoundTrainer& self) { return self.trainer->data_parallel_size(); })
      .def_property_readonly("step_count",
                             [](BoundTrainer& self) { return self.trainer->optimizer().step(); })
      .def_property(
          "progress",
          [](const BoundTrainer& self) {
            switch (self.progress) {
              case ProgressMode::kAuto:
                return "auto";
              case ProgressMode::kAlways:
                return "always";
              case ProgressMode::kNever:
                return "never";
            }
            return "auto";
          },
          [](BoundTrainer& self, const std::string& mode) {
            const absl::StatusOr<ProgressMode> parsed = ParseProgressMode(mode);
            if (!parsed.ok())
              throw py::value_error("progress: " + std::string(parsed.status().message()));
            self.progress = *parsed;
          });

  // TensorBoard event files without TensorFlow (core/metrics), for dta.Trainer(tensorboard_dir=).
  py::class_<TensorBoardWriter>(m, "TensorBoardWriter")
      .def(py::init([](const std::string& directory) {
             absl::StatusOr<std::unique_ptr<TensorBoardWriter>> opened =
                 TensorBoardWriter::Open(directory);
             if (!opened.ok()) throw py::value_error(std::string(opened.status().message()));
             return *std::move(opened);
           }),
           py::arg("directory"))
      .def(
          "write",
          [](TensorBoardWriter& self, int64_t step, const Scalars& scalars) {
            const absl::Status written = self.Write(step, scalars);
            if (!written.ok()) throw std::runtime_error(std::string(written.message()));
          },
          py::arg("step"), py::arg("scalars"))
      .def_property_readonly("path", &TensorBoardWriter::path);
}

}  // namespace dta::python

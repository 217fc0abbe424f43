#include "executor/engine/executor.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "core/base/env_switch.h"
#include "core/model/layer_spec.h"
#include "core/tree/shared_marks.h"
#include "executor/device/host_to_device.h"
#include "executor/engine/methods.h"
#include "executor/engine/packed_layout.h"
#include "executor/model/ops/gather_rows.h"

namespace dta {
namespace engine {

std::vector<at::Tensor> TokenTensors(absl::Span<const Rollout> rollouts,
                                     const at::TensorOptions& model_options) {
  std::vector<int64_t> ids;
  for (const Rollout& rollout : rollouts)
    ids.insert(ids.end(), rollout.tokens.begin(), rollout.tokens.end());
  const at::Tensor all =
      CopyToDevice(absl::MakeConstSpan(ids), at::TensorOptions().device(model_options.device()));
  std::vector<at::Tensor> out;
  int64_t offset = 0;
  for (const Rollout& rollout : rollouts) {
    const int64_t length = static_cast<int64_t>(rollout.tokens.size());
    out.push_back(all.slice(0, offset, offset + length));
    offset += length;
  }
  return out;
}

PrefixTree BuildTree(const RoutingReplay& keys, absl::Span<const RolloutIndex> subset) {
  PrefixTreeBuilder builder;
  for (RolloutIndex r : subset) {
    TORCH_CHECK(builder.AddRollout(keys.keys(r)).ok(), "rollout '", keys.rollout(r).id, "'");
  }
  return std::move(builder).Build();
}

PrefixTree BuildTree(const RoutingReplay& keys) {
  std::vector<RolloutIndex> all(keys.num_rollouts());
  std::iota(all.begin(), all.end(), RolloutIndex{0});
  return BuildTree(keys, all);
}

void CheckRollouts(const Decoder& model, absl::Span<const Rollout> rollouts) {
  for (const Rollout& rollout : rollouts) {
    const absl::Status status = ValidateRollout(rollout, model.config().vocab_size);
    TORCH_CHECK(status.ok(), "rollout '", rollout.id, "': ", std::string(status.message()));
  }
}

LogprobPositions LogprobPositions::OfLossMasks(absl::Span<const Rollout> rollouts) {
  // A tree over the token ids alone: rollouts routed differently on a shared token (routing
  // replay) compute it apart, and each computation reads the union, which holds its own reads.
  PrefixTreeBuilder builder(TokenStorage::kBorrow);
  std::vector<absl::Span<const uint8_t>> masks;
  for (const Rollout& rollout : rollouts) {
    TORCH_CHECK(builder.AddRollout(rollout.tokens).ok(), "rollout '", rollout.id, "'");
    masks.push_back(rollout.loss_mask);
  }
  absl::StatusOr<std::vector<std::vector<uint8_t>>> read =
      MarksOverSharedTokens(std::move(builder).Build(), masks);
  TORCH_CHECK(read.ok(), std::string(read.status().message()));
  LogprobPositions positions;
  positions.read_ = *std::move(read);
  return positions;
}

at::Tensor LogprobsOfReadRows(const Decoder& model, const at::Tensor& rows,
                              const at::Tensor& targets, absl::Span<const uint8_t> read,
                              at::Tensor* entropy, const LogprobOptions& options) {
  TORCH_CHECK(read.empty() || static_cast<int64_t>(read.size()) == rows.size(0),
              "internal: ", read.size(), " read flags for ", rows.size(0), " rows");
  std::vector<int64_t> index;
  for (size_t i = 0; i < read.size(); ++i) {
    if (read[i] != 0) index.push_back(static_cast<int64_t>(i));
  }
  if (index.size() == read.size()) return model.Logprobs(rows, targets, entropy, options);
  // The read rows only (possibly none: the result is still connected to `rows`' graph, so that a
  // backward seeded from it runs as for any other chunk).
  const at::Tensor where = IndexTensor(index, rows.device());
  at::Tensor read_entropy;
  const at::Tensor values = model.Logprobs(GatherRows(rows, where), targets.index_select(0, where),
                                           entropy != nullptr ? &read_entropy : nullptr, options);
  const at::Tensor zeros = at::zeros({rows.size(0)}, values.options());
  if (entropy != nullptr) *entropy = zeros.index_put({where}, read_entropy);
  return zeros.index_put({where}, values);
}

LossPlan::LossPlan(const Decoder& model, absl::Span<const Rollout> rollouts,
                   const LossOptions& options, const ExecutorOptions& executor,
                   const BatchLossContext& batch)
    : rollouts_(rollouts), options_(options), batch_(batch) {
  if (UsesAdvantages(options, rollouts))
    advantages_ = ComputeAdvantages(rollouts, options.advantages);
  if (!options.custom && EnvSwitchOn("DTA_LOSS_ROWS_ONLY"))
    read_ = LogprobPositions::OfLossMasks(rollouts);
  if (options.custom ? options.with_proximal : options.kind == LossKind::kDecoupledPpo) {
    // The proximal policy is the current one before this step: its log-probabilities come from a
    // forward-only pass, each unique token once, where the losses read them.
    ExecutorOptions forward = executor;
    if (forward.method == Method::kDense) forward.method = Method::kDta;
    proximal_ = Run(model, rollouts, nullptr, read_, forward).logprobs;
  }
  const ModelConfig& config = model.config();
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) sparse_layers_ += IsSparseLayer(config, l);
  experts_ = config.num_experts;
  const double coef = options.router_aux_loss_coef;
  TORCH_CHECK(std::isfinite(coef) && coef >= 0,
              "router_aux_loss_coef must be finite and >= 0, got ", coef);
  TORCH_CHECK(coef == 0 || sparse_layers_ > 0, "router_aux_loss_coef = ", coef, " but the model (",
              config.model_type, ") has no mixture-of-experts layers to balance");
}

at::Tensor LossPlan::RouterBalanceRow(int32_t r, const at::Tensor& counts) const {
  const double rows =
      static_cast<double>(sparse_layers_) * static_cast<double>(rollouts_[r].tokens.size());
  return counts * (options_.router_aux_loss_coef * static_cast<double>(experts_) /
                   (static_cast<double>(batch_.num_rollouts) * rows * rows));
}

at::Tensor RouterBalanceRows(const LossPlan& plan, const at::Tensor& router_counts,
                             absl::Span<const RolloutIndex> rollouts,
                             absl::Span<const at::Tensor> paths) {
  at::Tensor rows = at::zeros_like(router_counts);
  for (size_t i = 0; i < rollouts.size(); ++i) {
    const at::Tensor counts = router_counts.index_select(0, paths[i]);
    const at::Tensor row = plan.RouterBalanceRow(rollouts[i], counts.sum(0));
    rows.index_add_(0, paths[i], row.expand_as(counts));
  }
  return rows;
}

RolloutLossInputs LossPlan::Inputs(int32_t r, const at::Tensor& logprobs,
                                   const at::Tensor& entropy) const {
  RolloutLossInputs in;
  in.rollout = &rollouts_[r];
  in.logprobs = logprobs;
  in.entropy = entropy;
  if (!proximal_.empty()) in.proximal_logprobs = proximal_[r];
  if (!advantages_.empty()) in.advantages = &advantages_[r];
  return in;
}

at::Tensor LossPlan::Loss(int32_t r, const at::Tensor& logprobs, const at::Tensor& entropy) const {
  return RolloutLoss(Inputs(r, logprobs, entropy), options_, batch_, &diagnostics_);
}

RolloutLossGrad LossPlan::LossAndGrad(int32_t r, const at::Tensor& logprobs,
                                      const at::Tensor& entropy) const {
  return RolloutLossAndGrad(Inputs(r, logprobs, entropy), options_, batch_, &diagnostics_);
}

RolloutLossGrad LossPlan::LossAndGrad(int32_t r, const at::Tensor& logprobs,
                                      const at::Tensor& entropy,
                                      DiagnosticsAccumulator& diagnostics) const {
  return RolloutLossAndGrad(Inputs(r, logprobs, entropy), options_, batch_, &diagnostics);
}

RolloutLossGrad LossPlan::LossAndGradOfRollouts(absl::Span<const RolloutIndex> rs,
                                                const at::Tensor& logprobs,
                                                const at::Tensor& entropy) const {
  RolloutsLossInputs in;
  in.logprobs = logprobs;
  in.entropy = entropy;
  for (const RolloutIndex r : rs) {
    in.rollouts.push_back(&rollouts_[r]);
    in.proximal_logprobs.push_back(proximal_.empty() ? at::Tensor() : proximal_[r]);
    in.advantages.push_back(advantages_.empty() ? nullptr : &advantages_[r]);
  }
  return RolloutsLossAndGrad(in, options_, batch_, &diagnostics_);
}

}  // namespace engine

std::string_view MethodName(Method method) {
  switch (method) {
    case Method::kDense:
      return "dense";
    case Method::kPacked:
      return "packed";
    case Method::kDta:
      return "dta";
  }
  TORCH_CHECK(false, "MethodName: unknown method ", static_cast<int>(method));
}

std::string_view LeafOrderName(LeafOrderKind order) {
  switch (order) {
    case LeafOrderKind::kBackwardDfs:
      return "backward-dfs";
    case LeafOrderKind::kLexicographic:
      return "lexicographic";
  }
  TORCH_CHECK(false, "LeafOrderName: unknown order ", static_cast<int>(order));
}

ExecutorMemoryOptions ExecutorMemoryOf(const ExecutorOptions& executor, int64_t longest_rollout,
                                       int64_t tree_tokens) {
  ExecutorMemoryOptions memory;
  switch (executor.method) {
    case Method::kDta:
      memory.method = ExecutorKind::kDta;
      break;
    case Method::kDense:
      memory.method = ExecutorKind::kDense;
      break;
    case Method::kPacked:
      memory.method = ExecutorKind::kPacked;
      break;
  }
  memory.longest_rollout = longest_rollout > 0 ? longest_rollout : kDefaultPlannedRollout;
  // ExecutorOptions' automatic values are core/layout's (-1); kUnboundedBlock stays unbounded.
  memory.block_size =
      executor.block_size == kAutoBlockSize ? kAutomaticCapacity : executor.block_size;
  memory.graph_budget =
      executor.graph_budget == kAutoGraphBudget ? kAutomaticCapacity : executor.graph_budget;
  memory.pack = executor.pack;
  memory.token_capacity = executor.token_capacity;
  memory.tree_tokens = tree_tokens;
  memory.checkpointing = executor.checkpointing;
  memory.logprob_slice_rows = executor.logprob_slice_rows;
  return memory;
}

int64_t GraphBytesPerToken(const ModelConfig& c, at::ScalarType dtype, int tensor_parallel,
                           int expert_parallel) {
  // Per layer, the tensors autograd saves for one token (core/model/layer_spec.h's
  // LayerSavedBytes, block by block); the norms' and attention's per-row statistics are not
  // counted here.
  TORCH_CHECK(tensor_parallel >= 1, "GraphBytesPerToken: tensor_parallel must be >= 1");
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  int64_t bytes = 0;
  for (const LayerSpec& layer : BuildModelSpec(c).layers) {
    bytes += LayerSavedBytes(c, layer, element, tensor_parallel, expert_parallel).tensors;
  }
  return bytes;
}

namespace engine {
namespace {

// ExecutorOptions::replace_gradients over one run: the decoder's gradients zeroed or marked fresh
// while it runs; when it ends (normally or unwinding) the graphs no longer carry the marks and the
// gradients no chunk wrote are zeroed.
class FreshGradientsScope {
 public:
  FreshGradientsScope(const Decoder& model, bool replace) : model_(model) {
    if (!replace) return;
    fresh_ = std::make_unique<FreshGradients>();
    model_.StartFreshGradients(fresh_.get());
  }
  FreshGradientsScope(const FreshGradientsScope&) = delete;
  FreshGradientsScope& operator=(const FreshGradientsScope&) = delete;
  ~FreshGradientsScope() {
    if (fresh_ != nullptr) model_.StartFreshGradients(nullptr);
  }  // then fresh_'s destructor zeroes what no chunk wrote

 private:
  const Decoder& model_;
  std::unique_ptr<FreshGradients> fresh_;
};

}  // namespace

GradientResult Run(const Decoder& model, absl::Span<const Rollout> rollouts, const LossPlan* plan,
                   const LogprobPositions& read, const ExecutorOptions& options) {
  TORCH_CHECK(options.logprob_slice_rows > 0, "logprob_slice_rows must be positive");
  TORCH_CHECK(
      options.unshared_prefix_fraction >= 0 && std::isfinite(options.unshared_prefix_fraction),
      "unshared_prefix_fraction must be >= 0 and finite, got ", options.unshared_prefix_fraction);
  TORCH_CHECK(options.temperature > 0 && std::isfinite(options.temperature),
              "ExecutorOptions.temperature must be positive and finite, got ", options.temperature);
  const RoutingReplay replay(model.config(), rollouts);
  GradientResult result;
  {
    const FreshGradientsScope fresh(model, plan != nullptr && options.replace_gradients);
    switch (options.method) {
      case Method::kDense:
        result = RunDense(model, rollouts, replay, plan, read, options);
        break;
      case Method::kPacked:
        result = RunPacked(model, rollouts, replay, plan, read, options);
        break;
      case Method::kDta:
        result = RunDta(model, rollouts, replay, plan, read, options);
        break;
      default:
        TORCH_CHECK(false, "unknown method");
    }
  }
  result.replay_split_tokens = replay.split_tokens();
  if (plan != nullptr) {
    model.ReduceTensorParallelGradients();
    result.diagnostics = plan->ReadDiagnostics();
  }
  return result;
}

}  // namespace engine

GradientResult ComputeGradients(const Decoder& model, absl::Span<const Rollout> rollouts,
                                const LossOptions& loss, const ExecutorOptions& options) {
  return ComputeGradients(model, rollouts, loss, options, MakeBatchContext(rollouts));
}

GradientResult ComputeGradients(const Decoder& model, absl::Span<const Rollout> rollouts,
                                const LossOptions& loss, const ExecutorOptions& options,
                                const BatchLossContext& batch) {
  // The host's checks and loss plan (a profiler scope; RunDta's steps have their own).
  at::RecordFunction prepare_scope(at::RecordScope::USER_SCOPE);
  if (prepare_scope.isActive()) prepare_scope.before("dta::prepare");
  engine::CheckRollouts(model, rollouts);
  const engine::LossPlan plan(model, rollouts, loss, options, batch);
  prepare_scope.end();
  return engine::Run(model, rollouts, &plan, plan.read_positions(), options);
}

std::vector<at::Tensor> ComputeLogprobs(const Decoder& model, absl::Span<const Rollout> rollouts,
                                        const ExecutorOptions& options) {
  engine::CheckRollouts(model, rollouts);
  return engine::Run(model, rollouts, nullptr, engine::LogprobPositions(), options).logprobs;
}

}  // namespace dta

#include "dispatcher/client/trainer_session.h"

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "dispatcher/client/dispatcher_client.h"
#include "dispatcher/wire/trajectory.h"

namespace dta {
namespace {

StepPartition FromProto(const v1::Partition& partition) {
  StepPartition out;
  out.step = partition.step();
  out.replay = partition.replay();
  out.policy_version = partition.policy_version();
  out.total_loss_tokens = partition.total_loss_tokens();
  out.num_rollouts = partition.num_rollouts();
  out.tree_tokens = partition.tree_tokens();
  out.rollouts.reserve(partition.trajectories_size());
  for (const v1::Trajectory& t : partition.trajectories())
    out.rollouts.push_back(RolloutFromTrajectory(t));
  return out;
}

class GrpcTrainerSession final : public TrainerSession {
 public:
  GrpcTrainerSession(const ClientOptions& options, const TrainerIdentity& identity)
      : client_(options), identity_(identity) {}

  absl::Status Register() {
    v1::RegisterTrainerRequest request;
    request.set_rank(identity_.rank);
    request.set_world_size(identity_.world_size);
    request.set_device(identity_.device);
    request.set_resume_step(identity_.resume_step);
    request.set_trainer_id(identity_.trainer_id);
    request.set_vocab_size(identity_.vocab_size);
    request.set_needs_ref_logprobs(identity_.needs_ref_logprobs);
    request.set_needs_advantages(identity_.needs_advantages);
    request.set_num_hidden_layers(identity_.routing.num_hidden_layers);
    request.mutable_sparse_layers()->Assign(identity_.routing.sparse_layers.begin(),
                                            identity_.routing.sparse_layers.end());
    request.set_experts_per_token(identity_.routing.top_k);
    request.set_num_experts(static_cast<int32_t>(identity_.routing.num_experts));
    ASSIGN_OR_RETURN(registered_, client_.Register(request));
    return absl::OkStatus();
  }

  int64_t generation() const override { return registered_.generation(); }
  int64_t committed_steps() const override { return registered_.committed_steps(); }

  absl::StatusOr<StepPartition> Fetch(int64_t step) override {
    absl::StatusOr<v1::Partition> partition = client_.Fetch(identity_.rank, step, generation());
    if (!partition.ok()) return partition.status();
    return FromProto(*partition);
  }

  absl::StatusOr<StepDecision> Prepared(const PreparedStep& step,
                                        int64_t* policy_version) override {
    v1::StepReport report = Base(step.step);
    report.set_phase(v1::StepReport::PREPARED);
    report.set_loss(step.loss);
    report.set_rollout_tokens(step.rollout_tokens);
    report.set_forwarded_tokens(step.forwarded_tokens);
    report.set_tree_tokens(step.tree_tokens);
    report.set_seconds(step.seconds);
    report.set_peak_memory_bytes(step.peak_memory_bytes);
    report.set_checkpoint_step(step.checkpoint_step);
    absl::StatusOr<v1::ReportStepResponse> decision = client_.Report(report);
    if (!decision.ok()) return decision.status();
    if (policy_version != nullptr) *policy_version = decision->policy_version();
    return decision->decision() == v1::ReportStepResponse::COMMIT ? StepDecision::kCommit
                                                                  : StepDecision::kAbort;
  }

  void Failed(int64_t step, const std::string& error) override {
    v1::StepReport report = Base(step);
    report.set_phase(v1::StepReport::FAILED);
    report.set_error(error);
    (void)client_.Report(report);
  }

 private:
  v1::StepReport Base(int64_t step) const {
    v1::StepReport report;
    report.set_step(step);
    report.set_rank(identity_.rank);
    report.set_generation(generation());
    return report;
  }

  TrainerClient client_;
  const TrainerIdentity identity_;
  v1::RegisterTrainerResponse registered_;
};

}  // namespace

std::string SerializeStepPartition(const StepPartition& partition) {
  v1::Partition proto;
  proto.set_step(partition.step);
  proto.set_replay(partition.replay);
  proto.set_policy_version(partition.policy_version);
  proto.set_total_loss_tokens(partition.total_loss_tokens);
  proto.set_num_rollouts(partition.num_rollouts);
  proto.set_tree_tokens(partition.tree_tokens);
  for (const Rollout& r : partition.rollouts) *proto.add_trajectories() = TrajectoryFromRollout(r);
  return proto.SerializeAsString();
}

absl::StatusOr<StepPartition> ParseStepPartition(std::string_view bytes) {
  v1::Partition proto;
  if (!proto.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a serialized dta.v1.Partition (", bytes.size(), " bytes)"));
  }
  return FromProto(proto);
}

absl::StatusOr<std::unique_ptr<TrainerSession>> TrainerSession::Register(
    const ClientOptions& options, const TrainerIdentity& identity) {
  auto session = std::make_unique<GrpcTrainerSession>(options, identity);
  RETURN_IF_ERROR(session->Register());
  return session;
}

}  // namespace dta

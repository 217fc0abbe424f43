// Clients of the dispatcher (dta.v1.Dispatcher): what rollout workers and trainers call.
//
// Both set a deadline on every call, present the shared token when one is given, and retry what is
// safe to retry (UNAVAILABLE: the dispatcher is restarting or the batch is not ready; a deadline
// hit by a long poll) until ClientOptions::retry_for has passed. Ingestion is at-least-once on the
// wire and exactly-once in effect: a trajectory whose answer was lost is sent again, and the
// dispatcher acknowledges an identical resend as already accepted without storing it twice.
//
// Thread safety: one call at a time per object (make one per thread; they can share nothing).
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "dispatcher/client/client_options.h"
#include "proto/dta/v1/dispatcher.grpc.pb.h"

namespace dta {

// A channel to the dispatcher as the options say.
std::shared_ptr<grpc::Channel> DispatcherChannel(const ClientOptions& options);

class TrainerClient {
 public:
  explicit TrainerClient(ClientOptions options);
  TrainerClient(const TrainerClient&) = delete;
  TrainerClient& operator=(const TrainerClient&) = delete;

  // Errors as the dispatcher's (INVALID_ARGUMENT, FAILED_PRECONDITION) or UNAVAILABLE after
  // retry_for.
  absl::StatusOr<v1::RegisterTrainerResponse> Register(const v1::RegisterTrainerRequest& request);
  // Waits for the step's partition. ABORTED: the generation is over, register again.
  absl::StatusOr<v1::Partition> Fetch(int32_t rank, int64_t step, int64_t generation);
  // Reports and waits for a decision other than PENDING (COMMIT or ABORT).
  absl::StatusOr<v1::ReportStepResponse> Report(const v1::StepReport& report);
  absl::StatusOr<v1::GetStatusResponse> Status();

 private:
  void Prepare(grpc::ClientContext& context) const;

  const ClientOptions options_;
  std::unique_ptr<v1::Dispatcher::Stub> stub_;
};

class RolloutSender {
 public:
  explicit RolloutSender(ClientOptions options);
  RolloutSender(const RolloutSender&) = delete;
  RolloutSender& operator=(const RolloutSender&) = delete;

  // Sends every trajectory on one stream and returns their answers, in order: ACCEPTED (durable)
  // or REJECTED (with the field and reason). When the stream breaks, reconnects and resends from
  // the first unanswered trajectory, also when the dispatcher asks it to back off (its memory for
  // trajectories not yet stored is full: dispatcher/wire/ingest_back_off.h). UNAVAILABLE if the
  // dispatcher stays unreachable, or keeps asking to back off, for retry_for; UNAUTHENTICATED for
  // a wrong token.
  absl::StatusOr<std::vector<v1::IngestResponse>> Send(
      absl::Span<const v1::Trajectory> trajectories);

 private:
  const ClientOptions options_;
  std::unique_ptr<v1::Dispatcher::Stub> stub_;
};

}  // namespace dta

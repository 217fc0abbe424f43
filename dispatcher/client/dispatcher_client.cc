#include "dispatcher/client/dispatcher_client.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "dispatcher/wire/ingest_back_off.h"

namespace dta {
namespace {

absl::Status FromGrpc(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

bool Retryable(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED;
}

// The dispatcher asks an Ingest stream to back off (its memory for trajectories not yet stored, or
// its open streams, are at their limits: dispatcher_service.h); what it did not acknowledge is
// resent later. gRPC's own "message larger than max" has the same code but can never succeed.
bool DispatcherAsksToBackOff(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
         absl::StartsWith(status.error_message(), kIngestBackOffPrefix);
}

// Calls `call` (a fresh context each time) until it succeeds, fails for good, or retry_for passes;
// backs off from 10 ms to 1 s between attempts that fail fast.
template <typename Call>
grpc::Status WithRetries(const ClientOptions& options, Call call) {
  const absl::Time give_up = absl::Now() + options.retry_for;
  absl::Duration backoff = absl::Milliseconds(10);
  while (true) {
    const absl::Time started = absl::Now();
    grpc::Status status = call();
    if (status.ok() || !Retryable(status.error_code()) || absl::Now() >= give_up) return status;
    // A long poll that waited needs no backoff; a refused connection does.
    if (absl::Now() - started < backoff) {
      std::this_thread::sleep_for(absl::ToChronoNanoseconds(backoff));
      backoff = std::min(backoff * 2, absl::Seconds(1));
    }
  }
}

}  // namespace

std::shared_ptr<grpc::Channel> DispatcherChannel(const ClientOptions& options) {
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!options.tls_root_certificates.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_certificates;
    credentials = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(
      -1);  // partitions can be large; the server limits what it sends
  return grpc::CreateCustomChannel(options.address, credentials, arguments);
}

TrainerClient::TrainerClient(ClientOptions options)
    : options_(std::move(options)), stub_(v1::Dispatcher::NewStub(DispatcherChannel(options_))) {}

void TrainerClient::Prepare(grpc::ClientContext& context) const {
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.call_timeout));
  context.set_wait_for_ready(true);  // a restarting dispatcher is waited for, within the deadline
  if (!options_.token.empty()) context.AddMetadata("authorization", "Bearer " + options_.token);
}

absl::StatusOr<v1::RegisterTrainerResponse> TrainerClient::Register(
    const v1::RegisterTrainerRequest& request) {
  v1::RegisterTrainerResponse response;
  const grpc::Status status = WithRetries(options_, [&] {
    grpc::ClientContext context;
    Prepare(context);
    return stub_->RegisterTrainer(&context, request, &response);
  });
  if (!status.ok()) return FromGrpc(status);
  return response;
}

absl::StatusOr<v1::Partition> TrainerClient::Fetch(int32_t rank, int64_t step, int64_t generation) {
  v1::FetchPartitionRequest request;
  request.set_rank(rank);
  request.set_step(step);
  request.set_generation(generation);
  v1::FetchPartitionResponse response;
  const grpc::Status status = WithRetries(options_, [&] {
    grpc::ClientContext context;
    Prepare(context);
    return stub_->FetchPartition(&context, request, &response);
  });
  if (!status.ok()) return FromGrpc(status);
  return std::move(*response.mutable_partition());
}

absl::StatusOr<v1::ReportStepResponse> TrainerClient::Report(const v1::StepReport& report) {
  v1::ReportStepRequest request;
  *request.mutable_report() = report;
  v1::ReportStepResponse response;
  const absl::Time give_up = absl::Now() + options_.retry_for;
  while (true) {
    const grpc::Status status = WithRetries(options_, [&] {
      grpc::ClientContext context;
      Prepare(context);
      return stub_->ReportStep(&context, request, &response);
    });
    if (!status.ok()) return FromGrpc(status);
    if (response.decision() != v1::ReportStepResponse::PENDING) return response;
    if (absl::Now() >= give_up) {
      return absl::UnavailableError(absl::StrCat("step ", report.step(), ": no decision after ",
                                                 absl::FormatDuration(options_.retry_for)));
    }
  }
}

absl::StatusOr<v1::GetStatusResponse> TrainerClient::Status() {
  v1::GetStatusResponse response;
  const grpc::Status status = WithRetries(options_, [&] {
    grpc::ClientContext context;
    Prepare(context);
    return stub_->GetStatus(&context, {}, &response);
  });
  if (!status.ok()) return FromGrpc(status);
  return response;
}

RolloutSender::RolloutSender(ClientOptions options)
    : options_(std::move(options)), stub_(v1::Dispatcher::NewStub(DispatcherChannel(options_))) {}

absl::StatusOr<std::vector<v1::IngestResponse>> RolloutSender::Send(
    absl::Span<const v1::Trajectory> trajectories) {
  std::vector<v1::IngestResponse> answers;
  answers.reserve(trajectories.size());
  const absl::Time give_up = absl::Now() + options_.retry_for;
  absl::Duration backoff = absl::Milliseconds(10);
  while (answers.size() < trajectories.size()) {
    grpc::ClientContext context;
    context.set_wait_for_ready(true);
    if (!options_.token.empty()) context.AddMetadata("authorization", "Bearer " + options_.token);
    // A stream lives as long as it makes progress; each answer must come within call_timeout.
    context.set_deadline(absl::ToChronoTime(
        absl::Now() +
        options_.call_timeout * static_cast<double>(trajectories.size() - answers.size() + 1)));
    std::unique_ptr<grpc::ClientReaderWriter<v1::IngestRequest, v1::IngestResponse>> stream =
        stub_->Ingest(&context);
    const size_t before = answers.size();
    v1::IngestRequest request;
    v1::IngestResponse answer;
    while (answers.size() < trajectories.size()) {
      *request.mutable_trajectory() = trajectories[answers.size()];
      if (!stream->Write(request) || !stream->Read(&answer)) break;
      answers.push_back(std::move(answer));
    }
    if (answers.size() == trajectories.size()) stream->WritesDone();
    const grpc::Status status = stream->Finish();
    if (answers.size() == trajectories.size()) break;
    if (!status.ok() && !Retryable(status.error_code()) &&
        status.error_code() != grpc::StatusCode::CANCELLED && !DispatcherAsksToBackOff(status)) {
      return FromGrpc(status);
    }
    if (absl::Now() >= give_up) {
      return absl::UnavailableError(
          absl::StrCat(trajectories.size() - answers.size(),
                       " trajectories not acknowledged: ", status.error_message()));
    }
    if (answers.size() == before) {  // no progress: back off before reconnecting
      std::this_thread::sleep_for(absl::ToChronoNanoseconds(backoff));
      backoff = std::min(backoff * 2, absl::Seconds(1));
    } else {
      backoff = absl::Milliseconds(10);
    }
  }
  return answers;
}

}  // namespace dta

#include "dispatcher/service/dispatcher_service.h"

#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"

namespace dta {
namespace {

// Compares in time independent of where the strings differ, so that the answer's timing does
// not reveal a token's prefix.
bool SecretEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ |= static_cast<unsigned char>(a[i] ^ b[i]);
  return differ == 0;
}

// The token of the call's "authorization: Bearer <token>" metadata; empty when there is none.
std::string_view BearerToken(grpc::CallbackServerContext* context) {
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return {};
  const std::string_view value(it->second.data(), it->second.size());
  constexpr std::string_view kBearer = "Bearer ";
  return value.substr(0, kBearer.size()) == kBearer ? value.substr(kBearer.size())
                                                    : std::string_view();
}

}  // namespace

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

WorkerPool::WorkerPool(int threads) {
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this] {
      while (true) {
        std::function<void()> task;
        {
          std::unique_lock<std::mutex> lock(mu_);
          ready_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
          if (tasks_.empty()) return;  // stopping, and nothing left to do
          task = std::move(tasks_.front());
          tasks_.pop_front();
        }
        task();
      }
    });
  }
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  ready_.notify_all();
  for (std::thread& thread : threads_) thread.join();
}

void WorkerPool::Submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  ready_.notify_one();
}

// One rollout stream: read a trajectory, store it (on a worker), answer, and read the next one
// once the pending pool has room. Strictly one operation in flight, so no locking is needed
// beyond what gRPC's callbacks already order.
class DispatcherService::IngestReactor final
    : public grpc::ServerBidiReactor<v1::IngestRequest, v1::IngestResponse> {
 public:
  IngestReactor(DispatcherService* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context) {
    if (grpc::Status refused = service_->Authorize(context, CallerRole::kRollout, "Ingest");
        !refused.ok()) {
      Finish(refused);
      return;
    }
    ReadWhenThereIsRoom();  // a new stream's first trajectory too: the limit is hard
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client finished sending (or the call broke): every answer is written
      Finish(grpc::Status::OK);
      return;
    }
    service_->ingest_workers_.Submit([this] {
      absl::StatusOr<v1::IngestResponse> response = service_->core_->Ingest(request_.trajectory());
      // The pool filled up since the read (other streams took the room): wait, then store it.
      while (response.status().code() == absl::StatusCode::kResourceExhausted) {
        if (!WaitForRoom()) return;
        response = service_->core_->Ingest(request_.trajectory());
      }
      if (!response.ok()) {  // not stored, not acknowledged: the client resends elsewhere or later
        Finish(ToGrpc(response.status()));
        return;
      }
      response_ = *std::move(response);
      StartWrite(&response_);
    });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the acknowledgement could not be sent"));
      return;
    }
    ReadWhenThereIsRoom();
  }

  void OnDone() override { delete this; }

 private:
  // Backpressure: the next trajectory is read only while the pending pool has room; otherwise a
  // worker waits for room (HTTP/2 flow control holds the client meanwhile).
  void ReadWhenThereIsRoom() {
    if (service_->core_->HasRoom()) {
      StartRead(&request_);
      return;
    }
    service_->ingest_workers_.Submit([this] {
      if (WaitForRoom()) StartRead(&request_);
    });
  }

  // On a worker: true once there is room; false (the call finished CANCELLED) when the client
  // gave up first.
  bool WaitForRoom() {
    while (!service_->core_->AwaitRoom(absl::Now() + absl::Milliseconds(200))) {
      if (context_->IsCancelled()) {
        Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled while waiting for room"));
        return false;
      }
    }
    return true;
  }

  DispatcherService* const service_;
  grpc::CallbackServerContext* const context_;
  v1::IngestRequest request_;
  v1::IngestResponse response_;
};

DispatcherService::DispatcherService(DispatcherCore* core, DispatcherServiceOptions options)
    : core_(core),
      options_(std::move(options)),
      ingest_workers_(options_.worker_threads),
      trainer_workers_(options_.trainer_threads) {}

DispatcherService::~DispatcherService() = default;

grpc::Status DispatcherService::Authorize(grpc::CallbackServerContext* context, CallerRole role,
                                          const char* rpc) const {
  const std::string_view token = BearerToken(context);
  const bool rollout = !options_.rollout_token.empty() && !token.empty() &&
                       SecretEquals(token, options_.rollout_token);
  const bool trainer = !options_.trainer_token.empty() && !token.empty() &&
                       SecretEquals(token, options_.trainer_token);
  switch (role) {
    case CallerRole::kRollout:
      if (trainer) {
        return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                            absl::StrCat(rpc,
                                         ": the trainer credential cannot send trajectories; "
                                         "rollout workers use the rollout credential"));
      }
      if (rollout || options_.rollout_token.empty()) return grpc::Status::OK;
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          absl::StrCat(rpc,
                                       " needs the rollout credential (the token in "
                                       "dta-dispatcher's --rollout_token_file): missing or "
                                       "wrong authorization token"));
    case CallerRole::kTrainer:
      if (trainer || options_.trainer_token.empty()) return grpc::Status::OK;
      if (rollout) {
        return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                            absl::StrCat(rpc,
                                         " is a trainer's call: the rollout credential "
                                         "cannot make it"));
      }
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          absl::StrCat(rpc,
                                       " needs the trainer credential (the token file "
                                       "dta-dispatcher printed at start, its "
                                       "--trainer_token_file): missing or wrong "
                                       "authorization token"));
    case CallerRole::kReader:
      if (rollout || trainer || options_.rollout_token.empty()) return grpc::Status::OK;
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          absl::StrCat(rpc,
                                       " needs the rollout or the trainer credential: "
                                       "missing or wrong authorization token"));
  }
  return grpc::Status(grpc::StatusCode::INTERNAL, "unknown caller role");
}

template <typename Answer>
void DispatcherService::LongPoll(grpc::CallbackServerContext* context,
                                 grpc::ServerUnaryReactor* reactor,
                                 std::function<absl::StatusOr<Answer>()> attempt,
                                 std::function<bool(const absl::StatusOr<Answer>&)> final,
                                 std::function<void(Answer)> deliver) {
  trainer_workers_.Submit([this, context, reactor, attempt = std::move(attempt),
                           final = std::move(final), deliver = std::move(deliver)] {
    const absl::Time deadline = PollDeadline(context);
    while (true) {
      const uint64_t seen = core_->change_count();
      absl::StatusOr<Answer> answer = attempt();
      if (final(answer) || absl::Now() >= deadline || context->IsCancelled()) {
        if (answer.ok()) deliver(*std::move(answer));
        reactor->Finish(ToGrpc(answer.status()));
        return;
      }
      core_->AwaitChange(seen, deadline);
    }
  });
}

bool DispatcherService::Refuse(grpc::CallbackServerContext* context,
                               grpc::ServerUnaryReactor* reactor, CallerRole role,
                               const char* rpc) const {
  grpc::Status status = Authorize(context, role, rpc);
  if (status.ok()) return false;
  reactor->Finish(std::move(status));
  return true;
}

absl::Time DispatcherService::PollDeadline(grpc::CallbackServerContext* context) const {
  absl::Time deadline = absl::Now() + options_.long_poll;
  const absl::Time client = absl::FromChrono(context->deadline());
  // Answer a little before the client gives up, so it sees "not yet" rather than a timeout.
  return std::min(deadline, client - absl::Milliseconds(100));
}

grpc::ServerBidiReactor<v1::IngestRequest, v1::IngestResponse>* DispatcherService::Ingest(
    grpc::CallbackServerContext* context) {
  return new IngestReactor(this, context);
}

grpc::ServerUnaryReactor* DispatcherService::RegisterTrainer(
    grpc::CallbackServerContext* context, const v1::RegisterTrainerRequest* request,
    v1::RegisterTrainerResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (Refuse(context, reactor, CallerRole::kTrainer, "RegisterTrainer")) return reactor;
  trainer_workers_.Submit([this, request, response, reactor] {
    absl::StatusOr<v1::RegisterTrainerResponse> result = core_->RegisterTrainer(*request);
    if (result.ok()) *response = *std::move(result);
    reactor->Finish(ToGrpc(result.status()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* DispatcherService::FetchPartition(
    grpc::CallbackServerContext* context, const v1::FetchPartitionRequest* request,
    v1::FetchPartitionResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (Refuse(context, reactor, CallerRole::kTrainer, "FetchPartition")) return reactor;
  // Not ready yet (UNAVAILABLE): wait for trajectories or trainers.
  LongPoll<v1::Partition>(
      context, reactor, [this, request] { return core_->FetchPartition(*request); },
      [](const absl::StatusOr<v1::Partition>& p) {
        return p.status().code() != absl::StatusCode::kUnavailable;
      },
      [response](v1::Partition p) { *response->mutable_partition() = std::move(p); });
  return reactor;
}

grpc::ServerUnaryReactor* DispatcherService::ReportStep(grpc::CallbackServerContext* context,
                                                        const v1::ReportStepRequest* request,
                                                        v1::ReportStepResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (Refuse(context, reactor, CallerRole::kTrainer, "ReportStep")) return reactor;
  // PENDING: wait for the other ranks. Asking again with the same report is harmless (a rank's
  // PREPARED report replaces itself).
  LongPoll<v1::ReportStepResponse>(
      context, reactor, [this, request] { return core_->ReportStep(request->report()); },
      [](const absl::StatusOr<v1::ReportStepResponse>& d) {
        return !d.ok() || d->decision() != v1::ReportStepResponse::PENDING;
      },
      [response](v1::ReportStepResponse d) { *response = std::move(d); });
  return reactor;
}

grpc::ServerUnaryReactor* DispatcherService::GetStatus(grpc::CallbackServerContext* context,
                                                       const v1::GetStatusRequest* request,
                                                       v1::GetStatusResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (Refuse(context, reactor, CallerRole::kReader, "GetStatus")) return reactor;
  trainer_workers_.Submit([this, response, reactor] {
    *response = core_->GetStatus();
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

grpc::ServerUnaryReactor* DispatcherService::GetStatistics(grpc::CallbackServerContext* context,
                                                           const v1::GetStatisticsRequest* request,
                                                           v1::GetStatisticsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (Refuse(context, reactor, CallerRole::kReader, "GetStatistics")) return reactor;
  trainer_workers_.Submit([this, response, reactor] {
    *response = core_->GetStatistics();
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

}  // namespace dta

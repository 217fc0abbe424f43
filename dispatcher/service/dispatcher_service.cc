#include "dispatcher/service/dispatcher_service.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/secret_equals.h"
#include "dispatcher/wire/ingest_back_off.h"

namespace dta {
namespace {

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

// Parses the bytes of a request to the call `rpc`; INVALID_ARGUMENT naming the call when they are
// not a Message. It reads a copy (sharing the bytes): gRPC's deserializer clears what it reads.
template <typename Message>
grpc::Status Parse(const grpc::ByteBuffer& bytes, const char* rpc, Message* message) {
  grpc::ByteBuffer copy(bytes);
  const grpc::Status parsed = grpc::SerializationTraits<Message>::Deserialize(&copy, message);
  if (parsed.ok()) return grpc::Status::OK;
  // gRPC's reason is usually empty: protobuf says only that parsing failed.
  const std::string reason =
      parsed.error_message().empty() ? "" : absl::StrCat(" (", parsed.error_message(), ")");
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      absl::StrCat(rpc, ": the request could not be parsed: its bytes are not a ",
                                   message->GetTypeName(), reason));
}

// Serializes `message` into `bytes`, replacing what they held (gRPC's serializer aborts on a
// buffer that still holds bytes).
template <typename Message>
grpc::Status Serialize(const Message& message, grpc::ByteBuffer* bytes) {
  bytes->Clear();
  bool own_buffer = false;
  return grpc::SerializationTraits<Message>::Serialize(message, bytes, &own_buffer);
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
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  IngestReactor(DispatcherService* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context) {
    if (grpc::Status refused = service_->Authorize(context, CallerRole::kRollout, "Ingest");
        !refused.ok()) {
      Finish(refused);
      return;
    }
    if (grpc::Status refused = service_->OpenStream(); !refused.ok()) {
      Finish(refused);
      return;
    }
    counted_ = true;
    ReadWhenThereIsRoom();  // a new stream's first trajectory too: the limit is hard
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client finished sending (or the call broke): every answer is written
      End(grpc::Status::OK);
      return;
    }
    // Undecodable bytes end the stream: no answer could name their trajectory, and the client is
    // broken, not the trajectory. What was acknowledged before stays stored.
    grpc::Status parsed = Parse(request_bytes_, "Ingest", &request_);
    request_bytes_.Clear();  // the parsed trajectory is all that is kept
    if (!parsed.ok()) {
      End(parsed);
      return;
    }
    // Counted against the streams' budget until answered, whatever keeps it: a queue of workers,
    // the log's sync, or a full pending pool.
    const int64_t bytes = static_cast<int64_t>(request_.SpaceUsedLong());
    const int64_t budget = service_->options_.max_held_bytes;
    if (bytes > budget) {  // never storable: an answer, not a failure the client would retry
      Answer(RejectedAsTooLarge(bytes, budget));
      return;
    }
    if (grpc::Status refused = service_->Hold(request_.trajectory().id(), bytes); !refused.ok()) {
      End(std::move(refused));
      return;
    }
    held_ = bytes;
    service_->ingest_workers_.Submit([this] {
      absl::StatusOr<v1::IngestResponse> response = service_->core_->Ingest(request_.trajectory());
      // The pool filled up since the read (other streams took the room): wait, then store it.
      while (response.status().code() == absl::StatusCode::kResourceExhausted) {
        if (!WaitForRoom()) return;
        response = service_->core_->Ingest(request_.trajectory());
      }
      if (!response.ok()) {  // not stored, not acknowledged: the client resends elsewhere or later
        End(ToGrpc(response.status()));
        return;
      }
      Answer(*std::move(response));
    });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the acknowledgement could not be sent"));
      return;
    }
    ReadWhenThereIsRoom();
  }

  void OnDone() override {
    Release();  // every path ends here; End has released already unless gRPC ended the call
    if (counted_) service_->CloseStream();
    delete this;
  }

 private:
  // Backpressure: the next trajectory is read only while the pending pool has room; otherwise a
  // worker waits for room (HTTP/2 flow control holds the client meanwhile).
  void ReadWhenThereIsRoom() {
    if (service_->core_->HasRoom()) {
      StartRead(&request_bytes_);
      return;
    }
    service_->ingest_workers_.Submit([this] {
      if (WaitForRoom()) StartRead(&request_bytes_);
    });
  }

  // On a worker: true once there is room; false (the call finished CANCELLED) when the client
  // gave up first.
  bool WaitForRoom() {
    while (!service_->core_->AwaitRoom(absl::Now() + absl::Milliseconds(200))) {
      if (context_->IsCancelled()) {
        End(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled while waiting for room"));
        return false;
      }
    }
    return true;
  }

  v1::IngestResponse RejectedAsTooLarge(int64_t bytes, int64_t budget) const {
    v1::IngestResponse response;
    response.set_id(request_.trajectory().id());
    response.set_outcome(v1::IngestResponse::REJECTED);
    response.set_field("tokens");
    response.set_reason(absl::StrCat(
        "field 'tokens': the trajectory takes ", bytes,
        " bytes in memory, more than the dispatcher holds of received trajectories for all "
        "streams together (max_held_bytes = ",
        budget, ", dta-dispatcher's --max_held_mb)"));
    return response;
  }

  // Writes the answer to the current trajectory, which is then done with.
  void Answer(const v1::IngestResponse& response) {
    Release();
    if (grpc::Status serialized = Serialize(response, &response_bytes_); !serialized.ok()) {
      End(serialized);
      return;
    }
    StartWrite(&response_bytes_);
  }

  // The current trajectory is answered or abandoned: its memory and its share of the budget go
  // back.
  void Release() {
    v1::IngestRequest().Swap(&request_);  // Clear() would keep the repeated fields' capacity
    if (held_ > 0) service_->ReleaseHeld(held_);
    held_ = 0;
  }

  // Finish, once the current trajectory is released (OnDone may run as soon as Finish is called).
  void End(grpc::Status status) {
    Release();
    Finish(std::move(status));
  }

  DispatcherService* const service_;
  grpc::CallbackServerContext* const context_;
  bool counted_ = false;  // by OpenStream
  int64_t held_ = 0;      // bytes of request_ counted by Hold
  grpc::ByteBuffer request_bytes_;
  v1::IngestRequest request_;
  grpc::ByteBuffer response_bytes_;
};

// A unary call of the raw service seen typed, so that the handlers read a parsed request and fill
// a response as with the generated service. Its Finish is the only way to end the call (the
// reactor is a private base): it serializes an OK call's response into gRPC's buffer first.
// Deletes itself once gRPC is done with the call, which is never before Finish.
template <typename Request, typename Response>
class DispatcherService::UnaryCall final : private grpc::ServerUnaryReactor {
 public:
  // `response_bytes` is gRPC's buffer for the answer; it outlives the call.
  UnaryCall(grpc::CallbackServerContext* context, grpc::ByteBuffer* response_bytes)
      : context_(context), response_bytes_(response_bytes) {}

  // Parses the request's bytes; false (the call finished INVALID_ARGUMENT) when they do not.
  bool ParseRequest(const grpc::ByteBuffer& bytes, const char* rpc) {
    grpc::Status parsed = Parse(bytes, rpc, &request_);
    if (parsed.ok()) return true;
    Finish(std::move(parsed));
    return false;
  }

  // Ends the call: with the response when `status` is OK, with `status` alone otherwise.
  void Finish(grpc::Status status) {
    if (status.ok()) status = Serialize(response_, response_bytes_);
    grpc::ServerUnaryReactor::Finish(std::move(status));
  }

  grpc::CallbackServerContext* context() const { return context_; }
  const Request& request() const { return request_; }
  Response* response() { return &response_; }
  // What gRPC is handed: it calls OnDone once the call is over.
  grpc::ServerUnaryReactor* reactor() { return this; }

 private:
  void OnDone() override { delete this; }

  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer* const response_bytes_;
  Request request_;
  Response response_;
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

template <typename Request, typename Response>
grpc::ServerUnaryReactor* DispatcherService::Serve(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer& request,
                                                   grpc::ByteBuffer* response, CallerRole role,
                                                   const char* rpc,
                                                   Handler<Request, Response> handler) {
  auto* call = new UnaryCall<Request, Response>(context, response);
  // The credential first: a caller without one learns nothing, not even whether its bytes parse.
  if (grpc::Status refused = Authorize(context, role, rpc); !refused.ok()) {
    call->Finish(std::move(refused));
  } else if (call->ParseRequest(request, rpc)) {
    (this->*handler)(call);
  }
  return call->reactor();  // gRPC binds it only now: a Finish before then waits for it
}

template <typename Answer, typename Request, typename Response>
void DispatcherService::LongPoll(UnaryCall<Request, Response>* call,
                                 std::function<absl::StatusOr<Answer>()> attempt,
                                 std::function<bool(const absl::StatusOr<Answer>&)> final,
                                 std::function<void(Answer)> deliver) {
  trainer_workers_.Submit([this, call, attempt = std::move(attempt), final = std::move(final),
                           deliver = std::move(deliver)] {
    const absl::Time deadline = PollDeadline(call->context());
    while (true) {
      const uint64_t seen = core_->change_count();
      absl::StatusOr<Answer> answer = attempt();
      if (final(answer) || absl::Now() >= deadline || call->context()->IsCancelled()) {
        if (answer.ok()) deliver(*std::move(answer));
        call->Finish(ToGrpc(answer.status()));
        return;
      }
      core_->AwaitChange(seen, deadline);
    }
  });
}

grpc::Status DispatcherService::OpenStream() {
  absl::MutexLock lock(&memory_mu_);
  if (memory_.open_streams >= options_.max_ingest_streams) {
    ++memory_.refused_over_streams;
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat(kIngestBackOffPrefix, memory_.open_streams,
                                     " streams are open, the most the dispatcher serves at once "
                                     "(max_ingest_streams); back off and connect again"));
  }
  ++memory_.open_streams;
  return grpc::Status::OK;
}

void DispatcherService::CloseStream() {
  absl::MutexLock lock(&memory_mu_);
  --memory_.open_streams;
}

grpc::Status DispatcherService::Hold(const std::string& id, int64_t bytes) {
  absl::MutexLock lock(&memory_mu_);
  if (memory_.held_bytes + bytes > options_.max_held_bytes) {
    ++memory_.refused_over_held_bytes;
    return grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat(kIngestBackOffPrefix, "'", id, "' (", bytes, " bytes) was not stored: ",
                     memory_.held_trajectories, " received trajectories not yet stored take ",
                     memory_.held_bytes, " of the ", options_.max_held_bytes,
                     " bytes the dispatcher holds for them (max_held_bytes, dta-dispatcher's "
                     "--max_held_mb); back off and send it again, or raise --max_held_mb"));
  }
  memory_.held_bytes += bytes;
  ++memory_.held_trajectories;
  memory_.peak_held_bytes = std::max(memory_.peak_held_bytes, memory_.held_bytes);
  return grpc::Status::OK;
}

void DispatcherService::ReleaseHeld(int64_t bytes) {
  absl::MutexLock lock(&memory_mu_);
  memory_.held_bytes -= bytes;
  --memory_.held_trajectories;
}

IngestMemory DispatcherService::ingest_memory() const {
  absl::MutexLock lock(&memory_mu_);
  return memory_;
}

absl::Time DispatcherService::PollDeadline(grpc::CallbackServerContext* context) const {
  absl::Time deadline = absl::Now() + options_.long_poll;
  const absl::Time client = absl::FromChrono(context->deadline());
  // Answer a little before the client gives up, so it sees "not yet" rather than a timeout.
  return std::min(deadline, client - absl::Milliseconds(100));
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* DispatcherService::Ingest(
    grpc::CallbackServerContext* context) {
  return new IngestReactor(this, context);
}

grpc::ServerUnaryReactor* DispatcherService::RegisterTrainer(grpc::CallbackServerContext* context,
                                                             const grpc::ByteBuffer* request,
                                                             grpc::ByteBuffer* response) {
  return Serve(context, *request, response, CallerRole::kTrainer, "RegisterTrainer",
               &DispatcherService::ServeRegisterTrainer);
}

grpc::ServerUnaryReactor* DispatcherService::FetchPartition(grpc::CallbackServerContext* context,
                                                            const grpc::ByteBuffer* request,
                                                            grpc::ByteBuffer* response) {
  return Serve(context, *request, response, CallerRole::kTrainer, "FetchPartition",
               &DispatcherService::ServeFetchPartition);
}

grpc::ServerUnaryReactor* DispatcherService::ReportStep(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  return Serve(context, *request, response, CallerRole::kTrainer, "ReportStep",
               &DispatcherService::ServeReportStep);
}

grpc::ServerUnaryReactor* DispatcherService::GetStatus(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  return Serve(context, *request, response, CallerRole::kReader, "GetStatus",
               &DispatcherService::ServeGetStatus);
}

grpc::ServerUnaryReactor* DispatcherService::GetStatistics(grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* request,
                                                           grpc::ByteBuffer* response) {
  return Serve(context, *request, response, CallerRole::kReader, "GetStatistics",
               &DispatcherService::ServeGetStatistics);
}

void DispatcherService::ServeRegisterTrainer(
    UnaryCall<v1::RegisterTrainerRequest, v1::RegisterTrainerResponse>* call) {
  trainer_workers_.Submit([this, call] {
    absl::StatusOr<v1::RegisterTrainerResponse> result = core_->RegisterTrainer(call->request());
    if (result.ok()) *call->response() = *std::move(result);
    call->Finish(ToGrpc(result.status()));
  });
}

void DispatcherService::ServeFetchPartition(
    UnaryCall<v1::FetchPartitionRequest, v1::FetchPartitionResponse>* call) {
  // Not ready yet (UNAVAILABLE): wait for trajectories or trainers.
  LongPoll<v1::Partition>(
      call, [this, call] { return core_->FetchPartition(call->request()); },
      [](const absl::StatusOr<v1::Partition>& p) {
        return p.status().code() != absl::StatusCode::kUnavailable;
      },
      [call](v1::Partition p) { *call->response()->mutable_partition() = std::move(p); });
}

void DispatcherService::ServeReportStep(
    UnaryCall<v1::ReportStepRequest, v1::ReportStepResponse>* call) {
  // PENDING: wait for the other ranks. Asking again with the same report is harmless (a rank's
  // PREPARED report replaces itself).
  LongPoll<v1::ReportStepResponse>(
      call, [this, call] { return core_->ReportStep(call->request().report()); },
      [](const absl::StatusOr<v1::ReportStepResponse>& d) {
        return !d.ok() || d->decision() != v1::ReportStepResponse::PENDING;
      },
      [call](v1::ReportStepResponse d) { *call->response() = std::move(d); });
}

void DispatcherService::ServeGetStatus(
    UnaryCall<v1::GetStatusRequest, v1::GetStatusResponse>* call) {
  trainer_workers_.Submit([this, call] {
    *call->response() = core_->GetStatus();
    call->Finish(grpc::Status::OK);
  });
}

void DispatcherService::ServeGetStatistics(
    UnaryCall<v1::GetStatisticsRequest, v1::GetStatisticsResponse>* call) {
  trainer_workers_.Submit([this, call] {
    *call->response() = core_->GetStatistics();
    call->Finish(grpc::Status::OK);
  });
}

}  // namespace dta

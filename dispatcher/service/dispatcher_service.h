// The dispatcher's gRPC service (dta.v1.Dispatcher) over a DispatcherCore, with the callback API.
//
// Reactions never block: everything that may wait or take the dispatcher's lock (the log's sync on
// ingestion, long polls for a batch or a commit decision, waiting for room in the pending pool)
// runs on the service's own worker threads, ingestion and trainers on separate pools. One Ingest
// stream has at most one read and one write in flight, and reads the next trajectory only after
// answering the last one and only while the pending pool has room: when it is full the dispatcher
// stops reading, and HTTP/2 flow control pushes back on the client.
//
// Memory: a received trajectory counts against max_held_bytes, shared by all streams, from the
// moment gRPC hands it over until it is answered (checked and logged, or waiting for room: a stream
// that read while the pool had room may find it full by the time its trajectory is stored). One
// that would take the total past the budget is not stored: its stream ends RESOURCE_EXHAUSTED
// (back off and resend; what the stream acknowledged before stays stored). One larger than the
// whole budget could never be held: it is REJECTED (field "tokens") and the stream goes on. Past
// max_ingest_streams open streams, a new one ends RESOURCE_EXHAUSTED at once: gRPC itself holds,
// for each open stream, the message it is receiving (up to the server's max receive size) or,
// for a stream not being read, up to its HTTP/2 flow-control window (a few MiB once the window has
// grown). See docs/usage.md for the whole bound.
//
// Security: two roles, each with its own credential, presented as the metadata "authorization:
// Bearer <token>":
//   rollout workers  Ingest, with rollout_token (open when it is empty: loopback only);
//   trainers         RegisterTrainer, FetchPartition, ReportStep, with trainer_token
//   (dta-dispatcher
//                    always sets one, creating it when none is given, so that no other local
//                    process can take a batch, commit it untrained or abort a step);
//   either           GetStatus, GetStatistics (read-only; open when rollout_token is empty).
// A missing or unknown credential gets UNAUTHENTICATED, the other role's PERMISSION_DENIED; both
// name the call and the credential it needs. dta-dispatcher refuses a non-loopback address without
// TLS and both credentials.
//
// Undecodable requests: bytes that do not parse as the call's request message get
// INVALID_ARGUMENT naming the call (once the credential was accepted). For Ingest this ends the
// stream; what it acknowledged before stays stored. The service receives every message as bytes
// and parses them itself, since gRPC's generated handlers would answer such a unary call
// UNIMPLEMENTED and end such a stream as if the client had finished (OK).
//
// Thread safety: thread-safe; owned by the server's lifetime (destroy after the server shut down).
#pragma once

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "dispatcher/core/dispatcher_core.h"
#include "proto/dta/v1/dispatcher.grpc.pb.h"

namespace dta {

struct DispatcherServiceOptions {
  // Threads for ingestion (log syncs, waiting for room). Concurrent streams beyond this wait their
  // turn; more threads let more of them share one log sync.
  int worker_threads = 32;
  // Threads for the trainers' calls (long polls for batches and decisions, registration,
  // statistics): a pool of their own, so that streams paused by backpressure can never keep the
  // trainers from taking the batch that would make room.
  int trainer_threads = 64;
  // The longest a FetchPartition or ReportStep call waits for a batch or a decision before it
  // answers UNAVAILABLE / PENDING (or the client's deadline, if sooner).
  absl::Duration long_poll = absl::Seconds(2);
  // The rollout workers' and the trainers' credentials (see the header comment); empty: that
  // role's calls are open. They must differ when both are set.
  std::string rollout_token;
  std::string trainer_token;
  // The most bytes of received trajectories the Ingest streams hold at once, all together (their
  // parsed size in memory; see "Memory" above). Must be positive.
  int64_t max_held_bytes = int64_t{1} << 30;
  // The most Ingest streams open at once (see "Memory" above). Must be positive.
  int max_ingest_streams = 1024;
};

// What the Ingest streams hold now (see "Memory" above).
struct IngestMemory {
  int64_t held_bytes = 0;         // received trajectories not yet answered, in bytes
  int64_t held_trajectories = 0;  // and their number
  int64_t peak_held_bytes = 0;    // the most held_bytes has been since the service started
  int64_t open_streams = 0;       // Ingest streams open (past their credential check)
  // Streams ended RESOURCE_EXHAUSTED by max_held_bytes, and by max_ingest_streams, since the start.
  int64_t refused_over_held_bytes = 0;
  int64_t refused_over_streams = 0;
};

// Who may make a call (see the header comment).
enum class CallerRole {
  kRollout,  // Ingest
  kTrainer,  // RegisterTrainer, FetchPartition, ReportStep
  kReader,   // GetStatus, GetStatistics: either role
};

// A fixed pool of threads running queued tasks; the destructor finishes the queue and joins.
class WorkerPool {
 public:
  explicit WorkerPool(int threads);
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;
  ~WorkerPool();
  void Submit(std::function<void()> task);

 private:
  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// The generated service with every method raw (bytes in, bytes out): see "Undecodable requests"
// above.
using RawDispatcherService = v1::Dispatcher::WithRawCallbackMethod_Ingest<
    v1::Dispatcher::WithRawCallbackMethod_RegisterTrainer<
        v1::Dispatcher::WithRawCallbackMethod_FetchPartition<
            v1::Dispatcher::WithRawCallbackMethod_ReportStep<
                v1::Dispatcher::WithRawCallbackMethod_GetStatus<
                    v1::Dispatcher::WithRawCallbackMethod_GetStatistics<
                        v1::Dispatcher::Service>>>>>>;

class DispatcherService final : public RawDispatcherService {
 public:
  DispatcherService(DispatcherCore* core, DispatcherServiceOptions options);
  ~DispatcherService() override;

  // gRPC's entry points: each checks the credential, parses, then runs the typed handler below.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Ingest(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* RegisterTrainer(grpc::CallbackServerContext* context,
                                            const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* FetchPartition(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ReportStep(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetStatistics(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;

  // A snapshot of what the Ingest streams hold (for metrics and tests). Never blocks for long.
  IngestMemory ingest_memory() const;

 private:
  class IngestReactor;
  // One unary call seen typed: its parsed request, its response, and the only way to finish it.
  template <typename Request, typename Response>
  class UnaryCall;
  template <typename Request, typename Response>
  using Handler = void (DispatcherService::*)(UnaryCall<Request, Response>* call);

  // OK when the call's credential lets `role` make the call named `rpc`; UNAUTHENTICATED or
  // PERMISSION_DENIED (see the header comment) otherwise.
  grpc::Status Authorize(grpc::CallbackServerContext* context, CallerRole role,
                         const char* rpc) const;
  // Answers the unary call `rpc`: refuses it as Authorize says, then INVALID_ARGUMENT when
  // `request` does not parse as a Request; otherwise `handler` finishes it.
  template <typename Request, typename Response>
  grpc::ServerUnaryReactor* Serve(grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer& request, grpc::ByteBuffer* response,
                                  CallerRole role, const char* rpc,
                                  Handler<Request, Response> handler);
  // The typed handlers: each finishes its call, on a worker.
  void ServeRegisterTrainer(
      UnaryCall<v1::RegisterTrainerRequest, v1::RegisterTrainerResponse>* call);
  void ServeFetchPartition(UnaryCall<v1::FetchPartitionRequest, v1::FetchPartitionResponse>* call);
  void ServeReportStep(UnaryCall<v1::ReportStepRequest, v1::ReportStepResponse>* call);
  void ServeGetStatus(UnaryCall<v1::GetStatusRequest, v1::GetStatusResponse>* call);
  void ServeGetStatistics(UnaryCall<v1::GetStatisticsRequest, v1::GetStatisticsResponse>* call);
  // On a worker: calls `attempt` until its answer is `final`, the poll is over or the call is
  // cancelled, waiting for a change of the dispatcher's state in between; then `deliver`s an OK
  // answer into the call's response and finishes the call with the answer's status.
  template <typename Answer, typename Request, typename Response>
  void LongPoll(UnaryCall<Request, Response>* call, std::function<absl::StatusOr<Answer>()> attempt,
                std::function<bool(const absl::StatusOr<Answer>&)> final,
                std::function<void(Answer)> deliver);
  // The time a long poll of this call may wait until.
  absl::Time PollDeadline(grpc::CallbackServerContext* context) const;
  // Counts a new Ingest stream; RESOURCE_EXHAUSTED (not counted) when max_ingest_streams are open.
  grpc::Status OpenStream();
  void CloseStream();
  // Counts `bytes` of the received trajectory `id` against max_held_bytes until ReleaseHeld;
  // RESOURCE_EXHAUSTED (nothing held, the refusal counted) when they would take the total past it.
  grpc::Status Hold(const std::string& id, int64_t bytes);
  void ReleaseHeld(int64_t bytes);

  DispatcherCore* const core_;
  const DispatcherServiceOptions options_;
  // Before the pools, which finish their queues when destroyed.
  mutable absl::Mutex memory_mu_;
  IngestMemory memory_ ABSL_GUARDED_BY(memory_mu_);
  WorkerPool ingest_workers_;
  WorkerPool trainer_workers_;
};

// absl::Status -> grpc::Status (the codes are numerically the same).
grpc::Status ToGrpc(const absl::Status& status);

}  // namespace dta

// The dispatcher over gRPC on loopback: ingestion streams (bad input, load, backpressure, the
// bounds on what they hold), trainers fetching and committing steps, authorization, and kill -9 of
// the dta-dispatcher process between acknowledgements.
#include "dispatcher/service/dispatcher_service.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dispatcher/client/dispatcher_client.h"
#include "dispatcher/service/dispatcher_metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/free_port.h"
#include "tests/testing/process.h"

namespace dta {
namespace {

using ::testing::HasSubstr;

v1::Trajectory Make(const std::string& id, int i) {
  v1::Trajectory t;
  t.set_id(id);
  t.set_group_id("g" + std::to_string(i % 4));
  for (int32_t token : {1, 2, 3, 4 + i % 5, 10 + i % 50}) t.add_tokens(token);
  for (int k = 0; k < 5; ++k) t.add_loss_mask(k >= 3);
  for (int k = 0; k < 5; ++k) t.add_logprobs(-0.5f * k);
  t.set_reward(0.1 * (i % 7));
  return t;
}

std::chrono::system_clock::time_point In(int seconds) {
  return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
}

class DispatcherServiceTest : public ::testing::Test {
 protected:
  DispatcherServiceTest() {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           (std::string("dispatcher_service_") +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  ~DispatcherServiceTest() override {
    if (server_) server_->Shutdown(In(1));
    server_.reset();
    service_.reset();
    core_.reset();
    std::filesystem::remove_all(dir_);
  }

  void Start(int64_t batch = 8, int64_t max_pending = 1 << 16,
             DispatcherServiceOptions service = {}) {
    DispatcherOptions options;
    options.wal_path = (dir_ / "log.wal").string();
    options.limits.vocab_size = 100;
    options.batch = {.rollouts = batch};
    options.max_pending_trajectories = max_pending;
    options.log = [](const std::string&) {};
    absl::StatusOr<std::unique_ptr<DispatcherCore>> core = DispatcherCore::Open(options);
    ASSERT_TRUE(core.ok()) << core.status();
    core_ = *std::move(core);
    service_ = std::make_unique<DispatcherService>(core_.get(), std::move(service));
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(port, 0);
    address_ = "127.0.0.1:" + std::to_string(port);
  }

  // Registers a one-rank trainer on the core and fetches step 0 (taking a batch out of the pending
  // pool); returns the generation.
  int64_t TakeFirstBatch() {
    v1::RegisterTrainerRequest registration;
    registration.set_world_size(1);
    registration.set_trainer_id("t");
    const int64_t generation = core_->RegisterTrainer(registration)->generation();
    v1::FetchPartitionRequest fetch;
    fetch.set_generation(generation);
    EXPECT_TRUE(core_->FetchPartition(fetch).ok());
    return generation;
  }

  std::unique_ptr<v1::Dispatcher::Stub> Stub() {
    return v1::Dispatcher::NewStub(
        grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  }

  std::filesystem::path dir_;
  std::unique_ptr<DispatcherCore> core_;
  std::unique_ptr<DispatcherService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

// Sends every trajectory on one stream and returns the answers in order (the status in `status`).
std::vector<v1::IngestResponse> SendAll(v1::Dispatcher::Stub& stub,
                                        const std::vector<v1::Trajectory>& trajectories,
                                        grpc::Status* status = nullptr, int deadline_seconds = 60) {
  grpc::ClientContext context;
  context.set_deadline(In(deadline_seconds));
  auto stream = stub.Ingest(&context);
  std::vector<v1::IngestResponse> answers;
  for (const v1::Trajectory& t : trajectories) {
    v1::IngestRequest request;
    *request.mutable_trajectory() = t;
    if (!stream->Write(request)) break;
    v1::IngestResponse answer;
    if (!stream->Read(&answer)) break;
    answers.push_back(answer);
  }
  stream->WritesDone();
  grpc::Status finish = stream->Finish();
  if (status != nullptr) *status = finish;
  return answers;
}

TEST_F(DispatcherServiceTest, BadTrajectoriesAreRejectedWhileTheStreamGoesOn) {
  Start();
  std::vector<v1::Trajectory> batch;
  for (int i = 0; i < 6; ++i) batch.push_back(Make("ok" + std::to_string(i), i));
  batch[1].set_tokens(0, 1000);                // outside the vocabulary
  batch[3].mutable_loss_mask()->RemoveLast();  // inconsistent lengths
  batch[4].set_id("ok0");                      // an id taken by other content
  auto stub = Stub();
  grpc::Status status;
  std::vector<v1::IngestResponse> answers = SendAll(*stub, batch, &status);
  EXPECT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(answers.size(), 6u);
  const char* fields[] = {"", "tokens", "", "loss_mask", "id", ""};
  for (int i = 0; i < 6; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(answers[i].id(), batch[i].id());
    EXPECT_EQ(answers[i].outcome(),
              *fields[i] ? v1::IngestResponse::REJECTED : v1::IngestResponse::ACCEPTED);
    EXPECT_EQ(answers[i].field(), fields[i]);
  }
  // The server is still up and counted everything.
  grpc::ClientContext context;
  context.set_deadline(In(10));
  v1::GetStatisticsResponse stats;
  ASSERT_TRUE(stub->GetStatistics(&context, {}, &stats).ok());
  EXPECT_EQ(stats.accepted(), 3);
  EXPECT_EQ(stats.rejected(), 3);
}

TEST_F(DispatcherServiceTest, TrainersLongPollForTheBatchAndCommitTogether) {
  Start(/*batch=*/6);
  std::atomic<int> trained{0};
  std::vector<std::set<std::string>> seen(2);
  std::vector<std::thread> trainers;
  for (int rank = 0; rank < 2; ++rank) {
    trainers.emplace_back([&, rank] {
      auto stub = Stub();
      v1::RegisterTrainerRequest registration;
      registration.set_rank(rank);
      registration.set_world_size(2);
      registration.set_trainer_id("trainer-" + std::to_string(rank));
      v1::RegisterTrainerResponse registered;
      grpc::ClientContext register_context;
      register_context.set_deadline(In(10));
      ASSERT_TRUE(stub->RegisterTrainer(&register_context, registration, &registered).ok());
      for (int64_t step = 0; step < 2; ++step) {
        v1::FetchPartitionResponse fetched;
        while (true) {  // the batch is not there yet: the call waits, then says UNAVAILABLE
          grpc::ClientContext context;
          context.set_deadline(In(5));
          v1::FetchPartitionRequest request;
          request.set_rank(rank);
          request.set_step(step);
          request.set_generation(registered.generation());
          grpc::Status status = stub->FetchPartition(&context, request, &fetched);
          if (status.ok()) break;
          ASSERT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
        }
        for (const v1::Trajectory& t : fetched.partition().trajectories())
          seen[rank].insert(t.id());
        trained += fetched.partition().trajectories_size();
        v1::ReportStepRequest report;
        report.mutable_report()->set_rank(rank);
        report.mutable_report()->set_step(step);
        report.mutable_report()->set_generation(registered.generation());
        report.mutable_report()->set_phase(v1::StepReport::PREPARED);
        v1::ReportStepResponse decision;
        do {
          grpc::ClientContext context;
          context.set_deadline(In(5));
          ASSERT_TRUE(stub->ReportStep(&context, report, &decision).ok());
        } while (decision.decision() == v1::ReportStepResponse::PENDING);
        ASSERT_EQ(decision.decision(), v1::ReportStepResponse::COMMIT);
        EXPECT_EQ(decision.policy_version(), step + 1);
      }
    });
  }
  // The rollouts arrive after the trainers started waiting.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  std::vector<v1::Trajectory> rollouts;
  for (int i = 0; i < 12; ++i) rollouts.push_back(Make("r" + std::to_string(i), i));
  auto stub = Stub();
  EXPECT_EQ(SendAll(*stub, rollouts).size(), 12u);
  for (std::thread& t : trainers) t.join();
  EXPECT_EQ(trained, 12);
  for (const std::string& id : seen[0])
    EXPECT_FALSE(seen[1].contains(id)) << id << " on both ranks";
  EXPECT_EQ(core_->GetStatus().committed_steps(), 2);
}

TEST_F(DispatcherServiceTest, SixtyFourConcurrentStreamsLoseNothing) {
  Start(/*batch=*/8);
  constexpr int kStreams = 64;
  constexpr int kPerStream = 40;
  std::atomic<int> accepted{0};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> clients;
  for (int s = 0; s < kStreams; ++s) {
    clients.emplace_back([&, s] {
      auto stub = Stub();
      std::vector<v1::Trajectory> mine;
      for (int i = 0; i < kPerStream; ++i)
        mine.push_back(Make("s" + std::to_string(s) + "-" + std::to_string(i), i));
      grpc::Status status;
      for (const v1::IngestResponse& answer : SendAll(*stub, mine, &status, 120)) {
        if (answer.outcome() == v1::IngestResponse::ACCEPTED && !answer.already_accepted())
          ++accepted;
      }
      EXPECT_TRUE(status.ok()) << status.error_message();
    });
  }
  for (std::thread& t : clients) t.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(accepted, kStreams * kPerStream);
  EXPECT_EQ(core_->GetStatus().pending_trajectories(), kStreams * kPerStream);
  const v1::GetStatisticsResponse stats = core_->GetStatistics();
  EXPECT_LT(stats.wal_syncs(), stats.accepted());  // concurrent streams shared log syncs
  std::printf(
      "ingestion: %d trajectories on %d streams in %.2f s: %.0f trajectories/s, %lld log syncs\n",
      kStreams * kPerStream, kStreams, seconds, kStreams * kPerStream / seconds,
      static_cast<long long>(stats.wal_syncs()));
}

TEST_F(DispatcherServiceTest, AFullPendingPoolPausesIngestionUntilABatchIsTaken) {
  Start(/*batch=*/5, /*max_pending=*/5);
  std::vector<v1::Trajectory> rollouts;
  for (int i = 0; i < 12; ++i) rollouts.push_back(Make("p" + std::to_string(i), i));
  std::atomic<int> answered{0};
  std::thread client([&] {
    auto stub = Stub();
    grpc::ClientContext context;
    context.set_deadline(In(60));
    auto stream = stub->Ingest(&context);
    for (const v1::Trajectory& t : rollouts) {
      v1::IngestRequest request;
      *request.mutable_trajectory() = t;
      ASSERT_TRUE(stream->Write(request));
      v1::IngestResponse answer;
      ASSERT_TRUE(stream->Read(&answer));
      ++answered;
    }
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(answered, 5);                       // the pool is full: the sixth is not read
  const int64_t generation = TakeFirstBatch();  // takes 5 out of the pool
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(answered, 10);
  v1::StepReport report;
  report.set_generation(generation);
  report.set_phase(v1::StepReport::PREPARED);
  ASSERT_EQ(core_->ReportStep(report)->decision(), v1::ReportStepResponse::COMMIT);
  v1::FetchPartitionRequest fetch;
  fetch.set_generation(generation);
  fetch.set_step(1);
  ASSERT_TRUE(core_->FetchPartition(fetch).ok());
  client.join();
  EXPECT_EQ(answered, 12);
}

// --max_pending is a hard limit, whatever the number of streams: 24 clients each connect, send
// one trajectory, give up after a short deadline and reconnect, over and over, while the pool is
// full. Nothing beyond the limit is ever stored or acknowledged; once a batch is taken, exactly
// the room it made is filled.
TEST_F(DispatcherServiceTest, MaxPendingHoldsHoweverManyStreamsConnectAndReconnect) {
  Start(/*batch=*/4, /*max_pending=*/4);
  constexpr int kClients = 24;
  std::atomic<bool> stop{false};
  std::atomic<int> acknowledged{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      auto stub = Stub();
      for (int attempt = 0; !stop; ++attempt) {
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
        auto stream = stub->Ingest(&context);
        v1::IngestRequest request;
        *request.mutable_trajectory() =
            Make("r" + std::to_string(c) + "-" + std::to_string(attempt), attempt);
        v1::IngestResponse answer;
        if (stream->Write(request) && stream->Read(&answer) &&
            answer.outcome() == v1::IngestResponse::ACCEPTED) {
          ++acknowledged;
        }
        context.TryCancel();
        stream->Finish();
      }
    });
  }
  int64_t most_pending = 0;
  auto watch = [&](std::chrono::seconds how_long) {  // the pool's size, sampled every 5 ms
    const auto until = std::chrono::steady_clock::now() + how_long;
    while (std::chrono::steady_clock::now() < until) {
      most_pending = std::max<int64_t>(most_pending, core_->GetStatus().pending_trajectories());
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  };
  watch(std::chrono::seconds(3));
  // Stored exactly up to the limit. A client may give up (its 300 ms deadline) before an answer
  // reaches it on a loaded machine, so it sees at most what was stored, never more.
  EXPECT_EQ(most_pending, 4);
  EXPECT_LE(acknowledged.load(), 4);
  EXPECT_EQ(core_->GetStatistics().accepted(), 4);
  TakeFirstBatch();  // the next 4 get in, and no more
  watch(std::chrono::seconds(2));
  stop = true;
  for (std::thread& t : clients) t.join();
  EXPECT_EQ(most_pending, 4);
  EXPECT_EQ(core_->GetStatistics().accepted(), 8);
  EXPECT_LE(acknowledged.load(), 8);
  EXPECT_GT(acknowledged.load(), 0);
}

// More streams paused by backpressure than ingestion has threads: the trainers' calls still get
// through (they have their own threads) and take the batches that make room, until all is trained.
TEST_F(DispatcherServiceTest, StreamsPausedByBackpressureNeverStarveTheTrainers) {
  Start(/*batch=*/5, /*max_pending=*/5, {.worker_threads = 2});
  constexpr int kStreams = 4;
  std::vector<std::thread> clients;
  for (int c = 0; c < kStreams; ++c) {
    clients.emplace_back([&, c] {
      std::vector<v1::Trajectory> mine;
      for (int i = 0; i < 5; ++i)
        mine.push_back(Make("c" + std::to_string(c) + "-" + std::to_string(i), i));
      auto stub = Stub();
      EXPECT_EQ(SendAll(*stub, mine).size(), 5u);
    });
  }
  auto stub = Stub();
  v1::RegisterTrainerRequest registration;
  registration.set_world_size(1);
  registration.set_trainer_id("t");
  v1::RegisterTrainerResponse registered;
  grpc::ClientContext register_context;
  register_context.set_deadline(In(10));
  ASSERT_TRUE(stub->RegisterTrainer(&register_context, registration, &registered).ok());
  int trained = 0;
  for (int64_t step = 0; step < kStreams; ++step) {
    v1::FetchPartitionRequest fetch;
    fetch.set_step(step);
    fetch.set_generation(registered.generation());
    v1::FetchPartitionResponse fetched;
    grpc::Status status;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    do {
      grpc::ClientContext context;
      context.set_deadline(In(5));
      status = stub->FetchPartition(&context, fetch, &fetched);
    } while (status.error_code() == grpc::StatusCode::UNAVAILABLE &&
             std::chrono::steady_clock::now() < give_up);
    ASSERT_TRUE(status.ok()) << "step " << step << ": " << status.error_message();
    trained += fetched.partition().trajectories_size();
    v1::ReportStepRequest report;
    report.mutable_report()->set_step(step);
    report.mutable_report()->set_generation(registered.generation());
    report.mutable_report()->set_phase(v1::StepReport::PREPARED);
    v1::ReportStepResponse decision;
    grpc::ClientContext report_context;
    report_context.set_deadline(In(10));
    ASSERT_TRUE(stub->ReportStep(&report_context, report, &decision).ok());
    ASSERT_EQ(decision.decision(), v1::ReportStepResponse::COMMIT);
  }
  for (std::thread& t : clients) t.join();
  EXPECT_EQ(trained, kStreams * 5);
}

// Calls `rpc` presenting `token` (none when empty); the status it ends with.
grpc::Status CallAs(v1::Dispatcher::Stub& stub, const std::string& rpc, const std::string& token) {
  grpc::ClientContext context;
  context.set_deadline(In(10));
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  if (rpc == "Ingest") {
    auto stream = stub.Ingest(&context);
    v1::IngestRequest request;
    *request.mutable_trajectory() = Make("role-probe", 0);
    v1::IngestResponse answer;
    if (stream->Write(request)) stream->Read(&answer);
    stream->WritesDone();
    return stream->Finish();
  }
  if (rpc == "RegisterTrainer") {
    v1::RegisterTrainerRequest request;
    request.set_rank(0);
    request.set_world_size(1);
    request.set_trainer_id("role-probe");
    v1::RegisterTrainerResponse response;
    return stub.RegisterTrainer(&context, request, &response);
  }
  if (rpc == "FetchPartition") {
    v1::FetchPartitionRequest request;
    v1::FetchPartitionResponse response;
    return stub.FetchPartition(&context, request, &response);
  }
  if (rpc == "ReportStep") {
    v1::ReportStepRequest request;
    request.mutable_report()->set_phase(v1::StepReport::FAILED);  // what a rogue abort would send
    v1::ReportStepResponse response;
    return stub.ReportStep(&context, request, &response);
  }
  if (rpc == "GetStatus") {
    v1::GetStatusResponse response;
    return stub.GetStatus(&context, {}, &response);
  }
  v1::GetStatisticsResponse response;
  return stub.GetStatistics(&context, {}, &response);
}

// Every RPC with every credential: rollout workers only send, trainers only train, either reads;
// a missing or wrong token is UNAUTHENTICATED, the other role's PERMISSION_DENIED, each naming
// the call. A rogue local process can neither take a batch, commit or abort a step, nor (with a
// rollout token) send trajectories.
TEST_F(DispatcherServiceTest, EachRoleCallsOnlyItsOwnRpcs) {
  Start(8, 1 << 16, {.rollout_token = "roll-secret", .trainer_token = "train-secret"});
  auto stub = Stub();
  using grpc::StatusCode;
  const std::vector<std::string> trainer_rpcs = {"RegisterTrainer", "FetchPartition", "ReportStep"};
  const std::vector<std::string> reader_rpcs = {"GetStatus", "GetStatistics"};
  auto expect = [&](const std::string& rpc, const std::string& token, StatusCode want) {
    const grpc::Status status = CallAs(*stub, rpc, token);
    const bool refused = status.error_code() == StatusCode::UNAUTHENTICATED ||
                         status.error_code() == StatusCode::PERMISSION_DENIED;
    if (want == StatusCode::OK) {
      // Past the credential check: the call itself may still fail (e.g. no step to report).
      EXPECT_FALSE(refused) << rpc << " with '" << token << "': " << status.error_message();
    } else {
      EXPECT_EQ(status.error_code(), want) << rpc << " with '" << token << "'";
      EXPECT_THAT(status.error_message(), HasSubstr(rpc)) << status.error_message();
    }
  };
  for (const std::string& token : {std::string(), std::string("wrong")}) {
    expect("Ingest", token, StatusCode::UNAUTHENTICATED);
    for (const std::string& rpc : trainer_rpcs) expect(rpc, token, StatusCode::UNAUTHENTICATED);
    for (const std::string& rpc : reader_rpcs) expect(rpc, token, StatusCode::UNAUTHENTICATED);
  }
  expect("Ingest", "roll-secret", StatusCode::OK);
  expect("Ingest", "train-secret", StatusCode::PERMISSION_DENIED);
  for (const std::string& rpc : trainer_rpcs) {
    expect(rpc, "roll-secret", StatusCode::PERMISSION_DENIED);
    expect(rpc, "train-secret", StatusCode::OK);
  }
  for (const std::string& rpc : reader_rpcs) {
    expect(rpc, "roll-secret", StatusCode::OK);
    expect(rpc, "train-secret", StatusCode::OK);
  }
  EXPECT_EQ(core_->GetStatus().pending_trajectories(), 1) << "only the rollout worker's arrived";
  // A prefix of the right token is as wrong as any other.
  expect("GetStatus", "roll-secre", StatusCode::UNAUTHENTICATED);
}

// Without a rollout token (loopback) sending and reading are open; the trainers' calls still need
// theirs, and the trainer credential still cannot send.
TEST_F(DispatcherServiceTest, AnOpenIngestStillGuardsTheTrainersCalls) {
  Start(8, 1 << 16, {.trainer_token = "train-secret"});
  auto stub = Stub();
  EXPECT_TRUE(CallAs(*stub, "Ingest", "").ok());
  EXPECT_TRUE(CallAs(*stub, "GetStatus", "").ok());
  EXPECT_EQ(CallAs(*stub, "Ingest", "train-secret").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  for (const char* rpc : {"RegisterTrainer", "FetchPartition", "ReportStep"}) {
    const grpc::Status status = CallAs(*stub, rpc, "");
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << rpc;
    EXPECT_THAT(status.error_message(), HasSubstr("needs the trainer credential"));
  }
  const grpc::Status registered = CallAs(*stub, "RegisterTrainer", "train-secret");
  EXPECT_TRUE(registered.ok()) << registered.error_message();
}

// A truncated length-delimited field (field 1, 127 bytes announced, none sent): no message of
// dta.v1 parses from it.
constexpr char kUndecodable[] = "\x0a\x7f";

grpc::ByteBuffer Bytes(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

grpc::ByteBuffer Serialized(const google::protobuf::Message& message) {
  return Bytes(message.SerializeAsString());
}

// One Ingest stream of raw bytes (what a broken client could send), each operation waited for.
class RawIngestStream {
 public:
  RawIngestStream(grpc::GenericStub& stub, const std::string& token) {
    context_.set_deadline(In(10));
    if (!token.empty()) context_.AddMetadata("authorization", "Bearer " + token);
    stream_ = stub.PrepareCall(&context_, "/dta.v1.Dispatcher/Ingest", &queue_);
    stream_->StartCall(this);
    started_ = Wait();
  }
  ~RawIngestStream() {
    context_.TryCancel();
    queue_.Shutdown();
    void* tag;
    bool ok;
    while (queue_.Next(&tag, &ok)) {
    }
  }

  bool Write(const grpc::ByteBuffer& bytes) {
    if (!started_) return false;
    stream_->Write(bytes, this);
    return Wait();
  }
  // False when the server ended the stream instead of answering.
  bool Read(v1::IngestResponse* answer) {
    grpc::ByteBuffer bytes;
    stream_->Read(&bytes, this);
    if (!Wait()) return false;
    return grpc::SerializationTraits<v1::IngestResponse>::Deserialize(&bytes, answer).ok();
  }
  bool WritesDone() {
    if (!started_) return false;
    stream_->WritesDone(this);
    return Wait();
  }
  grpc::Status Finish() {
    grpc::Status status;
    stream_->Finish(&status, this);
    Wait();
    return status;
  }

 private:
  bool Wait() {
    void* tag;
    bool ok = false;
    return queue_.Next(&tag, &ok) && ok;
  }

  grpc::ClientContext context_;
  grpc::CompletionQueue queue_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> stream_;
  bool started_ = false;
};

// Sends `request` as the unary call `rpc`, presenting `token`; the status it ends with.
grpc::Status RawCall(grpc::GenericStub& stub, const std::string& rpc, const std::string& token,
                     const grpc::ByteBuffer& request) {
  grpc::ClientContext context;
  context.set_deadline(In(10));
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  grpc::ByteBuffer response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/dta.v1.Dispatcher/" + rpc, grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status status) { done.set_value(std::move(status)); });
  return done.get_future().get();
}

// Bytes that are no dta.v1 message, sent to every RPC with the credential it needs: each call
// ends INVALID_ARGUMENT naming the RPC, the credential is still checked first, and the server
// goes on serving well-formed calls.
TEST_F(DispatcherServiceTest, UndecodableRequestsAreInvalidArgumentsOnEveryRpc) {
  Start(8, 1 << 16, {.rollout_token = "roll-secret", .trainer_token = "train-secret"});
  grpc::GenericStub raw(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  const std::vector<std::pair<std::string, std::string>> unary = {
      {"RegisterTrainer", "train-secret"},
      {"FetchPartition", "train-secret"},
      {"ReportStep", "train-secret"},
      {"GetStatus", "roll-secret"},
      {"GetStatistics", "train-secret"}};
  for (const auto& [rpc, token] : unary) {
    const grpc::Status status = RawCall(raw, rpc, token, Bytes(kUndecodable));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << rpc << ": " << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(rpc + ": the request could not be parsed"));
    EXPECT_EQ(RawCall(raw, rpc, "wrong", Bytes(kUndecodable)).error_code(),
              grpc::StatusCode::UNAUTHENTICATED)
        << rpc;
  }
  {
    RawIngestStream stream(raw, "roll-secret");
    stream.Write(Bytes(kUndecodable));
    v1::IngestResponse answer;
    EXPECT_FALSE(stream.Read(&answer));
    const grpc::Status status = stream.Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("Ingest: the request could not be parsed"));
  }
  {
    RawIngestStream stream(raw, "wrong");
    stream.Write(Bytes(kUndecodable));
    EXPECT_EQ(stream.Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  // Well-formed calls, through the generated stubs and as raw bytes alike, still get through.
  auto stub = Stub();
  EXPECT_TRUE(CallAs(*stub, "Ingest", "roll-secret").ok());
  EXPECT_TRUE(CallAs(*stub, "RegisterTrainer", "train-secret").ok());
  v1::GetStatusResponse status;
  grpc::ClientContext context;
  context.set_deadline(In(10));
  context.AddMetadata("authorization", "Bearer train-secret");
  ASSERT_TRUE(stub->GetStatus(&context, {}, &status).ok());
  EXPECT_EQ(status.pending_trajectories(), 1);
  EXPECT_EQ(status.registered_trainers(), 1);
  EXPECT_TRUE(
      RawCall(raw, "GetStatistics", "roll-secret", Serialized(v1::GetStatisticsRequest())).ok());
}

// An undecodable message after an acknowledged trajectory ends that stream INVALID_ARGUMENT; the
// acknowledged trajectory stays stored, and new streams go on.
TEST_F(DispatcherServiceTest, AnUndecodableMessageEndsItsStreamKeepingWhatWasAcknowledged) {
  Start();
  grpc::GenericStub raw(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  {
    RawIngestStream stream(raw, "");
    v1::IngestRequest request;
    *request.mutable_trajectory() = Make("before", 0);
    ASSERT_TRUE(stream.Write(Serialized(request)));
    v1::IngestResponse answer;
    ASSERT_TRUE(stream.Read(&answer));
    EXPECT_EQ(answer.id(), "before");
    EXPECT_EQ(answer.outcome(), v1::IngestResponse::ACCEPTED);
    stream.Write(Bytes(kUndecodable));
    EXPECT_FALSE(stream.Read(&answer));
    const grpc::Status status = stream.Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("Ingest: the request could not be parsed"));
  }
  EXPECT_EQ(core_->GetStatus().pending_trajectories(), 1);
  auto stub = Stub();
  grpc::Status status;
  const std::vector<v1::IngestResponse> answers =
      SendAll(*stub, {Make("before", 0), Make("after", 1)}, &status);
  EXPECT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(answers.size(), 2u);
  EXPECT_TRUE(answers[0].already_accepted());
  EXPECT_EQ(answers[1].outcome(), v1::IngestResponse::ACCEPTED);
  EXPECT_FALSE(answers[1].already_accepted());
  EXPECT_EQ(core_->GetStatistics().accepted(), 2);
}

// A valid trajectory of `tokens` tokens: a few hundred KB for tens of thousands.
v1::Trajectory Large(const std::string& id, int tokens) {
  v1::Trajectory t;
  t.set_id(id);
  t.set_group_id("large");
  for (int k = 0; k < tokens; ++k) {
    t.add_tokens(1 + k % 90);
    t.add_loss_mask(k > 0);
    t.add_logprobs(-0.25f);
  }
  t.set_reward(0.5);
  return t;
}

// What the service counts against max_held_bytes for `trajectory`: its parsed size in memory.
int64_t HeldBytes(const v1::Trajectory& trajectory) {
  v1::IngestRequest request;
  *request.mutable_trajectory() = trajectory;
  v1::IngestRequest parsed;
  EXPECT_TRUE(parsed.ParseFromString(request.SerializeAsString()));
  return static_cast<int64_t>(parsed.SpaceUsedLong());
}

// Polls `done` every 5 ms for at most 10 s; whether it became true.
bool WaitUntil(const std::function<bool()>& done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// Issue 42: streams that read while the pending pool had room and then found it full each keep
// their trajectory until there is room again. Eight streams send a large trajectory each into a
// full pool under a budget with room for about three: the held bytes never pass the budget, the
// streams past it end RESOURCE_EXHAUSTED without an acknowledgement, the held ones are stored once
// a batch makes room, and the refused ones, resent, are stored too: nothing is lost or doubled.
TEST_F(DispatcherServiceTest, HeldTrajectoriesStayWithinTheBudgetAndAreStoredWhenRoomReturns) {
  constexpr int kStreams = 8;
  constexpr int kTokens = 60000;  // about 0.4 MB on the wire, 0.5 MB in memory
  const int64_t one = HeldBytes(Large("probe", kTokens));
  const int64_t budget = 3 * one + one / 2;
  // One more than the streams, so that the pool still has room once all are stored (a stream
  // notices its client finishing only by reading).
  constexpr int kPool = kStreams + 1;
  Start(/*batch=*/kPool, /*max_pending=*/kPool, {.max_held_bytes = budget});
  grpc::GenericStub raw(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  std::vector<std::unique_ptr<RawIngestStream>> streams;
  for (int s = 0; s < kStreams; ++s) streams.push_back(std::make_unique<RawIngestStream>(raw, ""));
  // Every stream is reading (the pool had room when it opened) when the pool fills up.
  ASSERT_TRUE(WaitUntil([&] { return service_->ingest_memory().open_streams == kStreams; }));
  for (int i = 0; i < kPool; ++i)
    ASSERT_TRUE(core_->Ingest(Make("fill" + std::to_string(i), i)).ok());
  ASSERT_FALSE(core_->HasRoom());

  std::vector<v1::Trajectory> large;
  for (int s = 0; s < kStreams; ++s) large.push_back(Large("large" + std::to_string(s), kTokens));
  std::vector<std::optional<v1::IngestResponse>> answers(kStreams);
  std::vector<grpc::Status> statuses(kStreams);
  std::vector<std::thread> clients;
  for (int s = 0; s < kStreams; ++s) {
    clients.emplace_back([&, s] {
      v1::IngestRequest request;
      *request.mutable_trajectory() = large[s];
      RawIngestStream& stream = *streams[s];
      v1::IngestResponse answer;
      if (stream.Write(Serialized(request)) && stream.Read(&answer)) {
        answers[s] = answer;
        stream.WritesDone();
      }
      statuses[s] = stream.Finish();
    });
  }
  // Every trajectory arrived: held (waiting for room) or refused.
  ASSERT_TRUE(WaitUntil([&] {
    const IngestMemory memory = service_->ingest_memory();
    return memory.held_trajectories + memory.refused_over_held_bytes == kStreams;
  }));
  const IngestMemory memory = service_->ingest_memory();
  EXPECT_LE(memory.held_bytes, budget);
  EXPECT_LE(memory.peak_held_bytes, budget);
  ASSERT_GE(memory.held_trajectories, 1);
  EXPECT_GE(memory.refused_over_held_bytes, 1);
  // Refused only when one more would not have fitted. A parsed trajectory's in-memory size
  // (SpaceUsedLong, what is held) depends on how its repeated fields grew while the stream's bytes
  // arrived, up to twice the exact size, so the refused one may have been larger than the held
  // ones' average.
  EXPECT_GT(memory.held_bytes + 2 * (memory.held_bytes / memory.held_trajectories), budget);
  EXPECT_THAT(DispatcherPrometheus(core_->GetStatus(), core_->GetStatistics(), &memory),
              HasSubstr("dta_dispatcher_held_bytes " + std::to_string(memory.held_bytes) + "\n"));
  EXPECT_EQ(core_->GetStatistics().accepted(), kPool);  // nothing beyond the pool

  TakeFirstBatch();  // room for every held one
  for (std::thread& client : clients) client.join();
  std::vector<v1::Trajectory> refused;
  for (int s = 0; s < kStreams; ++s) {
    if (answers[s].has_value()) {
      EXPECT_EQ(answers[s]->id(), large[s].id());
      EXPECT_EQ(answers[s]->outcome(), v1::IngestResponse::ACCEPTED);
      EXPECT_TRUE(statuses[s].ok()) << statuses[s].error_message();
    } else {
      EXPECT_EQ(statuses[s].error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
          << s << ": " << statuses[s].error_message();
      EXPECT_THAT(statuses[s].error_message(), HasSubstr("--max_held_mb"));
      refused.push_back(large[s]);
    }
  }
  EXPECT_EQ(static_cast<int64_t>(refused.size()), memory.refused_over_held_bytes);
  EXPECT_EQ(core_->GetStatistics().accepted(), kPool + memory.held_trajectories);
  EXPECT_EQ(service_->ingest_memory().held_bytes, 0);
  EXPECT_EQ(service_->ingest_memory().held_trajectories, 0);
  EXPECT_LE(service_->ingest_memory().peak_held_bytes, budget);

  auto stub = Stub();
  grpc::Status status;
  const std::vector<v1::IngestResponse> resent = SendAll(*stub, refused, &status);
  EXPECT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(resent.size(), refused.size());
  for (const v1::IngestResponse& answer : resent) {
    EXPECT_EQ(answer.outcome(), v1::IngestResponse::ACCEPTED);
    EXPECT_FALSE(answer.already_accepted());  // never stored before
  }
  EXPECT_EQ(core_->GetStatistics().accepted(), kPool + kStreams);
  EXPECT_EQ(core_->GetStatus().pending_trajectories(), kStreams);
}

// A client that gives up while its trajectory waits for room gives its share of the budget back.
TEST_F(DispatcherServiceTest, AHeldTrajectoryIsReleasedWhenItsClientCancels) {
  Start(/*batch=*/1, /*max_pending=*/1);
  grpc::GenericStub raw(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  auto stream = std::make_unique<RawIngestStream>(raw, "");
  ASSERT_TRUE(WaitUntil([&] { return service_->ingest_memory().open_streams == 1; }));
  ASSERT_TRUE(core_->Ingest(Make("fill", 0)).ok());
  v1::IngestRequest request;
  *request.mutable_trajectory() = Large("waits", 1000);
  ASSERT_TRUE(stream->Write(Serialized(request)));
  ASSERT_TRUE(WaitUntil([&] { return service_->ingest_memory().held_trajectories == 1; }));
  EXPECT_EQ(service_->ingest_memory().held_bytes, HeldBytes(request.trajectory()));
  stream.reset();  // cancels the call
  ASSERT_TRUE(WaitUntil([&] {
    const IngestMemory memory = service_->ingest_memory();
    return memory.open_streams == 0 && memory.held_bytes == 0 && memory.held_trajectories == 0;
  }));
  EXPECT_EQ(core_->GetStatistics().accepted(), 1);
}

// A trajectory larger than the whole budget could never be held: it is rejected (an answer, so
// the client does not retry it) and the stream goes on.
TEST_F(DispatcherServiceTest, ATrajectoryLargerThanTheWholeBudgetIsRejected) {
  const v1::Trajectory large = Large("too-large", 20000);
  Start(8, 1 << 16, {.max_held_bytes = HeldBytes(large) - 1});
  auto stub = Stub();
  grpc::Status status;
  const std::vector<v1::IngestResponse> answers =
      SendAll(*stub, {large, Make("small", 1)}, &status);
  EXPECT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(answers.size(), 2u);
  EXPECT_EQ(answers[0].id(), "too-large");
  EXPECT_EQ(answers[0].outcome(), v1::IngestResponse::REJECTED);
  EXPECT_EQ(answers[0].field(), "tokens");
  EXPECT_THAT(answers[0].reason(), HasSubstr("--max_held_mb"));
  EXPECT_EQ(answers[1].outcome(), v1::IngestResponse::ACCEPTED);
  EXPECT_EQ(core_->GetStatistics().accepted(), 1);
  EXPECT_EQ(service_->ingest_memory().held_bytes, 0);
}

// Past max_ingest_streams open streams a new one ends RESOURCE_EXHAUSTED at once; once one closes,
// a new one gets in.
TEST_F(DispatcherServiceTest, StreamsPastTheLimitAreRefusedUntilOneCloses) {
  Start(8, 1 << 16, {.max_ingest_streams = 2});
  grpc::GenericStub raw(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  auto first = std::make_unique<RawIngestStream>(raw, "");
  RawIngestStream second(raw, "");
  ASSERT_TRUE(WaitUntil([&] { return service_->ingest_memory().open_streams == 2; }));
  {
    RawIngestStream third(raw, "");
    const grpc::Status status = third.Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("max_ingest_streams"));
  }
  EXPECT_EQ(service_->ingest_memory().refused_over_streams, 1);
  first.reset();
  ASSERT_TRUE(WaitUntil([&] { return service_->ingest_memory().open_streams == 1; }));
  auto stub = Stub();
  grpc::Status status;
  EXPECT_EQ(SendAll(*stub, {Make("after", 0)}, &status).size(), 1u);
  EXPECT_TRUE(status.ok()) << status.error_message();
}

// A rollout worker told to back off (the dispatcher's streams or held memory at their limits) waits
// and resends instead of failing; gRPC's own RESOURCE_EXHAUSTED (a message over the size limit) is
// still final.
TEST_F(DispatcherServiceTest, ARolloutSenderBacksOffWhenTheDispatcherIsFull) {
  Start(8, 1 << 16, {.max_ingest_streams = 1});
  grpc::GenericStub raw(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  auto holding = std::make_unique<RawIngestStream>(raw, "");
  ASSERT_TRUE(WaitUntil([&] { return service_->ingest_memory().open_streams == 1; }));
  RolloutSender sender({.address = address_, .retry_for = absl::Seconds(60)});
  std::future<absl::StatusOr<std::vector<v1::IngestResponse>>> sent =
      std::async(std::launch::async, [&] {
        return sender.Send({Make("later-0", 0), Make("later-1", 1)});
      });
  ASSERT_TRUE(WaitUntil([&] { return service_->ingest_memory().refused_over_streams >= 2; }));
  EXPECT_EQ(sent.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);
  holding.reset();  // room again
  const absl::StatusOr<std::vector<v1::IngestResponse>> answers = sent.get();
  ASSERT_TRUE(answers.ok()) << answers.status();
  ASSERT_EQ(answers->size(), 2u);
  for (const v1::IngestResponse& answer : *answers) {
    EXPECT_EQ(answer.outcome(), v1::IngestResponse::ACCEPTED) << answer.reason();
  }

  v1::Trajectory huge = Make("huge", 2);
  huge.set_id(std::string(8 << 20, 'x'));  // past gRPC's default 4 MiB receive limit
  const absl::StatusOr<std::vector<v1::IngestResponse>> refused = sender.Send({huge});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
}

TEST(IsLoopbackAddress, ParsesAndResolvesTheHost) {
  for (const char* loopback :
       {"127.0.0.1:50051", "127.3.2.1:1", "localhost:50051", "[::1]:50051", "unix:/tmp/d.sock"}) {
    EXPECT_TRUE(IsLoopbackAddress(loopback)) << loopback;
  }
  for (const char* remote : {"0.0.0.0:50051", ":50051", "[::]:50051", "10.1.2.3:50051",
                             "127.evil.invalid:50051", "127.0.0.1.invalid:50051", "[::1:50051"}) {
    EXPECT_FALSE(IsLoopbackAddress(remote)) << remote;
  }
}

// The dispatcher's trainer token: created once (64 hex digits, mode 0600), read back unchanged
// afterwards (a restart keeps it), refused when others could read it.
TEST(ReadOrCreateTokenFile, CreatesAPrivateTokenOnceAndRefusesALooseOne) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / ("token_file_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "trainer-token").string();
  absl::StatusOr<std::string> created = ReadOrCreateTokenFile(path);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_THAT(*created, ::testing::MatchesRegex("[0-9a-f]{64}"));
  EXPECT_EQ(std::filesystem::status(path).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  absl::StatusOr<std::string> again = ReadOrCreateTokenFile(path);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *created);
  const std::string other = (dir / "other-token").string();
  absl::StatusOr<std::string> different = ReadOrCreateTokenFile(other);
  ASSERT_TRUE(different.ok());
  EXPECT_NE(*different, *created);
  std::filesystem::permissions(path, std::filesystem::perms::group_read,
                               std::filesystem::perm_options::add);
  absl::StatusOr<std::string> loose = ReadOrCreateTokenFile(path);
  EXPECT_EQ(loose.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(loose.status().message(), HasSubstr("chmod 600"));
  std::filesystem::remove_all(dir);
}

std::string DispatcherBinary() { return (testing::BinaryDirectory() / "dta-dispatcher").string(); }

// kill -9 of the dispatcher between acknowledgements: the client resends what was not
// acknowledged (and, not knowing, some that were); after the restart every trajectory is stored
// exactly once, and training takes each exactly once.
TEST_F(DispatcherServiceTest, KillNineBetweenAcknowledgementsLosesAndDuplicatesNothing) {
  const std::string binary = DispatcherBinary();
  ASSERT_TRUE(std::filesystem::exists(binary)) << binary;
  const int port = dta::testing::FreeLoopbackPort();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  const std::vector<std::string> args = {binary, "--wal=" + (dir_ / "log.wal").string(),
                                         "--listen=" + address, "--batch_rollouts=10",
                                         "--vocab_size=100"};
  constexpr int kTotal = 60;
  std::vector<v1::Trajectory> rollouts;
  for (int i = 0; i < kTotal; ++i) rollouts.push_back(Make("k" + std::to_string(i), i));
  std::set<std::string> acknowledged;
  int next = 0;  // the first trajectory not acknowledged yet
  for (int kill_after : {17, 23, 1000}) {
    testing::Process dispatcher(args, (dir_ / "dispatcher.log").string());
    auto stub =
        v1::Dispatcher::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(In(60));
    context.set_wait_for_ready(true);  // the process is starting
    auto stream = stub->Ingest(&context);
    int sent_here = 0;
    while (next < kTotal) {
      if (sent_here == kill_after) {
        // Sent, not yet acknowledged, when the process dies.
        v1::IngestRequest request;
        *request.mutable_trajectory() = rollouts[next];
        stream->Write(request);
        dispatcher.Kill(SIGKILL);
        break;
      }
      v1::IngestRequest request;
      *request.mutable_trajectory() = rollouts[next];
      ASSERT_TRUE(stream->Write(request));
      v1::IngestResponse answer;
      ASSERT_TRUE(stream->Read(&answer));
      ASSERT_EQ(answer.outcome(), v1::IngestResponse::ACCEPTED) << answer.reason();
      acknowledged.insert(answer.id());
      ++next;
      ++sent_here;
    }
    if (next == kTotal) {
      stream->WritesDone();
      EXPECT_TRUE(stream->Finish().ok());
      // Train everything through a trainer on the last incarnation, with the trainer token the
      // first incarnation created beside the log (kept across restarts).
      absl::StatusOr<std::string> token =
          ReadCredentialFile((dir_ / "log.wal.trainer-token").string(), /*trim=*/true);
      ASSERT_TRUE(token.ok()) << token.status();
      const std::string bearer = "Bearer " + *token;
      grpc::ClientContext register_context;
      register_context.set_deadline(In(10));
      register_context.AddMetadata("authorization", bearer);
      v1::RegisterTrainerRequest registration;
      registration.set_world_size(1);
      registration.set_trainer_id("trainer");
      v1::RegisterTrainerResponse registered;
      ASSERT_TRUE(stub->RegisterTrainer(&register_context, registration, &registered).ok());
      std::multiset<std::string> trained;
      for (int64_t step = 0; step < kTotal / 10; ++step) {
        grpc::ClientContext fetch_context;
        fetch_context.set_deadline(In(10));
        fetch_context.AddMetadata("authorization", bearer);
        v1::FetchPartitionRequest fetch;
        fetch.set_step(step);
        fetch.set_generation(registered.generation());
        v1::FetchPartitionResponse fetched;
        ASSERT_TRUE(stub->FetchPartition(&fetch_context, fetch, &fetched).ok());
        for (const v1::Trajectory& t : fetched.partition().trajectories()) trained.insert(t.id());
        grpc::ClientContext report_context;
        report_context.set_deadline(In(10));
        report_context.AddMetadata("authorization", bearer);
        v1::ReportStepRequest report;
        report.mutable_report()->set_step(step);
        report.mutable_report()->set_generation(registered.generation());
        report.mutable_report()->set_phase(v1::StepReport::PREPARED);
        v1::ReportStepResponse decision;
        ASSERT_TRUE(stub->ReportStep(&report_context, report, &decision).ok());
        EXPECT_EQ(decision.decision(), v1::ReportStepResponse::COMMIT);
      }
      EXPECT_EQ(trained.size(), static_cast<size_t>(kTotal));
      EXPECT_EQ(std::set<std::string>(trained.begin(), trained.end()), acknowledged);
      grpc::ClientContext stats_context;
      stats_context.set_deadline(In(10));
      v1::GetStatisticsResponse stats;
      ASSERT_TRUE(stub->GetStatistics(&stats_context, {}, &stats).ok());
      EXPECT_EQ(stats.accepted(), kTotal);  // nothing stored twice
      dispatcher.Kill(SIGTERM);
    } else {
      context.TryCancel();
    }
    dispatcher.Wait(std::chrono::seconds(30));
  }
  EXPECT_EQ(acknowledged.size(), static_cast<size_t>(kTotal));
}

// A file-size limit (ulimit -f) reached mid-ingestion: the write fails (SIGXFSZ is ignored, so the
// process is not killed mid-write), the trajectory is not acknowledged, and the dispatcher ends
// with status 1 saying why. Restarted without the limit, it holds every acknowledged trajectory.
TEST_F(DispatcherServiceTest, AFileSizeLimitEndsTheDispatcherWithStatusOneLosingNothing) {
  const std::string port = std::to_string(testing::FreeLoopbackPort());
  const std::string address = "127.0.0.1:" + port;
  const std::string command = DispatcherBinary() + " --wal=" + (dir_ / "log.wal").string() +
                              " --listen=" + address + " --batch_rollouts=1000 --max_pending=1000" +
                              " --vocab_size=100";
  int acknowledged = 0;
  {
    testing::Process limited({"/bin/bash", "-c", "ulimit -f 16 && exec " + command},
                             (dir_ / "limited.log").string());
    auto stub =
        v1::Dispatcher::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(In(60));
    context.set_wait_for_ready(true);
    auto stream = stub->Ingest(&context);
    for (int i = 0; i < 1000; ++i) {  // 16 KiB hold far fewer
      v1::IngestRequest request;
      *request.mutable_trajectory() = Make("f" + std::to_string(i), i);
      v1::IngestResponse answer;
      if (!stream->Write(request) || !stream->Read(&answer)) break;
      ASSERT_EQ(answer.outcome(), v1::IngestResponse::ACCEPTED) << answer.reason();
      ++acknowledged;
    }
    const grpc::Status status = stream->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
    EXPECT_GT(acknowledged, 10);
    EXPECT_LT(acknowledged, 1000);
    EXPECT_EQ(limited.Wait(std::chrono::seconds(30)), 1) << limited.Log();
    EXPECT_THAT(limited.Log(), HasSubstr("restart me"));
  }
  testing::Process restarted(
      {DispatcherBinary(), "--wal=" + (dir_ / "log.wal").string(), "--listen=" + address,
       "--batch_rollouts=1000", "--max_pending=1000", "--vocab_size=100"},
      (dir_ / "restarted.log").string());
  ClientOptions options{.address = address, .retry_for = absl::Seconds(20)};
  TrainerClient client(options);
  absl::StatusOr<v1::GetStatusResponse> status = client.Status();
  ASSERT_TRUE(status.ok()) << status.status() << "\n" << restarted.Log();
  EXPECT_EQ(status->pending_trajectories(), acknowledged);
  restarted.Kill(SIGTERM);
  EXPECT_EQ(restarted.Wait(std::chrono::seconds(30)), 0);
}

// Anything but loopback needs TLS and a rollout token: without them dta-dispatcher refuses to
// start; with them a client that trusts the certificate and presents a token gets in, one without
// does not. The trainer token it created beside the log (mode 0600, named at start) is the one
// trainers must present; the retired shared --token_file is refused with the flags to use.
TEST_F(DispatcherServiceTest, RemoteAddressesNeedTlsAndAToken) {
  const std::string binary = DispatcherBinary();
  const std::string port = std::to_string(testing::FreeLoopbackPort());
  const std::vector<std::string> common = {binary, "--wal=" + (dir_ / "log.wal").string(),
                                           "--listen=0.0.0.0:" + port, "--batch_rollouts=4",
                                           "--vocab_size=100"};
  testing::Process refused(common, (dir_ / "refused.log").string());
  EXPECT_EQ(refused.Wait(std::chrono::seconds(30)), 2);
  EXPECT_THAT(refused.Log(), HasSubstr("is not loopback"));

  const std::string key = (dir_ / "key.pem").string(), cert = (dir_ / "cert.pem").string();
  const std::string make_certificate =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost -addext "
      "subjectAltName=IP:127.0.0.1 -keyout " +
      key + " -out " + cert + " >/dev/null 2>&1";
  ASSERT_EQ(std::system(make_certificate.c_str()), 0);
  std::ofstream(dir_ / "token") << "s3cret\n";
  std::filesystem::permissions(
      dir_ / "token", std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  std::vector<std::string> retired = common;
  retired.insert(retired.end(), {"--tls_cert=" + cert, "--tls_key=" + key,
                                 "--token_file=" + (dir_ / "token").string()});
  testing::Process shared(retired, (dir_ / "shared.log").string());
  EXPECT_EQ(shared.Wait(std::chrono::seconds(30)), 2);
  EXPECT_THAT(shared.Log(), HasSubstr("--token_file is gone"));
  std::vector<std::string> secure = common;
  secure.insert(secure.end(), {"--tls_cert=" + cert, "--tls_key=" + key,
                               "--rollout_token_file=" + (dir_ / "token").string()});
  testing::Process server(secure, (dir_ / "server.log").string());
  absl::StatusOr<std::string> roots = ReadCredentialFile(cert, /*trim=*/false);
  ASSERT_TRUE(roots.ok());
  ClientOptions options{.address = "127.0.0.1:" + port,
                        .token = "s3cret",
                        .tls_root_certificates = *roots,
                        .retry_for = absl::Seconds(20)};
  TrainerClient with_token(options);
  absl::StatusOr<v1::GetStatusResponse> status = with_token.Status();
  EXPECT_TRUE(status.ok()) << status.status() << "\n" << server.Log();
  options.token = "";
  TrainerClient without_token(options);
  EXPECT_EQ(without_token.Status().status().code(), absl::StatusCode::kUnauthenticated);

  const std::filesystem::path trainer_token = dir_ / "log.wal.trainer-token";
  ASSERT_TRUE(std::filesystem::exists(trainer_token)) << server.Log();
  EXPECT_EQ(std::filesystem::status(trainer_token).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  EXPECT_THAT(server.Log(), HasSubstr("trainers present the token in " + trainer_token.string()));
  absl::StatusOr<std::string> token = ReadCredentialFile(trainer_token.string(), /*trim=*/true);
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ(token->size(), 64u);
  options.token = *token;
  TrainerClient trainer(options);
  EXPECT_TRUE(trainer.Status().ok());
  server.Kill(SIGTERM);
  EXPECT_EQ(server.Wait(std::chrono::seconds(30)), 0) << server.Log();
}

}  // namespace
}  // namespace dta

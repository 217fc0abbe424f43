// Tests for dta::distributed. Ranks are threads of this process, each with its own Gloo group over
// a shared c10d::HashStore (or, in one test, the launcher path's TCPStore on a free loopback port).
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <array>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "executor/distributed/grad_sync.h"
#include "executor/distributed/process_group.h"
#include "tests/testing/free_port.h"
#include "tests/testing/gloo_ranks.h"

namespace dta {
namespace {

using ::testing::HasSubstr;
using NamedParameters = std::vector<std::pair<std::string, at::Tensor>>;

using testing::ErrorText;
using testing::LoopbackOptions;
using testing::RunRanks;
constexpr std::chrono::milliseconds kTimeout = testing::kRankTimeout;

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype;
};

// Odd sizes in two dtypes, interleaved so that grouping by dtype reorders them; "d" (733 float64,
// 5864 bytes) is larger than a 1 KiB bucket.
const std::vector<ParamSpec>& Specs() {
  static const auto* specs = new std::vector<ParamSpec>{
      {"a", {1}, at::kDouble},   {"b", {3}, at::kFloat},      {"c", {7, 19}, at::kDouble},
      {"d", {733}, at::kDouble}, {"e", {7, 19}, at::kFloat},  {"f", {3}, at::kDouble},
      {"g", {1}, at::kFloat},    {"h", {19, 7}, at::kDouble},
  };
  return *specs;
}

// Rank `rank`'s parameters: every element of parameter i is 100 * rank + i.
NamedParameters MakeParams(int rank) {
  NamedParameters params;
  for (size_t i = 0; i < Specs().size(); ++i) {
    const ParamSpec& spec = Specs()[i];
    at::Tensor p = at::full(spec.shape, 100.0 * rank + i, at::TensorOptions().dtype(spec.dtype));
    p.set_requires_grad(true);
    params.emplace_back(spec.name, p);
  }
  return params;
}

// Rank `rank`'s grad of parameter i at `step` (fixed seeds), or nullopt when that rank leaves it
// undefined: every parameter is undefined on some rank of three, none on all of them.
std::optional<at::Tensor> GradFor(int rank, size_t i, int step) {
  if ((i + rank) % 3 == 1) return std::nullopt;
  const ParamSpec& spec = Specs()[i];
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + 100 * rank + i);
  return at::randn(spec.shape, gen, at::TensorOptions().dtype(at::kDouble)).to(spec.dtype);
}

void SetGrads(NamedParameters& params, int rank, int step) {
  for (size_t i = 0; i < params.size(); ++i) {
    std::optional<at::Tensor> g = GradFor(rank, i, step);
    params[i].second.mutable_grad() = g ? g->to(params[i].second.device()) : at::Tensor();
  }
}

// Every grad equals the sum over `world` ranks of GradFor (undefined as zero) / divide_by, computed
// here in float64, up to the rounding of summing `world` terms in the grad's dtype in any order.
void ExpectSummed(const NamedParameters& params, int world, int step, double divide_by) {
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor got = params[i].second.grad();
    ASSERT_TRUE(got.defined()) << params[i].first;
    ASSERT_EQ(got.scalar_type(), Specs()[i].dtype);
    ASSERT_EQ(got.sizes(), params[i].second.sizes());
    at::Tensor sum = at::zeros(Specs()[i].shape, at::TensorOptions().dtype(at::kDouble));
    at::Tensor magnitude = at::zeros_like(sum);
    for (int r = 0; r < world; ++r) {
      if (std::optional<at::Tensor> g = GradFor(r, i, step)) {
        sum += g->to(at::kDouble);
        magnitude += g->to(at::kDouble).abs();
      }
    }
    sum /= divide_by;
    const double eps = Specs()[i].dtype == at::kDouble ? std::numeric_limits<double>::epsilon()
                                                       : std::numeric_limits<float>::epsilon();
    const double error = (got.cpu().to(at::kDouble) - sum).abs().max().item<double>();
    const double bound = 4 * eps * magnitude.max().item<double>() / std::abs(divide_by);
    EXPECT_LE(error, bound) << "parameter " << params[i].first << ", world " << world;
  }
}

void SyncAndCheck(int world) {
  std::vector<std::vector<at::Tensor>> results(world);
  RunRanks(world, [&](ProcessGroup& group) {
    const int rank = group.rank();
    NamedParameters params = MakeParams(rank);
    GradientSynchronizer sync(group, params, {.bucket_bytes = 1024});
    // float64 {a, c, d, f, h} and float32 {b, e, g}, cut at 1 KiB, with "d" alone.
    EXPECT_GE(sync.buckets().size(), 5u);
    bool d_alone = false;
    for (const GradientBucket& bucket : sync.buckets()) {
      if (bucket.parameters.size() == 1 && bucket.parameters[0] == 3) d_alone = true;
      if (bucket.parameters.size() > 1) {
        EXPECT_LE(bucket.numel * static_cast<int64_t>(c10::elementSize(bucket.dtype)), 1024);
      }
    }
    EXPECT_TRUE(d_alone);
    for (int step = 0; step < 2; ++step) {  // twice: the flat buffers are reused
      SetGrads(params, rank, step);
      std::vector<const void*> storage;
      for (const auto& [name, p] : params) {
        storage.push_back(p.grad().defined() ? p.grad().data_ptr() : nullptr);
      }
      sync.SyncGradients();
      ExpectSummed(params, world, step, 1.0);
      for (size_t i = 0; i < params.size(); ++i) {
        if (storage[i] != nullptr) {
          EXPECT_EQ(params[i].second.grad().data_ptr(), storage[i]);  // written in place
        }
      }
    }
    for (const auto& [name, p] : params) results[rank].push_back(p.grad().clone());
  });
  // Every rank holds bit-identical sums.
  for (int r = 1; r < world; ++r) {
    for (size_t i = 0; i < results[r].size(); ++i) {
      EXPECT_TRUE(at::equal(results[r][i], results[0][i])) << "rank " << r << " parameter " << i;
    }
  }
}

TEST(GradientSynchronizer, SumsAcrossOneRank) { SyncAndCheck(1); }
TEST(GradientSynchronizer, SumsAcrossTwoRanks) { SyncAndCheck(2); }
TEST(GradientSynchronizer, SumsAcrossThreeRanks) { SyncAndCheck(3); }

TEST(GradientSynchronizer, DividesTheSum) {
  for (int world : {1, 3}) {
    RunRanks(world, [&](ProcessGroup& group) {
      NamedParameters params = MakeParams(group.rank());
      GradientSynchronizer sync(group, params, {.bucket_bytes = 4096, .divide_by = 4.0});
      SetGrads(params, group.rank(), 0);
      sync.SyncGradients();
      ExpectSummed(params, world, 0, 4.0);
    });
  }
}

// bfloat16 parameters keep float32 grads (as Decoder accumulates them): the buckets are float32
// and the sums exact to float32 rounding.
TEST(GradientSynchronizer, LowPrecisionParametersSumTheirFloat32Grads) {
  RunRanks(2, [&](ProcessGroup& group) {
    const at::Tensor param =
        at::zeros({7, 19}, at::TensorOptions().dtype(at::kBFloat16)).requires_grad_();
    GradientSynchronizer sync(group, {{"w", param}});
    ASSERT_EQ(sync.buckets().size(), 1u);
    EXPECT_EQ(sync.buckets()[0].dtype, at::kFloat);
    param.mutable_grad() =
        at::full({7, 19}, 0.1 * (group.rank() + 1), at::TensorOptions().dtype(at::kFloat));
    sync.SyncGradients();
    EXPECT_EQ(param.grad().scalar_type(), at::kFloat);
    EXPECT_NEAR(param.grad().max().item<double>(), 0.1f + 0.2f, 1e-7);
    EXPECT_NEAR(param.grad().min().item<double>(), 0.1f + 0.2f, 1e-7);
  });
}

TEST(GradientSynchronizer, DefaultBucketsHoldEveryParameterOfADtype) {
  RunRanks(1, [&](ProcessGroup& group) {
    GradientSynchronizer sync(group, MakeParams(0));
    ASSERT_EQ(sync.buckets().size(), 2u);
    EXPECT_EQ(sync.buckets()[0].dtype, at::kDouble);
    EXPECT_EQ(sync.buckets()[0].parameters, (std::vector<size_t>{0, 2, 3, 5, 7}));
    EXPECT_EQ(sync.buckets()[0].numel, 1 + 7 * 19 + 733 + 3 + 19 * 7);
    EXPECT_EQ(sync.buckets()[1].dtype, at::kFloat);
    EXPECT_EQ(sync.buckets()[1].parameters, (std::vector<size_t>{1, 4, 6}));
    EXPECT_EQ(sync.buckets()[1].numel, 3 + 7 * 19 + 1);
  });
}

TEST(GradientSynchronizer, RanksWithDifferentParametersFailTogether) {
  std::array<std::string, 2> errors;
  RunRanks(2, [&](ProcessGroup& group) {
    NamedParameters params = MakeParams(group.rank());
    if (group.rank() == 1) params[2].second = at::zeros({19, 7}, at::kDouble);  // transposed
    try {
      GradientSynchronizer sync(group, params);
    } catch (const c10::Error& e) {
      errors[group.rank()] = e.what_without_backtrace();
    }
  });
  EXPECT_THAT(errors[0], HasSubstr("rank 0 of 2: the ranks planned different gradient buckets"));
  EXPECT_THAT(errors[1], HasSubstr("rank 1 of 2: the ranks planned different gradient buckets"));
}

TEST(GradientSynchronizer, RejectsBadParametersOptionsAndGrads) {
  RunRanks(1, [&](ProcessGroup& group) {
    NamedParameters params = MakeParams(0);
    EXPECT_THROW(GradientSynchronizer(group, params, {.bucket_bytes = 0}), c10::Error);
    EXPECT_THROW(GradientSynchronizer(group, params, {.divide_by = 0.0}), c10::Error);
    NamedParameters twice = params;
    twice.push_back(params[0]);
    EXPECT_THROW(GradientSynchronizer(group, twice), c10::Error);
    NamedParameters integer = params;
    integer.emplace_back("steps", at::zeros({3}, at::kLong));
    EXPECT_THROW(GradientSynchronizer(group, integer), c10::Error);

    GradientSynchronizer sync(group, params);
    params[1].second.mutable_grad() = at::zeros({4}, at::kFloat);  // the wrong shape
    try {
      sync.SyncGradients();
      ADD_FAILURE() << "expected a c10::Error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("the grad of parameter 'b'"));
    }
    EXPECT_FALSE(params[0].second.grad().defined());  // nothing changed
  });
}

TEST(GradientSynchronizer, BroadcastCopiesTheRootsParameters) {
  for (int root : {0, 2}) {
    RunRanks(3, [&](ProcessGroup& group) {
      NamedParameters params = MakeParams(group.rank());
      GradientSynchronizer sync(group, params, {.bucket_bytes = 1024});
      sync.BroadcastParameters(root);
      const NamedParameters expected = MakeParams(root);
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(params[i].second.requires_grad());
        EXPECT_TRUE(at::equal(params[i].second, expected[i].second))
            << "rank " << group.rank() << " parameter " << params[i].first;
      }
      EXPECT_THROW(sync.BroadcastParameters(3), c10::Error);
    });
  }
}

TEST(ProcessGroup, AllReduceScalarsSumsAndBarrierReturns) {
  for (int world : {1, 2, 3}) {
    RunRanks(world, [&](ProcessGroup& group) {
      const double r = group.rank();
      std::vector<double> sums = group.AllReduceScalars({r, 1.5, -r * r, 0.1});
      double ranks = 0, squares = 0;
      for (int k = 0; k < world; ++k) {
        ranks += k;
        squares += k * k;
      }
      ASSERT_EQ(sums.size(), 4u);
      EXPECT_EQ(sums[0], ranks);
      EXPECT_EQ(sums[1], 1.5 * world);
      EXPECT_EQ(sums[2], -squares);
      EXPECT_NEAR(sums[3], 0.1 * world, 1e-16);
      EXPECT_TRUE(group.AllReduceScalars({}).empty());
      group.Barrier();
      group.Barrier();
    });
  }
}

TEST(ProcessGroup, CreateWithStoreRejectsBadArguments) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const at::Device cpu(at::kCPU);
  EXPECT_EQ(ProcessGroup::CreateWithStore(store, 2, 2, cpu).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ProcessGroup::CreateWithStore(store, 0, 0, cpu).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ProcessGroup::CreateWithStore(nullptr, 0, 1, cpu).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ProcessGroup::CreateWithStore(store, 0, 1, at::Device(at::kMeta)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ProcessGroup::CreateWithStore(store, 0, 1, at::Device(at::kCUDA)).status().code(),
            absl::StatusCode::kInvalidArgument);
  ProcessGroupOptions zero_timeout;
  zero_timeout.timeout = std::chrono::milliseconds(0);
  EXPECT_EQ(ProcessGroup::CreateWithStore(store, 0, 1, cpu, zero_timeout).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Clears the launcher variables for each test and restores them afterwards.
class LaunchEnvironmentTest : public ::testing::Test {
 protected:
  static constexpr std::array<const char*, 7> kNames = {"RANK",
                                                        "WORLD_SIZE",
                                                        "LOCAL_RANK",
                                                        "MASTER_ADDR",
                                                        "MASTER_PORT",
                                                        "TORCHELASTIC_USE_AGENT_STORE",
                                                        "TORCHELASTIC_RESTART_COUNT"};
  void SetUp() override {
    for (size_t i = 0; i < kNames.size(); ++i) {
      const char* value = std::getenv(kNames[i]);
      saved_[i] = value ? std::optional<std::string>(value) : std::nullopt;
    }
    ClearAll();
  }
  void TearDown() override {
    for (size_t i = 0; i < kNames.size(); ++i) {
      if (saved_[i]) {
        setenv(kNames[i], saved_[i]->c_str(), 1);
      } else {
        unsetenv(kNames[i]);
      }
    }
  }
  static void ClearAll() {
    for (const char* name : kNames) unsetenv(name);
  }

  std::array<std::optional<std::string>, kNames.size()> saved_;
};

TEST_F(LaunchEnvironmentTest, ReadsTorchrunVariables) {
  setenv("RANK", "5", 1);
  setenv("WORLD_SIZE", "8", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("MASTER_ADDR", "node-0.cluster", 1);
  setenv("MASTER_PORT", "29611", 1);
  setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  setenv("TORCHELASTIC_RESTART_COUNT", "2", 1);
  absl::StatusOr<LaunchEnvironment> env = LaunchEnvironmentFromEnv();
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->rank, 5);
  EXPECT_EQ(env->world_size, 8);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->master_addr, "node-0.cluster");
  EXPECT_EQ(env->master_port, 29611);
  EXPECT_TRUE(env->agent_store);
  EXPECT_EQ(env->restart_count, 2);

  setenv("TORCHELASTIC_USE_AGENT_STORE", "False", 1);
  env = LaunchEnvironmentFromEnv();
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_FALSE(env->agent_store);
}

TEST_F(LaunchEnvironmentTest, DefaultsToASingleProcess) {
  setenv("MASTER_ADDR", "", 1);  // empty counts as unset
  absl::StatusOr<LaunchEnvironment> env = LaunchEnvironmentFromEnv();
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->rank, 0);
  EXPECT_EQ(env->world_size, 1);
  EXPECT_EQ(env->local_rank, 0);
  EXPECT_EQ(env->master_addr, "127.0.0.1");
  EXPECT_EQ(env->master_port, 29500);
  EXPECT_FALSE(env->agent_store);
  EXPECT_EQ(env->restart_count, 0);
}

TEST_F(LaunchEnvironmentTest, RejectsMalformedValuesNamingTheVariable) {
  struct Case {
    const char* name;
    const char* value;
  };
  for (const Case& c :
       {Case{"RANK", "abc"}, Case{"RANK", "2"}, Case{"RANK", "-1"}, Case{"WORLD_SIZE", "0"},
        Case{"WORLD_SIZE", "1.5"}, Case{"LOCAL_RANK", "2"}, Case{"MASTER_PORT", "70000"},
        Case{"MASTER_PORT", "0"}, Case{"MASTER_PORT", "99999999999"},
        Case{"TORCHELASTIC_RESTART_COUNT", "-1"}, Case{"TORCHELASTIC_RESTART_COUNT", "x"}}) {
    ClearAll();
    setenv("WORLD_SIZE", "2", 1);
    setenv(c.name, c.value, 1);
    absl::StatusOr<LaunchEnvironment> env = LaunchEnvironmentFromEnv();
    EXPECT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument) << c.name << "=" << c.value;
    EXPECT_THAT(std::string(env.status().message()),
                HasSubstr(std::string(c.name) + "='" + c.value + "'"));
  }
}

TEST(ProcessGroup, CreateThroughTheTcpStore) {
  const int port = dta::testing::FreeLoopbackPort();
  std::array<std::string, 2> errors;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        const LaunchEnvironment env{.rank = r,
                                    .world_size = 2,
                                    .local_rank = r,
                                    .master_addr = "127.0.0.1",
                                    .master_port = port};
        auto group = ProcessGroup::Create(env, at::Device(at::kCPU), LoopbackOptions());
        ASSERT_TRUE(group.ok()) << group.status();
        EXPECT_EQ((*group)->AllReduceScalars({r + 1.0}), std::vector<double>{3.0});
        NamedParameters params = MakeParams(r);
        GradientSynchronizer sync(**group, params, {.bucket_bytes = 1024});
        SetGrads(params, r, 0);
        sync.SyncGradients();
        ExpectSummed(params, 2, 0, 1.0);
        (*group)->Barrier();
      } catch (const std::exception& e) {
        errors[r] = ErrorText(e);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// Under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True) the agent hosts the TCPStore and
// keeps it across restarts: every rank connects as a client, and a restarted attempt must not read
// the Gloo addresses the killed attempt left in it. Here attempt 0 leaves both ranks' keys behind;
// in attempt 1 rank 0 starts alone first, so reading a stale key would dial a closed port at once.
TEST(ProcessGroup, ARestartUnderTheAgentStoreIgnoresTheLastAttemptsKeys) {
  const int port = dta::testing::FreeLoopbackPort();
  c10d::TCPStoreOptions agent_options;
  agent_options.port = static_cast<uint16_t>(port);
  agent_options.isServer = true;
  agent_options.waitWorkers = false;
  auto agent = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", agent_options);
  ProcessGroupOptions options = LoopbackOptions();
  options.timeout = std::chrono::seconds(20);
  auto attempt = [&](int restart_count, std::chrono::milliseconds rank1_delay) {
    std::array<std::string, 2> errors;
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        if (r == 1) std::this_thread::sleep_for(rank1_delay);
        const LaunchEnvironment env{.rank = r,
                                    .world_size = 2,
                                    .local_rank = r,
                                    .master_addr = "127.0.0.1",
                                    .master_port = port,
                                    .agent_store = true,
                                    .restart_count = restart_count};
        auto group = ProcessGroup::Create(env, at::Device(at::kCPU), options);
        if (!group.ok()) {
          errors[r] = group.status().ToString();
          return;
        }
        try {
          EXPECT_EQ((*group)->AllReduceScalars({r + 1.0}), std::vector<double>{3.0});
        } catch (const std::exception& e) {
          errors[r] = ErrorText(e);
        }
      });
    }
    for (std::thread& t : threads) t.join();
    EXPECT_EQ(errors[0], "") << "attempt " << restart_count;
    EXPECT_EQ(errors[1], "") << "attempt " << restart_count;
  };
  attempt(0, std::chrono::milliseconds(0));
  attempt(1, std::chrono::milliseconds(500));
}

TEST(ProcessGroup, CreateIsUnavailableWhenNoMasterAnswers) {
  ProcessGroupOptions options = LoopbackOptions();
  options.timeout = std::chrono::milliseconds(300);
  const LaunchEnvironment env{.rank = 1,
                              .world_size = 2,
                              .local_rank = 1,
                              .master_addr = "127.0.0.1",
                              .master_port = dta::testing::FreeLoopbackPort()};
  auto group = ProcessGroup::Create(env, at::Device(at::kCPU), options);
  EXPECT_EQ(group.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(group.status().message()), HasSubstr("rank 1 of 2"));
}

// NCCL between the first two GPUs, ranks as threads; only where there are two.
TEST(ProcessGroup, NcclSumsAndBroadcastsAcrossTwoGpus) {
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::array<std::string, 2> errors;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        const at::Device device(at::kCUDA, r);
        ProcessGroupOptions options;
        options.timeout = kTimeout;
        auto group = ProcessGroup::CreateWithStore(store, r, 2, device, options);
        ASSERT_TRUE(group.ok()) << group.status();
        EXPECT_EQ((*group)->backend_name(), "nccl");
        EXPECT_EQ((*group)->AllReduceScalars({r + 1.0, 0.5}), (std::vector<double>{3.0, 1.0}));
        NamedParameters params;
        for (auto& [name, p] : MakeParams(r)) {
          params.emplace_back(name, p.detach().to(device).requires_grad_());
        }
        GradientSynchronizer sync(**group, params, {.bucket_bytes = 1024});
        sync.BroadcastParameters(1);
        const NamedParameters expected = MakeParams(1);
        for (size_t i = 0; i < params.size(); ++i) {
          EXPECT_TRUE(at::equal(params[i].second.cpu(), expected[i].second));
        }
        for (int step = 0; step < 2; ++step) {
          SetGrads(params, r, step);
          sync.SyncGradients();
          ExpectSummed(params, 2, step, 1.0);
        }
        (*group)->Barrier();
      } catch (const std::exception& e) {
        errors[r] = ErrorText(e);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

}  // namespace
}  // namespace dta

// ShardedAdamW (ZeRO-1, optionally offloaded) against AdamW on the summed gradients: float64 to
// 1e-12 over several clipped steps for 1, 2 and 3 ranks, with and without offload, with buckets
// smaller than a parameter and larger than the slice; bfloat16 bit for bit; saved slices resumed
// on another number of ranks; the errors. Ranks are threads with Gloo groups (tests/testing).
#include "executor/distributed/sharded_adamw.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "executor/optim/adamw.h"
#include "executor/optim/host_adamw.h"
#include "tests/testing/gloo_ranks.h"

namespace dta {
namespace {

using ::testing::HasSubstr;
using Named = std::vector<std::pair<std::string, at::Tensor>>;
using testing::ErrorText;
using testing::RunRanks;

// Odd sizes, so that slices and buckets cut through parameters. 15 + 7 + 32 + 1 = 55 elements.
const std::vector<std::pair<std::string, std::vector<int64_t>>> kShapes = {
    {"model.embed_tokens.weight", {5, 3}},
    {"model.norm.weight", {7}},
    {"model.layers.0.mlp.up_proj.weight", {4, 4, 2}},
    {"lm_head.bias", {1}},
};

at::Tensor Randn(c10::IntArrayRef shape, uint64_t seed) {
  return at::randn(shape, at::detail::createCPUGenerator(seed),
                   at::TensorOptions().dtype(at::kDouble));
}

Named MakeParams(at::ScalarType dtype) {
  Named named;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    named.emplace_back(kShapes[i].first,
                       Randn(kShapes[i].second, 100 + i).to(dtype).requires_grad_(true));
  }
  return named;
}

// Rank `rank`'s gradient of parameter i at `step` (float64).
at::Tensor RankGrad(size_t i, int step, int rank) {
  return Randn(kShapes[i].second, 1000 * step + 10 * i + rank);
}

void AddInto(const at::Tensor& param, const at::Tensor& value) {
  at::Tensor& grad = const_cast<at::Tensor&>(param).mutable_grad();
  at::NoGradGuard no_grad;
  if (!grad.defined()) {
    grad = value.to(param.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  } else {
    grad.add_(value);
  }
}

double MaxRelativeError(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor w = want.to(at::kDouble);
  const double scale = std::max(1.0, w.abs().max().item<double>());
  return (got.to(at::kDouble) - w).abs().max().item<double>() / scale;
}

constexpr AdamWOptions kOptions = {
    .lr = 1e-2,
    .beta1 = 0.9,
    .beta2 = 0.99,
    .eps = 1e-8,
    .weight_decay = 0.1,
    .max_grad_norm = 2.0};  // the summed grads' norm is ~10-15: every step clips

class ShardedAdamWMatchesAdamW : public ::testing::TestWithParam<std::tuple<int, bool, int64_t>> {};

TEST_P(ShardedAdamWMatchesAdamW, OverClippedStepsInFloat64) {
  const auto [world, offload, bucket] = GetParam();
  constexpr int kSteps = 4;
  // The reference: one AdamW over the sum of every rank's gradients.
  Named reference = MakeParams(at::kDouble);
  AdamW adamw(reference, kOptions);
  std::vector<StepStats> want_stats;
  std::vector<Named> want_params;
  for (int step = 0; step < kSteps; ++step) {
    adamw.ZeroGrad(/*set_to_none=*/true);
    for (int r = 0; r < world; ++r) {
      for (size_t i = 0; i < kShapes.size(); ++i)
        AddInto(reference[i].second, RankGrad(i, step, r));
    }
    want_stats.push_back(adamw.Step());
    Named copy;
    for (const auto& [name, p] : reference) copy.emplace_back(name, p.detach().clone());
    want_params.push_back(std::move(copy));
  }
  EXPECT_LT(want_stats.front().clip_coef, 1.0) << "the test must exercise clipping";

  RunRanks(world, [&](ProcessGroup& group) {
    Named params = MakeParams(at::kDouble);
    ShardedAdamW optimizer(&group, params, kOptions,
                           {.offload = offload, .bucket_elements = bucket});
    EXPECT_EQ(optimizer.numel(), 55);
    for (int step = 0; step < kSteps; ++step) {
      optimizer.ZeroGrad();
      for (size_t i = 0; i < kShapes.size(); ++i)
        AddInto(params[i].second, RankGrad(i, step, group.rank()));
      optimizer.ReduceGradients();
      const StepStats stats = optimizer.Step();
      EXPECT_EQ(stats.step, step + 1);
      EXPECT_NEAR(stats.grad_norm, want_stats[step].grad_norm, 1e-12 * want_stats[step].grad_norm);
      EXPECT_NEAR(stats.clip_coef, want_stats[step].clip_coef, 1e-12);
      for (size_t i = 0; i < kShapes.size(); ++i) {
        EXPECT_LT(MaxRelativeError(params[i].second, want_params[step][i].second), 1e-12)
            << params[i].first << " after step " << step + 1 << ", rank " << group.rank();
      }
    }
    EXPECT_EQ(optimizer.master_shard().device().type(), at::kCPU);
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, ShardedAdamWMatchesAdamW,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Bool(),
                                            ::testing::Values<int64_t>(4, 1 << 20)),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool, int64_t>>& info) {
                           return "world" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_offload" : "_gpu_state") +
                                  "_bucket" + std::to_string(std::get<2>(info.param));
                         });

// With bfloat16 weights, float32 gradients that every order sums exactly and no clipping, the
// weights equal AdamW's bit for bit: the same update, element for element.
TEST(ShardedAdamW, Bfloat16WeightsEqualAdamWsBitForBit) {
  AdamWOptions options = kOptions;
  options.max_grad_norm = 0;
  auto grad = [](size_t i, int step, int rank) {  // multiples of 1/8 below 8: exact in any sum
    return (RankGrad(i, step, rank) * 8).round().clamp(-60, 60) / 8;
  };
  Named reference = MakeParams(at::kBFloat16);
  AdamW adamw(reference, options);
  for (int step = 0; step < 3; ++step) {
    adamw.ZeroGrad(true);
    for (int r = 0; r < 2; ++r) {
      for (size_t i = 0; i < kShapes.size(); ++i) AddInto(reference[i].second, grad(i, step, r));
    }
    adamw.Step();
  }
  RunRanks(2, [&](ProcessGroup& group) {
    Named params = MakeParams(at::kBFloat16);
    ShardedAdamW optimizer(&group, params, options, {.bucket_elements = 5});
    for (int step = 0; step < 3; ++step) {
      optimizer.ZeroGrad();
      for (size_t i = 0; i < kShapes.size(); ++i)
        AddInto(params[i].second, grad(i, step, group.rank()));
      optimizer.ReduceGradients();
      optimizer.Step();
    }
    for (size_t i = 0; i < kShapes.size(); ++i) {
      EXPECT_TRUE(at::equal(params[i].second, reference[i].second)) << params[i].first;
      EXPECT_EQ(params[i].second.scalar_type(), at::kBFloat16);
    }
  });
}

// Float32 state offloaded takes the fused host update (HostAdamWUpdate): AdamW's arithmetic to
// float32 rounding, and the weights are the master copy rounded.
TEST(ShardedAdamW, OffloadedFloat32StateFollowsAdamWToFloat32Rounding) {
  Named reference = MakeParams(at::kFloat);
  AdamW adamw(reference, kOptions);
  for (int step = 0; step < 3; ++step) {
    adamw.ZeroGrad(true);
    for (int r = 0; r < 2; ++r) {
      for (size_t i = 0; i < kShapes.size(); ++i)
        AddInto(reference[i].second, RankGrad(i, step, r));
    }
    adamw.Step();
  }
  RunRanks(2, [&](ProcessGroup& group) {
    Named params = MakeParams(at::kFloat);
    ShardedAdamW optimizer(&group, params, kOptions, {.offload = true, .bucket_elements = 5});
    for (int step = 0; step < 3; ++step) {
      optimizer.ZeroGrad();
      for (size_t i = 0; i < kShapes.size(); ++i)
        AddInto(params[i].second, RankGrad(i, step, group.rank()));
      optimizer.ReduceGradients();
      optimizer.Step();
    }
    for (size_t i = 0; i < kShapes.size(); ++i) {
      EXPECT_LT(MaxRelativeError(params[i].second, reference[i].second), 1e-6) << params[i].first;
      // The update moved the weights far more than the tolerance.
      EXPECT_GT(MaxRelativeError(params[i].second, MakeParams(at::kFloat)[i].second), 1e-3);
    }
  });
}

TEST(HostAdamWUpdate, MatchesAdamWUpdateAndRoundsTheMasterCopy) {
  const int64_t n = 100003;  // several parallel_for grains and a ragged end
  const at::Tensor w0 = Randn({n}, 1).to(at::kFloat);
  const at::Tensor m0 = Randn({n}, 2).to(at::kFloat) * 0.1;
  const at::Tensor v0 = Randn({n}, 3).to(at::kFloat).square() * 0.01;
  const at::Tensor g = Randn({n}, 4).to(at::kFloat);
  const AdamWStepScalars scalars = AdamWScalarsFor(kOptions, 7);
  at::Tensor w = w0.clone(), m = m0.clone(), v = v0.clone();
  at::Tensor want_w = w0.clone(), want_m = m0.clone(), want_v = v0.clone();
  const at::Tensor clipped = g.mul(0.25);
  AdamWUpdate(want_w, want_m, want_v, clipped, scalars);
  for (at::ScalarType type : {at::kBFloat16, at::kHalf, at::kFloat}) {
    at::Tensor ww = w.clone(), mm = m.clone(), vv = v.clone();
    at::Tensor rounded = at::empty({n}, at::TensorOptions().dtype(type));
    HostAdamWUpdate(ww, mm, vv, g, 0.25, scalars, rounded);
    EXPECT_LT(MaxRelativeError(ww, want_w), 1e-6) << type;
    EXPECT_LT(MaxRelativeError(mm, want_m), 1e-6) << type;
    EXPECT_LT(MaxRelativeError(vv, want_v), 1e-6) << type;
    EXPECT_TRUE(at::equal(rounded, ww.to(type))) << type;
    EXPECT_GT((ww - w0).abs().max().item<double>(), 1e-3) << "the update must move the weights";
  }
  at::Tensor doubles = w0.to(at::kDouble);
  at::Tensor out = at::empty({n}, at::kBFloat16);
  EXPECT_THROW(HostAdamWUpdate(doubles, m, v, g, 1.0, scalars, out), c10::Error);
}

// A gradient replaced or reset between steps (outside the buffer) still takes part.
TEST(ShardedAdamW, RebindsGradientsReplacedOrReset) {
  RunRanks(2, [&](ProcessGroup& group) {
    Named params = MakeParams(at::kDouble);
    ShardedAdamW optimizer(&group, params, kOptions, {.bucket_elements = 8});
    params[0].second.mutable_grad() = at::ones({5, 3}, at::kDouble);  // replaced
    params[1].second.mutable_grad() = at::Tensor();                   // reset
    optimizer.ReduceGradients();
    // The slice holding parameter 0 sums both ranks' ones.
    if (group.rank() == 0) {
      EXPECT_TRUE(at::equal(params[0].second.grad(), at::full({5, 3}, 2.0, at::kDouble)));
    }
    EXPECT_TRUE(params[1].second.grad().defined());
    optimizer.ZeroGrad();
    EXPECT_EQ(params[0].second.grad().abs().sum().item<double>(), 0.0);
  });
}

std::string TempDir(const std::string& name) {
  const std::string dir =
      ::testing::TempDir() + "/sharded_adamw_" + name + "_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  return dir;
}

// Rank 0 carries the whole gradient, the others zeros: the sum is exact for any world size, so a
// run resumed on another number of ranks must continue as the uninterrupted one.
void TrainSteps(ProcessGroup& group, ShardedAdamW& optimizer, Named& params, int from, int to) {
  for (int step = from; step < to; ++step) {
    optimizer.ZeroGrad();
    if (group.rank() == 0) {
      for (size_t i = 0; i < kShapes.size(); ++i) AddInto(params[i].second, RankGrad(i, step, 0));
    }
    optimizer.ReduceGradients();
    optimizer.Step();
  }
}

TEST(ShardedAdamW, ResumesOnAnotherNumberOfRanks) {
  std::vector<at::Tensor> uninterrupted;
  RunRanks(2, [&](ProcessGroup& group) {
    Named params = MakeParams(at::kDouble);
    ShardedAdamW optimizer(&group, params, kOptions, {.bucket_elements = 6});
    TrainSteps(group, optimizer, params, 0, 4);
    if (group.rank() == 0) {
      for (const auto& [name, p] : params) uninterrupted.push_back(p.detach().clone());
    }
  });
  const std::string dir = TempDir("resume");
  RunRanks(2, [&](ProcessGroup& group) {
    Named params = MakeParams(at::kDouble);
    ShardedAdamW optimizer(&group, params, kOptions, {.bucket_elements = 6});
    TrainSteps(group, optimizer, params, 0, 2);
    optimizer.SaveState(dir + "/" + ShardedAdamW::ShardFileName(group.rank(), 2));
  });
  const std::vector<std::string> files = ShardedAdamW::ShardFiles(dir);
  ASSERT_EQ(files.size(), 2u);
  for (int world : {1, 2, 3}) {
    for (bool offload : {false, true}) {
      RunRanks(world, [&](ProcessGroup& group) {
        Named params = MakeParams(at::kDouble);
        for (auto& [name, p] : params) {
          at::NoGradGuard no_grad;
          p.zero_();  // LoadState must restore the weights from the master copy
        }
        ShardedAdamW optimizer(&group, params, {.lr = 123},
                               {.offload = offload, .bucket_elements = 5});
        optimizer.LoadState(files);
        EXPECT_EQ(optimizer.step(), 2);
        EXPECT_EQ(optimizer.options().lr, kOptions.lr);
        TrainSteps(group, optimizer, params, 2, 4);
        for (size_t i = 0; i < kShapes.size(); ++i) {
          EXPECT_LT(MaxRelativeError(params[i].second, uninterrupted[i]), 1e-14)
              << params[i].first << " on " << world << " ranks, offload " << offload;
        }
      });
    }
  }
}

TEST(ShardedAdamW, RefusesIncompleteOrForeignStateNamingWhatIsWrong) {
  const std::string dir = TempDir("refuse");
  RunRanks(2, [&](ProcessGroup& group) {
    Named params = MakeParams(at::kDouble);
    ShardedAdamW optimizer(&group, params, kOptions);
    TrainSteps(group, optimizer, params, 0, 1);
    optimizer.SaveState(dir + "/" + ShardedAdamW::ShardFileName(group.rank(), 2));
  });
  const std::vector<std::string> files = ShardedAdamW::ShardFiles(dir);
  ASSERT_EQ(files.size(), 2u);
  auto load_error = [](Named params, const std::vector<std::string>& paths) -> std::string {
    ShardedAdamW optimizer(nullptr, std::move(params), kOptions);
    try {
      optimizer.LoadState(paths);
    } catch (const c10::Error& e) {
      EXPECT_EQ(optimizer.step(), 0) << "a refused load changes nothing";
      return e.what_without_backtrace();
    }
    return "";
  };
  // One rank's file alone does not cover a single rank's slice.
  EXPECT_THAT(load_error(MakeParams(at::kDouble), {files[0]}),
              HasSubstr("no file holds elements [28, 55) of 55"));
  // Another model.
  Named other = MakeParams(at::kDouble);
  other[1].first = "model.final_norm.weight";
  EXPECT_THAT(load_error(std::move(other), files), HasSubstr("saved for other parameters"));
  // A replicated AdamW's file.
  Named replicated = MakeParams(at::kDouble);
  AdamW adamw(replicated, kOptions);
  adamw.SaveState(dir + "/replicated.safetensors");
  EXPECT_THAT(load_error(MakeParams(at::kDouble), {dir + "/replicated.safetensors"}),
              HasSubstr("resume it without optimizer sharding or offload"));
  EXPECT_THAT(load_error(MakeParams(at::kDouble), {}), HasSubstr("no state files"));
}

TEST(ShardedAdamW, NonFiniteGradientFailsOnEveryRankAndUpdatesNothing) {
  RunRanks(2, [&](ProcessGroup& group) {
    Named params = MakeParams(at::kDouble);
    std::vector<at::Tensor> before;
    for (const auto& [name, p] : params) before.push_back(p.detach().clone());
    ShardedAdamW optimizer(&group, params, kOptions);
    if (group.rank() == 1) {
      at::Tensor g = at::zeros({4, 4, 2}, at::kDouble);
      g[3][3][1] = std::numeric_limits<double>::quiet_NaN();  // element 53: rank 1's slice
      AddInto(params[2].second, g);
    }
    optimizer.ReduceGradients();
    std::string error;
    try {
      optimizer.Step();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
    if (group.rank() == 1) {
      EXPECT_THAT(error, HasSubstr("gradient of parameter 'model.layers.0.mlp.up_proj.weight' is "
                                   "not finite"));
    } else {
      EXPECT_THAT(error, HasSubstr("in another rank's slice"));
    }
    EXPECT_EQ(optimizer.step(), 0);
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i].second, before[i]));
    // Skipping instead: every rank reports it (the same global norm), nothing moves.
    const StepStats skipped = optimizer.Step(NonFiniteGradients::kSkip);
    EXPECT_TRUE(skipped.skipped);
    EXPECT_TRUE(std::isnan(skipped.grad_norm));
    EXPECT_EQ(optimizer.step(), 0);
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i].second, before[i]));
  });
}

// Weights written into the parameters by other means (a checkpoint loaded into the live model),
// offloaded or not: after ResetMasterFromParameters every rank's master slice holds them and the
// moments stay.
TEST(ShardedAdamW, ResetMasterFromParametersTakesEachRanksSliceOfTheNewWeights) {
  for (const bool offload : {false, true}) {
    RunRanks(2, [&](ProcessGroup& group) {
      Named params = MakeParams(at::kBFloat16);
      ShardedAdamW optimizer(&group, params, kOptions, {.offload = offload});
      for (size_t i = 0; i < params.size(); ++i)
        AddInto(params[i].second, RankGrad(i, 1, group.rank()));
      optimizer.ReduceGradients();
      optimizer.Step();
      const at::Tensor moments = optimizer.exp_avg_shard().clone();
      {
        at::NoGradGuard no_grad;
        for (auto& [name, p] : params) p.fill_(0.375);
      }
      const int64_t n = optimizer.shard_end() - optimizer.shard_begin();
      const at::Tensor master = optimizer.master_shard().narrow(0, 0, n);
      EXPECT_FALSE(at::equal(master, at::full_like(master, 0.375))) << offload;
      optimizer.ResetMasterFromParameters();
      EXPECT_TRUE(at::equal(master, at::full_like(master, 0.375))) << offload;
      EXPECT_TRUE(at::equal(optimizer.exp_avg_shard(), moments)) << offload;
      EXPECT_EQ(optimizer.step(), 1);
    });
  }
}

// On a GPU the offloaded state streams through it by default (page-locked host memory, the
// update on the device): weights and state equal those of the state kept on the GPU bit for bit,
// with one bucket and with many (two slots reused, a ragged last bucket; more slots loaded ahead
// while many resident buckets are updated), and a resumed stream
// goes on identically. The host update stays available and agrees to float32 rounding. GPU
// machines only (scripts/gpu_test.sh).
TEST(ShardedAdamW, StreamedThroughTheGpuEqualsTheGpuResidentStateBitForBit) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device: streaming runs on the GPU machines";
  const at::Device cuda(at::kCUDA, 0);
  const std::string dir = TempDir("streamed");
  struct Run {
    Named params;
    std::unique_ptr<ShardedAdamW> optimizer;
  };
  for (at::ScalarType dtype : {at::kBFloat16, at::kFloat, at::kDouble}) {
    for (int64_t bucket : {int64_t{5}, int64_t{1} << 20}) {
      SCOPED_TRACE(::testing::Message() << dtype << ", bucket " << bucket);
      auto start = [&](bool offload, OffloadUpdate where, int64_t resident = 0,
                       int64_t bucket_elements = 0) {
        Run run;
        for (auto& [name, p] : MakeParams(dtype)) {
          run.params.emplace_back(name, p.detach().to(cuda).requires_grad_(true));
        }
        run.optimizer = std::make_unique<ShardedAdamW>(
            nullptr, run.params, kOptions,
            ShardedAdamWOptions{.offload = offload,
                                .offload_update = where,
                                .bucket_elements = bucket_elements > 0 ? bucket_elements : bucket,
                                .resident_elements = resident});
        return run;
      };
      auto step = [&](Run& run, int step) {
        run.optimizer->ZeroGrad();
        for (size_t i = 0; i < kShapes.size(); ++i) {
          AddInto(run.params[i].second, (RankGrad(i, step, 0) + RankGrad(i, step, 1)).to(cuda));
        }
        run.optimizer->ReduceGradients();
        run.optimizer->Step();
      };
      Run resident = start(false, OffloadUpdate::kOnDevice);
      Run streamed = start(true, OffloadUpdate::kOnDevice);
      // Part of the state kept on the GPU: 12 elements round down to whole buckets (10 of 5, none
      // of a bucket as large as the 55-element slice), more than the slice keeps all of it.
      Run part = start(true, OffloadUpdate::kOnDevice, 12);
      Run all = start(true, OffloadUpdate::kOnDevice, 1000);
      // Buckets of 2: 20 resident, 8 streamed (the last of one element) through 4 slots, each
      // refilled, the first 3 loaded while the resident buckets are updated. Against the state
      // kept on the GPU in buckets of 2 as well: the global norm sums per bucket, so another
      // bucket size clips by a factor equal only to ~1e-16.
      Run slots = start(true, OffloadUpdate::kOnDevice, 40, 2);
      Run resident_in_twos = start(false, OffloadUpdate::kOnDevice, 0, 2);
      Run host = start(true, OffloadUpdate::kOnHost);
      ASSERT_TRUE(streamed.optimizer->streams_through_device())
          << streamed.optimizer->streaming_refused();
      EXPECT_FALSE(host.optimizer->streams_through_device());
      EXPECT_TRUE(streamed.optimizer->exp_avg_shard().is_pinned());
      EXPECT_EQ(streamed.optimizer->resident_elements(), 0);
      EXPECT_EQ(part.optimizer->resident_elements(), bucket == 5 ? 10 : 0);
      EXPECT_EQ(all.optimizer->resident_elements(), 55);
      EXPECT_EQ(slots.optimizer->resident_elements(), 40);
      EXPECT_EQ(host.optimizer->resident_elements(), 0);
      for (int t = 0; t < 3; ++t) {
        for (Run* run : {&resident, &streamed, &part, &all, &slots, &resident_in_twos, &host}) {
          step(*run, t);
        }
      }
      // Resume the stream from its saved state (the resident part's as well, into an optimizer
      // that keeps another part on the GPU) and take one more step everywhere.
      const std::string path = dir + "/" + ShardedAdamW::ShardFileName(0, 1);
      streamed.optimizer->SaveState(path);
      Run resumed = start(true, OffloadUpdate::kOnDevice, 12);
      resumed.optimizer->LoadState({path});
      const std::string part_path = dir + "/part-" + ShardedAdamW::ShardFileName(0, 1);
      part.optimizer->SaveState(part_path);
      Run part_resumed = start(true, OffloadUpdate::kOnDevice);
      part_resumed.optimizer->LoadState({part_path});
      for (Run* run : {&resident, &streamed, &part, &all, &slots, &resident_in_twos, &host,
                       &resumed, &part_resumed}) {
        step(*run, 3);
      }

      for (const Run* run : {&streamed, &part, &all, &slots, &resumed, &part_resumed}) {
        const Run& reference = run == &slots ? resident_in_twos : resident;
        const ShardedAdamW& want = *reference.optimizer;
        const ShardedAdamW& got = *run->optimizer;
        EXPECT_EQ(got.master_shard().device().type(), at::kCPU);
        EXPECT_TRUE(at::equal(got.master_shard(), want.master_shard().cpu()));
        EXPECT_TRUE(at::equal(got.exp_avg_shard(), want.exp_avg_shard().cpu()));
        EXPECT_TRUE(at::equal(got.exp_avg_sq_shard(), want.exp_avg_sq_shard().cpu()));
        for (size_t i = 0; i < kShapes.size(); ++i) {
          EXPECT_TRUE(at::equal(run->params[i].second.cpu(), reference.params[i].second.cpu()))
              << run->params[i].first;
        }
      }
      const ShardedAdamW& want = *resident.optimizer;
      const double tolerance = dtype == at::kDouble ? 1e-12 : 1e-6;
      EXPECT_LT(MaxRelativeError(host.optimizer->master_shard(), want.master_shard().cpu()),
                tolerance);
      // The steps moved the weights far more than any tolerance.
      EXPECT_GT(MaxRelativeError(resident.params[0].second.cpu(), MakeParams(dtype)[0].second),
                1e-2);
    }
  }
}

TEST(ShardedAdamW, RejectsParametersItCannotFlatten) {
  auto error = [](Named params, ShardedAdamWOptions sharding = {}) -> std::string {
    try {
      ShardedAdamW optimizer(nullptr, std::move(params), {}, sharding);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "";
  };
  Named mixed = MakeParams(at::kDouble);
  mixed[1].second = mixed[1].second.detach().to(at::kFloat).requires_grad_(true);
  EXPECT_THAT(error(std::move(mixed)), HasSubstr("every parameter must have one dtype"));
  Named strided = MakeParams(at::kDouble);
  strided[0].second = at::zeros({3, 5}, at::kDouble).t().requires_grad_(true);
  EXPECT_THAT(error(std::move(strided)), HasSubstr("is not contiguous"));
  EXPECT_THAT(error(MakeParams(at::kDouble), {.bucket_elements = 0}),
              HasSubstr("bucket_elements must be > 0"));
  EXPECT_THAT(error({}), HasSubstr("no parameters"));
}

}  // namespace
}  // namespace dta

// kernels/chunk_state_recurrence: the autograd function against autograd through the plain loop
// of ATen ops in float64 (outputs and the gradients of every input, relative error 1e-12), against
// central finite differences, with undefined initial states and output gradients, in float32, and
// its errors for bad inputs; on a GPU, the CUDA kernel against the ATen path from the same inputs:
// float64 within 1e-12 and float32 within 1e-5 (relative to each tensor's largest magnitude), for
// Qwen3-Next's shapes, odd sizes (one chunk, one token a chunk, Dk and Dv that no tile divides,
// more rows than one pass of a step), unaligned inputs, and shapes the kernel leaves to ATen. The
// GPU tests skip without a CUDA device.
#include "kernels/chunk_state_recurrence.h"

#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/kernels/kernel_testing.h"
#include "tests/testing/live_cpu_bytes.h"

namespace dta::kernels {
namespace {

using testing::kFloat64;
using testing::RelativeError;

struct Shape {
  int64_t heads, chunks, chunk, dk, dv;
};

std::string Name(const Shape& s) {
  return "H=" + std::to_string(s.heads) + " N=" + std::to_string(s.chunks) +
         " C=" + std::to_string(s.chunk) + " Dk=" + std::to_string(s.dk) +
         " Dv=" + std::to_string(s.dv);
}

void PrintTo(const Shape& s, std::ostream* os) { *os << Name(s); }

// Inputs in the ranges the chunked rule produces: W and Kd rows of keys scaled by decays (norms
// up to 1), chunk decays in (0, 1], a state of order 1.
struct Inputs {
  at::Tensor w, u, kd, d, s0;
  std::vector<at::Tensor> all() const { return {w, u, kd, d, s0}; }
};

Inputs RandomInputs(const Shape& s, uint64_t seed, at::TensorOptions o = kFloat64) {
  at::manual_seed(seed);
  const double key_scale = 1.0 / std::sqrt(static_cast<double>(s.dk));
  Inputs in;
  in.w = at::randn({s.heads, s.chunks, s.chunk, s.dk}, kFloat64) * key_scale;
  in.u = at::randn({s.heads, s.chunks, s.chunk, s.dv}, kFloat64);
  in.kd = at::randn({s.heads, s.chunks, s.chunk, s.dk}, kFloat64) * key_scale;
  in.d = at::exp(-at::rand({s.heads, s.chunks}, kFloat64));
  in.s0 = 0.5 * at::randn({s.heads, s.dk, s.dv}, kFloat64);
  for (at::Tensor* t : {&in.w, &in.u, &in.kd, &in.d, &in.s0}) *t = t->to(o);
  return in;
}

Inputs RequiringGrad(const Inputs& in) {
  Inputs r;
  r.w = in.w.clone().requires_grad_(true);
  r.u = in.u.clone().requires_grad_(true);
  r.kd = in.kd.clone().requires_grad_(true);
  r.d = in.d.clone().requires_grad_(true);
  r.s0 = in.s0.clone().requires_grad_(true);
  return r;
}

// The recurrence as ChunkedGatedDeltaRule wrote it before the function: a loop of ATen ops.
ChunkStates Loop(const Inputs& in) {
  at::Tensor state = in.s0;
  std::vector<at::Tensor> states, values;
  for (int64_t i = 0; i < in.w.size(1); ++i) {
    states.push_back(state);
    const at::Tensor v_new = in.u.select(1, i) - at::matmul(in.w.select(1, i), state);
    values.push_back(v_new);
    state = state * in.d.select(1, i).view({-1, 1, 1}) +
            at::matmul(in.kd.select(1, i).transpose(-1, -2), v_new);
  }
  return {at::stack(states, 1), at::stack(values, 1), state};
}

// Weights of the loss sum(h * wh) + sum(v_new * wv) + sum(final * ws): every output gradient
// non-zero.
struct LossWeights {
  at::Tensor h, v, s;
};

LossWeights RandomWeights(const Shape& s, uint64_t seed, at::TensorOptions o = kFloat64) {
  at::manual_seed(seed);
  return {at::randn({s.heads, s.chunks, s.dk, s.dv}, o),
          at::randn({s.heads, s.chunks, s.chunk, s.dv}, o), at::randn({s.heads, s.dk, s.dv}, o)};
}

at::Tensor Loss(const ChunkStates& r, const LossWeights& w) {
  return (r.states * w.h).sum() + (r.new_values * w.v).sum() + (r.final_state * w.s).sum();
}

const char* kInputNames[] = {"k_cumdecay", "new_values", "k_decayed", "chunk_decay",
                             "initial_state"};

class ChunkStateRecurrenceShapes : public ::testing::TestWithParam<Shape> {};

TEST_P(ChunkStateRecurrenceShapes, EqualsAutogradOfTheLoop) {
  const Shape s = GetParam();
  const Inputs in = RandomInputs(s, 10 + s.chunks);
  const LossWeights lw = RandomWeights(s, 20 + s.chunks);
  const Inputs a = RequiringGrad(in), b = RequiringGrad(in);
  const ChunkStates ours = ChunkStateRecurrence(a.w, a.u, a.kd, a.d, a.s0);
  const ChunkStates loop = Loop(b);
  EXPECT_LT(RelativeError(ours.states, loop.states), 1e-12) << Name(s);
  EXPECT_LT(RelativeError(ours.new_values, loop.new_values), 1e-12) << Name(s);
  EXPECT_LT(RelativeError(ours.final_state, loop.final_state), 1e-12) << Name(s);
  const auto ga = torch::autograd::grad({Loss(ours, lw)}, a.all());
  const auto gb = torch::autograd::grad({Loss(loop, lw)}, b.all());
  for (size_t i = 0; i < ga.size(); ++i) {
    ASSERT_TRUE(ga[i].defined()) << kInputNames[i];
    EXPECT_GT(gb[i].abs().max().item<double>(), 1e-3) << kInputNames[i] << " " << Name(s);
    EXPECT_LT(RelativeError(ga[i], gb[i]), 1e-12) << kInputNames[i] << " " << Name(s);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ChunkStateRecurrenceShapes,
                         ::testing::Values(Shape{2, 1, 4, 5, 3}, Shape{2, 3, 4, 5, 3},
                                           Shape{1, 7, 1, 3, 7}, Shape{3, 5, 3, 6, 6},
                                           Shape{2, 19, 5, 4, 9}));

TEST(ChunkStateRecurrence, MatchesFiniteDifferences) {
  // The directional derivative of the loss along a random direction of every input at once,
  // by central differences (error O(eps^2)), against the gradients' dot product with it.
  const Shape s{2, 4, 3, 5, 4};
  const Inputs in = RandomInputs(s, 5);
  const LossWeights lw = RandomWeights(s, 6);
  const Inputs a = RequiringGrad(in);
  const auto grads =
      torch::autograd::grad({Loss(ChunkStateRecurrence(a.w, a.u, a.kd, a.d, a.s0), lw)}, a.all());
  at::manual_seed(7);
  const std::vector<at::Tensor> x = in.all();
  std::vector<at::Tensor> direction;
  double analytic = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    direction.push_back(at::randn(x[i].sizes(), kFloat64));
    analytic += (grads[i] * direction[i]).sum().item<double>();
  }
  auto loss_at = [&](double eps) {
    std::vector<at::Tensor> p;
    for (size_t i = 0; i < x.size(); ++i) p.push_back(x[i] + eps * direction[i]);
    return Loss(ChunkStateRecurrence(p[0], p[1], p[2], p[3], p[4]), lw).item<double>();
  };
  const double eps = 1e-5;
  const double numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps);
  EXPECT_NEAR(numeric, analytic, 1e-7 * std::max(1.0, std::abs(analytic)));
}

TEST(ChunkStateRecurrence, UndefinedInitialStateIsZeros) {
  const Shape s{2, 3, 4, 5, 3};
  Inputs in = RandomInputs(s, 8);
  in.s0 = at::zeros_like(in.s0);
  const LossWeights lw = RandomWeights(s, 9);
  const Inputs a = RequiringGrad(in), b = RequiringGrad(in);
  const ChunkStates none = ChunkStateRecurrence(a.w, a.u, a.kd, a.d, at::Tensor());
  const ChunkStates zero = Loop(b);
  EXPECT_LT(RelativeError(none.final_state, zero.final_state), 1e-12);
  const auto ga = torch::autograd::grad({Loss(none, lw)}, {a.w, a.u, a.kd, a.d});
  const auto gb = torch::autograd::grad({Loss(zero, lw)}, {b.w, b.u, b.kd, b.d});
  for (size_t i = 0; i < ga.size(); ++i) {
    EXPECT_LT(RelativeError(ga[i], gb[i]), 1e-12) << kInputNames[i];
  }
  // A zero initial state that requires grad gets the loop's gradient.
  const Inputs c = RequiringGrad(in), e = RequiringGrad(in);
  const auto gs =
      torch::autograd::grad({Loss(ChunkStateRecurrence(c.w, c.u, c.kd, c.d, c.s0), lw)}, {c.s0});
  const auto gl = torch::autograd::grad({Loss(Loop(e), lw)}, {e.s0});
  EXPECT_GT(gl[0].abs().max().item<double>(), 1e-3);
  EXPECT_LT(RelativeError(gs[0], gl[0]), 1e-12);
}

TEST(ChunkStateRecurrence, OutputsWithoutGradientsCountAsZeros) {
  // Losses on one output at a time: the others' gradients reach backward undefined.
  const Shape s{2, 4, 3, 4, 5};
  const Inputs in = RandomInputs(s, 12);
  const LossWeights lw = RandomWeights(s, 13);
  for (int which = 0; which < 3; ++which) {
    auto one = [&](const ChunkStates& r) {
      if (which == 0) return (r.states * lw.h).sum();
      if (which == 1) return (r.new_values * lw.v).sum();
      return (r.final_state * lw.s).sum();
    };
    const Inputs a = RequiringGrad(in), b = RequiringGrad(in);
    const auto ga =
        torch::autograd::grad({one(ChunkStateRecurrence(a.w, a.u, a.kd, a.d, a.s0))}, a.all());
    const auto gb = torch::autograd::grad({one(Loop(b))}, b.all(), {}, std::nullopt, false,
                                          /*allow_unused=*/true);
    for (size_t i = 0; i < ga.size(); ++i) {
      const at::Tensor expected = gb[i].defined() ? gb[i] : at::zeros_like(in.all()[i]);
      if (!ga[i].defined()) {
        EXPECT_EQ(expected.abs().max().item<double>(), 0.0) << kInputNames[i] << " " << which;
        continue;
      }
      if (expected.abs().max().item<double>() == 0.0) {
        EXPECT_EQ(ga[i].abs().max().item<double>(), 0.0) << kInputNames[i] << " " << which;
      } else {
        EXPECT_LT(RelativeError(ga[i], expected), 1e-12) << kInputNames[i] << " " << which;
      }
    }
  }
}

TEST(ChunkStateRecurrence, Float32StaysFloat32AndCloseToFloat64) {
  const Shape s{2, 9, 8, 16, 12};
  const Inputs in = RandomInputs(s, 14);
  const Inputs f32 = RandomInputs(s, 14, kFloat64.dtype(at::kFloat));
  const ChunkStates exact = ChunkStateForward(in.w, in.u, in.kd, in.d, in.s0);
  const ChunkStates ours = ChunkStateForward(f32.w, f32.u, f32.kd, f32.d, f32.s0);
  EXPECT_EQ(ours.states.scalar_type(), at::kFloat);
  EXPECT_EQ(ours.final_state.scalar_type(), at::kFloat);
  EXPECT_LT(RelativeError(ours.states, exact.states), 1e-5);
  EXPECT_LT(RelativeError(ours.final_state, exact.final_state), 1e-5);
}

TEST(ChunkStateRecurrence, NonContiguousInputs) {
  // Strided views (as the triangular solves return) give the contiguous inputs' results.
  const Shape s{2, 3, 4, 5, 6};
  const Inputs in = RandomInputs(s, 15);
  const at::Tensor w = in.w.transpose(2, 3).contiguous().transpose(2, 3);
  const at::Tensor d = in.d.t().contiguous().t();
  ASSERT_FALSE(w.is_contiguous());
  ASSERT_FALSE(d.is_contiguous());
  const ChunkStates a = ChunkStateForward(w, in.u, in.kd, d, in.s0);
  const ChunkStates b = ChunkStateForward(in.w, in.u, in.kd, in.d, in.s0);
  EXPECT_TRUE(at::equal(a.states, b.states));
  EXPECT_TRUE(at::equal(a.final_state, b.final_state));
}

TEST(ChunkStateRecurrence, RefusesBadInputs) {
  const Shape s{2, 3, 4, 5, 6};
  const Inputs in = RandomInputs(s, 16);
  using ::testing::HasSubstr;
  auto message = [&](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const c10::Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_THAT(message([&] { ChunkStateRecurrence(in.w[0], in.u, in.kd, in.d, in.s0); }),
              HasSubstr("k_cumdecay must be [H, N, C, Dk]"));
  EXPECT_THAT(message([&] { ChunkStateRecurrence(in.w, in.u.narrow(2, 0, 3), in.kd, in.d, {}); }),
              HasSubstr("new_values must be [H, N, C, Dv] = [2, 3, 4, 6]"));
  EXPECT_THAT(message([&] { ChunkStateRecurrence(in.w, in.u, in.kd.narrow(3, 0, 4), in.d, {}); }),
              HasSubstr("k_decayed must be [H, N, C, Dk] = [2, 3, 4, 5]"));
  EXPECT_THAT(message([&] { ChunkStateRecurrence(in.w, in.u, in.kd, in.d.t(), {}); }),
              HasSubstr("chunk_decay must be [H, N] = [2, 3]"));
  EXPECT_THAT(
      message([&] { ChunkStateRecurrence(in.w, in.u, in.kd, in.d, in.s0.transpose(1, 2)); }),
      HasSubstr("initial_state must be [H, Dk, Dv] = [2, 5, 6]"));
  EXPECT_THAT(message([&] { ChunkStateRecurrence(in.w, in.u.to(at::kFloat), in.kd, in.d, {}); }),
              HasSubstr("new_values is Float, k_cumdecay Double"));
  EXPECT_THAT(message([&] {
                ChunkStateRecurrence(in.w.to(at::kHalf), in.u.to(at::kHalf), in.kd.to(at::kHalf),
                                     in.d.to(at::kHalf), {});
              }),
              HasSubstr("k_cumdecay must be float32 or float64"));
  const ChunkStates f = ChunkStateForward(in.w, in.u, in.kd, in.d, in.s0);
  EXPECT_THAT(message([&] {
                ChunkStateBackward(f.states.narrow(1, 0, 2), {}, {}, in.w, in.kd, in.d, f.states,
                                   f.new_values);
              }),
              HasSubstr("grad_states must be [H, N, Dk, Dv] = [2, 3, 5, 6]"));
}

TEST(ChunkStateRecurrence, NoKernelOnTheCpu) {
  const Inputs in = RandomInputs({2, 3, 4, 5, 6}, 17);
  EXPECT_FALSE(ChunkStateUsesKernel(in.w, 6));
}

// ---------------------------------------------------------------------------------------------
// The CUDA kernel against the ATen path.

bool HaveCuda() { return torch::cuda::is_available(); }

// ChunkStateOutput against the composition it replaces: at::matmul(Qd, h) + at::matmul(intra,
// v_new) over ChunkStateRecurrence, in float64, outputs and the gradients of all seven inputs; with
// the loss on both outputs and on each alone (the other's gradient undefined).
TEST(ChunkStateOutput, EqualsTheRecurrenceAndTheOutputProducts) {
  for (const Shape& s : {Shape{2, 3, 4, 5, 3}, Shape{1, 7, 1, 3, 7}, Shape{2, 19, 5, 4, 9}}) {
    const Inputs in = RandomInputs(s, 40 + s.chunks);
    at::manual_seed(50 + s.chunks);
    const at::Tensor qd = at::randn({s.heads, s.chunks, s.chunk, s.dk}, kFloat64);
    const at::Tensor intra = at::randn({s.heads, s.chunks, s.chunk, s.chunk}, kFloat64).tril();
    const at::Tensor w_out = at::randn({s.heads, s.chunks, s.chunk, s.dv}, kFloat64);
    const at::Tensor w_final = at::randn({s.heads, s.dk, s.dv}, kFloat64);
    for (int which = 0; which < 3; ++which) {
      SCOPED_TRACE(Name(s) + " loss on " + (which == 0 ? "both" : which == 1 ? "out" : "final"));
      auto loss = [&](const at::Tensor& out, const at::Tensor& final_state) {
        at::Tensor l = at::zeros({}, kFloat64);
        if (which != 2) l = l + (out * w_out).sum();
        if (which != 1) l = l + (final_state * w_final).sum();
        return l;
      };
      const Inputs a = RequiringGrad(in), b = RequiringGrad(in);
      const at::Tensor qa = qd.clone().requires_grad_(), qb = qd.clone().requires_grad_();
      const at::Tensor ia = intra.clone().requires_grad_(), ib = intra.clone().requires_grad_();
      const ChunkOutput ours = ChunkStateOutput(a.w, a.u, a.kd, a.d, a.s0, qa, ia);
      const ChunkStates scan = ChunkStateRecurrence(b.w, b.u, b.kd, b.d, b.s0);
      const at::Tensor out = at::matmul(qb, scan.states) + at::matmul(ib, scan.new_values);
      EXPECT_LT(RelativeError(ours.out, out), 1e-12);
      EXPECT_LT(RelativeError(ours.final_state, scan.final_state), 1e-12);
      std::vector<at::Tensor> xa = a.all(), xb = b.all();
      xa.insert(xa.end(), {qa, ia});
      xb.insert(xb.end(), {qb, ib});
      const auto ga = torch::autograd::grad({loss(ours.out, ours.final_state)}, xa, {},
                                            std::nullopt, false, /*allow_unused=*/true);
      const auto gb = torch::autograd::grad({loss(out, scan.final_state)}, xb, {}, std::nullopt,
                                            false, /*allow_unused=*/true);
      for (size_t i = 0; i < ga.size(); ++i) {
        const at::Tensor expected = gb[i].defined() ? gb[i] : at::zeros_like(xb[i]);
        const at::Tensor actual = ga[i].defined() ? ga[i] : at::zeros_like(xa[i]);
        EXPECT_LT(RelativeError(actual, expected), 1e-12) << "input " << i;
        if (i < 5 && which != 2) {
          EXPECT_GT(expected.abs().max().item<double>(), 1e-6) << i;
        }
      }
    }
  }
}

// What the graph keeps: the composition saves h (a [Dk, Dv] state per chunk) and v_new for
// backward; ChunkStateOutput keeps only its inputs (already alive), so the bytes that stay
// allocated after its forward are the two outputs'.
TEST(ChunkStateOutput, KeepsNoStatesForBackward) {
  const Shape s{2, 16, 8, 16, 16};
  const Inputs a = RequiringGrad(RandomInputs(s, 60));
  const at::Tensor qd = at::randn({s.heads, s.chunks, s.chunk, s.dk}, kFloat64);
  const at::Tensor intra = at::randn({s.heads, s.chunks, s.chunk, s.chunk}, kFloat64);
  const int64_t states_bytes = s.heads * s.chunks * s.dk * s.dv * 8;
  const int64_t outputs_bytes = (s.heads * s.chunks * s.chunk * s.dv + s.heads * s.dk * s.dv) * 8;
  auto live_after = [&](auto&& forward) {
    const auto live = std::make_shared<dta::testing::LiveCpuBytes>();
    c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, live);
    [[maybe_unused]] const auto kept = forward();
    return live->live();
  };
  const int64_t composed = live_after([&] {
    const ChunkStates scan = ChunkStateRecurrence(a.w, a.u, a.kd, a.d, a.s0);
    return at::matmul(qd, scan.states) + at::matmul(intra, scan.new_values);
  });
  const int64_t fused =
      live_after([&] { return ChunkStateOutput(a.w, a.u, a.kd, a.d, a.s0, qd, intra); });
  EXPECT_GE(composed, outputs_bytes + states_bytes);
  EXPECT_LE(fused, outputs_bytes + 4096);
}

// Segments (ChunkStateOptions::segment_chunks): one call over independent sequences of chunks
// equals a call per sequence on its chunks from its own initial state: outputs, final states and
// the gradients of every input (an empty segment passes its state through). `options` picks the
// device and path; float64 within 1e-12, float32 within 1e-6.
void ExpectSegmentsEqualSeparateCalls(const std::vector<int64_t>& offsets, at::TensorOptions o,
                                      bool use_kernel) {
  const int64_t segments = static_cast<int64_t>(offsets.size()) - 1;
  const Shape s{3, offsets.back(), 8, 12, 10};
  Inputs in = RandomInputs(s, 70, o);
  at::manual_seed(71);
  in.s0 = 0.5 * at::randn({segments, s.heads, s.dk, s.dv}, o);
  const at::Tensor qd = at::randn({s.heads, s.chunks, s.chunk, s.dk}, o);
  const at::Tensor intra = at::randn({s.heads, s.chunks, s.chunk, s.chunk}, o).tril();
  const at::Tensor w_out = at::randn({s.heads, s.chunks, s.chunk, s.dv}, o);
  const at::Tensor w_final = at::randn({segments, s.heads, s.dk, s.dv}, o);
  const double tolerance = o.dtype() == at::kDouble ? 1e-12 : 1e-6;

  const Inputs a = RequiringGrad(in);
  const at::Tensor qa = qd.clone().requires_grad_(), ia = intra.clone().requires_grad_();
  const ChunkOutput whole = ChunkStateOutput(a.w, a.u, a.kd, a.d, a.s0, qa, ia,
                                             {.use_kernel = use_kernel, .segment_chunks = offsets});
  ASSERT_EQ(whole.final_state.sizes(), in.s0.sizes());
  std::vector<at::Tensor> xa = a.all();
  xa.insert(xa.end(), {qa, ia});
  const std::vector<at::Tensor> ga =
      torch::autograd::grad({(whole.out * w_out).sum() + (whole.final_state * w_final).sum()}, xa);

  const Inputs b = RequiringGrad(in);
  const at::Tensor qb = qd.clone().requires_grad_(), ib = intra.clone().requires_grad_();
  std::vector<at::Tensor> outs, finals;
  for (int64_t seg = 0; seg < segments; ++seg) {
    const int64_t first = offsets[seg], n = offsets[seg + 1] - first;
    auto part = [&](const at::Tensor& x) { return x.narrow(1, first, n); };
    const ChunkOutput one = ChunkStateOutput(part(b.w), part(b.u), part(b.kd), part(b.d), b.s0[seg],
                                             part(qb), part(ib), {.use_kernel = use_kernel});
    outs.push_back(one.out);
    finals.push_back(one.final_state);
  }
  const at::Tensor out = at::cat(outs, 1), final_state = at::stack(finals);
  std::vector<at::Tensor> xb = b.all();
  xb.insert(xb.end(), {qb, ib});
  const std::vector<at::Tensor> gb =
      torch::autograd::grad({(out * w_out).sum() + (final_state * w_final).sum()}, xb);

  EXPECT_LT(RelativeError(whole.out, out), tolerance);
  EXPECT_LT(RelativeError(whole.final_state, final_state), tolerance);
  const char* names[] = {"k_cumdecay",    "new_values", "k_decayed", "chunk_decay",
                         "initial_state", "q_decayed",  "intra"};
  for (size_t i = 0; i < ga.size(); ++i) {
    EXPECT_LT(RelativeError(ga[i], gb[i]), tolerance) << names[i];
  }
  // An empty segment's final state is its initial state, and its state gradient the final one's.
  for (int64_t seg = 0; seg < segments; ++seg) {
    if (offsets[seg + 1] != offsets[seg]) continue;
    EXPECT_TRUE(at::equal(whole.final_state[seg], in.s0[seg])) << seg;
    EXPECT_TRUE(at::equal(ga[4][seg], w_final[seg])) << seg;
  }
}

TEST(ChunkStateSegments, EqualSeparateCallsInFloat64) {
  // One-chunk, empty and longer segments.
  ExpectSegmentsEqualSeparateCalls({0, 3, 3, 4, 7}, kFloat64, /*use_kernel=*/true);
  ExpectSegmentsEqualSeparateCalls({0, 5}, kFloat64, /*use_kernel=*/true);
}

TEST(ChunkStateSegments, RefusesBadOffsets) {
  const Shape s{2, 4, 4, 6, 5};
  const Inputs in = RandomInputs(s, 72);
  auto message = [&](const std::vector<int64_t>& offsets, const at::Tensor& s0) {
    try {
      ChunkStateForward(in.w, in.u, in.kd, in.d, s0, {.segment_chunks = offsets});
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  EXPECT_THAT(message({0, 3}, {}), ::testing::HasSubstr("must run from 0 to the 4 chunks"));
  EXPECT_THAT(message({1, 4}, {}), ::testing::HasSubstr("must run from 0 to the 4 chunks"));
  EXPECT_THAT(message({0, 3, 2, 4}, {}), ::testing::HasSubstr("must not decrease"));
  EXPECT_THAT(message({0, 2, 4}, in.s0),
              ::testing::HasSubstr("initial_state must be [S, H, Dk, Dv]"));
}

// `in` copied to the GPU, each tensor at a storage offset of one element when `unaligned` (so that
// the kernel's 16-byte vector loads and stores are off).
Inputs OnCuda(const Inputs& in, bool unaligned) {
  auto move = [&](const at::Tensor& t) {
    if (!unaligned) return t.cuda();
    at::Tensor flat = at::empty({t.numel() + 1}, t.options().device(at::kCUDA));
    at::Tensor view = flat.narrow(0, 1, t.numel()).view(t.sizes());
    view.copy_(t);
    return view;
  };
  return {move(in.w), move(in.u), move(in.kd), move(in.d), move(in.s0)};
}

struct GpuCase {
  Shape shape;
  at::ScalarType type;
  bool unaligned = false;
  bool kernel = true;  // whether the kernel takes it (else both sides are the ATen path)
};

void PrintTo(const GpuCase& c, std::ostream* os) {
  *os << Name(c.shape) << " " << c.type << (c.unaligned ? " unaligned" : "")
      << (c.kernel ? "" : " (ATen)");
}

class ChunkStateKernel : public ::testing::TestWithParam<GpuCase> {
 protected:
  void SetUp() override {
    if (!HaveCuda()) GTEST_SKIP() << "no CUDA device; the kernel needs a GPU";
  }
};

TEST_P(ChunkStateKernel, EqualsTheAtenPath) {
  const GpuCase c = GetParam();
  const Shape& s = c.shape;
  const at::TensorOptions o = kFloat64.dtype(c.type);
  const Inputs in = OnCuda(RandomInputs(s, 30 + s.chunks, o), c.unaligned);
  const LossWeights lw = RandomWeights(s, 40 + s.chunks, o.device(at::kCUDA));
  const double tolerance = c.type == at::kDouble ? 1e-12 : 1e-5;
  ASSERT_EQ(ChunkStateUsesKernel(in.w, s.dv), c.kernel) << Name(s);
  ASSERT_FALSE(ChunkStateUsesKernel(in.w, s.dv, {.use_kernel = false}));

  const ChunkStates ref = ChunkStateForward(in.w, in.u, in.kd, in.d, in.s0, {.use_kernel = false});
  const ChunkStates ours = ChunkStateForward(in.w, in.u, in.kd, in.d, in.s0);
  EXPECT_EQ(ours.states.scalar_type(), c.type);
  EXPECT_LT(RelativeError(ours.states, ref.states), tolerance) << Name(s);
  EXPECT_LT(RelativeError(ours.new_values, ref.new_values), tolerance) << Name(s);
  EXPECT_LT(RelativeError(ours.final_state, ref.final_state), tolerance) << Name(s);
  // Without an initial state.
  const ChunkStates ref0 = ChunkStateForward(in.w, in.u, in.kd, in.d, {}, {.use_kernel = false});
  const ChunkStates ours0 = ChunkStateForward(in.w, in.u, in.kd, in.d, {});
  EXPECT_LT(RelativeError(ours0.final_state, ref0.final_state), tolerance) << Name(s);

  // Backward with every output gradient, then with only the final state's.
  for (bool all : {true, false}) {
    const at::Tensor dh = all ? lw.h : at::Tensor(), dv = all ? lw.v : at::Tensor();
    const ChunkStateGrads gr = ChunkStateBackward(dh, dv, lw.s, in.w, in.kd, in.d, ref.states,
                                                  ref.new_values, {.use_kernel = false});
    const ChunkStateGrads go =
        ChunkStateBackward(dh, dv, lw.s, in.w, in.kd, in.d, ref.states, ref.new_values);
    const std::vector<at::Tensor> r = {gr.k_cumdecay, gr.new_values, gr.k_decayed, gr.chunk_decay,
                                       gr.initial_state};
    const std::vector<at::Tensor> k = {go.k_cumdecay, go.new_values, go.k_decayed, go.chunk_decay,
                                       go.initial_state};
    for (size_t i = 0; i < r.size(); ++i) {
      EXPECT_LT(RelativeError(k[i], r[i]), tolerance)
          << kInputNames[i] << " " << Name(s) << (all ? "" : " (final state only)");
    }
    // Deterministic: no atomics.
    const ChunkStateGrads again =
        ChunkStateBackward(dh, dv, lw.s, in.w, in.kd, in.d, ref.states, ref.new_values);
    EXPECT_TRUE(at::equal(again.k_cumdecay, go.k_cumdecay));
    EXPECT_TRUE(at::equal(again.initial_state, go.initial_state));
  }
}

TEST_P(ChunkStateKernel, AutogradThroughTheKernel) {
  const GpuCase c = GetParam();
  const Shape& s = c.shape;
  const at::TensorOptions o = kFloat64.dtype(c.type);
  const Inputs in = OnCuda(RandomInputs(s, 50, o), c.unaligned);
  const LossWeights lw = RandomWeights(s, 51, o.device(at::kCUDA));
  const double tolerance = c.type == at::kDouble ? 1e-12 : 1e-5;
  const Inputs a = RequiringGrad(in), b = RequiringGrad(in);
  const auto ga =
      torch::autograd::grad({Loss(ChunkStateRecurrence(a.w, a.u, a.kd, a.d, a.s0), lw)}, a.all());
  const auto gb = torch::autograd::grad(
      {Loss(ChunkStateRecurrence(b.w, b.u, b.kd, b.d, b.s0, {.use_kernel = false}), lw)}, b.all());
  for (size_t i = 0; i < ga.size(); ++i) {
    EXPECT_LT(RelativeError(ga[i], gb[i]), tolerance) << kInputNames[i] << " " << Name(s);
  }
}

// ChunkStateOutput through the kernel (its backward runs the forward scan again on the GPU)
// against the ATen loop, outputs and the gradients of all seven inputs.
TEST_P(ChunkStateKernel, OutputFunctionThroughTheKernel) {
  const GpuCase c = GetParam();
  const Shape& s = c.shape;
  const at::TensorOptions o = kFloat64.dtype(c.type).device(at::kCUDA);
  const Inputs in = OnCuda(RandomInputs(s, 52, kFloat64.dtype(c.type)), c.unaligned);
  at::manual_seed(53);
  const at::Tensor qd = at::randn({s.heads, s.chunks, s.chunk, s.dk}, o);
  const at::Tensor intra = at::randn({s.heads, s.chunks, s.chunk, s.chunk}, o).tril();
  const at::Tensor w_out = at::randn({s.heads, s.chunks, s.chunk, s.dv}, o);
  const at::Tensor w_final = at::randn({s.heads, s.dk, s.dv}, o);
  const double tolerance = c.type == at::kDouble ? 1e-12 : 1e-5;
  auto run = [&](bool use_kernel) {
    const Inputs a = RequiringGrad(in);
    const at::Tensor q = qd.clone().requires_grad_(), i = intra.clone().requires_grad_();
    const ChunkOutput r =
        ChunkStateOutput(a.w, a.u, a.kd, a.d, a.s0, q, i, {.use_kernel = use_kernel});
    std::vector<at::Tensor> x = a.all();
    x.insert(x.end(), {q, i});
    std::vector<at::Tensor> values =
        torch::autograd::grad({(r.out * w_out).sum() + (r.final_state * w_final).sum()}, x);
    values.insert(values.end(), {r.out.detach(), r.final_state.detach()});
    return values;
  };
  const std::vector<at::Tensor> kernel = run(true), aten = run(false);
  for (size_t i = 0; i < kernel.size(); ++i) {
    EXPECT_LT(RelativeError(kernel[i], aten[i]), tolerance) << "value " << i << " " << Name(s);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ChunkStateKernel,
    ::testing::Values(
        // Qwen3-Next: 64-token chunks, Dk = Dv = 128.
        GpuCase{{4, 6, 64, 128, 128}, at::kFloat}, GpuCase{{4, 6, 64, 128, 128}, at::kDouble},
        // One chunk; one token a chunk; Dk and Dv that neither 4 nor 32 divide.
        GpuCase{{3, 1, 64, 128, 128}, at::kFloat}, GpuCase{{2, 7, 1, 5, 37}, at::kDouble},
        GpuCase{{2, 5, 3, 7, 33}, at::kFloat},
        // More than one pass of each step (C > 64, Dk > 128), a partial column block.
        GpuCase{{2, 3, 65, 130, 40}, at::kDouble}, GpuCase{{2, 3, 100, 190, 40}, at::kFloat},
        // Dk = 256: float32 in one stage; float64 does not fit, so ATen on both sides.
        GpuCase{{2, 4, 64, 256, 64}, at::kFloat},
        GpuCase{{2, 2, 64, 256, 64}, at::kDouble, false, /*kernel=*/false},
        // Unaligned tensors: scalar global loads and stores.
        GpuCase{{2, 4, 64, 64, 96}, at::kFloat, /*unaligned=*/true},
        GpuCase{{2, 4, 16, 32, 64}, at::kDouble, /*unaligned=*/true}));

// The kernel's segments (side by side in one launch, more than one launch past 255 of them)
// against a kernel call per segment, and against the ATen path.
TEST(ChunkStateKernel, SegmentsEqualSeparateCalls) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device; the kernel needs a GPU";
  const at::TensorOptions f32 = kFloat64.dtype(at::kFloat).device(at::kCUDA);
  ExpectSegmentsEqualSeparateCalls({0, 3, 3, 4, 7}, f32, /*use_kernel=*/true);
  ExpectSegmentsEqualSeparateCalls({0, 3, 3, 4, 7}, kFloat64.device(at::kCUDA), true);
  std::vector<int64_t> many = {0};
  for (int64_t seg = 0; seg < 300; ++seg) many.push_back(many.back() + 1 + seg % 3);
  ExpectSegmentsEqualSeparateCalls(many, f32, /*use_kernel=*/true);

  // The scan's own outputs bit for bit: each segment's blocks do what a call of its own does.
  const std::vector<int64_t> offsets = {0, 2, 2, 6};
  const Shape s{4, 6, 64, 128, 128};
  Inputs in = RandomInputs(s, 73, f32);
  in.s0 = 0.5 * at::randn({3, s.heads, s.dk, s.dv}, f32);
  ASSERT_TRUE(ChunkStateUsesKernel(in.w, s.dv));
  const ChunkStates whole =
      ChunkStateForward(in.w, in.u, in.kd, in.d, in.s0, {.segment_chunks = offsets});
  const ChunkStates aten = ChunkStateForward(in.w, in.u, in.kd, in.d, in.s0,
                                             {.use_kernel = false, .segment_chunks = offsets});
  EXPECT_LT(RelativeError(whole.final_state, aten.final_state), 1e-5);
  for (int64_t seg = 0; seg < 3; ++seg) {
    const int64_t first = offsets[seg], n = offsets[seg + 1] - first;
    auto part = [&](const at::Tensor& x) { return x.narrow(1, first, n); };
    const ChunkStates one =
        ChunkStateForward(part(in.w), part(in.u), part(in.kd), part(in.d), in.s0[seg]);
    EXPECT_TRUE(at::equal(part(whole.states), one.states)) << seg;
    EXPECT_TRUE(at::equal(part(whole.new_values), one.new_values)) << seg;
    EXPECT_TRUE(at::equal(whole.final_state[seg], one.final_state)) << seg;
  }
}

// One stage (two blocks an SM, the default for launches with blocks for two an SM) and two (a
// block's next chunk copied while it computes) run the same products in the same order: bitwise
// the same states, values and gradients, on a launch of many segments and on one of a few.
TEST(ChunkStateKernel, OneAndTwoStagesAreBitwiseTheSame) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device; the kernel needs a GPU";
  const at::TensorOptions f32 = kFloat64.dtype(at::kFloat).device(at::kCUDA);
  for (const int64_t segments : {2, 90}) {
    std::vector<int64_t> offsets = {0};
    for (int64_t seg = 0; seg < segments; ++seg) offsets.push_back(offsets.back() + 1 + seg % 4);
    const Shape s{32, offsets.back(), 64, 128, 128};
    Inputs in = RandomInputs(s, 74, f32);
    in.s0 = 0.5 * at::randn({segments, s.heads, s.dk, s.dv}, f32);
    const at::Tensor w_states = at::randn({s.heads, s.chunks, s.dk, s.dv}, f32);
    std::vector<std::vector<at::Tensor>> results;
    for (const char* stages : {"1", "2"}) {
      setenv("DTA_SCAN_STAGES", stages, 1);
      const Inputs a = RequiringGrad(in);
      const ChunkStates found =
          ChunkStateRecurrence(a.w, a.u, a.kd, a.d, a.s0, {.segment_chunks = offsets});
      std::vector<at::Tensor> all = {found.states.detach(), found.new_values.detach(),
                                     found.final_state.detach()};
      const std::vector<at::Tensor> grads = torch::autograd::grad(
          {(found.states * w_states).sum() + found.new_values.sum() + found.final_state.sum()},
          a.all());
      all.insert(all.end(), grads.begin(), grads.end());
      results.push_back(all);
    }
    unsetenv("DTA_SCAN_STAGES");
    for (size_t i = 0; i < results[0].size(); ++i) {
      EXPECT_TRUE(at::equal(results[0][i], results[1][i])) << segments << " segments, output " << i;
    }
  }
}

TEST(ChunkStateKernel, EnvironmentTurnsItOff) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device; the kernel needs a GPU";
  const at::Tensor w = at::zeros({2, 3, 64, 128}, kFloat64.dtype(at::kFloat).device(at::kCUDA));
  EXPECT_TRUE(ChunkStateUsesKernel(w, 128));
  setenv("DTA_LINEAR_ATTENTION_KERNEL", "0", 1);
  EXPECT_FALSE(ChunkStateUsesKernel(w, 128));
  unsetenv("DTA_LINEAR_ATTENTION_KERNEL");
  EXPECT_TRUE(ChunkStateUsesKernel(w, 128));
}

}  // namespace
}  // namespace dta::kernels

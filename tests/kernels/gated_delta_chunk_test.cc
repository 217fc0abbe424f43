// kernels/gated_delta_chunk: the fused path (on the CPU, its reference loops and analytic
// backward) against autograd through the batched ATen ops in float64 (every term and the gradients
// of q, k, v, g and beta, relative error 1e-12), in float32 against float64 (1e-5: float32's
// rounding through a triangular solve), for partial last chunks, several heads and value heads
// sharing a key head, and its errors for bad inputs. On a GPU the forward and backward kernels
// against the same references and the backward kernel against BackwardAnalytic on the device
// (float64 1e-12, float32 1e-5; losses of every term and of single terms, so undefined output
// gradients), bitwise equal across two runs, for Qwen3-Next's shapes and odd ones; the GPU tests
// skip without a CUDA device.
#include "kernels/gated_delta_chunk.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/cuda.h>

#include <cctype>
#include <cstdlib>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/kernels/kernel_testing.h"

#ifdef DTA_KERNELS_HAVE_CUDA
#include "kernels/gated_delta_chunk_internal.h"
#endif

namespace dta::kernels {
namespace {

using testing::kFloat64;
using testing::RelativeError;

struct Shape {
  int64_t tokens, key_heads, heads, dk, dv, chunk;
};

std::string Name(const Shape& s) {
  return "T=" + std::to_string(s.tokens) + " Hk=" + std::to_string(s.key_heads) +
         " H=" + std::to_string(s.heads) + " Dk=" + std::to_string(s.dk) +
         " Dv=" + std::to_string(s.dv) + " C=" + std::to_string(s.chunk);
}

void PrintTo(const Shape& s, std::ostream* os) { *os << Name(s); }

std::string TestName(const ::testing::TestParamInfo<Shape>& info) {
  std::string name = Name(info.param);
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

// Inputs as the mixer makes them: L2-normalised q and k, log decays in (-0.2, 0), beta in (0, 1).
struct Inputs {
  at::Tensor q, k, v, g, beta;
  std::vector<at::Tensor> all() const { return {q, k, v, g, beta}; }
  Inputs To(const at::TensorOptions& o) const {
    return {q.to(o), k.to(o), v.to(o), g.to(o), beta.to(o)};
  }
  Inputs RequiringGrad() const {
    Inputs r;
    r.q = q.clone().requires_grad_(true);
    r.k = k.clone().requires_grad_(true);
    r.v = v.clone().requires_grad_(true);
    r.g = g.clone().requires_grad_(true);
    r.beta = beta.clone().requires_grad_(true);
    return r;
  }
};

Inputs RandomInputs(const Shape& s, uint64_t seed) {
  at::manual_seed(seed);
  auto normalized = [&] {
    const at::Tensor x = at::randn({s.tokens, s.key_heads, s.dk}, kFloat64);
    return x / x.norm(2, -1, /*keepdim=*/true);
  };
  Inputs in;
  in.q = normalized();
  in.k = normalized();
  in.v = at::randn({s.tokens, s.heads, s.dv}, kFloat64);
  in.g = -0.2 * at::rand({s.tokens, s.heads}, kFloat64);
  in.beta = at::sigmoid(at::randn({s.tokens, s.heads}, kFloat64));
  return in;
}

std::vector<at::Tensor> Terms(const ChunkTerms& t) {
  return {t.k_cumdecay, t.new_values, t.k_decayed, t.q_decayed, t.intra, t.chunk_decay};
}

const char* const kTermNames[] = {"k_cumdecay", "new_values", "k_decayed",
                                  "q_decayed",  "intra",      "chunk_decay"};

ChunkTerms TermsOf(const Inputs& in, const Shape& s, GatedDeltaPath path) {
  return GatedDeltaChunkTerms(in.q, in.k, in.v, in.g, in.beta, s.chunk, path);
}

// The terms and the gradients of the inputs for the loss sum_term sum(term * seed).
struct Result {
  std::vector<at::Tensor> terms, grads;
};

// Bit i: the loss uses term i (Terms' order); the others' gradients reach the backward undefined.
constexpr unsigned kAllTerms = (1u << 6) - 1;

Result RunWithGrads(const Inputs& in, const Shape& s, GatedDeltaPath path, uint64_t seed,
                    unsigned used = kAllTerms) {
  const Inputs r = in.RequiringGrad();
  const std::vector<at::Tensor> terms = Terms(TermsOf(r, s, path));
  at::manual_seed(seed);
  at::Tensor loss = at::zeros({}, terms[0].options());
  for (size_t i = 0; i < terms.size(); ++i) {
    const at::Tensor seeds = at::randn(terms[i].sizes(), kFloat64).to(terms[i].options());
    if ((used >> i) & 1u) loss = loss + (terms[i] * seeds).sum();
  }
  Result result;
  const std::vector<at::Tensor> inputs = r.all();
  result.grads = torch::autograd::grad({loss}, inputs, /*grad_outputs=*/{},
                                       /*retain_graph=*/std::nullopt, /*create_graph=*/false,
                                       /*allow_unused=*/true);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!result.grads[i].defined()) result.grads[i] = at::zeros_like(inputs[i]);
  }
  for (const at::Tensor& t : terms) result.terms.push_back(t.detach());
  return result;
}

const char* const kInputNames[] = {"q", "k", "v", "g", "beta"};

void ExpectClose(const Result& actual, const Result& expected, double tolerance) {
  for (size_t i = 0; i < expected.terms.size(); ++i) {
    EXPECT_LT(RelativeError(actual.terms[i], expected.terms[i]), tolerance) << kTermNames[i];
  }
  for (size_t i = 0; i < expected.grads.size(); ++i) {
    EXPECT_LT(RelativeError(actual.grads[i], expected.grads[i]), tolerance)
        << "d " << kInputNames[i];
  }
}

const Shape kCpuShapes[] = {
    {1, 1, 1, 8, 8, 64},      // one token
    {37, 2, 4, 16, 24, 16},   // partial last chunk, two value heads a key head
    {64, 3, 3, 12, 5, 64},    // one whole chunk
    {130, 1, 3, 16, 16, 64},  // three value heads on one key head, a partial third chunk
};

class CpuTest : public ::testing::TestWithParam<Shape> {};

TEST_P(CpuTest, FusedMatchesAtenInFloat64) {
  const Shape s = GetParam();
  const Inputs in = RandomInputs(s, 1);
  ExpectClose(RunWithGrads(in, s, GatedDeltaPath::kFused, 2),
              RunWithGrads(in, s, GatedDeltaPath::kAten, 2), 1e-12);
}

TEST_P(CpuTest, Float32WithinRounding) {
  const Shape s = GetParam();
  const Inputs in = RandomInputs(s, 3);
  const Result expected = RunWithGrads(in, s, GatedDeltaPath::kAten, 4);
  const Inputs in32 = in.To(at::TensorOptions().dtype(at::kFloat));
  ExpectClose(RunWithGrads(in32, s, GatedDeltaPath::kFused, 4), expected, 1e-5);
  ExpectClose(RunWithGrads(in32, s, GatedDeltaPath::kAten, 4), expected, 1e-5);
}

// Losses of some terms only: the backward gets undefined gradients for the others.
TEST_P(CpuTest, FusedMatchesAtenWithUnusedTerms) {
  const Shape s = GetParam();
  const Inputs in = RandomInputs(s, 18);
  for (const unsigned used : {0b000011u, 0b010000u, 0b100100u}) {
    SCOPED_TRACE("terms in the loss: " + std::to_string(used));
    ExpectClose(RunWithGrads(in, s, GatedDeltaPath::kFused, 19, used),
                RunWithGrads(in, s, GatedDeltaPath::kAten, 19, used), 1e-12);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuTest, ::testing::ValuesIn(kCpuShapes), TestName);

bool IsFused(const ChunkTerms& t) {
  return t.intra.grad_fn() != nullptr &&
         t.intra.grad_fn()->name().find("FusedFunction") != std::string::npos;
}

TEST(GatedDeltaChunkTest, FusedPathShowsInTheGraph) {
  const Shape s{10, 1, 1, 8, 8, 16};
  const Inputs in = RandomInputs(s, 20).RequiringGrad();
  EXPECT_TRUE(IsFused(TermsOf(in, s, GatedDeltaPath::kFused)));
  EXPECT_FALSE(IsFused(TermsOf(in, s, GatedDeltaPath::kAten)));
}

// Terms depend only on each value head's own inputs: a key head shared by three value heads gives
// what three copies of it give, bit for bit.
TEST(GatedDeltaChunkTest, SharedKeyHeadEqualsRepeatedHeads) {
  const Shape s{50, 2, 6, 8, 8, 16};
  const Inputs in = RandomInputs(s, 5);
  Inputs repeated = in;
  repeated.q = in.q.repeat_interleave(3, 1);
  repeated.k = in.k.repeat_interleave(3, 1);
  const Shape r{50, 6, 6, 8, 8, 16};
  const std::vector<at::Tensor> shared = Terms(TermsOf(in, s, GatedDeltaPath::kFused));
  const std::vector<at::Tensor> copies = Terms(TermsOf(repeated, r, GatedDeltaPath::kFused));
  for (size_t i = 0; i < shared.size(); ++i) {
    EXPECT_TRUE(at::equal(shared[i], copies[i])) << kTermNames[i];
  }
}

TEST(GatedDeltaChunkTest, RejectsBadInputs) {
  const Shape s{10, 2, 4, 8, 8, 64};
  const Inputs in = RandomInputs(s, 6);
  EXPECT_THROW(GatedDeltaChunkTerms(in.q, in.k.narrow(2, 0, 4), in.v, in.g, in.beta, 64),
               c10::Error);
  EXPECT_THROW(GatedDeltaChunkTerms(in.q, in.k, in.v.narrow(1, 0, 3), in.g, in.beta, 64),
               c10::Error);
  EXPECT_THROW(GatedDeltaChunkTerms(in.q, in.k, in.v, in.g.to(at::kFloat), in.beta, 64),
               c10::Error);
  EXPECT_THROW(GatedDeltaChunkTerms(in.q, in.k, in.v, in.g, in.beta, 0), c10::Error);
  EXPECT_FALSE(GatedDeltaChunkUsesKernel(in.q, s.dv, 64));  // the CPU
}

// GPU: the kernel against float64 references on the host and on the device.
class CudaTest : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
    unsetenv("DTA_GATED_DELTA_FUSED");
    unsetenv("DTA_GATED_DELTA_BACKWARD_KERNEL");
  }
};

const at::TensorOptions kCuda64 = at::TensorOptions().dtype(at::kDouble).device(at::kCUDA);
const at::TensorOptions kCuda32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);

TEST_P(CudaTest, KernelMatchesReferencesInFloat64) {
  const Shape s = GetParam();
  const Inputs in = RandomInputs(s, 7);
  const Inputs gpu = in.To(kCuda64);
  ASSERT_TRUE(GatedDeltaChunkUsesKernel(gpu.q, s.dv, s.chunk));
  const Result kernel = RunWithGrads(gpu, s, GatedDeltaPath::kFused, 8);
  ExpectClose(kernel, RunWithGrads(gpu, s, GatedDeltaPath::kAten, 8), 1e-12);
  ExpectClose(kernel, RunWithGrads(in, s, GatedDeltaPath::kFused, 8), 1e-12);
}

TEST_P(CudaTest, KernelInFloat32WithinRounding) {
  const Shape s = GetParam();
  const Inputs in = RandomInputs(s, 9);
  const Result expected = RunWithGrads(in.To(kCuda64), s, GatedDeltaPath::kAten, 10);
  ExpectClose(RunWithGrads(in.To(kCuda32), s, GatedDeltaPath::kFused, 10), expected, 1e-5);
}

TEST_P(CudaTest, KernelIsBitwiseReproducible) {
  const Shape s = GetParam();
  for (const at::TensorOptions& o : {kCuda32, kCuda64}) {
    const Inputs in = RandomInputs(s, 11).To(o);
    const Result first = RunWithGrads(in, s, GatedDeltaPath::kFused, 12);
    const Result second = RunWithGrads(in, s, GatedDeltaPath::kFused, 12);
    for (size_t i = 0; i < first.terms.size(); ++i) {
      EXPECT_TRUE(at::equal(first.terms[i], second.terms[i])) << kTermNames[i];
    }
    for (size_t i = 0; i < first.grads.size(); ++i) {
      EXPECT_TRUE(at::equal(first.grads[i], second.grads[i])) << "d " << kInputNames[i];
    }
  }
}

// FusedFunction's backward on the GPU through BackwardAnalytic (the batched ATen ops) instead of
// the backward kernel.
Result RunWithAnalyticBackward(const Inputs& in, const Shape& s, uint64_t seed, unsigned used) {
  setenv("DTA_GATED_DELTA_BACKWARD_KERNEL", "0", 1);
  Result r = RunWithGrads(in, s, GatedDeltaPath::kFused, seed, used);
  unsetenv("DTA_GATED_DELTA_BACKWARD_KERNEL");
  return r;
}

// The backward kernel against BackwardAnalytic on the device and on the host and autograd through
// the ATen ops, with every term in the loss and with each term alone (the other five gradients
// undefined): a gradient term the kernel dropped or got wrong shows in one of them.
TEST_P(CudaTest, BackwardKernelMatchesReferencesInFloat64) {
  const Shape s = GetParam();
  const Inputs in = RandomInputs(s, 13);
  const Inputs gpu = in.To(kCuda64);
#ifdef DTA_KERNELS_HAVE_CUDA
  ASSERT_TRUE(internal::GatedDeltaChunkBackwardFits(at::kDouble, s.chunk, s.dk, 0));
#endif
  std::vector<unsigned> masks = {kAllTerms, 0b000011, 0b111100};
  for (unsigned i = 0; i < 6; ++i) masks.push_back(1u << i);
  for (const unsigned used : masks) {
    SCOPED_TRACE("terms in the loss: " + std::to_string(used));
    const Result kernel = RunWithGrads(gpu, s, GatedDeltaPath::kFused, 14, used);
    ExpectClose(kernel, RunWithAnalyticBackward(gpu, s, 14, used), 1e-12);
    ExpectClose(kernel, RunWithGrads(gpu, s, GatedDeltaPath::kAten, 14, used), 1e-12);
    if (used == kAllTerms || used == 0b000011) {
      ExpectClose(kernel, RunWithGrads(in, s, GatedDeltaPath::kFused, 14, used), 1e-12);
    }
  }
}

TEST_P(CudaTest, BackwardKernelInFloat32WithinRounding) {
  const Shape s = GetParam();
  const Inputs in = RandomInputs(s, 15);
  for (const unsigned used : {kAllTerms, 0b101010u}) {
    SCOPED_TRACE("terms in the loss: " + std::to_string(used));
    const Result expected = RunWithGrads(in.To(kCuda64), s, GatedDeltaPath::kAten, 16, used);
    ExpectClose(RunWithGrads(in.To(kCuda32), s, GatedDeltaPath::kFused, 16, used), expected, 1e-5);
  }
}

// kAuto fuses a pass that keeps a graph where the backward kernel runs, and keeps the ATen ops
// there when DTA_GATED_DELTA_BACKWARD_KERNEL=0 turns that kernel off.
TEST_P(CudaTest, AutoFusesTrainingWhereTheBackwardKernelRuns) {
  const Shape s = GetParam();
  const Inputs in = RandomInputs(s, 17).To(kCuda32).RequiringGrad();
  EXPECT_TRUE(IsFused(TermsOf(in, s, GatedDeltaPath::kAuto)));
  setenv("DTA_GATED_DELTA_BACKWARD_KERNEL", "0", 1);
  EXPECT_FALSE(IsFused(TermsOf(in, s, GatedDeltaPath::kAuto)));
  unsetenv("DTA_GATED_DELTA_BACKWARD_KERNEL");
}

TEST_P(CudaTest, EnvironmentSwitchTurnsTheKernelOff) {
  const Shape s = GetParam();
  const at::Tensor q = at::zeros({s.tokens, s.key_heads, s.dk}, kCuda32);
  setenv("DTA_GATED_DELTA_FUSED", "0", 1);
  EXPECT_FALSE(GatedDeltaChunkUsesKernel(q, s.dv, s.chunk));
  unsetenv("DTA_GATED_DELTA_FUSED");
  EXPECT_TRUE(GatedDeltaChunkUsesKernel(q, s.dv, s.chunk));
}

const Shape kCudaShapes[] = {
    {1000, 16, 32, 128, 128, 64},  // Qwen3-Next's heads, a partial last chunk
    {64, 1, 1, 128, 128, 64},      // one whole chunk
    {150, 2, 4, 128, 128, 64},     // two value heads a key head, a partial last chunk
    {1, 2, 4, 8, 8, 64},           // one token
    {1, 1, 1, 24, 40, 16},         // one token, a small chunk
    {50, 2, 4, 24, 40, 64},        // fewer tokens than a chunk, odd dims
    {77, 3, 6, 20, 36, 16},        // sizes no tile divides, small chunks
    {200, 2, 2, 100, 200, 64},     // a key dim no tile divides, value columns over several passes
    {95, 1, 2, 32, 48, 20},        // a chunk no tile divides (padded to 32 rows), three chunks
};

INSTANTIATE_TEST_SUITE_P(Shapes, CudaTest, ::testing::ValuesIn(kCudaShapes), TestName);

}  // namespace
}  // namespace dta::kernels

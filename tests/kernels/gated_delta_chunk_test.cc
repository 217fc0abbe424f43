// kernels/gated_delta_chunk: the fused path (on the CPU, its reference loops and analytic
// backward) against autograd through the batched ATen ops in float64 (every term and the gradients
// of q, k, v, g and beta, relative error 1e-12), in float32 against float64 (1e-5: float32's
// rounding through a triangular solve), for partial last chunks, several heads and value heads
// sharing a key head, and its errors for bad inputs. On a GPU the CUDA kernel against the same
// references (float64 1e-12, float32 1e-5), bitwise equal across two runs, for Qwen3-Next's shapes
// and odd ones; the GPU tests skip without a CUDA device.
#include "kernels/gated_delta_chunk.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include <cctype>
#include <cstdlib>
#include <ostream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/kernels/kernel_testing.h"

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

Result RunWithGrads(const Inputs& in, const Shape& s, GatedDeltaPath path, uint64_t seed) {
  const Inputs r = in.RequiringGrad();
  const std::vector<at::Tensor> terms = Terms(TermsOf(r, s, path));
  at::manual_seed(seed);
  at::Tensor loss = at::zeros({}, terms[0].options());
  for (const at::Tensor& t : terms) {
    loss = loss + (t * at::randn(t.sizes(), kFloat64).to(t.options())).sum();
  }
  Result result;
  result.grads = torch::autograd::grad({loss}, r.all());
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

INSTANTIATE_TEST_SUITE_P(Shapes, CpuTest, ::testing::ValuesIn(kCpuShapes), TestName);

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
  const Inputs in = RandomInputs(s, 11).To(kCuda32);
  const std::vector<at::Tensor> first = Terms(TermsOf(in, s, GatedDeltaPath::kFused));
  const std::vector<at::Tensor> second = Terms(TermsOf(in, s, GatedDeltaPath::kFused));
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_TRUE(at::equal(first[i], second[i])) << kTermNames[i];
  }
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
    {1, 2, 4, 8, 8, 64},           // one token
    {77, 3, 6, 20, 36, 16},        // sizes no tile divides, small chunks
    {200, 2, 2, 130, 200, 64},     // more columns than one pass of the solve's threads
};

INSTANTIATE_TEST_SUITE_P(Shapes, CudaTest, ::testing::ValuesIn(kCudaShapes), TestName);

}  // namespace
}  // namespace dta::kernels

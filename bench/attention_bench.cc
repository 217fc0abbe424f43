// dta-attention-bench: tree attention kernels against PyTorch's flash attention (FlashAttention-2
// inside ATen) on the GPU, and on causal chains also against PyTorch's cuDNN attention (a row that
// says "unsupported" with cuDNN's error where this cuDNN refuses the shape). Causal chains compare
// like for like; the packed tree (a shared prefix and branches) compares one tree pass against
// flash over every rollout separately. Where the Hopper kernels exist (kernels/hopper/, compute
// capability 9.x; kernels/hopper/head_dims.h lists the head dims of each direction) ours run up to
// four times: "ours FA2" (DTA_HOPPER_ATTENTION=0, DTA_HOPPER_ATTENTION_BACKWARD=0), "ours Hopper
// fwd" (the Hopper forward, the FlashAttention-2 backward), "ours Hopper fwd + Hopper bwd" (the
// default backward: its dQ and dK/dV kernels) and "ours Hopper fwd + Hopper bwd (single kernel)"
// (DTA_HOPPER_ATTENTION_BACKWARD_FUSED=1; at the head dims that kernel is built for).
// Times are medians of 20 CUDA-event-timed runs after 5 warm-ups; TFLOP/s count only visible score
// entries (forward 4 * D * Hq per entry, forward + backward 3.5 times that, FlashAttention's
// convention); the backward's column is forward + backward minus forward, at 2.5 times the
// forward's work. Prints a Markdown table.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "core/base/scoped_env.h"
#include "core/cli/usage.h"
#include "kernels/tree_attention.h"
#include "kernels/tree_attention_internal.h"

#ifdef DTA_KERNELS_HAVE_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime_api.h>
#endif

namespace {

// The flags' defaults come from the environment variables the profiling scripts set.
bool EnvIsOne(const char* name) {
  const char* env = std::getenv(name);
  return env != nullptr && env[0] == '1';
}

int32_t EnvInt(const char* name, int32_t fallback) {
  const char* env = std::getenv(name);
  return env != nullptr ? std::atoi(env) : fallback;
}

}  // namespace

ABSL_FLAG(
    bool, quick, EnvIsOne("DTA_ATTENTION_BENCH_QUICK"),
    "one case, one warm-up and three runs, for profilers (default: DTA_ATTENTION_BENCH_QUICK=1)");
ABSL_FLAG(bool, ours_only, EnvIsOne("DTA_ATTENTION_BENCH_OURS_ONLY"),
          "skip PyTorch's flash attention (default: DTA_ATTENTION_BENCH_OURS_ONLY=1)");
ABSL_FLAG(int32_t, chain_case, EnvInt("DTA_ATTENTION_BENCH_CASE", -1),
          "with --quick: only chain case i, -1 all (default: DTA_ATTENTION_BENCH_CASE)");
ABSL_FLAG(int32_t, head_dim, EnvInt("DTA_ATTENTION_BENCH_HEAD_DIM", 128),
          "head dim of every case: 64, 128 or 256 (default: DTA_ATTENTION_BENCH_HEAD_DIM, else "
          "128)");

namespace dta::kernels {
namespace {

#ifdef DTA_KERNELS_HAVE_CUDA

struct Case {
  std::string name;
  int64_t prefix = 0;    // cached prefix rows P
  int64_t trunk = 0;     // chunk: a chain of `trunk` tokens ...
  int64_t branches = 0;  // ... then this many branches hanging off its last token
  int64_t branch_len = 0;
  int64_t q_heads = 16, kv_heads = 8, head_dim = 128;
  int64_t tokens() const { return trunk + branches * branch_len; }
};

bool Quick() { return absl::GetFlag(FLAGS_quick); }

bool OursOnly() { return absl::GetFlag(FLAGS_ours_only); }

// Which kernels our rows run: FlashAttention-2 both ways, the Hopper forward with the
// FlashAttention-2 backward, or Hopper both ways (DTA_HOPPER_ATTENTION and
// DTA_HOPPER_ATTENTION_BACKWARD, read by the dispatch at every call).
// kHopperBoth: the Hopper forward and backward (its dQ and dK/dV kernels); kHopperSingleKernel:
// the same with the opt-in single-kernel backward.
enum class Kernel { kFa2, kHopper, kHopperBoth, kHopperSingleKernel };

const char* Switch(bool on) { return on ? "1" : "0"; }

// The switches that select `kernel`, set for the object's lifetime.
class ScopedKernel {
 public:
  explicit ScopedKernel(Kernel kernel)
      : forward_("DTA_HOPPER_ATTENTION", Switch(kernel != Kernel::kFa2)),
        backward_("DTA_HOPPER_ATTENTION_BACKWARD",
                  Switch(kernel == Kernel::kHopperBoth || kernel == Kernel::kHopperSingleKernel)),
        fused_("DTA_HOPPER_ATTENTION_BACKWARD_FUSED",
               Switch(kernel == Kernel::kHopperSingleKernel)) {}

 private:
  ScopedEnv forward_;
  ScopedEnv backward_;
  ScopedEnv fused_;
};

// The kernels our rows compare: FA2 always, the Hopper forward and backward where this GPU and
// build run them for c's shape.
std::vector<Kernel> OurKernels(const Case& c) {
  const ScopedKernel on(Kernel::kHopperSingleKernel);
  internal::TreeAttentionShape shape;
  shape.tokens = c.tokens();
  shape.prefix = c.prefix;
  shape.q_heads = c.q_heads;
  shape.kv_heads = c.kv_heads;
  shape.head_dim = c.head_dim;
  const at::Tensor probe =
      at::empty({1, 1, c.head_dim}, at::TensorOptions(at::kCUDA).dtype(at::kBFloat16));
  std::vector<Kernel> kernels = {Kernel::kFa2};
  if (internal::UsesHopperForward(shape, probe)) {
    kernels.push_back(Kernel::kHopper);
    if (internal::UsesHopperBackward(shape, probe)) kernels.push_back(Kernel::kHopperBoth);
    if (internal::UsesHopperFusedBackward(shape, probe)) {
      kernels.push_back(Kernel::kHopperSingleKernel);
    }
  }
  return kernels;
}

double MedianMs(const std::function<void()>& fn) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  const int warmups = Quick() ? 1 : 5;
  const int runs = Quick() ? 3 : 20;
  for (int i = 0; i < warmups; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < runs; ++i) {
    cudaEventRecord(start, stream);
    fn();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float elapsed = 0;
    cudaEventElapsedTime(&elapsed, start, stop);
    ms.push_back(elapsed);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return runs % 2 == 1 ? ms[runs / 2] : (ms[runs / 2 - 1] + ms[runs / 2]) / 2;
}

std::vector<int64_t> KeyEnd(const Case& c) {
  const int64_t t = c.tokens();
  std::vector<int64_t> end(t, t);
  for (int64_t b = 0; b < c.branches; ++b) {
    const int64_t first = c.trunk + b * c.branch_len;
    for (int64_t j = first; j < first + c.branch_len; ++j) end[j] = first + c.branch_len;
  }
  return end;
}

struct Row {
  std::string name, method;
  double visible = 0, fwd_ms = 0, fwd_tflops = 0, fb_ms = 0, fb_tflops = 0, bwd_tflops = 0;
  std::string vs_flash;
};

double Tflops(double visible, const Case& c, double ms, double factor) {
  return 4.0 * c.head_dim * c.q_heads * visible * factor / (ms * 1e-3) / 1e12;
}

// PyTorch's attention kernels our rows are compared with.
enum class Sdpa { kFlash, kCudnn };

// `sdpa` over `batch` causal sequences of `len` tokens with GQA expanded to Hq heads (same work).
// A cuDNN that refuses the shape gives a row of zeros whose method says so.
Row RunSdpa(Sdpa sdpa, const Case& c, const std::string& name, int64_t batch, int64_t len) {
  const at::TensorOptions opt = at::TensorOptions(at::kCUDA).dtype(at::kBFloat16);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  // [B, T, H, D] storage, passed as [B, H, T, D] views like PyTorch's SDPA does.
  const at::Tensor q = at::randn({batch, len, c.q_heads, c.head_dim}, opt).transpose(1, 2);
  const at::Tensor k = at::randn({batch, len, c.q_heads, c.head_dim}, opt).transpose(1, 2);
  const at::Tensor v = at::randn({batch, len, c.q_heads, c.head_dim}, opt).transpose(1, 2);
  const at::Tensor dout = at::randn({batch, len, c.q_heads, c.head_dim}, opt).transpose(1, 2);
  std::function<void()> fwd, fb;
  if (sdpa == Sdpa::kFlash) {
    fwd = [&] { at::_scaled_dot_product_flash_attention(q, k, v, 0.0, true, false, scale); };
    fb = [&] {
      auto [o, lse, cq, ck, mq, mk, seed, offset, dbg] =
          at::_scaled_dot_product_flash_attention(q, k, v, 0.0, true, false, scale);
      at::_scaled_dot_product_flash_attention_backward(dout, q, k, v, o, lse, cq, ck,
                                                       mq.expect_int(), mk.expect_int(), 0.0, true,
                                                       seed, offset, scale);
    };
  } else {
    auto cudnn_fwd = [&] {
      return at::_scaled_dot_product_cudnn_attention(q, k, v, /*attn_bias=*/std::nullopt,
                                                     /*compute_log_sumexp=*/true, 0.0, true, false,
                                                     scale);
    };
    fwd = [&] { cudnn_fwd(); };
    fb = [&] {
      auto [o, lse, cq, ck, mq, mk, seed, offset, dbg] = cudnn_fwd();
      // cuDNN wants the gradient in the output's strides.
      const at::Tensor d_o = at::empty_like(o).copy_(dout);
      at::_scaled_dot_product_cudnn_attention_backward(
          d_o, q, k, v, o, lse, seed, offset, at::Tensor(), cq, ck, len, len, 0.0, true, scale);
    };
  }
  Row row;
  row.name = name;
  row.method = sdpa == Sdpa::kFlash ? "flash (PyTorch)" : "cuDNN (PyTorch)";
  row.visible = static_cast<double>(batch) * len * (len + 1) / 2;
  try {
    row.fwd_ms = MedianMs(fwd);
    row.fb_ms = MedianMs(fb);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    row.method += ": unsupported (" + what.substr(0, std::min<size_t>(what.find('\n'), 80)) + ")";
    row.fwd_ms = row.fb_ms = 0;
    return row;
  }
  row.fwd_tflops = Tflops(row.visible, c, row.fwd_ms, 1.0);
  row.fb_tflops = Tflops(row.visible, c, row.fb_ms, 3.5);
  row.bwd_tflops = Tflops(row.visible, c, row.fb_ms - row.fwd_ms, 2.5);
  return row;
}

Row RunOurs(const Case& c, Kernel kernel, at::Tensor* out0, at::Tensor* q0, at::Tensor* k0,
            at::Tensor* v0) {
  const ScopedKernel use(kernel);
  const at::TensorOptions opt = at::TensorOptions(at::kCUDA).dtype(at::kBFloat16);
  const int64_t t = c.tokens(), p = c.prefix, d = c.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const at::Tensor q = at::randn({t, c.q_heads, d}, opt);
  const at::Tensor k = at::randn({t, c.kv_heads, d}, opt);
  const at::Tensor v = at::randn({t, c.kv_heads, d}, opt);
  const at::Tensor dout = at::randn({t, c.q_heads, d}, opt);
  const at::Tensor pk = p > 0 ? at::randn({p, c.kv_heads, d}, opt) : at::Tensor();
  const at::Tensor pv = p > 0 ? at::randn({p, c.kv_heads, d}, opt) : at::Tensor();
  at::Tensor gpk = p > 0 ? at::zeros({p, c.kv_heads, d}, opt.dtype(at::kFloat)) : at::Tensor();
  at::Tensor gpv = p > 0 ? at::zeros({p, c.kv_heads, d}, opt.dtype(at::kFloat)) : at::Tensor();
  const std::vector<int64_t> ends_host = KeyEnd(c);
  const at::Tensor ends = at::tensor(ends_host, at::TensorOptions().dtype(at::kLong)).to(at::kCUDA);
  Row row;
  row.name = c.name;
  row.method = kernel == Kernel::kHopperBoth ? "ours Hopper fwd + Hopper bwd"
               : kernel == Kernel::kHopperSingleKernel
                   ? "ours Hopper fwd + Hopper bwd (single kernel)"
               : kernel == Kernel::kHopper ? "ours Hopper fwd"
                                           : "ours FA2";
  for (int64_t j = 0; j < t; ++j) row.visible += static_cast<double>(ends_host[j] - j);
  row.visible += static_cast<double>(p) * t;
  row.fwd_ms = MedianMs([&] { TreeAttentionForward(q, k, v, pk, pv, ends, scale); });
  row.fb_ms = MedianMs([&] {
    const TreeAttentionOutput f = TreeAttentionForward(q, k, v, pk, pv, ends, scale);
    TreeAttentionBackward(dout, q, k, v, pk, pv, ends, f.out, f.lse, scale, gpk, gpv);
  });
  row.fwd_tflops = Tflops(row.visible, c, row.fwd_ms, 1.0);
  row.fb_tflops = Tflops(row.visible, c, row.fb_ms, 3.5);
  row.bwd_tflops = Tflops(row.visible, c, row.fb_ms - row.fwd_ms, 2.5);
  if (out0 != nullptr) {
    *out0 = TreeAttentionForward(q, k, v, pk, pv, ends, scale).out;
    *q0 = q;
    *k0 = k;
    *v0 = v;
  }
  return row;
}

int Main() {
  if (!at::hasCUDA()) {
    std::printf("dta-attention-bench needs a CUDA device\n");
    return 1;
  }
  const int64_t d = absl::GetFlag(FLAGS_head_dim);
  if (d != 64 && d != 128 && d != 256) {
    std::fprintf(stderr, "dta-attention-bench: --head_dim must be 64, 128 or 256, got %lld\n",
                 static_cast<long long>(d));
    return 2;
  }
  // Case names carry the head dim when it is not the default 128.
  const std::string dim = d == 128 ? "" : " D=" + std::to_string(d);
  std::vector<Row> rows;
  const std::vector<Case> chains = {
      {"chain T=4096 Hq=16 Hkv=8" + dim, 0, 4096, 0, 0, 16, 8, d},
      {"chain T=8192 Hq=16 Hkv=8" + dim, 0, 8192, 0, 0, 16, 8, d},
      {"chain T=16384 Hq=16 Hkv=8" + dim, 0, 16384, 0, 0, 16, 8, d},
      {"chain T=8192 Hq=32 Hkv=8" + dim, 0, 8192, 0, 0, 32, 8, d},
  };
  const int32_t only = absl::GetFlag(FLAGS_chain_case);
  for (size_t ci = 0; ci < chains.size(); ++ci) {
    const Case& c = chains[ci];
    if (only >= 0 && only != static_cast<int>(ci)) continue;
    std::vector<Row> ours;
    std::vector<at::Tensor> ours_out;
    at::Tensor q, k, v;
    for (const Kernel kernel : OurKernels(c)) {
      ours_out.emplace_back();
      ours.push_back(RunOurs(c, kernel, &ours_out.back(), &q, &k, &v));
    }
    if (OursOnly()) {
      rows.insert(rows.end(), ours.begin(), ours.end());
      if (Quick()) break;
      continue;
    }
    Row flash = RunSdpa(Sdpa::kFlash, c, c.name, 1, c.tokens());
    // Sanity at full size: flash on our inputs gives our output (each run draws its own inputs,
    // so only the last one is checked: the Hopper kernel where it ran).
    const int64_t group = c.q_heads / c.kv_heads;
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
    const at::Tensor ref = std::get<0>(at::_scaled_dot_product_flash_attention(
        q.unsqueeze(0).transpose(1, 2), k.repeat_interleave(group, 1).unsqueeze(0).transpose(1, 2),
        v.repeat_interleave(group, 1).unsqueeze(0).transpose(1, 2), 0.0, true, false, scale));
    const double err =
        (ours_out.back().to(at::kFloat) - ref.transpose(1, 2).squeeze(0).to(at::kFloat))
            .abs()
            .max()
            .item<double>();
    std::printf("%s: max |%s - flash| of out = %.3e\n", c.name.c_str(), ours.back().method.c_str(),
                err);
    // TFLOP/s of a row over flash's, per direction.
    auto vs_flash = [&](Row& r) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "fwd %.2f, bwd %.2f, fwd+bwd %.2f",
                    r.fwd_tflops / flash.fwd_tflops, r.bwd_tflops / flash.bwd_tflops,
                    r.fb_tflops / flash.fb_tflops);
      r.vs_flash = buf;
    };
    for (Row& r : ours) {
      vs_flash(r);
      rows.push_back(r);
    }
    rows.push_back(flash);
    Row cudnn = RunSdpa(Sdpa::kCudnn, c, c.name, 1, c.tokens());
    if (cudnn.fb_ms > 0) vs_flash(cudnn);
    rows.push_back(cudnn);
    if (Quick()) break;
  }
  if (!Quick()) {  // --quick times one chain case only
    // A packed tree: 4096 shared tokens, 16 branches of 1024; flash runs the 16 rollouts of 5120.
    const Case tree{"tree 4096 + 16 x 1024 Hq=16 Hkv=8" + dim, 0, 4096, 16, 1024, 16, 8, d};
    std::vector<Row> ours;
    for (const Kernel kernel : OurKernels(tree)) {
      ours.push_back(RunOurs(tree, kernel, nullptr, nullptr, nullptr, nullptr));
    }
    if (OursOnly()) {
      rows.insert(rows.end(), ours.begin(), ours.end());
    } else {
      Row flash = RunSdpa(Sdpa::kFlash, tree, "16 rollouts x 5120 (no sharing)", 16, 4096 + 1024);
      for (Row& r : ours) {
        char buf[96];
        std::snprintf(buf, sizeof(buf), "TFLOP/s fwd %.2f, fwd+bwd %.2f; time %.2fx, %.2fx faster",
                      r.fwd_tflops / flash.fwd_tflops, r.fb_tflops / flash.fb_tflops,
                      flash.fwd_ms / r.fwd_ms, flash.fb_ms / r.fb_ms);
        r.vs_flash = buf;
        rows.push_back(r);
      }
      rows.push_back(flash);
    }
    // A dta step: one 1024-token branch chunk over a cached 4096-token prefix.
    const Case step{
        "chunk T=1024 over cached P=4096 Hq=16 Hkv=8" + dim, 4096, 1024, 0, 0, 16, 8, d};
    for (const Kernel kernel : OurKernels(step)) {
      rows.push_back(RunOurs(step, kernel, nullptr, nullptr, nullptr, nullptr));
    }
    // A tau2-like packed step: a tree of 26,624 tokens (a 2,048-token task, 16 branches of 1,536)
    // over the cached system prompt, 4,838 tokens (a partial last tile), which three quarters of
    // such a step's tiles read (bench/results/2026-12-02-attention-tiles-cpu).
    const Case packed{"packed tree 2048 + 16 x 1536 over cached P=4838 Hq=16 Hkv=8" + dim,
                      4838,
                      2048,
                      16,
                      1536,
                      16,
                      8,
                      d};
    for (const Kernel kernel : OurKernels(packed)) {
      rows.push_back(RunOurs(packed, kernel, nullptr, nullptr, nullptr, nullptr));
    }
  }
  std::printf(
      "\n| case | method | visible entries | fwd ms | fwd TFLOP/s | fwd+bwd ms | "
      "fwd+bwd TFLOP/s | bwd TFLOP/s | ours / flash |\n");
  std::printf("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n");
  for (const Row& r : rows) {
    std::printf("| %s | %s | %.3g | %.3f | %.1f | %.3f | %.1f | %.1f | %s |\n", r.name.c_str(),
                r.method.c_str(), r.visible, r.fwd_ms, r.fwd_tflops, r.fb_ms, r.fb_tflops,
                r.bwd_tflops, r.vs_flash.c_str());
  }
  return 0;
}

#else

int Main() {
  std::printf("dta-attention-bench: built without nvcc, no kernels to time\n");
  return 1;
}

#endif

}  // namespace
}  // namespace dta::kernels

int main(int argc, char** argv) {
  dta::SetProgramUsage(
      "dta-attention-bench [--quick] [--ours_only] [--head_dim=64|128|256]: tree-attention "
      "kernels against PyTorch's flash and cuDNN attention");
  dta::ParseCommandLine(argc, argv);
  return dta::kernels::Main();
}

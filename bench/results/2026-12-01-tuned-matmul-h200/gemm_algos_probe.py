"""The step's GEMMs at Qwen3 shapes: ATen's choice against every algorithm cuBLASLt's heuristic
offers for the same problem (layouts as dta's Projections call them). Prints, per shape, ATen's
time, the heuristic's first algorithm and the best of up to 16, in us and TFLOP/s."""
import sys

import torch
from torch.utils.cpp_extension import load_inline

CPP = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <vector>

#define CK(x) TORCH_CHECK((x) == CUBLAS_STATUS_SUCCESS, #x)

// Row-major out[M,N] = beta out + a[M,K] @ b[K,N], a and b bf16 (contiguous or transposed views),
// out bf16 or fp32; every heuristic algorithm timed; returns [us of each].
// Per algorithm: us, then its tile, stages, split-K, reduction scheme, swizzle, custom option,
// cluster shape, and max |its result - ref| from out = c0 (beta 1) or from zero.
std::vector<std::vector<double>> Sweep(torch::Tensor a, torch::Tensor b, torch::Tensor out,
                                       double beta, int max_algos, int reps, torch::Tensor c0,
                                       torch::Tensor ref) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  // Column-major: out^T[N,M] = b^T[N,K] a^T[K,M].
  const bool b_rows = b.stride(1) == 1;  // b contiguous [K,N]: col-major N x K = b^T, op N
  const bool a_rows = a.stride(1) == 1;
  const cublasOperation_t opA = b_rows ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t opB = a_rows ? CUBLAS_OP_N : CUBLAS_OP_T;
  const int64_t lda = b_rows ? b.stride(0) : b.stride(1);
  const int64_t ldb = a_rows ? a.stride(0) : a.stride(1);
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  cublasLtMatmulDesc_t desc;
  CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opA, sizeof(opA)));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opB, sizeof(opB)));
  cublasLtMatrixLayout_t la, lb, lc;
  CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, opA == CUBLAS_OP_N ? N : K,
                                opA == CUBLAS_OP_N ? K : N, lda));
  CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, opB == CUBLAS_OP_N ? K : M,
                                opB == CUBLAS_OP_N ? M : K, ldb));
  const cudaDataType_t ct = out.scalar_type() == torch::kFloat ? CUDA_R_32F : CUDA_R_16BF;
  CK(cublasLtMatrixLayoutCreate(&lc, ct, N, M, out.stride(0)));
  size_t ws_bytes = 64 << 20;
  auto ws = torch::empty({(int64_t)ws_bytes}, a.options().dtype(torch::kUInt8));
  cublasLtMatmulPreference_t pref;
  CK(cublasLtMatmulPreferenceCreate(&pref));
  CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                          &ws_bytes, sizeof(ws_bytes)));
  std::vector<cublasLtMatmulHeuristicResult_t> res(max_algos);
  int found = 0;
  CK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, max_algos, res.data(), &found));
  const float alpha = 1.f, bet = static_cast<float>(beta);
  auto stream = at::cuda::getCurrentCUDAStream().stream();
  cudaEvent_t s, e;
  cudaEventCreate(&s);
  cudaEventCreate(&e);
  std::vector<std::vector<double>> rows;
  for (int i = 0; i < found; ++i) {
    std::vector<double> row;
    auto run = [&] {
      return cublasLtMatmul(lt, desc, &alpha, b.data_ptr(), la, a.data_ptr(), lb, &bet,
                            out.data_ptr(), lc, out.data_ptr(), lc, &res[i].algo, ws.data_ptr(),
                            ws_bytes, stream);
    };
    out.copy_(c0);
    if (run() != CUBLAS_STATUS_SUCCESS) { rows.push_back({-1}); continue; }
    const double diff = (out - ref).abs().max().item<double>();
    for (int w = 0; w < 3; ++w) run();
    cudaEventRecord(s, stream);
    for (int r = 0; r < reps; ++r) run();
    cudaEventRecord(e, stream);
    cudaEventSynchronize(e);
    float ms = 0;
    cudaEventElapsedTime(&ms, s, e);
    row.push_back(1e3 * ms / reps);
    const cublasLtMatmulAlgoConfigAttributes_t attrs[] = {
        CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_STAGES_ID,
        CUBLASLT_ALGO_CONFIG_SPLITK_NUM, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
        CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION,
        CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID};
    for (auto attr : attrs) {
      uint64_t v = 0;
      size_t written = 0;
      cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, attr, &v, sizeof(v), &written);
      row.push_back(static_cast<double>(written == 4 ? static_cast<uint32_t>(v) : v));
    }
    row.push_back(diff);
    rows.push_back(row);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(desc);
  cublasLtDestroy(lt);
  return rows;
}
"""

ext = load_inline("gemm_algos_probe", cpp_sources=CPP, functions=["Sweep"],
                  extra_ldflags=["-lcublasLt"], with_cuda=True, verbose=False)


def aten_us(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return 1e3 * s.elapsed_time(e) / reps


# (label, kind, M, N, K): kind dW += dy^T x (fp32 accumulator, beta 1); fwd y = x W^T (bf16).
SHAPES = [("8B gate_up dW", "dW", 24576, 4096, k) for k in (1909, 2420, 3146, 4096, 5702)] + [
    ("8B down dW", "dW", 4096, 12288, 3146),
    ("8B o/q dW", "dW", 4096, 4096, 3146),
    ("8B o/q dW", "dW", 4096, 4096, 2420),
    ("8B k/v dW", "dW", 1024, 4096, 3146),
    ("8B head dW", "dW", 151936, 4096, 1536),
    ("1.7B gate_up dW", "dW", 12288, 2048, 7341),
    ("1.7B o/q dW", "dW", 2048, 2048, 27763),
    ("8B down fwd", "fwd", 3146, 4096, 12288),
]
torch.manual_seed(0)
bf = dict(device="cuda", dtype=torch.bfloat16)
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
print("columns: index, us, algo id, tile, stages, split-K, reduction, swizzle, custom, cluster, max |diff| vs ATen")
for label, kind, M, N, K in SHAPES:
    flops = 2.0 * M * N * K
    reps = max(3, min(50, int(2e12 / flops * 20)))
    if kind == "dW":
        dy = torch.randn(K, M, **bf)
        x = torch.randn(K, N, **bf)
        a, b = dy.t(), x
        c0 = torch.randn(M, N, device="cuda", dtype=torch.float32)
        out = c0.clone()
        ref = c0.clone()
        torch.addmm(ref, a, b, out_dtype=torch.float32, out=ref)  # as the executor's AddMatmul
        beta = 1.0
        fn = lambda: torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    else:
        a = torch.randn(M, K, **bf)
        b = torch.randn(N, K, **bf).t()
        out = torch.empty(M, N, **bf)
        c0 = torch.zeros(M, N, **bf)
        ref = torch.mm(a, b)
        beta = 0.0
        fn = lambda: torch.mm(a, b)
    base = aten_us(fn, reps)
    rows = ext.Sweep(a, b, out, beta, 16, reps, c0, ref)
    print(f"\n{label} {M} x {N} x {K}: ATen {base:.1f} us ({flops / base / 1e6:.0f} TF/s)")
    for i, r in enumerate(rows):
        if r[0] < 0:
            print(f"  #{i}: failed"); continue
        print(f"  #{i}: {r[0]:8.1f} us {flops / r[0] / 1e6:5.0f} TF/s  " + " ".join(f"{int(v)}" for v in r[1:9]) + f"  diff {r[9]:.3g}")
    sys.stdout.flush()

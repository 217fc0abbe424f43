"""Can torch._grouped_mm give the experts' weight gradient in float32 from bfloat16 inputs?"""
import time
import torch

torch.manual_seed(0)
dev = "cuda"
E, H, I = 128, 2048, 768
N = 8192 * 8  # pairs (8K tokens x top-8)
counts = torch.randint(0, 2 * N // E, (E,), device=dev)
counts = (counts * N // counts.sum()).clamp(min=0)
counts[-1] += N - counts.sum()
ends = counts.cumsum(0).to(torch.int32)
dy = torch.randn(N, I, device=dev, dtype=torch.bfloat16)
x = torch.randn(N, H, device=dev, dtype=torch.bfloat16)

def current():
    return torch._grouped_mm(dy.float().t(), x.float(), ends)

def bf16_fp32_out():
    return torch._grouped_mm(dy.t(), x, ends, out_dtype=torch.float32)

def bf16_out():
    return torch._grouped_mm(dy.t(), x, ends)

def timeit(f, n=10):
    f(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3

ref = current()
flops = 2 * N * H * I
for name, f in [("fp32 copies (current)", current), ("bf16 in, fp32 out", bf16_fp32_out), ("bf16 in/out", bf16_out)]:
    try:
        out = f()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ms = timeit(f)
        print(f"{name:24s} {ms:8.3f} ms  {flops / ms / 1e9:8.1f} TFLOP/s  dtype {out.dtype}  rel err vs current {err:.2e}")
    except Exception as e:
        print(f"{name:24s} FAILED: {str(e).splitlines()[0]}")
# the forward shape: x [N, H] @ w[e]^T
w = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16)
f = lambda: torch._grouped_mm(x, w.transpose(1, 2), ends)
ms = timeit(f)
print(f"forward grouped (bf16) {ms:8.3f} ms  {flops / ms / 1e9:8.1f} TFLOP/s")
try:
    g = lambda: torch._grouped_mm(x, w.transpose(1, 2), ends, out_dtype=torch.float32)
    ms = timeit(g)
    print(f"forward grouped fp32 out {ms:8.3f} ms  {flops / ms / 1e9:8.1f} TFLOP/s")
except Exception as e:
    print("forward fp32 out FAILED:", str(e).splitlines()[0])
dense = lambda: x @ w[0].t()
ms = timeit(dense)
print(f"dense mm same rows [N,H]x[H,I] {ms:8.3f} ms {flops / ms / 1e9:8.1f} TFLOP/s")

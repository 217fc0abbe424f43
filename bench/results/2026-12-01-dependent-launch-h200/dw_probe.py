"""The weight-gradient GEMM at Qwen3 shapes on a GPU: accumulated into float32 (beta 1, as dta's
chunks do), written fresh in float32, and in bfloat16. Run by before.sh."""
import torch
torch.manual_seed(0)
def t(fn, n=20):
    try:
        fn()
    except Exception as e:  # an API this torch lacks
        print("  failed:", str(e).splitlines()[0]); return float("nan")
    for _ in range(3): fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n
for (out, inp) in ((24576, 4096), (4096, 12288), (6144, 4096), (4096, 4096), (12288, 2048), (2048, 6144)):
    for k in (256, 1024, 2048, 4096):
        dy = torch.randn(k, out, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(k, inp, device="cuda", dtype=torch.bfloat16)
        acc = torch.zeros(out, inp, device="cuda", dtype=torch.float32)
        f = 2.0 * out * inp * k
        a = t(lambda: torch.addmm(acc, dy.t(), x, out_dtype=torch.float32, out=acc))
        b = t(lambda: torch.mm(dy.t(), x, out_dtype=torch.float32))
        c = t(lambda: torch.mm(dy.t(), x))
        print(f"dW {out:6d} x {inp:6d}, K {k:5d}: addmm fp32 {a*1e3:8.1f} us ({f/a/1e9:4.0f} TF/s), "
              f"mm fp32 {b*1e3:8.1f} ({f/b/1e9:4.0f}), mm bf16 {c*1e3:8.1f} ({f/c/1e9:4.0f})")

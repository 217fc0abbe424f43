"""Is the fp32 reference attention less precise on the GPU than on the CPU? bf16
inputs at head dim 16 (test_trainer_gpu's tiny model), float64 truth; the reference's formula in
float32 on each device, and SDPA in bf16 on the GPU."""
import torch

print("allow_tf32", torch.backends.cuda.matmul.allow_tf32,
      getattr(torch.backends.cuda.matmul, "fp32_precision", None),
      "float32_matmul_precision", torch.get_float32_matmul_precision())
torch.manual_seed(0)
T, H, D = 100, 4, 16
q = (torch.randn(H, T, D) * 2).bfloat16()
k = (torch.randn(H, T, D) * 2).bfloat16()
v = torch.randn(H, T, D).bfloat16()
g = torch.randn(H, T, D).bfloat16()
mask = torch.ones(T, T, dtype=torch.bool).tril()


def ref(q, k, v, dtype, device):
    q, k, v = (t.to(device, dtype).requires_grad_(True) for t in (q, k, v))
    s = (q @ k.transpose(1, 2)) * D ** -0.5
    s = s.masked_fill(~mask.to(device), float("-inf"))
    out = torch.softmax(s, -1) @ v
    out.backward(g.to(device, dtype))
    return [t.detach().double().cpu() for t in (out, q.grad, k.grad, v.grad)]


truth = ref(q, k, v, torch.float64, "cpu")
for name, got in [("ref fp32 cpu", ref(q, k, v, torch.float32, "cpu")),
                  ("ref fp32 cuda", ref(q, k, v, torch.float32, "cuda"))]:
    print(name, " ".join(f"{n}={((a - b).norm() / b.norm()).item():.2e}"
                         for n, a, b in zip(["out", "dq", "dk", "dv"], got, truth)))
qc, kc, vc = (t.cuda().requires_grad_(True) for t in (q, k, v))
out = torch.nn.functional.scaled_dot_product_attention(qc[None], kc[None], vc[None], is_causal=True)[0]
out.backward(g.cuda())
got = [t.detach().double().cpu() for t in (out, qc.grad, kc.grad, vc.grad)]
print("sdpa bf16 cuda", " ".join(f"{n}={((a - b).norm() / b.norm()).item():.2e}"
                                  for n, a, b in zip(["out", "dq", "dk", "dv"], got, truth)))

# dta with and without the cuDNN prefix split, alternating in one process (same weights, data, GPU).
import os, time, statistics, torch, dta
trajectories = dta.read_jsonl("device-inputs/tau2.jsonl")
trainer = dta.Trainer.from_config("qwen3-1.7b", dtype="bfloat16", device="cuda", progress="never")
run = lambda: trainer.compute_gradients(trajectories, "grpo", "dta")
times = {"1": [], "0": []}
for setting in ["1", "0"] * 2:
    os.environ["DTA_CUDNN_PREFIX"] = setting
    run(); torch.cuda.synchronize()
for setting in ["1", "0"] * 5:
    os.environ["DTA_CUDNN_PREFIX"] = setting
    torch.cuda.synchronize(); t = time.perf_counter(); run(); torch.cuda.synchronize()
    times[setting].append(time.perf_counter() - t)
for s, name in [("1", "split (cuDNN prefix)"), ("0", "tree attention on the prefix")]:
    print(f"dta {name:30s} median {statistics.median(times[s]):.3f} s  min {min(times[s]):.3f}  all {[round(x, 3) for x in times[s]]}")
# native GQA in cuDNN attention?
q = torch.randn(1, 16, 256, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 8, 512, 128, device="cuda", dtype=torch.bfloat16)
try:
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, k, None, True, 0.0, False, False, scale=0.1)
    ref = torch.softmax((q.float() @ k.float().repeat_interleave(2, 1).transpose(-1, -2)) * 0.1, -1) @ k.float().repeat_interleave(2, 1)
    print("native GQA forward ok, err", (r[0].float() - ref).abs().max().item())
except Exception as e:
    print("native GQA refused:", str(e).splitlines()[0][:200])

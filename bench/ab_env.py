# dta's step under several environment settings, alternating in one process (same weights, data and
# GPU), then one profiled step per setting: kernel launches and GPU time by kind.
#   PYTHONPATH=<site> python3 bench/ab_env.py ROLLOUTS.jsonl NAME=ENV,ENV... [NAME=...]
#   e.g. python3 bench/ab_env.py tau2.jsonl before=DTA_BATCHED_COPY=0,DTA_HOPPER_ATTENTION=0 after=
import os, statistics, sys, time

import torch
import dta

rollouts, settings = sys.argv[1], {}
for arg in sys.argv[2:]:
    name, _, env = arg.partition("=")
    settings[name] = dict(kv.split("=", 1) for kv in env.split(",") if kv)
keys = sorted({k for env in settings.values() for k in env})
trajectories = dta.read_jsonl(rollouts)
trainer = dta.Trainer.from_config("qwen3-1.7b", dtype="bfloat16", device="cuda", progress="never")


def use(name):
    for k in keys:
        os.environ.pop(k, None)
    os.environ.update(settings[name])


def step():
    trainer.compute_gradients(trajectories, "grpo", "dta")


times = {name: [] for name in settings}
for name in list(settings) * 2:
    use(name)
    step()
torch.cuda.synchronize()
for name in list(settings) * 5:
    use(name)
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    times[name].append(time.perf_counter() - start)
for name, t in times.items():
    print(f"{name:12s} {settings[name]}: median {statistics.median(t):.3f} s, min {min(t):.3f}, "
          f"all {[round(x, 3) for x in t]}")

for name in settings:
    use(name)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kind = {"attention": 0.0, "gemm": 0.0, "copy/cast/fill": 0.0, "other": 0.0}
    for e in kernels:
        n = e.name.lower()
        attention_names = ("attention", "sdpa", "flash", "fmha", "hopperforward", "hopperdq", "hopperdkdv")
        kind = ("attention" if any(w in n for w in attention_names)
                else "gemm" if "gemm" in n or "nvjet" in n or "cutlass" in n
                else "copy/cast/fill" if "copy" in n or "fill" in n or "memset" in n or "memcpy" in n
                else "other")
        by_kind[kind] += e.device_time_total / 1e3
    print(f"{name:12s} kernels {len(kernels):,}, GPU ms " +
          ", ".join(f"{k} {v:.1f}" for k, v in by_kind.items()) + f", total {sum(by_kind.values()):.1f}")

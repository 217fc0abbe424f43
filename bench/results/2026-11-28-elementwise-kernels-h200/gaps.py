"""Where dta's step leaves the GPU idle, and who asks for its memsets and float32 adds.

One warm-up step, then (1) a GPU-only profile: the idle gaps between kernels, the largest with the
kernels on either side and when they fall in the step; (2) a profile with host operations: the
callers (host operation ancestry) of every cudaMemsetAsync and of the float32 adds.

  PYTHONPATH=<site> python3 gaps.py --rollouts=tau2-s0.25.jsonl [--config=qwen3-1.7b]
"""
import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

import dta

parser = argparse.ArgumentParser()
parser.add_argument("--rollouts", required=True)
parser.add_argument("--config", default="qwen3-1.7b")
parser.add_argument("--top", type=int, default=25)
args = parser.parse_args()

trajectories = dta.read_jsonl(args.rollouts)
trainer = dta.Trainer.from_config(args.config, dtype="bfloat16", device="cuda", progress="never")


def step():
    trainer.compute_gradients(trajectories, loss="grpo", method="dta")
    torch.cuda.synchronize()


step()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    step()
kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
t0 = kernels[0][0]
gaps = []
busy_end = kernels[0][1]
for (s, e, name), prev in zip(kernels[1:], kernels):
    if s > busy_end:
        gaps.append((s - busy_end, busy_end - t0, prev[2], name))
    busy_end = max(busy_end, e)
total = busy_end - t0
idle = sum(g[0] for g in gaps)
print(f"GPU-only profile: {len(kernels)} GPU events over {total / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms "
      f"in {len(gaps)} gaps; gaps over 50 us: {sum(g[0] for g in gaps if g[0] > 50) / 1e3:.1f} ms "
      f"({sum(1 for g in gaps if g[0] > 50)}), 10-50 us: {sum(g[0] for g in gaps if 10 < g[0] <= 50) / 1e3:.1f} ms, "
      f"under 10 us: {sum(g[0] for g in gaps if g[0] <= 10) / 1e3:.1f} ms")
windows = collections.Counter()
for g in gaps:
    windows[int(g[1] // 100_000)] += g[0]
print("idle per 100 ms of the step:", " ".join(f"{w * 100}:{us / 1e3:.1f}" for w, us in sorted(windows.items())))
for us, at, before, after in sorted(gaps, reverse=True)[:args.top]:
    print(f"  gap {us / 1e3:7.3f} ms at {at / 1e3:8.2f} ms: after {before[:60]!r} before {after[:60]!r}")

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step()


def ancestry(event, depth=4):
    names = []
    parent = event.cpu_parent
    while parent is not None and len(names) < depth:
        names.append(parent.name[:48])
        parent = parent.cpu_parent
    return " < ".join(names)


memsets = collections.Counter()
adds = collections.Counter()
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        continue
    if e.name == "cudaMemsetAsync":
        memsets[ancestry(e)] += 1
    elif e.name in ("aten::add", "aten::add_"):
        adds[ancestry(e, 3)] += 1
print(f"\ncudaMemsetAsync callers ({sum(memsets.values())}):")
for chain, n in memsets.most_common(args.top):
    print(f"  {n:6d}  {chain}")
print(f"\naten::add / add_ callers ({sum(adds.values())}):")
for chain, n in adds.most_common(args.top):
    print(f"  {n:6d}  {chain}")

"""A/B of ExecutorOptions.unshared_prefix_fraction in one process: the default (a short prompt before
long answers recomputed) against 0 (every prefix shared), dta with pack=True, best of `repeats`
steps each, alternating. Usage: ab_unshare.py ROLLOUTS.jsonl [REPEATS]"""
import sys
import time

import torch

import dta

trajectories = dta.read_jsonl(sys.argv[1])
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
trainer = dta.Trainer.from_config("qwen3-1.7b", dtype="bfloat16", device="cuda", progress="never")
times = {"unshared": [], "shared": []}
for round in range(repeats + 1):  # round 0 warms up
    for name, fraction in (("unshared", dta.trainer.ExecutorOptions().unshared_prefix_fraction), ("shared", 0.0)):
        torch.cuda.synchronize()
        start = time.perf_counter()
        stats = trainer.compute_gradients(trajectories, "grpo", "dta", pack=True, unshared_prefix_fraction=fraction)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if round > 0:
            times[name].append(seconds)
        print(f"{name}: {seconds:.3f} s, {stats.forwarded_tokens:,} tokens forwarded", flush=True)
best = {name: min(t) for name, t in times.items()}
print(f"best: unshared {best['unshared']:.3f} s, shared {best['shared']:.3f} s, "
      f"shared / unshared {best['shared'] / best['unshared']:.3f}")

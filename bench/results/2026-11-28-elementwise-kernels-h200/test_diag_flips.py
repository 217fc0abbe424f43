"""Does the bf16 check of test_trainer_gpu measure rounding, or tokens that cross
GRPO's clip edges? For each method, the trained tokens whose clip state (which of the surrogate's
two branches is active) differs between the bf16 run's log-probabilities and float64's. Copied into
tests/python/ for a device run; runs on the CPU too (DIAG_DEVICE=cpu)."""
import math
import os
import statistics

import torch

import dta
from test_trainer import checkpoint, trajectories  # noqa: F401

DEVICE = os.environ.get("DIAG_DEVICE", "cuda")
VARIANTS = [("dense", {}), ("packed", {}), ("dta", {"block_size": 16, "pack": True})]


def clip_states(logprobs, trajectories):
    """Per trained token: 0 inside the clip range, 1 clipped (the gradient is 0), with the margin
    to the nearest edge that matters for the token's advantage sign."""
    groups = {}
    for t in trajectories:
        groups.setdefault(t.group, []).append(t.reward)
    states, margins = [], []
    for lp, t in zip(logprobs, trajectories):
        mean = statistics.fmean(groups[t.group])
        sign = 0 if t.reward == mean else (1 if t.reward > mean else -1)
        for i in range(1, len(t.tokens)):
            if not t.loss_mask[i] or sign == 0:
                continue
            r = math.exp(float(lp[i]) - t.logprobs[i])
            edge = 1.2 if sign > 0 else 0.8
            states.append(int(r > edge) if sign > 0 else int(r < edge))
            margins.append(abs(r - edge) / edge)
    return states, margins


def test_flips(checkpoint, trajectories):  # noqa: F811
    _, directory = checkpoint
    cpu = dta.Trainer(directory, dtype="float64", device="cpu")
    want_lp = cpu.compute_logprobs(trajectories, method="dense")
    want, margins = clip_states(want_lp, trajectories)
    near = sorted(margins)[:5]
    print(f"FLIPS {DEVICE} trained tokens with a nonzero advantage: {len(want)}, clipped in float64: "
          f"{sum(want)}, smallest margins to the edge: {['%.4f' % m for m in near]}")
    for method, options in VARIANTS:
        trainer = dta.Trainer(directory, dtype="bfloat16", device=DEVICE)
        got_lp = trainer.compute_logprobs(trajectories, method=method, **options)
        got, _ = clip_states(got_lp, trajectories)
        worst = max(float((g.cpu().double() - w).abs().max()) for g, w in zip(got_lp, want_lp))
        flips = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
        print(f"FLIPS {DEVICE} {method} {options}: {len(flips)} tokens change clip state "
              f"(margins {['%.4f' % margins[i] for i in flips]}); largest log-prob error {worst:.4f}")

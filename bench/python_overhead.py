"""The host time dta.Trainer spends checking a batch before its executor runs: the per-trajectory
Python validation it ran on every trajectory until commit d4c2685, beside the C++ check
(`_core.first_unchecked_trajectory`, what Trajectory.validate runs first) and the whole of
`Trainer._checked`, which since commit d4aaee7 also converts the batch for the executor in the same
pass (`_core.convert_checked`); and `dta.from_areal` of every trajectory
(AReaL's [1, L] tensors to a validated Trajectory, what dta's AReaL engine runs on each batch).
Nothing here needs a GPU or a model: the vocabulary size is the only part of the trainer the
checks read.

  build/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=tau2.jsonl
  python bench/python_overhead.py --rollouts=tau2.jsonl [--vocab_size=151936] [--repeats=5]

Prints the fastest of --repeats runs of each, in milliseconds, and the batch's size.
"""
from __future__ import annotations

import argparse
import sys
import time
from types import SimpleNamespace

import dta
from dta import Trajectory, _core


def best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", required=True, help="a JSON Lines rollout file (dta-workload writes them)")
    parser.add_argument("--vocab_size", type=int, default=151936, help="Qwen3's by default")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    batch = dta.read_jsonl(args.rollouts)
    tokens = sum(len(t.tokens) for t in batch)
    # Trainer._checked reads only vocab_size from the trainer.
    trainer = SimpleNamespace(vocab_size=args.vocab_size)
    python = best_ms(lambda: [t.validate(args.vocab_size) for t in batch], args.repeats)
    cpp = best_ms(lambda: _core.first_unchecked_trajectory(batch, 0, args.vocab_size, Trajectory), args.repeats)
    checked = best_ms(lambda: dta.Trainer._checked(trainer, batch, training=True), args.repeats)
    areal = [dta.to_areal(t, shifted=False) for t in batch]
    converted = best_ms(lambda: [dta.from_areal(d, id=t.id, group=t.group, shifted=False, vocab_size=args.vocab_size)
                                 for d, t in zip(areal, batch)], args.repeats)
    print(f"{len(batch)} trajectories, {tokens:,} tokens, vocabulary {args.vocab_size:,}")
    print(f"Python validation of every trajectory (before): {python:8.2f} ms")
    print(f"C++ check of plain trajectories (now):          {cpp:8.2f} ms ({python / max(cpp, 1e-9):.0f}x)")
    print(f"Trainer._checked, checked and converted (now): {checked:8.2f} ms")
    print(f"from_areal of every trajectory:                 {converted:8.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

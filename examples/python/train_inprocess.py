"""In-process training with dta.Trainer: dta against dense on the same rollouts.

    build/bin/dta-workload --preset=tau2 --seed=1 --scale=0.05 --vocab_size=1024 --out=/tmp/tau2.jsonl
    .venv/bin/python examples/python/train_inprocess.py --rollouts=/tmp/tau2.jsonl

Without --model, a small Qwen3 with random weights (examples/configs/qwen3-tiny.json) is written as
a Hugging Face checkpoint first, and both methods load it. The script prints the batch's prefix-tree
compression, trains GRPO steps (--steps, default 1) with each method from the same weights, and
compares their losses, times and first-step gradients (every parameter).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import dta

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", required=True, help="JSON Lines rollouts (dta-workload writes some)")
    parser.add_argument("--model", help="a Hugging Face Qwen3 directory (default: a tiny random one)")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--block_size", type=int, default=2048, help="dta: tokens per backward chunk")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        if model is None:
            checkpoint = Path(scratch) / "qwen3-tiny"
            random_model = dta.Trainer.from_config(REPO / "examples" / "configs" / "qwen3-tiny.json", seed=1)
            random_model.save(checkpoint, dtype=None, optimizer=False)  # float32, as initialised
            model = str(checkpoint / "model")
            print(f"wrote a random Qwen3 (examples/configs/qwen3-tiny.json) to {model}")

        def trainer() -> dta.Trainer:
            return dta.Trainer(model, dtype=args.dtype, device=args.device, lr=args.lr)

        batch = dta.read_jsonl(args.rollouts)
        stats = dta.PrefixTree(batch).stats()
        print(f"{args.rollouts}: {stats.num_rollouts} rollouts, {stats.rollout_tokens} rollout tokens, "
              f"{stats.tree_tokens} tree tokens (C = {stats.compression:.2f})")

        # Each method trains from the same weights; the first step's gradients (still in .grad
        # after the optimizer step) are compared parameter by parameter.
        print(f"\n{'method':>6} {'step':>4} {'loss':>14} {'grad norm':>10} {'forwarded':>10} {'time s':>8} "
              f"{'rollout tok/s':>14}")
        runs, first_gradients = {}, {}
        for method, options in [("dense", {}), ("dta", {"block_size": args.block_size})]:
            t = trainer()
            runs[method] = []
            for step in range(1, args.steps + 1):
                s = t.train_batch(batch, "grpo", method, **options)
                runs[method].append(s)
                if step == 1:
                    first_gradients[method] = {n: g.detach().double().clone() for n, g in t.gradients().items()}
                print(f"{method:>6} {step:>4} {s.loss:>14.8g} {s.grad_norm:>10.4g} {s.forwarded_tokens:>10} "
                      f"{s.seconds:>8.3f} {s.rollout_tokens_per_second:>14.0f}")
        want, got = first_gradients["dense"], first_gradients["dta"]
        worst = max(((got[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in want.items())
        seconds = {m: sum(s.seconds for s in r) for m, r in runs.items()}
        losses = [abs(a.loss - b.loss) / max(abs(b.loss), 1e-30) for a, b in zip(runs["dta"], runs["dense"])]
        print(f"\ndta vs dense: {seconds['dense'] / seconds['dta']:.2f}x the throughput, tokens forwarded "
              f"{runs['dta'][0].forwarded_tokens} vs {runs['dense'][0].forwarded_tokens}; largest relative "
              f"difference of the losses {max(losses):.2e}, of the first step's gradients {worst:.2e} "
              f"(over {len(want)} parameters, {args.dtype})")


if __name__ == "__main__":
    main()

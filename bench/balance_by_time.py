"""Data-parallel balance by time: a time model fitted on the device, and each share of a split run alone.

The DFS-contiguous split (core/partition/partition.h) balances tree tokens by default; a rank whose
share holds long paths then spends far more time in attention than the others. This script fits a
monotonic time model on the device, seconds = a x tree tokens + b x attended keys (a tree token at
depth d attends to d + 1 keys), from shares of the batches run alone (dta.Trainer.compute_gradients,
dta with its defaults), and shows, per batch and rank, the predicted and the measured time of each
share under the token split and under the time split (`PrefixTree.partition(per_token, per_key)`, the
weights in picoseconds, as `dta-dispatcher --balance_per_token --balance_per_key` and `dta-train
--distributed` take them). A data-parallel step waits for its slowest rank: the largest measured share
is the step's time.

The model is fitted on the token split's shares of every batch (and at twice the ranks), then judged on
the time split's shares, which it did not see. `--long_paths=3x40000` adds, for each file, the same batch
with an agentic group of long paths (3 of 40,000 tokens sharing a 2,000-token prompt). Nothing here is a
test: run it on a GPU for numbers.

  python bench/balance_by_time.py --config=qwen3-1.7b --ranks=8 --rollouts=tau2.jsonl --long_paths=3x40000
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

import dta


def attended_keys(tree: dta.PrefixTree) -> int:
    """Keys the tree's tokens attend to: each token at depth d attends to d + 1."""
    return round(tree.stats().tree_attention_work)


def features(rollouts: list) -> tuple[int, int]:
    """(tree tokens, attended keys) of a share's own prefix tree."""
    if not rollouts:
        return 0, 0
    tree = dta.PrefixTree(rollouts)
    return tree.tree_tokens, attended_keys(tree)


def measure(trainer, rollouts: list, repeats: int, device: torch.device) -> float:
    """The fastest of `repeats` timed runs of the share's gradients after one warm-up, seconds (NaN
    for a share without a trained token, which has no gradient to compute)."""
    if not rollouts:
        return 0.0
    if not any(any(r.loss_mask) for r in rollouts):
        return math.nan
    best = math.inf
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        trainer.compute_gradients(rollouts, "grpo", "dta")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i > 0:
            best = min(best, time.perf_counter() - start)
    return best


def fit(samples: list[tuple[int, int, float]]) -> tuple[float, float]:
    """Non-negative least squares of seconds = a tokens + b keys over the samples (two unknowns: the
    unconstrained fit, else the better of the two one-term fits)."""
    x = torch.tensor([[s[0], s[1]] for s in samples], dtype=torch.float64)
    y = torch.tensor([s[2] for s in samples], dtype=torch.float64)
    scale = x.abs().max(0).values.clamp_min(1)
    solution = torch.linalg.lstsq(x / scale, y[:, None]).solution[:, 0] / scale
    a, b = float(solution[0]), float(solution[1])
    if a >= 0 and b >= 0:
        return a, b
    candidates = []
    for column in (0, 1):
        c = float((x[:, column] @ y) / (x[:, column] @ x[:, column]).clamp_min(1e-300))
        residual = float(((x[:, column] * c - y) ** 2).sum())
        candidates.append((residual, (c, 0.0) if column == 0 else (0.0, c)))
    return min(candidates)[1]


def long_path_group(count: int, length: int, vocab_size: int, seed: int = 1) -> list:
    """`count` paths of `length` random tokens sharing a 2,000-token prompt (an agent's growing
    context), trained on their last 4,000 tokens, rewards alternating 0 and 1 (a GRPO group)."""
    rng = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, vocab_size, (min(2000, length // 2),), generator=rng).tolist()
    paths = []
    for i in range(count):
        tokens = prompt + torch.randint(1, vocab_size, (length - len(prompt),), generator=rng).tolist()
        trained = min(4000, length - len(prompt))
        mask = [0] * (length - trained) + [1] * trained
        paths.append(dta.Trajectory(id=f"long-{i}", group="long-paths", tokens=tokens, loss_mask=mask,
                                    logprobs=[0.0] * length, reward=float(i % 2)))
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", required=True, help="comma-separated JSON Lines files, one batch each")
    parser.add_argument("--config", default="qwen3-1.7b", help="a dta preset or a config.json")
    parser.add_argument("--ranks", type=int, default=8, help="data-parallel ranks to split each batch over")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--long_paths", default="",
                        help="NxLENGTH: also each batch with N paths of LENGTH tokens sharing a prompt")
    parser.add_argument("--json", action="store_true", help="a JSON line per batch")
    args = parser.parse_args()
    if args.ranks < 1:
        parser.error("--ranks must be >= 1")
    device = torch.device(args.device)
    trainer = dta.Trainer.from_config(args.config, dtype=args.dtype, device=args.device, progress="never")
    batches = {}
    for path in args.rollouts.split(","):
        rollouts = dta.read_jsonl(path)
        for r in rollouts:
            r.validate(trainer.vocab_size)
        batches[path] = rollouts
        if args.long_paths:
            count, length = (int(v) for v in args.long_paths.lower().split("x"))
            batches[f"{path} + {count} x {length:,}-token paths"] = rollouts + long_path_group(
                count, length, trainer.vocab_size)

    def shares(rollouts, partition):
        return [[rollouts[i] for i in group] for group in partition.groups]

    # Calibration: the token split's shares at ranks and 2 x ranks, every batch.
    samples = []
    for path, rollouts in batches.items():
        tree = dta.PrefixTree(rollouts)
        for ranks in (args.ranks, 2 * args.ranks):
            for share in shares(rollouts, tree.partition(ranks)):
                seconds = measure(trainer, share, args.repeats, device)
                if share and not math.isnan(seconds):
                    samples.append((*features(share), seconds))
        print(f"balance_by_time: calibrated on {path}", file=sys.stderr, flush=True)
    a, b = fit(samples)
    per_token, per_key = max(round(a * 1e12), 0), max(round(b * 1e12), 0)
    if per_token == 0 and per_key == 0:
        per_token = 1
    print(f"time model: {a * 1e6:.4f} us per tree token + {b * 1e9:.4f} ns per attended key "
          f"(--balance_per_token={per_token} --balance_per_key={per_key}); fitted on {len(samples)} shares")
    errors = [abs(a * t + b * k - s) / s for t, k, s in samples if s > 0]
    print(f"fit: median relative error {sorted(errors)[len(errors) // 2]:.1%} on the calibration shares")

    for path, rollouts in batches.items():
        tree = dta.PrefixTree(rollouts)
        stats = tree.stats()
        print(f"\n{path}: {len(rollouts)} rollouts, {stats.rollout_tokens:,} rollout tokens, "
              f"{stats.tree_tokens:,} tree tokens (C = {stats.compression:.2f}), longest {stats.longest_rollout:,}; "
              f"{args.ranks} ranks, {args.config} {args.dtype} on "
              f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
        print(f"{'split':<7} {'rank':>4} {'tree tok':>9} {'keys':>13} {'predicted s':>11} {'measured s':>10}")
        record = {"batch": path, "ranks": args.ranks, "config": args.config, "per_token_ps": per_token,
                  "per_key_ps": per_key}
        for name, partition in (("tokens", tree.partition(args.ranks)),
                                ("time", tree.partition(args.ranks, per_token=per_token, per_key=per_key))):
            rows = []
            for rank, share in enumerate(shares(rollouts, partition)):
                tokens, keys = features(share)
                predicted = a * tokens + b * keys
                measured = measure(trainer, share, args.repeats, device)
                rows.append({"rank": rank, "tree_tokens": tokens, "keys": keys, "predicted_s": predicted,
                             "measured_s": measured})
                print(f"{name:<7} {rank:>4} {tokens:>9,} {keys:>13,} {predicted:>11.3f} {measured:>10.3f}")
            measured = [r["measured_s"] for r in rows if not math.isnan(r["measured_s"])]
            slowest = max(measured, default=math.nan)
            mean = sum(measured) / len(rows)
            print(f"{name:<7} step (slowest share) {slowest:.3f} s, measured imbalance {slowest / mean:.3f}, "
                  f"extra tokens {partition.extra_tokens:,}")
            record[name] = {"shares": rows, "step_s": slowest, "imbalance": slowest / mean,
                            "extra_tokens": partition.extra_tokens}
        print(f"time split vs token split: {record['tokens']['step_s'] / record['time']['step_s']:.3f}x")
        if args.json:
            print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())

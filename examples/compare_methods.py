"""Prints dta against dense from the per-step metrics files dta-train writes (--metrics=FILE).

Usage: compare_methods.py DENSE.jsonl DTA.jsonl
"""
import json
import statistics
import sys


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    dense, dta = load(sys.argv[1]), load(sys.argv[2])
    if len(dense) != len(dta) or not dense:
        sys.exit(f"compare_methods: {len(dense)} dense steps vs {len(dta)} dta steps")
    print(f"{'step':>4} {'dense loss':>14} {'dta loss':>14} {'|diff|':>9}"
          f" {'dense tok/s':>12} {'dta tok/s':>12} {'speedup':>8}")
    for a, b in zip(dense, dta):
        print(f"{a['step']:>4} {a['loss']:>14.8g} {b['loss']:>14.8g} {abs(a['loss'] - b['loss']):>9.1e}"
              f" {a['rollout_tokens_per_second']:>12.0f} {b['rollout_tokens_per_second']:>12.0f}"
              f" {b['rollout_tokens_per_second'] / a['rollout_tokens_per_second']:>7.2f}x")
    # The first step includes one-time costs (allocator warm-up); report the median of the rest.
    rest = slice(1, None) if len(dense) > 1 else slice(None)
    speed = statistics.median(b["rollout_tokens_per_second"] / a["rollout_tokens_per_second"]
                              for a, b in zip(dense[rest], dta[rest]))
    memory = max(b["peak_memory_gib"] for b in dta) / max(a["peak_memory_gib"] for a in dense)
    print(f"\ndta vs dense on {dense[0]['rollout_tokens']} rollout tokens ({dense[0]['tree_tokens']} unique,"
          f" C = {dense[0]['compression']:.2f}x): {speed:.2f}x the rollout tokens per second,"
          f" {memory:.2f}x the peak memory (process RSS on CPU)")


if __name__ == "__main__":
    main()

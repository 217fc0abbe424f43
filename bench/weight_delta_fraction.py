"""How much of the published bf16 weights changes per RL step: the size of the weight deltas that
dta-trainer --publish_weight_delta writes (docs/weight_sync.md, "Delta sync").

Trains dta.Trainer with GRPO on dta-workload rollouts (a new batch, from a new seed, each step) and
after every optimizer step rounds the parameters to bf16, as a published checkpoint holds them, and
compares them bitwise with the previous step's. The model has random weights (init_std 0.02), not a
pretrained one: a pretrained model's larger weights change less often at the same lr.

  # CPU: the tiny Qwen3 (examples/configs/qwen3-tiny.json), seconds
  python bench/weight_delta_fraction.py
  # GPU: Qwen3-1.7B and -8B presets, bf16 parameters (float32 master weights), lr 1e-6 and 1e-5
  python bench/weight_delta_fraction.py --device=cuda

Prints per step: the changed fraction of bf16 elements, the delta's bytes (encoded as the trainer
encodes it: per tensor the smallest of sparse, bitmap and dense) beside the full weights' bytes.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import dta
from dta.weight_delta import encoded_size

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "configs" / "qwen3-tiny.json"


def workload(tool: Path, preset: str, seed: int, scale: float, vocab_size: int, directory: Path) -> list:
    out = directory / f"{preset}-{seed}.jsonl"
    subprocess.run([str(tool), f"--preset={preset}", f"--seed={seed}", f"--scale={scale}",
                    f"--vocab_size={vocab_size}", f"--out={out}"], check=True, capture_output=True)
    return dta.read_jsonl(out)


def published(parameter: torch.Tensor) -> torch.Tensor:
    """A parameter as a checkpoint publishes it (bf16, rounded to nearest even)."""
    with torch.no_grad():
        return parameter.detach().to(torch.bfloat16, copy=True)


def run(config: str, lr: float, args: argparse.Namespace, tool: Path, directory: Path) -> None:
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    trainer = dta.Trainer.from_config(config, device=args.device, dtype=dtype, lr=lr, progress="never")
    full_bytes = elements = 0
    # The previous step's bf16 weights wait in host memory (an 8B model's 16 GB would crowd the
    # trainer's GPU); each tensor is compared on the trainer's device.
    previous = {name: published(p).cpu() for name, p in trainer.parameters().items()}
    for t in previous.values():
        elements += t.numel()
        full_bytes += t.numel() * t.element_size()
    name = Path(config).stem if config.endswith(".json") else config
    print(f"\n{name} ({elements / 1e6:,.1f}M parameters, {full_bytes / 1e6:,.1f} MB bf16) on "
          f"{args.device}, {dtype} parameters, lr {lr:g}, {args.workload} at scale {args.scale}")
    print(f"{'step':>4} {'tokens':>9} {'changed':>13} {'fraction':>9} {'delta MB':>10} "
          f"{'full MB':>10} {'delta/full':>10} {'seconds':>8}")
    fractions, ratios = [], []
    for step in range(1, args.steps + 1):
        batch = workload(tool, args.workload, args.seed + step, args.scale, trainer.vocab_size, directory)
        start = time.perf_counter()
        stats = trainer.train_batch(batch, loss="grpo", method=args.method)
        seconds = time.perf_counter() - start
        changed = delta_bytes = 0
        for tensor_name, parameter in trainer.parameters().items():
            current = published(parameter)
            c, b = encoded_size(previous[tensor_name].to(current.device), current)
            changed += c
            delta_bytes += b
            previous[tensor_name] = current.cpu()
        fractions.append(changed / elements)
        ratios.append(delta_bytes / full_bytes)
        print(f"{step:>4} {stats.rollout_tokens:>9,} {changed:>13,} {changed / elements:>9.4%} "
              f"{delta_bytes / 1e6:>10.3f} {full_bytes / 1e6:>10.3f} {delta_bytes / full_bytes:>10.4f} "
              f"{seconds:>8.2f}")
    # AdamW's first update moves every weight with a gradient by lr (m / sqrt(v) is its sign).
    print(f"mean of steps 2..{args.steps}: changed {sum(fractions[1:]) / (len(fractions) - 1):.4%}, "
          f"delta/full {sum(ratios[1:]) / (len(ratios) - 1):.4f}")
    del trainer
    if args.device == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--configs", default=None,
                        help="comma-separated presets or config.json files (default: the tiny Qwen3 on the "
                             "CPU, qwen3-1.7b,qwen3-8b on cuda)")
    parser.add_argument("--lrs", default="1e-6,1e-5", help="comma-separated learning rates")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--workload", default="tau2", help="a dta-workload preset")
    parser.add_argument("--scale", type=float, default=None,
                        help="dta-workload --scale (default 0.01 on the CPU, 0.1 on cuda)")
    parser.add_argument("--seed", type=int, default=1, help="step s trains on the batch of seed + s")
    parser.add_argument("--method", default="dta")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2")
    if args.scale is None:
        args.scale = 0.01 if args.device == "cpu" else 0.1
    configs = args.configs.split(",") if args.configs else \
        ([str(TINY)] if args.device == "cpu" else ["qwen3-1.7b", "qwen3-8b"])
    tool = Path(os.environ.get("DTA_BUILD_DIR", REPO / "build")) / "bin" / "dta-workload"
    if not tool.exists():
        parser.error(f"{tool} does not exist: build it (scripts/build.sh) or set DTA_BUILD_DIR")
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 16)))
    with tempfile.TemporaryDirectory() as directory:
        for config in configs:
            for lr in (float(x) for x in args.lrs.split(",")):
                run(config, lr, args, tool, Path(directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Full training steps of a mixture-of-experts model on several GPUs of one host, with and without
expert parallelism, side by side: `dta-train --distributed` under torchrun (one process per GPU,
NCCL), the same batch, model and flags, `--expert_parallel` the only difference. Prints one table
row per run (the last step's numbers; the first steps include allocation and first touch) and
writes every step's JSON line under --out.

    python bench/expert_parallel_steps.py --build=build-device --gpus=2 --config=qwen3-moe-small \
        --rollouts=tau2.jsonl --expert_parallel=1,2 --out=/tmp/ep

Exit status: 0 when every run succeeded, 1 otherwise (the failing run's stderr is printed).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def run(args: argparse.Namespace, expert_parallel: int) -> dict | None:
    out = Path(args.out) / f"ep{expert_parallel}"
    out.mkdir(parents=True, exist_ok=True)
    command = ["torchrun", f"--nproc_per_node={args.gpus}", "--no-python", str(Path(args.build) / "bin" / "dta-train"),
               "--distributed", f"--config={args.config}", f"--rollouts={args.rollouts}", "--dtype=bfloat16",
               "--device=cuda", f"--steps={args.steps}", "--json", f"--expert_parallel={expert_parallel}",
               "--init_std=0.02", "--router_aux_loss_coef=0.001", *args.extra]
    # torchrun would set OMP_NUM_THREADS=1: the host's share of the cores instead (random weights are
    # drawn on every host thread).
    threads = str(max(1, (os.cpu_count() or 1) // args.gpus))
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", threads))
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    (out / "stdout.jsonl").write_text(done.stdout)
    (out / "stderr.txt").write_text(done.stderr)
    if done.returncode != 0:
        print(f"EP {expert_parallel}: exit {done.returncode}\n{done.stderr[-3000:]}", file=sys.stderr)
        return None
    steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    layout = next((line for line in done.stderr.splitlines() if "layout:" in line), "")
    return {"expert_parallel": expert_parallel, "last": steps[-1], "layout": layout}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default="build")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--config", required=True)
    parser.add_argument("--rollouts", required=True)
    parser.add_argument("--expert_parallel", default="1,2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout_s", type=int, default=240)
    parser.add_argument("--out", required=True)
    parser.add_argument("extra", nargs="*", help="more dta-train flags (after --)")
    args = parser.parse_args()
    rows = []
    for ep in (int(e) for e in args.expert_parallel.split(",")):
        result = run(args, ep)
        if result is None:
            return 1
        rows.append(result)
    print(f"| EP | step s | executor s | optimizer s | rollout tok/s per GPU | GPU peak GiB | loss | layout |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        s = row["last"]
        layout = row["layout"].split("layout: ", 1)[-1].split(" for ")[0]
        print(f"| {row['expert_parallel']} | {s['seconds']:.3f} | {s['executor_seconds']:.3f} | "
              f"{s['optimizer_seconds']:.3f} | {s['rollout_tokens_per_second'] / args.gpus:,.0f} | "
              f"{s['peak_memory_gib']:.1f} | {s['loss']:.6g} | {layout} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

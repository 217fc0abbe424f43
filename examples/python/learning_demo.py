#!/usr/bin/env python3
"""A policy that learns through dta's services: the lookup task (lookup_task.py), dense against dta.

For each method (``--methods``, default dense then dta) the demo starts, in a private directory of
its own under ``--out``, a dta-dispatcher and ``--ranks`` dta-trainer ranks (data parallel: Gloo on
the CPU, NCCL on GPUs) and runs the on-policy worker of learning_worker.py in this process: it
samples a batch of GRPO groups, the dispatcher batches and splits it, the trainers train one step
and publish the weights, the worker loads them and samples the next batch. Every run starts from
the same initial model (``--config`` with random weights from ``--seed``), so with float64 weights
dense and dta trainers publish the same weights to ~1e-13, the seeded worker samples the same
tokens and both earn the same reward at every step; the demo checks it (exit status 1 otherwise,
when ``--dtype=float64``) and prints the steps side by side.

    .venv/bin/python examples/python/learning_demo.py --steps=40 --plot=docs/learning-curve.png

It writes ``--out``/learning.json (every step of every method, the wall times) and, with
``--plot``, the learning curves as a PNG. On a GPU: ``--device=cuda`` (the trainers and the
worker), a bigger model: ``--config`` with any Qwen3 (or Llama, Qwen2) config.json, whose
vocabulary is replaced by the task's 14 tokens; ``--dtype=float32`` or ``bfloat16`` trains faster
there, but the methods then round differently and their samples may part ways.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import dta
import learning_worker
import lookup_task

REPO = Path(__file__).resolve().parents[2]
METHODS = ("dense", "dta", "packed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initial_model(config_file: Path, directory: Path, seed: int) -> Path:
    """A Hugging Face model with random weights (seeded) from `config_file`, the task's vocabulary."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    values = json.loads(config_file.read_text())
    values["vocab_size"] = lookup_task.VOCAB_SIZE
    config = AutoConfig.for_model(values.pop("model_type", "qwen3"), **values)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


class Services:
    """One method's dta-dispatcher and dta-trainer ranks; stops whatever is still running on exit."""

    def __init__(self, args: argparse.Namespace, method: str, directory: Path, model: Path) -> None:
        self.args, self.method, self.directory, self.model = args, method, directory, model
        self.address = f"127.0.0.1:{free_port()}"
        self.dispatcher: subprocess.Popen | None = None
        self.trainers: list[subprocess.Popen] = []

    def __enter__(self) -> "Services":
        try:
            self._start()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _start(self) -> None:
        bin_dir, d = Path(self.args.build_dir) / "bin", self.directory
        wal = d / "dispatcher.wal"
        with open(d / "dispatcher.log", "w") as log:
            self.dispatcher = subprocess.Popen(
                [bin_dir / "dta-dispatcher", f"--wal={wal}", f"--listen={self.address}",
                 f"--batch_rollouts={self.args.groups * self.args.group_size * self.args.answers}",
                 f"--vocab_size={lookup_task.VOCAB_SIZE}"], stdout=log, stderr=log)
        give_up = time.monotonic() + 60
        while "listening on" not in (d / "dispatcher.log").read_text():  # it has written the token
            if self.dispatcher.poll() is not None or time.monotonic() > give_up:
                raise RuntimeError(f"dta-dispatcher did not start:\n{(d / 'dispatcher.log').read_text()}")
            time.sleep(0.02)
        env = dict(os.environ, WORLD_SIZE=str(self.args.ranks), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
        env.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores; idle OpenMP threads spin
        for rank in range(self.args.ranks):
            with open(d / f"trainer{rank}.log", "w") as log:
                self.trainers.append(subprocess.Popen(
                    [bin_dir / "dta-trainer", f"--dispatcher={self.address}", f"--token_file={wal}.trainer-token",
                     f"--checkpoint_dir={d / 'checkpoints'}", f"--model={self.model}", f"--method={self.method}",
                     f"--device={self.args.device}", f"--dtype={self.args.dtype}", "--checkpoint_dtype=model",
                     "--loss=grpo", f"--lr={self.args.lr}", f"--max_steps={self.args.steps}",
                     f"--wait_s={self.args.timeout_s:g}"],
                    stdout=log, stderr=log, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank))))

    def failed(self) -> str | None:
        """The log of a trainer that exited with an error, if one did."""
        for rank, trainer in enumerate(self.trainers):
            if trainer.poll() not in (None, 0):
                return (self.directory / f"trainer{rank}.log").read_text()[-4000:]
        return None

    def __exit__(self, *exc) -> None:
        for trainer in self.trainers:  # they stop by themselves after --max_steps
            try:
                trainer.wait(timeout=60 if exc[0] is None else 0)
            except subprocess.TimeoutExpired:
                pass
        for process in [*self.trainers, self.dispatcher]:
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


async def supervised(services: Services, options: learning_worker.Options) -> list[dict]:
    """The worker's steps, stopped with the trainer's log when a trainer fails."""
    worker = asyncio.ensure_future(learning_worker.learn(options, lambda line: print(line, flush=True)))
    while not worker.done():
        if (log := services.failed()) is not None:
            worker.cancel()
            raise RuntimeError(f"a dta-trainer rank failed:\n{log}")
        await asyncio.wait({worker}, timeout=0.2)
    return worker.result()


def run_method(args: argparse.Namespace, method: str, model: Path) -> dict:
    directory = Path(args.out) / method
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(mode=0o700, parents=True)  # private: the dispatcher creates the trainer token here
    started = time.monotonic()
    with Services(args, method, directory, model) as services:
        options = learning_worker.Options(
            dispatcher=services.address, model=str(model), checkpoint_dir=str(directory / "checkpoints"),
            steps=args.steps, groups=args.groups, group_size=args.group_size, answers=args.answers,
            seed=args.seed, device=args.device, dtype=args.dtype, timeout_s=args.timeout_s, label=f"[{method}] ")
        records = asyncio.run(supervised(services, options))
    return {"records": records, "wall_s": time.monotonic() - started}


def compare(runs: dict[str, dict]) -> dict:
    """Prints the methods' steps side by side; returns how far they agree."""
    methods = list(runs)
    steps = zip(*(runs[m]["records"] for m in methods))
    print("\n" + "step".rjust(4) + "".join(f"{m + ' reward':>14}" for m in methods)
          + "".join(f"{m + ' loss':>16}" for m in methods))
    loss_diff, equal = 0.0, True
    for rows in steps:
        print(f"{rows[0]['step']:4d}" + "".join(f"{r['reward']:14.4f}" for r in rows)
              + "".join(f"{r['loss']:+16.3e}" for r in rows))
        equal &= all(r["reward"] == rows[0]["reward"] for r in rows)
        loss_diff = max([loss_diff] + [abs(r["loss"] - rows[0]["loss"]) for r in rows])
    # On-policy GRPO's loss is about 0 (the advantages are centred): its absolute difference is the
    # measure of the methods' agreement.
    return {"rewards_equal": equal, "max_loss_difference": loss_diff}


def summary(runs: dict[str, dict], agreement: dict, window: int = 5) -> None:
    for method, run in runs.items():
        rewards = [r["reward"] for r in run["records"]]
        w = min(window, len(rewards))
        train = sorted(r["train_s"] for r in run["records"])[len(rewards) // 2]
        print(f"{method}: mean reward {sum(rewards[:w]) / w:.3f} over the first {w} steps, "
              f"{sum(rewards[-w:]) / w:.3f} over the last {w}; {len(rewards)} steps in {run['wall_s']:.0f} s "
              f"(a trainer step {train * 1000:.0f} ms, median)")
    if len(runs) > 1:
        verdict = "the same at every step" if agreement["rewards_equal"] else "DIFFERENT"
        print(f"{' and '.join(runs)}: rewards {verdict}; losses differ by at most "
              f"{agreement['max_loss_difference']:.1e}")


def plot(runs: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    styles = {"dta": dict(color="tab:blue", linewidth=3, alpha=0.6),
              "dense": dict(color="black", linewidth=1, linestyle="--", zorder=3),
              "packed": dict(color="tab:green", linewidth=1, linestyle=":")}
    for method, run in runs.items():
        steps = [r["step"] for r in run["records"]]
        axes.plot(steps, [r["reward"] for r in run["records"]], label=f"{method}: mean reward",
                  **styles.get(method, {}))
    lookups = next(iter(runs.values()))["records"]
    axes.plot([r["step"] for r in lookups], [r["lookups"] for r in lookups], color="tab:orange", linewidth=1,
              alpha=0.7, label="tool calls that look up the asked key")
    axes.set_xlabel("step (its batch sampled from the weights of the step before)")
    axes.set_ylabel("fraction of the batch")
    axes.set_ylim(0, 1.02)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    axes.set_title(title, fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="dense,dta", help="comma-separated: dense, dta, packed")
    parser.add_argument("--ranks", type=int, default=2, help="dta-trainer ranks (data parallel)")
    parser.add_argument("--config", default=str(REPO / "examples" / "configs" / "qwen3-lookup.json"),
                        help="the model's config.json (random weights; its vocabulary becomes the task's)")
    parser.add_argument("--lr", type=float, default=5e-3, help="AdamW's learning rate")
    parser.add_argument("--out", default=str(REPO / "build" / "demo" / "learning"), help="where runs are written")
    parser.add_argument("--build_dir", default=os.environ.get("DTA_BUILD_DIR", str(REPO / "build")),
                        help="holds bin/dta-dispatcher and bin/dta-trainer")
    parser.add_argument("--plot", help="draw the learning curves into this PNG")
    learning_worker.add_flags(parser)
    args = parser.parse_args()
    methods = args.methods.split(",")
    if not set(methods) <= set(METHODS) or len(set(methods)) != len(methods):
        parser.error(f"--methods: a list of distinct methods among {', '.join(METHODS)}")
    if min(args.steps, args.groups, args.group_size, args.answers, args.ranks) < 1:
        parser.error("counts must be positive")
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = initial_model(Path(args.config), out / "initial-model", args.seed)
    print(f"the lookup task: {args.groups} groups x {args.group_size} episodes x {args.answers} answers = "
          f"{args.groups * args.group_size * args.answers} trajectories a step, {args.steps} steps; "
          f"{Path(args.config).name} ({args.dtype}, {args.device}), {args.ranks} trainer ranks, seed {args.seed}",
          flush=True)
    runs = {}
    for method in methods:
        print(f"\n== {method}: dta-dispatcher, {args.ranks} dta-trainer ranks (--method={method}), the worker",
              flush=True)
        try:
            runs[method] = run_method(args, method, model)
        except (RuntimeError, TimeoutError, asyncio.TimeoutError, dta.DispatcherError) as error:
            print(f"learning_demo: {method}: {error}", file=sys.stderr)
            return 1
    agreement = compare(runs)
    print()
    summary(runs, agreement)
    (out / "learning.json").write_text(json.dumps({"options": vars(args), "agreement": agreement, "runs": runs},
                                                  indent=1) + "\n")
    if args.plot:
        plot(runs, Path(args.plot), f"The lookup task, {Path(args.config).name} ({args.dtype}), "
             f"{args.groups}x{args.group_size}x{args.answers} trajectories a step, {args.ranks} ranks, "
             f"seed {args.seed}")
    print(f"{time.monotonic() - started:.0f} s in all")
    if args.dtype == "float64" and not agreement["rewards_equal"]:
        print("the methods' rewards differ in float64: they should not", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One rank of test_trainer_distributed.py: trains a fixed batch with dta.Trainer and writes what
it saw (losses, gradient norms, log-probabilities) and a checkpoint. Run as one process, or as one
of several under a launcher's environment (RANK, WORLD_SIZE, ...) with --distributed."""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

import dta


def batch() -> list[dta.Trajectory]:
    """Twelve GRPO trajectories in two groups over a shared prompt with branches, a duplicate and a
    trajectory that is a prefix of another: the same on every rank."""
    rng = random.Random(3)
    prompt = [rng.randrange(1024) for _ in range(24)]
    turns = [prompt + [rng.randrange(1024) for _ in range(12)] for _ in range(3)]
    sequences = [t + [rng.randrange(1024) for _ in range(rng.randrange(1, 20))] for t in turns for _ in range(3)]
    sequences += [sequences[0], turns[1], prompt + [7]]
    return [dta.Trajectory(id=f"r{i}", group=f"g{i % 2}", tokens=tokens,
                           loss_mask=[0] + [int(rng.random() < 0.7) for _ in tokens[1:]],
                           logprobs=[-7.0 + rng.random() for _ in tokens], reward=rng.random())
            for i, tokens in enumerate(sequences)]


def grpo(logprobs: torch.Tensor, rollout: dta.trainer.RolloutLossInput) -> torch.Tensor:
    """A callable loss: -A ratio over the loss tokens, normalised over the whole batch."""
    ratio = torch.exp(logprobs - rollout.old_logprobs)
    return -(rollout.advantages * ratio * rollout.loss_mask).sum() / rollout.total_loss_tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--distributed", action="store_true")
    parser.add_argument("--tensor_parallel", type=int, default=1)
    parser.add_argument("--shard_optimizer", default="auto")
    parser.add_argument("--offload_optimizer", default="auto")
    args = parser.parse_args()
    choice = {"auto": "auto", "true": True, "false": False}
    trainer = dta.Trainer.from_config(args.config, seed=4, init_std=0.2, dtype="float64", lr=1e-2,
                                      max_grad_norm=0.05, distributed=args.distributed,
                                      tensor_parallel=args.tensor_parallel,
                                      shard_optimizer=choice[args.shard_optimizer],
                                      offload_optimizer=choice[args.offload_optimizer], timeout_s=60)
    trajectories = batch()
    steps = []
    for loss in ["grpo", "sft", grpo]:
        stats = trainer.train_batch(trajectories, loss=loss, method="dta", block_size=8)
        steps.append({"loss": stats.loss, "grad_norm": stats.grad_norm,
                      "rollout_tokens": stats.rollout_tokens, "tree_tokens": stats.tree_tokens})
    logprobs = trainer.compute_logprobs(trajectories, method="dta", block_size=8)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trainer.save(out / "ckpt", dtype=None)  # float64: compared exactly
    torch.save(logprobs, out / f"logprobs-{trainer.rank}.pt")
    (out / f"rank-{trainer.rank}.json").write_text(json.dumps({
        "steps": steps, "layout": trainer.layout, "rank": trainer.rank, "world_size": trainer.world_size,
        "tensor_parallel": trainer.tensor_parallel, "data_parallel_size": trainer.data_parallel_size,
        "shard_optimizer": trainer.shard_optimizer, "offload_optimizer": trainer.offload_optimizer}))


if __name__ == "__main__":
    main()

"""One rank of test_areal_distributed.py: AReaL's PPO loop on dta.areal's engine under a launcher's
environment (RANK, WORLD_SIZE, ...), for each run given, one after the other in the same
processes; the test runs ``drive`` in its own process for the one-process reference.

Per run (allocation, loss, route) it writes ``<out>/<run_name>/rank-R.pt``: the engine's layout,
each step's train_batch results and AReaL's exported statistics, this rank's compute_logp rows (keyed by their
tokens), the whole weights xccl would send (rank 0), a disk weight update and an hf save
(checkpoints beside it), and for one run an xccl update's received weights (rank 0)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal.api.cli_args import NameResolveConfig, PPOActorConfig, RejectionSamplingConfig
from areal.api.io_struct import SaveLoadMeta, WeightUpdateMeta
from areal.utils import name_resolve
from dta.areal import DTAOptions, DTAPPOActor
from test_areal_engine import FT_SPEC, VERSION, BroadcastInference, Inference, actor_config, xccl_meta

STEPS = 2


def config_of(path: str, backend: str, loss: str) -> PPOActorConfig:
    """test_areal_engine's configuration; ``decoupled``: AReaL's decoupled loss with a token cap
    (compute_logp runs, rejection statistics)."""
    decoupled = dict(use_decoupled_loss=True, rejection_sampling=RejectionSamplingConfig(upper=1.2))
    return actor_config(path, backend=backend, **(decoupled if loss == "decoupled" else {}))


class Shares(Inference):
    """test_areal_engine's inference side as a data-parallel head sees it: its own part of the
    rollouts (every replica's head pulls different ones)."""

    def __init__(self, rollouts: list[dict], replica: int, replicas: int) -> None:
        super().__init__("dta-test", "t0", rollouts[replica::replicas])


def key(row_ids: torch.Tensor, mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(row_ids[mask.bool()].tolist())


def run_name(backend: str, loss: str, route: str) -> str:
    return f"{backend.replace(':', '-')}-{loss}-{route}"


def drive(checkpoint: str, rollouts: list[dict], backend: str, loss: str, route: str, out: Path, *,
          device: str = "cpu", xccl: bool = False) -> dict[str, Any]:
    """AReaL's PPO loop (as PPOTrainer.train runs it) on this process's engine (float64 on the
    CPU, float32 on a GPU); what it saw. ``xccl``: then an xccl weight update to
    test_areal_engine's worker process (on world rank 0)."""
    out.mkdir(parents=True, exist_ok=True)
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(out / "names")))
    config = config_of(checkpoint, backend, loss)
    engine = DTAPPOActor(config, DTAOptions(dtype="float64" if device == "cpu" else "float32", device=device,
                                            loss=route, executor={"block_size": 8}))
    engine.create_process_group()
    engine.initialize(None, FT_SPEC)
    engine.set_version(VERSION)
    rank = dist.get_rank()
    inference = Shares(rollouts, engine.data_parallel_rank, engine.data_parallel_world_size)
    meta = WeightUpdateMeta.from_disk(config.experiment_name, config.trial_name, str(out / "root"))
    engine.connect_engine(inference, meta)
    results: list[dict] = []
    train_batch = engine.train_batch

    def recorded(*args: Any, **kwargs: Any) -> dict[str, float]:
        results.append(train_batch(*args, **kwargs))
        return results[-1]

    engine.train_batch = recorded
    steps, logp = [], {}
    for _ in range(STEPS):
        # AReaL's coordinator: the heads' shares redistributed over the data-parallel group and
        # broadcast to each replica's tensor-parallel ranks.
        batch = engine.rollout_batch([{}] * len(rollouts), workflow=None)
        if config.should_compute_prox_logp():
            for trajectory, lp in zip(batch, engine.compute_logp(batch)):
                trajectory["prox_logp"] = lp
                for b in range(lp.shape[0]):
                    mask = trajectory["attention_mask"][b]
                    logp.setdefault(key(trajectory["input_ids"][b], mask), []).append(lp[b][mask.bool()].cpu())
        engine.ppo_update(engine.compute_advantages(batch))
        engine.step_lr_scheduler()
        steps.append({"stats": engine.export_stats(), "train": list(results)})
        results.clear()
    with engine._whole_weights(engine.trainer.dtype) as weights:  # what xccl sends, in the engine's dtype
        whole = {name: tensor.cpu() for name, tensor in weights} if rank == 0 else None
    engine.update_weights(meta.with_version(VERSION))
    received, xccl_events = None, None
    if xccl:
        sink = BroadcastInference(str(out / "received.pt"), rollouts) if rank == 0 else inference
        update = xccl_meta()
        engine.connect_engine(sink, update)
        engine.update_weights(update)
        if rank == 0:
            received, xccl_events = sink.finish(), sink.events
    engine.save(SaveLoadMeta(path=str(out / "saved"), weight_format="hf", with_optim=True, tokenizer=None))
    report = {"rank": rank, "world": dist.get_world_size(), "replicas": engine.data_parallel_world_size,
              "dp_rank": engine.data_parallel_rank, "head": engine.current_data_parallel_head(),
              "tp": engine.trainer.tensor_parallel, "layout": engine.trainer.layout, "steps": steps, "logp": logp,
              "events": inference.events, "whole": whole, "received": received, "xccl_events": xccl_events,
              "route": engine.last_loss_route, "version": engine.get_version()}
    torch.save(report, out / f"rank-{rank}.pt")
    engine.destroy()
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--rollouts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--xccl_run", default="", help="the run (BACKEND/LOSS/ROUTE) that also updates over xccl")
    parser.add_argument("--runs", required=True,
                        help="comma-separated BACKEND/LOSS/ROUTE (e.g. fsdp:d2/decoupled/auto), one after the other")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # As AReaL's launcher: torch.distributed from torchrun's environment, before the engines.
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl")
    rollouts = torch.load(args.rollouts)
    for run in args.runs.split(","):
        backend, loss, route = run.split("/")
        drive(args.checkpoint, rollouts, backend, loss, route, Path(args.out) / run_name(backend, loss, route),
              device=args.device, xccl=run == args.xccl_run)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

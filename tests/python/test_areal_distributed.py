"""dta.areal at several processes: AReaL's PPOActor loop (its rollout coordinator, compute_logp,
compute_advantages, ppo_update, export_stats) on DTAPPOActor, its processes started as AReaL's
local launcher starts trainers (torchrun with AREAL_SPMD_MODE=1), on Gloo, with the allocations
fsdp:d2 (DP 2), fsdp:t2 (TP 2) and fsdp:d2t2 (4 processes), equals the one-process engine's in
float64 (test_areal_engine's tiny model and rollouts):

- each step's train_batch results (loss, gradient norm, learning rate, tree tokens) within 1e-9,
  AReaL's exported statistics (float32 in its tracker) within 1e-6, under the same names (but
  two of PPOActor's own that depend on AReaL's split, PADDING_STATS);
- compute_logp hands each rank the rows of its own share (keyed by their tokens), equal to the
  one-process engine's;
- the weights xccl would send (world rank 0, after dta's TP gather), the checkpoint of a disk
  weight update (AReaL's protocol from rank 0 only) and an hf save: one checkpoint each, equal to
  one process's within 1e-9; on 4 ranks (DP 2 x TP 2) an xccl update from rank 0 to
  test_areal_engine's worker process delivers exactly those weights.

On GPUs (2, or 4 for fsdp:d2t2; skipped elsewhere) the same runs in float32 over NCCL, within
1e-4. Worker: areal_distributed_worker.py (2 and 4 processes running their allocations one after
the other); the one-process reference runs here."""
from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal.api.alloc_mode import ModelAllocation
from areal_distributed_worker import drive, run_name
from test_areal_engine import checkpoint, make_rollouts, model64  # noqa: F401 - the fixtures

WORKER = Path(__file__).resolve().parent / "areal_distributed_worker.py"
# PPOActor's own statistics of its padded share (before the engine): n_tokens counts the padding
# and no_eos_ratios takes a row as wide as its share's widest for one without EOS, so both depend
# on how AReaL's coordinator split the batch, under AReaL's FSDP engine as here.
PADDING_STATS = {"ppo_actor/n_tokens", *(f"ppo_actor/no_eos_ratios/{s}" for s in ("avg", "min", "max"))}
CASES = [("decoupled", "auto"), ("ppo", "areal")]  # dta's built-in loss; AReaL's loss per rollout
RUNS = {2: [("fsdp:d2", *CASES[0]), ("fsdp:t2", *CASES[0])],
        4: [("fsdp:d2t2", *CASES[0]), ("fsdp:d2t2", *CASES[1])]}
XCCL_RUN = RUNS[4][0]  # also sends its weights over xccl (to a worker process; TP gather on 4 ranks)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, world: int, checkpoint_dir: str, rollouts_file: Path, device: str) -> list[subprocess.Popen]:
    """The world's ranks, started as AReaL's local launcher starts its trainers
    (areal/infra/launcher/local.py: ``torchrun --nnodes 1 --nproc-per-node N --master-addr
    localhost --master-port P <script> <args>`` with AREAL_SPMD_MODE=1); torchrun stops every rank
    when one fails."""
    runs = ",".join("/".join(run) for run in RUNS[world])
    return [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
         "--master-addr", "localhost", "--master-port", str(free_port()),
         str(WORKER), f"--checkpoint={checkpoint_dir}", f"--rollouts={rollouts_file}",
         f"--out={out}", f"--runs={runs}", f"--device={device}",
         # test_areal_engine's xccl worker joins over Gloo: the CPU runs only
         f"--xccl_run={'/'.join(XCCL_RUN) if device == 'cpu' else ''}"],
        env=dict(os.environ, AREAL_SPMD_MODE="1", OMP_NUM_THREADS="1"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)]


def wait(ranks: list[subprocess.Popen], timeout: float) -> None:
    """Until every rank exits; when one fails, the others (waiting for it) are stopped. Asserts
    that all succeeded, with the failures' stderr."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in ranks):
        if any(p.returncode not in (None, 0) for p in ranks) or time.monotonic() > deadline:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    errors = [p.communicate()[1] for p in ranks]
    for p, err in zip(ranks, errors):
        assert p.returncode == 0, err[-6000:]


def run_all(checkpoint_dir: str, model64, out: Path, device: str, worlds: list[int]) -> tuple[Path, Path]:
    """The workers' outputs (each world's processes; concurrently on the CPU, one world after the
    other on GPUs, which they share) and the one-process references' (run here). Four prompts of
    three rollouts: AReaL's coordinator needs as many from each data-parallel head."""
    rollouts = make_rollouts(model64, 4)
    rollouts_file = out / "rollouts.pt"
    torch.save(rollouts, rollouts_file)
    concurrent = device == "cpu"
    ranks = [p for world in worlds for p in launch(out / "ranks", world, checkpoint_dir, rollouts_file, device)] \
        if concurrent else []
    try:
        for loss, route in CASES:
            drive(checkpoint_dir, rollouts, "fsdp:d1", loss, route, out / "single" / run_name("fsdp:d1", loss, route),
                  device=device)
    finally:
        if concurrent:
            wait(ranks, timeout=300)
    if not concurrent:
        for world in worlds:
            wait(launch(out / "ranks", world, checkpoint_dir, rollouts_file, device), timeout=300)
    return out / "ranks", out / "single"


@pytest.fixture(scope="module")
def results(checkpoint, model64, tmp_path_factory) -> tuple[Path, Path]:  # noqa: F811 - the fixtures
    return run_all(checkpoint[1], model64, tmp_path_factory.mktemp("areal-distributed"), "cpu", sorted(RUNS))


def close(got: float, want: float, relative: float) -> bool:
    return math.isclose(got, want, rel_tol=relative, abs_tol=relative * 1e-3)


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
                        relative: float) -> None:
    assert got.keys() == want.keys() and len(want) > 10, what
    for name, w in want.items():
        assert got[name].dtype == w.dtype, (what, name)
        scale = max(float(w.double().norm()), 1e-300)
        assert float((got[name].double() - w.double()).norm()) <= relative * scale, (what, name)


def checkpoint_file(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.rglob("model*.safetensors"))
    assert len(files) == 1, files
    return load_file(str(files[0]))


def check_run(ranks_dir: Path, single_dir: Path, backend: str, loss: str, route: str, *, exact: float,
              statistics: float) -> None:
    """A run's ranks against the one-process run: train_batch's results and the weights within
    ``exact``, AReaL's statistics and compute_logp's rows within ``statistics``."""
    want = torch.load(single_dir / run_name("fsdp:d1", loss, route) / "rank-0.pt")
    run = ranks_dir / run_name(backend, loss, route)
    parallel = ModelAllocation.from_str(backend).parallel
    replicas, tp, world = parallel.dp_size, parallel.tp_size, parallel.world_size
    reports = [torch.load(run / f"rank-{r}.pt") for r in range(world)]
    assert want["route"].startswith("dta:decoupled-ppo" if route == "auto" else "areal")
    logp: dict = {}
    for r, got in enumerate(reports):
        # dta's layout as AReaL's engine API describes it: a replica's TP ranks are consecutive.
        assert (got["world"], got["replicas"], got["tp"]) == (world, replicas, tp)
        assert (got["dp_rank"], got["head"]) == (r // tp, r // tp * tp)
        assert f"TP {tp} x DP {replicas}" in got["layout"]
        assert got["route"] == want["route"] and got["version"] == want["version"]
        assert got["events"] == (["pause", "update", "continue"] if r == 0 else []), r
        for step, (g, w) in enumerate(zip(got["steps"], want["steps"], strict=True)):
            assert len(g["train"]) == len(w["train"])
            for gt, wt in zip(g["train"], w["train"]):
                assert gt.keys() == wt.keys()
                for k in ("dta_loss", "grad_norm", "lr", "dta_tree_tokens", "update_successful"):
                    assert close(gt[k], wt[k], exact), (r, step, k, gt[k], wt[k])
            # AReaL's statistics (its tracker reduces in float32): the same names and values; a
            # scalar's __count counts the ranks that logged it.
            names = {k for k in w["stats"] if not k.endswith("__count")}
            assert names == {k for k in g["stats"] if not k.endswith("__count")}, (r, step)
            for k in names - PADDING_STATS:
                assert math.isclose(g["stats"][k], w["stats"][k], rel_tol=statistics, abs_tol=statistics / 10), \
                    (r, step, k, g["stats"][k], w["stats"][k])
        for row, values in got["logp"].items():
            assert row not in logp or r % tp, "a row in two replicas' shares"
            logp[row] = values
    if want["logp"]:  # compute_logp ran: every rank got its own rows, as one process computes them
        assert logp.keys() == want["logp"].keys()
        for row, values in want["logp"].items():
            for g, w in zip(logp[row], values, strict=True):
                assert g.dtype == torch.float32 and torch.allclose(g, w, rtol=statistics, atol=statistics / 10), row
    if route == "auto":  # AReaL's names for dta's built-in loss's statistics
        stats = want["steps"][0]["stats"]
        for name in ("importance_weight/avg", "importance_weight/max", "approx_kl/avg", "clip_ratio/avg",
                     "dual_clip_ratio/avg", "actor_loss/avg", "behave_imp_weight/avg", "behave_approx_kl/avg",
                     "rs_filtered_fraction", "version_stats/sample_staleness_theta_avg"):
            assert f"ppo_actor/update/{name}" in stats, name
    assert_same_weights(reports[0]["whole"], want["whole"], "the weights xccl sends", exact)
    assert all(got["whole"] is None for got in reports[1:])
    if reports[0]["received"] is not None:  # XCCL_RUN: rank 0 sent them, in the config's dtype, each once
        received, whole = reports[0]["received"], reports[0]["whole"]
        assert [name for name, _ in received] == list(whole)
        for name, tensor in received:
            assert tensor.dtype == torch.float32 and torch.equal(tensor, whole[name].float()), name
        events = reports[0]["xccl_events"]
        assert events[:2] == ["init", "pause"] and events[-1] == "continue" and set(events[2:-1]) == {"update"}
    single = single_dir / run_name("fsdp:d1", loss, route)
    assert_same_weights(checkpoint_file(run / "root"), checkpoint_file(single / "root"), "disk weight update", exact)
    assert_same_weights(load_file(str(run / "saved" / "model.safetensors")),
                        load_file(str(single / "saved" / "model.safetensors")), "hf save", exact)
    state = sorted(p.relative_to(run / "saved" / "optimizer").as_posix()
                   for p in (run / "saved" / "optimizer").rglob("*.safetensors"))
    assert state and all(p.startswith("tp-") for p in state) == (tp > 1), state


ALL_RUNS = [run for world in sorted(RUNS) for run in RUNS[world]]


@pytest.mark.parametrize("backend, loss, route", ALL_RUNS, ids=lambda v: str(v))
def test_ranks_run_areals_loop_as_one_process(results, backend, loss, route):
    check_run(*results, backend, loss, route, exact=1e-9, statistics=1e-6)
    assert (torch.load(results[0] / run_name(backend, loss, route) / "rank-0.pt")["received"] is not None) == \
        ((backend, loss, route) == XCCL_RUN)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (4 for fsdp:d2t2)")
def test_gpu_ranks_run_areals_loop_as_one_process(checkpoint, model64, tmp_path):  # noqa: F811
    """The same on GPUs (NCCL data-parallel and replica groups, dta's NCCL trainer) in float32:
    float32 rounding apart, what one GPU computes."""
    worlds = [w for w in sorted(RUNS) if w <= torch.cuda.device_count()]
    ranks_dir, single_dir = run_all(checkpoint[1], model64, tmp_path, "cuda", worlds)
    for backend, loss, route in (run for world in worlds for run in RUNS[world]):
        check_run(ranks_dir, single_dir, backend, loss, route, exact=1e-4, statistics=1e-4)

"""dta.Trainer under a launcher (distributed=True) on Gloo, with dta-train's layout options: every
rank trains the same whole batch, split across the data-parallel replicas with the tensor-parallel
ranks of a replica sharing its share; the losses, gradient norms (clipped steps), log-probabilities
and saved weights equal one process's in float64, whatever the layout (TP, DP, sharded, offloaded,
two "nodes"), and a callable loss sees the batch's trajectories."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.numpy import load_file

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "qwen3-tiny.json"
WORKER = Path(__file__).resolve().parent / "distributed_trainer_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), f"--config={CONFIG}", f"--out={out}", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_ranks(out: Path, world: int, nodes: int, *args: str) -> None:
    port, per_node = free_port(), world // nodes
    ranks = [run_worker(out, "--distributed", *args,
                        env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r % per_node),
                                 LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(world)]
    outputs = [p.communicate(timeout=300) for p in ranks]
    for r, (p, (_, err)) in enumerate(zip(ranks, outputs)):
        assert p.returncode == 0, f"rank {r}:\n{err}"


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single")
    p = run_worker(out)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    return out


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-10 * max(1.0, abs(b))


@pytest.mark.parametrize("world, nodes, tp, shard, offload", [
    (2, 1, 2, "false", "false"),   # TP 2
    (2, 1, 1, "true", "false"),    # DP 2, ZeRO-1
    (3, 1, 1, "false", "false"),   # DP 3, replicated, an uneven split
    (4, 2, 2, "true", "true"),     # TP 2 x DP 2 on two nodes, sharded and offloaded
])
def test_ranks_train_what_one_process_trains(single, tmp_path, world, nodes, tp, shard, offload):
    run_ranks(tmp_path, world, nodes, f"--tensor_parallel={tp}", f"--shard_optimizer={shard}",
              f"--offload_optimizer={offload}")
    reference = json.loads((single / "rank-0.json").read_text())
    assert all(s["grad_norm"] > 0.05 for s in reference["steps"]), "the steps must clip"
    want_logprobs = torch.load(single / "logprobs-0.pt")
    for rank in range(world):
        got = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert (got["rank"], got["world_size"], got["tensor_parallel"]) == (rank, world, tp)
        assert got["data_parallel_size"] == world // tp
        assert got["shard_optimizer"] == (shard == "true") and got["offload_optimizer"] == (offload == "true")
        assert f"TP {tp} x DP {world // tp}" in got["layout"], got["layout"]
        for s, r in zip(got["steps"], reference["steps"], strict=True):
            assert (s["rollout_tokens"], s["tree_tokens"]) == (r["rollout_tokens"], r["tree_tokens"])
            assert close(s["loss"], r["loss"]), (rank, s, r)
            assert close(s["grad_norm"], r["grad_norm"]), (rank, s, r)
        logprobs = torch.load(tmp_path / f"logprobs-{rank}.pt")
        assert len(logprobs) == len(want_logprobs)
        for g, w in zip(logprobs, want_logprobs):
            assert g.dtype == torch.float64 and torch.allclose(g, w, rtol=1e-10, atol=1e-12)
    want = load_file(str(single / "ckpt" / "model" / "model.safetensors"))
    got = load_file(str(tmp_path / "ckpt" / "model" / "model.safetensors"))
    assert got.keys() == want.keys() and len(want) > 10
    for name, w in want.items():
        scale = max(float((w ** 2).sum()) ** 0.5, 1e-300)
        assert float(((got[name] - w) ** 2).sum()) ** 0.5 <= 1e-10 * scale, name
    replicas = world // tp
    for t in range(tp):
        state = tmp_path / "ckpt" / "optimizer" / (f"tp-{t:02d}-of-{tp:02d}" if tp > 1 else "")
        files = sorted(p.name for p in state.glob("optimizer*.safetensors"))
        sharded = shard == "true" or offload == "true"
        assert files == ([f"optimizer-{r:05d}-of-{replicas:05d}.safetensors" for r in range(replicas)]
                         if sharded else ["optimizer.safetensors"])


def test_layout_options_are_checked():
    import dta
    with pytest.raises(ValueError, match="needs distributed=True"):
        dta.Trainer.from_config(str(CONFIG), tensor_parallel=2)
    with pytest.raises(ValueError, match="shard_optimizer must be 'auto', True or False"):
        dta.Trainer.from_config(str(CONFIG), shard_optimizer="maybe")
    with pytest.raises(RuntimeError, match="cannot be trained on 1 GPU"):
        dta.Trainer.from_config(str(CONFIG), gpu_memory_gb=0.001, activation_gb=0)
    with pytest.raises(ValueError, match="offload_update must be 'gpu' or 'host', got 'disk'"):
        dta.Trainer.from_config(str(CONFIG), offload_optimizer=True, offload_update="disk")
    with pytest.raises(ValueError, match="longest_rollout must be an int >= 1"):
        dta.Trainer.from_config(str(CONFIG), longest_rollout=0)
    for bad in (-1, "lots", True):
        with pytest.raises(ValueError, match="offload_resident_gb must be 'auto' or a number of GB >= 0"):
            dta.Trainer.from_config(str(CONFIG), offload_optimizer=True, offload_resident_gb=bad)
    # Only state streamed through a GPU can stay on it.
    with pytest.raises(RuntimeError, match="keeps state on a GPU only when it is streamed through one"):
        dta.Trainer.from_config(str(CONFIG), offload_optimizer=True, offload_resident_gb=1)
    # The executor's estimated peak is planned for the longest rollout asked for.
    assert "for a 8192-token path" in dta.Trainer.from_config(str(CONFIG)).layout
    assert "for a 32768-token path" in dta.Trainer.from_config(str(CONFIG), longest_rollout=32768).layout
    trainer = dta.Trainer.from_config(str(CONFIG), offload_optimizer=True)
    assert trainer.offload_optimizer and "TP 1 x DP 1" in trainer.layout and trainer.world_size == 1
    # On a CPU the offloaded state is updated on the host whichever is asked for.
    assert re.fullmatch(r"the offloaded AdamW update runs on \d+ host threads", trainer.offload_description)
    assert dta.Trainer.from_config(str(CONFIG)).offload_description == ""
    if torch.cuda.is_available():
        for where, says in [("gpu", "streams through the GPU"), ("host", "host threads")]:
            on_gpu = dta.Trainer.from_config(str(CONFIG), device="cuda", offload_optimizer=True,
                                             offload_update=where)
            assert says in on_gpu.offload_description

"""dta-train end to end: the three methods dump the same float64 gradients, the optimizer state
resumes, and bad input exits with status 2 and a message naming what is wrong."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import random
import subprocess
from pathlib import Path

import pytest
from safetensors.numpy import load_file

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "qwen3-tiny.json"
MOE_CONFIG = REPO / "examples" / "configs" / "qwen3-moe-tiny.json"


def tool(name: str) -> Path:
    path = Path(os.environ.get("DTA_BUILD_DIR", REPO / "build")) / "bin" / name
    if not path.exists():
        pytest.fail(f"{path} does not exist: build it with scripts/build.sh (or set DTA_BUILD_DIR)")
    return path


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory) -> Path:
    """Twelve rollouts over a shared 40-token prompt with two levels of branching, a duplicate and a
    rollout that is a prefix of others; random masks, behaviour log-probabilities and rewards."""
    rng = random.Random(5)
    prompt = [rng.randrange(1024) for _ in range(40)]
    turns = [prompt + [rng.randrange(1024) for _ in range(30)] for _ in range(3)]
    sequences = [t + [rng.randrange(1024) for _ in range(rng.randrange(1, 60))] for t in turns for _ in range(3)]
    sequences += [sequences[0], turns[1], prompt + [7]]
    path = tmp_path_factory.mktemp("data") / "rollouts.jsonl"
    with open(path, "w") as f:
        for i, tokens in enumerate(sequences):
            f.write(json.dumps({
                "id": f"r{i}", "group": f"g{i % 2}", "tokens": tokens,
                "loss_mask": [0] + [int(rng.random() < 0.7) for _ in tokens[1:]],
                "logprobs": [-7.0 + rng.random() for _ in tokens], "reward": rng.random()}) + "\n")
    return path


def train(*args: str, config: Path = CONFIG) -> subprocess.CompletedProcess:
    return subprocess.run([tool("dta-train"), f"--config={config}", *args], capture_output=True, text=True)


def test_methods_dump_identical_float64_gradients(rollouts, tmp_path):
    grads = {}
    # dta without packing (--nopack), and with it (the default).
    for method, extra in [("dense", []), ("packed", []), ("dta", ["--block_size=64", "--nopack"]),
                          ("dta", ["--block_size=64", "--graph_budget=200"])]:
        out = tmp_path / f"{method}{len(grads)}.safetensors"
        run = train(f"--rollouts={rollouts}", f"--method={method}", "--dtype=float64", "--init_std=0.2",
                    f"--dump_grads={out}", "--json", *extra)
        assert run.returncode == 0, run.stderr
        step = json.loads(run.stdout.splitlines()[-1])
        assert step["rollout_tokens"] > step["tree_tokens"] > 0
        grads[f"{method} {' '.join(extra)}"] = load_file(str(out))
    reference = grads.pop("dense ")
    assert len(reference) > 10
    # A zero reference would make the comparison vacuous.
    assert all(float((g ** 2).sum()) > 0 for g in reference.values())
    for name, other in grads.items():
        assert other.keys() == reference.keys()
        for key, ref in reference.items():
            scale = max(float((ref ** 2).sum()) ** 0.5, 1e-300)
            error = float(((other[key] - ref) ** 2).sum()) ** 0.5 / scale
            assert error <= 1e-9, f"{name}: {key} relative error {error}"


def test_resume_continues_like_an_uninterrupted_run(rollouts, tmp_path):
    common = [f"--rollouts={rollouts}", "--dtype=float64", "--lr=1e-3", "--json"]
    straight = train(*common, "--steps=3")
    assert straight.returncode == 0, straight.stderr
    first = train(*common, "--steps=2", f"--save={tmp_path / 'ckpt'}")
    assert first.returncode == 0, first.stderr
    resumed = subprocess.run([tool("dta-train"), f"--model={tmp_path / 'ckpt' / 'model'}",
                              f"--resume={tmp_path / 'ckpt'}", *common, "--steps=1"], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    expected = json.loads(straight.stdout.splitlines()[-1])["loss"]
    got = json.loads(resumed.stdout.splitlines()[-1])["loss"]
    assert abs(got - expected) <= 1e-12 * abs(expected)


def test_an_lr_schedule_decays_over_the_whole_run_resumed_or_not(rollouts, tmp_path):
    """--lr_schedule=linear --warmup_steps=1: each step's lr is --lr x its factor over the run's
    steps; a run resumed after 2 steps with --steps=2 continues on the same curve (its run is 4
    steps long) and ends with the uninterrupted run's loss."""
    common = [f"--rollouts={rollouts}", "--dtype=float64", "--lr=1e-2", "--json", "--lr_schedule=linear",
              "--warmup_steps=1", "--min_lr_ratio=0.25"]
    straight = train(*common, "--steps=4")
    assert straight.returncode == 0, straight.stderr
    records = [json.loads(line) for line in straight.stdout.splitlines()]
    factors = [1.0, 1.0, 0.25 + 0.75 * (1 - 1 / 3), 0.25 + 0.75 * (1 - 2 / 3)]  # warmup 1, decay to step 4
    assert [r["lr"] for r in records] == pytest.approx([1e-2 * f for f in factors], rel=1e-15)
    first = train(*common, "--steps=2", f"--save={tmp_path / 'ckpt'}", "--decay_steps=4")
    assert first.returncode == 0, first.stderr
    resumed = subprocess.run([tool("dta-train"), f"--model={tmp_path / 'ckpt' / 'model'}",
                              f"--resume={tmp_path / 'ckpt'}", *common, "--steps=2"], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    tail = [json.loads(line) for line in resumed.stdout.splitlines()]
    assert [r["lr"] for r in tail] == [r["lr"] for r in records[2:]]
    assert abs(tail[-1]["loss"] - records[-1]["loss"]) <= 1e-12 * abs(records[-1]["loss"])


@pytest.mark.parametrize("args, message", [
    (["--method=sparse"], "--method must be dta, dense or packed"),
    (["--dtype=float16"], "--dtype must be"),
    (["--loss=dpo"], "--loss must be"),
    (["--steps=0"], "--steps must be >= 1"),
    (["--block_size=-3"], "--block_size must be >= 0"),
    (["--lr_schedule=step"], "--lr_schedule: lr schedule 'step' is not constant, linear or cosine"),
    (["--lr_schedule=cosine", "--warmup_steps=5"], "which must be above --warmup_steps (5); it is 1"),
    (["--min_lr_ratio=2"], "--min_lr_ratio must be in [0, 1]"),
    (["--warmup_steps=-1"], "--warmup_steps must be >= 0"),
    (["--checkpoint_dtype=int8"], "--checkpoint_dtype must be bfloat16, float16, float32, float64 or model"),
    (["--progress=sometimes"], "--progress must be auto, always or never, got 'sometimes'"),
    (["--offload_resident_gb=-1"], "--offload_resident_gb must be auto or a number of GB >= 0, got '-1'"),
    (["--offload_resident_gb=lots"], "--offload_resident_gb must be auto or a number of GB >= 0, got 'lots'"),
    (["--offload_optimizer=true", "--offload_resident_gb=1"],
     "offload_resident_gb: an optimizer offloaded to the host keeps state on a GPU only when it is streamed"),
])
def test_bad_flags_exit_2(rollouts, args, message):
    run = train(f"--rollouts={rollouts}", *args)
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_bad_rollout_file_names_line_and_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "group": "g", "tokens": [1, 2000], "loss_mask": [0, 1], "logprobs": [0, -1]}\n')
    run = train(f"--rollouts={bad}")
    assert run.returncode == 2
    assert f"{bad}:1: rollout 'a': field 'tokens'" in run.stderr, run.stderr


def test_missing_checkpoint_exits_2(tmp_path, rollouts):
    run = subprocess.run([tool("dta-train"), f"--model={tmp_path / 'nothing'}", f"--rollouts={rollouts}"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "nothing: no such file" in run.stderr, run.stderr


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, args: list[str], nodes: int = 1, config: Path = CONFIG) -> list[tuple[str, str]]:
    """dta-train --distributed on `world` local processes (Gloo), as `nodes` torchrun nodes would
    start them (LOCAL_RANK and LOCAL_WORLD_SIZE per node); every rank must succeed."""
    port = free_port()
    per_node = world // nodes
    ranks = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node),
                   LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        ranks.append(subprocess.Popen(
            [tool("dta-train"), f"--config={config}", *args, "--distributed", "--timeout_s=60"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=300) for p in ranks]
    for p, (out, err) in zip(ranks, outputs):
        assert p.returncode == 0, err
    return outputs


def assert_same_tensors(reference_file: Path, other_file: Path, tolerance: float = 1e-10):
    reference = load_file(str(reference_file))
    other = load_file(str(other_file))
    assert reference.keys() == other.keys() and len(reference) > 10
    for key, ref in reference.items():
        scale = max(float((ref ** 2).sum()) ** 0.5, 1e-300)
        error = float(((other[key] - ref) ** 2).sum()) ** 0.5 / scale
        assert error <= tolerance, f"{other_file} {key}: relative error {error}"


LAYOUTS = {
    "replicated": ["--shard_optimizer=false", "--offload_optimizer=false"],
    "sharded": ["--shard_optimizer=true", "--offload_optimizer=false"],
    "sharded_offloaded": ["--shard_optimizer=true", "--offload_optimizer=true"],
    "tp2": ["--tensor_parallel=2", "--shard_optimizer=false", "--offload_optimizer=false"],
    "tp2_sharded_offloaded": ["--tensor_parallel=2", "--shard_optimizer=true", "--offload_optimizer=true"],
    # The split balances a time model (tree tokens and the keys they attend to) instead of tokens.
    "balanced_by_time": ["--balance_per_token=1000", "--balance_per_key=3", "--shard_optimizer=false",
                         "--offload_optimizer=false"],
}


@pytest.mark.parametrize("world, layout, nodes", [(2, "replicated", 1), (3, "replicated", 1), (2, "sharded", 1),
                                                  (3, "sharded", 1), (2, "sharded_offloaded", 1),
                                                  (4, "sharded", 2), (2, "tp2", 1),
                                                  (4, "tp2_sharded_offloaded", 2), (3, "balanced_by_time", 1)])
def test_distributed_ranks_train_what_one_process_trains(rollouts, tmp_path, world, layout, nodes):
    """dta-train --distributed on Gloo: each rank trains its part of the split under the whole
    batch's advantages and normalisers; the summed gradient equals one process's (float64), and so
    do the weights after two clipped optimizer steps, whether AdamW's state is replicated, sharded
    across the ranks (ZeRO-1) or sharded and offloaded; and on two "nodes" (local ranks repeat, one
    rendezvous on loopback), as torchrun --nnodes=2 starts them. With --tensor_parallel=2 each
    replica's weights are split across two ranks (TP 2 x DP 1, and TP 2 x DP 2 on two nodes): the
    same losses, norms and saved weights (gathered: plain Hugging Face tensors). A split balancing a
    time model (--balance_per_token, --balance_per_key) trains the same batch."""
    common = [f"--rollouts={rollouts}", "--dtype=float64", "--init_std=0.2", "--lr=1e-2", "--steps=2",
              "--method=dta", "--block_size=64", "--max_grad_norm=0.05", "--json", "--checkpoint_dtype=model"]
    single = train(*common, f"--dump_grads={tmp_path / 'one.safetensors'}", f"--save={tmp_path / 'one'}")
    assert single.returncode == 0, single.stderr
    dump = [f"--dump_grads={tmp_path / 'many.safetensors'}"] if layout == "replicated" else []
    tensor_parallel = 2 if layout.startswith("tp2") else 1
    outputs = run_ranks(world, [*common, *LAYOUTS[layout], *dump, f"--save={tmp_path / 'many'}"], nodes)
    if world // tensor_parallel > 1:
        assert "DFS-contiguous" in outputs[0][0] and "greedy by tree tokens" in outputs[0][0]
        unit = " cost (" if layout == "balanced_by_time" else " tree tokens ("
        assert unit in outputs[0][0], outputs[0][0]
    sharded = "sharded" in layout
    assert ("optimizer sharded" in outputs[0][1]) == sharded, outputs[0][1]
    assert f"TP {tensor_parallel} x DP {world // tensor_parallel}" in outputs[0][1], outputs[0][1]
    steps = [json.loads(line) for line in outputs[0][0].splitlines() if line.startswith("{")]
    reference_steps = [json.loads(line) for line in single.stdout.splitlines() if line.startswith("{")]
    assert [s["rollout_tokens"] for s in steps] == [s["rollout_tokens"] for s in reference_steps]
    for s, r in zip(steps, reference_steps):
        assert abs(s["loss"] - r["loss"]) <= 1e-10 * max(1.0, abs(r["loss"]))
        assert abs(s["grad_norm"] - r["grad_norm"]) <= 1e-10 * r["grad_norm"]
        assert r["grad_norm"] > 0.05, "the steps must clip"
    assert_same_tensors(tmp_path / "one/model/model.safetensors", tmp_path / "many/model/model.safetensors")
    if dump:
        assert_same_tensors(tmp_path / "one.safetensors", tmp_path / "many.safetensors")
    replicas = world // tensor_parallel
    for t in range(tensor_parallel):
        state = tmp_path / "many" / "optimizer" / (f"tp-{t:02d}-of-{tensor_parallel:02d}" if tensor_parallel > 1 else "")
        shards = sorted(p.name for p in state.glob("optimizer*.safetensors"))
        assert shards == ([f"optimizer-{r:05d}-of-{replicas:05d}.safetensors" for r in range(replicas)]
                          if sharded else ["optimizer.safetensors"])


@pytest.mark.parametrize("world, layout", [(4, "replicated"), (4, "sharded_offloaded"), (4, "tp2_sharded_offloaded")])
def test_expert_parallel_ranks_train_what_one_process_trains(rollouts, tmp_path, world, layout):
    """dta-train --distributed --expert_parallel=2 on a mixture-of-experts model (Gloo, float64):
    every sparse layer's experts spread over two replicas, whose different shares of the split run
    in lockstep (small blocks, so their schedules differ), with the router's load-balancing loss;
    the losses, gradient norms and saved weights after two clipped steps equal one process's, in
    each optimizer layout and with tensor parallelism too; each EP rank's optimizer state is saved
    under experts/, and a resume with another expert-parallel size is refused naming both."""
    common = [f"--rollouts={rollouts}", "--dtype=float64", "--init_std=0.2", "--lr=1e-2", "--steps=2",
              "--method=dta", "--block_size=16", "--max_grad_norm=0.05", "--json", "--checkpoint_dtype=model",
              "--router_aux_loss_coef=0.01"]
    single = train(*common, f"--save={tmp_path / 'one'}", config=MOE_CONFIG)
    assert single.returncode == 0, single.stderr
    outputs = run_ranks(world, [*common, *LAYOUTS[layout], "--expert_parallel=2", f"--save={tmp_path / 'many'}"],
                        config=MOE_CONFIG)
    assert "(experts: EP 2 x EDP " in outputs[0][1], outputs[0][1]
    steps = [json.loads(line) for line in outputs[0][0].splitlines() if line.startswith("{")]
    reference_steps = [json.loads(line) for line in single.stdout.splitlines() if line.startswith("{")]
    assert len(steps) == len(reference_steps) == 2
    for s, r in zip(steps, reference_steps):
        assert abs(s["loss"] - r["loss"]) <= 1e-10 * max(1.0, abs(r["loss"]))
        assert abs(s["router_aux_loss"] - r["router_aux_loss"]) <= 1e-10 * max(1.0, abs(r["router_aux_loss"]))
        assert abs(s["grad_norm"] - r["grad_norm"]) <= 1e-10 * r["grad_norm"]
        assert r["grad_norm"] > 0.05, "the steps must clip"
    assert_same_tensors(tmp_path / "one/model/model.safetensors", tmp_path / "many/model/model.safetensors")
    experts = sorted(p.name for p in (tmp_path / "many" / "optimizer" / "experts").iterdir())
    assert experts == ["ep-00-of-02", "ep-01-of-02"]
    refused = subprocess.run([tool("dta-train"), f"--config={MOE_CONFIG}", f"--rollouts={rollouts}", "--dtype=float64",
                              f"--resume={tmp_path / 'many'}", "--steps=1",
                              *[flag for flag in LAYOUTS[layout] if "tensor_parallel" not in flag]],
                             capture_output=True, text=True)
    assert refused.returncode == 2, refused.stderr
    assert "resumes only with the" in refused.stderr, refused.stderr


def test_expert_parallel_replica_without_rollouts_serves_its_experts(tmp_path):
    """One rollout on two EP replicas: the replica with none still takes part in every step (its
    experts serve the other's tokens), and the steps equal one process's."""
    path = tmp_path / "one.jsonl"
    rng = random.Random(3)
    tokens = [rng.randrange(1024) for _ in range(30)]
    path.write_text(json.dumps({"id": "r0", "group": "g", "tokens": tokens, "loss_mask": [0] + [1] * 29,
                                "logprobs": [-7.0] * 30, "reward": 1.0}) + "\n")
    common = [f"--rollouts={path}", "--dtype=float64", "--init_std=0.2", "--steps=2", "--json", "--loss=sft"]
    single = train(*common, config=MOE_CONFIG)
    assert single.returncode == 0, single.stderr
    outputs = run_ranks(2, [*common, "--expert_parallel=2"], config=MOE_CONFIG)
    got = [json.loads(line)["loss"] for line in outputs[0][0].splitlines() if line.startswith("{")]
    expected = [json.loads(line)["loss"] for line in single.stdout.splitlines() if line.startswith("{")]
    assert len(got) == len(expected) == 2
    for g, e in zip(got, expected):
        assert abs(g - e) <= 1e-10 * abs(e)


def test_expert_parallel_sizes_that_cannot_run_are_refused(rollouts):
    """--expert_parallel must divide the replicas and the experts, and a dense model has none."""
    run = train(f"--rollouts={rollouts}", "--expert_parallel=2")
    assert run.returncode == 2 and "have no experts" in run.stderr, run.stderr
    run = train(f"--rollouts={rollouts}", "--expert_parallel=2", config=MOE_CONFIG)
    assert run.returncode == 2 and "must divide the 8 experts and the data-parallel ranks" in run.stderr, run.stderr
    run = train(f"--rollouts={rollouts}", "--expert_parallel=-1", config=MOE_CONFIG)
    assert run.returncode == 2 and "--expert_parallel must be >= 0" in run.stderr, run.stderr


def test_sharded_state_resumes_on_another_layout(rollouts, tmp_path):
    """Optimizer state saved by 2 ranks, sharded, resumes on one process with offload (which reads
    every rank's slice) and continues like an uninterrupted run; a replicated resume of it is
    refused, naming the flags that resume it."""
    common = [f"--rollouts={rollouts}", "--dtype=float64", "--init_std=0.2", "--lr=1e-2",
              "--method=dta", "--json"]
    straight = train(*common, "--steps=3")
    assert straight.returncode == 0, straight.stderr
    run_ranks(2, [*common, "--steps=2", *LAYOUTS["sharded"], f"--save={tmp_path / 'ckpt'}"])
    resume = [tool("dta-train"), f"--model={tmp_path / 'ckpt' / 'model'}", f"--resume={tmp_path / 'ckpt'}",
              *common, "--steps=1"]
    resumed = subprocess.run([*resume, "--offload_optimizer=true"], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "offloaded" in resumed.stderr
    expected = json.loads(straight.stdout.splitlines()[-1])
    got = json.loads(resumed.stdout.splitlines()[-1])
    assert abs(got["loss"] - expected["loss"]) <= 1e-10 * abs(expected["loss"])
    refused = subprocess.run(resume, capture_output=True, text=True)
    assert refused.returncode == 2
    assert "it holds a sharded optimizer" in refused.stderr, refused.stderr
    assert "--offload_optimizer=true" in refused.stderr


def test_layout_that_cannot_fit_is_refused_naming_the_numbers(rollouts):
    run = train(f"--rollouts={rollouts}", "--gpu_memory_gb=0.001", "--activation_gb=0")
    assert run.returncode == 2 and "cannot be trained on 1 GPU(s)" in run.stderr, run.stderr
    run = train(f"--rollouts={rollouts}", "--shard_optimizer=maybe")
    assert run.returncode == 2
    assert "--shard_optimizer must be auto, true or false, got 'maybe'" in run.stderr


def test_tensor_parallel_sizes_that_cannot_run_are_refused(rollouts, tmp_path):
    """--tensor_parallel must divide the KV heads and fit the ranks, in dta-train and dta-trainer
    alike (the planner refuses it before any process group or dispatcher is contacted)."""
    run = train(f"--rollouts={rollouts}", "--tensor_parallel=2")
    assert run.returncode == 2 and "tensor_parallel" in run.stderr, run.stderr
    run = train(f"--rollouts={rollouts}", "--tensor_parallel=-1")
    assert run.returncode == 2 and "--tensor_parallel must be >= 0" in run.stderr, run.stderr
    trainer = subprocess.run([tool("dta-trainer"), f"--config={CONFIG}", "--tensor_parallel=2",
                              f"--checkpoint_dir={tmp_path / 'ckpt'}"], capture_output=True, text=True)
    assert trainer.returncode == 2, trainer.stderr
    assert "field 'tensor_parallel': 2 is not allowed" in trainer.stderr, trainer.stderr
    assert "dividing the world size (1)" in trainer.stderr, trainer.stderr


def _help_defaults(binary: Path) -> dict[str, str]:
    """Each flag's default as `BINARY --help` prints it: `--name (...); default: VALUE;`."""
    text = subprocess.run([str(binary), "--help"], capture_output=True, text=True).stdout
    return dict(re.findall(r"--(\w+) \(.*?\);\s+default: (.*?);", text, flags=re.S))


def test_executor_flags_default_to_the_python_options():
    """dta-train, dta-trainer and dta-bench take the executor's defaults from dta::ExecutorOptions,
    as dta.ExecutorOptions does: none can drift from the others."""
    from dta import trainer

    python = dataclasses.asdict(trainer.ExecutorOptions())
    expected = {"block_size": str(python["block_size"]), "graph_budget": str(python["graph_budget"]),
                "token_capacity": str(python["token_capacity"]), "pack": str(python["pack"]).lower(),
                "checkpointing": str(python["checkpointing"]).lower(), "order": f'"{python["order"]}"',
                "method": f'"{trainer.DEFAULT_METHOD}"', "memory_budget": str(python["memory_budget"]).rstrip("0").rstrip(".")}
    assert expected["block_size"] == "-1", "the executor's default block size is automatic"
    assert expected["pack"] == "true", "dta packs by default"
    for binary, flags in (("dta-train", expected), ("dta-trainer", expected),
                          ("dta-bench", {k: expected[k] for k in ("token_capacity", "graph_budget")})):
        defaults = _help_defaults(tool(binary))
        for name, value in flags.items():
            assert defaults.get(name) == value, f"{binary} --{name}: {defaults.get(name)} != {value}"
    # dta-layout plans for what dta-train runs by default.
    assert _help_defaults(tool("dta-layout")).get("pack") == "true"


def test_a_dumped_flag_file_replays_the_run(rollouts, tmp_path):
    """--dump_flags writes the run's non-default flags; --flagfile replays them exactly."""
    flags = tmp_path / "run.flags"
    first = train(f"--rollouts={rollouts}", "--dtype=float64", "--lr=1e-3", "--steps=2", "--temperature=0.9",
                  "--rejection_sampling=upper=3", "--loss=decoupled-ppo", "--json", f"--dump_flags={flags}")
    assert first.returncode == 0, first.stderr
    lines = flags.read_text().splitlines()
    assert lines == sorted(lines)
    for line in [f"--config={CONFIG}", f"--rollouts={rollouts}", "--dtype=float64", "--lr=0.001", "--steps=2",
                 "--temperature=0.9", "--rejection_sampling=upper=3", "--loss=decoupled-ppo", "--json=true"]:
        assert line in lines, (line, lines)
    assert not any(line.startswith(("--dump_flags", "--method=", "--block_size")) for line in lines), lines
    replayed = subprocess.run([tool("dta-train"), f"--flagfile={flags}"], capture_output=True, text=True)
    assert replayed.returncode == 0, replayed.stderr
    first_steps = [json.loads(line) for line in first.stdout.splitlines() if line.startswith("{")]
    replayed_steps = [json.loads(line) for line in replayed.stdout.splitlines() if line.startswith("{")]
    assert len(first_steps) == 2
    for a, b in zip(first_steps, replayed_steps):
        assert (a["loss"], a["grad_norm"], a["rejected_fraction"]) == (b["loss"], b["grad_norm"], b["rejected_fraction"])
    # A later flag overrides the file's.
    other = subprocess.run([tool("dta-train"), f"--flagfile={flags}", "--steps=1"], capture_output=True, text=True)
    assert other.returncode == 0 and len([l for l in other.stdout.splitlines() if l.startswith("{")]) == 1
    unwritable = train(f"--rollouts={rollouts}", f"--dump_flags={tmp_path / 'missing' / 'run.flags'}")
    assert unwritable.returncode == 2 and "--dump_flags: cannot write" in unwritable.stderr


def test_objective_flags_are_checked(rollouts):
    for flag, message in [("--advantage_std_level=token", "--advantage_std_level: an advantage level is group, "
                           "batch or none, got 'token'"),
                          ("--reward_clip=0", "--reward_clip must be positive"),
                          ("--temperature=0", "--temperature must be positive and finite"),
                          ("--memory_budget=-1", "--memory_budget must be >= 0 GiB"),
                          ("--memory_budget=nan", "--memory_budget must be >= 0 GiB"),
                          ("--rejection_sampling=cap=3", "--rejection_sampling: unknown key 'cap'")]:
        run = train(f"--rollouts={rollouts}", flag)
        assert run.returncode == 2 and message in run.stderr, (flag, run.stderr)
    # Batch-level advantages with reward shaping train (and differ from the default's).
    default = train(f"--rollouts={rollouts}", "--dtype=float64", "--json")
    shaped = train(f"--rollouts={rollouts}", "--dtype=float64", "--json", "--advantage_mean_level=batch",
                   "--advantage_std_level=batch", "--reward_scaling=2", "--reward_bias=-0.5")
    assert default.returncode == 0 and shaped.returncode == 0, shaped.stderr
    assert json.loads(default.stdout.splitlines()[-1])["loss"] != json.loads(shaped.stdout.splitlines()[-1])["loss"]


def test_a_nonfinite_gradient_stops_the_run_or_skips_the_step(rollouts, tmp_path):
    """A learning rate of 1e30 blows the float32 weights up after the first step, so the second
    step's gradients are NaN: by default the run stops naming a parameter; with
    --nonfinite_gradients=skip every later step is skipped (nothing updated) and the run ends."""
    common = [f"--rollouts={rollouts}", "--dtype=float32", "--lr=1e30", "--steps=3", "--json"]
    stopped = train(*common)
    assert stopped.returncode != 0 and "is not finite" in stopped.stderr, stopped.stderr
    skipped = train(*common, "--nonfinite_gradients=skip", f"--save={tmp_path / 'ckpt'}")
    assert skipped.returncode == 0, skipped.stderr
    records = [json.loads(line) for line in skipped.stdout.splitlines() if line.startswith("{")]
    assert [r["skipped"] for r in records] == [False, True, True]
    assert records[1]["grad_norm"] is None  # NaN: JSON has no NaN
    assert re.search(r"step 2: the gradient norm is -?nan: step skipped, nothing updated", skipped.stderr), skipped.stderr
    import numpy as np
    state = load_file(str(tmp_path / "ckpt" / "optimizer" / "optimizer.safetensors"))
    assert state and all(np.isfinite(t).all() for t in state.values())  # a skipped step writes no NaN
    bad = train(f"--rollouts={rollouts}", "--nonfinite_gradients=ignore")
    assert bad.returncode == 2 and "--nonfinite_gradients must be raise or skip" in bad.stderr, bad.stderr


def test_tensorboard_event_files_hold_every_steps_numbers(rollouts, tmp_path):
    """--tensorboard_dir: one event per step with the JSON line's numbers (RL diagnostics included),
    read back with tensorboardX's protos and CRC; an unusable directory is refused naming the flag."""
    from event_files import read_scalars

    board = tmp_path / "board"
    run = train(f"--rollouts={rollouts}", "--dtype=float64", "--lr=1e-3", "--steps=3", "--loss=decoupled-ppo",
                "--json", f"--tensorboard_dir={board}")
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    scalars = read_scalars(board)
    assert sorted(scalars) == [1, 2, 3]
    for record in records:
        written = scalars[record["step"]]
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        assert "approx_kl" in numbers and "behave_imp_weight" in numbers
        assert set(written) == set(numbers), set(written) ^ set(numbers)
        for key, value in numbers.items():  # float32 in the file
            assert written[key] == pytest.approx(float(value), rel=1e-6, abs=1e-30), key  # bools as 0 and 1
    (tmp_path / "file").write_text("x")
    refused = train(f"--rollouts={rollouts}", "--steps=1", f"--tensorboard_dir={tmp_path / 'file' / 'sub'}")
    assert refused.returncode == 2 and "--tensorboard_dir" in refused.stderr, refused.stderr


def test_the_router_aux_loss_is_reported_where_the_loss_is(rollouts, tmp_path):
    """A mixture-of-experts run with --router_aux_loss_coef reports the mean load-balancing loss its
    loss includes (the difference from the same run without it is coef times that mean) in --json,
    --metrics and the table; null without the coefficient."""
    config = json.loads(CONFIG.read_text())
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True)
    moe = tmp_path / "moe.json"
    moe.write_text(json.dumps(config))
    coef = 0.25
    common = [tool("dta-train"), f"--config={moe}", f"--rollouts={rollouts}", "--dtype=float64", "--init_std=0.2"]
    runs = {}
    for c in (0.0, coef):
        metrics = tmp_path / f"metrics-{c}.jsonl"
        run = subprocess.run([*common, f"--router_aux_loss_coef={c}", "--json", f"--metrics={metrics}"],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        record = json.loads(run.stdout.splitlines()[-1])
        assert json.loads(metrics.read_text().splitlines()[-1])["router_aux_loss"] == record["router_aux_loss"]
        runs[c] = record
    assert runs[0.0]["router_aux_loss"] is None
    aux = runs[coef]["router_aux_loss"]
    assert aux > 0
    assert runs[coef]["loss"] - runs[0.0]["loss"] == pytest.approx(coef * aux, rel=1e-9)
    table = subprocess.run([*common, f"--router_aux_loss_coef={coef}"], capture_output=True, text=True)
    assert table.returncode == 0, table.stderr
    header, row = [line for line in table.stdout.splitlines() if line.strip()][-2:]
    assert header.split()[-2:] == ["router", "aux"]
    assert float(row.split()[-1]) == pytest.approx(aux, rel=1e-6)

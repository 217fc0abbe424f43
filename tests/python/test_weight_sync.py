"""dta-trainer's weight sync over c10d (--weight_sync=xccl, apps/engines/weight_sync.h), on the CPU.

The dispatcher, a few batches of rollouts and dta-trainer (a tiny float32 Qwen3), with fake engines
(fake_weight_engine.py: SGLang's and AReaL's vLLM server's HTTP routes, each joining the trainer's
group with torch.distributed over Gloo as those servers do). Healthy: after every committed step
each engine receives every tensor of that step's published checkpoint once, bit for bit, in the
same order everywhere, in buckets packed as documented, between a pause and a continue; the
engines hold ranks 1 and 2 of one group that lives across steps. Faults: an engine that dies in an
update, or never answers one, makes the trainer fall back within the timeout to a checkpoint that
the live engines reload from disk (then continue), and training goes on: no step is lost.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

import dta
from test_client import make, free_port, tool

HERE = Path(__file__).resolve().parent
BUCKET_MB = 0.01  # 10485 bytes: the tiny model's tensors (1 to 8 KiB in bf16) fill several buckets
TIMEOUT_S = 5


@pytest.fixture(scope="module")
def source_model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("source")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=256, tie_word_embeddings=False, rope_theta=10000.0)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


class FakeEngine:
    def __init__(self, kind: str, out: Path, fault: str = "") -> None:
        self.kind, self.out = kind, out
        self.log = open(out.with_suffix(".log"), "w")
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "fake_weight_engine.py"), f"--kind={kind}", f"--out={out}",
             f"--fault={fault}", "--timeout_s=8"], stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 120
        while not (out / "url").exists():
            assert self.process.poll() is None, (out.with_suffix(".log")).read_text()
            assert time.monotonic() < deadline, "the fake engine did not start"
            time.sleep(0.1)
        self.url = (out / "url").read_text()

    def events(self) -> list[dict]:
        path = self.out / "events.json"
        return json.loads(path.read_text()) if path.exists() else []

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.log.close()


def train(source_model: Path, directory: Path, engines: list[FakeEngine], steps: int,
          save_every: int, world: int = 1, flags: tuple[str, ...] = (),
          model_flag: str = "") -> subprocess.CompletedProcess:
    """dta-trainer on `world` local ranks (Gloo, as torchrun starts them when world > 1); every rank
    must exit; returns rank 0's run."""
    wal = directory / "dispatcher.wal"
    address = f"127.0.0.1:{free_port()}"
    dispatcher_log = open(directory / "dispatcher.log", "w")
    dispatcher = subprocess.Popen([tool("dta-dispatcher"), f"--wal={wal}", f"--listen={address}",
                                   "--batch_rollouts=4", "--vocab_size=100"],
                                  stdout=dispatcher_log, stderr=dispatcher_log)
    try:
        with dta.RolloutClient(address, call_timeout=10, retry_for=30) as client:
            for i in range(4 * steps):
                client.send(make(i))
        spec = ",".join(f"{e.kind}={e.url}" for e in engines)
        command = [tool("dta-trainer"), f"--dispatcher={address}", f"--token_file={wal}.trainer-token",
                   f"--checkpoint_dir={directory / 'ckpt'}", model_flag or f"--model={source_model}",
                   "--dtype=float32", "--loss=sft", "--lr=1e-2", f"--max_steps={steps}",
                   "--keep_checkpoints=100", f"--save_every={save_every}", "--wait_s=60",
                   "--weight_sync=xccl", f"--weight_sync_engines={spec}",
                   f"--weight_sync_timeout_s={TIMEOUT_S}", f"--weight_sync_bucket_mb={BUCKET_MB}", *flags]
        if world == 1:
            result = subprocess.run(command, capture_output=True, text=True, timeout=600)
            (directory / "trainer.log").write_text(result.stderr)
            return result
        port = free_port()
        ranks = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                           LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=str(port)))
                 for r in range(world)]
        outputs = [p.communicate(timeout=600) for p in ranks]
        for r, (p, (_, err)) in enumerate(zip(ranks, outputs)):
            (directory / f"trainer{r}.log").write_text(err)
            assert p.returncode == 0, f"rank {r}: {err}"
        return subprocess.CompletedProcess(command, ranks[0].returncode, outputs[0][0], outputs[0][1])
    finally:
        dispatcher.terminate()
        dispatcher.wait(timeout=30)
        dispatcher_log.close()


def syncs(events: list[dict]) -> list[list[dict]]:
    """The events from each pause to its continue."""
    out, current = [], None
    for event in events:
        if event["route"] == "pause":
            current = []
        if current is not None:
            current.append(event)
        if event["route"] == "continue" and current is not None:
            out.append(current)
            current = None
    return out


def checkpoint_model(directory: Path, step: int) -> Path:
    return directory / "ckpt" / f"step-{step:08d}" / "model"


STEPS = 3


@pytest.fixture(scope="module")
def healthy(source_model, tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("healthy")
    engines = [FakeEngine("sglang", directory / "sglang"), FakeEngine("areal-vllm", directory / "areal")]
    try:
        result = train(source_model, directory, engines, STEPS, save_every=1)
    finally:
        for engine in engines:
            engine.close()
    assert result.returncode == 0, result.stderr
    return {"dir": directory, "engines": engines, "log": result.stderr}


def test_every_step_reaches_every_engine_bit_for_bit(healthy):
    for engine in healthy["engines"]:
        for step in range(1, STEPS + 1):
            received = load_file(engine.out / f"sync-{step}.safetensors")
            published = load_file(checkpoint_model(healthy["dir"], step) / "model.safetensors")
            assert set(received) == set(published), (engine.kind, step)
            for name, tensor in published.items():
                assert received[name].dtype == torch.bfloat16
                assert torch.equal(received[name], tensor), (engine.kind, step, name)
        assert not (engine.out / f"sync-{STEPS + 1}.safetensors").exists()
    assert healthy["log"].count("weights of policy version") == STEPS, healthy["log"]


def test_the_group_and_the_requests_are_as_sglang_and_areal_document(healthy):
    sglang, areal = healthy["engines"]
    inits = [[e for e in engine.events() if e["route"] == "init"] for engine in (sglang, areal)]
    assert [len(i) for i in inits] == [1, 1], "one group for every step"
    for init, rank in zip(inits, (1, 2)):
        body = init[0]["body"]
        assert set(body) == {"master_address", "master_port", "rank_offset", "world_size", "backend",
                             "group_name"}
        assert body["rank_offset"] == rank and body["world_size"] == 3 and body["backend"] == "gloo"
        assert isinstance(body["master_port"], str) and body["group_name"].startswith("dta-weights-")
    assert inits[0][0]["body"]["group_name"] == inits[1][0]["body"]["group_name"]
    for engine in (sglang, areal):
        assert not [e for e in engine.events() if e["route"] in ("reload", "error")]
    # At exit the trainer destroys the group (SGLang has the route; AReaL's server has none).
    destroyed = [e for e in sglang.events() if e["route"] == "destroy"]
    assert destroyed == [sglang.events()[-1]]
    assert destroyed[0]["body"] == {"group_name": inits[0][0]["body"]["group_name"]}
    # A clean exit leaves no group for a successor to destroy.
    assert not (healthy["dir"] / "ckpt" / "weight_sync.json").exists()


def test_buckets_are_packed_in_order_between_pause_and_continue(healthy):
    limit = int(BUCKET_MB * (1 << 20))
    sglang, areal = healthy["engines"]
    orders = []
    for engine in (sglang, areal):
        per_sync = syncs(engine.events())
        assert len(per_sync) == STEPS, engine.kind
        for version, events in enumerate(per_sync, start=1):
            routes = [e["route"] for e in events]
            assert routes[0] == "pause" and routes[-1] == "continue"
            updates = [e["body"] for e in events if e["route"] == "update"]
            assert len(updates) > 2, "several buckets"
            assert routes[1:-1] == (["update", "updated"] if engine.kind == "sglang"
                                    else ["meta", "update", "updated"]) * len(updates)
            names = [n for u in updates for n in u["names"]]
            assert len(names) == len(set(names))
            orders.append(names)
            sizes = [[2 * torch.Size(s).numel() for s in u["shapes"]] for u in updates]
            for i, bucket in enumerate(sizes):
                assert sum(bucket) <= limit or len(bucket) == 1, bucket
                if i + 1 < len(sizes):
                    assert sum(bucket) + sizes[i + 1][0] > limit, "a bucket could have held more"
            for u in updates:
                assert set(u["dtypes"]) == {"bfloat16"}
            if engine.kind == "sglang":
                assert [u.get("weight_version") for u in updates] == [None] * (len(updates) - 1) + [str(version)]
                assert [u["flush_cache"] for u in updates] == [False] * (len(updates) - 1) + [True]
            else:
                assert all(set(u) == {"names", "dtypes", "shapes", "group_name"} for u in updates)
    assert all(order == orders[0] for order in orders), "one order, every engine, every step"
    assert [e["body"] for e in sglang.events() if e["route"] == "pause"] == [{"mode": "retract"}] * STEPS


@pytest.mark.parametrize("fault", ["die", "hang"])
def test_a_failed_engine_costs_a_disk_reload_and_no_step(source_model, tmp_path, fault):
    steps = 4
    engines = [FakeEngine("sglang", tmp_path / "healthy"),
               FakeEngine("areal-vllm" if fault == "die" else "sglang", tmp_path / "faulty",
                          fault=f"{fault}:2")]
    try:
        start = time.monotonic()
        result = train(source_model, tmp_path, engines, steps, save_every=100)
        elapsed = time.monotonic() - start
    finally:
        for engine in engines:
            engine.close()
    assert result.returncode == 0, result.stderr
    log = result.stderr
    # Step 1 synced; steps 2 to 4 failed (the engine died or hangs) and fell back to their
    # checkpoints, each within a few timeouts.
    assert log.count("weights of policy version") == 1, log
    assert log.count("weight sync of policy version") == steps - 1, log
    assert elapsed < 60 + steps * 4 * TIMEOUT_S, elapsed
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))
    assert saved == [f"step-{n:08d}" for n in range(2, steps + 1)], saved
    healthy = engines[0]
    first = load_file(healthy.out / "sync-1.safetensors")
    assert first.keys() == load_file(next((tmp_path / "ckpt").glob("step-*/model")) / "model.safetensors").keys()
    reloads = [e["body"]["model_path"] for e in healthy.events() if e["route"] == "reload"]
    assert reloads == [str(checkpoint_model(tmp_path, n)) for n in range(2, steps + 1)], reloads
    # Each reload is followed by a continue (the engine was paused for the failed sync).
    events = [e["route"] for e in healthy.events()]
    for i, route in enumerate(events):
        if route == "reload":
            assert "continue" in events[i + 1:], events
    assert events[-1] == "continue" or "continue" in events[events.index("reload"):], events


def test_bad_weight_sync_flags_are_refused_before_training(tmp_path):
    for flags, message in [(["--weight_sync=nccl"], "--weight_sync must be disk or xccl"),
                           (["--weight_sync=xccl"], "needs --weight_sync_engines"),
                           (["--weight_sync_engines=vllm=http://x:1"], "cannot join a c10d group"),
                           (["--weight_sync_engines=sglang=http://x:1*0"], "worker count"),
                           (["--weight_sync_bucket_mb=0"], "--weight_sync_bucket_mb"),
                           (["--weight_sync_every=0"], "--weight_sync_every must be >= 1")]:
        result = subprocess.run([tool("dta-trainer"), "--config=qwen3-0.6b", f"--checkpoint_dir={tmp_path}",
                                 "--dispatcher=127.0.0.1:1", "--wait_s=1", *flags],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert message in result.stderr, result.stderr


MOE_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 128,
              "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": 256, "tie_word_embeddings": False, "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True,
              "torch_dtype": "float32"}


def sent_names(engine: FakeEngine) -> list[list[str]]:
    """Per sync, the tensors' names in the order the updates announced them."""
    return [[n for e in events if e["route"] == "update" for n in e["body"]["names"]]
            for events in syncs(engine.events())]


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_parallel_ranks_gather_the_checkpoints_tensors_for_rank_0(source_model, healthy, tmp_path, layout):
    """Two ranks (Gloo) split the model; rank 0 sends what the checkpoint export gathers, the other
    rank only takes part in the gathers, and each engine receives every tensor once, bit for bit the
    step's published checkpoint, in the order one rank sends."""
    if layout == "tp2":
        flags, model_flag = ("--tensor_parallel=2", "--timeout_s=60"), ""
    else:  # two replicas, each holding half of the experts
        config = tmp_path / "moe.json"
        config.write_text(json.dumps(MOE_CONFIG))
        flags, model_flag = ("--expert_parallel=2", "--timeout_s=60"), f"--config={config}"
    engines = [FakeEngine("sglang", tmp_path / "sglang"), FakeEngine("areal-vllm", tmp_path / "areal")]
    try:
        result = train(source_model, tmp_path, engines, STEPS, save_every=1, world=2, flags=flags,
                       model_flag=model_flag)
    finally:
        for engine in engines:
            engine.close()
    assert result.stderr.count("weights of policy version") == STEPS, result.stderr
    peer = (tmp_path / "trainer1.log").read_text()
    assert "weight group" not in peer and "weights of policy version" not in peer, peer
    single = sent_names(healthy["engines"][0])[0]
    orders = []
    for engine in engines:
        assert not [e for e in engine.events() if e["route"] in ("reload", "error")], engine.kind
        names = sent_names(engine)
        assert len(names) == STEPS, engine.kind
        for step in range(1, STEPS + 1):
            received = load_file(engine.out / f"sync-{step}.safetensors")
            published = load_file(checkpoint_model(tmp_path, step) / "model.safetensors")
            assert sorted(names[step - 1]) == sorted(published), (engine.kind, step)
            assert len(names[step - 1]) == len(set(names[step - 1]))
            for name, tensor in published.items():
                assert torch.equal(received[name], tensor), (engine.kind, step, name)
        orders += names
    assert all(order == orders[0] for order in orders)
    if layout == "tp2":  # the same model as the one-rank run: the same order
        assert orders[0] == single
    else:  # the layer spec's (SaveHfModel's), each stacked projection as its experts, ascending
        layers = [[f"model.layers.{l}.{n}.weight" for n in (
            "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
            "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm",
            *(f"mlp.experts.{e}.{p}_proj" for p in ("gate", "up", "down") for e in range(4)), "mlp.gate")]
            for l in range(2)]
        assert orders[0] == ["model.embed_tokens.weight", *layers[0], *layers[1], "model.norm.weight",
                             "lm_head.weight"]


def test_a_failed_sync_under_tensor_parallelism_falls_back_and_training_goes_on(source_model, tmp_path):
    """Rank 0's sync fails (the engine dies in the second one): its TP peer gathers along, nobody
    hangs, the step's checkpoint goes to the live engine from disk, and every step trains."""
    steps = 3
    engines = [FakeEngine("sglang", tmp_path / "healthy"), FakeEngine("sglang", tmp_path / "faulty", fault="die:2")]
    try:
        result = train(source_model, tmp_path, engines, steps, save_every=100, world=2,
                       flags=("--tensor_parallel=2", "--timeout_s=60"))  # a lost gather fails fast
    finally:
        for engine in engines:
            engine.close()
    log = result.stderr
    assert log.count("weights of policy version") == 1, log
    assert log.count("weight sync of policy version") == steps - 1, log
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))
    assert saved == [f"step-{n:08d}" for n in range(2, steps + 1)], saved
    reloads = [e["body"]["model_path"] for e in engines[0].events() if e["route"] == "reload"]
    assert reloads == [str(checkpoint_model(tmp_path, n)) for n in range(2, steps + 1)], reloads


def test_weight_sync_every_sends_only_the_versions_it_names(source_model, tmp_path):
    """--weight_sync_every=2: the engines get the policy versions that are multiples of 2, over the
    group (xccl) and as a disk reload (--notify_engines), and no other."""
    steps = 4
    synced, notified = FakeEngine("sglang", tmp_path / "synced"), FakeEngine("sglang", tmp_path / "notified")
    try:
        result = train(source_model, tmp_path, [synced], steps, save_every=1,
                       flags=("--weight_sync_every=2", f"--notify_engines=sglang={notified.url}"))
    finally:
        synced.close()
        notified.close()
    assert result.returncode == 0, result.stderr
    versions = {json.loads((checkpoint_model(tmp_path, n).parent / "trainer.json").read_text())["policy_version"]: n
                for n in range(1, steps + 1)}
    assert len(versions) == steps
    chosen = sorted(v for v in versions if v % 2 == 0)
    assert len(chosen) == 2, versions
    sent = [u["body"].get("weight_version") for events in syncs(synced.events()) for u in events
            if u["route"] == "update" and "weight_version" in u["body"]]
    assert sent == [str(v) for v in chosen], (sent, versions)
    for i, version in enumerate(chosen, start=1):
        received = load_file(synced.out / f"sync-{i}.safetensors")
        published = load_file(checkpoint_model(tmp_path, versions[version]) / "model.safetensors")
        assert received.keys() == published.keys()
        assert all(torch.equal(received[n], t) for n, t in published.items())
    assert not (synced.out / f"sync-{len(chosen) + 1}.safetensors").exists()
    reloads = [e["body"]["model_path"] for e in notified.events() if e["route"] == "reload"]
    assert reloads == [str(checkpoint_model(tmp_path, versions[v])) for v in chosen], reloads


def test_a_parallel_sync_must_fit_in_the_training_timeout(source_model, tmp_path):
    """Rank 0's TP peers wait in the gathers while it talks to the engines: --timeout_s must leave
    room for 4 engine timeouts, checked before anything starts."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for timeout_s, refused in [(119, True), (120, False)]:
        result = subprocess.run(
            [tool("dta-trainer"), f"--model={source_model}", f"--checkpoint_dir={tmp_path}",
             "--dispatcher=127.0.0.1:1", "--wait_s=1", "--tensor_parallel=2", "--weight_sync=xccl",
             "--weight_sync_engines=sglang=http://127.0.0.1:1", f"--timeout_s={timeout_s}",
             "--weight_sync_timeout_s=30"], env=env, capture_output=True, text=True, timeout=120)
        assert ("needs --timeout_s >= 4 x --weight_sync_timeout_s" in result.stderr) == refused, result.stderr
        assert result.returncode != 0  # without the refusal: no dispatcher to register with


def test_a_restarted_trainer_destroys_the_group_a_crashed_one_left(source_model, tmp_path):
    """A trainer killed mid-run leaves its group in the engines and its name in
    <checkpoint_dir>/weight_sync.json; its successor has SGLang destroy that group before forming
    its own. The file is planted here as a kill -9 leaves it (mode 0600); a file others could have
    written is ignored."""
    (tmp_path / "ckpt").mkdir(mode=0o755)
    left = tmp_path / "ckpt" / "weight_sync.json"

    def train_over(group_name: str, mode: int, engine_dir: str, steps: int):
        """Trains `steps` steps over a left file naming `group_name`; the engine's events."""
        left.write_text(json.dumps({"group_name": group_name}) + "\n")
        left.chmod(mode)
        engine = FakeEngine("sglang", tmp_path / engine_dir)
        try:
            result = train(source_model, tmp_path, [engine], steps=steps, save_every=1)
        finally:
            engine.close()
        assert result.returncode == 0, result.stderr
        return result, engine.events()

    result, events = train_over("dta-weights-left-by-a-crash", 0o600, "sglang", steps=1)
    routes = [(e["route"], e.get("body", {}).get("group_name")) for e in events]
    assert routes[0] == ("destroy", "dta-weights-left-by-a-crash"), routes
    assert routes[1][0] == "init" and routes[1][1].startswith("dta-weights-"), routes
    assert "left by a trainer that did not tear it down" in result.stderr
    assert not left.exists()

    # Open to others: not trusted, not read.
    result, events = train_over("dta-weights-planted", 0o644, "sglang-2", steps=2)
    assert "dta-weights-planted" not in [e.get("body", {}).get("group_name") for e in events]
    assert f"ignoring {left}" in result.stderr

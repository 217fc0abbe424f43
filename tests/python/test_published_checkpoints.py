"""Published checkpoints, as rollout engines see them.

dta-trainer trains a transformers-made Qwen3 (with a tokenizer and a generation config) from a
dispatcher for a few steps, publishing a checkpoint after each. Every published ``model/`` directory
must be exactly what SGLang and vLLM load: the weights (bf16) with their index, config.json,
generation_config.json and the source's tokenizer files, and nothing else; transformers loads it
(weights, tokenizer) and computes the log-probabilities dta computes from it; its weights are the
trained ones (the optimizer's master weights, rounded to bf16). Local HTTP servers stand in for the
engines and check each documented reload request (SGLang's /update_weights_from_disk, vLLM's
/collective_rpc reload_weights, AReaL's /areal_update_weights), including the bearer token, a
retried failure and an engine that never answers. The rollout-worker example, given a real
transformers policy, reloads each published checkpoint into it.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast, Qwen3Config,
                          Qwen3ForCausalLM)

import dta
from test_client import REPO, VOCAB, free_port, make, tool

MODEL_VOCAB = 128  # above the dispatcher's --vocab_size (VOCAB)
STEPS = 3
TOKEN = "engine-secret-7"
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json"}


@pytest.fixture(scope="module")
def source_model(tmp_path_factory) -> Path:
    """A tiny Qwen3 as a Hub directory ships it: weights, config, generation config, tokenizer."""
    directory = tmp_path_factory.mktemp("source")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=MODEL_VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False, rope_theta=10000.0)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], do_sample=True, temperature=0.7,
                     top_p=0.9).save_pretrained(directory)
    from tokenizers import Tokenizer, models, pre_tokenizers
    word_level = Tokenizer(models.WordLevel({f"t{i}": i for i in range(MODEL_VOCAB)}, unk_token="t0"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(directory)
    (directory / "README.md").write_text("a model card: not for the engines\n")
    return directory


class Engine:
    """An HTTP server standing in for a rollout engine: records every request (and whether the
    checkpoint it names was complete when it arrived), answers with `answers` in turn (then 200)."""

    def __init__(self, answers: list[tuple[int, dict]] | None = None) -> None:
        self.requests: list[dict] = []
        self.answers = list(answers or [])
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length))
                path = Path(body.get("model_path") or body.get("kwargs", {}).get("weights_path", ""))
                engine.requests.append({"path": self.path, "headers": dict(self.headers), "body": body,
                                        "complete": (path / "config.json").is_file()
                                        and (path / "model.safetensors.index.json").is_file()})
                status, answer = engine.answers.pop(0) if engine.answers else (200, {"success": True})
                payload = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def run(source_model, tmp_path_factory) -> dict:
    """Dispatcher, STEPS batches of rollouts and dta-trainer with three engines to notify (SGLang
    refuses once, then accepts) and one that is not there."""
    directory = tmp_path_factory.mktemp("run")
    wal = directory / "dispatcher.wal"
    address = f"127.0.0.1:{free_port()}"
    dispatcher_log = open(directory / "dispatcher.log", "w")
    dispatcher = subprocess.Popen([tool("dta-dispatcher"), f"--wal={wal}", f"--listen={address}",
                                   "--batch_rollouts=4", f"--vocab_size={VOCAB}"],
                                  stdout=dispatcher_log, stderr=dispatcher_log)
    engines = {"sglang": Engine([(400, {"success": False, "message": "busy"})]), "vllm": Engine(),
               "areal-vllm": Engine()}
    try:
        with dta.RolloutClient(address, call_timeout=10, retry_for=30) as client:
            for i in range(4 * STEPS):
                client.send(make(i))
        (directory / "engine.token").write_text(TOKEN + "\n")
        (directory / "engine.token").chmod(0o600)  # a credential: the user's own, closed to others
        absent = f"http://127.0.0.1:{free_port()}"
        notify = ",".join([f"sglang={engines['sglang'].url}", f"vllm={engines['vllm'].url}/",
                           f"areal-vllm={engines['areal-vllm'].url}", f"sglang={absent}"])
        trainer = subprocess.run(
            [tool("dta-trainer"), f"--dispatcher={address}", f"--token_file={wal}.trainer-token",
             f"--checkpoint_dir={directory / 'ckpt'}", f"--model={source_model}", "--dtype=float32",
             "--loss=sft", "--lr=1e-2", f"--max_steps={STEPS}", f"--keep_checkpoints={STEPS}",
             f"--notify_engines={notify}", f"--notify_token_file={directory / 'engine.token'}",
             # Steps slower than the 1 s between attempts, so that retries happen while training:
             # once the trainer exits, an engine gets at most one more attempt (the newest).
             "--notify_attempts=2", "--notify_timeout_s=5", "--wait_s=60", "--slow_step_ms=1500"],
            capture_output=True, text=True, timeout=300)
    finally:
        dispatcher.terminate()
        dispatcher.wait(timeout=30)
        dispatcher_log.close()
        for engine in engines.values():
            engine.close()
    assert trainer.returncode == 0, trainer.stderr
    return {"ckpt": directory / "ckpt", "engines": engines, "log": trainer.stderr}


def published(run) -> list[Path]:
    steps = sorted(run["ckpt"].glob("step-*"))
    assert [p.name for p in steps] == [f"step-{n:08d}" for n in range(1, STEPS + 1)]
    return [p / "model" for p in steps]


def test_a_published_model_holds_what_the_engines_load_and_nothing_else(run, source_model):
    tokenizer_files = {p.name for p in source_model.iterdir()} & TOKENIZER_FILES
    assert {"tokenizer.json", "tokenizer_config.json"} <= tokenizer_files
    for model in published(run):
        assert {p.name for p in model.parent.iterdir()} == {"model", "optimizer", "trainer.json"}
        assert {p.name for p in model.iterdir()} == {
            "config.json", "generation_config.json", "model.safetensors",
            "model.safetensors.index.json"} | tokenizer_files, model
        index = json.loads((model / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == {"model.safetensors"}
        assert set(index["weight_map"]) == set(load_file(model / "model.safetensors"))
        config = json.loads((model / "config.json").read_text())
        assert config["torch_dtype"] == "bfloat16"
        assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # kept from the source
        assert (model / "generation_config.json").read_text() == \
            (source_model / "generation_config.json").read_text()
        for name in tokenizer_files:
            assert (model / name).read_bytes() == (source_model / name).read_bytes(), name
    latest = json.loads((run["ckpt"] / "latest.json").read_text())
    assert latest["step"] == STEPS and latest["model_path"] == str(published(run)[-1])


def test_transformers_loads_every_published_model_and_agrees_with_dta(run):
    rollouts = [make(i) for i in range(5)]
    for model_dir in published(run):
        loaded, info = Qwen3ForCausalLM.from_pretrained(model_dir, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert loaded.dtype == torch.bfloat16
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        assert tokenizer("t5 t7 t99")["input_ids"] == [5, 7, 99]
        assert tokenizer.eos_token == "t2"
        reference = loaded.float().eval()
        ours = dta.Trainer(model_dir, dtype="float32").compute_logprobs(rollouts)
        for rollout, got in zip(rollouts, ours):
            with torch.no_grad():
                logits = reference(torch.tensor([rollout.tokens])).logits[0]
            want = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(rollout.tokens[1:])[:, None])[:, 0]
            assert torch.allclose(torch.as_tensor(got)[1:], want, atol=1e-5, rtol=0), model_dir


def test_the_published_weights_are_the_trained_ones(run, source_model):
    source = load_file(source_model / "model.safetensors")
    previous = None
    for model_dir in published(run):
        weights = load_file(model_dir / "model.safetensors")
        master = load_file(model_dir.parent / "optimizer" / "optimizer.safetensors")
        assert set(weights) == set(source)
        for name, tensor in weights.items():
            assert tensor.dtype == torch.bfloat16
            # float32 parameters are their own master weights: the optimizer's copy, rounded.
            assert torch.equal(tensor, master[f"{name}.master"].to(torch.bfloat16)), name
        moved = sum((weights[n].float() - source[n].to(torch.bfloat16).float()).abs().sum() for n in weights)
        assert moved > 0, "training moved the weights"
        if previous is not None:
            assert any(not torch.equal(weights[n], previous[n]) for n in weights), "each step moves them"
        previous = weights


def test_every_engine_is_asked_to_reload_the_newest_checkpoint_as_documented(run):
    newest = str(published(run)[-1])
    expected = {
        "sglang": ("/update_weights_from_disk", {"model_path": newest, "weight_version": str(STEPS)}),
        "vllm": ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": newest}}),
        "areal-vllm": ("/areal_update_weights", {"model_path": newest}),
    }
    for kind, engine in run["engines"].items():
        assert engine.requests, kind
        for request in engine.requests:
            assert request["headers"]["Content-Type"] == "application/json", kind
            assert request["headers"]["Authorization"] == f"Bearer {TOKEN}", kind
            assert request["complete"], f"{kind} was told of a checkpoint before it was in place"
            path, body = expected[kind]
            assert request["path"] == path, kind
            assert set(request["body"]) == set(body), kind
        assert engine.requests[-1]["body"] == expected[kind][1], kind
        # Checkpoints are announced in order (later ones may be coalesced, never reordered).
        steps = [json.dumps(r["body"]) for r in engine.requests]
        assert steps == sorted(steps), kind
    # SGLang's refusal ("success": false, HTTP 400) was retried once and then accepted.
    sglang = run["engines"]["sglang"].requests
    assert sglang[0]["body"] == sglang[1]["body"]
    log = run["log"]
    assert f"the sglang engine at {run['engines']['sglang'].url} reloaded policy version {STEPS}" in log, log
    assert "could not tell the sglang engine at http://127.0.0.1:" in log and "(after 2 attempts)" in log, log


def test_bad_engine_lists_are_refused_before_training(tmp_path):
    for spec, message in [("sglang", "expected KIND=URL"), ("tgi=http://x:1", "unknown kind 'tgi'"),
                          ("vllm=ftp://x:1", "must start with http:// or https://"),
                          ("vllm=http://", "names no host")]:
        result = subprocess.run([tool("dta-trainer"), "--config=qwen3-0.6b", f"--checkpoint_dir={tmp_path}",
                                 f"--notify_engines={spec}"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert "--notify_engines: engine 1" in result.stderr and message in result.stderr, result.stderr


def test_the_rollout_worker_example_reloads_the_published_weights_into_its_model(source_model, tmp_path):
    """examples/python/rollout_worker.py with a real transformers policy: it samples the episodes
    with the source model, dta-trainer trains them, and each time a step commits the worker waits
    for that checkpoint and loads its weights into its model, until policy version 2."""
    wal, address = tmp_path / "dispatcher.wal", f"127.0.0.1:{free_port()}"
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("dispatcher", "trainer")}
    dispatcher = subprocess.Popen([tool("dta-dispatcher"), f"--wal={wal}", f"--listen={address}",
                                   "--batch_rollouts=4", f"--vocab_size={MODEL_VOCAB}"],
                                  stdout=logs["dispatcher"], stderr=logs["dispatcher"])
    trainer = worker = None
    try:
        trainer = subprocess.Popen(
            [tool("dta-trainer"), f"--dispatcher={address}", f"--token_file={wal}.trainer-token",
             f"--checkpoint_dir={tmp_path / 'ckpt'}", f"--model={source_model}", "--dtype=float32",
             "--loss=grpo", "--lr=1e-2", "--max_steps=2", "--wait_s=120"],
            stdout=logs["trainer"], stderr=logs["trainer"])
        worker = subprocess.run(
            [sys.executable, str(REPO / "examples" / "python" / "rollout_worker.py"), f"--dispatcher={address}",
             f"--model={source_model}", f"--checkpoint_dir={tmp_path / 'ckpt'}", "--groups=2", "--group_size=2",
             "--max_turns=2", "--system_tokens=8", "--until_version=2", "--poll_s=0.05", "--retry_s=60"],
            capture_output=True, text=True, timeout=300)
        assert trainer.wait(timeout=120) == 0, (tmp_path / "trainer.log").read_text()
    finally:
        for process in (trainer, dispatcher):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        for log in logs.values():
            log.close()
    assert worker.returncode == 0, worker.stdout + worker.stderr
    reloads = re.findall(r"^policy version (\d+) -> (\d+): reloaded (\d+) tensors from (\S+)$", worker.stdout, re.M)
    assert reloads, worker.stdout
    versions = [int(new) for _, new, _, _ in reloads]
    assert versions == sorted(versions) and versions[-1] == 2, worker.stdout
    tensors = len(load_file(source_model / "model.safetensors"))
    for old, new, count, path in reloads:
        assert int(count) == tensors and path == str(tmp_path / "ckpt" / f"step-{int(new):08d}" / "model")
    assert "synthetic" not in worker.stdout

"""The Python benchmark scripts run end to end on a tiny model and batch (their numbers come from
GPU runs, docs/benchmarks.md; here only that they work and report consistently)."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dta

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import hf_baseline  # noqa: E402


def test_hf_baseline_times_transformers_and_dta_on_the_same_batch(tmp_path):
    rng = random.Random(3)
    prompt = [rng.randrange(1024) for _ in range(40)]
    batch = []
    for i in range(4):
        tokens = prompt + [rng.randrange(1024) for _ in range(20 + 5 * i)]
        batch.append(dta.Trajectory(id=f"r{i}", group="g", tokens=tokens, loss_mask=[0] * 40 + [1] * (len(tokens) - 40),
                                    logprobs=[-1.0] * len(tokens), reward=float(i % 2)))
    rollouts = tmp_path / "rollouts.jsonl"
    dta.write_jsonl(rollouts, batch)
    run = subprocess.run([sys.executable, str(REPO / "bench" / "hf_baseline.py"), f"--rollouts={rollouts}",
                          "--device=cpu", "--dtype=float32", "--repeats=1", "--methods=hf-sdpa,hf-sdpa-packed,dta-dense,dta,dta-pack",
                          "--json", "--profile=hf-sdpa-packed,dta"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["method"] for r in records] == ["hf-sdpa", "hf-sdpa-packed", "dta-dense", "dta", "dta-pack"]
    tokens = sum(len(t.tokens) for t in batch)
    for r in records:
        assert r["rollout_tokens"] == tokens and r["tree_tokens"] == 40 + sum(20 + 5 * i for i in range(4))
        assert r["seconds"] > 0 and r["rollout_tokens_per_second"] == tokens / r["seconds"]
        if r["method"].startswith("dta"):  # what the executor did, beside dta-bench's step
            assert 0 < r["executor_seconds"] and r["forwarded_tokens"] >= r["tree_tokens"], r
            assert "hf_class" not in r, r["method"]
        else:
            assert "forwarded_tokens" not in r, r["method"]
            assert r["hf_class"] == "Qwen3ForCausalLM", r  # the default config's family
        if r["method"] not in ("hf-sdpa-packed", "dta"):
            assert "profile" not in r, r["method"]
            continue
        # On the CPU the profiler sees no kernels: only the report's shape is checked here.
        assert r["profile"]["kernel_launches"] == 0 and set(r["profile"]["gpu_ms"]) == {"attention", "gemm", "other"}
        assert r["profile"]["host_ops"], "the host's operations are listed"
    assert run.stdout.count("profile of ") == 2
    # Each method reports as it finishes, so that a run cut short keeps what it measured.
    assert [line.split()[1] for line in run.stderr.splitlines() if line.startswith("hf_baseline: ")] == \
        ["hf-sdpa", "hf-sdpa-packed", "dta-dense", "dta", "dta-pack"]
    gpu_only = subprocess.run([sys.executable, str(REPO / "bench" / "hf_baseline.py"), f"--rollouts={rollouts}",
                               "--device=cpu", "--dtype=float32", "--repeats=1", "--methods=dta", "--json",
                               "--profile", "--no-profile_host"], capture_output=True, text=True, timeout=120)
    assert gpu_only.returncode == 2 and "--device=cpu has none" in gpu_only.stderr
    unknown = subprocess.run([sys.executable, str(REPO / "bench" / "hf_baseline.py"), f"--rollouts={rollouts}",
                              "--methods=dta", "--profile=hf-sdpa"], capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "--profile names methods not in --methods: ['hf-sdpa']" in unknown.stderr
    typo = subprocess.run([sys.executable, str(REPO / "bench" / "hf_baseline.py"), f"--rollouts={rollouts}",
                           "--methods=dta,dta-packed"], capture_output=True, text=True, timeout=120)
    assert typo.returncode == 2 and "--methods: unknown ['dta-packed']" in typo.stderr
    fastest = min(r["seconds"] for r in records if r["method"] in ("hf-sdpa", "hf-sdpa-packed", "dta-dense"))
    assert all(abs(r["vs_fastest_dense"] - fastest / r["seconds"]) < 1e-12 for r in records)


def test_hf_baseline_loads_transformers_model_of_the_configs_family(tmp_path):
    """A Llama config runs transformers' LlamaForCausalLM beside dta on the same saved weights
    (transformers' Auto class, from the model_type dta saves), not Qwen3's."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 512,
              "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    rng = random.Random(4)
    batch = [dta.Trajectory(id=f"r{i}", group="g", tokens=[rng.randrange(256) for _ in range(12 + i)],
                            loss_mask=[0] * 4 + [1] * (8 + i), logprobs=[-1.0] * (12 + i), reward=float(i))
             for i in range(3)]
    dta.write_jsonl(tmp_path / "rollouts.jsonl", batch)
    run = subprocess.run([sys.executable, str(REPO / "bench" / "hf_baseline.py"),
                          f"--rollouts={tmp_path / 'rollouts.jsonl'}", f"--config={tmp_path / 'config.json'}",
                          "--device=cpu", "--dtype=float32", "--repeats=1", "--methods=hf-sdpa,hf-sdpa-packed,dta",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    records = {r["method"]: r for r in (json.loads(line) for line in run.stdout.splitlines() if line.startswith("{"))}
    assert set(records) == {"hf-sdpa", "hf-sdpa-packed", "dta"}
    assert records["hf-sdpa"]["hf_class"] == records["hf-sdpa-packed"]["hf_class"] == "LlamaForCausalLM"


def test_packed_transformers_computes_the_per_rollout_gradient():
    """hf-*-packed is the same baseline: transformers keeps packed rollouts apart (position ids
    restarting at each), so the packed loss's gradient is the per-rollout one, with packs padded to
    one length too (float64; SDPA
    exactly, eager up to its float32 softmax; flex attention has no backward on the CPU)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    rng = random.Random(5)
    batch = []
    for i in range(7):
        tokens = [rng.randrange(64) for _ in range(3 + 4 * i)]
        batch.append(dta.Trajectory(id=f"r{i}", group=f"g{i % 2}", tokens=tokens,
                                    loss_mask=[0] + [rng.randrange(2) or 1 for _ in tokens[1:]],
                                    logprobs=[-1.0] * len(tokens), reward=float(i % 3)))
    advantages = hf_baseline.group_advantages(batch)
    assert any(a != 0 for a in advantages)
    grads = {}
    for attention in ("sdpa", "eager"):
        model = Qwen3ForCausalLM(config).to(torch.float64)
        model.config._attn_implementation = attention
        torch.manual_seed(1)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.3)
        for name, run in [("each", lambda: hf_baseline.hf_gradients(model, batch, advantages, torch.device("cpu"))),
                          ("packed", lambda: hf_baseline.hf_packed_gradients(model, batch, advantages,
                                                                             torch.device("cpu"), pack_tokens=40)),
                          ("padded", lambda: hf_baseline.hf_packed_gradients(model, batch, advantages,
                                                                             torch.device("cpu"), pack_tokens=40,
                                                                             pad=True))]:
            model.zero_grad()
            run()
            grads[attention, name] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert len(hf_baseline.packs(batch, 40)) < len(batch)  # some packs hold several rollouts
    for attention, tolerance in (("sdpa", 1e-10), ("eager", 1e-6)):
        each = grads[attention, "each"]
        assert each.norm() > 0
        for packing in ("packed", "padded"):
            assert (grads[attention, packing] - each).norm() <= tolerance * each.norm(), (attention, packing)


def test_packs_keep_file_order_under_the_cap():
    batch = [dta.Trajectory(id=str(i), group="g", tokens=[1] * n, loss_mask=[0] + [1] * (n - 1),
                            logprobs=[-1.0] * n, reward=0.0) for i, n in enumerate([5, 5, 9, 30, 2, 2])]
    assert hf_baseline.packs(batch, 10) == [[0, 1], [2], [3], [4, 5]]
    assert hf_baseline.packs(batch, 1000) == [[0, 1, 2, 3, 4, 5]]


def test_python_overhead_times_both_checks_of_a_batch(tmp_path):
    batch = [dta.Trajectory(id=f"r{i}", group="g", tokens=list(range(1, 30 + i)), loss_mask=[0] + [1] * (28 + i),
                            logprobs=[-1.0] * (29 + i), reward=float(i)) for i in range(5)]
    rollouts = tmp_path / "rollouts.jsonl"
    dta.write_jsonl(rollouts, batch)
    run = subprocess.run([sys.executable, str(REPO / "bench" / "python_overhead.py"), f"--rollouts={rollouts}",
                          "--repeats=2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == f"5 trajectories, {sum(29 + i for i in range(5))} tokens, vocabulary 151,936"
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "Python validation of every trajectory (before)", "C++ check of plain trajectories (now)",
        "Trainer._checked, checked and converted (now)", "from_areal of every trajectory"]
    bad = subprocess.run([sys.executable, str(REPO / "bench" / "python_overhead.py"), f"--rollouts={rollouts}",
                          "--repeats=0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--repeats must be >= 1, got 0" in bad.stderr

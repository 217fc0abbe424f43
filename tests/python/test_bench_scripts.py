"""The Python benchmark scripts run end to end on a tiny model and batch (their numbers come from
GPU runs, docs/benchmarks.md; here only that they work and report consistently)."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import dta

REPO = Path(__file__).resolve().parents[2]


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
                          "--device=cpu", "--dtype=float32", "--repeats=1", "--methods=hf-sdpa,dta-dense,dta",
                          "--json", "--profile"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["method"] for r in records] == ["hf-sdpa", "dta-dense", "dta"]
    tokens = sum(len(t.tokens) for t in batch)
    for r in records:
        assert r["rollout_tokens"] == tokens and r["tree_tokens"] == 40 + sum(20 + 5 * i for i in range(4))
        assert r["seconds"] > 0 and r["rollout_tokens_per_second"] == tokens / r["seconds"]
        # On the CPU the profiler sees no kernels: only the report's shape is checked here.
        assert r["profile"]["kernel_launches"] == 0 and set(r["profile"]["gpu_ms"]) == {"attention", "gemm", "other"}
    assert run.stdout.count("profile of ") == 3
    fastest = min(r["seconds"] for r in records if r["method"] != "dta")
    assert all(abs(r["vs_fastest_dense"] - fastest / r["seconds"]) < 1e-12 for r in records)

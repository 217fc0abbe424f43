"""A policy that learns through dta's services: the README's demo (examples/python/learning_demo.py),
shortened, with the real dta-dispatcher, two dta-trainer ranks (Gloo) and the on-policy worker.

A tiny Qwen3 learns the lookup task (examples/python/lookup_task.py) once with dense trainers and
once with dta trainers from the same seed: its mean reward rises from near chance to well above it,
and in float64 both methods earn the same reward at every step (the same weights to ~1e-13, so the
seeded worker samples the same tokens). Every batch is sampled from the weights the trainers
published for the step before (on-policy).
"""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from test_client import REPO, tool

sys.path.insert(0, str(REPO / "examples" / "python"))
import learning_demo  # noqa: E402
import lookup_task  # noqa: E402

STEPS = 20


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("learning")
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "python" / "learning_demo.py"), f"--steps={STEPS}", f"--out={out}",
         f"--build_dir={tool('dta-trainer').parents[1]}", f"--plot={out / 'curve.png'}"],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return {"out": out, "stdout": result.stdout, **json.loads((out / "learning.json").read_text())}


def rewards(demo: dict, method: str) -> list[float]:
    return [r["reward"] for r in demo["runs"][method]["records"]]


def test_the_reward_rises_from_near_chance_to_well_above_it(demo):
    for method in ("dense", "dta"):
        got = rewards(demo, method)
        assert len(got) == STEPS, method
        start, end = sum(got[:3]) / 3, sum(got[-3:]) / 3
        assert start < 0.15, (method, got)
        assert end > 0.5 and end > 4 * start, (method, got)
    lookups = [r["lookups"] for r in demo["runs"]["dta"]["records"]]
    assert sum(lookups[-3:]) / 3 > 0.7, lookups  # it learnt to call the tool with the asked key


def test_dense_and_dta_earn_the_same_reward_at_every_step(demo):
    dense, dta = (demo["runs"][m]["records"] for m in ("dense", "dta"))
    assert rewards(demo, "dense") == rewards(demo, "dta")
    for a, b in zip(dense, dta):  # the same batches, trained to the same loss
        assert (a["lookups"], a["rollout_tokens"], a["tree_tokens"]) == (b["lookups"], b["rollout_tokens"],
                                                                         b["tree_tokens"])
        assert abs(a["loss"] - b["loss"]) < 1e-12, (a, b)
    assert demo["agreement"]["rewards_equal"]
    assert "dense and dta: rewards the same at every step" in demo["stdout"]


def test_every_batch_is_sampled_from_the_newest_published_weights(demo):
    for method in ("dense", "dta"):
        records = demo["runs"][method]["records"]
        assert [r["policy_version"] for r in records] == list(range(STEPS)), method
        # Trained as a tree: every batch shares the system prompt and each group its question.
        assert all(r["tree_tokens"] * 4 < r["rollout_tokens"] for r in records), method
        latest = json.loads((demo["out"] / method / "checkpoints" / "latest.json").read_text())
        assert latest["policy_version"] == STEPS, method
        lines = [line for line in demo["stdout"].splitlines() if line.startswith(f"[{method}] step ")]
        assert len(lines) == STEPS, demo["stdout"]
    assert (demo["out"] / "curve.png").stat().st_size > 10_000


def test_the_comparison_tells_different_rewards_apart():
    def run(rewards: list[float]) -> dict:
        return {"records": [{"step": i + 1, "reward": r, "loss": 0.0} for i, r in enumerate(rewards)]}

    assert learning_demo.compare({"dense": run([0.1, 0.5]), "dta": run([0.1, 0.5])})["rewards_equal"]
    assert not learning_demo.compare({"dense": run([0.1, 0.5]), "dta": run([0.1, 0.25])})["rewards_equal"]


def test_the_task_rewards_the_asked_lookup_and_its_value_only():
    task = lookup_task.Task.sample(random.Random(3), "t")
    value = task.table[task.key]
    assert task.prompt([lookup_task.BOS]) == [lookup_task.BOS, lookup_task.USER, task.key]
    assert task.tool(task.key) == [lookup_task.TOOL, value]
    assert task.tool(lookup_task.ERR) == [lookup_task.TOOL, lookup_task.ERR]
    assert task.reward(task.key, value) == 1.0
    assert task.reward(task.key, (value + 1) % lookup_task.DIGITS) == 0.0
    other = (task.key + 1) % lookup_task.DIGITS
    assert task.reward(other, value) == 0.0  # a lucky answer after the wrong lookup earns nothing
    # A policy choosing tokens uniformly earns 1 / 14^2 on average.
    rng = random.Random(0)
    tasks = [lookup_task.Task.sample(rng, str(i)) for i in range(20000)]
    mean = sum(t.reward(rng.randrange(lookup_task.VOCAB_SIZE), rng.randrange(lookup_task.VOCAB_SIZE))
               for t in tasks) / len(tasks)
    assert abs(mean - 1 / lookup_task.VOCAB_SIZE**2) < 0.003

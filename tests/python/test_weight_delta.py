"""Weight deltas, as a rollout worker receives them.

dta-trainer --publish_weight_delta trains the tiny Qwen3 preset from a dispatcher for a few steps,
publishing a checkpoint after each; every checkpoint but the first carries
``model/delta-from-<previous step>.{safetensors,json}``. dta.weight_delta applies the deltas in turn
to the first checkpoint's bf16 weights and must reach every later step's weights bit for bit; the
engines' loaders must not see the delta (the weight index does not name it); a delta applied to the
wrong weights is refused before anything changes.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dta
from dta.weight_delta import apply_delta, encoded_size, load_weights, read_delta
from test_client import REPO, Dispatcher, make, tool

STEPS = 4
CONFIG = REPO / "examples" / "configs" / "qwen3-tiny.json"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("run")
    dispatcher = Dispatcher(directory).start()
    try:
        with dta.RolloutClient(dispatcher.address, call_timeout=10, retry_for=30) as client:
            for i in range(4 * STEPS):
                client.send(make(i))
        trainer = subprocess.run(
            [tool("dta-trainer"), f"--dispatcher={dispatcher.address}",
             f"--token_file={dispatcher.wal}.trainer-token", f"--checkpoint_dir={directory / 'ckpt'}",
             f"--config={CONFIG}", "--dtype=float32", "--loss=sft", "--lr=1e-5", f"--max_steps={STEPS}",
             f"--keep_checkpoints={STEPS}", "--wait_s=60", "--publish_weight_delta"],
            capture_output=True, text=True, timeout=300)
    finally:
        dispatcher.stop()
    assert trainer.returncode == 0, trainer.stderr
    return {"ckpt": directory / "ckpt", "log": trainer.stderr}


def steps(run) -> list[Path]:
    found = sorted(run["ckpt"].glob("step-*"))
    assert [p.name for p in found] == [f"step-{n:08d}" for n in range(1, STEPS + 1)]
    return found


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.bfloat16, name
        assert torch.equal(a[name].view(torch.int16), b[name].view(torch.int16)), name


def test_every_checkpoint_but_the_first_carries_a_delta_the_engines_do_not_load(run):
    first, *later = steps(run)
    assert not list((first / "model").glob("delta-*"))
    assert "weight_delta" not in json.loads((first / "trainer.json").read_text())
    for n, step in enumerate(later, start=2):
        model = step / "model"
        stem = f"delta-from-{n - 1:08d}"
        assert (model / f"{stem}.safetensors").is_file() and (model / f"{stem}.json").is_file()
        weight_map = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(weight_map.values()) == {"model.safetensors"}
        trainer = json.loads((step / "trainer.json").read_text())["weight_delta"]
        assert trainer["base_step"] == n - 1
        assert trainer["index"] == f"model/{stem}.json"
        delta = read_delta(model / f"{stem}.json")
        assert (delta.base_step, delta.step) == (n - 1, n)
        assert trainer["changed_elements"] == delta.changed_elements > 0
        assert trainer["delta_bytes"] == delta.delta_bytes < delta.full_bytes
        assert delta.full_bytes == 2 * delta.elements  # bf16
        assert f"weight delta from step {n - 1} to {n}" in run["log"]
    latest = json.loads((run["ckpt"] / "latest.json").read_text())
    assert latest["weight_delta"]["base_step"] == STEPS - 1
    assert Path(latest["weight_delta"]["index"]) == later[-1] / "model" / f"delta-from-{STEPS - 1:08d}.json"


def test_applying_the_deltas_in_turn_reaches_every_step_bitwise(run):
    found = steps(run)
    weights = load_weights(found[0] / "model")
    for step in found[1:]:
        expected = load_weights(step / "model")
        changed = sum(int((weights[n].view(torch.int16) != expected[n].view(torch.int16)).sum()) for n in weights)
        delta = read_delta(step / "model")  # the directory holding one delta
        assert delta.changed_elements == changed
        # The trainer encodes what dta.weight_delta.encoded_size predicts, tensor by tensor.
        assert delta.delta_bytes == sum(encoded_size(weights[n], expected[n])[1] for n in weights)
        assert apply_delta(weights, delta, base_step=delta.base_step) is weights
        assert_bitwise_equal(weights, expected)


def test_a_directory_is_read_and_returned_changed(run):
    first, second = steps(run)[:2]
    weights = apply_delta(first / "model", second / "model" / f"delta-from-{1:08d}.safetensors")
    assert_bitwise_equal(weights, load_weights(second / "model"))
    assert_bitwise_equal(load_weights(first / "model"), load_weights(first / "model"))  # files unchanged


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_deltas_apply_to_weights_on_the_gpu(run):
    found = steps(run)
    weights = {n: t.cuda() for n, t in load_weights(found[0] / "model").items()}
    for step in found[1:]:
        apply_delta(weights, step / "model")
    assert_bitwise_equal({n: t.cpu() for n, t in weights.items()}, load_weights(found[-1] / "model"))


def test_a_delta_for_other_weights_is_refused_and_changes_nothing(run):
    first, second, third = steps(run)[:3]
    delta = read_delta(third / "model")
    weights = load_weights(first / "model")
    before = {n: t.clone() for n, t in weights.items()}
    with pytest.raises(ValueError, match="applies to step 2, not 1"):
        apply_delta(weights, delta, base_step=1)
    name = sorted(weights)[-1]
    reshaped = dict(weights)
    reshaped[name] = weights[name].reshape(-1)[:-1].clone()
    with pytest.raises(ValueError, match=f"tensor '{name}': the delta is for torch.bfloat16"):
        apply_delta(reshaped, delta)
    missing = {n: t for n, t in weights.items() if n != name}
    with pytest.raises(ValueError, match="is missing from the weights"):
        apply_delta(missing, delta)
    transposed = dict(weights)
    big = next(n for n, t in weights.items() if t.dim() == 2 and t.shape[0] == t.shape[1])
    transposed[big] = weights[big].t()
    with pytest.raises(ValueError, match="not contiguous"):
        apply_delta(transposed, delta)
    assert_bitwise_equal(weights, before)
    with pytest.raises(FileNotFoundError):
        read_delta(first / "model")  # no delta there


def test_encoded_size_chooses_the_smallest_encoding():
    torch.manual_seed(0)
    base = torch.randn(10000).to(torch.bfloat16)
    assert encoded_size(base, base.clone()) == (0, 0)
    sparse = base.clone()
    sparse[[0, 1, 200, 9999]] += 1  # gaps 0, 0, 198, 9798: 1 + 1 + 2 + 2 bytes
    assert encoded_size(base, sparse) == (4, 4 * 2 + 6)
    dense = base + 1
    changed = int((dense.view(torch.int16) != base.view(torch.int16)).sum())
    assert encoded_size(base, dense) == (changed, 2 * 10000)
    half = base.clone()
    half[::2] += 1
    changed = int((half.view(torch.int16) != base.view(torch.int16)).sum())
    assert encoded_size(base, half) == (changed, 2 * changed + 10000 // 8)


def test_the_fraction_bench_reports_every_step():
    run = subprocess.run([sys.executable, str(REPO / "bench" / "weight_delta_fraction.py"), "--steps=2",
                          "--lrs=1e-5", "--workload=gsm8k", "--scale=0.02"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert len(rows) == 2
    for row in rows:
        fraction, delta_mb, full_mb = float(row[3].rstrip("%")), float(row[4]), float(row[5])
        assert 0 < fraction < 100 and 0 < delta_mb < full_mb
    assert "mean of steps 2..2" in run.stdout

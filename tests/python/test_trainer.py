"""dta.Trainer against plain PyTorch + transformers.

A tiny random Qwen3ForCausalLM (test_hf_parity's) is saved as a Hugging Face checkpoint and loaded
by dta.Trainer in float64. The reference runs every rollout through transformers on its own (float64,
with test_hf_parity's exact_float64 patches), computes the SFT or GRPO loss from its definition here,
independently of dta, and backpropagates. Every parameter's gradient from every method (dense,
packed, dta with small backward chunks) must match within 1e-9 relative error, with the named
losses and with the same GRPO written as a Python callable. Also: log-probabilities against
transformers, the AdamW step against torch.optim.AdamW, checkpoints transformers loads, the GIL
released during long calls, errors naming the trajectory and the field, and a GPU device this
process cannot see.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from transformers import Qwen3ForCausalLM

import dta
from test_hf_parity import VOCAB, exact_float64, make_rollouts, random_model

RELATIVE = 1e-9
TINY_CONFIG = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3-tiny.json")
# dta both ways, packing stated (the executor packs by default).
METHODS = [("dense", {}), ("packed", {}), ("dta", {"block_size": 7, "pack": False}),
           ("dta", {"block_size": 16, "pack": True})]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request, tmp_path_factory) -> tuple[Qwen3ForCausalLM, str]:
    model = random_model(request.param)
    directory = tmp_path_factory.mktemp("hf")
    model.save_pretrained(directory, safe_serialization=True)
    return model, str(directory)


def hf_logprobs(model: Qwen3ForCausalLM, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[t] | tokens[:t]) for t >= 1, [L - 1], with autograd."""
    ids = torch.tensor(tokens)
    logits = model(input_ids=ids[None]).logits[0]
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]


@pytest.fixture(scope="module")
def trajectories(checkpoint) -> list[dta.Trajectory]:
    """test_hf_parity's rollouts (shared prefixes, a prefix rollout, a duplicate, one token) with
    random masks, rewards in mixed groups and behaviour log-probabilities around the model's own, so
    that PPO ratios fall inside and outside the clip range."""
    model, _ = checkpoint
    rng = random.Random(11)
    out = []
    with exact_float64(), torch.no_grad():
        model64 = copy.deepcopy(model).to(torch.float64)
        for i, r in enumerate(make_rollouts()):
            current = [0.0] + hf_logprobs(model64, r["tokens"]).tolist()
            mask = [0] + [int(rng.random() < 0.8) for _ in r["tokens"][1:]]
            out.append(dta.Trajectory(id=r["id"], group=r["group"], tokens=r["tokens"], loss_mask=mask,
                                      logprobs=[lp + rng.uniform(-0.4, 0.4) for lp in current],
                                      reward=float(rng.randrange(3))))
    assert len({t.group for t in out}) < len(out)
    return out


# --- the reference --------------------------------------------------------------------------------


def f32(values: list[float]) -> torch.Tensor:
    """As dta stores per-token floats: float32, then used in float64."""
    return torch.tensor(values, dtype=torch.float32).to(torch.float64)


def group_advantages(trajectories: list[dta.Trajectory]) -> list[float]:
    """GRPO: (reward - group mean) / (group std + 1e-6), unbiased std; 0 for equal rewards."""
    by_group: dict[str, list[float]] = {}
    for t in trajectories:
        by_group.setdefault(t.group, []).append(t.reward)
    out = []
    for t in trajectories:
        rewards = torch.tensor(by_group[t.group], dtype=torch.float64)
        if (rewards == rewards[0]).all():
            out.append(0.0)
        else:
            out.append(float((t.reward - rewards.mean()) / (rewards.std() + 1e-6)))
    return out


def sft_loss(lp: torch.Tensor, t: dta.Trajectory, advantage: float, n: float) -> torch.Tensor:
    mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
    return -lp[mask].sum() / n


def grpo_loss(lp: torch.Tensor, t: dta.Trajectory, advantage: float, n: float) -> torch.Tensor:
    mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
    a = f32([advantage])[0]
    ratio = torch.exp(lp - f32(t.logprobs)[1:])
    surrogate = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.2))
    return surrogate[mask].sum() / n


REFERENCE_LOSSES = {"sft": sft_loss, "grpo": grpo_loss}


def reference(model: Qwen3ForCausalLM, trajectories: list[dta.Trajectory], loss: str):
    """The batch loss and every parameter's gradient, one rollout at a time through transformers."""
    model64 = copy.deepcopy(model).to(torch.float64)
    n = float(sum(sum(t.loss_mask) for t in trajectories))
    advantages = group_advantages(trajectories)
    total = torch.zeros((), dtype=torch.float64)
    with exact_float64():
        for t, a in zip(trajectories, advantages):
            if len(t.tokens) == 1:
                continue  # nothing predicted, no loss
            total = total + REFERENCE_LOSSES[loss](hf_logprobs(model64, t.tokens), t, a, n)
    total.backward()
    return total.item(), {name: p.grad for name, p in model64.named_parameters()}, model64


def assert_gradients_match(trainer: dta.Trainer, want: dict[str, torch.Tensor], what: str) -> None:
    got = trainer.gradients()
    assert sorted(got) == sorted(want), what
    for name, g in want.items():
        assert g.norm() > 0, f"{what}: {name} has a zero reference gradient"
        error = ((got[name] - g).norm() / g.norm()).item()
        assert error <= RELATIVE, f"{what}: {name}: relative error {error:.3g}"


# --- gradients ------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["sft", "grpo"])
def test_gradients_match_transformers(checkpoint, trajectories, loss):
    model, directory = checkpoint
    want_loss, want, _ = reference(model, trajectories, loss)
    trainer = dta.Trainer(directory, dtype="float64")
    for method, options in METHODS:
        stats = trainer.compute_gradients(trajectories, loss, method, **options)
        what = f"{loss} {method} {options}"
        assert stats.loss == pytest.approx(want_loss, rel=RELATIVE, abs=1e-12), what
        assert stats.rollout_tokens == sum(len(t.tokens) for t in trajectories)
        assert stats.tree_tokens == dta.PrefixTree(trajectories).tree_tokens < stats.rollout_tokens
        assert_gradients_match(trainer, want, what)


def test_compute_gradients_replaces_unless_it_accumulates(checkpoint, trajectories):
    _, directory = checkpoint
    trainer = dta.Trainer(directory, dtype="float64")
    trainer.compute_gradients(trajectories, "sft", "dta")
    once = {name: g.clone() for name, g in trainer.gradients().items()}
    trainer.compute_gradients(trajectories, "sft", "dta")  # replaces: the same gradients, bitwise
    for name, g in trainer.gradients().items():
        assert once[name].norm() > 0 and torch.equal(g, once[name]), name
    trainer.compute_gradients(trajectories, "sft", "dense", accumulate=True)  # adds
    for name, g in trainer.gradients().items():
        assert torch.allclose(g, 2 * once[name], rtol=1e-10, atol=0), name


def test_python_loss_matches_transformers(checkpoint, trajectories):
    model, directory = checkpoint
    want_loss, want, _ = reference(model, trajectories, "grpo")
    want_advantages = group_advantages(trajectories)
    seen = []

    def grpo(logprobs: torch.Tensor, rollout: dta.trainer.RolloutLossInput) -> torch.Tensor:
        assert logprobs.requires_grad and logprobs.dtype == torch.float64
        assert rollout.trajectory is trajectories[rollout.index]
        assert rollout.num_rollouts == len(trajectories)
        assert torch.equal(rollout.advantages, f32([want_advantages[rollout.index]] * len(logprobs)))
        seen.append(rollout.index)
        ratio = torch.exp(logprobs - rollout.old_logprobs)
        a = rollout.advantages
        surrogate = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.2))
        return torch.where(rollout.loss_mask, surrogate, 0).sum() / rollout.total_loss_tokens

    trainer = dta.Trainer(directory, dtype="float64")
    for method, options in METHODS:
        seen.clear()
        stats = trainer.compute_gradients(trajectories, grpo, method, **options)
        assert sorted(seen) == list(range(len(trajectories))), method
        assert stats.loss == pytest.approx(want_loss, rel=RELATIVE, abs=1e-12)
        assert_gradients_match(trainer, want, f"python loss {method} {options}")


def test_tensor_fields_reach_a_python_loss_as_the_lists_do(checkpoint, trajectories):
    """Per-token fields given as tensors (advantages without a reward, reference log-probabilities)
    train exactly as the same lists: no "truth value is ambiguous", no copy warnings."""
    trainer = dta.Trainer(checkpoint[1], dtype="float64")
    as_lists, as_tensors = [], []
    for t in trajectories:
        advantages = [0.25 * ((i % 5) - 2) for i in range(len(t.tokens))]
        ref = [lp - 0.1 for lp in t.logprobs]
        as_lists.append(dataclasses.replace(t, reward=None, advantages=advantages, ref_logprobs=ref))
        as_tensors.append(dataclasses.replace(t, reward=None, advantages=torch.tensor(advantages),
                                              ref_logprobs=torch.tensor(ref, dtype=torch.float64)))

    def kl(logprobs: torch.Tensor, rollout: dta.trainer.RolloutLossInput) -> torch.Tensor:
        assert rollout.ref_logprobs is not None
        penalty = (logprobs - rollout.ref_logprobs) * rollout.advantages
        return torch.where(rollout.loss_mask, penalty, 0).sum() / rollout.total_loss_tokens

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = trainer.compute_gradients(as_lists, kl).loss
        got = trainer.compute_gradients(as_tensors, kl).loss
        assert got == want
        assert trainer.compute_gradients(as_tensors, "grpo").loss == trainer.compute_gradients(as_lists, "grpo").loss


def test_python_loss_errors_propagate(checkpoint, trajectories):
    trainer = dta.Trainer(checkpoint[1], dtype="float64")

    class Boom(Exception):
        pass

    def raising(logprobs, rollout):
        raise Boom(rollout.trajectory.id)

    with pytest.raises(Boom):
        trainer.compute_gradients(trajectories, raising, "dta")
    with pytest.raises(TypeError, match="expected a scalar torch.Tensor"):
        trainer.compute_gradients(trajectories, lambda lp, r: 1.0, "dense")
    with pytest.raises(RuntimeError, match="one floating-point value"):
        trainer.compute_gradients(trajectories, lambda lp, r: lp * 2, "packed")
    with pytest.raises(TypeError, match="do not apply to a callable loss"):
        trainer.compute_gradients(trajectories, lambda lp, r: lp.sum(), "dta", eps_clip_low=0.1)
    # A loss calling back into its own trainer gets an error, not a deadlock.
    def reentrant(logprobs, rollout):
        trainer.lr = 0.1
        return logprobs.sum()

    with pytest.raises(RuntimeError, match="must not call its trainer"):
        trainer.compute_gradients(trajectories, reentrant, "dta")
    # The trainer still works afterwards.
    assert trainer.compute_gradients(trajectories, "sft", "dta").loss > 0


def test_one_pass_conversion_gives_the_general_paths_rollouts(checkpoint, trajectories):
    """Trajectories of plain values are checked and converted for the executor in one pass in C++;
    the same trajectories with numpy and tuple values (and a subclass) are validated in Python and
    converted through pybind11's casts. Both give the same rollouts: the same log-probabilities,
    loss and gradients, bitwise, with versions, advantages and reference log-probabilities too."""
    import numpy as np

    class Tagged(dta.Trajectory):
        pass

    rng = random.Random(4)
    plain = [dataclasses.replace(t, versions=[-1] + [rng.randrange(3) for _ in t.tokens[1:]],
                                 advantages=[rng.uniform(-1, 1) for _ in t.tokens],
                                 ref_logprobs=[lp - 0.1 for lp in t.logprobs]) for t in trajectories]
    other = []
    for i, t in enumerate(plain):
        if i % 3 == 0:
            other.append(dataclasses.replace(t, tokens=np.array(t.tokens), logprobs=np.array(t.logprobs)))
        elif i % 3 == 1:
            other.append(Tagged(**dataclasses.asdict(t)))
        else:
            other.append(dataclasses.replace(t, loss_mask=tuple(t.loss_mask), versions=np.array(t.versions),
                                             advantages=tuple(t.advantages)))
    trainer = dta.Trainer(checkpoint[1], dtype="float64")
    assert trainer._checked(plain)[1].unchecked == []
    assert trainer._checked(other)[1].unchecked == list(range(len(other)))
    runs = []
    for batch in (plain, other):
        logprobs = trainer.compute_logprobs(batch, "dta")
        stats = trainer.compute_gradients(batch, "grpo", "dta", kl_coef=0.1)  # ref_logprobs count
        runs.append((logprobs, stats.loss, {n: g.clone() for n, g in trainer.gradients().items()}))
    (lp_plain, loss_plain, grads_plain), (lp_other, loss_other, grads_other) = runs
    assert all(torch.equal(a, b) for a, b in zip(lp_plain, lp_other))
    assert loss_plain == loss_other != 0
    assert all(torch.equal(grads_plain[n], grads_other[n]) for n in grads_plain)


def test_a_converted_batch_refuses_a_trajectory_nobody_validated(checkpoint, trajectories):
    """What the C++ check does not pass stays pending until dta.Trainer has validated and converted
    it: the executor's entry points refuse a batch that still holds one."""
    import numpy as np

    trainer = dta.Trainer(checkpoint[1], dtype="float64")
    batch = [trajectories[0], dataclasses.replace(trajectories[1], tokens=np.array(trajectories[1].tokens))]
    converted = dta._core.convert_checked(batch, trainer.vocab_size, dta.Trajectory)
    assert converted.unchecked == [1] and len(converted) == 2
    executor = dta.trainer.ExecutorOptions()._to_core("dta")
    with pytest.raises(RuntimeError, match="trajectory 1 was neither checked nor validated and converted"):
        trainer._core.compute_logprobs(converted, executor)
    with pytest.raises(IndexError, match="0 is not an unchecked trajectory"):
        converted.convert(0, batch[0])
    converted.convert(1, batch[1])
    with pytest.raises(IndexError, match="1 is not an unchecked trajectory"):
        converted.convert(1, batch[1])
    assert [lp.tolist() for lp in trainer._core.compute_logprobs(converted, executor)] == \
        [lp.tolist() for lp in trainer.compute_logprobs(batch, "dta")]


def test_cpp_errors_that_format_numbers_reach_python(checkpoint, trajectories):
    """A C++ check whose message streams an integer (c10 formats it with an ostream) raises
    RuntimeError with the number in it. On the GPU machines' toolchain, which links libstdc++
    statically, the module carried a second copy of the locale machinery and this crashed the
    process (bindings/python/CMakeLists.txt links the shared library instead)."""
    trainer = dta.Trainer(checkpoint[1], dtype="float64")
    executor = dta.trainer.ExecutorOptions()._to_core("dta")
    executor.block_size = -5  # past the Python-side check, to reach the C++ one
    with pytest.raises(RuntimeError, match="block_size must be >= 1 or kAutoBlockSize, got -5"):
        trainer._core.compute_gradients(trainer._checked(trajectories)[1], dta._core.LossOptions(), None, executor)


def test_train_batch_is_one_unit_across_threads(checkpoint, trajectories):
    """Two threads' train_batch calls on one trainer: each zeroes, computes and steps without the
    other's calls in between, so the two steps equal two train_batch calls in a row."""
    _, directory = checkpoint
    together = dta.Trainer(directory, dtype="float64", lr=1e-2)
    threads = [threading.Thread(target=together.train_batch, args=(trajectories,), kwargs={"loss": "sft"})
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    alone = dta.Trainer(directory, dtype="float64", lr=1e-2)
    alone.train_batch(trajectories, loss="sft")
    alone.train_batch(trajectories, loss="sft")
    assert together.step_count == 2
    for name, p in alone.parameters().items():
        torch.testing.assert_close(together.parameters()[name], p, rtol=1e-12, atol=1e-14, msg=name)


# --- log-probabilities ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-5), ("float64", 1e-10)])
def test_compute_logprobs_matches_transformers(checkpoint, trajectories, dtype, tolerance):
    model, directory = checkpoint
    trainer = dta.Trainer(directory, dtype=dtype)
    with torch.no_grad():
        if dtype == "float64":
            with exact_float64():
                model64 = copy.deepcopy(model).to(torch.float64)
                want = [hf_logprobs(model64, t.tokens) for t in trajectories]
        else:
            want = [hf_logprobs(model, t.tokens) for t in trajectories]
    for method, options in METHODS:
        got = trainer.compute_logprobs(trajectories, method, **options)
        assert len(got) == len(trajectories)
        for t, g, w in zip(trajectories, got, want):
            assert g.shape == (len(t.tokens),) and g.dtype == trainer.dtype and g[0].item() == 0.0
            assert torch.allclose(g[1:].double(), w.double(), rtol=0, atol=tolerance), t.id


# --- the optimizer and checkpoints ------------------------------------------------------------------


@pytest.mark.parametrize("offload", [False, True])
def test_train_batch_steps_like_torch_adamw_and_saves(checkpoint, trajectories, tmp_path, offload):
    """One clipped AdamW step equals torch's, with AdamW's state on the model's device or offloaded
    to host memory (ShardedAdamW over one rank); the state saves and resumes."""
    model, directory = checkpoint
    _, grads, model64 = reference(model, trajectories, "grpo")
    before = {name: p.detach().clone() for name, p in model64.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(list(model64.parameters()), max_norm=0.5).item()
    optimizer = torch.optim.AdamW(model64.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    optimizer.step()

    trainer = dta.Trainer(directory, dtype="float64", lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                          max_grad_norm=0.5, offload_optimizer=offload)
    stats = trainer.train_batch(trajectories, "grpo", "dta", block_size=7)
    assert stats.step == 1 and trainer.step_count == 1
    assert stats.grad_norm == pytest.approx(norm, rel=RELATIVE) and stats.clip_coef < 1  # clipping was exercised
    assert stats.seconds > 0 and stats.rollout_tokens_per_second > 0
    params = trainer.parameters()
    for name, p in model64.named_parameters():
        want_update = p.detach() - before[name]
        got_update = params[name].detach() - before[name]
        error = ((got_update - want_update).norm() / want_update.norm()).item()
        assert error <= 1e-9, f"{name}: update differs by {error:.3g}"

    saved = tmp_path / "step-1"
    trainer.save(saved, dtype=None)  # the model's own float64
    loaded = Qwen3ForCausalLM.from_pretrained(saved / "model", dtype=torch.float64)
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), params[name].detach()), name
    resumed = dta.Trainer(saved / "model", dtype="float64", offload_optimizer=offload)
    resumed.load_optimizer(saved)
    assert resumed.step_count == 1 and resumed.lr == 1e-3
    state_files = sorted(p.name for p in (saved / "optimizer").glob("optimizer*.safetensors"))
    assert state_files == (["optimizer-00000-of-00001.safetensors"] if offload else ["optimizer.safetensors"])
    other_kind = dta.Trainer(saved / "model", dtype="float64", offload_optimizer=not offload)
    with pytest.raises(RuntimeError, match="--offload_optimizer=" + ("true" if offload else "false")):
        other_kind.load_optimizer(saved)
    # By default the model is published in bf16 (as engines serve it), with the source's tokenizer
    # and generation files; resuming from the optimizer still restores the float64 weights exactly.
    published = tmp_path / "bf16"
    trainer.save(published)
    assert json.loads((published / "model" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (published / "model" / "model.safetensors.index.json").is_file()
    assert (published / "model" / "generation_config.json").is_file()
    from_bf16 = dta.Trainer(published / "model", dtype="float64", offload_optimizer=offload)
    assert not torch.equal(from_bf16.parameters()["model.norm.weight"], params["model.norm.weight"])
    from_bf16.load_optimizer(published / "optimizer")
    for name, p in from_bf16.parameters().items():
        assert torch.equal(p.detach(), params[name].detach()), name
    with pytest.raises(RuntimeError, match=r"a dta checkpoint: its model is in .*bf16/model"):
        dta.Trainer(published, dtype="float64")


def poisoned(logprobs: torch.Tensor, rollout: dta.trainer.RolloutLossInput) -> torch.Tensor:
    """One rollout's loss is NaN: NaN gradients wherever it reaches."""
    return logprobs.sum() * (math.nan if rollout.index == 1 else 1.0)


def test_a_nonfinite_gradient_raises_or_skips_the_step_and_updates_nothing(checkpoint, trajectories):
    """By default the step raises naming a parameter; with nonfinite_gradients="skip" it reports
    skipped and updates nothing (the next finite step is exactly a fresh trainer's first)."""
    _, directory = checkpoint
    raising = dta.Trainer(directory, dtype="float64", lr=1e-2)
    before = {name: p.detach().clone() for name, p in raising.parameters().items()}
    with pytest.raises(RuntimeError, match=r"gradient of parameter '.*' is not finite .* nothing was updated"):
        raising.train_batch(trajectories, poisoned)
    assert raising.step_count == 0

    skipping = dta.Trainer(directory, dtype="float64", lr=1e-2, nonfinite_gradients="skip")
    stats = skipping.train_batch(trajectories, poisoned)
    assert stats.skipped and math.isnan(stats.grad_norm) and stats.step == 0 == skipping.step_count
    for name, p in skipping.parameters().items():
        assert torch.equal(p.detach(), before[name]), name
    step = skipping.train_batch(trajectories, "grpo")
    assert not step.skipped and step.step == 1
    fresh = dta.Trainer(directory, dtype="float64", lr=1e-2)
    fresh.train_batch(trajectories, "grpo")
    moved = 0
    for name, p in skipping.parameters().items():
        assert torch.equal(p.detach(), fresh.parameters()[name].detach()), name
        moved += not torch.equal(p.detach(), before[name])
    assert moved > 0
    with pytest.raises(ValueError, match="nonfinite_gradients must be 'raise' or 'skip'"):
        dta.Trainer(directory, nonfinite_gradients="ignore")


def test_tensorboard_scalars_of_every_train_batch(checkpoint, trajectories, tmp_path):
    """tensorboard_dir: each train_batch's numbers at its step (a skipped step's too), read back with
    tensorboardX's protos and CRC."""
    from event_files import read_scalars

    trainer = dta.Trainer(checkpoint[1], dtype="float64", lr=1e-2, nonfinite_gradients="skip",
                          tensorboard_dir=tmp_path / "tb")
    trainer.train_batch(trajectories, poisoned)
    step = trainer.train_batch(trajectories, "grpo")
    scalars = read_scalars(tmp_path / "tb")
    assert sorted(scalars) == [0, 1]
    assert scalars[0]["skipped"] == 1.0 and math.isnan(scalars[0]["grad_norm"])
    assert scalars[1]["skipped"] == 0.0 and scalars[1]["loss"] == pytest.approx(step.loss, rel=1e-6)
    assert scalars[1]["compression"] == pytest.approx(step.compression, rel=1e-6)
    assert "ratio_mean" in scalars[1] and "entropy" not in scalars[1]  # only what applies


def test_load_weights_replaces_the_weights_and_the_master_copy(checkpoint, trajectories, tmp_path):
    """A trained checkpoint loaded into a live trainer gives its weights exactly; in bfloat16 the
    optimizer's float32 master copy follows (saved with the state), the moments and count stay;
    another model's checkpoint is refused naming the field."""
    model, directory = checkpoint
    trained = dta.Trainer(directory, dtype="float64", lr=1e-2)
    trained.train_batch(trajectories, "grpo")
    trained.save(tmp_path / "trained", dtype=None, optimizer=False)
    live = dta.Trainer(directory, dtype="float64", lr=1e-2)
    live.train_batch(trajectories[:3], "sft")
    live.load_weights(tmp_path / "trained" / "model")
    for name, p in live.parameters().items():
        assert torch.equal(p.detach(), trained.parameters()[name].detach()), name
    assert live.step_count == 1

    low = dta.Trainer(directory, dtype="bfloat16", lr=1e-2)
    low.train_batch(trajectories, "grpo")  # the master copy exists from here on
    low.load_weights(directory)
    low.save(tmp_path / "low", dtype=None)
    from safetensors.torch import load_file
    state = load_file(tmp_path / "low" / "optimizer" / "optimizer.safetensors")
    for name, p in model.named_parameters():
        assert torch.equal(state[f"{name}.master"], p.detach().to(torch.bfloat16).float()), name
        assert torch.equal(low.parameters()[name].detach(), p.detach().to(torch.bfloat16)), name
    assert state["model.norm.weight.exp_avg"].abs().sum() > 0  # the moments stayed

    other = copy.deepcopy(model.config)
    other.rms_norm_eps = 1e-5
    Qwen3ForCausalLM(other).save_pretrained(tmp_path / "other", safe_serialization=True)
    with pytest.raises(RuntimeError, match="rms_norm_eps 1e-05, the model's 1e-06"):
        live.load_weights(tmp_path / "other")
    with pytest.raises(FileNotFoundError):
        live.load_weights(tmp_path / "missing")


def test_from_config_and_properties():
    trainer = dta.Trainer.from_config(TINY_CONFIG, seed=3, dtype="float32")
    assert trainer.vocab_size == 1024 and trainer.config["num_hidden_layers"] == 2
    assert trainer.dtype == torch.float32 and trainer.device == torch.device("cpu")
    again = dta.Trainer.from_config(TINY_CONFIG, seed=3)
    other = dta.Trainer.from_config(TINY_CONFIG, seed=4)
    name = "model.embed_tokens.weight"
    assert torch.equal(trainer.parameters()[name], again.parameters()[name])
    assert not torch.equal(trainer.parameters()[name], other.parameters()[name])
    trainer.lr = 0.5
    assert trainer.lr == 0.5


def test_presets_and_families_come_from_the_registry():
    presets = dta.Trainer.presets()
    assert {"qwen3-0.6b", "qwen3-8b", "llama-3.1-8b", "qwen3-30b-a3b", "qwen3-next-small"} <= set(presets)
    assert len(presets) == len(set(presets))
    families = dta.Trainer.model_families()
    assert families == sorted(families) and {"qwen3", "qwen2", "llama", "qwen3_moe", "qwen3_next", "qwen3_5_text",
                                             "qwen3_5_moe_text"} <= set(families)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: this checks the error without one")
def test_a_gpu_device_without_a_visible_gpu_says_so(checkpoint):
    """CUDA's own error (from the driver, at the first allocation) does not say that no GPU is
    visible; the trainer does, before loading anything, with the environment that decides it."""
    want = r"device='cuda(:0)?' but no GPU is visible to this process \(torch.cuda.is_available\(\) is False; "
    for device in ("cuda", "cuda:0", torch.device("cuda")):
        with pytest.raises(RuntimeError, match=want + "CUDA_VISIBLE_DEVICES"):
            dta.Trainer.from_config(TINY_CONFIG, device=device)
        with pytest.raises(RuntimeError, match=want):
            dta.Trainer(checkpoint[1], device=device)


def test_a_gpu_index_that_is_not_visible_names_the_visible_ones(checkpoint, monkeypatch):
    """As seen from a process with two visible GPUs (whether or not this machine has any): an index
    past them, given or LOCAL_RANK's under distributed=True, is refused before CUDA is touched."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(RuntimeError, match=r"device='cuda:2': GPU 2 is not visible: this process sees 2 GPUs "
                                           r"\(cuda:0 to cuda:1; CUDA_VISIBLE_DEVICES='4,5'\)"):
        dta.Trainer.from_config(TINY_CONFIG, device="cuda:2")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(RuntimeError, match=r"device='cuda' \(cuda:LOCAL_RANK, LOCAL_RANK=3\): GPU 3 is not visible"):
        dta.Trainer.from_config(TINY_CONFIG, device="cuda", distributed=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError, match=r"no GPU is visible .*CUDA_VISIBLE_DEVICES is unset"):
        dta.Trainer(checkpoint[1], device="cuda:1")


def test_an_lr_schedule_sets_each_steps_rate_and_resumes_on_its_curve(tmp_path):
    """A cosine schedule with warmup: each train_batch reports (and uses) peak x factor(step); the
    update is AdamW's at that rate (the same step taken with the rate set by hand); a trainer resumed
    from a checkpoint continues on the curve; bad schedules are refused naming the field."""
    def factor(s: int) -> float:  # warmup 2, cosine to 0.1 at step 6
        if s < 2:
            return (s + 1) / 2
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - 2) / 4)))

    rng = random.Random(5)
    batch = [dta.Trajectory(id=f"r{i}", tokens=[rng.randrange(1024) for _ in range(9)], loss_mask=[0] + [1] * 8,
                            logprobs=[0.0] + [-1.0] * 8, advantages=[0.5 - i] * 9) for i in range(3)]
    scheduled = dta.Trainer.from_config(TINY_CONFIG, dtype="float64", lr=0.01, max_grad_norm=0)
    scheduled.set_lr_schedule("cosine", warmup_steps=2, decay_steps=6, min_lr_ratio=0.1)
    by_hand = dta.Trainer.from_config(TINY_CONFIG, dtype="float64", lr=0.01, max_grad_norm=0)
    for s in range(8):
        if s == 3:
            scheduled.save(tmp_path / "ckpt", dtype=None)
            scheduled = dta.Trainer(tmp_path / "ckpt" / "model", dtype="float64", lr=0.01, max_grad_norm=0)
            scheduled.load_optimizer(tmp_path / "ckpt")
            scheduled.set_lr_schedule("cosine", warmup_steps=2, decay_steps=6, min_lr_ratio=0.1)
        stats = scheduled.train_batch(batch, "grpo")
        assert stats.lr == pytest.approx(0.01 * factor(s), rel=1e-15), s
        by_hand.lr = 0.01 * factor(s)
        assert by_hand.train_batch(batch, "grpo").lr == stats.lr
        for name, p in by_hand.parameters().items():
            assert torch.equal(scheduled.parameters()[name], p), (s, name)
    for args, field in [(("step",), "not constant, linear or cosine"), (("cosine",), "field 'total_steps'"),
                        (("linear",), "field 'total_steps'")]:
        with pytest.raises(ValueError, match=field):
            scheduled.set_lr_schedule(*args, warmup_steps=3, decay_steps=3)
    with pytest.raises(ValueError, match="field 'min_lr_ratio'"):
        scheduled.set_lr_schedule("constant", min_lr_ratio=2)


# --- threads and errors -----------------------------------------------------------------------------


def test_long_calls_release_the_gil():
    trainer = dta.Trainer.from_config(TINY_CONFIG)
    rng = random.Random(3)
    batch = [dta.Trajectory(id=str(i), tokens=[rng.randrange(1024) for _ in range(600)], loss_mask=[0] * 600,
                            logprobs=[0.0] * 600) for i in range(8)]
    ticks = 0
    done = threading.Event()

    def count():
        nonlocal ticks
        while not done.is_set():
            ticks += 1

    thread = threading.Thread(target=count)
    thread.start()
    time.sleep(0.05)
    try:
        start_ticks = ticks
        start = time.perf_counter()
        trainer.compute_logprobs(batch, "dense")
        elapsed = time.perf_counter() - start
        during = ticks - start_ticks
    finally:
        done.set()
        thread.join()
    # Holding the GIL for the whole call would leave the counter at (about) zero.
    assert elapsed > 0.05 and during > 1000, (elapsed, during)


_PROGRESS_SCRIPT = """
import random, sys, time
import dta
trainer = dta.Trainer.from_config(sys.argv[1], progress="never")
rng = random.Random(0)
def batch(n):
    return [dta.Trajectory(id=str(i), tokens=[rng.randrange(1024) for _ in range(512)], loss_mask=[0] * 512,
                           logprobs=[0.0] * 512) for i in range(n)]
trainer.compute_logprobs(batch(2), "dense")  # warm up, so that the timing below is not the first call's
start = time.perf_counter()
trainer.compute_logprobs(batch(4), "dense")
per_rollout = (time.perf_counter() - start) / 4
trainer.progress = sys.argv[2]
size = max(8, int(4.0 / per_rollout))  # about 4 s: past the 2 s delay
for _ in range(4):  # a loaded machine can make the estimate short: grow until one call lasts 3 s
    start = time.perf_counter()
    trainer.compute_logprobs(batch(size), "dense")
    if time.perf_counter() - start >= 3.0:
        break
    size *= 2
print("done", trainer.progress)
"""


@pytest.mark.parametrize("mode", ["auto", "never"])
def test_progress_lines_on_a_terminal(mode):
    """A call of about 4 s on a terminal (a pty as stderr) shows the progress line with its rate,
    unless progress="never"."""
    import os
    import pty
    import subprocess
    import sys

    master, terminal = pty.openpty()
    child = subprocess.Popen([sys.executable, "-c", _PROGRESS_SCRIPT, TINY_CONFIG, mode], stdout=subprocess.PIPE,
                             stderr=terminal)
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0 and out.decode().strip() == f"done {mode}", (out, shown)
    if mode == "never":
        assert b"dta.Trainer" not in shown, shown
    else:
        assert b"dta.Trainer: compute_logprobs: " in shown and b"tokens/s" in shown and b"ETA" in shown, shown
    with pytest.raises(ValueError, match="progress must be"):
        dta.Trainer.from_config(TINY_CONFIG, progress="sometimes")


def test_bad_input_names_the_trajectory_and_field(checkpoint, trajectories, tmp_path):
    trainer = dta.Trainer(checkpoint[1], dtype="float64")
    bad = dataclasses.replace(trajectories[2], tokens=[VOCAB] + trajectories[2].tokens[1:])
    with pytest.raises(ValueError, match=rf"trajectory 1 \('{bad.id}'\): field 'tokens': token 0 = {VOCAB}"):
        trainer.compute_gradients([trajectories[0], bad], "sft")
    unrewarded = dataclasses.replace(trajectories[0], reward=None)
    with pytest.raises(ValueError, match=r"trajectory 0 .*field 'reward': missing"):
        trainer.train_batch([unrewarded], "grpo")
    assert trainer.compute_gradients([unrewarded], "sft").loss > 0  # SFT needs no reward
    with pytest.raises(TypeError, match="unknown option 'eps_clip'"):
        trainer.compute_gradients(trajectories, "grpo", eps_clip=0.1)
    with pytest.raises(ValueError, match="loss must be one of"):
        trainer.compute_gradients(trajectories, "dpo")
    with pytest.raises(ValueError, match="method must be one of"):
        trainer.compute_gradients(trajectories, "sft", "tree")
    with pytest.raises(TypeError, match="expected dta.Trajectory"):
        trainer.compute_gradients([{"id": "x"}], "sft")
    with pytest.raises(FileNotFoundError):
        dta.Trainer(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError, match="config.json"):
        dta.Trainer(tmp_path / "empty")
    with pytest.raises(ValueError, match="dtype must be"):
        dta.Trainer(checkpoint[1], dtype="float16")


def test_a_batch_that_trains_nothing_or_repeats_an_id_is_refused_without_a_step(checkpoint, trajectories):
    """An empty batch, one whose every loss_mask is 0, and one with an id twice are refused with
    a ValueError naming why; the optimizer takes no step and the weights stay as they were."""
    trainer = dta.Trainer(checkpoint[1], dtype="float64", lr=1e-2)
    before = {name: p.detach().clone() for name, p in trainer.parameters().items()}
    masked = [dataclasses.replace(t, loss_mask=[0] * len(t.tokens)) for t in trajectories]
    twice = [trajectories[0], trajectories[1], dataclasses.replace(trajectories[2], id=trajectories[0].id)]
    for batch, message in [([], "the batch is empty"),
                           (masked, f"no trajectory of the {len(masked)} has a trained token"),
                           (twice, rf"trajectory 2 \('{trajectories[0].id}'\): field 'id': the same id as trajectory 0")]:
        for loss in ("grpo", "sft"):
            with pytest.raises(ValueError, match=message):
                trainer.train_batch(batch, loss)
    with pytest.raises(ValueError, match="field 'id'"):
        trainer.compute_logprobs(twice)
    assert trainer.compute_logprobs([]) == []
    assert trainer.step_count == 0
    for name, p in trainer.parameters().items():
        assert torch.equal(p.detach(), before[name]), name
    assert trainer.train_batch(trajectories, "grpo").step == 1  # the same trainer still trains



def test_executor_defaults_are_the_cpp_structs():
    """dta.ExecutorOptions takes its defaults from dta::ExecutorOptions (test_train_cli.py checks
    the binaries' flags against it)."""
    from dta import trainer

    core = trainer._core.ExecutorOptions()
    converted = trainer.ExecutorOptions()._to_core(trainer.DEFAULT_METHOD)
    # dta packs by default (the fastest on a GPU, docs/benchmarks.md), here as in C++.
    assert core.pack is True and trainer.ExecutorOptions().pack is True
    assert trainer.ExecutorOptions(pack=False)._to_core("dta").pack is False
    for name in ("method", "block_size", "graph_budget", "memory_budget", "pack", "order", "token_capacity",
                 "checkpointing", "logprob_slice_rows", "unshared_prefix_fraction"):
        assert getattr(converted, name) == getattr(core, name), name
    with pytest.raises(ValueError, match="unshared_prefix_fraction must be >= 0 and finite, got -0.5"):
        trainer.ExecutorOptions(unshared_prefix_fraction=-0.5)._to_core("dta")
    budget = trainer.ExecutorOptions(memory_budget=1.5)._to_core("dta")
    assert budget.memory_budget == 3 * 2**29
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="memory_budget must be >= 0 GiB"):
            trainer.ExecutorOptions(memory_budget=bad)._to_core("dta")


def test_router_aux_loss_through_the_trainer(checkpoint, trajectories, tmp_path):
    """LossOptions.router_aux_loss_coef reaches the executor: on a Qwen3-MoE checkpoint the step's
    router_aux_loss is the mean of transformers' per-rollout aux_loss and the loss grows by coef
    times it; a dense model refuses the option, naming it."""
    from test_hf_parity_families import exact_float64 as families_exact, float64_router_loss, random_model as moe_model
    model = moe_model("qwen3moe-norm")
    directory = tmp_path / "moe"
    model.save_pretrained(directory, safe_serialization=True)
    tokens = list(trajectories)
    with families_exact(), float64_router_loss(), torch.no_grad():
        model64 = copy.deepcopy(model).to(torch.float64)
        want = sum(model64(input_ids=torch.tensor(t.tokens)[None], output_router_logits=True).aux_loss.item()
                   for t in tokens) / len(tokens)
    trainer = dta.Trainer(str(directory), dtype="float64")
    plain = trainer.compute_gradients(tokens, "grpo", "dta", block_size=3)
    balanced = trainer.compute_gradients(tokens, "grpo", "dta", block_size=3, router_aux_loss_coef=0.5)
    assert plain.router_aux_loss == 0
    assert balanced.router_aux_loss == pytest.approx(want, rel=1e-10)
    assert balanced.loss == pytest.approx(plain.loss + 0.5 * want, rel=1e-10)
    with pytest.raises(RuntimeError, match="router_aux_loss_coef = 0.5 but the model .* has no mixture-of-experts"):
        dta.Trainer(checkpoint[1], dtype="float64").compute_gradients(trajectories, "grpo", router_aux_loss_coef=0.5)


def test_gate_and_up_are_stacked_views_that_save_and_train_as_two():
    """A dense MLP's gate_proj and up_proj are views of one tensor (one GEMM for both), as
    Trainer.parameters says; each is still its own parameter, written alone and with a gradient
    of its own."""
    trainer = dta.Trainer.from_config(str(Path(__file__).resolve().parents[2] / "examples" / "configs" /
                                          "qwen3-tiny.json"), dtype="float32", device="cpu", progress="never")
    params = trainer.parameters()
    gate, up = params["model.layers.0.mlp.gate_proj.weight"], params["model.layers.0.mlp.up_proj.weight"]
    assert gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
    assert up.data_ptr() == gate.data_ptr() + gate.numel() * gate.element_size()
    before = up.detach().clone()
    with torch.no_grad():
        gate.fill_(0.5)
    assert torch.equal(up, before) and bool((gate == 0.5).all())
    rng = random.Random(2)
    batch = [dta.Trajectory(id=f"r{i}", group="g", tokens=[rng.randrange(1024) for _ in range(9)],
                            loss_mask=[0] + [1] * 8, logprobs=[-1.0] * 9, reward=float(i)) for i in range(3)]
    trainer.compute_gradients(batch, "grpo", "dta")
    grads = trainer.gradients()
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        assert grads[name].shape == params[name].shape and grads[name].abs().sum() > 0, name

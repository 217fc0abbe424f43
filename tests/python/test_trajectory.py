"""dta.Trajectory: validation (the C++ ValidateRollout's rules, errors naming the field), JSON Lines
files (round trips, compatibility with the C++ reader and writer, errors naming file and line),
AReaL's tensor dicts in both of its conventions (aligned with the tokens, and shifted by PPOActor's
torch.roll) and verl's DataProto batches (left-padded prompts, right-padded responses,
response-aligned tensors), including bad inputs."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import subprocess
import types
from pathlib import Path

import numpy as np

import pytest
import torch

import dta
from dta import Trajectory, from_areal, from_verl, read_jsonl, to_areal, to_verl, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def tool(name: str) -> Path:
    path = Path(os.environ.get("DTA_BUILD_DIR", REPO / "build")) / "bin" / name
    if not path.exists():
        pytest.fail(f"{path} does not exist: build it with scripts/build.sh (or set DTA_BUILD_DIR)")
    return path


def f32(x: float) -> float:
    """x rounded to float32, as the C++ core and the wire store per-token floats."""
    return torch.tensor(x, dtype=torch.float32).item()


def full(seed: int = 0, length: int = 9) -> Trajectory:
    """A trajectory with every field set; floats exactly representable in float32."""
    rng = random.Random(seed)
    prompt = rng.randrange(1, length - 1)
    return Trajectory(
        id=f"t{seed}", group=f"g{seed % 2}",
        tokens=[rng.randrange(1000) for _ in range(length)],
        loss_mask=[0] * prompt + [int(rng.random() < 0.8) for _ in range(length - prompt)],
        logprobs=[0.0] * prompt + [f32(-rng.random() * 5) for _ in range(length - prompt)],
        versions=[-1] * prompt + [rng.randrange(4) for _ in range(length - prompt)],
        reward=rng.choice([0.0, 1.0, 0.25]),
        advantages=[f32(rng.gauss(0, 1)) for _ in range(length)],
        ref_logprobs=[f32(-rng.random() * 5) for _ in range(length)],
        metadata={"task": str(seed), "turn": "2"})


# --- validation -------------------------------------------------------------------------------------


def test_valid_trajectories_pass():
    full(1).validate()
    full(2).validate(vocab_size=1000)
    Trajectory(id="one", tokens=[5], loss_mask=[0], logprobs=[0.0]).validate()
    Trajectory(id="bools", tokens=[5, 6], loss_mask=[False, True], logprobs=[0, -1]).validate()


BAD = [
    # (change, field, words in the message)
    ({"id": ""}, "id", "empty"),
    ({"id": 7}, "id", "string"),
    ({"group": None}, "group", "string"),
    ({"tokens": [], "loss_mask": [], "logprobs": []}, "tokens", "empty"),
    ({"tokens": [1, -2, 3, 4, 5, 6, 7, 8, 9]}, "tokens", "token 1 = -2"),
    ({"tokens": [1, 2, 3, 2**31, 5, 6, 7, 8, 9]}, "tokens", "2^31"),
    ({"tokens": [1, 2, 3, 4.0, 5, 6, 7, 8, 9]}, "tokens", "value 3 is not an integer"),
    ({"loss_mask": [0, 1]}, "loss_mask", "2 values for 9 tokens"),
    ({"logprobs": [0.0] * 10}, "logprobs", "10 values for 9 tokens"),
    ({"versions": [0] * 3}, "versions", "3 values for 9 tokens"),
    ({"advantages": [0.0] * 8}, "advantages", "8 values for 9 tokens"),
    ({"ref_logprobs": [0.0]}, "ref_logprobs", "1 values for 9 tokens"),
    ({"logprobs": [0.0] * 4 + [math.nan] + [0.0] * 4}, "logprobs", "value 4 is not finite"),
    ({"advantages": [0.0] * 8 + [math.inf]}, "advantages", "value 8 is not finite"),
    ({"ref_logprobs": [1e39] + [0.0] * 8}, "ref_logprobs", "value 0 is not finite"),  # inf in float32
    ({"logprobs": ["x"] * 9}, "logprobs", "not a number"),
    ({"loss_mask": [0, 1, 2, 1, 1, 1, 1, 1, 1]}, "loss_mask", "value 2 is 2, not 0 or 1"),
    ({"loss_mask": [1] * 9}, "loss_mask", "first token has no context"),
    ({"versions": [-1, -2] + [0] * 7}, "versions", "value 1 is -2 (must be >= -1)"),
    ({"versions": [-1, 2**31] + [0] * 7}, "versions", "value 1 is 2147483648 (must be < 2^31)"),
    ({"tokens": None}, "tokens", "must be a list, got NoneType"),
    ({"logprobs": 5}, "logprobs", "must be a list, got int"),
    ({"reward": math.nan}, "reward", "not finite"),
    ({"reward": -1e308}, "reward", "-1e+308 is beyond the limit of +-1e+30"),
    ({"reward": "1"}, "reward", "number"),
    ({"metadata": {"a": 1}}, "metadata", "strings"),
]


@pytest.mark.parametrize("change,field,words", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_invalid_trajectories_name_the_field(change, field, words):
    t = dataclasses.replace(full(3), **change)
    with pytest.raises(ValueError) as e:
        t.validate()
    assert str(e.value).startswith(f"field '{field}': "), str(e.value)
    assert words in str(e.value)


# --- torch tensors ---------------------------------------------------------------------------------


def tensor_form(t: Trajectory, **dtypes: torch.dtype) -> Trajectory:
    """t with its per-token fields as 1-D tensors (int64 / float32 unless dtypes says otherwise)."""
    kinds = {"tokens": torch.int64, "loss_mask": torch.int64, "versions": torch.int64, "logprobs": torch.float32,
             "advantages": torch.float32, "ref_logprobs": torch.float32}
    return dataclasses.replace(t, **{name: torch.tensor(getattr(t, name), dtype=dtypes.get(name, dtype))
                                     for name, dtype in kinds.items()})


@pytest.mark.parametrize("dtypes", [
    {},
    {"tokens": torch.int32, "loss_mask": torch.bool, "versions": torch.int16, "logprobs": torch.float64},
    {"tokens": torch.int16, "loss_mask": torch.uint8, "versions": torch.int32, "advantages": torch.bfloat16,
     "ref_logprobs": torch.float16},
], ids=["int64-float32", "int32-bool-float64", "int16-uint8-half"])
def test_tensor_fields_are_accepted_as_their_values(dtypes):
    """Integer tensors for tokens and versions, integer or bool for loss_mask, floating for the
    float fields: the trajectory is what the same values as lists make it."""
    t = full(5)
    if "advantages" in dtypes:  # values a half-precision tensor holds exactly
        t = dataclasses.replace(t, advantages=[round(x * 4) / 4 for x in t.advantages],
                                ref_logprobs=[round(x * 4) / 4 for x in t.ref_logprobs])
    tensors = tensor_form(t, **dtypes)
    tensors.validate(vocab_size=1000)
    assert tensors.to_dict() == t.to_dict()
    assert Trajectory.from_dict(tensors.to_dict()) == t
    for shifted in (False, True):
        got = from_areal(to_areal(tensors, shifted=shifted), id=t.id, group=t.group, shifted=shifted)
        assert got == dataclasses.replace(t, metadata={})
    want = to_verl([t])
    for key, value in to_verl([tensors]).items():
        assert (torch.equal(value, want[key]) if torch.is_tensor(value) else value.tolist() == want[key].tolist()), key


BAD_TENSORS = [
    ({"tokens": torch.arange(9.0)}, "tokens", "must hold integers, got a torch.float32 tensor"),
    ({"tokens": torch.ones(9, dtype=torch.bool)}, "tokens", "must hold integers, got a torch.bool tensor"),
    ({"tokens": torch.arange(9)[None]}, "tokens", "expected a 1-D tensor, got a tensor of shape [1, 9]"),
    ({"tokens": torch.tensor(3)}, "tokens", "expected a 1-D tensor, got a tensor of shape []"),
    ({"tokens": torch.tensor([1, 2, -3, 4, 5, 6, 7, 8, 9], dtype=torch.int8)}, "tokens", "token 2 = -3 is outside"),
    ({"tokens": torch.tensor([1, 2, 3, 2**31, 5, 6, 7, 8, 9])}, "tokens", "token 3 = 2147483648 is outside"),
    ({"versions": torch.zeros(9)}, "versions", "must hold integers, got a torch.float32 tensor"),
    ({"versions": torch.tensor([-1, -2] + [0] * 7)}, "versions", "value 1 is -2 (must be >= -1)"),
    ({"versions": torch.tensor([-1] + [0] * 7 + [2**31])}, "versions", "value 8 is 2147483648 (must be < 2^31)"),
    ({"loss_mask": torch.tensor([0.0] + [1.0] * 8)}, "loss_mask",
     "must hold integers or booleans, got a torch.float32 tensor"),
    ({"loss_mask": torch.tensor([0, 1, 2, 1, 1, 1, 1, 1, 1])}, "loss_mask", "value 2 is 2, not 0 or 1"),
    ({"loss_mask": torch.ones(9, dtype=torch.bool)}, "loss_mask", "value 0 is 1, but the first token"),
    ({"logprobs": torch.zeros(9, dtype=torch.bool)}, "logprobs",
     "must hold floating-point numbers or integers, got a torch.bool tensor"),
    ({"advantages": torch.zeros(9, dtype=torch.complex64)}, "advantages", "got a torch.complex64 tensor"),
    ({"ref_logprobs": torch.zeros(3, 3)}, "ref_logprobs", "expected a 1-D tensor, got a tensor of shape [3, 3]"),
    ({"logprobs": torch.tensor([0.0] * 4 + [math.nan] + [0.0] * 4)}, "logprobs", "value 4 is not finite"),
    ({"advantages": torch.tensor([0.0] * 8 + [1e39], dtype=torch.float64)}, "advantages", "value 8 is not finite"),
    ({"logprobs": torch.zeros(10)}, "logprobs", "10 values for 9 tokens"),
]


@pytest.mark.parametrize("change,field,words", BAD_TENSORS, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD_TENSORS)])
def test_bad_tensor_fields_name_the_field_and_the_type(change, field, words):
    t = dataclasses.replace(tensor_form(full(3)), **change)
    with pytest.raises(ValueError) as e:
        t.validate()
    assert str(e.value).startswith(f"field '{field}': "), str(e.value)
    assert words in str(e.value), str(e.value)


def test_tensors_take_the_validated_path_and_plain_lists_the_fast_one():
    """dta._core's one-pass check converts plain lists itself and leaves tensors (and numpy arrays)
    to Trajectory.validate; converting a validated tensor trajectory gives the list form's rollout."""
    from dta import _core

    lists = full(1)
    batch = [lists, tensor_form(full(2), tokens=torch.int32, loss_mask=torch.bool), full(3),
             dataclasses.replace(full(4), tokens=np.array(full(4).tokens))]
    converted = _core.convert_checked(batch, 0, Trajectory)
    assert list(converted.unchecked) == [1, 3]
    assert _core.first_unchecked_trajectory(batch, 0, 0, Trajectory) == 1


def test_trainer_trains_tensor_trajectories_as_their_lists():
    """dta.Trainer.train_batch on tensor fields: the loss, gradients and step of the same values as
    lists (float64, so any difference in the values would show)."""
    config = str(REPO / "examples" / "configs" / "qwen3-tiny.json")
    lists = [full(seed, length=5 + seed) for seed in range(5)]
    tensors = [tensor_form(t, tokens=torch.int32, loss_mask=torch.bool, logprobs=torch.float64) for t in lists]
    by_lists = dta.Trainer.from_config(config, seed=2, dtype="float64", lr=1e-3)
    by_tensors = dta.Trainer.from_config(config, seed=2, dtype="float64", lr=1e-3)
    want = by_lists.train_batch(lists, loss="grpo", method="dta")
    got = by_tensors.train_batch(tensors, loss="grpo", method="dta")
    assert got.loss == want.loss and got.grad_norm == want.grad_norm
    for name, p in by_lists.parameters().items():
        assert torch.equal(by_tensors.parameters()[name], p), name
    for g, w in zip(by_tensors.compute_logprobs(tensors), by_lists.compute_logprobs(lists)):
        assert torch.equal(g, w)
    with pytest.raises(ValueError, match=r"trajectory 1 \('t1'\): field 'tokens': must hold integers, got a "
                                         r"torch.float64 tensor"):
        by_tensors.train_batch([lists[0], dataclasses.replace(tensors[1], tokens=tensors[1].tokens.double())])
    assert by_tensors.step_count == 1


def test_vocab_size_bounds_tokens():
    t = full(4)
    t.validate(vocab_size=max(t.tokens) + 1)
    with pytest.raises(ValueError, match=rf"field 'tokens': token \d+ = {max(t.tokens)} is outside \[0, "
                                         rf"{max(t.tokens)}\)"):
        t.validate(vocab_size=max(t.tokens))


# --- JSON Lines ---------------------------------------------------------------------------------


def test_jsonl_round_trip(tmp_path):
    trajectories = [full(i, length=5 + i) for i in range(6)]
    trajectories.append(Trajectory(id="minimal", tokens=[3, 4], loss_mask=[0, 1], logprobs=[0.0, -0.5]))
    path = tmp_path / "t.jsonl"
    write_jsonl(path, trajectories)
    assert read_jsonl(path) == trajectories
    assert len(path.read_text().splitlines()) == len(trajectories)
    # Optional fields are written only when set.
    last = json.loads(path.read_text().splitlines()[-1])
    assert sorted(last) == ["group", "id", "logprobs", "loss_mask", "tokens"]


def test_jsonl_accepts_what_the_cpp_reader_accepts(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": 17, "group": 3, "tokens": [1, 2], "loss_mask": [false, true], "logprobs": [0, -1],'
                    ' "metadata": {"k": [1, 2], "s": "v"}}\n\n   \n'
                    '{"group": "g", "tokens": [5], "loss_mask": [0], "logprobs": [0.5], "id": "b"}\n')
    a, b = read_jsonl(path)
    assert a == Trajectory(id="17", group="3", tokens=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0],
                           metadata={"k": "[1, 2]", "s": "v"})
    assert isinstance(a.logprobs[1], float)
    assert b.id == "b" and b.group == "g"


@pytest.mark.parametrize("line,words", [
    ('{"id": "a", "group": "g", "tokens": [1, 2], "loss_mask": [0, 1]', ["malformed JSON"]),
    ('{"id": "a", "group": "g", "tokens": [1, 2], "loss_mask": [0, 1], "logprobs": [0, 0], "rewrd": 1}',
     ["rollout 'a':", "field 'rewrd': unknown field"]),
    ('{"id": "a", "tokens": [1, 2], "loss_mask": [0, 1], "logprobs": [0, 0]}', ["rollout 'a':", "field 'group': missing"]),
    ('{"id": "a", "group": "g", "tokens": [1, 2], "loss_mask": [0, 1, 1], "logprobs": [0, 0]}',
     ["rollout 'a':", "field 'loss_mask': 3 values for 2 tokens"]),
    ('{"id": "a", "group": "g", "tokens": 5, "loss_mask": [0], "logprobs": [0]}', ["field 'tokens': must be an array"]),
    ('{"id": 1.5, "group": "g", "tokens": [1], "loss_mask": [0], "logprobs": [0]}',
     ["field 'id': must be a string or an integer"]),
    ('[1, 2]', ["a rollout must be a JSON object"]),
])
def test_jsonl_errors_name_file_line_rollout_and_field(tmp_path, line, words):
    path = tmp_path / "bad.jsonl"
    good = '{"id": "ok", "group": "g", "tokens": [1, 2], "loss_mask": [0, 1], "logprobs": [0, -1]}'
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(ValueError) as e:
        read_jsonl(path)
    assert str(e.value).startswith(f"{path}:3:"), str(e.value)
    for w in words:
        assert w in str(e.value)


def test_jsonl_duplicate_ids_and_vocab(tmp_path):
    path = tmp_path / "dup.jsonl"
    line = '{"id": "x", "group": "g", "tokens": [1, 900], "loss_mask": [0, 1], "logprobs": [0, -1]}\n'
    path.write_text(line + line)
    with pytest.raises(ValueError, match=r"dup.jsonl:2: rollout 'x': field 'id': duplicate of line 1"):
        read_jsonl(path)
    path.write_text(line)
    with pytest.raises(ValueError, match=r":1: rollout 'x': field 'tokens': token 1 = 900"):
        read_jsonl(path, vocab_size=900)
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "missing.jsonl")


def test_write_jsonl_refuses_invalid_and_duplicates(tmp_path):
    path = tmp_path / "out.jsonl"
    bad = dataclasses.replace(full(1), loss_mask=[1] * 9)
    with pytest.raises(ValueError, match=r"trajectory 1 \('t1'\): field 'loss_mask'"):
        write_jsonl(path, [full(0), bad])
    with pytest.raises(ValueError, match=r"trajectory 1 \('t0'\): field 'id': duplicate"):
        write_jsonl(path, [full(0), full(0)])
    assert not path.exists()


def test_jsonl_is_the_cpp_tools_format(tmp_path):
    """A file from dta-workload reads here; written back, dta-tree sees the same batch."""
    generated = tmp_path / "workload.jsonl"
    run = subprocess.run([tool("dta-workload"), "--preset=tau2", "--seed=3", "--scale=0.02", "--vocab_size=1024",
                          f"--out={generated}"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    trajectories = read_jsonl(generated, vocab_size=1024)
    assert len(trajectories) > 5
    assert all(t.reward is not None and t.versions for t in trajectories)
    rewritten = tmp_path / "rewritten.jsonl"
    write_jsonl(rewritten, trajectories)
    assert read_jsonl(rewritten) == trajectories

    def tree_json(path: Path) -> dict:
        out = subprocess.run([tool("dta-tree"), "--json", str(path)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["tree"]

    assert tree_json(rewritten) == tree_json(generated)
    # And dta.PrefixTree agrees with dta-tree.
    stats = dta.PrefixTree(trajectories).stats()
    tree = tree_json(generated)
    assert (stats.rollout_tokens, stats.tree_tokens) == (tree["rollout_tokens"], tree["tree_tokens"])


# --- AReaL ------------------------------------------------------------------------------------------


def areal_rollout(t: Trajectory) -> dict[str, torch.Tensor]:
    """What AReaL's RLVR workflow builds for one sample (areal/workflow/rlvr.py), independently."""
    return {
        "input_ids": torch.tensor(t.tokens).unsqueeze(0),
        "loss_mask": torch.tensor(t.loss_mask).unsqueeze(0),
        "logprobs": torch.tensor(t.logprobs).unsqueeze(0),
        "versions": torch.tensor(t.versions).unsqueeze(0),
        "attention_mask": torch.ones(len(t.tokens), dtype=torch.bool).unsqueeze(0),
        "rewards": torch.tensor([float(t.reward)]),
    }


def areal_shift(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PPOActor.compute_advantages' shift of loss_mask and logprobs to the logits' positions."""
    out = dict(d)
    for key in ("loss_mask", "logprobs"):
        out[key] = torch.roll(d[key], shifts=-1, dims=-1)
    return out


def without_extras(t: Trajectory) -> Trajectory:
    return dataclasses.replace(t, advantages=[], ref_logprobs=[], metadata={})


@pytest.mark.parametrize("shifted", [False, True], ids=["aligned", "shifted"])
def test_areal_round_trip(shifted):
    for seed in range(5):
        t = full(seed, length=3 + 4 * seed)
        d = to_areal(t, shifted=shifted)
        for key in ("input_ids", "loss_mask", "logprobs", "versions", "attention_mask", "advantages", "ref_logp"):
            assert d[key].shape == (1, len(t.tokens)), key
        assert d["rewards"].shape == (1,)
        assert d["input_ids"].dtype == torch.int64 and d["logprobs"].dtype == torch.float32
        assert from_areal(d, id=t.id, group=t.group, shifted=shifted) == dataclasses.replace(t, metadata={})


def test_from_areal_converts_every_dtype_as_int_and_float_do():
    """from_areal converts through the tensors (a cast, then tolist); the values must be those of
    int() and float() of each element, for the dtypes AReaL and users hand over."""
    gen = torch.Generator().manual_seed(3)
    n = 40
    ids = torch.randint(0, 1000, (1, n), generator=gen)
    mask = torch.rand(1, n, generator=gen) < 0.5
    mask[0, 0] = False
    logprobs = -torch.rand(1, n, generator=gen, dtype=torch.float64) * 5
    for ids_dtype, mask_dtype, float_dtype in [(torch.int64, torch.bool, torch.float32),
                                               (torch.int32, torch.float32, torch.bfloat16),
                                               (torch.int16, torch.int64, torch.float16),
                                               (torch.uint8, torch.uint8, torch.float64)]:
        d = {"input_ids": (ids % 256).to(ids_dtype), "loss_mask": mask.to(mask_dtype),
             "logprobs": logprobs.to(float_dtype), "versions": torch.where(mask, 3.0, -1.0).to(float_dtype),
             "advantages": (logprobs * -0.3).to(float_dtype), "ref_logp": (logprobs * 1.1).to(float_dtype)}
        t = from_areal(d, id="x", shifted=False)
        expected = Trajectory(id="x", tokens=[int(v) for v in d["input_ids"][0].tolist()],
                              loss_mask=[int(v) for v in d["loss_mask"][0].tolist()],
                              logprobs=[float(v) for v in d["logprobs"][0].tolist()],
                              versions=[int(v) for v in d["versions"][0].tolist()],
                              advantages=[float(v) for v in d["advantages"][0].tolist()],
                              ref_logprobs=[float(v) for v in d["ref_logp"][0].tolist()])
        assert t == expected, (ids_dtype, mask_dtype, float_dtype)
        for name in ("tokens", "loss_mask", "logprobs", "versions", "advantages", "ref_logprobs"):
            kinds = {type(v) for v in getattr(t, name)}
            assert kinds == ({int} if name in ("tokens", "loss_mask", "versions") else {float}), (name, kinds)


def test_areal_conventions_match_areals_own_tensors():
    t = without_extras(full(7, length=12))
    workflow = areal_rollout(t)
    for key, value in workflow.items():
        assert torch.equal(to_areal(t, shifted=False)[key], value), key
    actor = areal_shift(workflow)
    ours = to_areal(t, shifted=True)
    for key, value in actor.items():
        assert torch.equal(ours[key], value), key
    # Position p of the shifted frame is about token p + 1: the logits at p predict it.
    assert ours["loss_mask"][0, :-1].tolist() == t.loss_mask[1:]
    assert ours["logprobs"][0, :-1].tolist() == t.logprobs[1:]
    assert from_areal(actor, id=t.id, group=t.group, shifted=True) == t
    assert from_areal(workflow, id=t.id, group=t.group, shifted=False) == t


def test_areal_padded_row():
    """A row of a padded batch: AReaL rolls the whole padded row, so token 0's values wrap to the
    padding's last position; from_areal undoes the roll before dropping the padding."""
    t = without_extras(full(8, length=7))
    pad = 4
    workflow = {k: torch.cat([v, torch.zeros(1, pad, dtype=v.dtype)], dim=1) if v.dim() == 2 else v
                for k, v in areal_rollout(t).items()}
    t_wrapped = dataclasses.replace(t, logprobs=[-0.5] + t.logprobs[1:])  # a value that must come back
    workflow["logprobs"][0, 0] = -0.5
    assert from_areal(workflow, id=t.id, group=t.group, shifted=False) == t_wrapped
    assert from_areal(areal_shift(workflow), id=t.id, group=t.group, shifted=True) == t_wrapped


@pytest.mark.parametrize("change,field,words", [
    (lambda d: d.pop("input_ids"), "input_ids", "missing"),
    (lambda d: d.pop("logprobs"), "logprobs", "missing"),
    (lambda d: d.update(input_ids=d["input_ids"][0]), "input_ids", "expected shape [1, L]"),
    (lambda d: d.update(loss_mask=d["loss_mask"][:, :-1]), "loss_mask", "values for"),
    (lambda d: d.update(input_ids=d["input_ids"].float()), "input_ids", "integers"),
    (lambda d: d.update(logprobs=[0.0]), "logprobs", "torch.Tensor"),
    (lambda d: d.update(rewards=torch.tensor([1.0, 2.0])), "rewards", "one value"),
    (lambda d: d.update(attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]])), "attention_mask", "ones followed"),
    (lambda d: d.update(versions=torch.full((1, 6), -3)), "versions", "must be >= -1"),
    (lambda d: d.update(logprobs=torch.full((1, 6), math.nan)), "logprobs", "not finite"),
])
def test_areal_bad_inputs_name_the_field(change, field, words):
    t = without_extras(full(9, length=6))
    d = to_areal(t, shifted=False)
    change(d)
    with pytest.raises(ValueError) as e:
        from_areal(d, id="x", shifted=False)
    assert str(e.value).startswith(f"field '{field}': "), str(e.value)
    assert words in str(e.value)


def test_areal_shifted_dict_read_as_aligned_is_refused():
    # The first generated token right after a one-token prompt: shifted, its mask sits at position 0.
    t = Trajectory(id="s", tokens=[4, 5, 6], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -2.0])
    with pytest.raises(ValueError, match="field 'loss_mask': value 0 is 1"):
        from_areal(to_areal(t, shifted=True), id="s", shifted=False)
    with pytest.raises(ValueError, match="field 'tokens'"):
        from_areal(to_areal(t, shifted=False), id="s", shifted=False, vocab_size=6)


def test_areal_frames_are_checked_where_the_data_tells():
    """A tokens-frame dict read as shifted (its last token trained), and with versions either
    frame read as the other (a trained token lands on a prompt or tool token's version -1), are
    refused naming the field; versions all -1 (unknown) decide nothing."""
    t = Trajectory(id="f", tokens=[1, 2, 3, 4, 5, 6], loss_mask=[0, 0, 1, 1, 0, 1],
                   logprobs=[0.0, 0.0, -1.0, -2.0, 0.0, -3.0], versions=[-1, -1, 3, 3, -1, 4], reward=1.0)
    tokens_frame, logits_frame = areal_rollout(t), areal_shift(areal_rollout(t))
    assert from_areal(tokens_frame, id="f", shifted=False) == without_extras(t)
    assert from_areal(logits_frame, id="f", shifted=True) == without_extras(t)
    with pytest.raises(ValueError, match=r"field 'loss_mask': position 5, the last token's, is trained.*tokens' frame"):
        from_areal(tokens_frame, id="f", shifted=True)
    with pytest.raises(ValueError, match=r"token 1 is trained but its version is -1.*logits frame \(shifted=True\)"):
        from_areal(logits_frame, id="f", shifted=False)
    # the last token untrained: only the versions tell the tokens' frame from the logits frame
    u = dataclasses.replace(t, loss_mask=[0, 0, 1, 1, 0, 0], versions=[-1, -1, 3, 3, -1, -1])
    with pytest.raises(ValueError, match=r"token 4 is trained but its version is -1.*tokens' frame \(shifted=False\)"):
        from_areal(areal_rollout(u), id="f", shifted=True)
    unknown = dict(areal_rollout(u), versions=torch.full((1, 6), -1))
    assert from_areal(unknown, id="f", shifted=True).loss_mask == [0, 0, 0, 1, 1, 0]  # undetectable


# --- verl -------------------------------------------------------------------------------------------


def verl_form(t: Trajectory) -> Trajectory:
    """t as verl can hold it: the prompt (up to the first trained token) carries no per-token values,
    there are no versions, and the metadata is the prompt length from_verl records."""
    n = t.loss_mask.index(1)
    zero = lambda values: [0.0] * n + values[n:] if values else []  # noqa: E731
    return dataclasses.replace(t, logprobs=zero(t.logprobs), advantages=zero(t.advantages),
                               ref_logprobs=zero(t.ref_logprobs), versions=[],
                               metadata={"verl_prompt_length": str(n)})


def verl_batch() -> dict:
    """verl's own example (verl/experimental/agent_loop/agent_loop.py, AgentLoopWorker's comment):
    prompt [1, 2, 3, 4], response [5, 6, 7, 8, 9, 10, 11, 12] whose 8, 9 are a tool's output, padded to
    P = 6 and R = 10 with pad id 0; and a second row, prompt [21, 22, 23, 24, 25, 26] (no padding),
    response [27, 28]. Written out by hand, not by to_verl."""
    return {
        "prompts": torch.tensor([[0, 0, 1, 2, 3, 4], [21, 22, 23, 24, 25, 26]]),
        "responses": torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 0, 0], [27, 28, 0, 0, 0, 0, 0, 0, 0, 0]]),
        "input_ids": torch.tensor([[0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 0],
                                   [21, 22, 23, 24, 25, 26, 27, 28, 0, 0, 0, 0, 0, 0, 0, 0]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0],
                                        [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]]),
        "position_ids": torch.tensor([[0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 11, 11],
                                      [0, 1, 2, 3, 4, 5, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7]]),
        "response_mask": torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0, 0, 0]]),
        "old_log_probs": torch.tensor([[-0.5, -0.25, -1.0, -2.0, -3.0, -0.125, -0.75, -1.5, -9.0, -9.0],
                                       [-4.0, -0.0625, -9.0, -9.0, -9.0, -9.0, -9.0, -9.0, -9.0, -9.0]]),
        "advantages": torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0],
                                    [-1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]),
        "token_level_rewards": torch.tensor([[0.0] * 7 + [1.0, 0.0, 0.0], [0.0] * 10]),
        "uid": np.array(["u1", "u1"], dtype=object),
    }


def test_verl_frame_on_verls_own_example():
    a, b = from_verl(verl_batch())
    assert a == Trajectory(
        id="u1-0", group="u1",
        tokens=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
        loss_mask=[0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1],
        logprobs=[0.0, 0.0, 0.0, 0.0, -0.5, -0.25, -1.0, -2.0, -3.0, -0.125, -0.75, -1.5],
        advantages=[0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0],
        reward=1.0, metadata={"verl_prompt_length": "4"})
    assert b == Trajectory(id="u1-1", group="u1", tokens=[21, 22, 23, 24, 25, 26, 27, 28],
                           loss_mask=[0] * 6 + [1, 1], logprobs=[0.0] * 6 + [-4.0, -0.0625],
                           advantages=[0.0] * 6 + [-1.0, -1.0], reward=0.0,
                           metadata={"verl_prompt_length": "6"})
    # And back: the same tensors, position_ids as verl computes them (compute_position_id_with_mask).
    out = to_verl([a, b], prompt_length=6, response_length=10)
    for key, value in verl_batch().items():
        if key == "uid":
            assert out[key].tolist() == value.tolist()
        elif key == "old_log_probs":  # verl's log-probabilities on padding are not kept
            assert torch.equal(out[key], torch.where(value == -9.0, 0.0, value))
        else:
            assert torch.equal(out[key], value), key
    assert torch.equal(out["token_level_scores"], out["token_level_rewards"])
    assert out["dta_id"].tolist() == ["u1-0", "u1-1"]


def test_verl_logprobs_are_dtas_frame():
    """verl's actor takes the log-probabilities of `responses` from the logits at [:, -R - 1 : -1]
    of the padded row (dp_actor.py, _forward_micro_batch); from_verl must turn them into dta's
    logprobs[t] = log p(tokens[t] | tokens[:t]). A bigram model makes both computable by hand."""
    vocab = 29
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    batch = verl_batch()
    r = batch["responses"].size(1)
    logits = table[batch["input_ids"]]  # [B, P + R, V]: position s predicts s + 1
    verl_logp = torch.log_softmax(logits[:, -r - 1:-1], dim=-1).gather(-1, batch["responses"].unsqueeze(-1))
    batch["old_log_probs"] = verl_logp.squeeze(-1)
    for t in from_verl(batch):
        for i, token in enumerate(t.tokens):
            if i < t.loss_mask.index(1):
                assert t.logprobs[i] == 0.0
            else:
                expected = torch.log_softmax(table[t.tokens[i - 1]], dim=-1)[token].item()
                assert t.logprobs[i] == pytest.approx(expected, abs=1e-12), (t.id, i)


@pytest.mark.parametrize("widths", [{}, {"prompt_length": 13, "response_length": 11, "pad_token_id": 7}],
                         ids=["tight", "padded"])
def test_verl_round_trip(widths):
    ts = [verl_form(t) for t in (full(seed, length=3 + 2 * seed) for seed in range(7)) if 1 in t.loss_mask]
    assert len(ts) >= 5 and len({t.group for t in ts}) == 2
    d = to_verl(ts, **widths)
    rows = len(ts)
    p, r = d["prompts"].shape[1], d["responses"].shape[1]
    if widths:
        assert (p, r) == (13, 11)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert d[key].shape == (rows, p + r), key
    for key in ("response_mask", "old_log_probs", "ref_log_prob", "advantages", "token_level_rewards"):
        assert d[key].shape == (rows, r), key
    assert d["old_log_probs"].dtype == torch.float32 and d["prompts"].dtype == torch.int64
    assert from_verl(d) == ts
    # Through a DataProto-like object (verl's from_single_dict splits tensors from numpy arrays) and
    # numpy tensors.
    proto = types.SimpleNamespace(batch={k: v for k, v in d.items() if torch.is_tensor(v)},
                                  non_tensor_batch={k: v for k, v in d.items() if isinstance(v, np.ndarray)},
                                  meta_info={})
    assert from_verl(proto) == ts
    as_numpy = {k: v.numpy() if torch.is_tensor(v) else v for k, v in d.items()}
    assert from_verl(as_numpy) == ts


def untrained_first(b: dict) -> None:
    b["response_mask"][1, 0] = 0  # the response starts with an untrained token (a tool's output, say)


def untrained_row(b: dict) -> None:
    b["response_mask"][1] = 0  # the row trains nothing


def empty_response(b: dict) -> None:
    for key in ("responses", "response_mask", "old_log_probs", "advantages", "token_level_rewards"):
        b[key][1] = 0
    b["input_ids"][1, 6:] = 0
    b["attention_mask"][1, 6:] = 0
    b["position_ids"][1, 6:] = 5


@pytest.mark.parametrize("change", [untrained_first, untrained_row, empty_response],
                         ids=["untrained-first", "untrained-row", "empty-response"])
def test_verl_reverse_round_trip_keeps_prompt_lengths(change):
    """to_verl(from_verl(batch)) gives verl's tensors back without being told where prompts end,
    even for a row whose response starts untrained, trains nothing or is empty: from_verl records
    each prompt's length in the trajectory's metadata."""
    batch = verl_batch()
    change(batch)
    batch["ref_log_prob"] = batch["old_log_probs"] * 2
    # verl's values on padding are not kept (to_verl writes 0 there).
    for key in ("old_log_probs", "ref_log_prob"):
        batch[key] = torch.where(batch["attention_mask"][:, 6:].bool(), batch[key], 0.0)
    ts = from_verl(batch)
    assert [t.metadata for t in ts] == [{"verl_prompt_length": "4"}, {"verl_prompt_length": "6"}]
    with pytest.raises(ValueError, match=r"trajectory 1 \('u1-1'\): field 'tokens': a prompt of 6 tokens is "
                                         r"longer than prompt_length 4"):
        to_verl(ts, prompt_length=4)
    out = to_verl(ts, prompt_length=6, response_length=10)
    for key, value in batch.items():
        if key != "uid":
            assert torch.equal(out[key], value), key
    assert from_verl(out) == ts
    # prompt_lengths still decide where given; without a recorded length the prompt runs to the first
    # trained token, and a row that trains nothing has none.
    assert to_verl(ts, prompt_lengths=[3, 6])["prompts"][0].tolist() == [0, 0, 0, 1, 2, 3]
    unrecorded = [dataclasses.replace(t, metadata={}) for t in ts]
    if change is untrained_first:
        assert to_verl(unrecorded)["prompts"][1].tolist() == [21, 22, 23, 24, 25, 26, 27]
    else:
        with pytest.raises(ValueError, match=r"trajectory 1 \('u1-1'\): field 'loss_mask': no trained token .*"
                                             r"metadata\['verl_prompt_length'\]"):
            to_verl(unrecorded)


def test_verl_optional_layouts():
    batch = verl_batch()
    del batch["advantages"], batch["token_level_rewards"], batch["input_ids"]
    batch["token_level_scores"] = torch.zeros(2, 10)
    batch["token_level_scores"][0, 3] = 0.5
    batch["token_level_scores"][0, 7] = 0.25
    batch["rollout_log_probs"] = batch.pop("old_log_probs") - 1
    a, b = from_verl(batch, ids=["x", "y"], logprobs="rollout_log_probs", vocab_size=29)
    assert (a.id, b.id) == ("x", "y")
    assert a.reward == 0.75 and b.reward == 0.0  # the row's sum, as verl's GRPO takes it
    assert a.logprobs[4:6] == [-1.5, -1.25] and a.advantages == []
    # verl's multi-turn rollouts of 2025 wrote the mask as `loss_mask` over the whole row.
    mask = batch.pop("response_mask")
    batch["loss_mask"] = torch.cat([torch.zeros(2, 6, dtype=mask.dtype), mask], dim=1)
    assert from_verl(batch, logprobs="rollout_log_probs")[0].loss_mask == a.loss_mask
    batch["loss_mask"] = mask.bool()
    assert from_verl(batch, logprobs="rollout_log_probs")[0].loss_mask == a.loss_mask
    # With neither mask, verl trains the response's attention mask (compute_response_mask).
    del batch["loss_mask"]
    assert from_verl(batch, logprobs="rollout_log_probs")[0].loss_mask == [0] * 4 + [1] * 8
    # ids from the uids: the k-th row of each.
    batch["uid"] = np.array(["p", "q"], dtype=object)
    assert [t.id for t in from_verl(batch, logprobs="rollout_log_probs")] == ["p-0", "q-0"]


def _set(key, row, col, value):
    def change(b):
        b[key][row, col] = value
    return change


@pytest.mark.parametrize("change,words", [
    (lambda b: b.pop("prompts"), "field 'prompts': missing"),
    (lambda b: b.pop("old_log_probs"), "field 'old_log_probs': missing"),
    (lambda b: b.pop("uid"), "field 'uid': missing"),
    (lambda b: b.update(uid=np.array(["u"], dtype=object)), "field 'uid': 1 values for 2 rows"),
    (lambda b: b.update(prompts=b["prompts"].float()), "field 'prompts': must be integers"),
    (lambda b: b.update(responses=b["responses"][:1]), "field 'responses': 1 rows for 2 prompts"),
    (lambda b: b.update(old_log_probs=b["old_log_probs"][:, :-1]),
     "field 'old_log_probs': expected shape [2, 10], got [2, 9]"),
    (lambda b: b.update(advantages=b["advantages"].long()), "field 'advantages': must be floating point"),
    (lambda b: b.update(old_log_probs=[[0.0]]), "field 'old_log_probs': must be a torch.Tensor or a numeric"),
    (lambda b: b.update(attention_mask=b["attention_mask"][:, 1:]), "field 'attention_mask': expected shape"),
    (_set("attention_mask", 0, 0, 1), "row 0: field 'attention_mask': the prompt's part [1, 0, 1, 1, 1, 1] is "
                                      "not left-padded"),
    (_set("attention_mask", 1, 9, 1), "row 1: field 'attention_mask': the response's part"),
    (_set("attention_mask", 0, 3, 2), "row 0: field 'attention_mask': value at position 3 is 2"),
    (lambda b: b["attention_mask"][1, :6].zero_(), "row 1: field 'attention_mask': the prompt is empty"),
    (_set("response_mask", 1, 4, 1), "row 1: field 'response_mask': 1 at position 4, which is padding"),
    (_set("response_mask", 0, 1, 3), "row 0: field 'response_mask': value at position 1 is 3, not 0 or 1"),
    (_set("input_ids", 1, 7, 99), "row 1: field 'input_ids': position 7 differs"),
    (_set("old_log_probs", 1, 1, math.nan), "row 1: field 'logprobs': value 7 is not finite"),
    (lambda b: (_set("responses", 0, 2, -3)(b), b.pop("input_ids")), "row 0: field 'tokens': token 6 = -3"),
    (lambda b: b.update(loss_mask=b.pop("response_mask")[:, 1:]), "field 'loss_mask': expected shape [2, 10] "
                                                                   "or [2, 16], got [2, 9]"),
    (lambda b: b.update(uid=np.array(["u", "u"], dtype=object), dta_id=np.array(["i", "i"], dtype=object)),
     "row 1: field 'id': 'i' is also row 0's"),
])
def test_verl_bad_batches_name_the_row_and_field(change, words):
    batch = verl_batch()
    change(batch)
    with pytest.raises(ValueError) as e:
        from_verl(batch)
    assert words in str(e.value), str(e.value)
    assert "field '" in str(e.value)


def test_verl_refuses_what_it_cannot_hold():
    t = verl_form(full(1, length=8))
    untrained = Trajectory(id="u", group="g", tokens=[1, 2], loss_mask=[0, 0], logprobs=[0.0, 0.0], reward=1.0)
    with pytest.raises(ValueError, match=r"trajectory 1 \('u'\): field 'loss_mask': no trained token"):
        to_verl([t, untrained])
    with pytest.raises(ValueError, match=r"trajectory 0 \('u'\): field 'reward': 1, but the response is empty"):
        to_verl([untrained], prompt_lengths=[2])
    for recorded in ("0", "3", "x", "-1", ""):
        with pytest.raises(ValueError, match=rf"trajectory 0 \('u'\): field 'metadata': verl_prompt_length "
                                             rf"'{recorded}' is not a prompt length in \[1, 2\]"):
            to_verl([dataclasses.replace(untrained, metadata={"verl_prompt_length": recorded})])
    with pytest.raises(ValueError, match=r"trajectory 0 \('t1'\): field 'loss_mask': token \d of the prompt is "
                                         r"trained"):
        to_verl([dataclasses.replace(t, metadata={"verl_prompt_length": "7"})])
    no_reward = dataclasses.replace(verl_form(full(4)), reward=None)
    with pytest.raises(ValueError, match=r"trajectory 1 \('t4'\): field 'reward': unset, but trajectory 0 has it"):
        to_verl([t, no_reward])
    with pytest.raises(ValueError, match=r"trajectory 0 \('t1'\): field 'loss_mask': token \d of the prompt is "
                                         r"trained"):
        to_verl([t], prompt_lengths=[7])
    with pytest.raises(ValueError, match=r"prompt_lengths: trajectory 0 \('t1'\): 0 is outside \[1, 8\]"):
        to_verl([t], prompt_lengths=[0])
    with pytest.raises(ValueError, match=r"trajectory 0 \('t1'\): field 'tokens': a response of \d+ tokens is "
                                         r"longer than response_length 1"):
        to_verl([t], response_length=1)
    with pytest.raises(ValueError, match=r"trajectory 0 \('bad'\): field 'loss_mask'"):
        to_verl([dataclasses.replace(t, id="bad", loss_mask=[1] * 8)])
    with pytest.raises(ValueError, match="no trajectories"):
        to_verl([])
    # Versions, metadata and the prompt's per-token values are dropped, not refused.
    assert from_verl(to_verl([full(3)])) == [verl_form(full(3))]

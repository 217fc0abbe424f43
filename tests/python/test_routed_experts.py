"""dta.Trajectory.routed_experts (routing replay, docs/expert_parallelism.md section 4): SGLang's
and vLLM's base64 payload, validation errors naming the field, JSON Lines round trips bit for bit
and with the C++ reader and writer, the conversion to the C++ Rollout and back, dta.Trainer
replaying the rows on a small mixture-of-experts model, and AReaL's and verl's routed_experts
tensors."""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import dta
from dta import Trajectory, from_areal, from_verl, read_jsonl, routed_experts_from_sglang, to_areal, to_verl, \
    write_jsonl
from dta.trajectory import routed_experts_bytes

REPO = Path(__file__).resolve().parents[2]
LAYERS, TOP_K, EXPERTS = 3, 2, 5


def tool(name: str) -> Path:
    path = Path(os.environ.get("DTA_BUILD_DIR", REPO / "build")) / "bin" / name
    if not path.exists():
        pytest.fail(f"{path} does not exist: build it with scripts/build.sh (or set DTA_BUILD_DIR)")
    return path


def routing(rows: int, seed: int = 0, layers: int = LAYERS, top_k: int = TOP_K, experts: int = EXPERTS,
            holes: int = 0) -> torch.Tensor:
    """int32 [rows, layers, top_k]: top_k distinct experts per (row, layer), `holes` (row, layer)s
    of -1 (not recorded)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows * layers)]) if rows \
        else torch.zeros(0, top_k)
    ids = ids.reshape(rows, layers, top_k).to(torch.int32)
    for h in range(min(holes, rows)):
        ids[h * rows // max(holes, 1), (h * 7) % layers] = -1
    return ids


def sglang_payload(ids: np.ndarray) -> str:
    """What SGLang puts in meta_info["routed_experts"]: base64 of the C-order little-endian int32
    array (tokenizer_manager's pybase64.b64encode of the numpy bytes)."""
    return base64.b64encode(np.ascontiguousarray(ids, dtype="<i4").tobytes()).decode("ascii")


def trajectory(length: int = 7, rows: int | None = None, seed: int = 0, **fields) -> Trajectory:
    tokens = [(seed * 31 + 7 * i) % 1000 + 1 for i in range(length)]
    t = Trajectory(id=f"r{seed}", group="g", tokens=tokens, loss_mask=[0, 0] + [1] * (length - 2),
                   logprobs=[0.0, 0.0] + [-0.5 - i / 8 for i in range(length - 2)], reward=1.0,
                   routed_experts=routing(length - 1 if rows is None else rows, seed))
    return dataclasses.replace(t, **fields)


def same(a: Trajectory, b: Trajectory) -> bool:
    """Field by field, routed_experts by value and as int32 (a dataclass's == cannot compare
    tensors)."""
    def int32(ids):
        return torch.as_tensor(ids).to(torch.int32)

    for f in dataclasses.fields(Trajectory):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "routed_experts":
            if (x is None) != (y is None):
                return False
            if x is not None and not torch.equal(int32(x), int32(y)):
                return False
        elif x != y:
            return False
    return True


# --- SGLang's payload -----------------------------------------------------------------------------


def test_sglang_payload_gives_a_row_per_token_but_the_last():
    """A request of 9 tokens (prompt and output): SGLang returns [8, layers, top_k], which is this
    trajectory's routed_experts as it is; AReaL's own decoding (np.frombuffer, reshape) agrees."""
    engine = routing(8, seed=3, holes=2).numpy()
    payload = sglang_payload(engine)
    ids = routed_experts_from_sglang(payload, LAYERS, TOP_K)
    assert ids.dtype == torch.int32 and ids.shape == (8, LAYERS, TOP_K)
    assert np.array_equal(ids.numpy(), engine)
    areal = np.frombuffer(base64.b64decode(payload), dtype=np.int32).reshape(8, -1)
    assert np.array_equal(ids.reshape(8, -1).numpy(), areal)
    trajectory(9, routed_experts=ids).validate()
    assert dta.routed_experts_from_sglang is routed_experts_from_sglang
    # Bytes work as the str does, an empty payload is no rows, and the bytes come back as given.
    assert torch.equal(routed_experts_from_sglang(payload.encode(), LAYERS, TOP_K), ids)
    assert routed_experts_from_sglang("", LAYERS, TOP_K).shape == (0, LAYERS, TOP_K)
    assert routed_experts_bytes(ids) == (LAYERS, TOP_K, base64.b64decode(payload))


@pytest.mark.parametrize("payload,layers,top_k,words", [
    ("AAAA$AAA", LAYERS, TOP_K, "is not base64"),
    ("AAAAAA", LAYERS, TOP_K, "is not base64"),  # bad padding
    (base64.b64encode(bytes(4 * LAYERS * TOP_K + 4)).decode(), LAYERS, TOP_K,
     f"{4 * LAYERS * TOP_K + 4} bytes are not whole rows of 3 layers x 2 int32 experts (24 bytes)"),
    (base64.b64encode(bytes(6)).decode(), 1, 1, "6 bytes are not whole rows of 1 layers x 1 int32 experts"),
    ("", 0, TOP_K, "num_layers must be a positive integer, got 0"),
    ("", LAYERS, True, "top_k must be a positive integer, got True"),
    ("", LAYERS, 2.0, "top_k must be a positive integer, got 2.0"),
])
def test_bad_sglang_payloads_name_the_field(payload, layers, top_k, words):
    with pytest.raises(ValueError) as e:
        routed_experts_from_sglang(payload, layers, top_k)
    assert str(e.value).startswith("field 'routed_experts': "), str(e.value)
    assert words in str(e.value), str(e.value)


# --- validation ---------------------------------------------------------------------------------


FORMS = {
    "tensor": lambda ids: ids,
    "int64": lambda ids: ids.long(),
    "int8": lambda ids: ids.to(torch.int8),
    "numpy": lambda ids: ids.numpy(),
    "numpy-int64": lambda ids: ids.numpy().astype(np.int64),
    "lists": lambda ids: ids.tolist(),
    "tuples": lambda ids: tuple(tuple(tuple(layer) for layer in row) for row in ids.tolist()),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows", ["tokens - 1", "tokens"])
def test_every_form_of_valid_routing_passes(form, rows):
    t = trajectory(7, rows=6 if rows == "tokens - 1" else 7)
    t.routed_experts[1, 2] = -1  # not recorded
    dataclasses.replace(t, routed_experts=FORMS[form](t.routed_experts)).validate()
    dataclasses.replace(t, routed_experts=None).validate()
    # Unsigned dtypes hold no -1, and ids past the model's experts are the trainer's to refuse.
    dataclasses.replace(t, routed_experts=torch.full((6, 48, 8), 255, dtype=torch.uint8)).validate()
    dataclasses.replace(t, routed_experts=np.full((6, 1, 1), 2**31 - 1, dtype=np.uint32)).validate()


def with_id(ids: torch.Tensor, row: int, layer: int, slot: int, value: int) -> torch.Tensor:
    ids = ids.long()
    ids[row, layer, slot] = value
    return ids


BAD = [
    (lambda ids: ids[:, :, 0], "expected a 3-D integer array [rows, layers, top_k] (a torch tensor, a numpy "
                               "array or nested lists), got "),
    (lambda ids: ids.float(), "must hold integers, got a torch.float32 tensor"),
    (lambda ids: ids.bool(), "must hold integers, got a torch.bool tensor"),
    (lambda ids: ids.numpy().astype(np.float64), "must hold integers, got a numpy float64 array"),
    (lambda ids: ids[:4], "4 rows for 7 tokens (7 or 6 expected)"),
    (lambda ids: torch.cat([ids, ids[:2]]), "8 rows for 7 tokens (7 or 6 expected)"),
    (lambda ids: ids[:, :0], "layers (0) and top_k (2) must be positive"),
    (lambda ids: ids[:, :, :0], "layers (3) and top_k (0) must be positive"),
    (lambda ids: with_id(ids, 4, 1, 1, -2), "row 4, layer 1: expert -2 is neither an expert nor -1 (not recorded)"),
    (lambda ids: with_id(ids, 2, 0, 0, 2**31), "row 2, layer 0: expert 2147483648 is not below 2^31"),
    (lambda ids: with_id(ids, 3, 2, 1, -1), "row 3, layer 2: ["),
    (lambda ids: "AAAA", "must be a 3-D integer array [rows, layers, top_k] (a torch tensor, a numpy array or "
                         "nested lists) or None, got str"),
    (lambda ids: [], "an empty list has no layers and top_k"),
    (lambda ids: [1, 2, 3], "expected a 3-D integer array"),
]


def bad_cases() -> list:
    """(form, change, words): each change in each form but a tensor's dtype in lists or numpy (which
    have their own cases) and no layers or ids in lists (empty lists have no length to name)."""
    cases = []
    for form in ("tensor", "numpy", "lists"):
        for change, words in BAD:
            if (form != "tensor" and "got a torch." in words) or (form == "lists" and words.startswith("layers (")):
                continue
            cases.append(pytest.param(form, change, words, id=f"{form}-{words[:30]}"))
    return cases


@pytest.mark.parametrize("form,change,words", bad_cases())
def test_invalid_routing_names_the_field(form, change, words):
    t = trajectory(7)
    bad = change(t.routed_experts)
    if isinstance(bad, torch.Tensor) and form != "tensor":
        bad = bad.numpy() if form == "numpy" else bad.tolist()
    with pytest.raises(ValueError) as e:
        dataclasses.replace(t, routed_experts=bad).validate()
    assert str(e.value).startswith("field 'routed_experts': "), str(e.value)
    assert words in str(e.value), str(e.value)
    if "layer 2: [" in words:
        assert "is recorded only in part" in str(e.value)


def test_invalid_lists_name_the_value():
    t = trajectory(4)
    rows = t.routed_experts.tolist()
    for change, words in [
        (lambda r: r[1][2].__setitem__(0, True), "row 1, layer 2: True is not an integer"),
        (lambda r: r[1][2].__setitem__(0, 1.0), "row 1, layer 2: 1.0 is not an integer"),
        (lambda r: r[2].pop(), "row 2 is not a list of 3 layers of 2 ids"),
        (lambda r: r[2][1].append(4), "row 2, layer 1 is not a list of 2 ids"),
        (lambda r: r[0][0].__setitem__(1, np.int64(-3)), "row 0, layer 0: expert -3 is neither"),
    ]:
        bad = [[list(layer) for layer in row] for row in rows]
        change(bad)
        with pytest.raises(ValueError, match="^field 'routed_experts': " + words.replace("[", r"\[")):
            dataclasses.replace(t, routed_experts=bad).validate()
    # numpy values pass as their ints.
    dataclasses.replace(t, routed_experts=[[[np.int32(v) for v in layer] for layer in row] for row in rows]).validate()


def test_errors_name_the_trajectory_where_a_batch_is_checked(tmp_path):
    bad = trajectory(5, seed=1, routed_experts=routing(2))
    with pytest.raises(ValueError, match=r"^trajectory 1 \('r1'\): field 'routed_experts': 2 rows for 5 tokens"):
        write_jsonl(tmp_path / "t.jsonl", [trajectory(5), bad])
    with pytest.raises(ValueError, match=r"^trajectory 0 \('r1'\): field 'routed_experts': 2 rows for 5 tokens"):
        to_verl([bad])


# --- JSON Lines -----------------------------------------------------------------------------------


def test_jsonl_round_trip_is_bit_exact(tmp_path):
    extremes = torch.tensor([[[2**31 - 1, 0]] * LAYERS, [[-1, -1]] * LAYERS, [[7, 2**24 + 1]] * LAYERS],
                            dtype=torch.int32)
    one_token = trajectory(1, seed=5, loss_mask=[0], logprobs=[0.0],
                           routed_experts=torch.zeros(0, 48, 8, dtype=torch.int32))
    ts = [trajectory(9, seed=1), trajectory(5, rows=5, seed=2), trajectory(4, seed=3, routed_experts=extremes),
          trajectory(6, seed=4, routed_experts=None), one_token]
    path = tmp_path / "t.jsonl"
    write_jsonl(path, ts)
    back = read_jsonl(path)
    assert len(back) == len(ts)
    for t, b in zip(ts, back):
        assert same(t, b), t.id
        if t.routed_experts is not None:
            assert b.routed_experts.dtype == torch.int32 and b.routed_experts.shape == t.routed_experts.shape
    line = json.loads(path.read_text().splitlines()[0])
    assert line["routed_experts"] == {"layers": LAYERS, "top_k": TOP_K, "dtype": "int32",
                                      "base64": sglang_payload(ts[0].routed_experts.numpy())}
    assert "routed_experts" not in json.loads(path.read_text().splitlines()[3])
    # Every form writes the same line.
    for form in FORMS.values():
        assert json.dumps(dataclasses.replace(ts[0], routed_experts=form(ts[0].routed_experts)).to_dict()) == \
            json.dumps(ts[0].to_dict())


def test_jsonl_reads_hand_written_ids():
    ids = routing(3, holes=1)
    obj = trajectory(4).to_dict()
    obj["routed_experts"] = {"layers": LAYERS, "top_k": TOP_K, "ids": ids.tolist()}
    assert torch.equal(Trajectory.from_dict(obj).routed_experts, ids)
    obj["routed_experts"] = {"layers": LAYERS, "top_k": TOP_K, "base64": sglang_payload(ids.numpy())}
    assert torch.equal(Trajectory.from_dict(obj).routed_experts, ids)


@pytest.mark.parametrize("value,words", [
    ([1, 2], 'must be an object {"layers", "top_k", "base64" or "ids"}'),
    ({"layers": 3, "top_k": 2, "base64": "", "shape": [1]}, "unknown member 'shape'"),
    ({"top_k": 2, "base64": ""}, "'layers' is missing"),
    ({"layers": 3, "top_k": 0, "base64": ""}, "'top_k' must be a positive integer"),
    ({"layers": True, "top_k": 2, "base64": ""}, "'layers' must be a positive integer"),
    ({"layers": 3, "top_k": 2, "dtype": "int64", "base64": ""}, "'dtype' must be \"int32\""),
    ({"layers": 3, "top_k": 2, "base64": 5}, "'base64' must be a string"),
    ({"layers": 3, "top_k": 2}, "needs 'base64' or 'ids'"),
    ({"layers": 3, "top_k": 2, "base64": "AAAA"}, "3 bytes are not whole rows"),
    ({"layers": 3, "top_k": 2, "ids": "x"}, "'ids' must be an array of rows"),
    ({"layers": 3, "top_k": 2, "ids": [[[1, 2], [3, 4]]] * 3}, "row 0 is not a list of 3 layers of 2 ids"),
    ({"layers": 3, "top_k": 2, "ids": [[[1, 2]] * 3] * 4}, "4 rows for 4 tokens"),  # fine: 4 rows
    ({"layers": 3, "top_k": 2, "ids": [[[1, 2]] * 3] * 2}, "2 rows for 4 tokens (4 or 3 expected)"),
])
def test_jsonl_errors_name_the_field(tmp_path, value, words):
    obj = trajectory(4).to_dict()
    obj["routed_experts"] = value
    if words.startswith("4 rows for 4 tokens"):
        assert Trajectory.from_dict(obj).routed_experts.shape == (4, 3, 2)
        return
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(obj) + "\n")
    with pytest.raises(ValueError) as e:
        read_jsonl(path)
    assert f"{path}:1: rollout 'r0': field 'routed_experts': " in str(e.value), str(e.value)
    assert words in str(e.value), str(e.value)


def test_jsonl_is_the_cpp_readers_and_writers(tmp_path):
    """A file written here reads in C++ (dta._core's ReadRolloutsJsonl, and dta-tree) to the same
    rows; the C++ writer's file reads here to the same rows, with the same routed_experts object."""
    from dta import _core

    ts = [trajectory(9, seed=1), trajectory(5, rows=5, seed=2), trajectory(6, seed=4, routed_experts=None),
          trajectory(12, seed=5, routed_experts=routing(11, 5, layers=48, top_k=8, experts=128, holes=3))]
    python_file = tmp_path / "python.jsonl"
    write_jsonl(python_file, ts)
    by_cpp = _core.read_rollouts_jsonl(str(python_file), 0, Trajectory)
    for t, c in zip(ts, by_cpp, strict=True):
        assert same(dataclasses.replace(t, metadata={}), c), t.id
    run = subprocess.run([tool("dta-tree"), "--json", str(python_file)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr

    cpp_file = tmp_path / "cpp.jsonl"
    _core.convert_checked(ts, 0, Trajectory).write_jsonl(str(cpp_file))
    for t, b in zip(ts, read_jsonl(cpp_file), strict=True):
        assert same(t, b), t.id
    for ours, theirs in zip(python_file.read_text().splitlines(), cpp_file.read_text().splitlines()):
        assert json.loads(ours).get("routed_experts") == json.loads(theirs).get("routed_experts")

    # The C++ reader refuses what Python's does, naming the field.
    bad = tmp_path / "bad.jsonl"
    obj = ts[0].to_dict()
    obj["routed_experts"]["base64"] = sglang_payload(routing(3).numpy())
    bad.write_text(json.dumps(obj) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: rollout 'r1': field 'routed_experts': 3 rows for 9 tokens"):
        _core.read_rollouts_jsonl(str(bad), 0, Trajectory)
    with pytest.raises(ValueError, match=r"bad.jsonl:1: rollout 'r1': field 'routed_experts': 3 rows for 9 tokens"):
        read_jsonl(bad)


# --- the C++ conversion ---------------------------------------------------------------------------


def test_conversion_through_the_cpp_core_and_back():
    """dta._core converts plain lists and signed integer tensors itself (one pass that checks them
    as validate does), leaves numpy arrays and unsigned tensors to Trajectory.validate and then
    converts them; every form gives the same int32 rows back."""
    from dta import _core

    base = trajectory(8, seed=2)
    base.routed_experts[3, 1] = -1
    forms = {**FORMS, "uint8": lambda ids: ids.clamp(min=0).to(torch.uint8), "none": lambda ids: None}
    batch = [dataclasses.replace(base, id=name, routed_experts=form(base.routed_experts))
             for name, form in forms.items()]
    converted = _core.convert_checked(batch, 0, Trajectory)
    unchecked = [batch[i].id for i in converted.unchecked]
    assert unchecked == ["numpy", "numpy-int64", "tuples", "uint8"]
    for i in converted.unchecked:
        batch[i].validate()
        converted.convert(i, batch[i])
    for t, back in zip(batch, converted.to_trajectories(Trajectory), strict=True):
        assert same(dataclasses.replace(t, metadata={}), back), t.id
        if t.routed_experts is not None:
            assert back.routed_experts.dtype == torch.int32


@pytest.mark.parametrize("change", [
    lambda ids: with_id(ids, 3, 2, 1, -1),           # recorded only in part
    lambda ids: with_id(ids, 3, 2, 1, -2),
    lambda ids: with_id(ids, 3, 2, 1, 2**31),
    lambda ids: ids[:3],
    lambda ids: ids.tolist()[:3],
    lambda ids: [[[*layer[:1], True] for layer in row] for row in ids.tolist()],
    lambda ids: ids[:, :, :0],
    lambda ids: ids.float(),
])
def test_the_cpp_check_refuses_what_validate_refuses(change):
    """A trajectory the one-pass C++ check would pass must pass validate; these break a rule, so
    the check sends them to validate, which names it."""
    from dta import _core

    t = trajectory(7)
    bad = dataclasses.replace(t, routed_experts=change(t.routed_experts))
    with pytest.raises(ValueError, match="^field 'routed_experts': "):
        bad.validate()
    assert _core.first_unchecked_trajectory([t, bad], 0, 0, Trajectory) == 1


ROUTED_IDS = [-1, 0, 3, 2**31 - 1, -2, 2**31, True, 1.0, np.int64(2), None]


def random_routing(rng: random.Random, tokens: int):
    """Nested lists or a tensor of a random shape, mostly valid, sometimes one bad id or shape."""
    rows = rng.choice([tokens - 1, tokens - 1, tokens, tokens + 1, max(tokens - 2, 0)])
    layers, top_k = rng.choice([1, 2, 3, 0]) if rng.random() < 0.1 else rng.choice([1, 2, 3]), rng.choice([1, 2, 3])
    ids = [[[rng.randrange(8) for _ in range(top_k)] for _ in range(layers)] for _ in range(rows)]
    if rows and layers and rng.random() < 0.5:
        ids[rng.randrange(rows)][rng.randrange(layers)] = [-1] * top_k
    if rows and layers and rng.random() < 0.4:
        ids[rng.randrange(rows)][rng.randrange(layers)][rng.randrange(top_k)] = rng.choice(ROUTED_IDS)
    values = [i for row in ids for layer in row for i in layer]
    if rng.random() < 0.4 and all(type(i) is int for i in values):
        dtype = rng.choice([torch.int8, torch.int32, torch.int64, torch.uint8])
        if all(torch.iinfo(dtype).min <= i <= torch.iinfo(dtype).max for i in values):
            return torch.tensor(ids, dtype=torch.int64).reshape(rows, layers, top_k).to(dtype)
    return ids


def test_the_cpp_check_agrees_with_validate_on_random_routing():
    """dta.Trainer skips Python's validation for what _core.first_unchecked_trajectory passes: on
    plain lists and signed integer tensors it must pass exactly what validate accepts; on others
    (unsigned tensors, numpy values) it may only refuse more."""
    from dta import _core

    rng = random.Random(13)
    counts = {"passed": 0, "refused": 0, "left to validate": 0}
    for _ in range(3000):
        tokens = rng.randrange(1, 6)
        t = Trajectory(id="t", tokens=[1] * tokens, loss_mask=[0] * tokens, logprobs=[0.0] * tokens,
                       routed_experts=random_routing(rng, tokens))
        passed = _core.first_unchecked_trajectory([t], 0, 0, Trajectory) == 1
        try:
            t.validate()
            ok = True
        except ValueError:
            ok = False
        value = t.routed_experts
        plain = (value.dtype != torch.uint8 if isinstance(value, torch.Tensor) else
                 all(type(i) in (int, bool, float, type(None)) for row in value for layer in row for i in layer))
        if plain:
            assert passed == ok, (value, ok)
            counts["passed" if passed else "refused"] += 1
        else:
            assert not passed or ok, value
            counts["left to validate"] += not passed
    assert min(counts.values()) > 100, counts


# --- dta.Trainer ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_config(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE: 3 decoder layers, the middle one dense (mlp_only_layers), 5 experts of
    which each token takes 2."""
    config = json.loads((REPO / "examples" / "configs" / "qwen3-tiny.json").read_text())
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=LAYERS,
                  num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=12, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[1], router_aux_loss_coef=0.0)
    path = tmp_path_factory.mktemp("moe") / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_trainer_replays_every_form_alike(moe_config):
    """The executor gets the same rows from a tensor, lists and a numpy array (so the same
    log-probabilities and step), the rows change the log-probabilities (the router's own top-k is
    not what they replay), and a row the model cannot take is refused naming the rollout."""
    trainer = dta.Trainer.from_config(moe_config, seed=3, dtype="float64")
    ts = [trajectory(9, seed=s) for s in range(3)]
    own = trainer.compute_logprobs([dataclasses.replace(t, routed_experts=None) for t in ts])
    by_form = {name: trainer.compute_logprobs([dataclasses.replace(t, routed_experts=form(t.routed_experts))
                                               for t in ts])
               for name, form in FORMS.items()}
    for name, logprobs in by_form.items():
        for got, want in zip(logprobs, by_form["tensor"]):
            assert torch.equal(got, want), name
    assert any(not torch.equal(a, b) for a, b in zip(by_form["tensor"], own))
    for method in ("dense", "packed"):
        for got, want in zip(trainer.compute_logprobs(ts, method=method), by_form["tensor"]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-9)

    stats = trainer.train_batch([dataclasses.replace(t, routed_experts=t.routed_experts.tolist()) for t in ts],
                                loss="grpo", method="dta")
    assert stats.loss == stats.loss and trainer.step_count == 1  # finite, and a step taken
    # Two copies of one trajectory routed differently from token 3 on do not share tokens 3..8.
    twin = ts[0].routed_experts.clone()
    twin[3:] = torch.roll(twin[3:], 1, dims=-1)  # the same experts in another order
    pair = [ts[0], dataclasses.replace(ts[0], id="twin", routed_experts=twin)]
    assert trainer.compute_gradients(pair, loss="grpo").replay_split_tokens == len(ts[0].tokens) - 3
    assert trainer.compute_gradients(pair[:1], loss="grpo").replay_split_tokens == 0

    bad = dataclasses.replace(ts[1], routed_experts=with_id(ts[1].routed_experts, 2, 0, 1, EXPERTS))
    with pytest.raises(RuntimeError, match=r"rollout 'r1': field 'routed_experts': row 2, layer 0: .* expert 5 is "
                                           r"not in \[0, 5\)"):
        trainer.compute_logprobs([ts[0], bad])
    with pytest.raises(ValueError, match=r"trajectory 1 \('r1'\): field 'routed_experts': row 2, layer 0: "):
        trainer.compute_logprobs([ts[0], dataclasses.replace(bad, routed_experts=with_id(bad.routed_experts, 2, 0, 1,
                                                                                           -5).numpy())])


# --- AReaL ----------------------------------------------------------------------------------------


def areal_dict(t: Trajectory, engine_rows: torch.Tensor, width: int | None = None) -> dict[str, torch.Tensor]:
    """AReaL's RLVR dict with R3 (areal/workflow/rlvr_r3_patch.py, router_replay_utils.py
    preprocess_routed_experts_batch): the engine's [L - 1, layers * top_k] rows reshaped into a
    [1, L, layers, top_k] tensor, zeros where it has none (the last token), compressed to uint8
    when the ids fit; right-padded to `width` as AReaL's concat_batch pads a batch."""
    length = len(t.tokens)
    width = width or length
    routed = torch.zeros(1, width, *engine_rows.shape[1:], dtype=torch.int32)
    routed[0, :engine_rows.size(0)] = engine_rows
    if routed.max() < 256:
        routed = routed.to(torch.uint8)

    def padded(values, dtype):
        row = torch.zeros(1, width, dtype=dtype)
        row[0, :length] = torch.tensor(values, dtype=dtype)
        return row

    return {"input_ids": padded(t.tokens, torch.int64), "loss_mask": padded(t.loss_mask, torch.int64),
            "logprobs": padded(t.logprobs, torch.float32), "attention_mask": padded([1] * length, torch.bool),
            "rewards": torch.tensor([t.reward]), "routed_experts": routed}


@pytest.mark.parametrize("width", [None, 13], ids=["unpadded", "padded"])
def test_from_areal_takes_the_engines_rows(width):
    t = trajectory(9, seed=4)  # [8, layers, top_k]: SGLang's rows
    got = from_areal(areal_dict(t, t.routed_experts, width), id=t.id, group=t.group, shifted=False)
    assert got.routed_experts.dtype == torch.int32
    assert torch.equal(got.routed_experts, t.routed_experts)
    assert got.tokens == t.tokens
    # The frame of the other tensors does not move it (AReaL never shifts it); [L, layers, top_k] works too.
    shifted = to_areal(t, shifted=True)
    assert torch.equal(from_areal(shifted, id=t.id, group=t.group, shifted=True).routed_experts, t.routed_experts)
    d = areal_dict(t, t.routed_experts, width)
    d["routed_experts"] = d["routed_experts"][0]
    assert torch.equal(from_areal(d, id=t.id, shifted=False).routed_experts, t.routed_experts)


@pytest.mark.parametrize("shifted", [False, True], ids=["aligned", "shifted"])
def test_areal_round_trip_with_routing(shifted):
    t = trajectory(9, seed=5)
    d = to_areal(t, shifted=shifted)
    assert d["routed_experts"].shape == (1, 9, LAYERS, TOP_K) and d["routed_experts"].dtype == torch.int32
    assert not d["routed_experts"][0, 8].any()  # the last token: zeros, as AReaL fills it
    back = from_areal(d, id=t.id, group=t.group, shifted=shifted)
    assert same(back, dataclasses.replace(t, metadata={}, logprobs=[float(torch.tensor(x, dtype=torch.float32))
                                                                    for x in t.logprobs]))
    # A trajectory with a row for every token loses the last one (the engines' form).
    full_rows = trajectory(9, rows=9, seed=5)
    again = from_areal(to_areal(full_rows, shifted=shifted), id=t.id, shifted=shifted).routed_experts
    assert torch.equal(again, full_rows.routed_experts[:8])


@pytest.mark.parametrize("change,words", [
    (lambda d: d.update(routed_experts=d["routed_experts"].float()), "must hold integers, got torch.float32"),
    (lambda d: d.update(routed_experts=d["routed_experts"][:, :5]), "5 rows for 9 tokens (input_ids)"),
    (lambda d: d.update(routed_experts=d["routed_experts"][0, :, :, 0]),
     "expected shape [1, L, layers, top_k], got [9, 3]"),
    (lambda d: d.update(routed_experts=d["routed_experts"].numpy()), "must be a torch.Tensor, got ndarray"),
    (lambda d: d.update(routed_experts=torch.full_like(d["routed_experts"], -3, dtype=torch.int64)),
     "row 0, layer 0: expert -3 is neither an expert nor -1"),
])
def test_areal_bad_routing_names_the_field(change, words):
    t = trajectory(9)
    d = areal_dict(t, t.routed_experts)
    change(d)
    with pytest.raises(ValueError) as e:
        from_areal(d, id=t.id, shifted=False)
    assert str(e.value).startswith("field 'routed_experts': "), str(e.value)
    assert words in str(e.value), str(e.value)


# --- verl -----------------------------------------------------------------------------------------


def verl_batch(ts: list[Trajectory], prompts: list[int], p: int, r: int) -> dict:
    """A verl batch with R3 written as verl's agent loop writes it (agent_loop.py, _postprocess):
    prompts left-padded to P, responses right-padded to R, and routed_experts [B, P + R, layers,
    top_k] zeros with the engine's rows placed from the prompt's first token."""
    rows = len(ts)
    batch = {"prompts": torch.zeros(rows, p, dtype=torch.int64), "responses": torch.zeros(rows, r, dtype=torch.int64),
             "attention_mask": torch.zeros(rows, p + r, dtype=torch.int64),
             "response_mask": torch.zeros(rows, r, dtype=torch.int64),
             "old_log_probs": torch.zeros(rows, r), "uid": np.array([t.group for t in ts], dtype=object),
             "routed_experts": torch.zeros(rows, p + r, LAYERS, TOP_K, dtype=torch.int32)}
    for i, (t, n) in enumerate(zip(ts, prompts)):
        m = len(t.tokens) - n
        batch["prompts"][i, p - n:] = torch.tensor(t.tokens[:n])
        batch["responses"][i, :m] = torch.tensor(t.tokens[n:])
        batch["attention_mask"][i, p - n:p + m] = 1
        batch["response_mask"][i, :m] = torch.tensor(t.loss_mask[n:])
        batch["old_log_probs"][i, :m] = torch.tensor(t.logprobs[n:])
        start = p - n
        batch["routed_experts"][i, start:start + t.routed_experts.size(0)] = t.routed_experts
    batch["input_ids"] = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    return batch


def test_from_verl_takes_the_engines_rows():
    ts = [trajectory(9, seed=1), trajectory(6, seed=2), trajectory(11, seed=3)]
    batch = verl_batch(ts, prompts=[2, 3, 2], p=4, r=10)
    got = from_verl(batch)
    for t, g in zip(ts, got, strict=True):
        assert g.tokens == t.tokens
        assert g.routed_experts.dtype == torch.int32 and torch.equal(g.routed_experts, t.routed_experts), t.id
    # numpy arrays work as tensors do.
    batch["routed_experts"] = batch["routed_experts"].numpy()
    assert all(torch.equal(g.routed_experts, t.routed_experts) for t, g in zip(ts, from_verl(batch)))


def test_verl_round_trip_with_routing():
    ts = [trajectory(9, seed=1), trajectory(6, seed=2), trajectory(11, seed=3)]
    batch = verl_batch(ts, prompts=[2, 2, 2], p=2, r=9)
    out = to_verl(from_verl(batch))
    assert torch.equal(out["routed_experts"], batch["routed_experts"])
    for t, back in zip(ts, from_verl(out), strict=True):
        assert torch.equal(back.routed_experts, t.routed_experts)


@pytest.mark.parametrize("change,words", [
    (lambda b: b.update(routed_experts=b["routed_experts"][:, :-1]), "expected shape [3, 14, layers, top_k], got"),
    (lambda b: b.update(routed_experts=b["routed_experts"][..., 0]),
     "expected shape [B, P + R, layers, top_k], got [3, 14, 3]"),
    (lambda b: b.update(routed_experts=b["routed_experts"].double()), "must be integers, got torch.float64"),
    # Row 1's prompt has 3 tokens left-padded to 4: position 3 is its token 2.
    (lambda b: b["routed_experts"].__setitem__((1, 3, 0, 0), -4), "row 1: field 'routed_experts': row 2, layer 0: "
                                                                  "expert -4 is neither"),
])
def test_verl_bad_routing_names_the_field(change, words):
    ts = [trajectory(9, seed=1), trajectory(6, seed=2), trajectory(11, seed=3)]
    batch = verl_batch(ts, prompts=[2, 3, 2], p=4, r=10)
    change(batch)
    with pytest.raises(ValueError) as e:
        from_verl(batch)
    assert "field 'routed_experts': " in str(e.value), str(e.value)
    assert words in str(e.value), str(e.value)


def test_to_verl_needs_one_routing_shape_for_the_batch():
    a, b = trajectory(5, seed=1), trajectory(6, seed=2)
    with pytest.raises(ValueError, match=r"trajectory 1 \('r2'\): field 'routed_experts': unset, but trajectory 0 "
                                         r"has it"):
        to_verl([a, dataclasses.replace(b, routed_experts=None)])
    with pytest.raises(ValueError, match=r"trajectory 1 \('r2'\): field 'routed_experts': 2 layers x 2 experts, but "
                                         r"trajectory 0's are 3 x 2"):
        to_verl([a, dataclasses.replace(b, routed_experts=b.routed_experts[:, :2])])


@pytest.mark.parametrize("largest, id_type, width", [(10, "UINT8", 1), (254, "UINT8", 1), (255, "UINT16", 2),
                                                     (70000, "INT32", 4)])
def test_wire_carries_routing_in_the_narrowest_id_type(largest, id_type, width):
    from dta import _wire
    from dta.v1 import dispatcher_pb2

    routed = torch.tensor([[[0, largest], [-1, -1]], [[3, 1], [largest - 1, 2]]], dtype=torch.int32)
    t = Trajectory(id="w", tokens=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -2.0], reward=1.0,
                   routed_experts=routed)
    message = _wire.to_proto(t)
    assert message.routed_experts.id_type == getattr(dispatcher_pb2.RoutedExperts, id_type)
    assert (message.routed_experts.layers, message.routed_experts.top_k) == (2, 2)
    assert len(message.routed_experts.ids) == routed.numel() * width
    # The bytes are little-endian, the type's all-ones value for "not recorded".
    assert message.routed_experts.ids[width * 2:width * 3] == b"\xff" * width
    back = _wire.from_proto(dispatcher_pb2.Trajectory.FromString(message.SerializeToString()))
    assert torch.equal(back.routed_experts, routed)
    assert _wire.from_proto(_wire.to_proto(dataclasses.replace(t, routed_experts=None))).routed_experts is None


def test_wire_refuses_routing_bytes_that_are_not_whole_rows():
    from dta import _wire

    message = _wire.to_proto(Trajectory(id="w", tokens=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0], reward=1.0,
                                        routed_experts=[[[1, 2]]]))
    message.routed_experts.ids = message.routed_experts.ids[:-1]
    with pytest.raises(ValueError, match="field 'routed_experts': 1 bytes of id type 1 are not whole rows"):
        _wire.from_proto(message)

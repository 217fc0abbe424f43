"""Trajectory.validate's whole-list checks (one pass in C over plain Python numbers) accept
exactly what its per-value rules accept: on random lists of every kind of value, validate gives the
same outcome, message included, with and without them."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

import dta.trajectory as trajectory
from dta import Trajectory

VALUES = {
    "tokens": [0, 1, 5, 999, 1000, -1, 2**31 - 1, 2**31, True, False, 3.0, np.int64(7), np.int32(-2), "4"],
    "loss_mask": [0, 1, True, False, 2, -1, 0.0, 1.0, np.int64(1), None],
    "floats": [0.0, -1.5, 7, -3, 3.4e38, 3.5e38, -1e39, math.inf, -math.inf, math.nan, True, np.float32(2.5),
               np.float64(math.nan), "0.5", None],
    "versions": [-1, 0, 5, -2, 2**31 - 1, 2**31, True, 1.0, np.int64(3)],
}


def outcome(t: Trajectory, vocab_size: int | None) -> str:
    try:
        t.validate(vocab_size)
        return "ok"
    except (ValueError, TypeError, OverflowError) as e:
        return f"{type(e).__name__}: {e}"


def random_trajectory(rng: random.Random) -> Trajectory:
    n = rng.randrange(1, 6)

    def pick(kind: str, plain: list) -> list:
        # Mostly plain values (the whole-list checks pass), sometimes one value of any kind.
        values = [rng.choice(plain) for _ in range(n)]
        if rng.random() < 0.6:
            values[rng.randrange(n)] = rng.choice(VALUES[kind])
        return values

    loss_mask = pick("loss_mask", [0, 1])
    if rng.random() < 0.8:
        loss_mask[0] = 0
    return Trajectory(id="t", tokens=pick("tokens", [0, 1, 5, 999]), loss_mask=loss_mask,
                      logprobs=pick("floats", [0.0, -1.5, -3]),
                      versions=pick("versions", [-1, 0, 5]) if rng.random() < 0.5 else [],
                      advantages=pick("floats", [0.5, -2.0]) if rng.random() < 0.5 else [],
                      ref_logprobs=pick("floats", [-0.25]) if rng.random() < 0.5 else [])


def test_whole_list_checks_accept_exactly_what_the_per_value_rules_accept(monkeypatch):
    rng = random.Random(11)
    cases = [(random_trajectory(rng), rng.choice([None, 1000])) for _ in range(3000)]
    fast = [outcome(t, v) for t, v in cases]
    for name in ("_plain_ints_within", "_plain_finite_float32s", "_plain_zeros_and_ones"):
        monkeypatch.setattr(trajectory, name, lambda *args: False)
    slow = [outcome(t, v) for t, v in cases]
    assert fast == slow
    # Both kinds of outcome occur, for every field: the comparison is not vacuous.
    assert fast.count("ok") > 300 and len(fast) - fast.count("ok") > 300
    for field in ("tokens", "loss_mask", "logprobs", "versions", "advantages", "ref_logprobs"):
        assert any(f"field '{field}'" in o for o in fast), field


@pytest.mark.parametrize("values,expected", [([1, 2, 3], True), ([], True), ([1, True], False), ([1, 2.0], False),
                                              ([0, 1000], False), ([-1, 5], False), ([np.int64(1)], False)])
def test_plain_ints_within(values, expected):
    assert trajectory._plain_ints_within(values, 0, 1000) is expected


# dta.Trainer skips Python's validation for the trajectories _core.first_unchecked_trajectory
# passes (plain Python values checked in C++). Values of plain types only: there it must agree with
# validate exactly; with any values (numpy's, strings, None) it may only fail more.
PLAIN_TYPES = (int, float, bool, type(None))
OTHER_FIELDS = {
    "id": ["t", "", 7],
    "group": ["g", "", None],
    "reward": [None, 1.0, 2, -3.5, 1e30, -1e31, math.nan, math.inf, True, "1", np.float64(1.0)],
    "metadata": [{}, {"k": "v"}, {"k": 1}, {2: "v"}],
}


def with_other_fields(t: Trajectory, rng: random.Random) -> Trajectory:
    for name, values in OTHER_FIELDS.items():
        if rng.random() < 0.2:
            setattr(t, name, rng.choice(values))
    return t


def is_plain(t: Trajectory) -> bool:
    lists = (t.tokens, t.loss_mask, t.logprobs, t.versions, t.advantages, t.ref_logprobs)
    return (all(type(x) in PLAIN_TYPES for values in lists for x in values) and type(t.reward) in PLAIN_TYPES
            and type(t.id) in (str, int) and type(t.group) in (str, type(None))
            and all(type(x) in (str, int) for item in t.metadata.items() for x in item))


def test_the_cpp_check_passes_only_what_validate_accepts():
    from dta import _core

    rng = random.Random(12)
    counts = {"plain passed": 0, "plain refused": 0, "other refused": 0}
    for _ in range(4000):
        t, vocab = with_other_fields(random_trajectory(rng), rng), rng.choice([None, 1000])
        passed = _core.first_unchecked_trajectory([t], 0, vocab or 0, Trajectory) == 1
        ok = outcome(t, vocab) == "ok"
        if is_plain(t):
            assert passed == ok, (t, vocab, outcome(t, vocab))
            counts["plain passed" if passed else "plain refused"] += 1
        else:
            assert not passed or ok, (t, vocab)
            counts["other refused"] += not passed
    assert min(counts.values()) > 300, counts


def test_the_cpp_check_leaves_subclasses_and_other_objects_to_python():
    from dta import _core

    class Tagged(Trajectory):
        pass

    good = dict(id="a", tokens=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0])
    batch = [Trajectory(**good), Tagged(**good), Trajectory(**good), "not a trajectory", Trajectory(**good)]
    assert [_core.first_unchecked_trajectory(batch, start, 0, Trajectory) for start in range(6)] == [1, 1, 3, 3, 5, 5]
    # tuples and numpy arrays are valid but not plain lists: Python's validate decides.
    for field, value in (("tokens", (1, 2)), ("logprobs", np.array([0.0, -1.0]))):
        t = Trajectory(**{**good, field: value})
        t.validate()
        assert _core.first_unchecked_trajectory([t], 0, 0, Trajectory) == 0

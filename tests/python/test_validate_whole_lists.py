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

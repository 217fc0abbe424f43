"""Conversion between :class:`dta.Trajectory` and the wire message ``dta.v1.Trajectory``.

The two differ only in spelling: ``group`` is ``group_id`` on the wire, ``loss_mask`` is 0/1 here
and boolean there, and a missing ``reward`` is ``None`` here and an unset optional field there.
A value the wire cannot carry (a token id beyond int32, a string among the log-probabilities)
raises ``ValueError`` naming the field, as the dispatcher's rejections do; everything else is
checked by the dispatcher, which answers with the field and the reason.
"""
from __future__ import annotations

from typing import Callable, TypeVar

from dta.trajectory import Trajectory
from dta.v1 import dispatcher_pb2

T = TypeVar("T")


def _field(name: str, convert: Callable[[], T]) -> T:
    try:
        return convert()
    except (TypeError, ValueError, OverflowError) as error:
        raise ValueError(f"field '{name}': {error}") from error


def _mask_bit(value: object) -> bool:
    if value not in (0, 1):  # True and False compare equal to 1 and 0
        raise ValueError(f"{value!r} is not 0 or 1")
    return bool(value)


def to_proto(trajectory: Trajectory) -> dispatcher_pb2.Trajectory:
    """The wire message for ``trajectory``. Raises ``ValueError`` naming the trajectory's id and
    the field that the wire cannot carry."""
    try:
        return _to_proto(trajectory)
    except ValueError as error:
        raise ValueError(f"trajectory {getattr(trajectory, 'id', None)!r}: {error}") from error


def _to_proto(t: Trajectory) -> dispatcher_pb2.Trajectory:
    message = dispatcher_pb2.Trajectory()
    _field("id", lambda: setattr(message, "id", t.id))
    _field("group", lambda: setattr(message, "group_id", t.group))
    _field("tokens", lambda: message.tokens.extend(t.tokens))
    _field("loss_mask", lambda: message.loss_mask.extend(_mask_bit(m) for m in t.loss_mask))
    _field("logprobs", lambda: message.logprobs.extend(t.logprobs))
    _field("versions", lambda: message.versions.extend(t.versions))
    if t.reward is not None:
        _field("reward", lambda: setattr(message, "reward", t.reward))
    _field("advantages", lambda: message.advantages.extend(t.advantages))
    _field("ref_logprobs", lambda: message.ref_logprobs.extend(t.ref_logprobs))
    _field("metadata", lambda: message.metadata.update(t.metadata))
    return message


def from_proto(message: dispatcher_pb2.Trajectory) -> Trajectory:
    """The trajectory a wire message carries (e.g. one of a trainer's partition)."""
    return Trajectory(
        id=message.id,
        tokens=list(message.tokens),
        loss_mask=[int(m) for m in message.loss_mask],
        logprobs=list(message.logprobs),
        group=message.group_id,
        versions=list(message.versions),
        reward=message.reward if message.HasField("reward") else None,
        advantages=list(message.advantages),
        ref_logprobs=list(message.ref_logprobs),
        metadata=dict(message.metadata),
    )

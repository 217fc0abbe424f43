"""Conversion between :class:`dta.Trajectory` and the wire message ``dta.v1.Trajectory``.

The two differ only in spelling: ``group`` is ``group_id`` on the wire, ``loss_mask`` is 0/1 here
and boolean there, a missing ``reward`` is ``None`` here and an unset optional field there, and
``routed_experts`` (an int32 array here) travels as little-endian bytes in the narrowest id type
that holds its experts (UINT8 below 255, UINT16 below 65535, else INT32; the type's all-ones value
is -1, "not recorded"), as the C++ side sends it.
A value the wire cannot carry (a token id beyond int32, a string among the log-probabilities)
raises ``ValueError`` naming the field, as the dispatcher's rejections do; everything else is
checked by the dispatcher, which answers with the field and the reason.
"""
from __future__ import annotations

from typing import Callable, TypeVar

from dta.trajectory import Trajectory, routed_experts_bytes
from dta.v1 import dispatcher_pb2

_ID_WIDTHS = {dispatcher_pb2.RoutedExperts.UINT8: 1, dispatcher_pb2.RoutedExperts.UINT16: 2,
              dispatcher_pb2.RoutedExperts.INT32: 4}

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
    routed = _field("routed_experts", lambda: routed_experts_bytes(t.routed_experts))
    if routed is not None:
        _routed_experts_to_proto(*routed, message.routed_experts)
    return message


def _routed_experts_to_proto(layers: int, top_k: int, raw: bytes,
                             message: dispatcher_pb2.RoutedExperts) -> None:
    import torch

    ids = torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.int64)
    largest = int(ids.max()) if ids.numel() else 0
    id_type = (dispatcher_pb2.RoutedExperts.UINT8 if largest < 0xff else
               dispatcher_pb2.RoutedExperts.UINT16 if largest < 0xffff else
               dispatcher_pb2.RoutedExperts.INT32)
    width = _ID_WIDTHS[id_type]
    ids = torch.where(ids < 0, (1 << (8 * width)) - 1, ids)
    little_endian = torch.stack([(ids >> (8 * b)) & 0xff for b in range(width)], dim=1)
    message.layers = layers
    message.top_k = top_k
    message.id_type = id_type
    message.ids = little_endian.to(torch.uint8).numpy().tobytes()


def _routed_experts_from_proto(message: dispatcher_pb2.RoutedExperts):
    import torch

    width = _ID_WIDTHS.get(message.id_type)
    per_row = message.layers * message.top_k * (width or 0)
    if width is None or per_row <= 0 or len(message.ids) % per_row:
        raise ValueError(f"field 'routed_experts': {len(message.ids)} bytes of id type "
                         f"{message.id_type} are not whole rows of {message.layers} layers x "
                         f"{message.top_k}")
    raw = torch.frombuffer(bytearray(message.ids), dtype=torch.uint8).view(-1, width).to(torch.int64)
    ids = sum(raw[:, b] << (8 * b) for b in range(width))
    ids = torch.where(ids == (1 << (8 * width)) - 1, -1, ids)
    return ids.to(torch.int32).view(-1, message.layers, message.top_k)


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
        routed_experts=(_routed_experts_from_proto(message.routed_experts)
                        if message.HasField("routed_experts") else None),
    )

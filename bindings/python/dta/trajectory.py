"""One trajectory (rollout) as dta trains it, its validation, JSON Lines files, AReaL's and verl's
tensors.

A :class:`Trajectory` mirrors the C++ ``dta::Rollout`` (core/io/rollout.h) and the wire
message ``dta.v1.Trajectory``. Per-token fields are aligned with ``tokens``:
``logprobs[t]`` is the behaviour policy's log p(tokens[t] | tokens[:t]) and ``loss_mask[t]`` says
whether token t is trained, so the first token, which has no context, has ``loss_mask[0] == 0``.

Everything here is pure Python (``torch`` is imported only by the AReaL and verl converters and
where routed experts are decoded into a tensor), so rollout workers can use it without the compiled
extension. Per-token fields may also be numpy arrays or 1-D torch tensors (checked as tensors,
without importing torch where none is given).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import numbers
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import torch

__all__ = ["Trajectory", "read_jsonl", "write_jsonl", "from_areal", "to_areal", "from_verl", "to_verl",
           "verl_train_options", "routed_experts_from_sglang"]

# Token ids are int32 in the C++ core and on the wire.
_TOKEN_LIMIT = 2**31
# The smallest magnitude that rounds to infinity in float32 (FLT_MAX plus half an ulp): per-token
# floats are float32 in the C++ core and on the wire, so they must stay finite there.
_FLOAT32_OVERFLOW = 3.4028235677973366e38
# The largest |reward| (kMaxAbsReward in core/io/rollout.h): beyond it GRPO group advantages
# could overflow.
MAX_ABS_REWARD = 1e30
_FIELDS = ("id", "group", "tokens", "loss_mask", "logprobs", "versions", "reward", "advantages",
           "ref_logprobs", "routed_experts", "metadata")


def _field_error(name: str, what: str) -> ValueError:
    return ValueError(f"field '{name}': {what}")


def _is_int(value: Any) -> bool:
    # numbers.Integral takes numpy's integers too. bool is one: loss_mask accepts it (as the JSONL
    # reader does), the other integer fields do not.
    return isinstance(value, numbers.Integral)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _finite_float32(value: float) -> bool:
    return math.isfinite(value) and abs(value) < _FLOAT32_OVERFLOW


# Whole-list checks for the common case, plain Python numbers, each one pass in C (map, set, min,
# max, all): True means every value passes the per-value rule below; False sends validate() to its
# per-value loop, which names the first value that breaks it (and accepts what these do not
# cover, such as numpy scalars).
def _plain_ints_within(values: Any, low: int, high: int) -> bool:
    """Every value a Python int (not a bool) in [low, high)."""
    return len(values) == 0 or (set(map(type, values)) <= {int} and low <= min(values)
                                and max(values) < high)


def _plain_finite_float32s(values: Any) -> bool:
    """Every value a Python float or int (not a bool), finite in float32."""
    return len(values) == 0 or (set(map(type, values)) <= {float, int} and all(map(math.isfinite, values))
                                and max(map(abs, values)) < _FLOAT32_OVERFLOW)


def _plain_zeros_and_ones(values: Any) -> bool:
    """Every value a Python int or bool equal to 0 or 1."""
    return set(map(type, values)) <= {int, bool} and set(values) <= {0, 1}


# --- per-token fields given as torch tensors ----------------------------------------------------
#
# A tensor is checked as a whole (its dtype and shape, then each rule as one reduction on its
# device), not value by value: indexing a tensor gives 0-d tensors, which are not Python numbers,
# and on a GPU each would be a device round trip. dta._core then copies it once, to the CPU and the
# field's C++ type together (rollout_conversion.cc).

# What each per-token field takes from a tensor: integers (tokens, versions), integers or booleans
# (loss_mask), or numbers that are not booleans (the float fields, which take ints as lists do).
_TENSOR_KINDS = {"tokens": "integers", "versions": "integers", "loss_mask": "integers or booleans",
                 "logprobs": "floating-point numbers or integers", "advantages": "floating-point numbers or integers",
                 "ref_logprobs": "floating-point numbers or integers"}


def _torch_tensor(values: Any) -> bool:
    """Whether values is a torch.Tensor; never imports torch (a process that made one has)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(values, torch.Tensor)


def _check_tensor(name: str, values: torch.Tensor) -> None:
    """A per-token field given as a tensor must be 1-D and of a dtype the field takes (an empty
    one of any dtype: it holds no value to be wrong)."""
    if values.dim() != 1:
        raise _field_error(name, f"expected a 1-D tensor, got a tensor of shape {list(values.shape)}")
    if values.numel() == 0:
        return
    import torch

    integer = not (values.is_floating_point() or values.is_complex()) and values.dtype != torch.bool
    kind = _TENSOR_KINDS[name]
    takes = {"integers": integer, "integers or booleans": integer or values.dtype == torch.bool,
             "floating-point numbers or integers": integer or values.is_floating_point()}[kind]
    if not takes:
        raise _field_error(name, f"must hold {kind}, got a {values.dtype} tensor")


def _first_true(bad: torch.Tensor) -> int | None:
    """The first position where the bool tensor is true, or None."""
    if not bool(bad.any()):
        return None
    return int(bad.nonzero()[0, 0])


def _first_outside(values: torch.Tensor, low: int, high: int) -> tuple[int, int] | None:
    """(position, value) of an integer tensor's first value outside [low, high), or None."""
    import torch

    values = values.to(torch.int64)  # bounds beyond a narrower dtype's range compare exactly
    i = _first_true((values < low) | (values >= high))
    return None if i is None else (i, int(values[i]))


def _first_not_finite_float32(values: torch.Tensor) -> int | None:
    """The position of a float tensor's first value that is not finite in float32, or None (ints
    always are). A cast to float32 rounds to infinity exactly what _finite_float32 refuses."""
    import torch

    if not values.is_floating_point():
        return None
    return _first_true(~torch.isfinite(values.to(torch.float32)))


def _as_list(values: Any) -> list:
    """A per-token field as a list (a tensor's or an array's values through one tolist())."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


# --- routed experts (routing replay) --------------------------------------------------------------
#
# Trajectory.routed_experts holds what the inference engine routed each token to, int [rows, layers,
# top_k]: row t the top_k experts of token t at each of `layers` decoder layers (every decoder
# layer, as SGLang and vLLM return them, or the sparse ones only), rows = len(tokens) - 1 (the
# engines: the last sampled token is never forwarded) or len(tokens), -1 throughout a (row, layer)
# the engine did not record (the trainer's router picks those). C++: core/io/routed_experts.h.

_ROUTED = "routed_experts"
_ROUTED_FORM = "a 3-D integer array [rows, layers, top_k] (a torch tensor, a numpy array or nested lists)"
_NOT_RECORDED = -1


def _numpy_array(value: Any) -> bool:
    """Whether value is a numpy.ndarray; never imports numpy."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.ndarray)


def _native_int32s(raw: bytes) -> bytes:
    """Little-endian int32s in this machine's order, or back (the same swap both ways)."""
    if sys.byteorder == "little":
        return raw
    import array

    values = array.array("i", raw)
    values.byteswap()
    return values.tobytes()


def _check_routed_shape(rows: int, layers: int, top_k: int, tokens: int) -> None:
    if layers <= 0 or top_k <= 0:
        raise _field_error(_ROUTED, f"layers ({layers}) and top_k ({top_k}) must be positive")
    if rows not in (tokens, tokens - 1):
        raise _field_error(_ROUTED, f"{rows} rows for {tokens} tokens ({tokens} or {tokens - 1} expected)")


def _bad_id(row: int, layer: int, value: int) -> ValueError:
    if value < _NOT_RECORDED:
        return _field_error(_ROUTED, f"row {row}, layer {layer}: expert {value} is neither an expert nor "
                            f"{_NOT_RECORDED} (not recorded)")
    return _field_error(_ROUTED, f"row {row}, layer {layer}: expert {value} is not below 2^31")


def _in_part(row: int, layer: int, ids: list) -> ValueError:
    return _field_error(_ROUTED, f"row {row}, layer {layer}: [{', '.join(str(int(i)) for i in ids)}] is recorded "
                        "only in part (all its ids or none may be -1)")


def _check_routed_array(value: Any, tokens: int) -> None:
    """A torch tensor's or numpy array's routed experts, checked as whole arrays (on the tensor's
    device)."""
    tensor = _torch_tensor(value)
    if value.ndim != 3:
        raise _field_error(_ROUTED, f"expected {_ROUTED_FORM}, got shape {list(value.shape)}")
    if tensor:
        import torch as xp

        integer = not (value.is_floating_point() or value.is_complex()) and value.dtype != xp.bool
        what = f"a {value.dtype} tensor"
    else:
        import numpy as xp

        integer = value.dtype.kind in "iu"
        what = f"a numpy {value.dtype} array"
    if not integer:
        raise _field_error(_ROUTED, f"must hold integers, got {what}")
    rows, layers, top_k = (int(x) for x in value.shape)
    _check_routed_shape(rows, layers, top_k, tokens)
    if rows == 0:
        return
    # torch compares with a Python int in the tensor's dtype, where -1 and 2^31 may wrap: signed
    # dtypes up to 32 bits hold no id too large and compare with -1 exactly, the others are
    # compared as int64. numpy compares exactly.
    narrow = tensor and value.dtype in (xp.int8, xp.int16, xp.int32)
    if tensor and not narrow:
        value = value.to(xp.int64)
    bad = value < _NOT_RECORDED
    if not narrow:
        bad |= value >= _TOKEN_LIMIT
    if bool(bad.any()):
        row, layer, slot = (int(i) for i in xp.argwhere(bad)[0])
        raise _bad_id(row, layer, int(value[row, layer, slot]))
    unrecorded = value == _NOT_RECORDED
    in_part = unrecorded.any(axis=2) & ~unrecorded.all(axis=2)
    if bool(in_part.any()):
        row, layer = (int(i) for i in xp.argwhere(in_part)[0])
        raise _in_part(row, layer, value[row, layer].tolist())


def _check_routed_lists(value: Any, layers: int, top_k: int) -> None:
    """Nested sequences [rows][layers][top_k] of integers in [-1, 2^31), each (row, layer) all -1
    or none; checked value by value where a whole-list check does not pass."""
    for r, row in enumerate(value):
        if not isinstance(row, (list, tuple)) or len(row) != layers:
            raise _field_error(_ROUTED, f"row {r} is not a list of {layers} layers of {top_k} ids")
        for layer, ids in enumerate(row):
            if not isinstance(ids, (list, tuple)) or len(ids) != top_k:
                raise _field_error(_ROUTED, f"row {r}, layer {layer} is not a list of {top_k} ids")
            if not _plain_ints_within(ids, _NOT_RECORDED, _TOKEN_LIMIT):
                for v in ids:
                    if not _is_int(v) or isinstance(v, bool):
                        raise _field_error(_ROUTED, f"row {r}, layer {layer}: {v!r} is not an integer")
                    if not _NOT_RECORDED <= v < _TOKEN_LIMIT:
                        raise _bad_id(r, layer, int(v))
            if _NOT_RECORDED in ids and ids.count(_NOT_RECORDED) != top_k:
                raise _in_part(r, layer, list(ids))


def _check_routed_experts(value: Any, tokens: int) -> None:
    """Trajectory.validate's rules for routed_experts (value not None) of a rollout of `tokens`."""
    if _torch_tensor(value) or _numpy_array(value):
        _check_routed_array(value, tokens)
        return
    if not isinstance(value, (list, tuple)):
        raise _field_error(_ROUTED, f"must be {_ROUTED_FORM} or None, got {type(value).__name__}")
    if not value:
        raise _field_error(_ROUTED, "an empty list has no layers and top_k (give an array of shape "
                           "[0, layers, top_k])")
    first = value[0]
    if not isinstance(first, (list, tuple)) or not first or not isinstance(first[0], (list, tuple)):
        raise _field_error(_ROUTED, f"expected {_ROUTED_FORM}, got a list whose first row is not a list of "
                           "lists")
    _check_routed_shape(len(value), len(first), len(first[0]), tokens)
    _check_routed_lists(value, len(first), len(first[0]))


def routed_experts_bytes(value: Any) -> tuple[int, int, bytes] | None:
    """(layers, top_k, the ids as little-endian int32 [rows, layers, top_k], row-major) of a
    validated trajectory's ``routed_experts`` (see :meth:`Trajectory.validate`), or None for None:
    the bytes of SGLang's and vLLM's payload, of the JSON Lines form and of the wire. A tensor is
    copied once, to the CPU as int32."""
    if value is None:
        return None
    if _torch_tensor(value) or _numpy_array(value):
        if value.ndim != 3:
            raise _field_error(_ROUTED, f"expected {_ROUTED_FORM}, got shape {list(value.shape)}")
        shape = tuple(value.shape)
        if _torch_tensor(value):
            import torch

            ids = value.detach().to("cpu", torch.int32).contiguous()
            if ids.storage_offset() or ids.untyped_storage().nbytes() != 4 * ids.numel():
                ids = ids.clone()  # a view: its storage holds more than its values
            raw = bytes(ids.untyped_storage())
        else:
            import numpy as np

            raw = np.asarray(value, dtype=np.int32, order="C").tobytes()
    else:
        import array

        if not (isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)) and value[0]):
            raise _field_error(_ROUTED, f"expected {_ROUTED_FORM}")
        shape = (len(value), len(value[0]), len(value[0][0]))
        raw = array.array("i", (int(i) for row in value for layer in row for i in layer)).tobytes()
    return int(shape[1]), int(shape[2]), _native_int32s(raw)


def routed_experts_from_sglang(payload: str | bytes, num_layers: int, top_k: int) -> torch.Tensor:
    """The routed experts of SGLang's ``meta_info["routed_experts"]`` (and vLLM's, which returns
    the same payload) as an int32 tensor [rows, num_layers, top_k], for
    :attr:`Trajectory.routed_experts`.

    The payload is base64 of little-endian int32 [rows, num_layers, top_k], row-major (SGLang with
    ``--enable-return-routed-experts`` and ``return_routed_experts: true``); rows is the request's
    tokens less the last sampled one, which was never forwarded, so ``len(tokens) - 1`` for a
    trajectory of the request's prompt and output. num_layers is the model's
    ``num_hidden_layers`` (the engines record every decoder layer; dense layers' entries are
    unused), top_k its ``num_experts_per_tok``.

    Raises:
        ValueError: ``field 'routed_experts': ...``: num_layers or top_k not positive, a payload
            that is not base64, or bytes that are not whole rows of num_layers x top_k int32 ids.
    """
    import binascii

    import torch

    for name, count in (("num_layers", num_layers), ("top_k", top_k)):
        if not _is_int(count) or isinstance(count, bool) or count <= 0:
            raise _field_error(_ROUTED, f"{name} must be a positive integer, got {count!r}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise _field_error(_ROUTED, f"is not base64 ({e})") from None
    row_bytes = 4 * num_layers * top_k
    if len(raw) % row_bytes:
        raise _field_error(_ROUTED, f"{len(raw)} bytes are not whole rows of {num_layers} layers x {top_k} int32 "
                           f"experts ({row_bytes} bytes)")
    if not raw:
        return torch.empty((0, num_layers, top_k), dtype=torch.int32)
    ids = torch.frombuffer(bytearray(_native_int32s(raw)), dtype=torch.int32)
    return ids.reshape(len(raw) // row_bytes, num_layers, top_k)


def _routed_experts_from_json(value: Any) -> torch.Tensor:
    """The JSON Lines form of routed_experts (core/io/rollout_jsonl.h) as an int32 tensor:
    {"layers", "top_k", "dtype": "int32", "base64"} or {"layers", "top_k", "ids": [[[...]]]}."""
    if not isinstance(value, dict):
        raise _field_error(_ROUTED, 'must be an object {"layers", "top_k", "base64" or "ids"}')
    for key in value:
        if key not in ("layers", "top_k", "dtype", "base64", "ids"):
            raise _field_error(_ROUTED, f"unknown member '{key}' (expected layers, top_k, dtype, base64, ids)")

    def positive(key: str) -> int:
        if key not in value:
            raise _field_error(_ROUTED, f"'{key}' is missing")
        count = value[key]
        if not _is_int(count) or isinstance(count, bool) or not 0 < count < _TOKEN_LIMIT:
            raise _field_error(_ROUTED, f"'{key}' must be a positive integer")
        return int(count)

    layers, top_k = positive("layers"), positive("top_k")
    if "base64" in value:
        if value.get("dtype", "int32") != "int32":
            raise _field_error(_ROUTED, "'dtype' must be \"int32\" (the engines' little-endian ids)")
        if not isinstance(value["base64"], str):
            raise _field_error(_ROUTED, "'base64' must be a string")
        return routed_experts_from_sglang(value["base64"], layers, top_k)
    if "ids" not in value:
        raise _field_error(_ROUTED, "needs 'base64' or 'ids'")
    ids = value["ids"]
    if not isinstance(ids, list):
        raise _field_error(_ROUTED, "'ids' must be an array of rows")
    _check_routed_lists(ids, layers, top_k)
    import torch

    return torch.tensor(ids, dtype=torch.int32).reshape(len(ids), layers, top_k)


def _routed_tensor(value: Any) -> torch.Tensor:
    """A validated routed_experts value as a CPU int32 tensor [rows, layers, top_k]."""
    import torch

    if _torch_tensor(value):
        return value.detach().to("cpu", torch.int32)
    return torch.as_tensor(value).to(torch.int32)


@dataclass
class Trajectory:
    """One rollout: token ids and per-token training data.

    The per-token fields are lists of plain Python numbers as the JSONL reader and most rollout
    workers make them (the fastest to check and convert), or any other sequence of numbers (numpy
    arrays), or 1-D torch tensors on any device (integer dtypes for ``tokens`` and ``versions``,
    integer or bool for ``loss_mask``, integer or floating for the float fields), which
    ``dta.Trainer`` copies once to the CPU.

    Attributes:
        id: Unique within a batch (the dispatcher de-duplicates resends by it). Non-empty.
        tokens: Token ids in [0, 2^31) (and below the model's vocabulary), at least one.
        loss_mask: 0/1 per token; 1 = trained. ``loss_mask[0]`` must be 0.
        logprobs: Behaviour-policy log p(tokens[t] | tokens[:t]) per token (0 where unknown,
            e.g. prompt tokens); finite in float32.
        group: Rollouts sampled from the same prompt (GRPO's group; advantages are computed
            over the rollouts of a batch with the same group).
        versions: Optional: policy version that produced each token (-1: prompt), >= -1.
        reward: Optional: the trajectory's reward (GRPO advantages come from it); finite,
            at most MAX_ABS_REWARD in magnitude.
        advantages: Optional: per-token advantages, used as given instead of the reward's.
        ref_logprobs: Optional: reference-policy log-probabilities per token (KL penalty).
        metadata: Free-form strings carried along (ignored by training).
        routed_experts: Optional, for routing replay (mixture-of-experts models): the experts the
            inference engine routed each token to, integers [rows, layers, top_k] as a torch
            tensor (any device), a numpy array or nested lists. Row t holds token t's top_k
            experts at each of ``layers`` decoder layers (every decoder layer, as SGLang and vLLM
            return them, or the sparse ones only); rows = len(tokens) - 1 (the engines' form: the
            last sampled token is never forwarded, :func:`routed_experts_from_sglang`) or
            len(tokens); -1 throughout a (row, layer) that was not recorded (the trainer's router
            picks those experts). The trainer routes every recorded token as given.
    """

    id: str
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    group: str = ""
    versions: list[int] = field(default_factory=list)
    reward: float | None = None
    advantages: list[float] = field(default_factory=list)
    ref_logprobs: list[float] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    routed_experts: Any = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Checks the rules of the C++ ``ValidateRollout`` (and the field types).

        Per-token fields may be lists, other sequences of Python or numpy numbers (checked value
        by value), or 1-D torch tensors on any device: integer dtypes for ``tokens`` and
        ``versions``, integer or bool for ``loss_mask``, integer or floating for the float fields
        (checked as whole tensors). ``routed_experts``, when set, must be 3-D of an integer dtype
        (nested lists of integers) with rows for every token or all but the last, positive layers
        and top_k, ids >= -1 and below 2^31, and each (row, layer) either -1 throughout or free of
        -1; whether the ids fit the model is checked by the trainer.

        Args:
            vocab_size: When given (> 0), token ids must be below it.

        Raises:
            ValueError: The first broken rule, with a message starting ``field '<name>': `` and
                naming the position, e.g. ``field 'loss_mask': 5 values for 6 tokens``, or the type
                given, e.g. ``field 'tokens': must hold integers, got a torch.float32 tensor``.
        """
        if not isinstance(self.id, str):
            raise _field_error("id", f"must be a string, got {type(self.id).__name__}")
        if not self.id:
            raise _field_error("id", "empty")
        if not isinstance(self.group, str):
            raise _field_error("group", f"must be a string, got {type(self.group).__name__}")
        for name in ("tokens", "loss_mask", "logprobs", "versions", "advantages", "ref_logprobs"):
            values = getattr(self, name)
            if _torch_tensor(values):
                _check_tensor(name, values)
            elif isinstance(values, (str, bytes)) or not (hasattr(values, "__len__") and hasattr(values, "__iter__")):
                raise _field_error(name, f"must be a list, got {type(values).__name__}")
        n = len(self.tokens)
        if n == 0:
            raise _field_error("tokens", "empty rollout")
        limit = vocab_size if vocab_size is not None and vocab_size > 0 else None
        # Each per-value loop below runs only where a whole-list check did not already pass every
        # value, and then names the first value that breaks its rule; tensors are checked whole.
        if _torch_tensor(self.tokens):
            outside = _first_outside(self.tokens, 0, limit or _TOKEN_LIMIT)
            if outside is not None:
                raise _field_error("tokens", f"token {outside[0]} = {outside[1]} is outside [0, {limit or '2^31'})")
        unchecked = () if _torch_tensor(self.tokens) or _plain_ints_within(self.tokens, 0, limit or _TOKEN_LIMIT) \
            else self.tokens
        for i, token in enumerate(unchecked):
            if not _is_int(token) or isinstance(token, bool):
                raise _field_error("tokens", f"value {i} is not an integer")
            if token < 0 or token >= (limit or _TOKEN_LIMIT):
                raise _field_error("tokens", f"token {i} = {token} is outside [0, {limit or '2^31'})")
        for name, optional in (("loss_mask", False), ("logprobs", False), ("versions", True),
                               ("advantages", True), ("ref_logprobs", True)):
            values = getattr(self, name)
            if optional and len(values) == 0:
                continue
            if len(values) != n:
                raise _field_error(name, f"{len(values)} values for {n} tokens")
        for name in ("logprobs", "advantages", "ref_logprobs"):
            values = getattr(self, name)
            if _torch_tensor(values):
                i = _first_not_finite_float32(values)
                if i is not None:
                    raise _field_error(name, f"value {i} is not finite")
                continue
            unchecked = () if _plain_finite_float32s(values) else values
            for i, value in enumerate(unchecked):
                if not _is_number(value):
                    raise _field_error(name, f"value {i} is not a number")
                if not _finite_float32(value):
                    raise _field_error(name, f"value {i} is not finite")
        mask = self.loss_mask
        if _torch_tensor(mask):
            i = _first_true((mask != 0) & (mask != 1))
            if i is not None:
                raise _field_error("loss_mask", f"value {i} is {mask[i].item()!r}, not 0 or 1")
        unchecked = () if _torch_tensor(mask) or _plain_zeros_and_ones(mask) else mask
        for i, value in enumerate(unchecked):
            if not _is_int(value) or value not in (0, 1):
                raise _field_error("loss_mask", f"value {i} is {value!r}, not 0 or 1")
        if mask[0] != 0:
            raise _field_error("loss_mask",
                               "value 0 is 1, but the first token has no context to be predicted from")
        if _torch_tensor(self.versions):
            outside = _first_outside(self.versions, -1, _TOKEN_LIMIT)
            if outside is not None:
                i, value = outside
                raise _field_error("versions", f"value {i} is {value} "
                                   f"({'must be >= -1' if value < -1 else 'must be < 2^31'})")
        unchecked = () if _torch_tensor(self.versions) or _plain_ints_within(self.versions, -1, _TOKEN_LIMIT) \
            else self.versions
        for i, value in enumerate(unchecked):
            if not _is_int(value) or isinstance(value, bool):
                raise _field_error("versions", f"value {i} is not an integer")
            if value < -1:
                raise _field_error("versions", f"value {i} is {value} (must be >= -1)")
            if value >= _TOKEN_LIMIT:
                raise _field_error("versions", f"value {i} is {value} (must be < 2^31)")
        if self.reward is not None:
            if not _is_number(self.reward):
                raise _field_error("reward", "must be a number")
            if not math.isfinite(self.reward):
                raise _field_error("reward", "not finite")
            if abs(self.reward) > MAX_ABS_REWARD:
                raise _field_error("reward", f"{self.reward:g} is beyond the limit of +-{MAX_ABS_REWARD:g}")
        if self.routed_experts is not None:
            _check_routed_experts(self.routed_experts, n)
        if not isinstance(self.metadata, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.metadata.items()):
            raise _field_error("metadata", "must map strings to strings")

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the repo's JSON Lines format (optional fields only when set)."""
        out: dict[str, Any] = {
            "id": self.id,
            "group": self.group,
            "tokens": [int(t) for t in _as_list(self.tokens)],
            "loss_mask": [int(m) for m in _as_list(self.loss_mask)],
            "logprobs": [float(x) for x in _as_list(self.logprobs)],
        }
        if len(self.versions):
            out["versions"] = [int(v) for v in _as_list(self.versions)]
        if self.reward is not None:
            out["reward"] = float(self.reward)
        if len(self.advantages):
            out["advantages"] = [float(x) for x in _as_list(self.advantages)]
        if len(self.ref_logprobs):
            out["ref_logprobs"] = [float(x) for x in _as_list(self.ref_logprobs)]
        routed = routed_experts_bytes(self.routed_experts)
        if routed is not None:
            layers, top_k, ids = routed
            out["routed_experts"] = {"layers": layers, "top_k": top_k, "dtype": "int32",
                                     "base64": base64.b64encode(ids).decode("ascii")}
        if self.metadata:
            out["metadata"] = dict(self.metadata)
        return out

    @classmethod
    def from_dict(cls, obj: Any, *, vocab_size: int | None = None) -> Trajectory:
        """Parses one JSON object of the JSON Lines format and validates it.

        ``id`` and ``group`` may be strings or integers; ``loss_mask`` may hold booleans;
        ``metadata`` values that are not strings are kept as their JSON text; ``routed_experts``
        (``{"layers", "top_k", "dtype": "int32", "base64"}``, or ``"ids"`` nested arrays in place
        of ``dtype`` and ``base64``) becomes an int32 torch tensor. Any unknown field is an error,
        as in the C++ reader, so a misspelt optional field is never silently dropped.

        Raises:
            ValueError: Naming the field (``field 'tokens': missing``).
        """
        if not isinstance(obj, dict):
            raise ValueError("a rollout must be a JSON object")
        for key in obj:
            if key not in _FIELDS:
                raise _field_error(key, "unknown field (expected " + ", ".join(_FIELDS) + ")")
        for key in ("id", "group", "tokens", "loss_mask", "logprobs"):
            if key not in obj:
                raise _field_error(key, "missing")

        def name(key: str) -> str:
            value = obj[key]
            if isinstance(value, str):
                return value
            if _is_int(value) and not isinstance(value, bool):
                return str(value)
            raise _field_error(key, "must be a string or an integer")

        def array(key: str) -> list[Any]:
            value = obj.get(key, [])
            if not isinstance(value, list):
                raise _field_error(key, "must be an array")
            return value

        metadata = obj.get("metadata", {})
        if not isinstance(metadata, dict):
            raise _field_error("metadata", "must be an object")
        reward = obj.get("reward")
        if reward is not None and not _is_number(reward):
            raise _field_error("reward", "must be a number")
        trajectory = cls(
            id=name("id"),
            group=name("group"),
            tokens=array("tokens"),
            loss_mask=[int(m) if isinstance(m, bool) else m for m in array("loss_mask")],
            logprobs=array("logprobs"),
            versions=array("versions"),
            reward=None if reward is None else float(reward),
            advantages=array("advantages"),
            ref_logprobs=array("ref_logprobs"),
            metadata={str(k): v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()},
            routed_experts=_routed_experts_from_json(obj[_ROUTED]) if _ROUTED in obj else None,
        )
        trajectory.validate(vocab_size)
        # Integers are valid floats in JSON; keep the float fields floats.
        for key in ("logprobs", "advantages", "ref_logprobs"):
            setattr(trajectory, key, [float(x) for x in getattr(trajectory, key)])
        return trajectory


def read_jsonl(path: str | os.PathLike[str], *, vocab_size: int | None = None) -> list[Trajectory]:
    """Reads and validates every trajectory of a JSON Lines file (docs/usage.md's format).

    Blank lines are skipped. Ids must be unique in the file.

    Raises:
        ValueError: At the first bad line, naming the file, the 1-based line, the rollout when its
            id is known and the field, as ``dta-tree`` does:
            ``data.jsonl:17: rollout 'b7': field 'loss_mask': 9 values for 10 tokens``.
        OSError: The file cannot be read.
    """
    trajectories: list[Trajectory] = []
    line_of_id: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: malformed JSON: {e}") from None
            try:
                trajectory = Trajectory.from_dict(obj, vocab_size=vocab_size)
            except ValueError as e:
                rid = obj.get("id") if isinstance(obj, dict) else None
                who = f" rollout '{rid}':" if isinstance(rid, (str, int)) and rid != "" else ""
                raise ValueError(f"{path}:{number}:{who} {e}") from None
            if trajectory.id in line_of_id:
                raise ValueError(f"{path}:{number}: rollout '{trajectory.id}': field 'id': duplicate of "
                                 f"line {line_of_id[trajectory.id]}")
            line_of_id[trajectory.id] = number
            trajectories.append(trajectory)
    return trajectories


def write_jsonl(path: str | os.PathLike[str], trajectories: Iterable[Trajectory]) -> None:
    """Validates and writes trajectories, one JSON object per line, replacing the file.

    Raises:
        ValueError: A trajectory is invalid (``trajectory 3 ('r7'): field ...``) or two share an
            id; nothing is written then.
        OSError: The file cannot be written.
    """
    lines = []
    seen: set[str] = set()
    for i, trajectory in enumerate(trajectories):
        try:
            trajectory.validate()
        except ValueError as e:
            raise ValueError(f"trajectory {i} ({trajectory.id!r}): {e}") from None
        if trajectory.id in seen:
            raise ValueError(f"trajectory {i} ({trajectory.id!r}): field 'id': duplicate")
        seen.add(trajectory.id)
        lines.append(json.dumps(trajectory.to_dict(), separators=(",", ":"), allow_nan=False))
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")


# --- AReaL's tensor dicts -------------------------------------------------------------------------
#
# AReaL's rollout workflows (areal/workflow/rlvr.py, multi_turn.py) return one dict per trajectory
# of [1, L] tensors aligned with the tokens exactly as here:
#
#   input_ids       int64  [1, L]  prompt + generated tokens
#   loss_mask       int64  [1, L]  0 for prompt tokens, 1 for generated ones
#   logprobs        float32[1, L]  0 for prompt tokens, the generated token's log-probability
#   versions        int64  [1, L]  -1 for prompt tokens, the policy version of each generated one
#   attention_mask  bool   [1, L]  ones (padding, in a padded batch, is zeros at the end)
#   rewards         float32[1]     the trajectory's reward (one per row, not per token)
#
# AReaL's PPO actor then shifts them to the logits' positions (PPOActor.compute_advantages:
# `torch.roll(x, shifts=-1, dims=-1)` on loss_mask and logprobs), so that position t holds what the
# model's output at position t predicts, token t + 1; advantages, ref_logp and prox_logp are
# computed in that shifted frame and versions are left unshifted. `shifted=True` reads and
# writes that frame: loss_mask, logprobs, advantages and ref_logp rolled by -1 over the (padded)
# row, versions as they are. The roll wraps token 0's values (mask 0, logprob 0) to the last
# position, so the conversion is exact both ways.

_SHIFTED_KEYS = {"loss_mask": "loss_mask", "logprobs": "logprobs", "advantages": "advantages",
                 "ref_logp": "ref_logprobs"}


def _row(d: dict[str, Any], key: str, length: int | None) -> torch.Tensor:
    """d[key] as a 1-D tensor: a [1, L] tensor's only row."""
    import torch

    value = d[key]
    if not isinstance(value, torch.Tensor):
        raise _field_error(key, f"must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != 2 or value.size(0) != 1:
        raise _field_error(key, f"expected shape [1, L], got {list(value.shape)}")
    if length is not None and value.size(1) != length:
        raise _field_error(key, f"{value.size(1)} values for {length} tokens (input_ids)")
    return value[0].detach().cpu()


def from_areal(d: dict[str, Any], *, id: str, group: str = "", shifted: bool,
               vocab_size: int | None = None) -> Trajectory:
    """Converts one AReaL trajectory dict of [1, L] tensors into a validated :class:`Trajectory`.

    Args:
        d: ``input_ids``, ``loss_mask`` and ``logprobs`` (required); ``versions``, ``rewards``
            ([1] or a scalar), ``attention_mask`` (right padding is dropped), ``advantages``,
            ``ref_logp`` and ``routed_experts`` (optional; see below). Other keys are ignored.
        id: The trajectory's id (AReaL dicts carry none).
        group: Its GRPO group, e.g. the prompt's id.
        shifted: Whether loss_mask, logprobs, advantages and ref_logp are in AReaL's shifted
            (logits) frame, i.e. after ``PPOActor.compute_advantages``: position t refers to token
            t + 1. False for what rollout workflows return (aligned with tokens, as here).
        vocab_size: When given, token ids must be below it.

    Frames are checked where the data can tell them apart: in the logits frame the last real
    position predicts nothing, so ``shifted=True`` refuses a dict whose loss_mask trains it (a
    tokens-frame dict, whose last generated token is trained); and AReaL gives prompt and tool
    tokens version -1, so with ``versions`` (some >= 0) a trained token of version -1 means
    loss_mask and versions are one position apart (the other frame, or a mixed dict). A dict
    without versions read with ``shifted=False`` although it is shifted is caught only when its
    first token ends up trained (``field 'loss_mask': value 0 is 1``).

    ``routed_experts`` (R3, AReaL's ``rlvr_r3_patch``): integers [1, L, layers, top_k] (or
    [L, layers, top_k]) aligned with ``input_ids`` in either frame (AReaL never shifts it). Its row
    of the last real token is dropped: the engine records none for the last sampled token, which
    AReaL's ``preprocess_routed_experts_batch`` fills with zeros, so the trajectory gets
    len(tokens) - 1 rows, as the engines give them.

    Raises:
        ValueError: Naming the AReaL key for a bad type or shape, or the trajectory field for a
            broken rule (``field 'loss_mask': value 0 is 1, ...`` when a shifted dict was read as
            unshifted, say), or a frame that contradicts ``shifted`` (see above).
    """
    import torch

    if "input_ids" not in d:
        raise _field_error("input_ids", "missing")
    ids = _row(d, "input_ids", None)
    padded = ids.numel()
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise _field_error("input_ids", f"must be integers, got {ids.dtype}")
    length = padded
    if d.get("attention_mask") is not None:
        attention = _row(d, "attention_mask", padded).to(torch.int64)
        length = int(attention.sum())
        if not torch.equal(attention[:length], torch.ones(length, dtype=torch.int64)) or attention[length:].any():
            raise _field_error("attention_mask", "must be ones followed by padding zeros")

    def per_token(key: str) -> torch.Tensor:
        row = _row(d, key, padded)
        if key in _SHIFTED_KEYS and shifted:
            row = torch.roll(row, shifts=1)  # undoes AReaL's roll(-1) over the padded row
        return row[:length]

    for key in ("loss_mask", "logprobs"):
        if key not in d:
            raise _field_error(key, "missing")
    mask = per_token("loss_mask")
    if mask.is_floating_point() and not torch.all((mask == 0) | (mask == 1)):
        raise _field_error("loss_mask", "values must be 0 or 1")
    if shifted and length and _row(d, "loss_mask", padded)[length - 1]:
        raise _field_error("loss_mask", f"position {length - 1}, the last token's, is trained, but in the logits "
                           "frame (shifted=True) it predicts nothing: the dict is in the tokens' frame (pass "
                           "shifted=False, or AReaL's PPOActor.compute_advantages, which shifts it)")
    reward = None
    if d.get("rewards") is not None:
        rewards = d["rewards"]
        if not isinstance(rewards, torch.Tensor) or rewards.numel() != 1:
            raise _field_error("rewards", "must be a tensor with one value ([1])")
        reward = float(rewards.reshape(()).item())
    mask = mask.to(torch.int64)
    versions = per_token("versions").to(torch.int64) if d.get("versions") is not None else None
    routed = _areal_routed_experts(d[_ROUTED], padded, length) if d.get(_ROUTED) is not None else None
    trajectory = Trajectory(
        id=id,
        group=group,
        tokens=_plain_values(ids[:length], torch.int64),
        loss_mask=_plain_values(mask, torch.int64),
        logprobs=_plain_values(per_token("logprobs"), torch.float64),
        versions=_plain_values(versions, torch.int64) if versions is not None else [],
        reward=reward,
        advantages=_plain_values(per_token("advantages"), torch.float64) if d.get("advantages") is not None else [],
        ref_logprobs=_plain_values(per_token("ref_logp"), torch.float64) if d.get("ref_logp") is not None else [],
        routed_experts=routed,
    )
    _validate(trajectory, vocab_size)
    if versions is not None:
        _check_trained_tokens_generated(mask, versions, shifted)
    return trajectory


def _routed_rows(value: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """value[start:stop] ([tokens, layers, top_k] of integers) as a CPU int32 tensor of its own."""
    import torch

    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise _field_error(_ROUTED, f"must hold integers, got {value.dtype}")
    return value[start:stop].to("cpu", torch.int32, copy=True)


def _areal_routed_experts(value: Any, padded: int, length: int) -> torch.Tensor:
    """AReaL's routed_experts [1, L, layers, top_k] or [L, layers, top_k]: the rows of the first
    length - 1 tokens (the last real token's is AReaL's zero fill)."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise _field_error(_ROUTED, f"must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() == 4 and value.size(0) == 1:
        value = value[0]
    if value.dim() != 3:
        raise _field_error(_ROUTED, f"expected shape [1, L, layers, top_k], got {list(value.shape)}")
    if value.size(0) != padded:
        raise _field_error(_ROUTED, f"{value.size(0)} rows for {padded} tokens (input_ids)")
    return _routed_rows(value.detach(), 0, max(length - 1, 0))


def _plain_values(row: torch.Tensor, dtype: torch.dtype) -> list:
    """A tensor's values as a list of plain Python ints (dtype int64) or floats (float64): int() /
    float() of each value (a cast to int64 truncates as int() does), a few times faster than
    converting value by value in Python, and what dta._core's check of plain values takes."""
    return row.to(dtype).tolist()


def _validate(trajectory: Trajectory, vocab_size: int | None) -> None:
    """trajectory.validate(vocab_size), through dta._core's C++ check of plain Python values (the
    same rules, one pass over each list) where it passes; validate decides otherwise and names the
    broken rule."""
    from . import _core

    if _core.first_unchecked_trajectory([trajectory], 0, vocab_size or 0, Trajectory) == 0:
        trajectory.validate(vocab_size)


def _check_trained_tokens_generated(mask: torch.Tensor, versions: torch.Tensor, shifted: bool) -> None:
    """AReaL gives prompt and tool tokens version -1 (and loss_mask 0), generated tokens the
    policy's version (>= 0): a trained token of version -1 means loss_mask is one position off
    versions. Versions all -1 (unknown) say nothing. mask and versions: the trajectory's, as
    int64 tensors."""
    if not bool((versions >= 0).any()):
        return
    off = ((mask != 0) & (versions < 0)).nonzero()
    if off.numel():
        t = int(off[0, 0])
        other = "tokens' frame (shifted=False)" if shifted else "logits frame (shifted=True)"
        raise _field_error("loss_mask", f"token {t} is trained but its version is {int(versions[t])} (a prompt or "
                           f"tool token): loss_mask is one position off versions, so the dict is in the {other} "
                           "or mixes frames")


def to_areal(trajectory: Trajectory, *, shifted: bool) -> dict[str, torch.Tensor]:
    """Converts a :class:`Trajectory` into an AReaL trajectory dict of [1, L] tensors.

    Gives ``input_ids``, ``loss_mask``, ``logprobs``, ``attention_mask`` (ones), and when set
    ``versions``, ``rewards`` ([1]), ``advantages``, ``ref_logp`` and ``routed_experts``
    (int32 [1, L, layers, top_k], zeros where the trajectory has no row, as AReaL fills them), with
    AReaL's dtypes (int64, float32, bool). ``shifted=True`` writes loss_mask, logprobs, advantages
    and ref_logp in the shifted (logits) frame of AReaL's PPO actor (rolled by -1; see
    :func:`from_areal`).
    ``from_areal(to_areal(t, shifted=s), id=t.id, group=t.group, shifted=s)`` gives back ``t``
    (float fields rounded to float32, metadata dropped, routed experts of len(tokens) - 1 rows:
    :func:`from_areal` drops the last token's).

    Raises:
        ValueError: The trajectory is invalid (see :meth:`Trajectory.validate`).
    """
    import torch

    trajectory.validate()

    def row(values: Any, dtype: torch.dtype, key: str) -> torch.Tensor:
        t = torch.tensor(_as_list(values), dtype=dtype)
        if shifted and key in _SHIFTED_KEYS:
            t = torch.roll(t, shifts=-1)
        return t.unsqueeze(0)

    out = {
        "input_ids": row(trajectory.tokens, torch.int64, "input_ids"),
        "loss_mask": row(trajectory.loss_mask, torch.int64, "loss_mask"),
        "logprobs": row(trajectory.logprobs, torch.float32, "logprobs"),
        "attention_mask": torch.ones(1, len(trajectory.tokens), dtype=torch.bool),
    }
    if len(trajectory.versions):
        out["versions"] = row(trajectory.versions, torch.int64, "versions")
    if trajectory.reward is not None:
        out["rewards"] = torch.tensor([float(trajectory.reward)], dtype=torch.float32)
    if len(trajectory.advantages):
        out["advantages"] = row(trajectory.advantages, torch.float32, "advantages")
    if len(trajectory.ref_logprobs):
        out["ref_logp"] = row(trajectory.ref_logprobs, torch.float32, "ref_logp")
    if trajectory.routed_experts is not None:
        ids = _routed_tensor(trajectory.routed_experts)
        routed = torch.zeros(1, len(trajectory.tokens), *ids.shape[1:], dtype=torch.int32)
        routed[0, :ids.size(0)] = ids
        out["routed_experts"] = routed
    return out


# --- verl's DataProto batches ---------------------------------------------------------------------
#
# verl's PPO trainer carries a batch as a DataProto (verl/protocol.py): `.batch`, a TensorDict of
# [B, ...] tensors, and `.non_tensor_batch`, a dict of numpy object arrays of length B. After
# generation (verl/experimental/agent_loop/agent_loop.py, _postprocess) and the trainer's steps
# (verl/trainer/ppo/ray_trainer.py, fit) a row holds:
#
#   prompts             int64  [B, P]      prompt ids, left-padded to P (rollout.prompt_length)
#   responses           int64  [B, R]      generated and tool-output ids, right-padded to R
#   input_ids           int64  [B, P + R]  cat(prompts, responses)
#   attention_mask      int64  [B, P + R]  0 0 1 1 1 | 1 1 1 0 0  (1 on tokens, 0 on padding)
#   position_ids        int64  [B, P + R]  clip(cumsum(attention_mask) - 1, min=0)
#   response_mask       int64  [B, R]      1 on LLM-generated tokens, 0 on tool output and padding
#   old_log_probs       float32[B, R]      log p(responses[:, t] | prompt, responses[:, :t]),
#                                          recomputed by the actor (dp_actor.py takes the logits at
#                                          [:, -R - 1 : -1] and gathers `responses`)
#   rollout_log_probs   float32[B, R]      the same from the inference engine (0 on padding)
#   ref_log_prob        float32[B, R]      the reference policy's, same frame
#   advantages          float32[B, R]
#   token_level_scores  float32[B, R]      the reward at the last response token (reward managers);
#   token_level_rewards float32[B, R]      the same less the in-reward KL penalty, if any
#   non_tensor_batch["uid"]  object [B]    the prompt's uuid4, repeated over its n samples: GRPO's
#                                          group (compute_grpo_outcome_advantage's `index`)
#
# The per-token tensors cover the response only and are aligned with `responses`, so response
# position t is dta's token (prompt length) + t with no shift. verl's multi-turn rollouts of
# 2025-04..07 called the mask `loss_mask`, over the whole [B, P + R] row; without either mask verl
# trains the response's attention mask (ray_trainer.py, compute_response_mask).

_VERL_ID_KEY = "dta_id"  # non_tensor_batch key to_verl writes the ids under
# Trajectory.metadata key from_verl records each row's prompt length under (decimal), where to_verl
# splits the trajectory again: a row whose response starts untrained, or trains nothing, has no
# other mark of where its prompt ends.
VERL_PROMPT_LENGTH = "verl_prompt_length"


def _verl_containers(batch: Any) -> tuple[Any, Any]:
    """(tensors, non-tensors) of a DataProto-like object, or the same dict twice."""
    if hasattr(batch, "batch") and hasattr(batch, "non_tensor_batch"):
        return ({} if batch.batch is None else batch.batch,
                {} if batch.non_tensor_batch is None else batch.non_tensor_batch)
    if hasattr(batch, "keys") and hasattr(batch, "__getitem__"):
        return batch, batch
    raise ValueError("a verl batch must be a dict of tensors or have .batch and .non_tensor_batch "
                     f"(a DataProto), got {type(batch).__name__}")


def _verl_tensor(container: Any, key: str, shape: tuple[int, ...] | None, *, integer: bool = False,
                 required: bool = True, dims: int = 2) -> torch.Tensor | None:
    """container[key] as a CPU tensor of the given shape (any of `dims` dimensions when None)."""
    import torch

    if key not in container:
        if required:
            raise _field_error(key, "missing")
        return None
    value = container[key]
    if not isinstance(value, torch.Tensor):
        import numpy as np

        if not isinstance(value, np.ndarray) or value.dtype == object:
            raise _field_error(key, f"must be a torch.Tensor or a numeric numpy array, got {type(value).__name__}")
        value = torch.from_numpy(np.ascontiguousarray(value))
    value = value.detach().cpu()
    if shape is None and value.dim() != dims:
        expected = "[B, L]" if dims == 2 else "[B, P + R, layers, top_k]"
        raise _field_error(key, f"expected shape {expected}, got {list(value.shape)}")
    if shape is not None and tuple(value.shape) != shape:
        raise _field_error(key, f"expected shape {list(shape)}, got {list(value.shape)}")
    if integer and (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
        raise _field_error(key, f"must be integers, got {value.dtype}")
    return value


def _verl_zero_one(key: str, mask: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """mask (0/1 of any dtype) as int64; names the first other value's row and position."""
    import torch

    bad = ~((mask == 0) | (mask == 1))
    if bad.any():
        row, col = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"row {row}: field '{key}': value at position {col + offset} is "
                         f"{mask[row, col].item()!r}, not 0 or 1")
    return mask.to(torch.int64)


def _verl_names(container: Any, key: str, rows: int) -> list[str] | None:
    """non_tensor_batch[key] as strings (a numpy object array or any sequence of length B)."""
    if key not in container:
        return None
    values = container[key]
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise _field_error(key, f"must be an array of {rows} values, got {type(values).__name__}")
    if len(values) != rows:
        raise _field_error(key, f"{len(values)} values for {rows} rows")
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


def from_verl(batch: Any, *, ids: Iterable[str] | None = None, logprobs: str = "old_log_probs",
              vocab_size: int | None = None) -> list[Trajectory]:
    """Converts a verl batch (a ``DataProto``, or a dict of its tensors) into validated trajectories.

    Row i becomes the trajectory of ``prompts[i]`` without its left padding followed by
    ``responses[i]`` without its right padding (both as ``attention_mask`` marks them). The
    response-aligned tensors fill the response's tokens and leave the prompt's at 0: the logprob
    of ``responses[i, t]`` is ``logprobs[n + t]``, n the prompt's length, which is dta's frame
    (``logprobs[t] = log p(tokens[t] | tokens[:t])``). verl is not needed: any object with
    ``.batch`` and ``.non_tensor_batch`` is read as a DataProto, and a plain dict of torch tensors
    or numpy arrays (``uid`` among them, as ``DataProto.from_single_dict`` takes) as both. Each
    trajectory's ``metadata[VERL_PROMPT_LENGTH]`` (``"verl_prompt_length"``) records its prompt
    length, where :func:`to_verl` splits it again, so ``to_verl(from_verl(batch))`` gives every row
    back, one whose response starts with an untrained token or trains nothing included.

    The batch holds data, not the loss: :func:`verl_train_options` maps the actor's settings (and
    the rollout's sampling temperature) to :meth:`dta.Trainer.train_batch`'s.

    Args:
        batch: ``prompts``, ``responses``, ``attention_mask``, the ``logprobs`` key and
            ``uid`` (non-tensor) are required. ``response_mask`` gives ``loss_mask`` (else
            ``loss_mask``, [B, R] or [B, P + R], as older verl multi-turn rollouts wrote it; else
            the response's attention mask, as verl's ``compute_response_mask``). Optional:
            ``input_ids`` (must equal cat(prompts, responses)), ``ref_log_prob``,
            ``advantages``, ``token_level_rewards`` or else ``token_level_scores`` (the reward is
            the row's sum, as verl's GRPO takes it), ``routed_experts`` (R3: integers
            [B, P + R, layers, top_k] aligned with ``input_ids``, padding stripped as from the
            tokens; the last token's row is dropped, which verl's agent loop fills with zeros as
            the engine records none for the last sampled token, so each trajectory gets
            len(tokens) - 1 rows, as the engines give them). Other keys (``position_ids``
            included) are ignored.
        ids: One id per row. Default: non_tensor_batch ``dta_id`` (what :func:`to_verl` writes),
            else ``"<uid>-<k>"`` for the k-th row of each uid (verl's uids are uuid4s per prompt
            and step, so these are unique across steps too).
        logprobs: The key of the behaviour log-probabilities: ``old_log_probs`` (what verl's
            actor uses as the old policy) or ``rollout_log_probs`` (the inference engine's).
        vocab_size: When given, token ids must be below it.

    Raises:
        ValueError: ``field '<verl key>': ...`` for a missing key or a bad shape or type;
            ``row <i>: field '<key>': ...`` for a row whose masks are not left-padded prompt /
            right-padded response, whose prompt is empty, whose ``response_mask`` is 1 on
            padding, or whose trajectory breaks a rule of :meth:`Trajectory.validate`.
    """
    import torch

    tensors, others = _verl_containers(batch)
    prompts = _verl_tensor(tensors, "prompts", None, integer=True)
    rows, p = prompts.shape
    responses = _verl_tensor(tensors, "responses", None, integer=True)
    if responses.size(0) != rows:
        raise _field_error("responses", f"{responses.size(0)} rows for {rows} prompts")
    r = responses.size(1)
    attention = _verl_zero_one("attention_mask", _verl_tensor(tensors, "attention_mask", (rows, p + r)))
    input_ids = _verl_tensor(tensors, "input_ids", (rows, p + r), integer=True, required=False)
    if input_ids is not None:
        differs = input_ids != torch.cat([prompts, responses], dim=1).to(input_ids.dtype)
        if differs.any():
            row, col = (int(x) for x in differs.nonzero()[0])
            raise ValueError(f"row {row}: field 'input_ids': position {col} differs from "
                             "cat(prompts, responses)")
    if "response_mask" in tensors:
        mask_key, offset = "response_mask", 0
        mask = _verl_tensor(tensors, "response_mask", (rows, r))
    elif "loss_mask" in tensors:
        mask_key = "loss_mask"
        mask = _verl_tensor(tensors, "loss_mask", None)
        if tuple(mask.shape) not in ((rows, r), (rows, p + r)):
            raise _field_error("loss_mask", f"expected shape {[rows, r]} or {[rows, p + r]}, got {list(mask.shape)}")
        offset = mask.size(1) - r
        mask = mask[:, offset:]
    else:
        mask_key, offset, mask = "attention_mask", p, attention[:, p:]
    mask = _verl_zero_one(mask_key, mask, offset)

    def floats(key: str, required: bool) -> torch.Tensor | None:
        value = _verl_tensor(tensors, key, (rows, r), required=required)
        if value is not None and not value.is_floating_point():
            raise _field_error(key, f"must be floating point, got {value.dtype}")
        return value

    old = floats(logprobs, True)
    ref = floats("ref_log_prob", False)
    advantages = floats("advantages", False)
    reward_key = "token_level_rewards" if "token_level_rewards" in tensors else "token_level_scores"
    rewards = floats(reward_key, False)
    routed = _verl_tensor(tensors, _ROUTED, None, integer=True, required=False, dims=4)
    if routed is not None and tuple(routed.shape[:2]) != (rows, p + r):
        raise _field_error(_ROUTED, f"expected shape [{rows}, {p + r}, layers, top_k], got {list(routed.shape)}")

    groups = _verl_names(others, "uid", rows)
    if groups is None:
        raise _field_error("uid", "missing (non_tensor_batch['uid']: the GRPO group of each row)")
    if ids is not None:
        names = [str(x) for x in ids]
        if len(names) != rows:
            raise ValueError(f"ids: {len(names)} ids for {rows} rows")
    else:
        names = _verl_names(others, _VERL_ID_KEY, rows)
        if names is None:
            seen: dict[str, int] = {}
            names = []
            for group in groups:
                names.append(f"{group}-{seen.get(group, 0)}")
                seen[group] = seen.get(group, 0) + 1
    first_row: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in first_row:
            raise ValueError(f"row {i}: field 'id': {name!r} is also row {first_row[name]}'s")
        first_row[name] = i

    trajectories = []
    for i in range(rows):
        n = int(attention[i, :p].sum())
        if n == 0:
            raise ValueError(f"row {i}: field 'attention_mask': the prompt is empty (dta's first token "
                             "is an untrained prompt token)")
        if attention[i, :p - n].any():
            raise ValueError(f"row {i}: field 'attention_mask': the prompt's part {attention[i, :p].tolist()} "
                             "is not left-padded (zeros, then ones)")
        m = int(attention[i, p:].sum())
        if not attention[i, p:p + m].all():
            raise ValueError(f"row {i}: field 'attention_mask': the response's part "
                             f"{attention[i, p:].tolist()} is not right-padded (ones, then zeros)")
        if mask[i, m:].any():
            j = m + int(mask[i, m:].nonzero()[0])
            raise ValueError(f"row {i}: field '{mask_key}': 1 at position {j + offset}, which is padding "
                             "(attention_mask 0)")

        def per_token(values: torch.Tensor | None) -> list[float]:
            return [] if values is None else [0.0] * n + _plain_values(values[i, :m], torch.float64)

        trajectory = Trajectory(
            id=names[i],
            group=groups[i],
            tokens=_plain_values(prompts[i, p - n:], torch.int64) + _plain_values(responses[i, :m], torch.int64),
            loss_mask=[0] * n + _plain_values(mask[i, :m], torch.int64),
            logprobs=per_token(old),
            reward=None if rewards is None else float(rewards[i].to(torch.float64).sum()),
            advantages=per_token(advantages),
            ref_logprobs=per_token(ref),
            metadata={VERL_PROMPT_LENGTH: str(n)},
            routed_experts=None if routed is None else _routed_rows(routed[i], p - n, p + m - 1),
        )
        try:
            _validate(trajectory, vocab_size)
        except ValueError as e:
            raise ValueError(f"row {i}: {e}") from None
        trajectories.append(trajectory)
    return trajectories


def to_verl(trajectories: Iterable[Trajectory], *, prompt_lengths: Iterable[int] | None = None,
            prompt_length: int | None = None, response_length: int | None = None, pad_token_id: int = 0,
            logprobs: str = "old_log_probs") -> dict[str, Any]:
    """Converts trajectories into a verl batch: one dict of [B, ...] tensors and numpy arrays.

    ``verl.DataProto.from_single_dict(to_verl(ts))`` makes the DataProto (tensors go to ``.batch``,
    the numpy arrays ``uid`` and ``dta_id`` to ``.non_tensor_batch``). Each trajectory is split into
    a prompt, left-padded to P, and a response, right-padded to R, and gives ``prompts``,
    ``responses``, ``input_ids``, ``attention_mask``, ``position_ids`` (int64),
    ``response_mask`` (int64, its loss_mask over the response), the ``logprobs`` key (float32,
    response-aligned; 0 on padding), and when set ``ref_log_prob``, ``advantages``,
    ``token_level_scores`` and ``token_level_rewards`` (both the reward at the last response token,
    as verl's reward managers put it) and ``routed_experts`` (int32 [B, P + R, layers, top_k]
    aligned with ``input_ids``, zeros on padding and where a trajectory has no row, as verl's agent
    loop fills them); ``uid`` is the group, ``dta_id`` the id.

    verl has no per-token versions, no metadata, and no per-token values on prompt tokens: those
    are dropped. So ``from_verl(to_verl(ts)) == ts`` for trajectories whose prompt tokens carry
    logprob, advantage and reference logprob 0, which have no versions, and whose only metadata is
    the prompt length :func:`from_verl` records (what it makes), floats rounded to float32, routed
    experts of len(tokens) - 1 rows (:func:`from_verl` drops the last token's).

    Args:
        prompt_lengths: Each trajectory's prompt length, in [1, len(tokens)]. Default: its
            ``metadata[VERL_PROMPT_LENGTH]`` (what :func:`from_verl` records), else up to its first
            trained token (``loss_mask`` 1).
        prompt_length, response_length: The padded widths P and R (verl's
            ``rollout.prompt_length`` and ``rollout.response_length``). Default: the longest.
        pad_token_id: The id written on padding.
        logprobs: The key of the logprobs: ``old_log_probs`` or ``rollout_log_probs``.

    Raises:
        ValueError: No trajectory; a trajectory is invalid, has no trained token (and no prompt
            length), has a ``metadata[VERL_PROMPT_LENGTH]`` that is not a length in
            [1, len(tokens)], trains a prompt token, is longer than P or R, has a nonzero reward
            and an empty response, lacks an optional field (``reward``, ``advantages``,
            ``ref_logprobs``, ``routed_experts``) that another has (a verl tensor covers the whole
            batch), or has routed experts of other layers or top_k than the first's; named
            ``trajectory <i> ('<id>'): field '<name>': ...``.
    """
    import numpy as np
    import torch

    trajectories = list(trajectories)
    if not trajectories:
        raise ValueError("no trajectories")
    lengths = None if prompt_lengths is None else [int(x) for x in prompt_lengths]
    if lengths is not None and len(lengths) != len(trajectories):
        raise ValueError(f"prompt_lengths: {len(lengths)} lengths for {len(trajectories)} trajectories")

    def error(i: int, name: str, what: str) -> ValueError:
        return ValueError(f"trajectory {i} ({trajectories[i].id!r}): field '{name}': {what}")

    splits = []
    for i, t in enumerate(trajectories):
        try:
            t.validate()
        except ValueError as e:
            raise ValueError(f"trajectory {i} ({t.id!r}): {e}") from None
        # Tensors and arrays as lists, once: the slicing and searching below are list operations.
        t = trajectories[i] = dataclasses.replace(
            t, **{name: _as_list(getattr(t, name)) for name in ("tokens", "loss_mask", "logprobs", "advantages",
                                                                "ref_logprobs")})
        recorded = t.metadata.get(VERL_PROMPT_LENGTH)
        if lengths is not None:
            n = lengths[i]
            if not 1 <= n <= len(t.tokens):
                raise ValueError(f"prompt_lengths: trajectory {i} ({t.id!r}): {n} is outside "
                                 f"[1, {len(t.tokens)}]")
        elif recorded is not None:
            if not (recorded.isdecimal() and 1 <= int(recorded) <= len(t.tokens)):
                raise error(i, "metadata", f"{VERL_PROMPT_LENGTH} {recorded!r} is not a prompt length in "
                            f"[1, {len(t.tokens)}]")
            n = int(recorded)
        elif 1 in t.loss_mask:
            n = t.loss_mask.index(1)
        else:
            raise error(i, "loss_mask", "no trained token to start the response at (pass prompt_lengths, or "
                        f"set metadata['{VERL_PROMPT_LENGTH}'])")
        if any(t.loss_mask[:n]):
            raise error(i, "loss_mask", f"token {t.loss_mask.index(1)} of the prompt is trained "
                        "(verl trains response tokens only)")
        splits.append(n)
    for name in ("reward", "advantages", "ref_logprobs", _ROUTED):
        # (an array's `in` would compare it element by element)
        has = [getattr(t, name) is not None if name == _ROUTED else getattr(t, name) not in (None, [])
               for t in trajectories]
        if any(has) and not all(has):
            raise error(has.index(False), name, f"unset, but trajectory {has.index(True)} has it (a verl "
                        "tensor covers the whole batch)")
    p = max(splits) if prompt_length is None else prompt_length
    r = max(len(t.tokens) - n for t, n in zip(trajectories, splits)) if response_length is None else response_length
    for i, (t, n) in enumerate(zip(trajectories, splits)):
        if n > p:
            raise error(i, "tokens", f"a prompt of {n} tokens is longer than prompt_length {p}")
        if len(t.tokens) - n > r:
            raise error(i, "tokens", f"a response of {len(t.tokens) - n} tokens is longer than "
                        f"response_length {r}")
        if t.reward and len(t.tokens) == n:
            raise error(i, "reward", f"{t.reward:g}, but the response is empty (verl puts it on its last "
                        "token)")

    rows = len(trajectories)
    prompts = torch.full((rows, p), pad_token_id, dtype=torch.int64)
    responses = torch.full((rows, r), pad_token_id, dtype=torch.int64)
    attention = torch.zeros(rows, p + r, dtype=torch.int64)
    mask = torch.zeros(rows, r, dtype=torch.int64)
    first = trajectories[0]
    floats = {logprobs: "logprobs"}
    if first.ref_logprobs:
        floats["ref_log_prob"] = "ref_logprobs"
    if first.advantages:
        floats["advantages"] = "advantages"
    per_response = {key: torch.zeros(rows, r, dtype=torch.float32) for key in floats}
    scores = torch.zeros(rows, r, dtype=torch.float32) if first.reward is not None else None
    routed_rows = [None if t.routed_experts is None else _routed_tensor(t.routed_experts) for t in trajectories]
    routed = None
    if routed_rows[0] is not None:
        routed = torch.zeros(rows, p + r, *routed_rows[0].shape[1:], dtype=torch.int32)
        for i, ids in enumerate(routed_rows):
            if ids.shape[1:] != routed.shape[2:]:
                raise error(i, _ROUTED, f"{ids.size(1)} layers x {ids.size(2)} experts, but trajectory 0's are "
                            f"{routed.size(2)} x {routed.size(3)} (a verl tensor covers the whole batch)")
    for i, (t, n) in enumerate(zip(trajectories, splits)):
        m = len(t.tokens) - n
        prompts[i, p - n:] = torch.tensor(t.tokens[:n], dtype=torch.int64)
        responses[i, :m] = torch.tensor(t.tokens[n:], dtype=torch.int64)
        attention[i, p - n:p + m] = 1
        mask[i, :m] = torch.tensor(t.loss_mask[n:], dtype=torch.int64)
        for key, name in floats.items():
            per_response[key][i, :m] = torch.tensor(getattr(t, name)[n:], dtype=torch.float32)
        if scores is not None and m:
            scores[i, m - 1] = float(t.reward)
        if routed is not None:
            routed[i, p - n:p - n + routed_rows[i].size(0)] = routed_rows[i]
    out: dict[str, Any] = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": torch.clip(torch.cumsum(attention, dim=-1) - 1, min=0),
        "response_mask": mask,
        **per_response,
    }
    if scores is not None:
        out["token_level_scores"] = scores
        out["token_level_rewards"] = scores.clone()
    if routed is not None:
        out[_ROUTED] = routed
    out["uid"] = np.array([t.group for t in trajectories], dtype=object)
    out[_VERL_ID_KEY] = np.array([t.id for t in trajectories], dtype=object)
    return out


# --- verl's actor settings ------------------------------------------------------------------------
#
# verl 0.9.1's actor loss (verl/workers/utils/losses.py ppo_loss, verl/trainer/ppo/core_algos.py):
# the log-probabilities of softmax(logits / rollout.temperature) (the trainer puts the rollout's
# temperature into the batch), the "vanilla" clipped surrogate with dual clip
# (compute_policy_loss_vanilla), minus entropy_coeff times the entropy, plus kl_loss_coef times the
# KL to ref_log_prob with use_kl_loss, each aggregated over the mini-batch by agg_loss's
# loss_agg_mode, one optimizer step per mini-batch.

# loss_agg_mode -> dta's normalization: agg_loss divides the masked token sum by the mini-batch's
# loss tokens (token-mean), by nothing (token-sum), or averages each row's token mean over the
# mini-batch's rows (seq-mean-token-mean; global_batch_size, every row of the mini-batch).
_VERL_NORMALIZATIONS = {"token-mean": "token-mean", "token-sum": "sum", "seq-mean-token-mean": "sequence-mean"}
# The modes dta has no normalisation for, and what they compute.
_VERL_UNSUPPORTED_MODES = {
    "seq-mean-token-sum": "each row's token sum averaged over the rows",
    "seq-mean-token-sum-norm": "each row's token sum averaged over the rows, divided by loss_scale_factor "
                               "(default: the response length)",
}
# verl's KL estimators that are dta's k3 (kl_coef): exp(ref - logp) - (ref - logp) - 1.
_VERL_K3 = ("low_var_kl", "k3")
# The ActorConfig fields read, with verl 0.9.1's defaults (verl/trainer/config/actor/actor.yaml).
_VERL_ACTOR_DEFAULTS: dict[str, Any] = {
    "loss_agg_mode": "token-mean", "clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None,
    "clip_ratio_c": 3.0, "entropy_coeff": 0.0, "use_kl_loss": False, "kl_loss_coef": 0.001,
    "kl_loss_type": "low_var_kl", "loss_mode": "vanilla",
}


def _verl_setting(actor: Any, name: str) -> Any:
    """actor.<name> of a verl ActorConfig, an OmegaConf node or a dict (``loss_mode``:
    actor.policy_loss.loss_mode); verl's default where it is unset or actor is None."""
    def get(config: Any, key: str) -> Any:
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    config = get(actor, "policy_loss") if name == "loss_mode" and actor is not None else actor
    value = None if config is None else get(config, name)
    return _VERL_ACTOR_DEFAULTS[name] if value is None else value


def verl_train_options(actor: Any = None, *, temperature: float, **settings: Any) -> dict[str, Any]:
    """The :meth:`dta.Trainer.train_batch` arguments that compute verl's actor loss.

    ``trainer.train_batch(from_verl(batch), **verl_train_options(config.actor_rollout_ref.actor,
    temperature=config.actor_rollout_ref.rollout.temperature))`` takes the step verl's actor takes
    on that mini-batch (verl 0.9.1, ``policy_loss.loss_mode: vanilla``): the clipped surrogate
    with verl's clip ranges and dual clip, its entropy bonus and KL loss, normalised as its
    ``loss_agg_mode``, on log-probabilities at the sampling temperature. Advantages are the
    batch's (``from_verl`` reads ``advantages``), so ``loss`` is ``ppo``.

    Args:
        actor: verl's actor settings (``actor_rollout_ref.actor``: an ``ActorConfig``, an OmegaConf
            node or a dict), or None for verl's defaults. Read: ``loss_agg_mode``, ``clip_ratio``,
            ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``, ``entropy_coeff``,
            ``use_kl_loss``, ``kl_loss_coef``, ``kl_loss_type``, ``policy_loss.loss_mode``.
        temperature: The rollout's sampling temperature (``actor_rollout_ref.rollout.temperature``;
            verl's trainer hands it to the actor, which divides the logits by it). Required, as
            verl requires it: log-probabilities at another temperature move every ratio.
        **settings: The same settings by name (``loss_mode`` included), over ``actor``'s.

    Returns:
        ``loss``, ``normalization``, ``eps_clip_low``, ``eps_clip_high``, ``dual_clip``,
        ``entropy_coef``, ``kl_coef`` and ``temperature``.

    Raises:
        ValueError: A setting dta has no equivalent for, by name: ``loss_agg_mode``
            ``seq-mean-token-sum`` or ``seq-mean-token-sum-norm`` (the error names the modes that
            map), a ``loss_mode`` other than ``vanilla``, a ``kl_loss_type`` other than
            ``low_var_kl``/``k3`` with ``use_kl_loss``; an unknown setting; a temperature or
            ``clip_ratio_c`` out of range.
    """
    unknown = set(settings) - set(_VERL_ACTOR_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown verl actor setting(s) {', '.join(sorted(unknown))} (known: "
                         f"{', '.join(_VERL_ACTOR_DEFAULTS)})")

    def setting(name: str) -> Any:
        return settings[name] if name in settings else _verl_setting(actor, name)

    if not (isinstance(temperature, numbers.Real) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature {temperature!r}: the rollout's sampling temperature, a number > 0")
    mode = setting("loss_agg_mode")
    if mode in _VERL_UNSUPPORTED_MODES:
        raise ValueError(f"loss_agg_mode {mode!r} ({_VERL_UNSUPPORTED_MODES[mode]}) has no dta normalization; "
                         "use token-mean (dta's token-mean), seq-mean-token-mean (sequence-mean) or token-sum "
                         "(sum), or a callable loss (its rollout.num_rollouts divides a token sum by the rows)")
    if mode not in _VERL_NORMALIZATIONS:
        raise ValueError(f"loss_agg_mode {mode!r} is not one of verl's ({', '.join(_VERL_NORMALIZATIONS)}, "
                         f"{', '.join(_VERL_UNSUPPORTED_MODES)})")
    loss_mode = setting("loss_mode")
    if loss_mode != "vanilla":
        raise ValueError(f"policy_loss.loss_mode {loss_mode!r}: dta maps verl's 'vanilla' PPO loss only (for "
                         "another, pass dta.Trainer.train_batch a callable loss)")
    clip = float(setting("clip_ratio"))
    low, high = setting("clip_ratio_low"), setting("clip_ratio_high")
    dual = float(setting("clip_ratio_c"))
    if not dual > 1:
        raise ValueError(f"clip_ratio_c {dual!r}: verl requires > 1 (its dual clip is always on)")
    kl_coef = 0.0
    if setting("use_kl_loss"):
        kl_type = setting("kl_loss_type")
        if kl_type not in _VERL_K3:
            raise ValueError(f"kl_loss_type {kl_type!r}: dta's KL loss is k3 (verl's low_var_kl), use that or "
                             "use_kl_loss=False")
        kl_coef = float(setting("kl_loss_coef"))
    return {
        "loss": "ppo",
        "normalization": _VERL_NORMALIZATIONS[mode],
        "eps_clip_low": clip if low is None else float(low),
        "eps_clip_high": clip if high is None else float(high),
        "dual_clip": dual,
        "entropy_coef": float(setting("entropy_coeff")),
        "kl_coef": kl_coef,
        "temperature": float(temperature),
    }

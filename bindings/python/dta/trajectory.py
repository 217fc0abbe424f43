"""One trajectory (rollout) as dta trains it, its validation, JSON Lines files and AReaL's tensors.

A :class:`Trajectory` mirrors the C++ ``dta::Rollout`` (core/io/rollout.h) and the wire
message ``dta.v1.Trajectory``. Per-token fields are aligned with ``tokens``:
``logprobs[t]`` is the behaviour policy's log p(tokens[t] | tokens[:t]) and ``loss_mask[t]`` says
whether token t is trained, so the first token, which has no context, has ``loss_mask[0] == 0``.

Everything here is pure Python (``torch`` is imported only by the AReaL converters), so rollout
workers can use it without the compiled extension.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import torch

__all__ = ["Trajectory", "read_jsonl", "write_jsonl", "from_areal", "to_areal"]

# Token ids are int32 in the C++ core and on the wire.
_TOKEN_LIMIT = 2**31
# The smallest magnitude that rounds to infinity in float32 (FLT_MAX plus half an ulp): per-token
# floats are float32 in the C++ core and on the wire, so they must stay finite there.
_FLOAT32_OVERFLOW = 3.4028235677973366e38
# The largest |reward| (kMaxAbsReward in core/io/rollout.h): beyond it GRPO group advantages
# could overflow.
MAX_ABS_REWARD = 1e30
_FIELDS = ("id", "group", "tokens", "loss_mask", "logprobs", "versions", "reward", "advantages",
           "ref_logprobs", "metadata")


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


@dataclass
class Trajectory:
    """One rollout: token ids and per-token training data.

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

    def validate(self, vocab_size: int | None = None) -> None:
        """Checks the rules of the C++ ``ValidateRollout`` (and the field types).

        Args:
            vocab_size: When given (> 0), token ids must be below it.

        Raises:
            ValueError: The first broken rule, with a message starting ``field '<name>': `` and
                naming the position, e.g. ``field 'loss_mask': 5 values for 6 tokens``.
        """
        if not isinstance(self.id, str):
            raise _field_error("id", f"must be a string, got {type(self.id).__name__}")
        if not self.id:
            raise _field_error("id", "empty")
        if not isinstance(self.group, str):
            raise _field_error("group", f"must be a string, got {type(self.group).__name__}")
        for name in ("tokens", "loss_mask", "logprobs", "versions", "advantages", "ref_logprobs"):
            values = getattr(self, name)
            if isinstance(values, (str, bytes)) or not (hasattr(values, "__len__") and hasattr(values, "__iter__")):
                raise _field_error(name, f"must be a list, got {type(values).__name__}")
        n = len(self.tokens)
        if n == 0:
            raise _field_error("tokens", "empty rollout")
        limit = vocab_size if vocab_size is not None and vocab_size > 0 else None
        for i, token in enumerate(self.tokens):
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
            for i, value in enumerate(getattr(self, name)):
                if not _is_number(value):
                    raise _field_error(name, f"value {i} is not a number")
                if not _finite_float32(value):
                    raise _field_error(name, f"value {i} is not finite")
        for i, value in enumerate(self.loss_mask):
            if not _is_int(value) or value not in (0, 1):
                raise _field_error("loss_mask", f"value {i} is {value!r}, not 0 or 1")
        if self.loss_mask[0] != 0:
            raise _field_error("loss_mask",
                               "value 0 is 1, but the first token has no context to be predicted from")
        for i, value in enumerate(self.versions):
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
        if not isinstance(self.metadata, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.metadata.items()):
            raise _field_error("metadata", "must map strings to strings")

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the repo's JSON Lines format (optional fields only when set)."""
        out: dict[str, Any] = {
            "id": self.id,
            "group": self.group,
            "tokens": [int(t) for t in self.tokens],
            "loss_mask": [int(m) for m in self.loss_mask],
            "logprobs": [float(x) for x in self.logprobs],
        }
        if self.versions:
            out["versions"] = [int(v) for v in self.versions]
        if self.reward is not None:
            out["reward"] = float(self.reward)
        if self.advantages:
            out["advantages"] = [float(x) for x in self.advantages]
        if self.ref_logprobs:
            out["ref_logprobs"] = [float(x) for x in self.ref_logprobs]
        if self.metadata:
            out["metadata"] = dict(self.metadata)
        return out

    @classmethod
    def from_dict(cls, obj: Any, *, vocab_size: int | None = None) -> Trajectory:
        """Parses one JSON object of the JSON Lines format and validates it.

        ``id`` and ``group`` may be strings or integers; ``loss_mask`` may hold booleans;
        ``metadata`` values that are not strings are kept as their JSON text. Any unknown field is
        an error, as in the C++ reader, so a misspelt optional field is never silently dropped.

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
            ([1] or a scalar), ``attention_mask`` (right padding is dropped), ``advantages`` and
            ``ref_logp`` (optional). Other keys are ignored.
        id: The trajectory's id (AReaL dicts carry none).
        group: Its GRPO group, e.g. the prompt's id.
        shifted: Whether loss_mask, logprobs, advantages and ref_logp are in AReaL's shifted
            (logits) frame, i.e. after ``PPOActor.compute_advantages``: position t refers to token
            t + 1. False for what rollout workflows return (aligned with tokens, as here).
        vocab_size: When given, token ids must be below it.

    Raises:
        ValueError: Naming the AReaL key for a bad type or shape, or the trajectory field for a
            broken rule (``field 'loss_mask': value 0 is 1, ...`` when a shifted dict was read as
            unshifted, say).
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
    reward = None
    if d.get("rewards") is not None:
        rewards = d["rewards"]
        if not isinstance(rewards, torch.Tensor) or rewards.numel() != 1:
            raise _field_error("rewards", "must be a tensor with one value ([1])")
        reward = float(rewards.reshape(()).item())
    trajectory = Trajectory(
        id=id,
        group=group,
        tokens=[int(t) for t in ids[:length].tolist()],
        loss_mask=[int(m) for m in mask.tolist()],
        logprobs=[float(x) for x in per_token("logprobs").tolist()],
        versions=[int(v) for v in per_token("versions").tolist()] if d.get("versions") is not None else [],
        reward=reward,
        advantages=[float(x) for x in per_token("advantages").tolist()] if d.get("advantages") is not None else [],
        ref_logprobs=[float(x) for x in per_token("ref_logp").tolist()] if d.get("ref_logp") is not None else [],
    )
    trajectory.validate(vocab_size)
    return trajectory


def to_areal(trajectory: Trajectory, *, shifted: bool) -> dict[str, torch.Tensor]:
    """Converts a :class:`Trajectory` into an AReaL trajectory dict of [1, L] tensors.

    Gives ``input_ids``, ``loss_mask``, ``logprobs``, ``attention_mask`` (ones), and when set
    ``versions``, ``rewards`` ([1]), ``advantages`` and ``ref_logp``, with AReaL's dtypes (int64,
    float32, bool). ``shifted=True`` writes loss_mask, logprobs, advantages and ref_logp in the
    shifted (logits) frame of AReaL's PPO actor (rolled by -1; see :func:`from_areal`).
    ``from_areal(to_areal(t, shifted=s), id=t.id, group=t.group, shifted=s)`` gives back ``t``
    (float fields rounded to float32, metadata dropped).

    Raises:
        ValueError: The trajectory is invalid (see :meth:`Trajectory.validate`).
    """
    import torch

    trajectory.validate()

    def row(values: list[Any], dtype: torch.dtype, key: str) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        if shifted and key in _SHIFTED_KEYS:
            t = torch.roll(t, shifts=-1)
        return t.unsqueeze(0)

    out = {
        "input_ids": row(trajectory.tokens, torch.int64, "input_ids"),
        "loss_mask": row(trajectory.loss_mask, torch.int64, "loss_mask"),
        "logprobs": row(trajectory.logprobs, torch.float32, "logprobs"),
        "attention_mask": torch.ones(1, len(trajectory.tokens), dtype=torch.bool),
    }
    if trajectory.versions:
        out["versions"] = row(trajectory.versions, torch.int64, "versions")
    if trajectory.reward is not None:
        out["rewards"] = torch.tensor([float(trajectory.reward)], dtype=torch.float32)
    if trajectory.advantages:
        out["advantages"] = row(trajectory.advantages, torch.float32, "advantages")
    if trajectory.ref_logprobs:
        out["ref_logp"] = row(trajectory.ref_logprobs, torch.float32, "ref_logp")
    return out

"""Receiving weight deltas: the elements of the published weights that changed since the previous
checkpoint, as dta-trainer --publish_weight_delta writes them beside the full weights
(``step-<N>/model/delta-from-<M>.safetensors`` and its ``.json`` index; the format is
core/checkpoint/weight_delta.h's, described in docs/weight_sync.md "Delta sync").

A rollout worker holding step M's weights reaches step N's bit for bit::

    from dta.weight_delta import apply_delta
    latest = json.load(open(f"{ckpt}/latest.json"))
    delta = latest.get("weight_delta")
    if delta and delta["base_step"] == my_step:
        apply_delta(model.state_dict(), delta["index"], base_step=my_step)   # in place
    else:
        model.load_state_dict(...)   # the whole model from latest["model_path"]

Only torch is needed (no numpy, no safetensors package); the tensors may live on any device.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import MutableMapping

import torch

__all__ = ["TensorChange", "WeightDelta", "read_delta", "apply_delta", "load_weights", "encoded_size"]

FORMAT = "dta-weight-delta"
VERSION = 1

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
           "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
# Same-sized integer types: elements are compared and copied as bit patterns.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class TensorChange:
    """One tensor's changes: ``indices`` (flat, increasing, int64) and ``values`` (the new
    elements, in the tensor's dtype) of the changed elements; None for an unchanged tensor, and
    ``indices`` None when the tensor is dense (``values`` then holds every element, flat)."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    encoding: str  # "unchanged", "sparse", "bitmap" or "dense"
    changed: int
    indices: torch.Tensor | None = None
    values: torch.Tensor | None = None


@dataclass
class WeightDelta:
    """A delta read whole: every tensor of the weights it applies to, by name."""
    path: Path  # the .json index
    base_step: int | None
    step: int | None
    elements: int
    changed_elements: int
    delta_bytes: int
    full_bytes: int
    tensors: dict[str, TensorChange] = field(default_factory=dict)

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / max(self.elements, 1)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (copied out of the file, CPU)."""
    data = path.read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    buffer = memoryview(data)[8 + length:]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has an unsupported dtype {entry['dtype']}")
        raw = torch.frombuffer(bytearray(buffer[begin:end]), dtype=torch.uint8) if end > begin \
            else torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(dtype).reshape(entry["shape"])
    return out


def load_weights(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A published model directory's weights (``model.safetensors``, or the shards that
    ``model.safetensors.index.json`` names) as CPU tensors, as stored."""
    directory = Path(directory)
    single = directory / "model.safetensors"
    if single.is_file():
        return _read_safetensors(single)
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{directory}: neither model.safetensors nor model.safetensors.index.json")
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        weights.update(_read_safetensors(directory / shard))
    return weights


def _index_path(delta_path: str | os.PathLike[str]) -> Path:
    path = Path(delta_path)
    if path.is_dir():  # a model directory holding one delta
        found = sorted(path.glob("delta-from-*.json"))
        if len(found) != 1:
            raise FileNotFoundError(f"{path}: {len(found)} delta-from-*.json files, expected one")
        return found[0]
    return path.with_suffix(".json") if path.suffix == ".safetensors" else path


def _decode_varints(data: torch.Tensor) -> torch.Tensor:
    """Unsigned LEB128 varints (uint8) to int64 values, vectorised."""
    b = data.to(torch.int64)
    ends = (b & 0x80) == 0
    if b.numel() == 0:
        return b
    if not bool(ends[-1]):
        raise ValueError("sparse positions end inside a varint")
    group = torch.cumsum(ends.to(torch.int64), 0) - ends.to(torch.int64)  # each byte's varint
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(ends).flatten()[:-1] + 1])
    shift = 7 * (torch.arange(b.numel()) - starts[group])
    if int(shift.max()) > 62:
        raise ValueError("a sparse position's varint is too long")
    return torch.zeros(len(starts), dtype=torch.int64).index_add_(0, group, (b & 0x7F) << shift)


def _positions(encoding: str, positions: torch.Tensor | None, numel: int) -> torch.Tensor:
    if encoding == "sparse":
        indices = torch.cumsum(_decode_varints(positions) + 1, 0) - 1
    else:  # bitmap: bit i % 8 of byte i // 8
        if positions.numel() != (numel + 7) // 8:
            raise ValueError(f"a bitmap of {positions.numel()} bytes for {numel} elements")
        bits = (positions.to(torch.int64).unsqueeze(1) >> torch.arange(8)) & 1
        flat = bits.flatten()
        if bool(flat[numel:].any()):
            raise ValueError("a bitmap has bits set past the tensor's end")
        indices = torch.nonzero(flat[:numel]).flatten()
    if indices.numel() and int(indices[-1]) >= numel:
        raise ValueError(f"sparse positions reach past the tensor's {numel} elements")
    return indices


def read_delta(delta_path: str | os.PathLike[str]) -> WeightDelta:
    """Reads a delta: ``delta_path`` is its .json index, its .safetensors file, or a model
    directory holding one. Raises FileNotFoundError for a missing file, ValueError naming the file
    and tensor for a malformed one."""
    index_path = _index_path(delta_path)
    index = json.loads(index_path.read_text())
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(f"{index_path}: not a {FORMAT} version {VERSION} index")
    data_name = index["data"]
    if "/" in data_name or os.sep in data_name:
        raise ValueError(f"{index_path}: data {data_name!r} is not a file beside the index")
    data = _read_safetensors(index_path.parent / data_name)
    delta = WeightDelta(path=index_path, base_step=index.get("base_step"), step=index.get("step"),
                        elements=index["elements"], changed_elements=index["changed_elements"],
                        delta_bytes=index["delta_bytes"], full_bytes=index["full_bytes"])
    for name, entry in index["tensors"].items():
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{index_path}: tensor {name!r} has an unsupported dtype {entry['dtype']}")
        shape = tuple(int(d) for d in entry["shape"])
        numel = 1
        for d in shape:
            numel *= d
        change = TensorChange(name=name, dtype=dtype, shape=shape, encoding=entry["encoding"],
                              changed=int(entry["changed"]))
        try:
            if change.encoding not in ("unchanged", "sparse", "bitmap", "dense"):
                raise ValueError(f"unknown encoding {change.encoding!r}")
            if change.encoding != "unchanged":
                change.values = data[f"{name}/values"].flatten()
                if change.values.dtype != dtype:
                    raise ValueError(f"values are {change.values.dtype}, not {dtype}")
                expected = numel if change.encoding == "dense" else change.changed
                if change.values.numel() != expected:
                    raise ValueError(f"{change.values.numel()} values, expected {expected}")
            if change.encoding in ("sparse", "bitmap"):
                change.indices = _positions(change.encoding, data[f"{name}/positions"], numel)
                if change.indices.numel() != change.changed:
                    raise ValueError(f"{change.indices.numel()} positions but {change.changed} values")
        except (KeyError, ValueError) as error:
            raise ValueError(f"{index_path}: tensor {name!r}: {error}") from None
        delta.tensors[name] = change
    return delta


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(_BITS[tensor.element_size()])


def apply_delta(state_dict_or_dir: MutableMapping[str, torch.Tensor] | str | os.PathLike[str],
                delta_path: str | os.PathLike[str] | WeightDelta, *,
                base_step: int | None = None) -> MutableMapping[str, torch.Tensor]:
    """Applies a delta bit for bit, in place, and returns the weights.

    ``state_dict_or_dir``: tensors by their Hugging Face names (e.g. ``model.state_dict()``, on
    any device; each must be contiguous, in the delta's dtype and shape), or a model directory
    whose weights are read (``load_weights``) and returned changed (the files are not rewritten).
    ``delta_path``: as ``read_delta`` takes it, or a ``WeightDelta`` already read.
    ``base_step``: when given, the delta must start from this step.

    Every tensor is checked before any is changed. Raises ValueError (naming the tensor) when one
    is missing, of another dtype or shape, or not contiguous, or when ``base_step`` differs."""
    delta = delta_path if isinstance(delta_path, WeightDelta) else read_delta(delta_path)
    if base_step is not None and delta.base_step != base_step:
        raise ValueError(f"{delta.path} applies to step {delta.base_step}, not {base_step}")
    weights = load_weights(state_dict_or_dir) if isinstance(state_dict_or_dir, (str, os.PathLike)) \
        else state_dict_or_dir
    for name, change in delta.tensors.items():
        tensor = weights.get(name)
        if tensor is None:
            raise ValueError(f"{delta.path}: tensor {name!r} is missing from the weights")
        if tensor.dtype != change.dtype or tuple(tensor.shape) != change.shape:
            raise ValueError(f"{delta.path}: tensor {name!r}: the delta is for {change.dtype} "
                             f"{list(change.shape)}, the weights hold {tensor.dtype} {list(tensor.shape)}")
        if not tensor.is_contiguous():
            raise ValueError(f"{delta.path}: tensor {name!r} is not contiguous")
    with torch.no_grad():
        for name, change in delta.tensors.items():
            if change.encoding == "unchanged":
                continue
            target = _bits(weights[name].view(-1))
            values = _bits(change.values).to(target.device)
            if change.indices is None:
                target.copy_(values)
            else:
                target[change.indices.to(target.device)] = values
    return weights


def encoded_size(base: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    """(changed elements, delta bytes) of the delta from ``base`` to ``target`` (same dtype and
    shape, any device), as dta-trainer encodes it: the smallest of sparse, bitmap and dense."""
    a, b = _bits(base.detach().contiguous().view(-1)), _bits(target.detach().contiguous().view(-1))
    changed_at = torch.nonzero(a != b).flatten()
    changed = changed_at.numel()
    if changed == 0:
        return 0, 0
    numel, size = a.numel(), a.element_size()
    gaps = torch.diff(changed_at, prepend=changed_at.new_full((1,), -1)) - 1
    varint = torch.ones_like(gaps)
    for bits in range(7, 63, 7):  # one more byte per 7 bits past the first 7
        varint += (gaps >> bits) > 0
    sparse = int(varint.sum())
    bitmap = (numel + 7) // 8
    if (numel - changed) * size <= min(sparse, bitmap):
        return changed, numel * size
    return changed, changed * size + min(sparse, bitmap)

"""dta: train language models on tree-shaped rollouts without computing a shared prefix twice.

Pure Python, importable without torch:
    Trajectory, read_jsonl, write_jsonl, from_areal, to_areal   (dta.trajectory)
Over the compiled executor (imported on first use; they load torch):
    PrefixTree   (dta.tree)     the prefix tree of a batch and its statistics
    Trainer      (dta.trainer)  an HF Qwen3 model trained with dense / packed / dta
The dispatcher's client (gRPC; imported on first use):
    RolloutClient, AsyncRolloutClient, Ack, TrajectoryRejected, DispatcherError,
    DispatcherStatus, DispatcherStatistics   (dta.client)
The wire protocol's generated stubs: ``from dta.v1 import dispatcher_pb2, dispatcher_pb2_grpc``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .trajectory import Trajectory, from_areal, read_jsonl, to_areal, write_jsonl

if TYPE_CHECKING:
    from .client import (Ack, AsyncRolloutClient, DispatcherError, DispatcherStatistics, DispatcherStatus,
                         RolloutClient, TrajectoryRejected)
    from .trainer import Trainer, TrainStats
    from .tree import PrefixTree, TreeStats

__all__ = [
    "Trajectory", "read_jsonl", "write_jsonl", "from_areal", "to_areal",
    "PrefixTree", "TreeStats", "Trainer", "TrainStats", "RolloutClient", "AsyncRolloutClient",
    "Ack", "TrajectoryRejected", "DispatcherError", "DispatcherStatus", "DispatcherStatistics",
]

# Attributes loaded on first access, so that `import dta` (a rollout worker's) needs neither torch
# nor grpc.
_LAZY = {
    "PrefixTree": ".tree", "TreeStats": ".tree",
    "Trainer": ".trainer", "TrainStats": ".trainer",
    "RolloutClient": ".client", "AsyncRolloutClient": ".client", "Ack": ".client",
    "TrajectoryRejected": ".client", "DispatcherError": ".client", "DispatcherStatus": ".client",
    "DispatcherStatistics": ".client",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dta' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

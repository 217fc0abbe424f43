"""dta: train language models on tree-shaped rollouts without computing a shared prefix twice.

Pure Python, importable without torch:
    Trajectory, read_jsonl, write_jsonl, from_areal, to_areal, from_verl, to_verl,
    verl_train_options, routed_experts_from_sglang   (dta.trajectory)
Over the compiled executor (imported on first use; they load torch):
    PrefixTree   (dta.tree)     the prefix tree of a batch, its statistics and its split
                                across ranks (PrefixTree.partition -> Partition)
    Trainer      (dta.trainer)  a Hugging Face model of any family dta builds
                                (Trainer.model_families()) trained with dense / packed / dta
Weight deltas (torch only; imported on first use):
    apply_delta, read_delta   (dta.weight_delta)   apply dta-trainer --publish_weight_delta's
                                                   delta-from-<M> files to step M's weights
The dispatcher's client (gRPC; imported on first use):
    RolloutClient, AsyncRolloutClient, Ack, TrajectoryRejected, DispatcherError,
    DispatcherStatus, DispatcherStatistics   (dta.client)
The wire protocol's generated stubs: ``from dta.v1 import dispatcher_pb2, dispatcher_pb2_grpc``.
AReaL's TrainEngine on Trainer (imported on first use; needs the optional ``areal`` package):
    DTAPPOTrainer, DTAPPOActor, DTAEngine, DTAOptions   (dta.areal)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .trajectory import (Trajectory, from_areal, from_verl, read_jsonl, routed_experts_from_sglang, to_areal, to_verl,
                         verl_train_options, write_jsonl)

if TYPE_CHECKING:
    from .client import (Ack, AsyncRolloutClient, DispatcherError, DispatcherStatistics, DispatcherStatus,
                         RolloutClient, TrajectoryRejected)
    from .trainer import Trainer, TrainStats
    from .tree import Partition, PrefixTree, TreeStats
    from .weight_delta import apply_delta, read_delta

__all__ = [
    "Trajectory", "read_jsonl", "write_jsonl", "from_areal", "to_areal", "from_verl", "to_verl",
    "verl_train_options", "routed_experts_from_sglang", "Partition", "PrefixTree", "TreeStats", "Trainer",
    "TrainStats", "apply_delta", "read_delta",
    "RolloutClient", "AsyncRolloutClient",
    "Ack", "TrajectoryRejected", "DispatcherError", "DispatcherStatus", "DispatcherStatistics",
]

# Attributes loaded on first access, so that `import dta` (a rollout worker's) needs neither torch
# nor grpc.
_LAZY = {
    "Partition": ".tree", "PrefixTree": ".tree", "TreeStats": ".tree",
    "Trainer": ".trainer", "TrainStats": ".trainer",
    "apply_delta": ".weight_delta", "read_delta": ".weight_delta",
    "RolloutClient": ".client", "AsyncRolloutClient": ".client", "Ack": ".client",
    "TrajectoryRejected": ".client", "DispatcherError": ".client", "DispatcherStatus": ".client",
    "DispatcherStatistics": ".client",
}

# Submodules loaded on first access (``dta.areal`` imports the optional areal package).
_LAZY_SUBMODULES = {"areal", "weight_delta"}


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dta' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

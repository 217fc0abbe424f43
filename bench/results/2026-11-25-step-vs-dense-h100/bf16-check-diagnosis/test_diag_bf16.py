import statistics
import pytest
import torch
import dta
from test_trainer import checkpoint, trajectories  # noqa: F401
from test_trainer_gpu import relative_errors, reference  # noqa: F401

VARIANTS = [("dense", {}), ("packed", {}), ("dta", {"block_size": 7, "pack": False}),
            ("dta", {"block_size": 16, "pack": False}), ("dta", {"block_size": 16, "pack": True}),
            ("dta", {"block_size": 0, "pack": False}), ("dta", {"block_size": 1000, "pack": True})]

def test_diag(checkpoint, trajectories, reference):  # noqa: F811
    _, directory = checkpoint
    for method, options in VARIANTS:
        for dtype in ["bfloat16", "float32"]:
            trainer = dta.Trainer(directory, dtype=dtype, device="cuda")
            trainer.compute_gradients(trajectories, loss="grpo", method=method, **options)
            errs = relative_errors(trainer.gradients(), reference)
            worst = max(errs, key=errs.get)
            print(f"DIAG {dtype} {method} {options}: median {statistics.median(errs.values()):.4f} worst {worst} {errs[worst]:.4f}")

"""The diagnosis of test_trainer_gpu's bf16 check (split forwards at 4.6% against dense's
2.35% on an H100, tied embeddings): each method's bf16 error against the float64 CPU reference,
run once per setting of the kernels' switches (DIAG_LABEL names the setting). Copied into
tests/python/ for the device run."""
import os
import statistics

import torch

import dta
from test_trainer import checkpoint, trajectories  # noqa: F401
from test_trainer_gpu import reference, relative_errors  # noqa: F401

VARIANTS = [("dense", {}), ("packed", {}), ("dta", {"block_size": 16, "pack": True}),
            ("dta", {"block_size": 7, "pack": False}), ("dta", {"block_size": 0, "pack": False})]
SHOWN = ["model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight",
         "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]


def test_diag(checkpoint, trajectories, reference):  # noqa: F811
    _, directory = checkpoint
    label = os.environ.get("DIAG_LABEL", "default")
    if os.environ.get("DIAG_NO_REDUCED_PRECISION") == "1":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    for method, options in VARIANTS:
        trainer = dta.Trainer(directory, dtype="bfloat16", device="cuda")
        trainer.compute_gradients(trajectories, loss="grpo", method=method, **options)
        errs = relative_errors(trainer.gradients(), reference)
        shown = " ".join(f"{n.split('.')[-2] if 'layers' in n else n.split('.')[1]}={errs[n]:.4f}"
                         for n in SHOWN if n in errs)
        print(f"DIAG {label} {method} {options}: median {statistics.median(errs.values()):.4f} {shown}")

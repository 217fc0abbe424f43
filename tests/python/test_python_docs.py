"""docs/python.md runs as written: every ```python block is executed, each in a fresh namespace from
the repository's root on the CPU, and a failure names the block's line. A block that cannot run on
one CPU (GPUs, a live dispatcher, a cluster) carries `<!-- no-run: <reason> -->` on the line before
its fence; those must stay few and say why.

Some blocks are also checked for what they claim: the Trajectory listing against dta.Trajectory's
fields, AReaL's "by hand" recipe against DTAEngine.train_batch's loss (when areal is importable),
and the verl round's weights against the checkpoint transformers loads.
"""
from __future__ import annotations

import copy
import dataclasses
import re
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import dta

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "python.md"
MAX_NO_RUN = 3  # the distributed example, the dispatcher's clients, AReaL's whole trainer


@dataclasses.dataclass
class Block:
    line: int  # 1-based, the opening fence's
    code: str
    no_run: str | None  # the reason, when marked


def python_blocks() -> list[Block]:
    lines = DOC.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"docs/python.md:{i + 1}: a code block is never closed"
        if fence.group(1) == "python":
            marker = re.match(r"^<!-- no-run: (.*) -->$", lines[i - 1]) if i else None
            blocks.append(Block(i + 1, "\n".join(lines[i + 1:end]) + "\n", marker.group(1) if marker else None))
        i = end + 1
    return blocks


BLOCKS = python_blocks()
RUNNABLE = [b for b in BLOCKS if b.no_run is None]


def test_blocks_that_do_not_run_are_few_and_say_why():
    markers = [line for line in DOC.read_text(encoding="utf-8").splitlines() if line.startswith("<!-- no-run")]
    assert len(markers) == len([b for b in BLOCKS if b.no_run]), \
        "a no-run marker must sit on the line right before a ```python fence"
    marked = [b for b in BLOCKS if b.no_run]
    assert len(marked) <= MAX_NO_RUN, [b.line for b in marked]
    for b in marked:
        assert len(b.no_run.split()) >= 3, f"docs/python.md:{b.line}: say why the block cannot run"
    assert len(RUNNABLE) >= 5


def run_block(block: Block, monkeypatch, tmp_path: Path) -> dict[str, Any]:
    """Executes the block from the repository's root in a fresh namespace, its temporary files
    under tmp_path; the namespace after."""
    if re.search(r"^\s*(from|import) areal\b", block.code, re.M):
        pytest.importorskip("areal", reason=f"docs/python.md:{block.line} needs the areal package")
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # Line numbers in a traceback are the markdown file's.
    code = compile("\n" * block.line + block.code, str(DOC), "exec")
    namespace: dict[str, Any] = {"__name__": "__main__"}
    try:
        exec(code, namespace)
    except Exception:
        pytest.fail(f"docs/python.md:{block.line}: the ```python block raised:\n{traceback.format_exc()}")
    return namespace


# --- what some blocks claim -----------------------------------------------------------------------


def check_trajectory_listing(ns: dict[str, Any]) -> None:
    """The listing's fields, types and defaults are dta.Trajectory's."""
    listed = {f.name: (f.type, f.default, f.default_factory) for f in dataclasses.fields(ns["Trajectory"])}
    actual = {f.name: (f.type, f.default, f.default_factory) for f in dataclasses.fields(dta.Trajectory)}
    assert listed == actual


def check_areal_by_hand(ns: dict[str, Any]) -> None:
    """The recipe's loss is DTAEngine's on the same batch, from the same weights; without the
    temperature it is not."""
    from areal.api.io_struct import FinetuneSpec
    from dta.areal import DTAOptions, DTAPPOActor

    config = dataclasses.replace(ns["config"], backend="fsdp:d1")
    engine = DTAPPOActor(config, DTAOptions(device="cpu"))
    engine.create_process_group()
    try:
        engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=1))
        engine.ppo_update(copy.deepcopy(ns["trained"]))
        stats = engine.export_stats()
    finally:
        engine.destroy()
    assert engine.last_loss_route == "dta:ppo"
    assert ns["stats"].loss == pytest.approx(stats["ppo_actor/update/dta_loss"], rel=1e-5)
    opt = config.optimizer
    at_one = dta.Trainer(config.path, dtype=config.dtype, device="cpu", lr=opt.lr).train_batch(
        ns["trajectories"], loss="ppo", method="dta", eps_clip_low=config.eps_clip,
        eps_clip_high=config.eps_clip_higher, dual_clip=config.c_clip)
    assert abs(at_one.loss - ns["stats"].loss) > 0.05 * abs(ns["stats"].loss)


def check_verl_round(ns: dict[str, Any]) -> None:
    """The weights handed back are the trainer's, under the names transformers loads."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(ns["checkpoint"]) / "model", dtype=torch.float32)
    state = model.state_dict()
    for name, p in ns["weights"].items():
        assert torch.equal(state[name], p.detach().to(torch.bfloat16).float()), name
    assert ns["stats"].loss != 0 and ns["options"]["temperature"] == 0.8


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "class Trajectory:": check_trajectory_listing,
    "PPOActor(config, engine=None).compute_advantages": check_areal_by_hand,
    "dta.verl_train_options(actor, temperature=": check_verl_round,
}


def test_every_check_has_its_block():
    for marker in CHECKS:
        assert sum(marker in b.code for b in RUNNABLE) == 1, marker


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"line-{b.line}" for b in RUNNABLE])
def test_python_block_runs_as_written(block, monkeypatch, tmp_path):
    namespace = run_block(block, monkeypatch, tmp_path)
    for marker, check in CHECKS.items():
        if marker in block.code:
            check(namespace)

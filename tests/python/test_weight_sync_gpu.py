"""The weight sync over NCCL when an engine dies or hangs (skipped without two GPUs: NCCL refuses
two ranks of one communicator on one GPU). On a machine with two:
``DTA_BUILD_DIR=build-device python3 -m pytest -q tests/python/test_weight_sync_gpu.py``.

bench/weight_sync_bench.py sends Qwen3-0.6B's shapes from GPU 0 to a fake engine on GPU 1 that
fails from its second sync on. The sender must neither hang (a blocking ncclCommInitRank waits
forever for a rank that never joins) nor end (torch's watchdog ends the process at a timed-out
collective by default): each failed sync returns within a bound of the timeout, and the process
goes on to the next one. test_weight_sync.py tests the same failures over Gloo on the CPU.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("DTA_BUILD_DIR", REPO / "build"))
TIMEOUT_S = 10

pytestmark = [
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
    pytest.mark.skipif(not (BUILD / "bin" / "dta-weight-sync-bench").exists(),
                       reason="needs bin/dta-weight-sync-bench (apps/engines)"),
]


def run_bench(fault: str, syncs: int) -> tuple[str, float]:
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "weight_sync_bench.py"), "--config=qwen3-0.6b",
         f"--fault={fault}", f"--syncs={syncs}", f"--timeout_s={TIMEOUT_S}", "--bucket_mb=64",
         f"--build_dir={BUILD}"],
        capture_output=True, text=True, timeout=120 + syncs * 4 * TIMEOUT_S,
        env={**os.environ, "NCCL_NVLS_ENABLE": "0"})
    output = result.stdout + result.stderr
    # The process went on after the failures and ended by itself, not by NCCL's watchdog.
    assert result.returncode == 0, output
    return output, time.monotonic() - start


def sync_lines(output: str) -> dict[int, tuple[bool, float]]:
    """sync number -> (succeeded, seconds)."""
    lines = {}
    for match in re.finditer(r"^sync (\d+): (failed after )?([0-9.]+) s", output, re.M):
        lines[int(match[1])] = (match[2] is None, float(match[3]))
    return lines


@pytest.mark.parametrize("fault", ["hang:2", "die:2", "hang:1"])
def test_a_failing_engine_neither_hangs_nor_ends_the_sender(fault):
    at = int(fault.split(":")[1])
    output, _ = run_bench(fault, syncs=3)
    lines = sync_lines(output)
    assert sorted(lines) == [1, 2, 3], output
    for sync, (ok, seconds) in lines.items():
        assert ok == (sync < at), (sync, output)
        if not ok:
            # Each failure costs at most the engine requests' and the collective's timeouts, which
            # overlap, plus the teardown's bounded requests.
            assert seconds < 3 * TIMEOUT_S, (sync, seconds, output)

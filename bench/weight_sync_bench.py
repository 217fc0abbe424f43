"""The weight sync's time on GPUs: dta-weight-sync-bench (WeightBroadcaster, apps/engines/weight_sync.h)
sends a preset's random bf16 weights (qwen3-8b: 16.4 GB) from GPU 0 over NCCL to fake engines
(tests/python/fake_weight_engine.py, each a process joining the group with torch.distributed as
SGLang does and keeping what it receives on its GPU), and prints, per sync, the seconds from "the
optimizer step is done" to "every engine holds the weights".

    NCCL_NVLS_ENABLE=0 python3 bench/weight_sync_bench.py                 # GPU 0 -> GPU 1
    NCCL_NVLS_ENABLE=0 python3 bench/weight_sync_bench.py --engines=2     # GPU 0 -> GPUs 1, 2

NCCL refuses two ranks of one communicator on one GPU, so the receivers take GPUs 1..N: a machine
with N + 1 GPUs. Options: --config (a preset), --bucket_mb, --syncs, --kind (sglang or
areal-vllm), --build_dir (where bin/dta-weight-sync-bench is), --fault (die:N or hang:N for the
first engine: how long a dead or hanging engine holds the trainer, and that it survives).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-8b")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--kind", choices=["sglang", "areal-vllm"], default="sglang")
    parser.add_argument("--bucket_mb", type=float, default=1024)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--timeout_s", type=int, default=300)
    parser.add_argument("--fault", default="",
                        help="the first engine's fault (fake_weight_engine.py's --fault: die:N, hang:N); "
                             "failed syncs are then timed and the bench goes on")
    parser.add_argument("--build_dir", type=Path, default=Path(os.environ.get("DTA_BUILD_DIR", REPO / "build")))
    args = parser.parse_args()
    binary = args.build_dir / "bin" / "dta-weight-sync-bench"
    if not binary.exists():
        sys.exit(f"{binary} is missing: cmake --build build --target dta-weight-sync-bench")
    import torch
    if torch.cuda.device_count() < args.engines + 1:
        sys.exit(f"needs {args.engines + 1} GPUs (the sender on GPU 0, one per engine), "
                 f"found {torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    engines, urls = [], []
    with tempfile.TemporaryDirectory() as work:
        try:
            for i in range(args.engines):
                out = Path(work) / f"engine-{i}"
                fault = [f"--fault={args.fault}"] if args.fault and i == 0 else []
                engines.append(subprocess.Popen(
                    [sys.executable, str(REPO / "tests" / "python" / "fake_weight_engine.py"),
                     f"--kind={args.kind}", f"--out={out}", f"--device=cuda:{i + 1}",
                     f"--timeout_s={args.timeout_s}"] + fault))
                deadline = time.monotonic() + 180
                while not (out / "url").exists():
                    if engines[-1].poll() is not None or time.monotonic() > deadline:
                        sys.exit(f"fake engine {i} did not start")
                    time.sleep(0.2)
                urls.append(f"{args.kind}={(out / 'url').read_text()}")
            result = subprocess.run(
                [str(binary), f"--config={args.config}", "--device=cuda:0", f"--engines={','.join(urls)}",
                 f"--bucket_mb={args.bucket_mb}", f"--syncs={args.syncs}", f"--timeout_s={args.timeout_s}"]
                + (["--keep_going"] if args.fault else []))
            return result.returncode
        finally:
            for engine in engines:
                engine.kill()
                engine.wait()


if __name__ == "__main__":
    sys.exit(main())

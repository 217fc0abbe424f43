"""Where dta's step leaves the GPU idle, and what the host was doing then.

One warm-up step; one step profiled on the GPU alone (its idle time, which recording the host's
operations would inflate); then one step under torch.profiler with the host's operations and their
shapes, read back from its Chrome trace (kept with --trace):

- the GPU's idle time between its operations, by gap size, split into the part where the next
  operation's launch had not yet been issued when the GPU ran dry ("host late": the host bounds
  the step there) and the rest (launch latency);
- the host-late time by the executor's step scope the host was in when it finally launched
  (``dta::prepare``, ``dta::plan``, ``dta::forward``, ``dta::attach_loss``, ``dta::backward``,
  ``dta::pop``, ``dta::packed``, ``dta::loss_readback``: user scopes the executor records) and by
  the host operations that ran while the GPU waited (the outermost operations of each thread under
  a step scope, by name);
- the executor's scopes with their counts and host time (all a --device=cpu run reports);
- GPU time and operation counts by kind (attention, GEMM, memset, memcpy, other), and the GPU
  operations launched most often with the host operations that launch them.

dta's small kernels are launched after their predecessor (programmatic dependent launch): their
blocks start while the kernel before them finishes and wait for it, so a profiled duration
includes that wait (the norms' column sums measure 16 us a launch with it, 6 us without). Run with
DTA_DEPENDENT_LAUNCH=0 for each kernel's own time; the span and idle time then include the launch
gaps that dependent launch hides.

Nothing here is a test: run it on a GPU (docs/benchmarks.md, "Where dta's step spends its time").

  PYTHONPATH=<site> python3 bench/step_gaps.py --rollouts=tau2.jsonl --config=qwen3-1.7b
"""
from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import tempfile
from pathlib import Path

from hf_baseline import _ATTENTION, _GEMM  # one classification of kernels for both tools

_GPU_CATEGORIES = {"kernel", "gpu_memset", "gpu_memcpy"}
_LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver"}


def _kind(event: dict) -> str:
    if event["cat"] == "gpu_memset":
        return "memset"
    if event["cat"] == "gpu_memcpy":
        return "memcpy"
    name = event["name"]
    return "attention" if _ATTENTION.search(name) else "gemm" if _GEMM.search(name) else "other"


class ThreadOps:
    """One host thread's operations as a forest (each operation's innermost enclosing one)."""

    def __init__(self, events: list[dict]):
        self.events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
        self.starts = [e["ts"] for e in self.events]
        self.parent = [-1] * len(self.events)
        stack: list[int] = []
        for i, e in enumerate(self.events):
            while stack and self.events[stack[-1]]["ts"] + self.events[stack[-1]]["dur"] <= e["ts"]:
                stack.pop()
            self.parent[i] = stack[-1] if stack else -1
            stack.append(i)

    def open_at(self, ts: float) -> list[dict]:
        """The operations open at ts, innermost first."""
        i = bisect.bisect_right(self.starts, ts) - 1
        while i >= 0 and self.events[i]["ts"] + self.events[i]["dur"] < ts:
            i = self.parent[i]
        chain = []
        while i >= 0:
            chain.append(self.events[i])
            i = self.parent[i]
        return chain

    def outermost_below_scope(self) -> list[dict]:
        """The operations whose enclosing operations are all executor scopes (or none)."""
        keep = []
        for i, e in enumerate(self.events):
            if e["name"].startswith("dta::"):
                continue
            p = self.parent[i]
            while p >= 0 and self.events[p]["name"].startswith("dta::"):
                p = self.parent[p]
            if p < 0:
                keep.append(e)
        return keep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", required=True, help="JSON Lines rollouts (e.g. from dta-workload)")
    parser.add_argument("--config", default="qwen3-1.7b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--method", default="dta")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (the executor's scopes only)")
    parser.add_argument("--top", type=int, default=15, help="how many names to list per table")
    parser.add_argument("--trace", default="", help="also keep the Chrome trace at this path")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    import dta

    trajectories = dta.read_jsonl(args.rollouts)
    trainer = dta.Trainer.from_config(args.config, dtype=args.dtype, device=args.device, progress="never")
    cuda = args.device.startswith("cuda")

    def step() -> None:
        trainer.compute_gradients(trajectories, loss="grpo", method=args.method)
        if cuda:
            torch.cuda.synchronize()

    step()
    gpu_only: list[tuple[float, float]] = []
    if cuda:
        # The GPU alone first: recording host operations slows the host, which inflates its idle time.
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
        gpu_only = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                          if e.device_type == torch.autograd.DeviceType.CUDA)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(args.trace) if args.trace else Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]

    gpu = sorted((e for e in events if e.get("cat") in _GPU_CATEGORIES), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in _LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    threads: dict[tuple, list[dict]] = collections.defaultdict(list)
    for e in host:
        threads[(e["pid"], e["tid"])].append(e)
    thread_ops = {key: ThreadOps(ops) for key, ops in threads.items()}
    scopes = sorted((e for e in host if e["name"].startswith("dta::")), key=lambda e: e["ts"])
    scope_starts = [e["ts"] for e in scopes]

    def scope_at(ts: float) -> str:
        """The executor scope open at ts, or 'outside' (its scopes follow each other, unnested)."""
        i = bisect.bisect_right(scope_starts, ts) - 1
        if i >= 0 and scopes[i]["ts"] + scopes[i]["dur"] >= ts:
            return scopes[i]["name"]
        return "outside"

    def launcher(gpu_event: dict) -> list[dict]:
        """The host operations open when gpu_event was launched, innermost first."""
        launch = launches.get(gpu_event["args"].get("correlation"))
        ops = thread_ops.get((launch["pid"], launch["tid"])) if launch else None
        return ops.open_at(launch["ts"]) if ops else []

    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in gpu:
        k = by_kind[_kind(e)]
        k[0] += 1
        k[1] += e["dur"] / 1e3

    device = torch.cuda.get_device_name() if cuda else "the CPU"
    print(f"{args.config} {args.dtype}, method {args.method}, {len(trajectories)} rollouts, {device}")
    per_scope: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in scopes:
        per_scope[e["name"]][0] += 1
        per_scope[e["name"]][1] += e["dur"] / 1e3
    print("the executor's scopes (count, host ms): " + ", ".join(
        f"{name} {n:,} x {ms:.1f}" for name, (n, ms) in sorted(per_scope.items(), key=lambda kv: -kv[1][1])))
    if not gpu or not gpu_only:
        print("no GPU operations recorded: nothing more to attribute")
        return

    # Idle gaps of the GPU (all streams together), the launch of the operation after each.
    late_by_scope: collections.Counter = collections.Counter()
    latency_by_scope: collections.Counter = collections.Counter()
    windows: list[tuple[float, float]] = []  # host-late windows [GPU dry, launch issued]
    sizes = collections.Counter()
    idle = late = 0.0
    busy_end = gpu[0]["ts"] + gpu[0]["dur"]
    for e in gpu[1:]:
        if e["ts"] > busy_end:
            gap = e["ts"] - busy_end
            idle += gap
            sizes["under 10 us" if gap <= 10 else "10-50 us" if gap <= 50 else "over 50 us"] += gap
            launch = launches.get(e["args"].get("correlation"))
            issued = launch["ts"] if launch else busy_end
            scope = scope_at(issued)
            dry = min(gap, max(0.0, issued - busy_end))
            late += dry
            late_by_scope[scope] += dry
            latency_by_scope[scope] += gap - dry
            if dry > 0:
                windows.append((busy_end, busy_end + dry))
        busy_end = max(busy_end, e["ts"] + e["dur"])
    span = busy_end - gpu[0]["ts"]

    # The host operations that ran while the GPU waited for a launch.
    windows.sort()
    window_starts = [w[0] for w in windows]
    during: collections.Counter = collections.Counter()
    for ops in thread_ops.values():
        for e in ops.outermost_below_scope():
            begin, end = e["ts"], e["ts"] + e["dur"]
            i = max(0, bisect.bisect_right(window_starts, begin) - 1)
            while i < len(windows) and windows[i][0] < end:
                overlap = min(end, windows[i][1]) - max(begin, windows[i][0])
                if overlap > 0:
                    during[e["name"][:70]] += overlap
                i += 1

    quiet, reach, short = 0.0, gpu_only[0][1], 0.0
    for begin, end in gpu_only[1:]:
        if begin > reach:
            quiet += begin - reach
            short += begin - reach if begin - reach <= 10 else 0.0
        reach = max(reach, end)
    print(f"GPU only: span {(reach - gpu_only[0][0]) / 1e3:.1f} ms, idle {quiet / 1e3:.1f} ms "
          f"({short / 1e3:.1f} ms in gaps under 10 us)")
    print(f"with host operations recorded: GPU span {span / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms ({100 * idle / span:.1f}%): "
          f"host late {late / 1e3:.1f} ms, launch latency {(idle - late) / 1e3:.1f} ms; by gap: "
          + ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in sorted(sizes.items())))
    print("GPU operations by kind: " + ", ".join(
        f"{k} {n:,} x {ms:.1f} ms" for k, (n, ms) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])))
    print("\nidle by the executor's scope at the next launch (host late / launch latency, ms):")
    for scope in sorted(set(late_by_scope) | set(latency_by_scope),
                        key=lambda s: -(late_by_scope[s] + latency_by_scope[s])):
        print(f"  {scope:22s} {late_by_scope[scope] / 1e3:8.1f} {latency_by_scope[scope] / 1e3:8.1f}")
    print(f"\nGPU operations launched most often (count, ms, launched by; top {args.top}):")
    census: dict[str, list] = {}
    for e in gpu:
        entry = census.setdefault(e["name"], [0, 0.0, collections.Counter()])
        entry[0] += 1
        entry[1] += e["dur"] / 1e3
        chain = [o["name"] for o in launcher(e) if not o["name"].startswith("dta::")][:2]
        entry[2][" < ".join(n[:40] for n in chain)] += 1
    for name, (count, ms, callers) in sorted(census.items(), key=lambda kv: -kv[1][0])[:args.top]:
        caller, _ = callers.most_common(1)[0]
        print(f"  {count:6,d} {ms:8.1f}  {name[:60]}  <-  {caller}")
    waits = "" if os.environ.get("DTA_DEPENDENT_LAUNCH") == "0" else (
        "; dta's kernels' times include their wait for the kernel before them:"
        " DTA_DEPENDENT_LAUNCH=0 gives their own")
    print(f"\nGPU kernels other than GEMMs and attention by time (count, ms, launched by; top {args.top}{waits}):")
    kernels = [(name, entry) for name, entry in census.items()
               if _kind({"cat": "kernel", "name": name}) == "other"]
    for name, (count, ms, callers) in sorted(kernels, key=lambda kv: -kv[1][1])[:args.top]:
        caller, _ = callers.most_common(1)[0]
        print(f"  {count:6,d} {ms:8.1f}  {name[:60]}  <-  {caller}")
    # GEMMs by the shape of the matmul that launched them: time and TFLOP/s.
    shapes: dict[tuple, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    counted_ops: set[tuple] = set()
    for e in gpu:
        if _kind(e) != "gemm":
            continue
        op = next((o for o in launcher(e) if o["name"] in ("aten::mm", "aten::addmm")), None)
        dims = op["args"].get("Input Dims") if op else None
        if not dims:
            continue
        a, b = (dims[0], dims[1]) if op["name"] == "aten::mm" else (dims[1], dims[2])
        if len(a) != 2 or len(b) != 2:
            continue
        entry = shapes[(op["name"][6:], a[0], b[1], a[1])]
        entry[1] += e["dur"] / 1e3
        # Once per matmul: a split-K matmul launches more than one GEMM kernel.
        op_key = (op["pid"], op["tid"], op["ts"])
        if op_key not in counted_ops:
            counted_ops.add(op_key)
            entry[0] += 1
            entry[2] += 2.0 * a[0] * b[1] * a[1]
    counted = sum(v[1] for v in shapes.values())
    flops = sum(v[2] for v in shapes.values())
    if counted > 0:
        print(f"\nGEMMs by shape: {counted:.1f} ms with shapes known, {flops / counted / 1e9:.0f} TFLOP/s "
              f"over them; the costliest (op, M x N x K: count, ms, TFLOP/s; top {args.top}):")
        for (name, m, n, k), (count, ms, f) in sorted(shapes.items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"  {name:6s} {m:6d} x {n:6d} x {k:6d}  {count:5d} {ms:8.1f} {f / ms / 1e9:6.0f}")
        for lo, hi in ((0, 512), (512, 2048), (2048, 8192), (8192, 1 << 40)):
            sel = [v for (name, m, n, k), v in shapes.items() if lo <= min(m, n, k) < hi]
            if sel:
                ms, f = sum(v[1] for v in sel), sum(v[2] for v in sel)
                print(f"  smallest dimension in [{lo}, {hi}): {ms:8.1f} ms, {f / ms / 1e9:5.0f} TFLOP/s")
    print(f"\nhost operations while the GPU waited for a launch (ms of overlap, top {args.top}):")
    for name, us in during.most_common(args.top):
        print(f"  {us / 1e3:8.2f}  {name}")


if __name__ == "__main__":
    main()

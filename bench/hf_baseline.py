"""The dense baseline a user would pick: Hugging Face transformers, side by side with dta's methods.

One process, one device, the same random weights (dta.Trainer.from_config, saved and loaded back
by transformers) and the same rollouts (a JSON Lines file, e.g. from dta-workload): the time of one
batch's gradients (forward and backward of every rollout, no optimizer step) with

- ``hf-sdpa``, ``hf-flex``: transformers' model of the config's family (``AutoModelForCausalLM``:
  Qwen3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM, ...), one rollout at a time (each rollout is
  its own sequence, as trainers run them), attention through SDPA or flex attention; log-probs of
  the rollout's tokens, a GRPO-style surrogate on its trained tokens, backward;
- ``hf-sdpa-packed``, ``hf-flex-packed``: the same model and loss on packed sequences, as a
  dense trainer with packing runs them: rollouts concatenated in file order into packs of at most
  --pack_tokens tokens (a longer rollout alone), position ids restarting at each rollout, from
  which transformers builds a mask that keeps the rollouts apart (its packed-sequence detection;
  SDPA then takes a dense [L, L] mask, flex attention a block mask);
- ``dta-dense``, ``dta``, ``dta-pack``: dta.Trainer.compute_gradients with the same loss, dense
  (every rollout on its own) and dta (push/pop over the prefix tree) with its default options but
  ``pack=False`` (dta-bench's ``dta-bauto-gauto``), and with its default options, packing included
  (small complete subtrees in one tree-masked forward: dta-bench's ``dta-bauto-gauto-pack``).

Prints a table (rollout tokens / s and the ratio to the fastest dense) and, with --json, a JSON
line per method. With --profile, one more run of each method under torch.profiler counts its
kernel launches and splits its GPU time into attention, GEMMs, and the rest (elementwise kernels,
reductions, copies), with the kernels that take the most time. Nothing here is a test: run it on a
GPU for numbers (docs/benchmarks.md).

  python bench/hf_baseline.py --rollouts=tau2.jsonl --config=qwen3-1.7b --device=cuda --dtype=bfloat16
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_gradients(model, trajectories, advantages: list[float], device: torch.device) -> None:
    """One rollout at a time: log p(token t | tokens < t) on the trained tokens, the surrogate
    -A * exp(lp - lp.detach()) (whose gradient is GRPO's at ratio 1), summed over the batch."""
    total = sum(sum(t.loss_mask) for t in trajectories)
    for t, advantage in zip(trajectories, advantages):
        ids = torch.tensor(t.tokens, device=device)[None]
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(t.loss_mask[1:], device=device, dtype=torch.bool)
        loss = (-advantage * torch.exp(lp - lp.detach()))[mask].sum() / total
        loss.backward()


def packs(trajectories, pack_tokens: int) -> list[list[int]]:
    """Indices of the trajectories in each pack: file order, at most pack_tokens tokens a pack
    (a longer trajectory alone)."""
    out: list[list[int]] = []
    size = 0
    for i, t in enumerate(trajectories):
        if not out or size + len(t.tokens) > pack_tokens:
            out.append([])
            size = 0
        out[-1].append(i)
        size += len(t.tokens)
    return out


def hf_packed_gradients(model, trajectories, advantages: list[float], device: torch.device,
                        pack_tokens: int, pad: bool = False) -> None:
    """hf_gradients' loss on packed sequences: each pack is one sequence whose position ids restart
    at every rollout (transformers then keeps the rollouts apart); the prediction across a
    boundary is not trained. With `pad`, a pack shorter than pack_tokens is filled up to it with
    an untrained sequence of token 0 (its own positions, so nothing attends across): every pack
    then has one shape, which flex attention (compiled with static shapes) compiles once instead
    of once per pack length."""
    total = sum(sum(t.loss_mask) for t in trajectories)
    for pack in packs(trajectories, pack_tokens):
        ids = torch.tensor([x for i in pack for x in trajectories[i].tokens], device=device)
        positions = torch.cat([torch.arange(len(trajectories[i].tokens), device=device) for i in pack])
        fill = pack_tokens - len(ids) if pad else 0
        # Per predicted token (position p predicts p + 1): its rollout's advantage, and whether it
        # is trained (the rollout's loss mask; never across a boundary).
        weight, trained = [], []
        for i in pack:
            t = trajectories[i]
            weight += [advantages[i]] * len(t.tokens)
            trained += [bool(m) for m in t.loss_mask[1:]] + [False]
        if fill > 0:
            ids = torch.cat([ids, torch.zeros(fill, dtype=ids.dtype, device=device)])
            positions = torch.cat([positions, torch.arange(fill, device=device)])
            weight += [0.0] * fill
            trained += [False] * fill
        weight = torch.tensor(weight[:-1], device=device)
        mask = torch.tensor(trained[:-1], device=device, dtype=torch.bool)
        # No cache: transformers detects packing from the position ids only without one.
        logits = model(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(1, ids[1:, None])[:, 0]
        loss = (-weight * torch.exp(lp - lp.detach()))[mask].sum() / total
        loss.backward()


def group_advantages(trajectories) -> list[float]:
    """GRPO's group-normalised advantages of the rewards (0 where a group has one member)."""
    groups: dict[str, list[float]] = {}
    for t in trajectories:
        groups.setdefault(t.group, []).append(float(t.reward or 0.0))
    out = []
    for t in trajectories:
        rewards = groups[t.group]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1))
        out.append(((t.reward or 0.0) - mean) / (std + 1e-6) if len(rewards) > 1 else 0.0)
    return out


def release_memory(device: torch.device) -> None:
    """Frees what the last method left: unreachable tensors now, then the caching allocator's blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed(fn, device: torch.device, repeats: int) -> tuple[float, object]:
    """The fastest of `repeats` runs after one warm-up, seconds, and what the last run returned."""
    value = fn()
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best, value


METHODS = ("hf-sdpa", "hf-flex", "hf-sdpa-packed", "hf-flex-packed", "dta-dense", "dta", "dta-pack")
# dta's methods: (Trainer.compute_gradients method, its options).
# Each name states pack, so that it keeps meaning what it measured before packing became the default.
DTA_METHODS = {"dta-dense": ("dense", {}), "dta": ("dta", {"pack": False}), "dta-pack": ("dta", {"pack": True})}

# Kernel names by what they compute (cuBLAS/cuBLASLt's GEMMs, FlashAttention/cuDNN/our attention).
_ATTENTION = re.compile(r"attention|flash|fmha|sdpa|TreeAttention|tree_attention|hopper_detail::Hopper",
                        re.IGNORECASE)
_GEMM = re.compile(r"gemm|nvjet|xmma|cutlass|ampere_|sm80_|sm90_|splitK|Kernel2", re.IGNORECASE)


def _busy_ms(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals, in ms (their times in us)."""
    busy, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / 1e3


def kernel_profile(fn, device: torch.device, host: bool = True, top: int = 12) -> dict:
    """One run of fn under torch.profiler: kernel launches, GPU time by kind, the costliest kernels,
    and where the host's time goes: the run's wall time, how much of it the GPU was busy, and the
    CUDA runtime calls (launches, copies, synchronizations) by name with their host time. Without
    `host`, only the GPU's activity is recorded (no host operations or runtime calls): recording
    every host operation of a large batch slows the host enough to hide whether it bounds the step."""
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if host else [ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    kinds = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
    by_name: dict[str, list[float]] = {}
    runtime: dict[str, list[float]] = {}
    launches = 0
    gpu_intervals: list[tuple[float, float]] = []
    first, last = math.inf, -math.inf
    for event in prof.events():
        start, end = event.time_range.start, event.time_range.end
        first, last = min(first, start), max(last, end)
        if event.device_type != torch.autograd.DeviceType.CUDA:
            if event.name.startswith("cuda"):  # a CUDA runtime call on the host
                entry = runtime.setdefault(event.name, [0, 0.0])
                entry[0] += 1
                entry[1] += event.time_range.elapsed_us() / 1e3
            continue
        us = event.time_range.elapsed_us()
        gpu_intervals.append((start, end))
        name = event.name
        if name.startswith("Memcpy") or name.startswith("Memset"):
            kind = "other"
        else:
            launches += 1
            kind = "attention" if _ATTENTION.search(name) else "gemm" if _GEMM.search(name) else "other"
        kinds[kind] += us / 1e3
        entry = by_name.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += us / 1e3
    costliest = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    host_ops = sorted((e for e in prof.key_averages() if host and not e.key.startswith("cuda")),
                      key=lambda e: -e.self_cpu_time_total)[:top]
    host_calls = sorted(runtime.items(), key=lambda item: -item[1][1])[:top]
    return {"kernel_launches": launches, "gpu_ms": kinds,
            "wall_ms": round((last - first) / 1e3, 3) if gpu_intervals else 0.0,
            "gpu_busy_ms": round(_busy_ms(gpu_intervals), 3),
            "costliest": [{"name": n[:120], "count": c, "ms": round(ms, 3)} for n, (c, ms) in costliest],
            "runtime_calls": [{"name": n, "count": c, "ms": round(ms, 3)} for n, (c, ms) in host_calls],
            "host_ops": [{"name": e.key[:120], "count": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 3)}
                         for e in host_ops]}


def print_profile(r: dict) -> None:
    p = r["profile"]
    ms = p["gpu_ms"]
    total = sum(ms.values())
    print(f"\nprofile of {r['method']}: {p['kernel_launches']:,} kernel launches, GPU {total:.1f} ms: "
          + ", ".join(f"{kind} {t:.1f} ms ({t / max(total, 1e-9):.0%})" for kind, t in ms.items()))
    for k in p["costliest"]:
        print(f"  {k['ms']:>9.2f} ms {k['count']:>7} x  {k['name']}")
    print(f"  wall {p['wall_ms']:.1f} ms under the profiler, GPU busy {p['gpu_busy_ms']:.1f} ms "
          f"({p['gpu_busy_ms'] / max(p['wall_ms'], 1e-9):.0%}); CUDA runtime calls on the host:")
    for k in p["runtime_calls"]:
        print(f"  {k['ms']:>9.2f} ms {k['count']:>7} x  {k['name']}")
    print("  host operations by their own time:")
    for k in p["host_ops"]:
        print(f"  {k['self_ms']:>9.2f} ms {k['count']:>7} x  {k['name']}")
    print(flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", required=True, help="a JSON Lines rollout file (dta-workload writes them)")
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "examples" / "configs" /
                                                 "qwen3-tiny.json"), help="a dta preset or a config.json")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--pack_tokens", type=int, default=16384,
                        help="hf-*-packed: the most tokens in one packed sequence")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="a JSON line per method")
    parser.add_argument("--profile", nargs="?", const="all", default="",
                        help="profile one more run of each method, or of the methods listed "
                             "(--profile=dta,dta-dense): launches, GPU time by kind, host operations")
    parser.add_argument("--profile_top", type=int, default=12,
                        help="with --profile: how many of the costliest kernels and host operations to list")
    parser.add_argument("--profile_host", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-profile_host records the GPU's activity only (for large batches, "
                             "whose host operations the profiler would slow down)")
    args = parser.parse_args()
    if args.pack_tokens < 1:
        parser.error(f"--pack_tokens must be >= 1, got {args.pack_tokens}")
    methods = args.methods.split(",")
    if set(methods) - set(METHODS):
        parser.error(f"--methods: unknown {sorted(set(methods) - set(METHODS))} "
                     f"(known: {', '.join(sorted(METHODS))})")
    if not args.profile_host and not args.device.startswith("cuda"):
        parser.error(f"--no-profile_host records the GPU's activity only: --device={args.device} has none")
    profiled_methods = set(methods if args.profile == "all" else args.profile.split(",") if args.profile else [])
    if not profiled_methods <= set(methods):
        parser.error(f"--profile names methods not in --methods: {sorted(profiled_methods - set(methods))}")

    import dta
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    trajectories = dta.read_jsonl(args.rollouts)
    trainer = dta.Trainer.from_config(args.config, dtype=args.dtype, device=args.device, progress="never")
    for t in trajectories:
        t.validate(trainer.vocab_size)
    tokens = sum(len(t.tokens) for t in trajectories)
    tree = dta.PrefixTree(trajectories).stats()
    advantages = group_advantages(trajectories)

    results = []
    with tempfile.TemporaryDirectory() as scratch:
        trainer.save(scratch, dtype=None, optimizer=False)
        for method in methods:
            profile = method in profiled_methods
            if method.startswith("hf-"):
                attention = {"sdpa": "sdpa", "flex": "flex_attention"}[method.split("-")[1]]
                # dta saves each family under its transformers model_type, so the Auto class
                # loads the matching model (Llama's for a Llama config).
                model = AutoModelForCausalLM.from_pretrained(Path(scratch) / "model", dtype=dtype,
                                                             attn_implementation=attention).to(device)
                hf_class = type(model).__name__
                model.train()
                if method.endswith("-packed"):
                    run = lambda: hf_packed_gradients(model, trajectories, advantages, device,  # noqa: E731
                                                      args.pack_tokens, pad=attention == "flex_attention")
                else:
                    run = lambda: hf_gradients(model, trajectories, advantages, device)  # noqa: E731
                try:
                    seconds, _ = timed(run, device, args.repeats)
                    profiled = kernel_profile(run, device, args.profile_host, args.profile_top) if profile else None
                except (NotImplementedError, RuntimeError) as e:  # e.g. flex attention's backward on a CPU
                    print(f"hf_baseline: {method} cannot run here: {str(e).splitlines()[0]}", file=sys.stderr)
                    continue
                finally:
                    # Also after a failure (out of memory: transformers' 8B model on a long rollout):
                    # the model's memory and what the caching allocator keeps go back before the next
                    # method, whose cuBLAS handle is allocated outside that cache.
                    del model, run
                    release_memory(device)
            else:
                name, options = DTA_METHODS[method]
                run = lambda: trainer.compute_gradients(trajectories, "grpo", name, **options)  # noqa: E731
                seconds, stats = timed(run, device, args.repeats)
                # Inside compute_gradients after validation (the conversion to C++ included),
                # and the tokens forwarded (recomputed ones included): beside dta-bench's step.
                inner = {"executor_seconds": stats.seconds, "forwarded_tokens": stats.forwarded_tokens}
                profiled = kernel_profile(run, device, args.profile_host, args.profile_top) if profile else None
            release_memory(device)
            result = {"method": method, "seconds": seconds, "rollout_tokens_per_second": tokens / seconds,
                      "rollout_tokens": tokens, "tree_tokens": tree.tree_tokens, "config": args.config,
                      "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
            if method.startswith("hf-"):
                result["hf_class"] = hf_class
            else:
                result.update(inner)
            if profiled is not None:
                result["profile"] = profiled
                print_profile(result)
            results.append(result)
            # As each method finishes, so that a run cut short still reports what it measured.
            detail = "" if method.startswith("hf-") else (
                f" (last run: {inner['executor_seconds']:.3f} s in compute_gradients, "
                f"{inner['forwarded_tokens']:,} tokens forwarded)")
            print(f"hf_baseline: {method} {seconds:.3f} s{detail}", file=sys.stderr, flush=True)
    dense = [r["seconds"] for r in results if DTA_METHODS.get(r["method"], ("dense",))[0] == "dense"]
    fastest_dense = min(dense) if dense else math.nan
    where = results[0]["device"] if results else args.device
    print(f"{len(trajectories)} rollouts, {tokens} rollout tokens, {tree.tree_tokens} tree tokens "
          f"(C = {tokens / tree.tree_tokens:.2f}), {args.config} {args.dtype} on {where}")
    print(f"{'method':<15} {'seconds':>9} {'rollout tok/s':>14} {'vs fastest dense':>17}")
    for r in results:
        r["vs_fastest_dense"] = fastest_dense / r["seconds"]
        print(f"{r['method']:<15} {r['seconds']:>9.3f} {r['rollout_tokens_per_second']:>14,.0f} "
              f"{r['vs_fastest_dense']:>16.2f}x")
        if args.json:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())

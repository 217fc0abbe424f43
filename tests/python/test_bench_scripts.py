"""The Python benchmark scripts run end to end on a tiny model and batch (their numbers come from
GPU runs, docs/benchmarks.md; here only that they work and report consistently)."""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dta

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import balance_by_time  # noqa: E402
import gated_delta_baseline  # noqa: E402
import hf_baseline  # noqa: E402


def shared_prompt_batch(seed: int, prompt_tokens: int, answer_tokens: list[int]) -> list[dta.Trajectory]:
    """One group: a random prompt, then answers of the given lengths (trained), rewards 0 and 1."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1024) for _ in range(prompt_tokens)]
    batch = []
    for i, length in enumerate(answer_tokens):
        tokens = prompt + [rng.randrange(1024) for _ in range(length)]
        batch.append(dta.Trajectory(id=f"r{i}", group="g", tokens=tokens, loss_mask=[0] * prompt_tokens + [1] * length,
                                    logprobs=[-1.0] * len(tokens), reward=float(i % 2)))
    return batch


def test_hf_baseline_times_transformers_and_dta_on_the_same_batch(tmp_path):
    batch = shared_prompt_batch(3, 40, [20 + 5 * i for i in range(4)])
    rollouts = tmp_path / "rollouts.jsonl"
    dta.write_jsonl(rollouts, batch)
    run = subprocess.run([sys.executable, str(REPO / "bench" / "hf_baseline.py"), f"--rollouts={rollouts}",
                          "--device=cpu", "--dtype=float32", "--repeats=1", "--methods=hf-sdpa,hf-sdpa-packed,dta-dense,dta,dta-pack",
                          "--json", "--profile=hf-sdpa-packed,dta"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["method"] for r in records] == ["hf-sdpa", "hf-sdpa-packed", "dta-dense", "dta", "dta-pack"]
    tokens = sum(len(t.tokens) for t in batch)
    for r in records:
        assert r["rollout_tokens"] == tokens and r["tree_tokens"] == 40 + sum(20 + 5 * i for i in range(4))
        assert r["seconds"] > 0 and r["rollout_tokens_per_second"] == tokens / r["seconds"]
        if r["method"].startswith("dta"):  # what the executor did, beside dta-bench's step
            assert 0 < r["executor_seconds"] and r["forwarded_tokens"] >= r["tree_tokens"], r
            assert "hf_class" not in r, r["method"]
        else:
            assert "forwarded_tokens" not in r, r["method"]
            assert r["hf_class"] == "Qwen3ForCausalLM", r  # the default config's family
        if r["method"] not in ("hf-sdpa-packed", "dta"):
            assert "profile" not in r, r["method"]
            continue
        # On the CPU the profiler sees no kernels: only the report's shape is checked here.
        assert r["profile"]["kernel_launches"] == 0 and set(r["profile"]["gpu_ms"]) == {"attention", "gemm", "other"}
        assert r["profile"]["host_ops"], "the host's operations are listed"
    assert run.stdout.count("profile of ") == 2
    # Each method reports as it finishes, so that a run cut short keeps what it measured.
    assert [line.split()[1] for line in run.stderr.splitlines() if line.startswith("hf_baseline: ")] == \
        ["hf-sdpa", "hf-sdpa-packed", "dta-dense", "dta", "dta-pack"]
    gpu_only = subprocess.run([sys.executable, str(REPO / "bench" / "hf_baseline.py"), f"--rollouts={rollouts}",
                               "--device=cpu", "--dtype=float32", "--repeats=1", "--methods=dta", "--json",
                               "--profile", "--no-profile_host"], capture_output=True, text=True, timeout=120)
    assert gpu_only.returncode == 2 and "--device=cpu has none" in gpu_only.stderr
    unknown = subprocess.run([sys.executable, str(REPO / "bench" / "hf_baseline.py"), f"--rollouts={rollouts}",
                              "--methods=dta", "--profile=hf-sdpa"], capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "--profile names methods not in --methods: ['hf-sdpa']" in unknown.stderr
    typo = subprocess.run([sys.executable, str(REPO / "bench" / "hf_baseline.py"), f"--rollouts={rollouts}",
                           "--methods=dta,dta-packed"], capture_output=True, text=True, timeout=120)
    assert typo.returncode == 2 and "--methods: unknown ['dta-packed']" in typo.stderr
    fastest = min(r["seconds"] for r in records if r["method"] in ("hf-sdpa", "hf-sdpa-packed", "dta-dense"))
    assert all(abs(r["vs_fastest_dense"] - fastest / r["seconds"]) < 1e-12 for r in records)


def test_hf_baseline_frees_a_failed_method_before_the_next(tmp_path, monkeypatch, capsys):
    """A transformers method that fails (on the GPU: out of memory on a long rollout) is reported and
    skipped, and its model, with what the failure's traceback held, is freed before the next method
    runs: the next one (here dta) then gets the memory back instead of failing too."""
    import weakref
    batch = shared_prompt_batch(5, 16, [6, 8])
    rollouts = tmp_path / "rollouts.jsonl"
    dta.write_jsonl(rollouts, batch)
    models = []

    def out_of_memory(model, *args):
        models.append(weakref.ref(model))
        held = torch.ones(4)  # noqa: F841 - an activation the traceback keeps alive
        raise RuntimeError("CUDA out of memory. Tried to allocate 48.00 MiB.\nmore")

    alive_at_release = []
    release = hf_baseline.release_memory

    def recording_release(device):
        release(device)
        alive_at_release.append([ref() is not None for ref in models])

    monkeypatch.setattr(hf_baseline, "hf_gradients", out_of_memory)
    monkeypatch.setattr(hf_baseline, "release_memory", recording_release)
    monkeypatch.setattr(sys, "argv", ["hf_baseline.py", f"--rollouts={rollouts}", "--device=cpu", "--dtype=float32",
                                      "--repeats=1", "--methods=hf-sdpa,dta", "--json"])
    assert hf_baseline.main() == 0
    out, err = capsys.readouterr()
    assert "hf_baseline: hf-sdpa cannot run here: CUDA out of memory. Tried to allocate 48.00 MiB." in err
    assert [json.loads(line)["method"] for line in out.splitlines() if line.startswith("{")] == ["dta"]
    assert len(models) == 1 and alive_at_release[0] == [False], "the failed method's model outlived it"
    assert len(alive_at_release) == 2  # after the failure, and after dta


def test_hf_baseline_loads_transformers_model_of_the_configs_family(tmp_path):
    """A Llama config runs transformers' LlamaForCausalLM beside dta on the same saved weights
    (transformers' Auto class, from the model_type dta saves), not Qwen3's."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 512,
              "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    rng = random.Random(4)
    batch = [dta.Trajectory(id=f"r{i}", group="g", tokens=[rng.randrange(256) for _ in range(12 + i)],
                            loss_mask=[0] * 4 + [1] * (8 + i), logprobs=[-1.0] * (12 + i), reward=float(i))
             for i in range(3)]
    dta.write_jsonl(tmp_path / "rollouts.jsonl", batch)
    run = subprocess.run([sys.executable, str(REPO / "bench" / "hf_baseline.py"),
                          f"--rollouts={tmp_path / 'rollouts.jsonl'}", f"--config={tmp_path / 'config.json'}",
                          "--device=cpu", "--dtype=float32", "--repeats=1", "--methods=hf-sdpa,hf-sdpa-packed,dta",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    records = {r["method"]: r for r in (json.loads(line) for line in run.stdout.splitlines() if line.startswith("{"))}
    assert set(records) == {"hf-sdpa", "hf-sdpa-packed", "dta"}
    assert records["hf-sdpa"]["hf_class"] == records["hf-sdpa-packed"]["hf_class"] == "LlamaForCausalLM"


def test_packed_transformers_computes_the_per_rollout_gradient():
    """hf-*-packed is the same baseline: transformers keeps packed rollouts apart (position ids
    restarting at each), so the packed loss's gradient is the per-rollout one, with packs padded to
    one length too (float64; SDPA
    exactly, eager up to its float32 softmax; flex attention has no backward on the CPU)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    rng = random.Random(5)
    batch = []
    for i in range(7):
        tokens = [rng.randrange(64) for _ in range(3 + 4 * i)]
        batch.append(dta.Trajectory(id=f"r{i}", group=f"g{i % 2}", tokens=tokens,
                                    loss_mask=[0] + [rng.randrange(2) or 1 for _ in tokens[1:]],
                                    logprobs=[-1.0] * len(tokens), reward=float(i % 3)))
    advantages = hf_baseline.group_advantages(batch)
    assert any(a != 0 for a in advantages)
    grads = {}
    for attention in ("sdpa", "eager"):
        model = Qwen3ForCausalLM(config).to(torch.float64)
        model.config._attn_implementation = attention
        torch.manual_seed(1)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.3)
        for name, run in [("each", lambda: hf_baseline.hf_gradients(model, batch, advantages, torch.device("cpu"))),
                          ("packed", lambda: hf_baseline.hf_packed_gradients(model, batch, advantages,
                                                                             torch.device("cpu"), pack_tokens=40)),
                          ("padded", lambda: hf_baseline.hf_packed_gradients(model, batch, advantages,
                                                                             torch.device("cpu"), pack_tokens=40,
                                                                             pad=True))]:
            model.zero_grad()
            run()
            grads[attention, name] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert len(hf_baseline.packs(batch, 40)) < len(batch)  # some packs hold several rollouts
    for attention, tolerance in (("sdpa", 1e-10), ("eager", 1e-6)):
        each = grads[attention, "each"]
        assert each.norm() > 0
        for packing in ("packed", "padded"):
            assert (grads[attention, packing] - each).norm() <= tolerance * each.norm(), (attention, packing)


def test_packs_keep_file_order_under_the_cap():
    batch = [dta.Trajectory(id=str(i), group="g", tokens=[1] * n, loss_mask=[0] + [1] * (n - 1),
                            logprobs=[-1.0] * n, reward=0.0) for i, n in enumerate([5, 5, 9, 30, 2, 2])]
    assert hf_baseline.packs(batch, 10) == [[0, 1], [2], [3], [4, 5]]
    assert hf_baseline.packs(batch, 1000) == [[0, 1, 2, 3, 4, 5]]


def test_python_overhead_times_both_checks_of_a_batch(tmp_path):
    batch = [dta.Trajectory(id=f"r{i}", group="g", tokens=list(range(1, 30 + i)), loss_mask=[0] + [1] * (28 + i),
                            logprobs=[-1.0] * (29 + i), reward=float(i)) for i in range(5)]
    rollouts = tmp_path / "rollouts.jsonl"
    dta.write_jsonl(rollouts, batch)
    run = subprocess.run([sys.executable, str(REPO / "bench" / "python_overhead.py"), f"--rollouts={rollouts}",
                          "--repeats=2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == f"5 trajectories, {sum(29 + i for i in range(5))} tokens, vocabulary 151,936"
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "Python validation of every trajectory (before)", "C++ check of plain trajectories (now)",
        "Trainer._checked, checked and converted (now)", "from_areal of every trajectory"]
    bad = subprocess.run([sys.executable, str(REPO / "bench" / "python_overhead.py"), f"--rollouts={rollouts}",
                          "--repeats=0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--repeats must be >= 1, got 0" in bad.stderr


# scripts/gpu_bench_set.sh runs bench/configs/ on a GPU machine; --dry_run prints its commands
# without a GPU, which is what these check.
BENCH_SET = REPO / "scripts" / "gpu_bench_set.sh"
CONFIGS = REPO / "bench" / "configs"


def bench_set(*args):
    return subprocess.run(["bash", str(BENCH_SET), "--dry_run", *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def test_gpu_bench_set_prints_a_sets_commands_and_writes_nothing(tmp_path):
    run = bench_set(f"--out={tmp_path}", "step")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    record = re.fullmatch(r"record: (\S+) \(.*\)", lines[0]).group(1)
    assert re.fullmatch(re.escape(str(tmp_path)) + r"/\d{4}-\d\d-\d\d-step-[a-z0-9]+", record), record
    assert list(tmp_path.iterdir()) == [], "a dry run writes nothing"
    assert "DTA_DEVICE_TARGETS=dta-bench\\ dta-workload scripts/device_build.sh" in lines[1]
    workloads = [line for line in lines if "bin/dta-workload" in line]
    assert [re.search(r"--preset=(\S+) --seed=1 --scale=(\S+) ", w).groups() for w in workloads] == [
        ("tau2", "0.25"), ("tau2", "0.2"), ("gsm8k", "0.3"), ("aime", "0.1")]
    benches = [line for line in lines if "bin/dta-bench" in line]
    names = ["qwen3-1.7b-tau2", "qwen3-8b-tau2", "qwen3-1.7b-gsm8k", "qwen3-1.7b-aime-4"]
    assert len(benches) == 4
    for name, limit, line, workload in zip(names, [150, 200, 60, 45], benches, workloads):
        assert line.startswith(f"timeout {limit} build-device/bin/dta-bench --flagfile=bench/configs/{name}.flags "), line
        assert f"--rollouts={workload.split('--out=')[1].split()[0]}" in line
        assert f"--out_dir={record}/{name} --label={name} >/dev/null 2>{record}/{name}/log.txt" in line


def test_gpu_bench_set_runs_each_config_once_with_its_own_tool(tmp_path):
    run = bench_set(f"--out={tmp_path}", "--topic=mixed", "kernels", "attention-d64", "qwen3-1.7b-aime-4-transformers",
                    "data-parallel-2gpu")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    record = lines[0].split()[1]
    assert "-mixed-" in record
    assert lines[1].startswith("scripts/device_build.sh -DDTA_BUILD_PYTHON=ON"), "a script needs the whole build"
    assert sum("dta-attention-bench --flagfile=bench/configs/attention-d64.flags" in line for line in lines) == 1
    # The AIME batch's first 4 rollouts, for hf_baseline, which has no --max_rollouts.
    first = [line for line in lines if line.startswith("head -n 4 ")]
    assert len(first) == 1
    hf = [line for line in lines if "bench/hf_baseline.py" in line]
    assert len(hf) == 1 and hf[0].startswith("env PYTHONPATH=build-device/site timeout 120 python3 bench/hf_baseline.py "
                                             "--config=qwen3-1.7b --device=cuda --dtype=bfloat16 --repeats=2 ")
    assert f"--rollouts={first[0].split('>')[1]} --json >{record}/qwen3-1.7b-aime-4-transformers/results.jsonl" in hf[0]
    dp = [line for line in lines if "gpu_dp.sh" in line]
    assert dp == [f"env RANKS=2 MODEL=qwen3-1.7b SCALE=0.25 STEPS=4 OUT={record}/data-parallel-2gpu timeout 600 "
                  f"scripts/gpu_dp.sh --no_build >{record}/data-parallel-2gpu/output.log 2>&1"]


def flags_defined_by(path):
    text = path.read_text()
    if path.suffix == ".cc":
        return set(re.findall(r"ABSL_FLAG\(\s*[\w:]+,\s*(\w+),", text))
    if path.suffix == ".py":
        return set(re.findall(r'add_argument\("--(\w+)"', text))
    return set(re.findall(r"--(\w+)=?\*?\)", text))  # a script's case patterns


def test_every_named_run_uses_flags_its_tool_defines():
    """Every config of bench/configs/ is valid (a dry run of all of them passes its checks), and every
    flag in it is one its tool defines, so that a run on the GPU machine does not stop at a typo."""
    runs = sorted(p.stem for p in CONFIGS.glob("*.flags"))
    sets = sorted(p.stem for p in CONFIGS.glob("*.set"))
    assert "step" in sets and "qwen3-1.7b-tau2" in runs
    run = bench_set("--no_build", *sets, *runs)
    assert run.returncode == 0, run.stderr
    workload_flags = flags_defined_by(REPO / "apps" / "workload" / "workload_main.cc")
    defined = {"dta-bench": flags_defined_by(REPO / "bench" / "method_bench.cc"),
               "dta-attention-bench": flags_defined_by(REPO / "bench" / "attention_bench.cc"),
               "hf_baseline": flags_defined_by(REPO / "bench" / "hf_baseline.py")}
    for name in runs:
        text = (CONFIGS / f"{name}.flags").read_text()
        tool = (re.findall(r"^# tool: (\S+)", text, re.M) or ["dta-bench"])[0]
        known = defined.get(tool) or flags_defined_by(REPO / tool)
        if tool == "scripts/gpu_bench.sh":  # passes the flags it does not know to dta-bench
            known |= defined["dta-bench"]
        flags = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
        for flag in flags:
            assert re.fullmatch(r"--\w+(=\S+)?", flag) and flag[2:].split("=")[0] in known, (name, flag)
        for flag in " ".join(re.findall(r"^# workload: (.*)$", text, re.M)).split():
            assert flag[2:].split("=")[0] in workload_flags, (name, flag)
    for name in sets:
        members = [line for line in (CONFIGS / f"{name}.set").read_text().splitlines() if line and line[0] != "#"]
        assert members and all(m in runs for m in members), name


def test_gpu_bench_set_refuses_bad_names_and_configs_before_running(tmp_path):
    unknown = bench_set("step", "no-such-run")
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert "no set or run 'no-such-run' (neither bench/configs/no-such-run.set nor" in unknown.stderr
    assert bench_set().returncode == 2
    configs = tmp_path / "configs"
    configs.mkdir()
    cases = {
        "tool": ("# tool: dta-trainer\n--repeats=1\n", "unknown tool 'dta-trainer'"),
        "workload": ("--repeats=1\n", "a dta-bench run needs a '# workload: ...' line"),
        "timeout": ("# workload: --preset=tau2\n# timeout: soon\n", "timeout 'soon' is not a number of seconds"),
        "first": ("# tool: hf_baseline\n# workload: --preset=aime\n# first_rollouts: 0\n",
                  "first_rollouts '0' is not a positive number"),
        "env": ("# workload: --preset=tau2\n# env: 1BAD=x\n", "env '1BAD=x' is not VAR=VALUE"),
    }
    for name, (text, message) in cases.items():
        (configs / f"{name}.flags").write_text(text)
        run = bench_set(f"--configs={configs}", name)
        assert run.returncode == 2 and message in run.stderr and run.stdout == "", (name, run.stderr)
    (configs / "good.flags").write_text("# workload: --preset=tau2\n--repeats=1\n")
    (configs / "pair.set").write_text("# a set\ngood\nmissing\n")
    run = bench_set(f"--configs={configs}", "pair")
    assert run.returncode == 2 and f"{configs}/pair.set: no run 'missing'" in run.stderr
    assert bench_set(f"--configs={configs}", "good").returncode == 0
    assert bench_set(f"--configs={configs}", "--topic=Bad Topic", "good").returncode == 2


def test_balance_by_time_fits_a_model_and_runs_every_share_of_both_splits(tmp_path):
    """bench/balance_by_time.py on the CPU: a fitted time model, and per batch (the file, and the file
    with long paths added) both splits' shares with their predicted and measured times."""
    rng = random.Random(5)
    batch = []
    for g in range(3):
        prompt = [rng.randrange(1, 1024) for _ in range(30)]
        for s in range(2):
            tokens = prompt + [rng.randrange(1, 1024) for _ in range(10 + 10 * s)]
            batch.append(dta.Trajectory(id=f"g{g}-{s}", group=f"g{g}", tokens=tokens,
                                        loss_mask=[0] * 30 + [1] * (len(tokens) - 30),
                                        logprobs=[0.0] * len(tokens), reward=float(s)))
    rollouts = tmp_path / "rollouts.jsonl"
    dta.write_jsonl(rollouts, batch)
    run = subprocess.run([sys.executable, str(REPO / "bench" / "balance_by_time.py"), f"--rollouts={rollouts}",
                          "--config=" + str(REPO / "examples" / "configs" / "qwen3-tiny.json"), "--ranks=2",
                          "--device=cpu", "--dtype=float32", "--repeats=1", "--long_paths=2x120", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert re.search(r"--balance_per_token=\d+ --balance_per_key=\d+", run.stdout), run.stdout
    records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["batch"] for r in records] == [str(rollouts), f"{rollouts} + 2 x 120-token paths"]
    for record, rollouts_in in zip(records, (batch, batch + balance_by_time.long_path_group(2, 120, 1024))):
        tree = dta.PrefixTree(rollouts_in)
        for split in ("tokens", "time"):
            shares = record[split]["shares"]
            assert len(shares) == 2 and record[split]["step_s"] == max(s["measured_s"] for s in shares)
            # The shares together hold every tree token, plus what the split duplicates.
            assert sum(s["tree_tokens"] for s in shares) == tree.tree_tokens + record[split]["extra_tokens"]
            for s in shares:
                assert s["measured_s"] > 0 and s["predicted_s"] >= 0 and s["keys"] >= s["tree_tokens"]
        # The token split is the default partition.
        assert [s["tree_tokens"] for s in record["tokens"]["shares"]] == tree.partition(2).tree_tokens


def test_balance_by_time_fit_is_non_negative():
    # Times that grow with keys alone: the unconstrained fit would price tokens below zero.
    samples = [(100, 1000, 1.0), (100, 3000, 3.0), (200, 2000, 2.0), (50, 4000, 4.0)]
    a, b = balance_by_time.fit(samples)
    assert a >= 0 and b >= 0 and abs(b - 1e-3) < 1e-6
    a, b = balance_by_time.fit([(100, 1000, 1.2), (200, 1500, 2.1), (300, 9000, 3.4)])
    assert a >= 0 and b >= 0


def test_gated_delta_baseline_reference_is_the_delta_rule():
    """The FLA baseline's float64 reference against the rule written out for two tokens, and its
    FLOP count against dta-linear-attention-bench's (257.7 GFLOP forward+backward at 16K)."""
    torch.manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(1, 2, 16, 128, dtype=torch.float64), dim=-1) for _ in range(2))
    v = torch.randn(1, 2, 32, 128, dtype=torch.float64)
    g = -0.5 * torch.rand(1, 2, 32, dtype=torch.float64)
    beta = torch.rand(1, 2, 32, dtype=torch.float64)
    seed = torch.randn(1, 2, 32, 128, dtype=torch.float64)
    out, grad_v, grad_q = gated_delta_baseline.reference(q, k, v, g, beta, seed)
    leaf_q, leaf_v = q.clone().requires_grad_(True), v.clone().requires_grad_(True)
    qe, ke = leaf_q.repeat_interleave(2, dim=2)[0], k.repeat_interleave(2, dim=2)[0]
    rows = []
    for h in range(32):
        state = torch.outer(ke[0, h], beta[0, 0, h] * leaf_v[0, 0, h])  # from the zero state
        first = 128**-0.5 * qe[0, h] @ state
        state = g[0, 1, h].exp() * state
        state = state + torch.outer(ke[1, h], beta[0, 1, h] * (leaf_v[0, 1, h] - ke[1, h] @ state))
        rows.append(torch.stack([first, 128**-0.5 * qe[1, h] @ state]))
    expected = torch.stack(rows, dim=1)[None]
    expected_v, expected_q = torch.autograd.grad((expected * seed).sum(), [leaf_v, leaf_q])
    torch.testing.assert_close(out, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_v, expected_v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_q, expected_q, rtol=1e-12, atol=1e-12)
    assert abs(3 * gated_delta_baseline.rule_flops(16384) / 1e9 - 257.698) < 1e-3


def test_step_gaps_sees_the_executors_scopes_on_the_cpu(tmp_path):
    """bench/step_gaps.py attributes a step's GPU idle time to the executor's profiler scopes; on
    the CPU it reports the scopes themselves, which the C++ executor records (dta::prepare,
    dta::plan, one per kind of step, dta::loss_readback)."""
    batch = shared_prompt_batch(6, 24, [6 + 3 * i for i in range(4)])
    rollouts = tmp_path / "rollouts.jsonl"
    dta.write_jsonl(rollouts, batch)
    config = REPO / "examples" / "configs" / "qwen3-tiny.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "step_gaps.py"), f"--rollouts={rollouts}",
                          f"--config={config}", "--device=cpu", "--dtype=float32"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    line = next(line for line in run.stdout.splitlines() if line.startswith("the executor's scopes"))
    counts = {name: int(n) for name, n in re.findall(r"(dta::\w+) (\d+) x", line)}
    for scope in ("dta::prepare", "dta::plan", "dta::loss_readback"):
        assert counts.get(scope) == 1, (scope, line)
    # The shared prompt is forwarded, the four answers packed into one step and backpropagated.
    assert counts.get("dta::forward", 0) + counts.get("dta::packed", 0) >= 1, line
    assert counts.get("dta::backward", 0) + counts.get("dta::packed", 0) >= 1, line
    assert "no GPU operations recorded" in run.stdout

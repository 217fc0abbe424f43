"""Parity with Hugging Face transformers' Qwen3.

A tiny random Qwen3ForCausalLM is built and saved with transformers; build/bin/dta-hf-logprobs
(tests/executor/model/hf_logprobs_main.cc) loads it with LoadHfModel and computes every
rollout's per-token log-probabilities with each execution method (dense, packed, dta). They must
match transformers' own:

    logits = model(input_ids[None]).logits[0]
    logp[t] = log_softmax(logits[t - 1])[tokens[t]]  for t >= 1,  logp[0] = 0

within 1e-5 in float32 and 1e-10 in float64. The other direction too: a model saved by
SaveHfModel (fp32 single file, bf16 sharded) loads in transformers' from_pretrained with no
missing or unexpected keys and gives the same weights and logits bit for bit.

float64: transformers' Qwen3 is not a float64 implementation as shipped: Qwen3RMSNorm upcasts to
float32 (a float64 input is rounded to float32), and the rotary embedding computes inv_freq, the
angles, cos and sin in float32. For the float64 reference the test patches (only inside
`exact_float64`) Qwen3RMSNorm.forward and Qwen3RotaryEmbedding.forward to compute in the input's
dtype, with the same formulas; attention is SDPA, which computes in the input dtype. Both sides
are then float64 implementations of the same math. dta's model does the same in float64 (see
executor/model/decoder.h); in float32 both keep HF's float32 numerics unpatched.

The binary comes from the build directory $DTA_BUILD_DIR (default: <repo>/build); the tests fail
(not skip) when it is missing.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3 import modeling_qwen3

REPO = Path(__file__).resolve().parents[2]
VOCAB = 97
TOLERANCE = {"float32": 1e-5, "float64": 1e-10}
METHODS = ["dense", "packed", "dta"]


@pytest.fixture(scope="session")
def binary() -> Path:
    build = Path(os.environ.get("DTA_BUILD_DIR", REPO / "build"))
    path = build / "bin" / "dta-hf-logprobs"
    if not path.is_file():
        pytest.fail(f"{path} does not exist: build it with scripts/build.sh (or set DTA_BUILD_DIR)")
    return path


def run_binary(binary: Path, model_dir: Path, rollouts: Path, out: Path, dtype: str, method: str,
               *options: str, stdout: list[str] | None = None) -> dict[str, list[float]]:
    """The log-probabilities dta-hf-logprobs writes; its standard output appended to `stdout`."""
    result = subprocess.run([str(binary), str(model_dir), str(rollouts), str(out), dtype, method, *options],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{binary.name} failed ({result.returncode}):\n{result.stderr}"
    if stdout is not None:
        stdout.append(result.stdout)
    return json.loads(out.read_text())


# --- the model and the rollouts ---------------------------------------------------------------


def tiny_config(tied: bool) -> Qwen3Config:
    # The two variants also cover both rope thetas.
    return Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6 if tied else 10000.0},
                       max_position_embeddings=512, rms_norm_eps=1e-6)


def random_model(tied: bool) -> Qwen3ForCausalLM:
    torch.manual_seed(1234 + tied)
    model = Qwen3ForCausalLM(tiny_config(tied)).eval()
    assert model.config._attn_implementation == "sdpa"
    # Larger than transformers' init (std 0.02, norms 1) so attention and log-probabilities are
    # far from uniform and every weight matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def make_rollouts() -> list[dict]:
    """Shared prefixes, a prefix of another rollout, a duplicate, a one-token rollout, up to 100 tokens."""
    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    base = tokens(60)
    other = tokens(100)
    branch_a = base[:40] + tokens(30)
    sequences = {
        "base": base,
        "branch-a": branch_a,
        "branch-b": base[:40] + tokens(50),
        "prefix-of-base": base[:25],
        "one-token": base[:1],
        "long": other,
        "long-branch": other[:70] + tokens(20),
        "duplicate-of-branch-a": list(branch_a),
        "alone": tokens(13),
    }
    rollouts = []
    for i, (rid, toks) in enumerate(sequences.items()):
        rollouts.append({
            "id": rid,
            "group": f"g{i % 3}",
            "tokens": toks,
            "loss_mask": [0] + [1] * (len(toks) - 1),
            "logprobs": [0.0] + [-math.log(VOCAB)] * (len(toks) - 1),
            "reward": float(i % 2),
        })
    return rollouts


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory) -> tuple[list[dict], Path]:
    data = make_rollouts()
    path = tmp_path_factory.mktemp("rollouts") / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return data, path


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request, tmp_path_factory) -> tuple[Qwen3ForCausalLM, Path]:
    model = random_model(request.param)
    directory = tmp_path_factory.mktemp("hf-tied" if request.param else "hf-untied")
    model.save_pretrained(directory, safe_serialization=True)
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not request.param)
    return model, directory


# --- the reference --------------------------------------------------------------------------------


def _rms_norm_in_input_dtype(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _rotary_in_input_dtype(self, x, position_ids):
    # compute_default_rope_parameters and forward, in x's dtype instead of float32.
    base = self.config.rope_parameters["rope_theta"]
    dim = self.config.head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=x.dtype, device=x.device) / dim))
    freqs = position_ids[..., None].to(x.dtype) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


class exact_float64:
    """Within the block, transformers' Qwen3 norms and RoPE compute in the input dtype."""

    def __enter__(self):
        self._patch = pytest.MonkeyPatch()
        self._patch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", _rms_norm_in_input_dtype)
        self._patch.setattr(modeling_qwen3.Qwen3RotaryEmbedding, "forward", _rotary_in_input_dtype)
        return self

    def __exit__(self, *exc):
        self._patch.undo()


def hf_logprobs(model: Qwen3ForCausalLM, rollouts: list[dict]) -> dict[str, torch.Tensor]:
    out = {}
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor(r["tokens"], dtype=torch.long)
            logits = model(input_ids=ids[None]).logits[0]
            logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]
            out[r["id"]] = torch.cat([torch.zeros(1, dtype=logp.dtype), logp])
    return out


def bf16_rounded(model: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """A float32 copy whose parameters are rounded to bfloat16. Not model.to(bfloat16): that also
    rounds the rotary inv_freq buffer, which transformers then uses as is, changing the angles."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return rounded


def reference(model: Qwen3ForCausalLM, rollouts: list[dict], dtype: str) -> dict[str, torch.Tensor]:
    if dtype == "float32":
        return hf_logprobs(model, rollouts)
    with exact_float64():
        return hf_logprobs(copy.deepcopy(model).to(torch.float64), rollouts)


def max_difference(ours: dict[str, list[float]], theirs: dict[str, torch.Tensor]) -> float:
    assert sorted(ours) == sorted(theirs)
    worst = 0.0
    for rid, values in ours.items():
        expected = theirs[rid].to(torch.float64)
        got = torch.tensor(values, dtype=torch.float64)
        assert got.shape == expected.shape, f"rollout {rid}: {got.shape[0]} values for {expected.shape[0]} tokens"
        assert got[0].item() == 0.0, f"rollout {rid}: position 0 holds {got[0].item()}"
        assert torch.isfinite(got).all(), f"rollout {rid}: non-finite log-probabilities"
        worst = max(worst, (got - expected).abs().max().item())
    return worst


# --- dta vs transformers ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_logprobs_match_transformers(binary, checkpoint, rollouts, dtype, tmp_path):
    model, directory = checkpoint
    data, path = rollouts
    expected = reference(model, data, dtype)
    # The reference must be non-trivial: far from uniform over the vocabulary.
    spread = torch.cat([v[1:] for v in expected.values()]).to(torch.float64)
    assert (spread + math.log(VOCAB)).abs().max() > 1.0

    for method in METHODS:
        ours = run_binary(binary, directory, path, tmp_path / f"{method}.json", dtype, method)
        worst = max_difference(ours, expected)
        assert worst <= TOLERANCE[dtype], f"{method} {dtype}: max |dta - transformers| = {worst:.3g}"
    # dta with backward chunks of 7 tokens gives the same log-probabilities.
    chunked = run_binary(binary, directory, path, tmp_path / "dta-b7.json", dtype, "dta", "--block-size", "7")
    assert max_difference(chunked, expected) <= TOLERANCE[dtype]


def test_sharded_bf16_transformers_checkpoint_loads(binary, rollouts, tmp_path):
    """transformers' sharded bf16 save loads and converts to float32 exactly."""
    data, path = rollouts
    model = random_model(tied=False)
    directory = tmp_path / "hf-bf16-sharded"
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(directory, safe_serialization=True,
                                                            max_shard_size="20KB")
    assert (directory / "model.safetensors.index.json").is_file()
    assert not (directory / "model.safetensors").exists()
    # The float32 model with the bf16-rounded weights is the reference.
    expected = reference(bf16_rounded(model), data, "float32")
    ours = run_binary(binary, directory, path, tmp_path / "out.json", "float32", "packed")
    assert max_difference(ours, expected) <= TOLERANCE["float32"]


# --- transformers loads what dta saves ---------------------------------------------------------------


@pytest.mark.parametrize("export", ["float32", "bfloat16-sharded"])
def test_transformers_loads_dta_checkpoint(binary, checkpoint, rollouts, export, tmp_path):
    model, directory = checkpoint
    data, path = rollouts
    resaved = tmp_path / "resaved"
    options = ["--resave", str(resaved)]
    if export == "bfloat16-sharded":
        options += ["--resave-dtype", "bfloat16", "--resave-shard-bytes", "16384"]
    run_binary(binary, directory, path, tmp_path / "out.json", "float32", "dense", *options)

    config = json.loads((resaved / "config.json").read_text())
    assert config["torch_dtype"] == ("float32" if export == "float32" else "bfloat16")
    sharded = (resaved / "model.safetensors.index.json").is_file()
    assert sharded == (export == "bfloat16-sharded")

    loaded, info = Qwen3ForCausalLM.from_pretrained(resaved, dtype=torch.float32, output_loading_info=True)
    loaded.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert loaded.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert loaded.config.rope_parameters["rope_theta"] == model.config.rope_parameters["rope_theta"]
    if model.config.tie_word_embeddings:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()

    # The weights transformers loads are ours, bit for bit (rounded to bf16 for the export).
    want = copy.deepcopy(model) if export == "float32" else bf16_rounded(model)
    assert_same_model(loaded, want, data[0]["tokens"])


def assert_same_model(loaded, want, tokens: list[int]) -> None:
    """The same parameters bit for bit, hence the same logits (for `tokens`)."""
    want_state, got_state = want.state_dict(), loaded.state_dict()
    assert sorted(want_state) == sorted(got_state)
    for name, tensor in want_state.items():
        assert torch.equal(got_state[name], tensor), name
    ids = torch.tensor(tokens)[None]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, want(input_ids=ids).logits)

"""Parity with Hugging Face transformers' Llama, Qwen2 and Qwen3-MoE (the families beside Qwen3).

Tiny random LlamaForCausalLM, Qwen2ForCausalLM and Qwen3MoeForCausalLM models are built and saved
with transformers, covering every rope type dta supports, every kind of attention bias and the
mixture-of-experts routing options:

    llama-llama3      Llama, llama3 rope scaling (all three bands of frequencies), no biases
    llama-bias-linear Llama with attention_bias (q/k/v/o biases), linear rope scaling, tied
    llama-yarn-mscale Llama with attention_bias, yarn with mscale / mscale_all_dim, head_dim absent
    qwen2             Qwen2 (q/k/v biases, no o_proj bias), default rope, tied
    qwen2-yarn        Qwen2 with yarn rope scaling (beta_fast, beta_slow; attention factor from
                      the factor), head_dim other than hidden_size / num_attention_heads
    qwen3moe-norm     Qwen3-MoE, every layer sparse, 4 experts top-2 with norm_topk_prob, GQA
    qwen3moe-step     Qwen3-MoE, 4 layers, decoder_sparse_step 2 and mlp_only_layers [3] (layers 0,
                      2, 3 dense, 1 sparse), 5 experts top-3 without norm_topk_prob, head_dim
                      absent, tied

The MoE gradients: transformers keeps each layer's experts as gate_up_proj [E, 2I, H] and down_proj
[E, H, I]; dta stacks gate_proj and up_proj separately ([E, I, H] each, the halves of gate_up_proj)
under the names "model.layers.L.mlp.experts.{gate,up,down}_proj" (executor/model/hf_checkpoint.h).

build/bin/dta-hf-logprobs loads each with LoadHfModel and computes every rollout's per-token
log-probabilities with each method (dense, packed, dta, dta with B = 7): they must equal
transformers' within 1e-5 in float32 and 1e-10 in float64. In float64 the gradient of every
parameter (biases included) of the summed negative log-likelihood must equal transformers'
autograd to a relative error of 1e-9, for every method. And a model saved by SaveHfModel loads
in transformers' from_pretrained with no missing, unexpected or mismatched keys, the same config
(model_type, architectures, rope parameters, biases) and the same weights and logits bit for bit.

Routing replay (R3): each rollout carries routed_experts (routed_rollouts: k distinct random experts
per token and sparse layer, rows for every token or all but the last, some not recorded, shared
prefixes replaying one routing and shared tokens replaying two, as base64 rows of every decoder
layer or of the sparse ones). The reference is transformers with forced routing, each rollout
forwarded alone: the router's top-k replaced by the given ids, the weights its softmax gathered
there (renormalised with norm_topk_prob). Log-probabilities and gradients must match as above for
every method, and the router loss must count the router's own top-k, as transformers' does.

float64: as for Qwen3 (test_hf_parity.py), transformers' RMSNorm and rotary embedding compute in
float32 whatever the input; inside `exact_float64` only, LlamaRMSNorm / Qwen2RMSNorm and the
rotary embeddings compute in the input's dtype with the same formulas, and Qwen3-MoE's router takes
its softmax in the input's dtype (transformers: float32). The inverse frequencies of
each rope type are transformers' rope_init_fn expressions, here in float64 (`inv_freq`); the float32
comparison runs transformers unpatched, so it checks those expressions too.
"""

from __future__ import annotations

import base64
import copy
import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3_moe import modeling_qwen3_moe

from test_hf_parity import (METHODS, TOLERANCE, VOCAB, _rms_norm_in_input_dtype, assert_same_model,  # noqa: F401
                            binary, hf_logprobs, max_difference, rollouts, run_binary)

GRADIENT_TOLERANCE = 1e-9
# Beside METHODS' "dta" (the executor's defaults, packing on): small chunks without packing, so that
# gradients are checked against transformers both ways.
UNPACKED_SMALL_CHUNKS = ("--block-size", "3", "--pack", "false")

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

VARIANTS = {
    # original_max_position_embeddings 64, low 1, high 4: wavelengths below 16 kept, above 64
    # divided by the factor, between interpolated (head_dim 16, theta 10000: all three occur).
    "llama-llama3": lambda: LlamaForCausalLM(LlamaConfig(
        **COMMON, head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-bias-linear": lambda: LlamaForCausalLM(LlamaConfig(
        **COMMON, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0})),
    "llama-yarn-mscale": lambda: LlamaForCausalLM(LlamaConfig(
        **COMMON, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "mscale": 0.707, "mscale_all_dim": 1.3})),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(
        **COMMON, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2-yarn": lambda: Qwen2ForCausalLM(Qwen2Config(
        **COMMON, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256, "beta_fast": 8.0, "beta_slow": 0.5})),
    # transformers' experts loop ("eager"): its grouped_mm default takes no float64 on the CPU.
    "qwen3moe-norm": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **COMMON, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=12, norm_topk_prob=True, experts_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3moe-step": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 4}, rms_norm_eps=1e-6, tie_word_embeddings=True, num_experts=5,
        num_experts_per_tok=3, moe_intermediate_size=10, norm_topk_prob=False, decoder_sparse_step=2,
        mlp_only_layers=[3], experts_implementation="eager", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}

MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits",
              "intermediate_size")


def random_model(variant: str):
    torch.manual_seed(4321 + sorted(VARIANTS).index(variant))
    model = VARIANTS[variant]().eval()
    assert model.config._attn_implementation == "sdpa"
    # Larger than transformers' init so that every weight and bias matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.3)
            elif p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    return model


def expected_biases(variant: str) -> set[str]:
    if variant.startswith("qwen2"):
        return {"q_proj", "k_proj", "v_proj"}
    if "bias" in variant or "mscale" in variant:
        return {"q_proj", "k_proj", "v_proj", "o_proj"}
    return set()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    model = random_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory, safe_serialization=True)
    config = json.loads((directory / "config.json").read_text())
    if request.param == "qwen3moe-step":
        # Built without head_dim, which Qwen3MoeConfig does not write then: hidden_size / heads.
        assert "head_dim" not in config
    if request.param == "llama-yarn-mscale":
        # Llama's head_dim may be absent: hidden_size / num_attention_heads.
        assert config["head_dim"] == 8
        del config["head_dim"]
        (directory / "config.json").write_text(json.dumps(config))
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        biases = {name.split(".")[-2] for name in names if name.endswith(".bias")}
    assert biases == expected_biases(request.param)
    if request.param.startswith("qwen3moe"):
        # The Hub's layout, which transformers 5 also saves: one tensor per expert.
        assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names
        assert "model.layers.1.mlp.gate.weight" in names
        assert not any("gate_up_proj" in name for name in names)
    return request.param, model, directory


# --- the float64 reference ----------------------------------------------------------------------


def inv_freq(config, dtype: torch.dtype) -> torch.Tensor:
    """transformers' rope_init_fn of the config's rope type (modeling_rope_utils.py), in `dtype`."""
    rope = config.rope_parameters
    base = rope["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope_type = rope.get("rope_type", "default")
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=dtype) / dim))
    if rope_type == "default":
        return inv
    if rope_type == "linear":
        return inv / rope["factor"]
    if rope_type == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if rope_type == "yarn":
        factor = rope["factor"]
        old = rope["original_max_position_embeddings"]
        beta_fast = rope.get("beta_fast") or 32
        beta_slow = rope.get("beta_slow") or 1

        def correction_dim(rotations):
            return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = math.floor(correction_dim(beta_fast)), math.ceil(correction_dim(beta_slow))
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=dtype) / dim)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=dtype) - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp
        return (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    raise AssertionError(f"rope type {rope_type}")


def _rotary_in_input_dtype(self, x, position_ids):
    # The module's forward in x's dtype; attention_scaling is the module's own (transformers').
    freqs = position_ids[..., None].to(x.dtype) * inv_freq(self.config, x.dtype)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def _router_in_input_dtype(self, hidden_states):
    """Qwen3MoeTopKRouter.forward (Qwen3NextTopKRouter's is the same; Qwen3_5MoeTopKRouter's too, which
    has no norm_topk_prob and always renormalises) with the softmax in the input's dtype instead of
    float32. A router given `replay` (set_replay) routes token t < len(replay) to
    replay[t] where recorded: transformers with forced routing, the weights still its softmax
    gathered at those ids. Without it, the router's own top-k, as transformers."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=router_logits.dtype, dim=-1)
    _, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    router_indices = with_replay(router_indices, getattr(self, "replay", None))
    router_top_value = router_probs.gather(1, router_indices)
    if getattr(self, "norm_topk_prob", True):
        router_top_value = router_top_value / router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value, router_indices


def with_replay(indices: torch.Tensor, replay: torch.Tensor | None) -> torch.Tensor:
    """A router's own top-k `indices` [T, k] with each row t < len(replay) replaced by replay[t]
    unless that is all -1 (not recorded)."""
    if replay is None:
        return indices
    rows = replay.shape[0]
    return torch.cat([torch.where(replay >= 0, replay, indices[:rows]), indices[rows:]])


def dta_gradient_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused experts.gate_up_proj [E, 2I, H] as dta's experts.gate_proj and up_proj."""
    out = {}
    for name, grad in grads.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            gate, up = grad.chunk(2, dim=1)
            out[prefix + "gate_proj"], out[prefix + "up_proj"] = gate, up
        else:
            out[name] = grad
    return out


class exact_float64:
    """Within the block, transformers' Llama and Qwen2 norms and RoPE compute in the input dtype."""

    def __enter__(self):
        self._patch = pytest.MonkeyPatch()
        for module, prefix in ((modeling_llama, "Llama"), (modeling_qwen2, "Qwen2"),
                               (modeling_qwen3_moe, "Qwen3Moe")):
            self._patch.setattr(getattr(module, f"{prefix}RMSNorm"), "forward", _rms_norm_in_input_dtype)
            self._patch.setattr(getattr(module, f"{prefix}RotaryEmbedding"), "forward", _rotary_in_input_dtype)
        self._patch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", _router_in_input_dtype)
        return self

    def __exit__(self, *exc):
        self._patch.undo()


def reference(model, data: list[dict], dtype: str, exact=exact_float64) -> dict[str, torch.Tensor]:
    """transformers' log-probabilities: the model itself in float32, a float64 copy under `exact` (a
    context manager that keeps the family's internal float32 casts in float64) in float64."""
    if dtype == "float32":
        return hf_logprobs(model, data)
    with exact():
        return hf_logprobs(copy.deepcopy(model).to(torch.float64), data)


def backward_nll(model, data: list[dict]) -> None:
    """Adds d/dθ of -Σ_rollouts Σ_{t: loss_mask[t]} log p(tokens[t] | tokens[<t]) into model's .grad."""
    for r in data:
        ids = torch.tensor(r["tokens"], dtype=torch.long)
        if ids.numel() < 2:
            continue
        logits = model(input_ids=ids[None]).logits[0]
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]
        mask = torch.tensor(r["loss_mask"][1:], dtype=logp.dtype)
        (-(logp * mask).sum()).backward()


def backward_router_loss(model, data: list[dict], coef: float) -> float:
    """Adds d/dθ of coef / R Σ_r aux_r into model's .grad, aux_r transformers' router load-balancing
    loss (aux_loss with output_router_logits: load_balancing_loss_func) of rollout r forwarded alone;
    returns the mean of aux_r."""
    total = 0.0
    for r in data:
        out = model(input_ids=torch.tensor(r["tokens"], dtype=torch.long)[None], output_router_logits=True)
        (coef / len(data) * out.aux_loss).backward()
        total += out.aux_loss.item()
    return total / len(data)


def keep_float64_on_float(patch: pytest.MonkeyPatch) -> None:
    """Under `patch`, Tensor.float() leaves float64 tensors alone (transformers' explicit float32 casts)."""
    to_float = torch.Tensor.float
    patch.setattr(torch.Tensor, "float", lambda x, *a, **k: x if x.dtype == torch.float64 else to_float(x, *a, **k))


class _Float64Zeros:
    """The torch module as one modeling file sees it, with torch.zeros(..., dtype=float32) in float64."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, dtype=None, **kwargs):
        return torch.zeros(*args, dtype=torch.float64 if dtype == torch.float32 else dtype, **kwargs)


class float64_router_loss:
    """Within the block, transformers' load_balancing_loss_func (Qwen3-MoE's, Qwen3-Next's and
    Qwen3.5-MoE's) computes in float64: its float32 accumulators (torch.zeros(..., dtype=float32),
    which round the expert fractions count / rows) are float64, and Tensor.float() leaves float64
    tensors alone."""

    def __enter__(self):
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
        from transformers.models.qwen3_next import modeling_qwen3_next
        self._patch = pytest.MonkeyPatch()
        for module in (modeling_qwen3_moe, modeling_qwen3_next, modeling_qwen3_5_moe):
            self._patch.setattr(module, "torch", _Float64Zeros())
        keep_float64_on_float(self._patch)
        return self

    def __exit__(self, *exc):
        self._patch.undo()


def reference_gradients_with_router_loss(model, data: list[dict], coef: float,
                                         exact=exact_float64) -> tuple[dict[str, torch.Tensor], float]:
    """reference_gradients plus backward_router_loss's, in float64; and the mean aux_r."""
    model64 = copy.deepcopy(model).to(torch.float64)
    model64.zero_grad()
    with exact():
        backward_nll(model64, data)
    with exact(), float64_router_loss():
        aux = backward_router_loss(model64, data, coef)
    return gradients(model64), aux


def assert_router_loss_matches(binary, variant, directory, path, model, data, runs, tmp_path,
                               exact=exact_float64, coef: float = 1.0):
    """With --router-aux-loss-coef, every run's gradients equal transformers' NLL plus coef / R Σ_r
    aux_r (GRADIENT_TOLERANCE) and the mean aux_r it prints equals transformers' (1e-10). The
    loss must move every router's gradient by more than 1e-4 of its norm (10^5 times the tolerance)
    for the comparison to mean anything."""
    expected, aux = reference_gradients_with_router_loss(model, data, coef, exact)
    assert_router_loss_runs_match(binary, variant, directory, path, expected, reference_gradients(model, data, exact),
                                  aux, runs, tmp_path, coef)


def assert_router_loss_runs_match(binary, variant, directory, path, expected, plain, aux, runs, tmp_path, coef):
    """assert_router_loss_matches given transformers' gradients with the loss (`expected`) and
    without it (`plain`), and the mean aux_r."""
    routers = [n for n in expected if n.endswith("mlp.gate.weight")]
    assert routers and all((expected[n] - plain[n]).norm() > 1e-4 * plain[n].norm() for n in routers), variant
    option = ("--router-aux-loss-coef", repr(coef))
    printed: list[str] = []
    assert_gradients_match(binary, variant, directory, path, expected,
                           [(method, options + option) for method, options in runs], tmp_path, stdout=printed)
    for (method, options), output in zip(runs, printed, strict=True):
        values = [float(line.split()[1]) for line in output.splitlines() if line.startswith("router_aux_loss ")]
        assert len(values) == 1 and abs(values[0] - aux) <= 1e-10 * aux, f"{variant} {method} {options}: {values} vs {aux}"


def reference_gradients(model, data: list[dict], exact=exact_float64) -> dict[str, torch.Tensor]:
    """backward_nll's gradients in float64 (under `exact`, as `reference`), under dta's names."""
    model64 = copy.deepcopy(model).to(torch.float64)
    model64.zero_grad()
    with exact():
        backward_nll(model64, data)
    return gradients(model64)


def gradients(model) -> dict[str, torch.Tensor]:
    """model's .grad under dta's names; zeros where none flowed (an expert no token of one rollout
    reached)."""
    return dta_gradient_names({name: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                               for name, p in model.named_parameters()})


# --- routing replay -----------------------------------------------------------------------------


def sparse_layers(model) -> list[int]:
    """The decoder layers whose MLP is a sparse MoE block (routed experts)."""
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def routed_rollouts(model, data: list[dict], every_layer: bool) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """make_rollouts' `data` with routed_experts, and each rollout's routing at the sparse layers
    ([rows, sparse layers, top_k], -1 where not recorded). Each token's ids at each sparse layer are
    k distinct experts drawn at random; rows = tokens or tokens - 1 (either occurs); a few (row,
    layer) are not recorded, one row at no layer. base, branch-a, branch-b and prefix-of-base replay
    one routing of the prefix they share; long-branch (70 tokens of long) and duplicate-of-branch-a
    (branch-a's tokens) share tokens but not routing (from rows 30 and 55). The JSON Lines payload is
    base64, of rows of every decoder layer (dense layers' entries random and unused) when
    every_layer, of the sparse layers only otherwise."""
    sparse = sparse_layers(model)
    experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    generator = torch.Generator().manual_seed(2718)

    def fresh(rows: int) -> torch.Tensor:
        return torch.rand(rows, len(sparse), experts, generator=generator).argsort(-1)[..., :top_k].to(torch.int32)

    base, long = fresh(60), fresh(99)
    base[5, 0] = base[33, -1] = long[50, -1] = -1
    branch_a = torch.cat([base[:40], fresh(29)])
    routing = {
        "base": base,
        "branch-a": branch_a,
        "branch-b": torch.cat([base[:40], fresh(50)]),
        "prefix-of-base": base[:24],
        "one-token": fresh(1),
        "long": long,
        "long-branch": torch.cat([long[:30], fresh(60)]),
        "duplicate-of-branch-a": torch.cat([branch_a[:55], fresh(15)]),
        "alone": fresh(12),
    }
    routing["alone"][3] = -1
    routed = []
    for r in data:
        ids = routing[r["id"]]
        assert len(r["tokens"]) - ids.shape[0] in (0, 1), r["id"]
        if every_layer:
            rows = torch.randint(experts, (ids.shape[0], model.config.num_hidden_layers, top_k), generator=generator,
                                 dtype=torch.int32)
            rows[:, sparse] = ids
        else:
            rows = ids
        payload = base64.b64encode(rows.numpy().astype("<i4").tobytes()).decode()
        routed.append({**r, "routed_experts": {"layers": rows.shape[1], "top_k": top_k, "dtype": "int32",
                                               "base64": payload}})
    assert sorted(routing) == sorted(r["id"] for r in data)
    return routed, routing


def set_replay(model, routing: torch.Tensor) -> None:
    """Every sparse layer's router replays its column of `routing` (_router_in_input_dtype)."""
    for column, layer in enumerate(sparse_layers(model)):
        model.model.layers[layer].mlp.gate.replay = routing[:, column].long()


class replaying_routers:
    """Within the block, Qwen3-MoE's, Qwen3-Next's and Qwen3.5-MoE's routers are
    _router_in_input_dtype: a float32 model's is transformers' own math, with replay."""

    def __enter__(self):
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
        from transformers.models.qwen3_next import modeling_qwen3_next
        self._patch = pytest.MonkeyPatch()
        for router in (modeling_qwen3_moe.Qwen3MoeTopKRouter, modeling_qwen3_next.Qwen3NextTopKRouter,
                       modeling_qwen3_5_moe.Qwen3_5MoeTopKRouter):
            self._patch.setattr(router, "forward", _router_in_input_dtype)
        return self

    def __exit__(self, *exc):
        self._patch.undo()


def per_rollout(model, data: list[dict], routing: dict[str, torch.Tensor], compute) -> list:
    """compute(copy of model, [r]) for each rollout r alone, the copy's routers replaying r's routing."""
    model = copy.deepcopy(model)
    results = []
    with replaying_routers():
        for r in data:
            set_replay(model, routing[r["id"]])
            results.append(compute(model, [r]))
    return results


def summed(gradients: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: sum(g[name] for g in gradients) for name in gradients[0]}


def load_balancing_loss(router_logits, replays, top_k: int) -> float:
    """transformers' load_balancing_loss_func of one rollout's router logits (one [T, E] per sparse
    layer), counting each layer's `replays` ids where recorded instead of the router's own top-k."""
    experts = router_logits[0].shape[-1]
    counts, probs, rows = 0, 0, 0
    for logits, replay in zip(router_logits, replays, strict=True):
        p = torch.softmax(logits, dim=-1)
        ids = with_replay(torch.topk(p, top_k, dim=-1).indices, replay)
        counts = counts + torch.nn.functional.one_hot(ids, experts).sum((0, 1)).to(p.dtype)
        probs, rows = probs + p.sum(0), rows + p.shape[0]
    return (experts * (counts / rows * probs / rows).sum()).item()


def aux_losses(model, data: list[dict], exact) -> tuple[float, float]:
    """The router loss of data's one rollout, in float64 with the routers replaying: transformers'
    (the routers' own top-k), and the same counting the replayed ids, which dta must not compute."""
    (r,) = data
    model64 = copy.deepcopy(model).to(torch.float64)
    with torch.no_grad(), exact(), float64_router_loss():
        out = model64(input_ids=torch.tensor(r["tokens"], dtype=torch.long)[None], output_router_logits=True)
    gates = [model64.model.layers[i].mlp.gate for i in sparse_layers(model64)]
    top_k = model64.config.num_experts_per_tok
    own = load_balancing_loss(out.router_logits, [None] * len(gates), top_k)
    assert abs(own - out.aux_loss.item()) <= 1e-12 * own, (own, out.aux_loss.item())
    return own, load_balancing_loss(out.router_logits, [g.replay for g in gates], top_k)


def assert_routing_replay_matches(binary, variant, directory, model, rollouts, check: str, every_layer: bool,
                                  runs, tmp_path, exact=exact_float64):
    """Every run over routed_rollouts equals transformers with forced routing, each rollout forwarded
    alone (per_rollout). check: "float32" or "float64" (log-probabilities; replay must move them by
    more than 1e-3 for the comparison to mean anything), "gradients" (float64, the summed NLL), or
    "router-aux-loss" (assert_router_loss_runs_match; the loss must count the routers' own top-k, which
    differs from counting the replayed ids by more than 1e-3 of it)."""
    plain_data, plain_path = rollouts
    data, routing = routed_rollouts(model, plain_data, every_layer)
    path = tmp_path / "routed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    if check in TOLERANCE:
        parts = per_rollout(model, data, routing, lambda m, d: reference(m, d, check, exact))
        expected = {rid: logprobs for part in parts for rid, logprobs in part.items()}
        assert_logprobs_match(binary, variant, directory, path, expected, check, runs, tmp_path)
        unreplayed = run_binary(binary, directory, plain_path, tmp_path / "unreplayed.json", check, "dense")
        assert max_difference(unreplayed, expected) > 1e-3, variant
        return
    replayed_nll = summed(per_rollout(model, data, routing, lambda m, d: reference_gradients(m, d, exact)))
    if check == "gradients":
        unreplayed = reference_gradients(model, plain_data, exact)
        assert max(((replayed_nll[n] - g).norm() / g.norm()).item() for n, g in unreplayed.items()) > 1e-3, variant
        assert_gradients_match(binary, variant, directory, path, replayed_nll, runs, tmp_path)
        return
    assert check == "router-aux-loss", check
    coef = 1.0
    parts = per_rollout(model, data, routing,
                        lambda m, d: reference_gradients_with_router_loss(m, d, coef / len(data), exact))
    aux = sum(a for _, a in parts) / len(data)
    own, counting_replayed = (sum(values) / len(data) for values in
                              zip(*per_rollout(model, data, routing, lambda m, d: aux_losses(m, d, exact))))
    assert abs(own - aux) <= 1e-12 * aux and abs(counting_replayed - aux) > 1e-3 * aux, (own, counting_replayed, aux)
    assert_router_loss_runs_match(binary, variant, directory, path, summed([g for g, _ in parts]), replayed_nll, aux,
                                  runs, tmp_path, coef)


# --- dta vs transformers ------------------------------------------------------------------------


def assert_logprobs_match(binary, variant, directory, path, expected, dtype, runs, tmp_path):
    """Every (method, options) run of dta-hf-logprobs gives transformers' log-probabilities."""
    spread = torch.cat([v[1:] for v in expected.values()]).to(torch.float64)
    assert (spread + math.log(VOCAB)).abs().max() > 1.0, "the reference is too close to uniform"
    for method, options in runs:
        ours = run_binary(binary, directory, path, tmp_path / f"{method}.json", dtype, method, *options)
        worst = max_difference(ours, expected)
        assert worst <= TOLERANCE[dtype], f"{variant} {method} {options} {dtype}: max |dta - transformers| = {worst:.3g}"


def assert_gradients_match(binary, variant, directory, path, expected, runs, tmp_path, stdout=None):
    """Every run's float64 gradients (under dta's names) equal `expected` to GRADIENT_TOLERANCE; each
    run's standard output is appended to `stdout` when given."""
    for method, options in runs:
        grads = tmp_path / f"{method}-grads.safetensors"
        run_binary(binary, directory, path, tmp_path / "out.json", "float64", method, "--gradients", str(grads),
                   *options, stdout=stdout)
        with safe_open(str(grads), "pt") as f:
            ours = {name: f.get_tensor(name) for name in f.keys()}
        # Tied: transformers' lm_head.weight is the embedding (one gradient, both uses).
        theirs = {n: g for n, g in expected.items() if not (n == "lm_head.weight" and "lm_head.weight" not in ours)}
        assert sorted(ours) == sorted(theirs), f"{variant} {method}"
        for name, grad in theirs.items():
            assert grad.norm() > 0, f"{variant}: {name} has no gradient in transformers"
            error = ((ours[name] - grad).norm() / grad.norm()).item()
            assert error <= GRADIENT_TOLERANCE, f"{variant} {method} {options}: {name} relative error {error:.3g}"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_logprobs_match_transformers(binary, checkpoint, rollouts, dtype, tmp_path):
    variant, model, directory = checkpoint
    data, path = rollouts
    runs = [(method, ()) for method in METHODS] + [("dta", ("--block-size", "7"))]
    assert_logprobs_match(binary, variant, directory, path, reference(model, data, dtype), dtype, runs, tmp_path)


def test_gradients_match_transformers(binary, checkpoint, rollouts, tmp_path):
    variant, model, directory = checkpoint
    data, path = rollouts
    runs = [(m, ()) for m in METHODS] + [("dta", UNPACKED_SMALL_CHUNKS)]
    assert_gradients_match(binary, variant, directory, path, reference_gradients(model, data), runs, tmp_path)


@pytest.mark.parametrize("checkpoint", ["qwen3moe-norm", "qwen3moe-step"], indirect=True)
def test_router_aux_loss_matches_transformers(binary, checkpoint, rollouts, tmp_path):
    variant, model, directory = checkpoint
    data, path = rollouts
    runs = [(m, ()) for m in METHODS] + [("dta", UNPACKED_SMALL_CHUNKS)]
    assert_router_loss_matches(binary, variant, directory, path, model, data, runs, tmp_path)


# The methods of the parity tests above: dta also packed with B = 7 and unpacked with B = 3.
REPLAY_RUNS = [(m, ()) for m in METHODS] + [("dta", ("--block-size", "7")), ("dta", UNPACKED_SMALL_CHUNKS)]


@pytest.mark.parametrize("check", ["float32", "float64", "gradients", "router-aux-loss"])
@pytest.mark.parametrize("checkpoint, every_layer", [("qwen3moe-norm", True), ("qwen3moe-step", True),
                                                     ("qwen3moe-step", False)],
                         indirect=["checkpoint"], ids=["norm", "step-every-layer", "step-sparse-layers"])
def test_routing_replay_matches_transformers(binary, checkpoint, rollouts, check, every_layer, tmp_path):
    variant, model, directory = checkpoint
    assert_routing_replay_matches(binary, variant, directory, model, rollouts, check, every_layer, REPLAY_RUNS,
                                  tmp_path)


# --- transformers loads what dta saves ----------------------------------------------------------


def test_transformers_loads_dta_checkpoint(binary, checkpoint, rollouts, tmp_path):
    variant, model, directory = checkpoint
    data, path = rollouts
    resaved = tmp_path / "resaved"
    run_binary(binary, directory, path, tmp_path / "out.json", "float32", "dense", "--resave", str(resaved))

    config = json.loads((resaved / "config.json").read_text())
    family = type(model)
    assert config["model_type"] == model.config.model_type
    assert config["architectures"] == [family.__name__]
    assert config["torch_dtype"] == "float32"

    # transformers' default grouped_mm experts need 16-byte aligned strides; the loop is the reference.
    extra = {"experts_implementation": "eager"} if variant.startswith("qwen3moe") else {}
    loaded, info = family.from_pretrained(resaved, dtype=torch.float32, output_loading_info=True, **extra)
    loaded.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(loaded.config) is type(model.config)
    assert loaded.config.rope_parameters == model.config.rope_parameters
    for field in ("tie_word_embeddings", "rms_norm_eps", "num_key_value_heads", "attention_bias"):
        assert getattr(loaded.config, field, None) == getattr(model.config, field, None), field

    def head_dim(config):  # dta always writes it; an absent one is hidden_size / heads
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    assert head_dim(loaded.config) == head_dim(model.config)
    if variant.startswith("qwen3moe"):
        for field in MOE_FIELDS:
            assert getattr(loaded.config, field) == getattr(model.config, field), field
        with safe_open(str(resaved / "model.safetensors"), "pt") as f:
            assert "model.layers.1.mlp.experts.0.up_proj.weight" in set(f.keys())

    assert_same_model(loaded, model, data[0]["tokens"])

"""Parity with Hugging Face transformers' Qwen3-Next (hybrid linear attention), issue 18's third
family.

Tiny random Qwen3NextForCausalLM models are built and saved with transformers: Gated DeltaNet
(linear-attention) layers interleaved with gated full attention, zero-centred RMSNorms, partial
RoPE, and sparse MoE blocks with a shared expert (and dense MLP layers where mlp_only_layers says):

    next-moe     layers linear, full, linear, full; MoE (norm_topk_prob) with a shared expert on
                 layers 0, 1, 3 and a dense MLP on layer 2; 2 key heads serving 4 value heads
    next-dense   no experts (every MLP dense); linear, linear, full; as many value as key heads;
                 a two-tap convolution

build/bin/dta-hf-logprobs loads each with LoadHfModel and computes every rollout's per-token
log-probabilities with each method (dense, packed, dta, dta with B = 7 and B = 3, whose chunks
start inside rollouts, so the recurrent states and convolution inputs travel through the stack):
they must equal transformers' within 1e-5 in float32 and 1e-10 in float64. In float64 every
parameter's gradient of the summed negative log-likelihood must equal transformers' autograd to a
relative error of 1e-9. With routed experts (routing replay, next-moe) both must equal
transformers' with forced routing (test_hf_parity_families.py's assert_routing_replay_matches). A
model saved by dta loads in transformers with no missing or unexpected keys and the same logits.

float64: transformers computes the norms, the rotary tables, the router's softmax, the decays and
the delta rule in float32 whatever the input. Inside `exact_float64` only, those compute in the
input's dtype with the same formulas (the delta rule token by token, as
torch_recurrent_gated_delta_rule), and Tensor.float() leaves float64 tensors alone. The first two
tests hold the reference itself to transformers' own float32 computation.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next import modeling_qwen3_next as modeling

from test_hf_parity import METHODS, VOCAB, binary, rollouts, run_binary  # noqa: F401
import test_hf_parity_families as families
from test_hf_parity_families import assert_gradients_match, assert_logprobs_match, backward_nll, dta_gradient_names

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_key_head_dim=8, linear_value_head_dim=6, rms_norm_eps=1e-6,
              max_position_embeddings=512, experts_implementation="eager",
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})

VARIANTS = {
    "next-moe": lambda: Qwen3NextForCausalLM(Qwen3NextConfig(
        **COMMON, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20, decoder_sparse_step=1,
        mlp_only_layers=[2], norm_topk_prob=True, tie_word_embeddings=False)),
    "next-dense": lambda: Qwen3NextForCausalLM(Qwen3NextConfig(
        **COMMON, num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_conv_kernel_dim=2, num_experts=0,
        tie_word_embeddings=True)),
}


def random_model(variant: str) -> Qwen3NextForCausalLM:
    torch.manual_seed(987 + sorted(VARIANTS).index(variant))
    model = VARIANTS[variant]().eval()
    # Larger than transformers' init so that every weight matters; zero-centred norms near 0.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("dt_bias", "A_log")):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    model = random_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory, safe_serialization=True)
    return request.param, model, directory


# --- the float64 reference ----------------------------------------------------------------------


def _rms_norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _gated_rms_norm(self, x, gate):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x * torch.nn.functional.silu(gate)


def _rotary(self, x, position_ids):
    rope = self.config.rope_parameters
    dim = int(self.config.head_dim * rope.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=x.dtype) / dim))
    freqs = position_ids[..., None].to(x.dtype) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def _delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
    """torch_recurrent_gated_delta_rule in the inputs' dtype."""
    if use_qk_l2norm_in_kernel:
        query, key = modeling.l2norm(query), modeling.l2norm(key)
    batch, length, key_heads, key_dim = key.shape
    value_heads, value_dim = value.shape[-2:]
    query = query.repeat_interleave(value_heads // key_heads, dim=2) * key_dim**-0.5
    key = key.repeat_interleave(value_heads // key_heads, dim=2)
    state = (torch.zeros(batch, value_heads, key_dim, value_dim, dtype=value.dtype)
             if initial_state is None else initial_state)
    outs = []
    for t in range(length):
        state = state * g[:, t].exp()[..., None, None]
        delta = (value[:, t] - (state * key[:, t, :, :, None]).sum(-2)) * beta[:, t, :, None]
        state = state + key[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((state * query[:, t, :, :, None]).sum(-2))
    return torch.stack(outs, 1), (state if output_final_state else None)


class exact_float64:
    """Within the block, transformers' Qwen3-Next computes float64 inputs in float64 throughout."""

    def __enter__(self):
        self._patch = pytest.MonkeyPatch()
        self._patch.setattr(modeling.Qwen3NextRMSNorm, "forward", _rms_norm)
        self._patch.setattr(modeling.Qwen3NextRMSNormGated, "forward", _gated_rms_norm)
        self._patch.setattr(modeling.Qwen3NextRotaryEmbedding, "forward", _rotary)
        # Qwen3-MoE's router patch: the same router, with routing replay.
        self._patch.setattr(modeling.Qwen3NextTopKRouter, "forward", families._router_in_input_dtype)
        self._patch.setattr(modeling, "torch_chunk_gated_delta_rule", _delta_rule)
        self._patch.setattr(modeling, "torch_recurrent_gated_delta_rule", _delta_rule)
        families.keep_float64_on_float(self._patch)
        return self

    def __exit__(self, *exc):
        self._patch.undo()


def reference(model, data: list[dict], dtype: str) -> dict[str, torch.Tensor]:
    return families.reference(model, data, dtype, exact=exact_float64)


def reference_gradients(model, data: list[dict]) -> dict[str, torch.Tensor]:
    """d/dθ of -Σ_rollouts Σ_{t: loss_mask[t]} log p(tokens[t] | tokens[<t]), float64, under dta's names."""
    return families.reference_gradients(model, data, exact=exact_float64)


def test_reference_patches_keep_the_math(checkpoint, rollouts):
    """The float64 patches change only the precision: float32 and float64 agree to float32's."""
    variant, model, _ = checkpoint
    data, _ = rollouts
    float32, float64 = reference(model, data, "float32"), reference(model, data, "float64")
    worst = max((float32[k].to(torch.float64) - float64[k]).abs().max().item() for k in float32)
    assert worst < 1e-4, f"{variant}: {worst}"


def test_reference_gradients_keep_the_math(checkpoint, rollouts):
    """Backward too: the float64 reference's gradients equal transformers' own float32 autograd to
    float32's precision, under dta's names (stacked experts)."""
    variant, model, _ = checkpoint
    data, _ = rollouts
    expected = reference_gradients(model, data)
    model32 = copy.deepcopy(model)
    model32.zero_grad()
    backward_nll(model32, data)
    ours = dta_gradient_names({name: p.grad.detach().to(torch.float64) for name, p in model32.named_parameters()})
    assert sorted(ours) == sorted(expected)
    for name, grad in expected.items():
        assert ((ours[name] - grad).norm() / grad.norm()).item() < 1e-3, f"{variant}: {name}"


# --- dta vs transformers ------------------------------------------------------------------------

# "dta" and B = 7 pack (the executor's default), B = 3 does not: gradients are checked both ways.
RUNS = [(method, ()) for method in METHODS] + [("dta", ("--block-size", "7")),
                                               ("dta", ("--block-size", "3", "--pack", "false"))]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_logprobs_match_transformers(binary, checkpoint, rollouts, dtype, tmp_path):
    variant, model, directory = checkpoint
    data, path = rollouts
    assert_logprobs_match(binary, variant, directory, path, reference(model, data, dtype), dtype, RUNS, tmp_path)


def test_gradients_match_transformers(binary, checkpoint, rollouts, tmp_path):
    variant, model, directory = checkpoint
    data, path = rollouts
    assert_gradients_match(binary, variant, directory, path, reference_gradients(model, data), RUNS, tmp_path)


@pytest.mark.parametrize("checkpoint", ["next-moe"], indirect=True)
def test_router_aux_loss_matches_transformers(binary, checkpoint, rollouts, tmp_path):
    variant, model, directory = checkpoint
    data, path = rollouts
    families.assert_router_loss_matches(binary, variant, directory, path, model, data, RUNS, tmp_path,
                                        exact=exact_float64)


@pytest.mark.parametrize("check", ["float32", "float64", "gradients", "router-aux-loss"])
@pytest.mark.parametrize("checkpoint, every_layer", [("next-moe", True), ("next-moe", False)], indirect=["checkpoint"],
                         ids=["every-layer", "sparse-layers"])
def test_routing_replay_matches_transformers(binary, checkpoint, rollouts, check, every_layer, tmp_path):
    variant, model, directory = checkpoint
    families.assert_routing_replay_matches(binary, variant, directory, model, rollouts, check, every_layer, RUNS,
                                           tmp_path, exact=exact_float64)


def test_transformers_loads_dta_checkpoint(binary, checkpoint, rollouts, tmp_path):
    variant, model, directory = checkpoint
    data, path = rollouts
    resaved = tmp_path / "resaved"
    run_binary(binary, directory, path, tmp_path / "out.json", "float32", "dense", "--resave", str(resaved))
    config = json.loads((resaved / "config.json").read_text())
    assert config["model_type"] == "qwen3_next" and config["architectures"] == ["Qwen3NextForCausalLM"]
    loaded, info = Qwen3NextForCausalLM.from_pretrained(resaved, dtype=torch.float32, output_loading_info=True,
                                                        experts_implementation="eager")
    loaded.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert loaded.config.layer_types == model.config.layer_types
    ids = torch.tensor([data[0]["tokens"]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)

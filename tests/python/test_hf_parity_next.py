"""Parity with Hugging Face transformers' hybrid linear-attention families: Qwen3-Next (issue 18's
third family) and Qwen3.5's language models (issue 45).

Tiny random models are built and saved with transformers: Gated DeltaNet (linear-attention) layers
interleaved with gated full attention, zero-centred RMSNorms, partial RoPE, and sparse MoE blocks
with a shared expert (and dense MLP layers where mlp_only_layers says):

    next-moe     Qwen3NextForCausalLM: layers linear, full, linear, full; MoE (norm_topk_prob) with
                 a shared expert on layers 0, 1, 3 and a dense MLP on layer 2; 2 key heads serving
                 4 value heads
    next-dense   Qwen3NextForCausalLM without experts (every MLP dense); linear, linear, full; as
                 many value as key heads; a two-tap convolution

Qwen3.5's decoder is Qwen3-Next's with the Gated DeltaNet's input projections separate (in_proj_qkv
as [q | k | v], in_proj_z, in_proj_b, in_proj_a instead of in_proj_qkvz and in_proj_ba grouped per
key head), dense MLPs or a sparse block with a shared expert in every layer, and a multimodal RoPE
(mRoPE: each rotary frequency reads one of three position components, as rope_parameters'
mrope_section picks them, interleaved). For text all three components are the token's position,
so mRoPE is the plain partial RoPE dta computes: the reference runs transformers' own
recomposition (Qwen3_5TextRotaryEmbedding.recomposition_frequencies) with a section that sends
frequencies to each component, so the comparison fails if the reduction does not hold.

    q35-dense    Qwen3_5ForCausalLM: layers linear, full, linear, full; 2 key heads serving 4 value
                 heads, a four-tap convolution; q/k/v/o biases; half of each head rotated
    q35-moe      Qwen3_5MoeForCausalLM: layers linear, linear, full, each a sparse block of 4
                 experts (top 2, always renormalised) and a shared expert; as many value as key
                 heads; a three-tap convolution; tied embeddings
    q35-vl       Qwen3_5ForConditionalGeneration, a vision tower beside q35-dense's language model
                 (tied): the Hub's layout, config.json "qwen3_5" with the decoder in text_config and
                 its tensors under model.language_model.; dta reads the language model and skips
                 model.visual.*, and the reference is the vision-language model itself on text

build/bin/dta-hf-logprobs loads each with LoadHfModel and computes every rollout's per-token
log-probabilities with each method (dense, packed, dta, dta with B = 7 and B = 3, whose chunks
start inside rollouts, so the recurrent states and convolution inputs travel through the stack):
they must equal transformers' within 1e-5 in float32 and 1e-10 in float64. In float64 every
parameter's gradient of the summed negative log-likelihood must equal transformers' autograd to a
relative error of 1e-9. With routed experts (routing replay, next-moe and q35-moe) both must equal
transformers' with forced routing (test_hf_parity_families.py's assert_routing_replay_matches). A
model saved by dta (the decoder alone, also from q35-vl) loads in transformers' causal LM class
with no missing or unexpected keys and the same logits.

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
from safetensors import safe_open
from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM,
                          Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM)
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.qwen3_next import modeling_qwen3_next as modeling

from test_hf_parity import METHODS, VOCAB, binary, rollouts, run_binary  # noqa: F401
import test_hf_parity_families as families
from test_hf_parity_families import assert_gradients_match, assert_logprobs_match, backward_nll

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

# Qwen3.5: half of each head rotated, 4 frequencies, which mrope_section [2, 1, 1] sends to the
# temporal, height and width components (interleaved: 0 and 3 temporal, 1 height, 2 width).
Q35 = {key: value for key, value in COMMON.items() if key not in ("intermediate_size", "experts_implementation")}
Q35["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                          "mrope_section": [2, 1, 1], "mrope_interleaved": True}
Q35_DENSE = dict(**Q35, intermediate_size=40, num_hidden_layers=4,
                 layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4, attention_bias=True)
VARIANTS |= {
    "q35-dense": lambda: Qwen3_5ForCausalLM(Qwen3_5TextConfig(**Q35_DENSE, tie_word_embeddings=False)),
    "q35-moe": lambda: Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
        **Q35, num_hidden_layers=3,
        layer_types=["linear_attention", "linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=2, linear_conv_kernel_dim=3, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=12, shared_expert_intermediate_size=20, tie_word_embeddings=True,
        experts_implementation="eager")),
    "q35-vl": lambda: Qwen3_5ForConditionalGeneration(Qwen3_5Config(
        text_config={**Q35_DENSE, "tie_word_embeddings": True}, tie_word_embeddings=True,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                           patch_size=4, num_position_embeddings=16))),
}
# The causal LM class transformers loads each model's decoder with, and its model_type.
CAUSAL_LM = {"next": (Qwen3NextForCausalLM, "qwen3_next"), "q35-moe": (Qwen3_5MoeForCausalLM, "qwen3_5_moe_text"),
             "q35": (Qwen3_5ForCausalLM, "qwen3_5_text")}


def causal_lm(variant: str):
    return CAUSAL_LM.get(variant) or CAUSAL_LM[variant.split("-")[0]]


def random_model(variant: str):
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
    if request.param.startswith("q35"):
        # Qwen3.5's own projections, under the names dta must read.
        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        vl = request.param == "q35-vl"
        layer = "model.language_model.layers.0" if vl else "model.layers.0"
        assert {f"{layer}.linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")} <= names
        assert any(name.startswith("model.visual.") for name in names) == vl
        config = json.loads((directory / "config.json").read_text())
        assert config["model_type"] == ("qwen3_5" if vl else causal_lm(request.param)[1])
    return request.param, model, directory


# --- the float64 reference ----------------------------------------------------------------------


def _rms_norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _gated_rms_norm(self, x, gate):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x * torch.nn.functional.silu(gate)


def _angles(self, x, position_ids):
    rope = self.config.rope_parameters
    dim = int(self.config.head_dim * rope.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=x.dtype) / dim))
    return position_ids[..., None].to(x.dtype) * inv_freq


def _rotary(self, x, position_ids):
    emb = torch.cat((_angles(self, x, position_ids),) * 2, dim=-1)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def _mrope(self, x, position_ids):
    """Qwen3_5TextRotaryEmbedding.forward in x's dtype: the three components' angles, recomposed by
    the module's own mrope_section."""
    freqs = _angles(self, x, position_ids.expand(3, -1, -1))
    return (self.recomposition_frequencies(freqs.cos() * self.attention_scaling),
            self.recomposition_frequencies(freqs.sin() * self.attention_scaling))


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
    """Within the block, transformers' Qwen3-Next and Qwen3.5 compute float64 inputs in float64
    throughout."""

    def __enter__(self):
        self._patch = pytest.MonkeyPatch()
        for module, prefix, rotary in ((modeling, "Qwen3Next", _rotary), (modeling_qwen3_5, "Qwen3_5", _mrope),
                                       (modeling_qwen3_5_moe, "Qwen3_5Moe", _mrope)):
            self._patch.setattr(getattr(module, f"{prefix}RMSNorm"), "forward", _rms_norm)
            self._patch.setattr(getattr(module, f"{prefix}RMSNormGated"), "forward", _gated_rms_norm)
            rotary_class = "Qwen3NextRotaryEmbedding" if module is modeling else f"{prefix}TextRotaryEmbedding"
            self._patch.setattr(getattr(module, rotary_class), "forward", rotary)
            self._patch.setattr(module, "torch_chunk_gated_delta_rule", _delta_rule)
            self._patch.setattr(module, "torch_recurrent_gated_delta_rule", _delta_rule)
        # Qwen3-MoE's router patch: the same router, with routing replay.
        self._patch.setattr(modeling.Qwen3NextTopKRouter, "forward", families._router_in_input_dtype)
        self._patch.setattr(modeling_qwen3_5_moe.Qwen3_5MoeTopKRouter, "forward", families._router_in_input_dtype)
        families.keep_float64_on_float(self._patch)
        return self

    def __exit__(self, *exc):
        self._patch.undo()


def reference(model, data: list[dict], dtype: str) -> dict[str, torch.Tensor]:
    return families.reference(model, data, dtype, exact=exact_float64)


def dta_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gradients under dta's names (test_hf_parity_families.py's dta_gradient_names); a
    vision-language model's language model's as the decoder's, its vision tower's dropped."""
    prefix = "model.language_model."
    return {("model." + name[len(prefix):] if name.startswith(prefix) else name): grad
            for name, grad in families.dta_gradient_names(grads).items() if not name.startswith("model.visual.")}


def reference_gradients(model, data: list[dict]) -> dict[str, torch.Tensor]:
    """d/dθ of -Σ_rollouts Σ_{t: loss_mask[t]} log p(tokens[t] | tokens[<t]), float64, under dta's names."""
    return dta_names(families.reference_gradients(model, data, exact=exact_float64))


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
    ours = dta_names({name: p.grad.detach().to(torch.float64) for name, p in model32.named_parameters()
                      if not name.startswith("model.visual.")})
    assert sorted(ours) == sorted(expected)
    for name, grad in expected.items():
        assert ((ours[name] - grad).norm() / grad.norm()).item() < 1e-3, f"{variant}: {name}"


@pytest.mark.parametrize("checkpoint", ["q35-dense", "q35-moe", "q35-vl"], indirect=True)
def test_mrope_is_the_plain_partial_rope_on_text(checkpoint):
    """Qwen3.5: the reduction dta relies on, directly: for text positions (three equal components)
    the recomposed tables are those of one component, the plain partial RoPE; with different
    components they are not (the check can fail)."""
    _, model, _ = checkpoint
    decoder = getattr(model.model, "language_model", model.model)
    x = torch.zeros(1, dtype=torch.float64)
    positions = torch.arange(40)[None].expand(3, 1, -1)
    with exact_float64():
        cos, sin = decoder.rotary_emb(x, positions)
        plain_cos, plain_sin = _rotary(decoder.rotary_emb, x, positions[0])
        moved_cos, _ = decoder.rotary_emb(x, positions * torch.tensor([1, 2, 3])[:, None, None])
    assert torch.equal(cos, plain_cos) and torch.equal(sin, plain_sin)
    assert (moved_cos - plain_cos).abs().max() > 0.1


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


@pytest.mark.parametrize("checkpoint", ["next-moe", "q35-moe"], indirect=True)
def test_router_aux_loss_matches_transformers(binary, checkpoint, rollouts, tmp_path):
    variant, model, directory = checkpoint
    data, path = rollouts
    families.assert_router_loss_matches(binary, variant, directory, path, model, data, RUNS, tmp_path,
                                        exact=exact_float64)


@pytest.mark.parametrize("check", ["float32", "float64", "gradients", "router-aux-loss"])
@pytest.mark.parametrize("checkpoint, every_layer", [("next-moe", True), ("next-moe", False), ("q35-moe", True)],
                         indirect=["checkpoint"], ids=["every-layer", "sparse-layers", "q35-every-layer"])
def test_routing_replay_matches_transformers(binary, checkpoint, rollouts, check, every_layer, tmp_path):
    variant, model, directory = checkpoint
    families.assert_routing_replay_matches(binary, variant, directory, model, rollouts, check, every_layer, RUNS,
                                           tmp_path, exact=exact_float64)


def test_transformers_loads_dta_checkpoint(binary, checkpoint, rollouts, tmp_path):
    """What dta saves is the decoder alone, which transformers' causal LM class loads; from q35-vl
    too, whose text logits it reproduces."""
    variant, model, directory = checkpoint
    data, path = rollouts
    resaved = tmp_path / "resaved"
    run_binary(binary, directory, path, tmp_path / "out.json", "float32", "dense", "--resave", str(resaved))
    config = json.loads((resaved / "config.json").read_text())
    family, model_type = causal_lm(variant)
    assert config["model_type"] == model_type and config["architectures"] == [family.__name__]
    extra = {} if family is Qwen3_5ForCausalLM else {"experts_implementation": "eager"}
    loaded, info = family.from_pretrained(resaved, dtype=torch.float32, output_loading_info=True, **extra)
    loaded.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    text_config = model.config.get_text_config()
    assert loaded.config.layer_types == text_config.layer_types
    assert loaded.config.tie_word_embeddings == text_config.tie_word_embeddings
    for key in ("rope_theta", "partial_rotary_factor"):
        assert loaded.config.rope_parameters[key] == text_config.rope_parameters[key], key
    ids = torch.tensor([data[0]["tokens"]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)

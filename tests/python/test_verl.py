"""verl users: dta.verl_train_options maps verl's actor settings to dta.Trainer.train_batch's, and
refuses by name what dta cannot compute; with it, dta's loss on dta.from_verl's trajectories is
verl's actor loss.

The reference is verl 0.9.1's actor loss written out from its source (verl/workers/utils/losses.py
ppo_loss; verl/trainer/ppo/core_algos.py compute_policy_loss_vanilla, agg_loss, kl_penalty) on
log-probabilities and entropies that transformers computes at the sampling temperature, in float64
(test_hf_parity's exact_float64), from the checkpoint dta.Trainer saves: the same tiny Qwen3 on both
sides. Each term the mapping sets moves the loss far beyond the tolerance.
"""
from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen3ForCausalLM

import dta
from test_hf_parity import exact_float64

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = str(REPO / "examples" / "configs" / "qwen3-tiny.json")
TEMPERATURE = 0.8
# Float64 round-off, and verl's seq-mean-token-mean divides each row's token sum by its tokens + 1e-8.
RELATIVE = 1e-8


# --- the settings ---------------------------------------------------------------------------------


def test_verls_defaults_map_to_dta_options():
    assert dta.verl_train_options(temperature=0.7) == {
        "loss": "ppo", "normalization": "token-mean", "eps_clip_low": 0.2, "eps_clip_high": 0.2,
        "dual_clip": 3.0, "entropy_coef": 0.0, "kl_coef": 0.0, "temperature": 0.7}


def test_settings_come_from_an_actor_config_or_by_name():
    """verl's ActorConfig is a dataclass (attributes), its YAML an OmegaConf node or a dict."""
    actor = types.SimpleNamespace(loss_agg_mode="seq-mean-token-mean", clip_ratio=0.3, clip_ratio_low=None,
                                  clip_ratio_high=0.28, clip_ratio_c=10.0, entropy_coeff=0.01, use_kl_loss=True,
                                  kl_loss_coef=0.05, kl_loss_type="low_var_kl",
                                  policy_loss=types.SimpleNamespace(loss_mode="vanilla"))
    want = {"loss": "ppo", "normalization": "sequence-mean", "eps_clip_low": 0.3, "eps_clip_high": 0.28,
            "dual_clip": 10.0, "entropy_coef": 0.01, "kl_coef": 0.05, "temperature": 1.0}
    assert dta.verl_train_options(actor, temperature=1.0) == want
    as_dict = dict(vars(actor), policy_loss={"loss_mode": "vanilla"})
    assert dta.verl_train_options(as_dict, temperature=1.0) == want
    assert dta.verl_train_options(as_dict, temperature=1.0, loss_agg_mode="token-sum",
                                  use_kl_loss=False)["normalization"] == "sum"
    assert dta.verl_train_options(as_dict, temperature=1.0, use_kl_loss=False)["kl_coef"] == 0.0
    # Unset fields take verl's defaults.
    assert dta.verl_train_options({"clip_ratio": 0.1}, temperature=1.0)["eps_clip_high"] == 0.1


def test_the_temperature_is_required():
    with pytest.raises(TypeError, match="temperature"):
        dta.verl_train_options()
    for bad in (0, -1.0, float("nan"), "0.8"):
        with pytest.raises(ValueError, match="temperature"):
            dta.verl_train_options(temperature=bad)


@pytest.mark.parametrize("setting,words", [
    ({"loss_agg_mode": "seq-mean-token-sum"},
     "loss_agg_mode 'seq-mean-token-sum' (each row's token sum averaged over the rows) has no dta normalization; "
     "use token-mean (dta's token-mean), seq-mean-token-mean (sequence-mean) or token-sum (sum)"),
    ({"loss_agg_mode": "seq-mean-token-sum-norm"}, "loss_agg_mode 'seq-mean-token-sum-norm' ("),
    ({"loss_agg_mode": "token_mean"}, "loss_agg_mode 'token_mean' is not one of verl's"),
    ({"loss_mode": "gspo"}, "policy_loss.loss_mode 'gspo': dta maps verl's 'vanilla' PPO loss only"),
    ({"use_kl_loss": True, "kl_loss_type": "k1"}, "kl_loss_type 'k1': dta's KL loss is k3"),
    ({"clip_ratio_c": 1.0}, "clip_ratio_c 1.0: verl requires > 1"),
    ({"clip_ratio_cc": 3.0}, "unknown verl actor setting(s) clip_ratio_cc"),
], ids=["seq-mean-token-sum", "seq-mean-token-sum-norm", "misspelt-mode", "gspo", "k1", "clip_ratio_c", "unknown"])
def test_what_dta_cannot_compute_is_refused_by_name(setting, words):
    with pytest.raises(ValueError) as e:
        dta.verl_train_options(temperature=1.0, **setting)
    assert words in str(e.value), str(e.value)


# --- the loss -------------------------------------------------------------------------------------


def verl_batch(model: Qwen3ForCausalLM, rows: int = 5, seed: int = 3) -> dict:
    """A verl mini-batch: left-padded prompts (a shared system prompt, two GRPO groups), right-padded
    responses with a tool's output (response_mask 0) in one, old_log_probs near the model's own at
    the temperature (so ratios fall inside and outside the clips, dual clip included), advantages
    of both signs, ref_log_prob."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    system = torch.randint(1, vocab, (4,), generator=g).tolist()
    prompts, responses, masks = [], [], []
    for i in range(rows):
        prompts.append(system + torch.randint(1, vocab, (1 + i % 3,), generator=g).tolist())
        responses.append(torch.randint(1, vocab, (3 + (2 * i) % 5,), generator=g).tolist())
        masks.append([1] * len(responses[-1]))
    masks[1][1:3] = [0, 0]  # a tool's output inside the response
    p, r = max(map(len, prompts)), max(map(len, responses))
    batch = {
        "prompts": torch.tensor([[0] * (p - len(x)) + x for x in prompts]),
        "responses": torch.tensor([x + [0] * (r - len(x)) for x in responses]),
        "attention_mask": torch.tensor([[0] * (p - len(a)) + [1] * (len(a) + len(b)) + [0] * (r - len(b))
                                        for a, b in zip(prompts, responses)]),
        "response_mask": torch.tensor([m + [0] * (r - len(m)) for m in masks]),
        "uid": np.array(["g0", "g0", "g0", "g1", "g1"][:rows], dtype=object),
    }
    lp, _ = model_logprobs(model, batch)
    noise = torch.randn(rows, r, generator=g, dtype=torch.float64) * 0.4
    noise[0, 0] = 2.5  # ratio exp(-2.5) on a negative advantage's token: far below 1 - eps
    noise[2, 0] = -2.5  # ratio e^2.5 > clip_ratio_c = 3 on a negative advantage's token: dual clip
    valid = batch["attention_mask"][:, p:].bool()
    batch["old_log_probs"] = torch.where(valid, lp + noise, 0.0).float()
    batch["ref_log_prob"] = torch.where(valid, lp - noise.flip(0) * 0.5, 0.0).float()
    advantages = torch.tensor([-1.0, 0.5, -0.75, 1.25, -0.25])[:rows, None].expand(rows, r)
    batch["advantages"] = torch.where(valid, advantages, 0.0).float()
    return batch


def model_logprobs(model: Qwen3ForCausalLM, batch: dict, temperature: float = TEMPERATURE
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's actor's log-probabilities and entropies of `responses`, [B, R], at the temperature:
    each row unpadded through transformers, logits / T (0 on padding)."""
    p, r = batch["prompts"].size(1), batch["responses"].size(1)
    logprobs = torch.zeros(len(batch["prompts"]), r, dtype=torch.float64)
    entropy = torch.zeros_like(logprobs)
    for i, row in enumerate(torch.cat([batch["prompts"], batch["responses"]], dim=1)):
        keep = batch["attention_mask"][i].bool()
        ids = row[keep]
        n = int(keep[:p].sum())
        m = len(ids) - n
        logits = model(input_ids=ids[None]).logits[0, n - 1:-1].to(torch.float64) / temperature
        log_softmax = torch.log_softmax(logits, dim=-1)
        logprobs[i, :m] = log_softmax.gather(1, ids[n:, None])[:, 0]
        entropy[i, :m] = -(log_softmax.exp() * log_softmax).sum(-1)
    return logprobs, entropy


def verl_agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """core_algos.agg_loss on one data-parallel rank with the mini-batch as its global batch
    (batch_num_tokens: its loss tokens; global_batch_size: its rows, ppo_mini_batch_size * n)."""
    mask = loss_mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    if mode == "token-sum":
        return (loss_mat * mask).sum()
    if mode == "seq-mean-token-mean":
        seq_tokens = mask.sum(-1)
        seq_losses = (loss_mat * mask).sum(-1) / (seq_tokens + 1e-8)
        return (seq_losses * (seq_tokens > 0)).sum() / loss_mat.size(0)
    raise AssertionError(mode)


def verl_actor_loss(logprobs: torch.Tensor, entropy: torch.Tensor, batch: dict, actor: dict) -> torch.Tensor:
    """losses.ppo_loss with policy_loss.loss_mode "vanilla" (compute_policy_loss_vanilla)."""
    old = batch["old_log_probs"].to(torch.float64)
    advantages = batch["advantages"].to(torch.float64)
    mask = batch["response_mask"].bool()
    mode = actor["loss_agg_mode"]
    ratio = torch.exp(torch.clamp(logprobs - old, min=-20.0, max=20.0))
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - actor["clip_ratio_low"], 1 + actor["clip_ratio_high"])
    clipped = torch.maximum(losses1, losses2)
    dual = torch.min(-advantages * actor["clip_ratio_c"], clipped)
    pg = torch.where(advantages < 0, dual, clipped)
    loss = verl_agg_loss(pg, mask, mode) - actor["entropy_coeff"] * verl_agg_loss(entropy, mask, mode)
    kl = batch["ref_log_prob"].to(torch.float64) - logprobs  # kl_penalty "low_var_kl"
    kld = torch.clamp(torch.exp(torch.clamp(kl, min=-20, max=20)) - kl - 1, min=-10, max=10)
    return loss + actor["kl_loss_coef"] * verl_agg_loss(kld, mask, mode)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, Qwen3ForCausalLM]:
    """A tiny random Qwen3 saved by dta (float64), and transformers' copy of it."""
    directory = tmp_path_factory.mktemp("tiny")
    dta.Trainer.from_config(TINY_CONFIG, seed=5, init_std=0.2, dtype="float64").save(
        directory, dtype="float64", optimizer=False)
    model = Qwen3ForCausalLM.from_pretrained(directory / "model", dtype=torch.float64).eval()
    return str(directory / "model"), model


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "token-sum"])
def test_dtas_loss_is_verls_actor_loss(checkpoint, mode):
    path, model = checkpoint
    actor = {"loss_agg_mode": mode, "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
             "clip_ratio_c": 3.0, "entropy_coeff": 0.01, "use_kl_loss": True, "kl_loss_coef": 0.05,
             "kl_loss_type": "low_var_kl"}
    with torch.no_grad(), exact_float64():
        batch = verl_batch(model)
        logprobs, entropy = model_logprobs(model, batch)
        want = verl_actor_loss(logprobs, entropy, batch, actor).item()
        # What each setting contributes, far beyond the tolerance: the temperature, the dual clip, the
        # entropy and KL terms.
        others = [verl_actor_loss(*model_logprobs(model, batch, temperature=1.0), batch, actor).item()]
        for change in ({"clip_ratio_c": 1e9}, {"entropy_coeff": 0.0}, {"kl_loss_coef": 0.0}):
            others.append(verl_actor_loss(logprobs, entropy, batch, {**actor, **change}).item())
    ratios = torch.exp(logprobs - batch["old_log_probs"].double())[batch["response_mask"].bool()]
    assert (ratios > 3).any() and (ratios < 0.8).any() and ((ratios > 0.8) & (ratios < 1.28)).any()

    trainer = dta.Trainer(path, dtype="float64", lr=1e-3)
    options = dta.verl_train_options(actor, temperature=TEMPERATURE)
    stats = trainer.train_batch(dta.from_verl(batch), method="dta", **options)
    assert stats.loss == pytest.approx(want, rel=RELATIVE)
    assert stats.dual_clip_fraction > 0
    for other in others:
        assert abs(other - want) > 100 * RELATIVE * abs(want)

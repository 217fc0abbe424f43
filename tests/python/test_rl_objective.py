"""AReaL's objective in dta.Trainer, against references written here from AReaL's definitions.

Sampling temperature, reward shaping and batch / token-weighted advantage normalisation, rejection
sampling of stale tokens in decoupled PPO (AReaL 1.0's RejectionSamplingConfig), entropy and
proximal log-probabilities for callable losses, and the RL diagnostics in TrainStats. The reference
runs every rollout through transformers on its own in float64 (test_trainer's), computes the loss
from the definitions below, independently of dta, and backpropagates; every method's gradient must
match within 1e-9 relative error on test_hf_parity's nasty rollouts (shared prefixes, a prefix
rollout, a duplicate, a one-token rollout).
"""
from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from transformers import Qwen3ForCausalLM

import dta
from test_hf_parity import exact_float64, make_rollouts, random_model
from test_trainer import RELATIVE, assert_gradients_match, f32

# dta both ways, packing stated (the executor packs by default).
METHODS = [("dense", {}), ("packed", {}), ("dta", {"block_size": 7, "pack": False}),
           ("dta", {"block_size": 16, "pack": True})]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Qwen3ForCausalLM, str]:
    model = random_model(False)
    directory = tmp_path_factory.mktemp("hf")
    model.save_pretrained(directory, safe_serialization=True)
    return model, str(directory)


def hf_outputs(model: Qwen3ForCausalLM, tokens: list[int], temperature: float = 1.0):
    """log p(tokens[t] | tokens[:t]) and the entropy of that distribution for t >= 1 ([L - 1] each),
    of softmax(logits / temperature), with autograd."""
    ids = torch.tensor(tokens)
    logits = model(input_ids=ids[None]).logits[0, :-1] / temperature
    log_p = torch.log_softmax(logits, dim=-1)
    return log_p.gather(1, ids[1:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)


@pytest.fixture(scope="module")
def trajectories(checkpoint) -> list[dta.Trajectory]:
    """Random masks, rewards in mixed groups, behaviour log-probabilities 0.5 around the model's own
    (so that ratios fall inside and outside clip ranges and rejection bounds)."""
    model, _ = checkpoint
    rng = random.Random(5)
    out = []
    with exact_float64(), torch.no_grad():
        model64 = copy.deepcopy(model).to(torch.float64)
        for r in make_rollouts():
            current = [0.0] + hf_outputs(model64, r["tokens"])[0].tolist()
            mask = [0] + [int(rng.random() < 0.8) for _ in r["tokens"][1:]]
            out.append(dta.Trajectory(id=r["id"], group=r["group"], tokens=r["tokens"], loss_mask=mask,
                                      logprobs=[lp + rng.uniform(-0.5, 0.5) for lp in current],
                                      reward=float(rng.randrange(4))))
    return out


# --- the reference -------------------------------------------------------------------------------


def advantages(trajectories: list[dta.Trajectory], *, bias=0.0, scaling=1.0, clip=math.inf, mean_level="group",
               std_level="group", eps=1e-6, token_weighted=False) -> list[float]:
    """AReaL's reward shaping, then its Normalization (mean / std over a level; unbiased std; every
    loss token of a rollout counts when token_weighted), one value per rollout."""
    shaped = [min(max((t.reward + bias) * scaling, -clip), clip) for t in trajectories]
    weights = [float(sum(t.loss_mask)) if token_weighted else 1.0 for t in trajectories]

    def members(level: str, i: int) -> list[int]:
        if level == "batch":
            return list(range(len(trajectories)))
        return [j for j, t in enumerate(trajectories) if t.group == trajectories[i].group]

    def stats(level: str, i: int) -> tuple[float, float]:
        js = [j for j in members(level, i) if weights[j] > 0]
        x = torch.tensor([shaped[j] for j in js], dtype=torch.float64)
        w = torch.tensor([weights[j] for j in js], dtype=torch.float64)
        if (x == x[0]).all():
            return float(x[0]), 0.0
        mean = (w * x).sum() / w.sum()
        return float(mean), float(((w * (x - mean) ** 2).sum() / (w.sum() - 1)).sqrt())

    out = []
    for i in range(len(trajectories)):
        a = shaped[i]
        if mean_level != "none":
            a -= stats(mean_level, i)[0]
        if std_level != "none":
            a /= stats(std_level, i)[1] + eps
        out.append(a)
    return out


@dataclass
class Rejection:
    """AReaL 1.0's RejectionSamplingConfig, applied as its apply_rejection_sampling does."""
    level: str = "token"
    action: str = "mask"
    metric: str = "ratio"
    aggregation: str = "mean"
    upper: float = 5.0
    lower: float | None = None

    def apply(self, prox: torch.Tensor, old: torch.Tensor, mask: torch.Tensor):
        """(behaviour weight, kept mask) over one rollout's tokens."""
        lr = torch.where(mask, prox - old, 0.0)
        metric = {"ratio": lr.exp(), "kl_k1": lr, "kl_k2": lr ** 2 / 2, "kl_k3": (-lr).exp() - 1 + lr}[self.metric]
        weight = lr.exp()

        def ok(x):
            return (x <= self.upper) & (x >= self.lower if self.lower is not None else True)

        low = self.lower if self.lower is not None else 0.0
        if self.level == "token":
            if self.action == "mask":
                return weight, mask & ok(metric)
            return weight.clamp(low, self.upper), mask
        values = lr if self.metric == "ratio" else metric
        m = int(mask.sum())
        if m == 0:
            return weight, mask
        if self.aggregation == "sum":
            agg = values[mask].sum()
        elif self.aggregation == "mean":
            agg = values[mask].sum() / m
        else:
            agg = values[mask].max()
        if self.metric == "ratio":
            agg = agg.exp()
            weight = torch.full_like(weight, float((lr[mask].sum() / m).exp()))
        if self.action == "mask":
            return weight, mask & bool(ok(agg))
        return (weight if bool(ok(agg)) else weight.clamp(low, self.upper)), mask

    def to_dta(self) -> dta.trainer.RejectionSampling:
        return dta.trainer.RejectionSampling(self.level, self.action, self.metric, self.aggregation, self.upper,
                                             self.lower)


def ppo_terms(lp: torch.Tensor, base: torch.Tensor, a: float, eps: float = 0.2) -> torch.Tensor:
    ratio = torch.exp(lp - base)
    return torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - eps, 1 + eps))


LossTerm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, dta.Trajectory, float], torch.Tensor]


def reference(model: Qwen3ForCausalLM, trajectories: list[dta.Trajectory], term: LossTerm, *,
              temperature: float = 1.0, adv: list[float] | None = None):
    """sum over rollouts of sum_t mask_t term_t / N, every parameter's gradient; term(lp, prox,
    entropy, trajectory, advantage) gives the rollout's per-token loss [L - 1] (prox: the
    log-probabilities before the step, detached)."""
    model64 = copy.deepcopy(model).to(torch.float64)
    n = float(sum(sum(t.loss_mask) for t in trajectories))
    adv = advantages(trajectories) if adv is None else adv
    total = torch.zeros((), dtype=torch.float64)
    with exact_float64():
        for t, a in zip(trajectories, adv):
            if len(t.tokens) == 1:
                continue
            lp, entropy = hf_outputs(model64, t.tokens, temperature)
            mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
            per_token = term(lp, lp.detach(), entropy, t, float(f32([a])[0]))
            total = total + torch.where(mask, per_token, 0.0).sum() / n
    total.backward()
    return total.item(), {name: p.grad for name, p in model64.named_parameters()}


def grpo_term(lp, prox, entropy, t, a):
    return ppo_terms(lp, f32(t.logprobs)[1:], a)


# --- temperature and advantages ------------------------------------------------------------------


def test_temperature_matches_transformers(checkpoint, trajectories):
    model, directory = checkpoint
    temperature = 0.7
    want_loss, want = reference(model, trajectories, grpo_term, temperature=temperature)
    trainer = dta.Trainer(directory, dtype="float64")
    for method, options in METHODS:
        stats = trainer.compute_gradients(trajectories, "grpo", method, temperature=temperature, **options)
        assert stats.loss == pytest.approx(want_loss, rel=RELATIVE), method
        assert_gradients_match(trainer, want, f"temperature {method} {options}")
    model64 = copy.deepcopy(model).to(torch.float64)
    with exact_float64(), torch.no_grad():
        for method, _ in METHODS[:3]:
            got = trainer.compute_logprobs(trajectories, method, temperature=temperature)
            for t, lp in zip(trajectories, got):
                want_lp = hf_outputs(model64, t.tokens, temperature)[0]
                torch.testing.assert_close(lp[1:], want_lp, rtol=1e-12, atol=1e-12)
    # Temperature 1 is not a no-op by accident: the two differ.
    plain = trainer.compute_logprobs(trajectories, "dta")
    hot = trainer.compute_logprobs(trajectories, "dta", temperature=temperature)
    assert not torch.allclose(plain[0], hot[0])
    with pytest.raises(ValueError, match="temperature must be positive"):
        trainer.compute_logprobs(trajectories, "dta", temperature=0.0)


ADVANTAGE_CASES = [
    {"bias": -1.0, "scaling": 2.0},
    {"clip": 7.5, "scaling": 3.0, "mean_level": "batch", "std_level": "batch"},
    {"mean_level": "group", "std_level": "none"},
    {"mean_level": "none", "std_level": "batch", "eps": 1e-3},
    {"token_weighted": True},
    {"token_weighted": True, "mean_level": "batch", "std_level": "batch", "eps": 1e-5},
]


@pytest.mark.parametrize("case", ADVANTAGE_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_advantage_options_match_the_definition(checkpoint, trajectories, case):
    model, directory = checkpoint
    adv = advantages(trajectories, **case)
    assert len({round(a, 9) for a in adv}) > 2, "advantages should differ between rollouts"
    want_loss, want = reference(model, trajectories, grpo_term, adv=adv)
    names = {"bias": "reward_bias", "scaling": "reward_scaling", "clip": "reward_clip", "mean_level": "adv_mean_level",
             "std_level": "adv_std_level", "eps": "adv_std_eps", "token_weighted": "adv_token_weighted"}
    options = {names[k]: v for k, v in case.items()}
    trainer = dta.Trainer(directory, dtype="float64")
    for method, executor in METHODS[1:3]:
        stats = trainer.compute_gradients(trajectories, "grpo", method, **options, **executor)
        assert stats.loss == pytest.approx(want_loss, rel=RELATIVE), method
        assert_gradients_match(trainer, want, f"{case} {method}")


def test_advantage_options_errors(checkpoint, trajectories):
    trainer = dta.Trainer(checkpoint[1], dtype="float64")
    with pytest.raises(ValueError, match="adv_std_level must be one of group, batch, none"):
        trainer.compute_gradients(trajectories, "grpo", adv_std_level="token")
    with pytest.raises(RuntimeError, match="reward_clip must be positive"):
        trainer.compute_gradients(trajectories, "grpo", reward_clip=0.0)


# --- decoupled PPO and rejection sampling --------------------------------------------------------


REJECTIONS = [
    Rejection(upper=1.3),
    Rejection(upper=1.3, lower=0.8),
    Rejection(action="clamp", upper=1.2, lower=0.9),
    Rejection(level="sequence", upper=1.05, lower=0.97),
    Rejection(level="sequence", action="clamp", upper=1.02, lower=0.99),
    Rejection(level="sequence", metric="kl_k3", aggregation="max", upper=0.14),
    Rejection(metric="kl_k2", upper=0.04),
    Rejection(level="sequence", metric="kl_k1", aggregation="sum", upper=0.5, lower=-0.5),
]


def decoupled_term(rejection: Rejection | None, behave_imp_weight: bool = True) -> LossTerm:
    def term(lp, prox, entropy, t, a):
        old = f32(t.logprobs)[1:]
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        surrogate = ppo_terms(lp, prox, a)
        if rejection is None:
            weight, kept = ((prox - old).exp() if behave_imp_weight else torch.ones_like(old)), mask
        else:
            weight, kept = rejection.apply(prox, old, mask)
        return torch.where(kept, surrogate * weight, 0.0)
    return term


@pytest.mark.parametrize("rejection", [None, *REJECTIONS], ids=lambda r: "none" if r is None else
                         f"{r.level}-{r.action}-{r.metric}-{r.aggregation}-{r.upper}-{r.lower}")
def test_rejection_sampling_matches_the_definition(checkpoint, trajectories, rejection):
    model, directory = checkpoint
    want_loss, want = reference(model, trajectories, decoupled_term(rejection))
    options = {} if rejection is None else {"rejection_sampling": rejection.to_dta()}
    trainer = dta.Trainer(directory, dtype="float64")
    for method, executor in [METHODS[0], METHODS[2], METHODS[3]]:
        stats = trainer.compute_gradients(trajectories, "decoupled-ppo", method, **options, **executor)
        assert stats.loss == pytest.approx(want_loss, rel=RELATIVE), method
        assert_gradients_match(trainer, want, f"{rejection} {method}")
        if rejection is not None and rejection.action == "mask":
            assert 0 < stats.rejected_fraction < 1, f"{rejection}: the bounds should reject some tokens"


def test_decoupled_ppo_without_behaviour_weight(checkpoint, trajectories):
    model, directory = checkpoint
    want_loss, want = reference(model, trajectories, decoupled_term(None, behave_imp_weight=False))
    trainer = dta.Trainer(directory, dtype="float64")
    stats = trainer.compute_gradients(trajectories, "decoupled-ppo", "dta", behave_imp_weight=False)
    assert stats.loss == pytest.approx(want_loss, rel=RELATIVE)
    assert_gradients_match(trainer, want, "behave_imp_weight=False")


def test_rejection_sampling_errors(checkpoint, trajectories):
    trainer = dta.Trainer(checkpoint[1], dtype="float64")
    rs = dta.trainer.RejectionSampling(upper=2.0)
    with pytest.raises(RuntimeError, match="applies to kDecoupledPpo only"):
        trainer.compute_gradients(trajectories, "grpo", rejection_sampling=rs)
    with pytest.raises(RuntimeError, match="two ways of saying the same"):
        trainer.compute_gradients(trajectories, "decoupled-ppo", rejection_sampling=rs, behave_imp_weight_cap=3.0)
    with pytest.raises(RuntimeError, match="upper must be finite and > 1 for the ratio metric"):
        trainer.compute_gradients(trajectories, "decoupled-ppo",
                                  rejection_sampling=dta.trainer.RejectionSampling(upper=0.5))
    with pytest.raises(ValueError, match="rejection_sampling.metric must be one of"):
        trainer.compute_gradients(trajectories, "decoupled-ppo",
                                  rejection_sampling=dta.trainer.RejectionSampling(metric="kl"))


# --- callables and diagnostics -------------------------------------------------------------------


def test_callable_gets_entropy_and_proximal(checkpoint, trajectories):
    """A callable restating decoupled PPO with an entropy bonus from what it is given."""
    model, directory = checkpoint

    def term(lp, prox, entropy, t, a):
        return decoupled_term(None)(lp, prox, entropy, t, a) - 0.01 * entropy

    want_loss, want = reference(model, trajectories, term)

    def loss(logprobs, rollout):
        assert rollout.entropy is not None and rollout.entropy.requires_grad
        assert rollout.proximal_logprobs is not None and not rollout.proximal_logprobs.requires_grad
        prox = rollout.proximal_logprobs
        surrogate = ppo_terms(logprobs, prox, rollout.advantages) * (prox - rollout.old_logprobs).exp()
        per_token = surrogate - 0.01 * rollout.entropy
        return torch.where(rollout.loss_mask, per_token, 0.0).sum() / rollout.total_loss_tokens

    trainer = dta.Trainer(directory, dtype="float64")
    for method, executor in METHODS:
        stats = trainer.compute_gradients(trajectories, loss, method, with_entropy=True, with_proximal=True,
                                          **executor)
        assert stats.loss == pytest.approx(want_loss, rel=RELATIVE), method
        assert_gradients_match(trainer, want, f"callable {method}")
        assert stats.entropy is not None and stats.clip_fraction is None


def test_diagnostics_match_the_definition(checkpoint, trajectories):
    model, directory = checkpoint
    model64 = copy.deepcopy(model).to(torch.float64)
    adv = advantages(trajectories)
    rejection = Rejection(upper=1.3, lower=0.8)
    tokens = clipped = 0
    kl = ratio_sum = entropy_sum = 0.0
    ratios = []
    rejected = kept_tokens = 0
    behave_sum = 0.0
    with exact_float64(), torch.no_grad():
        for t, a in zip(trajectories, adv):
            if len(t.tokens) == 1:
                continue
            lp, entropy = hf_outputs(model64, t.tokens)
            mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
            old = f32(t.logprobs)[1:]
            ratio = torch.exp(lp - old)[mask]
            a = float(f32([a])[0])
            clipped += int((-a * ratio < -a * ratio.clamp(0.8, 1.2)).sum())
            tokens += int(mask.sum())
            kl += float((lp - old)[mask].sum())
            ratio_sum += float(ratio.sum())
            ratios += ratio.tolist()
            entropy_sum += float(entropy[mask].sum())
            # Decoupled PPO right after the proximal forward: the current policy is the proximal.
            weight, kept = rejection.apply(lp, old, mask)
            rejected += int((mask & ~kept).sum())
            kept_tokens += int(kept.sum())
            behave_sum += float(weight[kept].sum())
    trainer = dta.Trainer(directory, dtype="float64")
    for method, executor in METHODS:
        stats = trainer.compute_gradients(trajectories, "grpo", method, with_entropy=True, **executor)
        assert 0 < clipped < tokens
        assert stats.clip_fraction == pytest.approx(clipped / tokens, abs=1e-12), method
        assert stats.approx_kl == pytest.approx(kl / tokens, rel=1e-9)
        assert stats.ratio_mean == pytest.approx(ratio_sum / tokens, rel=1e-9)
        assert stats.ratio_max == pytest.approx(max(ratios), rel=1e-9)
        assert stats.ratio_min == pytest.approx(min(ratios), rel=1e-9)
        assert stats.entropy == pytest.approx(entropy_sum / tokens, rel=1e-9)
        assert stats.dual_clip_fraction == 0 and stats.rejected_fraction is None
        decoupled = trainer.compute_gradients(trajectories, "decoupled-ppo", method,
                                              rejection_sampling=rejection.to_dta(), **executor)
        assert decoupled.rejected_fraction == pytest.approx(rejected / tokens, abs=1e-12)
        assert decoupled.behave_imp_weight == pytest.approx(behave_sum / kept_tokens, rel=1e-9)
        # The current policy is the proximal one: every kept ratio is 1, nothing clipped.
        assert decoupled.ratio_mean == pytest.approx(kept_tokens / tokens, rel=1e-9)
        assert decoupled.clip_fraction == 0 and decoupled.approx_kl == pytest.approx(0, abs=1e-12)
        assert decoupled.entropy is None
    sft = trainer.compute_gradients(trajectories, "sft", "dta")
    assert sft.clip_fraction is None and sft.ratio_mean is None and sft.entropy is None

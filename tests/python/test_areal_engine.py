"""dta.areal: AReaL's TrainEngine on dta.Trainer, driven by the real areal package (1.0.4).

A tiny random Qwen3 (test_hf_parity's) in float64 on the CPU, and AReaL-shaped rollouts: one dict
of [group, L] tensors per prompt, as AReaL's RLVR workflow returns them (prompts sharing a system
prompt, right padding, versions, a multi-turn rollout with a tool segment), with behaviour
log-probabilities around the model's own so that PPO ratios fall inside and outside the clips.

The PPO step runs as AReaL's PPOTrainer runs it (compute_logp when the config asks, then
PPOActor.compute_advantages and PPOActor.ppo_update, whose train_batch is the engine's), and must
equal, within 1e-9 relative error in float64:
- the same step done directly with dta.Trainer on the trajectories dta.from_areal makes of the
  batch (updated parameters and gradients), when dta's built-in loss runs, and
- an independent reference: AReaL's own loss on log-probabilities from transformers, one rollout
  at a time, weighted by loss tokens as AReaL's engines weight micro-batches (gradients): its
  ppo_actor_loss_fn in float64 for dta's built-in loss, its grpo_loss_fn on float32
  log-probabilities (as AReaL's engines call it) when the engine runs AReaL's loss.
Also: compute_logp against transformers, save/load round trips, AReaL's disk and xccl weight-update
protocols (at AReaL's address or DTAOptions.weight_update_host), the learning-rate schedule,
versions, and the batches, devices, dtypes and members that must raise.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import random
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future

import pytest
import torch
from transformers import Qwen3ForCausalLM

import dta
from areal.api.alloc_mode import ModelAllocation, ParallelStrategy
from areal.api.cli_args import (NameResolveConfig, NormConfig, OptimizerConfig, PPOActorConfig, SchedulingStrategy,
                                RejectionSamplingConfig)
from areal.api.engine_api import InferenceEngine, TrainEngine
from areal.api.io_struct import FinetuneSpec, SaveLoadMeta, WeightUpdateMeta
from areal.engine.fsdp_utils import get_cosine_schedule_with_warmup
from areal.trainer.ppo.actor import grpo_loss_fn
from areal.utils import name_resolve, names
from areal.utils.data import concat_batch, pack_tensor_dict
from areal.utils.functional import ppo_actor_loss_fn
from areal.utils.network import gethostip
from dta.areal import DTAEngine, DTAOptions, DTAPPOActor, DTAPPOTrainer
from test_hf_parity import VOCAB, exact_float64, random_model

RELATIVE = 1e-9
GROUPS, GROUP = 3, 3
VERSION = 2  # the trainer's policy version (rollouts come from versions 0 and 1)


# --- the model and the rollouts -------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Qwen3ForCausalLM, str]:
    model = random_model(False)
    directory = tmp_path_factory.mktemp("hf")
    model.save_pretrained(directory, safe_serialization=True)
    return model, str(directory)


def hf_logprobs(model: Qwen3ForCausalLM, tokens: list[int]) -> torch.Tensor:
    """In AReaL's logits frame, [L]: out[t] = log p(tokens[t + 1] | tokens[:t + 1]), out[L - 1] = 0."""
    ids = torch.tensor(tokens)
    logits = model(input_ids=ids[None]).logits[0]
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]
    return torch.cat([lp, lp.new_zeros(1)])


@pytest.fixture(scope="module")
def model64(checkpoint) -> Qwen3ForCausalLM:
    return copy.deepcopy(checkpoint[0]).to(torch.float64)


@pytest.fixture(scope="module")
def rollouts(model64) -> list[dict[str, torch.Tensor]]:
    return make_rollouts(model64, GROUPS)


def make_rollouts(model64: Qwen3ForCausalLM, groups: int) -> list[dict[str, torch.Tensor]]:
    """One dict of GROUP rows per prompt (the first ``GROUPS`` the same whatever ``groups``)."""
    rng = random.Random(5)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    system = tokens(6)
    out = []
    for g in range(groups):
        prompt = system + tokens(rng.randint(2, 7))
        rows = []
        for k in range(GROUP):
            if g == 0 and k == 0:  # multi-turn: answer, tool output (untrained), answer
                segments = [(prompt, 0), (tokens(4), 1), (tokens(3), 0), (tokens(5), 1)]
            else:
                segments = [(prompt, 0), (tokens(rng.randint(2, 11)), 1)]
            seq = [t for s, _ in segments for t in s]
            mask = [m for s, m in segments for _ in s]
            with exact_float64(), torch.no_grad():
                own = [0.0] + hf_logprobs(model64, seq)[:-1].tolist()  # the tokens' frame
            rows.append({"input_ids": seq, "loss_mask": mask,
                         "logprobs": [lp + rng.uniform(-0.3, 0.3) if m else 0.0 for lp, m in zip(own, mask)],
                         "versions": [rng.randrange(2) if m else -1 for m in mask]})
        width = max(len(r["input_ids"]) for r in rows)

        def padded(key: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([r[key] + [0] * (width - len(r[key])) for r in rows], dtype=dtype)

        out.append({"input_ids": padded("input_ids", torch.int32), "loss_mask": padded("loss_mask", torch.int32),
                    "logprobs": padded("logprobs", torch.float32), "versions": padded("versions", torch.int32),
                    "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"]))
                                                    for r in rows], dtype=torch.bool),
                    "rewards": torch.tensor([float(rng.randrange(2)) for _ in rows[:-1]] + [0.5])})
    return out


# --- engines --------------------------------------------------------------------------------------


def actor_config(path: str, **overrides) -> PPOActorConfig:
    fields = dict(experiment_name="dta-test", trial_name="t0", path=path, backend="fsdp:d1", dtype="float32",
                  optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.01, lr_scheduler_type="constant",
                                            warmup_steps_proportion=0.0, gradient_clipping=1.0),
                  ppo_n_minibatches=1, eps_clip=0.2, eps_clip_higher=0.28, c_clip=3.0, kl_ctl=0.0,
                  adv_norm=NormConfig(mean_level="group", std_level="group", group_size=GROUP))
    fields.update(overrides)
    return PPOActorConfig(**fields)


FT_SPEC = FinetuneSpec(total_train_epochs=1, dataset_size=10 * GROUPS, train_batch_size=GROUPS)


@pytest.fixture
def make_engine():
    """Builds initialised float64 CPU engines; destroys them (the process group's owner last)."""
    made = []

    def make(config: PPOActorConfig, **options) -> DTAPPOActor:
        engine = DTAPPOActor(config, DTAOptions(dtype="float64", device="cpu", **options))
        engine.create_process_group()
        engine.initialize(None, FT_SPEC)
        engine.set_version(VERSION)
        made.append(engine)
        return engine

    yield make
    for engine in reversed(made):
        engine.destroy()


def ppo_step(engine: DTAPPOActor, rollouts: list[dict]) -> list[dict]:
    """One step as PPOTrainer.train takes it; returns the batch ppo_update trained on."""
    batch = copy.deepcopy(rollouts)
    if engine.config.should_compute_prox_logp():
        for trajectory, logp in zip(batch, engine.compute_logp(batch)):
            trajectory["prox_logp"] = logp
    trained = engine.compute_advantages(batch)
    engine.ppo_update(copy.deepcopy(trained))
    engine.step_lr_scheduler()
    engine.last_stats = engine.export_stats()  # and reset AReaL's stats_tracker, as the trainer does
    return trained


def rows_of(batch: list[dict]) -> list[dict]:
    """The rows of AReaL's concatenated batch as [1, L] dicts (what the engine sees)."""
    padded, _ = concat_batch(copy.deepcopy(batch))
    size = padded["attention_mask"].shape[0]
    return [{k: v[b:b + 1] if torch.is_tensor(v) and v.dim() and v.shape[0] == size else v
             for k, v in padded.items()} for b in range(size)]


# --- references -----------------------------------------------------------------------------------


def areal_loss_kwargs(config: PPOActorConfig) -> dict:
    """What PPOActor._ppo_update binds into grpo_loss_fn, from the config."""
    return dict(eps_clip=config.eps_clip, eps_clip_higher=config.eps_clip_higher, c_clip=config.c_clip,
                rejection_sampling=config.rejection_sampling, m2_threshold=config.m2_threshold,
                importance_sampling_level=config.importance_sampling_level, current_version=VERSION,
                prox_logp_method=config.prox_logp_method, use_sapo_loss=config.use_sapo_loss,
                sapo_tau_pos=config.sapo_tau_pos, sapo_tau_neg=config.sapo_tau_neg,
                use_decoupled_loss=config.use_decoupled_loss)


def areal_reference(model64: Qwen3ForCausalLM, trained: list[dict], config: PPOActorConfig, *,
                    float32: bool) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of AReaL's loss on each rollout as a one-sequence packed
    micro-batch, log-probabilities from transformers, weighted by its loss tokens over the batch's.

    float32: grpo_loss_fn on float32 log-probabilities, as AReaL's engines call it (its statistics
    take float32 only). Else its loss, ppo_actor_loss_fn (or sapo_loss_fn), in float64."""
    model = copy.deepcopy(model64)
    mbs = [pack_tensor_dict(row) for row in rows_of(trained)]
    total = float(sum(mb["loss_mask"].count_nonzero() for mb in mbs))
    kwargs = areal_loss_kwargs(config)
    loss = torch.zeros((), dtype=torch.float64)
    with exact_float64():
        for mb in mbs:
            logprobs = hf_logprobs(model, mb["input_ids"].tolist())
            weight = float(mb["loss_mask"].count_nonzero()) / total
            if float32:
                logprobs = logprobs.float()
                loss = loss + grpo_loss_fn(logprobs, torch.zeros_like(logprobs), mb, **kwargs) * weight
            else:
                assert not config.use_sapo_loss and config.m2_threshold is None
                loss = loss + ppo_actor_loss_fn(
                    logprobs=logprobs, proximal_logprobs=mb["prox_logp"], old_logprobs=mb["logprobs"],
                    advantages=mb["advantages"], eps_clip=config.eps_clip, loss_mask=mb["loss_mask"].bool(),
                    eps_clip_higher=config.eps_clip_higher, c_clip=config.c_clip,
                    rejection_sampling=config.rejection_sampling, cu_seqlens=mb["cu_seqlens"])[0] * weight
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def dta_direct(path: str, trained: list[dict], config: PPOActorConfig, loss: str, **options) -> dta.Trainer:
    """The same step with dta.Trainer on dta.from_areal's trajectories."""
    opt = config.optimizer
    trainer = dta.Trainer(path, dtype="float64", lr=opt.lr, weight_decay=opt.weight_decay,
                          max_grad_norm=opt.gradient_clipping, betas=(opt.beta1, opt.beta2), eps=opt.eps)
    trajectories = [dta.from_areal(row, id=str(i), shifted=True) for i, row in enumerate(rows_of(trained))]
    trainer.train_batch(trajectories, loss=loss, method="dta", eps_clip_low=config.eps_clip,
                        eps_clip_high=config.eps_clip_higher, dual_clip=config.c_clip, **options)
    return trainer


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
                 relative: float = RELATIVE) -> None:
    assert sorted(got) == sorted(want), what
    for name, w in want.items():
        assert w.norm() > 0, f"{what}: {name} is zero"
        error = ((got[name] - w).norm() / w.norm()).item()
        assert error <= relative, f"{what}: {name}: relative error {error:.3g}"


def parameters(trainer: dta.Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.parameters().items()}


# --- the engine -----------------------------------------------------------------------------------


def test_the_engine_is_an_areal_train_engine_of_one_process(checkpoint, make_engine):
    engine = make_engine(actor_config(checkpoint[1]))
    assert isinstance(engine, TrainEngine) and isinstance(engine, DTAEngine) and engine.initialized
    assert (engine.data_parallel_rank, engine.data_parallel_world_size, engine.current_data_parallel_head(),
            engine.is_data_parallel_head()) == (0, 1, 0, True)
    assert engine.cpu_group is engine.data_parallel_group is engine.context_and_model_parallel_group
    engine.set_version(7)
    assert engine.get_version() == 7
    assert engine.eval() is engine and not engine.training
    assert engine.train() is engine and engine.training
    assert engine.trainer.dtype == torch.float64 and engine.trainer.lr == 1e-2


@pytest.mark.parametrize("route", ["auto", "areal"])
def test_ppo_update_equals_dta_and_areals_loss(checkpoint, model64, rollouts, make_engine, route):
    config = actor_config(checkpoint[1])
    engine = make_engine(config, loss=route)
    trained = ppo_step(engine, rollouts)
    assert engine.trainer.step_count == 1
    direct = dta_direct(checkpoint[1], trained, config, "ppo")
    gradients = engine.trainer.gradients()
    if route == "auto":
        assert engine.last_loss_route == "dta:ppo"
        assert engine.last_stats["ppo_actor/update/dta_compression"] > 1  # the group prompts are shared
        assert_close(gradients, direct.gradients(), "gradients vs dta.Trainer")
        assert_close(parameters(engine.trainer), parameters(direct), "parameters vs dta.Trainer")
        assert_close(gradients, areal_reference(model64, trained, config, float32=False), "gradients vs AReaL")
    else:
        assert engine.last_loss_route == "areal: DTAOptions.loss='areal'"
        assert_close(gradients, areal_reference(model64, trained, config, float32=True), "gradients vs AReaL")
        # AReaL's loss runs in float32; dta's built-in one in float64.
        assert_close(gradients, direct.gradients(), "gradients vs dta.Trainer", relative=1e-5)


@pytest.mark.parametrize("route", ["auto", "areal"])
def test_decoupled_ppo_update_equals_dta_and_areals_loss(checkpoint, model64, rollouts, make_engine, route):
    cap = 1.2
    config = actor_config(checkpoint[1], use_decoupled_loss=True,
                          rejection_sampling=RejectionSamplingConfig(level="token", action="mask", metric="ratio",
                                                                     upper=cap))
    engine = make_engine(config, loss=route)
    trained = ppo_step(engine, rollouts)
    rows = rows_of(trained)
    weights = torch.cat([torch.exp(r["prox_logp"] - r["logprobs"])[r["loss_mask"].bool()] for r in rows])
    assert (weights > cap).any() and (weights <= cap).any(), "the cap must drop some tokens and keep others"
    gradients = engine.trainer.gradients()
    if route == "auto":
        assert engine.last_loss_route == "dta:decoupled-ppo"
        direct = dta_direct(checkpoint[1], trained, config, "decoupled-ppo", behave_imp_weight_cap=cap)
        assert_close(gradients, direct.gradients(), "gradients vs dta.Trainer")
        assert_close(parameters(engine.trainer), parameters(direct), "parameters vs dta.Trainer")
        # AReaL's pi_prox is compute_logp's float32 output and its rejection sampling computes
        # pi_prox / pi_behave from float32 log-ratios; dta recomputes pi_prox in float64.
        assert_close(gradients, areal_reference(model64, trained, config, float32=False), "gradients vs AReaL",
                     relative=1e-5)
    else:
        assert engine.last_loss_route.startswith("areal")
        assert_close(gradients, areal_reference(model64, trained, config, float32=True), "gradients vs AReaL")


@pytest.mark.parametrize("rejection", [None, dict(level="sequence", action="clamp", upper=1.02, lower=0.99),
                                       dict(level="token", action="mask", metric="kl_k3", upper=0.01)],
                         ids=["no-rejection", "sequence-clamp", "token-kl_k3"])
def test_decoupled_ppo_maps_any_rejection_sampling_to_dta(checkpoint, model64, rollouts, make_engine, rejection):
    """AReaL 1.0's decoupled loss without rejection sampling (no behaviour weight) and with other
    levels, actions and metrics than the cap: dta's built-in decoupled-ppo, equal to AReaL's loss
    (up to AReaL's float32 pi_prox)."""
    rs = None if rejection is None else RejectionSamplingConfig(**rejection)
    config = actor_config(checkpoint[1], use_decoupled_loss=True, rejection_sampling=rs)
    engine = make_engine(config)
    trained = ppo_step(engine, rollouts)
    assert engine.last_loss_route == "dta:decoupled-ppo"
    assert_close(engine.trainer.gradients(), areal_reference(model64, trained, config, float32=False),
                 "gradients vs AReaL", relative=1e-5)


@pytest.mark.parametrize("decoupled", [False, True], ids=["ppo", "decoupled-ppo"])
def test_the_built_in_loss_logs_areals_statistics_under_its_names(checkpoint, rollouts, make_engine, decoupled):
    """dta's built-in loss logs what AReaL's grpo_loss_fn logs (the callable-loss route runs it),
    under its names, from dta's whole-batch means: equal up to AReaL's float32 ratios."""
    overrides = dict(use_decoupled_loss=True, rejection_sampling=RejectionSamplingConfig(upper=1.2)) if decoupled \
        else {}
    config = actor_config(checkpoint[1], **overrides)
    built_in, areal = make_engine(config), make_engine(config, loss="areal")
    for engine in (built_in, areal):
        ppo_step(engine, rollouts)
    assert built_in.last_loss_route.startswith("dta:") and areal.last_loss_route.startswith("areal")
    got, want = built_in.last_stats, areal.last_stats
    names = ["importance_weight/avg", "importance_weight/min", "importance_weight/max", "approx_kl/avg",
             "clip_ratio/avg", "dual_clip_ratio/avg", "actor_loss/avg", "n_valid_tokens", "clipped_tokens",
             "dual_clipped_tokens", "version_stats/v_theta"]
    if decoupled:
        names += ["behave_imp_weight/avg", "behave_approx_kl/avg", "unclipped_behave_tokens"]
    else:  # decoupled, AReaL takes staleness over the tokens rejection sampling keeps; dta over all
        names += ["version_stats/n_valid_tokens"]
    for name in names:
        key = f"ppo_actor/update/{name}"
        assert key in got and key in want, key
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (key, got[key], want[key])
    if decoupled:  # pi_prox is the current policy: the behaviour weight is what varies
        assert got["ppo_actor/update/unclipped_behave_tokens"] < got["ppo_actor/update/n_valid_tokens"]
        assert got["ppo_actor/update/importance_weight/min"] == 0  # the rejected tokens
    else:
        assert got["ppo_actor/update/clip_ratio/avg"] > 0 and got["ppo_actor/update/approx_kl/avg"] != 0
    # AReaL logs these per micro-batch (per rollout on the callable route) as scalars, which its
    # tracker averages; the built-in route logs the whole batch's once.
    assert ("ppo_actor/update/rs_filtered_fraction" in got) == decoupled
    assert got["ppo_actor/update/version_stats/sample_staleness_theta_max"] == 2
    assert "ppo_actor/update/entropy/avg" not in got  # dta computes no entropy for ppo


def test_losses_dta_cannot_express_take_areals(checkpoint, model64, rollouts, make_engine):
    config = actor_config(checkpoint[1], use_sapo_loss=True)
    engine = make_engine(config)
    trained = ppo_step(engine, rollouts)
    assert engine.last_loss_route == "areal: use_sapo_loss=True"
    assert engine.last_stats["ppo_actor/update/sapo_soft_gate/avg"] > 0  # AReaL's loss logged its statistics
    assert_close(engine.trainer.gradients(), areal_reference(model64, trained, config, float32=True),
                 "SAPO vs AReaL")
    strict = make_engine(config, loss="dta")
    with pytest.raises(ValueError, match="use_sapo_loss=True"):
        ppo_step(strict, rollouts)
    assert strict.trainer.step_count == 0
    m2po = make_engine(actor_config(checkpoint[1], m2_threshold=0.5))
    with pytest.raises(NotImplementedError, match="M2PO"):
        ppo_step(m2po, rollouts)
    # AReaL keeps pi_prox for every minibatch; dta's decoupled-ppo would recompute it at each step
    two = make_engine(actor_config(checkpoint[1], ppo_n_minibatches=2, use_decoupled_loss=True,
                                   rejection_sampling=RejectionSamplingConfig(upper=1.2)))
    ppo_step(two, rollouts)
    assert "ppo_n_minibatches=2" in two.last_loss_route and two.trainer.step_count == 2


def test_compute_logp_is_transformers_in_the_logits_frame(checkpoint, model64, rollouts, make_engine):
    engine = make_engine(actor_config(checkpoint[1]))
    got = engine.compute_logp(copy.deepcopy(rollouts))
    assert [g.shape for g in got] == [r["input_ids"].shape for r in rollouts]
    rows = rows_of(rollouts)
    batched = engine.forward(concat_batch(copy.deepcopy(rollouts))[0])
    assert batched.shape == (len(rows), rows[0]["input_ids"].shape[1])
    assert batched.dtype == torch.float32  # as AReaL's engines give them
    with exact_float64(), torch.no_grad():
        for b, row in enumerate(rows):
            n = int(row["attention_mask"].sum())
            want = hf_logprobs(model64, row["input_ids"][0, :n].tolist())
            assert torch.allclose(batched[b, :n].double(), want, rtol=1e-7, atol=0), f"row {b}"
            assert not batched[b, n:].any()
    plain = engine.trainer.compute_logprobs([dta.from_areal(r, id=str(i), shifted=False) for i, r in enumerate(rows)])
    for b, lp in enumerate(plain):
        assert torch.equal(batched[b, :len(lp)], torch.roll(lp, -1).float())
    # The sampling temperature reaches every forward, as AReaL's engines apply it.
    hot = make_engine(actor_config(checkpoint[1], temperature=0.7))
    hot_batched = hot.forward(concat_batch(copy.deepcopy(rollouts))[0])
    tempered = hot.trainer.compute_logprobs([dta.from_areal(r, id=str(i), shifted=False) for i, r in enumerate(rows)],
                                            temperature=0.7)
    for b, lp in enumerate(tempered):
        assert torch.equal(hot_batched[b, :len(lp)], torch.roll(lp, -1).float())
        assert not torch.allclose(lp, plain[b])


def test_eval_batch_is_areals_loss_without_a_step(checkpoint, model64, rollouts, make_engine):
    config = actor_config(checkpoint[1], eps_clip=0.05)  # most ratios outside the clip
    engine = make_engine(config)
    before = parameters(engine.trainer)
    trained = engine.compute_advantages(copy.deepcopy(rollouts))
    mbs = [pack_tensor_dict(row) for row in rows_of(trained)]
    total = float(sum(mb["loss_mask"].count_nonzero() for mb in mbs))
    with exact_float64(), torch.no_grad():
        want = sum(grpo_loss_fn(lp, torch.zeros_like(lp), mb, **areal_loss_kwargs(config))
                   * float(mb["loss_mask"].count_nonzero()) / total
                   for mb in mbs for lp in [hf_logprobs(model64, mb["input_ids"].tolist()).float()])
    got = engine.eval_batch(trained, loss_fn=functools.partial(grpo_loss_fn, **areal_loss_kwargs(config)),
                            loss_weight_fn=lambda mb: mb["loss_mask"].count_nonzero())
    assert got.dtype == torch.float32 and got.item() == pytest.approx(want.item(), rel=1e-6)
    assert engine.trainer.step_count == 0
    assert_close(parameters(engine.trainer), before, "parameters", relative=0)


# --- checkpoints, weights, versions, schedule -----------------------------------------------------


@pytest.mark.parametrize("weight_format", ["hf", "dcp"])
def test_save_and_load_round_trip(checkpoint, rollouts, make_engine, tmp_path, weight_format):
    engine = make_engine(actor_config(checkpoint[1]))
    ppo_step(engine, rollouts)
    saved, step = parameters(engine.trainer), engine.trainer.step_count
    meta = SaveLoadMeta(path=str(tmp_path / "ckpt"), weight_format=weight_format, with_optim=True)
    engine.save(meta)
    if weight_format == "hf":  # what SGLang and AReaL's evaluation load: Hugging Face files at the path
        hf = Qwen3ForCausalLM.from_pretrained(meta.path, dtype=torch.float64)
        assert_close({n: p.detach() for n, p in hf.named_parameters()}, saved, "saved weights", relative=0)
    ppo_step(engine, rollouts)
    assert engine.trainer.step_count == step + 1
    engine.load(meta)
    assert engine.trainer.step_count == step
    assert_close(parameters(engine.trainer), saved, "restored weights", relative=0)
    # Weights only: the moments and the step count stay, the weights are the checkpoint's.
    ppo_step(engine, rollouts)
    engine.load(SaveLoadMeta(path=meta.path, weight_format=weight_format, with_optim=False))
    assert engine.trainer.step_count == step + 1
    assert_close(parameters(engine.trainer), saved, "weights loaded without the optimizer", relative=0)


def test_a_nonfinite_gradient_is_an_unsuccessful_update_that_changes_nothing(checkpoint, rollouts, make_engine):
    """AReaL's FSDP engine's rule: a gradient norm that is not finite zeroes the gradients, updates
    nothing and reports update_successful = 0; the next finite batch steps as usual."""
    engine = make_engine(actor_config(checkpoint[1]))
    before = parameters(engine.trainer)
    batch = engine.compute_advantages(copy.deepcopy(rollouts))
    weight = lambda mb: mb["loss_mask"].count_nonzero()  # noqa: E731 - PPOActor's
    nan_loss = lambda logprobs, entropy, mb, **kw: logprobs.sum() * float("nan")  # noqa: E731
    stats = engine.train_batch(copy.deepcopy(batch), loss_fn=nan_loss, loss_weight_fn=weight)
    assert stats["update_successful"] == 0.0 and not math.isfinite(stats["grad_norm"])
    assert engine.trainer.step_count == 0
    assert_close(parameters(engine.trainer), before, "parameters after a skipped step", relative=0)
    assert all(not g.any() for g in engine.trainer.gradients().values())  # zeroed, as AReaL does
    # optimizer_step on its own follows the same rule
    engine.trainer.parameters()["model.norm.weight"].grad[0] = float("inf")
    assert engine.optimizer_step()["update_successful"] == 0.0 and engine.trainer.step_count == 0
    assert not engine.trainer.parameters()["model.norm.weight"].grad.any()
    stats = engine.train_batch(batch, loss_fn=functools.partial(grpo_loss_fn, **areal_loss_kwargs(
        actor_config(checkpoint[1]))), loss_weight_fn=weight)
    assert stats["update_successful"] == 1.0 and engine.trainer.step_count == 1


class Inference(InferenceEngine):
    """AReaL's inference side, in process: rollouts are the fixture's; a disk weight update (an
    SGLang server's, as RemoteSGLangEngine drives it) waits for the trainer's announcement, then
    loads the checkpoint, here with transformers."""

    def __init__(self, experiment: str, trial: str, rollouts: list[dict]) -> None:
        self.experiment, self.trial, self.rollouts = experiment, trial, rollouts
        self.events: list[str] = []
        self.loaded: Qwen3ForCausalLM | None = None

    def rollout_batch(self, data, workflow, workflow_kwargs=None, group_size=1) -> list[dict]:
        return copy.deepcopy(self.rollouts)

    @property
    def initialized(self) -> bool:
        return True

    def get_version(self) -> int:
        return VERSION

    def pause_generation(self) -> None:
        self.events.append("pause")

    def continue_generation(self) -> None:
        self.events.append("continue")

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> Future:
        done: Future = Future()
        self.events.append("update")

        def load() -> None:
            try:
                name = names.update_weights_from_disk(self.experiment, self.trial, self.get_version())
                name_resolve.wait(name, timeout=60)
                self.loaded = Qwen3ForCausalLM.from_pretrained(meta.path, dtype=torch.float64)
                done.set_result(None)
            except Exception as e:  # noqa: BLE001 - handed to the waiting trainer
                done.set_exception(e)

        threading.Thread(target=load, daemon=True).start()
        return done


def test_update_weights_follows_areals_disk_protocol(checkpoint, rollouts, make_engine, tmp_path):
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(tmp_path / "names")))
    config = actor_config(checkpoint[1], weight_update_mode="disk")
    engine = make_engine(config)
    ppo_step(engine, rollouts)
    inference = Inference(config.experiment_name, config.trial_name, rollouts)
    meta = WeightUpdateMeta.from_disk(config.experiment_name, config.trial_name, str(tmp_path / "root"))
    engine.connect_engine(inference, meta)
    versioned = meta.with_version(VERSION + 1)
    engine.update_weights(versioned)
    engine.set_version(VERSION + 1)
    assert inference.events == ["pause", "update", "continue"]
    assert_close({n: p.detach() for n, p in inference.loaded.named_parameters()}, parameters(engine.trainer),
                 "weights the inference engine loaded", relative=0)
    assert engine.get_version() == VERSION + 1
    # AReaL's rollout coordinator over the engine's process group hands the batch back whole
    got = engine.rollout_batch([{}] * GROUPS, workflow=None)
    key = lambda d: d["input_ids"].tolist()  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, rollouts))
    with pytest.raises(NotImplementedError, match="weight_update_mode=disk or xccl"):
        engine.connect_engine(inference, WeightUpdateMeta(type="awex"))
    with pytest.raises(ValueError, match="gen_allocation is None"):
        engine.connect_engine(inference, WeightUpdateMeta(type="xccl"))


# One worker of an inference engine in its own process: joins the weight-update group as rank 1
# with AReaL's init_custom_process_group (as SGLang's and AReaL's vLLM workers do), receives each
# bucket's broadcasts in order and, at the end, saves what it received.
_WORKER = """
import json, sys, torch, torch.distributed as dist
from areal.engine.core.distributed import init_custom_process_group
init = json.loads(sys.stdin.readline())
group = init_custom_process_group(backend=init["backend"], world_size=init["world_size"], rank=1,
                                  init_method=init["init_method"], group_name=init["group_name"])
print("joined", flush=True)
received = []
for line in sys.stdin:
    specs = json.loads(line)
    if specs is None:
        break
    for name, shape, dtype in specs:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        dist.broadcast(tensor, src=0, group=group)
        received.append((name, tensor))
    print("bucket", flush=True)
torch.save(received, init["out"])
"""


class BroadcastInference(Inference):
    """An inference engine whose weights arrive over xccl: AReaL's init_weights_update_group and
    update_weights_from_distributed, answered by a worker process (above)."""

    def __init__(self, out: str, rollouts: list[dict]) -> None:
        super().__init__("x", "y", rollouts)
        self.out = out
        self.worker: subprocess.Popen | None = None
        self.buckets: list[list] = []

    def _answer(self, expected: str) -> Future:
        done: Future = Future()

        def read() -> None:
            line = self.worker.stdout.readline().strip()
            if line == expected:
                done.set_result(None)
            else:
                done.set_exception(RuntimeError(f"worker answered {line!r}"))

        threading.Thread(target=read, daemon=True).start()
        return done

    def init_weights_update_group(self, meta: WeightUpdateMeta, rank_ids=None) -> Future:
        self.events.append("init")
        self.worker = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        init = dict(backend="gloo", world_size=meta.gen_allocation.parallel.world_size + 1,
                    init_method=f"tcp://{meta.nccl_master_address}:{meta.nccl_master_port}",
                    group_name=meta.nccl_group_name, out=self.out)
        self.worker.stdin.write(json.dumps(init) + "\n")
        self.worker.stdin.flush()
        return self._answer("joined")

    def update_weights_from_distributed(self, meta: WeightUpdateMeta, param_specs) -> Future:
        self.events.append("update")
        specs = [[p.name, list(p.shape), p.dtype] for p in param_specs]
        self.buckets.append(specs)
        self.worker.stdin.write(json.dumps(specs) + "\n")
        self.worker.stdin.flush()
        return self._answer("bucket")

    def finish(self) -> list:
        self.worker.stdin.write("null\n")
        self.worker.stdin.close()
        assert self.worker.wait(timeout=60) == 0
        return torch.load(self.out)


def xccl_meta(bucket_mb: int = 1024) -> WeightUpdateMeta:
    return WeightUpdateMeta(type="xccl", weight_chunked_mem_mb=bucket_mb, gen_allocation=ModelAllocation(
        backend="sglang", name="rollout", parallel=ParallelStrategy(), scheduling_strategy=SchedulingStrategy()))


@pytest.mark.parametrize("bucket_mb,host", [(0, None), (1024, "127.0.0.1")],
                         ids=["a-bucket-per-tensor-at-areals-address", "one-bucket-at-weight_update_host"])
def test_update_weights_broadcasts_to_the_engines_workers_over_xccl(checkpoint, rollouts, make_engine, tmp_path,
                                                                    monkeypatch, bucket_mb, host):
    """AReaL's xccl protocol against a worker in another process: the group forms at connect_engine,
    at AReaL's choice of this host's address or at DTAOptions.weight_update_host (here 127.0.0.1,
    with AReaL's gethostip() failing as it does on a host without a route out); each update pauses,
    sends every weight once under its Hugging Face name in the config's dtype (bucket by bucket, the
    specs before the broadcasts), then continues; the worker holds exactly the trainer's weights."""
    if host is not None:
        def no_route() -> str:
            raise RuntimeError("Could not determine host IP")

        monkeypatch.setattr(dta.areal, "gethostip", no_route)
    config = actor_config(checkpoint[1], weight_update_mode="xccl")
    engine = make_engine(config, weight_update_host=host)
    ppo_step(engine, rollouts)
    inference = BroadcastInference(str(tmp_path / "received.pt"), rollouts)
    meta = xccl_meta(bucket_mb)
    engine.connect_engine(inference, meta)
    assert inference.events == ["init"]
    assert meta.nccl_master_address == (host or gethostip())
    engine.update_weights(meta)
    received = inference.finish()
    want = {name: p.detach().to(torch.float32) for name, p in engine.trainer.parameters().items()}  # config dtype
    assert [name for name, _ in received] == list(want)  # each once, in order
    for name, tensor in received:
        assert tensor.dtype == torch.float32 and torch.equal(tensor, want[name]), name
    assert len(inference.buckets) == (len(want) if bucket_mb == 0 else 1)
    assert inference.events == ["init", "pause", *["update"] * len(inference.buckets), "continue"]


def test_the_learning_rate_follows_areals_schedule(checkpoint, rollouts, make_engine):
    opt = OptimizerConfig(lr=1e-2, lr_scheduler_type="cosine", warmup_steps_proportion=0.2, min_lr_ratio=0.1)
    config = actor_config(checkpoint[1], optimizer=opt)
    engine = make_engine(config)
    clock = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=opt.lr)
    areal = get_cosine_schedule_with_warmup(clock, int(0.2 * FT_SPEC.total_train_steps),
                                            FT_SPEC.total_train_steps, min_lr_ratio=0.1)
    rates = []
    for _ in range(3):
        rates.append(areal.get_last_lr()[0])
        assert engine.trainer.lr == pytest.approx(rates[-1], rel=1e-15)
        clock.step()
        areal.step()
        engine.step_lr_scheduler()
    assert len(set(rates)) == 3  # a warmup, then the cosine
    batch = engine.compute_advantages(copy.deepcopy(rollouts))
    stats = engine.train_batch(batch, loss_fn=functools.partial(grpo_loss_fn, **areal_loss_kwargs(config)),
                               loss_weight_fn=lambda mb: mb["loss_mask"].count_nonzero())
    assert stats["lr"] == pytest.approx(areal.get_last_lr()[0], rel=1e-15)


# --- what must not train, and what raises ---------------------------------------------------------


def test_batches_that_train_nothing_or_are_in_the_wrong_frame_take_no_step(checkpoint, rollouts, make_engine):
    engine = make_engine(actor_config(checkpoint[1]))
    before = parameters(engine.trainer)
    weight = lambda mb: mb["loss_mask"].count_nonzero()  # noqa: E731 - PPOActor's
    trained = engine.compute_advantages(copy.deepcopy(rollouts))
    unmasked = [dict(d, loss_mask=torch.zeros_like(d["loss_mask"])) for d in trained]
    tokens_frame = [dict(d, advantages=torch.ones(d["loss_mask"].shape)) for d in copy.deepcopy(rollouts)]
    # loss_mask and logprobs rolled one position too far: trained tokens land on prompt versions
    too_far = [dict(d, loss_mask=torch.roll(d["loss_mask"], -1, -1), logprobs=torch.roll(d["logprobs"], -1, -1))
               for d in trained]
    cases = [([], "empty"), (unmasked, "sum to 0"), (tokens_frame, "tokens' frame"),
             (too_far, "its version is -1")]
    for batch, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.train_batch(batch, loss_fn=grpo_loss_fn, loss_weight_fn=weight)
    assert engine.trainer.step_count == 0
    assert_close(parameters(engine.trainer), before, "parameters", relative=0)


def test_what_cannot_apply_raises_naming_the_alternative(checkpoint, make_engine):
    engine = make_engine(actor_config(checkpoint[1]))
    with pytest.raises(NotImplementedError, match="train_batch, eval_batch or forward_batch"):
        engine.forward_backward_batch(None, lambda *a: None)
    for call in (engine.offload, engine.onload):
        with pytest.raises(NotImplementedError, match="actor.offload=false"):
            call()
    path = checkpoint[1]
    for overrides, message in ((dict(is_critic=True), "critic"), (dict(use_lora=True), "LoRA"),
                               (dict(dtype="float16"), "dtype")):
        with pytest.raises((NotImplementedError, ValueError), match=message):
            DTAPPOActor(actor_config(path, **overrides))
    # An allocation of more processes than torch.distributed has, and dimensions dta has no
    # counterpart for (AReaL's megatron and fsdp grammars), refused naming the field.
    with pytest.raises(ValueError, match=r"2 processes .* but torch.distributed has 1"):
        engine.create_process_group(ModelAllocation.from_str("fsdp:d2", name="actor").parallel)
    for backend, field in (("megatron:d1p2", "pipeline_parallel_size=2"), ("fsdp:d1c2", "context_parallel_size=2")):
        with pytest.raises(ValueError, match=field):
            engine.create_process_group(ModelAllocation.from_str(backend, name="actor").parallel)
    # The tiny model has 2 KV heads: tensor parallelism over 4 ranks cannot split them.
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide the model's num_key_value_heads"):
        engine.create_process_group(ModelAllocation.from_str("fsdp:t4", name="actor").parallel)


def test_the_ppo_trainer_builds_its_train_engines_on_dta(checkpoint, monkeypatch):
    monkeypatch.setenv("AREAL_SPMD_MODE", "1")  # engines in this process (not AReaL's RPC workers)
    trainer = DTAPPOTrainer.__new__(DTAPPOTrainer)  # the integration point only: no rollout servers
    trainer.dta_options, trainer.scheduler = DTAOptions(dtype="float64", device="cpu"), None
    config = actor_config(checkpoint[1])
    engine = trainer._create_train_engine(config, ModelAllocation.from_str(config.backend, name="actor"))
    try:
        assert isinstance(engine, DTAPPOActor) and engine.options.dtype == "float64"
        engine.initialize(None, FT_SPEC)
        assert engine.trainer.step_count == 0
    finally:
        engine.destroy()
    with pytest.raises(ValueError, match="actor.backend='fsdp:d2': 2 processes"):
        trainer._create_train_engine(actor_config(checkpoint[1], backend="fsdp:d2"),
                                     ModelAllocation.from_str("fsdp:d2", name="actor"))


# --- issue 42: traps an AReaL user hit ------------------------------------------------------------


def test_a_per_token_tensor_of_another_width_than_input_ids_is_refused_before_padding(checkpoint, rollouts,
                                                                                       make_engine):
    """One dict's loss_mask one column short of its input_ids: AReaL's concat_batch pads it to the
    batch's width, and the engine trained on a mask shifted against the tokens. Every entry point
    that takes AReaL's dicts refuses it before padding, naming the dict, its rows, the key and both
    lengths; nothing is trained."""
    config = actor_config(checkpoint[1])
    engine = make_engine(config)
    before = parameters(engine.trainer)
    loss = functools.partial(grpo_loss_fn, **areal_loss_kwargs(config))
    weight = lambda mb: mb["loss_mask"].count_nonzero()  # noqa: E731 - PPOActor's
    trained = engine.compute_advantages(copy.deepcopy(rollouts))
    width = trained[1]["input_ids"].shape[1]
    assert width < max(d["input_ids"].shape[1] for d in trained), "padding must reach dict 1"

    def cut(batch: list[dict], key: str, index: int = 1) -> list[dict]:
        batch = copy.deepcopy(batch)
        batch[index][key] = batch[index][key][:, :-1]
        return batch

    def message(key: str, dict_index: int = 1, got: int = width - 1, want: int = width) -> str:
        return (rf"dict {dict_index}, rows 0-2 \(rows {3 * dict_index}-{3 * dict_index + 2} of the batch\): field "
                rf"'{key}' has {got} positions per row but 'input_ids' has {want}")

    calls = [("train_batch", lambda b: engine.train_batch(b, loss_fn=loss, loss_weight_fn=weight), trained),
             ("eval_batch", lambda b: engine.eval_batch(b, loss_fn=loss, loss_weight_fn=weight), trained),
             ("forward_batch", engine.forward_batch, trained),
             ("compute_logp", engine.compute_logp, rollouts),
             ("compute_advantages", engine.compute_advantages, rollouts),
             ("ppo_update", engine.ppo_update, trained)]
    for what, call, batch in calls:
        for key in ("loss_mask", "logprobs", "attention_mask"):
            with pytest.raises(ValueError, match=f"{what}: {message(key)}"):
                call(cut(batch, key))
    # A key dta does not read is checked too (AReaL's loss and statistics read it); so are longer
    # tensors, and input_ids itself against the others.
    with pytest.raises(ValueError, match=f"train_batch: {message('kl_rewards')}"):
        engine.train_batch(cut(trained, "kl_rewards"), loss_fn=loss, loss_weight_fn=weight)
    longer = copy.deepcopy(trained)
    longer[2]["advantages"] = torch.cat([longer[2]["advantages"], torch.zeros(3, 1)], dim=1)
    wide = trained[2]["input_ids"].shape[1]
    with pytest.raises(ValueError, match="train_batch: " + message("advantages", 2, wide + 1, wide)):
        engine.train_batch(longer, loss_fn=loss, loss_weight_fn=weight)
    with pytest.raises(ValueError, match=f"ppo_update: {message('attention_mask', 1, width, width - 1)}"):
        engine.ppo_update(cut(trained, "input_ids"))
    # One dict per rollout ([1, L] each), and AReaL's padded batch as one dict.
    singles = [{k: v[b:b + 1] if torch.is_tensor(v) else v for k, v in d.items()} for d in trained for b in range(3)]
    singles[4]["loss_mask"] = singles[4]["loss_mask"][:, 1:]  # the first position lost: the rest shifted
    with pytest.raises(ValueError, match=r"train_batch: dict 4, row 0 \(row 4 of the batch\): field 'loss_mask' has"):
        engine.train_batch(singles, loss_fn=loss, loss_weight_fn=weight)
    padded, _ = concat_batch(copy.deepcopy(trained))
    padded["prox_logp"] = padded["prox_logp"][:, 1:]
    with pytest.raises(ValueError, match=r"train_batch: the batch, rows 0-8: field 'prox_logp' has"):
        engine.train_batch(padded, loss_fn=loss, loss_weight_fn=weight)
    padded["prox_logp"] = padded["prox_logp"][:5]
    with pytest.raises(ValueError, match=r"field 'prox_logp' is \[5, \d+\] but 'input_ids' is \[9, \d+\]"):
        engine.train_batch(padded, loss_fn=loss, loss_weight_fn=weight)
    assert engine.trainer.step_count == 0
    assert_close(parameters(engine.trainer), before, "parameters", relative=0)
    ppo_step(engine, rollouts)  # the batch as it is trains
    assert engine.trainer.step_count == 1


def test_a_gpu_device_without_a_visible_gpu_says_so(checkpoint, monkeypatch):
    """CUDA's own error (from the driver) does not say that no GPU is visible; the engine does, at
    initialize, naming the option."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    engine = DTAPPOActor(actor_config(checkpoint[1]), DTAOptions(dtype="float64", device="cuda"))
    engine.create_process_group()
    try:
        with pytest.raises(RuntimeError, match=r"DTAOptions.device='cuda' but no GPU is visible to this process "
                                               r"\(torch.cuda.is_available\(\) is False; CUDA_VISIBLE_DEVICES=''; "):
            engine.initialize(None, FT_SPEC)
        assert not engine.initialized
    finally:
        engine.destroy()


def test_areals_config_refuses_float64_and_dta_options_run_it(checkpoint, make_engine):
    """AReaL's TrainEngineConfig takes float32, bfloat16 and float16 only: float64 is
    DTAOptions(dtype="float64") over the config's float32, and a dtype dta cannot run names that."""
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        actor_config(checkpoint[1], dtype="float64")
    engine = make_engine(actor_config(checkpoint[1]))  # DTAOptions(dtype="float64")
    assert engine.config.dtype == "float32" and engine.trainer.dtype == torch.float64
    with pytest.raises(ValueError, match=r"DTAOptions.dtype must be one of bfloat16, float32, float64 or None, "
                                         r"got 'float16'"):
        DTAOptions(dtype="float16")
    with pytest.raises(ValueError, match=r"dtype 'float16'.*DTAOptions\(dtype='float64'\) with the config's float32"):
        DTAPPOActor(actor_config(checkpoint[1], dtype="float16"))


def foreign_address() -> str:
    """A documentation address (RFC 5737) that is not one of this host's: sandboxes use them."""
    for address in ("198.51.100.254", "203.0.113.254", "192.0.2.254"):
        with socket.socket() as probe:
            try:
                probe.bind((address, 0))
            except OSError:
                return address
    raise AssertionError("every RFC 5737 candidate is an address of this host")


def test_a_weight_update_host_that_is_not_this_hosts_is_refused_before_the_workers_join(checkpoint, rollouts,
                                                                                         make_engine, tmp_path):
    with pytest.raises(ValueError, match="DTAOptions.weight_update_host must be an address or name of this host"):
        DTAOptions(weight_update_host="")
    host = foreign_address()
    engine = make_engine(actor_config(checkpoint[1], weight_update_mode="xccl"), weight_update_host=host)
    inference = BroadcastInference(str(tmp_path / "received.pt"), rollouts)
    with pytest.raises(ValueError, match=f"DTAOptions.weight_update_host='{host}' is not an address of this host"):
        engine.connect_engine(inference, xccl_meta())
    assert inference.events == []  # no worker was asked to join

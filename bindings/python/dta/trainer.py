"""Training a Qwen3 model on trajectories with the C++ executor (dense, packed tree or dta).

Shaped after AReaL's ``TrainEngine.train_batch``: a batch of trajectories and a loss in, the
gradients of the whole batch computed at once (shared prefixes once with ``method="dta"`` or
``"packed"``), then one AdamW step::

    trainer = dta.Trainer("/models/Qwen3-0.6B", dtype="bfloat16", device="cuda", lr=1e-6)
    stats = trainer.train_batch(dta.read_jsonl("batch.jsonl"), loss="grpo", method="dta")
    print(stats.loss, stats.rollout_tokens_per_second)
    trainer.save("/ckpt/step-1")          # step-1/model (Hugging Face, bf16) + step-1/optimizer

Under torchrun one process per GPU, with the layout options of dta-train (tensor parallelism,
optimizer sharding and offload); every rank makes the same calls with the same whole batch::

    # torchrun --nproc_per_node=8 train.py
    trainer = dta.Trainer("/models/Qwen3-14B", dtype="bfloat16", device="cuda", distributed=True,
                          tensor_parallel=2)     # TP 2 x DP 4; the batch is split across the 4
    stats = trainer.train_batch(batch, loss="grpo")  # the whole batch's loss on every rank
    trainer.save("/ckpt/step-1")                 # every rank: gathered weights, its optimizer part

A loss is a name with options (:class:`LossOptions`), or a callable on one rollout's
log-probabilities (:data:`LossFn`). The batch loss is the sum over rollouts of each rollout's loss;
the gradients equal those of running every rollout on its own (to rounding), whatever the method.

Long calls release the GIL. One call at a time per trainer (calls from other threads wait).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from . import _core
from .trajectory import Trajectory

__all__ = ["Trainer", "TrainStats", "LossOptions", "RejectionSampling", "ExecutorOptions", "RolloutLossInput",
           "LossFn"]

_LOSS_KINDS = {
    "grpo": _core.LossKind.PPO,  # PPO clip with GRPO group advantages (from rewards) unless given
    "ppo": _core.LossKind.PPO,
    "sft": _core.LossKind.SFT,
    "decoupled-ppo": _core.LossKind.DECOUPLED_PPO,
    "gspo": _core.LossKind.GSPO,
}
_NORMALIZATIONS = {
    "token-mean": _core.Normalization.TOKEN_MEAN,
    "sequence-mean": _core.Normalization.SEQUENCE_MEAN,
    "sum": _core.Normalization.SUM,
}
_METHODS = {"dta": _core.Method.DTA, "dense": _core.Method.DENSE, "packed": _core.Method.PACKED}
_ORDERS = {"backward-dfs": _core.LeafOrder.BACKWARD_DFS, "lexicographic": _core.LeafOrder.LEXICOGRAPHIC}


def _name_of(names: dict[str, Any], value: Any) -> str:
    return next(name for name, v in names.items() if v == value)


# dta::ExecutorOptions as the C++ code default-constructs it: the source of every default below.
_CORE_EXECUTOR = _core.ExecutorOptions()
DEFAULT_METHOD = _name_of(_METHODS, _CORE_EXECUTOR.method)
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _choice(what: str, value: str, choices: dict[str, Any]) -> Any:
    if value not in choices:
        raise ValueError(f"{what} must be one of {', '.join(choices)}, got {value!r}")
    return choices[value]


def _dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"dtype must be float32, float64 or bfloat16, got {value}")
        return value
    return _choice("dtype", value, _DTYPES)


def _serialized(method: Callable[..., Any]) -> Callable[..., Any]:
    """One call at a time per trainer: train_batch's zero-gradients, gradients and step are one
    unit that another thread's call cannot interleave with."""
    @functools.wraps(method)
    def locked(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


_ADVANTAGE_LEVELS = {"group": _core.AdvantageLevel.GROUP, "batch": _core.AdvantageLevel.BATCH,
                     "none": _core.AdvantageLevel.NONE}
_REJECTION = {
    "level": {"token": _core.RejectionLevel.TOKEN, "sequence": _core.RejectionLevel.SEQUENCE},
    "action": {"mask": _core.RejectionAction.MASK, "clamp": _core.RejectionAction.CLAMP},
    "metric": {"ratio": _core.RejectionMetric.RATIO, "kl_k1": _core.RejectionMetric.KL_K1,
               "kl_k2": _core.RejectionMetric.KL_K2, "kl_k3": _core.RejectionMetric.KL_K3},
    "aggregation": {"sum": _core.RejectionAggregation.SUM, "mean": _core.RejectionAggregation.MEAN,
                    "max": _core.RejectionAggregation.MAX},
}


@dataclass(frozen=True)
class RejectionSampling:
    """AReaL 1.0's rejection sampling of stale tokens (its ``RejectionSamplingConfig``), for
    ``decoupled-ppo``: on the divergence between the proximal policy and the behaviour policy
    (``lr = prox - old``), per token (``level="token"``) or per trajectory (``"sequence"``, through
    ``aggregation`` of the tokens' values: in log space for the ratio), tokens out of
    ``[lower, upper]`` contribute nothing (``action="mask"``) or have their behaviour weight
    clamped to it (``"clamp"``). ``metric``: ``ratio`` (exp(lr)), ``kl_k1`` (lr), ``kl_k2``
    (lr^2 / 2), ``kl_k3`` (exp(-lr) - 1 + lr). executor/loss/loss.h says exactly what each does.
    """

    level: str = "token"
    action: str = "mask"
    metric: str = "ratio"
    aggregation: str = "mean"
    upper: float = 5.0
    lower: float | None = None

    def _to_core(self) -> Any:
        core = _core.RejectionSampling()
        for name, choices in _REJECTION.items():
            setattr(core, name, _choice(f"rejection_sampling.{name}", getattr(self, name), choices))
        core.upper = float(self.upper)
        core.lower = None if self.lower is None else float(self.lower)
        return core


@dataclass(frozen=True)
class LossOptions:
    """Options of the named losses (executor/loss/loss.h says exactly what each does).

    Attributes:
        normalization: ``token-mean`` (divide by the batch's loss tokens), ``sequence-mean``
            (each rollout's token mean, divided by the rollouts) or ``sum``.
        eps_clip_low, eps_clip_high: PPO ratio clipped to [1 - low, 1 + high].
        dual_clip: c > 1 caps the loss of negative advantages at -c A; 0 = off.
        behave_imp_weight_cap: Decoupled PPO: tokens whose pi_prox / pi_behave exceeds it are
            dropped; 0 = no cap.
        entropy_coef: loss -= entropy_coef * entropy.
        kl_coef: loss += kl_coef * k3 KL to the trajectories' ``ref_logprobs``.
        gspo_eps_low, gspo_eps_high: GSPO's sequence-ratio clip range.
        behave_imp_weight: Decoupled PPO: multiply by the behaviour importance weight
            pi_prox / pi_behave (the AReaL paper, AReaL <= 0.5); False: no weight (AReaL 1.0
            without rejection sampling).
        rejection_sampling: Decoupled PPO: a :class:`RejectionSampling` (AReaL 1.0's), or None.
        reward_bias, reward_scaling, reward_clip: Rewards are shaped as AReaL's PPO actor does,
            ``clip((reward + bias) * scaling, -clip, clip)``, before they become advantages.
        adv_mean_level, adv_std_level: Advantages are centred on / divided by the std over the
            trajectory's ``group`` (GRPO, the default), the whole ``batch``, or ``none``.
        adv_std_eps: ``A = (r - mean) / (std + eps)``.
        adv_token_weighted: Mean and std count each trajectory once per loss token, as AReaL's
            ``adv_norm`` does over its padded batch, instead of once (GRPO).
        with_entropy: Compute the entropy even when ``entropy_coef`` is 0: a callable loss then gets
            it (``RolloutLossInput.entropy``, differentiable) and ``TrainStats.entropy`` is set.
        with_proximal: Give a callable loss the proximal log-probabilities (the policy before this
            step; ``RolloutLossInput.proximal_logprobs``): one extra forward-only pass.
        router_aux_loss_coef: Mixture-of-experts models: loss += coef * the mean over the batch's
            trajectories of each one's router load-balancing loss, as transformers' ``aux_loss``
            (``output_router_logits``) computes it for that trajectory alone; 0 = off. Reported as
            ``TrainStats.router_aux_loss``.

    Advantage options, ``with_entropy`` / ``with_proximal`` and ``router_aux_loss_coef`` apply to
    callable losses too.
    """

    normalization: str = "token-mean"
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    dual_clip: float = 0.0
    behave_imp_weight_cap: float = 0.0
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    gspo_eps_low: float = 3e-4
    gspo_eps_high: float = 4e-4
    behave_imp_weight: bool = True
    rejection_sampling: RejectionSampling | None = None
    reward_bias: float = 0.0
    reward_scaling: float = 1.0
    reward_clip: float = float("inf")
    adv_mean_level: str = "group"
    adv_std_level: str = "group"
    adv_std_eps: float = 1e-6
    adv_token_weighted: bool = False
    with_entropy: bool = False
    with_proximal: bool = False
    router_aux_loss_coef: float = 0.0

    def _to_core(self, kind: str | None) -> Any:
        """The C++ options; kind None: for a callable loss (only the fields that apply to one)."""
        core = _core.LossOptions()
        if kind is not None:
            core.kind = _choice("loss", kind, _LOSS_KINDS)
            core.normalization = _choice("normalization", self.normalization, _NORMALIZATIONS)
            for name in _FLOAT_LOSS_OPTIONS:
                setattr(core, name, float(getattr(self, name)))
            core.behave_imp_weight = bool(self.behave_imp_weight)
            if self.rejection_sampling is not None:
                if not isinstance(self.rejection_sampling, RejectionSampling):
                    raise TypeError("rejection_sampling must be a dta.RejectionSampling, got "
                                    f"{type(self.rejection_sampling).__name__}")
                core.rejection_sampling = self.rejection_sampling._to_core()
        advantages = _core.AdvantageOptions()
        advantages.reward_bias = float(self.reward_bias)
        advantages.reward_scaling = float(self.reward_scaling)
        advantages.reward_clip = float(self.reward_clip)
        advantages.mean_level = _choice("adv_mean_level", self.adv_mean_level, _ADVANTAGE_LEVELS)
        advantages.std_level = _choice("adv_std_level", self.adv_std_level, _ADVANTAGE_LEVELS)
        advantages.std_eps = float(self.adv_std_eps)
        advantages.token_weighted = bool(self.adv_token_weighted)
        core.advantages = advantages
        core.with_entropy = bool(self.with_entropy)
        core.with_proximal = bool(self.with_proximal)
        core.router_aux_loss_coef = float(self.router_aux_loss_coef)
        return core


_FLOAT_LOSS_OPTIONS = ("eps_clip_low", "eps_clip_high", "dual_clip", "behave_imp_weight_cap", "entropy_coef",
                       "kl_coef", "gspo_eps_low", "gspo_eps_high")
# What a callable loss may be given besides itself.
_CALLABLE_LOSS_OPTIONS = {"reward_bias", "reward_scaling", "reward_clip", "adv_mean_level", "adv_std_level",
                          "adv_std_eps", "adv_token_weighted", "with_entropy", "with_proximal",
                          "router_aux_loss_coef"}


@dataclass(frozen=True)
class ExecutorOptions:
    """How the batch is executed (executor/engine/executor.h).

    Attributes:
        block_size: dta: B, the most tokens per backward chunk; 0 = unbounded; -1 = automatic (the
            default: the longest rollout if its graph fits in the free GPU memory, else what fits;
            with packing at least 8192 tokens, doubled on a GPU while the schedule recomputes no
            more tokens, and for mixture-of-experts models all that fits).
        graph_budget: dta: tokens whose graphs are kept instead of recomputed; -1 = from the GPU's
            free memory (0 on the CPU).
        memory_budget: dta on a GPU: the most device memory a step may hold, GiB (weights,
            gradients and optimizer state included); the automatic block size and graph budget are
            the largest that fit, explicit ones are lowered to fit; 0 = no budget.
        pack: dta: pack runs of small complete subtrees into one tree-masked forward (the default,
            the fastest on a GPU); False runs AReaL-DTA's schedule as the paper gives it.
        order: dta: leaf order, ``backward-dfs`` (AReaL-DTA Algorithm 1) or ``lexicographic``.
        unshared_prefix_fraction: dta: a prefix shared by rollouts is recomputed for each instead
            when it is at most this fraction of the shorter one and that one continues past it for
            at least 4096 tokens (a short prompt before long answers: they then run as chains, as
            dense runs them); 0 shares every prefix. The gradient is the same either way.
        token_capacity: packed: the most unique tokens per packed forward (0 = the whole tree).
        checkpointing: dense and packed: activation checkpointing.
        temperature: Log-probabilities (and entropy) of softmax(logits / temperature): the
            temperature the trajectories were sampled at, as AReaL applies it in training.
    """

    # The defaults are the C++ struct's (dta::ExecutorOptions), read from the extension, so that
    # Python, dta-train and dta-bench cannot drift apart (tests/python/test_trainer.py checks).
    block_size: int = 0 if _CORE_EXECUTOR.block_size == _core.UNBOUNDED_BLOCK else _CORE_EXECUTOR.block_size
    graph_budget: int = _CORE_EXECUTOR.graph_budget
    memory_budget: float = _CORE_EXECUTOR.memory_budget / 2**30
    pack: bool = _CORE_EXECUTOR.pack
    order: str = _name_of(_ORDERS, _CORE_EXECUTOR.order)
    unshared_prefix_fraction: float = _CORE_EXECUTOR.unshared_prefix_fraction
    token_capacity: int = _CORE_EXECUTOR.token_capacity
    checkpointing: bool = _CORE_EXECUTOR.checkpointing
    temperature: float = _CORE_EXECUTOR.temperature

    def _to_core(self, method: str) -> Any:
        if self.block_size < -1 or self.graph_budget < -1 or self.token_capacity < 0:
            raise ValueError("block_size and graph_budget must be >= -1, token_capacity >= 0")
        if not 0 <= self.memory_budget < float("inf"):
            raise ValueError(f"memory_budget must be >= 0 GiB (0 = no budget), got {self.memory_budget}")
        if not 0 <= self.unshared_prefix_fraction < float("inf"):
            raise ValueError(f"unshared_prefix_fraction must be >= 0 and finite, got {self.unshared_prefix_fraction}")
        if not self.temperature > 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be positive and finite, got {self.temperature}")
        core = _core.ExecutorOptions()
        core.method = _choice("method", method, _METHODS)
        core.block_size = _core.UNBOUNDED_BLOCK if self.block_size == 0 else int(self.block_size)
        core.graph_budget = int(self.graph_budget)
        core.memory_budget = int(self.memory_budget * 2**30)
        core.pack = bool(self.pack)
        core.order = _choice("order", self.order, _ORDERS)
        core.unshared_prefix_fraction = float(self.unshared_prefix_fraction)
        core.token_capacity = int(self.token_capacity)
        core.checkpointing = bool(self.checkpointing)
        core.temperature = float(self.temperature)
        return core


_LOSS_OPTION_NAMES = {f.name for f in dataclasses.fields(LossOptions)}
_EXECUTOR_OPTION_NAMES = {f.name for f in dataclasses.fields(ExecutorOptions)}


def _split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    loss, executor = {}, {}
    for name, value in options.items():
        if name in _LOSS_OPTION_NAMES:
            loss[name] = value
        elif name in _EXECUTOR_OPTION_NAMES:
            executor[name] = value
        else:
            raise TypeError(f"unknown option {name!r} (loss options: {', '.join(sorted(_LOSS_OPTION_NAMES))}; "
                            f"executor options: {', '.join(sorted(_EXECUTOR_OPTION_NAMES))})")
    return loss, executor


class RolloutLossInput:
    """What a callable loss gets besides the log-probabilities: one rollout and the batch.

    Per-token tensors are [L], on the log-probabilities' device and (floats) in their dtype, with
    the values rounded to float32 first, as the executor stores them (so a callable that restates a
    built-in loss computes exactly what it does).

    Attributes:
        trajectory: The rollout as given to ``train_batch``.
        index: Its position in the batch.
        advantages: GRPO group advantages over the batch (or the trajectory's own), when every
            trajectory of the batch has a reward or advantages; else None.
        total_loss_tokens: N, the batch's tokens with loss_mask 1 (for a token mean).
        num_rollouts: R, the batch's rollouts.
        entropy: The current policy's per-token entropy [L] (differentiable, like the
            log-probabilities; position 0 holds 0) with ``with_entropy=True``, else None.
        proximal_logprobs: The proximal policy's log-probabilities [L] (the weights before this
            step, constant) with ``with_proximal=True``, else None.
    """

    def __init__(self, trajectory: Trajectory, index: int, advantages: torch.Tensor | None,
                 total_loss_tokens: float, num_rollouts: int, logprobs: torch.Tensor,
                 entropy: torch.Tensor | None = None, proximal_logprobs: torch.Tensor | None = None) -> None:
        self.trajectory = trajectory
        self.index = index
        self.advantages = advantages
        self.total_loss_tokens = total_loss_tokens
        self.num_rollouts = num_rollouts
        self.entropy = entropy
        self.proximal_logprobs = proximal_logprobs
        self._options = {"dtype": logprobs.dtype, "device": logprobs.device}

    @functools.cached_property
    def loss_mask(self) -> torch.Tensor:
        """bool [L]: the tokens to train."""
        return torch.as_tensor(self.trajectory.loss_mask).to(dtype=torch.bool, device=self._options["device"])

    def _floats(self, values: Any) -> torch.Tensor:
        # A list, a numpy array or a tensor (torch.tensor of a tensor would warn and copy twice).
        return torch.as_tensor(values, dtype=torch.float32).to(**self._options)

    @functools.cached_property
    def old_logprobs(self) -> torch.Tensor:
        """The behaviour policy's log-probabilities (the trajectory's ``logprobs``)."""
        return self._floats(self.trajectory.logprobs)

    @functools.cached_property
    def ref_logprobs(self) -> torch.Tensor | None:
        """The reference policy's log-probabilities, or None when the trajectory has none."""
        ref = self.trajectory.ref_logprobs
        return self._floats(ref) if ref is not None and len(ref) > 0 else None


# A loss on one rollout: its current log-probabilities [L] (requiring grad; position 0 holds 0 and
# has no prediction) and the rollout, to a scalar tensor. The batch loss is the sum over rollouts,
# so normalise inside (e.g. divide by `rollout.total_loss_tokens` for a token mean). It must not
# call back into the trainer.
LossFn = Callable[[torch.Tensor, RolloutLossInput], torch.Tensor]


@dataclass(frozen=True)
class TrainStats:
    """One batch's statistics.

    Attributes:
        loss: The batch loss (the sum over rollouts of each rollout's normalised loss).
        rollout_tokens: Every rollout's tokens.
        tree_tokens: The batch's unique tokens (its prefix tree's).
        forwarded_tokens: Tokens pushed through the model, recomputation included.
        router_aux_loss: With ``router_aux_loss_coef``: the mean over the trajectories of their
            router load-balancing losses (without the coefficient; ``loss`` includes coef times
            it); 0 when off.
        replay_split_tokens: Routing replay: the unique tokens the batch's tree gained because
            trajectories were routed differently on tokens they share (such prefixes are not
            shared); 0 without routed experts.
        seconds: Wall time (gradients, plus the optimizer step for train_batch).
        method: ``dta``, ``dense`` or ``packed``.
        grad_norm: Global gradient norm before clipping (train_batch only, else None).
        clip_coef: The clipping factor applied (train_batch only).
        step: The optimizer's step count after the step (train_batch only).
        lr: The learning rate the step used (train_batch only).
        skipped: The gradient norm was not finite and the step updated nothing (train_batch with
            ``Trainer(nonfinite_gradients="skip")`` only).

    RL diagnostics, as AReaL's PPO actor logs them, over the batch's loss tokens (None where they
    do not apply: a ratio for ``sft``, anything but the entropy for a callable loss):
        clip_fraction: Tokens whose clipped surrogate was the larger (GSPO: whole sequences).
        dual_clip_fraction: Tokens the dual clip bounded.
        approx_kl: Mean of log pi - log pi_base (pi_base: the proximal policy for decoupled PPO,
            else the behaviour policy's ``logprobs``), the current weights before the step.
        ratio_mean, ratio_max, ratio_min: The importance ratio pi / pi_base.
        entropy: Mean entropy of the current policy (when computed: ``entropy_coef`` or
            ``with_entropy``).
        rejected_fraction: Decoupled PPO: tokens rejection sampling (or the cap) dropped or clamped.
        behave_imp_weight: Decoupled PPO: mean pi_prox / pi_behave over the kept tokens.
        behave_approx_kl: Decoupled PPO: mean log pi_prox - log pi_behave over the kept tokens.
    """

    loss: float
    rollout_tokens: int
    tree_tokens: int
    forwarded_tokens: int
    seconds: float
    method: str
    router_aux_loss: float = 0.0
    replay_split_tokens: int = 0
    grad_norm: float | None = None
    clip_coef: float | None = None
    step: int | None = None
    lr: float | None = None
    skipped: bool = False
    clip_fraction: float | None = None
    dual_clip_fraction: float | None = None
    approx_kl: float | None = None
    ratio_mean: float | None = None
    ratio_max: float | None = None
    ratio_min: float | None = None
    entropy: float | None = None
    rejected_fraction: float | None = None
    behave_imp_weight: float | None = None
    behave_approx_kl: float | None = None

    @property
    def compression(self) -> float:
        """C = rollout tokens / tree tokens."""
        return self.rollout_tokens / self.tree_tokens if self.tree_tokens else 0.0

    @property
    def rollout_tokens_per_second(self) -> float:
        return self.rollout_tokens / self.seconds if self.seconds > 0 else 0.0


def _scalars(stats: TrainStats) -> list[tuple[str, float]]:
    """TrainStats' numbers as TensorBoard scalars (those that apply)."""
    numbers = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats) if f.name not in ("method", "step")}
    numbers.update(compression=stats.compression, rollout_tokens_per_second=stats.rollout_tokens_per_second)
    return [(name, float(value)) for name, value in numbers.items() if value is not None]


def _diagnostics(d: dict[str, float]) -> dict[str, float | None]:
    """TrainStats' diagnostic fields from the extension's sums (None where nothing was counted)."""
    def mean(total: str, count: str) -> float | None:
        return d[total] / d[count] if d[count] > 0 else None

    has_ratio = d["ratio_max"] >= d["ratio_min"]  # a ratio was taken on some token
    behave = d["behave_tokens"] > 0 or d["rejected_tokens"] > 0
    out = {
        "clip_fraction": mean("clipped_tokens", "loss_tokens") if has_ratio else None,
        "dual_clip_fraction": mean("dual_clipped_tokens", "loss_tokens") if has_ratio else None,
        "approx_kl": mean("approx_kl", "loss_tokens") if has_ratio else None,
        "ratio_mean": mean("ratio", "loss_tokens") if has_ratio else None,
        "ratio_max": d["ratio_max"] if has_ratio else None,
        "ratio_min": d["ratio_min"] if has_ratio else None,
        "entropy": mean("entropy", "entropy_tokens"),
        "rejected_fraction": mean("rejected_tokens", "loss_tokens") if behave else None,
        "behave_imp_weight": mean("behave_weight", "behave_tokens") if behave else None,
        "behave_approx_kl": mean("behave_approx_kl", "behave_tokens") if behave else None,
    }
    return out


class Trainer:
    """A decoder of any family dta builds, its AdamW optimizer and the executor, in this process.

    Not copyable; parameters and gradients are live torch tensors shared with the executor.
    Errors in trajectories raise ValueError naming the trajectory and the field; errors from the
    executor (a broken checkpoint, a GPU failure) raise RuntimeError.
    """

    def __init__(self, model: str | os.PathLike[str], *, dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu", lr: float = 1e-6, weight_decay: float = 0.01,
                 max_grad_norm: float = 1.0, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, distributed: bool = False, tensor_parallel: int = 1,
                 shard_optimizer: bool | str = "auto", offload_optimizer: bool | str = "auto",
                 offload_update: str = "gpu", offload_resident_gb: float | str = "auto", gpu_memory_gb: float = 0.0,
                 activation_gb: float | None = None, longest_rollout: int = 8192,
                 timeout_s: int = 600, nonfinite_gradients: str = "raise", progress: str = "auto",
                 tensorboard_dir: str | os.PathLike[str] | None = None) -> None:
        """Loads a Hugging Face directory of a family dta builds (config.json + model.safetensors
        or shards; docs/usage.md, "Model families", lists the families and says what is refused).

        Args:
            model: The directory.
            dtype: ``float32``, ``float64`` or ``bfloat16`` (or the torch dtype); stored weights
                are converted.
            device: ``cpu``, ``cuda``, ``cuda:N``.
            lr, weight_decay, max_grad_norm, betas, eps: AdamW (decoupled weight decay; global
                gradient-norm clip, <= 0 disables it).
            distributed: Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``,
                ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; ``cuda`` then means
                ``cuda:LOCAL_RANK``; NCCL on GPUs, Gloo on CPUs). Every rank then makes the same
                calls with the same whole batch: the batch is split across the data-parallel
                replicas (DFS-contiguous, advantages and normalisers over the whole batch) and the
                result is what one process would train.
            tensor_parallel: Split each replica's weights across this many consecutive ranks
                (heads, MLP, vocabulary; it must divide the KV heads and the world size, within
                a node); 0: the planner's choice. As dta-train --tensor_parallel.
            shard_optimizer: Shard AdamW's state across the data-parallel ranks (ZeRO-1):
                ``"auto"`` (the planner's choice), True or False.
            offload_optimizer: Keep AdamW's state (float32 master weights and both moments, 12
                bytes per parameter) in host memory and update it there, so that the GPU holds
                only the weights and the gradients: ``"auto"``, True or False.
            offload_update: Where offloaded state is updated when the model is on a GPU:
                ``"gpu"`` streams it through the GPU from page-locked host memory (3x faster than
                ``"host"`` for Qwen3-8B on an H200), ``"host"`` updates it on the host's cores
                (as on a CPU). As dta-train --offload_update; ``offload_description`` says which
                runs.
            offload_resident_gb: With offloaded state streamed through a GPU: GB (1e9 bytes) of it
                that stay on the GPU, updated there without crossing the bus; ``"auto"`` (what the
                GPU holds beside the rest of the layout, less 5% headroom) or a number (0: none).
                As dta-train --offload_resident_gb; ``offload_description`` says how much stays.
            gpu_memory_gb, activation_gb: What the planner may use per GPU (0: the device's) and
                reserves for the executor's stack, graphs and workspace (None: the executor's own
                peak, estimated from the model's shape for dta with automatic block size and graph
                budget on rollouts of up to ``longest_rollout`` tokens;
                core/layout/executor_memory.h). The
                planner refuses a layout that cannot fit with a RuntimeError naming the numbers
                (``trainer.layout`` describes the chosen one).
            longest_rollout: The longest rollout (tokens) the estimate plans for (dta-train's
                --longest_rollout; 8,192 by default, tau2-like agent rollouts).
            timeout_s: Collectives' and the rendezvous' timeout (distributed).
            nonfinite_gradients: What a step does when the global gradient norm is NaN or
                infinite: ``"raise"`` (RuntimeError naming the parameter) or ``"skip"`` (no
                update, the step count stays; ``TrainStats.skipped`` / ``step()["skipped"]`` say
                so, as AReaL's engines report ``update_successful = 0``). Nothing is updated
                either way.
            progress: Progress lines on stderr within long calls (tokens done, rate, ETA; rank 0):
                ``"auto"`` (on a terminal only), ``"always"`` or ``"never"``, as dta-train
                --progress. Settable later through the ``progress`` attribute.
            tensorboard_dir: Write every ``train_batch``'s numbers (TrainStats' fields,
                ``compression``, ``rollout_tokens_per_second``, ``skipped``) at its step as
                TensorBoard scalars into this directory (rank 0), as dta-train --tensorboard_dir.

        Raises:
            FileNotFoundError: No such directory.
            RuntimeError: ``device`` is a GPU but no GPU is visible to this process, or its index
                (``LOCAL_RANK`` for ``cuda`` with ``distributed``) is not below the visible GPUs'
                count (naming ``CUDA_VISIBLE_DEVICES``); the checkpoint is invalid (naming the file
                and the tensor), or the layout cannot be built.
        """
        if not Path(model).is_dir():
            raise FileNotFoundError(f"{model}: not a directory (expected a Hugging Face Qwen3 checkpoint)")
        parallel = _parallel_options(distributed, tensor_parallel, shard_optimizer, offload_optimizer,
                                     offload_update, offload_resident_gb, gpu_memory_gb, activation_gb,
                                     longest_rollout, timeout_s)
        _check_device(device, distributed)
        self._init(lambda d, dev, a: _core.Trainer.from_directory(str(model), d, dev, a, parallel),
                   dtype, device, lr, weight_decay, max_grad_norm, betas, eps, nonfinite_gradients, progress,
                   tensorboard_dir)

    @staticmethod
    def presets() -> list[str]:
        """The preset names ``from_config`` accepts (released model shapes and benchmark shapes)."""
        return list(_core.model_presets())

    @staticmethod
    def model_families() -> list[str]:
        """The config.json ``model_type`` values dta builds, sorted."""
        return list(_core.model_families())

    @classmethod
    def from_config(cls, config: str | os.PathLike[str], *, seed: int = 1, init_std: float = 0.02,
                    dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu", lr: float = 1e-6,
                    weight_decay: float = 0.01, max_grad_norm: float = 1.0,
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, distributed: bool = False,
                    tensor_parallel: int = 1, shard_optimizer: bool | str = "auto",
                    offload_optimizer: bool | str = "auto", offload_update: str = "gpu",
                    offload_resident_gb: float | str = "auto", gpu_memory_gb: float = 0.0,
                    activation_gb: float | None = None, longest_rollout: int = 8192, timeout_s: int = 600,
                    nonfinite_gradients: str = "raise", progress: str = "auto",
                    tensorboard_dir: str | os.PathLike[str] | None = None) -> Trainer:
        """A model with deterministic random weights from a preset (one of ``Trainer.presets()``,
        e.g. ``qwen3-0.6b``) or a config.json of a family dta builds (``Trainer.model_families()``),
        the same model at every tensor-parallel size; other arguments as the constructor's.

        Raises:
            RuntimeError: Neither a preset nor a valid config.json (naming it), or a GPU ``device``
                that is not visible (as the constructor).
        """
        self = cls.__new__(cls)
        parallel = _parallel_options(distributed, tensor_parallel, shard_optimizer, offload_optimizer,
                                     offload_update, offload_resident_gb, gpu_memory_gb, activation_gb,
                                     longest_rollout, timeout_s)
        _check_device(device, distributed)
        self._init(lambda d, dev, a: _core.Trainer.from_config(str(config), seed, init_std, d, dev, a, parallel),
                   dtype, device, lr, weight_decay, max_grad_norm, betas, eps, nonfinite_gradients, progress,
                   tensorboard_dir)
        return self

    def _init(self, make: Callable[[torch.dtype, torch.device, Any], Any], dtype: str | torch.dtype,
              device: str | torch.device, lr: float, weight_decay: float, max_grad_norm: float,
              betas: tuple[float, float], eps: float, nonfinite_gradients: str, progress: str,
              tensorboard_dir: str | os.PathLike[str] | None) -> None:
        if nonfinite_gradients not in ("raise", "skip"):
            raise ValueError(f"nonfinite_gradients must be 'raise' or 'skip', got {nonfinite_gradients!r}")
        if progress not in ("auto", "always", "never"):
            raise ValueError(f"progress must be 'auto', 'always' or 'never', got {progress!r}")
        self._skip_nonfinite = nonfinite_gradients == "skip"
        adamw = _core.AdamWOptions()
        adamw.lr, adamw.weight_decay, adamw.max_grad_norm = float(lr), float(weight_decay), float(max_grad_norm)
        adamw.beta1, adamw.beta2 = (float(b) for b in betas)
        adamw.eps = float(eps)
        self._lock = threading.RLock()
        self._dtype = _dtype(dtype)
        self._core = make(self._dtype, torch.device(device), adamw)
        self._core.progress = progress
        self._device = self._core.device
        self._config: dict[str, Any] = json.loads(self._core.config_json())
        self._tensorboard = (_core.TensorBoardWriter(str(tensorboard_dir))
                             if tensorboard_dir is not None and self._core.rank == 0 else None)

    # --- training -----------------------------------------------------------------------------

    @_serialized
    def train_batch(self, trajectories: Sequence[Trajectory], loss: str | LossFn = "grpo", method: str = DEFAULT_METHOD,
                    **options: Any) -> TrainStats:
        """Zeroes the gradients, computes the batch's gradients and steps AdamW.

        Args:
            trajectories: The batch (validated against the model's vocabulary).
            loss: ``grpo`` / ``ppo`` (clipped surrogate; advantages from group rewards unless the
                trajectories carry them), ``sft``, ``decoupled-ppo``, ``gspo``; or a :data:`LossFn`.
            method: ``dta`` (push/pop over the prefix tree), ``packed`` (Tree Training) or
                ``dense`` (every rollout on its own).
            **options: Fields of :class:`LossOptions` and :class:`ExecutorOptions`.

        Returns:
            The loss, token counts, time and the optimizer step's gradient norm.

        Raises:
            ValueError: A bad trajectory (``trajectory 3 ('r7'): field 'loss_mask': ...``), two
                trajectories with one id, an empty batch or one without a trained token (nothing is
                computed and the optimizer does not step), a bad option value, or a grpo batch
                where a trajectory has neither reward nor advantages.
            TypeError: An unknown option.
            Whatever a callable loss raises.
        """
        start = time.perf_counter()
        stats = self.compute_gradients(trajectories, loss, method, **options)
        step = self._core.step(self._skip_nonfinite)
        self._synchronize()
        stats = dataclasses.replace(stats, seconds=time.perf_counter() - start, **step)
        if self._tensorboard is not None:
            self._tensorboard.write(stats.step, _scalars(stats))
        return stats

    @_serialized
    def compute_gradients(self, trajectories: Sequence[Trajectory], loss: str | LossFn = "grpo",
                          method: str = DEFAULT_METHOD, *, accumulate: bool = False, **options: Any) -> TrainStats:
        """Like :meth:`train_batch` without the optimizer step; with ``accumulate`` the gradients
        are added to the current ones instead of replacing them."""
        batch, converted = self._checked(trajectories, training=True)
        loss_options, executor_options = _split_options(options)
        executor = ExecutorOptions(**executor_options)._to_core(method)
        custom = None
        if callable(loss):
            if set(loss_options) - _CALLABLE_LOSS_OPTIONS:
                raise TypeError(f"loss options {sorted(set(loss_options) - _CALLABLE_LOSS_OPTIONS)} do not apply "
                                f"to a callable loss (those that do: {', '.join(sorted(_CALLABLE_LOSS_OPTIONS))})")
            core_loss = LossOptions(**loss_options)._to_core(None)
            custom = _python_loss(loss, batch)
        else:
            core_loss = LossOptions(**loss_options)._to_core(loss)
            if loss != "sft":
                for i, t in enumerate(batch):
                    if t.reward is None and (t.advantages is None or len(t.advantages) == 0):
                        raise ValueError(f"trajectory {i} ({t.id!r}): field 'reward': missing, and no "
                                         f"'advantages' ({loss} needs one of them)")
        start = time.perf_counter()
        # Replacing, the executor overwrites the gradients (a mixture of experts' stacked expert
        # gradients are then never zero-filled: their first chunk writes them).
        executor.replace_gradients = not accumulate
        result = self._core.compute_gradients(converted, core_loss, custom, executor)
        self._synchronize()
        diagnostics = _diagnostics(result.pop("diagnostics"))
        return TrainStats(seconds=time.perf_counter() - start, method=method, **result, **diagnostics)

    @_serialized
    def compute_logprobs(self, trajectories: Sequence[Trajectory], method: str = DEFAULT_METHOD,
                         **options: Any) -> list[torch.Tensor]:
        """Every trajectory's per-token log-probabilities under the current weights.

        ``result[i][t]`` is log p(tokens[t] | tokens[:t]) for t >= 1, in the model's dtype on its
        device; ``result[i][0]`` is 0. With ``dta`` and ``packed`` each unique token is computed
        once. ``options``: fields of :class:`ExecutorOptions`.
        """
        _, converted = self._checked(trajectories)
        _, executor_options = _split_options(options)
        if set(options) - _EXECUTOR_OPTION_NAMES:
            raise TypeError(f"compute_logprobs takes executor options only, got {sorted(options)}")
        return self._core.compute_logprobs(converted, ExecutorOptions(**executor_options)._to_core(method))

    @_serialized
    def zero_grad(self) -> None:
        """Sets every gradient to zero."""
        self._core.zero_grad()

    @_serialized
    def step(self) -> dict[str, float]:
        """One AdamW step on the current gradients: ``{"grad_norm", "clip_coef", "step", "lr",
        "skipped"}`` (``skipped``: the norm was not finite and nothing was updated, with
        ``nonfinite_gradients="skip"``; the gradients stay until the next ``zero_grad``)."""
        return self._core.step(self._skip_nonfinite)

    @_serialized
    def set_lr_schedule(self, schedule: str = "cosine", *, warmup_steps: int = 0, decay_steps: int = 0,
                        min_lr_ratio: float = 0.0) -> None:
        """From the next step on, each optimizer step ``s`` (0: the first; the step count, so a
        trainer resumed with ``load_optimizer`` continues on the curve) uses ``lr`` (the peak)
        times: ``(s + 1) / warmup_steps`` during the warmup, then 1 (``constant``) or a ``linear``
        or ``cosine`` decay to ``min_lr_ratio`` at step ``decay_steps``, where it stays; what
        dta-train and dta-trainer do with ``--lr_schedule``. Setting ``lr`` later moves the peak.

        Raises:
            ValueError: An unknown schedule, a negative count, ``min_lr_ratio`` outside [0, 1], or
                a decay whose ``decay_steps`` is not above ``warmup_steps`` (naming the field).
        """
        self._core.set_lr_schedule(schedule, int(warmup_steps), int(decay_steps), float(min_lr_ratio))

    # --- checkpoints --------------------------------------------------------------------------

    @_serialized
    def save(self, directory: str | os.PathLike[str], *, dtype: str | torch.dtype | None = "bfloat16",
             optimizer: bool = True) -> None:
        """Writes a checkpoint, what dta-train --save and dta-trainer write:

        - ``directory/model``: exactly what SGLang, vLLM and transformers' ``from_pretrained`` load
          (safetensors in ``dtype``, bfloat16 by default, None for the model's own; with
          ``model.safetensors.index.json``, config.json, generation_config.json, and the tokenizer
          files of the directory the trainer was loaded from);
        - ``directory/optimizer`` with ``optimizer``: the AdamW state (``optimizer.safetensors``;
          sharded or offloaded, ``optimizer-RRRRR-of-WWWWW.safetensors`` per data-parallel rank;
          with tensor parallelism in ``tp-RR-of-TT/``), whose master weights restore the
          parameters exactly whatever ``dtype`` the model was published in.

        Distributed, every rank calls it: the weights are gathered and written once, each rank
        writes its part of the optimizer, and it returns once the checkpoint is complete."""
        self._core.save(str(directory), None if dtype is None else _dtype(dtype), optimizer)

    @_serialized
    def load_optimizer(self, path: str | os.PathLike[str]) -> None:
        """Restores the AdamW state (and through its master weights the parameters) from a
        checkpoint that ``save``, dta-train --save or dta-trainer wrote, from its ``optimizer/``
        directory, or from one state file. An offloaded trainer reads the sharded files
        (``optimizer-*-of-*.safetensors``, saved by any number of ranks), the others
        ``optimizer.safetensors``; the other kind raises RuntimeError naming the option to use."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or directory")
        self._core.load_optimizer(str(path))

    @_serialized
    def load_weights(self, directory: str | os.PathLike[str]) -> None:
        """Replaces the weights with a Hugging Face checkpoint of the same model (what ``save``
        writes to ``dir/model``, or any Qwen3 directory whose config.json describes this model;
        stored dtypes are converted). The optimizer's master weights follow the new weights; its
        moments and step count stay (load a saved optimizer state with :meth:`load_optimizer`
        to restore those too). Distributed, every rank calls it.

        Raises:
            FileNotFoundError: No such directory.
            RuntimeError: Another model's config.json (naming the first field that differs), or a
                missing or malformed tensor (naming it).
        """
        if not Path(directory).is_dir():
            raise FileNotFoundError(f"{directory}: not a directory (expected a Hugging Face Qwen3 checkpoint)")
        self._core.load_weights(str(directory))

    # --- the model ----------------------------------------------------------------------------

    def parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter under its Hugging Face name, as live tensors (``.grad`` holds the
        gradient; distributed, this rank's part of the batch's until ``step`` sums it over the
        replicas). lm_head.weight is absent when the embeddings are tied. With tensor parallelism
        each is this rank's part (``save`` gathers them). A dense MLP's gate_proj and up_proj are
        views of one stacked tensor (one GEMM for both): write them in place, and clone them
        before handing them to writers that refuse shared storage (``safetensors.torch.save_file``;
        ``save`` does not need it)."""
        return dict(self._core.named_parameters())

    def gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient (zeros where none was computed), as live tensors."""
        return {name: p.grad if p.grad is not None else torch.zeros_like(p)
                for name, p in self._core.named_parameters()}

    @property
    def config(self) -> dict[str, Any]:
        """The model's Qwen3 configuration (vocab_size, hidden_size, ...)."""
        return dict(self._config)

    @property
    def vocab_size(self) -> int:
        return int(self._config["vocab_size"])

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def lr(self) -> float:
        """The learning rate (with a schedule: the peak, or the last step's rate)."""
        return self._core.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._core.lr = float(value)

    @property
    def progress(self) -> str:
        """Progress lines within long calls: ``auto``, ``always`` or ``never``."""
        return self._core.progress

    @progress.setter
    def progress(self, mode: str) -> None:
        self._core.progress = mode

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (restored by load_optimizer)."""
        return self._core.step_count

    @property
    def layout(self) -> str:
        """The training layout and the memory it expects per GPU, as dta-train prints it."""
        return self._core.layout

    @property
    def tensor_parallel(self) -> int:
        return self._core.tensor_parallel

    @property
    def shard_optimizer(self) -> bool:
        return self._core.shard_optimizer

    @property
    def offload_optimizer(self) -> bool:
        return self._core.offload_optimizer

    @property
    def offload_description(self) -> str:
        """Where the offloaded optimizer is updated (and why, when it cannot stream through the
        GPU); empty when the optimizer is not offloaded."""
        return self._core.offload_description

    @property
    def rank(self) -> int:
        """This process's rank in the world (0 unless distributed)."""
        return self._core.rank

    @property
    def world_size(self) -> int:
        return self._core.world_size

    @property
    def tensor_parallel_rank(self) -> int:
        return self._core.tensor_parallel_rank

    @property
    def data_parallel_rank(self) -> int:
        return self._core.data_parallel_rank

    @property
    def data_parallel_size(self) -> int:
        return self._core.data_parallel_size

    # --- helpers ------------------------------------------------------------------------------

    def _checked(self, trajectories: Sequence[Trajectory], *,
                 training: bool = False) -> tuple[list[Trajectory], _core.ConvertedBatch]:
        """The batch as a list, every trajectory validated and every id unique; for training also
        non-empty with at least one trained token (so that no optimizer step follows a batch that
        trains nothing). With it, the batch converted for the executor."""
        batch = list(trajectories)
        # Trajectories of plain Python values are checked by the same rules in C++ while they are
        # converted for the executor, one pass over each list; `unchecked` are the others,
        # validated here, which names the broken rule or accepts what the C++ check does not
        # cover (numpy values, subclasses), and then converted.
        converted = _core.convert_checked(batch, self.vocab_size, Trajectory)
        unchecked = set(converted.unchecked)
        first_of: dict[str, int] = {}
        for i, t in enumerate(batch):
            if i in unchecked:
                if not isinstance(t, Trajectory):
                    raise TypeError(f"trajectory {i}: expected dta.Trajectory, got {type(t).__name__}")
                try:
                    t.validate(self.vocab_size)
                except ValueError as e:
                    raise ValueError(f"trajectory {i} ({t.id!r}): {e}") from None
                converted.convert(i, t)
            if t.id in first_of:
                raise ValueError(f"trajectory {i} ({t.id!r}): field 'id': the same id as trajectory "
                                 f"{first_of[t.id]} (ids must be unique within a batch)")
            first_of[t.id] = i
        if training and not batch:
            raise ValueError("the batch is empty: nothing to train (no gradient computed, no step taken)")
        if training and not converted.has_trained_token():
            raise ValueError(f"no trajectory of the {len(batch)} has a trained token (every loss_mask is 0): "
                             "nothing to train (no gradient computed, no step taken)")
        return batch, converted

    def _synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)


def _check_device(device: str | torch.device, distributed: bool, what: str = "device") -> None:
    """Refuses a GPU device that this process cannot see, before anything touches CUDA: CUDA's
    own error (from the driver, deep in the first allocation) does not say that no GPU is visible.

    ``what`` names the setting in the message. With ``distributed``, ``cuda`` means
    ``cuda:LOCAL_RANK`` (as the extension resolves it); a malformed ``LOCAL_RANK`` is left to the
    extension, which names it. Malformed device strings keep torch's own error.

    Raises:
        RuntimeError: ``device`` is a GPU and ``torch.cuda.is_available()`` is False, or its
            index is not below ``torch.cuda.device_count()``.
    """
    parsed = torch.device(device)
    if parsed.type != "cuda":
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = "CUDA_VISIBLE_DEVICES is unset" if visible is None else f"CUDA_VISIBLE_DEVICES={visible!r}"
    if not torch.cuda.is_available():
        # A GPU whose driver is older than torch's CUDA is invisible too: say which CUDA that is.
        build = (f"torch's CUDA {torch.version.cuda} needs a driver that supports it" if torch.version.cuda
                 else "this torch is built without CUDA")
        raise RuntimeError(f"{what}={str(device)!r} but no GPU is visible to this process "
                           f"(torch.cuda.is_available() is False; {where}; {build}): use {what}='cpu', or run "
                           "where a GPU is visible")
    index, source = parsed.index, ""
    if index is None and distributed:
        local = os.environ.get("LOCAL_RANK", "0")
        index = int(local) if local.isdigit() else None
        source = f" (cuda:LOCAL_RANK, LOCAL_RANK={local})"
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise RuntimeError(f"{what}={str(device)!r}{source}: GPU {index} is not visible: this process sees "
                           f"{count} GPU{'' if count == 1 else 's'} (cuda:0 to cuda:{count - 1}; {where})")


def _layout_choice(name: str, value: bool | str) -> bool | None:
    """``"auto"`` (None: the planner chooses), True or False."""
    if isinstance(value, bool):
        return value
    if value == "auto":
        return None
    raise ValueError(f"{name} must be 'auto', True or False, got {value!r}")


def _parallel_options(distributed: bool, tensor_parallel: int, shard_optimizer: bool | str,
                      offload_optimizer: bool | str, offload_update: str, offload_resident_gb: float | str,
                      gpu_memory_gb: float, activation_gb: float | None, longest_rollout: int,
                      timeout_s: int) -> Any:
    if not isinstance(tensor_parallel, int) or tensor_parallel < 0:
        raise ValueError(f"tensor_parallel must be an int >= 0, got {tensor_parallel!r}")
    if gpu_memory_gb < 0 or (activation_gb is not None and activation_gb < 0):
        raise ValueError(f"gpu_memory_gb and activation_gb must be >= 0, got {gpu_memory_gb}, {activation_gb}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if tensor_parallel != 1 and not distributed:
        raise ValueError(f"tensor_parallel={tensor_parallel} needs distributed=True (one process per rank, "
                         "started by torchrun)")
    parallel = _core.ParallelOptions()
    parallel.distributed = bool(distributed)
    parallel.timeout_s = int(timeout_s)
    if offload_update not in ("gpu", "host"):
        raise ValueError(f"offload_update must be 'gpu' or 'host', got {offload_update!r}")
    parallel.offload_update = offload_update
    layout = _core.LayoutOverrides()
    layout.tensor_parallel = tensor_parallel
    layout.shard_optimizer = _layout_choice("shard_optimizer", shard_optimizer)
    layout.offload_optimizer = _layout_choice("offload_optimizer", offload_optimizer)
    if offload_resident_gb != "auto":
        if isinstance(offload_resident_gb, bool) or not isinstance(offload_resident_gb, (int, float)) \
                or not offload_resident_gb >= 0:
            raise ValueError(f"offload_resident_gb must be 'auto' or a number of GB >= 0, got {offload_resident_gb!r}")
        layout.offload_resident_gb = float(offload_resident_gb)
    layout.gpu_memory_gb = float(gpu_memory_gb)
    layout.activation_gb = -1.0 if activation_gb is None else float(activation_gb)  # -1: estimated
    if not isinstance(longest_rollout, int) or longest_rollout < 1:
        raise ValueError(f"longest_rollout must be an int >= 1, got {longest_rollout!r}")
    layout.longest_rollout = longest_rollout
    parallel.layout = layout
    return parallel


def _python_loss(fn: LossFn, batch: list[Trajectory]) -> Callable[..., torch.Tensor]:
    """The adapter the extension calls for each rollout: builds the RolloutLossInput and checks
    the callable's result."""

    def adapter(index: int, logprobs: torch.Tensor, advantages: torch.Tensor | None, total_loss_tokens: float,
                num_rollouts: int, entropy: torch.Tensor | None,
                proximal_logprobs: torch.Tensor | None) -> torch.Tensor:
        rollout = RolloutLossInput(batch[index], index, advantages, total_loss_tokens, num_rollouts, logprobs,
                                   entropy, proximal_logprobs)
        value = fn(logprobs, rollout)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"the loss returned {type(value).__name__} for trajectory {index} "
                            f"({batch[index].id!r}), expected a scalar torch.Tensor")
        return value

    return adapter


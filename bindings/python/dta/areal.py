"""AReaL's ``TrainEngine`` on :class:`dta.Trainer`: an AReaL PPO actor whose updates run over the
batch's prefix tree (shared prefixes computed once).

AReaL (https://github.com/inclusionAI/AReaL, ``pip install --no-deps areal==1.0.4`` with
scripts/requirements-areal.txt) has no engine registry: its ``PPOTrainer`` builds the actor in
``_create_train_engine``. :class:`DTAPPOTrainer` overrides it, so a training script switches by
using it in place of ``PPOTrainer``; the YAML stays AReaL's (``actor.backend: fsdp:dXtY``, and
``actor.weight_update_mode: disk`` or ``xccl``)::

    from dta.areal import DTAOptions, DTAPPOTrainer
    with DTAPPOTrainer(config, train_dataset, options=DTAOptions(method="dta")) as trainer:
        trainer.train(workflow)

:class:`DTAPPOActor` mirrors AReaL's ``FSDPPPOActor`` (``PPOActor`` on this engine) and can be
used on its own. Members that cannot apply raise NotImplementedError naming the alternative
(``forward_backward_batch``, awex weight updates, offload, critics, LoRA). Weights reach the
inference engines as AReaL's FSDP engine sends them: ``disk`` (a Hugging Face checkpoint they
load) or ``xccl`` (broadcast over a process group with them, in buckets, in the config's dtype).

Processes. The engine's allocation ``dXtY`` (AReaL's launcher starts X*Y processes, torchrun's
environment) is dta's layout of X data-parallel replicas of Y tensor-parallel ranks each
(``dta.Trainer(distributed=True, tensor_parallel=Y)``; a replica's TP ranks are consecutive, as
AReaL's mesh orders them); pipeline, context and expert parallelism are refused. AReaL hands each
replica its share of the batch (``DistRolloutCoordinator``); every call that computes gathers the
shares over the data-parallel group in rank order, so every rank holds the whole batch, and dta
splits it across the replicas along its prefix tree (AReaL's split would cut shared prefixes),
with whole-batch normalisers. ``forward_batch`` answers each rank with its own share's rows.
Weight updates and the Hugging Face files of ``save`` go out from world rank 0 after dta's
tensor-parallel gather; the other ranks take part in the gather and wait on a barrier.

Frames. AReaL's engines compute ``logprobs[t] = log p(input_ids[t + 1] | input_ids[:t + 1])``
(the logits frame), and ``PPOActor.compute_advantages`` rolls ``loss_mask`` and ``logprobs`` into
that frame (``versions`` stays with the tokens). So ``forward_batch`` returns that frame, and
``train_batch`` takes batches in it (what ``compute_advantages`` returns), converting them with
``dta.from_areal(..., shifted=True)``, which refuses a batch in the tokens' frame wherever the
data tells (see its docstring).

Losses. ``train_batch`` routes AReaL's ``grpo_loss_fn`` to dta's built-in ``ppo`` /
``decoupled-ppo`` (C++, one pass over the tree) when AReaL's configuration maps onto it exactly,
else calls the given loss on each rollout through dta's callable-loss path (``DTAOptions.loss``
chooses). Either way the gradient is AReaL's: per-rollout losses weighted by
``loss_weight_fn / sum(loss_weight_fn)``, which is AReaL's micro-batch weighting with every
micro-batch one rollout.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import socket
import tempfile
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import get_constant_schedule_with_warmup, get_linear_schedule_with_warmup

from areal.api.alloc_mode import ModelAllocation, ParallelStrategy
from areal.api.cli_args import PPOActorConfig, TrainEngineConfig
from areal.api.engine_api import InferenceEngine, TrainEngine
from areal.api.io_struct import DeviceRuntimeInfo, FinetuneSpec, ParamSpec, SaveLoadMeta, WeightUpdateMeta
from areal.engine.core.distributed import init_custom_process_group, warmup_process_groups
from areal.engine.fsdp_utils import get_cosine_schedule_with_warmup
from areal.infra.dist_rollout import DistRolloutCoordinator
from areal.infra.platforms import current_platform
from areal.trainer.ppo.actor import PPOActor, PPOActorController, _log_version_staleness_stats, grpo_loss_fn
from areal.trainer.rl_trainer import PPOTrainer
from areal.utils import name_resolve, names, stats_tracker
from areal.utils.constants import DIST_GROUP_DEFAULT_TIMEOUT, PROX_LOGP_METHOD_RECOMPUTE
from areal.utils.data import concat_batch, pack_tensor_dict, split_batch, tensor_container_to
from areal.utils.environ import is_single_controller
from areal.utils.network import find_free_ports, format_host_for_url, gethostip

from .trainer import RejectionSampling, Trainer, TrainStats, _check_device
from .trajectory import Trajectory, from_areal

__all__ = ["DTAOptions", "DTAEngine", "DTAPPOActor", "DTAPPOTrainer"]

logger = logging.getLogger("dta.areal")

_LOSS_ROUTES = ("auto", "dta", "areal")
_DTYPES = {"float32", "float64", "bfloat16"}
_SCHEDULES = {
    "constant": lambda opt, warmup, total, min_lr_ratio: get_constant_schedule_with_warmup(opt, warmup),
    "linear": lambda opt, warmup, total, min_lr_ratio: get_linear_schedule_with_warmup(opt, warmup, total),
    "cosine": lambda opt, warmup, total, min_lr_ratio: get_cosine_schedule_with_warmup(
        opt, warmup, total, min_lr_ratio=min_lr_ratio),
}


@dataclass(frozen=True)
class DTAOptions:
    """What AReaL's configuration cannot say about the engine.

    Attributes:
        method: dta's execution method, ``dta`` (push/pop over the prefix tree), ``packed`` or
            ``dense``. Default ``dta``.
        loss: ``auto`` (default): dta's built-in loss when AReaL's ``grpo_loss_fn`` maps onto it
            exactly, else AReaL's loss called per rollout; ``dta``: the built-in loss or a
            ValueError naming what does not map; ``areal``: always AReaL's loss.
        dtype: ``float32``, ``float64`` or ``bfloat16``; None (default): the config's ``dtype``.
            AReaL's config refuses ``float64``: keep ``actor.dtype=float32`` (what the inference
            engines receive over xccl) and set ``dtype="float64"`` here.
        device: ``cpu``, ``cuda``, ``cuda:N``; None (default): ``cuda`` when available, else ``cpu``.
            A GPU that this process cannot see raises RuntimeError at ``initialize``.
        weight_update_host: xccl weight updates: the address of this host at which the
            weight-update group meets, handed to the inference engines' workers
            (``WeightUpdateMeta.nccl_master_address``): an IP (v4 or v6) or a name of this host
            that they can reach, e.g. ``127.0.0.1`` when they run on this host only, or the
            interface they reach on a host with several. None (default): AReaL's choice, as its
            FSDP engine makes it (``areal.utils.network.gethostip()``: the first address of the
            host's name that is not loopback, else the one routing to 8.8.8.8; AReaL 1.0.4 has no
            setting for it).
        executor: Fields of :class:`dta.trainer.ExecutorOptions` (``block_size``, ``pack``, ...).
            Default: none (dta's defaults).
        trainer: More keyword arguments for :class:`dta.Trainer` (``offload_optimizer``,
            ``gpu_memory_gb``, ...). Default: none.
    """

    method: str = "dta"
    loss: str = "auto"
    dtype: str | None = None
    device: str | None = None
    executor: Mapping[str, Any] = field(default_factory=dict)
    trainer: Mapping[str, Any] = field(default_factory=dict)
    weight_update_host: str | None = None

    def __post_init__(self) -> None:
        if self.loss not in _LOSS_ROUTES:
            raise ValueError(f"DTAOptions.loss must be one of {', '.join(_LOSS_ROUTES)}, got {self.loss!r}")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"DTAOptions.dtype must be one of {', '.join(sorted(_DTYPES))} or None, "
                             f"got {self.dtype!r}")
        host = self.weight_update_host
        if host is not None and (not isinstance(host, str) or not host.strip("[] ")):
            raise ValueError(f"DTAOptions.weight_update_host must be an address or name of this host, or None, "
                             f"got {host!r}")


class DTAEngine(TrainEngine):
    """AReaL's ``TrainEngine`` over a :class:`dta.Trainer` in this process.

    Lifecycle as AReaL's engines: construct with the config, ``create_process_group()``, then
    ``initialize(None, ft_spec)`` loads ``config.path`` (a Hugging Face Qwen3 directory) and builds
    AdamW from ``config.optimizer`` and AReaL's learning-rate schedule (stepped by
    ``step_lr_scheduler``). Not thread-safe beyond dta.Trainer's one-call-at-a-time; not copyable.

    Raises (at construction): NotImplementedError for critics, LoRA and
    optimizers other than AdamW with float32 state; ValueError for a bad dtype.
    """

    def __init__(self, config: TrainEngineConfig, options: DTAOptions | None = None) -> None:
        self.config = config
        self.options = options or DTAOptions()
        if config.is_critic:
            raise NotImplementedError("dta.areal trains causal language models only: use AReaL's FSDP engine "
                                      "for the critic (is_critic=True)")
        if config.use_lora:
            raise NotImplementedError("dta.Trainer trains every weight: LoRA (use_lora=True) needs AReaL's "
                                      "FSDP engine")
        # Log-probabilities at the sampling temperature, as AReaL's engines compute them.
        self._executor = {"temperature": float(config.temperature), **self.options.executor}
        optimizer = config.optimizer
        if optimizer is not None and (optimizer.type != "adam" or config.optimizer_dtype != "float32"):
            raise NotImplementedError(f"optimizer {optimizer.type!r} with optimizer_dtype "
                                      f"{config.optimizer_dtype!r}: dta.Trainer's optimizer is AdamW with "
                                      "float32 state (type=adam, optimizer_dtype=float32)")
        self.dtype = self.options.dtype or config.dtype
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: dta.Trainer computes in {', '.join(sorted(_DTYPES))}: set "
                             "the config's dtype to float32 or bfloat16, or DTAOptions(dtype=...) (float64, which "
                             "AReaL's config refuses: DTAOptions(dtype='float64') with the config's float32)")
        self.trainer: Trainer | None = None
        self.rollout_engine: InferenceEngine | None = None
        self.rollout_coordinator: DistRolloutCoordinator | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.last_loss_route = ""  # how the last train_batch computed its loss (for logs and tests)
        self.training = True
        self._version = 0
        # The data-parallel group (AReaL's backend for the device), its Gloo twin for the
        # batches' gathers, the replica's (context and model parallel) group and the world's Gloo
        # group; the layout: replicas x tensor-parallel ranks, and this rank's replica.
        self._group: dist.ProcessGroup | None = None
        self._dp_objects: dist.ProcessGroup | None = None
        self._mp_group: dist.ProcessGroup | None = None
        self._cpu_group: dist.ProcessGroup | None = None
        self._replicas, self._tp, self._dp_rank = 1, 1, 0
        self._owns_process_group = False
        # xccl: the process group with the inference engines' workers (this engine is rank 0) and
        # where they rendezvoused.
        self._weight_group: dist.ProcessGroup | None = None
        self._weight_group_at: tuple[str, int, str] | None = None

    # --- process groups and lifecycle -------------------------------------------------------

    def create_process_group(self, parallel_strategy: ParallelStrategy | None = None) -> None:
        """The engine's process groups over torch.distributed, after initialising it when nobody
        has (with AReaL's backend for the device, NCCL on GPUs, as its FSDP engine does: torchrun's
        environment, or one rank of its own when the allocation is one process).

        ``parallel_strategy`` (default: the config's ``backend``, e.g. ``fsdp:d2t2``) is dta's
        layout: ``data_parallel_group`` joins the ranks of one tensor-parallel rank across the
        replicas, ``context_and_model_parallel_group`` a replica's consecutive TP ranks (AReaL's
        backend for the device), ``cpu_group`` the world (Gloo).

        Raises:
            ValueError: A dimension dta cannot map (pipeline, context or expert parallelism), a
                tensor-parallel size that does not divide the model's attention or KV heads, or a
                world size other than the allocation's (each naming the field).
        """
        strategy = parallel_strategy
        if strategy is None:
            strategy = (ModelAllocation.from_str(self.config.backend).parallel if self.config.backend
                        else ParallelStrategy())
        replicas, tp = _layout(strategy, self.config, self.options)
        where = _allocation_name(strategy, self.config)
        if dist.is_initialized():
            world, source = dist.get_world_size(), "torch.distributed has"
        else:
            world, source = int(os.environ.get("WORLD_SIZE", "1")), "the launcher's WORLD_SIZE is"
        if world != replicas * tp:
            raise ValueError(f"{where}: {replicas * tp} process{'es' if replicas * tp > 1 else ''} "
                             f"(data_parallel_size {replicas} x tensor_parallel_size {tp}), but {source} {world}: "
                             "launch one process per rank of the allocation (AReaL's launcher or torchrun)")
        if not dist.is_initialized():
            backend = current_platform.communication_backend
            if world == 1:
                port = find_free_ports(1)[0]
                dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
            else:  # torchrun's environment, as AReaL's FSDP engine
                dist.init_process_group(backend, timeout=DIST_GROUP_DEFAULT_TIMEOUT)
            self._owns_process_group = True
        rank = dist.get_rank()
        self._replicas, self._tp = replicas, tp
        self._dp_rank = rank // tp
        backend = current_platform.communication_backend
        self._cpu_group = dist.new_group(backend="gloo")
        if world == 1:
            self._group = self._dp_objects = self._cpu_group
            self._mp_group = self._cpu_group
            return
        # Every rank creates every group, in the same order (torch.distributed's rule).
        for t in range(tp):
            ranks = list(range(t, world, tp))
            group, objects = dist.new_group(ranks, backend=backend), dist.new_group(ranks, backend="gloo")
            if rank % tp == t:
                self._group, self._dp_objects = group, objects
        for d in range(replicas):
            group = dist.new_group(list(range(d * tp, (d + 1) * tp)), backend=backend)
            if self._dp_rank == d:
                self._mp_group = group
        # As AReaL's FSDP engine: on GPUs, this rank's device (LOCAL_RANK) and the NCCL
        # communicators now, not lazily while a colocated engine is busy.
        warmup_process_groups(self._group, self._mp_group)

    def initialize(self, addr: str | None = None, ft_spec: FinetuneSpec | None = None, *args: Any,
                   **kwargs: Any) -> None:
        """Loads the model and builds AdamW and the learning-rate schedule (over
        ``ft_spec.total_train_steps``, as AReaL's FSDP engine). Several processes: every rank
        calls it; dta's trainer joins them (``distributed=True``) at world rank 0's address on a
        port of its own, next to torch.distributed's."""
        if addr is not None:
            raise NotImplementedError("dta.areal loads the model in this process (addr must be None)")
        if self._group is None:
            self.create_process_group()
        opt = self.config.optimizer
        adamw = {} if opt is None else dict(lr=opt.lr, weight_decay=opt.weight_decay, betas=(opt.beta1, opt.beta2),
                                              eps=opt.eps, max_grad_norm=opt.gradient_clipping)
        device = self.options.device or ("cuda" if torch.cuda.is_available() else "cpu")
        distributed = dist.get_world_size() > 1
        _check_device(device, distributed, what="DTAOptions.device")
        # A step whose gradient norm is not finite updates nothing and reports
        # update_successful = 0, as AReaL's FSDP engine does.
        trainer_options = {"nonfinite_gradients": "skip", **self.options.trainer}
        if distributed:
            trainer_options.update(distributed=True, tensor_parallel=self._tp)
            with _launch_environment(self._cpu_group):
                self.trainer = Trainer(self.config.path, dtype=self.dtype, device=device, **adamw, **trainer_options)
        else:
            self.trainer = Trainer(self.config.path, dtype=self.dtype, device=device, **adamw, **trainer_options)
        if opt is not None and ft_spec is not None:
            total = ft_spec.total_train_steps
            warmup = int(opt.warmup_steps_proportion * total)
            if opt.lr_scheduler_type not in _SCHEDULES:
                raise ValueError(f"Unknown lr scheduler type {opt.lr_scheduler_type}")
            # AReaL's schedules are torch LambdaLRs stepped once per PPO step (not per optimizer
            # step); this clock runs one and copies its rate into the trainer.
            clock = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=opt.lr)
            self.lr_scheduler = _SCHEDULES[opt.lr_scheduler_type](clock, warmup, total, opt.min_lr_ratio)
            self.trainer.lr = self.lr_scheduler.get_last_lr()[0]

    def destroy(self) -> None:
        if self._weight_group is not None:
            dist.destroy_process_group(self._weight_group)
            self._weight_group = self._weight_group_at = None
        self.trainer = None  # distributed: dta's trainer leaves its group on a barrier of every rank
        self.lr_scheduler = None
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False
        self._group = self._mp_group = self._cpu_group = self._dp_objects = None

    @property
    def initialized(self) -> bool:
        return self.trainer is not None

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        return self._require_group()

    @property
    def data_parallel_rank(self) -> int:
        self._require_group()
        return self._dp_rank

    @property
    def data_parallel_world_size(self) -> int:
        self._require_group()
        return self._replicas

    def current_data_parallel_head(self) -> int:
        """The replica's first (TP rank 0) world rank."""
        self._require_group()
        return self._dp_rank * self._tp

    def is_data_parallel_head(self) -> bool:
        return dist.get_rank() == self.current_data_parallel_head()

    @property
    def context_and_model_parallel_group(self) -> dist.ProcessGroup:
        self._require_group()
        return self._mp_group

    @property
    def cpu_group(self) -> dist.ProcessGroup:
        self._require_group()
        return self._cpu_group

    def train(self, mode: bool = True) -> DTAEngine:
        """A flag only: dta's Qwen3 has no dropout, and dta chooses recomputation itself."""
        self.training = mode
        return self

    # --- inference engine, weights and versions ---------------------------------------------

    def connect_engine(self, engine: InferenceEngine, meta: WeightUpdateMeta) -> None:
        """Remembers the inference engine that ``update_weights`` and ``prepare_batch`` use; for
        ``xccl`` also forms the weight-update group with its workers, as AReaL's FSDP engine does:
        this engine is rank 0 of ``1 + meta.gen_allocation``'s world size, at
        ``DTAOptions.weight_update_host`` (default: AReaL's choice of this host's address) and a
        free port, named ``update_weight_group`` (NCCL when the trainer is on a GPU, Gloo on the
        CPU); with several processes world rank 0 forms it and the others wait. Raises
        NotImplementedError for ``awex`` and for engines with pipeline parallelism (AReaL's
        per-stage groups); ValueError for a ``weight_update_host`` that is not an
        address of this host (before the workers are asked to join)."""
        self._check_update_mode(meta)
        self.rollout_engine = engine
        self.rollout_coordinator = DistRolloutCoordinator(rollout_engine=engine, train_engine=self)
        if meta.type == "xccl":
            if dist.get_rank() == 0:  # the sender; the other ranks' weights reach it through dta's gather
                self._form_weight_group(engine, meta)
            dist.barrier(group=self.cpu_group)

    def rollout_batch(self, data: list[dict[str, Any]], workflow: Any, workflow_kwargs: dict[str, Any] | None = None,
                      group_size: int = 1) -> list[dict[str, Any]]:
        return self._coordinator().rollout_batch(data, workflow=workflow, workflow_kwargs=workflow_kwargs,
                                                 group_size=group_size)

    def prepare_batch(self, dataloader: Any, workflow: Any, workflow_kwargs: dict[str, Any] | None = None,
                      should_accept_fn: Callable[[dict[str, Any]], bool] | str | None = None, group_size: int = 1,
                      dynamic_bs: bool = False) -> list[dict[str, Any]]:
        return self._coordinator().prepare_batch(dataloader, workflow=workflow, workflow_kwargs=workflow_kwargs,
                                                 should_accept_fn=should_accept_fn, group_size=group_size,
                                                 dynamic_bs=dynamic_bs)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """AReaL's protocols, as its FSDP engine runs them.

        ``disk``: pause generation, ask the inference engine to load ``meta.path``, write the
        Hugging Face checkpoint there, announce it under
        ``names.update_weights_from_disk(experiment, trial, get_version())``, wait, resume.

        ``xccl``: pause generation; then per bucket of at most ``meta.weight_chunked_mem_mb``
        (a larger tensor goes alone) the engine's ``update_weights_from_distributed(meta, specs)``
        and one broadcast from rank 0 per tensor, under Hugging Face names, in the config's dtype
        (what the engines run: AReaL's compute dtype); resume. A failure leaves generation paused
        (the engines may hold a mix of versions) and raises.

        Several processes: world rank 0 talks to the inference engine and sends; every rank first
        takes part in dta's TP gather (``disk``: the checkpoint; ``xccl`` with tensor parallelism:
        a checkpoint in a temporary directory that rank 0 writes and reads back); all return
        after a barrier.
        """
        self._check_update_mode(meta)
        if self.rollout_engine is None:
            raise RuntimeError("update_weights: no inference engine; call connect_engine() first")
        if meta.type == "xccl":
            self._broadcast_weights(meta)
            return
        if meta.path is None:
            raise ValueError("update_weights: WeightUpdateMeta.path is None")
        sender = dist.get_rank() == 0
        loaded: Future[None] | None = None
        if sender:
            self.rollout_engine.pause_generation()
            loaded = self.rollout_engine.update_weights_from_disk(meta)
        self._save_hf(meta.path, optimizer=False)  # every rank: dta's TP gather
        if sender:
            name = names.update_weights_from_disk(self.config.experiment_name, self.config.trial_name,
                                                  self.get_version())
            name_resolve.add(name, str(datetime.now().timestamp()), keepalive_ttl=120)
            loaded.result()
            self.rollout_engine.continue_generation()
        dist.barrier(group=self.cpu_group)

    def set_version(self, version: int) -> None:
        self._version = version

    def get_version(self) -> int:
        return self._version

    def save(self, meta: SaveLoadMeta) -> None:
        """``hf``: ``meta.path`` is a Hugging Face checkpoint (weights in the engine's dtype, its
        config, the source model's tokenizer files, ``meta.tokenizer``/``meta.processor`` when
        given), plus dta's AdamW state in ``meta.path/optimizer`` with ``meta.with_optim``.
        ``dcp`` (AReaL's recover checkpoints) is written as dta's own checkpoint
        (``meta.path/model``, ``meta.path/optimizer``), not torch.distributed.checkpoint: only this
        engine reads it back. Several processes: every rank calls it, with the same ``meta.path`` on a
        file system they share; world rank 0 writes the weights (gathered), every rank its part of
        the optimizer state."""
        trainer = self._require_trainer()
        if meta.weight_format == "hf":
            self._save_hf(meta.path, optimizer=meta.with_optim)
            if dist.get_rank() == 0:
                for extra in (meta.tokenizer, meta.processor):
                    if extra is not None:
                        extra.save_pretrained(meta.path)
            dist.barrier(group=self.cpu_group)
        elif meta.weight_format == "dcp":
            trainer.save(meta.path, dtype=None, optimizer=meta.with_optim)
        else:
            raise ValueError(f"Unknown weight format {meta.weight_format}. ")

    def load(self, meta: SaveLoadMeta) -> None:
        """Loads what ``save`` wrote (or, ``hf``, any Hugging Face checkpoint of this model): the
        weights, and with ``with_optim`` the AdamW state (moments, step count, and master weights
        that restore the parameters exactly). Without ``with_optim`` the moments and step count
        stay and the master weights follow the loaded weights, as loading a model state into
        AReaL's FSDP engine leaves its optimizer.

        Raises:
            FileNotFoundError: No checkpoint at ``meta.path`` (or no ``optimizer/`` in it with
                ``with_optim``).
            RuntimeError: Another model's checkpoint (naming the field that differs).
        """
        trainer = self._require_trainer()
        if meta.weight_format not in ("hf", "dcp"):
            raise ValueError(f"Unknown weight format {meta.weight_format}. ")
        path = Path(meta.path)
        trainer.load_weights(path if meta.weight_format == "hf" else path / "model")
        if meta.with_optim:
            trainer.load_optimizer(path / "optimizer")

    # --- the optimizer ----------------------------------------------------------------------

    def optimizer_zero_grad(self) -> None:
        self._require_trainer().zero_grad()

    def optimizer_step(self) -> dict[str, float]:
        """AdamW on the current gradients; a gradient norm that is not finite updates nothing,
        zeroes the gradients and reports ``update_successful = 0`` (AReaL's FSDP engine's rule)."""
        trainer = self._require_trainer()
        step = trainer.step()
        if step["skipped"]:
            trainer.zero_grad()
        return dict(update_successful=float(not step["skipped"]), grad_norm=float(step["grad_norm"]),
                    lr=float(step["lr"]))

    def lr_scheduler_step(self) -> None:
        """Advances AReaL's schedule (once per PPO step, as AReaL's trainer calls it) and sets the
        trainer's learning rate to it."""
        trainer = self._require_trainer()
        if self.lr_scheduler is None:
            raise RuntimeError("no learning-rate schedule: the config has no optimizer, or initialize() "
                               "got no ft_spec")
        self.lr_scheduler.optimizer.step()  # the clock has no gradients: this only orders the calls
        self.lr_scheduler.step()
        trainer.lr = self.lr_scheduler.get_last_lr()[0]

    # --- compute ----------------------------------------------------------------------------

    def forward_backward_batch(self, mb_list: Any, process_output_fn: Callable[..., Any],
                               forward_only: bool = False) -> None:
        raise NotImplementedError("forward_backward_batch hands out each micro-batch's logits, which dta never "
                                  "materialises (it works on the prefix tree): use train_batch, eval_batch "
                                  "or forward_batch")

    def train_batch(self, input_: list[dict[str, Any]] | dict[str, Any], loss_fn: Callable[..., torch.Tensor],
                    loss_weight_fn: Callable[[dict[str, Any]], torch.Tensor]) -> dict[str, float]:
        """One AdamW step on the batch's gradient, as AReaL's FSDP engine computes it.

        Args:
            input_: Padded ``[B, L]`` tensors in AReaL's logits frame, what
                ``PPOActor.compute_advantages`` returns (``input_ids``, ``attention_mask``,
                ``loss_mask``, ``logprobs``, ``advantages``, ``prox_logp``, ``versions``, ...), as one
                dict or a list of them.
            loss_fn: ``loss_fn(logprobs, entropy, mb_input, **kw)`` on packed 1-D inputs, AReaL's
                actor-loss signature; called per rollout unless a dta built-in loss replaces it, with
                float32 ``logprobs`` and ``entropy`` (AReaL's engines give float32).
            loss_weight_fn: A micro-batch's weight (AReaL: its loss tokens).

        Returns:
            ``update_successful`` (0 when the gradient norm was not finite: nothing updated),
            ``grad_norm``, ``lr``, ``num_micro_batches`` (1) and dta's
            ``dta_loss``, ``dta_compression`` (rollout tokens / tree tokens), ``dta_tree_tokens``.

        Several processes: every rank calls it with its share of the batch (AReaL's); the shares,
        gathered in data-parallel rank order, are the batch trained (dta splits it across the
        replicas), and every rank returns the same.

        Raises:
            ValueError: An empty batch, one whose weights sum to 0 (nothing trained: no step is
                taken), a batch in the tokens' frame or otherwise malformed (naming the row and
                field), or ``DTAOptions.loss="dta"`` with a loss dta cannot express.
            NotImplementedError: M2PO (``m2_threshold``), which masks a micro-batch's tokens jointly.
        """
        trainer = self._require_trainer()
        if self.config.optimizer is None:
            raise RuntimeError("train_batch: the config has no optimizer (an inference-only engine)")
        rows, mbs = self._rows(input_, "train_batch")
        weights = [float(loss_weight_fn(mb)) for mb in mbs]
        total = sum(weights)
        if total <= 0:
            raise ValueError(f"train_batch: the {len(rows)} rollouts' loss weights sum to {total:g} (no trained "
                             "token): nothing to train, no step taken")
        route = self._builtin_loss(loss_fn, rows, mbs, weights)
        if isinstance(route, tuple):
            loss, options = route
            self.last_loss_route = f"dta:{loss}"
        else:
            if isinstance(loss_fn, functools.partial) and loss_fn.keywords.get("m2_threshold") is not None:
                raise NotImplementedError("M2PO (m2_threshold) masks a micro-batch's tokens jointly; dta calls "
                                          "the loss per rollout: unset actor.m2_threshold")
            loss, options = _per_rollout(loss_fn, mbs, weights, total), {"with_entropy": True}
            self.last_loss_route = f"areal: {route}"
        # dta's ppo ratio is against the trajectories' logprobs, AReaL's against prox_logp (which
        # compute_advantages sets to the behaviour's, or the behaviour's to it).
        behaviour = "prox_logp" if loss == "ppo" and "prox_logp" in rows[0] else "logprobs"
        trajectories = [_trajectory(dict(row, logprobs=row[behaviour]), i) for i, row in enumerate(rows)]
        stats = trainer.train_batch(trajectories, loss=loss, method=self.options.method, **options,
                                    **self._executor)
        logger.debug("train_batch: %s", self.last_loss_route)
        if isinstance(route, tuple):  # AReaL's loss logs its statistics itself
            self._log_builtin_stats(stats, mbs, loss_fn, options)
        if stats.skipped:
            trainer.zero_grad()
            logger.warning("train_batch: the gradient norm is %s: no update (update_successful = 0)",
                           stats.grad_norm)
        return _step_stats(stats)

    def _log_builtin_stats(self, stats: TrainStats, mbs: list[dict[str, Any]], loss_fn: Callable[..., Any],
                           options: dict[str, Any]) -> None:
        """What AReaL's ``grpo_loss_fn`` logs, under its names, from dta's whole-batch
        diagnostics: ``importance_weight`` (mean, min, max), ``approx_kl``, ``actor_loss``,
        ``clip_ratio``, ``dual_clip_ratio``, ``entropy`` (when computed), ``behave_imp_weight``,
        ``behave_approx_kl``, ``rs_filtered_fraction`` and ``version_stats/*`` (staleness), with
        their denominators. dta gives means: a statistic's min and max are its mean, except the
        importance weight's. Each rank holds the whole batch's values, so data-parallel rank 0
        counts its tokens and the others log empty masks (the same keys on every rank, as
        ``export_stats``' reduction needs)."""
        n = int(sum(int(mb["loss_mask"].count_nonzero()) for mb in mbs))
        if n == 0:
            return
        device = mbs[0]["loss_mask"].device
        own = self._dp_rank == 0

        def mask(count: int | float, size: int = n) -> torch.Tensor:
            m = torch.zeros(size, dtype=torch.bool, device=device)
            m[:int(round(count))] = own
            return m

        def values(mean: float, low: float | None = None, high: float | None = None) -> torch.Tensor:
            # n values whose mean is `mean` (and, given, whose min and max are low and high: the
            # other n - 2 take the mean of the batch's other values, which lies between them).
            v = torch.full((n,), float(mean), dtype=torch.float64)
            if low is not None and n >= 2:
                v[0], v[1] = low, high
                if n > 2:
                    v[2:] = (n * mean - low - high) / (n - 2)
            return v.float().to(device)

        total_tokens = sum(int(mb["input_ids"].numel()) for mb in mbs)
        stats_tracker.denominator(n_tokens=mask(total_tokens, total_tokens), n_valid_tokens=mask(n),
                                  clipped_tokens=mask((stats.clip_fraction or 0.0) * n),
                                  dual_clipped_tokens=mask((stats.dual_clip_fraction or 0.0) * n))
        logged = dict(actor_loss=values(stats.loss))
        if stats.ratio_mean is not None:
            # Tokens rejection sampling masks count as ratio 0 in dta's mean and AReaL's statistic.
            rs = options.get("rejection_sampling")
            masked = rs is not None and rs.action == "mask" and (stats.rejected_fraction or 0.0) > 0
            low = 0.0 if masked else stats.ratio_min
            logged.update(importance_weight=values(stats.ratio_mean, low, stats.ratio_max),
                          approx_kl=values(stats.approx_kl), clip_ratio=values(stats.clip_fraction),
                          dual_clip_ratio=values(stats.dual_clip_fraction))
        if stats.entropy is not None:
            logged.update(entropy=values(stats.entropy))
        stats_tracker.stat(**logged, denominator="n_valid_tokens")
        if stats.behave_imp_weight is not None:
            kept = n * (1.0 - (stats.rejected_fraction or 0.0))
            stats_tracker.denominator(unclipped_behave_tokens=mask(kept))
            stats_tracker.stat(behave_imp_weight=values(stats.behave_imp_weight),
                               behave_approx_kl=values(stats.behave_approx_kl), denominator="unclipped_behave_tokens")
        if "rejection_sampling" in options and stats.rejected_fraction is not None and own:
            stats_tracker.scalar(rs_filtered_fraction=stats.rejected_fraction)
        current_version = loss_fn.keywords.get("current_version") if isinstance(loss_fn, functools.partial) else None
        if "versions" in mbs[0] and current_version is not None:
            loss_mask = torch.cat([mb["loss_mask"] for mb in mbs]).bool()
            _log_version_staleness_stats(torch.cat([mb["versions"] for mb in mbs]), current_version,
                                         loss_mask if own else torch.zeros_like(loss_mask))

    @torch.no_grad()
    def eval_batch(self, input_: list[dict[str, Any]] | dict[str, Any], loss_fn: Callable[..., torch.Tensor],
                   loss_weight_fn: Callable[[dict[str, Any]], torch.Tensor]) -> torch.Tensor:
        """The weighted loss of ``train_batch`` without gradients or a step: AReaL's loss on the
        log-probabilities of ``forward_batch``."""
        rows, mbs = self._rows(input_, "eval_batch")
        weights = [float(loss_weight_fn(mb)) for mb in mbs]
        total = sum(weights)
        if total <= 0:
            raise ValueError(f"eval_batch: the loss weights sum to {total:g}: nothing to evaluate")
        logprobs = self._logprobs(rows)
        loss = sum(loss_fn(lp, torch.full_like(lp, float("nan")), mb) * (w / total)
                   for lp, mb, w in zip(logprobs, mbs, weights) if w != 0)
        return loss.detach().to(torch.float32)

    @torch.no_grad()
    def forward_batch(self, input_: list[dict[str, Any]] | dict[str, Any], output_seqlens: list[int] | None = None,
                      aggregate_fn: Callable[[list[torch.Tensor]], torch.Tensor] = torch.cat
                      ) -> torch.Tensor | list[torch.Tensor]:
        """Log-probabilities in AReaL's logits frame, float32: ``out[b, t] = log p(input_ids[b, t + 1] |
        input_ids[b, :t + 1])`` for ``t`` below the row's length - 1, 0 elsewhere. ``[B, L]`` for a
        dict, one ``[b_i, L_i]`` per dict for a list (AReaL's ``split_batch``); every unique token
        is computed once (``method`` ``dta``/``packed``). Several processes: the rows of this rank's
        ``input_``, computed with the whole batch's (every rank calls it)."""
        share = _share(input_, "forward_batch", output_seqlens)
        rows, first = self._whole_batch(share)
        if not rows:
            raise ValueError("forward_batch: the batch is empty")
        mine = self._logprobs(rows)[first:first + len(share.rows)]  # every rank: dta's collectives
        if not share.rows:
            return []
        lengths = [int(row["attention_mask"].sum()) for row in share.rows]
        packed = aggregate_fn([torch.cat(mine)])
        out = torch.zeros(share.batch["attention_mask"].shape, dtype=packed.dtype, device=packed.device)
        for b, row in enumerate(packed.split(lengths)):
            out[b, :lengths[b]] = row
        return out if share.meta is None else split_batch(out, share.meta)

    # --- statistics and memory --------------------------------------------------------------

    def export_stats(self) -> dict[str, float]:
        return stats_tracker.export_all(reduce_group=self.data_parallel_group)

    def onload(self) -> None:
        raise NotImplementedError("dta.Trainer does not move its weights off the GPU: set actor.offload=false "
                                  "and keep the actor off the rollout GPUs (no colocation); "
                                  "DTAOptions(trainer={'offload_optimizer': True}) keeps AdamW's state on the host")

    def offload(self) -> None:
        self.onload()

    def get_device_stats(self) -> DeviceRuntimeInfo:
        return DeviceRuntimeInfo.get_current()

    # --- helpers ------------------------------------------------------------------------------

    def _require_trainer(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError("the engine is not initialized: call initialize() first")
        return self.trainer

    def _require_group(self) -> dist.ProcessGroup:
        if self._group is None:
            raise RuntimeError("no process group: call create_process_group() first")
        return self._group

    def _save_hf(self, path: str, *, optimizer: bool) -> None:
        """The Hugging Face files directly in ``path`` (dta.Trainer.save writes them to
        ``dir/model``) and, with ``optimizer``, the AdamW state in ``path/optimizer``. Collective:
        every rank saves into world rank 0's staging directory, which rank 0 then moves in place."""
        trainer = self._require_trainer()
        target = Path(path)
        first = dist.get_rank() == 0
        staging = [None]
        if first:
            target.mkdir(parents=True, exist_ok=True)
            staging = [tempfile.mkdtemp(prefix=".dta-save-", dir=target)]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(staging, src=0, group=self.cpu_group)
        try:
            trainer.save(staging[0], dtype=None, optimizer=optimizer)  # complete on every rank's return
            if first:
                for entry in [*(Path(staging[0]) / "model").iterdir(),
                              *([Path(staging[0]) / "optimizer"] if optimizer else [])]:
                    destination = target / entry.name
                    if destination.is_dir():
                        shutil.rmtree(destination)
                    os.replace(entry, destination)
        finally:
            if first:
                shutil.rmtree(staging[0], ignore_errors=True)

    def _coordinator(self) -> DistRolloutCoordinator:
        if self.rollout_coordinator is None:
            raise RuntimeError("no inference engine: call connect_engine() first")
        return self.rollout_coordinator

    @staticmethod
    def _check_update_mode(meta: WeightUpdateMeta) -> None:
        if meta.type not in ("disk", "xccl"):
            raise NotImplementedError(f"weight update mode {meta.type!r}: dta.areal publishes weights through "
                                      "disk or xccl (set actor.weight_update_mode=disk or xccl)")
        if meta.use_lora:
            raise NotImplementedError("LoRA weight updates: dta.Trainer trains every weight")

    def _form_weight_group(self, engine: InferenceEngine, meta: WeightUpdateMeta) -> None:
        """The xccl rendezvous (AReaL's ``_init_weight_update_from_distributed`` for one pipeline
        stage): the engine's workers join while this process creates rank 0."""
        generation = meta.gen_allocation
        if generation is None:
            raise ValueError("xccl: WeightUpdateMeta.gen_allocation is None (the inference engines' "
                             "allocation says how many workers join the group)")
        if generation.parallel.pp_size > 1:
            raise NotImplementedError(f"xccl to engines with pipeline parallelism ({generation.parallel}): "
                                      "use weight_update_mode=disk")
        host = self._weight_update_host()
        if self._weight_group is not None:
            dist.destroy_process_group(self._weight_group)
            self._weight_group = self._weight_group_at = None
        # torchrun's agent store blocks a second TCP store (AReaL sets the same).
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(False)
        meta.nccl_master_address, meta.nccl_master_port = host, find_free_ports(1)[0]
        meta.nccl_group_name = "update_weight_group"
        joined = engine.init_weights_update_group(meta)
        backend = "nccl" if self._require_trainer().device.type == "cuda" else "gloo"
        self._weight_group = init_custom_process_group(
            backend=backend, world_size=generation.parallel.world_size + 1, rank=0,
            init_method=f"tcp://{format_host_for_url(meta.nccl_master_address)}:{meta.nccl_master_port}",
            group_name=meta.nccl_group_name, timeout=DIST_GROUP_DEFAULT_TIMEOUT)
        joined.result()
        self._weight_group_at = (meta.nccl_master_address, meta.nccl_master_port, meta.nccl_group_name)
        logger.info("xccl: weight-update group %s formed with %d engine workers (%s)", meta.nccl_group_name,
                    generation.parallel.world_size, backend)

    def _weight_update_host(self) -> str:
        """Where the weight-update group meets: ``DTAOptions.weight_update_host``, which must be
        an address of this host (the group's store listens here, so a foreign or unresolvable one
        would leave the workers and this engine waiting out the rendezvous timeout), else AReaL's
        ``gethostip()``."""
        host = self.options.weight_update_host
        if host is None:
            return gethostip()
        host = host.strip().removeprefix("[").removesuffix("]")  # the brackets of an IPv6 URL
        try:
            addresses = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise ValueError(f"DTAOptions.weight_update_host={host!r} does not resolve ({e}): give an address "
                             "of this host that the inference engines' workers reach") from None
        errors = []
        for family, kind, proto, _, address in addresses:
            try:
                with socket.socket(family, kind, proto) as probe:
                    probe.bind(address)
                return host
            except OSError as e:
                errors.append(f"{address[0]}: {e.strerror or e}")
        raise ValueError(f"DTAOptions.weight_update_host={host!r} is not an address of this host "
                         f"({'; '.join(errors)}): the weight-update group meets there; give an address of one "
                         "of this host's interfaces that the inference engines' workers reach")

    def _broadcast_weights(self, meta: WeightUpdateMeta) -> None:
        sender = dist.get_rank() == 0
        if sender and (self._weight_group is None or self._weight_group_at is None):
            raise RuntimeError("update_weights(xccl): no weight-update group; call connect_engine() with an "
                               "xccl WeightUpdateMeta first")
        dtype = getattr(torch, self.config.dtype)
        with self._whole_weights(dtype) as weights:
            if not sender:
                dist.barrier(group=self.cpu_group)
                return
            meta.nccl_master_address, meta.nccl_master_port, meta.nccl_group_name = self._weight_group_at
            limit = meta.weight_chunked_mem_mb * 1024 * 1024
            engine = self.rollout_engine
            engine.pause_generation()
            bucket: list[tuple[str, torch.Tensor]] = []
            size = 0
            for name, tensor in weights:
                nbytes = tensor.numel() * tensor.element_size()
                if bucket and size + nbytes > limit:
                    self._broadcast_bucket(meta, bucket)
                    bucket, size = [], 0
                bucket.append((name, tensor))
                size += nbytes
            if bucket:
                self._broadcast_bucket(meta, bucket)
            engine.continue_generation()
        dist.barrier(group=self.cpu_group)

    @contextlib.contextmanager
    def _whole_weights(self, dtype: torch.dtype) -> Any:
        """Every weight whole under its Hugging Face name, in ``parameters()``' order and
        ``dtype``, on world rank 0 (empty elsewhere). Without tensor parallelism rank 0's replica
        holds them whole; with it, every rank takes part in dta's gather (``Trainer.save``, which
        writes them once) and rank 0 reads the checkpoint it wrote."""
        trainer = self._require_trainer()
        order = list(trainer.parameters())
        if self._tp == 1:
            params = trainer.parameters()
            # The parameter itself when already in dtype: the broadcast reads it.
            yield ((name, params[name].detach().to(dtype)) for name in order) if dist.get_rank() == 0 else iter(())
            return
        staging = [tempfile.mkdtemp(prefix=".dta-weights-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(staging, src=0, group=self.cpu_group)
        try:
            trainer.save(staging[0], dtype=dtype, optimizer=False)
            if dist.get_rank() != 0:
                yield iter(())
                return
            model = Path(staging[0]) / "model"
            saved: dict[str, torch.Tensor] = {}
            for file in sorted(model.glob("*.safetensors")):
                saved.update(load_file(str(file), device=str(trainer.device)))
            yield ((name, saved[name]) for name in order)
        finally:
            if dist.get_rank() == 0:
                shutil.rmtree(staging[0], ignore_errors=True)

    def _broadcast_bucket(self, meta: WeightUpdateMeta, bucket: list[tuple[str, torch.Tensor]]) -> None:
        specs = [ParamSpec(name=name, shape=tuple(t.shape), dtype=str(t.dtype).split("torch.")[1])
                 for name, t in bucket]
        received = self.rollout_engine.update_weights_from_distributed(meta, specs)
        sent = [dist.broadcast(tensor, src=0, group=self._weight_group, async_op=True) for _, tensor in bucket]
        for work in sent:
            work.wait()
        received.result()

    def _rows(self, input_: list[dict[str, Any]] | dict[str, Any], what: str
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The whole batch's rows as [1, L] dicts (see ``_whole_batch``), and each as the packed
        one-sequence micro-batch AReaL's loss functions take (on the trainer's device)."""
        rows, _ = self._whole_batch(_share(input_, what))
        if not rows:
            raise ValueError(f"{what}: the batch is empty: nothing to train, no step taken")
        device = self._require_trainer().device
        return rows, [tensor_container_to(pack_tensor_dict(row), device) for row in rows]

    def _whole_batch(self, share: _Share | ValueError) -> tuple[list[dict[str, Any]], int]:
        """The data-parallel ranks' shares gathered in rank order (every rank the same rows in the
        same order; a replica's TP ranks hold one share) and where this rank's rows begin. An
        error in any rank's share raises on every rank (before any collective of dta's)."""
        if self._replicas == 1:
            if isinstance(share, ValueError):
                raise share
            return share.rows, 0
        mine = share if isinstance(share, ValueError) else [tensor_container_to(r, "cpu") for r in share.rows]
        shares: list[Any] = [None] * self._replicas
        dist.all_gather_object(shares, mine, group=self._dp_objects)
        for rank, got in enumerate(shares):
            if isinstance(got, ValueError):
                raise got if rank == self._dp_rank else ValueError(f"data-parallel rank {rank}: {got}")
        first = sum(len(got) for got in shares[:self._dp_rank])
        return [row for got in shares for row in got], first

    def _agree(self, error: ValueError | None) -> None:
        """Raises on every rank when any data-parallel rank found an error in its share."""
        if self._replicas > 1:
            errors: list[Any] = [None] * self._replicas
            dist.all_gather_object(errors, error, group=self._dp_objects)
            for rank, got in enumerate(errors):
                if got is not None and rank != self._dp_rank:
                    raise ValueError(f"data-parallel rank {rank}: {got}")
        if error is not None:
            raise error

    def _logprobs(self, rows: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Each row's log-probabilities in AReaL's logits frame, [L_i]."""
        trajectories = []
        for i, row in enumerate(rows):
            zeros = torch.zeros(row["input_ids"].shape, dtype=torch.int64)  # a forward needs the tokens
            forward = {"input_ids": row["input_ids"], "attention_mask": row["attention_mask"],
                       "loss_mask": zeros, "logprobs": zeros}
            if row.get("routed_experts") is not None:  # and their routing, replayed (R3)
                forward["routed_experts"] = row["routed_experts"]
            trajectories.append(from_areal(forward, id=str(i), shifted=False))
        logprobs = self._require_trainer().compute_logprobs(trajectories, method=self.options.method,
                                                            **self._executor)
        # dta's frame ([0] = 0) to AReaL's, in float32 as AReaL's engines give them (its statistics
        # take nothing else); dta's log-probabilities are float32 already unless the model is float64.
        return [torch.roll(lp, -1).float() for lp in logprobs]

    def _builtin_loss(self, loss_fn: Callable[..., torch.Tensor], rows: list[dict[str, Any]],
                      mbs: list[dict[str, Any]], weights: list[float]) -> tuple[str, dict[str, float]] | str:
        """dta's loss and options computing exactly what ``loss_fn`` would, or why none does."""
        if self.options.loss == "areal":
            return "DTAOptions.loss='areal'"
        why = _why_not_builtin(loss_fn, rows, mbs, weights, getattr(self.config, "ppo_n_minibatches", 1))
        if isinstance(why, tuple) or self.options.loss == "auto":
            return why
        raise ValueError(f"DTAOptions.loss='dta' cannot express this loss ({why}): use loss='auto' or 'areal'")


class DTAPPOActor(DTAEngine):
    """AReaL's ``PPOActor`` on :class:`DTAEngine`, as ``FSDPPPOActor`` is on the FSDP engine."""

    def __init__(self, config: PPOActorConfig, options: DTAOptions | None = None) -> None:
        super().__init__(config, options)
        self.actor = PPOActor(config, self)

    # AReaL's PPOActor pads the list into one batch before the engine sees it: each dict's widths
    # are checked here, while they can still be told apart (see _check_token_widths), on every
    # data-parallel rank together.

    def _check_widths(self, data: list[dict[str, Any]], what: str) -> None:
        try:
            _check_token_widths(data, what)
        except ValueError as e:
            self._agree(e)
        else:
            self._agree(None)

    @torch.no_grad()
    def compute_logp(self, data: list[dict[str, Any]], *args: Any, **kwargs: Any) -> list[torch.Tensor] | None:
        self._check_widths(data, "compute_logp")
        return self.actor.compute_logp(data, *args, **kwargs)

    @torch.no_grad()
    def compute_advantages(self, data: list[dict[str, Any]], *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        self._check_widths(data, "compute_advantages")
        return self.actor.compute_advantages(data, *args, **kwargs)

    def ppo_update(self, data: list[dict[str, Any]], *args: Any, **kwargs: Any) -> None:
        self._check_widths(data, "ppo_update")
        self.actor.ppo_update(data, *args, **kwargs)

    @classmethod
    def as_controller(cls, config: PPOActorConfig, scheduler: Any) -> PPOActorController:
        """AReaL's single-controller mode: its RPC workers build ``DTAPPOActor(config=...)`` with
        the default :class:`DTAOptions` (not covered by dta's tests)."""
        if config._version != "v1":
            # v2 is AReaL's training service, whose weight updates are awex only, with adapters for
            # FSDP and Megatron engines (areal/experimental/training_service/worker/awex.py).
            raise NotImplementedError("dta.areal supports AReaL's v1 train controller (actor._version=v1): the "
                                      "v2 training service publishes weights through awex only, whose adapters "
                                      "take AReaL's FSDP and Megatron engines (docs/python.md)")
        return PPOActorController(train_engine=cls, config=config, scheduler=scheduler)


class DTAPPOTrainer(PPOTrainer):
    """AReaL's ``PPOTrainer`` whose train engines (actor, reference, teacher) are
    :class:`DTAPPOActor`; the critic, if any, stays AReaL's.

    Raises (at construction, from ``_create_train_engine``): ValueError when the engine's
    allocation does not map onto dta's layout (see :meth:`DTAEngine.create_process_group`)."""

    def __init__(self, config: Any, train_dataset: Any = None, valid_dataset: Any = None, *,
                 options: DTAOptions | None = None) -> None:
        self.dta_options = options or DTAOptions()
        super().__init__(config, train_dataset, valid_dataset)

    def _create_train_engine(self, actor_config: PPOActorConfig, alloc: ModelAllocation) -> Any:
        if is_single_controller():
            engine = DTAPPOActor.as_controller(actor_config, self.scheduler)
        else:
            engine = DTAPPOActor(actor_config, self.dta_options)
        engine.create_process_group(parallel_strategy=alloc.parallel)
        return engine


# --- layouts -----------------------------------------------------------------------------------


def _layout(strategy: ParallelStrategy, config: TrainEngineConfig, options: DTAOptions) -> tuple[int, int]:
    """AReaL's parallel strategy as dta's (replicas, tensor-parallel size), or a ValueError naming
    the field that does not map."""
    where = _allocation_name(strategy, config)
    for field_name, size, why in (
            ("pipeline_parallel_size", strategy.pipeline_parallel_size, "dta runs every layer on every rank"),
            ("context_parallel_size", strategy.context_parallel_size, "dta keeps a rollout's tokens on one replica"),
            ("expert_parallel_size", strategy.expert_parallel_size, "dta.Trainer has no expert parallelism"),
            ("expert_tensor_parallel_size", strategy.expert_tensor_parallel_size,
             "dta.Trainer has no expert parallelism")):
        if size != 1:
            raise ValueError(f"{where}: {field_name}={size}: {why}; dta.areal maps data (d) and tensor (t) "
                             "parallelism only (e.g. fsdp:d2t4)")
    tp, replicas = strategy.tensor_parallel_size, strategy.data_parallel_size
    for key in ("distributed", "tensor_parallel"):
        if key in options.trainer:
            raise ValueError(f"DTAOptions.trainer[{key!r}]: the engine's allocation ({where}) sets it")
    config_json = Path(config.path or "") / "config.json"
    if tp > 1 and config_json.is_file():
        model = json.loads(config_json.read_text())
        model = model.get("text_config", model)
        for key in ("num_attention_heads", "num_key_value_heads"):
            heads = model.get(key)
            if isinstance(heads, int) and heads % tp:
                raise ValueError(f"{where}: tensor_parallel_size={tp} does not divide the model's {key}={heads} "
                                 f"({config_json}): dta splits heads evenly across the tensor-parallel ranks")
    return replicas, tp


def _allocation_name(strategy: ParallelStrategy, config: TrainEngineConfig) -> str:
    return f"actor.backend={config.backend!r}" if config.backend else f"the allocation ({strategy})"


@contextlib.contextmanager
def _launch_environment(group: dist.ProcessGroup) -> Any:
    """torchrun's environment for dta's trainer while it joins the ranks: torch.distributed's own
    RANK and WORLD_SIZE, and world rank 0's MASTER_ADDR (or AReaL's choice of its address) with a
    free port of its, where dta's store meets (torch.distributed's store holds MASTER_PORT)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    where: list[Any] = [None]
    if rank == 0:
        where = [(os.environ.get("MASTER_ADDR") or gethostip(), find_free_ports(1)[0])]
    dist.broadcast_object_list(where, src=0, group=group)
    address, port = where[0]
    env = dict(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=address, MASTER_PORT=str(port),
               LOCAL_RANK=os.environ.get("LOCAL_RANK", str(rank)), TORCHELASTIC_USE_AGENT_STORE="False")
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# --- conversions ----------------------------------------------------------------------------------


# AReaL's per-token keys (its workflows', compute_logp's and compute_advantages'): [rows, L] as
# input_ids in every dict. Any other tensor of two or more dimensions whose first is the dict's rows
# is per-token too, as AReaL's padding treats it.
_PER_TOKEN_KEYS = ("attention_mask", "loss_mask", "logprobs", "versions", "prox_logp", "advantages", "ref_logp",
                   "teacher_logp", "values", "returns", "kl_rewards", "tot_rewards")


def _check_token_widths(input_: list[dict[str, Any]] | dict[str, Any], what: str) -> None:
    """Every per-token tensor of every dict is ``[rows, L, ...]`` with its ``input_ids``' ``[rows,
    L]``, checked before AReaL's ``concat_batch`` right-pads each key to the batch's widest (which
    hides a tensor one column short and leaves it misaligned with the tokens).

    Raises:
        ValueError: Naming the dict, its rows (and their rows in the concatenated batch), the key
            and both lengths; or an ``input_ids`` / ``attention_mask`` that is not a 2-D tensor.
    """
    dicts = input_ if isinstance(input_, list) else [input_]
    first = 0  # the dict's first row in the concatenated batch
    for i, d in enumerate(dicts):
        where = f"dict {i}" if isinstance(input_, list) else "the batch"
        if not isinstance(d, Mapping):
            raise ValueError(f"{what}: {where}: expected a dict of tensors, got {type(d).__name__}")
        for key in ("input_ids", "attention_mask"):
            value = d.get(key)
            if not isinstance(value, torch.Tensor) or value.dim() != 2:
                got = ("missing" if key not in d else f"got {list(value.shape)}" if isinstance(value, torch.Tensor)
                       else f"got {type(value).__name__}")
                raise ValueError(f"{what}: {where}: field '{key}': expected a [B, L] tensor, {got}")
        rows, width = d["input_ids"].shape
        span = "row 0" if rows == 1 else f"rows 0-{rows - 1}"
        if isinstance(input_, list):
            span += f" (row {first} of the batch)" if rows == 1 else f" (rows {first}-{first + rows - 1} of the batch)"
        # attention_mask first: with input_ids it says what the other tensors must match.
        for key, value in sorted(d.items(), key=lambda item: item[0] != "attention_mask"):
            if key == "input_ids" or not isinstance(value, torch.Tensor):
                continue
            if key in _PER_TOKEN_KEYS and (value.dim() < 2 or value.shape[0] != rows):
                raise ValueError(f"{what}: {where}: field '{key}' is {list(value.shape)} but 'input_ids' is "
                                 f"[{rows}, {width}]: a per-token tensor has a row of L values per row of input_ids")
            if value.dim() >= 2 and value.shape[0] == rows and value.shape[1] != width:
                raise ValueError(f"{what}: {where}, {span}: field '{key}' has {value.shape[1]} positions per row "
                                 f"but 'input_ids' has {width}: every per-token tensor is [rows, L] as input_ids "
                                 "(padding the batch would hide the difference and misalign the tokens)")
        first += rows


def _batched(input_: list[dict[str, Any]] | dict[str, Any], what: str) -> tuple[dict[str, Any], Any]:
    """AReaL's batch as one padded dict (list input concatenated by AReaL's ``concat_batch``, after
    ``_check_token_widths``)."""
    if isinstance(input_, list) and not input_:
        raise ValueError(f"{what}: the batch is empty: nothing to train, no step taken")
    _check_token_widths(input_, what)
    if isinstance(input_, list):
        batch, meta = concat_batch(input_)
    else:
        batch, meta = input_, None
    return batch, meta


@dataclass
class _Share:
    """A rank's part of the batch: its rows ([1, L] dicts), the padded batch and AReaL's
    ``concat_batch`` meta (None for a dict)."""

    rows: list[dict[str, Any]]
    batch: dict[str, Any] | None = None
    meta: Any = None


def _share(input_: list[dict[str, Any]] | dict[str, Any], what: str,
           output_seqlens: list[int] | None = None) -> _Share | ValueError:
    """This rank's ``input_`` as a :class:`_Share` (empty for ``[]``), or the ValueError that
    names what is wrong with it (returned, so that every rank raises it together)."""
    if isinstance(input_, list) and not input_:
        return _Share([])
    try:
        batch, meta = _batched(input_, what)
        rows = _split_rows(batch)
        lengths = [int(row["attention_mask"].sum()) for row in rows]
        if output_seqlens is not None and meta is None and list(output_seqlens) != lengths:
            raise ValueError(f"{what}: output_seqlens {list(output_seqlens)} differ from the attention "
                             f"mask's lengths {lengths}")
    except ValueError as e:
        return e
    return _Share(rows, batch, meta)


def _split_rows(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """Row b of every tensor whose first dimension is the batch's; other values as they are."""
    size = batch["attention_mask"].shape[0]
    return [{k: v[b:b + 1] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == size else v
             for k, v in batch.items()} for b in range(size)]


def _trajectory(row: dict[str, Any], index: int) -> Trajectory:
    """``from_areal`` of one row in the logits frame (which checks the frame), naming the row."""
    try:
        return from_areal(row, id=str(index), shifted=True)
    except ValueError as e:
        raise ValueError(f"row {index}: {e}") from None


def _why_not_builtin(loss_fn: Callable[..., torch.Tensor], rows: list[dict[str, Any]], mbs: list[dict[str, Any]],
                     weights: list[float], n_minibatches: int) -> tuple[str, dict[str, float]] | str:
    """dta's named loss for AReaL's ``functools.partial(grpo_loss_fn, ...)`` (PPOActor's), or the
    reason there is none. dta's ``ppo`` is AReaL's clipped surrogate (eps_clip, eps_clip_higher,
    dual clip c_clip) with a token mean; ``decoupled-ppo`` adds the behaviour weight and drops
    tokens whose pi_prox / pi_behave exceeds a cap, i.e. AReaL's decoupled loss with token-level
    ratio rejection sampling (mask, no lower bound)."""
    if not (isinstance(loss_fn, functools.partial) and loss_fn.func is grpo_loss_fn):
        return "the loss is not AReaL's grpo_loss_fn"
    kw = loss_fn.keywords
    for name, value, default in (("use_sapo_loss", kw.get("use_sapo_loss", False), False),
                                 ("m2_threshold", kw.get("m2_threshold"), None),
                                 ("importance_sampling_level", kw.get("importance_sampling_level", "token"), "token")):
        if value != default:
            return f"{name}={value!r}"
    if "teacher_logp" in rows[0]:
        return "teacher_logp (distillation)"
    for i, (mb, weight) in enumerate(zip(mbs, weights)):
        if weight != float(mb["loss_mask"].count_nonzero()):
            return f"loss_weight_fn is not the loss-token count (row {i}: {weight:g})"
    if "advantages" not in rows[0]:
        return "no 'advantages' (not the output of compute_advantages)"
    eps = float(kw["eps_clip"])
    higher = kw.get("eps_clip_higher")
    options = {"eps_clip_low": eps, "eps_clip_high": eps if higher is None else float(higher),
               "dual_clip": float(kw.get("c_clip") or 0.0)}
    rs = kw.get("rejection_sampling")
    if not kw.get("use_decoupled_loss", False):
        return ("ppo", options) if rs is None else "rejection_sampling without use_decoupled_loss"
    if kw.get("prox_logp_method", PROX_LOGP_METHOD_RECOMPUTE) != PROX_LOGP_METHOD_RECOMPUTE:
        return f"prox_logp_method={kw['prox_logp_method']!r} (dta recomputes pi_prox)"
    if n_minibatches != 1:
        return (f"ppo_n_minibatches={n_minibatches}: dta recomputes pi_prox at each step, AReaL keeps the one "
                "before the first minibatch")
    if rs is None:  # AReaL 1.0 applies no behaviour weight without rejection sampling
        return "decoupled-ppo", {**options, "behave_imp_weight": False}
    return "decoupled-ppo", {**options, "rejection_sampling": RejectionSampling(
        level=rs.level, action=rs.action, metric=rs.metric, aggregation=rs.agg, upper=float(rs.upper),
        lower=None if rs.lower is None else float(rs.lower))}


def _per_rollout(loss_fn: Callable[..., torch.Tensor], mbs: list[dict[str, Any]], weights: list[float],
                 total: float) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """AReaL's loss as a dta LossFn: rollout i is a one-sequence micro-batch of weight w_i, its
    loss scaled by w_i / sum(w), as AReaL's engines scale micro-batches."""

    def loss(logprobs: torch.Tensor, rollout: Any) -> torch.Tensor:
        i = rollout.index
        if weights[i] == 0:
            return logprobs.sum() * 0.0  # AReaL skips weightless micro-batches
        # dta's frame ([0] = 0) to AReaL's, float32 as AReaL's engines give them.
        shifted = torch.roll(logprobs, -1).float()
        entropy = torch.roll(rollout.entropy, -1).float()
        return loss_fn(shifted, entropy, mbs[i]) * (weights[i] / total)

    return loss


def _step_stats(stats: TrainStats) -> dict[str, float]:
    return dict(update_successful=float(not stats.skipped), grad_norm=float(stats.grad_norm), lr=float(stats.lr),
                num_micro_batches=1.0,
                dta_loss=float(stats.loss), dta_compression=float(stats.compression),
                dta_tree_tokens=float(stats.tree_tokens))

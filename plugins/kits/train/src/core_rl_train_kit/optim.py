"""Optimizer construction and the learning-rate schedule.

The schedule is a pure function of the optimizer step (:func:`lr_at`); the engine writes
``lr_at(step)`` into every parameter group before each optimizer step, so the schedule needs no
state of its own beyond the step count that checkpoints already carry.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from core_rl.config.model_sections import OPTIMIZERS
from core_rl.config.optimizer_class import constructor_kwargs, load_optimizer_class
from core_rl.config.schema import OptimizerConfig, SchedulerConfig

from core_rl_train_kit.muon import LR_RATIO, MuonWithAdamW, muon_split


def build_optimizer(
    params: Iterable[torch.nn.Parameter], config: OptimizerConfig, *, adamw_only: Iterable[torch.nn.Parameter] = ()
) -> torch.optim.Optimizer:
    """The optimizer ``config.name`` selects (:class:`~core_rl.config.model_sections.OptimizerConfig`)
    over the trainable ``params`` at ``config.lr``, grouped by :func:`decay_groups`: ``adamw``
    (betas, eps, decoupled weight decay), ``sgd`` (momentum, L2 weight decay), ``adafactor``,
    ``muon`` (Muon for the matrices among ``params`` that are not in ``adamw_only``, the engine's
    embeddings and output head: :func:`core_rl_train_kit.muon.embeddings_and_head`; AdamW for the
    rest) or ``class`` (``class_path``)."""
    params = [p for p in params if p.requires_grad]
    if config.name == "muon":
        hidden, others = muon_split(params, list(adamw_only))
        check_whole_matrices(hidden)
        kernel = adamw_kernel(others, config.implementation)
        return MuonWithAdamW(decay_groups(hidden, config), decay_groups(others, config), config, kernel)
    groups = decay_groups(params, config)
    if config.name == "adamw":
        return torch.optim.AdamW(
            groups,
            lr=config.lr,
            betas=tuple(config.betas),
            eps=config.eps,
            weight_decay=config.weight_decay,
            **adamw_kernel(params, config.implementation),
        )
    if config.name == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    if config.name in ("adafactor", "class"):
        cls = torch.optim.Adafactor if config.name == "adafactor" else load_optimizer_class(str(config.class_path))
        return cls(groups, **constructor_kwargs(cls, config))
    raise ValueError(f"actor.optimizer.name: unknown optimizer {config.name!r}; expected one of {OPTIMIZERS}")


def check_whole_matrices(hidden: list[torch.nn.Parameter]) -> None:
    """Raise ``ValueError`` when Muon's matrices are sharded (DTensors): it needs every matrix whole."""
    if any(type(p.data) is not torch.Tensor for p in hidden):
        raise ValueError(
            "actor.optimizer.name: muon needs whole weight matrices, but this engine shards them (DTensor "
            "parameters: FSDP with several processes, shard_single_rank, mixed precision or CPU offload); use "
            "adamw, or one process without sharding"
        )


def decay_groups(params: list[torch.nn.Parameter], config: OptimizerConfig) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: one group of every parameter, or, when ``weight_decay > 0``
    and ``no_decay`` is ``biases_and_norms``, the parameters of two or more dimensions (decayed)
    then the others (biases, norm scales; ``weight_decay`` 0). Dimensions are the parameter's full
    shape: a DeepSpeed ZeRO-3 partition's ``ds_shape``, a DTensor's global shape."""
    if config.weight_decay == 0 or config.no_decay == "none":
        return [{"params": params}]
    decayed = [p for p in params if len(getattr(p, "ds_shape", p.shape)) >= 2]
    spared = [p for p in params if len(getattr(p, "ds_shape", p.shape)) < 2]
    return [g for g in ({"params": decayed}, {"params": spared, "weight_decay": 0.0}) if g["params"]]


def restore_weight_decay(optimizer: torch.optim.Optimizer, config: OptimizerConfig) -> None:
    """After loading saved optimizer state, which brings the saving run's per-group settings: each
    group's weight decay as this run's ``config`` says (0 for a group of spared parameters, see
    :func:`decay_groups`), so a change of ``weight_decay`` or ``no_decay`` on resume takes effect."""
    for group in optimizer.param_groups:
        spared = config.no_decay == "biases_and_norms" and all(
            len(getattr(p, "ds_shape", p.shape)) < 2 for p in group["params"]
        )
        group["weight_decay"] = 0.0 if spared else config.weight_decay


FUSED_DEVICES = ("cpu", "cuda")
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def adamw_kernel(params: list[torch.nn.Parameter], implementation: str) -> dict[str, bool]:
    """The keyword arguments choosing torch's AdamW kernel (``OptimizerConfig.implementation``).

    ``auto`` picks ``fused`` when every parameter is a plain tensor (not a DTensor or other
    subclass) of a float dtype on CPU or CUDA: one kernel over all parameters instead of a Python
    loop of small ops (about 4x faster on CPU for a 3M-parameter model); otherwise torch's default.
    """
    if implementation == "fused":
        return {"fused": True}
    if implementation == "foreach":
        return {"foreach": True}
    if implementation == "for_loop":
        return {"foreach": False}
    plain = all(
        type(p.data) is torch.Tensor and p.device.type in FUSED_DEVICES and p.dtype in FUSED_DTYPES for p in params
    )
    return {"fused": True} if params and plain else {}


def placed_scalar_state(value: torch.Tensor, param: torch.Tensor, group: Mapping[str, Any]) -> torch.Tensor:
    """A copy of a scalar of a parameter's optimizer state (AdamW's ``step``) where torch's kernel
    for ``group`` reads it: on the parameter's device as float32 for the fused and capturable
    implementations, on the CPU otherwise (torch's own rule when it creates the state)."""
    if group.get("fused") or group.get("capturable"):
        return value.to(device=param.device, dtype=torch.float32, copy=True)
    return value.to(device="cpu", copy=True)


def settle_scalar_states(optimizer: torch.optim.Optimizer) -> None:
    """After loading saved optimizer state: each parameter's scalar state its own tensor, placed
    by :func:`placed_scalar_state` for the kernel this run uses.

    Loaders leave it otherwise: torch's ``load_state_dict`` places ``step`` by the *saved* groups'
    kernel flags (a checkpoint from a run whose parameters were DTensors, which use the foreach
    kernel, leaves it on the CPU, where a fused CUDA kernel refuses it), and megatron-core's
    distributed optimizer loads one tensor into every parameter's state (torch then adds 1 to it
    once per parameter at each step, and Adam's bias corrections go wrong)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            for key, value in (state or {}).items():
                if torch.is_tensor(value) and value.dim() == 0:
                    state[key] = placed_scalar_state(value, param, group)


def warmup_steps(config: SchedulerConfig) -> int:
    """``warmup_steps`` if set, else ``floor(warmup_ratio * total_steps)``."""
    if config.warmup_steps > 0:
        return config.warmup_steps
    return int(config.warmup_ratio * config.total_steps)


def check_schedule(config: SchedulerConfig) -> None:
    """Raise ``ValueError`` if the schedule cannot be evaluated: decaying schedules need
    ``total_steps`` (the loader fills it from ``trainer.total_steps``)."""
    if config.name in ("linear", "cosine", "wsd") and config.total_steps <= 0:
        raise ValueError(
            f"actor.lr_scheduler.total_steps: must be > 0 for a {config.name} schedule, got {config.total_steps}"
        )


def lr_at(step: int, base_lr: float, config: SchedulerConfig) -> float:
    """The learning rate of optimizer step ``step`` (0-based).

    With ``W`` warmup steps, ``S = total_steps``, ``m = min_lr_ratio``:

    - warmup, ``step < W``: ``base_lr * (step + 1) / W`` (the first step already moves; step
      ``W - 1`` reaches ``base_lr``);
    - afterwards, with progress ``p = clamp((step - W) / max(S - W, 1), 0, 1)``:

      - ``constant``: ``base_lr``
      - ``linear``:   ``base_lr * (m + (1 - m) * (1 - p))``
      - ``cosine``:   ``base_lr * (m + (1 - m) * (1 + cos(pi * p)) / 2)``
      - ``wsd``: ``base_lr`` until step ``S - D`` (``D``: ``SchedulerConfig.wsd_decay_steps``), then with
        ``p = clamp((step - (S - D)) / D, 0, 1)`` the ``decay_style`` ``linear`` or ``cosine`` as
        above, or ``1-sqrt``: ``base_lr * (m + (1 - m) * (1 - sqrt(p)))``

    so decaying schedules reach ``m * base_lr`` at step ``S`` and stay there.
    """
    check_schedule(config)
    w = warmup_steps(config)
    if step < w:
        return base_lr * (step + 1) / w
    if config.name == "constant":
        return base_lr
    style, start, span = config.name, w, config.total_steps - w
    if config.name == "wsd":
        span = config.wsd_decay_steps
        style, start = config.decay_style, max(config.total_steps - span, w)
    p = min(max((step - start) / max(span, 1), 0.0), 1.0)
    m = config.min_lr_ratio
    if style == "linear":
        return base_lr * (m + (1.0 - m) * (1.0 - p))
    if style == "cosine":
        return base_lr * (m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p)))
    if style == "1-sqrt":
        return base_lr * (m + (1.0 - m) * (1.0 - math.sqrt(p)))
    raise ValueError(f"actor.lr_scheduler.name: unknown schedule {config.name!r}")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write ``lr`` into every parameter group, times the group's ``lr_ratio`` where it has one
    (Muon's groups: ``muon_lr / lr``, :mod:`core_rl_train_kit.muon`)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group[LR_RATIO] if LR_RATIO in group else lr

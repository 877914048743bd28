"""The ``megatron`` engine's optimizer side: Megatron's own optimizer and the schedule hooks it
needs (CUDA), and the update step of both ways to run (:func:`apply_update`).

On a CPU the optimizer is the core's ``build_optimizer`` over DDP's gradient buffers
(``param.main_grad``); the gradient norm and clipping are computed over the model-parallel group
exactly as Megatron's optimizer computes them (:func:`main_grad_norm`).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from core_rl.config.schema import OptimizerConfig
from core_rl.loops import optimizer_states
from megatron.core import parallel_state as mpu
from megatron.core.distributed import finalize_model_grads
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from core_rl_megatron.config import MEGATRON_OPTIMIZERS, DDPConfig, MegatronConfig, gpu_optimizer_problem
from core_rl_megatron.errors import MegatronSetupError

if TYPE_CHECKING:
    from core_rl_megatron.engine import MegatronEngine


def megatron_optimizer(
    model: list[Any], opt: OptimizerConfig, cfg: MegatronConfig, grad_clip: float, dtype: torch.dtype
) -> Any:
    """Megatron's optimizer for the DDP-wrapped ``model`` chunks (parameters of ``dtype``), configured
    by :func:`optimizer_config`. ``actor.optimizer.no_decay`` picks which parameters are decayed by
    ``weight_decay``, as the core's optimizer does for fsdp and deepspeed: ``biases_and_norms``
    keeps Megatron's groups (``wd_mult`` 0 for one-dimensional parameters and biases),
    ``none`` decays every group."""
    from megatron.core.optimizer import get_megatron_optimizer

    optimizer = get_megatron_optimizer(optimizer_config(opt, cfg, grad_clip, dtype), model)
    set_group_weight_decay(optimizer, opt)
    return optimizer


def set_group_weight_decay(optimizer: Any, opt: OptimizerConfig) -> None:
    """Each of Megatron's parameter groups decayed by ``opt.weight_decay``, but the groups Megatron
    exempts (``wd_mult`` 0) under ``no_decay: biases_and_norms``. Also after loading a checkpoint,
    whose saved groups carry the saving run's values."""
    for group in optimizer.param_groups:
        spared = opt.no_decay == "biases_and_norms" and group.get("wd_mult", 1.0) == 0.0
        group["weight_decay"] = 0.0 if spared else opt.weight_decay


def optimizer_config(opt: OptimizerConfig, cfg: MegatronConfig, grad_clip: float, dtype: torch.dtype) -> Any:
    """Megatron's ``OptimizerConfig`` from ``actor.optimizer`` (AdamW or SGD), ``actor.grad_clip`` and the
    engine's ``bf16`` and distributed-optimizer settings, for parameters of ``dtype``. bfloat16
    parameters (``bf16: true``, or ``actor.dtype: bfloat16``) get float32 master weights: Megatron's
    float32 optimizer would assign float32 gradients to them. float16 parameters are refused: this
    engine sets up no loss scaling."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

    if opt.name not in MEGATRON_OPTIMIZERS:
        raise MegatronSetupError(gpu_optimizer_problem(opt.name))
    if dtype == torch.float16 and not cfg.bf16:
        raise MegatronSetupError(
            "actor.dtype: float16 on the megatron engine trains without loss scaling, which it does not set up; "
            "use actor.dtype: bfloat16, or float32 with actor.engine.bf16: true"
        )
    bf16 = cfg.bf16 or dtype == torch.bfloat16
    return MegatronOptimizerConfig(
        optimizer="adam" if opt.name == "adamw" else "sgd",
        lr=opt.lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        adam_eps=opt.eps,
        sgd_momentum=opt.momentum,
        clip_grad=grad_clip,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else dtype,
        use_distributed_optimizer=cfg.ddp.use_distributed_optimizer,
        overlap_param_gather=cfg.ddp.overlap_param_gather,
    )


#: a parameter name in a Megatron model chunk that belongs to the embeddings or the output layer
_EMBEDDING_OR_HEAD = re.compile(r"(^|\.)(embedding|output_layer)\.")


def embeddings_and_head(model: list[Any]) -> list[torch.nn.Parameter]:
    """The parameters of the chunks' embeddings and output layer (Muon leaves them to AdamW)."""
    return [p for chunk in model for name, p in chunk.named_parameters() if _EMBEDDING_OR_HEAD.search(name)]


def pending_state_bytes(optimizer: Any, opt: OptimizerConfig) -> int:
    """Device bytes ``optimizer``'s first step still allocates (the ``auto`` micro-batch budget
    leaves them free): its state for each tensor it updates, each that tensor's size (AdamW two
    moments, SGD a momentum buffer). Those tensors are the float32 master copies with Megatron's
    optimizer (this rank's shard of them under the distributed optimizer), the parameters with the
    CPU one; DDP's gradient buffers and the master copies exist from the engine's build."""
    updated = sum(p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"])
    return updated * optimizer_states(opt.name, opt.momentum)


def install_schedule_hooks(tconfig: Any, model: list[Any], ddp: DDPConfig) -> None:
    """What Megatron's schedules call between micro-batches (as Megatron-LM's training loop sets up):
    DDP's ``no_sync``, ``finalize_model_grads`` and, where overlapped, the gradient and parameter syncs."""

    def one_or_list(items: list[Any]) -> Any:
        return items[0] if len(items) == 1 else items

    tconfig.no_sync_func = one_or_list([c.no_sync for c in model])
    tconfig.finalize_model_grads_func = finalize_model_grads
    if ddp.overlap_grad_reduce:
        tconfig.grad_sync_func = one_or_list([c.start_grad_sync for c in model])
    if ddp.overlap_param_gather:
        tconfig.param_sync_func = one_or_list([c.start_param_sync for c in model])


def remove_schedule_hooks(tconfig: Any) -> None:
    """Undo :func:`install_schedule_hooks`: its hooks are bound to the chunks, so a config that
    keeps them keeps the model."""
    for hook in ("no_sync_func", "finalize_model_grads_func", "grad_sync_func", "param_sync_func"):
        setattr(tconfig, hook, None)


def apply_update(engine: MegatronEngine, loss: float) -> float:
    """Gradient norm over all replicas' reduced gradients (before clipping), clip to
    ``actor.grad_clip`` (0: no clipping), step; a non-finite norm or ``loss`` skips the update.
    Returns the norm (NaN where Megatron's optimizer found inf/nan while unscaling)."""
    skip = not math.isfinite(loss)
    optimizer = engine.optimizer
    if engine.use_megatron_schedule:
        if optimizer.prepare_grads():  # inf/nan found while unscaling
            optimizer.zero_grad()
            return float("nan")
        grad_norm = float(optimizer.get_grad_norm())
        if math.isfinite(grad_norm) and not skip:
            # Megatron's own step: clips to its config.clip_grad (= actor.grad_clip), updates,
            # and copies the new weights into the model (gathering them under the distributed optimizer)
            optimizer.step()
        optimizer.zero_grad()
        return grad_norm
    params = engine._trainable_params()
    grad_norm = main_grad_norm(params, engine.device)
    clip = engine.actor.grad_clip
    if math.isfinite(grad_norm) and not skip:
        coef = clip / (grad_norm + 1e-6) if clip > 0 else 1.0
        for p in params:
            grad = p.main_grad if coef >= 1.0 else p.main_grad * coef
            p.grad = grad if grad.dtype == p.dtype else grad.to(p.dtype)
        optimizer.step()
    engine._zero_grad()
    return grad_norm


def main_grad_norm(params: list[torch.nn.Parameter], device: torch.device) -> float:
    """L2 norm of DDP's reduced gradients over the whole model: each tensor-parallel shard once,
    replicated tensors (norms) once per model, summed over the model-parallel group (what
    Megatron's ``get_grad_norm_fp32`` computes)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
            total += p.main_grad.float().pow(2).sum()
    if mpu.get_model_parallel_group().size() > 1:
        dist.all_reduce(total, group=mpu.get_model_parallel_group())
    return float(total.sqrt())

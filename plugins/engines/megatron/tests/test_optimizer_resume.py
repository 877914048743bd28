"""Resuming Megatron's distributed optimizer (the GPU path) continues Adam exactly.

megatron-core's ``DistributedOptimizer`` needs CUDA to be built, but its ``state_dict`` and
``load_state_dict`` only read a few attributes: they run here, on the CPU, over torch's AdamW (the
optimizer megatron-core uses without Apex or Transformer Engine), with those attributes set as
``DistributedOptimizer.__init__`` sets them for one flat shard per parameter. What
``load_parameter_state_from_dp_zero`` does next (copy the saved moments into the allocated state)
is done by hand.
"""

from __future__ import annotations

from types import SimpleNamespace

import mcore_cpu_shim
import pytest
import torch
from core_rl_train_kit.optim import settle_scalar_states
from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer.optimizer import param_group_identifier_keys

pytestmark = pytest.mark.skipif(
    distrib_optimizer.HAVE_APEX_OR_TE, reason="with Apex or Transformer Engine megatron-core uses their fused Adam"
)

GROUP = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
assert set(GROUP) == set(param_group_identifier_keys)


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW([{"params": params, **GROUP}], lr=1e-2, weight_decay=0.1)


def _as_distributed(optimizer: torch.optim.AdamW) -> SimpleNamespace:
    """The attributes of a ``DistributedOptimizer`` that its ``state_dict``/``load_state_dict`` read,
    for one data-parallel rank holding each (flat) parameter whole."""
    params = optimizer.param_groups[0]["params"]
    return SimpleNamespace(
        optimizer=optimizer,
        grad_scaler=None,
        ddp_config=SimpleNamespace(use_megatron_fsdp=False),
        config=SimpleNamespace(
            exp_avg_dtype=torch.float32,
            exp_avg_sq_dtype=torch.float32,
            use_precision_aware_optimizer_no_fp8_or_ds_fp8=False,
            fp16=False,
        ),
        gbuf_ranges=[
            {(torch.float32, torch.float32): [{"param_map": {p: {"gbuf_world": range(p.numel())} for p in params}}]}
        ],
        model_param_group_index_map={p: (0, i) for i, p in enumerate(params)},
    )


def _step(optimizer: torch.optim.AdamW, grads: list[torch.Tensor]) -> None:
    for p, g in zip(optimizer.param_groups[0]["params"], grads, strict=True):
        p.grad = g.clone()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("resume_after", [1, 2])
def test_a_resumed_distributed_optimizer_steps_like_the_uninterrupted_one(resume_after: int) -> None:
    gen = torch.Generator().manual_seed(0)
    sizes = [5, 7, 3, 4]
    grads = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(resume_after + 3)]
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    straight = _adamw(params)
    for g in grads[:resume_after]:
        _step(straight, g)

    saved = distrib_optimizer.DistributedOptimizer.state_dict(_as_distributed(straight))
    saved_params = [p.detach().clone() for p in params]
    saved_moments = [{k: straight.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")} for p in params]
    for g in grads[resume_after:]:
        _step(straight, g)

    copies = [torch.nn.Parameter(p) for p in saved_params]
    resumed = _adamw(copies)
    with mcore_cpu_shim.installed():  # load_state_dict allocates the state on torch.cuda.current_device()
        distrib_optimizer.DistributedOptimizer.load_state_dict(_as_distributed(resumed), saved)
    for p, moments in zip(copies, saved_moments, strict=True):  # what load_parameter_state_from_dp_zero does
        for key, value in moments.items():
            resumed.state[p][key].copy_(value)
    settle_scalar_states(resumed)
    for g in grads[resume_after:]:
        _step(resumed, g)

    steps = [resumed.state[p]["step"].item() for p in copies]
    assert steps == [float(len(grads))] * len(copies)
    for before, after in zip(params, copies, strict=True):
        assert torch.equal(before, after)


def test_optimizer_state_is_saved_once_an_update_has_run() -> None:
    """Before any update (every step so far empty or skipped) there is nothing to save, for the
    CPU path's torch optimizer and for Megatron's (shaped as ``ChainedOptimizer``: each part's
    ``optimizer`` a torch one), whose distributed ``state_dict`` could not run then."""
    from core_rl_megatron.checkpoint import _has_state

    params = [torch.nn.Parameter(torch.ones(3))]
    adamw = _adamw(params)
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adamw)])
    assert not _has_state(adamw) and not _has_state(chained)
    _step(adamw, [torch.ones(3)])
    assert _has_state(adamw) and _has_state(chained)

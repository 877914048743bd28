"""float16's dynamic loss scale survives a checkpoint (:mod:`core_rl_deepspeed.loss_scale`), with
DeepSpeed's own scaler classes; the engine round trip on a GPU is in ``test_gpu.py``."""

from __future__ import annotations

import json
import types

import pytest

pytest.importorskip("deepspeed")


def _scalers():
    """DeepSpeed's dynamic scaler (as its float16 config builds it: window, floor 1, hysteresis 2)
    and its static one."""
    import functools

    import torch.distributed as dist
    from core_rl.launch.distributed import ensure_process_group, pick_device
    from core_rl_deepspeed.config import DeepSpeedConfig
    from core_rl_deepspeed.engine import import_deepspeed

    # as the engine tests in this process set up (one device type per process for DeepSpeed): the
    # scaler reports an overflow through DeepSpeed's logger, which asks its backend for the rank
    device = pick_device("auto")
    ensure_process_group("auto", device)
    import_deepspeed(DeepSpeedConfig(), device).init_distributed(dist_backend=dist.get_backend(), verbose=False)
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    dynamic = functools.partial(DynamicLossScaler, min_scale=1, delayed_shift=2, consecutive_hysteresis=False)
    return dynamic, LossScaler


def test_a_restored_scaler_goes_on_as_the_saved_one() -> None:
    from core_rl_deepspeed.loss_scale import loss_scale_state, restore_loss_scale

    dynamic, _ = _scalers()
    overflows = [True, False, True, True, False, False, False, True, False, False]
    saved = types.SimpleNamespace(loss_scaler=dynamic(init_scale=2**16, scale_window=3))
    for overflow in overflows[:5]:
        saved.loss_scaler.update_scale(overflow)
    state = json.loads(json.dumps(loss_scale_state(saved)))  # as meta.json holds it
    assert state["cur_scale"] < 2**16 and state["cur_iter"] == 5  # training moved it
    restored = types.SimpleNamespace(loss_scaler=dynamic(init_scale=2**16, scale_window=3))
    restore_loss_scale(restored, state)
    for overflow in overflows[5:]:  # the same steps after the resume
        saved.loss_scaler.update_scale(overflow)
        restored.loss_scaler.update_scale(overflow)
        assert vars(restored.loss_scaler) == vars(saved.loss_scaler)
    fresh = types.SimpleNamespace(loss_scaler=dynamic(init_scale=2**16, scale_window=3))
    assert fresh.loss_scaler.cur_scale != saved.loss_scaler.cur_scale  # what a resume without it gets


def test_static_scaling_saves_nothing_and_ignores_a_saved_scale() -> None:
    from core_rl_deepspeed.loss_scale import loss_scale_state, restore_loss_scale

    dynamic, static = _scalers()
    bf16 = types.SimpleNamespace(loss_scaler=static(scale=1.0))
    assert loss_scale_state(bf16) is None and loss_scale_state(object()) is None
    restore_loss_scale(bf16, {"cur_scale": 8.0, "cur_iter": 3, "last_overflow_iter": 1, "cur_hysteresis": 2})
    assert bf16.loss_scaler.cur_scale == 1.0
    fp16 = types.SimpleNamespace(loss_scaler=dynamic(init_scale=2**10, scale_window=1000))
    restore_loss_scale(fp16, None)  # a checkpoint of another precision
    assert fp16.loss_scaler.cur_scale == 2**10

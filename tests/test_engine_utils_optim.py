"""The learning-rate schedule against hand-computed values, and optimizer construction."""

from __future__ import annotations

import math

import pytest
import torch
from core_rl.config.schema import OptimizerConfig, SchedulerConfig
from core_rl_train_kit.optim import (
    adamw_kernel,
    build_optimizer,
    decay_groups,
    lr_at,
    settle_scalar_states,
    warmup_steps,
)


def test_constant_with_warmup() -> None:
    cfg = SchedulerConfig(name="constant", warmup_steps=4)
    assert [lr_at(s, 1.0, cfg) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_constant_without_total_steps() -> None:
    assert lr_at(1000, 3e-4, SchedulerConfig()) == 3e-4


def test_linear_decay_to_min_ratio() -> None:
    cfg = SchedulerConfig(name="linear", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    # after warmup: p = (s - 2) / 8; lr = 0.1 + 0.9 * (1 - p)
    want = [0.5, 1.0, 1.0, 0.8875, 0.775, 0.6625, 0.55, 0.4375, 0.325, 0.2125, 0.1, 0.1, 0.1]
    assert [lr_at(s, 1.0, cfg) for s in range(13)] == pytest.approx(want)


def test_cosine_decay() -> None:
    cfg = SchedulerConfig(name="cosine", total_steps=4, min_lr_ratio=0.0)
    # p = s / 4; lr = 2 * (1 + cos(pi p)) / 2
    want = [2.0, 1.0 + math.sqrt(0.5), 1.0, 1.0 - math.sqrt(0.5), 0.0, 0.0]
    assert [lr_at(s, 2.0, cfg) for s in range(6)] == pytest.approx(want)
    cfg = SchedulerConfig(name="cosine", warmup_steps=1, total_steps=5, min_lr_ratio=0.5)
    assert lr_at(0, 1.0, cfg) == pytest.approx(1.0)
    assert lr_at(3, 1.0, cfg) == pytest.approx(0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(5, 1.0, cfg) == pytest.approx(0.5)


def test_warmup_ratio() -> None:
    cfg = SchedulerConfig(name="linear", warmup_ratio=0.25, total_steps=10)
    assert warmup_steps(cfg) == 2
    assert lr_at(0, 1.0, cfg) == pytest.approx(0.5)
    assert lr_at(2, 1.0, cfg) == pytest.approx(1.0)
    assert warmup_steps(SchedulerConfig(warmup_steps=3, warmup_ratio=0.5, total_steps=100)) == 3


def test_decay_needs_total_steps() -> None:
    with pytest.raises(ValueError, match="total_steps"):
        lr_at(0, 1.0, SchedulerConfig(name="cosine"))


def test_build_optimizers() -> None:
    params = [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)]
    adam = build_optimizer(params, OptimizerConfig(name="adamw", lr=0.1, betas=(0.8, 0.9), weight_decay=0.01))
    assert isinstance(adam, torch.optim.AdamW)
    group = adam.param_groups[0]
    assert len(group["params"]) == 1 and group["betas"] == (0.8, 0.9) and group["weight_decay"] == 0.01
    sgd = build_optimizer(params, OptimizerConfig(name="sgd", lr=0.5, momentum=0.9))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9


def _adamw_run(implementation: str, steps: int = 5) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(5))]
    optimizer = build_optimizer(
        params, OptimizerConfig(name="adamw", lr=0.1, weight_decay=0.01, implementation=implementation)
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    return [p.detach() for p in params]


def test_adamw_kernels_agree() -> None:
    """fused, foreach and the for-loop kernel give the same update up to float rounding."""
    reference = _adamw_run("for_loop")
    for implementation in ("auto", "fused", "foreach"):
        for got, want in zip(_adamw_run(implementation), reference):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_adamw_auto_kernel_choice() -> None:
    plain = [torch.nn.Parameter(torch.ones(2))]
    assert adamw_kernel(plain, "auto") == {"fused": True}
    assert adamw_kernel([torch.nn.Parameter(torch.ones(2, dtype=torch.float64))], "auto") == {}
    assert adamw_kernel([], "auto") == {}
    assert adamw_kernel(plain, "for_loop") == {"foreach": False}
    assert build_optimizer(plain, OptimizerConfig(implementation="auto")).param_groups[0]["fused"] is True


@pytest.mark.parametrize("kernel", [{}, {"foreach": True}, {"fused": True}, {"capturable": True}])
def test_settled_scalar_states_are_each_parameters_own_where_its_kernel_reads_them(kernel: dict) -> None:
    """As loaders leave it: one ``step`` tensor shared by every parameter (megatron-core's
    distributed optimizer), on the CPU whatever the kernel (torch placing it by a saving run's
    flags). Parameters on the ``meta`` device stand for a GPU's: the fused and capturable kernels
    read ``step`` there (as float32), the others on the CPU."""
    params = [torch.nn.Parameter(torch.empty(n, device="meta")) for n in (3, 5)]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    optimizer.param_groups[0].update(kernel)
    shared = torch.tensor(7.0, dtype=torch.float64)
    for p in params:
        optimizer.state[p] = {"step": shared, "exp_avg": torch.zeros_like(p)}
    settle_scalar_states(optimizer)
    steps = [optimizer.state[p]["step"] for p in params]
    on_device = bool(kernel.get("fused") or kernel.get("capturable"))
    assert [s.device.type for s in steps] == ["meta" if on_device else "cpu"] * 2
    assert len({id(s) for s in steps} | {id(shared)}) == 3  # each its own
    if on_device:
        assert all(s.dtype == torch.float32 for s in steps)
    else:
        assert [s.item() for s in steps] == [7.0, 7.0] and all(s.dtype == torch.float64 for s in steps)
    assert all(optimizer.state[p]["exp_avg"].device.type == "meta" for p in params)  # tensors left alone


def test_a_settled_shared_step_advances_once_per_step() -> None:
    """The failure :func:`settle_scalar_states` prevents, on real AdamW steps: a ``step`` tensor
    shared by the parameters advances once per parameter."""
    grads = [torch.ones(2), torch.ones(3), torch.ones(4)]

    def run(settle: bool) -> list[float]:
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        optimizer = torch.optim.AdamW(params, lr=0.1, foreach=True)
        shared = torch.tensor(1.0)
        for p in params:
            optimizer.state[p] = {"step": shared, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        if settle:
            settle_scalar_states(optimizer)
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
        return [optimizer.state[p]["step"].item() for p in params]

    assert run(settle=False) == [4.0, 4.0, 4.0]  # 1 + one increment per parameter
    assert run(settle=True) == [2.0, 2.0, 2.0]


def test_weight_decay_groups_spare_biases_and_norms() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2, bias=False))
    weight, bias, norm_w, norm_b, head = model.parameters()
    head.requires_grad_(False)
    for name in ("adamw", "sgd"):
        groups = build_optimizer(model.parameters(), OptimizerConfig(name=name, weight_decay=0.1)).param_groups
        assert [(g["params"], g["weight_decay"]) for g in groups] == [([weight], 0.1), ([bias, norm_w, norm_b], 0.0)]
    (only,) = build_optimizer(model.parameters(), OptimizerConfig(weight_decay=0.1, no_decay="none")).param_groups
    assert only["params"] == [weight, bias, norm_w, norm_b] and only["weight_decay"] == 0.1
    (only,) = build_optimizer(model.parameters(), OptimizerConfig(weight_decay=0.0)).param_groups
    assert len(only["params"]) == 4  # no decay at all: one group, as before the option existed


def test_weight_decay_groups_read_a_zero3_partitions_full_shape() -> None:
    """A ZeRO-3 partitioned parameter is a flat (often empty) tensor; its real shape is ``ds_shape``."""
    flat_matrix, flat_norm = torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.empty(0))
    flat_matrix.ds_shape, flat_norm.ds_shape = torch.Size([8, 4]), torch.Size([8])
    groups = decay_groups([flat_matrix, flat_norm], OptimizerConfig(weight_decay=0.1))
    assert [g["params"] for g in groups] == [[flat_matrix], [flat_norm]] and groups[1]["weight_decay"] == 0.0


@pytest.mark.parametrize(
    ("style", "decayed"),
    [
        ("linear", lambda p: 1 - p),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
        ("1-sqrt", lambda p: 1 - math.sqrt(p)),
    ],
)
def test_wsd_holds_the_rate_then_decays_over_the_last_steps(style, decayed) -> None:
    """20 steps, 2 of warmup, decay_ratio 0.25: steps 0-1 warm up, 2-14 hold 1.0, 15-20 decay to
    m = 0.1 (p = (step - 15) / 5)."""
    config = SchedulerConfig(
        name="wsd", warmup_steps=2, total_steps=20, decay_ratio=0.25, decay_style=style, min_lr_ratio=0.1
    )
    assert config.wsd_decay_steps == 5
    assert [lr_at(s, 1.0, config) for s in (0, 1)] == [0.5, 1.0]
    assert all(lr_at(s, 1.0, config) == 1.0 for s in range(2, 16))
    for step in range(15, 23):
        p = min((step - 15) / 5, 1.0)
        assert lr_at(step, 1.0, config) == pytest.approx(0.1 + 0.9 * decayed(p)), step


def test_wsd_keys_apply_to_wsd_alone() -> None:
    with pytest.raises(ValueError, match=r"decay_style: .*applies only to name: wsd \(not cosine\)"):
        SchedulerConfig(name="cosine", decay_style="cosine")
    assert SchedulerConfig(name="wsd", total_steps=3, decay_ratio=0.1).wsd_decay_steps == 1  # at least one step

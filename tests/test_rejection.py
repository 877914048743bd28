"""Built-in rejection samplers: the conformance contract for each, configuration errors naming the
key, and a third-party metric registered like any plugin."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import core_rl.builtin.rejection as builtin_rejection
import pytest
import torch
from core_rl.config.loader import structure
from core_rl.errors import ConfigError
from core_rl.hookspecs import Register, hookimpl
from core_rl.ops.rejection import (
    ImportanceSamplingConfig,
    MetricRejectionSampler,
    RatioRejectionConfig,
    RejectionSamplingConfig,
)
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import REJECTION_SAMPLER
from core_rl.testing import RejectionSamplerContract, installed_distribution

DIST = installed_distribution("core-rl")


class TestRatioMask(RejectionSamplerContract):
    plugin = builtin_rejection
    name = "ratio"
    distribution = DIST


class TestRatioSequenceClamp(RejectionSamplerContract):
    plugin = builtin_rejection
    name = "ratio"
    options: ClassVar[dict[str, Any]] = {"level": "sequence", "action": "clamp", "agg": "sum", "upper": 3.0}
    distribution = DIST


class TestKLk1(RejectionSamplerContract):
    plugin = builtin_rejection
    name = "kl_k1"
    options: ClassVar[dict[str, Any]] = {"lower": -0.5, "upper": 0.5}
    distribution = DIST


class TestKLk2(RejectionSamplerContract):
    plugin = builtin_rejection
    name = "kl_k2"
    distribution = DIST


class TestKLk3Sequence(RejectionSamplerContract):
    plugin = builtin_rejection
    name = "kl_k3"
    options: ClassVar[dict[str, Any]] = {"level": "sequence", "agg": "max", "upper": 0.3}
    distribution = DIST


class TestTIS(RejectionSamplerContract):
    plugin = builtin_rejection
    name = "tis"
    distribution = DIST


class TestMISSequence(RejectionSamplerContract):
    plugin = builtin_rejection
    name = "mis"
    options: ClassVar[dict[str, Any]] = {"level": "sequence", "upper": 1.5, "lower": 0.5}
    distribution = DIST


def build(name: str, **options: Any):
    host = PluginHost(entry_points=[])
    host.register_plugin(builtin_rejection, distribution="core-rl")
    entry = host.get(REJECTION_SAMPLER, name)
    return entry.factory(structure(options, entry.config_cls, path="algorithm.rejection_sampling"))


def test_tis_truncates_and_mis_masks():
    # ratios pi_prox / pi_behave: 3, 0.25, 1.2
    behave = torch.zeros(1, 3)
    prox = torch.log(torch.tensor([[3.0, 0.25, 1.2]]))
    mask = torch.ones(1, 3)
    tis = build("tis", upper=2.0, lower=0.5)(prox, behave, mask)
    torch.testing.assert_close(tis.weight, torch.tensor([[2.0, 0.5, 1.2]]))
    assert tis.keep.all() and tis.clamped.tolist() == [[True, True, False]]
    mis = build("mis", upper=2.0, lower=0.5)(prox, behave, mask)
    torch.testing.assert_close(mis.weight, torch.tensor([[3.0, 0.25, 1.2]]))
    assert mis.keep.tolist() == [[False, False, True]]
    # sequence-level TIS on the product 3 * 0.25 * 1.2 = 0.9: every token weighs 0.9
    seq = build("tis", level="sequence", agg="sum")(prox, behave, mask)
    torch.testing.assert_close(seq.weight, torch.full((1, 3), 0.9))


@pytest.mark.parametrize(
    ("cls", "options", "message"),
    [
        (RatioRejectionConfig, {"upper": 0.9}, r"upper: must be > 1"),
        (RatioRejectionConfig, {"lower": 1.5}, r"lower: must be in \(0, 1\)"),
        (RatioRejectionConfig, {"action": "drop"}, r"action: must be one of 'mask', 'clamp'"),
        (RatioRejectionConfig, {"level": "batch"}, r"level: must be one of 'token', 'sequence'"),
        (RatioRejectionConfig, {"agg": "median"}, r"agg: must be one of 'sum', 'mean', 'max'"),
        (RejectionSamplingConfig, {"action": "clamp"}, r"action: must be one of 'mask'"),
        (RejectionSamplingConfig, {"lower": 1.0, "upper": 0.5}, r"lower: must be < upper \(0.5\)"),
        (ImportanceSamplingConfig, {"upper": 1.0}, r"upper: must be > 1"),
    ],
)
def test_config_errors_name_the_key(cls, options, message):
    with pytest.raises(ConfigError, match=r"algorithm\.rejection_sampling\." + message):
        structure(options, cls, path="algorithm.rejection_sampling")


def test_no_upper_bound_is_null_and_infinity_is_refused():
    with pytest.raises(ConfigError, match=r"algorithm\.rejection_sampling\.upper: expected a finite number"):
        build("ratio", upper=math.inf)
    sampler = build("ratio", upper=None)
    out = sampler(torch.tensor([[5.0]]), torch.zeros(1, 1), torch.ones(1, 1))
    assert out.keep.all() and out.weight.item() == pytest.approx(math.exp(5.0))


class _EntropyGapMetric:
    """A third-party metric: |log r|, registered under its own name."""

    @hookimpl
    def core_rl_register_rejection_samplers(self, register: Register) -> None:
        register(
            "abs_log_ratio",
            lambda config: MetricRejectionSampler(config, lambda p, b: (p - b).abs(), log_space=False),
            description="|log pi_prox - log pi_behave|",
            config_cls=RejectionSamplingConfig,
        )


def test_a_third_party_metric_registers_like_any_plugin():
    host = PluginHost(entry_points=[])
    host.register_plugin(_EntropyGapMetric(), distribution="my-metric")
    entry = host.get(REJECTION_SAMPLER, "abs_log_ratio")
    sampler = entry.factory(structure({"upper": 0.5}, entry.config_cls))
    out = sampler(torch.tensor([[0.2, -1.0]]), torch.zeros(1, 2), torch.ones(1, 2))
    assert out.keep.tolist() == [[True, False]]

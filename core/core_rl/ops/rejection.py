"""Rejection sampling by a per-token divergence between the proximal and the behaviour policy
(``algorithm.rejection_sampling``): the configuration classes and :class:`MetricRejectionSampler`,
which turns any per-token metric into a :class:`core_rl.interfaces.RejectionSampler`.

The built-in samplers (registered by :mod:`core_rl.builtin.rejection`) and what they judge, with
``r_t = pi_prox(y_t) / pi_behave(y_t)``:

======  ==========================  =========================================================
name    metric                      actions
======  ==========================  =========================================================
ratio   ``r_t``                     ``mask`` (reject out-of-bounds) or ``clamp`` (truncate)
kl_k1   ``log r_t``                 ``mask``
kl_k2   ``(log r_t)^2 / 2``         ``mask``
kl_k3   ``r_t - log r_t - 1``       ``mask``
tis     ``r_t``                     truncated importance sampling: ``clamp`` to ``[lower, upper]``
mis     ``r_t``                     masked importance sampling: ``mask`` outside ``[lower, upper]``
======  ==========================  =========================================================

A third party adds a metric by registering a new name whose factory returns
``MetricRejectionSampler(config, my_metric, log_space=False)`` with ``config_cls=RejectionSamplingConfig``.
This module imports no torch at import time (the registration path stays light).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from core_rl.config.validators import FieldValueError, one_of, positive
from core_rl.interfaces import ImportanceCorrection, RejectionSampler
from core_rl.ops.names import REJECTION_ACTIONS, REJECTION_AGGREGATIONS, REJECTION_LEVELS

if TYPE_CHECKING:
    import torch


#: (proximal log-probs [b, T], behaviour log-probs [b, T]) -> per-token metric [b, T]
Metric = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]


def _check_bounds(config: Any, *, ratio: bool) -> None:
    """``upper`` / ``lower``: finite bounds, or null for none (the config loader refuses infinities)."""
    if ratio and config.upper is not None and not config.upper > 1.0:
        raise FieldValueError("upper", config.upper, "must be > 1 (an upper bound on an importance ratio) or null")
    if config.lower is None:
        return
    if ratio and not 0.0 < config.lower < 1.0:
        raise FieldValueError("lower", config.lower, "must be in (0, 1) (a lower bound on an importance ratio)")
    if config.upper is not None and not config.lower < config.upper:
        raise FieldValueError("lower", config.lower, f"must be < upper ({config.upper})")


@attrs.define
class RejectionSamplingConfig:
    """``algorithm.rejection_sampling`` of a metric compared as it is (``kl_k1``, ``kl_k2``,
    ``kl_k3``, third-party metrics).

    ``level``: ``token`` (each token judged alone) or ``sequence`` (one value per sequence, by
    ``agg`` = ``sum``, ``mean`` or ``max`` of its tokens' values; the whole sequence shares its fate).
    ``action``: ``mask`` (tokens outside ``[lower, upper]`` leave the loss). ``upper``: the upper
    bound; ``lower``: the lower bound (each null: none).
    """

    level: str = attrs.field(default="token", validator=one_of(REJECTION_LEVELS))
    action: str = attrs.field(default="mask", validator=one_of(("mask",)))
    agg: str = attrs.field(default="mean", validator=one_of(REJECTION_AGGREGATIONS))
    upper: float | None = 2.0
    lower: float | None = None

    def __attrs_post_init__(self) -> None:
        _check_bounds(self, ratio=False)


@attrs.define
class RatioRejectionConfig:
    """``algorithm.rejection_sampling`` of ``ratio``: as :class:`RejectionSamplingConfig`, on the
    importance ratio (aggregated in log space at sequence level: ``sum`` is the product of the
    token ratios, ``mean`` their geometric mean), with ``action: clamp`` (truncate the weight to
    ``[lower or 0, upper]``) besides ``mask``. ``upper`` > 1; ``lower`` in (0, 1)."""

    level: str = attrs.field(default="token", validator=one_of(REJECTION_LEVELS))
    action: str = attrs.field(default="mask", validator=one_of(REJECTION_ACTIONS))
    agg: str = attrs.field(default="mean", validator=one_of(REJECTION_AGGREGATIONS))
    upper: float | None = attrs.field(default=5.0, validator=positive())
    lower: float | None = None

    def __attrs_post_init__(self) -> None:
        _check_bounds(self, ratio=True)


@attrs.define
class ImportanceSamplingConfig:
    """``algorithm.rejection_sampling`` of ``tis`` (truncated) and ``mis`` (masked importance
    sampling): the ratio's level, ``agg``, ``upper`` (> 1) and ``lower`` (in (0, 1) or null)."""

    level: str = attrs.field(default="token", validator=one_of(REJECTION_LEVELS))
    agg: str = attrs.field(default="mean", validator=one_of(REJECTION_AGGREGATIONS))
    upper: float | None = attrs.field(default=2.0, validator=positive())
    lower: float | None = None

    def __attrs_post_init__(self) -> None:
        _check_bounds(self, ratio=True)


class MetricRejectionSampler(RejectionSampler):
    """A :class:`RejectionSampler` from a per-token ``metric`` (see
    :func:`core_rl.ops.reject_by_metric` for the level / action / aggregation / bounds rules).

    ``log_space``: the metric returns the log of a ratio (bounds then apply to its ``exp``, and
    sequence aggregation happens in log space); ``action`` overrides ``config.action``.
    """

    def __init__(self, config: Any, metric: Metric, *, log_space: bool, action: str | None = None) -> None:
        self.config = config
        self.metric = metric
        self.log_space = log_space
        self.action = action if action is not None else config.action

    def __call__(
        self, proximal_logprobs: torch.Tensor, behave_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> ImportanceCorrection:
        from core_rl import ops

        values = self.metric(proximal_logprobs, behave_logprobs)
        weight, keep, clamped = ops.reject_by_metric(
            values,
            ops.behaviour_log_ratio(proximal_logprobs, behave_logprobs),
            mask,
            level=self.config.level,
            action=self.action,
            agg=self.config.agg,
            upper=math.inf if self.config.upper is None else self.config.upper,
            lower=self.config.lower,
            log_space=self.log_space,
        )
        return ImportanceCorrection(weight=weight, keep=keep, clamped=clamped)


def builtin_metric(name: str) -> Metric:
    """The built-in per-token metric ``name`` (``ratio`` as ``log r``) of :mod:`core_rl.ops.importance`."""

    def metric(proximal_logprobs: torch.Tensor, behave_logprobs: torch.Tensor) -> torch.Tensor:
        from core_rl.ops import divergence_metric

        return divergence_metric(proximal_logprobs, behave_logprobs, name)

    return metric


def make_ratio(config: RatioRejectionConfig) -> MetricRejectionSampler:
    return MetricRejectionSampler(config, builtin_metric("ratio"), log_space=True)


def make_kl(name: str) -> Callable[[RejectionSamplingConfig], MetricRejectionSampler]:
    def factory(config: RejectionSamplingConfig) -> MetricRejectionSampler:
        return MetricRejectionSampler(config, builtin_metric(name), log_space=False)

    return factory


def make_tis(config: ImportanceSamplingConfig) -> MetricRejectionSampler:
    return MetricRejectionSampler(config, builtin_metric("ratio"), log_space=True, action="clamp")


def make_mis(config: ImportanceSamplingConfig) -> MetricRejectionSampler:
    return MetricRejectionSampler(config, builtin_metric("ratio"), log_space=True, action="mask")

"""The trainer's side of the rollout controller (:mod:`core_rl.rollout.controller`): generation
batches, weight updates around the controller, the controller's checkpoint state, and the step's
asynchronous-training metrics and warnings.

Metrics (rank 0, every step): ``staleness/*`` over the samples trained (see
:func:`staleness_metrics`), ``async/queue_groups`` (finished groups
waiting for later steps), ``async/inflight``, ``throughput/rollout_utilization`` (fraction of the wall
time since the previous batch during which some trajectory was generating), ``timing/rollout_wait_s`` (the
trainer's wait for generation batches), ``throughput/train_utilization`` (``1 - wait_s / step_s``),
``async/rejected_tokens`` (tokens the rejection sampler masked, from ``actor/rejected``) and
``async/max_head_offpolicyness``.

Warnings (asynchronous runs, at most once per :data:`WARN_EVERY_STEPS` steps each): the trainer
waited on rollout for more than ``warn_wait_fraction`` of a step, or rollout was idle (waiting on
the trainer) for more than that fraction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from core_rl.config.schema import RunConfig
from core_rl.errors import warn
from core_rl.interfaces import RolloutEngine, SamplingParams
from core_rl.plugins.attribution import built_by
from core_rl.protocol import Sample, TensorBatch
from core_rl.rollout.controller import RolloutController, Wave
from core_rl.rollout.workflows import RolloutWorkflow

P = TypeVar("P")

#: a warning that one side waited most of a step is repeated at most once per this many steps
WARN_EVERY_STEPS = 25


def batch_versions(batch: TensorBatch) -> tuple[list[int], list[int]]:
    """The oldest and newest weight version of each row's response tokens (``versions``, -1 off
    the response)."""
    versions = batch["versions"]
    on = versions >= 0
    big = torch.iinfo(versions.dtype).max
    oldest = torch.where(on, versions, torch.full_like(versions, big)).min(dim=1).values
    newest = versions.max(dim=1).values
    keep = on.any(dim=1)
    return oldest[keep].tolist(), newest[keep].tolist()


def staleness_metrics(oldest: Sequence[int], newest: Sequence[int], trained_version: int) -> dict[str, float]:
    """Staleness of each trained sample: ``trained_version - v`` for the oldest (and newest) weight
    version ``v`` among its tokens, where ``trained_version`` is the policy the update starts from.
    Mean and max of both, the fraction of samples whose tokens span several versions (interrupted
    by a weight update), and a histogram ``staleness/hist_<k>``: the fraction of samples whose
    oldest token is ``k`` versions behind, for ``k`` from 0 to the max."""
    if not oldest:
        return {}
    stale = [trained_version - v for v in oldest]
    lag = [trained_version - v for v in newest]
    out = {
        "staleness/mean": sum(stale) / len(stale),
        "staleness/max": float(max(stale)),
        "staleness/newest_mean": sum(lag) / len(lag),
        "staleness/newest_max": float(max(lag)),
        "staleness/interrupted_fraction": sum(a != b for a, b in zip(oldest, newest)) / len(oldest),
    }
    for k in range(max(stale) + 1):
        out[f"staleness/hist_{k}"] = sum(v == k for v in stale) / len(stale)
    return out


def flatten_groups(prompts: Sequence[P], groups: Sequence[Sequence[Sample]]) -> tuple[list[Sample], list[int], list[P]]:
    """``(samples, group index of each, prompt of each)`` of a generation batch's groups."""
    samples, group_index, owners = [], [], []
    for g, (prompt, group) in enumerate(zip(prompts, groups)):
        samples.extend(group)
        group_index.extend([g] * len(group))
        owners.extend([prompt] * len(group))
    return samples, group_index, owners


class RolloutFlow:
    """Owns the controller of a run (rank 0); created lazily so that a resumed run's data
    position and RNG are restored before the first wave is drawn."""

    def __init__(
        self,
        cfg: RunConfig,
        engine: RolloutEngine,
        workflow: RolloutWorkflow,
        data: Any,
        sampling: SamplingParams,
        tokenizer: Any,
    ) -> None:
        self.cfg = cfg
        self.config = cfg.rollout.controller
        #: what produces the samples, in messages (the watchdog's, :mod:`core_rl.reliability.watchdog`)
        self.words = f"{built_by(workflow, 'the workflow')} on {built_by(engine, 'the rollout engine')}"
        self._make = lambda: RolloutController(
            engine,
            workflow,
            data,
            sampling,
            self.config,
            batch_size=cfg.data.batch_size,
            tokenizer=tokenizer,
            generate_threads=torch.get_num_threads(),
        )
        self.data = data
        self.controller: RolloutController | None = None
        self._restore: tuple[Mapping[str, Any], int] | None = None
        self._wait_s = 0.0
        self._last_wave: Wave | None = None
        self._warned: dict[str, int] = {}

    def _controller(self) -> RolloutController:
        if self.controller is None:
            controller = self._make()
            if self._restore is not None:
                controller.load_state_dict(self._restore[0], completed_steps=self._restore[1])
            controller.start()
            self.controller = controller
        return self.controller

    def take(self, *, new_step: bool) -> Wave:
        """The next generation batch (``new_step``: the first of a step)."""
        import time

        if new_step:
            self._wait_s = 0.0
        t0 = time.perf_counter()
        wave = self._controller().take(new_step=new_step)
        self._wait_s += time.perf_counter() - t0
        self._last_wave = wave
        return wave

    @contextlib.contextmanager
    def paused(self, version: int) -> Iterator[None]:
        """Rollout paused (``rollout.controller.pause_mode``) while the body loads the weights of
        ``version`` into the engine (before the controller exists: nothing to pause)."""
        if self.controller is None:
            yield
            return
        with self.controller.paused(version):
            yield

    def state_dict(self) -> dict[str, Any]:
        if self.controller is None:
            return {"data": self.data.state_dict(), "extra": 0}
        return self.controller.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], completed_steps: int) -> None:
        if self.controller is not None:
            raise RuntimeError("the rollout controller already started; restore its state before the first step")
        self._restore = (state, completed_steps)

    def batch_metrics(self, batch: TensorBatch | None, step: int) -> dict[str, float]:
        """Staleness of the samples step ``step`` trains (the update starts from version
        ``step - 1``) and the controller's gauges at the last batch."""
        metrics: dict[str, float] = {"async/max_head_offpolicyness": float(self.config.max_head_offpolicyness)}
        if batch is not None and "versions" in batch:
            metrics.update(staleness_metrics(*batch_versions(batch), trained_version=step - 1))
        if self._last_wave is not None:
            metrics.update(self._last_wave.metrics)
        return metrics

    def step_metrics(self, metrics: Mapping[str, float], step: int) -> dict[str, float]:
        """Wait and utilisation figures of a finished step, with a warning when one side waited
        for most of it (asynchronous runs only: the synchronous loop waits by design)."""
        step_s = max(metrics.get("timing/step_s", 0.0), 1e-9)
        out = {
            "timing/rollout_wait_s": self._wait_s,
            "throughput/train_utilization": max(0.0, 1.0 - self._wait_s / step_s),
        }
        if "actor/rejected" in metrics and "batch/samples" in metrics:
            out["async/rejected_fraction"] = metrics["actor/rejected"]
        if self.config.max_head_offpolicyness == 0:
            return out
        limit = self.config.warn_wait_fraction
        if self._wait_s > limit * step_s and self._due("rollout", step):
            warn(
                f"step {step}: the trainer waited {self._wait_s:.1f} s of the {step_s:.1f} s step for rollout; "
                "generation is the bottleneck (add rollout capacity, or raise "
                "rollout.controller.max_concurrent_rollouts or max_head_offpolicyness="
                f"{self.config.max_head_offpolicyness})"
            )
        utilization = metrics.get("throughput/rollout_utilization")
        if utilization is not None and utilization < 1.0 - limit and self._due("trainer", step):
            warn(
                f"step {step}: rollout was idle {100 * (1 - utilization):.0f}% of the time, waiting on the trainer "
                f"(held by rollout.controller.max_head_offpolicyness={self.config.max_head_offpolicyness} or "
                "queue_size); training is the bottleneck"
            )
        return out

    def _due(self, kind: str, step: int) -> bool:
        """Whether a warning of ``kind`` may be printed at ``step`` (once per
        :data:`WARN_EVERY_STEPS` steps, so a run that is always bound one way says it, not spams)."""
        last = self._warned.get(kind)
        if last is not None and step - last < WARN_EVERY_STEPS:
            return False
        self._warned[kind] = step
        return True

    def close(self) -> None:
        if self.controller is not None:
            self.controller.close()
            self.controller = None

"""The RL loop's rollout-and-scoring stage (:class:`RolloutScoringStage`): a generation batch,
scored (the rollout controller's next wave, flattened, its rewards through the reward runner,
errors logged and counted), the sample log, and rank 0's whole part of a step (several waves under
dynamic sampling, filters, shaping and advantages through
:class:`~core_rl.loops.rl.batching.BatchAssembler`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from core_rl.config.schema import RunConfig
from core_rl.data.prompts import PromptItem, PromptSource
from core_rl.errors import stderr_line
from core_rl.interfaces import Logger
from core_rl.loops.rl.batching import BatchAssembler, Generation
from core_rl.loops.rl.difficulty import group_means
from core_rl.loops.rl.failed_steps import FailedEpisodes, FailedSteps
from core_rl.loops.rl.reward_runner import RewardErrorLog, RewardRunner, ScoreResult
from core_rl.loops.rl.rollout_flow import RolloutFlow, flatten_groups
from core_rl.loops.rl.sample_log import sample_records, score_samples
from core_rl.plugins.attribution import built_by
from core_rl.plugins.tally import PLUGIN_TALLY, tally_metrics, warnings_for
from core_rl.protocol import RewardInput, Sample, TensorBatch
from core_rl.reliability.progress import PROGRESS
from core_rl.rollout.colocation import RolloutSleep
from core_rl.rollout.dump import RolloutDump
from core_rl.rollout.replay import RolloutReplay


class RolloutScoringStage:
    """The rollout-and-reward stage of the RL loop, run on rank 0: :meth:`rollout_and_score` gives
    a step's batch to train on. Built from the run's prompt source ``data``, its rollout controller
    ``flow`` (``None`` when ``replay`` gives saved rollouts instead), ``rollout.dump``'s ``dump``,
    the reward runner and its error log, the ``reward_model:`` role's stage (``None``: none), the
    ``batcher`` (filters, shaping, advantages), the loggers that see samples, the tokenizer and the
    failed-steps count. It keeps the current step's scored generation batches (for the sample log)
    and failed episodes."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        data: PromptSource,
        flow: RolloutFlow | None,
        dump: RolloutDump | None,
        replay: RolloutReplay | None,
        reward_runner: RewardRunner | None,
        reward_log: RewardErrorLog,
        reward_stage: Any,
        rollout_sleep: RolloutSleep,
        batcher: BatchAssembler,
        loggers: list[Logger],
        tokenizer: Any,
        failed_steps: FailedSteps,
    ) -> None:
        self.cfg, self.data, self.flow, self.dump, self.replay = cfg, data, flow, dump, replay
        self.reward_runner, self.reward_log, self.reward_stage = reward_runner, reward_log, reward_stage
        self.rollout_sleep, self.batcher, self.loggers, self.tokenizer = rollout_sleep, batcher, loggers, tokenizer
        self.failed_steps = failed_steps
        # (reward inputs, scores) of each generation batch of the current step, for sample logging
        self._scored_this_step: list[tuple[list[RewardInput], ScoreResult]] = []
        self._episodes = FailedEpisodes()

    def _rollout(self) -> tuple[list[Sample], list[int], list[PromptItem], dict[str, float]]:
        """The next generation batch from the rollout controller (the first of a step or, under
        dynamic sampling, a further one), flattened: samples, their group, their prompt; and what
        the data said of drawing it (:attr:`core_rl.rollout.controller.Wave.draw_metrics`)."""
        assert self.flow is not None
        with PROGRESS.phase("rollout", self.flow.words):
            wave = self.flow.take(new_step=not self._scored_this_step)
        return (*flatten_groups(wave.prompts, wave.groups), wave.draw_metrics)

    def _score(
        self, samples: list[Sample], owners: list[PromptItem], step: int
    ) -> tuple[list[RewardInput], ScoreResult, dict[str, float]]:
        """Score ``samples`` through the reward runner; failed items are logged and counted."""
        assert self.reward_runner is not None
        with PROGRESS.phase("reward", f"{built_by(self.reward_runner.reward, 'the reward')}: score"):
            inputs, result = score_samples(self.reward_runner, self.tokenizer, samples, owners, step)
        return inputs, result, self.reward_log.record(step, inputs, result)

    def _generate_scored(self, step: int) -> Generation:
        """One generation batch: the next prompts, their samples and rewards (items the reward
        runner dropped are left out), with timings and reward-error counts."""
        t0 = time.perf_counter()
        samples, group_index, owners, draw_metrics = self._rollout()
        t_gen = time.perf_counter()
        inputs, result, error_metrics = self._score(samples, owners, step)
        self._scored_this_step.append((inputs, result))
        self._episodes.add(samples, result)
        t_reward = time.perf_counter()
        kept = result.kept
        if self.data.difficulty is not None:  # data.difficulty_filter's records: loops/rl/difficulty.py
            scores = [result.scores[i] for i in kept]
            self.data.difficulty.observe(
                group_means([owners[i].index for i in kept], [group_index[i] for i in kept], scores)
            )
        metrics = {
            "timing/generate_s": t_gen - t0,
            "timing/reward_s": t_reward - t_gen,
            "throughput/generated_tokens": float(sum(len(s.response_ids) for s in samples)),
            "reward/errors": error_metrics["reward/errors"],
            "reward/dropped": error_metrics["reward/dropped"],
            **{k: v for k, v in error_metrics.items() if k.startswith("reward/errors_") and k != "reward/errors_total"},
            **draw_metrics,  # summed over the step's generation batches
        }
        return Generation(
            samples=[samples[i] for i in kept],
            group_index=[group_index[i] for i in kept],
            rewards=[float(result.scores[i]) for i in kept],  # type: ignore[arg-type]
            metrics=metrics,
            reward_parts={name: [values[i] for i in kept] for name, values in result.parts.items()},
            where=[owners[i].where for i in kept],
            prompt_texts=[inputs[i].prompt_text for i in kept],
            response_texts=[inputs[i].response_text for i in kept],
        )

    def _generations(self, step: int) -> Callable[[], Generation]:
        """Where step ``step``'s generation batches come from: the saved step of
        ``rollout.replay_from``, else the rollout engine and the reward, kept for ``rollout.dump``."""
        if self.replay is not None:
            return self.replay.generations(step)
        generate = lambda: self._generate_scored(step)  # noqa: E731
        return self.dump.recording(step, generate) if self.dump is not None else generate

    def log_samples(self, step: int, model_scores: list[float] | None = None) -> None:
        """Every ``sample_log.every_n_steps`` steps, hand ``num_samples`` samples spread over the
        step's first generation batch to every logger. ``model_scores``: the ``reward_model:``
        role's score of each kept sample (the batch's rows, in order); a sample's reward is then
        ``rule + coef * score``, with the score as the part ``reward_model``."""
        if not self._scored_this_step:
            return
        inputs, result = self._scored_this_step[0]
        scores = dict(zip(result.kept, model_scores)) if model_scores is not None else None
        coef = self.reward_stage.config.coef if self.reward_stage is not None else 0.0
        records = sample_records(inputs, result, self.cfg.sample_log, step, scores, coef, tokenizer=self.tokenizer)
        if not records:
            return
        for lg in self.loggers:
            lg.log_samples(records, step)

    def rollout_and_score(self, step: int) -> tuple[TensorBatch | None, dict[str, float]]:
        """Rank 0's part of a step: generation batches (several under dynamic sampling), rewards,
        filters, shaping, advantages (:class:`~core_rl.loops.rl.batching.BatchAssembler`); the batch
        to train on (``None``: nothing left) and the metrics so far."""
        self._scored_this_step = []
        self._episodes = FailedEpisodes()
        self.rollout_sleep.before_generation()  # the engine asleep while training: rollout/colocation.py
        batch, metrics = self.batcher.assemble(self._generations(step), step=step)
        if self.dump is not None:
            metrics.update(self.dump.write(step))
        metrics.update(self.rollout_sleep.after_generation())
        metrics["reward/errors_total"] = float(self.reward_log.total)
        if self.flow is not None:
            metrics.update(self.flow.batch_metrics(batch, step))
        if self.data.difficulty is not None:
            metrics.update(self.data.difficulty.metrics())
        metrics.update(self._failures(step))
        if self.reward_stage is None or batch is None:  # else once the reward model has scored (step)
            self.log_samples(step)
        return batch, metrics

    def _failures(self, step: int) -> dict[str, float]:
        """The plugins' calls, timeouts and errors since the last step (:mod:`core_rl.plugins.tally`:
        ``plugins/...`` metrics, a warning per plugin past ``trainer.warn_failure_fraction``), and
        the step's failed episodes (:mod:`core_rl.loops.rl.failed_steps`; raises at the limit)."""
        taken = PLUGIN_TALLY.take()
        fraction = self.cfg.trainer.warn_failure_fraction
        for line in warnings_for(taken, step, fraction, "trainer.warn_failure_fraction"):
            stderr_line(line)
        metrics = tally_metrics(taken)
        episodes = self._episodes
        metrics.update(self.failed_steps.check(step, episodes.failed, episodes.total, episodes.why(taken)))
        metrics.update(episodes.error_metrics(step))
        return metrics
